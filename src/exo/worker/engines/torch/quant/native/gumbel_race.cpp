// The sampler's Gumbel-max race (decoding/gumbel_race.py, whose docstring gives the method):
// out[i] = scores[i] + G(key, id_i), G = -log(-log U), U from the 32-bit half id_i % 2 of
// splitmix64(key, id_i / 2 + 1): one 64-bit hash serves two neighbouring tokens.
//
// Bit for bit the torch reference (`reference_gumbel_scores`) on every path (512-bit,
// 256-bit, scalar): the same IEEE float32 adds, multiplies and divides in the same order,
// a multiply never fused into the add after it (`opaque` keeps GCC from contracting them
// into FMAs, which the torch operators cannot form), and the log an atanh series of our own
// rather than libm's. 64-bit multiplies are three 32x32->64 ones (AVX512F and AVX2 have no
// 64-bit low multiply; AVX512DQ's costs as much).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;  // splitmix64's increment
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kMix2 = 0x94D049BB133111EBull;
constexpr int32_t kSmallHash = 1 << 29;
constexpr int32_t kLargestHash = 0x7FFFFFFF;
constexpr float kThird = 0x1.555556p-2f;
constexpr float kFifth = 0x1.99999ap-3f;
constexpr float kSeventh = 0x1.24924ap-3f;
constexpr float kNinth = 0x1.c71c72p-4f;
constexpr float kLn2 = 0x1.62e430p-1f;
constexpr float kInv2To31 = 0x1p-31f;
constexpr int32_t kSqrt2Mantissa = 0x3504F3;

// A value the compiler must materialise: a product passed through it is never fused with
// the add that follows.
template <typename T>
inline T opaque(T value) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(value));
#elif defined(__aarch64__)
  asm("" : "+w"(value));
#else
  volatile T kept = value;
  value = kept;
#endif
  return value;
}

// ---- scalar: the definition the vector paths follow ----

inline int32_t hash31(uint64_t key, uint64_t id) {
  uint64_t z = key + ((id >> 1) + 1) * kGamma;
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  z ^= z >> 31;
  const uint32_t half = static_cast<uint32_t>((id & 1) != 0 ? z >> 32 : z);
  return static_cast<int32_t>(half >> 1);
}

inline float log1p_reduced(float f) {
  const float s = f / (f + 2.0f);
  const float z = opaque(s * s);
  float series = opaque(z * kNinth) + kSeventh;
  series = opaque(series * z) + kFifth;
  series = opaque(series * z) + kThird;
  series = opaque(series * z);
  const float twice = s + s;
  return twice + opaque(twice * series);
}

inline float bits_float(int32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// x = 2^e (1 + f), 1 + f in [sqrt(1/2), sqrt(2)].
inline void reduce(float x, float& exponent, float& f) {
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const int32_t mantissa = bits & 0x7FFFFF;
  const int32_t big = mantissa > kSqrt2Mantissa ? 1 : 0;
  exponent = static_cast<float>((bits >> 23) - 127 + big);
  f = bits_float((mantissa | 0x3F800000) - (big << 23)) - 1.0f;
}

inline float log_positive(float x) {
  float exponent, f;
  reduce(x, exponent, f);
  return opaque(exponent * kLn2) + log1p_reduced(f);
}

inline float gumbel(uint64_t key, uint64_t id) {
  const int32_t hashed = hash31(key, id);
  const bool small = hashed < kSmallHash;
  const float count = static_cast<float>(small ? hashed : kLargestHash - hashed);
  const float point = opaque((count + 0.5f) * kInv2To31);
  float exponent, f;
  reduce(point, exponent, f);
  if (small) {
    exponent = 0.0f;
    f = -point;
  }
  const float exponential = -(opaque(exponent * kLn2) + log1p_reduced(f));
  return -log_positive(exponential);
}

void scalar_range(const float* scores, const int64_t* ids, uint64_t key, int64_t begin,
                  int64_t end, float* out) {
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t id = ids != nullptr ? static_cast<uint64_t>(ids[i]) : static_cast<uint64_t>(i);
    out[i] = scores[i] + gumbel(key, id);
  }
}

#if defined(__AVX2__)
inline __m256 negate_avx2(__m256 x) { return _mm256_xor_ps(x, _mm256_set1_ps(-0.0f)); }

// ---- 256 bits: 8 tokens per step, hashed as two vectors of 4 64-bit lanes ----

inline __m256i mul64_avx2(__m256i a, uint64_t constant) {
  const __m256i low = _mm256_set1_epi64x(static_cast<int64_t>(constant & 0xFFFFFFFFu));
  const __m256i high = _mm256_set1_epi64x(static_cast<int64_t>(constant >> 32));
  const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), low),
                                         _mm256_mul_epu32(a, high));
  return _mm256_add_epi64(_mm256_mul_epu32(a, low), _mm256_slli_epi64(cross, 32));
}

