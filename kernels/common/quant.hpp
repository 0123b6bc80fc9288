// SPDX-License-Identifier: Apache-2.0
// Element math of the block quantizers (codecs fp8 / int8 / int4), shared by the CPU and CUDA
// backends. Every function is GRADCOMP_HD and bit-exact:
//   * float32 -> float8_e4m3fn / float8_e5m2, round to nearest even, as ml_dtypes converts
//     (e4m3fn: no infinity, values rounding above 448 (> 464) and NaN/inf -> NaN 0x7F|sign; e5m2:
//     values rounding above 57344 (>= 61440) -> inf 0x7C|sign, NaN -> 0x7E|sign, inf -> 0x7C|sign;
//     -0.0 and values rounding to zero keep the sign);
//   * the float8 codes back to float32 (exact);
//   * the block decode scale d (docs/contracts.md section 3): d = fl(amax / max_finite) over the block's
//     finite values, 1 for a block with no non-zero finite value, raised to the smallest normal
//     float32 if smaller; or (scale=e8m0, the OCP MX element scale) d = 2^ceil(log2 q) with
//     q = fl(amax / max_finite), clamped to [2^-127, 2^127], stored as its float8_e8m0fnu byte;
//   * round to nearest even to an integer for |q| < 2^22 (int8 / int4 codes).
// References the tests hold these to: ml_dtypes (Python), a table search over all 256 codes and a
// float64 evaluation of the e8m0 rule (C++), and the CUDA hardware convert (cuda_fp8.h).
#pragma once

#include <cstdint>

#include "math.hpp"

