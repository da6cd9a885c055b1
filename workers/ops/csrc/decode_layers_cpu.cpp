// A decode-only step through every decoder layer in one call, for w8a16 weights packed
// for int8_weight_linear and fp32 activations.
//
// At batch 1 the kernels of a layer take about 0.3 ms on a 2-core CPU, and calling them
// one by one from Python added about 0.1 ms per layer: each torch.ops call parses its
// arguments against the schema (5 us against 1.7 for a native torch op), and the model
// code between them allocates, slices and checks. Here the same kernels, in the same
// order, are called through the dispatcher's typed handles, so the result is bit-equal
// to DecoderLM.forward's layer loop with the CPU ops (workers/ops/fused_decode.py says
// when that loop may be replaced). Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

namespace {

// Per layer, in this order: qkv, qkv scale, o, o scale, gate_up, gate_up scale, down,
// down scale (int8_weight_linear's packed weights and scales), the post-attention norm,
// and the norm after the layer (the next layer's input norm, the final norm after the
// last).
constexpr int64_t kLayerTensors = 10;
constexpr int64_t kLayerBiases = 2;   // qkv, o

template <typename Sig>
c10::TypedOperatorHandle<Sig> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using LinearSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const std::optional<at::Tensor>&, int64_t);
using RotarySig = void(at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&);
using WriteSig = void(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&);
using AttentionSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double);
using AddNormSig = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using SiluSig = at::Tensor(const at::Tensor&);

at::Tensor decode_layers_w8a16(at::Tensor& h, const at::Tensor& x_in, const at::Tensor& positions,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, at::TensorList weights,
                               const c10::List<std::optional<at::Tensor>>& biases,
                               at::TensorList kv_caches, const at::Tensor& cos,
                               const at::Tensor& sin, at::IntArrayRef out_features,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               double eps, double scale) {
  static const auto linear = handle<LinearSig>("llm_cluster::int8_weight_linear");
  static const auto rotary = handle<RotarySig>("llm_cluster::rotary_");
  static const auto write_kv = handle<WriteSig>("llm_cluster::write_kv");
  static const auto attention = handle<AttentionSig>("llm_cluster::paged_decode_attention");
  static const auto add_norm = handle<AddNormSig>("llm_cluster::add_rms_norm_");
  static const auto silu_mul = handle<SiluSig>("llm_cluster::silu_and_mul");

  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerTensors &&
                  static_cast<int64_t>(biases.size()) == layers * kLayerBiases &&
                  out_features.size() == 4,
              "decode_layers_w8a16: ", kLayerTensors, " weights and ", kLayerBiases,
              " biases per KV cache, and 4 output widths (qkv, o, gate_up, down)");
  const int64_t tokens = x_in.size(0), q_size = num_heads * head_dim,
                kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(out_features[0] == q_size + 2 * kv_size,
              "decode_layers_w8a16: qkv width must be the heads' q, k and v widths");
  at::Tensor x = x_in;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kLayerTensors;
    const at::Tensor qkv = linear.call(x, w[0], w[1], biases.get(i * kLayerBiases),
                                       out_features[0]);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size)
                             .view({tokens, num_kv_heads, head_dim});
    rotary.call(q, k, positions, cos, sin);
    at::Tensor cache = kv_caches[i];
    write_kv.call(k, v, cache, slot_mapping);
    const at::Tensor o = attention.call(q.contiguous(), cache.select(0, 0), cache.select(0, 1),
                                        block_tables, seq_lens, scale);
    x = add_norm.call(h, linear.call(o.view({tokens, q_size}), w[2], w[3],
                                     biases.get(i * kLayerBiases + 1), out_features[1]),
                      w[8], eps);
    const at::Tensor act = silu_mul.call(linear.call(x, w[4], w[5], std::nullopt,
                                                     out_features[2]));
    x = add_norm.call(h, linear.call(act, w[6], w[7], std::nullopt, out_features[3]), w[9], eps);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("decode_layers_w8a16(Tensor(a!) h, Tensor x, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor[] weights, Tensor?[] biases, "
        "Tensor(b!)[] kv_caches, Tensor cos, Tensor sin, int[] out_features, int num_heads, "
        "int num_kv_heads, int head_dim, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("decode_layers_w8a16", &decode_layers_w8a16);
}
