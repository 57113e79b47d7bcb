// exo's int4 decode kernels for x86 CPUs: 256-bit (AVX2), and 512-bit where built with AVX512BW
// (see ../native_kernels.py and EXO_INT4_AVX512 below).
//
// y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m (decode), where
//   w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g],  g = k / group_size,
// the engine's int4 format (Int4Linear), with (scale, zero) as bfloat16 pairs (or compact
// Q4_K scales, read as their float32 values d sc and 8 d sc - dmin m: kernels.h `kQ4kBytes`)
// and q held
// per pair of blocks of 32 inputs (64 inputs, 32 bytes) as 16 little-endian 16-bit lanes:
// lane i holds q[i], q[16 + i], q[32 + i], q[48 + i] in its four nibbles, lowest first.
// One AND (and a shift) per nibble turns a 32-byte load into four vectors of 16 int16
// weights, with no byte-to-word widening (faster than GGUF's byte order, 16 bytes per block
// with q[j] and q[j + 16] in byte j, widened by vpmovzxbw; figures:
// docs/benchmarks/engine-design-figures.md#int4_gemvcpp). In bytes, the pair is the two
// GGUF-ordered blocks interleaved byte by byte; an odd last block of 32 (k % 64 == 32) is
// held in GGUF's order.
//
// With AVX2 (the CPUs this kernel is for) the activations are rounded per block of 32 to
// int16 with one float scale (largest |x| / 32767), the int4 x int16 products of a block
// are summed exactly in int32 (vpmaddwd: |sum| <= 32 * 15 * 32767) and scaled once by the
// block's two scales; the zero term is (zero - 8 scale) times the group's sum of the rounded
// activations. So the result is exactly the dequantized weights times the rounded
// activations (summed in another order), and the rounding, at most half a step of 1/32767
// of the block's largest |x| per value, is far below float16's precision. (llama.cpp rounds
// activations to int8 for its integer dot products; here that quadrupled the int4 model's
// KL from float32 and broke a greedy answer; int16 costs one more multiply-add per 16
// weights; figures: docs/benchmarks/engine-design-figures.md#int4_gemvcpp.) Four output
// rows are computed together (independent accumulators); output rows are split across
// torch's intra-op threads. Without AVX2 a portable loop computes the float32 product
// exactly.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "block_rows.h"
#include "int4_lanes.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using exo_native::bf16_to_float;
using namespace exo_native::block_rows;

#ifdef EXO_AVX2
// An accumulator's lanes summed: 256 bits here, 512 in the AVX512 kernel below.
inline float lane_sum(__m256 v) { return horizontal_sum(v); }
#if defined(__AVX512F__)
inline float lane_sum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// What both kernels' tiles do with the weight's (scale, zero) pairs: unpacked once per tile
// of NR output rows (block_rows.h's `unpack_scales`, or `unpack_q4k_scales` for compact Q4_K
// scales, their float32 values unrounded: the scales as float32 into
// scales[NR, groups], each times its activation block's scale where `x_scales` is given,
// and per output and activation row the zero term), the zero term added when the tile
// stores its sums into y[ROWS, n_total].
template <int ROWS, int NR>
struct TileScales {
  float offset_acc[NR][ROWS];

  TileScales(const Int4Scales& scale_zero, int64_t n, int64_t groups, const float* offset_sums,
             float* scales, const float* x_scales = nullptr) {
    scale_zero.unpack<ROWS, NR>(n, groups, offset_sums, scales, offset_acc, x_scales);
  }

  template <typename Vector>
  void store(const Vector (&acc)[NR][ROWS], float* y, int64_t n_total, int64_t n) const {
    for (int i = 0; i < NR; ++i)
      for (int r = 0; r < ROWS; ++r)
        y[r * n_total + n + i] = lane_sum(acc[i][r]) + offset_acc[i][r];
  }
};

// An odd last block of 32 (GGUF's byte order: byte j holds inputs j and j + 16) as two
// vectors of 16 int16 values, inputs 0-15 and 16-31.
inline void gguf_block_values(const uint8_t* block, __m256i& w0, __m256i& w1) {
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block));
  w0 = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low_nibbles));
  w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles));
}

