// Prefill's shared pieces (prefill.cpp: the integer GEMM's driver and its int16 kernels;
// prefill_int8.cpp: its int8-activation kernels; prefill_dequantized.cpp: the float32 path):
// how a block weight's integers are held, one block of a row's integers unpacked to int16,
// an 8 x 8 transpose of int32 lanes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "block_rows.h"

namespace exo_native::prefill {

// How a block weight's integers are held: int4 pairs of blocks (int4_gemv.cpp), int8 values
// (int8_blocks.cpp), or 5-bit blocks (int5_blocks.cpp).
enum class Held { kInt4, kInt8, kInt5 };

// The first 64-byte-aligned element of `buffer` grown to hold `count` of them from there
// (a thread's buffer kept between calls). malloc aligns to 16 bytes only: the packed slab
// and the 512-bit tiles' sums sat at 48 and 16 mod 64, so every 64-byte load of them
// crossed a cache line. (Aligned, Gemma's layer shapes ran within this VM's noise of the
// unaligned figures: 95-129 against 75-119 GMAC/s in one spell, 106-186 against 123-182 in
// a quieter one.)
template <typename T>
T* aligned_buffer(std::vector<T>& buffer, size_t count) {
  constexpr size_t kAlign = 64, kSlack = kAlign / sizeof(T);
  buffer.resize(std::max(buffer.size(), count + kSlack));
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<T*>((address + kAlign - 1) & ~static_cast<uintptr_t>(kAlign - 1));
}

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

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define EXO_VNNI 1
#endif

// acc + the int32 sums of u's unsigned and x's signed bytes, four per lane (one vpdpbusd;
// only with VNNI).
#ifdef EXO_VNNI
inline __m256i add_quad_products(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, x);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#endif
}
#endif

// acc + the int32 sums of w's and x's int16 pairs (vpmaddwd then vpaddd, or one vpdpwssd
// where the library is built with AVX512-VNNI or AVX-VNNI: the same exact sums).
inline __m256i add_pair_products(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

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

// A slab's (scale, zero) pairs as the tiles take them: for outputs [n0, n0 + count) and
// each group g, scales[g * padded + i] = scale and offsets[g * padded + i] = zero - 8 scale
// (output n0 + i; 0 for i from count to padded). The float32 values of the scalar loop in
// integer_block_matmul (8 scale is exact, so no rounding differs), 16 outputs a gather with
// AVX512. The loop and its activation rounding took 6-9 % of a prompt's expert products at
// Qwen3-30B-A3B's shapes (a slab of 32 outputs of 2,048 inputs has 2,048 pairs); the gather
// alone did not shorten that (the pairs came from memory), so the next slab's pairs
// (`next_count` outputs from n0 + count) are prefetched towards L2 here too
// (figures: docs/benchmarks/2026-12-07-moe-prefill-experts.md).
inline void pair_scales(const uint16_t* scale_zero, int64_t groups, int64_t n0, int64_t count,
                 int64_t padded, float* scales, float* offsets, int64_t next_count = 0) {
  const auto* next_pairs = reinterpret_cast<const char*>(scale_zero + (n0 + count) * groups * 2);
  const int64_t next_lines = (next_count * groups * 4 + 63) / 64;
  for (int64_t line = 0; line < next_lines; ++line)
    _mm_prefetch(next_pairs + 64 * line, _MM_HINT_T1);
#if defined(__AVX512F__)
  // Lane j reads output n0 + i + j's pair of group g: 32-bit units groups apart.
  const __m512i stride = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int32_t>(groups)));
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 eight = _mm512_set1_ps(8.0f);
  for (int64_t i = 0; i < padded; i += 16) {
    const int64_t valid = std::clamp<int64_t>(count - i, 0, 16);
    const __mmask16 mask = valid == 16 ? static_cast<__mmask16>(0xFFFF)
                                       : static_cast<__mmask16>((1u << valid) - 1);
    const auto* pairs = reinterpret_cast<const int32_t*>(scale_zero) + (n0 + i) * groups;
    for (int64_t g = 0; g < groups; ++g) {
      const __m512i pair =
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, stride, pairs + g, 4);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pair, high));
      _mm512_storeu_ps(scales + g * padded + i, scale);
      _mm512_storeu_ps(offsets + g * padded + i, _mm512_sub_ps(zero, _mm512_mul_ps(eight, scale)));
    }
  }
