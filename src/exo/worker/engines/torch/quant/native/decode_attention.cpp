// Attention of a decoder layer's step (see decode_layer.cpp), its rows' keys and values
// already in the cache. Each row attends to its own slot's keys, from the layer's window
// start up to its own position. A prompt chunk beside the decode rows (two or more rows of
// one slot at consecutive positions) attends by torch's scaled_dot_product_attention; every
// other row by a dot product per visible key in float32 (a decode row reads each key once
// per query head).
//
// The cache holds float32 or bfloat16 keys and values (`--kv-cache-dtype`, the KV cache's
// dtype: batching/slot_kv_cache.py). bfloat16 is converted on load (its 16 bits are the
// high half of a float32: a zero-extend and a shift) into float32 products and sums, so
// only the stored keys and values are rounded, never the query, the scores or the sums.
// 512-bit vectors where the library is built with AVX512F (native_kernels._flags), else
// 256-bit AVX2; `exo_native::decode_attention_vector_bits` forces 256 bits (both paths
// tested on one CPU).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EXO_AVX2 1
#endif
#if defined(EXO_AVX2) && defined(__AVX512F__)
#define EXO_AVX512 1
#endif

namespace {

// The vector width decode rows use: 512 where built with AVX512F, unless forced to 256.
#ifdef EXO_AVX512
std::atomic<int64_t> vector_bits{512};
#else
std::atomic<int64_t> vector_bits{256};
#endif

// A bfloat16 cache value (its raw bits) as float32: exact.
inline float widen(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}
inline float widen(float value) { return value; }

#ifdef EXO_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline float sum8(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}
#endif
#ifdef EXO_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

// a . b over n values, `b` a cache row (float32 or bfloat16 bits), summed in float32.
template <typename T>
inline float dot(const float* a, const T* b, int64_t n, bool wide) {
#ifdef EXO_AVX512
  if (wide && n % 32 == 0) {
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32) {
      sum0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), sum0);
      sum1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), load16(b + i + 16), sum1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
  }
#else
  (void)wide;
#endif
#ifdef EXO_AVX2
  if (n % 16 == 0) {
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), sum0);
      sum1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), sum1);
    }
    return sum8(_mm256_add_ps(sum0, sum1));
  }
#endif
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += a[i] * widen(b[i]);
  return total;
}

// out[n] += weight * v[n], `v` a cache row (float32 or bfloat16 bits).
template <typename T>
inline void axpy(float weight, const T* v, float* out, int64_t n, bool wide) {
  int64_t i = 0;
#ifdef EXO_AVX512
  if (wide) {
    const __m512 w = _mm512_set1_ps(weight);
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(out + i, _mm512_fmadd_ps(w, load16(v + i), _mm512_loadu_ps(out + i)));
  }
#else
  (void)wide;
#endif
#ifdef EXO_AVX2
  const __m256 w8 = _mm256_set1_ps(weight);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(w8, load8(v + i), _mm256_loadu_ps(out + i)));
