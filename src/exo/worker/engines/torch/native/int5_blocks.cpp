// exo's decode kernel for 5-bit blocks (GGUF Q5_0, see ../int5_blocks.py):
//   w[n, k] = v[n, k] * scale[n, k / 32],  v = (low | high << 4) - 16 in [-16, 15],
// one bfloat16 scale per block of 32 inputs (Q5_0's d), each block held as Q5_0 holds it
// without its scale: 4 bytes of high bits (bit j: input j), then 16 bytes of low nibbles
// (byte j: input j in its low nibble, input j + 16 in its high one). 20 bytes per block
// plus 2 of scale: 0.6875 bytes per weight, where the int8 blocks of the exact route took
// 1.125. The activations are rounded to int16 per block of 32 as for every block weight
// (block_rows.h) and the products summed exactly in int32: the same sums the int8 route
// computes on the same integers.

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

#ifdef EXO_AVX2
// NR output rows at once for ROWS activation rows (activations in their natural order).
template <int ROWS, int NR>
void tile_avx2_int5(const int16_t* xq, const float* x_scales, int64_t k, const uint8_t* w,
                    const uint16_t* scales_bf16, float* y, int64_t n_total, int64_t n,
                    float* scales) {
  const int64_t blocks = k / kBlock, row_bytes = blocks * kInt5BlockBytes;
  for (int i = 0; i < NR; ++i) unpack_bf16(scales_bf16 + (n + i) * blocks, blocks, scales + i * blocks);
  __m256 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int i = 0; i < NR; ++i) {
      const uint8_t* block = w + (n + i) * row_bytes + b * kInt5BlockBytes;
      prefetch_ahead(block);
      __m256i values[2];
      int5_block_values(block, values);
      const __m256 weight_scale = _mm256_broadcast_ss(scales + i * blocks + b);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock);
        const __m256i sums =
            _mm256_add_epi32(_mm256_madd_epi16(values[0], _mm256_loadu_si256(xv)),
                             _mm256_madd_epi16(values[1], _mm256_loadu_si256(xv + 1)));
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

template <int ROWS>
void rows_avx2_int5(const int16_t* xq, const float* xs, int64_t k, const uint8_t* w,
                    const uint16_t* sc, float* y, int64_t n_total, int64_t n0, int64_t n1) {
  constexpr int kTile = ROWS <= 2 ? 4 : 2;
  std::vector<float> scales(static_cast<size_t>(kTile * (k / kBlock)));
  int64_t n = n0;
  for (; n + kTile <= n1; n += kTile)
    tile_avx2_int5<ROWS, kTile>(xq, xs, k, w, sc, y, n_total, n, scales.data());
  for (; n < n1; ++n) tile_avx2_int5<ROWS, 1>(xq, xs, k, w, sc, y, n_total, n, scales.data());
}
#endif

// The 5-bit value of input j of one held row.
inline int int5_value(const uint8_t* row, int64_t j) {
  const uint8_t* block = row + (j / kBlock) * kInt5BlockBytes;
  const int64_t i = j % kBlock;
  uint32_t high;
  std::memcpy(&high, block, sizeof(high));
  const int low = i < 16 ? (block[4 + i] & 0x0F) : (block[4 + i - 16] >> 4);
  return (low | static_cast<int>(((high >> i) & 1u) << 4)) - 16;
}

}  // namespace

namespace exo_native {

void int5_product(const float* xp, int64_t rows, int64_t k, const at::Tensor& packed,
                  const at::Tensor& scales, float* yp) {
  const int64_t n = packed.size(0);
  if (rows == 0 || n == 0) return;
  const int64_t blocks = k / kBlock;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 17) / std::max<int64_t>(k, 1));
#ifdef EXO_AVX2
  thread_local std::vector<int16_t> quantized;
  thread_local std::vector<float> x_scales, block_sums;
  quantized.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * blocks));
  block_sums.resize(static_cast<size_t>(rows * blocks));  // unused: no zero term
  int16_t* xq = quantized.data();
  float* xs = x_scales.data();
  quantize_rows(xp, rows, k, kBlock, xq, xs, block_sums.data());
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for_row_groups(rows, [&](auto count, int64_t r) {
      rows_avx2_int5<decltype(count)::value>(xq + r * k, xs + r * blocks, k, wp, sc, yp + r * n,
                                             n, n0, n1);
    });
  });
#else
  const int64_t row_bytes = blocks * kInt5BlockBytes;
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t o = n0; o < n1; ++o)
      for (int64_t r = 0; r < rows; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          float dot = 0.0f;
          for (int64_t j = b * kBlock; j < (b + 1) * kBlock; ++j)
            dot += static_cast<float>(int5_value(wp + o * row_bytes, j)) * xp[r * k + j];
          total += bf16_to_float(sc[o * blocks + b]) * dot;
        }
        yp[r * n + o] = total;
      }
  });
#endif
}

}  // namespace exo_native

namespace {

at::Tensor int5_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int5_gemv: x must be a contiguous float32 [rows, in] tensor");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "int5_gemv: x has ", k, " inputs (a multiple of 32 is needed)");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == k / kBlock * kInt5BlockBytes,
              "int5_gemv: packed must be a contiguous uint8 [out, in / 32 * 20] tensor");
  const int64_t n = packed.size(0);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == k / kBlock &&
                  scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(),
              "int5_gemv: scales must be a contiguous bfloat16 [out, in / 32] tensor");
  at::Tensor y = at::empty({rows, n}, x.options());
  exo_native::int5_product(x.data_ptr<float>(), rows, k, packed, scales, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def("int5_gemv(Tensor x, Tensor packed, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("int5_gemv", &int5_gemv); }
