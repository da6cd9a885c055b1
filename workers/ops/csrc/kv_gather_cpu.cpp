// A context's keys and values read out of the paged pool as fp32, for prefill attention
// over cached tokens (a prefix-cache hit, a later chunk) and over every int8 pool. In
// torch that is an index copy of the blocks and then a conversion, two passes over the
// context and a temporary. This op reads each block once and writes it once: with int8
// KV the reads of a 23-28 s Workload A run took 0.13-0.15 s, against 0.4-0.8 s in torch
// (benchmarks/RESULTS.md). The values are exactly torch's: an int8 row dequantizes as
// float(value) * float(scale), one product per value (kvcache/kv_quant.py).
//
// Also here: copy_kv_blocks, a list of blocks (or one KV head of them) from one pool-shaped
// tensor into another, which offload mode does as a sequence's middle moves to the host
// tier (whole blocks) and as each step recalls the blocks every layer and head selects
// (kvcache/host_tier.py). torch's indexed read and write of one head took 2.2-2.4 ms for
// 504 blocks of the benchmark's shape, this 0.22 ms (benchmarks/RESULTS.md).
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

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

// Whether `ids` (contiguous int64) are all blocks of a pool of `num_blocks`, and, with
// `distinct`, none twice; the message names the first that is not.
void check_ids(const at::Tensor& ids, int64_t num_blocks, bool distinct, const char* what) {
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<char> seen(distinct ? num_blocks : 0, 0);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < num_blocks, "copy_kv_blocks: ", what, " block ",
                id[i], " outside its pool of ", num_blocks);
    if (distinct) {
      TORCH_CHECK(!seen[id[i]], "copy_kv_blocks: ", what, " block ", id[i],
                  " given twice; each destination block takes one source");
      seen[id[i]] = 1;
    }
  }
}

// src, dst [2, blocks, block_size, KVH, W], each block's rows contiguous (any block
// stride, as in either pool order and the host tier): blocks src_ids[i] into blocks
// dst_ids[i], keys and values, every row as stored (int8 rows with their scale); only
// head `head`'s rows when given. Every id is checked before anything is written.
void copy_kv_blocks(const at::Tensor& src, const at::Tensor& src_ids, at::Tensor& dst,
                    const at::Tensor& dst_ids, std::optional<int64_t> head) {
  TORCH_CHECK(src.dim() == 5 && dst.dim() == 5 && src.size(0) == 2 && dst.size(0) == 2 &&
                  blocks_contiguous(src, 1) && blocks_contiguous(dst, 1),
              "copy_kv_blocks: src and dst must be [2, blocks, block_size, KVH, W] with "
              "each block's rows contiguous");
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() && src.size(2) == dst.size(2) &&
                  src.size(3) == dst.size(3) && src.size(4) == dst.size(4),
              "copy_kv_blocks: src ", src.sizes(), " ", src.scalar_type(), " and dst ",
              dst.sizes(), " ", dst.scalar_type(), " differ in dtype or block shape");
  TORCH_CHECK(src_ids.scalar_type() == at::kLong && dst_ids.scalar_type() == at::kLong &&
                  src_ids.dim() == 1 && dst_ids.dim() == 1 && src_ids.is_contiguous() &&
                  dst_ids.is_contiguous() && src_ids.numel() == dst_ids.numel(),
              "copy_kv_blocks: src_ids and dst_ids must be contiguous int64 vectors of "
              "one length");
  TORCH_CHECK(!head || (*head >= 0 && *head < src.size(3)), "copy_kv_blocks: head ",
              head.value_or(0), " outside the ", src.size(3), " KV heads");
  check_ids(src_ids, src.size(1), false, "source");
  check_ids(dst_ids, dst.size(1), true, "destination");
  // A block's half is `runs` runs of `run` bytes: a head's row per token, or (every head)
  // the whole contiguous half.
  const int64_t bytes = src.element_size(), tokens = src.size(2);
  const int64_t runs = head ? tokens : 1;
  const int64_t run = (head ? 1 : tokens * src.size(3)) * src.size(4) * bytes;
  const int64_t s_half = src.stride(0) * bytes, s_block = src.stride(1) * bytes;
  const int64_t s_token = src.stride(2) * bytes;
  const int64_t d_half = dst.stride(0) * bytes, d_block = dst.stride(1) * bytes;
  const int64_t d_token = dst.stride(2) * bytes;
  const int64_t h = head.value_or(0);
  const char* from = static_cast<const char*>(src.data_ptr()) + h * src.stride(3) * bytes;
  char* to = static_cast<char*>(dst.data_ptr()) + h * dst.stride(3) * bytes;
  const int64_t* si = src_ids.data_ptr<int64_t>();
  const int64_t* di = dst_ids.data_ptr<int64_t>();
  at::parallel_for(0, src_ids.numel(), 4 * kBlockGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      for (int64_t half = 0; half < 2; ++half) {
        const char* s = from + half * s_half + si[i] * s_block;
        char* d = to + half * d_half + di[i] * d_block;
        for (int64_t t = 0; t < runs; ++t) std::memcpy(d + t * d_token, s + t * s_token, run);
      }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("gather_kv(Tensor cache, Tensor block_table, int length) -> Tensor");
  m.def("copy_kv_blocks(Tensor src, Tensor src_ids, Tensor(a!) dst, Tensor dst_ids, "
        "int? head) -> ()");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("gather_kv", &gather_kv);
  m.impl("copy_kv_blocks", &copy_kv_blocks);
}