// NR output rows at once (independent accumulators, each activation block loaded once for
// all of them) for ROWS activation rows. FOLDED (one activation row, groups of 32): the
// unpacked weight scales already hold the activation blocks' scales (`unpack_scales`), which
// spares two broadcasts and two multiplies per 64 weights of an instruction-bound loop
// (the same float32 products, so the same sums).
// Never inlined, as prefill.cpp's gemm_tile: inlined into the row dispatch, GCC 12 spilled
// the accumulators of several activation rows (figures: docs/benchmarks/2026-12-05-avx2-tiles.md).
template <int ROWS, int NR, bool FOLDED = false>
[[gnu::noinline]]
void tile_avx2_q8(const int16_t* xq, const float* x_scales, int64_t k, const uint8_t* q,
                  const Int4Scales& scale_zero, int64_t groups, int64_t group_size,
                  const float* offset_sums, float* y, int64_t n_total, int64_t n,
                  float* scales) {
  static_assert(!FOLDED || ROWS == 1, "folded scales are for one activation row");
  const int64_t blocks = k / kBlock;
  const int64_t blocks_per_group = group_size / kBlock;
  const TileScales<ROWS, NR> tile_scales(scale_zero, n, groups, offset_sums, scales,
                                         FOLDED ? x_scales : nullptr);
  __m256 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm256_setzero_ps();
  const __m256i nibble = _mm256_set1_epi16(0x000F);
  const int64_t pairs = blocks / 2;
  // A block's group: a shift where groups hold a power of two of blocks (every format exo
  // makes), found once: a 64-bit division per pair of blocks was a hot spot of the loop.
  const bool pow2 = (blocks_per_group & (blocks_per_group - 1)) == 0;
  const int shift = pow2 ? __builtin_ctzll(static_cast<uint64_t>(blocks_per_group)) : 0;
  const auto group_of = [&](int64_t block) {
    return FOLDED ? block : pow2 ? block >> shift : block / blocks_per_group;
  };
  for (int64_t p = 0; p < pairs; ++p) {  // two blocks: 32 bytes, 16 lanes of four nibbles
    const int64_t b = 2 * p;
    const int64_t g0 = group_of(b), g1 = group_of(b + 1);
    for (int i = 0; i < NR; ++i) {
      const uint8_t* pair = q + (n + i) * (k / 2) + p * 32;
      const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
      prefetch_ahead(pair);
      const __m256i w0 = _mm256_and_si256(lanes, nibble);  // q[0..15] as int16
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(lanes, 4), nibble);
      const __m256i w2 = _mm256_and_si256(_mm256_srli_epi16(lanes, 8), nibble);
      const __m256i w3 = _mm256_srli_epi16(lanes, 12);  // q[48..63]
      const __m256 scale0 = _mm256_broadcast_ss(scales + i * groups + g0);
      const __m256 scale1 = _mm256_broadcast_ss(scales + i * groups + g1);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock);
        const __m256i sums0 = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xv)),
                                               _mm256_madd_epi16(w1, _mm256_loadu_si256(xv + 1)));
        const __m256i sums1 =
            _mm256_add_epi32(_mm256_madd_epi16(w2, _mm256_loadu_si256(xv + 2)),
                             _mm256_madd_epi16(w3, _mm256_loadu_si256(xv + 3)));
        const float* x_scale = x_scales + r * blocks + b;
        if constexpr (FOLDED) {
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums0), scale0, acc[i][r]);
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums1), scale1, acc[i][r]);
        } else {
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums0),
                                      _mm256_mul_ps(_mm256_broadcast_ss(x_scale), scale0),
                                      acc[i][r]);
          acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums1),
                                      _mm256_mul_ps(_mm256_broadcast_ss(x_scale + 1), scale1),
                                      acc[i][r]);
        }
      }
    }
  }
  if (blocks % 2) {  // an odd last block in GGUF's byte order
    const int64_t b = blocks - 1;
    for (int i = 0; i < NR; ++i) {
      __m256i w0, w1;
      gguf_block_values(q + (n + i) * (k / 2) + pairs * 32, w0, w1);
      const __m256 scale = _mm256_broadcast_ss(scales + i * groups + b / blocks_per_group);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock);
        const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xv)),
                                              _mm256_madd_epi16(w1, _mm256_loadu_si256(xv + 1)));
        const __m256 weight =
            FOLDED ? scale : _mm256_mul_ps(_mm256_broadcast_ss(x_scales + r * blocks + b), scale);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), weight, acc[i][r]);
      }
    }
  }
  tile_scales.store(acc, y, n_total, n);
}

