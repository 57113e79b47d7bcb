// Prefill products with the activations rounded to int8 per block of 32 (llama.cpp's
// activation precision), for int4, 5-bit and 6-bit (GGUF Q6_K's, held as symmetric int8
// blocks of 16) weights on AVX2 CPUs: the opt-in behind `--prefill-activations int8`
// (prefill.cpp's header gives the accuracy it costs).
//
// The weight's integers are the unsigned operand of `vpmaddubsw` (int4 values 0..15 as held,
// 5-bit values x + 16 in 0..31) and the rounded activations (-127..127) the signed one: each
// instruction sums two products per 16-bit lane, and 8 (int4: |sum| <= 8 * 2 * 15 * 127 =
// 30480) or 4 (5-bit: 4 * 2 * 31 * 127 = 31496) such sums still fit in int16 before one
// `vpmaddwd` by ones widens them to int32. So a block of 32 inputs takes 8 `vpmaddubsw` and
// 1-2 `vpmaddwd` per 8 outputs and activation row where int16 activations take 16
// `vpmaddwd`, and half the adds. The 5-bit values' +16 comes back out through the block's
// offset term: w = (u - 16) * scale, so offset = -16 * scale against the rounded
// activations' block sum, as int4's (zero - 8 * scale) does. int8 weights whose values lie
// in [-32, 31] (Q6_K's blocks of 16, GGUF Q5_0 widened to int8 beside a Q8_0 neighbour) go
// the same way as u = x + 32 in 0..63, two sums per int16 (2 * 2 * 63 * 127 = 32004), blocks
// of 16 each half with its own scale and sum. That is decided per slab of outputs while
// unpacking: a slab holding a value outside (Q8_0's span -127..127) takes prefill.cpp's
// int16 kernel, as symmetric blocks of 32 (Q8_0) always do.
// Layout as prefill.cpp's int16 GEMM (whose driver runs both): a slab of output rows
// unpacked (here to bytes, 4 consecutive inputs per 32-bit lane) into a buffer of the thread
// that multiplies it, tiles of 4 activation rows x 16 outputs.
// Against int16 activations this is faster for int4, 5-bit and Q6_K weights, with a shorter
// TTFT.
// With VNNI (EXO_VNNI, prefill_pack.h) a quad of products goes straight into the int32 sums
// (vpdpbusd: no int16 partial sums, no widening), faster again
// (figures: docs/benchmarks/engine-design-figures.md#prefill_int8cpp).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "prefill_pack.h"

#ifdef EXO_AVX2

namespace exo_native::prefill {
namespace {

using block_rows::for_row_groups;
using block_rows::horizontal_max;
using block_rows::kBlock;

constexpr float kInt8Levels = 127.0f;

inline int32_t horizontal_sum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// ROWS activation rows x 16 outputs (two packed vectors from `tile`): each block's sums
// (STEPS quads summed in int16 before they widen), then its scales, into `acc` [ROWS][16].
// With HALVES 2 (blocks of 16) each half block (4 quads) is scaled on its own, its sum of
// rounded activations from `x_sums` [ROWS][k / 16] (else [ROWS][k / 32]), and
// `blocks_per_group` counts halves.
template <int ROWS, int STEPS, int HALVES>
[[gnu::noinline]]
void gemm_tile_u8(const int8_t* xq, const float* x_scales, const float* x_sums, int64_t k,
                  const int32_t* tile, const float* scales, const float* offsets,
                  int64_t padded, int64_t blocks_per_group, float* acc) {
  static_assert(STEPS * HALVES <= 8 && (8 / HALVES) % STEPS == 0, "quads per part");
  const int64_t blocks = k / kBlock, quads = k / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 sums[ROWS][2];
  for (int r = 0; r < ROWS; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
  const float* scale = scales;
  const float* offset = offsets;
  int64_t in_group = 0;
  for (int64_t half = 0; half < blocks * HALVES; ++half) {
    const int64_t b = half / HALVES;
    __m256i dot[ROWS][2];
    for (int r = 0; r < ROWS; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int part = 0; part < 8 / HALVES / STEPS; ++part) {
      __m256i partial[ROWS][2];
      for (int r = 0; r < ROWS; ++r) partial[r][0] = partial[r][1] = _mm256_setzero_si256();
      for (int s = 0; s < STEPS; ++s) {
        const int64_t q = half * (8 / HALVES) + part * STEPS + s;
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + q * 8));
        const __m256i w1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (quads + q) * 8));
        for (int r = 0; r < ROWS; ++r) {
          int32_t quad;
          std::memcpy(&quad, xq + r * k + 4 * q, sizeof(quad));
          const __m256i xr = _mm256_set1_epi32(quad);
#ifdef EXO_VNNI
          dot[r][0] = add_quad_products(dot[r][0], w0, xr);
          dot[r][1] = add_quad_products(dot[r][1], w1, xr);
#else
          partial[r][0] = _mm256_add_epi16(partial[r][0], _mm256_maddubs_epi16(w0, xr));
          partial[r][1] = _mm256_add_epi16(partial[r][1], _mm256_maddubs_epi16(w1, xr));
#endif
        }
        // Keeps each sum in a register step by step: free to reassociate the wrapping adds,
        // GCC may otherwise keep all STEPS products (spilled to the stack) and add them as a
        // tree, which ran the int4 GEMM at 67 instead of 85-92 GMAC/s.
#ifndef EXO_VNNI
        for (int r = 0; r < ROWS; ++r) asm("" : "+x"(partial[r][0]), "+x"(partial[r][1]));
#endif
      }
#ifndef EXO_VNNI
      for (int r = 0; r < ROWS; ++r) {
        dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(partial[r][0], ones));
        dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(partial[r][1], ones));
      }
