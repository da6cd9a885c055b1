// Weight-streaming linear layers for decode batches: out = x @ W.T with W stored packed,
// int8 (w8a16, a scale per output channel or per group of its input columns) or fp16.
//
// A decode step reads every weight once, so its speed is how fast the weights stream in.
// Row-major weights read a few output channels at once make as many memory streams per
// thread, which the hardware prefetchers follow poorly; packed, a block of kBlock
// channels is one sequential stream: [out / kBlock][in / L][kBlock][L], L = kInt8Cols
// int8 or kHalfCols fp16 values, zero-padded to whole blocks (packed_weights.pack_rows).
// Packed, the w8a16 layers of the default model took 3.5 ms per token instead of 7.6 on a
// 2-core AMD EPYC (benchmarks/RESULTS.md).
//
// int8 weights multiply activations quantized per row to int16 (scale = amax / 32767):
// AVX-512 VNNI's vpdpwssd then accumulates 32 exact products per instruction in int32,
// half the instructions of widening the weights to fp32; the int16 rounding is 1/65534 of
// the row's largest value, far below the weights' own int8 rounding. W8A8's int8
// activations widened the same way give its exact int32 product (int8_packed_mm).
// Without AVX-512 (a Zen 3 EPYC, older Xeons) AVX2's vpmaddwd does the same on 16 pairs
// and F16C widens the fp16 weights; only CPUs without AVX2 take the scalar loops.
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace {

constexpr int64_t kBlock = 8;       // output channels per packed block
constexpr int64_t kInt8Cols = 32;   // int8 weights per channel per packed step
constexpr int64_t kHalfCols = 16;   // fp16 weights per channel per packed step
constexpr int64_t kBlockGrain = 2;  // blocks per parallel task

// x rows as int16 (vec_math.h's quantize_row), padded with zeros to `padded` columns.
void quantize_rows_int16(const float* x, int64_t rows, int64_t in, int64_t padded,
                         int16_t* q, float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    scale[r] = quantize_row(x + r * in, in, 32767.f, q + r * padded);
    std::fill(q + r * padded + in, q + (r + 1) * padded, int16_t{0});
  }
}

// Exact int32 sums of one int16 row with a block's int8 channels over packed steps
// [s0, s1): per channel, one vector of partial sums (lanes) with AVX-512 BW or AVX2
// (vpmaddwd on 32 or 16 pairs), one integer without.
#if defined(__AVX512BW__)
using Int32Lanes = __m512i;

inline void accumulate_steps(const int16_t* x, const int8_t* q, int64_t s0, int64_t s1,
                             Int32Lanes* acc) {
  for (int64_t c = 0; c < kBlock; ++c) acc[c] = _mm512_setzero_si512();
  for (int64_t s = s0; s < s1; ++s) {
    const __m512i xv = _mm512_loadu_si512(x + s * kInt8Cols);
    const int8_t* step = q + s * kBlock * kInt8Cols;
    for (int64_t c = 0; c < kBlock; ++c) {
      const __m512i w = _mm512_cvtepi8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + c * kInt8Cols)));
#if defined(__AVX512VNNI__)
      acc[c] = _mm512_dpwssd_epi32(acc[c], xv, w);
#else
      acc[c] = _mm512_add_epi32(acc[c], _mm512_madd_epi16(xv, w));
#endif
    }
  }
}
#elif defined(__AVX2__)
using Int32Lanes = __m256i;

inline __m256i widened(const int8_t* q) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
}

// Channels [c0, c0 + C) only: with C = 4 the sums, their fp32 totals and the row fit
// AVX2's 16 registers (all 8 channels' spilled: 110 against 86 us for a 3072x576 layer).
template <int64_t C = kBlock>
inline void accumulate_steps(const int16_t* x, const int8_t* q, int64_t s0, int64_t s1,
                             Int32Lanes* acc, int64_t c0 = 0) {
  for (int64_t c = 0; c < C; ++c) acc[c] = _mm256_setzero_si256();
  for (int64_t s = s0; s < s1; ++s) {
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + s * kInt8Cols));
    const __m256i x1 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + s * kInt8Cols + 16));
    const int8_t* step = q + (s * kBlock + c0) * kInt8Cols;
    for (int64_t c = 0; c < C; ++c) {
      const int8_t* w = step + c * kInt8Cols;
      acc[c] = _mm256_add_epi32(acc[c], _mm256_add_epi32(_mm256_madd_epi16(x0, widened(w)),
                                                         _mm256_madd_epi16(x1, widened(w + 16))));
    }
  }
}
#else
using Int32Lanes = int32_t;

