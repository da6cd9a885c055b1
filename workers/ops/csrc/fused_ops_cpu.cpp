// Fused elementwise ops of a decoder layer for CPUs. In plain torch each of these is
// five to twenty small ops (RMSNorm: pow, mean, add, rsqrt, mul, mul; rotary: two
// gathers, slices, six products, a concatenation); at decode batch sizes a step then
// spends more time dispatching and re-reading activations than computing. Each op
// here reads its inputs once. Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kv_pool.h"
#include "vec_math.h"

namespace {

constexpr int64_t kRowGrain = 16;  // rows per parallel task: small batches stay on one thread

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 2 && x.stride(-1) == 1,
              name, " must be float32 with a contiguous last dimension");
}

// out[r] = w * x[r] / sqrt(mean(x[r]^2) + eps), after x[r] += delta[r] when delta is given.
void norm_rows(float* x, const float* delta, const float* w, float* out, int64_t rows,
               int64_t width, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = x + r * width;
      if (delta != nullptr) {
        const float* dr = delta + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) xr[i] += dr[i];
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) squares += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
      float* o = out + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) o[i] = w[i] * (xr[i] * inv);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() &&
                  weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  weight.numel() == x.size(-1),
              "rms_norm: x must be contiguous float32 [..., width], weight float32 [width]");
  auto out = at::empty_like(x);
  const int64_t width = x.size(-1);
  norm_rows(x.data_ptr<float>(), nullptr, weight.data_ptr<float>(), out.data_ptr<float>(),
            x.numel() / width, width, static_cast<float>(eps));
  return out;
}

// h += delta, then the RMSNorm of h: the residual add and the next norm in one pass.
at::Tensor add_rms_norm_(at::Tensor& h, const at::Tensor& delta, const at::Tensor& weight,
                         double eps) {
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.dim() == 2 && h.is_contiguous() &&
                  delta.sizes() == h.sizes() && delta.scalar_type() == at::kFloat &&
                  delta.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous() && weight.numel() == h.size(1),
              "add_rms_norm_: h and delta must be contiguous float32 [rows, width], weight "
              "float32 [width]");
  auto out = at::empty_like(h);
  norm_rows(h.data_ptr<float>(), delta.data_ptr<float>(), weight.data_ptr<float>(),
            out.data_ptr<float>(), h.size(0), h.size(1), static_cast<float>(eps));
  return out;
}

// Rotate the heads of one token in place (neox halves): x1' = x1 c - x2 s,
// x2' = x2 c + x1 s. Products and sums are rounded separately, as torch's are.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rotate_heads(float* x, int64_t heads, int64_t head_stride, int64_t half, const float* c,
                  const float* s) {
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = x + h * head_stride;
    float* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * c[i] - b * s[i];
      x2[i] = b * c[i] + a * s[i];
    }
  }
}
#pragma GCC pop_options

void rotary_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
             const at::Tensor& sin) {
  check_rows(q, "rotary_: q");
  check_rows(k, "rotary_: k");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.stride(1) == q.size(2) && k.stride(1) == k.size(2),
              "rotary_: q [T, H, D] and k [T, KVH, D] with contiguous heads");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == q.size(0) &&
                  positions.is_contiguous(),
              "rotary_: positions must be contiguous int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) * 2 == q.size(2),
              "rotary_: cos/sin must be contiguous float32 [max_pos, D/2]");
  const int64_t half = cos.size(1), max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, q.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_: position ", pos[t],
                  " outside the table of ", max_pos);
      const float* c = cp + pos[t] * half;
      const float* s = sp + pos[t] * half;
      rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), half, c, s);
      rotate_heads(kp + t * k.stride(0), k.size(1), k.stride(1), half, c, s);
    }
  });
}

