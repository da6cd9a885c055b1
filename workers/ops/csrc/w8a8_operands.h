// The checks of W8A8's rescale operands, shared by the separate epilogue
// (int8_linear_cpu.cpp) and the tile kernels' fused one (int8_tiles.h): per row of
// activations a scale and a zero point, per output channel a scale and the weight's sum
// (quant_linear.w8a8_linear defines the arithmetic).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

inline void check_row_scales(const at::Tensor& row_scale, const at::Tensor& row_zero,
                             int64_t rows, const char* name) {
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() &&
                  row_scale.numel() == rows && row_zero.scalar_type() == at::kInt &&
                  row_zero.is_contiguous() && row_zero.numel() == rows,
              name, ": row_scale must be contiguous float32 and row_zero int32, [", rows, "]");
}

inline void check_col_scales(const at::Tensor& col_scale, const at::Tensor& col_sums,
                             int64_t cols, const char* name) {
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() &&
                  col_scale.numel() == cols && col_sums.scalar_type() == at::kInt &&
                  col_sums.is_contiguous() && col_sums.numel() == cols,
              name, ": col_scale must be contiguous float32 and col_sums int32, [", cols, "]");
}

// The bias's data, or nullptr without one.
inline const float* checked_bias(const c10::optional<at::Tensor>& bias, int64_t cols,
                                 const char* name) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                  bias->numel() == cols,
              name, ": bias must be contiguous float32 [", cols, "]");
  return bias->data_ptr<float>();
}
