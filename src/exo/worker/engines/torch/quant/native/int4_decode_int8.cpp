// exo's int4 decode product with the activations rounded to int8 per block of 32 (llama.cpp's
// activation precision): the opt-in behind `--decode-activations int8` (int4_gemv.cpp's
// header and docs/benchmarks/engine-design-figures.md#int4_decode_int8cpp give what it
// costs). 256-bit tiles for AVX2 CPUs (below), and 512-bit `vpdpbusd` tiles where the
// library is built with AVX512-VNNI and BW (`tile_avx512_int8`, further down).
//
// Same weights and sum as int4_gemv.cpp's int16 kernel:
//   y[m, n] = sum_b x_scale[m, b] * (scale[n, g] * sum_j xq[m, j] q[n, j])
//           + sum_g (zero - 8 scale)[n, g] * (sum over the group of x_scale * xq),
// with xq the activations rounded per block of 32 to -127..127 (prefill_int8.cpp's
// `round_row_int8`). The weight's 4-bit integers (0..15) are the unsigned operand of
// `vpmaddubsw`, the rounded activations the signed one: one instruction multiplies 32 pairs
// and sums them two by two into int16 (|sum| <= 2 * 15 * 127), where int16 activations take
// two `vpmaddwd` and an add for the same 32 products. Two such sums still fit int16 before a
// `vpmaddwd` by ones widens them, so a pair of blocks (64 inputs) costs per activation row
// 2 vpmaddubsw, 1 vpaddw, 1 vpmaddwd, 1 conversion and 1 FMA (int16: 4 vpmaddwd, 2 vpaddd,
// 2 conversions, 2 FMAs), and per output row the weight's unpacking is 1 shuffle, 2 ANDs
// and a shift (int16: 4 ANDs, 3 shifts).
//
// The weight is held as int4_gemv.cpp holds it (a pair of blocks as 32 bytes: block 0's GGUF
// byte j at 2j, block 1's at 2j + 1; GGUF byte j = q[j] | q[j + 16] << 4). `vpmaddubsw` sums
// neighbouring bytes, which there belong to different blocks (different scales), so one
// in-lane byte shuffle (`kPairShuffle`) regroups each 128-bit lane into runs of four bytes
// of one block, alternating blocks: low lane [block 0 bytes 0-3, block 1 bytes 0-3, block 0
// bytes 4-7, block 1 bytes 4-7], high lane the same for bytes 8-15. Its low nibbles are then
// q[0..15] of both blocks and its high nibbles q[16..31], and each 32-bit lane of the
// widened sums holds one block's products: lanes 0, 2, 4, 6 block 0, lanes 1, 3, 5, 7
// block 1, scaled by one 64-bit broadcast of the two blocks' adjacent combined scales
// (weight scale x activation scale). The activations of each pair are rounded once per call
// into the matching order (`arrange_pair`). An odd last block (k % 64 == 32) is held in
// GGUF's order and multiplied in its natural order.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "block_rows.h"
#include "prefill_pack.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef EXO_AVX2

