// The register tile shared by exo's decode products for blocks of 32 int8 values with one
// float scale per block (or per half block of 16) and, for some formats, a zero term:
// int8_blocks.cpp's (scale, zero) blocks (GGUF Q8_0, Q5_0, Q5_1 held as int8) and symmetric
// int8 blocks (GGUF Q8_0, Q6_K), and mxfp4.cpp's MXFP4 blocks (E2M1 codes turned into
// doubled int8 values by a table lookup) where a row ends in an odd block (whole pairs of
// blocks take mxfp4.cpp's own pair tile).
//
// Scheme (block_rows.h): activations rounded to int16 per block of 32 and reordered to each
// block's even inputs, then its odd ones (`reorder_even_odd`), the order in which two shifts
// sign-extend a 32-byte vector of int8 weights to int16; products summed exactly in int32
// (two multiply-adds per block and activation row); one float multiply-add per block,
// activation row and output row. In that order 32-bit lane l of the two multiply-adds sums
// inputs 4l..4l+3, so lanes 0-3 hold the block's first 16 inputs and lanes 4-7 its last 16:
// with scales per 16 inputs (HALVES 2) each 128-bit half of the weight's scale vector is
// one half block's scale. A zero term (the format's zeros times each block's sum of rounded
// activations, block_rows.h's `unpack_scales`) is added to each output once, at the end.
//
// What differs between the formats is given by a `Blocks` policy (a small struct, passed by
// value so its members stay in registers):
//   kZeroTerm           whether `unpack` computes zero terms;
//   unpack<ROWS, NR>(n, k, scales, zero_terms)
//                       output rows n..n + NR - 1's scales as float32 into
//                       scales[NR, k / 32 * HALVES] and, with kZeroTerm, each output and
//                       activation row's zero term into zero_terms[NR][ROWS];
//   block(row, b, k)    where output row `row`'s block b is held (read once, prefetched
//                       `kPrefetchBytes` ahead);
//   values(block)       that block's 32 int8 values, in input order, as one __m256i.
// k (the inputs) is the tile's argument, not a policy member, so the loop holds it once.
#pragma once

#include <cstdint>
#include <vector>

#include "block_rows.h"

namespace exo_native::int8_tile {

#ifdef EXO_AVX2
// NR output rows from n for ROWS activation rows (xq: each row's k int16 values in even/odd
// order per block; x_scales [ROWS, k / 32]) into y[ROWS, n_total]; `scales` holds
// NR x (k / 32 * HALVES) floats. Never inlined: inlined into the row-group dispatch, GCC 12
// spilled loop values to the stack and left the block loops of 1-3 activation rows
// unaligned, which made MXFP4 slower (figures: docs/benchmarks/2026-12-05-int8-tile.md).
template <int ROWS, int NR, int HALVES, typename Blocks>
[[gnu::noinline]] void tile_avx2(const int16_t* xq, const float* x_scales, int64_t k,
                                Blocks weights, float* y, int64_t n_total, int64_t n,
                                float* scales) {
  using block_rows::kBlock;
  const int64_t blocks = k / kBlock, per_row = blocks * HALVES;
  float zero_terms[NR][ROWS];
  weights.template unpack<ROWS, NR>(n, k, scales, zero_terms);
  __m256 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int i = 0; i < NR; ++i) {
      const auto* block = weights.block(n + i, b, k);
      block_rows::prefetch_ahead(block);
      const __m256i values = weights.values(block);
      const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(values, 8), 8);
      const __m256i odd = _mm256_srai_epi16(values, 8);
      const float* scale = scales + i * per_row + b * HALVES;
      __m256 weight_scale;
      if constexpr (HALVES == 1) {
        weight_scale = _mm256_broadcast_ss(scale);
      } else {
        weight_scale = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(scale)),
                                            _mm_broadcast_ss(scale + 1), 1);
      }
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock);
        const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_loadu_si256(xv)),
                                              _mm256_madd_epi16(odd, _mm256_loadu_si256(xv + 1)));
        acc[i][r] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(sums),
            _mm256_mul_ps(_mm256_broadcast_ss(x_scales + r * blocks + b), weight_scale),
            acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) {
      const float sum = block_rows::horizontal_sum(acc[i][r]);
      if constexpr (Blocks::kZeroTerm) {
        y[r * n_total + n + i] = sum + zero_terms[i][r];
      } else {
        y[r * n_total + n + i] = sum;
      }
    }
}

// Output rows [n0, n1) for ROWS activation rows: tiles of `int8_tile_rows<ROWS>()` output
// rows (block_rows.h), then one at a time.
template <int ROWS, int HALVES, typename Blocks>
void rows_avx2(const int16_t* xq, const float* x_scales, int64_t k, Blocks weights, float* y,
               int64_t n_total, int64_t n0, int64_t n1) {
  constexpr int kTile = block_rows::int8_tile_rows<ROWS>();
  std::vector<float> scales(static_cast<size_t>(kTile * (k / block_rows::kBlock) * HALVES));
  block_rows::for_output_tiles<kTile>(n0, n1, [&](auto nr, int64_t n) {
    tile_avx2<ROWS, decltype(nr)::value, HALVES>(xq, x_scales, k, weights, y, n_total, n,
                                                 scales.data());
  });
}
#endif  // EXO_AVX2

