// The int8 KV cache's rows in decode attention (paged_attention_cpu.cpp). A row is
// head_dim int8 values followed by its fp16 scale (kvcache/kv_quant.py). Keys are
// scored in integers against the query rounded to int16 (Int8Query); values are summed
// in fp32 with each row's scale folded into its weight (int8_value_sums with AVX-512;
// block_rows + accumulate there otherwise). Every path gives the same bits: the integer
// sums are exact, and the fp32 sums add the same products in the same order.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace int8_kv {

// Keys: the query head is rounded to int16 (quantize_row: scale = its largest magnitude
// / 32767), so q16 . k8 is an exact int32 sum and score = that sum * qscale * kscale. The
// query's rounding moves a score by at most 1/65534 of the query's largest element times
// the key row's L1 norm; the products take half the instructions of fp32 ones and the
// key rows are never widened to fp32. Without AVX-512 VNNI each key row is widened to
// int16 (widen_int16) and scored against each head (int_scores).
inline float widen_int16(const int8_t* src, int16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BW__)
  for (; i + 32 <= n; i += 32)
    _mm512_storeu_si512(dst + i, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__AVX2__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = src[i];
  return row_scale(src, n);
}

// out[t] = (q . rows[t]) * qscale * scales[t] over n int16 rows of d (D when D > 0).
template <int D>
inline void int_scores(const int16_t* q, float qscale, const int16_t* rows, const float* scales,
                       int64_t n, float* out, int64_t d) {
#if defined(__AVX512BW__)
  if constexpr (D > 0 && D % 32 == 0) {
    __m512i qv[D / 32];
    for (int j = 0; j < D / 32; ++j) qv[j] = _mm512_loadu_si512(q + 32 * j);
    const __m512 vq = _mm512_set1_ps(qscale);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t m = std::min<int64_t>(16, n - t0);
      const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
      __m512 partial[16];
      for (int64_t t = 0; t < 16; ++t) {
        __m512i acc = _mm512_setzero_si512();
        if (t < m) {
          const int16_t* k = rows + (t0 + t) * D;
          for (int j = 0; j < D / 32; ++j) {
#if defined(__AVX512VNNI__)
            acc = _mm512_dpwssd_epi32(acc, qv[j], _mm512_loadu_si512(k + 32 * j));
#else
            acc = _mm512_add_epi32(acc,
                                   _mm512_madd_epi16(qv[j], _mm512_loadu_si512(k + 32 * j)));
#endif
          }
        }
        partial[t] = _mm512_castsi512_ps(acc);
      }
      const __m512 sums =
          _mm512_cvtepi32_ps(_mm512_castps_si512(transpose_sum16(partial, add_epi32)));
      const __m512 ks = _mm512_maskz_loadu_ps(mask, scales + t0);
      _mm512_mask_storeu_ps(out + t0, mask, _mm512_mul_ps(sums, _mm512_mul_ps(vq, ks)));
    }
    return;
  }
#elif defined(__AVX2__)
  if constexpr (D > 0 && D % 16 == 0) {
    for (int64_t t = 0; t < n; ++t) {
      const int16_t* k = rows + t * D;
      __m256i acc = _mm256_setzero_si256();
      for (int j = 0; j < D; j += 16)
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + j)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + j))));
      out[t] = static_cast<float>(sum8(acc)) * (qscale * scales[t]);
    }
    return;
  }
#endif
  const int64_t size = D > 0 ? D : d;
  for (int64_t t = 0; t < n; ++t) {
    const int16_t* k = rows + t * size;
    int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < size; ++i) acc += static_cast<int32_t>(q[i]) * k[i];
    out[t] = static_cast<float>(acc) * (qscale * scales[t]);
  }
}

// Calls f(std::integral_constant<int, G>{}, g) for g = 0, kMax, 2 kMax, ... with G the
// number of query heads left in that chunk (at most kMax): the kernels below keep G
// heads' sums in registers, so G is a compile-time constant.
template <int kMax, typename F>
inline void by_head_chunks(int64_t group, F&& f) {
  for (int64_t g = 0; g < group; g += kMax) {
    switch (std::min<int64_t>(kMax, group - g)) {
      case 1: f(std::integral_constant<int, 1>{}, g); break;
      case 2: if constexpr (kMax >= 2) f(std::integral_constant<int, 2>{}, g); break;
      case 3: if constexpr (kMax >= 3) f(std::integral_constant<int, 3>{}, g); break;
      default: if constexpr (kMax >= 4) f(std::integral_constant<int, 4>{}, g); break;
    }
  }
}

