// W8A16's products at batch sizes, in register tiles: its int8 layers (fp32 rows rounded
// to int16 per row, as the decode kernel rounds them, packed_linear_cpu.cpp: scale =
// amax / 32767; a weight scale per output channel or per group of input columns) and its
// fp16 LM head (fp32 rows, the weights widened to fp32).
//
// The decode kernels widen every weight again for each row and sum each channel's lanes
// horizontally: at a few rows the weights' stream from memory decides their speed, but
// from about 16 rows those instructions do, and they lost to dequantizing the weight into
// the fp32 GEMM. Here a 512-bit register's 16 lanes are 16 output channels. The weight is
// packed [ceil(out / 16)][steps][16][e] (packed_weights.pack_pair_tiles / pack_half_tiles):
// per step each channel's e = 2 consecutive int8 inputs or e = 1 fp16 input, so one
// widened step of a block meets a row's step of inputs, broadcast to all lanes, in one
// instruction (vpdpwssd: 32 exact int16 products; or one fp32 FMA), and no sum crosses
// lanes. A register tile of 4 rows x 4 blocks (64 channels) keeps 16 sums in registers
// over a span of steps, then adds them (int8: times the span's scale group, the span at
// most kSpan inputs, within int32: 256 * 32767 * 128 < 2^31) to fp32 totals in L1. A task
// takes a share of the blocks and goes over all rows with each group of 4 blocks, whose
// weights stay in L2.
// Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec_math.h"
#include "w8a8_operands.h"

#if defined(__AVX512BW__)
#include <immintrin.h>
#define LLM_CLUSTER_W8A16_TILES 1
#endif

namespace {

constexpr int64_t kChannels = 16;   // output channels per packed block: one register's lanes
constexpr int64_t kRowTile = 4;     // rows per register tile
constexpr int64_t kBlockTile = 4;   // blocks per register tile
constexpr int64_t kSpan = 256;      // int8 inputs summed in int32 before the scales apply

#ifdef LLM_CLUSTER_W8A16_TILES

// One step of 16 channels' weights widened into lanes: int8 pairs to int16, fp16 to fp32.
inline __m512i widened(const int8_t* w, int64_t step) {
  return _mm512_cvtepi8_epi16(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + step * 2 * kChannels)));
}
inline __m512 widened(const at::Half* w, int64_t step) {
  return _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + step * kChannels)));
}

// A row's inputs of one step in every lane: an int16 pair, or one fp32 value.
inline __m512i broadcast(const int16_t* row, int64_t step) {
  int32_t pair;
  std::memcpy(&pair, row + 2 * step, sizeof pair);
  return _mm512_set1_epi32(pair);
}
inline __m512 broadcast(const float* row, int64_t step) { return _mm512_set1_ps(row[step]); }

inline __m512i dot(__m512i acc, __m512i a, __m512i w) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, w);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, w));
#endif
}
inline __m512 dot(__m512 acc, __m512 a, __m512 w) { return _mm512_fmadd_ps(a, w, acc); }

// A span's sums added to the totals: int32 ones times their scale group's 16 scales.
inline __m512 added(__m512i sums, const float* scale, __m512 totals) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_loadu_ps(scale), totals);
}
inline __m512 added(__m512 sums, const float*, __m512 totals) {
  return _mm512_add_ps(sums, totals);
}

// The sums of row r with block v live in c<r><v>: named registers, since GCC keeps an
// array of vectors in memory across the loop.
#define LLM_SUMS(r) Acc c##r##0 = z, c##r##1 = z, c##r##2 = z, c##r##3 = z;
#define LLM_DOT(r, v) \
  if constexpr (V > v) c##r##v = dot(c##r##v, a, w##v);
#define LLM_ROW(r)                                           \
  if constexpr (R > r) {                                     \
    const auto a = broadcast(x + r * ldx, s);                \
    LLM_DOT(r, 0) LLM_DOT(r, 1) LLM_DOT(r, 2) LLM_DOT(r, 3)  \
  }
