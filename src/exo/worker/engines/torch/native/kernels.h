// exo's CPU kernels shared between the operator files (int4_gemv.cpp, decode_layer.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace exo_native {

// y[rows, out] = x[rows, k] times the int4 weight (qweight uint8 [out, k / 2] in blocks of
// 32, scale_zero bfloat16 [out, groups, 2]); see int4_gemv.cpp. Splits outputs across
// torch's intra-op threads.
void int4_product(const float* x, int64_t rows, int64_t k, const at::Tensor& qweight,
                  const at::Tensor& scale_zero, float* y);

// y[rows, out] = x[rows, k] times the int8-block weight (values int8 [out, k], scale_zero
// bfloat16 [out, k / 32, 2]); see int4_gemv.cpp.
void int8_block_product(const float* x, int64_t rows, int64_t k, const at::Tensor& values,
                        const at::Tensor& scale_zero, float* y);

// out[hidden] = row / sqrt(mean(row^2) + eps) * weight (weight nullptr: no weight).
void rms_norm_row(const float* row, const float* weight, int64_t hidden, float eps, float* out);

}  // namespace exo_native
