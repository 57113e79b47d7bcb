// Many rows (prefill) times exo's block weights (see ../native_kernels.py): the same sum as the
// decode kernels (int4_gemv.cpp) compute row by row, the weight times the activations
// rounded per block of 32 to int16 multiples of one scale, for row counts where the product
// is compute-bound.
//
// On AVX2 + FMA CPUs the product is an integer GEMM: the weight's integer values (int4 0..15
// or int8) are unpacked, one slab of output rows at a time, into int16 pairs laid out for
// `vpmaddwd` (8 outputs per vector, two consecutive inputs per 32-bit lane), and each block
// of 32 inputs is summed exactly in int32 for a tile of 4 activation rows x 16 outputs before
// its scales apply in float32: w = q * scale + offset per group, so
//   y[m, n] += x_scale[m, b] * (scale[n, g] * sum_j xq[m, j] q[n, j] + offset[n, g] * sum_j xq[m, j]).
// Symmetric int8 blocks (one scale per 16 or 32 inputs, int8_blocks.cpp) and 5-bit blocks
// (int5_blocks.cpp) have no offset; with blocks of 16 each half of a block of 32 is summed
// and scaled on its own.
// `vpmaddwd` does 16 multiply-adds per instruction where a float32 FMA does 8, which made
// prefill's products and TTFT faster than float32's. The bound is the vpaddd after each
// vpmaddwd (the sum of a block goes on in int32), and in place the tile runs below its
// stand-alone speed (packing the slab, rounding the activations, the per-block scales).
// llama.cpp rounds activations to int8 and multiplies with `vpmaddubsw` (u8 x s8 summed in
// int16 before one widening), faster in the same stand-alone loop.
// Prefill keeps int16 by default except on AMX-BF16 CPUs (prefill_bf16.cpp; int8 is an
// opt-in, prefill_int8.cpp, `--prefill-activations int8`): rounding every linear's input to
// int8 per block of 32 moved the next-token distributions (teacher-forced, against the same
// weights with unrounded activations; int16 leaves them all but unmoved) by more than the
// int4 weights' own KL from float32, also when only well-behaved blocks took int8
// (figures: docs/benchmarks/engine-design-figures.md#prefillcpp).
// With VNNI (AVX512-VNNI or AVX-VNNI, where native_kernels._flags builds for it) each
// vpmaddwd + vpaddd pair is one vpdpwssd, and prefill_int8.cpp's vpmaddubsw, widening and add
// one vpdpbusd: the same exact integer sums.
// With AVX512-VNNI and AVX512BW the int16 tiles are 512 bits wide (16 outputs per vector, 6
// activation rows x 32 outputs per tile) and the loops turn around: for each tile of 32
// outputs, 8 blocks of its packed weight (16 KiB, L1-resident) meet every activation row
// before the next 8, the float32 sums of all rows kept in a buffer of the thread. The block
// sums and their scaling are the 256-bit tiles' (the same float32 operations in the same
// order: bit for bit the same product, tested). They are faster than the float32 path at
// 32 to 512 rows; a 4 x 32 tile looping rows outside tiles (the 256-bit tiles' order) was
// slower: each 4 rows re-read the whole slab from L2
// (figures: docs/benchmarks/engine-design-figures.md#prefillcpp).
// AMX tiles (AMX-INT8) were tried and not kept: each int16 activation split exactly into two
// bytes (x = 256 hi + lo + 128, lo = (x & 255) - 128), `tdpbssd` per block of 32 inputs for 16
// rows x 2 x 16 outputs (hi and lo), the weight's block sums from the packing, the tiles'
// int32 sums stored and scaled as here: bit for bit this product (tested), but about the
// 512-bit tiles' time. The tile multiplies are fast, but each block has its own scales, so
// every tile's sums go through memory into the vector unit once per block; scaling one block
// while the tiles multiply the next changed nothing, and `tilerelease` and `ldtilecfg` per
// slab cost more (figures: docs/benchmarks/engine-design-figures.md#prefillcpp).
// Elsewhere (and by default for int16 activations where the library is built with AVX512
// but not AVX512-VNNI + AVX512BW: kInt16GemmByDefault) the weight is dequantized to float32
// one slab at a time and multiplied by torch's float32 matmul (prefill_dequantized.cpp; the
// portable kernel's exact product).
//
// Slabs of output rows (each unpacked into a buffer of the thread that multiplies it, small
// enough to stay in its core's cache) are spread over torch's intra-op threads; with int8
// activations each slab whose integers fit them takes prefill_int8.cpp's kernel, the others
// this file's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "block_rows.h"
#include "prefill_pack.h"