namespace {

using namespace exo_native::block_rows;

// Bytes of an interleaved pair regrouped per 128-bit lane into runs of four of one block.
inline __m256i pair_shuffle() {
  return _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,  //
                          0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
}

// A pair of blocks' 64 rounded activations (natural order: block 0's 32, block 1's 32) into
// the order the shuffled weight's nibbles take: 16 runs of four, run c (v = c / 8, lane =
// c % 8 / 4, pos = c % 4) holding inputs 32 (pos % 2) + 16 v + 8 lane + 4 (pos / 2) + 0..3.
inline void arrange_pair(const int8_t* natural, int8_t* arranged) {
  for (int c = 0; c < 16; ++c) {
    const int v = c / 8, lane = c % 8 / 4, pos = c % 4;
    std::memcpy(arranged + 4 * c, natural + 32 * (pos % 2) + 16 * v + 8 * lane + 4 * (pos / 2),
                4);
  }
}

// NR output rows from n for ROWS activation rows (xq [ROWS, k], pairs arranged; `combined`
// [NR, ROWS, blocks]: weight scale x activation scale per block), the zero terms from
// `tile_scales`.
template <int ROWS, int NR>
[[gnu::noinline]]
void tile_avx2_int8(const int8_t* xq, int64_t k, const uint8_t* q, const float* combined,
                    const float (&offset_acc)[NR][ROWS], float* y, int64_t n_total, int64_t n) {
  const int64_t blocks = k / kBlock;
  const int64_t pairs = blocks / 2;
  __m256 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm256_setzero_ps();
  const __m256i shuffle = pair_shuffle();
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < pairs; ++p) {
    for (int i = 0; i < NR; ++i) {
      const uint8_t* pair = q + (n + i) * (k / 2) + p * 32;
      const __m256i bytes = _mm256_shuffle_epi8(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair)), shuffle);
      prefetch_ahead(pair);
      const __m256i low = _mm256_and_si256(bytes, nibble);  // q[0..15] of both blocks
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + p * 64);
        const __m256i products =
            _mm256_add_epi16(_mm256_maddubs_epi16(low, _mm256_loadu_si256(xv)),
                             _mm256_maddubs_epi16(high, _mm256_loadu_si256(xv + 1)));
        const __m256i sums = _mm256_madd_epi16(products, ones);
        const __m256 scales = _mm256_castpd_ps(_mm256_broadcast_sd(
            reinterpret_cast<const double*>(combined + (i * ROWS + r) * blocks + 2 * p)));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scales, acc[i][r]);
      }
    }
  }
  if (blocks % 2) {  // an odd last block in GGUF's byte order
    const int64_t b = blocks - 1;
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    for (int i = 0; i < NR; ++i) {
      const __m128i held =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (n + i) * (k / 2) + pairs * 32));
      const __m256i values =
          _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(held, 4), low_nibbles),
                           _mm_and_si128(held, low_nibbles));  // q[0..15], q[16..31]
      for (int r = 0; r < ROWS; ++r) {
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock));
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(values, x), ones);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                    _mm256_broadcast_ss(combined + (i * ROWS + r) * blocks + b),
                                    acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r)
      y[r * n_total + n + i] = horizontal_sum(acc[i][r]) + offset_acc[i][r];
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define EXO_INT8_DECODE_AVX512 1
// The 512-bit tile (CPUs with AVX512-VNNI and BW, where `int4_decode_bits()` is 512): each
// 64-byte load is two interleaved pairs of blocks (128 inputs, blocks 4c..4c+3; pair A in
// bytes 0-31, pair B in 32-63), regrouped by the same in-lane shuffle in each of the four
// 128-bit lanes, so the low nibbles are q[0..15] of the four blocks and the high ones
// q[16..31]. `vpdpbusd` multiplies 64 unsigned weight bytes by 64 signed activation bytes
// and adds each four neighbouring products into one int32 lane of the running sums: each
// lane's four bytes are one block's (lanes 0-7 blocks 4c and 4c+1 alternating, lanes 8-15
// 4c+2 and 4c+3), and two such instructions (low then high nibbles) give each lane eight
// products of one block, exactly (|sum| <= 8 * 15 * 127). Per activation row and 128
// weights: 2 vpdpbusd, 1 conversion, 1 multiply (the row's activation scales, laid out per
// call in the sums' lane order, `activation_lanes`, times the weight's scales, permuted to
// those lanes once per output row and chunk) and 1 FMA, where the int16 tile (int4_gemv.cpp's
// `tile_avx512`) takes 4 vpdpwssd, 2 conversions, 2 permutes and 2 FMAs: the instructions a
// decode step over many requests is bound by
// (docs/benchmarks/2026-12-07-int4-decode-tiles.md). The scales' products are the same
// float32 products a per-tile table of weight x activation scales held before, without
// building that table per tile: at 8 activation rows and 576 inputs it took a sixth of the
// product's time (docs/benchmarks/2026-12-07-int8-decode-lanes.md). A chunk's activations
// are laid out to match (`wide_chunk`): pair A's arranged low half, B's low half, A's high
// half, B's high half. A last pair (k % 128 >= 64) and an odd last block take the same
// instructions on 256 bits (the upper lanes zero) in `arrange_pair`'s and natural order.

constexpr int64_t kChunk = 128;  // inputs per 64-byte load: two pairs of blocks

