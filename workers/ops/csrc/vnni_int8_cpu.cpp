// W8A8's exact int32 product with AVX-512 VNNI, for processors that have it but no AMX
// (AMD Zen 4 and later, Intel Ice Lake and Cascade Lake): out[M, N] = qx[M, K] @ W[N, K].T.
//
// vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each group of four
// products to one of 16 int32 lanes. The weight is packed as the AMX kernel's is
// (int8_tiles.h): each 64-byte row holds four consecutive inputs of 16 channels, so one
// vpdpbusd of such a row by a row's four activations, broadcast to all 16 lanes, adds
// those inputs' products to 16 channels' sums, and no lane is ever summed across. A
// register tile of 4 rows x 4 blocks (64 channels) keeps its 16 sums in registers and
// reads each weight row once for its 4 rows; a task goes over all rows with each block
// group, whose weights stay in L1/L2.
//
// The weight is the unsigned operand, stored offset by 128 (w ^ 0x80 = w + 128, 0..255,
// packed_weights.pack_tiles): the activations are then the broadcast signed operand, and
// 128 times each row's activation sum is taken off the sums, which stay exact.
// torch._int_mm repacks its weight on every call and builds a oneDNN kernel for each new
// row count; at decode batches of 8-64 rows this ran 1.2-1.7x faster than it on a Zen 4
// EPYC (benchmarks/RESULTS.md).
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "int8_tiles.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LLM_CLUSTER_VNNI 1
#endif

namespace {

constexpr int64_t kRowTile = 4;     // rows per register tile
constexpr int64_t kBlockTile = 4;   // blocks of 16 channels per register tile

#ifdef LLM_CLUSTER_VNNI

// 128 times each row's activation sum: what the weight's offset adds to its sums.
std::vector<int32_t> row_offsets(const int8_t* x, int64_t rows, int64_t in) {
  std::vector<int32_t> offsets(rows);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t r = 0; r < rows; ++r) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t k = 0; k < in; k += kTileK)
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_loadu_si512(x + r * in + k));
    offsets[r] = 128 * _mm512_reduce_add_epi32(acc);
  }
  return offsets;
}

// The sums of row r with block v live in c<r><v>: named registers, since GCC keeps an
// array of vectors in memory across the loop.
#define LLM_SUMS(r) __m512i c##r##0 = z, c##r##1 = z, c##r##2 = z, c##r##3 = z;
#define LLM_DOT(r, v) \
  if constexpr (V > v) c##r##v = _mm512_dpbusd_epi32(c##r##v, w##v, a);
#define LLM_ROW(r)                                                 \
  if constexpr (R > r) {                                           \
    int32_t quad;                                                  \
    std::memcpy(&quad, x + r * ldx + 4 * q, sizeof quad);          \
    const __m512i a = _mm512_set1_epi32(quad);                     \
    LLM_DOT(r, 0) LLM_DOT(r, 1) LLM_DOT(r, 2) LLM_DOT(r, 3)        \
  }
#define LLM_PUT(r, v)                                                        \
  if constexpr (R > r && V > v)                                              \
    _mm512_storeu_si512(sums + (r * V + v) * kTileChannels,                  \
                        _mm512_sub_epi32(c##r##v, _mm512_set1_epi32(offset[r])));
#define LLM_PUT_ROW(r) LLM_PUT(r, 0) LLM_PUT(r, 1) LLM_PUT(r, 2) LLM_PUT(r, 3)

// R rows of x (ldx apart) times V blocks of the weight (ldw apart): sums [R][V * 16].
template <int R, int V>
void register_tile(const int8_t* x, int64_t ldx, const int8_t* w, int64_t ldw, int64_t quads,
                   const int32_t* offset, int32_t* sums) {
  const __m512i z = _mm512_setzero_si512();
  LLM_SUMS(0) LLM_SUMS(1) LLM_SUMS(2) LLM_SUMS(3)
  for (int64_t q = 0; q < quads; ++q) {
    const __m512i w0 = _mm512_loadu_si512(w + q * 64);
    const __m512i w1 = V > 1 ? _mm512_loadu_si512(w + ldw + q * 64) : z;
    const __m512i w2 = V > 2 ? _mm512_loadu_si512(w + 2 * ldw + q * 64) : z;
    const __m512i w3 = V > 3 ? _mm512_loadu_si512(w + 3 * ldw + q * 64) : z;
    LLM_ROW(0) LLM_ROW(1) LLM_ROW(2) LLM_ROW(3)
  }
  LLM_PUT_ROW(0) LLM_PUT_ROW(1) LLM_PUT_ROW(2) LLM_PUT_ROW(3)
}

using TileFn = void (*)(const int8_t*, int64_t, const int8_t*, int64_t, int64_t,
                        const int32_t*, int32_t*);
#define LLM_TILES(R) \
  { register_tile<R, 1>, register_tile<R, 2>, register_tile<R, 3>, register_tile<R, 4> }
constexpr TileFn kTiles[kRowTile][kBlockTile] = {LLM_TILES(1), LLM_TILES(2), LLM_TILES(3),
                                                 LLM_TILES(4)};

// qx [rows, in] times the packed weight, emit as int8_tiles.h says: one task per share
// of the blocks, going over all rows with each group of kBlockTile blocks.
template <typename Emit>
void vnni_product(const at::Tensor& qx, const at::Tensor& packed, const Emit& emit) {
  const int64_t rows = qx.size(0), in = qx.size(1), quads = in / 4, ldw = quads * 64;
  const int8_t* x = qx.data_ptr<int8_t>();
  const int8_t* w = packed.data_ptr<int8_t>();
  const std::vector<int32_t> offsets = row_offsets(x, rows, in);
  at::parallel_for(0, packed.size(0), kBlockTile, [&](int64_t b0, int64_t b1) {
    alignas(64) int32_t sums[kRowTile * kBlockTile * kTileChannels];
    for (int64_t b = b0; b < b1; b += kBlockTile) {
      const int64_t v = std::min(kBlockTile, b1 - b), width = v * kTileChannels;
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int64_t n = std::min(kRowTile, rows - r0);
        kTiles[n - 1][v - 1](x + r0 * in, in, w + b * ldw, ldw, quads, offsets.data() + r0,
                             sums);
        for (int64_t r = 0; r < n; ++r)
          emit(r0 + r, b * kTileChannels, sums + r * width, width);
      }
    }
  });
}

#endif  // LLM_CLUSTER_VNNI

bool vnni_int8_available() {
#ifdef LLM_CLUSTER_VNNI
  return true;
#else
  return false;
#endif
}

// The kernel as TiledInt8Ops (int8_tiles.h) takes it.
struct Vnni {
  static constexpr const char* kName = "vnni";
  static constexpr const char* kMissing = "this build has no AVX-512 VNNI (use _int_mm)";
  static bool available() { return vnni_int8_available(); }
  template <typename Emit>
  static void product(const at::Tensor& qx, const at::Tensor& packed, const Emit& emit) {
#ifdef LLM_CLUSTER_VNNI
    vnni_product(qx, packed, emit);
#endif
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("vnni_int8_available() -> bool", &vnni_int8_available);
  m.def("vnni_int8_mm(Tensor qx, Tensor packed, int out_ch) -> Tensor");
  m.def("vnni_w8a8_linear(Tensor qx, Tensor row_scale, Tensor row_zero, Tensor packed, "
        "Tensor col_scale, Tensor col_sums, Tensor? bias, int out_ch) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("vnni_int8_mm", &TiledInt8Ops<Vnni>::int8_mm);
  m.impl("vnni_w8a8_linear", &TiledInt8Ops<Vnni>::w8a8_linear);
}