#ifdef EXO_AVX2
#define EXO_INT_GEMM 1
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define EXO_INT16_TILES_512 1
#endif
#endif

#ifdef EXO_INT_GEMM
namespace {
// Whether int16 activations take the integer GEMM when EXO_NATIVE_INT_GEMM is unset. Not
// where the library is built with AVX512 but without the 512-bit int16 tiles (no
// AVX512-VNNI + AVX512BW): there a float32 FMA does 16 multiply-adds, as many as a 256-bit
// vpdpwssd, and torch's float32 matmul (MKL) runs near that peak, while the 256-bit tile
// is bound by its unpacking and adds, so the dequantized float32 path is faster there (its
// activations rounded to int16 the same way first, so the product is the same to float32
// rounding; not bit for bit the decode kernels' sums)
// (figures: docs/benchmarks/engine-design-figures.md#prefillcpp).
// int8 activations keep the integer GEMM.
#if defined(__AVX512F__) && !defined(EXO_INT16_TILES_512)
constexpr bool kInt16GemmByDefault = false;
#else
constexpr bool kInt16GemmByDefault = true;
#endif

// EXO_NATIVE_INT_GEMM, read once: 0 ("0": the dequantized float32 path for every product),
// 2 ("256": the integer GEMM with 256-bit int16 tiles even where 512-bit ones are built; to
// compare the two), 1 (any other value: the integer GEMM for every product), -1 (unset).
int int_gemm_forced() {
  static const int forced = [] {
    const char* value = std::getenv("EXO_NATIVE_INT_GEMM");
    if (value == nullptr) return -1;
    const std::string text(value);
    return text == "0" ? 0 : text == "256" ? 2 : 1;
  }();
  return forced;
}
}  // namespace
#endif  // EXO_INT_GEMM

namespace exo_native {
// Whether products with int16 activations take the integer GEMM (exactly the decode kernels'
// sums) rather than the dequantized float32 path (the same to float32 rounding).
bool int16_integer_gemm() {
#ifdef EXO_INT_GEMM
  const int forced = int_gemm_forced();
  return forced == -1 ? kInt16GemmByDefault : forced != 0;
#else
  return false;
#endif
}

// The width of the integer GEMM's int16 tiles in bits: 512 or 256 (0 where there is none).
int64_t int16_tile_bits() {
#if defined(EXO_INT16_TILES_512)
  return int_gemm_forced() == 2 ? 256 : 512;
#elif defined(EXO_INT_GEMM)
  return 256;
#else
  return 0;
#endif
}
}  // namespace exo_native

namespace {

using exo_native::bf16_to_float;
using exo_native::block_rows::kBlock;
using exo_native::prefill::aligned_buffer;
using exo_native::prefill::Held;
using exo_native::prefill::row_bytes_of;
#ifdef EXO_INT_GEMM
using exo_native::block_rows::for_row_groups;
using exo_native::prefill::block_values;
using exo_native::prefill::int8_bias;
using exo_native::prefill::pack_slab_u8;
using exo_native::prefill::pair_scales;
#ifdef EXO_INT16_TILES_512
using exo_native::prefill::pack_int4_slab_16;
#endif
using exo_native::prefill::round_row_int8;
using exo_native::prefill::transpose8;
using exo_native::prefill::u8_slab_product;
#endif

#ifdef EXO_INT_GEMM

// Unpacks outputs [n0, n0 + count) (count <= padded, a multiple of LANES) into `packed`: for
// each group of LANES outputs v (8: the 256-bit tiles' vectors, 16: the 512-bit tiles') and
// input pair p, one vector of LANES int32 lanes (lane i: output n0 + LANES v + i, inputs 2p
// and 2p + 1 as two int16) at packed + (v * k / 2 + p) * LANES. Outputs past `count` are
// zero.
template <int LANES>
void pack_slab(const uint8_t* bytes, int64_t row_bytes, Held held, int64_t k, int64_t n0,
               int64_t count, int64_t padded, int32_t* packed) {
  const int64_t blocks = k / 32, pairs = k / 2;
  for (int64_t eighth = 0; eighth < padded / 8; ++eighth) {  // 8 outputs: one transpose
    const int64_t v = eighth / (LANES / 8), lane = (eighth % (LANES / 8)) * 8;
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i low[8], high[8];  // per output row: inputs 0-15 (pairs 0-7), 16-31 (8-15)
      for (int i = 0; i < 8; ++i) {
        const int64_t row = 8 * eighth + i;
        if (row < count) {
          __m256i values[2];
          block_values(bytes + (n0 + row) * row_bytes, held, b, blocks, values);
          low[i] = values[0];
          high[i] = values[1];
        } else {
          low[i] = high[i] = _mm256_setzero_si256();
        }
      }
      __m256i out[8];
      int32_t* base = packed + (v * pairs + b * 16) * LANES + lane;
      transpose8(low, out);
      for (int j = 0; j < 8; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + j * LANES), out[j]);
      transpose8(high, out);
      for (int j = 0; j < 8; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + (8 + j) * LANES), out[j]);
    }
  }
}

