"""Checkpoint loading: HF directories, GGUF files and the embedded default model."""

from workers.loading.checkpoint import (
    Checkpoint,
    cache_root,
    default_model_path,
    load_checkpoint,
)

__all__ = ["Checkpoint", "cache_root", "default_model_path", "load_checkpoint"]
