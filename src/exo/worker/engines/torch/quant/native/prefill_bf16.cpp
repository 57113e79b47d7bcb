// Prefill's product on CPUs with AMX-BF16 (Intel Sapphire Rapids and later), behind
// `--prefill-activations bf16` (the default there): the weight dequantized to bfloat16 one
// slab of output rows at a time, laid out for the tile unit, times the activations rounded
// to bfloat16, by oneDNN's batch-reduce GEMM micro-kernel (torch's
// `at::native::cpublas::brgemm`, float32 sums).
//
// Why not the integer GEMM (prefill.cpp) there: its sums are exact per block of 32 inputs,
// so every block's int32 sums leave the multiplier to be scaled in float32. AMX-INT8 tiles
// were tried that way and ran about as fast as the 512-bit vpdpwssd tiles (prefill.cpp's
// notes). Dequantizing folds the scales into the weight, so the tiles sum a whole row of
// inputs without leaving the multiplier: a layer's products and the TTFT are markedly
// faster from 128 rows on, the same at 32 (measured with `bench/bench_prefill_paths.py`;
// figures: docs/benchmarks/engine-design-figures.md#prefill_bf16cpp).
//
// What it costs in accuracy: the activations are rounded to bfloat16 (8 significant bits)
// where the integer GEMM rounds them to int16 per block of 32, and each dequantized weight
// (q * scale + offset in float32) is rounded to bfloat16 once (relative error up to 2^-9,
// against int4's own step of 1/15 of a group's range); the products of two bfloat16 are
// exact in float32 and summed in float32. That error lies between int16's and int8's, in
// the product (`bench/bench_prefill_paths.py`) and in the next-token distributions
// (`bench/bench_prefill_rounding.py`, prompt chunks attending in bfloat16 too), well under
// a tenth of int8's KL. Keeping what the rounding leaves as a second bfloat16 term was tried
// (weights split, or weights and activations split): more exact, but slower than int16
// (figures: docs/benchmarks/engine-design-figures.md#prefill_bf16cpp). A
// token's product therefore differs (by rounding) from the decode kernels' exact integer
// sums, which steps of at most `NATIVE_BLOCK_MAX_ROWS` rows take, and a step's decode rows
// keep int16 (prefill.cpp's `block_matmul`). A step with decode rows and fewer than
// `kBf16MinRows` prompt rows takes int16 for all (prefill_pack.h), so a prompt chunk joining
// beside other requests' decodes (8 tokens) is rounded to int16, one prefilled alone to
// bfloat16. Within bf16 calls a row's result does not depend on the rows beside it (tested).
//
// Layout (oneDNN's "VNNI" form for bfloat16 B matrices): for a slab of kSlab outputs, input
// pair p and output i, the two bfloat16 weights of inputs 2p and 2p + 1 as one 32-bit word
// at packed[p * kSlab + i]. One output row's block of 32 dequantized and converted is 16
// such words; 8 rows' are transposed 8 x 8 (prefill_pack.h's `transpose8`) into place.

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "prefill_pack.h"

#if defined(EXO_AVX2) && defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(EXO_AMX_BF16)
#define EXO_BF16_TILES 1
#endif

namespace exo_native::prefill {

#ifdef EXO_BF16_TILES
namespace {

using block_rows::kBlock;

// Outputs per slab: 64 (four of the tile unit's 16 columns); its packed weight for k inputs
// is k * 128 bytes (80 KiB at k = 640, 256 KiB at 2048: L2-resident on these CPUs).
constexpr int64_t kSlab = 64;
// Activation rows per micro-kernel call (the kernel walks them 16 at a time).
constexpr int64_t kRowBlock = 64;

// 16 float32 (two vectors of 8) as 8 words of two bfloat16 each (round to nearest even).
inline __m256i to_bf16_pairs(__m256 low, __m256 high) {
  return reinterpret_cast<__m256i>(_mm256_cvtne2ps_pbh(high, low));
}

// int16 values (16 lanes) times a scale plus an offset, as 8 words of bfloat16 pairs.
inline __m256i dequantized_pairs(__m256i values, __m256 scale, __m256 offset) {
  const __m256 first = _mm256_fmadd_ps(
      _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(values))), scale, offset);
  const __m256 second = _mm256_fmadd_ps(
      _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(values, 1))), scale,
      offset);
  return to_bf16_pairs(first, second);
}

