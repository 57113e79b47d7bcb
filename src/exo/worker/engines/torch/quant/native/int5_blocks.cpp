// exo's decode kernel for 5-bit lanes (GGUF Q5_0, see ../int5_blocks.py):
//   w[n, k] = x[n, k] * scale[n, k / 32],  x in [-16, 15],
// one bfloat16 scale per block of 32 inputs (Q5_0's d). The values are held as u = x + 16
// in [0, 31], three to a 16-bit lane: a row is groups of 3 blocks (96 inputs) of 64 bytes,
// two vectors of 16 lanes, lane j of vector h holding the values of inputs 16 (3h + f) + j
// of the group at bits 5f .. 5f + 4 (f = 0, 1, 2; bit 15 is 0); block p of the group is
// inputs 32p .. 32p + 31, "vectors" 2p and 2p + 1. A row's last group, with 1 or 2 blocks, is
// zero-padded: int5_row_bytes(k) = ceil(k / 96) * 64 bytes, 0.667 bytes per weight (0.7 for
// rows of 640) plus 0.0625 of scale, where GGUF's own 20-byte blocks take 0.625.
//
// Why lanes: a GGUF block's fifth bits (a 32-bit word beside 16 bytes of nibbles) took ~15
// vector operations per block to unpack into int16, and the kernel read them about half as
// fast as the int8-block kernel reads its weights
// (figures: docs/benchmarks/engine-design-figures.md#int5_blockscpp).
// Three values per lane unpack with one shift and one mask each.
//
// The activations are rounded to int16 per block of 32 as for every block weight
// (block_rows.h) and each block's products summed exactly in int32, the offset included:
//   sum_j x_j a_j = sum_j u_j a_j - 16 sum_j a_j,
// the second term computed once per activation row (per lane of the sums): the same int32
// sums, lane by lane, the int8 route computes on the same integers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

#include "block_rows.h"

namespace {

using exo_native::bf16_to_float;
using exo_native::kInt5GroupBlocks;
using exo_native::kInt5GroupBytes;
using namespace exo_native::block_rows;

#ifdef EXO_AVX2
// The three blocks of one group of one output row (BLOCKS of them: 3, or 1-2 in a row's
// last group) times ROWS activation rows, into acc[ROWS]. `xq` points at the group's first
// block of activation row 0, `combined` at the block's scale products (weight scale times
// activation scale, [ROWS][blocks]), `offsets` at the block's offset vectors ([ROWS][blocks]
// vectors of 8 int32: -16 times the sum of the rounded activations each lane of the
// products sums, so that every lane holds the sum the int8 kernel's lane holds).
template <int ROWS, int BLOCKS>
inline void group_avx2_int5(const uint8_t* group, const int16_t* xq, int64_t k,
                            const float* combined, const __m256i* offsets, int64_t blocks,
                            __m256 acc[ROWS]) {
  __m256i v[6];
  v[0] = exo_native::block_rows::int5_vector<0>(group);
  v[1] = exo_native::block_rows::int5_vector<1>(group);
  if constexpr (BLOCKS >= 2) {
    v[2] = exo_native::block_rows::int5_vector<2>(group);
    v[3] = exo_native::block_rows::int5_vector<3>(group);
  }
  if constexpr (BLOCKS == 3) {
    v[4] = exo_native::block_rows::int5_vector<4>(group);
    v[5] = exo_native::block_rows::int5_vector<5>(group);
  }
  for (int p = 0; p < BLOCKS; ++p) {
    for (int r = 0; r < ROWS; ++r) {
      const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + p * kBlock);
      __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(v[2 * p], _mm256_loadu_si256(xv)),
                                      _mm256_madd_epi16(v[2 * p + 1], _mm256_loadu_si256(xv + 1)));
      sums = _mm256_add_epi32(sums, _mm256_loadu_si256(offsets + r * blocks + p));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums),
                               _mm256_broadcast_ss(combined + r * blocks + p), acc[r]);
    }
  }
}