inline void accumulate_steps(const int16_t* x, const int8_t* q, int64_t s0, int64_t s1,
                             Int32Lanes* acc) {
  for (int64_t c = 0; c < kBlock; ++c) {
    acc[c] = 0;
    for (int64_t s = s0; s < s1; ++s) {
      const int8_t* w = q + (s * kBlock + c) * kInt8Cols;
      for (int64_t l = 0; l < kInt8Cols; ++l)
        acc[c] += int32_t{x[s * kInt8Cols + l]} * int32_t{w[l]};
    }
  }
}
#endif

// One block's products with one int16 row: out[c] = xs * sum_g scale[c, g] * (x . q_c
// over group g), the group sums exact in int32.
void int8_block_dot(const int16_t* x, const int8_t* q, const float* scale, int64_t groups,
                    int64_t steps_per_group, float xs, float* out) {
  Int32Lanes acc[kBlock];
#if defined(__AVX512BW__)
  __m512 total[kBlock];
  for (auto& t : total) t = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    accumulate_steps(x, q, g * steps_per_group, (g + 1) * steps_per_group, acc);
    for (int64_t c = 0; c < kBlock; ++c)
      total[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c]),
                                 _mm512_set1_ps(scale[c * groups + g]), total[c]);
  }
  for (int64_t c = 0; c < kBlock; ++c) out[c] = _mm512_reduce_add_ps(total[c]) * xs;
#elif defined(__AVX2__)
  constexpr int64_t kHalf = kBlock / 2;
  for (int64_t c0 = 0; c0 < kBlock; c0 += kHalf) {
    __m256 total[kHalf];
    for (auto& t : total) t = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      accumulate_steps<kHalf>(x, q, g * steps_per_group, (g + 1) * steps_per_group, acc, c0);
      for (int64_t c = 0; c < kHalf; ++c)
        total[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[c]),
                                   _mm256_set1_ps(scale[(c0 + c) * groups + g]), total[c]);
    }
    for (int64_t c = 0; c < kHalf; ++c) out[c0 + c] = sum8(total[c]) * xs;
  }
#else
  float total[kBlock] = {};
  for (int64_t g = 0; g < groups; ++g) {
    accumulate_steps(x, q, g * steps_per_group, (g + 1) * steps_per_group, acc);
    for (int64_t c = 0; c < kBlock; ++c)
      total[c] += static_cast<float>(acc[c]) * scale[c * groups + g];
  }
  for (int64_t c = 0; c < kBlock; ++c) out[c] = total[c] * xs;
#endif
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// One block's exact int32 products with one row: what torch._int_mm gives for them.
void int8_block_mm(const int16_t* x, const int8_t* q, int64_t steps, int32_t* out) {
  Int32Lanes acc[kBlock];
  accumulate_steps(x, q, 0, steps, acc);
  for (int64_t c = 0; c < kBlock; ++c) {
#if defined(__AVX512BW__)
    out[c] = _mm512_reduce_add_epi32(acc[c]);
#elif defined(__AVX2__)
    out[c] = sum8(acc[c]);
#else
    out[c] = acc[c];
#endif
  }
}
#endif

