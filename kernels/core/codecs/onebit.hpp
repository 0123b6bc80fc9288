// SPDX-License-Identifier: Apache-2.0
// The onebit family: 1-bit sign quantization with a scale per chunk and fused error feedback
// (docs/contracts.md section 3; Seide et al., Interspeech 2014; Bernstein et al., signSGD, ICML 2018;
// the error-compensated 1-bit Adam of Tang et al., ICML 2021, whose DeepSpeed rules it follows).
//
// y = x' / divisor (x' = x + r), n elements cut into chunks of `chunk` elements (0: the whole tensor
// as one chunk; a multiple of 8 otherwise, so that every chunk starts on a byte of the bit section),
// the last one shorter. Per chunk a float32 scale s: scale=l2 (default) the RMS sqrt(sum y^2 / len)
// (DeepSpeed's ||x||_2 / sqrt(n)), scale=mean_abs the mean of |y|, each summed in binary64 in the
// fixed order of kernels/common/reduce.hpp and rounded once; a NaN in the chunk makes s the quiet
// NaN 0x7FC00000, an inf makes it +inf. One bit per element, bit = !(y < 0) (1 for +-0.0 and NaN, as
// DeepSpeed), most significant bit first in each byte (numpy.packbits order), padding bits 0.
// Decode: D = bit ? s : -s (the sign flipped by its bit); out = fl(D * alpha) or out + fl(D * alpha).
// The residual keeps r_new = fl(x' - D) (fl(x' - fl(divisor * D))). The header's non-finite flag is
// set exactly when some r_new is not finite (some chunk's s, or divisor * s, is not finite).
// Packet: header (main parameter: the chunk; wire dtype uint1), section "bits" (n bits, ceil(n / 8)
// bytes), section "scales" (one float32 per chunk).
#pragma once

#include "../backend.hpp"

namespace gradcomp::detail {

struct OnebitPlan {
  DType input = DType::float32;
  bool l2 = true;         //!< scale=l2 (RMS); false: scale=mean_abs
  int64_t numel = 0;
  int64_t chunk = 0;      //!< elements per chunk, numel (at least 1) for chunk=0
  int64_t nchunks = 0;    //!< ceil(numel / chunk)
  int64_t tiles = 0;      //!< reduce tiles per chunk, ceil(chunk / common::kSumTile)
  int threads = 1;        //!< CPU threads of this call
  PacketLayout layout;    //!< section 0: bits, section 1: scales
};

namespace cpu {
extern const Kernels<OnebitPlan> onebit;
} // namespace cpu
namespace cuda {
extern const Kernels<OnebitPlan> onebit;
} // namespace cuda

} // namespace gradcomp::detail
