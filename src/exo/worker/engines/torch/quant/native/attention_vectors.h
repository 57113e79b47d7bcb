// The vector types of decode attention's row kernel (decode_attention.cpp): one value at a
// time, AVX2's 8 and AVX512's 16 float32 lanes, each with the same few operations
// (loads that widen bfloat16 cache values, fused multiply-adds, reductions, exp through
// SLEEF, and `pack_sums`: lane j of the result is the sum of the j-th vector's lanes, a
// transpose-and-add tree instead of a horizontal sum per vector).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "block_rows.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <sleef.h>  // the vectorized exp torch's own kernels use (exported by libtorch_cpu)
#define EXO_AVX2 1
#endif
#if defined(EXO_AVX2) && defined(__AVX512F__)
#define EXO_AVX512 1
#endif

namespace exo_native::attention_vectors {

// A score this far below its row's largest has exp() < 2e-38: nothing beside the largest
// (whose exp is 1) in float32. `exp` returns 0 below it.
constexpr float kNegligible = -87.0f;

// A bfloat16 cache value (its raw bits) as float32: exact.
inline float widen(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}
inline float widen(float value) { return value; }

// One value at a time (CPUs without AVX2 + FMA, head dimensions not a multiple of 8).
struct Scalar {
  using V = float;
  static constexpr int kLanes = 1;
  static V zero() { return 0.0f; }
  static V set1(float v) { return v; }
  static V load(const float* p) { return *p; }
  static V load(const uint16_t* p) { return widen(*p); }
  static void store(float* p, V v) { *p = v; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V max(V a, V b) { return std::max(a, b); }
  static float reduce_add(V v) { return v; }
  static float reduce_max(V v) { return v; }
  static V exp(V x) { return x < kNegligible ? 0.0f : std::exp(x); }
  static V pack_sums(const V* t) { return t[0]; }
};

#ifdef EXO_AVX2
struct Avx2 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float reduce_add(V v) { return exo_native::block_rows::horizontal_sum(v); }
  static float reduce_max(V v) { return exo_native::block_rows::horizontal_max(v); }
  static V exp(V x) {
    const V kept = _mm256_cmp_ps(x, set1(kNegligible), _CMP_GE_OQ);
    return _mm256_and_ps(Sleef_expf8_u10avx2(x), kept);
  }
  // Lane j of the result = the sum of t[j]'s lanes (8 vectors).
  __attribute__((always_inline)) static V pack_sums(const V* t) {
    V pairs[4];
    for (int i = 0; i < 4; ++i)  // [a0+a2, b0+b2, a1+a3, b1+b3 | same for lanes 4-7]
      pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(t[2 * i], t[2 * i + 1]),
                               _mm256_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    V quads[2];
    for (int i = 0; i < 2; ++i)  // per 128-bit half: the sums of 4 vectors over it
      quads[i] = _mm256_add_ps(_mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                               _mm256_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                         _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
  }
};
#endif

#ifdef EXO_AVX512
struct Avx512 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static V exp(V x) {
    const __mmask16 kept = _mm512_cmp_ps_mask(x, set1(kNegligible), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(kept, Sleef_expf16_u10avx512f(x));
  }
  // Lane j of the result = the sum of t[j]'s lanes (16 vectors): pairs within 128-bit
  // lanes, then quads, then the four 128-bit lanes.
  __attribute__((always_inline)) static V pack_sums(const V* t) {
    V pairs[8];
    for (int i = 0; i < 8; ++i)
      pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]),
                               _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    V quads[4];  // quads[i]: 128-bit lane l holds t[4i..4i+3]'s sums over lane l
    for (int i = 0; i < 4; ++i)
      quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                               _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    V halves[2];  // 128-bit lanes [q0 l0+l2, q0 l1+l3, q1 l0+l2, q1 l1+l3]
    for (int i = 0; i < 2; ++i)
      halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x44),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
  }
};
#endif

}  // namespace exo_native::attention_vectors