// One block's products with one fp32 row, fp16 weights widened in registers.
void half_block_dot(const float* x, const at::Half* w, int64_t steps, float* out) {
#if defined(__AVX512F__)
  __m512 acc[kBlock];
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const __m512 xv = _mm512_loadu_ps(x + s * kHalfCols);
    const at::Half* step = w + s * kBlock * kHalfCols;
    for (int64_t c = 0; c < kBlock; ++c)
      acc[c] = _mm512_fmadd_ps(xv, _mm512_cvtph_ps(_mm256_loadu_si256(
                                       reinterpret_cast<const __m256i*>(step + c * kHalfCols))),
                               acc[c]);
  }
  for (int64_t c = 0; c < kBlock; ++c) out[c] = _mm512_reduce_add_ps(acc[c]);
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  __m256 acc[kBlock];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const __m256 x0 = _mm256_loadu_ps(x + s * kHalfCols), x1 = _mm256_loadu_ps(x + s * kHalfCols + 8);
    const at::Half* step = w + s * kBlock * kHalfCols;
    for (int64_t c = 0; c < kBlock; ++c) {
      const __m128i* h = reinterpret_cast<const __m128i*>(step + c * kHalfCols);
      acc[c] = _mm256_fmadd_ps(x0, _mm256_cvtph_ps(_mm_loadu_si128(h)), acc[c]);
      acc[c] = _mm256_fmadd_ps(x1, _mm256_cvtph_ps(_mm_loadu_si128(h + 1)), acc[c]);
    }
  }
  for (int64_t c = 0; c < kBlock; ++c) out[c] = sum8(acc[c]);
#else
  for (int64_t c = 0; c < kBlock; ++c) {
    float acc = 0.f;
    for (int64_t s = 0; s < steps; ++s)
      for (int64_t l = 0; l < kHalfCols; ++l)
        acc += x[s * kHalfCols + l] * static_cast<float>(w[(s * kBlock + c) * kHalfCols + l]);
    out[c] = acc;
  }
#endif
}

// A weight packed by packed_weights.pack_rows (`cols` values per step) for rows of
// `in` values and `out` output channels.
void check_packed(const at::Tensor& packed, int64_t cols, int64_t in, int64_t out,
                  const char* name) {
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kBlock &&
                  packed.size(3) == cols && packed.size(1) * cols >= in &&
                  packed.size(0) * kBlock >= out,
              name, ": the weight must be packed by packed_weights.pack_rows for this "
              "input width and output count");
}

// fp32 rows [..., in] and an optional fp32 bias [out].
void check_input(const at::Tensor& x, int64_t out, const c10::optional<at::Tensor>& bias,
                const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous(), name,
              ": x must be contiguous float32 [..., in]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                    bias->is_contiguous() && bias->numel() == out),
              name, ": bias must be contiguous float32 [out_features]");
}

// [rows, out_ch] from each row's products block by block, through a block-sized scratch
// (the last block may be padding past `out_ch`), plus the bias where one is given.
template <typename Out, typename BlockDot>
void for_blocks(int64_t rows, int64_t blocks, int64_t out_ch, Out* op, const Out* bias,
                BlockDot dot) {
  at::parallel_for(0, blocks, kBlockGrain, [&](int64_t begin, int64_t end) {
    Out part[kBlock];
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = 0; r < rows; ++r) {
        dot(b, r, part);
        const int64_t c0 = b * kBlock, n = std::min(kBlock, out_ch - c0);
        for (int64_t c = 0; c < n; ++c)
          op[r * out_ch + c0 + c] = bias != nullptr ? part[c] + bias[c0 + c] : part[c];
      }
  });
}

// x [..., in] -> float [..., out_ch]
template <typename BlockDot>
at::Tensor float_out(const at::Tensor& x, int64_t blocks, int64_t out_ch,
                     const c10::optional<at::Tensor>& bias, BlockDot dot) {
  auto sizes = x.sizes().vec();
  sizes.back() = out_ch;
  auto out = at::empty(sizes, x.options());
  for_blocks<float>(x.numel() / x.size(-1), blocks, out_ch, out.data_ptr<float>(),
                    bias.has_value() ? bias->data_ptr<float>() : nullptr, dot);
  return out;
}