// Output rows [n0, n1) for ROWS activation rows: tiles of 4 output rows (2 for 3-4
// activation rows, keeping the accumulators in registers), then one at a time; one at a time
// throughout for one or two activation rows of long weight rows (`for_decode_tiles`).
template <int ROWS>
void rows_avx2_q8(const int16_t* xq, const float* x_scales, int64_t k, const uint8_t* q,
                  const Int4Scales& scale_zero, int64_t groups, int64_t group_size,
                  const float* offset_sums, float* y, int64_t n_total, int64_t n0, int64_t n1,
                  float* scratch) {
  constexpr int kTile = ROWS <= 2 ? 4 : 2;
  if constexpr (ROWS == 1) {
    if (group_size == kBlock) {
      for_decode_tiles<ROWS, kTile, 2>(k, n0, n1, [&](auto nr, int64_t n) {
        tile_avx2_q8<1, decltype(nr)::value, true>(xq, x_scales, k, q, scale_zero, groups,
                                                   group_size, offset_sums, y, n_total, n,
                                                   scratch);
      });
      return;
    }
  }
  for_decode_tiles<ROWS, kTile, 2>(k, n0, n1, [&](auto nr, int64_t n) {
    tile_avx2_q8<ROWS, decltype(nr)::value>(xq, x_scales, k, q, scale_zero, groups, group_size,
                                            offset_sums, y, n_total, n, scratch);
  });
}
#endif

#if defined(EXO_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define EXO_INT4_AVX512 1
// The 512-bit kernel (CPUs with AVX512BW; built with it by native_kernels._flags): the same
// exact int32 block sums as the 256-bit one, twice the inputs per instruction. Each 64-byte
// load is two pairs of blocks (128 inputs, blocks 4c..4c+3); its int16 lanes 0-15 are the
// first pair's, 16-31 the second's, so the activations of each full 128 inputs are
// reordered to match (`interleave_chunks`): for j = 0..3, inputs 16 j..16 j + 15 then
// 64 + 16 j..64 + 16 j + 15. A chunk's four weight scales are multiplied by the activation
// row's four block scales in the loop (one 128-bit multiply): the same float32 products as
// a per-tile table of combined scales, whose construction per tile took a sixth of an
// 8-row product at 576 inputs (docs/benchmarks/2026-12-07-int8-decode-lanes.md). With
// AVX512-VNNI each multiply-add and its int32 add are one vpdpwssd: the per-row work per
// 128 weights is 4 vpdpwssd, 2 conversions, 2 permutes, 2 FMAs and the small multiply,
// against about twice that for the 256-bit kernel, which is what a decode step over many
// requests (one weight read for all rows) is bound by (figures:
// docs/benchmarks/2026-12-05-batching.md). A last odd pair and an odd last block take
// 256-bit code in the activations' natural order. Weights of under 1,024 inputs take
// int4_lanes.h's tiles instead (output channels in the lanes, no sums across lanes).

constexpr int64_t kChunk = 128;  // inputs per 64-byte load: two pairs of blocks

// Every full chunk of 128 rounded activations of each row in the 512-bit kernel's order.
inline void interleave_chunks(int16_t* values, int64_t rows, int64_t k) {
  int16_t chunk[kChunk];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t start = r * k; start + kChunk <= (r + 1) * k; start += kChunk) {
      for (int j = 0; j < 4; ++j) {
        std::memcpy(chunk + 32 * j, values + start + 16 * j, 16 * sizeof(int16_t));
        std::memcpy(chunk + 32 * j + 16, values + start + 64 + 16 * j, 16 * sizeof(int16_t));
      }
      std::memcpy(values + start, chunk, sizeof(chunk));
    }
}

