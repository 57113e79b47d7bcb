// exo's decode product for symmetric int8 weights with one scale per output row
// (Int8Linear, the LM head's format): y[m, n] = scale[n] * sum_k v[n, k] x[m, k], the
// activations rounded per block of 32 to int16 as the int4 kernels round them
// (int4_gemv.cpp), 256-bit (AVX2) and, where built with AVX512BW, 512-bit for several rows.
// Without AVX2 a portable loop computes the float32 product exactly.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "block_rows.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(EXO_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define EXO_INT8_CHANNEL_AVX512 1
#endif

namespace {

using exo_native::bf16_to_float;
using namespace exo_native::block_rows;

}  // namespace

namespace {

// Symmetric int8 weights with one scale per output row (Int8Linear, the LM head's format):
// y[m, n] = scale[n] * sum_k v[n, k] x[m, k]. Activations rounded per block of 32 to int16
// (block_rows.h's `quantize_rows`, as int4_gemv.cpp's kernels), reordered within each block to its even then its odd inputs, so a 32-byte load
// of weights sign-extends to int16 by shifts alone (lane i of the load holds inputs 2i and
// 2i + 1 of the block in its low and high bytes); no byte-to-word widening.
#ifdef EXO_AVX2
template <int ROWS, int NR>
[[gnu::noinline]]
void tile_avx2_int8_channel(const int16_t* xq, const float* x_scales, int64_t k, const int8_t* v,
                            const uint16_t* scales, float* y, int64_t n_total, int64_t n) {
  const int64_t blocks = k / kBlock;
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
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock);
        const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_loadu_si256(xv)),
                                              _mm256_madd_epi16(odd, _mm256_loadu_si256(xv + 1)));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                                    _mm256_broadcast_ss(x_scales + r * blocks + b), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r)
      y[r * n_total + n + i] = horizontal_sum(acc[i][r]) * bf16_to_float(scales[n + i]);
}

template <int ROWS>
void rows_avx2_int8_channel(const int16_t* xq, const float* xs, int64_t k, const int8_t* v,
                            const uint16_t* scales, float* y, int64_t n_total, int64_t n0,
                            int64_t n1) {
  constexpr int kTile = int8_tile_rows<ROWS>();
  int64_t n = n0;
  for (; n + kTile <= n1; n += kTile)
    tile_avx2_int8_channel<ROWS, kTile>(xq, xs, k, v, scales, y, n_total, n);
  for (; n < n1; ++n) tile_avx2_int8_channel<ROWS, 1>(xq, xs, k, v, scales, y, n_total, n);
}
#endif

#ifdef EXO_INT8_CHANNEL_AVX512
// The same product on 512 bits, for several activation rows (a decode step over many
// requests: the LM head's int8 rows are read once for all of them, so its cost per row is
// the arithmetic): each 64-byte load is one pair of blocks, whose int16 lanes 0-15 are the
// first block's; the activations of each pair are reordered to its 32 even inputs then its
// 32 odd ones (`reorder_pairs_even_odd`), so the shifts give the matching weights, and
// with AVX512-VNNI a block pair's products and their sums are two vpdpwssd per row. Each
// pair's two activation scales are expanded once per call to the 16 int32 lanes they
// scale (`pair_scales`, 8 lanes each), one load and one FMA per row and pair.
template <int ROWS, int NR>
void tile_avx512_int8_channel(const int16_t* xq, const float* pair_scales, int64_t k,
                              const int8_t* v, const uint16_t* scales, float* y,
                              int64_t n_total, int64_t n) {
  const int64_t pairs = k / (2 * kBlock);
  __m512 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    for (int i = 0; i < NR; ++i) {
      const int8_t* bytes = v + (n + i) * k + p * 2 * kBlock;
      const __m512i lanes = _mm512_loadu_si512(bytes);
      prefetch_ahead(bytes);
      const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(lanes, 8), 8);
      const __m512i odd = _mm512_srai_epi16(lanes, 8);
      for (int r = 0; r < ROWS; ++r) {
        const int16_t* xv = xq + r * k + p * 2 * kBlock;
        const __m512i sums =
            multiply_add(multiply_add(_mm512_setzero_si512(), even, _mm512_loadu_si512(xv)),
                         odd, _mm512_loadu_si512(xv + kBlock));
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                                    _mm512_loadu_ps(pair_scales + (r * pairs + p) * 16),
                                    acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r)
      y[r * n_total + n + i] = _mm512_reduce_add_ps(acc[i][r]) * bf16_to_float(scales[n + i]);
}

