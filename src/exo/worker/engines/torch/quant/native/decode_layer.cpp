// One decoder layer's decode step in one call (called by ../../model/direct_forward.py): the layer's
// norms, projections, per-head q/k norms, rotary, KV-cache write, attention and gated MLP over D
// decode rows, each its own request (KV slot, position), with no torch operator between
// them. A decode step of a small model is otherwise mostly the cost of calling ~30 torch
// operators per layer from Python, about half a token's time outside the int4 kernels
// (figures: docs/benchmarks/engine-design-figures.md#decode_layercpp). A row is any (slot,
// position): a prompt chunk beside the decode rows is its slot's consecutive positions,
// each row attending to its slot's keys up to its own position (every row's key and value
// are written before any row attends; decode_attention.cpp), so a short chunk joining
// decodes runs here too (model/direct_forward.py).
//
// Per layer (row-major float32 throughout, the KV cache float32 or bfloat16, stored rounded
// and read widened to float32: decode_attention.cpp; the residual stream x is updated in
// place):
//   h  = rms_norm(x, input_norm)                         [D, hidden]
//   qkv = h W_qkv^T (+ bias)                             [D, (heads + 2 kv_heads) head_dim]
//   q, k = rotary(qk_norm(q), qk_norm(k))                per head, "rotate half" convention
//   keys[slot, :, position] = k; values[slot, :, position] = v
//   a  = softmax(q K^T * scaling) V                      per head over the slot's visible keys
//   o  = a W_o^T (+ bias); o = rms_norm(o, post_attention_norm) where given; x += o
//   h  = rms_norm(x, pre_mlp_norm); [g, u] = h W_gate_up^T
//   m  = act(g) * u; o = m W_down^T; o = rms_norm(o, post_mlp_norm) where given; x += o
// A key at position j is visible to the query at position p when j <= p and, with a sliding
// window w, p - j < w (transformers' sliding-window convention, as batch_attention.py).
//
// On a tensor rank the output and down projections are row-parallel: their partial sums
// must be all-reduced before their bias, norm and residual. `stage` 0 runs the whole layer;
// 1 stops after the output projection (written, without bias, to `partial`); once the
// caller has all-reduced `partial`, 2 adds its bias, finishes the attention's residual and
// stops after the down projection (again into `partial`); after the second all-reduce, 3
// adds the down bias and finishes the MLP's residual. Where no layer all-reduces (one
// process, or a pipeline rank) `decode_layers` runs every layer of the step in one call.
// A layer with no gate/up and down entries (a mixture-of-experts layer, whose routed
// experts the caller runs: moe_experts.cpp) takes stage 1 only: its attention block up to
// the output projection, into `partial`.

#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels.h"
#include "row_ops.h"

