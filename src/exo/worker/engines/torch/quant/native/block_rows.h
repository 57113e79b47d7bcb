// Helpers shared by exo's block kernels (int4_gemv.cpp, int8_blocks.cpp, int5_blocks.cpp, and
// prefill.cpp for the 5-bit blocks' values): activations rounded to int16 per block of 32,
// horizontal sums, software prefetch, bfloat16 scales and (scale, zero) pairs unpacked per
// tile of output rows, 5-bit lanes unpacked to int16, the dispatch of activation rows
// to register tiles of 4, 3, 2 or 1 rows, and of output rows to tiles of a few rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/Half.h>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EXO_AVX2 1
#endif

namespace exo_native::block_rows {

constexpr int64_t kBlock = 32;

#ifdef EXO_AVX2
inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}


// Output rows per register tile of the int8 decode kernels (int8_blocks.cpp, and
// int4_gemv.cpp's per-channel int8) for ROWS activation rows: one for one or two rows, so
// the weight is read as one sequential stream, which the prefetchers follow best. The int4
// and 5-bit kernels, with more arithmetic per byte, keep tiles of 4, which read faster there
// (figures: docs/benchmarks/engine-design-figures.md#block_rowsh), except the int4 tiles
// over long weight rows (`for_decode_tiles` below).
template <int ROWS>
constexpr int int8_tile_rows() {
  return ROWS <= 2 ? 1 : 2;
}

// Weights are read once per token, from memory: a software prefetch this many bytes ahead
// of each row's read position: 8-32 KiB ahead read a large weight markedly faster than none
// (figures: docs/benchmarks/engine-design-figures.md#block_rowsh).
constexpr int64_t kPrefetchBytes = 16384;

inline void prefetch_ahead(const void* address) {
  _mm_prefetch(static_cast<const char*>(address) + kPrefetchBytes, _MM_HINT_T0);
}

// For NR output rows' (scale, zero) bfloat16 pairs [NR, groups, 2]: the scales as float32
// into scales[NR, groups], and per row and activation row the zero term, sum over groups of
// (zero - 8 scale) times the group's sum of rounded activations (offset_sums[ROWS, groups]).
// 8 groups per step: a pair's bfloat16 scale is the low half of its 32 bits (shifted up it
// is the float32), the zero the high half (masked).
// With `x_scales` (one activation row whose blocks are the groups: [groups]) each stored
// scale is multiplied by its block's activation scale, the product the kernel would
// otherwise form per block and output row in its loop (the same float32 product).
template <int ROWS, int NR>
void unpack_scales(const uint16_t* scale_zero, int64_t groups, const float* offset_sums,
                   float* scales, float (&offset_acc)[NR][ROWS],
                   const float* x_scales = nullptr) {
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 eight = _mm256_set1_ps(8.0f);
  for (int i = 0; i < NR; ++i) {
    const uint16_t* pairs = scale_zero + i * groups * 2;
    __m256 offset_vec[ROWS];
    for (int r = 0; r < ROWS; ++r) offset_vec[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 2 * g));
      const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(packed, 16));
      const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(packed, high_half));
      _mm256_storeu_ps(scales + i * groups + g,
                       x_scales ? _mm256_mul_ps(_mm256_loadu_ps(x_scales + g), scale) : scale);
      const __m256 offset = _mm256_fnmadd_ps(eight, scale, zero);
      for (int r = 0; r < ROWS; ++r)
        offset_vec[r] =
            _mm256_fmadd_ps(offset, _mm256_loadu_ps(offset_sums + r * groups + g), offset_vec[r]);
    }
    for (int r = 0; r < ROWS; ++r) offset_acc[i][r] = horizontal_sum(offset_vec[r]);
    for (; g < groups; ++g) {
      const float scale = bf16_to_float(pairs[2 * g]);
      scales[i * groups + g] = x_scales ? x_scales[g] * scale : scale;
      const float offset = bf16_to_float(pairs[2 * g + 1]) - 8.0f * scale;
      for (int r = 0; r < ROWS; ++r) offset_acc[i][r] += offset * offset_sums[r * groups + g];
    }
  }
}