namespace gradcomp::common {

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;
inline constexpr uint32_t kFloatMinNormalBits = 0x00800000u; // 2^-126

// ---- float8 ------------------------------------------------------------------------------------------
//! float32 -> float8 with M mantissa bits and the given exponent bias, for a finite |v| given by
//! its bits `a`: the magnitude code before the format's overflow rule (may exceed the largest
//! code). |v| is rounded to a multiple of the float8 quantum 2^(max(e, 1 - Bias) - M) (e its
//! exponent) by adding and subtracting c = 2^(max(e, 1 - Bias) + 23 - M): the float32 addition
//! rounds to nearest even, the subtraction is exact. Exponents above Bias + 2 all overflow, so c
//! is capped there. The rounded value's bits give the code (normal range: drop 23 - M bits and
//! rebias; subnormal range: the value over the smallest subnormal, an integer in [0, 2^M]).
//! Branch-free, so that the CPU loops vectorize; identical to ml_dtypes' conversion for all 2^32
//! inputs (checked once exhaustively against a bit-manipulation version; tests/cpp/test_quant.cpp
//! checks it against a search over the codes).
template <int M, int Bias> GRADCOMP_HD uint32_t fp8_magnitude(uint32_t a) {
  constexpr uint32_t kMinNormal = uint32_t(127 + 1 - Bias) << 23;  // 2^(1 - Bias)
  constexpr uint32_t kCap = uint32_t(127 + Bias + 2) << 23;
  uint32_t e = a & 0x7F800000u;
  e = e < kMinNormal ? kMinNormal : (e > kCap ? kCap : e);
  const float c = bits_float(e + (uint32_t(23 - M) << 23));
  const float rv = add_raw(add_raw(bits_float(a), c), -c);
  const uint32_t rb = float_bits(rv);
  const uint32_t normal = (rb >> (23 - M)) - (uint32_t(127 - Bias) << M);
  // the subnormal branch converts only values below 2^(1 - Bias) (a select, not a branch: the
  // loops still vectorize); converting every rv would be undefined for |rv| >= 2^31 (UBSan)
  const float sv = rb < kMinNormal ? rv : 0.0f;
  const uint32_t sub = uint32_t(int32_t(mul_raw(sv, bits_float(uint32_t(127 + Bias - 1 + M) << 23))));
  return rb < kMinNormal ? sub : normal;
}

//! float32 -> float8_e4m3fn bits (ml_dtypes' conversion). 464, halfway between 448 and the NaN
//! code's 480, rounds to even (448); anything rounding above 448, and NaN and +-inf, gives NaN.
GRADCOMP_HD uint8_t float_to_e4m3fn(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // inf and NaN go in as 2^32, which rounds far above 448: NaN (written so that GCC vectorizes it)
  const uint32_t m = fp8_magnitude<3, 7>(a < 0x7F800000u ? a : 0x4F800000u);
  return uint8_t(sign | (m > 0x7Eu ? 0x7Fu : m));
}
//! float32 -> float8_e5m2 bits (ml_dtypes' conversion). 61440, halfway between 57344 and 2^16,
//! rounds to even: inf; NaN -> 0x7E|sign, +-inf -> 0x7C|sign.
GRADCOMP_HD uint8_t float_to_e5m2(float v) {
  const uint32_t u = float_bits(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t m = fp8_magnitude<2, 15>(a < 0x7F800000u ? a : 0u);
  const uint32_t finite = m >= 0x7Cu ? 0x7Cu : m;
  return uint8_t(sign | (a > 0x7F800000u ? 0x7Eu : a == 0x7F800000u ? 0x7Cu : finite));
}

//! float8_e4m3fn bits -> float32 (exact; 0x7F / 0xFF -> the canonical quiet NaN with the sign).
//! Branch-free (the CPU decode loops vectorize).
GRADCOMP_HD float e4m3fn_to_float(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
  const uint32_t normal = ((e + 120u) << 23) | (m << 20);
  const uint32_t sub = float_bits(mul_raw(float(int32_t(m)), 0.001953125f));  // m * 2^-9, exact
  const uint32_t mag = (c & 0x7Fu) == 0x7Fu ? 0x7FC00000u : (e == 0u ? sub : normal);
  return bits_float(sign | mag);
}
//! float8_e5m2 bits -> float32 (exact; the NaN codes -> the canonical quiet NaN with the sign).
GRADCOMP_HD float e5m2_to_float(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t e = (c >> 2) & 0x1Fu, m = c & 3u;
  const uint32_t normal = ((e + 112u) << 23) | (m << 21);
  const uint32_t sub = float_bits(mul_raw(float(int32_t(m)), 1.52587890625e-05f));  // m * 2^-16, exact
  const uint32_t special = m == 0u ? 0x7F800000u : 0x7FC00000u;
  const uint32_t mag = e == 31u ? special : (e == 0u ? sub : normal);
  return bits_float(sign | mag);
}

// ---- block scales ----------------------------------------------------------------------------------------
//! |v| for the block amax, 0 for a non-finite v (amax runs over the finite values; max is order-free).
GRADCOMP_HD float finite_abs(float v) {
  const uint32_t a = float_bits(v) & 0x7FFFFFFFu;
  return bits_float(a < 0x7F800000u ? a : 0u);
}

//! The float32 decode scale of a block whose finite |values| have maximum `amax` (>= 0):
//! fl(amax / max_finite), 1 when amax is 0, raised to the smallest normal float32.
GRADCOMP_HD float block_scale(float amax, float max_finite) {
  if (amax == 0.0f) return 1.0f;
  const float d = div_raw(amax, max_finite);
  return float_bits(d) < kFloatMinNormalBits ? bits_float(kFloatMinNormalBits) : d;
}

//! The e8m0 scale of a block (OCP MX element scale, rounded up): the byte e + 127 of d = 2^e,
//! e = ceil(log2 q), q = fl(amax / max_finite), e clamped to [-127, 127] (a q that underflows to 0
//! gives -127); 127 (d = 1) when amax is 0.
GRADCOMP_HD uint8_t block_scale_e8m0(float amax, float max_finite) {
  if (amax == 0.0f) return 127u;
  const uint32_t q = float_bits(div_raw(amax, max_finite));
  int e;
  if (q >= kFloatMinNormalBits) {
    e = int(q >> 23) - 127 + ((q & 0x7FFFFFu) != 0u ? 1 : 0);
  } else {  // subnormal q = m * 2^-149 (m >= 1): ceil(log2 m) - 149
    uint32_t m = q, bits = 0;
    while ((1u << bits) < m) ++bits;  // ceil(log2 m), m < 2^23
    e = int(bits) - 149;
  }
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return uint8_t(e + 127);
}
//! The float32 value of an e8m0 scale byte: 2^(byte - 127) (byte 0: 2^-127, a subnormal;
//! byte 255: NaN).
GRADCOMP_HD float e8m0_to_float(uint8_t b) {
  if (b == 255u) return bits_float(0x7FC00000u);
  return bits_float(b == 0u ? 0x00400000u : uint32_t(b) << 23);
}

// ---- integers ------------------------------------------------------------------------------------------------
//! Round to nearest even to an integer, for |q| < 2^22 (exact: the addition rounds in binary32).
GRADCOMP_HD float round_half_even(float q) { return add_raw(add_raw(q, 12582912.0f), -12582912.0f); }

//! The stochastic rounding of int8 / int4 (`rounding=stochastic`): with l = floor(q), the code is
//! l + (u < fl(q - l)) clamped to [-kmax, kmax] (up with probability q - l: E[code] = q inside the
//! range); q NaN (a block holding a non-finite value, whose scale is NaN) gives 0. q - l is exact
//! (|q| < 2^23 here: |q| <= kmax up to a rounding).
GRADCOMP_HD int32_t int_code_sr(float q, float u, float kmax) {
  if (q != q) return 0;
#if defined(__CUDA_ARCH__)
  const float l = floorf(q);
#else
  const float l = __builtin_floorf(q);
#endif
  const float c = add_raw(l, u < add_raw(q, -l) ? 1.0f : 0.0f);
  return int32_t(c > kmax ? kmax : (c < -kmax ? -kmax : c));
}

} // namespace gradcomp::common
