// Causal prompt attention for CPUs, one sequence per call: q [n, H, D] are the last n
// positions of a context k/v [L, KVH, D] (fp32). torch's flash kernel ran about 60
// GFLOP/s here at a few hundred tokens, a third of two cores' fp32 peak, and it reads a
// KV head's keys once for every query head of its group. A task here takes one KV head
// and 16 query positions of every head in its group (up to 16 * G rows), so each key
// and value row is loaded once for all of them; the softmax is the online (flash) one
// over blocks of 64 keys, and tasks are dealt to the threads so that each gets about an
// equal share of the causal triangle. Each block's keys are transposed once per call into
// a contiguous [D][64] tile (a transposed row per head, L floats long, put a block's rows
// L * 4 bytes apart: at L = 1024, 8192 or 32768 all in the same few cache sets). With
// AVX-512 or AVX2, scores and value sums go 6 rows at a time through a tile of
// accumulators held in registers, each key or value vector loaded once for the 6 rows.
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kQueryBlock = 16;  // query positions per task
constexpr int64_t kKeyBlock = 64;    // keys per online-softmax step
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// A register tile of kRowGroup rows x kVectors vectors: with AVX-512's 32 registers
// 6 x 4 of 16 floats (24 accumulators), with AVX2's 16 registers 6 x 2 of 8 (12), leaving
// room for the shared vectors and a broadcast.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16;
constexpr int64_t kRowGroup = 6;
constexpr int kVectors = 4;
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec x) { _mm512_storeu_ps(p, x); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec zero() { return _mm512_setzero_ps(); }
// x's value pinned in a register (any of the 32): the compiler would otherwise fold each
// use's load into the FMA, loading the same vector once per row.
inline Vec in_register(Vec x) {
  asm("" : "+v"(x));
  return x;
}
#else
using Vec = __m256;
constexpr int kLanes = 8;
constexpr int64_t kRowGroup = 6;
constexpr int kVectors = 2;
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec x) { _mm256_storeu_ps(p, x); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec in_register(Vec x) {
  asm("" : "+x"(x));
  return x;
}
#endif
constexpr int kTileWidth = kVectors * kLanes;  // keys or columns a tile covers

// acc[r][.] += a[r] * b[.] for the kRowGroup rows, a[r] = row_scalars[r * stride].
inline void fma_rows(Vec (&acc)[kRowGroup][kVectors], const float* row_scalars,
                     int64_t stride, const float* b) {
  Vec bv[kVectors];
#pragma GCC unroll 4
  for (int c = 0; c < kVectors; ++c) bv[c] = in_register(load(b + c * kLanes));
#pragma GCC unroll 6
  for (int r = 0; r < kRowGroup; ++r) {
    const Vec a = broadcast(row_scalars[r * stride]);
#pragma GCC unroll 4
    for (int c = 0; c < kVectors; ++c) acc[r][c] = fmadd(a, bv[c], acc[r][c]);
  }
}

// s[r][j] = q[r] . kt[., j] for kRowGroup rows and kKeyBlock keys (kt: [D][kKeyBlock],
// the block's keys transposed), a tile's width of keys at a time.
template <int D>
inline void score_rows(const float* q, const float* kt, float* s) {
  for (int j0 = 0; j0 < kKeyBlock; j0 += kTileWidth) {
    Vec acc[kRowGroup][kVectors];
    for (auto& row : acc)
      for (Vec& a : row) a = zero();
    for (int d = 0; d < D; ++d) fma_rows(acc, q + d, D, kt + d * kKeyBlock + j0);
    for (int r = 0; r < kRowGroup; ++r)
      for (int c = 0; c < kVectors; ++c) store(s + r * kKeyBlock + j0 + c * kLanes, acc[r][c]);
  }
}

// out[r] += p[r][.] . v for kRowGroup rows over `keys` value rows (v row stride vs), a
// tile's width of columns at a time.
template <int D>
inline void accumulate_rows(const float* p, const float* v, int64_t vs, int64_t keys,
                            float* out) {
  for (int c0 = 0; c0 < D; c0 += kTileWidth) {
    Vec acc[kRowGroup][kVectors];
    for (int r = 0; r < kRowGroup; ++r)
      for (int c = 0; c < kVectors; ++c) acc[r][c] = load(out + r * D + c0 + c * kLanes);
    for (int64_t j = 0; j < keys; ++j) fma_rows(acc, p + j, kKeyBlock, v + j * vs + c0);
    for (int r = 0; r < kRowGroup; ++r)
      for (int c = 0; c < kVectors; ++c) store(out + r * D + c0 + c * kLanes, acc[r][c]);
  }
}
#else
constexpr int64_t kRowGroup = 4;     // score rows computed together

// s[r][j] = q[r] . kt[., j] for kRowGroup rows and kKeyBlock keys (kt: [D][kKeyBlock],
// the block's keys transposed).
template <int D>
inline void score_rows(const float* q, const float* kt, float* s) {
  float acc[kRowGroup][kKeyBlock] = {};
  for (int d = 0; d < D; ++d) {
    const float* k = kt + d * kKeyBlock;
    for (int r = 0; r < kRowGroup; ++r) {
      const float qd = q[r * D + d];
#pragma omp simd
      for (int j = 0; j < kKeyBlock; ++j) acc[r][j] += qd * k[j];
    }
  }
  for (int r = 0; r < kRowGroup; ++r)
    for (int j = 0; j < kKeyBlock; ++j) s[r * kKeyBlock + j] = acc[r][j];
}

// out[r] += p[r][.] . v for kRowGroup rows over `keys` value rows (v row stride vs).
template <int D>
inline void accumulate_rows(const float* p, const float* v, int64_t vs, int64_t keys,
                            float* out) {
  float acc[kRowGroup][D];
  for (int r = 0; r < kRowGroup; ++r)
    for (int d = 0; d < D; ++d) acc[r][d] = out[r * D + d];
  for (int64_t j = 0; j < keys; ++j) {
    const float* vj = v + j * vs;
    for (int r = 0; r < kRowGroup; ++r) {
      const float pj = p[r * kKeyBlock + j];
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[r][d] += pj * vj[d];
    }
  }
  for (int r = 0; r < kRowGroup; ++r)
    for (int d = 0; d < D; ++d) out[r * D + d] = acc[r][d];
}
#endif

struct Shape {
  int64_t n, length, heads, kv_heads, group;
  int64_t q_stride, v_stride;  // row (token) strides
  int64_t key_blocks;          // ceil(length / kKeyBlock)
  float scale;
};

// One task: KV head h, query positions [i0, i0 + kQueryBlock); kt: every KV head's keys
// transposed a block at a time, [KVH][key_blocks][D][kKeyBlock], zero past the context.
template <int D>
void attend_block(const Shape& s, const float* q, const float* kt, const float* v, float* out,
                  int64_t h, int64_t i0) {
  const int64_t qn = std::min(kQueryBlock, s.n - i0);
  const int64_t rows = s.group * qn;
  const int64_t padded = (rows + kRowGroup - 1) / kRowGroup * kRowGroup;
  std::vector<float> qbuf(padded * D, 0.f), acc(padded * D, 0.f);
  std::vector<float> scores(padded * kKeyBlock);
  std::vector<float> row_sum(padded, 0.f);
  std::vector<float> row_max(padded, -std::numeric_limits<float>::infinity());
  // Row r = g * qn + i: query head h * group + g at position i0 + i, pre-scaled.
  for (int64_t g = 0; g < s.group; ++g)
    for (int64_t i = 0; i < qn; ++i) {
      const float* src = q + (i0 + i) * s.q_stride + (h * s.group + g) * D;
      float* dst = qbuf.data() + (g * qn + i) * D;
      for (int d = 0; d < D; ++d) dst[d] = src[d] * s.scale;
    }
  const int64_t offset = s.length - s.n;          // position of query 0 in the context
  const int64_t key_end = offset + i0 + qn;       // keys any row of the task sees
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
    const int64_t kc = std::min(kKeyBlock, key_end - k0);
    const float* tile = kt + (h * s.key_blocks + k0 / kKeyBlock) * D * kKeyBlock;
    for (int64_t r = 0; r < padded; r += kRowGroup)
      score_rows<D>(qbuf.data() + r * D, tile, scores.data() + r * kKeyBlock);
    const bool diagonal = k0 + kc > offset + i0;   // some row sees only part of the block
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = scores.data() + r * kKeyBlock;
      int64_t visible = kc;
      if (diagonal) visible = std::min(kc, offset + i0 + r % qn + 1 - k0);
      if (visible <= 0) {
        std::fill(sr, sr + kKeyBlock, 0.f);
        continue;
      }
      const float m = max_of(sr, visible, row_max[r]);
      const float rescale = std::exp(row_max[r] - m);
      const float block_sum = exp_shift(sr, visible, m);
      std::fill(sr + visible, sr + kKeyBlock, 0.f);
      row_sum[r] = row_sum[r] * rescale + block_sum;
      row_max[r] = m;
      if (rescale != 1.f) {
        float* ar = acc.data() + r * D;
        for (int d = 0; d < D; ++d) ar[d] *= rescale;
      }
    }
    for (int64_t r = 0; r < padded; r += kRowGroup)
      accumulate_rows<D>(scores.data() + r * kKeyBlock, v + k0 * s.v_stride + h * D,
                         s.v_stride, kc, acc.data() + r * D);
  }
  for (int64_t g = 0; g < s.group; ++g)
    for (int64_t i = 0; i < qn; ++i) {
      const int64_t r = g * qn + i;
      const float inv = 1.f / row_sum[r];
      float* dst = out + (i0 + i) * s.heads * D + (h * s.group + g) * D;
      for (int d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
    }
}