// NR output rows from n for ROWS activation rows (xq: each row's k values, full chunks
// interleaved; x_scales [ROWS, blocks]; offset_sums [ROWS, groups]). `scales` holds NR x
// groups floats, `block_scales` NR x blocks (the weight's scale per block, where a group
// holds several blocks).
template <int ROWS, int NR>
void tile_avx512(const int16_t* xq, const float* x_scales, int64_t k, const uint8_t* q,
                 const Int4Scales& scale_zero, int64_t groups, int64_t group_size,
                 const float* offset_sums, float* y, int64_t n_total, int64_t n, float* scales,
                 float* block_scales) {
  const int64_t blocks = k / kBlock;
  const int64_t blocks_per_group = group_size / kBlock;
  const TileScales<ROWS, NR> tile_scales(scale_zero, n, groups, offset_sums, scales);
  const float* weight_scales = scales;
  if (blocks_per_group != 1) {
    for (int i = 0; i < NR; ++i)
      for (int64_t g = 0; g < groups; ++g)
        std::fill_n(block_scales + i * blocks + g * blocks_per_group, blocks_per_group,
                    scales[i * groups + g]);
    weight_scales = block_scales;
  }
  const int64_t chunks = k / kChunk;
  __m512 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i second = _mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3);
  for (int64_t c = 0; c < chunks; ++c) {
    // Both loops unrolled, so that each accumulator is a register: GCC 12 otherwise kept
    // the loop over output rows and with it acc[i][...] in memory (a load and a store per
    // FMA; 5-12 % of an 8-row tile).
#pragma GCC unroll 4
    for (int i = 0; i < NR; ++i) {
      const uint8_t* bytes = q + (n + i) * (k / 2) + c * 64;
      const __m512i lanes = _mm512_loadu_si512(bytes);
      prefetch_ahead(bytes);
      const __m512i w0 = _mm512_and_si512(lanes, nibble);
      const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(lanes, 4), nibble);
      const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(lanes, 8), nibble);
      const __m512i w3 = _mm512_srli_epi16(lanes, 12);
      const __m128 weight_four = _mm_loadu_ps(weight_scales + i * blocks + 4 * c);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const int16_t* xv = xq + r * k + c * kChunk;
        const __m512i zero = _mm512_setzero_si512();
        // Blocks 4c and 4c + 2 (lanes 0-7, 8-15), then 4c + 1 and 4c + 3.
        const __m512i sums0 = multiply_add(multiply_add(zero, w0, _mm512_loadu_si512(xv)), w1,
                                           _mm512_loadu_si512(xv + 32));
        const __m512i sums1 = multiply_add(multiply_add(zero, w2, _mm512_loadu_si512(xv + 64)),
                                           w3, _mm512_loadu_si512(xv + 96));
        const __m512 four = _mm512_castps128_ps512(
            _mm_mul_ps(_mm_loadu_ps(x_scales + r * blocks + 4 * c), weight_four));
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums0),
                                    _mm512_permutexvar_ps(first, four), acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums1),
                                    _mm512_permutexvar_ps(second, four), acc[i][r]);
      }
    }
  }
  // The rest in natural order, in the low 256 bits (the high ones zero): one pair of blocks
  // (k % 128 >= 64), then an odd block (k % 64, GGUF's byte order).
  const int64_t pairs = blocks / 2;
  for (int64_t p = 2 * chunks; p < pairs; ++p) {
    const int64_t b = 2 * p;
    for (int i = 0; i < NR; ++i) {
      const __m512i lanes = _mm512_zextsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (n + i) * (k / 2) + p * 32)));
      const __m512i w0 = _mm512_and_si512(lanes, nibble);
      const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(lanes, 4), nibble);
      const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(lanes, 8), nibble);
      const __m512i w3 = _mm512_srli_epi16(lanes, 12);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock);
        const __m512i zero = _mm512_setzero_si512();
        const __m512i sums0 = multiply_add(
            multiply_add(zero, w0, _mm512_zextsi256_si512(_mm256_loadu_si256(xv))), w1,
            _mm512_zextsi256_si512(_mm256_loadu_si256(xv + 1)));
        const __m512i sums1 = multiply_add(
            multiply_add(zero, w2, _mm512_zextsi256_si512(_mm256_loadu_si256(xv + 2))), w3,
            _mm512_zextsi256_si512(_mm256_loadu_si256(xv + 3)));
        const float* x_scale = x_scales + r * blocks + b;
        const float* weight = weight_scales + i * blocks + b;
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums0),
                                    _mm512_set1_ps(x_scale[0] * weight[0]), acc[i][r]);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums1),
                                    _mm512_set1_ps(x_scale[1] * weight[1]), acc[i][r]);
      }
    }
  }
  if (blocks % 2) {
    const int64_t b = blocks - 1;
    for (int i = 0; i < NR; ++i) {
      __m256i low, high;
      gguf_block_values(q + (n + i) * (k / 2) + pairs * 32, low, high);
      const __m512i w0 = _mm512_zextsi256_si512(low);
      const __m512i w1 = _mm512_zextsi256_si512(high);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock);
        const __m512i sums = multiply_add(
            multiply_add(_mm512_setzero_si512(), w0,
                         _mm512_zextsi256_si512(_mm256_loadu_si256(xv))),
            w1, _mm512_zextsi256_si512(_mm256_loadu_si256(xv + 1)));
        const float scale = x_scales[r * blocks + b] * weight_scales[i * blocks + b];
        acc[i][r] =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(scale), acc[i][r]);
      }
    }
  }
  tile_scales.store(acc, y, n_total, n);
}