// ROWS activation rows (starting at xq's row 0) x 16 outputs (two packed vectors from
// `packed_tile`): each block's int32 sums, then its scales, into `acc` [ROWS][16].
// With HALVES 2 (symmetric blocks of 16: zero offsets) each half of a block (input pairs
// 0-7, 8-15) is summed and scaled on its own, `blocks_per_group` then counting halves.
// Never inlined: inlined into int16_slab_product's row-group dispatch, GCC 12 kept the tile's
// int32 block sums on the stack (a store and a reload around each vpaddd); alone it holds
// them in registers, 1.4x faster on a Zen 3 core
// (figures: docs/benchmarks/2026-12-05-avx2-tiles.md).
template <int ROWS, int HALVES>
[[gnu::noinline]]
void gemm_tile(const int16_t* xq, const float* x_scales, const float* x_sums, int64_t k,
               const int32_t* packed_tile, const float* scales, const float* offsets,
               int64_t padded, int64_t blocks_per_group, float* acc) {
  const int64_t blocks = k / 32, pairs = k / 2;
  constexpr int kPairs = 16 / HALVES;  // input pairs summed before a scale applies
  __m256 sums[ROWS][2];
  for (int r = 0; r < ROWS; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
  const float* scale = scales;  // the group's scales and offsets: advanced per group
  const float* offset = offsets;
  int64_t in_group = 0;
  for (int64_t half = 0; half < blocks * HALVES; ++half) {
    const int64_t b = half / HALVES;
    const int64_t first = b * 16 + (half % HALVES) * kPairs;  // this part's first pair
    __m256i dot[ROWS][2];
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    const int32_t* w = packed_tile + first * 8;
    const int16_t* x = xq + 2 * first;
    for (int p = 0; p < kPairs; ++p) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 8));
      const __m256i w1 =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + pairs * 8 + p * 8));
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * k + 2 * p, sizeof(pair));
        const __m256i xr = _mm256_set1_epi32(pair);
        dot[r][0] = exo_native::prefill::add_pair_products(dot[r][0], w0, xr);
        dot[r][1] = exo_native::prefill::add_pair_products(dot[r][1], w1, xr);
      }
    }
    // The float32 side, as prefill_int8.cpp's tile writes it too: a shared helper (a struct
    // holding the sums and group pointers) made GCC's int8 tile slower, measured
    // (figures: docs/benchmarks/engine-design-figures.md#prefillcpp).
    const __m256 scale0 = _mm256_loadu_ps(scale), scale1 = _mm256_loadu_ps(scale + 8);
    const __m256 offset0 = _mm256_loadu_ps(offset), offset1 = _mm256_loadu_ps(offset + 8);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x_scale = _mm256_broadcast_ss(x_scales + r * blocks + b);
      const __m256 x_sum = _mm256_broadcast_ss(x_sums + r * blocks + b);
      const __m256 block0 =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), scale0, _mm256_mul_ps(x_sum, offset0));
      const __m256 block1 =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][1]), scale1, _mm256_mul_ps(x_sum, offset1));
      sums[r][0] = _mm256_fmadd_ps(x_scale, block0, sums[r][0]);
      sums[r][1] = _mm256_fmadd_ps(x_scale, block1, sums[r][1]);
    }
    if (++in_group == blocks_per_group) {  // the next part starts the next group
      in_group = 0;
      scale += padded;
      offset += padded;
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    _mm256_storeu_ps(acc + r * 16, sums[r][0]);
    _mm256_storeu_ps(acc + r * 16 + 8, sums[r][1]);
  }
}

