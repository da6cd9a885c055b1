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
// the row's largest value, far below the weights' own int8 rounding.
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 8;       // output channels per packed block
constexpr int64_t kInt8Cols = 32;   // int8 weights per channel per packed step
constexpr int64_t kHalfCols = 16;   // fp16 weights per channel per packed step
constexpr int64_t kBlockGrain = 2;  // blocks per parallel task

// x rows as int16, scale = amax / 32767 per row (1 for an all-zero row), padded with
// zeros to `padded` columns.
void quantize_rows_int16(const float* x, int64_t rows, int64_t in, int64_t padded,
                         int16_t* q, float* scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * in;
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t k = 0; k < in; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float s = amax > 0.f ? amax / 32767.f : 1.f;
    scale[r] = s;
    int16_t* qr = q + r * padded;
    for (int64_t k = 0; k < in; ++k) qr[k] = static_cast<int16_t>(std::nearbyint(xr[k] / s));
    std::fill(qr + in, qr + padded, int16_t{0});
  }
}

// One block's products with one int16 row: out[c] = xs * sum_g scale[c, g] * (x . q_c
// over group g), the group sums exact in int32.
void int8_block_dot(const int16_t* x, const int8_t* q, const float* scale, int64_t groups,
                    int64_t steps_per_group, float xs, float* out) {
#if defined(__AVX512BW__)
  __m512 total[kBlock];
  for (auto& t : total) t = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[kBlock];
    for (auto& a : acc) a = _mm512_setzero_si512();
    for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
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
    for (int64_t c = 0; c < kBlock; ++c)
      total[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[c]),
                                 _mm512_set1_ps(scale[c * groups + g]), total[c]);
  }
  for (int64_t c = 0; c < kBlock; ++c) out[c] = _mm512_reduce_add_ps(total[c]) * xs;
#else
  for (int64_t c = 0; c < kBlock; ++c) {
    float total = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t acc = 0;
      for (int64_t s = g * steps_per_group; s < (g + 1) * steps_per_group; ++s) {
        const int8_t* w = q + (s * kBlock + c) * kInt8Cols;
        const int16_t* xv = x + s * kInt8Cols;
        for (int64_t l = 0; l < kInt8Cols; ++l) acc += int32_t{xv[l]} * int32_t{w[l]};
      }
      total += static_cast<float>(acc) * scale[c * groups + g];
    }
    out[c] = total * xs;
  }
#endif
}

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

void check_packed(const at::Tensor& x, const at::Tensor& packed, int64_t cols, int64_t out,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous(),
              "packed linear: x must be contiguous float32 [..., in]");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kBlock &&
                  packed.size(3) == cols && packed.size(1) * cols >= x.size(-1) &&
                  packed.size(0) * kBlock >= out,
              "packed linear: the weight must be packed by packed_weights.pack_rows for this "
              "input width and output count");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat &&
                                    bias->is_contiguous() && bias->numel() == out),
              "packed linear: bias must be contiguous float32 [out_features]");
}

// x [..., in] -> [..., out_ch]: each row's outputs block by block, through a block-sized
// scratch (the last block may be padding past `out_ch`), plus the bias.
template <typename BlockDot>
at::Tensor for_blocks(const at::Tensor& x, int64_t blocks, int64_t out_ch,
                      const c10::optional<at::Tensor>& bias, BlockDot dot) {
  auto sizes = x.sizes().vec();
  sizes.back() = out_ch;
  auto out = at::empty(sizes, x.options());
  const int64_t rows = x.numel() / x.size(-1);
  float* op = out.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::parallel_for(0, blocks, kBlockGrain, [&](int64_t begin, int64_t end) {
    float part[kBlock];
    for (int64_t b = begin; b < end; ++b)
      for (int64_t r = 0; r < rows; ++r) {
        dot(b, r, part);
        const int64_t c0 = b * kBlock, n = std::min(kBlock, out_ch - c0);
        for (int64_t c = 0; c < n; ++c)
          op[r * out_ch + c0 + c] = bp != nullptr ? part[c] + bp[c0 + c] : part[c];
      }
  });
  return out;
}

at::Tensor int8_weight_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                              int64_t out_ch) {
  TORCH_CHECK(packed.scalar_type() == at::kChar, "int8_weight_linear: int8 weight expected");
  check_packed(x, packed, kInt8Cols, out_ch, bias);
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
  return for_blocks(x, blocks, out_ch, bias, [&](int64_t b, int64_t r, float* part) {
    int8_block_dot(xp + r * padded, qp + b * kBlock * padded, sp + b * kBlock * groups, groups,
                   steps_per_group, xsp[r], part);
  });
}

at::Tensor half_weight_linear(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias, int64_t out_ch) {
  TORCH_CHECK(packed.scalar_type() == at::kHalf, "half_weight_linear: fp16 weight expected");
  check_packed(x, packed, kHalfCols, out_ch, bias);
  const int64_t in = x.size(-1), blocks = packed.size(0);
  const int64_t padded = packed.size(1) * kHalfCols;
  at::Tensor xpad = (in == padded ? x : at::constant_pad_nd(x, {0, padded - in}))
                        .reshape({-1, padded});
  const float* xp = xpad.data_ptr<float>();
  const at::Half* wp = packed.data_ptr<at::Half>();
  return for_blocks(x, blocks, out_ch, bias, [&](int64_t b, int64_t r, float* part) {
    half_block_dot(xp + r * padded, wp + b * kBlock * padded, packed.size(1), part);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("int8_weight_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, "
        "int out_features) -> Tensor");
  m.def("half_weight_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("int8_weight_linear", &int8_weight_linear);
  m.impl("half_weight_linear", &half_weight_linear);
}
