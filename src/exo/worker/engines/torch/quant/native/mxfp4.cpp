// exo's decode product for MXFP4 weights (gpt-oss's experts, ../mxfp4.py): the blocks are
// read inside the product, never widened into a float copy of the weight.
//
// MXFP4 (OCP Microscaling v1.0): per output row, each block of 32 inputs holds 32 E2M1
// codes (16 bytes, the even-indexed input in the low nibble) and one e8m0 scale byte s
// (2 ** (s - 127)). Twice every E2M1 value is an integer in [-12, 12], so a block is
// w = v * 2 ** (s - 128) with v the int8 "doubled" value: the same shape as the symmetric
// int8 blocks of int8_blocks.cpp (int8 values, one float scale per 32 inputs), and the same
// register tile (int8_tile.h): activations rounded to int16 per block of 32
// (block_rows.h), products summed exactly in int32 (|v| <= 12, so a pair of multiply-adds
// stays far inside int32), one float multiply-add per block and output row. A byte table
// lookup (`pshufb` on the codes) turns 16 bytes into the block's 32 int8 values in input
// order; that and the e8m0 scales are all that differ from int8_blocks.cpp's symmetric int8.
//
// 4.25 bits per weight are read per token, against 32 for the widened float32 weight.
//
// Where a row is whole pairs of blocks (k % 64 == 0: gpt-oss's 2880 inputs are 45 pairs),
// the AVX2 product takes a pair per step instead (`pair_tile_avx2`): one 32-byte load holds
// blocks b and b + 1 (16 bytes each, as held), one mask and one shift-and-mask give all 64
// codes as bytes, two 256-bit table lookups their doubled values (block b's in the low
// 128-bit lane, b + 1's in the high one), and shifts sign-extend them to four int16 vectors;
// the activations are reordered to match once per call (`reorder_pairs_by_four`). The four
// multiply-adds leave block b's sums in int32 lanes 0-3 and b + 1's in lanes 4-7, so one
// conversion and one multiply-add by [scale b x 4, scale b + 1 x 4] finish the pair. About
// 21 instructions per 64 weights and output row at one activation row, against about 40 for
// the block tile, whose one-row product was bound by instructions, not by memory: 1.6-2.1x
// less CPU time per weight at 1-8 activation rows (figures:
// docs/benchmarks/2026-12-06-mxfp4-pairs.md). The integer sums are the block tile's; the
// float32 sums are added in another order. Each activation row's result is the same
// whatever rows share the call (per-row accumulators, the same operations per row).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "block_rows.h"
#include "int8_tile.h"

namespace {

using namespace exo_native::block_rows;
namespace int8_tile = exo_native::int8_tile;

constexpr int64_t kBlockBytes = kBlock / 2;
// Twice each E2M1 value, by 4-bit code (sign bit 3, then exponent and mantissa).
constexpr int8_t kDoubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The weight of a doubled value of a block with scale byte s: 2 ** (s - 127) / 2, by byte
// (a table: one libm call per block would cost more than the block's products).
struct DoubledScales {
  float by_byte[256];
  DoubledScales() {
    for (int s = 0; s < 256; ++s) by_byte[s] = std::ldexp(1.0f, s - 128);
  }
};
const DoubledScales kScales;

inline float doubled_scale(uint8_t s) { return kScales.by_byte[s]; }

#ifdef EXO_AVX2
// A block's 16 bytes as its 32 doubled values (int8), in input order.
inline __m256i block_values(const uint8_t* bytes, __m128i table, __m128i nibble) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i low = _mm_shuffle_epi8(table, _mm_and_si128(packed, nibble));
  const __m128i high = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
  // Input 2j is byte j's low nibble, 2j + 1 its high one.
  return _mm256_set_m128i(_mm_unpackhi_epi8(low, high), _mm_unpacklo_epi8(low, high));
}

// 8 scale bytes s as `doubled_scale` gives them, 2 ** (s - 128), by their float32 bits:
// (s - 1) << 23 where that is a normal number (s >= 2; s = 255, e8m0's NaN, gives 2 ** 127
// as the table does), else the subnormals 2 ** -128 (s = 0, bit 21) and 2 ** -127 (s = 1,
// bit 22), in place of a table lookup per byte.
inline __m256 doubled_scales(const uint8_t* bytes) {
  const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(s, one), 23);
  const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(1 << 21), s);
  return _mm256_castsi256_ps(
      _mm256_blendv_epi8(subnormal, normal, _mm256_cmpgt_epi32(s, one)));
}