// The block (0-3 within a chunk) of each int32 lane of the tile's sums.
constexpr int kLaneBlock[16] = {0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3};

// One activation row's block scales (`row_scales` [blocks]) as the 512-bit tile multiplies
// them: per full chunk c, 16 floats, lane j holding block 4c + kLaneBlock[j]'s scale; then
// one vector for the blocks after the last full chunk (a last pair, an odd block) in
// natural order, zero-padded. `lanes`: [k / kChunk + 1, 16].
inline void activation_lanes(const float* row_scales, int64_t blocks, float* lanes) {
  const int64_t chunks = blocks / 4;
  for (int64_t c = 0; c < chunks; ++c)
    for (int j = 0; j < 16; ++j) lanes[c * 16 + j] = row_scales[4 * c + kLaneBlock[j]];
  for (int j = 0; j < 16; ++j)
    lanes[chunks * 16 + j] = 4 * chunks + j < blocks ? row_scales[4 * chunks + j] : 0.0f;
}

// A chunk's two arranged pairs (pair A: bytes 0-63, pair B: 64-127, each its low-nibble
// half then its high-nibble half) into the order of the 512-bit tile: A low, B low, A high,
// B high (A low and B high stay where they are).
inline void wide_chunk(int8_t* chunk) {
  int8_t held[64];
  std::memcpy(held, chunk + 32, 64);  // A high, B low
  std::memcpy(chunk + 32, held + 32, 32);
  std::memcpy(chunk + 64, held, 32);
}

// NR output rows from n for ROWS activation rows (xq [ROWS, k], each full chunk in
// `wide_chunk`'s order, a last pair arranged, an odd block natural; `x_lanes` [ROWS,
// chunks + 1, 16]: `activation_lanes` per row; `block_scales` [NR, blocks]: the weight's
// scale per block), the zero terms from `offset_acc`. A weight scale times an activation
// scale is the same float32 product a table of combined scales held.
template <int ROWS, int NR>
[[gnu::noinline]]
void tile_avx512_int8(const int8_t* xq, int64_t k, const uint8_t* q, const float* x_lanes,
                      const float* block_scales, const float (&offset_acc)[NR][ROWS], float* y,
                      int64_t n_total, int64_t n) {
  const int64_t blocks = k / kBlock;
  const int64_t pairs = blocks / 2;
  const int64_t chunks = k / kChunk;
  const int64_t lanes_per_row = (chunks + 1) * 16;
  __m512 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m512i shuffle = _mm512_broadcast_i32x4(_mm256_castsi256_si128(pair_shuffle()));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i lane_block = _mm512_loadu_si512(kLaneBlock);
  for (int64_t c = 0; c < chunks; ++c) {
    // Both loops unrolled so that each accumulator stays a register (as `tile_avx512`).
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      const uint8_t* bytes = q + (n + i) * (k / 2) + c * 64;
      const __m512i shuffled = _mm512_shuffle_epi8(_mm512_loadu_si512(bytes), shuffle);
      prefetch_ahead(bytes);
      const __m512i low = _mm512_and_si512(shuffled, nibble);  // q[0..15] of four blocks
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(shuffled, 4), nibble);
      const __m512 weight_lanes = _mm512_permutexvar_ps(
          lane_block, _mm512_castps128_ps512(_mm_loadu_ps(block_scales + i * blocks + 4 * c)));
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const int8_t* xv = xq + r * k + c * kChunk;
        const __m512i sums = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(xv)), high,
            _mm512_loadu_si512(xv + 64));
        const __m512 lane_scales =
            _mm512_mul_ps(_mm512_loadu_ps(x_lanes + r * lanes_per_row + c * 16), weight_lanes);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), lane_scales, acc[i][r]);
      }
    }
  }
  // The scales of the blocks after the last full chunk: natural order from here.
  const float* tail_lanes = x_lanes + chunks * 16;
  const __m256i shuffle256 = pair_shuffle();
  const __m256i nibble256 = _mm256_set1_epi8(0x0F);
  for (int64_t p = 2 * chunks; p < pairs; ++p) {  // at most one: k % 128 >= 64
    for (int i = 0; i < NR; ++i) {
      const __m256i bytes = _mm256_shuffle_epi8(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (n + i) * (k / 2) + p * 32)),
          shuffle256);
      const __m256i low = _mm256_and_si256(bytes, nibble256);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble256);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + p * 64);
        const __m256i sums = _mm256_dpbusd_epi32(
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), low, _mm256_loadu_si256(xv)), high,
            _mm256_loadu_si256(xv + 1));
        // Lanes alternate the pair's two blocks; the upper 256 bits of the sum are zero.
        const float* row_tail = tail_lanes + r * lanes_per_row;
        const float two[2] = {row_tail[0] * block_scales[i * blocks + 2 * p],
                              row_tail[1] * block_scales[i * blocks + 2 * p + 1]};
        double both;
        std::memcpy(&both, two, sizeof(both));
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(sums)),
                                    _mm512_castpd_ps(_mm512_set1_pd(both)), acc[i][r]);
      }
    }
  }
  if (blocks % 2) {  // an odd last block in GGUF's byte order, activations natural
    const int64_t b = blocks - 1;
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    for (int i = 0; i < NR; ++i) {
      const __m128i held =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (n + i) * (k / 2) + pairs * 32));
      const __m256i values =
          _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(held, 4), low_nibbles),
                           _mm_and_si128(held, low_nibbles));  // q[0..15], q[16..31]
      for (int r = 0; r < ROWS; ++r) {
        const __m256i x =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock));
        const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), values, x);
        const float scale =
            tail_lanes[r * lanes_per_row + (b - 4 * chunks)] * block_scales[i * blocks + b];
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(sums)),
                                    _mm512_set1_ps(scale), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r)
      y[r * n_total + n + i] = _mm512_reduce_add_ps(acc[i][r]) + offset_acc[i][r];
}

