// Top-k retrieval blocks for sparse attention: kvcache/block_summary.py's ExactSelector
// for all of a layer's sparse rows in one call. In torch a row's selection is about ten
// ops (the query's parts, a batched product, the max over the GQA group, top-k, a sort):
// 100 us a row and layer at decode sizes on a 2-core EPYC, as long as attending its 2K
// selected tokens took (benchmarks/RESULTS.md). Here each (row, KV head) is one pass over
// its scoring rows and a partial sort. Registered under torch.ops.llm_cluster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

// Summary kinds in kvcache.long_context.SUMMARY_KINDS order, by their vectors per block: mean (1);
// minmax (2: lo, hi); hybrid (3: lo, hi, mean).
constexpr int64_t kVectors[] = {1, 2, 3};

// The query heads [H, D] as parts matched to a scoring row's vectors (query_parts):
// q against the mean, its negative and positive parts against the bounds (lo, hi).
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
      if (kind == 2) ph[2 * dim + d] = qh[d];
    }
  }
}

// Indices (ascending) of the k highest of `scores` (no NaN: the comparison must be a strict
// order); equal scores rank the lower index first.
void top_k(const std::vector<float>& scores, int64_t k, int64_t* out) {
  std::vector<int64_t> idx(scores.size());
  std::iota(idx.begin(), idx.end(), int64_t{0});
  std::nth_element(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
    return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
  });
  std::sort(idx.begin(), idx.begin() + k);
  std::copy(idx.begin(), idx.begin() + k, out);
}

// Per row r: indices [KVH, min(k_r, M_r)] of the blocks of rows[r] [KVH, M_r, S * D] (a
// scoring-row view; its last dimension contiguous) that score highest for queries[r]
// [H, D]: a block's score is the best of the KV head's group of query heads.
std::vector<at::Tensor> select_blocks(const at::Tensor& queries, at::TensorList rows,
                                      at::IntArrayRef ks, int64_t kind) {
  TORCH_CHECK(queries.scalar_type() == at::kFloat && queries.dim() == 3 &&
                  queries.is_contiguous(),
              "select_blocks: queries must be contiguous float32 [rows, heads, head_dim]");
  TORCH_CHECK(kind >= 0 && kind <= 2, "select_blocks: kind must be 0 (mean), 1 (minmax) "
              "or 2 (hybrid)");
  const int64_t n = queries.size(0), heads = queries.size(1), dim = queries.size(2);
  const int64_t width = kVectors[kind] * dim;
  TORCH_CHECK(static_cast<int64_t>(rows.size()) == n && static_cast<int64_t>(ks.size()) == n,
              "select_blocks: one scoring-row tensor and one k per query row");
  std::vector<at::Tensor> out(n);
  std::vector<int64_t> first_task(n + 1, 0);
  for (int64_t r = 0; r < n; ++r) {
    const at::Tensor& row = rows[r];
    TORCH_CHECK(row.scalar_type() == at::kFloat && row.dim() == 3 && row.size(2) == width &&
                    row.stride(2) == 1 && row.size(0) > 0 && heads % row.size(0) == 0,
                "select_blocks: each rows tensor must be float32 [KVH, M, S * D] with a "
                "contiguous last dimension and KVH dividing the query heads");
    TORCH_CHECK(ks[r] > 0, "select_blocks: k must be positive");
    out[r] = at::empty({row.size(0), std::min(ks[r], row.size(1))}, queries.options().dtype(at::kLong));
    first_task[r + 1] = first_task[r] + row.size(0);
  }
  auto parts = at::empty({n, heads, width}, queries.options());
  for (int64_t r = 0; r < n; ++r)
    query_parts(queries.data_ptr<float>() + r * heads * dim, heads, dim, kind,
                parts.data_ptr<float>() + r * heads * width);
  const float* pp = parts.data_ptr<float>();
  at::parallel_for(0, first_task[n], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = std::upper_bound(first_task.begin(), first_task.end(), t) -
                        first_task.begin() - 1;
      const at::Tensor& row = rows[r];
      const int64_t h = t - first_task[r], m_blocks = row.size(1);
      const int64_t group = heads / row.size(0);
      const float* p = pp + (r * heads + h * group) * width;
      const float* base = row.data_ptr<float>() + h * row.stride(0);
      scores.assign(m_blocks, 0.f);
      for (int64_t m = 0; m < m_blocks; ++m) {
        const float* x = base + m * row.stride(1);
        float best = -INFINITY;
        for (int64_t g = 0; g < group; ++g) {
          const float* pg = p + g * width;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t w = 0; w < width; ++w) s += pg[w] * x[w];
          best = std::max(best, s);
        }
        scores[m] = std::isnan(best) ? -INFINITY : best;   // a strict order for the sort
      }
      top_k(scores, out[r].size(1), out[r].data_ptr<int64_t>() + h * out[r].size(1));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cluster, m) {
  m.def("select_blocks(Tensor queries, Tensor[] rows, int[] ks, int kind) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(llm_cluster, CPU, m) {
  m.impl("select_blocks", &select_blocks);
}
