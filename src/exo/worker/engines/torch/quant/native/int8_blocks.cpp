// exo's decode kernels for int8 block weights (see ../native_kernels.py):
//   int8_block_gemv: GGUF's 8- and 5-bit blocks held as int8 values with a bfloat16
//     (scale, zero) pair per block of 32 inputs;
//   int8_scaled_gemv: symmetric int8 values with one bfloat16 scale per block of 16 or 32
//     inputs (GGUF Q6_K, Q8_0).
// Both round the activations as the int4 kernel does (int16 per block of 32, block_rows.h)
// and sum the products exactly in int32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

#include "block_rows.h"

namespace {

using exo_native::bf16_to_float;
using namespace exo_native::block_rows;

// GGUF's 8- and 5-bit blocks (Q8_0, Q5_0, Q5_1): w[n, k] = (v[n, k] - 8) * scale[n, b] +
// zero[n, b] per block b of 32 inputs (the int4 convention; GGUF's d * v + m is scale d,
// zero 8d + m, which bfloat16 holds exactly for Q8_0 / Q5_0), v in [-128, 127] held as int8
// (1 byte per weight plus 4 per block: 1.125 bytes, where torch's kernels hold them as two
// int4 planes at 1.25 and twice the work). Same scheme as int4_gemv: int16 activations per
// block, int32 products, (zero - 8 scale) times the block's sum of rounded activations.
#ifdef EXO_AVX2
template <int ROWS, int NR>
void tile_avx2_int8(const int16_t* xq, const float* x_scales, const float* block_sums,
                    int64_t k, const int8_t* v, const uint16_t* scale_zero, float* y,
                    int64_t n_total, int64_t n, float* scales) {
  const int64_t blocks = k / kBlock;
  float offset_acc[NR][ROWS];
  unpack_scales<ROWS, NR>(scale_zero + n * blocks * 2, blocks, block_sums, scales, offset_acc);
  __m256 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int i = 0; i < NR; ++i) {
      const __m256i bytes =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (n + i) * k + b * kBlock));
      prefetch_ahead(v + (n + i) * k + b * kBlock);
      const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 8);
      const __m256i odd = _mm256_srai_epi16(bytes, 8);
      const __m256 weight_scale = _mm256_broadcast_ss(scales + i * blocks + b);
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
    for (int r = 0; r < ROWS; ++r)
      y[r * n_total + n + i] = horizontal_sum(acc[i][r]) + offset_acc[i][r];
}

template <int ROWS>
void rows_avx2_int8(const int16_t* xq, const float* xs, const float* sums, int64_t k,
                    const int8_t* v, const uint16_t* so, float* y, int64_t n_total, int64_t n0,
                    int64_t n1) {
  constexpr int kTile = int8_tile_rows<ROWS>();
  std::vector<float> scales(static_cast<size_t>(kTile * (k / kBlock)));
  int64_t n = n0;
  for (; n + kTile <= n1; n += kTile)
    tile_avx2_int8<ROWS, kTile>(xq, xs, sums, k, v, so, y, n_total, n, scales.data());
  for (; n < n1; ++n) tile_avx2_int8<ROWS, 1>(xq, xs, sums, k, v, so, y, n_total, n, scales.data());
}
#endif