#define LLM_ADD(r, v)                                                                     \
  if constexpr (R > r && V > v) {                                                         \
    float* t = totals + (r * kBlockTile + v) * kChannels;                                 \
    _mm512_storeu_ps(t, added(c##r##v, scale + v * lds, _mm512_loadu_ps(t)));             \
  }
#define LLM_ADD_ROW(r) LLM_ADD(r, 0) LLM_ADD(r, 1) LLM_ADD(r, 2) LLM_ADD(r, 3)

// R rows of x (ldx apart) times V blocks of w (ldw apart) over steps [s0, s1): the sums
// (times the blocks' scales, lds floats apart, for int8) added to totals
// [kRowTile][kBlockTile * 16].
template <typename X, typename W, int R, int V>
void span_tile(const X* x, int64_t ldx, const W* w, int64_t ldw, int64_t s0, int64_t s1,
               const float* scale, int64_t lds, float* totals) {
  using Acc = decltype(widened(w, 0));
  const Acc z{};
  LLM_SUMS(0) LLM_SUMS(1) LLM_SUMS(2) LLM_SUMS(3)
  for (int64_t s = s0; s < s1; ++s) {
    const Acc w0 = widened(w, s);
    const Acc w1 = V > 1 ? widened(w + ldw, s) : z;
    const Acc w2 = V > 2 ? widened(w + 2 * ldw, s) : z;
    const Acc w3 = V > 3 ? widened(w + 3 * ldw, s) : z;
    LLM_ROW(0) LLM_ROW(1) LLM_ROW(2) LLM_ROW(3)
  }
  LLM_ADD_ROW(0) LLM_ADD_ROW(1) LLM_ADD_ROW(2) LLM_ADD_ROW(3)
}

template <typename X, typename W>
using TileFn = void (*)(const X*, int64_t, const W*, int64_t, int64_t, int64_t, const float*,
                        int64_t, float*);
#define LLM_TILES(R)                                                              \
  {                                                                               \
    span_tile<X, W, R, 1>, span_tile<X, W, R, 2>, span_tile<X, W, R, 3>,          \
        span_tile<X, W, R, 4>                                                     \
  }
template <typename X, typename W>
constexpr TileFn<X, W> kTiles[kRowTile][kBlockTile] = {LLM_TILES(1), LLM_TILES(2),
                                                       LLM_TILES(3), LLM_TILES(4)};

// out [rows, out_ch] = x [rows, ldx] times the packed weight ([blocks] blocks of ldw
// values): each register tile's totals from its spans ((first, last step, scale offset),
// from spans(emit)), times row_scale (if given), plus the bias (if given).
template <typename X, typename W, typename Spans>
void tiled_product(const X* x, int64_t rows, int64_t ldx, const W* w, int64_t blocks,
                   int64_t ldw, const float* scale, int64_t lds, const float* row_scale,
                   const float* bias, int64_t out_ch, float* out, const Spans& spans) {
  at::parallel_for(0, blocks, kBlockTile, [&](int64_t b0, int64_t b1) {
    alignas(64) float totals[kRowTile * kBlockTile * kChannels];
    for (int64_t b = b0; b < b1; b += kBlockTile) {
      const int64_t v = std::min(kBlockTile, b1 - b);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int64_t n = std::min(kRowTile, rows - r0);
        std::fill(std::begin(totals), std::end(totals), 0.f);
        spans([&](int64_t s0, int64_t s1, int64_t scale_at) {
          kTiles<X, W>[n - 1][v - 1](x + r0 * ldx, ldx, w + b * ldw, ldw, s0, s1,
                                     scale + b * lds + scale_at, lds, totals);
        });
        for (int64_t r = 0; r < n; ++r)
          for (int64_t u = 0; u < v; ++u) {
            const int64_t c0 = (b + u) * kChannels, m = std::min(kChannels, out_ch - c0);
            const float* t = totals + (r * kBlockTile + u) * kChannels;
            const float rs = row_scale != nullptr ? row_scale[r0 + r] : 1.f;
            float* dst = out + (r0 + r) * out_ch + c0;
            for (int64_t c = 0; c < m; ++c)
              dst[c] = t[c] * rs + (bias != nullptr ? bias[c0 + c] : 0.f);
          }
      }
    }
  });
}

#endif  // LLM_CLUSTER_W8A16_TILES

bool w8a16_tiles_available() {
#ifdef LLM_CLUSTER_W8A16_TILES
  return true;
#else
  return false;
#endif
}

// x [..., in] fp32: its rows, and the output [..., out_ch] to fill.
std::pair<int64_t, at::Tensor> rows_and_out(const at::Tensor& x, int64_t out_ch,
                                            const char* name) {
  TORCH_CHECK(w8a16_tiles_available(), name, ": this build has no AVX-512 BW");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.is_contiguous() &&
                  x.size(-1) > 0,
              name, ": x must be contiguous float32 [..., in]");
  auto sizes = x.sizes().vec();
  sizes.back() = out_ch;
  return {x.numel() / x.size(-1), at::empty(sizes, x.options())};
}