#ifdef EXO_INT16_TILES_512
// gemm_tile with 512-bit vectors: ROWS activation rows (row stride k) x 16 VECS outputs
// (VECS packed vectors from `packed_tile`), the blocks [b0, b1) only, each block's scaled
// sum added into acc [ROWS][32] (the same float32 operations, in the same order, as
// gemm_tile's: a tile's sums over blocks [0, 8) then [8, 16) ... equal its sums over all).
template <int ROWS, int HALVES, int VECS>
void gemm_tile_512(const int16_t* xq, const float* x_scales, const float* x_sums, int64_t k,
                   int64_t b0, int64_t b1, const int32_t* packed_tile, const float* scales,
                   const float* offsets, int64_t padded, int64_t blocks_per_group,
                   float* acc) {
  const int64_t blocks = k / 32, pairs = k / 2;
  constexpr int kPairs = 16 / HALVES;  // input pairs summed before a scale applies
  int64_t part = b0 * HALVES;  // a block, or half of one with HALVES 2
  const float* scale = scales + (part / blocks_per_group) * padded;
  const float* offset = offsets + (part / blocks_per_group) * padded;
  int64_t in_group = part % blocks_per_group;
  for (; part < b1 * HALVES; ++part) {
    const int64_t b = part / HALVES;
    const int64_t first = b * 16 + (part % HALVES) * kPairs;  // this part's first pair
    __m512i dot[ROWS][VECS];
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < VECS; ++v) dot[r][v] = _mm512_setzero_si512();
    const int32_t* w = packed_tile + first * 16;
    // Unrolled: GCC's rolled loop moved every accumulator through a copy per vpdpwssd, much
    // slower (figures: docs/benchmarks/engine-design-figures.md#prefillcpp).
#pragma GCC unroll 16
    for (int p = 0; p < kPairs; ++p) {
      __m512i weights[VECS];
#pragma GCC unroll 2
      for (int v = 0; v < VECS; ++v)
        weights[v] = _mm512_loadu_si512(w + v * pairs * 16 + p * 16);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;  // inputs 2 (first + p) and the next of row r, as one lane
        std::memcpy(&pair, xq + r * k + 2 * (first + p), sizeof(pair));
        const __m512i xr = _mm512_set1_epi32(pair);
#pragma GCC unroll 2
        for (int v = 0; v < VECS; ++v) dot[r][v] = _mm512_dpwssd_epi32(dot[r][v], weights[v], xr);
      }
    }
    for (int v = 0; v < VECS; ++v) {
      const __m512 scale_v = _mm512_loadu_ps(scale + 16 * v);
      const __m512 offset_v = _mm512_loadu_ps(offset + 16 * v);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 x_scale = _mm512_set1_ps(x_scales[r * blocks + b]);
        const __m512 x_sum = _mm512_set1_ps(x_sums[r * blocks + b]);
        const __m512 block = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][v]), scale_v,
                                             _mm512_mul_ps(x_sum, offset_v));
        float* sums = acc + r * 32 + 16 * v;
        _mm512_storeu_ps(sums, _mm512_fmadd_ps(x_scale, block, _mm512_loadu_ps(sums)));
      }
    }
    if (++in_group == blocks_per_group) {  // the next part starts the next group
      in_group = 0;
      scale += padded;
      offset += padded;
    }
  }
}

// Blocks of a tile's packed weight per pass over the activation rows: 8 blocks of 32
// outputs are 16 KiB (L1-resident while every row meets them); 4 or 16 were no better, all
// of k slower (figures: docs/benchmarks/engine-design-figures.md#prefillcpp).
constexpr int64_t kBlocksPerPass = 8;

