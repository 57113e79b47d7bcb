// exo's CPU kernels shared between the operator files (int4_gemv.cpp, int8_blocks.cpp,
// int5_blocks.cpp, decode_layer.cpp, prefill.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <utility>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace exo_native {

// std::allocator's work at 64-byte (cache-line) alignment: `AlignedBuffer` holds the rounded
// activations the decode kernels read 32 or 64 bytes at a time. malloc aligns to 16 bytes
// only, and a 512-bit load at 16 bytes past a 32-byte boundary costs a second access on
// Zen 4 (a 576-input tile of 8 activation rows took 22 % longer in a standalone replica
// of int4_gemv.cpp's loop; figures: docs/benchmarks/2026-12-07-int4-decode-tiles.md).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kAlignment{64};
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(std::size_t count) {
    return static_cast<T*>(::operator new(count * sizeof(T), kAlignment));
  }
  void deallocate(T* pointer, std::size_t) noexcept { ::operator delete(pointer, kAlignment); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const noexcept {
    return false;
  }
};

// A std::vector whose data starts on a cache line (so does every row of it whose stride is a
// multiple of 64 bytes: 32 int16 activations, 64 int8 ones).
template <typename T>
using AlignedBuffer = std::vector<T, CacheLineAllocator<T>>;

// A bfloat16 (its 16 bits) as the float32 it is: the upper half of the float32's bits.
inline float bf16_to_float(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// Activations are rounded per block of 32 to integers in [-kActivationLevels,
// kActivationLevels] (int16) times one float scale.
constexpr float kActivationLevels = 32767.0f;

// Rounds the 32 values of `block` to int16 `values` (nearest, ties to even) in units of
// the returned scale, the block's largest |x| / kActivationLevels (0 for an all-zero block,
// whose values are all 0).
#if defined(__AVX2__)
// Vectorized: the same IEEE division and the same rounding (vcvtps2dq rounds as MXCSR says,
// nearest-even by default, as std::nearbyint does), so the same values. The scalar loop
// cost milliseconds of a core per prefill
// (figures: docs/benchmarks/engine-design-figures.md#kernelsh).
inline float round_block(const float* block, int16_t* values) {
  const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 x[4];
  __m256 largest8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(block + 8 * i);
    largest8 = _mm256_max_ps(_mm256_and_ps(x[i], magnitude_bits), largest8);
  }
  __m128 largest4 =
      _mm_max_ps(_mm256_castps256_ps128(largest8), _mm256_extractf128_ps(largest8, 1));
  largest4 = _mm_max_ps(largest4, _mm_movehl_ps(largest4, largest4));
  largest4 = _mm_max_ss(largest4, _mm_movehdup_ps(largest4));
  const float scale = _mm_cvtss_f32(largest4) / kActivationLevels;
  if (!(scale > 0.0f)) {
    std::memset(values, 0, 32 * sizeof(int16_t));
    return scale;
  }
  const __m256 scales = _mm256_set1_ps(scale);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(x[i], scales));
  // packs interleaves 128-bit lanes (0-3, 8-11, 4-7, 12-15): the permute puts them back.
  const __m256i low = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
  const __m256i high = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(values), low);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + 16), high);
  return scale;
}
#else
inline float round_block(const float* block, int16_t* values) {
  float largest = 0.0f;
  for (int j = 0; j < 32; ++j) largest = std::max(largest, std::abs(block[j]));
  const float scale = largest / kActivationLevels;
  for (int j = 0; j < 32; ++j)
    values[j] = scale > 0.0f ? static_cast<int16_t>(std::nearbyint(block[j] / scale)) : 0;
  return scale;
}
#endif

// Compact Q4_K scales (q4k_scales.cpp) of an int4 weight converted from GGUF Q4_K, in place
// of bfloat16 (scale, zero) pairs per group of 32: per output row and super-block of 256
// inputs (8 groups), 20 bytes: fp16 d, fp16 dmin (little-endian), the 8 sub-blocks' scales
// sc, then their mins m, each a uint8 (Q4_K's 6-bit fields, widened at conversion): uint8
// [out, in / 256, 20], 0.625 bits per weight against the pairs' 1. Group g's scale is d sc
// and its zero 8 d sc - dmin m (GGUF's weights d sc q - dmin m, q: 0..15). The decode tiles
// take them in float32 unrounded (block_rows.h `unpack_q4k_scales`); the paths that read
// pairs (block_matmul, the portable loop) take the pairs the old form loads to: each value
// rounded to bfloat16 (nearest, ties to even: torch's `.to(torch.bfloat16)`).
constexpr int64_t kQ4kGroups = 8;
constexpr int64_t kQ4kBytes = 20;

