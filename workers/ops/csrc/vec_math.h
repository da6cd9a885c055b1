// Vector math shared by the CPU kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#if defined(__AVX2__)
// The sum of a register's eight int32 lanes.
inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// The sum of a register's eight fp32 lanes.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// An int8 row as kvcache/kv_quant.py writes it (the int8 KV cache's rows, the block
// summaries' scoring vectors): n int8 values, then the row's fp16 scale (2 bytes).
inline float row_scale(const int8_t* row, int64_t n) {
  c10::Half scale;
  std::memcpy(&scale, row + n, sizeof(scale));
  return static_cast<float>(scale);
}

// Such a row's n values as fp32: value * scale.
inline void widen(const int8_t* src, float* dst, int64_t n) {
  const float scale = row_scale(src, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

// n stored fp16 or bf16 values as fp32, with vector conversions (F16C / AVX-512 for
// fp16, shifts for bf16) rather than element by element through c10::Half. The stored
// types are read as raw bits.
inline void widen(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

// a . b over n floats, with four independent sums: one running sum would make every
// step wait for the last one's add (a 24-step chain for a 192-wide scoring row).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k)
      acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * k), _mm256_loadu_ps(b + i + 8 * k),
                               acc[k]);
  for (; i + 8 <= n; i += 8)
    acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[0]);
  s = sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// exp(x) as exp_ps computes it, for 8 (AVX2) or 16 (AVX-512) floats: 2^n * e^f with
// |f| <= ln2/2 and a degree-7 Taylor polynomial for e^f (relative error below 1e-8 before
// rounding); x is clamped to [kExpMin, kExpMax], where float's exp neither underflows to
// denormals nor overflows. ln2 is split in two (kLn2Hi + kLn2Lo) so f loses no bits.
constexpr float kExpMin = -87.0f, kExpMax = 88.0f, kLog2e = 1.44269504f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f,
                              1.f, 1.f};   // highest power first

#if defined(__AVX2__) && defined(__FMA__)
// 2^n is built in the exponent bits (n + 127) << 23, a normal float for x in range.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  f = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), f);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpPoly[i]));
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// Lane t of the result is the sum of v[t]'s 8 lanes (an 8x8 transpose folded into adds).
inline __m256 transpose_sum8(const __m256* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  // b0: v0..v3's sums over lanes 0-3 in its low half, over lanes 4-7 in its high half.
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                       _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

#if defined(__AVX512F__)
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), f);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_scalef_ps(p, n);
}
#endif

// The largest of m and x[0:n] (exact: the order of max operations does not matter).
inline float max_of(const float* x, int64_t n, float m) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(vm);
#elif defined(__AVX2__)
  __m256 vm = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  m = _mm_cvtss_f32(h);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[0:n] = exp(x[0:n] - m) in place; returns the sum of the new values (a softmax's
// numerators and their total, m the row's max).
inline float exp_shift(float* x, int64_t n, float m) {
  float total = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vtotal = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
    _mm512_storeu_ps(x + i, e);
    vtotal = _mm512_add_ps(vtotal, e);
  }
  total = _mm512_reduce_add_ps(vtotal);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vtotal = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    vtotal = _mm256_add_ps(vtotal, e);
  }
  total = sum8(vtotal);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    total += x[i];
  }
  return total;
}