// int16_slab_product with 512-bit tiles on a slab packed by `pack_slab<16>`.
void int16_slab_product_512(const int16_t* xq, const float* x_scales, const float* x_sums,
                            int64_t rows, int64_t k, bool halves, const int32_t* packed,
                            const float* scales, const float* offsets, int64_t padded,
                            int64_t count, int64_t blocks_per_group, int64_t n0, int64_t n,
                            float* y) {
  const int64_t blocks = k / 32;
  // The float32 sums of every row for one tile: 128 B per row; kept between calls (a fresh
  // buffer is a fresh mapping whose pages fault in on first write).
  thread_local std::vector<float> sums_buffer;
  float* acc = aligned_buffer(sums_buffer, static_cast<size_t>(rows * 32));
  for (int64_t t = 0; t < padded / 16; t += 2) {  // t: the tile's first vector of 16
    const int32_t* tile = packed + t * (k / 2) * 16;
    const bool two = t + 1 < padded / 16;  // 32 outputs, or the last 16
    std::fill(acc, acc + rows * 32, 0.0f);
    for (int64_t b0 = 0; b0 < blocks; b0 += kBlocksPerPass) {
      const int64_t b1 = std::min(blocks, b0 + kBlocksPerPass);
      auto rows_tile = [&](auto count_rows, int64_t r) {
        constexpr int R = decltype(count_rows)::value;
        const int16_t* x = xq + r * k;
        const float* x_scale = x_scales + r * blocks;
        const float* x_sum = x_sums + r * blocks;
        const float* scale = scales + 16 * t;
        const float* offset = offsets + 16 * t;
        float* sums = acc + r * 32;
        if (two && halves)
          gemm_tile_512<R, 2, 2>(x, x_scale, x_sum, k, b0, b1, tile, scale, offset, padded,
                                 blocks_per_group, sums);
        else if (two)
          gemm_tile_512<R, 1, 2>(x, x_scale, x_sum, k, b0, b1, tile, scale, offset, padded,
                                 blocks_per_group, sums);
        else if (halves)
          gemm_tile_512<R, 2, 1>(x, x_scale, x_sum, k, b0, b1, tile, scale, offset, padded,
                                 blocks_per_group, sums);
        else
          gemm_tile_512<R, 1, 1>(x, x_scale, x_sum, k, b0, b1, tile, scale, offset, padded,
                                 blocks_per_group, sums);
      };
      // Tiles of 6 rows (12 accumulators: enough vpdpwssd in flight), the rest by 4..1.
      int64_t r = 0;
      for (; r + 6 <= rows; r += 6) rows_tile(std::integral_constant<int, 6>{}, r);
      const int64_t done = r;
      for_row_groups(rows - done, [&](auto count_rows, int64_t rest) {
        rows_tile(count_rows, done + rest);
      });
    }
    // Out to y's columns n0 + 16 t.. (masked: libc's memcpy per row took a noticeable share
    // of the product; figures: docs/benchmarks/engine-design-figures.md#prefillcpp).
    const int64_t width = std::min<int64_t>(two ? 32 : 16, count - 16 * t);
    const auto mask_of = [](int64_t lanes) {
      return lanes >= 16 ? static_cast<__mmask16>(0xFFFF)
             : lanes <= 0 ? static_cast<__mmask16>(0)
                          : static_cast<__mmask16>((1u << lanes) - 1);
    };
    const __mmask16 mask0 = mask_of(width), mask1 = mask_of(width - 16);
    for (int64_t i = 0; i < rows; ++i) {
      float* out = y + i * n + n0 + 16 * t;
      _mm512_mask_storeu_ps(out, mask0, _mm512_loadu_ps(acc + i * 32));
      _mm512_mask_storeu_ps(out + 16, mask1, _mm512_loadu_ps(acc + i * 32 + 16));
    }
  }
}
#endif  // EXO_INT16_TILES_512

// The int16 activation rows times a slab packed by `pack_slab<8>` into y's columns
// [n0, n0 + count).
void int16_slab_product(const int16_t* xq, const float* x_scales, const float* x_sums,
                        int64_t rows, int64_t k, bool halves, const int32_t* packed,
                        const float* scales, const float* offsets, int64_t padded,
                        int64_t count, int64_t blocks_per_group, int64_t n0, int64_t n,
                        float* y) {
  const int64_t blocks = k / 32;
  float acc[4 * 16];
  // Row groups outside, tiles inside: a group's activation rows (4 x k int16) stay in L1
  // while the slab's tiles come from L2.
  for_row_groups(rows, [&](auto count_rows, int64_t r) {
    constexpr int R = decltype(count_rows)::value;
    for (int64_t t = 0; t < padded / 16; ++t) {
      const int32_t* tile = packed + 2 * t * (k / 2) * 8;
      if (halves)
        gemm_tile<R, 2>(xq + r * k, x_scales + r * blocks, x_sums + r * blocks, k, tile,
                        scales + 16 * t, offsets + 16 * t, padded, blocks_per_group, acc);
      else
        gemm_tile<R, 1>(xq + r * k, x_scales + r * blocks, x_sums + r * blocks, k, tile,
                        scales + 16 * t, offsets + 16 * t, padded, blocks_per_group, acc);
      const int64_t width = std::min<int64_t>(16, count - 16 * t);
      for (int i = 0; i < R; ++i)
        std::memcpy(y + (r + i) * n + n0 + 16 * t, acc + i * 16, sizeof(float) * width);
    }
  });
}