// Whether an int4 weight's `scale_zero` is the compact Q4_K form (else bfloat16 pairs).
inline bool is_q4k_scales(const at::Tensor& scale_zero) {
  return scale_zero.scalar_type() == at::kByte && scale_zero.dim() == 3 &&
         scale_zero.size(2) == kQ4kBytes;
}

// The groups of 32 (or more) inputs of an int4 weight's `scale_zero`, either form.
inline int64_t int4_group_count(const at::Tensor& scale_zero) {
  return is_q4k_scales(scale_zero) ? scale_zero.size(1) * kQ4kGroups : scale_zero.size(1);
}

// The bfloat16 (scale, zero) pairs [out, in / 32, 2] of compact Q4_K scales (a new tensor),
// bit for bit the ones the old stored form loads to; for the paths that do not read the
// compact form (prefill's block_matmul, the portable decode loop).
at::Tensor q4k_scale_pairs(const at::Tensor& compact);

// The width in bits of the int4 decode kernel that runs (int4_gemv.cpp): 512 where built
// with AVX512BW and not `EXO_NATIVE_AVX512=0`, 256 with AVX2, 0 for the portable loop.
int64_t int4_decode_bits();

// y[rows, out] = x[rows, k] times the int4 weight (qweight uint8 [out, k / 2] in blocks of
// 32, scale_zero bfloat16 [out, groups, 2]); see int4_gemv.cpp. Splits outputs across
// torch's intra-op threads.
void int4_product(const float* x, int64_t rows, int64_t k, const at::Tensor& qweight,
                  const at::Tensor& scale_zero, float* y);

// The same product with the activations rounded to int8 per block of 32 (AVX2 builds only;
// int4_decode_int8.cpp), which `int4_product` runs while `decode_activation_bits()` is 8.
void int4_product_int8(const float* x, int64_t rows, int64_t k, const at::Tensor& qweight,
                       const at::Tensor& scale_zero, float* y);

// How the int4 decode products round their activations per block of 32: 16 (int16, the
// default) or 8 (int8, `--decode-activations int8`); process-wide, set once by the runner.
int64_t decode_activation_bits();
void set_decode_activation_bits(int64_t bits);

// y[rows, out] = x[rows, k] times the int8-block weight (values int8 [out, k], scale_zero
// bfloat16 [out, k / 32, 2]); see int8_blocks.cpp.
void int8_block_product(const float* x, int64_t rows, int64_t k, const at::Tensor& values,
                        const at::Tensor& scale_zero, float* y);

// y[rows, out] = x[rows, k] times symmetric int8 blocks (values int8 [out, k], scales
// bfloat16 [out, k / S], S = 16 or 32); see int8_blocks.cpp.
void int8_scaled_product(const float* x, int64_t rows, int64_t k, const at::Tensor& values,
                         const at::Tensor& scales, float* y);

// y[rows, out] = x[rows, k] times an MXFP4 weight (blocks uint8 [out, k / 32, 16], scale
// bytes uint8 [out, k / 32]); see mxfp4.cpp.
void mxfp4_product(const float* x, int64_t rows, int64_t k, const uint8_t* blocks,
                   const uint8_t* scale_bytes, int64_t out, float* y);

// The same MXFP4 weight as symmetric int8 blocks of 32 (values int8 [out, k], scales
// bfloat16 [out, k / 32]) for `block_matmul`, bit for bit the weight; see mxfp4.cpp.
std::pair<at::Tensor, at::Tensor> mxfp4_int8_blocks(const at::Tensor& blocks,
                                                    const at::Tensor& scales);