#else
  for (int64_t i = 0; i < padded; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      float scale = 0.0f, offset = 0.0f;
      if (i < count) {
        scale = bf16_to_float(scale_zero[((n0 + i) * groups + g) * 2]);
        offset = bf16_to_float(scale_zero[((n0 + i) * groups + g) * 2 + 1]) - 8.0f * scale;
      }
      scales[g * padded + i] = scale;
      offsets[g * padded + i] = offset;
    }
#endif
}

#if defined(__AVX512F__)
// `pack_slab<16>` (prefill.cpp) for an int4 weight, the same int16 pairs in the same
// places, from whole 32-byte pairs of blocks: in int4_gemv.cpp's layout 32-bit lane j of a
// pair of blocks holds inputs 2j and 2j + 1 (bits 0-3 and 16-19), then 16 + 2j and 17 + 2j
// (bits 4-7, 20-23), 32 + 2j ... and 48 + 2j ..., so after a 16-output x 8-lane transpose
// one shift and one mask give 16 outputs' int16 pair of inputs (2p, 2p + 1) for four p.
// About half the instructions of unpacking each block to int16 and transposing those, but
// alone no faster: at a prompt's 8-32 rows per expert the unpacking took a fifth to a
// quarter of its GEMM's time either way, waiting on the weight's memory
// (figures: docs/benchmarks/2026-12-07-moe-prefill-experts.md). An odd last block of 32
// (held in GGUF's byte order) goes through `block_values`.
//
// `next_count` outputs from n0 + count on (the slab the thread packs next) are prefetched
// towards L2 meanwhile, a line of each of 16 rows per two chunks: a prompt's expert reads
// its weight from memory once, and the unpacking, the first to touch it, otherwise waited
// on each line (at 8-32 rows a product from memory took 1.2-1.6x its time on weights in
// cache, the prefetching decode kernel 1.1x).
inline void pack_int4_slab_16(const uint8_t* bytes, int64_t row_bytes, int64_t k, int64_t n0,
                              int64_t count, int64_t padded, int32_t* packed,
                              int64_t next_count = 0) {
  const int64_t blocks = k / 32, pairs = k / 2, chunks = blocks / 2;
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  // next_count rows spread over this slab's padded / 16 groups of 16 rows.
  const int64_t groups16 = padded / 16;
  const int64_t next_per_group = (next_count + groups16 - 1) / groups16;
  for (int64_t v = 0; v < padded / 16; ++v) {
    const int64_t outputs = std::clamp<int64_t>(count - 16 * v, 0, 16);
    const uint8_t* first = bytes + (n0 + 16 * v) * row_bytes;
    int32_t* group = packed + v * pairs * 16;
    const int64_t next_first = v * next_per_group;
    const int64_t next_rows = std::clamp<int64_t>(next_count - next_first, 0, next_per_group);
    const uint8_t* next = bytes + (n0 + count + next_first) * row_bytes;
    for (int64_t c = 0; c < chunks; ++c) {
      if (c % 2 == 0)
        for (int64_t i = 0; i < next_rows; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(next + i * row_bytes + c * 32), _MM_HINT_T1);
      __m256i rows[16], low[8], high[8];
      for (int i = 0; i < 16; ++i) {
        const auto* line = reinterpret_cast<const __m256i*>(first + i * row_bytes + c * 32);
        rows[i] = i < outputs ? _mm256_loadu_si256(line) : _mm256_setzero_si256();
      }
      transpose8(rows, low);
      transpose8(rows + 8, high);
      int32_t* out = group + c * 32 * 16;
      for (int j = 0; j < 8; ++j) {
        const __m512i lanes = _mm512_inserti64x4(_mm512_castsi256_si512(low[j]), high[j], 1);
        for (int nibble = 0; nibble < 4; ++nibble)
          _mm512_storeu_si512(out + (8 * nibble + j) * 16,
                              _mm512_and_si512(_mm512_srli_epi32(lanes, 4 * nibble), nibbles));
      }
    }
    if (blocks % 2 == 1) {  // the odd last block: inputs k - 32 .. k, pairs 16 (blocks - 1) on
      for (int half = 0; half < 2; ++half) {  // outputs 0-7, 8-15 of the group
        __m256i low_inputs[8], high_inputs[8], out[8];
        for (int i = 0; i < 8; ++i) {
          const int row = 8 * half + i;
          if (row < outputs) {
            __m256i values[2];
            block_values(first + row * row_bytes, Held::kInt4, blocks - 1, blocks, values);
            low_inputs[i] = values[0];
            high_inputs[i] = values[1];
          } else {
            low_inputs[i] = high_inputs[i] = _mm256_setzero_si256();
          }
        }
        int32_t* base = group + (blocks - 1) * 16 * 16 + 8 * half;
        transpose8(low_inputs, out);
        for (int j = 0; j < 8; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + j * 16), out[j]);
        transpose8(high_inputs, out);
        for (int j = 0; j < 8; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + (8 + j) * 16), out[j]);
      }
    }
  }
}
#endif

