// SPDX-License-Identifier: Apache-2.0
// Stochastic rounding of float32 to bfloat16 with Philox4x32-10 uniforms keyed by the EncodeContext
// (codec `bf16:rounding=stochastic`, docs/contracts.md section 3), shared by the CPU and CUDA
// backends so that the same key gives the same packet on both. Integer operations only.
//
// The random bits, for an encode of n elements with EncodeContext {seed, step, bucket, chunk}
// (all arithmetic modulo 2^32, words little-endian; philox4x32_10(counter, key) as in philox.hpp):
//   1. the stream (one call, on the host):
//        (m0, m1, m2, m3) = philox4x32_10({step, bucket, chunk, kSroundTag},
//                                         {seed mod 2^32, seed >> 32})
//   2. the bits of group j = i / 8 (elements 8j .. 8j + 7; one call per group):
//        (w0, w1, w2, w3) = philox4x32_10({j mod 2^32, j >> 32, m2, m3}, {m0, m1})
//   3. element i takes the 16-bit unit k = i mod 8 of (w0, w1, w2, w3):
//        R_i = (w[k / 2] >> (16 * (k mod 2))) & 0xFFFF
//      (the 16 bytes w0 w1 w2 w3 little-endian, read as eight little-endian u16, in order).
// So every element's uniform depends on all of (seed, step, bucket, chunk) and on its index in the
// encoded tensor, and on nothing else: not the thread count, the backend or a global generator.
//
// The rounding of y (float32 bits u, magnitude bits a = u & 0x7FFFFFFF, sign s = u & 0x80000000):
//   NaN (a > 0x7F800000):  0x7FC0 | s >> 16, as the round-to-nearest cast;
//   +-inf (a == 0x7F800000): 0x7F80 | s >> 16;
//   finite:               (s >> 16) | ((a + R) >> 16).
// For finite y the result is the bfloat16 below |y| (truncation) or the one above it, up with
// probability (a & 0xFFFF) / 65536 = (|y| - lo) / (hi - lo): E[q] = y exactly (unbiased), and y == q
// whenever y is a bfloat16 (the low 16 bits zero), so +-0 stay +-0. At the top of the finite range
// the code above 0x7F7F (3.3895314e38, the largest finite bfloat16) is 0x7F80 = inf: a finite
// |y| in (0x7F7F0000, 0x7F7FFFFF] (up to FLT_MAX) becomes +-inf with probability (a & 0xFFFF) /
// 65536 (FLT_MAX: 65535 / 65536), as if inf were the next grid point 2^128; the packet is then
// flagged non-finite like an overflowing round-to-nearest cast.
#pragma once

#include <cstdint>

#include "math.hpp"
#include "philox.hpp"

namespace gradcomp::sround {

//! Counter word 3 of the stream derivation: ASCII "BF16" read as a big-endian u32 (it tells this
//! use of the seed apart from any other keyed draw).
inline constexpr uint32_t kSroundTag = 0x42463136u;
//! Elements per Philox4x32-10 call (128 bits, 16 per element).
inline constexpr int kGroup = 8;

//! The Philox key and counter words 2-3 of an encode's stream (step 1 above).
struct Key {
  uint32_t k0, k1; //!< the key of the per-group calls
  uint32_t c2, c3; //!< their counter words 2 and 3
};

GRADCOMP_HD Key derive(uint64_t seed, uint32_t step, uint32_t bucket, uint32_t chunk) {
  const philox::Ctr4x32 m =
      philox::philox4x32_10({step, bucket, chunk, kSroundTag}, {uint32_t(seed), uint32_t(seed >> 32)});
  return Key{m[0], m[1], m[2], m[3]};
}

//! The 128 random bits of group j (step 2 above).
GRADCOMP_HD philox::Ctr4x32 group_bits(const Key& k, uint64_t j) {
  return philox::philox4x32_10({uint32_t(j), uint32_t(j >> 32), k.c2, k.c3}, {k.k0, k.k1});
}

//! The 16-bit uniform of element 8j + e of a group's bits (step 3 above), e in [0, 8).
//! (A select chain, not w[e >> 1]: a run-time index into the array would put it in local memory
//! in a CUDA loop that is not unrolled.)
GRADCOMP_HD uint32_t uniform16(const philox::Ctr4x32& w, int e) {
  const uint32_t word = e < 2 ? w[0] : e < 4 ? w[1] : e < 6 ? w[2] : w[3];
  return (word >> (16 * (e & 1))) & 0xFFFFu;
}

//! float32 -> bfloat16 bits, rounded up in magnitude iff (low 16 bits of |y|) + r16 >= 2^16.
GRADCOMP_HD uint16_t float_to_bf16_sr_bits(float y, uint32_t r16) {
  const uint32_t u = common::float_bits(y);
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t s = (u >> 16) & 0x8000u;
  if (a > 0x7F800000u) return uint16_t(s | 0x7FC0u);  // NaN: the canonical quiet NaN, sign kept
  if (a == 0x7F800000u) return uint16_t(s | 0x7F80u); // inf
  return uint16_t(s | ((a + r16) >> 16));
}

} // namespace gradcomp::sround
