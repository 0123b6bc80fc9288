// SPDX-License-Identifier: Apache-2.0
// The fixed reduction tree of the chunk scales (onebit's l2 and mean_abs), shared by the CPU and
// CUDA backends so that their sums, and so their packets, agree bit for bit
// (docs/contracts.md section 2).
//
// A chunk of `len` elements is cut into tiles of kSumTile elements (the last one shorter). The sum
// of a tile: lane l (0 <= l < kSumLanes) adds the terms of elements l, l + 32, l + 64, ... of the
// tile in that order into a binary64 accumulator starting at +0.0; then lane_tree() folds the 32
// lanes (v[l] += v[l + 16] for l < 16, then offsets 8, 4, 2, 1), which is a CUDA warp's shuffle-down
// reduction. The sum of a chunk: the same lane rule over its tile sums (lane l adds tiles l, l + 32,
// ... in order), then lane_tree(). Terms are binary64 and exact for float32 inputs (y * y of a
// float32 y has at most 48 significant bits; |y| is exact), so only the additions round, in this
// one order on both backends; a missing term is the same as a +0.0 one (s + 0.0 == s for s >= 0).
#pragma once

#include <cstdint>

#include "math.hpp"

namespace gradcomp::common {

inline constexpr int kSumLanes = 32;
inline constexpr int64_t kSumTile = 4096;

GRADCOMP_HD double dadd(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
GRADCOMP_HD double dmul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

//! Fold 32 lane sums in the fixed tree (offsets 16, 8, 4, 2, 1); returns the total.
GRADCOMP_HD double lane_tree(double (&v)[kSumLanes]) {
  for (int o = kSumLanes / 2; o >= 1; o /= 2)
    for (int l = 0; l < o; ++l) v[l] = dadd(v[l], v[l + o]);
  return v[0];
}

//! The chunk scale from its fixed-order sum S of `len` terms: l2 = fl32(sqrt(S / len)) (the RMS,
//! DeepSpeed's ||x||_2 / sqrt(n)), mean_abs = fl32(S / len), both evaluated in binary64 and rounded
//! once to float32; a NaN sum gives the canonical quiet NaN 0x7FC00000, an infinite one +inf.
GRADCOMP_HD float chunk_scale(double S, int64_t len, bool l2) {
  if (S != S) return bits_float(0x7FC00000u);
  if (len <= 0) return 0.0f;
#if defined(__CUDA_ARCH__)
  const double m = __ddiv_rn(S, double(len));
  return __double2float_rn(l2 ? __dsqrt_rn(m) : m);
#else
  const double m = S / double(len);
  return float(l2 ? __builtin_sqrt(m) : m);
#endif
}

} // namespace gradcomp::common