// Each pair of blocks of rounded activations (64 int16 values, blocks A and B) reordered to
// the order in which `pair_tile_avx2` multiplies the pair's weights: four vectors of 16,
// the i-th holding A's inputs 4m + o_i (m = 0..7) then B's, for o = 0, 2, 1, 3 (the even
// bytes of the low-nibble values, their odd bytes, then the same of the high nibbles).
inline void reorder_pairs_by_four(int16_t* values, int64_t count) {
  constexpr int kOffsets[4] = {0, 2, 1, 3};
  int16_t pair[2 * kBlock];
  for (int64_t start = 0; start + 2 * kBlock <= count; start += 2 * kBlock) {
    for (int v = 0; v < 4; ++v)
      for (int half = 0; half < 2; ++half)
        for (int m = 0; m < 8; ++m)
          pair[v * 16 + half * 8 + m] = values[start + half * kBlock + 4 * m + kOffsets[v]];
    std::memcpy(values + start, pair, sizeof(pair));
  }
}

// NR output rows from n for ROWS activation rows over whole pairs of blocks (k % 64 == 0),
// activations reordered by `reorder_pairs_by_four`, `pair_x_scales` [ROWS, k / 64, 8] each
// pair's activation scales as [A x 4, B x 4]; `weight_scales` holds NR x (k / 64) x 8
// floats: the weight's scales in the same lanes (for one activation row already times the
// activation scales: the product the loop would form, the same float32 value).
// Never inlined, as int8_tile.h's tiles (GCC 12 spilled the accumulators when inlined).
template <int ROWS, int NR>
[[gnu::noinline]] void pair_tile_avx2(const int16_t* xq, const float* pair_x_scales, int64_t k,
                                      const uint8_t* blocks, const uint8_t* scale_bytes,
                                      float* y, int64_t n_total, int64_t n,
                                      float* weight_scales) {
  const int64_t groups = k / kBlock, pairs = groups / 2;
  // Each pair's [A x 4, B x 4] from 8 scale bytes (4 pairs) at a time by `doubled_scales`.
  const __m256i spread[4] = {_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
                             _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                             _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5),
                             _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7)};
  const auto store = [&](float* out, int64_t p, __m256 lanes) {
    _mm256_storeu_ps(out, ROWS == 1 ? _mm256_mul_ps(_mm256_loadu_ps(pair_x_scales + p * 8), lanes)
                                    : lanes);
  };
  for (int i = 0; i < NR; ++i) {
    const uint8_t* bytes = scale_bytes + (n + i) * groups;
    float* out = weight_scales + i * pairs * 8;
    int64_t p = 0;
    for (; p + 4 <= pairs; p += 4) {
      const __m256 eight = doubled_scales(bytes + 2 * p);
      for (int j = 0; j < 4; ++j)
        store(out + (p + j) * 8, p + j, _mm256_permutevar8x32_ps(eight, spread[j]));
    }
    for (; p < pairs; ++p)
      store(out + p * 8, p,
            _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(doubled_scale(bytes[2 * p]))),
                                 _mm_set1_ps(doubled_scale(bytes[2 * p + 1])), 1));
  }
  const __m256i table =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kDoubled)));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[NR][ROWS];
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    for (int i = 0; i < NR; ++i) {
      const uint8_t* pair = blocks + ((n + i) * groups + 2 * p) * kBlockBytes;
      prefetch_ahead(pair);
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
      const __m256i low = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, nibble));
      const __m256i high =
          _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble));
      const __m256i v0 = _mm256_srai_epi16(_mm256_slli_epi16(low, 8), 8);  // inputs 4m
      const __m256i v1 = _mm256_srai_epi16(low, 8);                        // 4m + 2
      const __m256i v2 = _mm256_srai_epi16(_mm256_slli_epi16(high, 8), 8); // 4m + 1
      const __m256i v3 = _mm256_srai_epi16(high, 8);                       // 4m + 3
      const __m256 weight_scale = _mm256_loadu_ps(weight_scales + (i * pairs + p) * 8);
      for (int r = 0; r < ROWS; ++r) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xq + r * k + p * 2 * kBlock);
        const __m256i sums = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(v0, _mm256_loadu_si256(xv)),
                             _mm256_madd_epi16(v1, _mm256_loadu_si256(xv + 1))),
            _mm256_add_epi32(_mm256_madd_epi16(v2, _mm256_loadu_si256(xv + 2)),
                             _mm256_madd_epi16(v3, _mm256_loadu_si256(xv + 3))));
        const __m256 scale =
            ROWS == 1 ? weight_scale
                      : _mm256_mul_ps(_mm256_loadu_ps(pair_x_scales + (r * pairs + p) * 8),
                                      weight_scale);
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[i][r]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < ROWS; ++r)
      y[r * n_total + n + i] = horizontal_sum(acc[i][r]);
}