// NR output rows from n at once for ROWS activation rows. `scratch` holds NR * ROWS * blocks
// floats.
template <int ROWS, int NR>
[[gnu::noinline]]
void tile_avx2_int5(const int16_t* xq, const float* x_scales, const __m256i* x_offsets,
                    int64_t k, const uint8_t* w, const uint16_t* scales_bf16, float* y,
                    int64_t n_total, int64_t n, float* scratch) {
  const int64_t blocks = k / kBlock, row_bytes = exo_native::int5_row_bytes(k);
  const int64_t full_groups = blocks / kInt5GroupBlocks, left = blocks % kInt5GroupBlocks;
  // combined[i][r][b] = weight scale [i][b] * activation scale [r][b].
  for (int i = 0; i < NR; ++i) {
    float* combined = scratch + i * ROWS * blocks;
    unpack_bf16(scales_bf16 + (n + i) * blocks, blocks, combined);
    for (int r = ROWS - 1; r >= 0; --r)
      for (int64_t b = 0; b < blocks; ++b)
        combined[r * blocks + b] = combined[b] * x_scales[r * blocks + b];
  }
  for (int i = 0; i < NR; ++i) {
    const uint8_t* row = w + (n + i) * row_bytes;
    const float* combined = scratch + i * ROWS * blocks;
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g < full_groups; ++g) {
      const uint8_t* group = row + g * kInt5GroupBytes;
      prefetch_ahead(group);
      const int64_t b = g * kInt5GroupBlocks;
      group_avx2_int5<ROWS, 3>(group, xq + b * kBlock, k, combined + b, x_offsets + b, blocks,
                               acc);
    }
    const int64_t b = g * kInt5GroupBlocks;
    if (left == 1)
      group_avx2_int5<ROWS, 1>(row + g * kInt5GroupBytes, xq + b * kBlock, k, combined + b,
                               x_offsets + b, blocks, acc);
    if (left == 2)
      group_avx2_int5<ROWS, 2>(row + g * kInt5GroupBytes, xq + b * kBlock, k, combined + b,
                               x_offsets + b, blocks, acc);
    for (int r = 0; r < ROWS; ++r) y[r * n_total + n + i] = horizontal_sum(acc[r]);
  }
}

template <int ROWS>
void rows_avx2_int5(const int16_t* xq, const float* xs, const __m256i* offsets, int64_t k,
                    const uint8_t* w, const uint16_t* sc, float* y, int64_t n_total, int64_t n0,
                    int64_t n1) {
  constexpr int kTile = ROWS <= 2 ? 4 : 2;
  std::vector<float> scratch(static_cast<size_t>(kTile * ROWS * (k / kBlock)));
  int64_t n = n0;
  for (; n + kTile <= n1; n += kTile)
    tile_avx2_int5<ROWS, kTile>(xq, xs, offsets, k, w, sc, y, n_total, n, scratch.data());
  for (; n < n1; ++n)
    tile_avx2_int5<ROWS, 1>(xq, xs, offsets, k, w, sc, y, n_total, n, scratch.data());
}
#endif

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
  thread_local AlignedBuffer<int16_t> quantized;
  thread_local std::vector<float> x_scales, block_sums;
  thread_local std::vector<__m256i> offsets;
  quantized.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * blocks));
  block_sums.resize(static_cast<size_t>(rows * blocks));  // unused: the offsets below
  offsets.resize(static_cast<size_t>(rows * blocks));
  // Pointers, not the thread_local vectors, go into the parallel loop (a worker thread
  // naming them would see its own, empty, ones).
  int16_t* xq = quantized.data();
  float* xs = x_scales.data();
  __m256i* xo = offsets.data();
  quantize_rows(xp, rows, k, kBlock, xq, xs, block_sums.data());
  const __m256i minus16 = _mm256_set1_epi16(-16);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256i* block = reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock);
      xo[r * blocks + b] =
          _mm256_add_epi32(_mm256_madd_epi16(minus16, _mm256_loadu_si256(block)),
                           _mm256_madd_epi16(minus16, _mm256_loadu_si256(block + 1)));
    }
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for_weight_spans(rows, 4, n0, n1, k * 5 / 8, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        rows_avx2_int5<decltype(count)::value>(xq + r * k, xs + r * blocks, xo + r * blocks, k,
                                               wp, sc, yp + r * n, n, s0, s1);
      });
    });
  });
#else
  const int64_t row_bytes = exo_native::int5_row_bytes(k);
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t o = n0; o < n1; ++o)
      for (int64_t r = 0; r < rows; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          float dot = 0.0f;
          for (int64_t j = b * kBlock; j < (b + 1) * kBlock; ++j)
            dot += static_cast<float>(exo_native::int5_value(wp + o * row_bytes, j)) * xp[r * k + j];
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
                  packed.size(1) == exo_native::int5_row_bytes(k),
              "int5_gemv: packed must be contiguous uint8 5-bit lanes [out, ceil(in / 96) * "
              "64]");
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
