// Paged decode attention for CPUs: each query token attends to its sequence's KV
// straight from the block pool, one (sequence, KV head) context per task (below twice
// as many contexts as threads, one piece of a context; over int8 rows with one table
// for all heads, a sequence's every head: decode_kernel), so no per-step copy of the
// context is made. Each task reads the block table and length of
// its own (sequence, KV head), so sparse attention (a subset of blocks per KV head) runs
// the code dense decode runs, whose one table is every head's. Registered as
// torch.ops.llm_cluster.paged_decode_attention.
//
// Speed comes from three choices: the head size is a compile-time constant for the
// common sizes (64, 128), so a dot product or an update of one head row is a few
// unrolled vector instructions (AVX-512, or AVX2 + FMA, whose exp and 8-row sums
// vec_math.h holds: without them a token cost ~300 cycles a head on a Zen 3, 3x this);
// fp16/bf16 keys and values are widened to fp32 one block at a time with vector
// conversions (F16C / AVX-512 for fp16, shifts for bf16), never element by element
// through at::Half; and every query head of a GQA group reuses
// each key and value row while it is in cache. The int8 cache's rows go through
// int8_kv_rows.h: keys scored in integers, values summed with the row's scale folded
// into its weight.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "int8_kv_rows.h"
#include "kv_pool.h"
#include "vec_math.h"

namespace {

// An int8 row's n values as fp32 without its scale, which the caller folds into the
// row's score or weight (one multiply per row, not per value); returns the scale.
inline float widen_unscaled(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)))));
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  return row_scale(src, n);
}

// One block's rows of a head as fp32: row t is data[t * stride], times scales[t] when
// scales is set (int8 rows), as stored otherwise.
struct Rows {
  const float* data;
  int64_t stride;
  const float* scales;
};

// One block's n rows of a head: read in place for fp32 (row stride token_stride),
// widened into buf otherwise (row stride head_dim), int8 rows' scales into scale_buf.
template <typename T>
inline Rows block_rows(const T* base, int64_t n, int64_t token_stride, int64_t head_dim,
                       float* buf, float* scale_buf) {
  if constexpr (std::is_same_v<T, float>) {
    return {base, token_stride, nullptr};
  } else if constexpr (std::is_same_v<T, int8_t>) {
    for (int64_t t = 0; t < n; ++t)
      scale_buf[t] = widen_unscaled(base + t * token_stride, buf + t * head_dim, head_dim);
    return {buf, head_dim, scale_buf};
  } else {
    for (int64_t t = 0; t < n; ++t) widen(base + t * token_stride, buf + t * head_dim, head_dim);
    return {buf, head_dim, nullptr};
  }
}

// Ask for n rows of row_bytes each, stride_bytes apart, to be brought into L2. Block
// tables scatter a context over the pool, so the hardware prefetcher cannot guess the
// next block; fetching it two blocks ahead (kPrefetchAhead) hides the memory latency
// that otherwise dominates a decode step. Into L2 (prefetcht1), not L1: a block's 64
// lines at once fill L1's few miss buffers and stall the loads behind them, and on a
// Zen 4 the same kernel with prefetcht0 read a long context at half the speed
// (benchmarks/RESULTS.md, "Prefetching into L2").
constexpr int64_t kPrefetchAhead = 2;   // 1 and 3 were 1-4% slower (RESULTS.md)
inline void prefetch_rows(const void* base, int64_t n, int64_t row_bytes, int64_t stride_bytes) {
  const char* p = static_cast<const char*>(base);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + t * stride_bytes + b, 0, 2);
}