// Output rows [n0, n1) for ROWS activation rows by `pair_tile_avx2`: tiles of
// `int8_tile_rows<ROWS>()` output rows, then one at a time.
template <int ROWS>
void pair_rows_avx2(const int16_t* xq, const float* pair_x_scales, int64_t k,
                    const uint8_t* blocks, const uint8_t* scale_bytes, float* y, int64_t n_total,
                    int64_t n0, int64_t n1) {
  constexpr int kTile = int8_tile_rows<ROWS>();
  std::vector<float> weight_scales(static_cast<size_t>(kTile * (k / kBlock / 2) * 8));
  for_output_tiles<kTile>(n0, n1, [&](auto nr, int64_t n) {
    pair_tile_avx2<ROWS, decltype(nr)::value>(xq, pair_x_scales, k, blocks, scale_bytes, y,
                                              n_total, n, weight_scales.data());
  });
}

// MXFP4 blocks [n, k / 32, 16] and scale bytes [n, k / 32] as int8_tile.h's policy: the
// doubled values by `block_values`, the scales by `doubled_scale`, no zero term.
struct Mxfp4Blocks {
  static constexpr bool kZeroTerm = false;
  const uint8_t* blocks;
  const uint8_t* scale_bytes;
  __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kDoubled));
  __m128i nibble = _mm_set1_epi8(0x0F);

  const uint8_t* block(int64_t row, int64_t b, int64_t k) const {
    return blocks + (row * (k / kBlock) + b) * kBlockBytes;
  }
  __m256i values(const uint8_t* block) const { return block_values(block, table, nibble); }
  template <int ROWS, int NR>
  void unpack(int64_t n, int64_t k, float* scales, float (&)[NR][ROWS]) const {
    const int64_t groups = k / kBlock;
    for (int i = 0; i < NR; ++i)
      for (int64_t g = 0; g < groups; ++g)
        scales[i * groups + g] = doubled_scale(scale_bytes[(n + i) * groups + g]);
  }
};
#endif

}  // namespace

namespace exo_native {

// y[rows, n] = x[rows, k] W^T for W held as MXFP4 (blocks [n, k / 32, 16], scales [n, k / 32]).
void mxfp4_product(const float* xp, int64_t rows, int64_t k, const uint8_t* blocks,
                   const uint8_t* scale_bytes, int64_t n, float* yp) {
  using namespace block_rows;
  if (rows == 0 || n == 0) return;
  const int64_t groups = k / kBlock;
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 16) / std::max<int64_t>(k, 1));
#ifdef EXO_AVX2
  thread_local AlignedBuffer<int16_t> quantized;
  thread_local std::vector<float> x_scales, block_sums;
  quantized.resize(static_cast<size_t>(rows * k));
  x_scales.resize(static_cast<size_t>(rows * groups));
  block_sums.resize(static_cast<size_t>(rows * groups));  // unused: no zero term
  int16_t* xq = quantized.data();
  float* xs = x_scales.data();
  quantize_rows(xp, rows, k, kBlock, xq, xs, block_sums.data());
  if (k % (2 * kBlock) == 0) {  // whole pairs of blocks: the pair tile
    const int64_t pairs = groups / 2;
    thread_local std::vector<float> pair_scales;
    pair_scales.resize(static_cast<size_t>(rows * pairs * 8));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t p = 0; p < pairs; ++p)
        for (int lane = 0; lane < 8; ++lane)
          pair_scales[(r * pairs + p) * 8 + lane] = xs[r * groups + 2 * p + lane / 4];
    reorder_pairs_by_four(xq, rows * k);
    const float* ps = pair_scales.data();
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      for_weight_spans(rows, 4, n0, n1, k * 17 / 32, [&](int64_t s0, int64_t s1) {
        for_row_groups(rows, [&](auto count, int64_t r) {
          pair_rows_avx2<decltype(count)::value>(xq + r * k, ps + r * pairs * 8, k, blocks,
                                                 scale_bytes, yp + r * n, n, s0, s1);
        });
      });
    });
    return;
  }
  reorder_even_odd(xq, rows * k);
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for_weight_spans(rows, 4, n0, n1, k * 17 / 32, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        int8_tile::rows_avx2<decltype(count)::value, 1>(
            xq + r * k, xs + r * groups, k, Mxfp4Blocks{blocks, scale_bytes}, yp + r * n, n,
            s0, s1);
      });
    });
  });
