// W8A8's int32 product on weights packed in 64-byte quads (packed_weights.pack_tiles):
// the checks of its operands and the two ways its sums leave a kernel, shared by the AMX
// kernel (amx_int8_cpu.cpp) and the AVX-512 VNNI one (vnni_int8_cpu.cpp), so that both
// give the same ops.
//
// The packed weight is [N / 16][K / 64][16][64]: tile (j, kk) holds, in its row r, the
// four inputs 64 kk + 4 r .. + 3 of each of the output channels 16 j .. 16 j + 15, so
// each block of 16 channels is one sequential run. K must be a multiple of 64; N is
// padded with zero channels to a multiple of 16.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "vec_math.h"
#include "w8a8_operands.h"

constexpr int64_t kTileChannels = 16;  // output channels per packed block
constexpr int64_t kTileK = 64;         // inputs per packed tile

inline void check_tiled_operands(const at::Tensor& qx, const at::Tensor& packed,
                                 int64_t out_ch, const char* name) {
  TORCH_CHECK(qx.scalar_type() == at::kChar && qx.dim() == 2 && qx.is_contiguous(), name,
              ": qx must be contiguous int8 [rows, in]");
  const int64_t in = qx.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 &&
                  packed.is_contiguous() && packed.size(0) * kTileChannels >= out_ch &&
                  packed.size(0) * kTileChannels < out_ch + kTileChannels &&
                  packed.size(1) * kTileK == in && packed.size(2) == kTileK / 4 &&
                  packed.size(3) == kTileChannels * 4,
              name, ": packed must be int8 [ceil(out / 16), in / 64, 16, 64] for in = ", in,
              " and out = ", out_ch, "; got ", packed.sizes());
}

// A tile kernel's two ops, the same for each kernel. `Kernel` gives its name (kName, the
// ops' prefix), why it may be missing (kMissing), whether it runs here (available()),
// and product(qx, packed, emit), which calls emit(row, c0, sums, n) with one row's exact
// sums for the channels c0 .. c0 + n - 1, n a multiple of 16 that may run into the
// padding; product is called only where available() holds.
template <typename Kernel>
struct TiledInt8Ops {
  static void check(const at::Tensor& qx, const at::Tensor& packed, int64_t out_ch,
                    const std::string& op) {
    TORCH_CHECK(Kernel::available(), op, ": ", Kernel::kMissing);
    check_tiled_operands(qx, packed, out_ch, op.c_str());
  }

  // The exact int32 sums [rows, out_ch].
  static at::Tensor int8_mm(const at::Tensor& qx, const at::Tensor& packed, int64_t out_ch) {
    check(qx, packed, out_ch, std::string(Kernel::kName) + "_int8_mm");
    auto out = at::empty({qx.size(0), out_ch}, qx.options().dtype(at::kInt));
    int32_t* o = out.data_ptr<int32_t>();
    Kernel::product(qx, packed, [&](int64_t r, int64_t c0, const int32_t* sums, int64_t n) {
      std::memcpy(o + r * out_ch + c0, sums, std::min(n, out_ch - c0) * sizeof(int32_t));
    });
    return out;
  }

  // W8A8's linear from its quantized activations: the sums rescaled as dequantize_int32
  // rescales them (vec_math.h's rescale_row), bit for bit, while they are in L1: no int32
  // [rows, out_ch] in memory and no second op.
  static at::Tensor w8a8_linear(const at::Tensor& qx, const at::Tensor& row_scale,
                                const at::Tensor& row_zero, const at::Tensor& packed,
                                const at::Tensor& col_scale, const at::Tensor& col_sums,
                                const c10::optional<at::Tensor>& bias, int64_t out_ch) {
    const std::string op = std::string(Kernel::kName) + "_w8a8_linear";
    check(qx, packed, out_ch, op);
    check_scales(row_scale, "row_scale", row_zero, "row_zero", qx.size(0), op.c_str());
    check_scales(col_scale, "col_scale", col_sums, "col_sums", out_ch, op.c_str());
    const float* bp = checked_bias(bias, out_ch, op.c_str());
    auto out = at::empty({qx.size(0), out_ch}, qx.options().dtype(at::kFloat));
    const float* rs = row_scale.data_ptr<float>();
    const int32_t* rz = row_zero.data_ptr<int32_t>();
    const float* cs = col_scale.data_ptr<float>();
    const int32_t* ws = col_sums.data_ptr<int32_t>();
    float* o = out.data_ptr<float>();
    Kernel::product(qx, packed, [&](int64_t r, int64_t c0, const int32_t* sums, int64_t n) {
      rescale_row(sums, rz[r], ws + c0, rs[r], cs + c0, bp ? bp + c0 : nullptr,
                  std::min(n, out_ch - c0), o + r * out_ch + c0);
    });
    return out;
  }
};
