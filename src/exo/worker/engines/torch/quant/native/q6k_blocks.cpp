// exo's decode product for weights held as GGUF Q6_K blocks, byte for byte as the file
// stores them (Q6KLinear, ../q6k_blocks.py: a Q4_K_M GGUF's LM head):
//   q6k_gemv(x [rows, in] float32, blocks [out, in / 256 * 210] uint8) -> [rows, out] float32.
//
// A Q6_K block (ggml's `block_q6_K`, 256 weights, 210 bytes) holds ql[128] (the values' low
// nibbles), qh[64] (their high bit pairs), sc[16] (int8, one per 16 weights) and an fp16 d:
// w[16 s + i] = d * sc[s] * (q[16 s + i] - 32), q in [0, 63]. Within each half of 128
// weights (ql + 64 h, qh + 32 h), weight l (0-31) takes ql[l]'s low nibble and qh[l]'s bits
// 0-1, weight 32 + l ql[32 + l]'s low nibble and qh[l]'s bits 2-3, weight 64 + l ql[l]'s
// high nibble and bits 4-5, weight 96 + l ql[32 + l]'s high nibble and bits 6-7 (ggml's
// dequantize_row_q6_K).
//
// Activations are rounded per block of 256 to int8 (scale: the block's largest |x| / 127,
// round to nearest; llama.cpp rounds them the same way for its Q6_K product, its Q8_K
// blocks). For each weight block b and activation row r the sum
//   S = sum_s sc[s] * (sum_i q[16 s + i] * xq[16 s + i] - 32 * sum_i xq[16 s + i])
// is exact in int32, and y[r, o] = sum_b d[o, b] * dx[r, b] * S in float32. The 32 offset
// goes through each sub-block's activation sum (computed once per call), so the values are
// used unsigned as they unpack.
//
// The 512-bit path (AVX512BW + VNNI, unless EXO_NATIVE_AVX512=0): a half-block's ql (64
// bytes) and qh (32 bytes, in both 256-bit halves) unpack to two 64-byte vectors of values
// with a mask, a shift, a variable 16-bit shift and a ternary-logic merge each; per 64
// values and activation row one vpmaddubsw (u8 x s8 pair sums to int16) and one vpdpwssd
// (times the sub-blocks' scales, widened to int16 and spread by one vpermw per 64 values,
// into int32); per block and row one vpdpwssd for the offset term, one conversion and one
// FMA. Up to 8 activation rows share each weight read. The 256-bit path (AVX2) does the
// same 32 values at a time with vpmaddwd + add. Without AVX2 a portable loop computes the
// same integers. All paths give each block's S exactly; they differ only in the order in
// which the float32 terms are added.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_rows.h"

#if defined(EXO_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
#define EXO_Q6K_AVX512 1
#endif

namespace {

using namespace exo_native::block_rows;

constexpr int64_t kSuper = 256;       // weights per Q6_K block
constexpr int64_t kBlockBytes = 210;  // bytes per Q6_K block
constexpr int64_t kSubBlocks = 16;    // scales per block

inline float fp16_at(const uint8_t* bytes) {
  uint16_t bits;
  std::memcpy(&bits, bytes, sizeof(bits));
#ifdef EXO_AVX2
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Activation rows [rows, k] rounded per block of 256: xq int8 [rows, k], dx float
// [rows, k / 256] (the block's scale), neg_sums int16 [rows, k / 16] (minus each
// sub-block's sum of xq: the offset term's factor).
void quantize_activations(const float* x, int64_t rows, int64_t k, int8_t* xq, float* dx,
                          int16_t* neg_sums) {
  const int64_t blocks = k / kSuper;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* in = x + r * k + b * kSuper;
      float largest = 0.0f;
      for (int64_t i = 0; i < kSuper; ++i) largest = std::max(largest, std::fabs(in[i]));
      const float scale = largest / 127.0f;
      const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
      dx[r * blocks + b] = scale;
      int8_t* out = xq + r * k + b * kSuper;
      for (int64_t s = 0; s < kSubBlocks; ++s) {
        int sum = 0;
        for (int64_t i = 0; i < 16; ++i) {
          const float rounded = std::nearbyint(in[s * 16 + i] * inverse);
          const int value = static_cast<int>(std::clamp(rounded, -127.0f, 127.0f));
          out[s * 16 + i] = static_cast<int8_t>(value);
          sum += value;
        }
        neg_sums[r * k / 16 + b * kSubBlocks + s] = static_cast<int16_t>(-sum);
      }
    }
}

// The block's integer sum S (see the top) for one activation row: the reference the vector
// paths equal, and the portable path.
int32_t block_sum_portable(const uint8_t* block, const int8_t* xq, const int16_t* neg_sums) {
  const uint8_t* ql = block;
  const uint8_t* qh = block + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
  int32_t products[kSubBlocks] = {};
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const int base = 128 * h;
      const uint8_t low = ql[64 * h + l], high = ql[64 * h + 32 + l], bits = qh[32 * h + l];
      const int q[4] = {(low & 0xF) | ((bits & 3) << 4), (high & 0xF) | (((bits >> 2) & 3) << 4),
                        (low >> 4) | (((bits >> 4) & 3) << 4), (high >> 4) | (((bits >> 6) & 3) << 4)};
      for (int j = 0; j < 4; ++j) {
        const int index = base + 32 * j + l;
        products[index / 16] += q[j] * xq[index];
      }
    }
  int32_t total = 0;
  for (int s = 0; s < kSubBlocks; ++s) total += sc[s] * (products[s] + 32 * neg_sums[s]);
  return total;
}

