"""A small, deterministic Llama-style engine with a paged KV cache: the test bed for handoffs."""

from engine_integration.reference.config import ModelConfig
from engine_integration.reference.context import ReferenceContext
from engine_integration.reference.engine import (
    InferenceRequest,
    ReferenceController,
    ReferenceDynamicEngine,
    build_reference_engine,
)
from engine_integration.reference.kv_cache import BlockAllocator, block_hashes
from engine_integration.reference.model import TinyLlama, greedy

__all__ = [
    "BlockAllocator", "InferenceRequest", "ModelConfig", "ReferenceContext", "ReferenceController",
    "ReferenceDynamicEngine", "TinyLlama", "block_hashes", "build_reference_engine", "greedy",
]
