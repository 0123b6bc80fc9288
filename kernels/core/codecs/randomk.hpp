// SPDX-License-Identifier: Apache-2.0
// The random-k family: codec `randomk` (docs/contracts.md section 3). Keyed: k indices drawn from
// the EncodeContext, one per stratum (kernels/common/randomk.hpp), so every rank with the same key
// selects the same elements and only the k values travel; linear (the `sum` scheme allreduces the
// values), error feedback fused.
//
// Encode of x (float32/float16/bfloat16, n elements), residual r (float32 [n] or none), divisor W:
//   x'_i = x_i + r_i, y_i = x'_i / W (section 2's fixed expressions) for every i;
//   values_j = wire(y_{i_j})            (unbiased=false)
//   values_j = wire(y_{i_j} * size_j)   (unbiased=true: E[D] = y over the draw, for use without
//                                        error feedback; Wangni et al. 2018, section 3)
//   r_i = x'_i - W * D_i (D_i = values_j at i = i_j, else 0: r_i = x'_i off the selection).
// The wire dtype is the input dtype. Non-finite values: encode reads every y; when one is not
// finite (or a sent value overflows) the header flag is set and values_0 is NaN, so the decoded
// bucket is non-finite after a `sum` too (the payload is all that travels there); r at i_0 then
// follows the same formula (NaN). k = 0 (only through `k=0`) sends the flag alone; decoding a
// flagged packet then writes NaN into out[0], as top-k's decode does.
//
// Packet: header (main parameter k), "values": k wire elements (the payload), then the 32-byte key
// section. Decode recomputes the indices from the packet's key: out[i_j] (= | +=) alpha *
// values_j; assign zeroes every other element.
#pragma once

#include "../backend.hpp"

namespace gradcomp::detail {

struct RandomKPlan {
  DType input = DType::float32; //!< also the wire dtype
  int64_t numel = 0;
  int64_t k = 0;
  bool unbiased = false;
  int threads = 1;     //!< CPU threads of this call
  PacketLayout layout; //!< section 0: values (the payload); section 1: the key
};

namespace cpu {
extern const Kernels<RandomKPlan> randomk;
} // namespace cpu
namespace cuda {
extern const Kernels<RandomKPlan> randomk;
} // namespace cuda

} // namespace gradcomp::detail