#ifdef EXO_AVX512_TILES
// The 512-bit tile, for policies that also give `values512(block)`: a pair of blocks' 64
// int8 values (blocks b and b + 1, held one after the other) as one __m512i. A decode step
// over many requests reads each weight row once for up to 8 activation rows, so its cost
// per extra row is this loop's arithmetic: per pair of blocks and activation row, two
// vpdpwssd (AVX512-VNNI; vpmaddwd + add without it), one conversion, one multiply (the
// activation blocks' scales times the weight's) and one FMA, for 64 products; the 256-bit
// tile takes twice the instructions for the same products.
//
// Activations: each pair of blocks reordered to its 32 even inputs, then its 32 odd ones
// (block_rows.h's `reorder_pairs_even_odd`), the order in which two shifts sign-extend the
// 64-byte load; the int32 lane l of the two multiply-adds then sums inputs 4l..4l+3 of the
// pair, so lanes 0-7 are block b's, 8-15 block b + 1's (with HALVES 2: four lanes per half
// block). `pair_scales` [ROWS, k / 64, 16] holds each pair's activation scales expanded to
// those lanes (lanes 0-7 block b's, 8-15 block b + 1's); the weight's scales are expanded
// once per pair and output row (one permute) for all activation rows. Needs k % 64 == 0.
// The block sums are the 256-bit tile's exactly; the float32 sums are added in another
// order (within float32 rounding of the 256-bit tile's).
template <int ROWS, int NR, int HALVES, typename Blocks>
[[gnu::noinline]] void tile_avx512(const int16_t* xq, const float* pair_scales, int64_t k,
                                  Blocks weights, float* y, int64_t n_total, int64_t n,
                                  float* scales) {
  using block_rows::kBlock;
  using block_rows::multiply_add;
  const int64_t pairs = k / (2 * kBlock), per_row = k / kBlock * HALVES;
  float zero_terms[NR][ROWS];
  weights.template unpack<ROWS, NR>(n, k, scales, zero_terms);
  // Which of a pair's 2 HALVES scales each int32 lane takes.
  const __m512i lane_scale =
      HALVES == 1 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                  : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    for (int i = 0; i < NR; ++i) {
      const auto* block = weights.block(n + i, 2 * p, k);
      block_rows::prefetch_ahead(block);
      const __m512i values = weights.values512(block);
      const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(values, 8), 8);
      const __m512i odd = _mm512_srai_epi16(values, 8);
      const float* scale = scales + i * per_row + p * 2 * HALVES;
      const __m512 weight_scale = _mm512_permutexvar_ps(
          lane_scale, _mm512_castps128_ps512(HALVES == 1 ? _mm_castsi128_ps(_mm_loadl_epi64(
                                                               reinterpret_cast<const __m128i*>(scale)))
                                                         : _mm_loadu_ps(scale)));
      for (int r = 0; r < ROWS; ++r) {
        const int16_t* xv = xq + r * k + p * 2 * kBlock;
        const __m512i sums =
            multiply_add(multiply_add(_mm512_setzero_si512(), even, _mm512_loadu_si512(xv)),
                         odd, _mm512_loadu_si512(xv + kBlock));
        acc[i][r] = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(sums),
            _mm512_mul_ps(_mm512_loadu_ps(pair_scales + (r * pairs + p) * 16), weight_scale),
            acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) {
      const float sum = _mm512_reduce_add_ps(acc[i][r]);
      if constexpr (Blocks::kZeroTerm) {
        y[r * n_total + n + i] = sum + zero_terms[i][r];
      } else {
        y[r * n_total + n + i] = sum;
      }
    }
}

// Output rows [n0, n1) for ROWS (1-8) activation rows: tiles of one output row for up to 2
// activation rows, of 2 above (16 accumulators of the 32 registers at 8 rows), then one at
// a time.
template <int ROWS, int HALVES, typename Blocks>
void rows_avx512(const int16_t* xq, const float* pair_scales, int64_t k, Blocks weights,
                 float* y, int64_t n_total, int64_t n0, int64_t n1) {
  constexpr int kTile = ROWS <= 2 ? 1 : 2;
  std::vector<float> scales(static_cast<size_t>(kTile * (k / block_rows::kBlock) * HALVES));
  block_rows::for_output_tiles<kTile>(n0, n1, [&](auto nr, int64_t n) {
    tile_avx512<ROWS, decltype(nr)::value, HALVES>(xq, pair_scales, k, weights, y, n_total, n,
                                                   scales.data());
  });
}

// Whether a product of `rows` activation rows over k inputs takes the 512-bit tile: built,
// not switched off (`int4_decode_bits()`, EXO_NATIVE_AVX512=0) and whole pairs of blocks,
// whatever the row count: a row's sums are then the same bits in a step of one row as of
// several (speculative decoding's verify rows equal decode rows; one row had kept the
// 256-bit tile, whose float32 sums run in another order).
inline bool use_avx512(int64_t rows, int64_t k) {
  (void)rows;
  return k % (2 * block_rows::kBlock) == 0 && int4_decode_bits() == 512;
}

// The activations (quantized by `quantize_rows`, natural order, [rows, k]) reordered for
// the 512-bit tile in place, and their scales x_scales [rows, k / 32] expanded per pair of
// blocks to the tile's 16 lanes into pair_scales [rows, k / 64, 16].
inline void prepare_avx512(int16_t* xq, const float* x_scales, int64_t rows, int64_t k,
                           std::vector<float>& pair_scales) {
  const int64_t blocks = k / block_rows::kBlock, pairs = blocks / 2;
  block_rows::reorder_pairs_even_odd(xq, rows * k);
  pair_scales.resize(static_cast<size_t>(rows * pairs * 16));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < pairs; ++p)
      for (int lane = 0; lane < 16; ++lane)
        pair_scales[(r * pairs + p) * 16 + lane] = x_scales[r * blocks + 2 * p + lane / 8];
}
#endif  // EXO_AVX512_TILES

}  // namespace exo_native::int8_tile