at::Tensor int8_weight_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                              int64_t out_ch) {
  TORCH_CHECK(packed.scalar_type() == at::kChar, "int8_weight_linear: int8 weight expected");
  check_input(x, out_ch, bias, "int8_weight_linear");
  check_packed(packed, kInt8Cols, x.size(-1), out_ch, "int8_weight_linear");
  const int64_t in = x.size(-1), rows = x.numel() / in, blocks = packed.size(0);
  const int64_t padded = packed.size(1) * kInt8Cols;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 &&
                  scale.size(0) == blocks * kBlock && packed.size(1) % scale.size(1) == 0,
              "int8_weight_linear: scale must be contiguous float32 [padded out, groups], "
              "each group a whole number of packed steps");
  const int64_t groups = scale.size(1), steps_per_group = packed.size(1) / groups;
  auto xq = at::empty({rows, padded}, x.options().dtype(at::kShort));
  auto xs = at::empty({rows}, x.options());
  quantize_rows_int16(x.data_ptr<float>(), rows, in, padded, xq.data_ptr<int16_t>(),
                      xs.data_ptr<float>());
  const int16_t* xp = xq.data_ptr<int16_t>();
  const float* xsp = xs.data_ptr<float>();
  const int8_t* qp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  return float_out(x, blocks, out_ch, bias, [&](int64_t b, int64_t r, float* part) {
    int8_block_dot(xp + r * padded, qp + b * kBlock * padded, sp + b * kBlock * groups, groups,
                   steps_per_group, xsp[r], part);
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// W8A8 with VNNI's vpdpbusd (unsigned by signed bytes, 64 products per instruction, no
// widening): each activation is biased to unsigned x + 128, and 128 * (the channel's
// weight sum) is taken off again, so the int32 sums stay exact. One 512-bit register
// holds a pair of channels' 32 weights of a step, met by the row's 32 biased
// activations in both halves; kRowTile rows share each weight load.
constexpr int64_t kRowTile = 4;
constexpr int64_t kPairs = kBlock / 2;

inline __m512i biased_twice(const int8_t* x) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_broadcast_i64x4(_mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))));
}

// The two channels of a pair register: lanes 0-7 and 8-15 summed.
inline void pair_sums(__m512i v, int32_t* out) {
  out[0] = sum8(_mm512_castsi512_si256(v));
  out[1] = sum8(_mm512_extracti64x4_epi64(v, 1));
}

// 128 * each channel's weight sum over the block's steps (the bias to take off).
void block_bias(const int8_t* q, int64_t steps, int32_t* bias) {
  __m512i acc[kPairs];
  for (auto& a : acc) a = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t s = 0; s < steps; ++s)
    for (int64_t p = 0; p < kPairs; ++p)
      acc[p] = _mm512_dpbusd_epi32(acc[p], ones, _mm512_loadu_si512(q + (s * kPairs + p) * 64));
  for (int64_t p = 0; p < kPairs; ++p) pair_sums(acc[p], bias + 2 * p);
  for (int64_t c = 0; c < kBlock; ++c) bias[c] *= 128;
}

// R rows (x, `stride` bytes apart) times one block: out[r][c], exact.
template <int R>
void block_rows_mm(const int8_t* x, int64_t stride, const int8_t* q, int64_t steps,
                   const int32_t* bias, int32_t (*out)[kBlock]) {
  __m512i acc[R][kPairs];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_si512();
  for (int64_t s = 0; s < steps; ++s) {
    __m512i xv[R];
    for (int r = 0; r < R; ++r) xv[r] = biased_twice(x + r * stride + s * kInt8Cols);
    for (int64_t p = 0; p < kPairs; ++p) {
      const __m512i w = _mm512_loadu_si512(q + (s * kPairs + p) * 64);
      for (int r = 0; r < R; ++r) acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], xv[r], w);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t p = 0; p < kPairs; ++p) pair_sums(acc[r][p], out[r] + 2 * p);
    for (int64_t c = 0; c < kBlock; ++c) out[r][c] -= bias[c];
  }
}