// Super-block `block`'s fp16 d and dmin (its first 4 bytes) as float32.
inline void q4k_d_dmin(const uint8_t* block, float& d, float& dmin) {
#ifdef __F16C__
  int32_t halves;
  std::memcpy(&halves, block, sizeof(halves));
  const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(halves));
  d = _mm_cvtss_f32(both);
  dmin = _mm_cvtss_f32(_mm_movehdup_ps(both));
#else
  uint16_t d_bits, dmin_bits;
  std::memcpy(&d_bits, block, 2);
  std::memcpy(&dmin_bits, block + 2, 2);
  d = static_cast<float>(c10::Half(d_bits, c10::Half::from_bits()));
  dmin = static_cast<float>(c10::Half(dmin_bits, c10::Half::from_bits()));
#endif
}

// `unpack_scales` for compact Q4_K scales (kernels.h `kQ4kBytes`: rows of [groups / 8, 20]
// bytes): per super-block the 8 sub-block scales and mins are one 8-lane vector each (a load
// and a widen), and group g's weights are GGUF's own, w = d sc q - dmin m (q: 0..15): scale
// d sc and zero term (zero - 8 scale) = -dmin m, both products exact in float32 (11 + 6
// significant bits), so the sums use the checkpoint's values, not the bfloat16 pairs' (the
// pairs round both, 8 significant bits; prefill's expansion still does: q4k_scales.cpp).
// Per super-block and output row: 2 widenings, 2 conversions, 2 products (the pairs: a
// load, a shift, a mask). 20 bytes per 256 inputs instead of the pairs' 32.
template <int ROWS, int NR>
void unpack_q4k_scales(const uint8_t* compact, int64_t groups, const float* offset_sums,
                       float* scales, float (&offset_acc)[NR][ROWS],
                       const float* x_scales = nullptr) {
  const int64_t super_blocks = groups / kQ4kGroups;
  for (int i = 0; i < NR; ++i) {
    __m256 offset_vec[ROWS];
    for (int r = 0; r < ROWS; ++r) offset_vec[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < super_blocks; ++s) {
      const uint8_t* block = compact + (i * super_blocks + s) * kQ4kBytes;
      float d_value, dmin_value;
      q4k_d_dmin(block, d_value, dmin_value);
      const __m256 sc = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 4))));
      const __m256 m = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 12))));
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(d_value), sc);
      const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(dmin_value), m);  // -(zero - 8 scale)
      const int64_t g = s * kQ4kGroups;
      _mm256_storeu_ps(scales + i * groups + g,
                       x_scales ? _mm256_mul_ps(_mm256_loadu_ps(x_scales + g), scale) : scale);
      for (int r = 0; r < ROWS; ++r)
        offset_vec[r] =
            _mm256_fnmadd_ps(mins, _mm256_loadu_ps(offset_sums + r * groups + g), offset_vec[r]);
    }
    for (int r = 0; r < ROWS; ++r) offset_acc[i][r] = horizontal_sum(offset_vec[r]);
  }
}

// An int4 weight's scales as the decode tiles take them: bfloat16 (scale, zero) pairs
// [out, groups, 2] (`pairs`), or compact Q4_K scales [out, groups / 8, 20] (`q4k`, when not
// null); `unpack` reads NR output rows from row n with whichever `unpack_*` fits.
struct Int4Scales {
  const uint16_t* pairs = nullptr;
  const uint8_t* q4k = nullptr;