#if defined(__AVX512VNNI__)
// With AVX-512 VNNI a block's key rows are transposed instead of widened: 16 rows of 64
// bytes become 16 registers whose lane t holds 4 bytes of token t, so one vpdpbusd adds
// 4 products for each of 16 tokens and lane t of the running sum is token t's score;
// no per-token horizontal sums (the widened path's transpose_sum16, per query head)
// and no widened copy. vpdpbusd multiplies unsigned by signed bytes, so the int16 query
// is split, q = 256 hi + lo with hi signed and lo unsigned: lo . k is one product;
// hi . k = hi . (k + 128) - 128 sum(hi), with k + 128 (k xor 0x80) unsigned. The sum is
// the same exact int32 as the widened path's.

// One query head's int16 values as the two byte operands; dword c packs the bytes that
// meet key bytes 4c..4c+3. corr = 32768 sum(hi) (the 128 sum(hi) above, times 256).
template <int D>
struct SplitQuery {
  std::array<int32_t, D / 4> hi, lo;
  int32_t corr;

  void set(const int16_t* q) {
    int8_t* h = reinterpret_cast<int8_t*>(hi.data());
    uint8_t* l = reinterpret_cast<uint8_t*>(lo.data());
    int32_t sum_hi = 0;
    for (int i = 0; i < D; ++i) {
      h[i] = static_cast<int8_t>(q[i] >> 8);   // floor(q / 256), in -128..127
      l[i] = static_cast<uint8_t>(q[i] & 255);
      sum_hi += q[i] >> 8;
    }
    corr = 32768 * sum_hi;
  }
};

// out[g * out_stride + t] for G query heads and n <= 16 key rows.
template <int D, int G>
inline void transposed_scores(const SplitQuery<D>* q, const float* qscale, const int8_t* rows,
                              int64_t token_stride, int64_t n, float* out, int64_t out_stride) {
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i hi[G], lo[G];
  for (int g = 0; g < G; ++g) hi[g] = lo[g] = _mm512_setzero_si512();
  for (int c0 = 0; c0 < D / 64; ++c0) {
    __m512i k[16];
    load_transposed16(rows + 64 * c0, token_stride, n, k);
    for (int c = 0; c < 16; ++c) {
      const __m512i ku = _mm512_xor_si512(k[c], flip);
      for (int g = 0; g < G; ++g) {
        hi[g] = _mm512_dpbusd_epi32(hi[g], ku, _mm512_set1_epi32(q[g].hi[16 * c0 + c]));
        lo[g] = _mm512_dpbusd_epi32(lo[g], _mm512_set1_epi32(q[g].lo[16 * c0 + c]), k[c]);
      }
    }
  }
  alignas(64) float scales[16];
  for (int64_t t = 0; t < n; ++t) scales[t] = row_scale(rows + t * token_stride, D);
  const __m512 ks = _mm512_maskz_loadu_ps(mask, scales);
  for (int g = 0; g < G; ++g) {
    const __m512i sums = _mm512_sub_epi32(
        _mm512_add_epi32(_mm512_slli_epi32(hi[g], 8), lo[g]), _mm512_set1_epi32(q[g].corr));
    _mm512_mask_storeu_ps(out + g * out_stride, mask,
                          _mm512_mul_ps(_mm512_cvtepi32_ps(sums),
                                        _mm512_mul_ps(_mm512_set1_ps(qscale[g]), ks)));
  }
}
#endif

// A (sequence, KV head) context's query heads, rounded to int16 once, scoring key rows
// a block at a time. One per thread: it holds that thread's buffers.
template <int D>
class Int8Query {
 public:
  Int8Query(int64_t group, int64_t head_dim, int64_t block_size)
      : group_(group), head_dim_(head_dim), q16_(group * head_dim), scales_(group) {
#if defined(__AVX512VNNI__)
    if constexpr (kTransposed) {
      split_.resize(group);
      return;
    }
#endif
    keys16_.resize(block_size * head_dim);
    row_scales_.resize(block_size);
  }