inline __m256i mix_avx2(__m256i z) {
  z = mul64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), kMix1);
  z = mul64_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), kMix2);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

inline __m256 log1p_reduced_avx2(__m256 f) {
  const __m256 s = _mm256_div_ps(f, _mm256_add_ps(f, _mm256_set1_ps(2.0f)));
  const __m256 z = opaque(_mm256_mul_ps(s, s));
  __m256 series = _mm256_add_ps(opaque(_mm256_mul_ps(z, _mm256_set1_ps(kNinth))),
                                _mm256_set1_ps(kSeventh));
  series = _mm256_add_ps(opaque(_mm256_mul_ps(series, z)), _mm256_set1_ps(kFifth));
  series = _mm256_add_ps(opaque(_mm256_mul_ps(series, z)), _mm256_set1_ps(kThird));
  series = opaque(_mm256_mul_ps(series, z));
  const __m256 twice = _mm256_add_ps(s, s);
  return _mm256_add_ps(twice, opaque(_mm256_mul_ps(twice, series)));
}

inline void reduce_avx2(__m256 x, __m256& exponent, __m256& f) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i mantissa = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF));
  const __m256i big = _mm256_cmpgt_epi32(mantissa, _mm256_set1_epi32(kSqrt2Mantissa));  // -1
  const __m256i power = _mm256_sub_epi32(
      _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127)), big);
  exponent = _mm256_cvtepi32_ps(power);
  const __m256i reduced = _mm256_add_epi32(
      _mm256_or_si256(mantissa, _mm256_set1_epi32(0x3F800000)), _mm256_slli_epi32(big, 23));
  f = _mm256_sub_ps(_mm256_castsi256_ps(reduced), _mm256_set1_ps(1.0f));
}

inline __m256 log_avx2(__m256 x) {
  __m256 exponent, f;
  reduce_avx2(x, exponent, f);
  return _mm256_add_ps(opaque(_mm256_mul_ps(exponent, _mm256_set1_ps(kLn2))),
                       log1p_reduced_avx2(f));
}

// G for 8 tokens whose 31-bit hashes are `hashed`.
inline __m256 gumbel_avx2(__m256i hashed) {
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(kSmallHash), hashed);
  const __m256i count = _mm256_blendv_epi8(
      _mm256_sub_epi32(_mm256_set1_epi32(kLargestHash), hashed), hashed, small);
  const __m256 point = opaque(_mm256_mul_ps(
      _mm256_add_ps(_mm256_cvtepi32_ps(count), _mm256_set1_ps(0.5f)), _mm256_set1_ps(kInv2To31)));
  __m256 exponent, f;
  reduce_avx2(point, exponent, f);
  const __m256 small_lanes = _mm256_castsi256_ps(small);
  exponent = _mm256_blendv_ps(exponent, _mm256_setzero_ps(), small_lanes);
  f = _mm256_blendv_ps(f, negate_avx2(point), small_lanes);
  const __m256 log_u = _mm256_add_ps(opaque(_mm256_mul_ps(exponent, _mm256_set1_ps(kLn2))),
                                     log1p_reduced_avx2(f));
  return negate_avx2(log_avx2(negate_avx2(log_u)));
}

// The low 32 bits of two vectors of 4 64-bit lanes, in lane order.
inline __m256i pack_low_avx2(__m256i first, __m256i second) {
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  return _mm256_blend_epi32(_mm256_permutevar8x32_epi32(first, order),
                            _mm256_permutevar8x32_epi32(second, order), 0xF0);
}

// The 31-bit hashes of 4 token ids: each id's half of its pair's hash, shifted down by 1.
inline __m256i hash_ids_avx2(__m256i ids, __m256i key_lanes) {
  const __m256i one = _mm256_set1_epi64x(1);
  const __m256i counters = _mm256_add_epi64(_mm256_srli_epi64(ids, 1), one);
  const __m256i z = mix_avx2(_mm256_add_epi64(mul64_avx2(counters, kGamma), key_lanes));
  const __m256i shift = _mm256_add_epi64(_mm256_slli_epi64(_mm256_and_si256(ids, one), 5), one);
  return _mm256_and_si256(_mm256_srlv_epi64(z, shift), _mm256_set1_epi64x(0x7FFFFFFF));
}

