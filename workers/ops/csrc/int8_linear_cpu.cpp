// Weight-only int8 linear layer for small batches (decode): out = (x @ q.T) * scale,
// the scale per output channel or per group of input columns of it.
// Decode reads every weight once per token, so its speed is the weight bytes; an int8
// weight is a quarter of fp32's. Each output channel's int8 row is read once and
// widened to fp32 in registers for every activation row, never stored as fp32.
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
#include <tuple>

namespace {

constexpr int64_t kChannelGrain = 16;  // output channels per parallel task
constexpr int64_t kMaxRows = 16;       // activation rows one pass serves
constexpr int64_t kRowGrain = 16;      // activation rows per parallel quantization task

constexpr int64_t kLanes = 16;          // floats in one vector register (AVX-512)

// sum_g scale[g] * (x . q over group g): one channel's product, one sum per group.
inline float dot_groups(const float* x, const int8_t* q, const float* scale, int64_t groups,
                        int64_t group) {
  float total = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * group;
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = k0; k < k0 + group; ++k) acc += x[k] * static_cast<float>(q[k]);
    total += acc * scale[g];
  }
  return total;
}

// The same for groups a multiple of kLanes wide, kept in kLanes running sums (one
// register) and added up once at the end: a horizontal sum per group would cost more
// than the group's multiply-adds (a 64-wide group is four).
inline float dot_groups_in_lanes(const float* x, const int8_t* q, const float* scale,
                                 int64_t groups, int64_t group) {
  float total[kLanes] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float part[kLanes] = {};
    for (int64_t k = g * group; k < (g + 1) * group; k += kLanes)
#pragma omp simd
      for (int64_t l = 0; l < kLanes; ++l) part[l] += x[k + l] * static_cast<float>(q[k + l]);
    const float s = scale[g];
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) total[l] += part[l] * s;
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += total[l];
  return sum;
}

#if defined(__AVX512F__)
// Four output channels' products (rows q, q + in, ...) at once, for groups a multiple of
// 16 wide: each x vector feeds four independent multiply-add chains, so neither the
// load of x nor one chain's latency sets the pace.
inline void dot4_groups_avx512(const float* x, const int8_t* q, int64_t in, const float* scale,
                               int64_t groups, int64_t group, float* out, int64_t out_stride) {
  __m512 total[4];
  for (int c = 0; c < 4; ++c) total[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[4];
    for (int c = 0; c < 4; ++c) part[c] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += kLanes) {
      const __m512 xv = _mm512_loadu_ps(x + k);
      for (int c = 0; c < 4; ++c) {
        const __m128i qi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * in + k));
        part[c] = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qi)), part[c]);
      }
    }
    for (int c = 0; c < 4; ++c)
      total[c] = _mm512_fmadd_ps(part[c], _mm512_set1_ps(scale[c * groups + g]), total[c]);
  }
  for (int c = 0; c < 4; ++c) out[c * out_stride] = _mm512_reduce_add_ps(total[c]);
}
#endif

at::Tensor int8_weight_linear(const at::Tensor& x, const at::Tensor& qweight,
                              const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "int8_weight_linear: x must be contiguous float32 [rows, in]");
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2 &&
                  qweight.is_contiguous() && qweight.size(1) == x.size(1),
              "int8_weight_linear: qweight must be contiguous int8 [out, in]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.size(0) == qweight.size(0) && scale.dim() <= 2,
              "int8_weight_linear: scale must be contiguous float32 [out] or [out, groups]");
  TORCH_CHECK(x.size(0) <= kMaxRows, "int8_weight_linear: at most 16 rows");
  const int64_t rows = x.size(0), in = x.size(1), out_ch = qweight.size(0);
  // One scale per output channel, or per group of `group` input columns of it.
  const int64_t groups = scale.dim() == 2 ? scale.size(1) : 1;
  TORCH_CHECK(in % groups == 0, "int8_weight_linear: groups must divide the input width");
  const int64_t group = in / groups;
  auto out = at::empty({rows, out_ch}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, out_ch, kChannelGrain, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
#if defined(__AVX512F__)
    if (group % kLanes == 0)
      for (; n + 4 <= end; n += 4)
        for (int64_t r = 0; r < rows; ++r)
          dot4_groups_avx512(xp + r * in, qp + n * in, in, sp + n * groups, groups, group,
                             op + r * out_ch + n, 1);
#endif
    for (; n < end; ++n) {
      const int8_t* qrow = qp + n * in;
      const float* srow = sp + n * groups;
      for (int64_t r = 0; r < rows; ++r)
        op[r * out_ch + n] = group % kLanes == 0
            ? dot_groups_in_lanes(xp + r * in, qrow, srow, groups, group)
            : dot_groups(xp + r * in, qrow, srow, groups, group);
    }
  });
  return out;
}

// W8A8's per-token activation quantization in one pass per row: scale = amax / 127
// (1 for an all-zero row), q = round-half-even(x / scale), as quant_linear.quantize_rows
// computes it with five torch ops (each its own pass and, past a size, its own
// parallel region).
std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "quantize_rows_int8: x must be contiguous float32 [rows, cols]");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto q = at::empty({rows, cols}, x.options().dtype(at::kChar));
  auto scale = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * cols;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t k = 0; k < cols; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      sp[r] = s;
      int8_t* qr = qp + r * cols;
      for (int64_t k = 0; k < cols; ++k) {
        const float v = std::nearbyint(xr[k] / s);
        qr[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      }
    }
  });
  return {q, scale};
}

// W8A8's epilogue in one pass: out = float(acc) * row_scale[r] * col_scale[c] (+ bias[c]),
// in that order, as quant_linear.w8a8_linear computes it with three or four torch ops
// (a conversion, two scalings and the bias, each its own pass over the output).
at::Tensor dequantize_int32(const at::Tensor& acc, const at::Tensor& row_scale,
                            const at::Tensor& col_scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous(),
              "dequantize_int32: acc must be contiguous int32 [rows, cols]");
  const int64_t rows = acc.size(0), cols = acc.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() &&
                  row_scale.numel() == rows,
              "dequantize_int32: row_scale must be contiguous float32 [rows]");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() &&
                  col_scale.numel() == cols,
              "dequantize_int32: col_scale must be contiguous float32 [cols]");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == cols,
                "dequantize_int32: bias must be contiguous float32 [cols]");
    bp = bias->data_ptr<float>();
  }
  auto out = at::empty({rows, cols}, acc.options().dtype(at::kFloat));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* rp = row_scale.data_ptr<float>();
  const float* cp = col_scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* ar = ap + r * cols;
      float* orow = op + r * cols;
      const float rs = rp[r];
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) orow[c] = static_cast<float>(ar[c]) * rs * cp[c];
      if (bp != nullptr) {  // a second loop over the row, still in cache: the product is
#pragma omp simd        // rounded before the add, as the torch ops round it (no FMA)
        for (int64_t c = 0; c < cols; ++c) orow[c] += bp[c];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("int8_weight_linear(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
  m.def("quantize_rows_int8(Tensor x) -> (Tensor, Tensor)");
  m.def("dequantize_int32(Tensor acc, Tensor row_scale, Tensor col_scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("int8_weight_linear", &int8_weight_linear);
  m.impl("quantize_rows_int8", &quantize_rows_int8);
  m.impl("dequantize_int32", &dequantize_int32);
}
