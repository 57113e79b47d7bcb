// A MoE block's routed experts held as MXFP4 (gpt-oss's: biased gate, up and down, the
// clamped SwiGLU), all of a step's chosen experts in one call (called by
// ../../model/direct_forward_moe.py's NativeMxfp4Experts in place of one Python call per
// expert): each expert's rows gathered, its gate and up products and biases, the
// activation, its down product and bias, and the weighted sum into the rows' outputs.
//
// The products are the ones the per-expert path calls (../mxfp4.py mxfp4_linear): the fused
// MXFP4 kernel (mxfp4_product) for up to `decode_max_rows` rows (mxfp4.py NATIVE_MAX_ROWS),
// above it prefill's block_matmul on the weight re-expressed as int8 blocks (the same
// integers and scales as mxfp4.py's mxfp4_int8_blocks) with int16 activations. The
// activation is torch's own operators on tensors of the same shapes, in the same order as
// families/gpt_oss.py's ClampedSwiglu (`(clamp(up, -limit, limit) + 1) * (g * sigmoid(g *
// alpha))`, g = min(gate, limit); transformers' GptOssExperts), and the weighted outputs
// are added into each row in ascending expert order, as moe.dispatch's index_add_ adds
// them. So the result is bit for bit the per-expert path's (tested:
// ../../tests/test_moe_mxfp4_native.py). In a decode step the chosen experts are shared out
// among the threads, each running whole experts (moe_parallel.h).
//
// What it saves is the ~25 torch operators a Python expert call dispatches per expert per
// layer (two mxfp4_linear calls, a concatenation, the bias, the activation's six, the down
// product and its bias, the gather, weighting and scatter): a decode step of gpt-oss-20b
// chooses 4 experts in each of its 24 layers. At its shapes that was about a tenth of a
// decode step's MoE-block CPU time, and the call sits at the cost of its products alone;
// past decode_max_rows the int8 blocks come from byte shuffles (mxfp4.cpp), faster than
// mxfp4.py's table gather (figures: docs/benchmarks/2026-12-06-mxfp4-experts.md).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "moe_parallel.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kBlockBytes = kBlock / 2;

// Projections per expert in the op's lists: gate, up, down.
constexpr size_t kGate = 0, kUp = 1, kDown = 2, kProjections = 3;

// The op's name in its argument checks.
constexpr const char* kOp = "moe_mxfp4_experts";

// One MXFP4 linear of an expert, checked: blocks uint8 [out, in / 32, 16], scale bytes
// uint8 [out, in / 32], bias float32 [out] or empty (none).
struct Mxfp4Linear {
  const at::Tensor& blocks;
  const at::Tensor& scales;
  const at::Tensor& bias;

  int64_t out() const { return blocks.size(0); }
};

Mxfp4Linear checked(at::TensorList blocks, at::TensorList scales, at::TensorList biases,
                    size_t expert, size_t projection, int64_t in) {
  static const char* names[kProjections] = {"gate", "up", "down"};
  const size_t at = kProjections * expert + projection;
  const at::Tensor &b = blocks[at], &s = scales[at], &bias = biases[at];
  TORCH_CHECK(b.dim() == 3 && b.size(2) == kBlockBytes && b.size(1) * kBlock == in &&
                  b.scalar_type() == at::kByte && b.is_contiguous(),
              kOp, ": expert ", expert, "'s ", names[projection],
              " blocks must be a contiguous uint8 [out, ", in / kBlock, ", 16] tensor");
  TORCH_CHECK(s.dim() == 2 && s.size(0) == b.size(0) && s.size(1) == b.size(1) &&
                  s.scalar_type() == at::kByte && s.is_contiguous(),
              kOp, ": expert ", expert, "'s ", names[projection],
              " scales must be a contiguous uint8 [out, ", in / kBlock, "] tensor");
  TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == b.size(0) &&
                                    bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              kOp, ": expert ", expert, "'s ", names[projection],
              " bias must be empty or a contiguous float32 [", b.size(0), "] tensor");
  return {b, s, bias};
}

// y[rows, out] = x[rows, in] W^T + bias, as mxfp4.py's mxfp4_linear and
// Mxfp4Projection add it: the fused kernel up to `decode_max_rows` rows, else block_matmul
// on int8 blocks with int16 activations; the bias added after the product (its own pass).
void linear(const float* x, int64_t rows, int64_t in, const Mxfp4Linear& weight,
            int64_t decode_max_rows, float* y) {
  const int64_t out = weight.out();
  if (rows <= decode_max_rows) {
    exo_native::mxfp4_product(x, rows, in, weight.blocks.data_ptr<uint8_t>(),
                              weight.scales.data_ptr<uint8_t>(), out, y);
  } else {
    const auto [values, block_scales] =
        exo_native::mxfp4_int8_blocks(weight.blocks, weight.scales);
    exo_native::block_matmul(x, rows, in, values, block_scales, y, 16, 0, false);
  }
  if (weight.bias.numel() == 0) return;
  const float* bias = weight.bias.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) y[r * out + o] += bias[o];
}