// prefill_int8.cpp, for prefill.cpp's GEMM with int8 activations:
// Rounds a row's blocks of 32 to int8 (`values` [k]) and writes each block's scale
// (`scales` [k / 32]) and the sums of its rounded values per block (`sums` [k / 32]) and per
// half block (`half_sums` [k / 16]).
void round_row_int8(const float* x, int64_t k, int8_t* values, float* scales, float* sums,
                    float* half_sums);

// The unsigned bytes `vpmaddubsw` multiplies (int4 values as held, 5-bit values + 16, int8
// values + 32; `int8_bias`) of outputs [n0, n0 + count) into `packed` (k / 4 int32 per 8
// outputs); false when an int8 value lies outside [-32, 31] (the slab then needs int16
// activations).
bool pack_slab_u8(const uint8_t* bytes, int64_t row_bytes, Held held, int64_t k, int64_t n0,
                  int64_t count, int64_t padded, int32_t* packed);

// The byte value `pack_slab_u8` adds to a weight integer of `held`: 0, 16 or 32.
inline float int8_bias(Held held) {
  return held == Held::kInt5 ? 16.0f : held == Held::kInt8 ? 32.0f : 0.0f;
}

// Activations rounded to int8 (`round_row_int8` for every row, [rows, k] and per block).
struct Int8Rows {
  const int8_t* values;
  const float* scales;
  const float* sums;
  const float* half_sums;
};

// y[:, n0 .. n0 + count) (row stride n) = the int8 rows times a slab packed by
// `pack_slab_u8`, with each group's float32 scale and offset [groups][padded] (the offset
// against the rounded activations' group sum, the bias already in it). `halves`: groups of
// 16 inputs (else `blocks_per_group` blocks of 32).
void u8_slab_product(const Int8Rows& x, int64_t rows, int64_t k, Held held, bool halves,
                     const int32_t* packed, const float* scales, const float* offsets,
                     int64_t padded, int64_t count, int64_t blocks_per_group, int64_t n0,
                     int64_t n, float* y);

#endif  // EXO_AVX2

// Whether this build and CPU have prefill_bf16.cpp's AMX-BF16 product.
bool bf16_tiles_available();

// Fewest prompt rows a call with leading int16 (decode) rows multiplies in bfloat16
// (`block_matmul`'s bf16): with fewer, all its rows take int16. A step's 8-token prompt
// chunk beside decodes (scheduler.py) would otherwise pay the weight's unpacking twice (its
// decode rows int16, the chunk bf16), and at 32 rows the two paths took the same time
// (figures: docs/benchmarks/engine-design-figures.md#prefill_packh). Calls without decode
// rows take bf16 at any row count, so a prompt gives the same products however a pipeline
// rank or a single process chunks it (a greedy answer then matches across placements).
constexpr int64_t kBf16MinRows = 32;

// y[rows, n] (row stride n) = x [rows, k] rounded to bfloat16 times the weight dequantized
// to bfloat16 slab by slab, by oneDNN's AMX micro-kernel (prefill_bf16.cpp). Raises where
// `bf16_tiles_available()` is false.
void bf16_block_matmul(const float* x, int64_t rows, int64_t k, const uint8_t* bytes, Held held,
                       bool symmetric, const uint16_t* scale_zero, int64_t groups, int64_t n,
                       float* y);

// y[rows, n] with the weight dequantized to float32 slab by slab times torch's matmul
// (prefill_dequantized.cpp: CPUs without AVX2, `EXO_NATIVE_INT_GEMM=0`).
void dequantized_block_matmul(const float* x, int64_t rows, int64_t k, const at::Tensor& weight,
                              const at::Tensor& scale_zero, Held held, int64_t group_size,
                              int64_t n, float* y);

}  // namespace exo_native::prefill