int64_t avx2_range(const float* scores, const int64_t* ids, uint64_t key, int64_t n,
                   float* out) {
  const __m256i key_lanes = _mm256_set1_epi64x(static_cast<int64_t>(key));
  // Without ids, tokens i .. i + 7 are the halves (low, high) of the hashes at counters
  // i / 2 + 1 .. i / 2 + 4, whose states key + counter gamma advance by 4 gamma per step.
  const __m256i step = _mm256_set1_epi64x(static_cast<int64_t>(4 * kGamma));
  __m256i state =
      _mm256_add_epi64(mul64_avx2(_mm256_setr_epi64x(1, 2, 3, 4), kGamma), key_lanes);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i hashed;
    if (ids != nullptr) {
      const auto* lanes = reinterpret_cast<const __m256i*>(ids + i);
      hashed = pack_low_avx2(hash_ids_avx2(_mm256_loadu_si256(lanes), key_lanes),
                             hash_ids_avx2(_mm256_loadu_si256(lanes + 1), key_lanes));
    } else {
      hashed = _mm256_srli_epi32(mix_avx2(state), 1);  // 32-bit lanes: low, high, low, ..
      state = _mm256_add_epi64(state, step);
    }
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(scores + i), gumbel_avx2(hashed)));
  }
  return i;
}
#endif

#if defined(__AVX512F__)
inline __m512 negate_avx512(__m512 x) {
  return _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

// ---- 512 bits: 16 tokens per step, hashed as two vectors of 8 64-bit lanes ----

inline __m512i mul64_avx512(__m512i a, uint64_t constant) {
#if defined(__AVX512DQ__)
  return _mm512_mullo_epi64(a, _mm512_set1_epi64(static_cast<int64_t>(constant)));
#else
  const __m512i low = _mm512_set1_epi64(static_cast<int64_t>(constant & 0xFFFFFFFFu));
  const __m512i high = _mm512_set1_epi64(static_cast<int64_t>(constant >> 32));
  const __m512i cross = _mm512_add_epi64(_mm512_mul_epu32(_mm512_srli_epi64(a, 32), low),
                                         _mm512_mul_epu32(a, high));
  return _mm512_add_epi64(_mm512_mul_epu32(a, low), _mm512_slli_epi64(cross, 32));
#endif
}

inline __m512i mix_avx512(__m512i z) {
  z = mul64_avx512(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), kMix1);
  z = mul64_avx512(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), kMix2);
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

inline __m512 log1p_reduced_avx512(__m512 f) {
  const __m512 s = _mm512_div_ps(f, _mm512_add_ps(f, _mm512_set1_ps(2.0f)));
  const __m512 z = opaque(_mm512_mul_ps(s, s));
  __m512 series = _mm512_add_ps(opaque(_mm512_mul_ps(z, _mm512_set1_ps(kNinth))),
                                _mm512_set1_ps(kSeventh));
  series = _mm512_add_ps(opaque(_mm512_mul_ps(series, z)), _mm512_set1_ps(kFifth));
  series = _mm512_add_ps(opaque(_mm512_mul_ps(series, z)), _mm512_set1_ps(kThird));
  series = opaque(_mm512_mul_ps(series, z));
  const __m512 twice = _mm512_add_ps(s, s);
  return _mm512_add_ps(twice, opaque(_mm512_mul_ps(twice, series)));
}

inline void reduce_avx512(__m512 x, __m512& exponent, __m512& f) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i mantissa = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFF));
  const __mmask16 big = _mm512_cmpgt_epi32_mask(mantissa, _mm512_set1_epi32(kSqrt2Mantissa));
  __m512i power = _mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(127));
  power = _mm512_mask_add_epi32(power, big, power, _mm512_set1_epi32(1));
  exponent = _mm512_cvtepi32_ps(power);
  __m512i reduced = _mm512_or_si512(mantissa, _mm512_set1_epi32(0x3F800000));
  reduced = _mm512_mask_sub_epi32(reduced, big, reduced, _mm512_set1_epi32(1 << 23));
  f = _mm512_sub_ps(_mm512_castsi512_ps(reduced), _mm512_set1_ps(1.0f));
}

inline __m512 log_avx512(__m512 x) {
  __m512 exponent, f;
  reduce_avx512(x, exponent, f);
  return _mm512_add_ps(opaque(_mm512_mul_ps(exponent, _mm512_set1_ps(kLn2))),
                       log1p_reduced_avx512(f));
}

inline __m512 gumbel_avx512(__m512i hashed) {
  const __mmask16 small = _mm512_cmplt_epi32_mask(hashed, _mm512_set1_epi32(kSmallHash));
  const __m512i count = _mm512_mask_blend_epi32(
      small, _mm512_sub_epi32(_mm512_set1_epi32(kLargestHash), hashed), hashed);
  const __m512 point = opaque(_mm512_mul_ps(
      _mm512_add_ps(_mm512_cvtepi32_ps(count), _mm512_set1_ps(0.5f)), _mm512_set1_ps(kInv2To31)));
  __m512 exponent, f;
  reduce_avx512(point, exponent, f);
  exponent = _mm512_mask_blend_ps(small, exponent, _mm512_setzero_ps());
  f = _mm512_mask_blend_ps(small, f, negate_avx512(point));
  const __m512 log_u = _mm512_add_ps(opaque(_mm512_mul_ps(exponent, _mm512_set1_ps(kLn2))),
                                     log1p_reduced_avx512(f));
  return negate_avx512(log_avx512(negate_avx512(log_u)));
}