// The integer GEMM of the file's comment: y[rows, n] for a block weight. `symmetric`: one
// bfloat16 scale per group of 16 or 32 inputs (offset 0) instead of (scale, zero) pairs.
// `int8_activations`: rows from `int16_rows` on multiply the activations rounded to int8
// (prefill_int8.cpp) in every slab whose integers fit (int4 and 5-bit weights always, int8
// ones whose values lie in [-32, 31]); the first `int16_rows` rows (a step's decode tokens)
// and the other slabs int16.
void integer_block_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* bytes,
                          Held held, bool symmetric, const uint16_t* scale_zero, int64_t groups,
                          int64_t n, float* y, bool int8_activations, int64_t int16_rows) {
  const int64_t blocks = k / 32, group_size = k / groups;
  const bool halves = group_size == 16;  // blocks of 16: each half of a block its own scale
  const int64_t blocks_per_group = halves ? 1 : group_size / 32;
  const int64_t row_bytes = row_bytes_of(held, k);
  const int64_t rows16 = int8_activations ? std::clamp<int64_t>(int16_rows, 0, rows) : rows;
  const bool int8_rows = rows16 < rows;
  // int16 rounding for the leading rows, and for all rows where a slab may not fit int8.
  const int64_t rounded16 = int8_rows && held != Held::kInt8 ? rows16 : rows;
  std::vector<int16_t> quantized(static_cast<size_t>(rounded16 * k));
  std::vector<float> x_scales(static_cast<size_t>(rounded16 * blocks));
  std::vector<float> x_sums(static_cast<size_t>(rounded16 * blocks));
  const int64_t rounded8 = int8_rows ? rows : 0;
  std::vector<int8_t> values8(static_cast<size_t>(rounded8 * k));
  std::vector<float> scales8(static_cast<size_t>(rounded8 * blocks));
  std::vector<float> sums8(static_cast<size_t>(rounded8 * blocks));
  std::vector<float> half_sums8(static_cast<size_t>(rounded8 * blocks * 2));
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (r >= rows16)
        round_row_int8(x + r * k, k, values8.data() + r * k, scales8.data() + r * blocks,
                       sums8.data() + r * blocks, half_sums8.data() + r * blocks * 2);
      if (r >= rounded16) continue;
      for (int64_t b = 0; b < blocks; ++b) {
        int16_t* values = quantized.data() + r * k + b * 32;
        x_scales[r * blocks + b] = exo_native::round_block(x + r * k + b * 32, values);
        int32_t sum = 0;
        for (int j = 0; j < 32; ++j) sum += values[j];
        x_sums[r * blocks + b] = static_cast<float>(sum);
      }
    }
  });
  // The int8 rows: those from `rows16` on.
  const exo_native::prefill::Int8Rows rows8{
      values8.data() + rows16 * k, scales8.data() + rows16 * blocks,
      sums8.data() + rows16 * blocks, half_sums8.data() + rows16 * blocks * 2};
  // A slab's packed integers take 2 bytes per weight as int16, 1 as bytes: ~128 KiB
  // (L2-resident).
  const int64_t weight_bytes = int8_rows && rows16 == 0 && held != Held::kInt8 ? 1 : 2;
  const int64_t slab =
      std::clamp<int64_t>(((int64_t{1} << 17) / (weight_bytes * k)) / 16 * 16, 16, 256);
  const int64_t slabs = (n + slab - 1) / slab;
  at::parallel_for(0, slabs, 1, [&](int64_t first, int64_t last) {
    // Each thread's buffers stay between calls: a fresh 128-256 KiB buffer is a fresh
    // mapping whose pages fault in on first write
    // (figures: docs/benchmarks/engine-design-figures.md#prefillcpp).
    thread_local std::vector<int32_t> packed_buffer, packed8_buffer;
    thread_local std::vector<float> scales_buffer, offsets_buffer, offsets8_buffer;
    int32_t* packed = aligned_buffer(packed_buffer, static_cast<size_t>(slab * k / 2));
    int32_t* packed8 =
        aligned_buffer(packed8_buffer, static_cast<size_t>(int8_rows ? slab * k / 4 : 0));
    const auto per_group = static_cast<size_t>(groups * slab);
    float* scales = aligned_buffer(scales_buffer, per_group);
    float* offsets = aligned_buffer(offsets_buffer, per_group);
    float* offsets8 = aligned_buffer(offsets8_buffer, per_group);
    for (int64_t s = first; s < last; ++s) {
      const int64_t n0 = s * slab, count = std::min(slab, n - n0);
      const int64_t padded = (count + 15) / 16 * 16;
      const bool as_int8 =
          int8_rows && pack_slab_u8(bytes, row_bytes, held, k, n0, count, padded, packed8);
      // The bytes' bias comes back out through the offset (w = (u - bias) * scale + ...).
      const float bias = int8_bias(held);
      // Outputs of the slab this thread takes next (prefetched while this one is packed).
      const int64_t next_count = s + 1 < last ? std::min(slab, n - n0 - count) : 0;
      if (!int8_rows && !symmetric) {
        pair_scales(scale_zero, groups, n0, count, padded, scales, offsets, next_count);
      } else {
      for (int64_t i = 0; i < padded; ++i)
        for (int64_t g = 0; g < groups; ++g) {
          float scale = 0.0f, offset = 0.0f;
          if (i < count && symmetric) {
            scale = bf16_to_float(scale_zero[(n0 + i) * groups + g]);
          } else if (i < count) {
            scale = bf16_to_float(scale_zero[((n0 + i) * groups + g) * 2]);
            offset = bf16_to_float(scale_zero[((n0 + i) * groups + g) * 2 + 1]) - 8.0f * scale;
          }
          scales[g * padded + i] = scale;
          offsets[g * padded + i] = offset;
          offsets8[g * padded + i] = offset - bias * scale;
        }
      }
      const int64_t int16_count = as_int8 ? rows16 : rows;  // rows the int16 kernel takes
      if (as_int8)
        u8_slab_product(rows8, rows - rows16, k, held, halves, packed8, scales, offsets8,
                        padded, count, blocks_per_group, n0, n, y + rows16 * n);
      if (int16_count == 0) continue;
#ifdef EXO_INT16_TILES_512
      if (int_gemm_forced() != 2) {
        if (held == Held::kInt4)
          pack_int4_slab_16(bytes, row_bytes, k, n0, count, padded, packed, next_count);
        else
          pack_slab<16>(bytes, row_bytes, held, k, n0, count, padded, packed);
        int16_slab_product_512(quantized.data(), x_scales.data(), x_sums.data(), int16_count,
                               k, halves, packed, scales, offsets, padded, count,
                               blocks_per_group, n0, n, y);
        continue;
      }
#endif
      pack_slab<8>(bytes, row_bytes, held, k, n0, count, padded, packed);
      int16_slab_product(quantized.data(), x_scales.data(), x_sums.data(), int16_count, k,
                         halves, packed, scales, offsets, padded, count, blocks_per_group, n0,
                         n, y);
    }
  });
}

