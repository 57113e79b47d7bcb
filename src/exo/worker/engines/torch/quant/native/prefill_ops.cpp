// Prefill steps' elementwise operators (called by ../../model/direct_forward.py between the prefill
// products): the gated activation and the per-head q/k norms + rotary, over the step's rows
// in parallel, with the decode layer's per-row code (row_ops.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "row_ops.h"

namespace {

using exo_native::row_ops::activate_rows;
using exo_native::row_ops::kGelu;
using exo_native::row_ops::kSilu;
using exo_native::row_ops::norm_rotate_heads;

// A prefill step's gated activation, act(gate) * up, over its rows in parallel:
// gate_up float32 [rows, 2 I] (gate, then up) -> [rows, I]. torch's tanh GELU is slow on
// CPU (and the product with `up` a second pass); `activate_rows` does both in one pass
// (figures: docs/benchmarks/engine-design-figures.md#prefill_opscpp).
at::Tensor gated_activation(const at::Tensor& gate_up, int64_t activation) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat &&
                  gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gated_activation: gate_up must be a contiguous float32 [rows, 2 I] tensor");
  TORCH_CHECK(activation >= kSilu && activation <= kGelu,
              "gated_activation: activation must be 0 (SiLU), 1 (tanh GELU) or 2 (GELU)");
  const int64_t rows = gate_up.size(0), intermediate = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, intermediate}, gate_up.options());
  const float* input = gate_up.data_ptr<float>();
  float* output = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(intermediate, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = input + r * 2 * intermediate;
      activate_rows(gate, gate + intermediate, intermediate, activation,
                    output + r * intermediate);
    }
  });
  return out;
}

// A prefill step's per-head q/k norms and rotary over its rows in parallel, in place:
// qkv float32 [rows, width] (each row's first `heads` heads of head_dim: queries then
// keys), norm float32 [heads, head_dim] or none, cos / sin float32 [rows, head_dim], perm
// int64 [head_dim] (direct_forward_parts.rotary_tables). torch's operators (rms_norm, the
// weight's product, then x cos + x[perm] sin with a gather over the last dimension) took
// several passes over the rows (figures: docs/benchmarks/engine-design-figures.md#prefill_opscpp).
void qk_norm_rotary(at::Tensor& qkv, int64_t heads, int64_t head_dim,
                    const std::optional<at::Tensor>& norm, double eps, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& perm) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() &&
                  heads > 0 && head_dim > 0 && heads * head_dim <= qkv.size(1),
              "qk_norm_rotary: qkv must be a contiguous float32 [rows, width] tensor holding "
              "heads x head_dim values per row");
  const int64_t rows = qkv.size(0), width = qkv.size(1);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && cos.size(1) == head_dim &&
                  cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat &&
                  sin.is_contiguous(),
              "qk_norm_rotary: cos / sin must be contiguous float32 [rows, head_dim]");
  TORCH_CHECK(perm.dim() == 1 && perm.size(0) == head_dim && perm.scalar_type() == at::kLong &&
                  perm.is_contiguous(),
              "qk_norm_rotary: perm must be int64 [head_dim]");
  const int64_t* perm_p = perm.data_ptr<int64_t>();
  for (int64_t d = 0; d < head_dim; ++d)
    TORCH_CHECK(perm_p[d] >= 0 && perm_p[d] < head_dim, "qk_norm_rotary: perm out of range");
  const float* norm_p = nullptr;
  if (norm.has_value()) {
    TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() &&
                    norm->numel() == heads * head_dim,
                "qk_norm_rotary: norm must be float32 [heads, head_dim]");
    norm_p = norm->data_ptr<float>();
  }
  float* qkv_p = qkv.data_ptr<float>();
  const float* cos_p = cos.data_ptr<float>();
  const float* sin_p = sin.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 16384 / (heads * head_dim));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(head_dim));
    for (int64_t r = begin; r < end; ++r)
      norm_rotate_heads(qkv_p + r * width, heads, head_dim, norm_p, static_cast<float>(eps),
                        cos_p + r * head_dim, sin_p + r * head_dim, perm_p, scratch.data());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def(
      "qk_norm_rotary(Tensor(a!) qkv, int heads, int head_dim, Tensor? norm, float eps, "
      "Tensor cos, Tensor sin, Tensor perm) -> ()");
  m.def("gated_activation(Tensor gate_up, int activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) {
  m.impl("gated_activation", &gated_activation);
  m.impl("qk_norm_rotary", &qk_norm_rotary);
}