// 5-bit lanes (int5_blocks.cpp): a row of k inputs (k / 32 blocks) is held in groups of 3
// blocks of 64 bytes, the last group zero-padded: its bytes.
constexpr int64_t kInt5GroupBlocks = 3;
constexpr int64_t kInt5GroupBytes = 64;
constexpr int64_t int5_row_bytes(int64_t k) {
  return (k / 32 + kInt5GroupBlocks - 1) / kInt5GroupBlocks * kInt5GroupBytes;
}

// The 5-bit value x = u - 16 of input j of a row of 5-bit lanes: group j / 96; within it,
// "vector" v = (j % 96) / 16 is field v % 3 of the lanes of half v / 3, lane (j % 16).
inline int int5_value(const uint8_t* row, int64_t j) {
  constexpr int64_t kGroupInputs = kInt5GroupBlocks * 32;
  const int64_t within = j % kGroupInputs, vector = within / 16;
  const uint8_t* lane = row + j / kGroupInputs * kInt5GroupBytes + vector / 3 * 32 + within % 16 * 2;
  uint16_t bits;  // a 16-bit lane in the machine's byte order (as int5_blocks.py writes it)
  std::memcpy(&bits, lane, sizeof(bits));
  return ((bits >> (5 * (vector % 3))) & 0x1F) - 16;
}

// y[rows, out] = x[rows, k] times 5-bit lanes (uint8 [out, int5_row_bytes(k)], scales
// bfloat16 [out, k / 32]); see int5_blocks.cpp.
void int5_product(const float* x, int64_t rows, int64_t k, const at::Tensor& packed,
                  const at::Tensor& scales, float* y);

// y[rows, out] = x[rows, k] times a symmetric int8 weight (int8 [out, k]) with one bfloat16
// scale per output row (scales [out]); see int4_gemv.cpp.
void int8_channel_product(const float* x, int64_t rows, int64_t k, const at::Tensor& weight,
                          const at::Tensor& scales, float* y);

// y[rows, out] = x[rows, k] times a bfloat16 weight [out, k], exactly in float32.
void bf16_product(const float* x, int64_t rows, int64_t k, const at::Tensor& weight, float* y);

// y[rows, out] = x[rows, k] times a block weight (int4, int8, symmetric int8 or 5-bit
// blocks, as above: scale_zero 3-d pairs or 2-d scales) for many rows
// (prefill): the activations rounded as the decode kernels round them, times the weight:
// with AVX2 an integer GEMM over slabs of output rows unpacked to int16 in each thread's
// cache (the decode kernels' int32 block sums), else torch's float32 matmul over slabs of
// dequantized rows. See prefill.cpp. `activation_bits` 8: rows from `int16_rows` on take
// activations rounded to int8 instead where the weight's integers fit (int4, 5-bit, int8
// values in [-32, 31]; prefill_int8.cpp; AVX2 only). `bf16` (with `activation_bits` 16):
// rows from `int16_rows` on take activations rounded to bfloat16 times the weight
// dequantized to bfloat16, by AMX tiles, where this CPU and build have them, unless there
// are leading int16 rows and fewer than `prefill::kBf16MinRows` others (prefill_bf16.cpp;
// then, and elsewhere, int16 as without it).
void block_matmul(const float* x, int64_t rows, int64_t k, const at::Tensor& weight,
                  const at::Tensor& scale_zero, float* y, int64_t activation_bits = 16,
                  int64_t int16_rows = 0, bool bf16 = false);

// attended[rows, heads * head_dim] = each row's query heads (qkv[rows, qkv_width], queries
// first) attending to its slot's keys / values ([slots, kv_heads, capacity, head_dim] of
// `cache_type`, float32 or bfloat16, this step's rows written) from the window's start
// (window 0: none) up to its own position, softmax scaled by `scaling`, summed in float32;
// see decode_attention.cpp.
void decode_attention(float* qkv, int64_t rows, int64_t qkv_width, const void* key_cache,
                      const void* value_cache, at::ScalarType cache_type, int64_t capacity,
                      at::IntArrayRef slots, at::IntArrayRef positions, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t window, double scaling,
                      float* attended);

// out[hidden] = row / sqrt(mean(row^2) + eps) * weight (weight nullptr: no weight).
void rms_norm_row(const float* row, const float* weight, int64_t hidden, float eps, float* out);

}  // namespace exo_native
