// The 512-bit int4 decode product with OUTPUT channels in the vector lanes (int4_gemv.cpp's
// kernel where it runs 512 bits wide): each 32-bit lane of an accumulator sums one output
// channel for one activation row, 16 output channels a vector.
//
// The weight stays in its held layout (int4_gemv.cpp's header: per output row and pair of
// blocks of 32, 16 little-endian 16-bit lanes, lane i holding the nibbles of inputs i,
// 16 + i, 32 + i, 48 + i). A tile of 16 output rows is transposed on the fly, one pair of
// blocks (32 bytes a row) at a time: 32-bit word m (m = 0..7) of the 16 rows becomes one
// vector V_m of 16 words (`transpose_16x8`: 24 shuffles and 8 inserts for 16 rows x 64
// inputs), whose 8 nibbles are the inputs 2m, 16 + 2m, 32 + 2m, 48 + 2m (bits 0-15) and
// 2m + 1, 17 + 2m, 33 + 2m, 49 + 2m (bits 16-31). One AND (after a shift) with 0x000F000F
// turns V_m into 16 lanes of an int16 pair of consecutive inputs, (2m, 2m + 1), (16 + 2m,
// 17 + 2m), ...: the pair that a vpdpwssd multiplies by the activations' 32-bit pair at
// that input, broadcast from memory ({1to16}), in the activations' natural order. So the
// weight's unpacking is shared by all activation rows, each row's work per 16 outputs and
// 32 inputs is 16 vpdpwssd and (per block) one conversion, one multiply and one FMA, and
// there is no horizontal sum or permute per output and row (the earlier 512-bit tile, with
// input positions in the lanes, spent about a third of an 8-row product at 576 inputs on
// them: docs/benchmarks/2026-12-07-eight-rows-lanes.md).
//
// Each lane's result, for output o and activation row r, in this order: acc = 0; for each
// block b, acc = fma(float(sum_b), weight_scale[o, g(b)] * x_scale[r, b], acc) with sum_b the
// block's exact int32 sum of int4 x int16 products; then the zero term, z = 0; for each
// group g, z = fma(zero_g - 8 scale_g, offset_sum[r, g], z); y = acc + z. The same
// operations whatever the number of activation rows or the tile's position, so a row's
// output is the same bits whether it runs alone or beside others (speculative decoding's
// exactness and batched-equals-alone rely on it).
//
// A last odd block of 32 (k % 64 == 32, GGUF's byte order: byte j holds inputs j and j + 16)
// is transposed by 32-bit words too (4 a row): word m's nibbles are inputs 4m, 16 + 4m,
// 4m + 1, 17 + 4m, 4m + 2, 18 + 4m, 4m + 3, 19 + 4m, so its pairs are (4m, 4m + 2),
// (16 + 4m, 18 + 4m), (4m + 1, 4m + 3), (17 + 4m, 19 + 4m): that block's rounded
// activations are reordered to match (`reorder_odd_block`).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_rows.h"

#if defined(EXO_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define EXO_INT4_LANES 1

