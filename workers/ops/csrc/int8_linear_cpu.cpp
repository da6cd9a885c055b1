// W8A8's passes around the int8 matrix product (torch._int_mm): per-token int8
// quantization of the activations, the int32 product's rescale to fp32, and the gated
// MLP's activation between its two products.
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "vec_math.h"
#include "w8a8_operands.h"

namespace {

constexpr int64_t kRowGrain = 16;  // activation rows per parallel task

// The row's scales and zero points and the columns' scales and weight sums that rescale
// an int32 product acc [rows, cols] (vec_math.h's rescale_row).
struct Rescale {
  const float* row_scale;
  const int32_t* row_zero;
  const float* col_scale;
  const int32_t* col_sums;
};

Rescale check_rescale(const at::Tensor& acc, const at::Tensor& row_scale,
                      const at::Tensor& row_zero, const at::Tensor& col_scale,
                      const at::Tensor& col_sums, const char* name) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous(), name,
              ": acc must be contiguous int32 [rows, cols]");
  check_scales(row_scale, "row_scale", row_zero, "row_zero", acc.size(0), name);
  check_scales(col_scale, "col_scale", col_sums, "col_sums", acc.size(1), name);
  return {row_scale.data_ptr<float>(), row_zero.data_ptr<int32_t>(),
          col_scale.data_ptr<float>(), col_sums.data_ptr<int32_t>()};
}

// W8A8's per-token activation quantization in one pass per row, as
// quant_linear.quantize_activations computes it with a dozen torch ops (each its own
// pass and, past a size, its own parallel region).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "quantize_rows_int8: x must be contiguous float32 [rows, cols]");
  const int64_t rows = x.size(0), cols = x.size(1);
  auto q = at::empty({rows, cols}, x.options().dtype(at::kChar));
  auto scale = at::empty({rows}, x.options());
  auto zero = at::empty({rows}, x.options().dtype(at::kInt));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  int32_t* zp = zero.data_ptr<int32_t>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      sp[r] = quantize_row_asymmetric(xp + r * cols, cols, qp + r * cols, zp + r);
  });
  return {q, scale, zero};
}

// W8A8's gated MLP between its two products, one pass per row: the gate/up product
// rescaled, silu(gate) * up, and that quantized per token for down_proj. Bit for bit
// what dequantize_int32, silu_and_mul and quantize_rows_int8 give one after the other,
// without writing the [rows, 2I] fp32 product or the [rows, I] activation.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dequantize_silu_mul_quantize(
    const at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& row_zero,
    const at::Tensor& col_scale, const at::Tensor& col_sums) {
  const Rescale by = check_rescale(acc, row_scale, row_zero, col_scale, col_sums,
                                   "dequantize_silu_mul_quantize");
  TORCH_CHECK(acc.size(1) % 2 == 0, "dequantize_silu_mul_quantize: acc must be [rows, 2 * I]");
  const int64_t rows = acc.size(0), width = acc.size(1) / 2;
  auto q = at::empty({rows, width}, acc.options().dtype(at::kChar));
  auto scale = at::empty({rows}, acc.options().dtype(at::kFloat));
  auto zero = at::empty({rows}, acc.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  int32_t* zp = zero.data_ptr<int32_t>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> product(2 * width), act(width);
    for (int64_t r = begin; r < end; ++r) {
      rescale_row(ap + r * 2 * width, by.row_zero[r], by.col_sums, by.row_scale[r],
                  by.col_scale, nullptr, 2 * width, product.data());
      silu_mul_row(product.data(), product.data() + width, act.data(), width);
      sp[r] = quantize_row_asymmetric(act.data(), width, qp + r * width, zp + r);
    }
  });
  return {q, scale, zero};
}

// W8A8's epilogue in one pass: out = float(acc - row_zero[r] * col_sums[c]) * row_scale[r]
// * col_scale[c] (+ bias[c]), in that order, as quant_linear.w8a8_linear computes it with
// a handful of torch ops (each its own pass over the output).
at::Tensor dequantize_int32(const at::Tensor& acc, const at::Tensor& row_scale,
                            const at::Tensor& row_zero, const at::Tensor& col_scale,
                            const at::Tensor& col_sums, const c10::optional<at::Tensor>& bias) {
  const Rescale by = check_rescale(acc, row_scale, row_zero, col_scale, col_sums,
                                   "dequantize_int32");
  const int64_t rows = acc.size(0), cols = acc.size(1);
  const float* bp = checked_bias(bias, cols, "dequantize_int32");
  auto out = at::empty({rows, cols}, acc.options().dtype(at::kFloat));
  const int32_t* ap = acc.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rescale_row(ap + r * cols, by.row_zero[r], by.col_sums, by.row_scale[r], by.col_scale,
                  bp, cols, op + r * cols);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("quantize_rows_int8(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("dequantize_int32(Tensor acc, Tensor row_scale, Tensor row_zero, Tensor col_scale, "
        "Tensor col_sums, Tensor? bias) -> Tensor");
  m.def("dequantize_silu_mul_quantize(Tensor acc, Tensor row_scale, Tensor row_zero, "
        "Tensor col_scale, Tensor col_sums) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("quantize_rows_int8", &quantize_rows_int8);
  m.impl("dequantize_int32", &dequantize_int32);
  m.impl("dequantize_silu_mul_quantize", &dequantize_silu_mul_quantize);
}