#if defined(__AVX512F__)
// Lane t of the result is the sum of v[t]'s 16 lanes: a 16x16 transpose folded into the
// additions (45 instructions for 16 sums, against 128 for 16 separate reductions). The
// shuffles only move lanes, so `add` decides the lanes' type: fp32 or int32 (bits
// carried in __m512).
template <typename Add>
inline __m512 transpose_sum16(const __m512* v, Add add) {
  __m512 w[8], r[4], u[2];
  for (int i = 0; i < 8; ++i)
    w[i] = add(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
               _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    r[i] = add(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
               _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    u[i] = add(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
               _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return add(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// In place: r[c] lane t = r[t] lane c, for 16 registers of 16 dwords. Inlined: a call
// passes the 16 registers through memory (7% of a hot call's time).
[[gnu::always_inline]] inline void transpose16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + k], 128-bit lane L: dword 4L + k of rows 4i..4i+3.
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {   // a 4x4 transpose of 128-bit lanes
    const __m512i ab_lo = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x44);
    const __m512i ab_hi = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xEE);
    r[k] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    r[4 + k] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
    r[8 + k] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
  }
}

// r[c] lane t = bytes 4c..4c+3 of the 64 at rows + t * stride, for the n <= 16 rows (lanes
// of rows t >= n are 0): one instruction then works on a 4-byte piece of all 16 rows.
[[gnu::always_inline]] inline void load_transposed16(const int8_t* rows, int64_t stride,
                                                     int64_t n, __m512i r[16]) {
  for (int64_t t = 0; t < 16; ++t)
    r[t] = t < n ? _mm512_loadu_si512(rows + t * stride) : _mm512_setzero_si512();
  transpose16_epi32(r);
}

inline __m512 add_ps(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 add_epi32(__m512 a, __m512 b) {
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}
#endif

// W8A8's rescale of one row of its int32 product: out[c] = float(acc[c] - z * ws[c]) *
// rs * cs[c], then + bias[c] when bias is set, in a second loop over the row (still in
// cache) so the product is rounded before the add, as the torch ops round it (no FMA).
// z is the row's zero point and ws[c] channel c's weight sum (quant_linear.w8a8_linear):
// the correction is exact integer arithmetic.
inline void rescale_row(const int32_t* acc, int32_t z, const int32_t* ws, float rs,
                        const float* cs, const float* bias, int64_t n, float* out) {
#pragma omp simd
  for (int64_t c = 0; c < n; ++c) out[c] = static_cast<float>(acc[c] - z * ws[c]) * rs * cs[c];
  if (bias != nullptr) {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) out[c] += bias[c];
  }
}

// out = silu(gate) * up over one row of `width` values: the gated MLP's activation.
inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t width) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= width; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(
                                                                _mm512_setzero_ps(), g))));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_loadu_ps(up + i)));
  }
#endif
  for (; i < width; ++i) out[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// One row's symmetric quantization to integers of magnitude at most `qmax`: scale =
// amax / qmax (1 for an all-zero row), q = round-half-even(x / scale), clamped; returns
// the scale. The w8a16 kernel's int16 activation rows, and the int16 query rows of the
// int8-KV decode attention.
template <typename Q>
inline float quantize_row(const float* xr, int64_t cols, float qmax, Q* qr) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t k = 0; k < cols; ++k) amax = std::max(amax, std::fabs(xr[k]));
  const float s = amax > 0.f ? amax / qmax : 1.f;
  for (int64_t k = 0; k < cols; ++k) {
    const float v = std::nearbyint(xr[k] / s);
    qr[k] = static_cast<Q>(std::min(qmax, std::max(-qmax, v)));
  }
  return s;
}

// W8A8's per-token int8 of one row, asymmetric, as quant_linear.quantize_activations
// defines it: the range [min(x, 0), max(x, 0)] in 255 steps of s (1 for an all-zero
// row), the zero point z = -128 - round(lo / s), q = round-half-even(x / s) + z clamped
// to int8; returns s and writes z.
inline float quantize_row_asymmetric(const float* xr, int64_t cols, int8_t* qr, int32_t* z) {
  float lo = 0.f, hi = 0.f;
#pragma omp simd reduction(min : lo) reduction(max : hi)
  for (int64_t k = 0; k < cols; ++k) {
    lo = std::min(lo, xr[k]);
    hi = std::max(hi, xr[k]);
  }
  const float s = hi > lo ? (hi - lo) / 255.f : 1.f;
  const float zero = -128.f - std::nearbyint(lo / s);
  for (int64_t k = 0; k < cols; ++k) {
    const float v = std::nearbyint(xr[k] / s) + zero;
    qr[k] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
  }
  *z = static_cast<int32_t>(zero);
  return s;
}