#endif
  for (; i < n; ++i) out[i] += weight * widen(v[i]);
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
// prefill_attention.prefill_attention's); written to `attended` [rows, heads * head_dim].
// A bfloat16 cache's visible keys and values are widened to float32 first (as
// batch_attention.attend does). The per-row loop (one dot product per key, row and head)
// took longer, for a step and for a long prompt's first token
// (figures: docs/benchmarks/engine-design-figures.md#decode_attentioncpp).
void attend_chunk(const Chunk& chunk, int64_t start, int64_t window, float* qkv, int64_t qkv_width,
                  const void* key_cache, const void* value_cache, at::ScalarType cache_type,
                  int64_t slot_offset, int64_t capacity, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, double scaling, float* attended) {
  c10::InferenceMode inference;
  const int64_t count = chunk.length, end = start + count;
  const int64_t first = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
  const int64_t keys = end - first;
  const at::Tensor query =
      at::from_blob(qkv + chunk.row * qkv_width, {count, heads, head_dim},
                    {qkv_width, head_dim, 1}, at::kFloat)
          .permute({1, 0, 2})
          .unsqueeze(0);  // [1, heads, count, head_dim]
  const int64_t element = cache_type == at::kBFloat16 ? 2 : 4;
  const auto cached = [&](const void* cache) {  // read only: from_blob takes a mutable pointer
    char* base = static_cast<char*>(const_cast<void*>(cache)) + slot_offset * element;
    return at::from_blob(base, {kv_heads, capacity, head_dim}, cache_type)
        .narrow(1, first, keys)
        .unsqueeze(0)
        .to(at::kFloat);  // [1, kv_heads, keys, head_dim]
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

// The decode rows (those outside `in_chunk`): one task per (row, query head), a dot product
// per visible key, a softmax and a weighted sum of the values, in float32. Tasks run head
// by head (every row's head 0, then head 1, ...), so the threads' contiguous task ranges each
// hold a share of every row: in row order one long row (a prompt token beside short decode
// rows) put all its heads on one thread (figures: docs/benchmarks/2026-12-05-mixed-steps.md).
template <typename T>
void attend_rows(const float* qkv, int64_t rows, int64_t qkv_width, const T* key_cache,
                 const T* value_cache, int64_t capacity, at::IntArrayRef slots,
                 at::IntArrayRef positions, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 int64_t window, double scaling, const std::vector<char>& in_chunk,
                 float* attended) {
  const int64_t q_width = heads * head_dim;
  int64_t longest = 1;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, positions[r] + 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (longest * head_dim));
  const int64_t group = heads / kv_heads;
  const float scale = static_cast<float>(scaling);
  const bool wide = vector_bits.load(std::memory_order_relaxed) == 512;
  at::parallel_for(0, rows * heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / rows, r = task % rows;
      if (in_chunk[r]) continue;
      const int64_t position = positions[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
      const int64_t count = position + 1 - first;
      const int64_t base = (slots[r] * kv_heads + h / group) * capacity * head_dim;
      const float* query = qkv + r * qkv_width + h * head_dim;
      scores.resize(static_cast<size_t>(count));
      float largest = -INFINITY;
      for (int64_t j = 0; j < count; ++j) {
        scores[j] = dot(query, key_cache + base + (first + j) * head_dim, head_dim, wide) * scale;
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
        axpy(scores[j], value_cache + base + (first + j) * head_dim, result, head_dim, wide);
      const float inverse = 1.0f / total;
      for (int64_t d = 0; d < head_dim; ++d) result[d] *= inverse;
    }
  });
}

// Sets the decode rows' vector width (256 or 512; 512 only where built with AVX512F) when
// `bits` > 0; returns the width in use. For tests (both paths on one CPU) and A/B runs.
int64_t decode_attention_vector_bits(int64_t bits) {
  if (bits > 0) {
    TORCH_CHECK(bits == 256 || bits == 512, "decode_attention_vector_bits: 256 or 512");
#ifdef EXO_AVX512
    vector_bits.store(bits);
#else
    TORCH_CHECK(bits == 256, "decode_attention_vector_bits: built without AVX512F");
#endif
  }
  return vector_bits.load();
}

}  // namespace

namespace exo_native {

void decode_attention(float* qkv, int64_t rows, int64_t qkv_width, const void* key_cache,
                      const void* value_cache, at::ScalarType cache_type, int64_t capacity,
                      at::IntArrayRef slots, at::IntArrayRef positions, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t window, double scaling,
                      float* attended) {
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kBFloat16,
              "decode_attention: the KV cache must be float32 or bfloat16");
  // Prompt chunks first (SDPA threads its own work); then one task per (row, query head)
  // of the other rows, short contexts on this thread.
  const std::vector<Chunk> chunks = prompt_chunks(slots, positions);
  std::vector<char> in_chunk(static_cast<size_t>(rows), 0);
  for (const Chunk& chunk : chunks) {
    std::fill(in_chunk.begin() + chunk.row, in_chunk.begin() + chunk.row + chunk.length, 1);
    attend_chunk(chunk, positions[chunk.row], window, qkv, qkv_width, key_cache, value_cache,
                 cache_type, slots[chunk.row] * kv_heads * capacity * head_dim, capacity,
                 heads, kv_heads, head_dim, scaling, attended);
  }
  if (cache_type == at::kBFloat16)
    attend_rows(qkv, rows, qkv_width, static_cast<const uint16_t*>(key_cache),
                static_cast<const uint16_t*>(value_cache), capacity, slots, positions, heads,
                kv_heads, head_dim, window, scaling, in_chunk, attended);
  else
    attend_rows(qkv, rows, qkv_width, static_cast<const float*>(key_cache),
                static_cast<const float*>(value_cache), capacity, slots, positions, heads,
                kv_heads, head_dim, window, scaling, in_chunk, attended);
}

}  // namespace exo_native

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def("decode_attention_vector_bits(int bits) -> int", &decode_attention_vector_bits);
}
