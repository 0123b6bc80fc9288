// SPDX-License-Identifier: Apache-2.0
// An independent reference of bf16:rounding=stochastic (docs/contracts.md section 3) for the C++
// tests (test_stochastic_rounding.cpp, and the CUDA test in test_cuda_codecs.cu): written from the
// contract's text, not from kernels/common/sround.hpp.
//   * Philox4x32-10 from its specification (Salmon, Moraes, Dror & Shaw, "Parallel random numbers:
//     as easy as 1, 2, 3", SC'11, section 3.3 and Random123's constants): the checks against
//     Random123's known answers are in test_stochastic_rounding.cpp.
//   * The stream: (m0..m3) = philox({step, bucket, chunk, 0x42463136}, {seed lo, seed hi}); group j
//     of 8 elements: philox({j lo, j hi, m2, m3}, {m0, m1}); element i the i % 8-th little-endian
//     16-bit unit of the group's 128 bits.
//   * The rounding, by value in binary64: with lo the largest bfloat16 <= |y| and gap the spacing
//     above it (2^128 standing for the code past the largest finite value), frac = 65536 (|y| - lo) /
//     gap (an integer); the magnitude rounds up to lo + gap iff frac + R >= 65536; NaN -> 0x7FC0 and
//     inf -> 0x7F80 with the sign.
// Header only, host code, no GoogleTest and no library dependency.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ref.hpp"  // ref::bits / ref::from_bits

namespace sref {

struct U4 {
  uint32_t v[4];
};

//! Philox4x32 with 10 rounds: per round, with the 64-bit products of the multipliers
//! M0 = 0xD2511F53, M1 = 0xCD9E8D57 split into (hi, lo) 32-bit halves (Random123's word order):
//!   x = {hi(M1 x2) ^ x1 ^ k0, lo(M1 x2), hi(M0 x0) ^ x3 ^ k1, lo(M0 x0)},
//! then the key bumped by the Weyl constants W0 = 0x9E3779B9, W1 = 0xBB67AE85 (mod 2^32).
inline U4 philox4x32_10(U4 x, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * x.v[0];
    const uint64_t p1 = uint64_t(0xCD9E8D57u) * x.v[2];
    const U4 y{{uint32_t(p1 >> 32) ^ x.v[1] ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ x.v[3] ^ k1, uint32_t(p0)}};
    x = y;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return x;
}

//! The 16-bit uniform of element i of an encode with key (seed, step, bucket, chunk).
struct Stream {
  uint32_t k0, k1, c2, c3;
  Stream(uint64_t seed, uint32_t step, uint32_t bucket, uint32_t chunk) {
    const U4 m = philox4x32_10(U4{{step, bucket, chunk, 0x42463136u}}, uint32_t(seed & 0xFFFFFFFFu),
                               uint32_t(seed >> 32));
    k0 = m.v[0];
    k1 = m.v[1];
    c2 = m.v[2];
    c3 = m.v[3];
  }
  uint32_t uniform(uint64_t i) const {
    const uint64_t j = i / 8;
    const U4 w = philox4x32_10(U4{{uint32_t(j & 0xFFFFFFFFu), uint32_t(j >> 32), c2, c3}}, k0, k1);
    uint8_t bytes[16];
    for (int k = 0; k < 4; ++k)
      for (int b = 0; b < 4; ++b) bytes[4 * k + b] = uint8_t(w.v[k] >> (8 * b));
    const int u = int(i % 8);
    return uint32_t(bytes[2 * u]) | (uint32_t(bytes[2 * u + 1]) << 8);
  }
};

//! The spacing of the bfloat16 grid just above |a| (a finite, >= 0): 2^-133 below 2^-126 (the
//! subnormals), else 2^(e - 7) for a in [2^e, 2^(e+1)).
inline double bf16_gap(double a) {
  if (a < std::ldexp(1.0, -126)) return std::ldexp(1.0, -133);
  int ex = 0;
  (void)std::frexp(a, &ex);  // a = m 2^ex, m in [0.5, 1): a in [2^(ex-1), 2^ex)
  return std::ldexp(1.0, ex - 1 - 7);
}

//! float32 y -> bfloat16 bits with uniform r16 in [0, 65536), by value (see the file comment).
inline uint16_t round_sr(float y, uint32_t r16) {
  const uint16_t sign = std::signbit(y) ? 0x8000 : 0;
  if (std::isnan(y)) return sign | 0x7FC0;
  if (std::isinf(y)) return sign | 0x7F80;
  const double a = std::fabs(double(y));
  const double gap = bf16_gap(a);
  const double lo = std::floor(a / gap) * gap;  // exact: powers of two and few significant bits
  const double frac = (a - lo) / gap * 65536.0; // an integer in [0, 65536)
  const double q = frac + double(r16) >= 65536.0 ? lo + gap : lo;
  if (q >= std::ldexp(1.0, 128)) return sign | 0x7F80;  // past the largest finite bfloat16
  return uint16_t(sign | (ref::bits(float(q)) >> 16));  // q is a bfloat16 value: exact in float32
}

} // namespace sref