#endif
    }
    // The float32 side, as prefill.cpp's int16 tile (kept apart: see there).
    const __m256 scale0 = _mm256_loadu_ps(scale), scale1 = _mm256_loadu_ps(scale + 8);
    const __m256 offset0 = _mm256_loadu_ps(offset), offset1 = _mm256_loadu_ps(offset + 8);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x_scale = _mm256_broadcast_ss(x_scales + r * blocks + b);
      const __m256 x_sum = _mm256_broadcast_ss(x_sums + (r * blocks + b) * HALVES + half % HALVES);
      const __m256 block0 =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][0]), scale0, _mm256_mul_ps(x_sum, offset0));
      const __m256 block1 =
          _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][1]), scale1, _mm256_mul_ps(x_sum, offset1));
      sums[r][0] = _mm256_fmadd_ps(x_scale, block0, sums[r][0]);
      sums[r][1] = _mm256_fmadd_ps(x_scale, block1, sums[r][1]);
    }
    if (++in_group == blocks_per_group) {
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

}  // namespace

// Rounds each block of 32 of a row to int8 values: round-to-nearest-even of x * (127 /
// largest |x|) (the MXCSR default of `vcvtps2dq`), all 0 for an all-zero block (or one so
// small that 127 / largest |x| overflows). Writes
// each block's scale (largest |x| / 127) and the sums of its rounded values: per block
// (`sums`) and per half block of 16 (`half_sums`).
void round_row_int8(const float* x, int64_t k, int8_t* values, float* scales, float* sums,
                    float* half_sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < k / kBlock; ++b) {
    __m256 v[4];
    __m256 largest = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v[i]));
    }
    float top = horizontal_max(largest);
    // A block too small for 127 / top to be finite (|x| < ~1e-36) rounds to zeros.
    if (!(kInt8Levels / top <= std::numeric_limits<float>::max())) top = 0.0f;
    const __m256 inverse = _mm256_set1_ps(top > 0.0f ? kInt8Levels / top : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const int32_t first = horizontal_sum_epi32(_mm256_add_epi32(q[0], q[1]));
    const int32_t second = horizontal_sum_epi32(_mm256_add_epi32(q[2], q[3]));
    // packs work within 128-bit lanes: the dwords come out as q0 0-3, q1 0-3, q2 0-3, q3 0-3,
    // q0 4-7, ...; `order` puts them back in input order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                             _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + b * kBlock),
                        _mm256_permutevar8x32_epi32(bytes, order));
    scales[b] = top / kInt8Levels;
    sums[b] = static_cast<float>(first + second);
    half_sums[2 * b] = static_cast<float>(first);
    half_sums[2 * b + 1] = static_cast<float>(second);
  }
}

