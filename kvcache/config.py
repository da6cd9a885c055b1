"""Settings of one KV block pool."""

from __future__ import annotations

from dataclasses import dataclass

KV_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")


@dataclass
class CacheConfig:
    """How a worker sizes and uses its paged KV pool.

    ``kv_cache_bytes`` is the pool's budget; when None, CPU workers take
    ``DEFAULT_CPU_KV_BYTES`` and accelerators ``memory_fraction`` of free memory.
    ``block_size`` None is the device's own (16; 128 on Ascend NPUs, whose paged-attention
    kernels are built for it). ``kv_dtype`` ``int8`` stores symmetric int8 with a scale per
    token and KV head (``kv_quant``); ``auto`` is the compute dtype.
    """

    block_size: int | None = None
    kv_cache_bytes: int | None = None
    memory_fraction: float = 0.9
    kv_dtype: str = "auto"
    enable_prefix_caching: bool = True

    DEFAULT_CPU_KV_BYTES = 2 << 30

    def __post_init__(self) -> None:
        if self.block_size is not None and (
                not isinstance(self.block_size, int) or not 16 <= self.block_size <= 256
                or self.block_size % 16):
            raise ValueError(f"block_size: got {self.block_size!r}; "
                             "allowed: a multiple of 16 from 16 to 256")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes: got {self.kv_cache_bytes}; expected > 0 bytes")
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction: got {self.memory_fraction}; allowed (0, 1]")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: got {self.kv_dtype!r}; allowed: {', '.join(KV_DTYPES)}")