  static Int4Scales of(const at::Tensor& scale_zero) {
    Int4Scales held;
    if (is_q4k_scales(scale_zero))
      held.q4k = scale_zero.data_ptr<uint8_t>();
    else
      held.pairs = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<at::BFloat16>());
    return held;
  }

  template <int ROWS, int NR>
  void unpack(int64_t n, int64_t groups, const float* offset_sums, float* scales,
              float (&offset_acc)[NR][ROWS], const float* x_scales = nullptr) const {
    if (q4k != nullptr)
      unpack_q4k_scales<ROWS, NR>(q4k + n * (groups / kQ4kGroups) * kQ4kBytes, groups,
                                  offset_sums, scales, offset_acc, x_scales);
    else
      unpack_scales<ROWS, NR>(pairs + n * groups * 2, groups, offset_sums, scales, offset_acc,
                              x_scales);
  }
};

// Per output row i < NR and activation row r < ROWS, each block's weight scale (`scales`
// [NR, groups], as `unpack_scales` leaves them) times its activation scale (`x_scales`
// [ROWS, blocks]), into combined[NR, ROWS, blocks]: the product a tile would otherwise form
// per block and row in its loop (the same float32 products).
template <int ROWS, int NR>
void combine_scales(const float* x_scales, const float* scales, int64_t groups, int64_t blocks,
                    int64_t blocks_per_group, float* combined) {
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) {
      float* out = combined + (i * ROWS + r) * blocks;
      const float* row_scales = x_scales + r * blocks;
      const float* weight_scales = scales + i * groups;
      if (blocks_per_group == 1) {
        int64_t b = 0;
        for (; b + 8 <= blocks; b += 8)
          _mm256_storeu_ps(out + b, _mm256_mul_ps(_mm256_loadu_ps(row_scales + b),
                                                  _mm256_loadu_ps(weight_scales + b)));
        for (; b < blocks; ++b) out[b] = row_scales[b] * weight_scales[b];
      } else {
        for (int64_t b = 0; b < blocks; ++b)
          out[b] = row_scales[b] * weight_scales[b / blocks_per_group];
      }
    }
}

// `count` bfloat16 scales as float32 (8 at a time: a bfloat16 shifted up 16 bits is its
// float32).
inline void unpack_bf16(const uint16_t* values, int64_t count, float* out) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values + j));
    _mm256_storeu_ps(out + j,
                     _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16)));
  }
  for (; j < count; ++j) out[j] = bf16_to_float(values[j]);
}

// Vector v (0-5) of a group of 5-bit lanes (int5_blocks.cpp): 16 int16 values u = x + 16 in
// [0, 31], of inputs 16 v + j of the group (j: the lane).
template <int V>
inline __m256i int5_vector(const uint8_t* group) {
  const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + (V / 3) * 32));
  const __m256i five_bits = _mm256_set1_epi16(0x1F);
  if constexpr (V % 3 == 0) return _mm256_and_si256(lanes, five_bits);
  if constexpr (V % 3 == 1) return _mm256_and_si256(_mm256_srli_epi16(lanes, 5), five_bits);
  return _mm256_srli_epi16(lanes, 10);  // bit 15 is 0
}

// Block `block` of a row of 5-bit lanes as two vectors of 16 int16 values x = u - 16 in
// [-16, 15]: inputs 0-15, 16-31 of the block.
inline void int5_block_values(const uint8_t* row, int64_t block, __m256i out[2]) {
  const uint8_t* group = row + block / kInt5GroupBlocks * kInt5GroupBytes;
  const __m256i sixteen = _mm256_set1_epi16(16);
  switch (block % kInt5GroupBlocks) {
    case 0:
      out[0] = int5_vector<0>(group);
      out[1] = int5_vector<1>(group);
      break;
    case 1:
      out[0] = int5_vector<2>(group);
      out[1] = int5_vector<3>(group);
      break;
    default:
      out[0] = int5_vector<4>(group);
      out[1] = int5_vector<5>(group);
  }
  out[0] = _mm256_sub_epi16(out[0], sixteen);
  out[1] = _mm256_sub_epi16(out[1], sixteen);
}

