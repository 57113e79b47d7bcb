// Attention of a decoder layer's step (see decode_layer.cpp), its rows' keys and values
// already in the cache. Each row attends to its own slot's keys, from the layer's window
// start up to its own position. A long prompt chunk beside the decode rows (more than
// kRowChunkMax rows of one slot at consecutive positions) attends by torch's
// scaled_dot_product_attention; every other row (decode rows, a speculative draft's verify
// rows, short prompt chunks) by exo's row kernel below, in float32.
//
// The row kernel. A row's work is cut into tasks of one KV head and at most kSplitKeys of
// its visible keys (flash-decoding's split of the keys: Dao et al. 2023, "Flash-Decoding
// for long-context inference"), so that one long row keeps every thread busy. A task reads
// each of its keys and values once for all the query heads that share that KV head
// (grouped-query attention), and for all the consecutive rows of one slot in the step (a
// short prompt chunk's, a draft's verify rows: up to kRowChunkMax) where no sliding window
// cuts them, in blocks of one vector's width L (16 keys with AVX512, 8 with AVX2):
//   1. the block's keys are widened to float32 once; each query head's L dot products are
//      L vectors of partial sums, reduced to one vector of L scores by a transpose-and-add
//      tree (no horizontal sum per key);
//   2. each head's scores minus their largest, exponentiated a vector at a time (SLEEF's
//      expf, 1.0 ulp, as torch's own kernels; a score more than 87 below the largest
//      counts 0, as it would in float32 anyway), summed;
//   3. the block's values are widened once; each head's weighted sum runs in registers.
// A task leaves (largest score, sum of exponentials, unnormalized weighted sum) per head;
// a row's tasks are merged in key order: exp(m_s - M) rescales each, one division at the
// end. A row's splits and its arithmetic depend only on its own keys, never on the step's
// other rows, the rows sharing its tasks or the thread count, so a row's output is the same
// bits whatever step it is in (a verified draft position equals the plain decode step's:
// speculative decoding's exactness). Before, each (row, query head) read its keys once per
// head, summed each dot product horizontally and called std::exp per key: 7-10 G
// multiply-adds a second per thread against this one's 15-23 at 2k-16k keys
// (docs/benchmarks/2026-12-07-decode-attention.md).
//
// The cache holds float32 or bfloat16 keys and values (`--kv-cache-dtype`, the KV cache's
// dtype: batching/slot_kv_cache.py). bfloat16 is widened on load (its 16 bits are the high
// half of a float32: a zero-extend and a shift), so only the stored keys and values are
// rounded, never the query, the scores or the sums. 512-bit vectors where the library is
// built with AVX512F (native_kernels._flags) and the head dimension is a multiple of 16,
// else 256-bit AVX2 where it is a multiple of 8, else one value at a time;
// `decode_attention_vector_bits` forces 256 bits (both paths tested on one CPU).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/zeros.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_vectors.h"
#include "kernels.h"