// Symmetric int8 blocks (GGUF Q8_0, Q6_K): w[n, k] = v[n, k] * scale[n, k / S], one bfloat16
// scale per block of S = 32 inputs (Q8_0's d) or S = 16 (Q6_K's d times its sub-block's
// scale): 1 + 2 / S bytes per weight (1.0625, 1.125), no zero term. In the even/odd order of
// a block's activations, 32-bit lane l of the two multiply-adds sums inputs 4l..4l+3, so
// lanes 0-3 hold the block's first 16 inputs and lanes 4-7 its last 16: with S = 16
// (HALVES 2) each 128-bit half of the weight's scale vector is one block of 16's scale.
#ifdef EXO_AVX2
template <int ROWS, int NR, int HALVES>
void tile_avx2_scaled(const int16_t* xq, const float* x_scales, int64_t k, const int8_t* v,
                      const uint16_t* scales_bf16, float* y, int64_t n_total, int64_t n,
                      float* scales) {
  const int64_t blocks = k / kBlock, per_row = blocks * HALVES;
  for (int i = 0; i < NR; ++i)  // the tile's scales as float32
    unpack_bf16(scales_bf16 + (n + i) * per_row, per_row, scales + i * per_row);
  __m256 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int i = 0; i < NR; ++i) {
      const int8_t* block = v + (n + i) * k + b * kBlock;
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
      prefetch_ahead(block);
      const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 8);
      const __m256i odd = _mm256_srai_epi16(bytes, 8);
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
    for (int r = 0; r < ROWS; ++r) y[r * n_total + n + i] = horizontal_sum(acc[i][r]);
}

template <int ROWS, int HALVES>
void rows_avx2_scaled(const int16_t* xq, const float* xs, int64_t k, const int8_t* v,
                      const uint16_t* sc, float* y, int64_t n_total, int64_t n0, int64_t n1) {
  constexpr int kTile = int8_tile_rows<ROWS>();
  std::vector<float> scales(static_cast<size_t>(kTile * (k / kBlock) * HALVES));
  int64_t n = n0;
  for (; n + kTile <= n1; n += kTile)
    tile_avx2_scaled<ROWS, kTile, HALVES>(xq, xs, k, v, sc, y, n_total, n, scales.data());
  for (; n < n1; ++n)
    tile_avx2_scaled<ROWS, 1, HALVES>(xq, xs, k, v, sc, y, n_total, n, scales.data());
}
#endif

}  // namespace

namespace exo_native {

void int8_block_product(const float* xp, int64_t rows, int64_t k, const at::Tensor& values,
                        const at::Tensor& scale_zero, float* yp) {
  const int64_t n = values.size(0);
  if (rows == 0 || n == 0) return;
  const int64_t blocks = k / kBlock;
  const int8_t* vp = values.data_ptr<int8_t>();
  const uint16_t* so = reinterpret_cast<const uint16_t*>(scale_zero.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 16) / std::max<int64_t>(k, 1));
  thread_local std::vector<float> block_sums;
  block_sums.resize(static_cast<size_t>(rows * blocks));
  float* sums = block_sums.data();
#ifdef EXO_AVX2
  thread_local std::vector<int16_t> quantized;
  thread_local std::vector<float> x_scales;
  quantized.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * blocks));
  int16_t* xq = quantized.data();
  float* xs = x_scales.data();
  quantize_rows(xp, rows, k, kBlock, xq, xs, sums);
  reorder_even_odd(xq, rows * k);
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for_weight_spans(rows, 4, n0, n1, k, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        rows_avx2_int8<decltype(count)::value>(xq + r * k, xs + r * blocks, sums + r * blocks,
                                               k, vp, so, yp + r * n, n, s0, s1);
      });
    });
  });
#else
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t o = n0; o < n1; ++o)
      for (int64_t r = 0; r < rows; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint16_t* pair = so + (o * blocks + b) * 2;
          float dot = 0.0f, sum = 0.0f;
          for (int j = 0; j < kBlock; ++j) {
            const float xv = xp[r * k + b * kBlock + j];
            dot += static_cast<float>(vp[o * k + b * kBlock + j]) * xv;
            sum += xv;
          }
          const float scale = bf16_to_float(pair[0]);
          total += scale * dot + (bf16_to_float(pair[1]) - 8.0f * scale) * sum;
        }
        yp[r * n + o] = total;
      }
  });
#endif
}

void int8_scaled_product(const float* xp, int64_t rows, int64_t k, const at::Tensor& values,
                         const at::Tensor& scales, float* yp) {
  const int64_t n = values.size(0);
  if (rows == 0 || n == 0) return;
  const int64_t block = k / scales.size(1);  // 16 or 32 (checked by the callers)
  const int8_t* vp = values.data_ptr<int8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 16) / std::max<int64_t>(k, 1));