#endif  // EXO_INT_GEMM
}  // namespace

namespace exo_native {

void block_matmul(const float* x, int64_t rows, int64_t k, const at::Tensor& weight,
                  const at::Tensor& scale_zero, float* y, int64_t activation_bits,
                  int64_t int16_rows, bool bf16) {
  const int64_t n = weight.size(0);
  if (rows == 0 || n == 0) return;
  // No autograd below this call (its torch ops write into views of the output).
  c10::InferenceMode inference;
  if (is_q4k_scales(scale_zero))  // compact Q4_K scales: the same pairs, for this call
    return block_matmul(x, rows, k, weight, q4k_scale_pairs(scale_zero), y, activation_bits,
                        int16_rows, bf16);
  // uint8 with 2-d scales: 5-bit blocks; uint8 with (scale, zero) pairs: int4.
  const bool bytes = weight.scalar_type() == at::kByte;
  const Held held = !bytes ? Held::kInt8 : scale_zero.dim() == 2 ? Held::kInt5 : Held::kInt4;
  const int64_t group_size = k / scale_zero.size(1);
#ifdef EXO_AVX2
  // With int8 decode activations (`decode_activation_bits`, int4_decode_int8.cpp) every row
  // of an int4 weight takes int8, the decode kernel's rounding: a stream's rows then round
  // alike whether its step's rows go through the decode kernel or this GEMM.
  if (held == Held::kInt4 && decode_activation_bits() == 8) {
    activation_bits = 8;
    int16_rows = 0;
    bf16 = false;
  }
#endif
  const int64_t leading = std::clamp<int64_t>(int16_rows, 0, rows);
  // A step with decode rows and a short prompt chunk beside them takes int16 for all.
  const bool short_chunk = leading > 0 && rows - leading < prefill::kBf16MinRows;
  if (bf16 && activation_bits == 16 && !short_chunk && prefill::bf16_tiles_available()) {
    // The leading int16 rows (a step's decode tokens) as without bf16, the rest in bf16.
    if (leading > 0) block_matmul(x, leading, k, weight, scale_zero, y, 16, 0, false);
    if (leading < rows)
      prefill::bf16_block_matmul(
          x + leading * k, rows - leading, k, static_cast<const uint8_t*>(weight.data_ptr()),
          held, scale_zero.dim() == 2,
          reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<at::BFloat16>()),
          scale_zero.size(1), n, y + leading * n);
    return;
  }
#ifdef EXO_INT_GEMM
  // int8 activations where asked: int4, 5-bit, and int8 weights with (scale, zero) pairs
  // or symmetric blocks of 16 (Q6_K's), each slab whose values fit; symmetric int8 blocks
  // of 32 (Q8_0's, which span -127..127) keep int16.
  const bool symmetric = scale_zero.dim() == 2;
  const bool int8_activations =
      activation_bits == 8 && (held != Held::kInt8 || !symmetric || group_size == 16);
  if (int8_activations ? int_gemm_forced() != 0 : int16_integer_gemm()) {
    integer_block_matmul(x, rows, k, static_cast<const uint8_t*>(weight.data_ptr()), held,
                         symmetric,
                         reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<at::BFloat16>()),
                         scale_zero.size(1), n, y, int8_activations, int16_rows);
    return;
  }