void check_blocks(const at::Tensor& packed, at::ScalarType dtype, int64_t steps,
                  int64_t per_step, int64_t out_ch, const char* name) {
  TORCH_CHECK(packed.scalar_type() == dtype && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(0) * kChannels >= out_ch &&
                  packed.size(0) * kChannels < out_ch + kChannels && packed.size(1) == steps &&
                  packed.size(2) == kChannels && packed.size(3) == per_step,
              name, ": packed must be ", dtype, " [ceil(out / 16), ", steps, ", 16, ", per_step,
              "] for out = ", out_ch, "; got ", packed.sizes());
}

// x [..., in] fp32 rounded to int16 per row, times the int8 weight packed
// [blocks, in / 2, 16, 2] with scales [blocks, groups, 16] (zero for padding channels).
at::Tensor int16_tiles_linear(const at::Tensor& x, const at::Tensor& packed,
                              const at::Tensor& scale, const c10::optional<at::Tensor>& bias,
                              int64_t out_ch) {
  auto [rows, out] = rows_and_out(x, out_ch, "int16_tiles_linear");
  const int64_t in = x.size(-1), pairs = in / 2;
  TORCH_CHECK(in % 2 == 0, "int16_tiles_linear: the input width must be even; got ", in);
  check_blocks(packed, at::kChar, pairs, 2, out_ch, "int16_tiles_linear");
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 3 && scale.is_contiguous() &&
                  scale.size(0) == blocks && scale.size(2) == kChannels &&
                  pairs % scale.size(1) == 0,
              "int16_tiles_linear: scale must be float32 [", blocks, ", groups, 16] with groups "
              "dividing ", pairs, " input pairs; got ", scale.sizes());
  const float* bp = checked_bias(bias, out_ch, "int16_tiles_linear");
#ifdef LLM_CLUSTER_W8A16_TILES
  const int64_t groups = scale.size(1), group_pairs = pairs / groups;
  auto xq = at::empty({rows, in}, x.options().dtype(at::kShort));
  auto xs = at::empty({rows}, x.options());
  const float* xp = x.data_ptr<float>();
  int16_t* q = xq.data_ptr<int16_t>();
  float* s = xs.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) s[r] = quantize_row(xp + r * in, in, 32767.f, q + r * in);
  });
  tiled_product(q, rows, in, packed.data_ptr<int8_t>(), blocks, pairs * 2 * kChannels,
                scale.data_ptr<float>(), groups * kChannels, s, bp, out_ch,
                out.data_ptr<float>(), [&](const auto& span) {
                  for (int64_t g = 0; g < groups; ++g)
                    for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; p += kSpan / 2)
                      span(p, std::min(p + kSpan / 2, (g + 1) * group_pairs), g * kChannels);
                });
#endif
  return out;
}

// x [..., in] fp32 times the fp16 weight packed [blocks, in, 16, 1].
at::Tensor half_tiles_linear(const at::Tensor& x, const at::Tensor& packed,
                             const c10::optional<at::Tensor>& bias, int64_t out_ch) {
  auto [rows, out] = rows_and_out(x, out_ch, "half_tiles_linear");
  const int64_t in = x.size(-1);
  check_blocks(packed, at::kHalf, in, 1, out_ch, "half_tiles_linear");
  const float* bp = checked_bias(bias, out_ch, "half_tiles_linear");
#ifdef LLM_CLUSTER_W8A16_TILES
  tiled_product(x.data_ptr<float>(), rows, in, packed.data_ptr<at::Half>(), packed.size(0),
                in * kChannels, nullptr, 0, nullptr, bp, out_ch, out.data_ptr<float>(),
                [&](const auto& span) { span(0, in, 0); });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("w8a16_tiles_available() -> bool", &w8a16_tiles_available);
  m.def("int16_tiles_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int out_ch) "
        "-> Tensor");
  m.def("half_tiles_linear(Tensor x, Tensor packed, Tensor? bias, int out_ch) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("int16_tiles_linear", &int16_tiles_linear);
  m.impl("half_tiles_linear", &half_tiles_linear);
}
