"""The default model's shape (SmolLM2-135M-Instruct), for benchmarks that need its KV
layout or a checkpoint of its size without its weights (the GPU machine gets no GGUF)."""

from __future__ import annotations

import torch

from kvcache.kv_tensors import KVShape

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True)
BLOCK_SIZE = 16   # tokens per KV block, the CPU and CUDA default


def kv_shape(dtype: torch.dtype) -> KVShape:
    """Its KV blocks: 30 layers, 3 KV heads of 64, ``BLOCK_SIZE`` tokens."""
    m = SMOLLM2_135M
    return KVShape(m["num_hidden_layers"], BLOCK_SIZE, m["num_key_value_heads"],
                   m["hidden_size"] // m["num_attention_heads"], dtype)