namespace {

using exo_native::row_ops::activate_rows;
using exo_native::row_ops::norm_rotate_heads;

// The layer's linears, in the order of the `linears` argument: (weight, scale_zero, bias)
// for Q/K/V, output, gate/up, down.
constexpr int kLinears = 4;
enum LinearIndex { kQkv = 0, kOutput = 1, kGateUp = 2, kDown = 3 };
// The `norms` argument: input, pre-MLP, post-attention, post-MLP, q/k.
enum NormIndex { kInputNorm = 0, kPreMlpNorm = 1, kPostAttentionNorm = 2, kPostMlpNorm = 3,
                 kQkNorm = 4 };
constexpr int kNorms = 5;

struct Linear {
  at::Tensor weight;      // uint8 [out, in / 2] int4 blocks, uint8 [out, ceil(in / 96) * 64]
                          // 5-bit lanes, int8 [out, in], or dense
  at::Tensor scale_zero;  // bfloat16 pairs (blocks) or compact Q4_K scales (int4 blocks),
                          // bfloat16 [out] (int8 per output row),
                          // bfloat16 [out, in / 16 or 32] (symmetric int8 or 5-bit
                          // blocks),
                          // undefined (dense)
  at::Tensor bias;        // float32 [out] or undefined
  int64_t out = 0;
  int64_t in = 0;
};

// Linear `index` of a layer whose entries start at `base` in `linears`.
Linear read_linear(const c10::List<std::optional<at::Tensor>>& linears, int64_t base, int index) {
  Linear linear;
  const std::optional<at::Tensor> weight = linears.get(base + 3 * index);
  TORCH_CHECK(weight.has_value() && weight->dim() == 2 && weight->is_contiguous(),
              "decode_layer: linear ", index, " needs a contiguous 2-d weight");
  linear.weight = *weight;
  const std::optional<at::Tensor> scale_zero = linears.get(base + 3 * index + 1);
  const std::optional<at::Tensor> bias = linears.get(base + 3 * index + 2);
  linear.out = linear.weight.size(0);
  const auto kind = linear.weight.scalar_type();
  if (kind == at::kChar && scale_zero.has_value() && scale_zero->dim() == 1) {
    TORCH_CHECK(scale_zero->scalar_type() == at::kBFloat16 && scale_zero->is_contiguous() &&
                    scale_zero->size(0) == linear.out && linear.weight.size(1) % 32 == 0,
                "decode_layer: linear ", index, " needs bfloat16 [out] scales");
    linear.scale_zero = *scale_zero;
    linear.in = linear.weight.size(1);
  } else if (kind == at::kByte && scale_zero.has_value() && scale_zero->dim() == 2) {
    // 5-bit lanes (int5_blocks.cpp): one bfloat16 scale per 32 inputs.
    linear.in = scale_zero->size(1) * 32;
    TORCH_CHECK(scale_zero->scalar_type() == at::kBFloat16 && scale_zero->is_contiguous() &&
                    scale_zero->size(0) == linear.out &&
                    linear.weight.size(1) == exo_native::int5_row_bytes(linear.in),
                "decode_layer: linear ", index, " needs 5-bit lanes of ceil(in / 96) * 64 "
                "bytes per row and bfloat16 [out, in / 32] scales");
    linear.scale_zero = *scale_zero;
  } else if (kind == at::kChar && scale_zero.has_value() && scale_zero->dim() == 2) {
    linear.in = linear.weight.size(1);
    TORCH_CHECK(scale_zero->scalar_type() == at::kBFloat16 && scale_zero->is_contiguous() &&
                    scale_zero->size(0) == linear.out && linear.in % 32 == 0 &&
                    (scale_zero->size(1) * 16 == linear.in || scale_zero->size(1) * 32 == linear.in),
                "decode_layer: linear ", index, " needs bfloat16 [out, in / 16 or in / 32] scales");
    linear.scale_zero = *scale_zero;
  } else if (kind == at::kByte && scale_zero.has_value() &&
             exo_native::is_q4k_scales(*scale_zero)) {
    // int4 blocks with compact Q4_K scales (kernels.h kQ4kBytes): one group per 32 inputs.
    linear.in = 2 * linear.weight.size(1);
    TORCH_CHECK(scale_zero->is_contiguous() && scale_zero->size(0) == linear.out &&
                    scale_zero->size(1) * exo_native::kQ4kGroups * 32 == linear.in,
                "decode_layer: linear ", index, " needs compact Q4_K scales [out, in / 256, 20]");
    linear.scale_zero = *scale_zero;
  } else if (kind == at::kByte || kind == at::kChar) {
    TORCH_CHECK(scale_zero.has_value() && scale_zero->dim() == 3 &&
                    scale_zero->scalar_type() == at::kBFloat16 && scale_zero->is_contiguous() &&
                    scale_zero->size(0) == linear.out && scale_zero->size(2) == 2,
                "decode_layer: linear ", index, " needs bfloat16 [out, groups, 2] scale_zero");
    linear.scale_zero = *scale_zero;
    linear.in = kind == at::kByte ? 2 * linear.weight.size(1) : linear.weight.size(1);
    TORCH_CHECK(linear.in % 32 == 0 && linear.in % linear.scale_zero.size(1) == 0 &&
                    (linear.in / linear.scale_zero.size(1)) % 32 == 0,
                "decode_layer: linear ", index, "'s groups must be multiples of 32 inputs");
    if (kind == at::kChar)
      TORCH_CHECK(linear.scale_zero.size(1) * 32 == linear.in,
                  "decode_layer: int8 blocks need one (scale, zero) pair per 32 inputs");
  } else {
    linear.in = linear.weight.size(1);
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == linear.out &&
                    bias->scalar_type() == at::kFloat && bias->is_contiguous(),
                "decode_layer: linear ", index, "'s bias must be float32 [out]");
    linear.bias = *bias;
  }
  return linear;
}