// Output rows [n0, n1) for ROWS activation rows (1-8): tiles of 4 output rows (2 for more
// than 4 activation rows: 16 accumulators of the 32 registers), then one at a time; one at a
// time throughout for up to 4 activation rows of long weight rows (`for_decode_tiles`).
template <int ROWS>
void rows_avx512(const int16_t* xq, const float* x_scales, int64_t k, const uint8_t* q,
                 const Int4Scales& scale_zero, int64_t groups, int64_t group_size,
                 const float* offset_sums, float* y, int64_t n_total, int64_t n0, int64_t n1,
                 float* scales, float* block_scales) {
  constexpr int kTile = ROWS <= 4 ? 4 : 2;
  for_decode_tiles<ROWS, kTile>(k, n0, n1, [&](auto nr, int64_t n) {
    tile_avx512<ROWS, decltype(nr)::value>(xq, x_scales, k, q, scale_zero, groups, group_size,
                                           offset_sums, y, n_total, n, scales, block_scales);
  });
}
#endif  // EXO_AVX2 && __AVX512F__ && __AVX512BW__

// The same product without vector intrinsics (CPUs without AVX2 + FMA).
// The int4 value of input j in a row held as described at the top of this file.
inline int nibble_at(const uint8_t* row, int64_t j, int64_t pairs) {
  const int64_t pair = j / 64;
  if (pair < pairs) {
    const int64_t within = j % 64, lane = within % 16, which = within / 16;
    const uint8_t byte = row[pair * 32 + 2 * lane + (which >= 2 ? 1 : 0)];
    return which % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
  }
  const int64_t tail = j - pairs * 64;  // the odd last block, GGUF's byte order
  const uint8_t byte = row[pairs * 32 + tail % 16];
  return tail < 16 ? (byte & 0x0F) : (byte >> 4);
}

void rows_scalar(const float* x, int64_t rows, int64_t k, const uint8_t* q,
                 const uint16_t* scale_zero, int64_t groups, int64_t group_size,
                 const float* offset_sums, float* y, int64_t n_total, int64_t n0, int64_t n1) {
  const int64_t pairs = k / (2 * kBlock);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = q + n * (k / 2);
    const uint16_t* pairs_sz = scale_zero + n * groups * 2;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * k;
      float total = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float group_sum = 0.0f;
        for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i)
          group_sum += static_cast<float>(nibble_at(row, i, pairs)) * xr[i];
        const float scale = bf16_to_float(pairs_sz[2 * g]);
        const float offset = bf16_to_float(pairs_sz[2 * g + 1]) - 8.0f * scale;
        total += scale * group_sum + offset * offset_sums[r * groups + g];
      }
      y[r * n_total + n] = total;
    }
  }
}

void check_arguments(const at::Tensor& x, const at::Tensor& qweight,
                     const at::Tensor& scale_zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int4_gemv: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "int4_gemv: qweight must be a contiguous uint8 [out, in / 2] tensor");
  TORCH_CHECK(scale_zero.is_contiguous() &&
                  (exo_native::is_q4k_scales(scale_zero) ||
                   (scale_zero.dim() == 3 && scale_zero.size(2) == 2 &&
                    scale_zero.scalar_type() == at::kBFloat16)),
              "int4_gemv: scale_zero must be a contiguous bfloat16 [out, groups, 2] tensor or "
              "compact Q4_K scales, uint8 [out, in / 256, 20]");
  const int64_t k = x.size(1), n = qweight.size(0);
  const int64_t groups = exo_native::int4_group_count(scale_zero);
  TORCH_CHECK(qweight.size(1) * 2 == k, "int4_gemv: x has ", k, " inputs, qweight ",
              qweight.size(1) * 2);
  TORCH_CHECK(scale_zero.size(0) == n && groups > 0 && k % groups == 0 &&
                  (k / groups) % kBlock == 0,
              "int4_gemv: groups must divide the inputs into multiples of 32");
}