namespace exo_native::int4_lanes {

using block_rows::kBlock;

constexpr int kLanes = 16;  // output channels a tile (32-bit lanes of a 512-bit vector)

// The rounded activations of one row, as `quantize_rows` left them, with a last odd block
// of 32 reordered to the pairs of its GGUF byte order (see the file's header): positions
// 2t, 2t + 1 of that block hold inputs a, b of pair t = 4m + s (s = 0..3 for the shifts
// 0, 4, 8, 12 of word m).
inline void reorder_odd_block(int16_t* values, int64_t rows, int64_t k) {
  if ((k / kBlock) % 2 == 0) return;
  for (int64_t r = 0; r < rows; ++r) {
    int16_t* block = values + r * k + k - kBlock;
    int16_t natural[kBlock];
    std::memcpy(natural, block, sizeof(natural));
    for (int m = 0; m < 4; ++m) {
      const int first[4] = {4 * m, 16 + 4 * m, 4 * m + 1, 17 + 4 * m};
      for (int s = 0; s < 4; ++s) {
        block[2 * (4 * m + s)] = natural[first[s]];
        block[2 * (4 * m + s) + 1] = natural[first[s] + 2];
      }
    }
  }
}

// 16 rows of 8 32-bit words (row j at rows[j] + offset) as 8 vectors of 16 lanes: out[m]
// lane j = word m of row j. Rows j and j + 8 share a vector (low and high 256 bits), then
// both halves are transposed as 8 x 8 words at once.
inline void transpose_16x8(const uint8_t* const* rows, int64_t offset, __m512i (&out)[8]) {
  __m512i r[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    r[j] = _mm512_inserti64x4(
        _mm512_castsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + offset))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j + 8] + offset)), 1);
  __m512i t[8], u[8];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    t[2 * j] = _mm512_unpacklo_epi32(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm512_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  }
  // Per 128 bits: u[0] = words 0 of rows 0-3 (and 4 in the next 128 bits), u[1] words 1, ...
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    u[4 * h + 0] = _mm512_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm512_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm512_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm512_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    out[m] = _mm512_permutex2var_epi64(u[m], low, u[4 + m]);
    out[m + 4] = _mm512_permutex2var_epi64(u[m], high, u[4 + m]);
  }
}

// The tile's weight scales and zero terms, per group and lane: scales[g * 16 + j],
// offsets[g * 16 + j] = zero - 8 scale of output n + j (0 for lanes past the weight's rows).
inline void tile_scales(const block_rows::Int4Scales& held, int64_t n, int count,
                        int64_t groups, float* scales, float* offsets) {
  int64_t first_scalar = 0;
  if (held.pairs != nullptr && count == kLanes) {
    // Eight groups' pairs (32 bytes a row) transposed as the weight's words are.
    const uint8_t* rows[kLanes];
    for (int j = 0; j < kLanes; ++j)
      rows[j] = reinterpret_cast<const uint8_t*>(held.pairs + (n + j) * groups * 2);
    const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (; first_scalar + 8 <= groups; first_scalar += 8) {
      __m512i words[8];
      transpose_16x8(rows, first_scalar * 4, words);
      for (int m = 0; m < 8; ++m) {
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(words[m], 16));
        const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(words[m], high_half));
        _mm512_storeu_ps(scales + (first_scalar + m) * kLanes, scale);
        _mm512_storeu_ps(offsets + (first_scalar + m) * kLanes,
                         _mm512_fnmadd_ps(eight, scale, zero));
      }
    }
  }
  for (int64_t g = first_scalar; g < groups; ++g)
    for (int j = 0; j < kLanes; ++j) {
      float scale = 0.0f, offset = 0.0f;
      if (j < count) {
        if (held.pairs != nullptr) {
          const uint16_t* pair = held.pairs + ((n + j) * groups + g) * 2;
          scale = bf16_to_float(pair[0]);
          // 8 scale is exact (a power of two), so this is the vector path's fnmadd.
          offset = bf16_to_float(pair[1]) - 8.0f * scale;
        } else {
          const uint8_t* block = held.q4k + ((n + j) * (groups / kQ4kGroups) + g / kQ4kGroups) *
                                                kQ4kBytes;
          float d, dmin;
          block_rows::q4k_d_dmin(block, d, dmin);
          scale = d * static_cast<float>(block[4 + g % kQ4kGroups]);
          offset = -(dmin * static_cast<float>(block[12 + g % kQ4kGroups]));
        }
      }
      scales[g * kLanes + j] = scale;
      offsets[g * kLanes + j] = offset;
    }
}

