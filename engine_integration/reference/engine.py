"""The reference engine: requests, a controller that runs the model, and a loop.

``ReferenceController`` and ``ReferenceContext`` are the ``controller``/``context``
pair that the disaggregation engines are built on, the way Megatron's engines take a
``TextGenerationController`` and a ``DynamicInferenceContext``. ``ReferenceDynamicEngine``
is the co-located engine (prefill and decode in one pool); the handoff engines in
``engine_integration.handoff_engine`` and ``disagg_engine`` extend it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from engine_integration.reference.context import ReferenceContext
from engine_integration.reference.model import TinyLlama, greedy

RequestId = int | str


@dataclass
class InferenceRequest:
    """One generation request while the engine owns it (mutable: it grows token by token)."""

    request_id: RequestId
    prompt: tuple[int, ...]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    cached_prefix_blocks: int = 0
    prefill_s: float = 0.0

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    @property
    def reserve_tokens(self) -> int:
        """Tokens whose K/V the request will ever store: the prompt plus all but the last output."""
        return len(self.prompt) + self.max_new_tokens - 1


def validate_prompt(prompt: Sequence[int], max_new_tokens: int, vocab_size: int) -> Optional[str]:
    """Why a request cannot run at all (``None`` if it can)."""
    if not prompt:
        return "the prompt is empty"
    if max_new_tokens < 1:
        return f"max_new_tokens must be >= 1, got {max_new_tokens}"
    bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        return f"token ids must be ints in [0, {vocab_size}); got {bad[:5]}"
    return None


class ReferenceController:
    """Runs the model over requests: prefill (with prefix reuse) and one-token decode steps."""

    def __init__(self, model: TinyLlama) -> None:
        self.model = model
        self.config = model.config

    def prefill(self, request: InferenceRequest, context: ReferenceContext, reserve_tokens: int) -> bool:
        """Compute the prompt's K/V and sample the first token; False (nothing held) if the pool is full.

        Cached full blocks are reused, except that the last prompt token is always
        computed: its logits give the first output token.
        """
        t0 = time.perf_counter()
        alloc = context.allocator
        T = self.config.tokens_per_block
        hashes = context.block_hashes(request.prompt)
        cached = alloc.acquire_prefix(hashes[: (len(request.prompt) - 1) // T])
        fresh = alloc.allocate(self.config.blocks_for(reserve_tokens) - len(cached))
        if fresh is None:
            alloc.release(cached)
            return False
        table = cached + fresh
        start = len(cached) * T
        logits = self.model.forward(request.prompt[start:], start, table, context.kv_pool)
        alloc.register(table[: len(hashes)], hashes)
        request.block_ids = table
        request.cached_prefix_blocks = len(cached)
        request.generated.append(greedy(logits))
        request.prefill_s = time.perf_counter() - t0
        return True

    def decode_step(self, requests: Sequence[InferenceRequest], context: ReferenceContext) -> None:
        """One more token for each request (one forward each: identical math in every setup)."""
        for r in requests:
            pos = len(r.prompt) + len(r.generated) - 1
            logits = self.model.forward([r.generated[-1]], pos, r.block_ids, context.kv_pool)
            r.generated.append(greedy(logits))


class ReferenceDynamicEngine:
    """Co-located engine: FIFO admission by free blocks, prefill, then greedy decode.

    Each step prefills requests until ``max_prefill_tokens_per_step`` prompt tokens
    (at least one request), so a burst of prompts does not stall the decode batch or,
    on a prefill instance, hold back the handoffs of the first prompts.
    """

    max_prefill_tokens_per_step = 256
    decode_chunk = 8

    def __init__(self, controller: ReferenceController, context: ReferenceContext) -> None:
        self.controller = controller
        self.context = context
        self.waiting: deque[InferenceRequest] = deque()
        self.running: list[InferenceRequest] = []
        self.outputs: list[dict[str, Any]] = []

    def add_request(self, request_id: RequestId, prompt: Sequence[int], max_new_tokens: int) -> None:
        prompt = tuple(int(t) for t in prompt)
        request = InferenceRequest(request_id, prompt, int(max_new_tokens))
        why = validate_prompt(prompt, request.max_new_tokens, self.controller.config.vocab_size)
        if why is None and self.controller.config.blocks_for(request.reserve_tokens) > self.context.num_blocks:
            why = (f"needs {self.controller.config.blocks_for(request.reserve_tokens)} KV blocks, "
                   f"the pool has {self.context.num_blocks}")
        if why is not None:
            self.outputs.append({"request_id": request_id, "error": f"request {request_id!r} rejected: {why}"})
            return
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[dict[str, Any]]:
        """Admit and prefill what fits, decode one token for the batch; return finished records."""
        self._schedule_prefills()
        self._decode()
        out, self.outputs = self.outputs, []
        return out

    def _schedule_prefills(self) -> None:
        budget = self.max_prefill_tokens_per_step
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if not self.controller.prefill(request, self.context, self._reserve_tokens(request)):
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            budget -= len(request.prompt)
            self._after_prefill(request)

    def _reserve_tokens(self, request: InferenceRequest) -> int:
        return request.reserve_tokens

    def _after_prefill(self, request: InferenceRequest) -> None:
        if request.done:
            self._finish(request)
        else:
            self.running.append(request)

    def _decode(self) -> None:
        """One token for every running request, ``decode_chunk`` requests at a time.

        Between chunks ``_between_decode_chunks`` lets the engine loop react (new
        handoffs, transfers, aborts) without waiting for the whole batch: this engine
        runs one forward per request, so a step grows with the batch.
        """
        batch = list(self.running)
        for start in range(0, len(batch), self.decode_chunk):
            if start:
                self._between_decode_chunks()
            chunk = [r for r in batch[start:start + self.decode_chunk] if r in self.running]  # not aborted meanwhile
            self.controller.decode_step(chunk, self.context)
            for request in [r for r in chunk if r.done]:
                self.running.remove(request)
                self._finish(request)

    def _between_decode_chunks(self) -> None:
        """Hook for the engine loop (the co-located engine has nothing to do here)."""

    def _finish(self, request: InferenceRequest) -> None:
        self.context.allocator.release(request.block_ids)
        record = self._record_and_serialize_finished_request(request)
        if record is not None:
            self.outputs.append(record)

    def _record_and_serialize_finished_request(self, request: InferenceRequest) -> Optional[dict[str, Any]]:
        return {"request_id": request.request_id, "tokens": list(request.generated)}


def build_reference_engine(config: Any, num_blocks: int, device: str = "cpu", engine_cls: type = ReferenceDynamicEngine):
    """Model + context + controller + engine of class ``engine_cls`` in one call."""
    model = TinyLlama(config, device)
    return engine_cls(ReferenceController(model), ReferenceContext(config, num_blocks, device))
