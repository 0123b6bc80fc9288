// SPDX-License-Identifier: Apache-2.0
// The top-k family (docs/contracts.md section 3): exact top-k by magnitude of y = x' / divisor, with
// x' = x + r, error feedback fused (Aji & Heafield, EMNLP 2017; Lin et al., ICLR 2018).
//
// Keys |y| with every NaN above +inf, -0.0 == +0.0, ties at the threshold to the lowest index.
// k = min(n, max(1, ceil(ratio * n))) in binary64, or `k=` clamped to n.
// Packet: header (main parameter k), section "indices": k ascending indices (uint32, or uint64
// above 2^32 elements or with index=u64), section "values": k values (value_dtype; auto = the
// input dtype).
#pragma once

#include "../backend.hpp"

namespace gradcomp::detail {

struct TopKPlan {
  DType input = DType::float32;
  int64_t numel = 0;
  int64_t k = 0;
  DType index_dtype = DType::uint32;
  DType value_dtype = DType::float32;
  int64_t values_offset = 0;      //!< byte offset of the values section
  int64_t candidate_capacity = 0; //!< CPU: entries the candidate buffer holds
  int threads = 1;                //!< CPU threads of this call (fewer when cores are contended)
  int workspace_threads = 1;      //!< CPU threads the workspace is sized for (the configured count)
  PacketLayout layout;            //!< section 0: indices, section 1: values
};

namespace cpu {
extern const Kernels<TopKPlan> topk;
} // namespace cpu
namespace cuda {
extern const Kernels<TopKPlan> topk;
} // namespace cuda

} // namespace gradcomp::detail
