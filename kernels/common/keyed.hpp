// SPDX-License-Identifier: Apache-2.0
// One 32-bit Philox4x32-10 word per element from an encode key, shared by the CPU and CUDA
// backends (int8 / int4 rounding=stochastic, qsgd, terngrad; docs/contracts.md section 3): for EncodeContext
// {seed, step, bucket, chunk} and a 32-bit tag naming the use,
//   (m0, m1, m2, m3) = philox4x32_10({step, bucket, chunk, tag}, {seed mod 2^32, seed >> 32})
//   element i: group g = i / 4, (w0, w1, w2, w3) = philox4x32_10({g mod 2^32, g >> 32, m2, m3},
//   {m0, m1}), R_i = w[i mod 4]; its uniform u_i = (R_i >> 8) * 2^-24 in [0, 1) (exact in float32).
// qsgd and terngrad draw theirs through it too, with their own tags (kernels/common/qsgd.hpp,
// terngrad.hpp).
#pragma once

#include <cstdint>

#include "math.hpp"
#include "philox.hpp"

namespace gradcomp::keyed {

struct Key {
  uint32_t k0, k1;
  uint32_t c2, c3;
};

GRADCOMP_HD Key derive(uint32_t tag, uint64_t seed, uint32_t step, uint32_t bucket, uint32_t chunk) {
  const philox::Ctr4x32 m = philox::philox4x32_10({step, bucket, chunk, tag}, {uint32_t(seed), uint32_t(seed >> 32)});
  return Key{m[0], m[1], m[2], m[3]};
}

GRADCOMP_HD philox::Ctr4x32 group_bits(const Key& k, uint64_t g) {
  return philox::philox4x32_10({uint32_t(g), uint32_t(g >> 32), k.c2, k.c3}, {k.k0, k.k1});
}

GRADCOMP_HD float uniform(uint32_t word) { return float(word >> 8) * 5.9604644775390625e-08f; }

//! Word e (0..3) of a group, by a select chain (no run-time index into the array: local memory
//! on CUDA).
GRADCOMP_HD uint32_t word_of(const philox::Ctr4x32& w, int64_t e) {
  return e == 0 ? w[0] : e == 1 ? w[1] : e == 2 ? w[2] : w[3];
}

} // namespace gradcomp::keyed
