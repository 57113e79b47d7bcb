// How a MoE block's native call (moe_experts.cpp: int4 experts; moe_mxfp4_experts.cpp:
// MXFP4 ones) runs a step's chosen experts and sums their outputs into the rows.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace exo_native::moe {

// Whether a step's chosen experts (spans [2 E']: each one's (start, end) in the choices) are
// better shared out among `threads` threads, each running whole experts, than run one after
// another with each product split over the threads: where there are at least two per thread,
// and either every one has at most `few` rows (a decode step's; its products are the decode
// kernels) or none has more rows than a thread's share of them all (a prompt's: the largest
// expert, run first, cannot leave the other threads idle for long). A prompt of
// Qwen3-30B-A3B's shapes spreads 128 or 512 rows over ~100-128 experts of 8-32 rows: split
// over two threads, each product of an expert of 8 rows is a ~0.2 ms parallel region, and
// its rounding of the activations another.
inline bool share_out(const std::vector<int64_t>& spans, int64_t threads, int64_t few) {
  const int64_t experts = static_cast<int64_t>(spans.size() / 2);
  if (threads < 2 || experts < 2 * threads) return false;
  int64_t largest = 0, total = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = spans[2 * e + 1] - spans[2 * e];
    largest = std::max(largest, rows);
    total += rows;
  }
  return largest <= few || largest * threads <= total;
}

// Calls run(e) once for each chosen expert of `spans` (e = 0 .. E' - 1).
//
// Where `share_out` says so, the experts are shared out among the threads: each takes the
// next expert not yet taken, the experts with the most rows first (the longest-first rule:
// the last experts taken are the shortest, so the threads finish close together), and runs
// it whole, its products on its own thread (at::parallel_for inside a parallel region runs
// inline). That is one parallel region per MoE block instead of one or two per product,
// and each thread reads whole experts' weights as one stream. Otherwise one expert after
// another, each product split over the threads by output rows. Each output row of a
// product is computed alone either way, and each expert writes only its own choices'
// outputs, so neither the split nor the order changes a bit.
template <typename Run>
void for_chosen_experts(const std::vector<int64_t>& spans, int64_t few, Run&& run) {
  const int64_t experts = static_cast<int64_t>(spans.size() / 2);
  const int64_t threads = at::get_num_threads();
  if (!at::in_parallel_region() && share_out(spans, threads, few)) {
    std::vector<int64_t> order(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    const auto rows = [&](int64_t e) { return spans[2 * e + 1] - spans[2 * e]; };
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return rows(a) > rows(b); });
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t i = next.fetch_add(1); i < experts; i = next.fetch_add(1)) run(order[i]);
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
// them), so the result is the per-expert path's bit for bit. A prompt's (at least 2^16
// values) is split over the threads by columns of hidden: each value of y still takes its
// additions in ascending expert order, so the split changes no bit.
inline void add_weighted(const std::vector<int64_t>& spans, float* outputs,
                         const int64_t* row_index, const float* weight, int64_t hidden,
                         float* y) {
  if (spans.empty()) return;
  const int64_t first = spans.front();
  const auto columns = [&](int64_t h0, int64_t h1) {
    for (size_t e = 0; 2 * e < spans.size(); ++e) {
      const int64_t start = spans[2 * e], end = spans[2 * e + 1];
      for (int64_t c = start; c < end; ++c) {
        float* source = outputs + (c - first) * hidden;
        const float scale = weight[c];
        for (int64_t h = h0; h < h1; ++h) source[h] *= scale;
      }
      for (int64_t c = start; c < end; ++c) {
        float* target = y + row_index[c] * hidden;
        const float* source = outputs + (c - first) * hidden;
        for (int64_t h = h0; h < h1; ++h) target[h] += source[h];
      }
    }
  };
  if ((spans.back() - first) * hidden < (int64_t{1} << 16) || at::in_parallel_region()) {
    columns(0, hidden);
    return;
  }
  // Column ranges of whole 64-byte lines (16 floats), so no two threads write one line.
  const int64_t lines = (hidden + 15) / 16;
  at::parallel_for(0, lines, 1, [&](int64_t l0, int64_t l1) {
    columns(16 * l0, std::min(hidden, 16 * l1));
  });
}

}  // namespace exo_native::moe
