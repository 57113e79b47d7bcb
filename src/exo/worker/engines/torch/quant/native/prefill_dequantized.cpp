// Prefill's product where the integer GEMM does not run (CPUs without AVX2 + FMA, int16
// activations where the library is built with AVX512 but not AVX512-VNNI + AVX512BW, or
// `EXO_NATIVE_INT_GEMM=0`): the weight dequantized to float32 one slab of output rows at a
// time (in a buffer of the thread that multiplies it) times torch's float32 matmul, with the
// activations rounded as the decode kernels round them (exactly, on the portable kernel).
// Dequantizing the whole weight first (as torch ops) took longer than a 128-row product
// itself (figures: docs/benchmarks/engine-design-figures.md#prefill_dequantizedcpp).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "prefill_pack.h"

namespace exo_native::prefill {
namespace {

using block_rows::kBlock;

#ifndef EXO_AVX2
// One output row of an int4 weight (pairs of blocks as 16-bit lanes, int4_gemv.cpp) as
// float32: w = q * scale + (zero - 8 scale).
void dequantize_int4_row(const uint8_t* row, const uint16_t* scale_zero, int64_t k,
                         int64_t group_size, float* out) {
  const int64_t blocks = k / kBlock, pairs = blocks / 2;
  auto scale_of = [&](int64_t block) {
    return bf16_to_float(scale_zero[2 * (block * kBlock / group_size)]);
  };
  auto offset_of = [&](int64_t block, float scale) {
    return bf16_to_float(scale_zero[2 * (block * kBlock / group_size) + 1]) - 8.0f * scale;
  };
  for (int64_t p = 0; p < pairs; ++p) {
    const float scale0 = scale_of(2 * p), scale1 = scale_of(2 * p + 1);
    const float offset0 = offset_of(2 * p, scale0), offset1 = offset_of(2 * p + 1, scale1);
    const uint8_t* bytes = row + p * 32;
    float* w = out + p * 64;
    for (int i = 0; i < 16; ++i) {
      const int low = bytes[2 * i], high = bytes[2 * i + 1];
      w[i] = static_cast<float>(low & 0x0F) * scale0 + offset0;
      w[16 + i] = static_cast<float>(low >> 4) * scale0 + offset0;
      w[32 + i] = static_cast<float>(high & 0x0F) * scale1 + offset1;
      w[48 + i] = static_cast<float>(high >> 4) * scale1 + offset1;
    }
  }
  if (blocks % 2) {  // the odd last block, GGUF's byte order
    const int64_t b = blocks - 1;
    const float scale = scale_of(b), offset = offset_of(b, scale);
    const uint8_t* bytes = row + pairs * 32;
    float* w = out + b * kBlock;
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<float>(bytes[j] & 0x0F) * scale + offset;
      w[16 + j] = static_cast<float>(bytes[j] >> 4) * scale + offset;
    }
  }
}

// One output row of an int8-block weight: w = v * scale + (zero - 8 scale) per block.
void dequantize_int8_row(const int8_t* row, const uint16_t* scale_zero, int64_t k, float* out) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float scale = bf16_to_float(scale_zero[2 * b]);
    const float offset = bf16_to_float(scale_zero[2 * b + 1]) - 8.0f * scale;
    for (int j = 0; j < kBlock; ++j)
      out[b * kBlock + j] = static_cast<float>(row[b * kBlock + j]) * scale + offset;
  }
}


// One output row of 5-bit lanes: w = x * scale per block of 32 inputs (the layout of
// int5_blocks.cpp).
void dequantize_int5_row(const uint8_t* row, const uint16_t* scales, int64_t k, float* out) {
  for (int64_t j = 0; j < k; ++j)
    out[j] = static_cast<float>(exo_native::int5_value(row, j)) * bf16_to_float(scales[j / kBlock]);
}

// One output row of a symmetric int8-block weight: w = v * scale per block of `block` inputs.
void dequantize_scaled_row(const int8_t* row, const uint16_t* scales, int64_t k, int64_t block,
                           float* out) {
  for (int64_t b = 0; b < k / block; ++b) {
    const float scale = bf16_to_float(scales[b]);
    for (int64_t j = 0; j < block; ++j)
      out[b * block + j] = static_cast<float>(row[b * block + j]) * scale;
  }
}