#ifdef EXO_Q6K_AVX512
// int16 lane j of the pair sums of 64 values c (0-3) belongs to sub-block 4 c + j / 8: the
// vpermw indices that spread the block's 16 scales over those lanes.
struct SpreadIndex {
  alignas(64) int16_t index[4][32];
  constexpr SpreadIndex() : index() {
    for (int c = 0; c < 4; ++c)
      for (int j = 0; j < 32; ++j) index[c][j] = static_cast<int16_t>(4 * c + j / 8);
  }
};
constexpr SpreadIndex kSpread{};

// One output row (its `blocks` Q6_K blocks) against ROWS activation rows.
template <int ROWS>
void row_avx512(const uint8_t* weight, int64_t blocks, const int8_t* xq, const float* dx,
                const int16_t* neg_sums, int64_t k, float* y, int64_t n_total) {
  const __m512i low_mask = _mm512_set1_epi8(0x0F);
  const __m512i high_mask = _mm512_set1_epi8(0x30);
  // 16-bit lanes 0-15 (the first 32 bytes) shift by the first count, 16-31 by the second.
  const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i right = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
  __m512i spread[4];
  for (int c = 0; c < 4; ++c) spread[c] = _mm512_load_si512(kSpread.index[c]);
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = weight + b * kBlockBytes;
    prefetch_ahead(block);
    __m512i q[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(block + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h)));
      q[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(ql, low_mask),
                                           _mm512_sllv_epi16(qh, left), high_mask, 0xF8);
      q[2 * h + 1] =
          _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low_mask),
                                    _mm512_srlv_epi16(qh, right), high_mask, 0xF8);
    }
    const __m256i sc16 = _mm256_cvtepi8_epi16(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
    const __m512i scales = _mm512_zextsi256_si512(sc16);
    __m512i spread_scales[4];
    for (int c = 0; c < 4; ++c) spread_scales[c] = _mm512_permutexvar_epi16(spread[c], scales);
    const __m512i offset_scales = _mm512_slli_epi16(scales, 5);  // 32 sc, upper lanes 0
    const __m512 d = _mm512_set1_ps(fp16_at(block + 208));
    for (int r = 0; r < ROWS; ++r) {
      const int8_t* xb = xq + r * k + b * kSuper;
      __m512i sum = _mm512_dpwssd_epi32(
          _mm512_setzero_si512(), offset_scales,
          _mm512_zextsi256_si512(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(neg_sums + r * (k / 16) + b * kSubBlocks))));
      for (int c = 0; c < 4; ++c)
        sum = _mm512_dpwssd_epi32(
            sum, _mm512_maddubs_epi16(q[c], _mm512_loadu_si512(xb + 64 * c)), spread_scales[c]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                               _mm512_mul_ps(d, _mm512_set1_ps(dx[r * (k / kSuper) + b])), acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) y[r * n_total] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#ifdef EXO_AVX2
// The same on 256 bits: 32 values at a time, up to 4 activation rows per weight read.
template <int ROWS>
void row_avx2(const uint8_t* weight, int64_t blocks, const int8_t* xq, const float* dx,
              const int16_t* neg_sums, int64_t k, float* y, int64_t n_total) {
  const __m256i low_mask = _mm256_set1_epi8(0x0F);
  const __m256i high_mask = _mm256_set1_epi8(0x30);
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = weight + b * kBlockBytes;
    prefetch_ahead(block);
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m256 d = _mm256_set1_ps(fp16_at(block + 208));
    __m256i sums[ROWS];
    const __m256i offset_scales = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc8), 5);
    for (int r = 0; r < ROWS; ++r)
      sums[r] = _mm256_madd_epi16(
          offset_scales, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                             neg_sums + r * (k / 16) + b * kSubBlocks)));
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = block + 64 * h;
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
      const __m256i qh =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, low_mask),
                          _mm256_and_si256(_mm256_slli_epi16(qh, 4), high_mask)),
          _mm256_or_si256(_mm256_and_si256(ql1, low_mask),
                          _mm256_and_si256(_mm256_slli_epi16(qh, 2), high_mask)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low_mask),
                          _mm256_and_si256(qh, high_mask)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low_mask),
                          _mm256_and_si256(_mm256_srli_epi16(qh, 2), high_mask)),
      };
      for (int c = 0; c < 4; ++c) {
        // 32 values: sub-blocks 8 h + 2 c and 8 h + 2 c + 1, each scale over 8 int16 lanes.
        const int first = 8 * h + 2 * c;
        const __m256i scale = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
            sc8, _mm_set_epi64x(0x0101010101010101LL * (first + 1),
                                0x0101010101010101LL * first)));
        for (int r = 0; r < ROWS; ++r) {
          const __m256i x = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq + r * k + b * kSuper + 128 * h + 32 * c));
          sums[r] = _mm256_add_epi32(sums[r],
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(q[c], x), scale));
        }
      }
    }
    for (int r = 0; r < ROWS; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]),
                               _mm256_mul_ps(d, _mm256_set1_ps(dx[r * (k / kSuper) + b])), acc[r]);
  }
  for (int r = 0; r < ROWS; ++r) y[r * n_total] = horizontal_sum(acc[r]);
}
#endif

}  // namespace

