// How a MoE block's native call (moe_experts.cpp: int4 experts; moe_mxfp4_experts.cpp:
// MXFP4 ones) runs a step's chosen experts and sums their outputs into the rows.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace exo_native::moe {

// Calls run(e) once for each of the step's `experts` chosen experts (0 .. experts - 1).
//
// Where every chosen expert has few rows (`few_rows`: a decode step's; the products then
// take the decode kernels) and there are at least two per thread, the experts are shared out
// among the threads: each takes the next expert not yet taken and runs it whole, its
// products on its own thread (at::parallel_for inside a parallel region runs inline). That
// is one parallel region per MoE block instead of one per product (two or three per expert),
// and each thread reads whole experts' weights as one stream. Otherwise one expert after
// another, each product split over the threads by output rows. Each output row of a
// product is computed alone either way, so the split changes no bits.
template <typename Run>
void for_chosen_experts(int64_t experts, bool few_rows, Run&& run) {
  const int64_t threads = at::get_num_threads();
  if (few_rows && threads > 1 && experts >= 2 * threads && !at::in_parallel_region()) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t e = next.fetch_add(1); e < experts; e = next.fetch_add(1)) run(e);
    });
    return;
  }
  for (int64_t e = 0; e < experts; ++e) run(e);
}

// The chosen experts' outputs weighted and added into y [total, hidden]: outputs holds each
// choice's unweighted output row, [spans.back() - spans.front(), hidden] from choice
// spans.front() on; spans [2 E'] the (start, end) of each chosen expert's choices, ascending;
// row_index / weight each choice's row and routing weight. Scaled in one pass and added in
// another, expert after expert in ascending order: the product and the sum each rounded, as
// moe.dispatch's multiply and index_add_ round them (one loop would let -mfma contract
// them), so the result is the per-expert path's bit for bit.
inline void add_weighted(const std::vector<int64_t>& spans, float* outputs,
                         const int64_t* row_index, const float* weight, int64_t hidden,
                         float* y) {
  if (spans.empty()) return;
  const int64_t first = spans.front();
  for (size_t e = 0; 2 * e < spans.size(); ++e) {
    const int64_t start = spans[2 * e], end = spans[2 * e + 1];
    for (int64_t c = start; c < end; ++c) {
      float* source = outputs + (c - first) * hidden;
      const float scale = weight[c];
      for (int64_t h = 0; h < hidden; ++h) source[h] *= scale;
    }
    for (int64_t c = start; c < end; ++c) {
      float* target = y + row_index[c] * hidden;
      const float* source = outputs + (c - first) * hidden;
      for (int64_t h = 0; h < hidden; ++h) target[h] += source[h];
    }
  }
}

// Whether each of the spans' experts has at most `most` choices (rows).
inline bool few_rows_each(const std::vector<int64_t>& spans, int64_t most) {
  for (size_t e = 0; 2 * e < spans.size(); ++e)
    if (spans[2 * e + 1] - spans[2 * e] > most) return false;
  return true;
}

}  // namespace exo_native::moe