#else  // exact float32 sums of the widened values
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t o = n0; o < n1; ++o)
      for (int64_t r = 0; r < rows; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < groups; ++b) {
          const uint8_t* block = blocks + (o * groups + b) * kBlockBytes;
          const float* x = xp + r * k + b * kBlock;
          float dot = 0.0f;
          for (int64_t j = 0; j < kBlockBytes; ++j) {
            dot += static_cast<float>(kDoubled[block[j] & 0x0F]) * x[2 * j];
            dot += static_cast<float>(kDoubled[block[j] >> 4]) * x[2 * j + 1];
          }
          total += doubled_scale(scale_bytes[o * groups + b]) * dot;
        }
        yp[r * n + o] = total;
      }
  });
#endif
}

// The doubled values as int8 [n, k] and the scales as bfloat16 2 ** (s - 128) [n, k / 32]
// (powers of two down to 2 ** -128, a bfloat16 subnormal: exact), the weight bit for bit.
std::pair<at::Tensor, at::Tensor> mxfp4_int8_blocks(const at::Tensor& blocks,
                                                    const at::Tensor& scales) {
  using block_rows::kBlock;
  const int64_t n = blocks.size(0), groups = blocks.size(1);
  at::Tensor values = at::empty({n, groups * kBlock}, blocks.options().dtype(at::kChar));
  at::Tensor block_scales = at::empty({n, groups}, blocks.options().dtype(at::kBFloat16));
  const uint8_t* bytes = blocks.data_ptr<uint8_t>();
  const uint8_t* scale_bytes = scales.data_ptr<uint8_t>();
  int8_t* value = values.data_ptr<int8_t>();
  uint16_t* scale_bits = reinterpret_cast<uint16_t*>(block_scales.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(groups, 1));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
#ifdef EXO_AVX2  // a block's 32 values by two byte shuffles (a byte loop took 2x torch's gather)
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kDoubled));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (int64_t b = n0 * groups; b < n1 * groups; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(value + b * kBlock),
                          block_values(bytes + b * kBlockBytes, table, nibble));
#else
    for (int64_t i = n0 * groups * kBlockBytes; i < n1 * groups * kBlockBytes; ++i) {
      value[2 * i] = kDoubled[bytes[i] & 0x0F];
      value[2 * i + 1] = kDoubled[bytes[i] >> 4];
    }
#endif
    for (int64_t i = n0 * groups; i < n1 * groups; ++i) {
      const float scale = doubled_scale(scale_bytes[i]);
      uint32_t bits;
      std::memcpy(&bits, &scale, sizeof(bits));
      scale_bits[i] = static_cast<uint16_t>(bits >> 16);  // the low half is zero
    }
  });
  return {values, block_scales};
}

}  // namespace exo_native

namespace {

void check_mxfp4(const at::Tensor& blocks, const at::Tensor& scales, const char* op) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == kBlockBytes &&
                  blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              op, ": blocks must be a contiguous uint8 [out, in / 32, 16] tensor");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == blocks.size(0) &&
                  scales.size(1) == blocks.size(1) && scales.scalar_type() == at::kByte &&
                  scales.is_contiguous(),
              op, ": scales must be a contiguous uint8 [out, in / 32] tensor");
}

std::tuple<at::Tensor, at::Tensor> mxfp4_int8_blocks_op(const at::Tensor& blocks,
                                                        const at::Tensor& scales) {
  check_mxfp4(blocks, scales, "mxfp4_int8_blocks");
  auto [values, block_scales] = exo_native::mxfp4_int8_blocks(blocks, scales);
  return {values, block_scales};
}

at::Tensor mxfp4_gemv(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "mxfp4_gemv: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == kBlockBytes &&
                  blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "mxfp4_gemv: blocks must be a contiguous uint8 [out, in / 32, 16] tensor");
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(blocks.size(1) * kBlock == k, "mxfp4_gemv: x has ", k, " inputs, blocks ",
              blocks.size(1) * kBlock);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == k / kBlock &&
                  scales.scalar_type() == at::kByte && scales.is_contiguous(),
              "mxfp4_gemv: scales must be a contiguous uint8 [out, in / 32] tensor");
  at::Tensor y = at::empty({rows, n}, x.options());
  exo_native::mxfp4_product(x.data_ptr<float>(), rows, k, blocks.data_ptr<uint8_t>(),
                scales.data_ptr<uint8_t>(), n, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def("mxfp4_gemv(Tensor x, Tensor blocks, Tensor scales) -> Tensor");
  m.def("mxfp4_int8_blocks(Tensor blocks, Tensor scales) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) {
  m.impl("mxfp4_gemv", &mxfp4_gemv);
  m.impl("mxfp4_int8_blocks", &mxfp4_int8_blocks_op);
}