#ifdef EXO_AVX2
template <int ROWS>
void rows_at(const int16_t* xq, const float* xs, int64_t k, const uint8_t* q, const Int4Scales& sz,
             int64_t groups, int64_t group_size, const float* sums, float* y, int64_t n,
             int64_t n0, int64_t n1, float* scratch) {
  rows_avx2_q8<ROWS>(xq, xs, k, q, sz, groups, group_size, sums, y, n, n0, n1, scratch);
}
#endif

}  // namespace

namespace exo_native {

int64_t int4_decode_bits() {
#ifdef EXO_INT4_AVX512
  // EXO_NATIVE_AVX512, read once: "0" takes the 256-bit (AVX2) kernel where the 512-bit
  // one is built (to test and compare both on one machine).
  static const int64_t bits = [] {
    const char* value = std::getenv("EXO_NATIVE_AVX512");
    return value != nullptr && std::string(value) == "0" ? int64_t{256} : int64_t{512};
  }();
  return bits;
#elif defined(EXO_AVX2)
  return 256;
#else
  return 0;
#endif
}

namespace {
std::atomic<int64_t> activation_bits{16};
}  // namespace

int64_t decode_activation_bits() { return activation_bits.load(std::memory_order_relaxed); }

void set_decode_activation_bits(int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 16, "decode activations are rounded to 8 or 16 bits, not ",
              bits);
  activation_bits.store(bits, std::memory_order_relaxed);
}

void int4_product(const float* xp, int64_t rows, int64_t k, const at::Tensor& qweight,
                  const at::Tensor& scale_zero, float* yp) {
#ifdef EXO_AVX2
  if (decode_activation_bits() == 8) {
    int4_product_int8(xp, rows, k, qweight, scale_zero, yp);
    return;
  }
#endif
  const int64_t n = qweight.size(0);
  const int64_t groups = int4_group_count(scale_zero);
  const int64_t group_size = k / groups;
  if (rows == 0 || n == 0) return;
  const uint8_t* qp = qweight.data_ptr<uint8_t>();

  // About 128 KiB of activations-times-weights work per task: small enough to balance two
  // threads on a 576-wide projection, large enough that the thread pool's cost stays small.
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 17) / std::max<int64_t>(k, 1));
  // Per-call scratch kept by the calling thread (no allocation per call in decode).
  thread_local std::vector<float> group_sums;
  group_sums.resize(static_cast<size_t>(rows * groups));
  float* sums = group_sums.data();
#ifdef EXO_AVX2
  const int64_t blocks = k / kBlock;
  thread_local AlignedBuffer<int16_t> quantized;
  thread_local std::vector<float> x_scales;
  quantized.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * blocks));
  int16_t* xq = quantized.data();
  float* xs = x_scales.data();
  quantize_rows(xp, rows, k, group_size, xq, xs, sums);
  const Int4Scales sz = Int4Scales::of(scale_zero);
#ifdef EXO_INT4_AVX512
  // Every row count, one included, takes the 512-bit kernel where it runs: a row's sums
  // are then the same bits whatever the step's row count, so a verified draft position's
  // logits are the plain decode step's (speculative decoding's exactness) and a request's
  // do not change with the batch it shares a step with. (One row had kept the 256-bit
  // kernel's folded scales, as fast there, whose float32 sums run in another order.)
  if (int4_decode_bits() == 512) {
#ifdef EXO_INT4_LANES
    if (int4_lanes::takes(k)) {  // output channels in the lanes (int4_lanes.h)
      int4_lanes::reorder_odd_block(xq, rows, k);
      int4_lanes::product(xq, xs, sums, rows, k, qp, sz, groups, group_size, yp, n);
      return;
    }
#endif
    interleave_chunks(xq, rows, k);
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      thread_local std::vector<float> scales, block_scales;
      scales.resize(static_cast<size_t>(4 * groups));
      block_scales.resize(static_cast<size_t>(4 * blocks));
      for_weight_spans(rows, 8, n0, n1, k / 2, [&](int64_t s0, int64_t s1) {
        for_row_groups_of_8(rows, [&](auto count, int64_t r) {
          rows_avx512<decltype(count)::value>(
              xq + r * k, xs + r * blocks, k, qp, sz, groups, group_size,
              sums + r * groups, yp + r * n, n, s0, s1, scales.data(), block_scales.data());
        });
      });
    });
    return;
  }
