// SPDX-License-Identifier: Apache-2.0
// AVX-512 loops of the block quantizers' CPU backend (kernels/cpu/blockq.cpp includes this inside
// its variant namespace, after Quant<K>; only the avx512 variant, or a native build on such a
// processor, compiles them). Each loop is the 16-lane form of a plain loop in blockq.cpp and gives
// the same bits: the same fixed float32 expressions (kernels/common/quant.hpp, math.hpp), with the
// NaN rule of math.hpp spelled out where two operands can both be NaN. tests/cpp/test_isa.cpp
// compares this variant's packets, residuals and decoded values with the avx2 and generic ones on
// normal, wide-range and special values; tests/cpp/test_quant.cpp holds it to plain-loop and
// code-search references. (GCC's own vectorization of the plain loops packs codes through words
// and spends mask moves on the boundary test; these loops run about twice as fast.)
#pragma once

#include <immintrin.h>

#include <cstdint>

#define GRADCOMP_BLOCKQ_AVX512 1

namespace simd {

inline __m512i u32(uint32_t v) { return _mm512_set1_epi32(int32_t(v)); }
inline __mmask16 tail_mask(int64_t rem) { return rem >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rem) - 1u); }
//! the NaN rule's fix for an operation whose first operand `a` may be a NaN together with the
//! second: the result is a quieted (math.hpp)
inline __m512 first_nan(__m512 r, __m512 a) {
  const __mmask16 n = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(
      _mm512_mask_or_epi32(_mm512_castps_si512(r), n, _mm512_castps_si512(a), u32(0x400000u)));
}

//! 16 codes in 32-bit lanes stored as bytes (a full 16-byte store unless `m` masks lanes off:
//! narrowing stores under a mask are slow on some processors).
inline void store_bytes(uint8_t* p, __mmask16 m, __m512i c) {
  if (m == 0xFFFF) _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(c));
  else _mm512_mask_cvtepi32_storeu_epi8(p, m, c);
}

//! common::fp8_magnitude on 16 lanes of |q| bits.
template <int M, int Bias> __m512i fp8_magnitude(__m512i a) {
  const __m512i min_normal = u32(uint32_t(127 + 1 - Bias) << 23), cap = u32(uint32_t(127 + Bias + 2) << 23);
  __m512i e = _mm512_and_si512(a, u32(0x7F800000u));
  e = _mm512_min_epu32(_mm512_max_epu32(e, min_normal), cap);
  const __m512 c = _mm512_castsi512_ps(_mm512_add_epi32(e, u32(uint32_t(23 - M) << 23)));
  const __m512 rv = _mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(a), c), c);
  const __m512i rb = _mm512_castps_si512(rv);
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rb, 23 - M), u32(uint32_t(127 - Bias) << M));
  const __m512 scale = _mm512_castsi512_ps(u32(uint32_t(127 + Bias - 1 + M) << 23));
  const __m512i sub = _mm512_cvttps_epi32(_mm512_mul_ps(rv, scale));
  return _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(rb, min_normal), normal, sub);
}

//! Quant<K>::code on 16 lanes: the code in each 32-bit lane (int codes as two's complement).
template <QuantKind K> __m512i code(__m512 q) {
  const __m512i u = _mm512_castps_si512(q);
  if constexpr (K == QuantKind::int8 || K == QuantKind::int4) {
    constexpr float kMax = K == QuantKind::int8 ? 127.0f : 7.0f;
    const __m512 r = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-kMax)), _mm512_set1_ps(kMax));
    return _mm512_maskz_cvttps_epi32(_mm512_cmp_ps_mask(q, q, _CMP_ORD_Q), c);  // NaN: 0
  } else {
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), u32(0x80u));
    const __m512i a = _mm512_and_si512(u, u32(0x7FFFFFFFu));
    const __m512i an = _mm512_min_epu32(a, u32(0x4F800000u));  // inf, NaN and beyond 2^32 overflow
    __m512i m;
    if constexpr (K == QuantKind::e4m3) {
      m = _mm512_min_epu32(fp8_magnitude<3, 7>(an), u32(0x7Fu));  // anything above 448: NaN
    } else {
      m = _mm512_min_epu32(fp8_magnitude<2, 15>(an), u32(0x7Cu));                  // overflow: inf
      m = _mm512_mask_mov_epi32(m, _mm512_cmpgt_epu32_mask(a, u32(0x7F800000u)), u32(0x7Eu));  // NaN
    }
    return _mm512_or_si512(m, sign);
  }
}

