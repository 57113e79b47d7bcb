// A MoE block's routed experts held as exo's int4 blocks, all of a step's chosen experts in
// one call (called by ../../model/direct_forward_moe.py in place of one Python call per
// expert): each expert's rows gathered, its fused gate/up product, the gated activation,
// its down product, and the weighted sum into the rows' outputs.
//
// The products are the kernels the per-expert path calls (Int4Linear.matmul): the decode
// kernel (int4_product) for up to kDecodeMaxRows rows, prefill's block_matmul above (it
// prefetches the weight it unpacks: a prompt's 8-32 rows per expert made its unpacking wait
// on memory), with the caller's activation rounding; the activation is torch's own operator
// on the same slices and the weighted outputs are added into each row in ascending expert
// order, as moe.dispatch's index_add_ adds them. So the result is bit for bit the
// per-expert path's (tested: ../../tests/test_moe_native.py). What it saves is the ~20
// torch operators a Python expert call dispatches (gathers, casts, slices, scaling), per
// expert per layer: a decode step of Qwen3-30B-A3B calls 8 experts in each of 48 layers. In
// decode steps and prompts alike the chosen experts are shared out among the threads, each
// running whole experts (moe_parallel.h). `Int4ExpertTable.route` goes one step further: it
// holds a block's experts by id from load on and runs the router, the routing and the
// grouping as well, so a block costs Python one call.

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gather.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "kernels.h"
#include "moe_parallel.h"

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

