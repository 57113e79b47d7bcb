// The prefill GEMMs' shared pieces (prefill.cpp: int16 activations; prefill_int8.cpp: int8
// activations): how a block weight's integers are held, one block of a row's integers
// unpacked to int16, an 8 x 8 transpose of int32 lanes, and the int8 GEMM's entry point.
#pragma once

#include <cstdint>

#include "block_rows.h"

namespace exo_native::prefill {

// How a block weight's integers are held: int4 pairs of blocks (int4_gemv.cpp), int8 values
// (int8_blocks.cpp), or 5-bit blocks (int5_blocks.cpp).
enum class Held { kInt4, kInt8, kInt5 };

inline int64_t row_bytes_of(Held held, int64_t k) {
  switch (held) {
    case Held::kInt4:
      return k / 2;
    case Held::kInt5:
      return exo_native::int5_row_bytes(k);
    case Held::kInt8:
      break;
  }
  return k;
}

#ifdef EXO_AVX2

// Transposes 8 vectors of 8 int32 (row i: lanes 0..7) so that out[j] holds lane j of every
// row (out[j] lane i = in[i] lane j).
inline void transpose8(__m256i in[8], __m256i out[8]) {
  __m256i a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_epi32(in[i], in[i + 1]);
    a[i + 1] = _mm256_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x20);
    out[i + 4] = _mm256_permute2x128_si256(b[i], b[i + 4], 0x31);
  }
}

// The int16 values of one block of 32 inputs of one output row as two vectors (inputs 0-15,
// 16-31). int4: pairs of blocks as 16-bit lanes of four nibbles, an odd last block in GGUF's
// byte order (int4_gemv.cpp); int8: the values in order; int5: block_rows.h.
inline void block_values(const uint8_t* row, Held held, int64_t block, int64_t blocks,
                         __m256i out[2]) {
  if (held == Held::kInt5) {
    exo_native::block_rows::int5_block_values(row, block, out);
    return;
  }
  if (held == Held::kInt8) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + block * 32));
    out[0] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes));
    out[1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1));
    return;
  }
  const __m256i nibble = _mm256_set1_epi16(0x000F);
  if (block / 2 < blocks / 2) {
    const __m256i lanes =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (block / 2) * 32));
    if (block % 2 == 0) {
      out[0] = _mm256_and_si256(lanes, nibble);
      out[1] = _mm256_and_si256(_mm256_srli_epi16(lanes, 4), nibble);
    } else {
      out[0] = _mm256_and_si256(_mm256_srli_epi16(lanes, 8), nibble);
      out[1] = _mm256_srli_epi16(lanes, 12);
    }
    return;
  }
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (blocks / 2) * 32));
  const __m128i low = _mm_set1_epi8(0x0F);
  out[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low));
  out[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), low));
}

// y[rows, n] for an int4, 5-bit or 6-bit-valued symmetric int8-block weight with the
// activations rounded to int8 per block of 32 (prefill_int8.cpp). `scale_zero`: (scale,
// zero) pairs [n, groups, 2] for int4, one scale per block [n, k / 32] for 5-bit blocks, one
// per half block [n, k / 16] for int8 (whose values must lie in [-32, 31]). False (and `y`
// not written in full) when an int8 value does not.
bool int8_activation_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* bytes,
                            Held held, const uint16_t* scale_zero, int64_t groups, int64_t n,
                            float* y);

#endif  // EXO_AVX2

}  // namespace exo_native::prefill