// sums[r] += one block's exact int32 products for ROWS rows: the weight's 16 vectors of
// int16 pairs, weight(t) for t = 0..15, times each row's activation pair at `x` + 2 t
// (broadcast: the load folds into the vpdpwssd).
template <int ROWS, typename Weight>
inline void block_sums(Weight&& weight, const int16_t* x, int64_t k, __m512i (&sums)[ROWS]) {
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const __m512i w = weight(t);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k + 2 * t, sizeof(pair));
      sums[r] = block_rows::multiply_add(sums[r], w, _mm512_set1_epi32(pair));
    }
  }
}

// Output rows n..n + count - 1 (count <= 16) for ROWS activation rows (xq: each row's k
// values, `reorder_odd_block` applied; x_scales [ROWS, blocks]; offset_sums [ROWS, groups]),
// into y[ROWS, n_total]. `scales`, `offsets`: 16 x groups floats each of scratch; `zero_row`
// k / 2 readable bytes (any values) for the lanes past count.
template <int ROWS>
[[gnu::noinline]] void tile(const int16_t* xq, const float* x_scales, int64_t k,
                            const uint8_t* q, const block_rows::Int4Scales& held,
                            int64_t groups, int64_t group_size, const float* offset_sums,
                            float* y, int64_t n_total, int64_t n, int count, float* scales,
                            float* offsets, const uint8_t* zero_row) {
  const int64_t blocks = k / kBlock, pairs = blocks / 2;
  const int64_t blocks_per_group = group_size / kBlock;
  const int64_t row_bytes = k / 2;
  const uint8_t* rows[kLanes];
  for (int j = 0; j < kLanes; ++j) rows[j] = j < count ? q + (n + j) * row_bytes : zero_row;
  tile_scales(held, n, count, groups, scales, offsets);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi32(0x000F000F);
  // Scales one block's int32 sums into the float accumulators.
  const auto add_block = [&](const __m512i (&sums)[ROWS], int64_t b) {
    const __m512 weight_scale = _mm512_loadu_ps(scales + (b / blocks_per_group) * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]),
                               _mm512_mul_ps(weight_scale,
                                             _mm512_set1_ps(x_scales[r * blocks + b])),
                               acc[r]);
  };
  const int64_t ahead = kLanes * row_bytes;
  for (int64_t p = 0; p < pairs; ++p) {
    // The next tile's weight (the 16 rows after this tile's: consecutive bytes), swept
    // linearly at the pace this tile reads its own, 16 rows x 32 bytes a pair of blocks.
    {
      const char* sweep = reinterpret_cast<const char*>(rows[0]) + ahead + p * kLanes * 32;
      for (int l = 0; l < 8; ++l) _mm_prefetch(sweep + 64 * l, _MM_HINT_T0);
    }
    __m512i words[8];
    transpose_16x8(rows, p * 32, words);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {  // blocks 2p (shifts 0, 4), 2p + 1 (8, 12)
      __m512i sums[ROWS];
      for (int r = 0; r < ROWS; ++r) sums[r] = _mm512_setzero_si512();
      // Vector t < 8: inputs 2t, 2t + 1 of the block; t >= 8: 16 + 2(t - 8) and the next.
      block_sums<ROWS>(
          [&](int t) {
            return _mm512_and_si512(_mm512_srli_epi32(words[t % 8], 8 * half + 4 * (t / 8)),
                                    mask);
          },
          xq + (2 * p + half) * kBlock, k, sums);
      add_block(sums, 2 * p + half);
    }
  }
  if (blocks % 2) {  // the odd last block: 4 words a row
    alignas(64) uint32_t words_by_row[4][kLanes];
    for (int j = 0; j < kLanes; ++j)
      for (int m = 0; m < 4; ++m)
        std::memcpy(&words_by_row[m][j], rows[j] + pairs * 32 + 4 * m, 4);
    __m512i v[4];
    for (int m = 0; m < 4; ++m) v[m] = _mm512_load_si512(words_by_row[m]);
    __m512i sums[ROWS];
    for (int r = 0; r < ROWS; ++r) sums[r] = _mm512_setzero_si512();
    // Vector t = 4m + s: word m shifted by 4 s (the pairs of the file's header).
    block_sums<ROWS>(
        [&](int t) { return _mm512_and_si512(_mm512_srli_epi32(v[t / 4], 4 * (t % 4)), mask); },
        xq + (blocks - 1) * kBlock, k, sums);
    add_block(sums, blocks - 1);
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1u);
  for (int r = 0; r < ROWS; ++r) {
    __m512 zero_term = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g)
      zero_term = _mm512_fmadd_ps(_mm512_loadu_ps(offsets + g * kLanes),
                                  _mm512_set1_ps(offset_sums[r * groups + g]), zero_term);
    _mm512_mask_storeu_ps(y + r * n_total + n, valid, _mm512_add_ps(acc[r], zero_term));
  }
}

