// SPDX-License-Identifier: Apache-2.0
// CRC-32C (Castagnoli) of the `integrity=crc32c` packet section (docs/contracts.md section 3), shared
// by the host and the CUDA kernels. The published algorithm: RFC 3720 (iSCSI), appendix B.4, the
// reflected polynomial 0x82F63B78, initial value and final XOR 0xFFFFFFFF; check value
// crc32c("123456789") = 0xE3069283. Tested against the google-crc32c package
// (tests/python/test_integrity.py).
//
// The register form used here (`raw`): initial value 0, no final XOR, so that it is linear:
//   raw(A || B) = shift(raw(A), |B|) ^ raw(B), shift(c, n) = c * x^(8n) mod P (reflected),
//   crc32c(M) = raw(M) ^ shift(0xFFFFFFFF, |M|) ^ 0xFFFFFFFF.
// Chunks of a packet are therefore summed in parallel and combined (zlib's crc32_combine method:
// multmodp and x^(2^k) mod P).
#pragma once

#include <cstddef>
#include <cstdint>

#include "math.hpp"

namespace gradcomp::crc32c {

inline constexpr uint32_t kPoly = 0x82F63B78u; //!< reflected Castagnoli polynomial
inline constexpr uint32_t kOne = 0x80000000u;  //!< x^0 in the reflected representation

//! Entry i of the byte table: the register after shifting byte i through 8 steps.
GRADCOMP_HD uint32_t table_entry(uint32_t i) {
  uint32_t c = i;
  for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
  return c;
}

//! The register after the bytes p[0, n), one table lookup per byte.
GRADCOMP_HD uint32_t update(uint32_t crc, const uint8_t* p, size_t n, const uint32_t* table) {
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return crc;
}

//! a * b mod P (reflected; zlib's multmodp).
GRADCOMP_HD uint32_t multmodp(uint32_t a, uint32_t b) {
  if (a == 0) return 0;
  uint32_t m = kOne, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

//! x^(2^k) mod P for k = 0..31 (x2n[0] = x, each the square of the previous).
struct X2n {
  uint32_t v[32];
};
GRADCOMP_HD X2n make_x2n() {
  X2n t{};
  uint32_t p = kOne >> 1; // x^1
  for (int k = 0; k < 32; ++k) {
    t.v[k] = p;
    p = multmodp(p, p);
  }
  return t;
}

//! raw register c moved past n zero bytes: c * x^(8 n) mod P.
GRADCOMP_HD uint32_t shift(uint32_t c, uint64_t n, const X2n& x2n) {
  int k = 3; // x^(8 n) = x^(n 2^3)
  uint32_t p = kOne;
  while (n) {
    if (n & 1u) p = multmodp(x2n.v[k & 31], p);
    n >>= 1;
    ++k;
  }
  return multmodp(p, c);
}

//! The CRC-32C of a message of n bytes from its raw register.
GRADCOMP_HD uint32_t finish(uint32_t raw, uint64_t n, const X2n& x2n) {
  return raw ^ shift(0xFFFFFFFFu, n, x2n) ^ 0xFFFFFFFFu;
}

} // namespace gradcomp::crc32c