template <int D>
void run_tasks(const Shape& s, const float* q, const float* k, int64_t k_stride,
               const float* v, float* out) {
  // Every task of a KV head reads the same keys: transposed once, a tile per block.
  std::vector<float> kt(s.kv_heads * s.key_blocks * D * kKeyBlock, 0.f);
  // A short context's transposition is shorter than waking a thread.
  const int64_t tiles = s.kv_heads * s.key_blocks;
  at::parallel_for(0, tiles, s.length >= 256 ? 1 : tiles, [&](int64_t begin, int64_t end) {
    for (int64_t hb = begin; hb < end; ++hb) {
      const int64_t h = hb / s.key_blocks, t0 = hb % s.key_blocks * kKeyBlock;
      float* tile = kt.data() + hb * D * kKeyBlock;
      for (int64_t t = 0; t < std::min(kKeyBlock, s.length - t0); ++t) {
        const float* key = k + (t0 + t) * k_stride + h * D;
        for (int d = 0; d < D; ++d) tile[d * kKeyBlock + t] = key[d];
      }
    }
  });
  const int64_t blocks = (s.n + kQueryBlock - 1) / kQueryBlock;
  // Later query blocks see more keys. Dealing them out longest first, round-robin over
  // the threads, gives each thread about an equal share of the triangle.
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t b = blocks - 1; b >= 0; --b)
    for (int64_t h = 0; h < s.kv_heads; ++h) tasks.emplace_back(h, b * kQueryBlock);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                  tasks.size()));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = t; i < static_cast<int64_t>(tasks.size()); i += threads)
        attend_block<D>(s, q, kt.data(), v, out, tasks[i].first, tasks[i].second);
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && q.dim() == 3 && k.dim() == 3 &&
                  v.dim() == 3 && k.sizes() == v.sizes(),
              "prefill_attention: q [n, H, D], k and v [L, KVH, D], all float32");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t length = k.size(0), kv_heads = k.size(1);
  TORCH_CHECK(k.size(2) == dim && n <= length && kv_heads > 0 && heads % kv_heads == 0,
              "prefill_attention: ", n, " queries of ", heads, " heads over ", length,
              " keys of ", kv_heads, " heads: need n <= L, KVH dividing H, one head size");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == dim,
                "prefill_attention: each token's heads must be contiguous");
  auto out = at::empty({n, heads, dim}, q.options());
  const Shape s{n, length, heads, kv_heads, heads / kv_heads, q.stride(0), v.stride(0),
                (length + kKeyBlock - 1) / kKeyBlock, static_cast<float>(scale)};
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  switch (dim) {
    case 64: run_tasks<64>(s, qp, kp, k.stride(0), vp, out.data_ptr<float>()); break;
    case 128: run_tasks<128>(s, qp, kp, k.stride(0), vp, out.data_ptr<float>()); break;
    default: TORCH_CHECK(false, "prefill_attention: head size ", dim, " (64 or 128 only)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