namespace {

using exo_native::attention_vectors::Scalar;
using exo_native::attention_vectors::widen;
#ifdef EXO_AVX2
using exo_native::attention_vectors::Avx2;
#endif
#ifdef EXO_AVX512
using exo_native::attention_vectors::Avx512;
#endif

// Keys per task: a row with more is split (above). Large enough that a task's fixed costs
// (its query heads' set-up, the merge) stay small against 512 keys of dot products.
constexpr int64_t kSplitKeys = 512;
// Prompt chunks of up to this many rows take the row kernel, longer ones torch's SDPA
// (figures: docs/benchmarks/2026-12-07-decode-attention.md).
constexpr int64_t kRowChunkMax = 12;

// The vector width rows use: 512 where built with AVX512F, unless forced to 256.
#ifdef EXO_AVX512
std::atomic<int64_t> vector_bits{512};
#else
std::atomic<int64_t> vector_bits{256};
#endif

// One task: the query heads of one KV head, for one row or for several rows of one slot
// (a short prompt chunk, whose rows read the same keys), against the keys from k0 on of
// that KV head (`keys` / `values`: that head's rows of the slot, head_dim values each). A
// member is one row: its `group` query heads (`queries`, head_dim values each), its key
// count from k0 (`count`; a chunk's rows see one more key each), and where its results go
// (`out`: largest[group], total[group] (the sum of exp(score - largest)), then
// weighted[group][head_dim] (the values' sum weighted by those exponentials)). A member's
// arithmetic is the same whatever other members share its task.
struct Member {
  const float* queries = nullptr;
  int64_t count = 0;
  float* out = nullptr;
};

// A block of `valid` cache rows of head_dim values as float32: the cache itself where it
// holds float32, else widened into `scratch` ([L, head_dim]).
template <typename Vec>
inline const float* widened(const float* rows, int64_t, int64_t, float*) {
  return rows;
}
template <typename Vec>
inline const float* widened(const uint16_t* rows, int64_t valid, int64_t head_dim, float* scratch) {
  for (int64_t i = 0; i < valid * head_dim; i += Vec::kLanes)
    Vec::store(scratch + i, Vec::load(rows + i));
  return scratch;
}

template <typename Vec, int kChunks, typename T>
void attend_task(const Member* members, int64_t member_count, int64_t group,
                 int64_t head_dim_runtime, const T* keys, const T* values, int64_t k0,
                 float scale) {
  using V = typename Vec::V;
  constexpr int L = Vec::kLanes;
  // kChunks > 0: head_dim = kChunks * L known here (registers for a head's vectors).
  const int64_t chunks = kChunks > 0 ? kChunks : head_dim_runtime / L;
  const int64_t head_dim = chunks * L;
  int64_t longest = 0;
  for (int64_t m = 0; m < member_count; ++m) longest = std::max(longest, members[m].count);
  const int64_t padded = (longest + L - 1) / L * L;  // a member's scores of one head
  thread_local std::vector<float> score_buffer, block_buffer;
  score_buffer.resize(static_cast<size_t>(member_count * group * padded));
  block_buffer.resize(static_cast<size_t>(L * head_dim));
  const V scaling = Vec::set1(scale);
  // 1. Scores, a block of L keys at a time, widened once for every member.
  for (int64_t b = 0; b < longest; b += L) {
    const float* block = widened<Vec>(keys + (k0 + b) * head_dim, std::min<int64_t>(L, longest - b),
                                      head_dim, block_buffer.data());
    for (int64_t m = 0; m < member_count; ++m) {
      const int64_t count = members[m].count;
      if (b >= count) continue;
      const int64_t valid = std::min<int64_t>(L, count - b);
      float* scores = score_buffer.data() + m * group * padded;
      for (int64_t g = 0; g < group; ++g) {
        const float* query = members[m].queries + g * head_dim;
        V partial[L];
        if constexpr (kChunks > 0) {
          if (valid == L) {  // a whole block: every vector in registers
            V q[kChunks];
            for (int c = 0; c < kChunks; ++c) q[c] = Vec::load(query + c * L);
            // 16 vectors of a head (256 values) and 16 sums would fill every register:
            // such heads take 8 keys at a time.
            constexpr int kKeysAtOnce = kChunks > 8 ? 8 : L;
            for (int j0 = 0; j0 < L; j0 += kKeysAtOnce) {
#pragma GCC unroll 16
              for (int j = j0; j < j0 + kKeysAtOnce; ++j) {
                V sum = Vec::mul(q[0], Vec::load(block + j * head_dim));
                for (int c = 1; c < kChunks; ++c)
                  sum = Vec::fma(q[c], Vec::load(block + j * head_dim + c * L), sum);
                partial[j] = sum;
              }
            }
            Vec::store(scores + g * padded + b, Vec::mul(Vec::pack_sums(partial), scaling));
            continue;
          }
        }
        for (int j = 0; j < L; ++j) {
          V sum = Vec::zero();
          if (j < valid) {
            sum = Vec::mul(Vec::load(query), Vec::load(block + j * head_dim));
            for (int64_t c = 1; c < chunks; ++c)
              sum =
                  Vec::fma(Vec::load(query + c * L), Vec::load(block + j * head_dim + c * L), sum);
          }
          partial[j] = sum;
        }
        Vec::store(scores + g * padded + b, Vec::mul(Vec::pack_sums(partial), scaling));
      }
    }
  }
  // 2. Exponentials of each head's scores less their largest; padding lanes count 0.
  for (int64_t m = 0; m < member_count; ++m) {
    const int64_t count = members[m].count;
    const int64_t used = (count + L - 1) / L * L;
    float* largest = members[m].out;
    float* total = largest + group;
    float* weighted = total + group;
    for (int64_t g = 0; g < group; ++g) {
      float* row_scores = score_buffer.data() + (m * group + g) * padded;
      for (int64_t j = count; j < used; ++j) row_scores[j] = -INFINITY;
      V high = Vec::set1(-INFINITY);
      for (int64_t j = 0; j < used; j += L) high = Vec::max(high, Vec::load(row_scores + j));
      const float top = Vec::reduce_max(high);
      const V shift = Vec::set1(top);
      V sum = Vec::zero();
      for (int64_t j = 0; j < used; j += L) {
        const V e = Vec::exp(Vec::sub(Vec::load(row_scores + j), shift));
        Vec::store(row_scores + j, e);
        sum = Vec::add(sum, e);
      }
      largest[g] = top;
      total[g] = Vec::reduce_add(sum);
      std::fill(weighted + g * head_dim, weighted + (g + 1) * head_dim, 0.0f);
    }
  }
  // 3. Weighted sums of the values, a block of L values at a time, widened once.
  for (int64_t b = 0; b < longest; b += L) {
    const float* block =
        widened<Vec>(values + (k0 + b) * head_dim, std::min<int64_t>(L, longest - b), head_dim,
                     block_buffer.data());
    for (int64_t m = 0; m < member_count; ++m) {
      const int64_t count = members[m].count;
      if (b >= count) continue;
      const int64_t valid = std::min<int64_t>(L, count - b);
      float* weighted = members[m].out + 2 * group;
      for (int64_t g = 0; g < group; ++g) {
        const float* weights = score_buffer.data() + (m * group + g) * padded + b;
        float* out = weighted + g * head_dim;
        if constexpr (kChunks > 0 && kChunks < 8) {
          // Even and odd keys in two sets of sums: at least 8 independent chains of fused
          // multiply-adds (a head of 8 vectors or more has as many in one set).
          V even[kChunks], odd[kChunks];
          for (int c = 0; c < kChunks; ++c) even[c] = Vec::load(out + c * L), odd[c] = Vec::zero();
          int64_t j = 0;
          for (; j + 2 <= valid; j += 2) {
            const V w0 = Vec::set1(weights[j]), w1 = Vec::set1(weights[j + 1]);
            for (int c = 0; c < kChunks; ++c) {
              even[c] = Vec::fma(w0, Vec::load(block + j * head_dim + c * L), even[c]);
              odd[c] = Vec::fma(w1, Vec::load(block + (j + 1) * head_dim + c * L), odd[c]);
            }
          }
          if (j < valid) {
            const V w = Vec::set1(weights[j]);
            for (int c = 0; c < kChunks; ++c)
              even[c] = Vec::fma(w, Vec::load(block + j * head_dim + c * L), even[c]);
          }
          for (int c = 0; c < kChunks; ++c) Vec::store(out + c * L, Vec::add(even[c], odd[c]));
        } else if constexpr (kChunks > 0) {
          V acc[kChunks];
          for (int c = 0; c < kChunks; ++c) acc[c] = Vec::load(out + c * L);
          for (int64_t j = 0; j < valid; ++j) {
            const V w = Vec::set1(weights[j]);
            for (int c = 0; c < kChunks; ++c)
              acc[c] = Vec::fma(w, Vec::load(block + j * head_dim + c * L), acc[c]);
          }
          for (int c = 0; c < kChunks; ++c) Vec::store(out + c * L, acc[c]);
        } else {
          for (int64_t c = 0; c < chunks; ++c) {
            V acc = Vec::load(out + c * L);
            for (int64_t j = 0; j < valid; ++j)
              acc = Vec::fma(Vec::set1(weights[j]), Vec::load(block + j * head_dim + c * L), acc);
            Vec::store(out + c * L, acc);
          }
        }
      }
    }
  }
}

// The task function for a vector type and head dimension: registers for the common
// dimensions, a runtime loop for the rest.
template <typename Vec, typename T>
using TaskFn = void (*)(const Member*, int64_t, int64_t, int64_t, const T*, const T*, int64_t,
                        float);

template <typename Vec, typename T>
TaskFn<Vec, T> task_for(int64_t head_dim) {
  switch (head_dim / Vec::kLanes) {
    case 4:
      return &attend_task<Vec, 4, T>;
    case 8:
      return &attend_task<Vec, 8, T>;
    case 16:
      return &attend_task<Vec, 16, T>;
    default:
      return &attend_task<Vec, 0, T>;
  }
}

// The rows outside `in_chunk` (see the top of this file), written to attended[r, heads *
// head_dim]. Consecutive rows of one slot (a short prompt chunk, a draft's verify rows)
// share their tasks where every one of them sees keys from position 0 (no sliding window
// cuts them): their splits then start at the same keys.
template <typename Vec, typename T>
void attend_rows(const float* qkv, int64_t rows, int64_t qkv_width, const T* key_cache,
                 const T* value_cache, int64_t capacity, at::IntArrayRef slots,
                 at::IntArrayRef positions, int64_t heads, int64_t kv_heads, int64_t head_dim,
                 int64_t window, double scaling, const std::vector<char>& in_chunk,
                 float* attended) {
  const int64_t group = heads / kv_heads;
  const int64_t q_width = heads * head_dim;
  const auto first_key = [&](int64_t r) {
    return window > 0 ? std::max<int64_t>(0, positions[r] - window + 1) : int64_t{0};
  };
  // Each row's results: kv_heads x splits entries of (largest, total, weighted) per query
  // head, `stride` floats each, from entry `row_entry[r]` on.
  const int64_t stride = head_dim + 2;
  std::vector<int64_t> row_entry(static_cast<size_t>(rows) + 1, 0);
  int64_t work = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t keys = in_chunk[r] ? 0 : positions[r] + 1 - first_key(r);
    row_entry[r + 1] = row_entry[r] + kv_heads * ((keys + kSplitKeys - 1) / kSplitKeys);
    work += keys * heads;
  }
  if (row_entry[rows] == 0) return;
  thread_local std::vector<float> partials;
  partials.resize(static_cast<size_t>(row_entry[rows] * group * stride));
  float* partial = partials.data();
  const auto entry = [&](int64_t r, int64_t kv_head, int64_t split) {
    const int64_t splits = (row_entry[r + 1] - row_entry[r]) / kv_heads;
    return partial + (row_entry[r] + kv_head * splits + split) * group * stride;
  };
  // Tasks: rows [row, row + count) (one, or the rows of a short chunk that see the split's
  // keys), one KV head, keys from k0.
  struct Task {
    int64_t row, count, kv_head, k0;
  };
  std::vector<Task> tasks;
  for (int64_t r = 0; r < rows;) {
    if (in_chunk[r]) {
      ++r;
      continue;
    }
    // A run of rows of one slot (a short chunk's, a draft's verify rows), up to
    // kRowChunkMax, shares tasks where no window cuts any of them.
    int64_t end = r + 1, last = positions[r] + 1;
    bool whole = first_key(r) == 0;
    while (end < rows && !in_chunk[end] && slots[end] == slots[r] && end - r < kRowChunkMax) {
      whole = whole && first_key(end) == 0;
      last = std::max(last, positions[end] + 1);
      ++end;
    }
    if (!whole) end = r + 1, last = positions[r] + 1;  // rows one by one
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t k0 = first_key(r); k0 < last; k0 += kSplitKeys)
        tasks.push_back({r, end - r, h, k0});
    r = end;
  }
  const int64_t count = static_cast<int64_t>(tasks.size());
  const TaskFn<Vec, T> run = task_for<Vec, T>(head_dim);
  const float scale = static_cast<float>(scaling);
  // About 2^16 multiply-adds (keys x heads x head_dim x 2) or more per thread's share.
  const int64_t grain =
      std::max<int64_t>(1, count * (int64_t{1} << 15) / std::max<int64_t>(1, work * head_dim));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    Member members[kRowChunkMax];
    for (int64_t i = begin; i < end; ++i) {
      const Task& task = tasks[i];
      const int64_t split = (task.k0 - first_key(task.row)) / kSplitKeys;
      int64_t seeing = 0;  // the run's rows that see keys from k0 on
      for (int64_t r = task.row; r < task.row + task.count; ++r)
        if (positions[r] >= task.k0)
          members[seeing++] = {qkv + r * qkv_width + task.kv_head * group * head_dim,
                               std::min(positions[r] + 1, task.k0 + kSplitKeys) - task.k0,
                               entry(r, task.kv_head, split)};
      const int64_t base = (slots[task.row] * kv_heads + task.kv_head) * capacity * head_dim;
      run(members, seeing, group, head_dim, key_cache + base, value_cache + base, task.k0, scale);
    }
  });
  // Merge each row's splits in key order: the same arithmetic for one split or many.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t splits = (row_entry[r + 1] - row_entry[r]) / kv_heads;
    if (splits == 0) continue;
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kv_head = h / group, g = h % group;
      float top = -INFINITY;
      for (int64_t s = 0; s < splits; ++s) top = std::max(top, entry(r, kv_head, s)[g]);
      float denominator = 0.0f;
      float* result = attended + r * q_width + h * head_dim;
      std::fill(result, result + head_dim, 0.0f);
      for (int64_t s = 0; s < splits; ++s) {
        const float* sums = entry(r, kv_head, s);
        const float weight = std::exp(sums[g] - top);
        denominator += weight * sums[group + g];
        const float* weighted = sums + 2 * group + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) result[d] += weight * weighted[d];
      }
      const float inverse = 1.0f / denominator;
      for (int64_t d = 0; d < head_dim; ++d) result[d] *= inverse;
    }
  }
}