#ifdef EXO_AVX2
  const int64_t blocks = k / kBlock;
  thread_local std::vector<int16_t> quantized;
  thread_local std::vector<float> x_scales, block_sums;
  quantized.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * blocks));
  block_sums.resize(static_cast<size_t>(rows * blocks));  // unused: no zero term
  int16_t* xq = quantized.data();
  float* xs = x_scales.data();
  quantize_rows(xp, rows, k, kBlock, xq, xs, block_sums.data());
  reorder_even_odd(xq, rows * k);
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for_weight_spans(rows, 4, n0, n1, k, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        constexpr int R = decltype(count)::value;
        if (block == 16)
          rows_avx2_scaled<R, 2>(xq + r * k, xs + r * blocks, k, vp, sc, yp + r * n, n, s0, s1);
        else
          rows_avx2_scaled<R, 1>(xq + r * k, xs + r * blocks, k, vp, sc, yp + r * n, n, s0, s1);
      });
    });
  });
#else
  const int64_t per_row = k / block;
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t o = n0; o < n1; ++o)
      for (int64_t r = 0; r < rows; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < per_row; ++b) {
          float dot = 0.0f;
          for (int64_t j = 0; j < block; ++j)
            dot += static_cast<float>(vp[o * k + b * block + j]) * xp[r * k + b * block + j];
          total += bf16_to_float(sc[o * per_row + b]) * dot;
        }
        yp[r * n + o] = total;
      }
  });
#endif
}


}  // namespace exo_native

namespace {

at::Tensor int8_block_gemv(const at::Tensor& x, const at::Tensor& values,
                           const at::Tensor& scale_zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_block_gemv: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar && values.is_contiguous(),
              "int8_block_gemv: values must be a contiguous int8 [out, in] tensor");
  const int64_t rows = x.size(0), k = x.size(1), n = values.size(0);
  TORCH_CHECK(values.size(1) == k && k % kBlock == 0, "int8_block_gemv: x has ", k,
              " inputs, values ", values.size(1), " (a multiple of 32 is needed)");
  TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.size(0) == n &&
                  scale_zero.size(1) == k / kBlock && scale_zero.size(2) == 2 &&
                  scale_zero.scalar_type() == at::kBFloat16 && scale_zero.is_contiguous(),
              "int8_block_gemv: scale_zero must be a contiguous bfloat16 [out, in / 32, 2] "
              "tensor");
  at::Tensor y = at::empty({rows, n}, x.options());
  exo_native::int8_block_product(x.data_ptr<float>(), rows, k, values, scale_zero,
                                 y.data_ptr<float>());
  return y;
}

at::Tensor int8_scaled_gemv(const at::Tensor& x, const at::Tensor& values,
                            const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_scaled_gemv: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kChar && values.is_contiguous(),
              "int8_scaled_gemv: values must be a contiguous int8 [out, in] tensor");
  const int64_t rows = x.size(0), k = x.size(1), n = values.size(0);
  TORCH_CHECK(values.size(1) == k && k % kBlock == 0, "int8_scaled_gemv: x has ", k,
              " inputs, values ", values.size(1), " (a multiple of 32 is needed)");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n &&
                  (scales.size(1) * 16 == k || scales.size(1) * 32 == k) &&
                  scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(),
              "int8_scaled_gemv: scales must be a contiguous bfloat16 [out, in / 16] or "
              "[out, in / 32] tensor");
  at::Tensor y = at::empty({rows, n}, x.options());
  exo_native::int8_scaled_product(x.data_ptr<float>(), rows, k, values, scales,
                                  y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def("int8_block_gemv(Tensor x, Tensor values, Tensor scale_zero) -> Tensor");
  m.def("int8_scaled_gemv(Tensor x, Tensor values, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) {
  m.impl("int8_block_gemv", &int8_block_gemv);
  m.impl("int8_scaled_gemv", &int8_scaled_gemv);
}
