// The checks of W8A8's rescale operands, shared by the separate epilogue
// (int8_linear_cpu.cpp) and the tile kernels' fused one (int8_tiles.h): per row of
// activations a scale and a zero point, per output channel a scale and the weight's sum
// (quant_linear.w8a8_linear defines the arithmetic).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

// A float32 scale and its int32 companion, n of each: a row's scale and zero point, or
// an output channel's scale and weight sum.
inline void check_scales(const at::Tensor& scale, const char* scale_name,
                         const at::Tensor& ints, const char* ints_name, int64_t n,
                         const char* name) {
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == n && ints.scalar_type() == at::kInt &&
                  ints.is_contiguous() && ints.numel() == n,
              name, ": ", scale_name, " must be contiguous float32 and ", ints_name,
              " int32, [", n, "]");
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