#endif  // __AVX512VNNI__ && __AVX512BW__ && __AVX512VL__

// Output rows [n0, n1) for ROWS activation rows on the 256-bit tiles (WIDE false: tiles of 4
// output rows, 2 for 3-4 activation rows) or the 512-bit ones (WIDE: 4 for up to 4
// activation rows, 1 where the weight rows are long: `for_decode_tiles`; else 1: with 2 the compiler spilled accumulators at 8 rows, 5-15 % slower,
// and two output rows shared nothing but the loop), then one at a time, keeping the
// accumulators in registers. Each tile's scales are unpacked first; the 256-bit tiles
// combine them with the activations' into `combined`, the 512-bit ones multiply them in the
// loop (`x_lanes`: `activation_lanes` per row), expanded to one scale per block where a
// group holds several blocks.
template <int ROWS, bool WIDE>
void rows_int8(const int8_t* xq, const float* x_scales, int64_t k, const uint8_t* q,
               const Int4Scales& scale_zero, int64_t groups, int64_t group_size,
               const float* offset_sums, float* y, int64_t n_total, int64_t n0, int64_t n1,
               float* scales, float* combined, const float* x_lanes) {
  constexpr int kTile = ROWS <= (WIDE ? 4 : 2) ? 4 : (WIDE ? 1 : 2);
  const int64_t blocks = k / kBlock;
  const int64_t blocks_per_group = group_size / kBlock;
  auto tile = [&](auto nr, int64_t n) {
    constexpr int NR = decltype(nr)::value;
    float offset_acc[NR][ROWS];
    scale_zero.unpack<ROWS, NR>(n, groups, offset_sums, scales, offset_acc);
#ifdef EXO_INT8_DECODE_AVX512
    if constexpr (WIDE) {
      const float* block_scales = scales;
      if (blocks_per_group != 1) {
        for (int i = 0; i < NR; ++i)
          for (int64_t g = 0; g < groups; ++g)
            std::fill_n(combined + i * blocks + g * blocks_per_group, blocks_per_group,
                        scales[i * groups + g]);
        block_scales = combined;
      }
      tile_avx512_int8<ROWS, NR>(xq, k, q, x_lanes, block_scales, offset_acc, y, n_total, n);
      return;
    }
#endif
    combine_scales<ROWS, NR>(x_scales, scales, groups, blocks, blocks_per_group, combined);
    tile_avx2_int8<ROWS, NR>(xq, k, q, combined, offset_acc, y, n_total, n);
  };
  if constexpr (WIDE)
    for_decode_tiles<ROWS, kTile>(k, n0, n1, tile);
  else
    for_output_tiles<kTile>(n0, n1, tile);
}

}  // namespace

