// A context's keys and values read out of the paged pool as fp32, for prefill attention
// over cached tokens (a prefix-cache hit, a later chunk) and over every int8 pool. In
// torch that is an index copy of the blocks and then a conversion, two passes over the
// context and a temporary. This op reads each block once and writes it once: with int8
// KV the reads of a 23-28 s Workload A run took 0.13-0.15 s, against 0.4-0.8 s in torch
// (benchmarks/RESULTS.md). The values are exactly torch's: an int8 row dequantizes as
// float(value) * float(scale), one product per value (kvcache/kv_quant.py).
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kv_pool.h"
#include "vec_math.h"

namespace {

constexpr int64_t kBlockGrain = 4;  // blocks per parallel task

// One block's first `tokens` rows of `heads` heads as fp32 [tokens, heads, dim]: the
// float types converted (vec_math.h's widen), int8 rows dequantized row by row.
template <typename T>
void read_rows(const T* src, float* dst, int64_t tokens, int64_t heads, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, tokens * heads * dim * sizeof(float));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    for (int64_t r = 0; r < tokens * heads; ++r) widen(src + r * (dim + 2), dst + r * dim, dim);
  } else {
    widen(src, dst, tokens * heads * dim);
  }
}

// cache [2, blocks, block_size, KVH, W] (one layer; W = D + 2 for int8): the first
// `length` tokens of the context whose blocks are block_table[0..], as fp32
// [2, length, KVH, D] (keys, then values).
at::Tensor gather_kv(const at::Tensor& cache, const at::Tensor& block_table, int64_t length) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && blocks_contiguous(cache, 1),
              "gather_kv: cache must be [2, blocks, block_size, KVH, W] with contiguous "
              "blocks");
  const bool int8 = cache.scalar_type() == at::kChar;
  const int64_t block_size = cache.size(2), heads = cache.size(3);
  const int64_t dim = cache.size(4) - (int8 ? 2 : 0);
  const int64_t num_blocks = (length + block_size - 1) / block_size;
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 &&
                  block_table.stride(0) == 1 && block_table.size(0) >= num_blocks &&
                  length >= 0,
              "gather_kv: block_table must be contiguous int64 with at least the ",
              num_blocks, " blocks of ", length, " tokens");
  TORCH_CHECK(dim > 0, "gather_kv: int8 rows need at least one value before the scale");
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_blocks; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < cache.size(1), "gather_kv: block ", table[b],
                " outside the pool of ", cache.size(1));
  auto out = at::empty({2, length, heads, dim}, cache.options().dtype(at::kFloat));
  const int64_t half_stride = cache.stride(0), block_stride = cache.stride(1);
  const int64_t out_row = heads * dim;
  float* dst = out.data_ptr<float>();
  auto run = [&](auto read, const auto* base) {
    at::parallel_for(0, 2 * num_blocks, kBlockGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t half = i / num_blocks, b = i % num_blocks;
        const int64_t tokens = std::min(block_size, length - b * block_size);
        read(base + half * half_stride + table[b] * block_stride,
             dst + (half * length + b * block_size) * out_row, tokens, heads, dim);
      }
    });
  };
  switch (cache.scalar_type()) {
    case at::kFloat: run(read_rows<float>, cache.data_ptr<float>()); break;
    case at::kHalf: run(read_rows<at::Half>, cache.data_ptr<at::Half>()); break;
    case at::kBFloat16: run(read_rows<at::BFloat16>, cache.data_ptr<at::BFloat16>()); break;
    case at::kChar: run(read_rows<int8_t>, cache.data_ptr<int8_t>()); break;
    default: TORCH_CHECK(false, "gather_kv: unsupported cache dtype ", cache.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("gather_kv(Tensor cache, Tensor block_table, int length) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) { m.impl("gather_kv", &gather_kv); }
