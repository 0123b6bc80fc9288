// SPDX-License-Identifier: Apache-2.0
// The element rules of QSGD (codec `qsgd`, docs/contracts.md section 3), shared by the CPU and CUDA
// backends so that the same input and key give the same packet on both. Alistarh, Grubic, Li, Tomioka
// & Vojnovic, "QSGD: Communication-efficient SGD via gradient quantization and encoding", NeurIPS
// 2017, section 3.1 (the stochastic quantizer Q_s with s levels, per bucket of d elements), in
// GRACE's form (Xu et al., "GRACE: A compressed communication framework for distributed machine
// learning", ICDCS 2021: qsgd.py, quantum_num s, bucket_size 128).
//
// Per block of B elements (the last one shorter), with y = x' / W:
//   norm = fl32(sqrt(S)), S the binary64 sum of y^2 over the block in common/reduce.hpp's lane order
//          (lane l adds elements l, l + 32, ... in order; lane_tree folds the 32 lanes); a block
//          holding a non-finite y gets norm = NaN (0x7FC00000) and all-zero codes;
//   per element: q = fl(fl(s / norm) * |y|) (q = 0 when norm = 0), l = floor(q),
//          level = min(s, l + (u < q - l)), code = sign(y) * level (int8, two's complement),
//          u = (R >> 8) * 2^-24 from the element's 32-bit Philox word R (below);
//   decode: D = fl(fl(norm / s) * code).
// E[level] = q (u < q - l with probability q - l): unbiased up to the float32 roundings of q and D
// and the clamp to s (q may exceed s by a rounding). The random words, for EncodeContext {seed,
// step, bucket, chunk}:
//   (m0, m1, m2, m3) = philox4x32_10({step, bucket, chunk, kQsgdTag}, {seed mod 2^32, seed >> 32})
//   element i: group g = i / 4, (w0, w1, w2, w3) = philox4x32_10({g mod 2^32, g >> 32, m2, m3},
//   {m0, m1}), R_i = w[i mod 4].
#pragma once

#include <cmath>
#include <cstdint>

#include "math.hpp"
#include "keyed.hpp"
#include "philox.hpp"

namespace gradcomp::qsgd {

//! Counter word 3 of the stream derivation: ASCII "QSGD" read as a big-endian u32.
inline constexpr uint32_t kQsgdTag = 0x51534744u;
//! Elements per Philox4x32-10 call (one 32-bit word each).
inline constexpr int kGroup = 4;
//! The largest block (one reduce tile of common/reduce.hpp) and the most levels (int8 codes).
inline constexpr int64_t kMaxBlock = 4096;
inline constexpr int kMaxLevels = 127;

using Key = keyed::Key;

//! The stream of an encode (step 1 above): kernels/common/keyed.hpp's derivation with kQsgdTag.
GRADCOMP_HD Key derive(uint64_t seed, uint32_t step, uint32_t bucket, uint32_t chunk) {
  return keyed::derive(kQsgdTag, seed, step, bucket, chunk);
}
using keyed::group_bits;
using keyed::uniform;

//! The block's norm from its fixed-order sum S of y^2: fl32(sqrt(S)); NaN for a block with a
//! non-finite y (`nonfinite`).
GRADCOMP_HD float block_norm(double S, bool nonfinite) {
  if (nonfinite) return common::bits_float(0x7FC00000u);
#if defined(__CUDA_ARCH__)
  return __double2float_rn(__dsqrt_rn(S));
#else
  return float(__builtin_sqrt(S));
#endif
}

//! The int8 code of y with ratio = fl(s / norm) (0 when norm is 0 or NaN: the caller passes 0)
//! and uniform u.
GRADCOMP_HD int32_t code(float y, float ratio, float u, int levels) {
  const uint32_t sign = common::float_bits(y) & 0x80000000u;
  const float q = common::mul_rn(ratio, common::bits_float(common::float_bits(y) & 0x7FFFFFFFu));
#if defined(__CUDA_ARCH__)
  const float l = floorf(q);
#else
  const float l = std::floor(q);
#endif
  const int32_t up = u < common::sub_rn(q, l) ? 1 : 0;
  const int32_t level = int32_t(l) + up < levels ? int32_t(l) + up : levels;
  return sign ? -level : level;
}

} // namespace gradcomp::qsgd