void check_activation(int64_t activation) {
  TORCH_CHECK(activation == kSilu || activation == kGeluTanh || activation == kGelu,
              "moe_int4_experts: activation must be 0 (SiLU), 1 (tanh GELU) or 2 (GELU), not ",
              activation);
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

// One expert's weights as the call takes them: fused gate/up [2 I, hidden / 2] and down
// [hidden, I / 2], each with its scales.
struct ExpertWeights {
  const at::Tensor* gate_up;
  const at::Tensor* gate_up_scales;
  const at::Tensor* down;
  const at::Tensor* down_scales;
};

void check_expert(const ExpertWeights& w, int64_t hidden, size_t expert) {
  check_int4(*w.gate_up, *w.gate_up_scales, hidden, "gate_up", expert);
  const int64_t width = w.gate_up->size(0) / 2;  // the expert's intermediate width
  check_int4(*w.down, *w.down_scales, width, "down", expert);
  TORCH_CHECK(w.down->size(0) == hidden, "moe_int4_experts: down[", expert, "] has ",
              w.down->size(0), " outputs, rows have ", hidden);
}

// One expert over its n rows (x's rows row_index[0..n)): the gate/up product, the gated
// activation (torch's operator on the same slices as the per-expert path) and the down
// product into down_out [n, hidden], unweighted.
void run_expert(const float* x, int64_t hidden, const int64_t* row_index, int64_t n,
                const ExpertWeights& w, int64_t activation, const ProductMode& gate_up_mode,
                const ProductMode& down_mode, float* down_out) {
  const int64_t width = w.gate_up->size(0) / 2;
  std::vector<float> gathered(static_cast<size_t>(n * hidden));
  for (int64_t j = 0; j < n; ++j)
    std::memcpy(gathered.data() + j * hidden, x + row_index[j] * hidden, hidden * sizeof(float));
  const auto options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor projected = at::empty({n, 2 * width}, options);
  product(gathered.data(), n, hidden, *w.gate_up, *w.gate_up_scales,
          projected.data_ptr<float>(), gate_up_mode);
  const at::Tensor gate = projected.narrow(1, 0, width);
  at::Tensor activated = activation == kSilu ? at::silu(gate)
                         : activation == kGeluTanh ? at::gelu(gate, "tanh")
                                                   : at::gelu(gate);
  activated.mul_(projected.narrow(1, width, width));
  product(activated.data_ptr<float>(), n, width, *w.down, *w.down_scales, down_out, down_mode);
}

// The step's chosen experts (weights[e] over the choices [spans[2e], spans[2e + 1]) of
// row_index / weight, experts ascending) into y [total, hidden] (zeroed by the caller):
// shared out among the threads where moe_parallel.h's `share_out` says so, the weighted
// outputs added in ascending expert order, so the result does not depend on the path or
// thread count.
void run_experts(const float* x, int64_t hidden, const int64_t* row_index, const float* weight,
                 const std::vector<int64_t>& spans, const std::vector<ExpertWeights>& weights,
                 int64_t activation, const ProductMode& gate_up_mode,
                 const ProductMode& down_mode, float* y) {
  if (weights.empty()) return;
  const int64_t first = spans.front();
  // Each choice's down output, unweighted, in the choices' order (every value written by
  // its expert's down product: not zeroed first, 32 MiB at a 512-token prompt).
  const auto values = static_cast<size_t>((spans.back() - first) * hidden);
  std::unique_ptr<float[]> outputs(new float[values]);
  float* out_rows = outputs.get();
  exo_native::moe::for_chosen_experts(
      spans, kDecodeMaxRows, [&](int64_t e) {
        const int64_t start = spans[2 * e], end = spans[2 * e + 1];
        run_expert(x, hidden, row_index + start, end - start, weights[e], activation,
                   gate_up_mode, down_mode, out_rows + (start - first) * hidden);
      });
  exo_native::moe::add_weighted(spans, out_rows, row_index, weight, hidden, y);
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
  check_activation(activation);
  const ProductMode gate_up_rounding = product_mode(gate_up_mode, "gate_up_mode");
  const ProductMode down_rounding = product_mode(down_mode, "down_mode");
  const int64_t total = rows.size(0), hidden = rows.size(1), choices = row_of.size(0);
  const int64_t* row_index = row_of.data_ptr<int64_t>();
  for (int64_t c = 0; c < choices; ++c)
    TORCH_CHECK(0 <= row_index[c] && row_index[c] < total, "moe_int4_experts: row ",
                row_index[c], " outside ", total);
  std::vector<int64_t> kept;
  std::vector<ExpertWeights> weights;
  int64_t previous = 0;
  for (size_t e = 0; e < experts; ++e) {
    const int64_t start = spans[2 * e], end = spans[2 * e + 1];
    TORCH_CHECK(previous <= start && start <= end && end <= choices, "moe_int4_experts: span ",
                e, " (", start, ", ", end, ") is outside the ", choices,
                " choices or before the span ahead of it");
    previous = end;
    if (start == end) continue;
    const ExpertWeights w{&gate_up[e], &gate_up_scales[e], &down[e], &down_scales[e]};
    check_expert(w, hidden, e);
    kept.insert(kept.end(), {start, end});
    weights.push_back(w);
  }
  at::Tensor out = at::zeros({total, hidden}, rows.options());
  run_experts(rows.data_ptr<float>(), hidden, row_index, weight_of.data_ptr<float>(), kept,
              weights, activation, gate_up_rounding, down_rounding, out.data_ptr<float>());
  return out;
}

// Routing scores as `moe.Routing.scoring` names them.
constexpr int64_t kSoftmax = 0;
constexpr int64_t kSigmoid = 1;

// A MoE block's routed experts held as exo's int4 blocks, per expert id (those this rank
// holds), made once at load (`direct_forward_moe.NativeInt4Experts`): `route` runs the
// block's router, the routing rules and the chosen experts in one call from Python, where
// the per-step work between them (`moe.route`, the grouping, the lists of the chosen
// experts' weights) cost about as much Python as a small expert's products.
struct Int4ExpertTable : torch::CustomClassHolder {
  std::vector<at::Tensor> gate_up, gate_up_scales, down, down_scales;  // per held expert
  std::vector<int64_t> slot;  // per expert id: its index in the lists above, or -1
  int64_t activation;

  // held: the ids of the experts given, ascending; experts: the block's expert count.
  Int4ExpertTable(std::vector<at::Tensor> gate_up_, std::vector<at::Tensor> gate_up_scales_,
                  std::vector<at::Tensor> down_, std::vector<at::Tensor> down_scales_,
                  std::vector<int64_t> held, int64_t experts, int64_t activation_)
      : gate_up(std::move(gate_up_)),
        gate_up_scales(std::move(gate_up_scales_)),
        down(std::move(down_)),
        down_scales(std::move(down_scales_)),
        slot(static_cast<size_t>(std::max<int64_t>(experts, 0)), -1),
        activation(activation_) {
    check_activation(activation);
    TORCH_CHECK(gate_up.size() == held.size() && gate_up_scales.size() == held.size() &&
                    down.size() == held.size() && down_scales.size() == held.size(),
                "Int4ExpertTable: each of the ", held.size(),
                " held experts needs gate_up, down and their scales");
    for (size_t i = 0; i < held.size(); ++i) {
      TORCH_CHECK(0 <= held[i] && held[i] < experts && slot[held[i]] == -1,
                  "Int4ExpertTable: expert id ", held[i], " is outside the block's ", experts,
                  " experts or given twice");
      slot[held[i]] = static_cast<int64_t>(i);
      const int64_t hidden = down[i].size(0);
      check_expert({&gate_up[i], &gate_up_scales[i], &down[i], &down_scales[i]}, hidden, i);
    }
  }

  // `moe.route` then `moe.dispatch` over these experts, in one call.
  //   rows: the normed [T, hidden] float32 rows; router [experts, hidden] float32 (and its
  //   bias [experts] or none); correction_bias [experts] (DeepSeek-V3's: moves the choice,
  //   not the weights) or none; scoring kSoftmax / kSigmoid; group-limited routing is not
  //   taken here (the caller keeps `moe.route` for it).
  // The routing runs torch's operators in `moe.route`'s order (the same choices and
  // weights, bit for bit); the choices are grouped by expert with rows ascending (a stable
  // counting sort: `dispatch`'s stable argsort). Returns [T, hidden] float32: this rank's
  // experts' weighted sum per row.
  at::Tensor route(const at::Tensor& rows, const at::Tensor& router,
                   const std::optional<at::Tensor>& router_bias,
                   const std::optional<at::Tensor>& correction_bias, int64_t scoring,
                   int64_t experts_per_token, bool normalize, double scaling,
                   std::vector<int64_t> gate_up_mode, std::vector<int64_t> down_mode) {
    TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.is_contiguous(),
                "Int4ExpertTable.route: rows must be a contiguous float32 [rows, hidden] tensor");
    const int64_t experts = static_cast<int64_t>(slot.size());
    TORCH_CHECK(router.dim() == 2 && router.size(0) == experts, "Int4ExpertTable.route: the "
                "router must be [", experts, ", hidden], got ", router.sizes());
    TORCH_CHECK(scoring == kSoftmax || scoring == kSigmoid,
                "Int4ExpertTable.route: scoring must be 0 (softmax) or 1 (sigmoid), not ",
                scoring);
    TORCH_CHECK(0 < experts_per_token && experts_per_token <= experts,
                "Int4ExpertTable.route: experts_per_token must be in 1..", experts, ", not ",
                experts_per_token);
    const ProductMode gate_up_rounding = product_mode(gate_up_mode, "gate_up_mode");
    const ProductMode down_rounding = product_mode(down_mode, "down_mode");
    const int64_t total = rows.size(0), hidden = rows.size(1);
    const at::Tensor logits = at::linear(rows, router, router_bias);
    const at::Tensor scores =
        scoring == kSoftmax ? at::softmax(logits, -1, at::kFloat) : at::sigmoid(logits);
    const at::Tensor choice = correction_bias ? at::add(scores, *correction_bias) : scores;
    const at::Tensor chosen = std::get<1>(at::topk(choice, experts_per_token, -1));
    at::Tensor weights = at::gather(scores, 1, chosen);
    if (normalize) weights = at::div(weights, at::add(at::sum(weights, -1, true), 1e-20));
    if (scaling != 1.0) weights = at::mul(weights, scaling);
    const at::Tensor flat = chosen.contiguous();
    const at::Tensor flat_weights = weights.contiguous();
    const int64_t* ids = flat.data_ptr<int64_t>();
    const float* choice_weights = flat_weights.data_ptr<float>();
    const int64_t choices = total * experts_per_token;
    // A stable counting sort of the choices by expert.
    std::vector<int64_t> starts(static_cast<size_t>(experts + 1), 0);
    for (int64_t c = 0; c < choices; ++c) ++starts[ids[c] + 1];
    for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
    std::vector<int64_t> row_index(static_cast<size_t>(choices));
    std::vector<float> weight(static_cast<size_t>(choices));
    std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
    for (int64_t c = 0; c < choices; ++c) {
      const int64_t at_ = fill[ids[c]]++;
      row_index[at_] = c / experts_per_token;
      weight[at_] = choice_weights[c];
    }
    std::vector<int64_t> spans;
    std::vector<ExpertWeights> held;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t i = slot[e];
      if (starts[e] == starts[e + 1] || i < 0) continue;
      spans.insert(spans.end(), {starts[e], starts[e + 1]});
      held.push_back({&gate_up[i], &gate_up_scales[i], &down[i], &down_scales[i]});
    }
    at::Tensor out = at::zeros({total, hidden}, rows.options());
    run_experts(rows.data_ptr<float>(), hidden, row_index.data(), weight.data(), spans, held,
                activation, gate_up_rounding, down_rounding, out.data_ptr<float>());
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.class_<Int4ExpertTable>("Int4ExpertTable")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t>())
      .def("route", &Int4ExpertTable::route);
  m.def(
      "moe_int4_experts(Tensor rows, Tensor row_of, Tensor weight_of, int[] spans, "
      "Tensor[] gate_up, Tensor[] gate_up_scales, Tensor[] down, Tensor[] down_scales, "
      "int activation, int[] gate_up_mode, int[] down_mode) -> Tensor");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("moe_int4_experts", &moe_int4_experts); }