namespace exo_native {

// y [rows, n] = x [rows, k] times the Q6_K weight [n, k / 256 * 210] (see the top).
void q6k_product(const float* xp, int64_t rows, int64_t k, const uint8_t* weight, int64_t n,
                 float* yp) {
  if (rows == 0 || n == 0) return;
  const int64_t blocks = k / kSuper;
  const int64_t row_bytes = blocks * kBlockBytes;
  thread_local AlignedBuffer<int8_t> rounded;
  thread_local std::vector<float> scales;
  thread_local AlignedBuffer<int16_t> neg_sums;
  rounded.resize(static_cast<size_t>(rows * k));
  scales.resize(static_cast<size_t>(rows * blocks));
  neg_sums.resize(static_cast<size_t>(rows * k / 16));
  quantize_activations(xp, rows, k, rounded.data(), scales.data(), neg_sums.data());
  const int8_t* xq = rounded.data();
  const float* dx = scales.data();
  const int16_t* ns = neg_sums.data();
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 17) / std::max<int64_t>(k, 1));
#ifdef EXO_Q6K_AVX512
  if (int4_decode_bits() == 512) {
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      for_weight_spans(rows, 8, n0, n1, row_bytes, [&](int64_t s0, int64_t s1) {
        for_row_groups_of_8(rows, [&](auto count, int64_t r) {
          constexpr int kRows = decltype(count)::value;
          for (int64_t o = s0; o < s1; ++o)
            row_avx512<kRows>(weight + o * row_bytes, blocks, xq + r * k, dx + r * blocks,
                              ns + r * (k / 16), k, yp + r * n + o, n);
        });
      });
    });
    return;
  }
#endif
#ifdef EXO_AVX2
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for_weight_spans(rows, 4, n0, n1, row_bytes, [&](int64_t s0, int64_t s1) {
      for_row_groups(rows, [&](auto count, int64_t r) {
        constexpr int kRows = decltype(count)::value;
        for (int64_t o = s0; o < s1; ++o)
          row_avx2<kRows>(weight + o * row_bytes, blocks, xq + r * k, dx + r * blocks,
                          ns + r * (k / 16), k, yp + r * n + o, n);
      });
    });
  });
#else
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t o = n0; o < n1; ++o)
      for (int64_t r = 0; r < rows; ++r) {
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* block = weight + o * row_bytes + b * kBlockBytes;
          const int32_t sum = block_sum_portable(block, xq + r * k + b * kSuper,
                                                 ns + r * (k / 16) + b * kSubBlocks);
          total += static_cast<float>(sum) * (fp16_at(block + 208) * dx[r * blocks + b]);
        }
        yp[r * n + o] = total;
      }
  });
#endif
}

}  // namespace exo_native

namespace {

at::Tensor q6k_gemv(const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "q6k_gemv: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "q6k_gemv: blocks must be a contiguous uint8 [out, in / 256 * 210] tensor");
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0);
  TORCH_CHECK(k % kSuper == 0 && blocks.size(1) == k / kSuper * kBlockBytes, "q6k_gemv: x has ",
              k, " inputs (a multiple of 256 is needed), the blocks ", blocks.size(1),
              " bytes a row (", k / kSuper * kBlockBytes, " expected)");
  at::Tensor y = at::empty({rows, n}, x.options());
  exo_native::q6k_product(x.data_ptr<float>(), rows, k, blocks.data_ptr<uint8_t>(), n,
                          y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) { m.def("q6k_gemv(Tensor x, Tensor blocks) -> Tensor"); }

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("q6k_gemv", &q6k_gemv); }
