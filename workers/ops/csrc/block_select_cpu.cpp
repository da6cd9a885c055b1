// Top-k retrieval blocks for sparse attention: kvcache/block_summary.py's ExactSelector
// for all of a layer's sparse rows in one call. In torch a row's selection is about ten
// ops (the query's parts, a batched product, the max over the GQA group, top-k, a sort):
// 100 us a row and layer at decode sizes on a 2-core EPYC, as long as attending its 2K
// selected tokens took (benchmarks/RESULTS.md). Here the blocks of every (row, KV head)
// are scored in one pass over their int8 scoring rows (kvcache/block_summary.py's
// scoring_rows), split over the threads by blocks, then each (row, KV head) takes a
// partial sort. Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "vec_math.h"

namespace {

// Summary kinds in kvcache.long_context.SUMMARY_KINDS order, by their scoring rows'
// vectors per block (block_summary.scoring_width): mean (1); minmax (2: lo, hi); hybrid
// (2: lo + mean, hi + mean).
constexpr int64_t kVectors[] = {1, 2, 2};

// The query heads [H, D] as parts matched to a scoring row's vectors (query_parts):
// q against the mean, its negative and positive parts against the other kinds' two.
void query_parts(const float* q, int64_t heads, int64_t dim, int64_t kind, float* parts) {
  const int64_t width = kVectors[kind] * dim;
  for (int64_t h = 0; h < heads; ++h) {
    const float* qh = q + h * dim;
    float* ph = parts + h * width;
    for (int64_t d = 0; d < dim; ++d) {
      if (kind == 0) {
        ph[d] = qh[d];
        continue;
      }
      ph[d] = std::min(qh[d], 0.f);
      ph[dim + d] = std::max(qh[d], 0.f);
    }
  }
}

// Indices (ascending) of the k highest of `scores` (no NaN: the comparison must be a strict
// order); equal scores rank the lower index first.
void top_k(const float* scores, int64_t m, int64_t k, int64_t* out) {
  std::vector<int64_t> idx(m);
  std::iota(idx.begin(), idx.end(), int64_t{0});
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  std::sort(idx.begin(), idx.begin() + k);
  std::copy(idx.begin(), idx.begin() + k, out);
}

// One (row, KV head) of a selection: its int8 scoring rows, one every `block_stride`
// bytes, each `vectors` kv_quant rows of `dim` values and a 2-byte fp16 scale; and its
// group's query parts [group, vectors * dim].
struct Task {
  const int8_t* rows;
  int64_t block_stride, group, row, head;
  const float* parts;
};

// A block's score from its group's best head; NaN ranks last (a strict order for the sort).
inline float rank_score(float best) { return std::isnan(best) ? -INFINITY : best; }

// Scores of a task's blocks [first, first + count), a kernel per GQA group size.
using ScoreFn = void (*)(const Task&, int64_t, int64_t, int64_t, int64_t, float*);

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 widen8(const int8_t* x) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
}

// Scores of blocks [first, first + count) of a task whose group has G heads and whose
// vectors' sizes are multiples of 8: each 8 widened values feed every head, two running
// sums a head and vector (one sum would wait on its own adds), the vector's scale applied
// to its sums once.
template <int G>
void score_group(const Task& task, int64_t first, int64_t count, int64_t vectors, int64_t dim,
                 float* out) {
  const int64_t width = vectors * dim;
  for (int64_t b = 0; b < count; ++b) {
    const int8_t* row = task.rows + (first + b) * task.block_stride;
    __m256 total[G];
    for (int g = 0; g < G; ++g) total[g] = _mm256_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      const int8_t* x = row + v * (dim + 2);
      const float* parts = task.parts + v * dim;
      __m256 acc[G][2];
      for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
      int64_t w = 0;
      for (; w + 16 <= dim; w += 16) {
        const __m256 x0 = widen8(x + w), x1 = widen8(x + w + 8);
        for (int g = 0; g < G; ++g) {
          const float* p = parts + g * width + w;
          acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(p), x0, acc[g][0]);
          acc[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(p + 8), x1, acc[g][1]);
        }
      }
      if (w < dim) {   // the last 8
        const __m256 x0 = widen8(x + w);
        for (int g = 0; g < G; ++g)
          acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(parts + g * width + w), x0, acc[g][0]);
      }
      const __m256 scale = _mm256_set1_ps(row_scale(x, dim));
      for (int g = 0; g < G; ++g)
        total[g] = _mm256_fmadd_ps(_mm256_add_ps(acc[g][0], acc[g][1]), scale, total[g]);
    }
    float best = -INFINITY;
    for (int g = 0; g < G; ++g) best = std::max(best, sum8(total[g]));
    out[b] = rank_score(best);
  }
}