// Scores of n key rows against one query row: out[t] = q . rows[t]; and the weighted
// sum dst += sum_t p[t] * rows[t]. D > 0 is the head size known at compile time (a
// multiple of 16 takes the AVX-512 path, where each head row is D/16 registers and
// the running sum stays in registers across rows); D == 0 is a run-time size d.
template <int D>
inline void block_scores(const float* q, const float* rows, int64_t stride, int64_t n,
                         float* out, int64_t d) {
#if defined(__AVX512F__)
  if constexpr (D > 0 && D % 32 == 0) {
    __m512 qv[D / 16];
    for (int j = 0; j < D / 16; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - t0);
      __m512 partial[16];
      for (int64_t t = 0; t < 16; ++t) {
        if (t >= m) {
          partial[t] = _mm512_setzero_ps();
          continue;
        }
        const float* k = rows + (t0 + t) * stride;
        __m512 s0 = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        __m512 s1 = _mm512_mul_ps(qv[1], _mm512_loadu_ps(k + 16));
        for (int j = 2; j < D / 16; j += 2) {
          s0 = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k + 16 * j), s0);
          s1 = _mm512_fmadd_ps(qv[j + 1], _mm512_loadu_ps(k + 16 * j + 16), s1);
        }
        partial[t] = _mm512_add_ps(s0, s1);
      }
      _mm512_mask_storeu_ps(out + t0, static_cast<__mmask16>((1u << m) - 1),
                            transpose_sum16(partial, add_ps));
    }
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (D > 0 && D % 16 == 0) {
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const int64_t m = std::min<int64_t>(8, n - t0);
      __m256 partial[8];
      for (int64_t t = 0; t < 8; ++t) {
        if (t >= m) {
          partial[t] = _mm256_setzero_ps();
          continue;
        }
        const float* k = rows + (t0 + t) * stride;
        __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
        __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_loadu_ps(k + 8));
        for (int j = 16; j < D; j += 16) {
          s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(k + j), s0);
          s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(k + j + 8), s1);
        }
        partial[t] = _mm256_add_ps(s0, s1);
      }
      if (m == 8) {
        _mm256_storeu_ps(out + t0, transpose_sum8(partial));
      } else {
        alignas(32) float sums[8];
        _mm256_store_ps(sums, transpose_sum8(partial));
        std::copy(sums, sums + m, out + t0);
      }
    }
    return;
  }
#endif
  const int64_t size = D > 0 ? D : d;
  for (int64_t t = 0; t < n; ++t) {
    const float* k = rows + t * stride;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < size; ++i) acc += q[i] * k[i];
    out[t] = acc;
  }
}

template <int D>
inline void accumulate(const float* p, const float* rows, int64_t stride, int64_t n, float* dst,
                       int64_t d) {
#if defined(__AVX512F__)
  if constexpr (D > 0 && D % 32 == 0) {
    __m512 a[D / 16];
    for (int j = 0; j < D / 16; ++j) a[j] = _mm512_loadu_ps(dst + 16 * j);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 w = _mm512_set1_ps(p[t]);
      const float* x = rows + t * stride;
      for (int j = 0; j < D / 16; ++j) a[j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + 16 * j), a[j]);
    }
    for (int j = 0; j < D / 16; ++j) _mm512_storeu_ps(dst + 16 * j, a[j]);
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (D > 0 && D % 64 == 0) {
    // 64 columns at a time: their 8 running sums stay in registers across the rows.
    for (int c = 0; c < D; c += 64) {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(dst + c + 8 * j);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 w = _mm256_set1_ps(p[t]);
        const float* x = rows + t * stride + c;
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8 * j), a[j]);
      }
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + c + 8 * j, a[j]);
    }
    return;
  }
#endif
  const int64_t size = D > 0 ? D : d;
  for (int64_t t = 0; t < n; ++t) {
    const float w = p[t];
    const float* x = rows + t * stride;
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) dst[i] += w * x[i];
  }
}

// row[0:len] = exp(row[0:len] - max) in place; returns {max, sum of the new row}. The
// normalisation waits for the merge of a context's pieces (decode_kernel).
inline std::pair<float, float> exp_shifted(float* row, int64_t len) {
  const float mx = max_of(row, len, -INFINITY);
  return {mx, exp_shift(row, len, mx)};
}

// How many pieces each (sequence, KV head) context is cut into: one, unless there are
// fewer contexts than twice the threads (batch 1: three KV heads on two threads would
// leave one thread reading two heads while the other idles for a third of the call),
// and never pieces under kMinPieceTokens, whose fixed costs would outweigh the balance.
constexpr int64_t kMinPieceTokens = 512;
inline int64_t pieces_per_context(int64_t contexts, int64_t max_len) {
  const int64_t threads = at::get_num_threads();
  if (contexts >= 2 * threads) return 1;
  const int64_t wanted = (2 * threads + contexts - 1) / contexts;
  return std::max<int64_t>(1, std::min(wanted, max_len / kMinPieceTokens));
}