// One expert over its n rows (x's rows row_index[0..n)): gate and up products with their
// biases, ClampedSwiglu and the down product with its bias into down_out [n, hidden],
// unweighted.
void run_expert(const float* x, int64_t hidden, const int64_t* row_index, int64_t n,
                const std::array<Mxfp4Linear, kProjections>& expert, double alpha, double limit,
                int64_t decode_max_rows, float* down_out) {
  const int64_t width = expert[kGate].out();
  std::vector<float> gathered(static_cast<size_t>(n * hidden));
  for (int64_t j = 0; j < n; ++j)
    std::memcpy(gathered.data() + j * hidden, x + row_index[j] * hidden, hidden * sizeof(float));
  const auto options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor gate_out = at::empty({n, width}, options);
  at::Tensor up_out = at::empty({n, width}, options);
  linear(gathered.data(), n, hidden, expert[kGate], decode_max_rows, gate_out.data_ptr<float>());
  linear(gathered.data(), n, hidden, expert[kUp], decode_max_rows, up_out.data_ptr<float>());
  // ClampedSwiglu's operators, each on a contiguous [n, I] tensor as there (sigmoid's
  // vectorized and scalar lanes fall on the same elements); in place where its
  // intermediate is a fresh tensor, which changes no value.
  gate_out.clamp_(std::nullopt, limit);
  up_out.clamp_(-limit, limit);
  at::Tensor activated = gate_out.mul(alpha);
  activated.sigmoid_();
  activated.mul_(gate_out);  // gate * sigmoid(gate * alpha) (IEEE products commute)
  up_out.add_(1);            // up + 1
  up_out.mul_(activated);    // (up + 1) * (...)
  linear(up_out.data_ptr<float>(), n, width, expert[kDown], decode_max_rows, down_out);
}

// rows float32 [T, hidden]; row_of int64 [C] and weight_of float32 [C]: the step's choices
// grouped by expert (moe.dispatch's order); spans [2 E']: each listed expert's (start, end)
// in them, experts ascending; blocks / scales / biases: 3 per listed expert (gate [I,
// hidden], up [I, hidden], down [hidden, I]; an empty bias: none); alpha and limit: the
// clamped SwiGLU's; decode_max_rows: mxfp4_linear's NATIVE_MAX_ROWS. Returns float32 [T,
// hidden].
at::Tensor moe_mxfp4_experts(const at::Tensor& rows, const at::Tensor& row_of,
                             const at::Tensor& weight_of, at::IntArrayRef spans,
                             at::TensorList blocks, at::TensorList scales, at::TensorList biases,
                             double alpha, double limit, int64_t decode_max_rows) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous(),
              kOp, ": rows must be a contiguous float32 [rows, hidden] tensor");
  TORCH_CHECK(row_of.dim() == 1 && row_of.scalar_type() == at::kLong && row_of.is_contiguous(),
              kOp, ": row_of must be a contiguous int64 [choices] tensor");
  TORCH_CHECK(weight_of.dim() == 1 && weight_of.scalar_type() == at::kFloat &&
                  weight_of.is_contiguous() && weight_of.size(0) == row_of.size(0),
              kOp, ": weight_of must be a contiguous float32 tensor like row_of");
  const size_t experts = spans.size() / 2;
  TORCH_CHECK(spans.size() % 2 == 0 && blocks.size() == kProjections * experts &&
                  scales.size() == blocks.size() && biases.size() == blocks.size(),
              kOp, ": spans must hold (start, end) for each of the experts given, and each "
              "expert needs gate, up and down blocks, scales and biases (3 of each)");
  const int64_t total = rows.size(0), hidden = rows.size(1), choices = row_of.size(0);
  TORCH_CHECK(hidden % kBlock == 0, kOp, ": hidden ", hidden, " is not a multiple of 32");
  const float* x = rows.data_ptr<float>();
  const int64_t* row_index = row_of.data_ptr<int64_t>();
  for (int64_t c = 0; c < choices; ++c)
    TORCH_CHECK(0 <= row_index[c] && row_index[c] < total, kOp, ": row ", row_index[c],
                " outside ", total);
  // The experts with rows, checked: their spans and (gate, up, down) linears.
  std::vector<int64_t> kept;
  std::vector<std::array<Mxfp4Linear, kProjections>> linears;
  int64_t previous = 0;
  for (size_t e = 0; e < experts; ++e) {
    const int64_t start = spans[2 * e], end = spans[2 * e + 1];
    TORCH_CHECK(previous <= start && start <= end && end <= choices, kOp, ": span ", e, " (",
                start, ", ", end, ") is outside the ", choices,
                " choices or before the span ahead of it");
    previous = end;
    if (start == end) continue;
    const Mxfp4Linear gate = checked(blocks, scales, biases, e, kGate, hidden);
    const int64_t width = gate.out();  // the expert's intermediate width
    const Mxfp4Linear up = checked(blocks, scales, biases, e, kUp, hidden);
    const Mxfp4Linear down = checked(blocks, scales, biases, e, kDown, width);
    TORCH_CHECK(up.out() == width && down.out() == hidden, kOp, ": expert ", e, "'s up has ",
                up.out(), " outputs and down ", down.out(), "; gate has ", width,
                " and rows ", hidden);
    kept.insert(kept.end(), {start, end});
    linears.push_back({gate, up, down});
  }
  at::Tensor out = at::zeros({total, hidden}, rows.options());
  if (linears.empty()) return out;
  const int64_t first = kept.front();
  // Each choice's down output, unweighted, in the choices' order.
  std::vector<float> outputs(static_cast<size_t>((kept.back() - first) * hidden));
  exo_native::moe::for_chosen_experts(kept, decode_max_rows, [&](int64_t e) {
        const int64_t start = kept[2 * e], end = kept[2 * e + 1];
        run_expert(x, hidden, row_index + start, end - start, linears[e], alpha, limit,
                   decode_max_rows, outputs.data() + (start - first) * hidden);
      });
  exo_native::moe::add_weighted(kept, outputs.data(), row_index, weight_of.data_ptr<float>(),
                                hidden, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def(
      "moe_mxfp4_experts(Tensor rows, Tensor row_of, Tensor weight_of, int[] spans, "
      "Tensor[] blocks, Tensor[] scales, Tensor[] biases, float alpha, float limit, "
      "int decode_max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("moe_mxfp4_experts", &moe_mxfp4_experts); }