// The 31-bit hashes of 8 token ids (as `hash_ids_avx2`), in 8 32-bit lanes.
inline __m256i hash_ids_avx512(__m512i ids, __m512i key_lanes) {
  const __m512i one = _mm512_set1_epi64(1);
  const __m512i counters = _mm512_add_epi64(_mm512_srli_epi64(ids, 1), one);
  const __m512i z = mix_avx512(_mm512_add_epi64(mul64_avx512(counters, kGamma), key_lanes));
  const __m512i shift = _mm512_add_epi64(_mm512_slli_epi64(_mm512_and_si512(ids, one), 5), one);
  return _mm512_cvtepi64_epi32(
      _mm512_and_si512(_mm512_srlv_epi64(z, shift), _mm512_set1_epi64(0x7FFFFFFF)));
}

int64_t avx512_range(const float* scores, const int64_t* ids, uint64_t key, int64_t n,
                     float* out) {
  const __m512i key_lanes = _mm512_set1_epi64(static_cast<int64_t>(key));
  // Without ids, tokens i .. i + 15 are the halves of the hashes at counters
  // i / 2 + 1 .. i / 2 + 8, whose states advance by 8 gamma per step.
  const __m512i step = _mm512_set1_epi64(static_cast<int64_t>(8 * kGamma));
  __m512i state = _mm512_add_epi64(
      mul64_avx512(_mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8), kGamma), key_lanes);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512i hashed;
    if (ids != nullptr) {
      hashed = _mm512_inserti64x4(
          _mm512_castsi256_si512(hash_ids_avx512(_mm512_loadu_si512(ids + i), key_lanes)),
          hash_ids_avx512(_mm512_loadu_si512(ids + i + 8), key_lanes), 1);
    } else {
      hashed = _mm512_srli_epi32(mix_avx512(state), 1);  // 32-bit lanes: low, high, low, ..
      state = _mm512_add_epi64(state, step);
    }
    _mm512_storeu_ps(out + i, _mm512_add_ps(_mm512_loadu_ps(scores + i), gumbel_avx512(hashed)));
  }
  return i;
}
#endif

// The widest path built: 512 (AVX512F, unless EXO_NATIVE_AVX512=0, read once), 256 (AVX2),
// else 1 (scalar).
int64_t widest() {
#if defined(__AVX512F__)
  static const int64_t bits = [] {
    const char* value = std::getenv("EXO_NATIVE_AVX512");
    return value != nullptr && std::string(value) == "0" ? int64_t{256} : int64_t{512};
  }();
  return bits;
#elif defined(__AVX2__)
  return 256;
#else
  return 1;
#endif
}

at::Tensor gumbel_scores(const at::Tensor& scores, const std::optional<at::Tensor>& ids,
                         int64_t key, int64_t width) {
  TORCH_CHECK(scores.dim() == 1 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "gumbel_scores: scores must be a contiguous float32 [n] tensor");
  const int64_t* id_data = nullptr;
  if (ids.has_value()) {
    TORCH_CHECK(ids->dim() == 1 && ids->scalar_type() == at::kLong && ids->is_contiguous() &&
                    ids->size(0) == scores.size(0),
                "gumbel_scores: ids must be a contiguous int64 tensor as long as scores");
    id_data = ids->data_ptr<int64_t>();
  }
  TORCH_CHECK(key >= 0, "gumbel_scores: the key must be in [0, 2**63)");
  const int64_t path = width == 0 ? widest() : width;
  const int64_t n = scores.size(0);
  at::Tensor out = at::empty({n}, scores.options());
  const float* data = scores.data_ptr<float>();
  float* result = out.data_ptr<float>();
  const uint64_t unsigned_key = static_cast<uint64_t>(key);
  int64_t done = 0;
  if (path == 512) {
#if defined(__AVX512F__)
    done = avx512_range(data, id_data, unsigned_key, n, result);
#else
    TORCH_CHECK(false, "gumbel_scores: the 512-bit path is not built");
#endif
  } else if (path == 256) {
#if defined(__AVX2__)
    done = avx2_range(data, id_data, unsigned_key, n, result);
#else
    TORCH_CHECK(false, "gumbel_scores: the 256-bit path is not built");
#endif
  } else {
    TORCH_CHECK(path == 1, "gumbel_scores: width must be 0, 1, 256 or 512");
  }
  scalar_range(data, id_data, unsigned_key, done, n, result);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def("gumbel_scores(Tensor scores, Tensor? ids, int key, int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("gumbel_scores", &gumbel_scores); }
