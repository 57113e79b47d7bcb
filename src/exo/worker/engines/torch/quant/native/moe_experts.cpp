// A MoE block's routed experts held as exo's int4 blocks, all of a step's chosen experts in
// one call (called by ../../model/direct_forward_moe.py in place of one Python call per
// expert): each expert's rows gathered, its fused gate/up product, the gated activation,
// its down product, and the weighted sum into the rows' outputs.
//
// The products are the ones the per-expert path calls (Int4Linear.matmul): the decode
// kernel (int4_product) for up to kDecodeMaxRows rows, prefill's block_matmul above, with the
// caller's activation rounding; the activation is torch's own operator on the same slices
// and the weighted outputs are added into each row in ascending expert order, as
// moe.dispatch's index_add_ adds them. So the result is bit for bit the per-expert path's
// (tested: ../../tests/test_moe_native.py). What it saves is the ~20 torch operators a
// Python expert call dispatches (gathers, casts, slices, scaling), per expert per layer: a
// decode step of Qwen3-30B-A3B calls 8 experts in each of 48 layers.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

// Int4Linear.matmul's crossover (quant/quantized_linear.py NATIVE_BLOCK_MAX_ROWS): up to
// this many rows the decode kernel, above it prefill's block_matmul.
constexpr int64_t kDecodeMaxRows = 7;

// activation codes as decode_layer.cpp numbers them (direct_forward_parts.activation_code).
constexpr int64_t kSilu = 0;
constexpr int64_t kGeluTanh = 1;
constexpr int64_t kGelu = 2;

// How a product rounds its activations above kDecodeMaxRows rows: block_matmul's
// activation_bits, int16_rows and bf16 (quantized_linear.prefill_product).
struct ProductMode {
  int64_t bits;
  int64_t int16_rows;
  bool bf16;
};

ProductMode product_mode(at::IntArrayRef mode, const char* name) {
  TORCH_CHECK(mode.size() == 3, "moe_int4_experts: ", name,
              " must be [activation_bits, int16_rows, bf16], got ", mode.size(), " values");
  return {mode[0], mode[1], mode[2] != 0};
}

void product(const float* x, int64_t rows, int64_t k, const at::Tensor& packed,
             const at::Tensor& scale_zero, float* y, const ProductMode& mode) {
  if (rows <= kDecodeMaxRows) {
    exo_native::int4_product(x, rows, k, packed, scale_zero, y);
  } else {
    exo_native::block_matmul(x, rows, k, packed, scale_zero, y, mode.bits, mode.int16_rows,
                             mode.bf16);
  }
}

void check_int4(const at::Tensor& packed, const at::Tensor& scale_zero, int64_t in,
                const char* name, size_t expert) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) * 2 == in,
              "moe_int4_experts: ", name, "[", expert, "] must be contiguous uint8 [out, ", in / 2,
              "]");
  const int64_t groups = exo_native::int4_group_count(scale_zero);
  TORCH_CHECK(scale_zero.is_contiguous() && scale_zero.size(0) == packed.size(0) &&
                  (exo_native::is_q4k_scales(scale_zero)
                       ? groups * 32 == in
                       : scale_zero.dim() == 3 && scale_zero.size(2) == 2 &&
                             scale_zero.scalar_type() == at::kBFloat16 && groups > 0 &&
                             in % groups == 0 && (in / groups) % 32 == 0),
              "moe_int4_experts: ", name, " scales [", expert,
              "] must be contiguous bfloat16 [out, groups, 2] with groups of a multiple of 32, "
              "or compact Q4_K scales uint8 [out, in / 256, 20]");
}