#endif
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    float scratch[4 * 512];  // four rows' scales, up to 512 groups (16,384 inputs)
    std::vector<float> large;
    float* tmp = scratch;
    if (4 * groups > 4 * 512) {
      large.resize(static_cast<size_t>(4 * groups));
      tmp = large.data();
    }
    for_weight_spans(rows, 4, n0, n1, k / 2, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        rows_at<decltype(count)::value>(xq + r * k, xs + r * blocks, k, qp, sz, groups,
                                        group_size, sums + r * groups, yp + r * n, n, s0, s1,
                                        tmp);
      });
    });
  });
#else
  // The portable loop reads pairs: compact Q4_K scales expanded for this call.
  const at::Tensor pairs = is_q4k_scales(scale_zero) ? q4k_scale_pairs(scale_zero) : scale_zero;
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(pairs.data_ptr<at::BFloat16>());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.0f;
      for (int64_t i = 0; i < group_size; ++i) sum += xp[r * k + g * group_size + i];
      sums[r * groups + g] = sum;
    }
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    rows_scalar(xp, rows, k, qp, sz, groups, group_size, sums, yp, n, n0, n1);
  });
#endif
}

}  // namespace exo_native

namespace {

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale_zero) {
  check_arguments(x, qweight, scale_zero);
  at::Tensor y = at::empty({x.size(0), qweight.size(0)}, x.options());
  exo_native::int4_product(x.data_ptr<float>(), x.size(0), x.size(1), qweight, scale_zero,
                           y.data_ptr<float>());
  return y;
}

}  // namespace

namespace exo_native {

void rms_norm_row(const float* row, const float* weight, int64_t hidden, float eps, float* out) {
  // Eight partial sums (vectorized by the compiler), then their total.
  float partial[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t i = 0;
  for (; i + 8 <= hidden; i += 8)
    for (int lane = 0; lane < 8; ++lane) partial[lane] += row[i + lane] * row[i + lane];
  float squares = 0.0f;
  for (; i < hidden; ++i) squares += row[i] * row[i];
  for (int lane = 0; lane < 8; ++lane) squares += partial[lane];
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + eps);
  if (weight == nullptr) {
    for (int64_t j = 0; j < hidden; ++j) out[j] = row[j] * inverse;
  } else {
    for (int64_t j = 0; j < hidden; ++j) out[j] = row[j] * inverse * weight[j];
  }
}

}  // namespace exo_native

namespace {

// RMSNorm over the last dimension of float32 rows, `x / sqrt(mean(x^2) + eps) * weight`
// (Zhang & Sennrich 2019), in one pass per row: torch's CPU rms_norm runs as ~7 separate
// operators (pow, mean, add, rsqrt, mul, mul, ...), which dominate a decode step's norms.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "rms_norm: x must be a contiguous float32 [rows, hidden] tensor");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden &&
                  weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "rms_norm: weight must be a contiguous float32 [hidden] tensor");
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  auto normalize = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      exo_native::rms_norm_row(xp + r * hidden, wp, hidden, epsilon, yp + r * hidden);
  };
  // One row (decode) is far below a thread hand-off's cost; prefill rows are split.
  if (rows * hidden < (int64_t{1} << 16)) {
    normalize(0, rows);
  } else {
    at::parallel_for(0, rows, std::max<int64_t>(1, (int64_t{1} << 15) / hidden), normalize);
  }
  return y;
}

}  // namespace


TORCH_LIBRARY(exo_native, m) {
  m.def("int4_gemv(Tensor x, Tensor qweight, Tensor scale_zero) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("int4_decode_bits() -> int", [] { return exo_native::int4_decode_bits(); });
  m.def("decode_activation_bits() -> int", [] { return exo_native::decode_activation_bits(); });
  m.def("set_decode_activation_bits(int bits) -> ()",
        [](int64_t bits) { exo_native::set_decode_activation_bits(bits); });
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("rms_norm", &rms_norm);
}
