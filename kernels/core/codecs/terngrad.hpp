// SPDX-License-Identifier: Apache-2.0
// The TernGrad family: codec `terngrad:clip=c` (docs/contracts.md section 3; Wen et al., NeurIPS
// 2017, sections 3 and 3.3). Keyed: the Bernoulli draws come from Philox4x32-10 words of the
// EncodeContext (kernels/common/terngrad.hpp says exactly how), the same on every rank, CPU and CUDA.
//
// y = x' / W (x' = x + r) over the whole tensor: clipped to [-clip, clip] with clip = c * sigma
// (c = 2.5 by default, 0: no clipping; sigma the standard deviation of y from binary64 sums in one
// fixed order), s = max |y_c|, codes b = sign(y) * Bernoulli(|y_c| / s) in {-1, 0, +1}, two bits
// each; D = s * b. E[D] = y_c: unbiased without clipping (`clip=0`). A non-finite y makes s NaN,
// every code 0 and D NaN, and flags the packet. Residual: r = fl(x' - D) (fl(x' - fl(W * D))).
// Packet: header (main parameter 0; wire dtype uint8), "codes": ceil(n / 4) bytes, "scale": one
// float32 (s), then the 32-byte key section.
#pragma once

#include "../backend.hpp"

namespace gradcomp::detail {

struct TernGradPlan {
  DType input = DType::float32;
  int64_t numel = 0;
  double clip_c = 2.5;  //!< c of the clipping threshold c * sigma; 0: no clipping
  int64_t ntiles = 0;   //!< ceil(numel / 4096): the tiles of the fixed-order sums
  int threads = 1;      //!< CPU threads of this call
  PacketLayout layout;  //!< section 0: codes; section 1: scale; section 2: the key
};

namespace cpu {
extern const Kernels<TernGradPlan> terngrad;
} // namespace cpu
namespace cuda {
extern const Kernels<TernGradPlan> terngrad;
} // namespace cuda

} // namespace gradcomp::detail
