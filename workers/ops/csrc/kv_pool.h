// A KV pool tensor as the CPU kernels read it, in either order of kvcache/kv_tensors.py:
// blocks lie stride(0) apart (a layer-major pool: one block's size; a block-major one: a
// block of every layer), and each block's rows are contiguous.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// Whether every dimension after the first (the block) is contiguous.
inline bool blocks_contiguous(const at::Tensor& cache) {
  int64_t step = 1;
  for (int64_t d = cache.dim() - 1; d >= 1; --d) {
    if (cache.size(d) != 1 && cache.stride(d) != step) return false;
    step *= cache.size(d);
  }
  return true;
}
