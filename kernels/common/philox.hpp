// SPDX-License-Identifier: Apache-2.0
// Philox4x32-10 and Philox4x64-10, the counter-based generators of J. K. Salmon, M. A. Moraes,
// R. O. Dror and D. E. Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11 (2011),
// section 3.3 (the Philox S-box) with the constants of Random123 1.x (philox.h), written here so
// that gradcomp needs no Random123 headers (issue 20: the package builds from PyPI alone).
//
// Shapes and units: a counter is four words and a key two words, of 32 bits (philox4x32) or
// 64 bits (philox4x64); the result is four words of the same width. One round, with
// (hi, lo) = the high and low halves of the double-width product:
//   (hi0, lo0) = M0 * c0,  (hi1, lo1) = M1 * c2
//   c = {hi1 ^ c1 ^ k0,  lo1,  hi0 ^ c3 ^ k1,  lo0}
// ten rounds, the key bumped by the Weyl constants (k0 += W0, k1 += W1, modulo 2^width) before
// every round but the first:
//   4x32: M0 = 0xD2511F53, M1 = 0xCD9E8D57, W0 = 0x9E3779B9, W1 = 0xBB67AE85
//   4x64: M0 = 0xD2E7470EE14C6C93, M1 = 0xCA5A826395121157,
//         W0 = 0x9E3779B97F4A7C15 (golden ratio), W1 = 0xBB67AE8584CAA73B (sqrt(3) - 1)
// philox4x32_10 / philox4x64_10 match Random123's philox4x32_R(10, ...) / philox4x64_R(10, ...)
// (r123::Philox4x32 / r123::Philox4x64) bit for bit: tests/cpp/test_philox.cpp checks Random123's
// known-answer vectors (kat_vectors) and, where Random123 is installed, random counters and keys.
//
// Host and device (GRADCOMP_HD, math.hpp): __umulhi / __umul64hi on the device, a 64-bit product /
// unsigned __int128 on the host. Integer operations only: no floating point, no FMA.
#pragma once

#include <array>
#include <cstdint>

#include "math.hpp"

namespace gradcomp::philox {

using Ctr4x32 = std::array<uint32_t, 4>;
using Key4x32 = std::array<uint32_t, 2>;
using Ctr4x64 = std::array<uint64_t, 4>;
using Key4x64 = std::array<uint64_t, 2>;

inline constexpr uint32_t kM4x32_0 = 0xD2511F53u, kM4x32_1 = 0xCD9E8D57u;
inline constexpr uint32_t kW32_0 = 0x9E3779B9u, kW32_1 = 0xBB67AE85u;
inline constexpr uint64_t kM4x64_0 = 0xD2E7470EE14C6C93ull, kM4x64_1 = 0xCA5A826395121157ull;
inline constexpr uint64_t kW64_0 = 0x9E3779B97F4A7C15ull, kW64_1 = 0xBB67AE8584CAA73Bull;
inline constexpr int kRounds = 10;

//! The high 32 / 64 bits of the full product a * b (the low half is the ordinary product).
GRADCOMP_HD uint32_t mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * b) >> 32);
#endif
}
//! Portable (hosts without unsigned __int128): four 32 x 32 -> 64 partial products.
GRADCOMP_HD uint64_t mulhi64_portable(uint64_t a, uint64_t b) {
  const uint64_t a0 = a & 0xFFFFFFFFu, a1 = a >> 32, b0 = b & 0xFFFFFFFFu, b1 = b >> 32;
  const uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
  const uint64_t mid = (p00 >> 32) + (p01 & 0xFFFFFFFFu) + (p10 & 0xFFFFFFFFu);  // < 3 * 2^32
  return p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
}
GRADCOMP_HD uint64_t mulhi64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#elif defined(__SIZEOF_INT128__)
  return uint64_t(((unsigned __int128)a * b) >> 64);
#else
  return mulhi64_portable(a, b);
#endif
}

//! Philox4x32 with 10 rounds (Random123's philox4x32_R(10, ctr, key)).
GRADCOMP_HD Ctr4x32 philox4x32_10(Ctr4x32 c, Key4x32 k) {
  GRADCOMP_UNROLL
  for (int r = 0; r < kRounds; ++r) {
    if (r > 0) {
      k[0] += kW32_0;
      k[1] += kW32_1;
    }
    const uint32_t hi0 = mulhi32(kM4x32_0, c[0]), lo0 = kM4x32_0 * c[0];
    const uint32_t hi1 = mulhi32(kM4x32_1, c[2]), lo1 = kM4x32_1 * c[2];
    c = Ctr4x32{hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
  }
  return c;
}

#if !defined(__CUDACC__)
//! Host batch form of philox4x32_10 for the keyed codecs' CPU loops: the four words of the groups
//! g = g0 .. g0 + count - 1, each the call philox4x32_10({g mod 2^32, g >> 32, c2, c3}, key),
//! into out[4 (g - g0) + w] (w = 0..3). The same rounds as philox4x32_10, written over 16
//! counters at a time in structure-of-arrays form so that the compiler vectorizes the 32 x 32 ->
//! 64-bit products (vpmuludq); bitwise the scalar function's results (tests/cpp/test_philox.cpp).
inline void philox4x32_10_groups(uint64_t g0, int64_t count, uint32_t c2, uint32_t c3, Key4x32 key,
                                 uint32_t* out) {
  constexpr int L = 16;
  for (int64_t b = 0; b < count; b += L) {
    uint32_t x0[L], x1[L], x2[L], x3[L];
    for (int l = 0; l < L; ++l) {
      const uint64_t g = g0 + uint64_t(b + l);
      x0[l] = uint32_t(g);
      x1[l] = uint32_t(g >> 32);
      x2[l] = c2;
      x3[l] = c3;
    }
    uint32_t k0 = key[0], k1 = key[1];
    for (int r = 0; r < kRounds; ++r) {
#pragma omp simd
      for (int l = 0; l < L; ++l) {
        const uint64_t p0 = uint64_t(kM4x32_0) * x0[l], p1 = uint64_t(kM4x32_1) * x2[l];
        const uint32_t n0 = uint32_t(p1 >> 32) ^ x1[l] ^ k0, n2 = uint32_t(p0 >> 32) ^ x3[l] ^ k1;
        x0[l] = n0;
        x1[l] = uint32_t(p1);
        x2[l] = n2;
        x3[l] = uint32_t(p0);
      }
      k0 += kW32_0;
      k1 += kW32_1;
    }
    const int m = int(count - b < L ? count - b : L);
    for (int l = 0; l < m; ++l) {
      out[4 * (b + l) + 0] = x0[l];
      out[4 * (b + l) + 1] = x1[l];
      out[4 * (b + l) + 2] = x2[l];
      out[4 * (b + l) + 3] = x3[l];
    }
  }
}
#endif

//! Philox4x64 with 10 rounds (Random123's philox4x64_R(10, ctr, key)).
GRADCOMP_HD Ctr4x64 philox4x64_10(Ctr4x64 c, Key4x64 k) {
  GRADCOMP_UNROLL
  for (int r = 0; r < kRounds; ++r) {
    if (r > 0) {
      k[0] += kW64_0;
      k[1] += kW64_1;
    }
    const uint64_t hi0 = mulhi64(kM4x64_0, c[0]), lo0 = kM4x64_0 * c[0];
    const uint64_t hi1 = mulhi64(kM4x64_1, c[2]), lo1 = kM4x64_1 * c[2];
    c = Ctr4x64{hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
  }
  return c;
}

} // namespace gradcomp::philox