void add_bias_rows(const Linear& linear, int64_t rows, float* y) {
  if (!linear.bias.defined()) return;
  const float* bias = linear.bias.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < linear.out; ++o) y[r * linear.out + o] += bias[o];
}

// Rows from which a block weight's product is the integer GEMM (`block_matmul` with int16
// activations: the decode kernels' block sums, scaled in another order) rather than the
// decode kernels, which unpack the weight again for every 4 rows (quantize.py's
// NATIVE_BLOCK_MAX_ROWS + 1). A step's rows beyond its decode rows are a prompt chunk
// beside them (model/direct_forward.py). At 8 rows the two took the same time, above it the
// GEMM is faster (figures: docs/benchmarks/engine-design-figures.md#decode_layercpp).
constexpr int64_t kGemmMinRows = 8;
// The same for an int4 weight where the 512-bit int4 decode kernel runs (int4_gemv.cpp): it
// does a step over 8-16 requests without the GEMM's unpacking of the whole weight to int16
// per call, which took most of an 8-row step's time
// (figures: docs/benchmarks/2026-12-05-batching.md). `EXO_DECODE_GEMM_MIN_ROWS` (read once)
// overrides both bounds, to measure the crossover.
constexpr int64_t kGemmMinRowsInt4Avx512 = 17;
// The same for int8 blocks (symmetric or with (scale, zero) pairs) where their 512-bit tile
// runs (int8_tile.h: whole pairs of blocks): on a 49,152 x 576 weight it took about half
// the GEMM's time at 8 and 12 rows and about as long at 16 (quantized_linear.py's
// NATIVE_INT8_BLOCK_MAX_ROWS_AVX512 + 1; figures: docs/benchmarks/2026-12-05-batching-vnni.md).
constexpr int64_t kGemmMinRowsInt8Avx512 = 16;

// What a block weight's decode product runs on, for `gemm_min_rows`.
enum class BlockTile { kOther, kInt4, kInt8 };

int64_t gemm_min_rows(BlockTile tile) {
  static const int64_t forced = [] {
    const char* value = std::getenv("EXO_DECODE_GEMM_MIN_ROWS");
    return value == nullptr ? int64_t{0} : std::max<int64_t>(1, std::atoll(value));
  }();
  if (forced > 0) return forced;
  if (exo_native::int4_decode_bits() != 512) return kGemmMinRows;
  if (tile == BlockTile::kInt4) return kGemmMinRowsInt4Avx512;
  if (tile == BlockTile::kInt8) return kGemmMinRowsInt8Avx512;
  return kGemmMinRows;
}