// block_tables [num_seqs, kv_heads, max_blocks] and seq_lens [num_seqs, kv_heads], read
// through their strides (a dense table is expanded over heads with stride 0).
template <typename T, int D>
void decode_kernel(const at::Tensor& out, const at::Tensor& q, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t kv_heads = key_cache.size(2), group = num_heads / kv_heads;
  const int64_t max_len = block_tables.size(2) * block_size;
  const int64_t table_seq = block_tables.stride(0), table_head = block_tables.stride(1);
  const int64_t len_seq = seq_lens.stride(0), len_head = seq_lens.stride(1);
  const int64_t row_width = key_cache.size(3);  // head_dim, or head_dim + 2 for int8
  // A block's rows are contiguous; blocks lie stride(0) apart (either pool order).
  const int64_t token_stride = kv_heads * row_width, block_stride = key_cache.stride(0);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const T* kp = key_cache.data_ptr<T>();
  const T* vp = value_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  // A task takes `heads` KV heads of one sequence. Over int8 rows that is all of them when
  // they share one table and the sequences alone keep every thread busy: an int8 row is
  // 66 bytes, so most of a head's rows share cache lines with its neighbours', and a
  // block read for every head at once loads each line once (11-18% faster, cold; fp16
  // rows, two whole lines each, ran 2-43% slower that way: benchmarks/RESULTS.md).
  // One head otherwise. Each (sequence, KV head) context is cut into `pieces` runs of
  // whole blocks. A task leaves each of its pieces' softmax unnormalised: per query head
  // the max score, the sum of exp(score - max) and the values weighted by those exps
  // (`parts`); the merge below rescales every piece to the context's max, as split-K
  // decoding does.
  const int64_t contexts = num_seqs * kv_heads;
  const bool shared_table = table_head == 0 && len_head == 0;
  const int64_t heads = std::is_same_v<T, int8_t> && shared_table &&
                                num_seqs >= 2 * at::get_num_threads() ? kv_heads : 1;
  // A block of every head is `heads` times the bytes: fetched one block ahead, not two.
  const int64_t prefetch_ahead = heads > 1 ? 1 : kPrefetchAhead;
  const int64_t pieces = pieces_per_context(contexts / heads, max_len);
  // A part per (context, piece, query head): acc[head_dim], max, sum, each part on its own
  // 64-byte lines (at::empty aligns to 64), so two threads' parts never share a line.
  const int64_t part_width = (head_dim + 2 + 15) / 16 * 16;
  const at::Tensor parts_buffer = at::empty({contexts * pieces * group, part_width},
                                            q.options());
  float* const parts = parts_buffer.data_ptr<float>();
  at::parallel_for(0, contexts / heads * pieces, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qs(heads * group * head_dim);
    std::vector<float> rows(block_size * head_dim);  // one block's rows of a head, fp32
    std::vector<float> row_scales(block_size), weights(block_size);  // int8 values
    std::vector<int8_kv::Int8Query<D>> query16;                       // int8 keys
    if constexpr (std::is_same_v<T, int8_t>)
      for (int64_t i = 0; i < heads; ++i) query16.emplace_back(group, head_dim, block_size);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t unit = task / pieces, piece = task % pieces;
      const int64_t s = unit * heads / kv_heads, h0 = unit * heads % kv_heads;
      const int64_t len = lens[s * len_seq + h0 * len_head];
      const int64_t* table = tables + s * table_seq + h0 * table_head;
      TORCH_CHECK(len > 0 && len <= max_len, "paged_decode_attention: length ", len,
                  " of sequence ", s, " head ", h0, " outside 1..", max_len);
      const int64_t blocks = (len + block_size - 1) / block_size;
      const int64_t first = blocks * piece / pieces, last = blocks * (piece + 1) / pieces;
      for (int64_t b = first; b < last; ++b)
        TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "paged_decode_attention: block ",
                    table[b], " outside the pool of ", num_blocks);
      const int64_t lo = first * block_size, hi = std::min(len, last * block_size);
      const int64_t span = std::max<int64_t>(0, hi - lo);
      // Head h0 + i's part for query head g.
      auto part_of = [&](int64_t i, int64_t g) {
        return parts + (((s * kv_heads + h0 + i) * pieces + piece) * group + g) * part_width;
      };
      if (span == 0) {   // a piece past a short context's end: the merge skips its acc
        for (int64_t i = 0; i < heads; ++i)
          for (int64_t g = 0; g < group; ++g) {
            part_of(i, g)[head_dim] = -INFINITY;
            part_of(i, g)[head_dim + 1] = 0.f;
          }
        continue;
      }
      scores.resize(heads * group * span);
      for (int64_t i = 0; i < heads * group; ++i) {
        const float* src = qp + (s * num_heads + h0 * group + i) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qs[i * head_dim + d] = src[d] * fscale;
      }
      // The piece's blocks are visited twice, keys then values: visit b < nb is key block
      // b, visit nb + b value block b. Each visit prefetches the task's heads' rows of the
      // block prefetch_ahead visits on, so the value pass's first blocks arrive while the
      // last keys are scored.
      const int64_t nb = last - first;
      auto visit_block = [&](int64_t visit) {
        return (visit < nb ? kp : vp) + table[first + visit % nb] * block_stride + h0 * row_width;
      };
      auto visit_rows = [&](int64_t visit) {
        return std::min(block_size, span - visit % nb * block_size);
      };
      // One pass (0: keys, 1: values): use(offset, n, rows, i) gets each block's n rows of
      // head h0 + i as stored, token_stride apart, for every head of the task in turn.
      auto each_block = [&](int64_t pass, auto&& use) {
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t ahead = pass * nb + b + prefetch_ahead;
          if (ahead < 2 * nb)
            prefetch_rows(visit_block(ahead), visit_rows(ahead), heads * row_width * sizeof(T),
                          token_stride * sizeof(T));
          const T* block = visit_block(pass * nb + b);
          for (int64_t i = 0; i < heads; ++i)
            use(b * block_size, visit_rows(pass * nb + b), block + i * row_width, i);
        }
      };
      if constexpr (std::is_same_v<T, int8_t>) {
        for (int64_t i = 0; i < heads; ++i) query16[i].set(qs.data() + i * group * head_dim);
        each_block(0, [&](int64_t offset, int64_t n, const T* block, int64_t i) {
          query16[i].score(block, token_stride, n, scores.data() + i * group * span + offset,
                           span);
        });
      } else {
        each_block(0, [&](int64_t offset, int64_t n, const T* block, int64_t i) {
          const Rows keys = block_rows(block, n, token_stride, head_dim, rows.data(), nullptr);
          for (int64_t g = 0; g < group; ++g)
            block_scores<D>(qs.data() + (i * group + g) * head_dim, keys.data, keys.stride, n,
                            scores.data() + (i * group + g) * span + offset, head_dim);
        });
      }
      for (int64_t i = 0; i < heads; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const auto [mx, total] = exp_shifted(scores.data() + (i * group + g) * span, span);
          float* part = part_of(i, g);
          std::fill(part, part + head_dim, 0.f);
          part[head_dim] = mx;
          part[head_dim + 1] = total;
        }
      each_block(1, [&](int64_t offset, int64_t n, const T* block, int64_t i) {
        const float* head_scores = scores.data() + i * group * span;
#if defined(__AVX512F__)
        if constexpr (std::is_same_v<T, int8_t> && int8_kv::kFusedValueSums<D>) {
          int8_kv::int8_value_sums<D>(head_scores + offset, span, group, block, token_stride,
                                      n, part_of(i, 0), part_width);
          return;
        }
#endif
        const Rows values = block_rows(block, n, token_stride, head_dim, rows.data(),
                                       row_scales.data());
        for (int64_t g = 0; g < group; ++g) {
          const float* p = head_scores + g * span + offset;
          if (values.scales) {
            for (int64_t t = 0; t < n; ++t) weights[t] = p[t] * values.scales[t];
            p = weights.data();
          }
          accumulate<D>(p, values.data, values.stride, n, part_of(i, g), head_dim);
        }
      });
    }
  });
  // Merge: out = sum_p exp(max_p - max) acc_p / sum_p exp(max_p - max) sum_p.
  constexpr int64_t kMergeGrain = 64;   // contexts per thread: a merge is a few hundred flops
  at::parallel_for(0, contexts, kMergeGrain, [&](int64_t begin, int64_t end) {
    for (int64_t context = begin; context < end; ++context) {
      const int64_t s = context / kv_heads, h = context % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        const float* first = parts + (context * pieces * group + g) * part_width;
        const int64_t piece_stride = group * part_width;
        float mx = -INFINITY;
        for (int64_t p = 0; p < pieces; ++p) mx = std::max(mx, first[p * piece_stride + head_dim]);
        float total = 0.f;
        float* dst = op + (s * num_heads + h * group + g) * head_dim;
        std::fill(dst, dst + head_dim, 0.f);
        for (int64_t p = 0; p < pieces; ++p) {
          const float* part = first + p * piece_stride;
          if (part[head_dim + 1] == 0.f) continue;   // an empty piece
          const float w = std::exp(part[head_dim] - mx);
          total += w * part[head_dim + 1];
          for (int64_t i = 0; i < head_dim; ++i) dst[i] += w * part[i];
        }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < head_dim; ++i) dst[i] *= inv;
      }
    }
  });
}