template <typename T>
void attend_rows_widest(const float* qkv, int64_t rows, int64_t qkv_width, const T* key_cache,
                        const T* value_cache, int64_t capacity, at::IntArrayRef slots,
                        at::IntArrayRef positions, int64_t heads, int64_t kv_heads,
                        int64_t head_dim, int64_t window, double scaling,
                        const std::vector<char>& in_chunk, float* attended) {
#ifdef EXO_AVX512
  if (vector_bits.load(std::memory_order_relaxed) == 512 && head_dim % 16 == 0) {
    attend_rows<Avx512>(qkv, rows, qkv_width, key_cache, value_cache, capacity, slots, positions,
                        heads, kv_heads, head_dim, window, scaling, in_chunk, attended);
    return;
  }
#endif
#ifdef EXO_AVX2
  if (head_dim % 8 == 0) {
    attend_rows<Avx2>(qkv, rows, qkv_width, key_cache, value_cache, capacity, slots, positions,
                      heads, kv_heads, head_dim, window, scaling, in_chunk, attended);
    return;
  }
#endif
  attend_rows<Scalar>(qkv, rows, qkv_width, key_cache, value_cache, capacity, slots, positions,
                      heads, kv_heads, head_dim, window, scaling, in_chunk, attended);
}

// Rows [row, row + length) of a step: one slot's consecutive positions (a prompt chunk).
struct Chunk {
  int64_t row = 0;
  int64_t length = 0;
};