#else
// One output row of any held kind, vectorized: each block's int16 values as the integer GEMM
// unpacks them (`block_values`), widened to float32, times its scale plus its offset (the
// same values as the scalar functions above, which ran Gemma 3 270M's 5-bit rows at a
// fraction of the matmul's speed).
void dequantize_row(const uint8_t* row, Held held, bool symmetric, const uint16_t* scale_zero,
                    int64_t k, int64_t group_size, float* out) {
  const int64_t blocks = k / kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i values[2];
    block_values(row, held, b, blocks, values);
    for (int half = 0; half < 2; ++half) {
      const int64_t first = b * kBlock + half * 16;  // this half's first input
      float scale, offset = 0.0f;
      if (symmetric) {  // 5-bit lanes, symmetric int8 blocks of 16 or 32: w = v * scale
        scale = bf16_to_float(scale_zero[first / group_size]);
      } else {  // (scale, zero) pairs: w = v * scale + (zero - 8 scale)
        const int64_t group = first / group_size;
        scale = bf16_to_float(scale_zero[2 * group]);
        offset = bf16_to_float(scale_zero[2 * group + 1]) - 8.0f * scale;
      }
      const __m256 scales = _mm256_set1_ps(scale), offsets = _mm256_set1_ps(offset);
      const __m128i low = _mm256_castsi256_si128(values[half]);
      const __m128i high = _mm256_extracti128_si256(values[half], 1);
      _mm256_storeu_ps(out + first, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(low)),
                                                    scales, offsets));
      _mm256_storeu_ps(out + first + 8,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(high)), scales,
                                       offsets));
    }
  }
}
#endif

}  // namespace

void dequantized_block_matmul(const float* x, int64_t rows, int64_t k, const at::Tensor& weight,
                              const at::Tensor& scale_zero, Held held, int64_t group_size,
                              int64_t n, float* y) {
  // The activations rounded as the decode kernels round them, [rows, k].
  at::Tensor activations = at::empty({rows, k}, at::kFloat);
  float* rounded = activations.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const float* block = x + r * k + b * kBlock;
        float* out = rounded + r * k + b * kBlock;
#if defined(__AVX2__) && defined(__FMA__)
        int16_t values[kBlock];
        const float scale = exo_native::round_block(block, values);
        for (int j = 0; j < kBlock; ++j) out[j] = static_cast<float>(values[j]) * scale;
#else  // the portable kernel computes the exact product
        std::memcpy(out, block, sizeof(float) * kBlock);
#endif
      }
  });
  at::Tensor result = at::from_blob(y, {rows, n}, at::kFloat);
  const int64_t slab = std::clamp<int64_t>(((int64_t{1} << 16) / k) / 8 * 8, 8, 256);
  const int64_t slabs = (n + slab - 1) / slab;
  const uint16_t* sz = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<at::BFloat16>());
  const auto* bytes = static_cast<const uint8_t*>(weight.data_ptr());
  const int64_t row_bytes = row_bytes_of(held, k);
  const bool symmetric = scale_zero.dim() == 2;
  const int64_t pairs_per_row = scale_zero.size(1) * (symmetric ? 1 : 2);
  at::parallel_for(0, slabs, 1, [&](int64_t first, int64_t last) {
    c10::InferenceMode worker_inference;  // thread-local: each worker sets its own
    std::vector<float> buffer(static_cast<size_t>(slab * k));
    for (int64_t s = first; s < last; ++s) {
      const int64_t n0 = s * slab, count = std::min(slab, n - n0);
      for (int64_t i = 0; i < count; ++i) {
        const uint8_t* row = bytes + (n0 + i) * row_bytes;
        const uint16_t* pairs = sz + (n0 + i) * pairs_per_row;
#ifdef EXO_AVX2
        dequantize_row(row, held, symmetric, pairs, k, group_size, buffer.data() + i * k);
#else
        if (held == Held::kInt4)
          dequantize_int4_row(row, pairs, k, group_size, buffer.data() + i * k);
        else if (held == Held::kInt5)
          dequantize_int5_row(row, pairs, k, buffer.data() + i * k);
        else if (symmetric)
          dequantize_scaled_row(reinterpret_cast<const int8_t*>(row), pairs, k, group_size,
                                buffer.data() + i * k);
        else
          dequantize_int8_row(reinterpret_cast<const int8_t*>(row), pairs, k,
                              buffer.data() + i * k);
#endif
      }
      at::Tensor slab_weight = at::from_blob(buffer.data(), {count, k}, at::kFloat);
      at::Tensor out = result.narrow(1, n0, count);  // columns n0.., row stride n
      at::mm_out(out, activations, slab_weight.t());
    }
  });
}

}  // namespace exo_native::prefill
