// SPDX-License-Identifier: Apache-2.0
// The cast family: codecs none / fp16 / bf16 (DESIGN.md section 3). Round-to-nearest-even casts of
// x' = x + r (divided by the divisor) to the wire dtype, error feedback fused into the same pass.
//
// Packet: header, then one section "payload" of numel + 1 wire elements (the input dtype for
// codec none, float16 for fp16, bfloat16 for bf16); the last element is the non-finite sentinel
// (0, or NaN when a non-finite value was encoded), so that a NaN survives a sum allreduce.
// Linear: the payload is what the `sum` scheme allreduces.
#pragma once

#include "../backend.hpp"

namespace gradcomp::detail {

struct CastPlan {
  DType input = DType::float32;
  DType wire = DType::float32;
  int64_t numel = 0;
  int threads = 1;     //!< CPU threads of this call
  PacketLayout layout; //!< section 0: the payload
};

namespace cpu {
extern const Kernels<CastPlan> cast;
} // namespace cpu
namespace cuda {
extern const Kernels<CastPlan> cast;
} // namespace cuda

} // namespace gradcomp::detail