// rows float32 [T, hidden]; row_of int64 [C] and weight_of float32 [C]: the step's choices
// grouped by expert (moe.dispatch's order); spans [2 E']: each listed expert's (start, end)
// in them, experts ascending; gate_up / down (and their scales): the listed experts' int4
// weights, gate_up [2 I, hidden / 2], down [hidden, I / 2]. Returns float32 [T, hidden].
at::Tensor moe_int4_experts(const at::Tensor& rows, const at::Tensor& row_of,
                            const at::Tensor& weight_of, at::IntArrayRef spans,
                            at::TensorList gate_up, at::TensorList gate_up_scales,
                            at::TensorList down, at::TensorList down_scales, int64_t activation,
                            at::IntArrayRef gate_up_mode, at::IntArrayRef down_mode) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous(),
              "moe_int4_experts: rows must be a contiguous float32 [rows, hidden] tensor");
  TORCH_CHECK(row_of.dim() == 1 && row_of.scalar_type() == at::kLong && row_of.is_contiguous(),
              "moe_int4_experts: row_of must be a contiguous int64 [choices] tensor");
  TORCH_CHECK(weight_of.dim() == 1 && weight_of.scalar_type() == at::kFloat &&
                  weight_of.is_contiguous() && weight_of.size(0) == row_of.size(0),
              "moe_int4_experts: weight_of must be a contiguous float32 tensor like row_of");
  const size_t experts = gate_up.size();
  TORCH_CHECK(spans.size() == 2 * experts && gate_up_scales.size() == experts &&
                  down.size() == experts && down_scales.size() == experts,
              "moe_int4_experts: spans must hold (start, end) for each of the ", experts,
              " experts given, and each expert needs gate_up, down and their scales");
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh || activation == kGelu,
              "moe_int4_experts: activation must be 0 (SiLU), 1 (tanh GELU) or 2 (GELU), not ",
              activation);
  const ProductMode gate_up_rounding = product_mode(gate_up_mode, "gate_up_mode");
  const ProductMode down_rounding = product_mode(down_mode, "down_mode");
  const int64_t total = rows.size(0), hidden = rows.size(1), choices = row_of.size(0);
  at::Tensor out = at::zeros({total, hidden}, rows.options());
  const float* x = rows.data_ptr<float>();
  const int64_t* row_index = row_of.data_ptr<int64_t>();
  const float* weight = weight_of.data_ptr<float>();
  float* y = out.data_ptr<float>();
  std::vector<float> gathered;
  for (size_t e = 0; e < experts; ++e) {
    const int64_t start = spans[2 * e], end = spans[2 * e + 1];
    TORCH_CHECK(0 <= start && start <= end && end <= choices, "moe_int4_experts: span ", e,
                " (", start, ", ", end, ") is outside the ", choices, " choices");
    const int64_t n = end - start;
    if (n == 0) continue;
    check_int4(gate_up[e], gate_up_scales[e], hidden, "gate_up", e);
    const int64_t width = gate_up[e].size(0) / 2;  // the expert's intermediate width
    check_int4(down[e], down_scales[e], width, "down", e);
    TORCH_CHECK(down[e].size(0) == hidden, "moe_int4_experts: down[", e, "] has ",
                down[e].size(0), " outputs, rows have ", hidden);
    gathered.resize(static_cast<size_t>(n * hidden));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t row = row_index[start + j];
      TORCH_CHECK(0 <= row && row < total, "moe_int4_experts: row ", row, " outside ", total);
      std::memcpy(gathered.data() + j * hidden, x + row * hidden, hidden * sizeof(float));
    }
    at::Tensor projected = at::empty({n, 2 * width}, rows.options());
    product(gathered.data(), n, hidden, gate_up[e], gate_up_scales[e],
            projected.data_ptr<float>(), gate_up_rounding);
    const at::Tensor gate = projected.narrow(1, 0, width);
    at::Tensor activated = activation == kSilu ? at::silu(gate)
                           : activation == kGeluTanh ? at::gelu(gate, "tanh")
                                                     : at::gelu(gate);
    activated.mul_(projected.narrow(1, width, width));
    at::Tensor expert_out = at::empty({n, hidden}, rows.options());
    float* down_out = expert_out.data_ptr<float>();
    product(activated.data_ptr<float>(), n, width, down[e], down_scales[e], down_out,
            down_rounding);
    // Scaled in one pass and added in another: the product and the sum each rounded, as
    // dispatch's multiply and index_add_ round them (one loop would let -mfma contract them).
    for (int64_t j = 0; j < n; ++j) {
      float* source = down_out + j * hidden;
      const float scale = weight[start + j];
      for (int64_t h = 0; h < hidden; ++h) source[h] *= scale;
    }
    for (int64_t j = 0; j < n; ++j) {
      float* target = y + row_index[start + j] * hidden;
      const float* source = down_out + j * hidden;
      for (int64_t h = 0; h < hidden; ++h) target[h] += source[h];
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def(
      "moe_int4_experts(Tensor rows, Tensor row_of, Tensor weight_of, int[] spans, "
      "Tensor[] gate_up, Tensor[] gate_up_scales, Tensor[] down, Tensor[] down_scales, "
      "int activation, int[] gate_up_mode, int[] down_mode) -> Tensor");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("moe_int4_experts", &moe_int4_experts); }
