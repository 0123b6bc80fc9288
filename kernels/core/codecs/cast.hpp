// SPDX-License-Identifier: Apache-2.0
// The cast family: codecs none / fp16 / bf16 (docs/contracts.md section 3). Round-to-nearest-even casts of
// x' = x + r (divided by the divisor) to the wire dtype, error feedback fused into the same pass.
//
// bf16:rounding=stochastic (keyed) rounds to one of the two bfloat16 neighbours of y instead, up
// with probability equal to y's distance from the lower one over the gap, from Philox4x32-10
// uniforms keyed by the EncodeContext (kernels/common/sround.hpp says exactly how).
//
// Packet: header, then one section "payload" of exactly numel wire elements (the input dtype for
// codec none, float16 for fp16, bfloat16 for bf16); the stochastic codec adds the 32-byte key
// section after it. Linear: the payload is what the `sum` scheme
// allreduces; being numel elements long, it is cut into the same chunks and summed in the same
// order as a dense allreduce of the bucket (bitwise parity with PyTorch's allreduce_hook and
// fp16/bf16_compress_hook wherever they round once). The casts carry every non-finite value
// (NaN and inf survive a sum by themselves), so no sentinel element is needed and decode does not
// write NaN into out[0]; the header's non-finite flag still sets the status word.
#pragma once

#include "../backend.hpp"

namespace gradcomp::detail {

struct CastPlan {
  DType input = DType::float32;
  DType wire = DType::float32;
  int64_t numel = 0;
  int threads = 1;     //!< CPU threads of this call
  bool stochastic = false; //!< bf16:rounding=stochastic (wire bfloat16; kernels/common/sround.hpp)
  PacketLayout layout; //!< section 0: the payload; section 1: the key (stochastic only)
};

namespace cpu {
extern const Kernels<CastPlan> cast;
} // namespace cpu
namespace cuda {
extern const Kernels<CastPlan> cast;
} // namespace cuda

} // namespace gradcomp::detail