constexpr ScoreFn kScoreGroup[] = {nullptr,         score_group<1>, score_group<2>,
                                   score_group<3>, score_group<4>, score_group<5>,
                                   score_group<6>, score_group<7>, score_group<8>};
#endif

#if defined(__AVX512F__)
// score_group for vectors whose size is a multiple of 64, 16 blocks at a time: their
// 64-byte pieces are transposed in registers (lane t of register c: bytes 4c..4c+3 of
// block t), so each of the 16 blocks' running sums is one lane of a register, each value
// is widened once for all G heads, and no block needs a horizontal sum. A step's
// selection at 128K tokens × 8 took 10-17% less time (benchmarks/RESULTS.md).
template <int G>
void score_group16(const Task& task, int64_t first, int64_t count, int64_t vectors,
                   int64_t dim, float* out) {
  const int64_t width = vectors * dim;
  const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t b0 = 0; b0 < count; b0 += 16) {
    const int64_t n = std::min<int64_t>(16, count - b0);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    const int8_t* base = task.rows + (first + b0) * task.block_stride;
    __m512 total[G];
    for (int g = 0; g < G; ++g) total[g] = _mm512_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      const int8_t* vec = base + v * (dim + 2);
      __m512 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
      for (int64_t c0 = 0; c0 < dim; c0 += 64) {
        __m512i x[16];
        load_transposed16(vec + c0, task.block_stride, n, x);
        const float* parts = task.parts + v * dim + c0;
        for (int c = 0; c < 16; ++c)
          for (int k = 0; k < 4; ++k) {   // byte k of each lane, sign-extended
            const __m512 xk = _mm512_cvtepi32_ps(
                _mm512_srai_epi32(_mm512_slli_epi32(x[c], 24 - 8 * k), 24));
            for (int g = 0; g < G; ++g)
              acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(parts[g * width + 4 * c + k]), xk, acc[g]);
          }
      }
      alignas(64) float scales[16] = {};
      for (int64_t t = 0; t < n; ++t) scales[t] = row_scale(vec + t * task.block_stride, dim);
      const __m512 s = _mm512_load_ps(scales);
      for (int g = 0; g < G; ++g) total[g] = _mm512_fmadd_ps(acc[g], s, total[g]);
    }
    // The best head, a NaN head skipped as score_group's std::max skips it (-inf if all).
    __m512 best = minus_inf;
    for (int g = 0; g < G; ++g) {
      const __mmask16 nan = _mm512_cmp_ps_mask(total[g], total[g], _CMP_UNORD_Q);
      best = _mm512_max_ps(best, _mm512_mask_mov_ps(total[g], nan, minus_inf));
    }
    _mm512_mask_storeu_ps(out + b0, mask, best);
  }
}

constexpr ScoreFn kScoreGroup16[] = {nullptr,           score_group16<1>, score_group16<2>,
                                     score_group16<3>, score_group16<4>, score_group16<5>,
                                     score_group16<6>, score_group16<7>, score_group16<8>};
#endif

// Scores of blocks [first, first + count) of `task`, each its group's best head.
void score_blocks(const Task& task, int64_t first, int64_t count, int64_t vectors,
                  int64_t dim, float* out) {
#if defined(__AVX512F__)
  if (dim % 64 == 0 && task.group <= 8)
    return kScoreGroup16[task.group](task, first, count, vectors, dim, out);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 8 == 0 && task.group <= 8)
    return kScoreGroup[task.group](task, first, count, vectors, dim, out);
#endif
  const int64_t width = vectors * dim;
  std::vector<float> x(width);   // the row's vectors, dequantized
  for (int64_t b = 0; b < count; ++b) {
    const int8_t* row = task.rows + (first + b) * task.block_stride;
    for (int64_t v = 0; v < vectors; ++v) widen(row + v * (dim + 2), x.data() + v * dim, dim);
    float best = -INFINITY;
    for (int64_t g = 0; g < task.group; ++g)
      best = std::max(best, dot(task.parts + g * width, x.data(), width));
    out[b] = rank_score(best);
  }
}

