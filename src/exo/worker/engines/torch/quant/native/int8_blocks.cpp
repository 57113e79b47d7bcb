// exo's decode kernels for int8 block weights (see ../native_kernels.py):
//   int8_block_gemv: GGUF's 8- and 5-bit blocks held as int8 values with a bfloat16
//     (scale, zero) pair per block of 32 inputs;
//   int8_scaled_gemv: symmetric int8 values with one bfloat16 scale per block of 16 or 32
//     inputs (GGUF Q6_K, Q8_0).
// Both round the activations as the int4 kernel does (int16 per block of 32, block_rows.h)
// and sum the products exactly in int32, in int8_tile.h's register tile (shared with
// mxfp4.cpp), or for 2+ activation rows over whole pairs of blocks its 512-bit tile (8
// activation rows per weight read; where built with AVX512BW and not EXO_NATIVE_AVX512=0);
// the policies below say how each format's scales and values are read.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

#include "block_rows.h"
#include "int8_tile.h"

namespace {

using exo_native::bf16_to_float;
using namespace exo_native::block_rows;
namespace int8_tile = exo_native::int8_tile;

// GGUF's 8- and 5-bit blocks (Q8_0, Q5_0, Q5_1): w[n, k] = (v[n, k] - 8) * scale[n, b] +
// zero[n, b] per block b of 32 inputs (the int4 convention; GGUF's d * v + m is scale d,
// zero 8d + m, which bfloat16 holds exactly for Q8_0 / Q5_0), v in [-128, 127] held as int8
// (1 byte per weight plus 4 per block: 1.125 bytes, where torch's kernels hold them as two
// int4 planes at 1.25 and twice the work). Same scheme as int4_gemv: int16 activations per
// block, int32 products, (zero - 8 scale) times the block's sum of rounded activations.
#ifdef EXO_AVX2
// Values v [n, k] as int8, the block's bfloat16 (scale, zero) pairs [n, k / 32, 2]; the
// activations' sums per block ([ROWS, k / 32], `quantize_rows`) for the zero term.
struct Int8PairBlocks {
  static constexpr bool kZeroTerm = true;
  const int8_t* v;
  const uint16_t* scale_zero;
  const float* block_sums;

  template <int ROWS, int NR>
  void unpack(int64_t n, int64_t k, float* scales, float (&zero_terms)[NR][ROWS]) const {
    const int64_t blocks = k / kBlock;
    unpack_scales<ROWS, NR>(scale_zero + n * blocks * 2, blocks, block_sums, scales, zero_terms);
  }
  const int8_t* block(int64_t row, int64_t b, int64_t k) const { return v + row * k + b * kBlock; }
  __m256i values(const int8_t* block) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
  }
#ifdef EXO_AVX512_TILES
  __m512i values512(const int8_t* block) const { return _mm512_loadu_si512(block); }
#endif
};
#endif

// Symmetric int8 blocks (GGUF Q8_0, Q6_K): w[n, k] = v[n, k] * scale[n, k / S], one bfloat16
// scale per block of S = 32 inputs (Q8_0's d) or S = 16 (Q6_K's d times its sub-block's
// scale): 1 + 2 / S bytes per weight (1.0625, 1.125), no zero term (HALVES 2 for S = 16 in
// int8_tile.h's tile).
#ifdef EXO_AVX2
struct ScaledInt8Blocks {
  static constexpr bool kZeroTerm = false;
  const int8_t* v;              // [n, k]
  const uint16_t* scales_bf16;  // [n, k / 32 * per_block]
  int64_t per_block;            // scales per block of 32: 1 or 2

  template <int ROWS, int NR>
  void unpack(int64_t n, int64_t k, float* scales, float (&)[NR][ROWS]) const {
    const int64_t per_row = k / kBlock * per_block;
    for (int i = 0; i < NR; ++i)
      unpack_bf16(scales_bf16 + (n + i) * per_row, per_row, scales + i * per_row);
  }
  const int8_t* block(int64_t row, int64_t b, int64_t k) const { return v + row * k + b * kBlock; }
  __m256i values(const int8_t* block) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block));
  }
#ifdef EXO_AVX512_TILES
  __m512i values512(const int8_t* block) const { return _mm512_loadu_si512(block); }
#endif
};
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
  thread_local AlignedBuffer<int16_t> quantized;
  thread_local std::vector<float> x_scales;
  quantized.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * blocks));
  int16_t* xq = quantized.data();
  float* xs = x_scales.data();
  quantize_rows(xp, rows, k, kBlock, xq, xs, sums);
#ifdef EXO_AVX512_TILES
  if (int8_tile::use_avx512(rows, k)) {
    thread_local std::vector<float> pair_scales;
    int8_tile::prepare_avx512(xq, xs, rows, k, pair_scales);
    const float* ps = pair_scales.data();
    const int64_t pairs = k / (2 * kBlock);
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      for_weight_spans(rows, 8, n0, n1, k, [&](int64_t s0, int64_t s1) {
        for_row_groups_of_8(rows, [&](auto count, int64_t r) {
          int8_tile::rows_avx512<decltype(count)::value, 1>(
              xq + r * k, ps + r * pairs * 16, k, Int8PairBlocks{vp, so, sums + r * blocks},
              yp + r * n, n, s0, s1);
        });
      });
    });
    return;
  }
#endif
  reorder_even_odd(xq, rows * k);
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for_weight_spans(rows, 4, n0, n1, k, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        int8_tile::rows_avx2<decltype(count)::value, 1>(
            xq + r * k, xs + r * blocks, k, Int8PairBlocks{vp, so, sums + r * blocks},
            yp + r * n, n, s0, s1);
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
  thread_local AlignedBuffer<int16_t> quantized;
  thread_local std::vector<float> x_scales, block_sums;
  quantized.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * blocks));
  block_sums.resize(static_cast<size_t>(rows * blocks));  // unused: no zero term
  int16_t* xq = quantized.data();
  float* xs = x_scales.data();
  quantize_rows(xp, rows, k, kBlock, xq, xs, block_sums.data());
#ifdef EXO_AVX512_TILES
  if (int8_tile::use_avx512(rows, k)) {
    thread_local std::vector<float> pair_scales;
    int8_tile::prepare_avx512(xq, xs, rows, k, pair_scales);
    const float* ps = pair_scales.data();
    const int64_t pairs = k / (2 * kBlock);
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      for_weight_spans(rows, 8, n0, n1, k, [&](int64_t s0, int64_t s1) {
        for_row_groups_of_8(rows, [&](auto count, int64_t r) {
          constexpr int R = decltype(count)::value;
          const ScaledInt8Blocks weights{vp, sc, kBlock / block};
          if (block == 16)
            int8_tile::rows_avx512<R, 2>(xq + r * k, ps + r * pairs * 16, k, weights, yp + r * n,
                                         n, s0, s1);
          else
            int8_tile::rows_avx512<R, 1>(xq + r * k, ps + r * pairs * 16, k, weights, yp + r * n,
                                         n, s0, s1);
        });
      });
    });
    return;
  }
#endif
  reorder_even_odd(xq, rows * k);
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for_weight_spans(rows, 4, n0, n1, k, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        constexpr int R = decltype(count)::value;
        const ScaledInt8Blocks weights{vp, sc, kBlock / block};
        if (block == 16)
          int8_tile::rows_avx2<R, 2>(xq + r * k, xs + r * blocks, k, weights, yp + r * n, n, s0,
                                     s1);
        else
          int8_tile::rows_avx2<R, 1>(xq + r * k, xs + r * blocks, k, weights, yp + r * n, n, s0,
                                     s1);
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