// Tiles [t0, t1) of 16 output rows (the last one partial where n_total % 16) for ROWS rows.
template <int ROWS>
void tiles(const int16_t* xq, const float* x_scales, int64_t k, const uint8_t* q,
           const block_rows::Int4Scales& held, int64_t groups, int64_t group_size,
           const float* offset_sums, float* y, int64_t n_total, int64_t t0, int64_t t1,
           float* scales, float* offsets, const uint8_t* zero_row) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n = t * kLanes;
    const int count = static_cast<int>(std::min<int64_t>(kLanes, n_total - n));
    tile<ROWS>(xq, x_scales, k, q, held, groups, group_size, offset_sums, y, n_total, n, count,
               scales, offsets, zero_row);
  }
}

// Weight rows from this many inputs keep the earlier 512-bit tiles (int4_gemv.cpp
// `rows_avx512`): read from memory (a decode step's case), the lanes tiles took up to twice
// as long for one activation row of 1,024-2,048 inputs (the cause was not found: reading
// one output row at a time did not help), while from cache, and for rows up to 768 inputs
// from memory, they were as fast as those tiles at one row and faster from two (figures:
// docs/benchmarks/2026-12-07-eight-rows-lanes.md). The choice depends on the weight's shape
// only, never on the row count, so a row's bits do not either.
constexpr int64_t kMaxInputs = 1024;

inline bool takes(int64_t k) { return k < kMaxInputs; }

// y[rows, n] for rows activation rows (xq [rows, k]: rounded by `quantize_rows`, then
// `reorder_odd_block`; x_scales [rows, k / 32]; offset_sums [rows, groups]) times the int4
// weight q [n, k / 2] with scales `held`: tiles of 16 output rows split across torch's
// intra-op threads; on each thread groups of up to 8 activation rows, each over a span of
// tiles (`for_weight_spans`: the weight read from memory once for all the groups).
inline void product(const int16_t* xq, const float* x_scales, const float* offset_sums,
                    int64_t rows, int64_t k, const uint8_t* q, const block_rows::Int4Scales& held,
                    int64_t groups, int64_t group_size, float* y, int64_t n) {
  const int64_t blocks = k / kBlock;
  const int64_t tile_count = (n + kLanes - 1) / kLanes;
  // About 128 KiB of activations-times-weights work per task, as int4_gemv.cpp's grain.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(k, 1) / kLanes);
  at::parallel_for(0, tile_count, grain, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scales, offsets;
    thread_local std::vector<uint8_t> zero_row;
    scales.resize(static_cast<size_t>(kLanes * groups));
    offsets.resize(static_cast<size_t>(kLanes * groups));
    zero_row.resize(static_cast<size_t>(k / 2));
    block_rows::for_weight_spans(rows, 8, t0, t1, kLanes * (k / 2), [&](int64_t s0, int64_t s1) {
      block_rows::for_row_groups_of_8(rows, [&](auto count, int64_t r) {
        tiles<decltype(count)::value>(xq + r * k, x_scales + r * blocks, k, q, held, groups,
                                      group_size, offset_sums + r * groups, y + r * n, n, s0, s1,
                                      scales.data(), offsets.data(), zero_row.data());
      });
    });
  });
}

}  // namespace exo_native::int4_lanes

#endif
