// W8A8's exact int32 product on AMX tiles, for processors that have them (Sapphire
// Rapids and later Xeons): out[M, N] = qx[M, K] @ W[N, K].T, int8 inputs, int32 sums.
//
// One tdpbssd multiplies a 16 x 64 int8 tile of activations by a 64 x 16 tile of weights
// into a 16 x 16 tile of int32 sums: 16384 products per instruction, where AVX-512 VNNI
// does 64. A decode batch of up to 64 rows keeps four sum tiles and reads each weight
// tile once, so small batches run as fast as the weights stream from memory; torch's
// _int_mm repacks its weight on every call and oneDNN builds a kernel for each new row
// count, which a decode batch, changing size every step, pays again and again.
//
// The weight is packed at load (packed_weights.pack_tiles) in the layout int8_tiles.h
// describes, the one tdpbssd reads its second operand in.
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "int8_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define LLM_CLUSTER_AMX 1
#endif

namespace {

constexpr int64_t kTileRows = 16;    // rows of an activation or sum tile
constexpr int64_t kGroupRows = 64;   // activation rows per pass over the weight: 4 sum tiles
constexpr int64_t kColGrain = 4;     // blocks of 16 channels per parallel task

#ifdef LLM_CLUSTER_AMX

// Linux hands out AMX's tile state only to a process that asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); asking again is harmless.
bool request_amx() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The tile configuration ldtilecfg reads: palette 1, bytes per row and rows per tile.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  uint8_t reserved2[16] = {};
};

// Tiles 0-3: sums of row tiles 0-3; 4: a whole activation tile; 5: the weight tile;
// 6: the last activation tile when it has fewer than 16 rows (`last_rows`).
void configure(int64_t row_tiles, int64_t last_rows) {
  TileConfig cfg;
  for (int t = 0; t < row_tiles; ++t) {
    cfg.rows[t] = t + 1 == row_tiles ? last_rows : kTileRows;
    cfg.colsb[t] = kTileRows * 4;
  }
  cfg.rows[4] = kTileRows, cfg.colsb[4] = kTileK;
  cfg.rows[5] = kTileK / 4, cfg.colsb[5] = kTileRows * 4;
  cfg.rows[6] = last_rows, cfg.colsb[6] = kTileK;
  _tile_loadconfig(&cfg);
}

// GCC's tile intrinsics paste their tile numbers into the instruction's text, so each
// tile's code is written out with its number (no template parameter can name a tile).
// Sum tile T (if T < R) += activation row tile T times the weight tile in tile 5; the
// last row tile reads through tile 6 when it is partial.
#define LLM_CLUSTER_MULTIPLY(T)                                \
  if constexpr (T < R) {                                       \
    if constexpr (Partial && T + 1 == R) {                     \
      _tile_loadd(6, a + T * kTileRows * lda, lda);            \
      _tile_dpbssd(T, 6, 5);                                   \
    } else {                                                   \
      _tile_loadd(4, a + T * kTileRows * lda, lda);            \
      _tile_dpbssd(T, 4, 5);                                   \
    }                                                          \
  }
#define LLM_CLUSTER_STORE(T) \
  if constexpr (T < R) _tile_stored(T, c + T * kTileRows * ldc, ldc * 4);

template <int R, bool Partial>
inline void multiply(const int8_t* a, int64_t lda) {
  LLM_CLUSTER_MULTIPLY(0)
  LLM_CLUSTER_MULTIPLY(1)
  LLM_CLUSTER_MULTIPLY(2)
  LLM_CLUSTER_MULTIPLY(3)
}

template <int R>
inline void store(int32_t* c, int64_t ldc) {
  LLM_CLUSTER_STORE(0)
  LLM_CLUSTER_STORE(1)
  LLM_CLUSTER_STORE(2)
  LLM_CLUSTER_STORE(3)
}

