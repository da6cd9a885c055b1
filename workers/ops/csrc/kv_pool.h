// A KV pool tensor as the CPU kernels read it, in either order of kvcache/kv_tensors.py:
// blocks lie stride(0) apart (a layer-major pool: one block's size; a block-major one: a
// block of every layer), and each block's rows are contiguous.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// Whether the dimensions from `block_dim + 1` on (a block's rows) are contiguous: the
// block is dimension 0 of one layer's K or V, 1 of a layer's [2, blocks, ...] tensor.
inline bool blocks_contiguous(const at::Tensor& cache, int64_t block_dim = 0) {
  int64_t step = 1;
  for (int64_t d = cache.dim() - 1; d > block_dim; --d) {
    if (cache.size(d) != 1 && cache.stride(d) != step) return false;
    step *= cache.size(d);
  }
  return true;
}