// Per row r: indices [KVH, min(k_r, M_r)] of the blocks of rows[r] [KVH, M_r, V * (D + 2)]
// (an int8 scoring-row view; its last dimension contiguous) that score highest for queries[r]
// [H, D]: a block's score is the best of the KV head's group of query heads. Scoring is
// split over the threads by blocks, not by (row, KV head): at batch 1 three KV heads on
// two threads would leave one thread reading two heads' rows while the other idles.
// Row r's query is queries[query_rows[r]] (every query row in order when empty).
std::vector<at::Tensor> select_rows(const at::Tensor& queries, at::IntArrayRef query_rows,
                                    at::TensorList rows, at::IntArrayRef ks, int64_t kind) {
  TORCH_CHECK(queries.scalar_type() == at::kFloat && queries.dim() == 3 &&
                  queries.stride(2) == 1 && queries.stride(1) == queries.size(2),
              "select_blocks: queries must be float32 [rows, heads, head_dim], each row's "
              "heads contiguous");
  TORCH_CHECK(kind >= 0 && kind <= 2, "select_blocks: kind must be 0 (mean), 1 (minmax) "
              "or 2 (hybrid)");
  const int64_t heads = queries.size(1), dim = queries.size(2);
  const int64_t n = query_rows.empty() ? queries.size(0) : query_rows.size();
  const int64_t width = kVectors[kind] * dim;
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == n && static_cast<int64_t>(ks.size()) == n,
              "select_blocks: one scoring-row tensor and one k per query row");
  for (int64_t q : query_rows)
    TORCH_CHECK(q >= 0 && q < queries.size(0), "select_blocks: query row ", q,
                " is not in [0, ", queries.size(0), ")");
  // Task t's blocks' scores start at first_score[t].
  std::vector<Task> tasks;
  std::vector<int64_t> first_score(1, 0);
  std::vector<at::Tensor> out(n);
  auto parts = at::empty({n, heads, width}, queries.options());
  for (int64_t r = 0; r < n; ++r) {
    const at::Tensor& row = rows[r];
    TORCH_CHECK(row.scalar_type() == at::kChar && row.dim() == 3 &&
                    row.size(2) == kVectors[kind] * (dim + 2) && row.stride(2) == 1 &&
                    row.size(0) > 0 && heads % row.size(0) == 0,
                "select_blocks: each rows tensor must be int8 [KVH, M, V * (D + 2)] with a "
                "contiguous last dimension and KVH dividing the query heads");
    TORCH_CHECK(ks[r] > 0, "select_blocks: k must be positive");
    out[r] = at::empty({row.size(0), std::min(ks[r], row.size(1))},
                       queries.options().dtype(at::kLong));
    float* row_parts = parts.data_ptr<float>() + r * heads * width;
    const int64_t q_row = query_rows.empty() ? r : query_rows[r];
    query_parts(queries.data_ptr<float>() + q_row * queries.stride(0), heads, dim, kind,
                row_parts);
    const int64_t group = heads / row.size(0);
    for (int64_t h = 0; h < row.size(0); ++h) {
      tasks.push_back({row.data_ptr<int8_t>() + h * row.stride(0), row.stride(1), group, r,
                       h, row_parts + h * group * width});
      first_score.push_back(first_score.back() + row.size(1));
    }
  }
  std::vector<float> scores(first_score.back());
  // Below a few hundred blocks (~20 ns each), waking a thread costs more than it saves.
  constexpr int64_t kBlocksPerThread = 256;
  at::parallel_for(0, first_score.back(), kBlocksPerThread, [&](int64_t begin, int64_t end) {
    int64_t t = std::upper_bound(first_score.begin(), first_score.end(), begin) -
                first_score.begin() - 1;
    while (begin < end) {
      const int64_t stop = std::min(end, first_score[t + 1]);
      score_blocks(tasks[t], begin - first_score[t], stop - begin, kVectors[kind], dim,
                   scores.data() + begin);
      begin = stop;
      ++t;
    }
  });
  const int64_t num_tasks = tasks.size();
  const int64_t per_task = std::max<int64_t>(
      1, kBlocksPerThread * num_tasks / std::max<int64_t>(1, first_score.back()));
  at::parallel_for(0, num_tasks, per_task, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const at::Tensor& o = out[tasks[t].row];
      top_k(scores.data() + first_score[t], first_score[t + 1] - first_score[t], o.size(1),
            o.data_ptr<int64_t>() + tasks[t].head * o.size(1));
    }
  });
  return out;
}