// The step's runs of more than kRowChunkMax rows of one slot at consecutive positions
// (decode rows are one per slot, a draft's verify rows run from the last position down,
// so never part of one).
std::vector<Chunk> long_prompt_chunks(at::IntArrayRef slots, at::IntArrayRef positions) {
  std::vector<Chunk> chunks;
  const int64_t rows = static_cast<int64_t>(slots.size());
  for (int64_t r = 0; r < rows;) {
    int64_t end = r + 1;
    while (end < rows && slots[end] == slots[r] && positions[end] == positions[end - 1] + 1) ++end;
    if (end - r > kRowChunkMax) chunks.push_back({r, end - r});
    r = end;
  }
  return chunks;
}

// Attention of a chunk's queries (rows `chunk`, the first at `start`) to its slot's keys
// from the layer's window start up to each query's own position, by torch's
// scaled_dot_product_attention with a boolean mask (the same call as
// prefill_attention.prefill_attention's); written to `attended` [rows, heads * head_dim].
// A bfloat16 cache's visible keys and values are widened to float32 first (as
// batch_attention.attend does).
void attend_chunk(const Chunk& chunk, int64_t start, int64_t window, float* qkv, int64_t qkv_width,
                  const void* key_cache, const void* value_cache, at::ScalarType cache_type,
                  int64_t slot_offset, int64_t capacity, int64_t heads, int64_t kv_heads,
                  int64_t head_dim, double scaling, float* attended) {
  c10::InferenceMode inference;
  const int64_t count = chunk.length, end = start + count;
  const int64_t first = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;
  const int64_t keys = end - first;
  const at::Tensor query = at::from_blob(qkv + chunk.row * qkv_width, {count, heads, head_dim},
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
      at::scaled_dot_product_attention(query, cached(key_cache), cached(value_cache), visible, 0.0,
                                       false, scaling, true)
          .squeeze(0)
          .permute({1, 0, 2})
          .contiguous();  // [count, heads, head_dim]
  std::memcpy(attended + chunk.row * heads * head_dim, output.data_ptr<float>(),
              sizeof(float) * count * heads * head_dim);
}

// Sets the rows' vector width (256 or 512; 512 only where built with AVX512F) when `bits`
// > 0; returns the width in use. For tests (both paths on one CPU) and A/B runs.
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

// `decode_attention` on tensors, for tests and benchmarks: qkv [rows, qkv_width] float32
// (queries first: heads * head_dim, then keys and values, not read), caches [slots,
// kv_heads, capacity, head_dim] float32 or bfloat16, slots / positions [rows] int64.
// Returns attended [rows, heads * head_dim].
at::Tensor decode_attention_of(const at::Tensor& qkv, const at::Tensor& keys,
                               const at::Tensor& values, const at::Tensor& slots,
                               const at::Tensor& positions, int64_t heads, int64_t window,
                               double scaling) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous(),
              "decode_attention_of: qkv must be a contiguous float32 [rows, width]");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == values.scalar_type() && keys.is_contiguous() &&
                  values.is_contiguous(),
              "decode_attention_of: keys and values must be contiguous [slots, kv_heads, "
              "capacity, head_dim] of one dtype");
  const at::Tensor slot_ids = slots.to(at::kLong).contiguous();
  const at::Tensor position_ids = positions.to(at::kLong).contiguous();
  const int64_t rows = qkv.size(0), kv_heads = keys.size(1), head_dim = keys.size(3);
  TORCH_CHECK(slot_ids.numel() == rows && position_ids.numel() == rows && heads % kv_heads == 0 &&
                  qkv.size(1) >= heads * head_dim,
              "decode_attention_of: shapes do not match");
  at::Tensor attended = at::zeros({rows, heads * head_dim}, at::kFloat);
  const at::IntArrayRef slot_list(slot_ids.data_ptr<int64_t>(), rows);
  const at::IntArrayRef position_list(position_ids.data_ptr<int64_t>(), rows);
  exo_native::decode_attention(qkv.data_ptr<float>(), rows, qkv.size(1), keys.data_ptr(),
                               values.data_ptr(), keys.scalar_type(), keys.size(2), slot_list,
                               position_list, heads, kv_heads, head_dim, window, scaling,
                               attended.data_ptr<float>());
  return attended;
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
  // Long prompt chunks first (SDPA threads its own work); then the row kernel's tasks.
  const std::vector<Chunk> chunks = long_prompt_chunks(slots, positions);
  std::vector<char> in_chunk(static_cast<size_t>(rows), 0);
  for (const Chunk& chunk : chunks) {
    std::fill(in_chunk.begin() + chunk.row, in_chunk.begin() + chunk.row + chunk.length, 1);
    attend_chunk(chunk, positions[chunk.row], window, qkv, qkv_width, key_cache, value_cache,
                 cache_type, slots[chunk.row] * kv_heads * capacity * head_dim, capacity, heads,
                 kv_heads, head_dim, scaling, attended);
  }
  if (cache_type == at::kBFloat16)
    attend_rows_widest(qkv, rows, qkv_width, static_cast<const uint16_t*>(key_cache),
                       static_cast<const uint16_t*>(value_cache), capacity, slots, positions, heads,
                       kv_heads, head_dim, window, scaling, in_chunk, attended);
  else
    attend_rows_widest(qkv, rows, qkv_width, static_cast<const float*>(key_cache),
                       static_cast<const float*>(value_cache), capacity, slots, positions, heads,
                       kv_heads, head_dim, window, scaling, in_chunk, attended);
}

}  // namespace exo_native

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def("decode_attention_vector_bits(int bits) -> int", &decode_attention_vector_bits);
  m.def(
      "decode_attention_of(Tensor qkv, Tensor keys, Tensor values, Tensor slots, Tensor "
      "positions, int heads, int window, float scaling) -> Tensor",
      &decode_attention_of);
}