// y[rows, out] = x[rows, in] W^T (+ bias when add_bias).
void apply_linear(const Linear& linear, const float* x, int64_t rows, float* y,
                  bool add_bias = true) {
  const auto kind = linear.weight.scalar_type();
  const bool blocks = (kind == at::kByte || kind == at::kChar) && linear.scale_zero.dim() >= 2;
  const BlockTile tile = kind == at::kByte && linear.scale_zero.dim() == 3 ? BlockTile::kInt4
                         : kind == at::kChar && linear.in % 64 == 0     ? BlockTile::kInt8
                                                                        : BlockTile::kOther;
  if (blocks && rows >= gemm_min_rows(tile)) {
    exo_native::block_matmul(x, rows, linear.in, linear.weight, linear.scale_zero, y);
  } else if (kind == at::kByte && linear.scale_zero.dim() == 2) {
    exo_native::int5_product(x, rows, linear.in, linear.weight, linear.scale_zero, y);
  } else if (kind == at::kByte) {
    exo_native::int4_product(x, rows, linear.in, linear.weight, linear.scale_zero, y);
  } else if (kind == at::kChar && linear.scale_zero.dim() == 1) {
    exo_native::int8_channel_product(x, rows, linear.in, linear.weight, linear.scale_zero, y);
  } else if (kind == at::kChar && linear.scale_zero.dim() == 2) {
    exo_native::int8_scaled_product(x, rows, linear.in, linear.weight, linear.scale_zero, y);
  } else if (kind == at::kChar) {
    exo_native::int8_block_product(x, rows, linear.in, linear.weight, linear.scale_zero, y);
  } else if (kind == at::kBFloat16) {  // held unquantized: exact float32 sums
    exo_native::bf16_product(x, rows, linear.in, linear.weight, y);
  } else {  // a dense float32 weight: torch's matmul
    c10::InferenceMode inference;
    const at::Tensor input =
        at::from_blob(const_cast<float*>(x), {rows, linear.in}, at::kFloat);
    const at::Tensor product = at::linear(input.to(linear.weight.scalar_type()), linear.weight)
                                   .to(at::kFloat)
                                   .contiguous();
    std::memcpy(y, product.data_ptr<float>(), sizeof(float) * rows * linear.out);
  }
  if (add_bias) add_bias_rows(linear, rows, y);
}

// cache[at .. at + n) = source (float32), rounded to nearest even where the cache is
// bfloat16 (as torch's float32 -> bfloat16 cast rounds: both paths store the same bits).
void store_kv(const float* source, void* cache, at::ScalarType cache_type, int64_t at,
              int64_t n) {
  if (cache_type == at::kFloat) {
    std::memcpy(static_cast<float*>(cache) + at, source, sizeof(float) * n);
    return;
  }
  c10::BFloat16* target = static_cast<c10::BFloat16*>(cache) + at;
  for (int64_t i = 0; i < n; ++i) target[i] = c10::BFloat16(source[i]);
}

// x[rows, hidden] += out (normed in place by `post_norm` first, where given: Gemma 3's
// post-attention and post-MLP norms).
void add_residual(float* x, float* out, int64_t rows, int64_t hidden, const float* post_norm,
                  double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * hidden;
    if (post_norm != nullptr)
      exo_native::rms_norm_row(o, post_norm, hidden, static_cast<float>(eps), o);
    float* residual = x + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) residual[i] += o[i];
  }
}

