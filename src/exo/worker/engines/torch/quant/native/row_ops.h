// Per-row operations shared by the decode layer (decode_layer.cpp) and the prefill
// operators (prefill_ops.cpp): the gated activation and per-head q/k norm + rotary.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <sleef.h>  // the vectorized exp / tanh torch's own kernels use (exported by libtorch_cpu)
#endif

namespace exo_native::row_ops {

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2 };

inline float activate(float g, int64_t activation) {
  switch (activation) {
    case kSilu:
      return g / (1.0f + std::exp(-g));
    case kGeluTanh: {  // Hendrycks & Gimpel 2016, the tanh approximation, as g sigmoid(2 z)
      const float twice_inner = 1.5957691216057308f * (g + 0.044715f * g * g * g);
      return g / (1.0f + std::exp(-twice_inner));
    }
    default:
      return 0.5f * g * (1.0f + std::erf(g * 0.7071067811865476f));
  }
}

// m[i] = act(gate[i]) * up[i] for i < n. With AVX2, SiLU and the tanh GELU 8 at a time
// through SLEEF's exp (1.0 ulp; torch's vectorized kernels call the same), several times
// faster than the scalar loop. The tanh GELU is computed as g sigmoid(2 z)
// (0.5 (1 + tanh z) = sigmoid(2 z)), one exp instead of SLEEF's tanh, faster and within a
// few float32 ulps of torch's tanh form
// (figures: docs/benchmarks/engine-design-figures.md#row_opsh). The exact (erf) GELU stays
// scalar.
inline void activate_rows(const float* gate, const float* up, int64_t n, int64_t activation,
                   float* m) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (activation == kSilu || activation == kGeluTanh) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 twice_root_two_over_pi = _mm256_set1_ps(1.5957691216057308f);
    const __m256 cubic = _mm256_set1_ps(0.044715f);
    for (; i + 8 <= n; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      __m256 a;
      if (activation == kSilu) {
        const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
        a = _mm256_div_ps(g, _mm256_add_ps(one, e));
      } else {
        const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
        const __m256 twice_inner =
            _mm256_mul_ps(twice_root_two_over_pi, _mm256_fmadd_ps(cubic, g3, g));
        const __m256 e = Sleef_expf8_u10avx2(_mm256_sub_ps(_mm256_setzero_ps(), twice_inner));
        a = _mm256_div_ps(g, _mm256_add_ps(one, e));
      }
      _mm256_storeu_ps(m + i, _mm256_mul_ps(a, _mm256_loadu_ps(up + i)));
    }
  }
#endif
  for (; i < n; ++i) m[i] = activate(gate[i], activation) * up[i];
}

// A row's first `heads` heads of `head_dim` values, in place: each normed by its slice of
// `norm` (per-head q/k norm weights [heads, head_dim]; nullptr: no norm), then rotated:
// v[d] = v[d] cos[d] + v[perm[d]] sin[d] (direct_forward_parts.rotary_tables: the sign of
// rotate-half folded into sin). `scratch` holds head_dim values.
inline void norm_rotate_heads(float* row, int64_t heads, int64_t head_dim, const float* norm,
                       float eps, const float* cos, const float* sin, const int64_t* perm,
                       float* scratch) {
  for (int64_t h = 0; h < heads; ++h) {
    float* vec = row + h * head_dim;
    if (norm != nullptr) exo_native::rms_norm_row(vec, norm + h * head_dim, head_dim, eps, vec);
    std::memcpy(scratch, vec, sizeof(float) * head_dim);
    for (int64_t d = 0; d < head_dim; ++d) vec[d] = scratch[d] * cos[d] + scratch[perm[d]] * sin[d];
  }
}

}  // namespace exo_native::row_ops