// Activations per block of 32 as int16 values (round to nearest) and one float scale
// (largest |x| / 32767; 0 for an all-zero block), and each group's sum of the rounded
// activations (so the zero term cancels against the same values the products use).
inline void quantize_rows(const float* x, int64_t rows, int64_t k, int64_t group_size, int16_t* values,
                   float* scales, float* group_sums) {
  const int64_t blocks = k / kBlock;
  const int64_t blocks_per_group = group_size / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      int16_t* block_values = values + r * k + b * kBlock;
      const float scale = exo_native::round_block(x + r * k + b * kBlock, block_values);
      scales[r * blocks + b] = scale;
      int32_t rounded_sum = 0;
      for (int j = 0; j < kBlock; ++j) rounded_sum += block_values[j];
      float& group_sum = group_sums[r * (k / group_size) + b / blocks_per_group];
      group_sum = (b % blocks_per_group == 0 ? 0.0f : group_sum) +
                  static_cast<float>(rounded_sum) * scale;
    }
  }
}

// Each block of 32 rounded activations reordered to its even inputs, then its odd ones:
// the order in which the int8 kernels' shifts sign-extend a 32-byte load of weights.
inline void reorder_even_odd(int16_t* values, int64_t count) {
  int16_t block[kBlock];
  for (int64_t start = 0; start + kBlock <= count; start += kBlock) {
    for (int i = 0; i < 16; ++i) {
      block[i] = values[start + 2 * i];
      block[16 + i] = values[start + 2 * i + 1];
    }
    std::memcpy(values + start, block, sizeof(block));
  }
}

// Calls body(std::integral_constant<int, R>{}, r) for the activation rows in groups of
// R = 4 starting at row r, then once for the 3, 2 or 1 rows left (the kernels' register
// tiles are templated on the row count).
template <typename Body>
void for_row_groups(int64_t rows, Body&& body) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) body(std::integral_constant<int, 4>{}, r);
  if (rows - r == 3) body(std::integral_constant<int, 3>{}, r);
  if (rows - r == 2) body(std::integral_constant<int, 2>{}, r);
  if (rows - r == 1) body(std::integral_constant<int, 1>{}, r);
}