// One layer: its 12 `linears` entries from `linear_base`, its 5 `norms` entries from
// `norm_base`, its 5 epsilons in `eps`.
void run_layer(at::Tensor& x, const c10::List<std::optional<at::Tensor>>& linears,
               int64_t linear_base, const c10::List<std::optional<at::Tensor>>& norms,
               int64_t norm_base, at::ArrayRef<double> eps, at::Tensor& keys, at::Tensor& values,
               at::IntArrayRef slots, at::IntArrayRef positions, const at::Tensor& cos,
               const at::Tensor& sin, const at::Tensor& perm, int64_t heads, int64_t kv_heads,
               int64_t head_dim, int64_t activation, int64_t window, double scaling,
               at::Tensor& partial, int64_t stage) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decode_layer: x must be a contiguous float32 [rows, hidden] tensor");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(stage >= 0 && stage <= 3, "decode_layer: stage must be 0 (the whole layer) to 3");
  TORCH_CHECK(stage == 0 || (partial.scalar_type() == at::kFloat && partial.is_contiguous() &&
                             partial.dim() == 2 && partial.size(0) == rows &&
                             partial.size(1) == hidden),
              "decode_layer: partial must be a contiguous float32 [rows, hidden] tensor");
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == rows &&
                  static_cast<int64_t>(positions.size()) == rows,
              "decode_layer: one slot and one position per row");
  TORCH_CHECK(static_cast<int64_t>(linears.size()) >= linear_base + 3 * kLinears,
              "decode_layer: 12 linear entries expected per layer");
  TORCH_CHECK(static_cast<int64_t>(norms.size()) >= norm_base + kNorms && eps.size() == kNorms,
              "decode_layer: 5 norm entries and 5 epsilons expected per layer");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
              "decode_layer: heads must be a multiple of kv_heads");
  const at::ScalarType cache_type = keys.scalar_type();
  TORCH_CHECK(keys.dim() == 4 && (cache_type == at::kFloat || cache_type == at::kBFloat16) &&
                  keys.is_contiguous() && keys.sizes() == values.sizes() &&
                  values.scalar_type() == cache_type && values.is_contiguous() &&
                  keys.size(1) == kv_heads && keys.size(3) == head_dim,
              "decode_layer: keys / values must be contiguous float32 or bfloat16 [slots, "
              "kv_heads, capacity, head_dim] of one dtype");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == rows && cos.size(1) == head_dim &&
                  cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat &&
                  sin.is_contiguous(),
              "decode_layer: cos / sin must be contiguous float32 [rows, head_dim]");
  TORCH_CHECK(perm.dim() == 1 && perm.size(0) == head_dim && perm.scalar_type() == at::kLong,
              "decode_layer: perm must be int64 [head_dim]");
  const Linear qkv = read_linear(linears, linear_base, kQkv);
  const Linear output = read_linear(linears, linear_base, kOutput);
  // No MLP entries: the attention block alone (stage 1), the caller's experts after it.
  const bool attention_only = !linears.get(linear_base + 3 * kGateUp).has_value();
  TORCH_CHECK(!attention_only || stage == 1,
              "decode_layer: a layer without gate/up and down projections runs stage 1 only");
  const Linear gate_up = attention_only ? Linear{} : read_linear(linears, linear_base, kGateUp);
  const Linear down = attention_only ? Linear{} : read_linear(linears, linear_base, kDown);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  const int64_t intermediate = gate_up.out / 2;
  TORCH_CHECK(qkv.in == hidden && qkv.out == qkv_width, "decode_layer: Q/K/V is ", qkv.out,
              "x", qkv.in, ", expected ", qkv_width, "x", hidden);
  TORCH_CHECK(output.in == q_width && output.out == hidden,
              "decode_layer: the output projection does not map the heads to hidden");
  TORCH_CHECK(attention_only || (gate_up.in == hidden && gate_up.out % 2 == 0 &&
                                 down.in == intermediate && down.out == hidden),
              "decode_layer: gate/up and down projections do not fit hidden");
  const int64_t slot_count = keys.size(0), capacity = keys.size(2);
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slots[r] >= 0 && slots[r] < slot_count && positions[r] >= 0 &&
                    positions[r] < capacity,
                "decode_layer: row ", r, "'s slot or position is outside the KV cache");
  const float* norm[kNorms];
  for (int i = 0; i < kNorms; ++i) {
    const std::optional<at::Tensor> weight = norms.get(norm_base + i);
    norm[i] = nullptr;
    if (!weight.has_value()) continue;
    const int64_t width = i == kQkNorm ? (heads + kv_heads) * head_dim : hidden;
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->is_contiguous() &&
                    weight->numel() == width,
                "decode_layer: norm ", i, " must be float32 with ", width, " values");
    norm[i] = weight->data_ptr<float>();
  }
  TORCH_CHECK(norm[kInputNorm] != nullptr && (attention_only || norm[kPreMlpNorm] != nullptr),
              "decode_layer: the input and pre-MLP norms are required");

  // Scratch kept by the calling thread: no allocation per call once warm.
  thread_local std::vector<float> normed_buffer, qkv_buffer, attended_buffer, out_buffer,
      gate_up_buffer, middle_buffer;
  normed_buffer.resize(static_cast<size_t>(rows * hidden));
  qkv_buffer.resize(static_cast<size_t>(rows * qkv_width));
  attended_buffer.resize(static_cast<size_t>(rows * q_width));
  out_buffer.resize(static_cast<size_t>(rows * hidden));
  gate_up_buffer.resize(static_cast<size_t>(rows * gate_up.out));
  middle_buffer.resize(static_cast<size_t>(rows * intermediate));
  float* xp = x.data_ptr<float>();
  float* normed = normed_buffer.data();
  float* qkv_out = qkv_buffer.data();
  float* attended = attended_buffer.data();
  float* out = stage == 0 ? out_buffer.data() : partial.data_ptr<float>();
  if (stage <= 1) {  // the attention block, up to the output projection
    for (int64_t r = 0; r < rows; ++r)
      exo_native::rms_norm_row(xp + r * hidden, norm[kInputNorm], hidden,
                               static_cast<float>(eps[kInputNorm]), normed + r * hidden);
    apply_linear(qkv, normed, rows, qkv_out);
    const float* cos_p = cos.data_ptr<float>();
    const float* sin_p = sin.data_ptr<float>();
    const int64_t* perm_p = perm.data_ptr<int64_t>();
    void* key_cache = keys.data_ptr();
    void* value_cache = values.data_ptr();
    std::vector<float> head_copy(static_cast<size_t>(head_dim));
    for (int64_t r = 0; r < rows; ++r) {
      float* row = qkv_out + r * qkv_width;
      // Queries, then keys: norm, rotary.
      norm_rotate_heads(row, heads + kv_heads, head_dim, norm[kQkNorm],
                        static_cast<float>(eps[kQkNorm]), cos_p + r * head_dim,
                        sin_p + r * head_dim, perm_p, head_copy.data());
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at_position =
            ((slots[r] * kv_heads + h) * capacity + positions[r]) * head_dim;
        store_kv(row + q_width + h * head_dim, key_cache, cache_type, at_position, head_dim);
        store_kv(row + q_width + kv_width + h * head_dim, value_cache, cache_type, at_position,
                 head_dim);
      }
    }
    exo_native::decode_attention(qkv_out, rows, qkv_width, key_cache, value_cache, cache_type,
                                 capacity, slots, positions, heads, kv_heads, head_dim, window,
                                 scaling, attended);
    apply_linear(output, attended, rows, out, /*add_bias=*/stage == 0);
    if (stage == 1) return;  // the caller all-reduces `partial`, then runs stage 2
  }
  if (stage == 2) add_bias_rows(output, rows, out);
  if (stage <= 2) {  // the attention's residual, the MLP block up to the down projection
    add_residual(xp, out, rows, hidden, norm[kPostAttentionNorm], eps[kPostAttentionNorm]);

    // MLP block.
    float* gate_up_out = gate_up_buffer.data();
    float* middle = middle_buffer.data();
    for (int64_t r = 0; r < rows; ++r)
      exo_native::rms_norm_row(xp + r * hidden, norm[kPreMlpNorm], hidden,
                               static_cast<float>(eps[kPreMlpNorm]), normed + r * hidden);
    apply_linear(gate_up, normed, rows, gate_up_out);
    for (int64_t r = 0; r < rows; ++r) {
      const float* gate = gate_up_out + r * gate_up.out;
      const float* up = gate + intermediate;
      activate_rows(gate, up, intermediate, activation, middle + r * intermediate);
    }
    apply_linear(down, middle, rows, out, /*add_bias=*/stage == 0);
    if (stage == 2) return;  // the caller all-reduces `partial`, then runs stage 3
  }
  if (stage == 3) add_bias_rows(down, rows, out);
  add_residual(xp, out, rows, hidden, norm[kPostMlpNorm], eps[kPostMlpNorm]);
}