// n float32 values to the cache's type, rounded to nearest even as torch's .to() does.
inline void narrow(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void narrow(const float* src, at::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
}
inline void narrow(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}

// One token's KV heads as int8 rows, as kvcache/kv_quant.py defines them: each head's
// `dim` values quantized with the fp16-rounded scale amax / 127 (1 for a zero head or
// one whose scale falls below fp16's range), then the scale's 2 bytes.
inline void quantize_heads(const float* src, int8_t* dst, int64_t heads, int64_t dim) {
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = src + h * dim;
    int8_t* q = dst + h * (dim + 2);
    float amax = 0.f;
#pragma omp simd reduction(max : amax)
    for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::fabs(x[i]));
    at::Half half_scale = static_cast<at::Half>(amax > 0.f ? amax / 127.f : 1.f);
    if (!(static_cast<float>(half_scale) > 0.f)) half_scale = static_cast<at::Half>(1.f);
    const float s = static_cast<float>(half_scale);
    for (int64_t i = 0; i < dim; ++i)
      q[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[i] / s))));
    std::memcpy(q + dim, &half_scale, 2);
  }
}

// cache[0][slot[t]] = store(k[t]), cache[1][slot[t]] = store(v[t]), where
// store(src, dst) writes one token's row of `row` stored elements.
template <typename T, typename Store>
void write_rows(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache,
                const at::Tensor& slots, int64_t row, Store store) {
  const int64_t tokens = k.size(0), block_size = cache.size(2);
  const int64_t num_slots = cache.size(1) * block_size, block_stride = cache.stride(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  T* kc = cache.data_ptr<T>();
  T* vc = kc + cache.stride(0);
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "write_kv: slot ", slot[t],
                  " outside the pool of ", num_slots);
      const int64_t at = slot[t] / block_size * block_stride + slot[t] % block_size * row;
      store(kp + t * k.stride(0), kc + at);
      store(vp + t * v.stride(0), vc + at);
    }
  });
}

// The rows converted to the cache's float type.
template <typename T>
void write_narrowed(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache,
                    const at::Tensor& slots) {
  const int64_t row = k.size(1) * k.size(2);
  write_rows<T>(k, v, cache, slots, row,
                [row](const float* src, T* dst) { narrow(src, dst, row); });
}

// The rows quantized to int8 rows of dim + 2 bytes per head (quantize_heads).
void write_quantized(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache,
                     const at::Tensor& slots) {
  const int64_t heads = k.size(1), dim = k.size(2);
  write_rows<int8_t>(k, v, cache, slots, heads * (dim + 2),
                     [heads, dim](const float* src, int8_t* dst) {
                       quantize_heads(src, dst, heads, dim);
                     });
}

// cache[0][slot[t]] = k[t], cache[1][slot[t]] = v[t], converted to the cache's type
// (int8: quantized per token and head, see quantize_heads).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& cache,
              const at::Tensor& slots) {
  check_rows(k, "write_kv: k");
  check_rows(v, "write_kv: v");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(1) == k.size(2) &&
                  v.stride(1) == v.size(2),
              "write_kv: k and v must be [T, KVH, D] with contiguous heads");
  const int64_t row = k.size(2) + (cache.scalar_type() == at::kChar ? 2 : 0);
  TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && blocks_contiguous(cache, 1) &&
                  cache.size(3) == k.size(1) && cache.size(4) == row,
              "write_kv: cache must be [2, blocks, block_size, KVH, D] with contiguous "
              "blocks (D + 2 for int8: the values, then the scale)");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == k.size(0),
              "write_kv: slot_mapping must be contiguous int64 [T]");
  switch (cache.scalar_type()) {
    case at::kFloat: write_narrowed<float>(k, v, cache, slots); break;
    case at::kHalf: write_narrowed<at::Half>(k, v, cache, slots); break;
    case at::kBFloat16: write_narrowed<at::BFloat16>(k, v, cache, slots); break;
    case at::kChar: write_quantized(k, v, cache, slots); break;
    default: TORCH_CHECK(false, "write_kv: unsupported cache dtype ", cache.scalar_type());
  }
}

// out = silu(x[:, :I]) * x[:, I:] for x [T, 2I]: the gated MLP's activation.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) % 2 == 0,
              "silu_and_mul: x must be contiguous float32 [T, 2 * I]");
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  auto out = at::empty({rows, width}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      silu_mul_row(xp + r * 2 * width, xp + r * 2 * width + width, op + r * width, width);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) cache, Tensor slot_mapping) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rotary_", &rotary_);
  m.impl("write_kv", &write_kv);
  m.impl("silu_and_mul", &silu_and_mul);
}
