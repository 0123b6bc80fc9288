// SPDX-License-Identifier: Apache-2.0
// Element math shared by the CPU and CUDA backends (docs/contracts.md section 1: kernels/common is the only
// code both backends run). Everything here is GRADCOMP_HD: __host__ __device__ under nvcc, plain
// inline functions under g++. The tests check these functions against independent references
// (numpy, torch, ml_dtypes, plain loops), never against themselves.
#pragma once

#include <cstdint>
#include <cstring>

// On the host the helpers are always inlined: the CPU kernels are compiled once per instruction
// set (kernels/cpu/isa.hpp), and an out-of-line copy of an inline function would be one symbol the
// linker shares between the variants (tests/check_portable.sh).
#if defined(__CUDACC__)
#define GRADCOMP_HD __host__ __device__ __forceinline__
#else
#define GRADCOMP_HD inline __attribute__((always_inline))
#endif
// Full unrolling of a loop with a constant trip count on the device (so that array indices become
// constants and small arrays in kernel parameters or registers are never copied to local memory).
#if defined(__CUDA_ARCH__)
#define GRADCOMP_UNROLL _Pragma("unroll")
#else
#define GRADCOMP_UNROLL
#endif

namespace gradcomp::common {

GRADCOMP_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
GRADCOMP_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Fixed binary32 round-to-nearest arithmetic (docs/contracts.md section 2). On the device the _rn
// intrinsics are never contracted into FMA; on the host the library is built with
// -ffp-contract=off and without fast-math.
//
// NaN results follow one rule on both backends, so that packets and residuals are byte-identical
// (the GPU alone would return the canonical NaN 0x7FFFFFFF, x86 the first NaN operand, and the
// compiler may swap the operands of a commutative operation): the result is the first operand
// if it is a NaN, else the second if it is a NaN, quieted (bit 22 set) with sign and payload kept;
// an invalid operation on non-NaN operands (inf - inf, 0 * inf, 0 / 0, inf / inf) gives
// 0xFFC00000. This is the x86 SSE rule, so numpy on x86 computes the same bits.
GRADCOMP_HD bool is_nan_bits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
GRADCOMP_HD float nan_rule(float r, float a, float b) {
  const uint32_t ua = float_bits(a), ub = float_bits(b);
  const uint32_t q = is_nan_bits(ua) ? (ua | 0x400000u) : is_nan_bits(ub) ? (ub | 0x400000u) : 0xFFC00000u;
  return is_nan_bits(float_bits(r)) ? bits_float(q) : r;
}

// Raw operations: whatever NaN the hardware gives (for values whose NaN result is discarded).
GRADCOMP_HD float add_raw(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GRADCOMP_HD float sub_raw(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
GRADCOMP_HD float mul_raw(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

GRADCOMP_HD float div_raw(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// On an x86-64 host the hardware already follows the rule except when both operands are NaN and
// the compiler put the second one first (SSE/AVX return the NaN operand quieted when one operand
// is a NaN, whichever it is, and 0xFFC00000 for an invalid operation), so only the first operand
// is checked there: a third of the selects, in the CPU kernels' inner loops.
#if !defined(__CUDA_ARCH__) && defined(__x86_64__) && defined(__SSE2_MATH__)
#define GRADCOMP_X86_NAN_RULE 1
GRADCOMP_HD float x86_nan_rule(float r, float a) {
  const uint32_t ua = float_bits(a);
  return is_nan_bits(ua) ? bits_float(ua | 0x400000u) : r;
}
GRADCOMP_HD float add_rn(float a, float b) { return x86_nan_rule(a + b, a); }
GRADCOMP_HD float sub_rn(float a, float b) { return x86_nan_rule(a - b, a); }
GRADCOMP_HD float mul_rn(float a, float b) { return x86_nan_rule(a * b, a); }
GRADCOMP_HD float div_rn(float a, float b) { return x86_nan_rule(a / b, a); }
#else
GRADCOMP_HD float add_rn(float a, float b) { return nan_rule(add_raw(a, b), a, b); }
GRADCOMP_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return nan_rule(__fsub_rn(a, b), a, b);
#else
  return nan_rule(a - b, a, b);
#endif
}
GRADCOMP_HD float mul_rn(float a, float b) { return nan_rule(mul_raw(a, b), a, b); }
GRADCOMP_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return nan_rule(__fdiv_rn(a, b), a, b);
#else
  return nan_rule(a / b, a, b);
#endif
}
#endif

GRADCOMP_HD bool is_finite_bits(uint32_t u) { return (u & 0x7F800000u) != 0x7F800000u; }

// ---- float16 (IEEE binary16) ---------------------------------------------------------------
// float32 -> float16, round to nearest even. NaN -> canonical quiet NaN 0x7E00 with the sign kept;
// |x| >= 65520 (halfway above the largest finite 65504) -> +-inf. Branch-free so that the CPU
// loops vectorize.
GRADCOMP_HD uint16_t float_to_half_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // normal range: rebias the exponent (127 - 15 = 112) and round the 13 dropped bits to even
  const uint32_t normal = ((a + 0x0FFFu + ((a >> 13) & 1u)) >> 13) - (112u << 10);
  // subnormal range (|x| < 2^-14): adding 0.5 aligns the value to multiples of 2^-24 and the
  // float addition rounds to nearest even; the low bits are then the half mantissa (0x400 when
  // it rounds up into the smallest normal, which is the right encoding too).
  const uint32_t sub = float_bits(add_raw(bits_float(a), 0.5f)) - 0x3F000000u;
  uint32_t h = a < 0x38800000u ? sub : normal;
  h = a >= 0x477FF000u ? 0x7C00u : h;
  h = a > 0x7F800000u ? 0x7E00u : h;
  return static_cast<uint16_t>(sign | h);
}
// float16 -> float32 (exact).
GRADCOMP_HD float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  const uint32_t normal = ((e + 112u) << 23) | (m << 13);
  const uint32_t special = 0x7F800000u | (m << 13);
  // subnormal: m * 2^-24, exact in binary32
  const uint32_t sub = float_bits(mul_raw(static_cast<float>(m), 5.9604644775390625e-8f));
  uint32_t r = e == 0 ? sub : normal;
  r = e == 0x1Fu ? special : r;
  return bits_float(sign | r);
}

// ---- bfloat16 -------------------------------------------------------------------------------
// float32 -> bfloat16, round to nearest even; NaN -> canonical quiet NaN 0x7FC0 with the sign kept;
// values rounding past the largest finite bfloat16 become +-inf.
GRADCOMP_HD uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7FC0u;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}
GRADCOMP_HD float bf16_bits_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// ---- top-k keys -------------------------------------------------------------------------------
// The radix key of |y| (docs/contracts.md section 3): the float32 bits with the sign cleared, so that
// -0.0 == +0.0 and unsigned order is magnitude order; every NaN maps to one key above +inf.
inline constexpr uint32_t kNaNKey = 0x7F800001u;
inline constexpr uint32_t kInfKey = 0x7F800000u;
GRADCOMP_HD uint32_t abs_key(float y) {
  const uint32_t a = float_bits(y) & 0x7FFFFFFFu;
  return a > kNaNKey ? kNaNKey : a;
}

// Radix select digits over the 31-bit keys: 11 + 11 + 9 bits, most significant first.
inline constexpr int kRadixLevels = 3;
inline constexpr int kRadixShift[kRadixLevels] = {20, 9, 0};
inline constexpr int kRadixBits[kRadixLevels] = {11, 11, 9};
inline constexpr int kRadixBuckets = 2048;
// Digit 0 of every non-finite key (inf and the NaN key); no finite key has it.
inline constexpr uint32_t kNonFiniteDigit0 = kInfKey >> 20;

} // namespace gradcomp::common