// Outputs [n0, n0 + count) of the weight dequantized into `packed` ([k / 2][kSlab] words;
// outputs past `count` are zero): w = v * scale + offset per group, as
// prefill_dequantized.cpp's `dequantize_row` computes it in float32, then rounded.
void pack_slab_bf16(const uint8_t* bytes, int64_t row_bytes, Held held, bool symmetric,
                    const uint16_t* scale_zero, int64_t pairs_per_row, int64_t group_size,
                    int64_t k, int64_t n0, int64_t count, int32_t* packed) {
  const int64_t blocks = k / kBlock;
  for (int64_t eighth = 0; eighth < kSlab / 8; ++eighth) {
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i halves[2][8];  // per output row: input pairs 0-7, 8-15 of the block
      for (int i = 0; i < 8; ++i) {
        const int64_t row = 8 * eighth + i;
        if (row >= count) {
          halves[0][i] = halves[1][i] = _mm256_setzero_si256();
          continue;
        }
        const uint16_t* pairs = scale_zero + (n0 + row) * pairs_per_row;
        __m256i values[2];
        block_values(bytes + (n0 + row) * row_bytes, held, b, blocks, values);
        for (int half = 0; half < 2; ++half) {
          const int64_t group = (b * kBlock + half * 16) / group_size;
          float scale, offset = 0.0f;
          if (symmetric) {  // 5-bit lanes, symmetric int8 blocks: w = v * scale
            scale = bf16_to_float(pairs[group]);
          } else {  // (scale, zero) pairs: w = v * scale + (zero - 8 scale)
            scale = bf16_to_float(pairs[2 * group]);
            offset = bf16_to_float(pairs[2 * group + 1]) - 8.0f * scale;
          }
          halves[half][i] =
              dequantized_pairs(values[half], _mm256_set1_ps(scale), _mm256_set1_ps(offset));
        }
      }
      __m256i out[8];
      int32_t* base = packed + b * 16 * kSlab + 8 * eighth;
      for (int half = 0; half < 2; ++half) {
        transpose8(halves[half], out);
        for (int j = 0; j < 8; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + (8 * half + j) * kSlab), out[j]);
      }
    }
  }
}

// float32 rows [rows, k] as bfloat16 (round to nearest even), k a multiple of 16.
void round_rows_bf16(const float* x, int64_t rows, int64_t k, uint16_t* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / k), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < k; j += 16) {
        const __m256i pairs =
            to_bf16_pairs(_mm256_loadu_ps(x + r * k + j), _mm256_loadu_ps(x + r * k + j + 8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * k + j), pairs);
      }
  });
}

}  // namespace
#endif  // EXO_BF16_TILES

bool bf16_tiles_available() {
#ifdef EXO_BF16_TILES
  // oneDNN's micro-kernel for bfloat16 needs AMX, enabled for this process by the kernel
  // (torch asks for the tile state's permission); torch's brgemm also refuses to run while
  // `torch.backends.mkldnn` is turned off, so that is checked at every call.
  static const bool cpu = at::native::cpublas::could_pack(at::kBFloat16);
  return cpu && at::globalContext().userEnabledMkldnn();
#else
  return false;
#endif
}

void bf16_block_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* bytes, Held held,
                       bool symmetric, const uint16_t* scale_zero, int64_t groups, int64_t n,
                       float* y) {
#ifdef EXO_BF16_TILES
  TORCH_CHECK(bf16_tiles_available(), "block_matmul: no AMX-BF16 product on this CPU");
  std::vector<uint16_t> activations(static_cast<size_t>(rows * k));
  round_rows_bf16(x, rows, k, activations.data());
  const auto* a = reinterpret_cast<const at::BFloat16*>(activations.data());
  const int64_t row_bytes = row_bytes_of(held, k), group_size = k / groups;
  const int64_t pairs_per_row = groups * (symmetric ? 1 : 2);
  const int64_t slabs = (n + kSlab - 1) / kSlab;
  at::parallel_for(0, slabs, 1, [&](int64_t first, int64_t last) {
    // Each thread's buffer stays between calls (prefill.cpp: fresh pages fault in slowly).
    thread_local std::vector<int32_t> packed_buffer;
    int32_t* packed = aligned_buffer(packed_buffer, static_cast<size_t>(k / 2 * kSlab));
    const auto* b = reinterpret_cast<const at::BFloat16*>(packed);
    for (int64_t s = first; s < last; ++s) {
      const int64_t n0 = s * kSlab, count = std::min(kSlab, n - n0);
      pack_slab_bf16(bytes, row_bytes, held, symmetric, scale_zero, pairs_per_row, group_size, k,
                     n0, count, packed);
      for (int64_t r0 = 0; r0 < rows; r0 += kRowBlock) {
        const int64_t m = std::min(kRowBlock, rows - r0);
        at::native::cpublas::brgemm(m, count, k, /*ld_a=*/k, /*ld_b=*/kSlab, /*ld_c=*/n,
                                    /*add_C=*/false, a + r0 * k, b, y + r0 * n + n0);
      }
    }
    at::native::cpublas::brgemm_release();
  });
#else
  (void)x, (void)rows, (void)k, (void)bytes, (void)held, (void)symmetric, (void)scale_zero;
  (void)groups, (void)n, (void)y;
  TORCH_CHECK(false, "block_matmul: this build has no AMX-BF16 product");
#endif
}

}  // namespace exo_native::prefill
