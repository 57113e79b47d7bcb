// Compact Q4_K scales (kernels.h `kQ4kBytes`): the expansion to bfloat16 (scale, zero) pairs
// for the paths that do not read the compact form themselves (prefill's block_matmul and the
// portable decode loop expand per call, a temporary of 1 bit per weight; tests compare both
// forms). The decode tiles read it natively and unrounded (block_rows.h `unpack_q4k_scales`).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace exo_native {

at::Tensor q4k_scale_pairs(const at::Tensor& compact) {
  TORCH_CHECK(is_q4k_scales(compact) && compact.is_contiguous(),
              "q4k_scale_pairs: compact Q4_K scales must be contiguous uint8 [out, in / 256, ",
              kQ4kBytes, "]");
  const int64_t out = compact.size(0), super_blocks = compact.size(1);
  at::Tensor pairs =
      at::empty({out, super_blocks * kQ4kGroups, 2}, compact.options().dtype(at::kBFloat16));
  const uint8_t* source = compact.data_ptr<uint8_t>();
  auto* target = reinterpret_cast<uint16_t*>(pairs.data_ptr<at::BFloat16>());
  at::parallel_for(0, out * super_blocks, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const uint8_t* block = source + s * kQ4kBytes;
      uint16_t d_bits, dmin_bits;
      std::memcpy(&d_bits, block, 2);
      std::memcpy(&dmin_bits, block + 2, 2);
      const float d = static_cast<float>(c10::Half(d_bits, c10::Half::from_bits()));
      const float dmin = static_cast<float>(c10::Half(dmin_bits, c10::Half::from_bits()));
      for (int64_t g = 0; g < kQ4kGroups; ++g) {
        // Both products are exact in float32 (11 + 6 significant bits); the difference is
        // rounded once, as numpy's `8.0 * scales - mins` in repack_q4_k.
        const float scale = d * static_cast<float>(block[4 + g]);
        const float mins = dmin * static_cast<float>(block[4 + kQ4kGroups + g]);
        const float zero = 8.0f * scale - mins;
        uint16_t* pair = target + (s * kQ4kGroups + g) * 2;
        pair[0] = c10::BFloat16(scale).x;  // nearest, ties to even
        pair[1] = c10::BFloat16(zero).x;
      }
    }
  });
  return pairs;
}

}  // namespace exo_native

TORCH_LIBRARY_FRAGMENT(exo_native, m) {
  m.def("q4k_scale_pairs(Tensor compact) -> Tensor");
}

TORCH_LIBRARY_IMPL(exo_native, CPU, m) { m.impl("q4k_scale_pairs", &exo_native::q4k_scale_pairs); }
