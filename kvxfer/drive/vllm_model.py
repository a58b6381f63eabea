"""A tiny random-weight Llama saved locally: what the vLLM tests and bench serve (no download).

``python -m kvxfer.drive.vllm_model DIR`` (run where transformers is installed: ``.venv-vllm``).
4 layers, hidden 256, 4 heads, 2 KV heads, head_dim 64, vocab 1024, bf16, seeded: the same
weights every time, so outputs are comparable across processes and runs.
"""

from __future__ import annotations

import sys
from pathlib import Path


def make_tiny_llama(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists():
        return path
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         torch_dtype="bfloat16")
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


if __name__ == "__main__":
    print(make_tiny_llama(sys.argv[1]))
