// exo's decode product for bfloat16 weights: y[m, n] = sum_k w[n, k] x[m, k] in float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "block_rows.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using exo_native::bf16_to_float;
using namespace exo_native::block_rows;

}  // namespace

namespace {

// bfloat16 weights (GGUF types held unquantized, e.g. Q6_K) times float32 activations,
// exactly in float32: widening the weight is one shift per 8 values, so the product is
// bound by reading 2 bytes per weight, faster than torch's bfloat16 linear on CPUs with no
// bfloat16 arithmetic (figures: docs/benchmarks/engine-design-figures.md#int4_gemvcpp).
#ifdef EXO_AVX2
template <int NR>
[[gnu::noinline]]
void tile_avx2_bf16(const float* x, int64_t rows, int64_t k, const uint16_t* w, float* y,
                    int64_t n_total, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    __m256 acc[NR];
    for (int i = 0; i < NR; ++i) acc[i] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= k; j += 8) {
      const __m256 xv = _mm256_loadu_ps(x + r * k + j);
      for (int i = 0; i < NR; ++i) {
        const uint16_t* values = w + (n + i) * k + j;
        const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values));
        if (j % 32 == 0) prefetch_ahead(values);
        const __m256 wv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
        acc[i] = _mm256_fmadd_ps(wv, xv, acc[i]);
      }
    }
    for (int i = 0; i < NR; ++i) {
      float total = horizontal_sum(acc[i]);
      for (int64_t t = j; t < k; ++t) total += bf16_to_float(w[(n + i) * k + t]) * x[r * k + t];
      y[r * n_total + n + i] = total;
    }
  }
}
#endif

}  // namespace

namespace exo_native {

void bf16_product(const float* x, int64_t rows, int64_t k, const at::Tensor& weight, float* y) {
  const int64_t n = weight.size(0);
  if (rows == 0 || n == 0) return;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 16) / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    int64_t o = n0;
#ifdef EXO_AVX2
    for (; o + 4 <= n1; o += 4) tile_avx2_bf16<4>(x, rows, k, w, y, n, o);
    for (; o < n1; ++o) tile_avx2_bf16<1>(x, rows, k, w, y, n, o);
#else
    for (; o < n1; ++o)
      for (int64_t r = 0; r < rows; ++r) {
        float total = 0.0f;
        for (int64_t t = 0; t < k; ++t) total += bf16_to_float(w[o * k + t]) * x[r * k + t];
        y[r * n + o] = total;
      }
#endif
  });
}

}  // namespace exo_native

namespace {

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "bf16_gemv: x must be a contiguous float32 [rows, in] tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "bf16_gemv: weight must be a contiguous bfloat16 [out, in] tensor");
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  exo_native::bf16_product(x.data_ptr<float>(), x.size(0), x.size(1), weight,
                           y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(exo_native, m) { m.def("bf16_gemv(Tensor x, Tensor weight) -> Tensor"); }

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("bf16_gemv", &bf16_gemv); }