template <int ROWS>
void rows_avx512_int8_channel(const int16_t* xq, const float* pair_scales, int64_t k,
                              const int8_t* v, const uint16_t* scales, float* y,
                              int64_t n_total, int64_t n0, int64_t n1) {
  constexpr int kTile = ROWS <= 2 ? 1 : 2;
  int64_t n = n0;
  for (; n + kTile <= n1; n += kTile)
    tile_avx512_int8_channel<ROWS, kTile>(xq, pair_scales, k, v, scales, y, n_total, n);
  for (; n < n1; ++n)
    tile_avx512_int8_channel<ROWS, 1>(xq, pair_scales, k, v, scales, y, n_total, n);
}
#endif

}  // namespace

namespace exo_native {

void int8_channel_product(const float* xp, int64_t rows, int64_t k, const at::Tensor& weight,
                          const at::Tensor& scales, float* yp) {
  const int64_t n = weight.size(0);
  if (rows == 0 || n == 0) return;
  const int8_t* vp = weight.data_ptr<int8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 17) / std::max<int64_t>(k, 1));
#ifdef EXO_AVX2
  const int64_t blocks = k / kBlock;
  thread_local AlignedBuffer<int16_t> rounded;
  thread_local std::vector<float> x_scales, block_sums;
  rounded.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * blocks));
  block_sums.resize(static_cast<size_t>(rows * blocks));
  quantize_rows(xp, rows, k, kBlock, rounded.data(), x_scales.data(), block_sums.data());
#ifdef EXO_INT8_CHANNEL_AVX512
  // Every row count, one included, takes the 512-bit tile where it runs: a row's sums are
  // then the same bits whatever the step's row count (speculative decoding's verify rows
  // equal decode rows; see int4_gemv.cpp).
  if (k % (2 * kBlock) == 0 && int4_decode_bits() == 512) {
    reorder_pairs_even_odd(rounded.data(), rows * k);
    const int64_t pairs = blocks / 2;
    thread_local std::vector<float> pair_scales;
    pair_scales.resize(static_cast<size_t>(rows * pairs * 16));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t p = 0; p < pairs; ++p)
        for (int lane = 0; lane < 16; ++lane)
          pair_scales[(r * pairs + p) * 16 + lane] = x_scales[r * blocks + 2 * p + lane / 8];
    const int16_t* xq = rounded.data();
    const float* ps = pair_scales.data();
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      for_weight_spans(rows, 8, n0, n1, k, [&](int64_t s0, int64_t s1) {
        for_row_groups_of_8(rows, [&](auto count, int64_t r) {
          rows_avx512_int8_channel<decltype(count)::value>(
              xq + r * k, ps + r * pairs * 16, k, vp, sp, yp + r * n, n, s0, s1);
        });
      });
    });
    return;
  }
#endif
  reorder_even_odd(rounded.data(), rows * k);
  const int16_t* xq = rounded.data();
  const float* xs = x_scales.data();
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for_weight_spans(rows, 4, n0, n1, k, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        rows_avx2_int8_channel<decltype(count)::value>(xq + r * k, xs + r * blocks, k, vp, sp,
                                                       yp + r * n, n, s0, s1);
      });
    });
  });
#else
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t o = n0; o < n1; ++o)
      for (int64_t r = 0; r < rows; ++r) {
        float total = 0.0f;
        for (int64_t j = 0; j < k; ++j) total += static_cast<float>(vp[o * k + j]) * xp[r * k + j];
        yp[r * n + o] = total * bf16_to_float(sp[o]);
      }
  });
#endif
}

}  // namespace exo_native

namespace {

at::Tensor int8_channel_gemv(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_channel_gemv: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_channel_gemv: weight must be a contiguous int8 [out, in] tensor");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k && k % kBlock == 0, "int8_channel_gemv: x has ", k,
              " inputs, the weight ", weight.size(1), " (a multiple of 32 is needed)");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n &&
                  scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(),
              "int8_channel_gemv: scales must be a contiguous bfloat16 [out] tensor");
  at::Tensor y = at::empty({rows, n}, x.options());
  exo_native::int8_channel_product(x.data_ptr<float>(), rows, k, weight, scales,
                                   y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def("int8_channel_gemv(Tensor x, Tensor weight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("int8_channel_gemv", &int8_channel_gemv); }