// R row tiles of `a` (rows with stride lda) times channel blocks [b0, b1) of the packed
// weight; each block's 16 x 16 tiles of sums go through `sums` (in L1) to emit(b, sums).
template <int R, bool Partial, typename Emit>
void row_group(const int8_t* a, int64_t lda, const int8_t* w, int64_t k_tiles, int64_t b0,
               int64_t b1, const Emit& emit) {
  alignas(64) int32_t sums[kGroupRows * kTileRows];
  for (int64_t b = b0; b < b1; ++b) {
    _tile_zero(0);
    if constexpr (R > 1) _tile_zero(1);
    if constexpr (R > 2) _tile_zero(2);
    if constexpr (R > 3) _tile_zero(3);
    const int8_t* wb = w + b * k_tiles * kTileK * kTileRows;
    for (int64_t kk = 0; kk < k_tiles; ++kk) {
      _tile_loadd(5, wb + kk * kTileK * kTileRows, kTileRows * 4);
      multiply<R, Partial>(a + kk * kTileK, lda);
    }
    store<R>(sums, kTileRows);
    emit(b, sums);
  }
}

// qx [rows, in] times the packed weight: one task per kColGrain channel blocks, each
// going over the rows in groups of kGroupRows (its share of the weight stays in L2);
// emit as int8_tiles.h says.
template <typename Emit>
void amx_product(const at::Tensor& qx, const at::Tensor& packed, const Emit& emit) {
  const int64_t rows = qx.size(0), in = qx.size(1), k_tiles = packed.size(1);
  const int8_t* a = qx.data_ptr<int8_t>();
  const int8_t* w = packed.data_ptr<int8_t>();
  at::parallel_for(0, packed.size(0), kColGrain, [&](int64_t b0, int64_t b1) {
    for (int64_t g = 0; g < rows; g += kGroupRows) {
      const int64_t n = std::min(kGroupRows, rows - g);
      const int64_t row_tiles = (n + kTileRows - 1) / kTileRows;
      const int64_t last = n - (row_tiles - 1) * kTileRows;
      configure(row_tiles, last);
      const int8_t* ag = a + g * in;
      const auto group = [&](int64_t b, const int32_t* sums) {
        for (int64_t r = 0; r < n; ++r)
          emit(g + r, b * kTileChannels, sums + r * kTileChannels, kTileChannels);
      };
      switch (row_tiles * 2 + (last < kTileRows)) {
        case 2: row_group<1, false>(ag, in, w, k_tiles, b0, b1, group); break;
        case 3: row_group<1, true>(ag, in, w, k_tiles, b0, b1, group); break;
        case 4: row_group<2, false>(ag, in, w, k_tiles, b0, b1, group); break;
        case 5: row_group<2, true>(ag, in, w, k_tiles, b0, b1, group); break;
        case 6: row_group<3, false>(ag, in, w, k_tiles, b0, b1, group); break;
        case 7: row_group<3, true>(ag, in, w, k_tiles, b0, b1, group); break;
        case 8: row_group<4, false>(ag, in, w, k_tiles, b0, b1, group); break;
        default: row_group<4, true>(ag, in, w, k_tiles, b0, b1, group);
      }
    }
    _tile_release();
  });
}

#endif  // LLM_CLUSTER_AMX

bool amx_int8_available() {
#ifdef LLM_CLUSTER_AMX
  static const bool ok = request_amx();
  return ok;
#else
  return false;
#endif
}

// The kernel as TiledInt8Ops (int8_tiles.h) takes it.
struct Amx {
  static constexpr const char* kName = "amx";
  static constexpr const char* kMissing =
      "this build or this kernel has no AMX int8 (use _int_mm)";
  static bool available() { return amx_int8_available(); }
  template <typename Emit>
  static void product(const at::Tensor& qx, const at::Tensor& packed, const Emit& emit) {
#ifdef LLM_CLUSTER_AMX
    amx_product(qx, packed, emit);
#endif
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("amx_int8_available() -> bool", &amx_int8_available);
  m.def("amx_int8_mm(Tensor qx, Tensor packed, int out_ch) -> Tensor");
  m.def("amx_w8a8_linear(Tensor qx, Tensor row_scale, Tensor row_zero, Tensor packed, "
        "Tensor col_scale, Tensor col_sums, Tensor? bias, int out_ch) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("amx_int8_mm", &TiledInt8Ops<Amx>::int8_mm);
  m.impl("amx_w8a8_linear", &TiledInt8Ops<Amx>::w8a8_linear);
}