template <typename T>
void decode_dispatch_head_dim(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& tables,
                              const at::Tensor& lens, double scale) {
  switch (q.size(2)) {
    case 64: decode_kernel<T, 64>(out, q, k, v, tables, lens, scale); break;
    case 128: decode_kernel<T, 128>(out, q, k, v, tables, lens, scale); break;
    default: decode_kernel<T, 0>(out, q, k, v, tables, lens, scale);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [num_seqs, num_heads, head_dim] tensor");
  TORCH_CHECK(key_cache.dim() == 4 && blocks_contiguous(key_cache) &&
                  value_cache.sizes() == key_cache.sizes() &&
                  value_cache.strides() == key_cache.strides(),
              "key/value caches must be [num_blocks, block_size, kv_heads, head_dim] of one "
              "shape and strides, each block contiguous");
  const int64_t scale_bytes = key_cache.scalar_type() == at::kChar ? 2 : 0;
  TORCH_CHECK(key_cache.size(3) == q.size(2) + scale_bytes,
              "head_dim of q and the cache differ (an int8 row holds head_dim + 2 bytes)");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of kv_heads");
  const int64_t num_seqs = q.size(0), kv_heads = key_cache.size(2);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  (block_tables.dim() == 2 ||
                   (block_tables.dim() == 3 && block_tables.size(1) == kv_heads)) &&
                  block_tables.size(0) == num_seqs,
              "block_tables must be a contiguous int64 [num_seqs, max_blocks] or "
              "[num_seqs, kv_heads, max_blocks] tensor");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong &&
                  (seq_lens.dim() == 1 || (seq_lens.dim() == 2 && seq_lens.size(1) == kv_heads)) &&
                  seq_lens.size(0) == num_seqs,
              "seq_lens must be int64 [num_seqs] or [num_seqs, kv_heads]");
  // One table and length per (sequence, KV head): a dense table is every head's.
  const at::Tensor tables = block_tables.dim() == 3 ? block_tables
      : block_tables.unsqueeze(1).expand({num_seqs, kv_heads, block_tables.size(1)});
  const at::Tensor lens = seq_lens.dim() == 2 ? seq_lens
      : seq_lens.unsqueeze(1).expand({num_seqs, kv_heads});
  auto out = at::empty_like(q);
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      decode_dispatch_head_dim<float>(out, q, key_cache, value_cache, tables, lens, scale);
      break;
    case at::kHalf:
      decode_dispatch_head_dim<at::Half>(out, q, key_cache, value_cache, tables, lens, scale);
      break;
    case at::kBFloat16:
      decode_dispatch_head_dim<at::BFloat16>(out, q, key_cache, value_cache, tables, lens,
                                             scale);
      break;
    case at::kChar:
      decode_dispatch_head_dim<int8_t>(out, q, key_cache, value_cache, tables, lens, scale);
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