#endif
  exo_native::prefill::dequantized_block_matmul(x, rows, k, weight, scale_zero, held,
                                               group_size, n, y);
}

}  // namespace exo_native

namespace {

at::Tensor block_matmul_op(const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& given_scales, int64_t activation_bits,
                           int64_t int16_rows, bool bf16) {
  const bool q4k = exo_native::is_q4k_scales(given_scales) && weight.scalar_type() == at::kByte;
  const at::Tensor scale_zero =
      q4k ? exo_native::q4k_scale_pairs(given_scales.contiguous()) : given_scales;
  TORCH_CHECK(activation_bits == 16 || activation_bits == 8,
              "block_matmul: activation_bits must be 16 or 8, not ", activation_bits);
  TORCH_CHECK(!bf16 || activation_bits == 16,
              "block_matmul: bf16 activations need activation_bits 16, not ", activation_bits);
  TORCH_CHECK(int16_rows >= 0, "block_matmul: int16_rows must be >= 0, not ", int16_rows);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "block_matmul: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kByte || weight.scalar_type() == at::kChar),
              "block_matmul: weight must be contiguous uint8 int4 pairs or 5-bit blocks, or "
              "int8 blocks");
  const int64_t k = x.size(1), n = weight.size(0);
  TORCH_CHECK(scale_zero.scalar_type() == at::kBFloat16 && scale_zero.is_contiguous() &&
                  scale_zero.size(0) == n && scale_zero.size(1) > 0,
              "block_matmul: scale_zero must be a contiguous bfloat16 [out, ...] tensor");
  const bool int5 = weight.scalar_type() == at::kByte && scale_zero.dim() == 2;
  const int64_t held = int5 ? scale_zero.size(1) * kBlock
                       : weight.scalar_type() == at::kByte ? 2 * weight.size(1)
                                                           : weight.size(1);
  TORCH_CHECK(held == k && k % kBlock == 0, "block_matmul: x has ", k, " inputs, the weight ",
              held, " (a multiple of 32 is needed)");
  if (int5) {  // 5-bit lanes: groups of 3 blocks in 64 bytes, one scale per 32 inputs
    TORCH_CHECK(weight.size(1) == exo_native::int5_row_bytes(k),
                "block_matmul: 5-bit lanes need ceil(in / 96) * 64 bytes per row");
  } else if (scale_zero.dim() == 2) {  // symmetric int8 blocks: one scale per 16 or 32 inputs
    TORCH_CHECK(weight.scalar_type() == at::kChar &&
                    (scale_zero.size(1) * 16 == k || scale_zero.size(1) * 32 == k),
                "block_matmul: symmetric int8 blocks need one scale per 16 or 32 inputs");
  } else {
    TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.size(2) == 2 &&
                    k % scale_zero.size(1) == 0 && (k / scale_zero.size(1)) % kBlock == 0,
                "block_matmul: scale_zero must be bfloat16 [out, groups, 2] with groups of "
                "multiples of 32 inputs");
  }
  TORCH_CHECK(weight.scalar_type() == at::kByte || scale_zero.dim() == 2 ||
                  scale_zero.size(1) * kBlock == k,
              "block_matmul: int8 blocks need one (scale, zero) pair per 32 inputs");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  exo_native::block_matmul(x.data_ptr<float>(), x.size(0), k, weight, scale_zero,
                           y.data_ptr<float>(), activation_bits, int16_rows, bf16);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def(
      "block_matmul(Tensor x, Tensor weight, Tensor scale_zero, int activation_bits=16, "
      "int int16_rows=0, bool bf16=False) -> Tensor");
  m.def("bf16_prefill_available() -> bool",
        [] { return exo_native::prefill::bf16_tiles_available(); });
  m.def("bf16_prefill_min_rows() -> int", [] { return exo_native::prefill::kBf16MinRows; });
  m.def("int16_integer_gemm() -> bool", [] { return exo_native::int16_integer_gemm(); });
  m.def("int16_tile_bits() -> int", [] { return exo_native::int16_tile_bits(); });
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("block_matmul", &block_matmul_op); }