  // The context's query heads (group rows of head_dim, already times the softmax scale).
  void set(const float* q) {
    for (int64_t g = 0; g < group_; ++g)
      scales_[g] = quantize_row(q + g * head_dim_, head_dim_, 32767.f,
                                q16_.data() + g * head_dim_);
#if defined(__AVX512VNNI__)
    if constexpr (kTransposed)
      for (int64_t g = 0; g < group_; ++g) split_[g].set(q16_.data() + g * head_dim_);
#endif
  }

  // out[g * out_stride + t]: head g's score of the block's row t (n rows, token_stride
  // apart).
  void score(const int8_t* rows, int64_t token_stride, int64_t n, float* out,
             int64_t out_stride) {
#if defined(__AVX512VNNI__)
    if constexpr (kTransposed) {
      for (int64_t t0 = 0; t0 < n; t0 += 16)
        by_head_chunks<4>(group_, [&](auto heads, int64_t g) {
          transposed_scores<D, decltype(heads)::value>(
              split_.data() + g, scales_.data() + g, rows + t0 * token_stride, token_stride,
              std::min<int64_t>(16, n - t0), out + g * out_stride + t0, out_stride);
        });
      return;
    }
#endif
    for (int64_t t = 0; t < n; ++t)
      row_scales_[t] = widen_int16(rows + t * token_stride, keys16_.data() + t * head_dim_,
                                   head_dim_);
    for (int64_t g = 0; g < group_; ++g)
      int_scores<D>(q16_.data() + g * head_dim_, scales_[g], keys16_.data(),
                    row_scales_.data(), n, out + g * out_stride, head_dim_);
  }

 private:
#if defined(__AVX512VNNI__)
  static constexpr bool kTransposed = D > 0 && D % 64 == 0;
  std::vector<SplitQuery<D>> split_;
#endif
  int64_t group_, head_dim_;
  std::vector<int16_t> q16_;
  std::vector<float> scales_;
  std::vector<int16_t> keys16_;   // the widened path's copy of a block's keys, its scales
  std::vector<float> row_scales_;
};

#if defined(__AVX512F__)
// part[g] += sum_t p[g][t] * scale[t] * rows[t] for G query heads (part[g] at
// part + g * part_width, p[g] at p + g * p_stride) over n int8 value rows: each row is
// widened to fp32 in registers once for all G heads, where block_rows + accumulate
// would store it widened and read it back once per head.
template <int D, int G>
inline void value_sums(const float* p, int64_t p_stride, const int8_t* rows,
                       int64_t token_stride, int64_t n, float* part, int64_t part_width) {
  constexpr int R = D / 16;
  __m512 acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < R; ++j) acc[g][j] = _mm512_loadu_ps(part + g * part_width + 16 * j);
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* row = rows + t * token_stride;
    const float scale = row_scale(row, D);
    __m512 x[R];
    for (int j = 0; j < R; ++j)
      x[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j))));
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * p_stride + t] * scale);
      for (int j = 0; j < R; ++j) acc[g][j] = _mm512_fmadd_ps(w, x[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < R; ++j) _mm512_storeu_ps(part + g * part_width + 16 * j, acc[g][j]);
}

// Whether int8_value_sums<D> exists: head sizes of 4 or 8 registers (64, 128).
template <int D>
constexpr bool kFusedValueSums = D == 64 || D == 128;

// value_sums over all `group` query heads, in chunks whose sums fit in registers.
template <int D>
inline void int8_value_sums(const float* p, int64_t p_stride, int64_t group, const int8_t* rows,
                            int64_t token_stride, int64_t n, float* part, int64_t part_width) {
  static_assert(kFusedValueSums<D>);
  by_head_chunks<256 / D>(group, [&](auto heads, int64_t g) {
    value_sums<D, decltype(heads)::value>(p + g * p_stride, p_stride, rows, token_stride, n,
                                          part + g * part_width, part_width);
  });
}
#endif

}  // namespace int8_kv
