// Weight-only int8 linear layer for small batches (decode): out = (x @ q.T) * scale,
// the scale per output channel or per group of input columns of it.
// Decode reads every weight once per token, so its speed is the weight bytes; an int8
// weight is a quarter of fp32's. Each output channel's int8 row is read once and
// widened to fp32 in registers for every activation row, never stored as fp32.
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kChannelGrain = 16;  // output channels per parallel task
constexpr int64_t kMaxRows = 16;       // activation rows one pass serves

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
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* qrow = qp + n * in;
      const float* srow = sp + n * groups;
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = xp + r * in;
        float total = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t k0 = g * group;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = k0; k < k0 + group; ++k) acc += xr[k] * static_cast<float>(qrow[k]);
          total += acc * srow[g];
        }
        op[r * out_ch + n] = total;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("int8_weight_linear(Tensor x, Tensor qweight, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("int8_weight_linear", &int8_weight_linear);
}
