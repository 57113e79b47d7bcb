// Attention of a decoder layer's step (see decode_layer.cpp), its rows' keys and values
// already in the cache. Each row attends to its own slot's keys, from the layer's window
// start up to its own position. A prompt chunk beside the decode rows (two or more rows of
// one slot at consecutive positions) attends by torch's scaled_dot_product_attention; every
// other row by a dot product per visible key in float32 (a decode row reads each key once
// per query head).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EXO_AVX2 1
#endif

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
#ifdef EXO_AVX2
  if (n % 16 == 0) {
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum0);
      sum1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), sum1);
    }
    const __m256 sum = _mm256_add_ps(sum0, sum1);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
  }
#endif
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * b[i];
  return total;
}

// out[n] += weight * v[n] (vectorized by the compiler).
inline void axpy(float weight, const float* v, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += weight * v[i];
}

// Rows [row, row + length) of a step: one slot's consecutive positions (a prompt chunk).
struct Chunk {
  int64_t row = 0;
  int64_t length = 0;
};

// The step's runs of at least two rows of one slot at consecutive positions (decode rows are
// one per slot, so never part of one).
std::vector<Chunk> prompt_chunks(at::IntArrayRef slots, at::IntArrayRef positions) {
  std::vector<Chunk> chunks;
  const int64_t rows = static_cast<int64_t>(slots.size());
  for (int64_t r = 0; r < rows;) {
    int64_t end = r + 1;
    while (end < rows && slots[end] == slots[r] && positions[end] == positions[end - 1] + 1)
      ++end;
    if (end - r >= 2) chunks.push_back({r, end - r});
    r = end;
  }
  return chunks;
}

// Attention of a chunk's queries (rows `chunk`, the first at `start`) to its slot's keys
// from the layer's window start up to each query's own position, by torch's
// scaled_dot_product_attention with a boolean mask (the same call as
// batch_attention.prefill_attention's); written to `attended` [rows, heads * head_dim].
// The per-row loop (one dot product per key, row and head) took longer, for a step and for
// a long prompt's first token
// (figures: docs/benchmarks/engine-design-figures.md#decode_attentioncpp).
void attend_chunk(const Chunk& chunk, int64_t start, int64_t window, float* qkv, int64_t qkv_width,
                  const float* key_cache, const float* value_cache, int64_t slot_offset,
                  int64_t capacity,
                  int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling,
                  float* attended) {
  c10::InferenceMode inference;
  const int64_t count = chunk.length, end = start + count;
  const int64_t first = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
  const int64_t keys = end - first;
  const at::Tensor query =
      at::from_blob(qkv + chunk.row * qkv_width, {count, heads, head_dim},
                    {qkv_width, head_dim, 1}, at::kFloat)
          .permute({1, 0, 2})
          .unsqueeze(0);  // [1, heads, count, head_dim]
  const auto cached = [&](const float* cache) {  // read only: from_blob takes a mutable pointer
    return at::from_blob(const_cast<float*>(cache) + slot_offset, {kv_heads, capacity, head_dim},
                         at::kFloat)
        .narrow(1, first, keys)
        .unsqueeze(0);  // [1, kv_heads, keys, head_dim]
  };
  at::Tensor visible = at::empty({count, keys}, at::kBool);
  bool* mask = visible.data_ptr<bool>();
  for (int64_t q = 0; q < count; ++q)
    for (int64_t j = 0; j < keys; ++j) {
      const int64_t distance = start + q - (first + j);  // query position - key position
      mask[q * keys + j] = distance >= 0 && (window <= 0 || distance < window);
    }
  const at::Tensor output =
      at::scaled_dot_product_attention(query, cached(key_cache), cached(value_cache), visible,
                                       0.0, false, scaling, true)
          .squeeze(0)
          .permute({1, 0, 2})
          .contiguous();  // [count, heads, head_dim]
  std::memcpy(attended + chunk.row * heads * head_dim, output.data_ptr<float>(),
              sizeof(float) * count * heads * head_dim);
}

}  // namespace

namespace exo_native {

void decode_attention(float* qkv, int64_t rows, int64_t qkv_width, const float* key_cache,
                      const float* value_cache, int64_t capacity, at::IntArrayRef slots,
                      at::IntArrayRef positions, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int64_t window, double scaling, float* attended) {
  const int64_t q_width = heads * head_dim;
  // Prompt chunks first (SDPA threads its own work); then one task per (row, query head)
  // of the other rows, short contexts on this thread.
  const std::vector<Chunk> chunks = prompt_chunks(slots, positions);
  std::vector<char> in_chunk(static_cast<size_t>(rows), 0);
  for (const Chunk& chunk : chunks) {
    std::fill(in_chunk.begin() + chunk.row, in_chunk.begin() + chunk.row + chunk.length, 1);
    attend_chunk(chunk, positions[chunk.row], window, qkv, qkv_width, key_cache,
                 value_cache, slots[chunk.row] * kv_heads * capacity * head_dim, capacity,
                 heads, kv_heads, head_dim, scaling, attended);
  }
  int64_t longest = 1;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, positions[r] + 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (longest * head_dim));
  const int64_t group = heads / kv_heads;
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, rows * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads, h = task % heads;
      if (in_chunk[r]) continue;
      const int64_t position = positions[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      const int64_t count = position + 1 - first;
      const int64_t base = (slots[r] * kv_heads + h / group) * capacity * head_dim;
      const float* query = qkv + r * qkv_width + h * head_dim;
      scores.resize(static_cast<size_t>(count));
      float largest = -INFINITY;
      for (int64_t j = 0; j < count; ++j) {
        scores[j] = dot(query, key_cache + base + (first + j) * head_dim, head_dim) * scale;
        largest = std::max(largest, scores[j]);
      }
      float total = 0.0f;
      for (int64_t j = 0; j < count; ++j) {
        scores[j] = std::exp(scores[j] - largest);
        total += scores[j];
      }
      float* result = attended + r * q_width + h * head_dim;
      std::fill(result, result + head_dim, 0.0f);
      for (int64_t j = 0; j < count; ++j)
        axpy(scores[j], value_cache + base + (first + j) * head_dim, result, head_dim);
      const float inverse = 1.0f / total;
      for (int64_t d = 0; d < head_dim; ++d) result[d] *= inverse;
    }
  });
}

}  // namespace exo_native