namespace exo_native {

void int4_product_int8(const float* xp, int64_t rows, int64_t k, const at::Tensor& qweight,
                       const at::Tensor& scale_zero, float* yp) {
  const int64_t n = qweight.size(0);
  const int64_t groups = int4_group_count(scale_zero);
  const int64_t group_size = k / groups;
  if (rows == 0 || n == 0) return;
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const Int4Scales sz = Int4Scales::of(scale_zero);
  const int64_t blocks = k / kBlock;
  const int64_t blocks_per_group = group_size / kBlock;
  // The activations rounded once per call (thread-local scratch, no allocation per step),
  // each pair of blocks arranged for the tile, and per group the sum of x_scale * xq.
  thread_local AlignedBuffer<int8_t> rounded;
  thread_local std::vector<float> x_scales, block_sums, half_sums, group_sums;
  rounded.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * blocks));
  block_sums.resize(static_cast<size_t>(blocks));
  half_sums.resize(static_cast<size_t>(2 * blocks));
  group_sums.resize(static_cast<size_t>(rows * groups));
  int8_t natural[2 * kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    int8_t* row = rounded.data() + r * k;
    float* row_scales = x_scales.data() + r * blocks;
    prefill::round_row_int8(xp + r * k, k, row, row_scales, block_sums.data(),
                            half_sums.data());
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b)
        sum += block_sums[b] * row_scales[b];
      group_sums[r * groups + g] = sum;
    }
    for (int64_t p = 0; p < blocks / 2; ++p) {
      std::memcpy(natural, row + p * 64, sizeof(natural));
      arrange_pair(natural, row + p * 64);
    }
  }
  const int8_t* xq = rounded.data();
  const float* xs = x_scales.data();
  const float* sums = group_sums.data();
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 17) / std::max<int64_t>(k, 1));
#ifdef EXO_INT8_DECODE_AVX512
  // Every row count takes the 512-bit tile where it runs (as the int16 kernel: a row's sums
  // are then the same bits whatever the step's row count).
  if (int4_decode_bits() == 512) {
    const int64_t lanes_per_row = (k / kChunk + 1) * 16;
    thread_local std::vector<float> lanes;
    lanes.resize(static_cast<size_t>(rows * lanes_per_row));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < k / kChunk; ++c) wide_chunk(rounded.data() + r * k + c * kChunk);
      activation_lanes(xs + r * blocks, blocks, lanes.data() + r * lanes_per_row);
    }
    // The calling thread's buffer, named before the pool's threads run (a thread_local
    // named inside the task would be each worker's own, empty one).
    const float* xl = lanes.data();
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      thread_local std::vector<float> scales, block_scales;
      scales.resize(static_cast<size_t>(4 * groups));
      block_scales.resize(static_cast<size_t>(4 * blocks));
      for_weight_spans(rows, 8, n0, n1, k / 2, [&](int64_t s0, int64_t s1) {
        for_row_groups_of_8(rows, [&](auto count, int64_t r) {
          rows_int8<decltype(count)::value, true>(
              xq + r * k, xs + r * blocks, k, qp, sz, groups, group_size, sums + r * groups,
              yp + r * n, n, s0, s1, scales.data(), block_scales.data(),
              xl + r * lanes_per_row);
        });
      });
    });
    return;
  }
#endif
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    thread_local std::vector<float> scales, combined;
    scales.resize(static_cast<size_t>(4 * groups));
    combined.resize(static_cast<size_t>(4 * 4 * blocks));
    for_weight_spans(rows, 4, n0, n1, k / 2, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        rows_int8<decltype(count)::value, false>(
            xq + r * k, xs + r * blocks, k, qp, sz, groups, group_size, sums + r * groups,
            yp + r * n, n, s0, s1, scales.data(), combined.data(), nullptr);
      });
    });
  });
}

}  // namespace exo_native

#endif  // EXO_AVX2