void decode_layer(at::Tensor& x, const c10::List<std::optional<at::Tensor>>& linears,
                  const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps,
                  at::Tensor& keys, at::Tensor& values, at::IntArrayRef slots,
                  at::IntArrayRef positions, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& perm, int64_t heads, int64_t kv_heads, int64_t head_dim,
                  int64_t activation, int64_t window, double scaling, at::Tensor& partial,
                  int64_t stage) {
  TORCH_CHECK(linears.size() == 3 * kLinears, "decode_layer: 12 linear entries expected");
  TORCH_CHECK(norms.size() == kNorms, "decode_layer: 5 norm entries expected");
  run_layer(x, linears, 0, norms, 0, eps, keys, values, slots, positions, cos, sin, perm, heads,
            kv_heads, head_dim, activation, window, scaling, partial, stage);
}

// Every layer of a decode step in one call (stage 0 each: no all-reduce between them):
// layer i's entries start at 12 i in `linears`, 5 i in `norms` and `eps`; it reads
// keys[i] / values[i], the rotary tables cos / sin / perm [rope[i]], and
// shape[5 i : 5 i + 5] = (heads, kv_heads, head_dim, activation, window), scaling[i].
// One call instead of one per layer spares each layer the Python call and the argument
// conversion, about a quarter of a small layer's time
// (figures: docs/benchmarks/engine-design-figures.md#decode_layercpp).
void decode_layers(at::Tensor& x, const c10::List<std::optional<at::Tensor>>& linears,
                   const c10::List<std::optional<at::Tensor>>& norms, at::ArrayRef<double> eps,
                   const c10::List<at::Tensor>& keys, const c10::List<at::Tensor>& values,
                   at::IntArrayRef slots, at::IntArrayRef positions,
                   const c10::List<at::Tensor>& cos, const c10::List<at::Tensor>& sin,
                   const c10::List<at::Tensor>& perm, at::IntArrayRef rope,
                   at::IntArrayRef shape, at::ArrayRef<double> scaling) {
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(static_cast<int64_t>(values.size()) == layers &&
                  static_cast<int64_t>(linears.size()) == 3 * kLinears * layers &&
                  static_cast<int64_t>(norms.size()) == kNorms * layers &&
                  static_cast<int64_t>(eps.size()) == kNorms * layers &&
                  static_cast<int64_t>(rope.size()) == layers &&
                  static_cast<int64_t>(shape.size()) == 5 * layers &&
                  static_cast<int64_t>(scaling.size()) == layers,
              "decode_layers: per layer 12 linears, 5 norms and epsilons, keys, values, a "
              "rotary index, 5 shape entries and a scaling expected");
  TORCH_CHECK(cos.size() == sin.size() && cos.size() == perm.size(),
              "decode_layers: one cos, sin and perm per rotary table");
  at::Tensor unused;  // `partial`: only stages 1-3 use it
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t table = rope[i];
    TORCH_CHECK(table >= 0 && table < static_cast<int64_t>(cos.size()),
                "decode_layers: layer ", i, "'s rotary index is out of range");
    at::Tensor layer_keys = keys.get(i), layer_values = values.get(i);
    const int64_t* dims = shape.data() + 5 * i;
    run_layer(x, linears, 3 * kLinears * i, norms, kNorms * i, eps.slice(kNorms * i, kNorms),
              layer_keys, layer_values, slots, positions, cos.get(table), sin.get(table),
              perm.get(table), dims[0], dims[1], dims[2], dims[3], dims[4], scaling[i], unused,
              0);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def(
      "decode_layer(Tensor(a!) x, Tensor?[] linears, Tensor?[] norms, float[] eps, "
      "Tensor(b!) keys, Tensor(c!) values, int[] slots, int[] positions, Tensor cos, "
      "Tensor sin, Tensor perm, int heads, int kv_heads, int head_dim, int activation, "
      "int window, float scaling, Tensor(d!) partial, int stage) -> ()");
  m.def(
      "decode_layers(Tensor(a!) x, Tensor?[] linears, Tensor?[] norms, float[] eps, "
      "Tensor(b!)[] keys, Tensor(c!)[] values, int[] slots, int[] positions, Tensor[] cos, "
      "Tensor[] sin, Tensor[] perm, int[] rope, int[] shape, float[] scaling) -> ()");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
}