// Unpacks outputs [n0, n0 + count) (count <= padded, a multiple of 8) into `packed` as
// unsigned bytes: for each group of 8 outputs v and input quad q, one vector of 8 32-bit
// lanes (lane i: output n0 + 8 v + i, inputs 4q..4q+3) at packed + (v * k / 4 + q) * 8.
// int4 values as held (0..15), 5-bit values plus 16 (0..31), int8 values plus 32 (0..63);
// outputs past `count` are 0. False when an int8 value lies outside [-32, 31] (the bytes
// are then not a product's).
bool pack_slab_u8(const uint8_t* bytes, int64_t row_bytes, Held held, int64_t k, int64_t n0,
                  int64_t count, int64_t padded, int32_t* packed) {
  const int64_t blocks = k / kBlock, quads = k / 4;
  const __m256i bias = _mm256_set1_epi16(static_cast<int16_t>(int8_bias(held)));
  const __m256i top = _mm256_set1_epi16(63);
  __m256i outside = _mm256_setzero_si256();  // any lane of any u outside 0..63
  for (int64_t v = 0; v < padded / 8; ++v) {
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i rows[8];  // per output row: the block's 32 values as bytes, in input order
      for (int i = 0; i < 8; ++i) {
        const int64_t row = 8 * v + i;
        if (row >= count) {
          rows[i] = _mm256_setzero_si256();
          continue;
        }
        __m256i values[2];
        block_values(bytes + (n0 + row) * row_bytes, held, b, blocks, values);
        const __m256i low = _mm256_add_epi16(values[0], bias);
        const __m256i high = _mm256_add_epi16(values[1], bias);
        if (held == Held::kInt8)  // u < 0 or u > 63 (signed compares)
          outside = _mm256_or_si256(
              outside, _mm256_or_si256(_mm256_or_si256(_mm256_cmpgt_epi16(low, top),
                                                       _mm256_cmpgt_epi16(high, top)),
                                       _mm256_or_si256(_mm256_srai_epi16(low, 15),
                                                       _mm256_srai_epi16(high, 15))));
        const __m256i u8 = _mm256_packus_epi16(low, high);
        rows[i] = _mm256_permute4x64_epi64(u8, 0xD8);  // undo packus's per-lane order
      }
      if (held == Held::kInt8 && !_mm256_testz_si256(outside, outside)) return false;
      __m256i out[8];
      transpose8(rows, out);
      int32_t* base = packed + (v * quads + b * 8) * 8;
      for (int j = 0; j < 8; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + j * 8), out[j]);
    }
  }
  return true;
}

void u8_slab_product(const Int8Rows& x, int64_t rows, int64_t k, Held held, bool halves,
                     const int32_t* packed, const float* scales, const float* offsets,
                     int64_t padded, int64_t count, int64_t blocks_per_group, int64_t n0,
                     int64_t n, float* y) {
  const int64_t blocks = k / kBlock;
  float acc[4 * 16];
  // Row groups outside, tiles inside (a group's activation rows stay in L1).
  for_row_groups(rows, [&](auto count_rows, int64_t r) {
    constexpr int R = decltype(count_rows)::value;
    const int8_t* xq = x.values + r * k;
    const float* row_scales = x.scales + r * blocks;
    for (int64_t t = 0; t < padded / 16; ++t) {
      const int32_t* tile = packed + 2 * t * (k / 4) * 8;
      const float* tile_scales = scales + 16 * t;
      const float* tile_offsets = offsets + 16 * t;
      // Quads summed in int16 before they widen: 8 for int4 (u <= 15), 4 for 5-bit
      // (u <= 31), 2 for int8 (u <= 63).
      if (held == Held::kInt4)
        gemm_tile_u8<R, 8, 1>(xq, row_scales, x.sums + r * blocks, k, tile, tile_scales,
                              tile_offsets, padded, blocks_per_group, acc);
      else if (held == Held::kInt5)
        gemm_tile_u8<R, 4, 1>(xq, row_scales, x.sums + r * blocks, k, tile, tile_scales,
                              tile_offsets, padded, blocks_per_group, acc);
      else if (halves)
        gemm_tile_u8<R, 2, 2>(xq, row_scales, x.half_sums + r * blocks * 2, k, tile,
                              tile_scales, tile_offsets, padded, blocks_per_group, acc);
      else
        gemm_tile_u8<R, 2, 1>(xq, row_scales, x.sums + r * blocks, k, tile, tile_scales,
                              tile_offsets, padded, blocks_per_group, acc);
      const int64_t width = std::min<int64_t>(16, count - 16 * t);
      for (int i = 0; i < R; ++i)
        std::memcpy(y + (r + i) * n + n0 + 16 * t, acc + i * 16, sizeof(float) * width);
    }
  });
}

}  // namespace exo_native::prefill

#endif  // EXO_AVX2
