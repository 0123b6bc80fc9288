// SPDX-License-Identifier: Apache-2.0
// The rules of TernGrad (codec `terngrad`, docs/contracts.md section 3), shared by the CPU and CUDA
// backends so that the same input and key give the same packet on both. Wen, Xu, Yan, Wu, Wang,
// Chen & Li, "TernGrad: Ternary gradients to reduce communication in distributed deep learning",
// NeurIPS 2017: section 3 (the stochastic ternarization b = sign(y) * Bernoulli(|y| / s),
// s = ||y||_inf, unbiased) and section 3.3 (gradient clipping at c sigma, c = 2.5).
//
// For y = x' / W over the whole tensor (n elements):
//   S1 = sum y, S2 = sum y^2 in binary64, each by common/reduce.hpp's order: tiles of 4096 (lane l
//        adds elements l, l + 32, ... of the tile in order, lane_tree folds the lanes), then the
//        tile sums by the same lane rule (lane l adds tiles l, l + 32, ...) and lane_tree;
//   sigma = sqrt(max(0, S2 / n - (S1 / n)^2)), clip = fl32(c * sigma) (binary64 throughout, one
//        rounding to float32; `clip=0` in the spec: no clipping, clip = +inf);
//   y_c = min(max(y, -clip), clip);  s = max |y_c| (float32, order-free);
//   per element p = fl(|y_c| / s) (every code 0 when s = 0), b = sign(y) * (u < p), u = (R >> 8) *
//        2^-24 from the element's Philox word R (below); D = fl(s * b) (exact: +-s or 0).
// A non-finite y makes s NaN (0x7FC00000) and every code 0, so D = NaN * 0 = NaN, and flags the
// packet. Codes: 2 bits per element, four per byte, element 4j + t in bits 2t .. 2t + 1 (low
// first): 0 -> 00, +1 -> 01, -1 -> 11; 10 never occurs (a packet holding it is corrupt).
// The random words, for EncodeContext {seed, step, bucket, chunk}:
//   (m0, m1, m2, m3) = philox4x32_10({step, bucket, chunk, kTernTag}, {seed mod 2^32, seed >> 32})
//   element i: group g = i / 4, (w0, w1, w2, w3) = philox4x32_10({g mod 2^32, g >> 32, m2, m3},
//   {m0, m1}), R_i = w[i mod 4].
#pragma once

#include <cstdint>

#include "math.hpp"
#include "keyed.hpp"
#include "philox.hpp"
#include "reduce.hpp"

namespace gradcomp::terngrad {

//! Counter word 3 of the stream derivation: ASCII "TERN" read as a big-endian u32.
inline constexpr uint32_t kTernTag = 0x5445524Eu;
inline constexpr int kGroup = 4; //!< elements per Philox call, and per code byte

using Key = keyed::Key;

//! The stream of an encode (step 1 above): kernels/common/keyed.hpp's derivation with kTernTag.
GRADCOMP_HD Key derive(uint64_t seed, uint32_t step, uint32_t bucket, uint32_t chunk) {
  return keyed::derive(kTernTag, seed, step, bucket, chunk);
}
using keyed::group_bits;
using keyed::uniform;

//! clip = fl32(c * sigma) from the sums (binary64, operations spelled out: no contraction).
GRADCOMP_HD float clip_threshold(double S1, double S2, int64_t n, double c) {
  if (n <= 0) return 0.0f;
#if defined(__CUDA_ARCH__)
  const double mean = __ddiv_rn(S1, double(n));
  const double var = __dsub_rn(__ddiv_rn(S2, double(n)), __dmul_rn(mean, mean));
  const double sigma = __dsqrt_rn(var > 0.0 ? var : 0.0);
  return __double2float_rn(__dmul_rn(c, sigma));
#else
  const double mean = S1 / double(n);
  const double var = S2 / double(n) - mean * mean;
  const double sigma = __builtin_sqrt(var > 0.0 ? var : 0.0);
  return float(c * sigma);
#endif
}

//! y clamped to [-clip, clip] (clip >= 0; NaN y stays NaN: the caller flags it).
GRADCOMP_HD float clamp(float y, float clip) { return y > clip ? clip : y < -clip ? -clip : y; }

//! The 2-bit code of y (clamped value yc) with the block scale s (finite, > 0) and uniform u.
GRADCOMP_HD uint32_t code(float yc, float s, float u) {
  const float a = common::bits_float(common::float_bits(yc) & 0x7FFFFFFFu);
  if (!(u < common::div_rn(a, s))) return 0u;
  return (common::float_bits(yc) & 0x80000000u) ? 3u : 1u;
}

//! D = fl(s * b) of a 2-bit code, b = +1 (01), -1 (11), 0 (00): +-s or 0, NaN when s is NaN
//! (code 10 never occurs; the callers treat it as corrupt).
GRADCOMP_HD float value(uint32_t c, float s) { return common::mul_rn(s, c == 1u ? 1.0f : c == 3u ? -1.0f : 0.0f); }

} // namespace gradcomp::terngrad