//! Quant<K>::value on 16 lanes of codes (fp8: the byte zero-extended; int: sign-extended).
template <QuantKind K> __m512 value(__m512i c) {
  if constexpr (K == QuantKind::int8 || K == QuantKind::int4) {
    return _mm512_cvtepi32_ps(c);
  } else {
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, u32(0x80u)), 24);
    const __m512i mag = _mm512_and_si512(c, u32(0x7Fu));
    constexpr int kM = K == QuantKind::e4m3 ? 3 : 2;
    constexpr uint32_t kRebias = K == QuantKind::e4m3 ? 120u : 112u;
    constexpr float kSub = K == QuantKind::e4m3 ? 0.001953125f : 1.52587890625e-05f;  // 2^-9, 2^-16
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - kM), u32(kRebias << 23));
    const __m512i sub = _mm512_castps_si512(
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c, u32((1u << kM) - 1u))), _mm512_set1_ps(kSub)));
    __m512i v = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(mag, u32(1u << kM)), normal, sub);
    if constexpr (K == QuantKind::e4m3) {
      v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epu32_mask(mag, u32(0x7Fu)), u32(0x7FC00000u));
    } else {
      const __m512i special = _mm512_mask_blend_epi32(_mm512_cmpeq_epu32_mask(mag, u32(0x7Cu)), u32(0x7FC00000u),
                                                      u32(0x7F800000u));
      v = _mm512_mask_mov_epi32(v, _mm512_cmpge_epu32_mask(mag, u32(0x7Cu)), special);
    }
    return _mm512_castsi512_ps(_mm512_or_si512(v, sign));
  }
}

//! 16 code bytes (or fewer under `m`) widened to 32-bit lanes as value() takes them.
template <QuantKind K> __m512i load_codes(const uint8_t* c, __mmask16 m) {
  const __m128i b = _mm_maskz_loadu_epi8(m, c);
  if constexpr (K == QuantKind::int8 || K == QuantKind::int4) return _mm512_cvtepi8_epi32(b);
  else return _mm512_cvtepu8_epi32(b);
}

//! block_amax(): the finite amax bits of y[0, len) and whether a value is non-finite.
inline uint32_t amax(const float* y, int64_t len, uint32_t* nonfinite) {
  __m512i mx = _mm512_setzero_si512();
  __mmask16 nf = 0;
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 m = tail_mask(len - j);
    const __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi32(m, y + j), u32(0x7FFFFFFFu));
    const __mmask16 fin = _mm512_cmplt_epu32_mask(a, u32(0x7F800000u));
    mx = _mm512_mask_max_epu32(mx, fin, mx, a);
    nf |= __mmask16(m & ~fin);
  }
  *nonfinite = nf != 0;
  return _mm512_reduce_max_epu32(mx);
}

//! The codes loop of quantize(): q = fl(y / d) into cb. (Both operands are NaN only in an
//! int block holding a non-finite value, whose codes are 0 whatever the NaN.)
template <QuantKind K>
void codes_exact(int64_t len, const float* __restrict yb, const float* __restrict db, uint8_t* __restrict cb) {
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 m = tail_mask(len - j);
    const __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(m, yb + j), _mm512_maskz_loadu_ps(m, db + j));
    store_bytes(cb + j, m, code<K>(q));
  }
}

//! residual_update(): r = x' - D (x' - divisor * D), D = value(code) * d. value() is a NaN only
//! for a NaN code, when d is finite (fp8 scales are), and d is a NaN only in int blocks, whose
//! values are finite: the product follows the NaN rule as is. x' and D can both be NaN.
template <QuantKind K, bool Div1>
void residual(int64_t len, const float* __restrict xp, const float* __restrict db, const uint8_t* __restrict cb,
              float div, float* __restrict r) {
  const __m512 dv = _mm512_set1_ps(div);
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 m = tail_mask(len - j);
    __m512 D = _mm512_mul_ps(value<K>(load_codes<K>(cb + j, m)), _mm512_maskz_loadu_ps(m, db + j));
    if constexpr (!Div1) D = _mm512_mul_ps(dv, D);  // divisor is finite
    const __m512 x = _mm512_maskz_loadu_ps(m, xp + j);
    _mm512_mask_storeu_ps(r + j, m, first_nan(_mm512_sub_ps(x, D), x));
  }
}

//! 16 float32 lanes stored as bfloat16 (common::float_to_bf16_bits).
inline void store_bf16(uint16_t* o, __mmask16 m, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), u32(1u));
  __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, u32(0x7FFFu)), lsb), 16);
  const __m512i nan = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u, 16), u32(0x8000u)), u32(0x7FC0u));
  h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
  _mm512_mask_cvtepi32_storeu_epi16(o, m, h);
}
inline __m512 load_bf16(const uint16_t* o, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, o)), 16));
}

//! decode_piece() for float32 (F = true) or bfloat16 out. D = value * d as in residual(); the
//! products and the sum by alpha and out can meet two NaNs, so the rule is spelled out.
template <QuantKind K, bool F>
void decode(int64_t len, const uint8_t* __restrict c, const float* __restrict db, float alpha, bool acc, bool alpha1,
            void* __restrict out) {
  const __m512 al = _mm512_set1_ps(alpha);
  float* of = static_cast<float*>(out);
  uint16_t* oh = static_cast<uint16_t*>(out);
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 m = tail_mask(len - j);
    __m512 D = _mm512_mul_ps(value<K>(load_codes<K>(c + j, m)), _mm512_maskz_loadu_ps(m, db + j));
    if (!alpha1 || acc) D = first_nan(_mm512_mul_ps(D, al), D);
    if (acc) {
      const __m512 o = F ? _mm512_maskz_loadu_ps(m, of + j) : load_bf16(oh + j, m);
      D = first_nan(_mm512_add_ps(o, D), o);
    }
    if constexpr (F) _mm512_mask_storeu_ps(of + j, m, D);
    else store_bf16(oh + j, m, D);
  }
}

} // namespace simd