void packed_mm_rows(const int8_t* x, int64_t rows, int64_t padded, const int8_t* q,
                    int64_t blocks, int64_t out_ch, int32_t* op) {
  const int64_t steps = padded / kInt8Cols;
  at::parallel_for(0, blocks, kBlockGrain, [&](int64_t begin, int64_t end) {
    int32_t bias[kBlock], part[kRowTile][kBlock];
    for (int64_t b = begin; b < end; ++b) {
      const int8_t* qb = q + b * kBlock * padded;
      block_bias(qb, steps, bias);
      const int64_t c0 = b * kBlock, n = std::min(kBlock, out_ch - c0);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int8_t* xr = x + r0 * padded;
        const int64_t m = std::min(kRowTile, rows - r0);
        switch (m) {
          case 1: block_rows_mm<1>(xr, padded, qb, steps, bias, part); break;
          case 2: block_rows_mm<2>(xr, padded, qb, steps, bias, part); break;
          case 3: block_rows_mm<3>(xr, padded, qb, steps, bias, part); break;
          default: block_rows_mm<4>(xr, padded, qb, steps, bias, part);
        }
        for (int64_t r = 0; r < m; ++r)
          std::copy(part[r], part[r] + n, op + (r0 + r) * out_ch + c0);
      }
    }
  });
}
#endif

// W8A8's int32 product on the packed weight: qx int8 [rows, in] (per-token quantized)
// times the int8 weight, exact, equal to torch._int_mm(qx, q.T); at decode batches it
// streams the weight faster than _int_mm.
at::Tensor int8_packed_mm(const at::Tensor& qx, const at::Tensor& packed, int64_t out_ch) {
  TORCH_CHECK(qx.scalar_type() == at::kChar && qx.dim() == 2 && qx.is_contiguous(),
              "int8_packed_mm: qx must be contiguous int8 [rows, in]");
  TORCH_CHECK(packed.scalar_type() == at::kChar, "int8_packed_mm: int8 weight expected");
  check_packed(packed, kInt8Cols, qx.size(1), out_ch, "int8_packed_mm");
  const int64_t rows = qx.size(0), in = qx.size(1), padded = packed.size(1) * kInt8Cols;
  auto out = at::empty({rows, out_ch}, qx.options().dtype(at::kInt));
  const int8_t* qp = packed.data_ptr<int8_t>();
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  auto x8 = (in == padded ? qx : at::constant_pad_nd(qx, {0, padded - in})).contiguous();
  packed_mm_rows(x8.data_ptr<int8_t>(), rows, padded, qp, packed.size(0), out_ch,
                 out.data_ptr<int32_t>());
#else
  auto x16 = at::constant_pad_nd(qx.to(at::kShort), {0, padded - in}).contiguous();
  const int16_t* xp = x16.data_ptr<int16_t>();
  for_blocks<int32_t>(rows, packed.size(0), out_ch, out.data_ptr<int32_t>(), nullptr,
                      [&](int64_t b, int64_t r, int32_t* part) {
                        int8_block_mm(xp + r * padded, qp + b * kBlock * padded,
                                      packed.size(1), part);
                      });
#endif
  return out;
}

at::Tensor half_weight_linear(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, int64_t out_ch) {
  TORCH_CHECK(packed.scalar_type() == at::kHalf, "half_weight_linear: fp16 weight expected");
  check_input(x, out_ch, bias, "half_weight_linear");
  check_packed(packed, kHalfCols, x.size(-1), out_ch, "half_weight_linear");
  const int64_t in = x.size(-1), blocks = packed.size(0);
  const int64_t padded = packed.size(1) * kHalfCols;
  at::Tensor xpad = (in == padded ? x : at::constant_pad_nd(x, {0, padded - in}))
                        .reshape({-1, padded});
  const float* xp = xpad.data_ptr<float>();
  const at::Half* wp = packed.data_ptr<at::Half>();
  return float_out(x, blocks, out_ch, bias, [&](int64_t b, int64_t r, float* part) {
    half_block_dot(xp + r * padded, wp + b * kBlock * padded, packed.size(1), part);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("int8_weight_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, "
        "int out_features) -> Tensor");
  m.def("half_weight_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_packed_mm(Tensor qx, Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("int8_weight_linear", &int8_weight_linear);
  m.impl("half_weight_linear", &half_weight_linear);
  m.impl("int8_packed_mm", &int8_packed_mm);
}