// Calls body(std::integral_constant<int, R>{}, r) for the activation rows in groups of
// R = 8 starting at row r, then once for the 1-7 rows left: the 512-bit tiles read a weight
// row once for up to 8 activation rows.
template <typename Body>
void for_row_groups_of_8(int64_t rows, Body&& body) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) body(std::integral_constant<int, 8>{}, r);
  switch (rows - r) {
    case 7: body(std::integral_constant<int, 7>{}, r); break;
    case 6: body(std::integral_constant<int, 6>{}, r); break;
    case 5: body(std::integral_constant<int, 5>{}, r); break;
    case 4: body(std::integral_constant<int, 4>{}, r); break;
    case 3: body(std::integral_constant<int, 3>{}, r); break;
    case 2: body(std::integral_constant<int, 2>{}, r); break;
    case 1: body(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// Each pair of blocks (64 rounded activations) reordered to its 32 even inputs, then its 32
// odd ones: the order in which the 512-bit int8 tiles' shifts sign-extend a 64-byte load of
// weights (int16 lane i of the load holds inputs 2i and 2i + 1 of the pair). A last lone
// block (count % 64 == 32) is left as it is.
inline void reorder_pairs_even_odd(int16_t* values, int64_t count) {
  int16_t pair[2 * kBlock];
  for (int64_t start = 0; start + 2 * kBlock <= count; start += 2 * kBlock) {
    for (int i = 0; i < kBlock; ++i) {
      pair[i] = values[start + 2 * i];
      pair[kBlock + i] = values[start + 2 * i + 1];
    }
    std::memcpy(values + start, pair, sizeof(pair));
  }
}

// Calls tile(std::integral_constant<int, NR>{}, n) for the output rows [n0, n1) in register
// tiles of NR = TILE rows starting at row n, then NR = 1 for each row left (the kernels'
// tiles are templated on their output row count).
template <int TILE, typename Tile>
void for_output_tiles(int64_t n0, int64_t n1, Tile&& tile) {
  int64_t n = n0;
  for (; n + TILE <= n1; n += TILE) tile(std::integral_constant<int, TILE>{}, n);
  for (; n < n1; ++n) tile(std::integral_constant<int, 1>{}, n);
}
// The int4 decode tiles (int4_gemv.cpp, int4_decode_int8.cpp) for up to STREAM_ROWS
// activation rows (4 on the 512-bit tiles, 2 on the 256-bit int16 ones: as far as measured):
// TILE output rows at a time where a weight row is short, one at a time from
// kStreamMinInputs inputs (weight rows of 512 bytes and more). A tile of several output rows
// reads their weight rows side by side, several streams a row apart; one output row at a time
// reads the weight as one sequential stream, which the prefetchers follow best. With the
// weight in memory (a decode step's case) that reads markedly faster at one or two activation
// rows of 1,536-2,048 inputs, and no faster at 576-768 inputs, where a tile of 4 rows is
// itself one short stretch; in cache the tile of 4 is faster (four independent accumulators),
// but a decode step's weights are not in cache. Each output row's sums are the same bits
// either way: tiles only group rows. Figures (Zen 4; Zen 3 not measured):
// docs/benchmarks/2026-12-07-int4-decode-one-stream.md.
constexpr int64_t kStreamMinInputs = 1024;

template <int ROWS, int TILE, int STREAM_ROWS = 4, typename Tile>
void for_decode_tiles(int64_t k, int64_t n0, int64_t n1, Tile&& tile) {
  if (ROWS <= STREAM_ROWS && k >= kStreamMinInputs)
    for_output_tiles<1>(n0, n1, tile);
  else
    for_output_tiles<TILE>(n0, n1, tile);
}
#endif  // EXO_AVX2

#if defined(EXO_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
// The 512-bit decode tiles (int4_gemv.cpp's int4 and per-channel int8, int8_tile.h's int8
// blocks) are built where the compiler targets AVX512BW (native_kernels._flags); which
// width runs is `int4_decode_bits()` (kernels.h; `EXO_NATIVE_AVX512=0` forces 256 bits).
#define EXO_AVX512_TILES 1

// acc + the int16 pair products of a and b summed into int32 lanes: one vpdpwssd with
// AVX512-VNNI, else a vpmaddwd and an add.
inline __m512i multiply_add(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#endif

// Weight bytes of one span of `for_weight_spans`: well inside any AVX2 core's L2 (256 KiB
// and up), with room for the activations and the prefetched bytes ahead.
constexpr int64_t kWeightSpanBytes = 64 * 1024;

// Calls span(s0, s1) over the output rows [n0, n1) of a weight whose rows take
// `weight_row_bytes` each: once over all of them when the `rows` activation rows fit one
// register tile of `group_rows` (the weight is streamed once), else in spans of about
// `kWeightSpanBytes` (a multiple of 8 rows), so that the caller, running every group of
// activation rows over a span before the next, reads the weight from memory once and the
// later groups read it from cache. Without spans each group streamed the whole weight: 8
// decoding requests read an LM head twice (4-row tiles), 16 four times.
template <typename Span>
void for_weight_spans(int64_t rows, int64_t group_rows, int64_t n0, int64_t n1,
                      int64_t weight_row_bytes, Span&& span) {
  if (rows <= group_rows) {
    span(n0, n1);
    return;
  }
  const int64_t fit = kWeightSpanBytes / std::max<int64_t>(weight_row_bytes, 1);
  const int64_t step = std::max<int64_t>(8, fit / 8 * 8);
  for (int64_t s0 = n0; s0 < n1; s0 += step) span(s0, std::min(n1, s0 + step));
}

}  // namespace exo_native::block_rows
