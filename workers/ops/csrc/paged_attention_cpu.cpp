// Paged decode attention for CPUs: each query token attends to its sequence's KV
// straight from the block pool, one (sequence, KV head) pair per task, so no
// per-step copy of the context is made. Registered as
// torch.ops.llm_cluster.paged_decode_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * to_float(b[i]);
  return acc;
}

template <typename T>
inline void axpy(float alpha, const T* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * to_float(x[i]);
}

template <typename T>
void decode_kernel(const at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  const int64_t group = num_heads / kv_heads, max_blocks = block_tables.size(1);
  const int64_t token_stride = kv_heads * head_dim, block_stride = block_size * token_stride;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const T* kp = key_cache.data_ptr<T>();
  const T* vp = value_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> qs(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads;
      const int64_t len = lens[s];
      const int64_t* table = tables + s * max_blocks;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const float* src = qp + (s * num_heads + h * group + g) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) qs[g * head_dim + i] = src[i] * fscale;
      }
      for (int64_t pos = 0; pos < len; ++pos) {
        const T* key = kp + table[pos / block_size] * block_stride +
                       (pos % block_size) * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g)
          scores[g * len + pos] = dot(qs.data() + g * head_dim, key, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * len;
        const float mx = *std::max_element(row, row + len);
        float total = 0.f;
        for (int64_t pos = 0; pos < len; ++pos) {
          row[pos] = std::exp(row[pos] - mx);
          total += row[pos];
        }
        const float inv = 1.f / total;
        for (int64_t pos = 0; pos < len; ++pos) row[pos] *= inv;
      }
      float* dst = op + (s * num_heads + h * group) * head_dim;
      std::fill(dst, dst + group * head_dim, 0.f);
      for (int64_t pos = 0; pos < len; ++pos) {
        const T* value = vp + table[pos / block_size] * block_stride +
                         (pos % block_size) * token_stride + h * head_dim;
        for (int64_t g = 0; g < group; ++g)
          axpy(scores[g * len + pos], value, dst + g * head_dim, head_dim);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [num_seqs, num_heads, head_dim] tensor");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "key/value caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.size(3) == q.size(2), "head_dim of q and the cache differ");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.size(0) == q.size(0),
              "block_tables must be a contiguous int64 [num_seqs, max_blocks] tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.numel() == q.size(0),
              "seq_lens must be int64 [num_seqs]");
  auto out = at::empty_like(q);
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      decode_kernel<float>(out, q, key_cache, value_cache, block_tables, seq_lens, scale);
      break;
    case at::kHalf:
      decode_kernel<at::Half>(out, q, key_cache, value_cache, block_tables, seq_lens, scale);
      break;
    case at::kBFloat16:
      decode_kernel<at::BFloat16>(out, q, key_cache, value_cache, block_tables, seq_lens, scale);
      break;
    default:
      TORCH_CHECK(false, "unsupported KV cache dtype ", key_cache.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(llm_cluster, m) {
  m.def("paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