std::vector<at::Tensor> select_blocks(const at::Tensor& queries, at::TensorList rows,
                                      at::IntArrayRef ks, int64_t kind) {
  return select_rows(queries, {}, rows, ks, kind);
}

// select_blocks for rows[r] with query q[query_rows[r]], each selection then written into
// the step's per-head block tables [B, KVH, width] (int64): head h of table row
// query_rows[r], from column firsts[r], takes the pool blocks middles[r] [M_r, per_block]
// of its selected middle blocks, in their (ascending) order. One call per layer instead of
// a gather of the queries and an indexed table write around the selection, which at
// batch 1 cost as much as attending the 2K tokens they choose (benchmarks/RESULTS.md).
std::vector<at::Tensor> select_into_tables(const at::Tensor& q, at::IntArrayRef query_rows,
                                           at::TensorList rows, at::IntArrayRef ks,
                                           int64_t kind, at::TensorList middles,
                                           at::IntArrayRef firsts, at::Tensor tables) {
  const int64_t n = query_rows.size();
  TORCH_CHECK(n > 0 && static_cast<int64_t>(middles.size()) == n &&
                  static_cast<int64_t>(firsts.size()) == n,
              "select_into_tables: one query row, middle and first column per row");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 3 && tables.stride(2) == 1,
              "select_into_tables: tables must be int64 [rows, KVH, width] with a contiguous "
              "last dimension");
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == n && static_cast<int64_t>(ks.size()) == n,
              "select_into_tables: one scoring-row tensor and one k per row");
  // Every row's place in the tables is checked before anything is written.
  for (int64_t r = 0; r < n; ++r) {
    const at::Tensor& mid = middles[r];
    TORCH_CHECK(query_rows[r] >= 0 && query_rows[r] < tables.size(0), "select_into_tables: "
                "row ", query_rows[r], " is not a row of the tables [0, ", tables.size(0), ")");
    TORCH_CHECK(mid.scalar_type() == at::kLong && mid.dim() == 2 && mid.stride(1) == 1 &&
                    rows[r].dim() == 3 && mid.size(0) == rows[r].size(1),
                "select_into_tables: middles[", r, "] must be int64 [M, per_block] with "
                "the row's M blocks and a contiguous last dimension");
    const int64_t w = std::min(ks[r], rows[r].size(1)), per = mid.size(1);
    TORCH_CHECK(rows[r].size(0) == tables.size(1) && firsts[r] >= 0 &&
                    firsts[r] + w * per <= tables.size(2),
                "select_into_tables: row ", r, "'s ", w, " blocks of ", per,
                " from column ", firsts[r], " do not fit the tables' ", tables.size(1),
                " heads of ", tables.size(2), " columns");
  }
  auto out = select_rows(q, query_rows, rows, ks, kind);
  int64_t* tab = tables.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    const at::Tensor& mid = middles[r];
    const at::Tensor& sel = out[r];
    const int64_t kvh = sel.size(0), w = sel.size(1), per = mid.size(1);
    const int64_t* m = mid.data_ptr<int64_t>();
    const int64_t* chosen = sel.data_ptr<int64_t>();
    for (int64_t h = 0; h < kvh; ++h) {
      int64_t* dst = tab + query_rows[r] * tables.stride(0) + h * tables.stride(1) + firsts[r];
      for (int64_t j = 0; j < w; ++j)
        for (int64_t t = 0; t < per; ++t)
          dst[j * per + t] = m[chosen[h * w + j] * mid.stride(0) + t];
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("select_blocks(Tensor queries, Tensor[] rows, int[] ks, int kind) -> Tensor[]");
  m.def("select_into_tables(Tensor q, int[] query_rows, Tensor[] rows, int[] ks, int kind, "
        "Tensor[] middles, int[] firsts, Tensor(a!) tables) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("select_blocks", &select_blocks);
  m.impl("select_into_tables", &select_into_tables);
}
