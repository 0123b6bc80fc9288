// SPDX-License-Identifier: Apache-2.0
// CPU backend of the block quantizers fp8 / int8 / int4 (kernels/core/codecs/blockq.hpp) with
// fused error feedback.
//
// Encode reads x (and the residual) once: a piece of whole blocks, up to kLocal elements, is
// loaded into a local buffer (x' and y = x' / divisor; float32 input without a residual is read in
// place), each block's finite amax taken there, then quantized from L1: codes (8-bit codes
// straight into the packet), the block's scale, and r_new = fl(x' - D) (fl(x' - fl(divisor * D)))
// written in place. Pieces are split over the threads in contiguous ranges. Larger blocks (and
// block=0, the whole tensor) take two passes: a parallel amax, then a parallel quantization. The
// non-finite flag comes from each block's amax (block_nonfinite), not from every element.
// Decode: D = fl(float(code) * d); out = fl(D * alpha) (D when alpha is 1) or
// out = fl(out + fl(D * alpha)).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include "../common/keyed.hpp"
#include "../common/quant.hpp"
#include "../core/codecs/blockq.hpp"
#include "isa.hpp"
#include "parallel.hpp"

namespace GRADCOMP_CPU_NAMESPACE {
namespace {

using common::add_rn;
using common::div_rn;
using common::float_bits;
using common::is_finite_bits;
using common::mul_rn;
using common::sub_rn;

constexpr int64_t kLocal = 1024;

// ---- the code of one quotient, and its value ---------------------------------------------------------
template <QuantKind K> struct Quant;
template <> struct Quant<QuantKind::e4m3> {
  static constexpr float kMax = common::kE4M3Max;
  static uint32_t code(float q) { return common::float_to_e4m3fn(q); }
  static float value(uint32_t c) { return common::e4m3fn_to_float(uint8_t(c)); }
};
template <> struct Quant<QuantKind::e5m2> {
  static constexpr float kMax = common::kE5M2Max;
  static uint32_t code(float q) { return common::float_to_e5m2(q); }
  static float value(uint32_t c) { return common::e5m2_to_float(uint8_t(c)); }
};
template <int Max> struct IntQuant {
  static constexpr float kMax = float(Max);
  // q finite (blocks with a non-finite value never get here): RNE, then clamp
  // q is NaN exactly in a block holding a non-finite value (its scale is NaN): code 0
  static uint32_t code(float q) {
    const float r = common::round_half_even(q);
    const float c = r > kMax ? kMax : (r < -kMax ? -kMax : r);
    return c == c ? uint32_t(int32_t(c)) : 0u;
  }
  static float value(uint32_t c) { return float(int32_t(c)); }
};
template <> struct Quant<QuantKind::int8> : IntQuant<127> {};
template <> struct Quant<QuantKind::int4> : IntQuant<7> {};

constexpr bool is_int(QuantKind k) { return k == QuantKind::int8 || k == QuantKind::int4; }

} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
// GCC 12's AVX-512 intrinsics start some results from _mm512_undefined_*() and warn about it at
// every inlined use (GCC bug 105593): not a fault of this file
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
namespace GRADCOMP_CPU_NAMESPACE {
namespace {
#include "blockq_avx512.hpp"
} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE
#endif
namespace GRADCOMP_CPU_NAMESPACE {
namespace {

#if defined(GRADCOMP_BLOCKQ_AVX512)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif

// ---- scales in the packet ----------------------------------------------------------------------------------
struct Scale {
  float d;       //!< the decode scale
  uint8_t byte;  //!< e8m0: its byte
};
template <QuantKind K, bool E8M0> Scale block_scale(float amax, bool nonfinite) {
  if constexpr (is_int(K)) {
    if (nonfinite) return {common::bits_float(0x7FC00000u), 0};
  }
  if constexpr (E8M0) {
    const uint8_t b = common::block_scale_e8m0(amax, Quant<K>::kMax);
    return {common::e8m0_to_float(b), b};
  } else {
    return {common::block_scale(amax, Quant<K>::kMax), 0};
  }
}
template <bool E8M0> void store_scale(uint8_t* scales, int64_t b, const Scale& s) {
  if constexpr (E8M0) scales[b] = s.byte;
  else std::memcpy(scales + 4 * b, &s.d, 4);
}
template <bool E8M0> float load_scale(const uint8_t* scales, int64_t b) {
  if constexpr (E8M0) {
    return common::e8m0_to_float(scales[b]);
  } else {
    float d;
    std::memcpy(&d, scales + 4 * b, 4);
    return d;
  }
}

// ---- encode ----------------------------------------------------------------------------------------------------
template <class In, bool HasRes, bool Div1> struct Src {
  const typename In::storage* x;
  float* r;
  float div;
  float xprime(int64_t i) const {
    float xp = In::load(x[i]);
    if constexpr (HasRes) xp = add_rn(xp, r[i]);
    return xp;
  }
  float y(float xp) const { return Div1 ? xp : div_rn(xp, div); }
};

//! r_new = x' - D (x' - divisor * D), D = code * d, for `len` codes in cb.
template <QuantKind K, bool Div1>
void residual_update(int64_t len, const float* __restrict xp, const float* __restrict db, const uint8_t* __restrict cb,
                     float div, float* __restrict r) {
#if defined(GRADCOMP_BLOCKQ_AVX512)
  return simd::residual<K, Div1>(len, xp, db, cb, div, r);
#endif
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t c = is_int(K) ? uint32_t(int32_t(int8_t(cb[j]))) : uint32_t(cb[j]);
    const float dv = mul_rn(Quant<K>::value(c), db[j]);
    r[j] = Div1 ? sub_rn(xp[j], dv) : sub_rn(xp[j], mul_rn(div, dv));
  }
}

//! Quantize `len` elements with their quotients q = fl(y / d), y = fl(x' / divisor): one code
//! byte each into cb (int codes as two's complement), and with a residual r_new into r. (An int
//! block holding a non-finite value has the scale NaN, so its quotients are NaN: code 0.) Plain
//! loops over arrays in L1: they vectorize (or the AVX-512 loops of blockq_avx512.hpp). (A product
//! by fl(1 / d) with an exact redo of the quotients near a rounding boundary measured slower than
//! the division: the redo is frequent on bfloat16 input, whose quotients are often exact ties.)
template <QuantKind K, bool HasRes, bool Div1>
void quantize(int64_t len, const float* __restrict xp, const float* __restrict yb, const float* __restrict db,
              float div, float* __restrict r, uint8_t* __restrict cb) {
  if constexpr (kAvx512) {
#if defined(GRADCOMP_BLOCKQ_AVX512)
    simd::codes_exact<K>(len, yb, db, cb);
#endif
  } else {
    for (int64_t j = 0; j < len; ++j) cb[j] = uint8_t(Quant<K>::code(div_rn(yb[j], db[j])));
  }
  if constexpr (HasRes) residual_update<K, Div1>(len, xp, db, cb, div, r);
}

//! quantize() with the stochastic rounding of int8 / int4 (rounding=stochastic): element i0 + j's
//! code is common::int_code_sr(fl(y / d), u_{i0 + j}) with the uniforms of common/keyed.hpp (one
//! batch of Philox calls for the piece).
template <QuantKind K, bool HasRes, bool Div1>
void quantize_sr(int64_t len, int64_t i0, const float* __restrict xp, const float* __restrict yb,
                 const float* __restrict db, float div, float* __restrict r, uint8_t* __restrict cb,
                 const keyed::Key& key) {
  static_assert(is_int(K), "stochastic rounding of the int codes only");
  alignas(64) uint32_t wbuf[kLocal + 8];
  const uint64_t glo = uint64_t(i0) / 4;
  const int64_t ng = int64_t((uint64_t(i0 + len - 1) / 4) - glo + 1);
  philox::philox4x32_10_groups(glo, ng, key.c2, key.c3, {key.k0, key.k1}, wbuf);
  const uint32_t* wb = wbuf + (i0 - int64_t(4 * glo));
  for (int64_t j = 0; j < len; ++j)
    cb[j] = uint8_t(common::int_code_sr(div_rn(yb[j], db[j]), keyed::uniform(wb[j]), Quant<K>::kMax));
  if constexpr (HasRes) residual_update<K, Div1>(len, xp, db, cb, div, r);
}

//! Whether a block leaves a non-finite new residual x' - div * D (D = code value * d), i.e. some x'
//! is not finite (fp8: a NaN or inf code; int: the NaN scale), or the largest decoded value D, or
//! div times it, overflows. The largest |code| is the code of amax / d (rounding is monotone and
//! symmetric) and x' has the sign of D, so this is exactly "some new residual is non-finite" (the
//! CUDA kernels test every residual; both are checked against a plain loop in test_quant).
template <QuantKind K> uint32_t block_nonfinite(float amax, const Scale& s, bool nonfinite, float div) {
  if (nonfinite) return 1u;
  // every finite code is at most kMax in magnitude: no overflow unless div * kMax * d overflows
  if (is_finite_bits(float_bits(mul_rn(div, mul_rn(Quant<K>::kMax, s.d))))) return 0u;
  const float dmax = mul_rn(Quant<K>::value(Quant<K>::code(div_rn(amax, s.d))), s.d);
  return uint32_t(!is_finite_bits(float_bits(dmax)) || !is_finite_bits(float_bits(mul_rn(div, dmax))));
}

//! Store `len` codes from cb at element i0 (even for int4: two per byte, low nibble first).
template <QuantKind K> void store_codes(uint8_t* __restrict codes, int64_t i0, int64_t len, const uint8_t* __restrict cb) {
  if constexpr (K == QuantKind::int4) {
    uint8_t* o = codes + (i0 >> 1);
    const int64_t pairs = len / 2;
    for (int64_t j = 0; j < pairs; ++j) o[j] = uint8_t((cb[2 * j] & 0xFu) | ((cb[2 * j + 1] & 0xFu) << 4));
    if (len & 1) o[pairs] = uint8_t(cb[len - 1] & 0xFu);
  } else {
    std::memcpy(codes + i0, cb, size_t(len));
  }
}

//! Load `len` int4 codes at element i0 (even) into cb, sign-extended to a byte.
void load_int4(const uint8_t* __restrict codes, int64_t i0, int64_t len, uint8_t* __restrict cb) {
  const uint8_t* in = codes + (i0 >> 1);
  const int64_t pairs = len / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    const uint32_t b = in[j];
    cb[2 * j] = uint8_t(int8_t(int32_t(b << 28) >> 28));
    cb[2 * j + 1] = uint8_t(int8_t(int32_t(b << 24) >> 28));
  }
  if (len & 1) cb[len - 1] = uint8_t(int8_t(int32_t(uint32_t(in[pairs]) << 28) >> 28));
}

//! The finite amax of yb[0, len) and whether a value is non-finite: an integer max over the bits
//! (non-negative floats order as integers; an integer max reduction vectorizes, a float one does
//! not without fast-math). Its own function, outside the OpenMP region, so that it vectorizes.
[[gnu::noinline]] float block_amax(const float* __restrict yb, int64_t len, uint32_t* nonfinite) {
#if defined(GRADCOMP_BLOCKQ_AVX512)
  return common::bits_float(simd::amax(yb, len, nonfinite));
#endif
  uint32_t amax = 0, nf = 0;
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t a = float_bits(yb[j]) & 0x7FFFFFFFu;
    const uint32_t finite = uint32_t(a < 0x7F800000u);
    amax = std::max(amax, a & (0u - finite));  // (a select here keeps GCC 12 from vectorizing)
    nf |= finite ^ 1u;
  }
  *nonfinite = nf;
  return common::bits_float(amax);
}

//! x' of `len` elements at i into the local buffer xb; returns where x' is (x itself for float32
//! input without a residual).
template <class In, bool HasRes, bool Div1>
const float* load_piece(const Src<In, HasRes, Div1>& src, int64_t i, int64_t len, float* __restrict xb) {
  if constexpr (std::is_same_v<In, common::F32> && !HasRes) {
    return src.x + i;
  } else {
    for (int64_t j = 0; j < len; ++j) xb[j] = src.xprime(i + j);
    return xb;
  }
}

//! y = fl(x' / divisor) of `len` elements into yb (x' itself at divisor 1).
template <bool Div1> const float* divide_piece(const float* __restrict xp, int64_t len, float div, float* __restrict yb) {
  if constexpr (Div1) {
    return xp;
  } else {
    for (int64_t j = 0; j < len; ++j) yb[j] = div_rn(xp[j], div);
    return yb;
  }
}

//! The codes of a piece: round to nearest (quantize) or, with `sr`, stochastically (quantize_sr).
template <QuantKind K, bool HasRes, bool Div1>
void quantize_piece(int64_t len, int64_t i0, const float* __restrict xp, const float* __restrict yb,
                    const float* __restrict db, float div, float* __restrict r, uint8_t* __restrict cb,
                    const keyed::Key* sr) {
  if constexpr (is_int(K)) {
    if (sr) return quantize_sr<K, HasRes, Div1>(len, i0, xp, yb, db, div, r, cb, *sr);
  }
  quantize<K, HasRes, Div1>(len, xp, yb, db, div, r, cb);
}

template <class In, QuantKind K, bool E8M0, bool HasRes, bool Div1>
uint32_t encode_blocks(const BlockQPlan& p, const Src<In, HasRes, Div1>& src, uint8_t* codes, uint8_t* scales,
                       const keyed::Key* sr) {
  const int64_t n = p.numel, B = p.block, nb = p.nblocks;
  const int T = p.threads;
  const float div = src.div;
  // 8-bit codes go straight into the packet; int4 codes through a byte buffer (packed on store)
  constexpr bool kDirect = K != QuantKind::int4;
  uint32_t flag = 0;
  if (B <= kLocal) {
    // pieces of whole blocks, up to kLocal elements: one read of x (and r) into local buffers
    const int64_t P = kLocal / B * B;
    const int64_t pieces = (n + P - 1) / P;
    TeamClock clock;
#pragma omp parallel num_threads(T) reduction(| : flag)
    {
      clock.arrive();
      alignas(64) float xb[kLocal];
      alignas(64) float yb[kLocal];
      alignas(64) float db[kLocal];
      alignas(64) uint8_t cb[kLocal];
#pragma omp for schedule(static)
      for (int64_t q = 0; q < pieces; ++q) {
        const int64_t i0 = q * P, len = std::min(P, n - i0);
        const float* xp = load_piece(src, i0, len, xb);
        const float* y = divide_piece<Div1>(xp, len, div, yb);
        for (int64_t j0 = 0; j0 < len; j0 += B) {
          const int64_t bl = std::min(B, len - j0);
          uint32_t nonfinite = 0;
          const float amax = block_amax(y + j0, bl, &nonfinite);
          const Scale s = block_scale<K, E8M0>(amax, nonfinite != 0);
          store_scale<E8M0>(scales, (i0 + j0) / B, s);
          for (int64_t j = 0; j < bl; ++j) db[j0 + j] = s.d;
          flag |= block_nonfinite<K>(amax, s, nonfinite != 0, div);
        }
        uint8_t* c = kDirect ? codes + i0 : cb;
        quantize_piece<K, HasRes, Div1>(len, i0, xp, y, db, div, HasRes ? src.r + i0 : nullptr, c, sr);
        if constexpr (!kDirect) store_codes<K>(codes, i0, len, cb);
      }
      clock.finish();
    }
    clock.report(T);
    return flag;
  }
  // large blocks: per block a parallel amax, then a parallel quantization (two reads), in even
  // pieces of at most kLocal elements (int4 bytes are never shared by two threads)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * B, len = std::min(B, n - i0);
    uint32_t amax_bits = 0, nonfinite = 0;
#pragma omp parallel for num_threads(T) schedule(static) reduction(max : amax_bits) reduction(| : nonfinite)
    for (int64_t j = 0; j < len; ++j) {
      const uint32_t a = float_bits(src.y(src.xprime(i0 + j))) & 0x7FFFFFFFu;
      const uint32_t finite = uint32_t(a < 0x7F800000u);
      amax_bits = std::max(amax_bits, a & (0u - finite));
      nonfinite |= finite ^ 1u;
    }
    const float amax = common::bits_float(amax_bits);
    const Scale s = block_scale<K, E8M0>(amax, nonfinite != 0);
    store_scale<E8M0>(scales, b, s);
    const int64_t pieces = (len + kLocal - 1) / kLocal;
#pragma omp parallel num_threads(T)
    {
      alignas(64) float xb[kLocal];
      alignas(64) float yb[kLocal];
      alignas(64) float db[kLocal];
      alignas(64) uint8_t cb[kLocal];
      for (int64_t j = 0; j < kLocal; ++j) db[j] = s.d;
#pragma omp for schedule(static)
      for (int64_t q = 0; q < pieces; ++q) {
        const int64_t j0 = i0 + q * kLocal, m = std::min(kLocal, i0 + len - j0);
        const float* xp = load_piece(src, j0, m, xb);
        uint8_t* c = kDirect ? codes + j0 : cb;
        quantize_piece<K, HasRes, Div1>(m, j0, xp, divide_piece<Div1>(xp, m, div, yb), db, div,
                                        HasRes ? src.r + j0 : nullptr, c, sr);
        if constexpr (!kDirect) store_codes<K>(codes, j0, m, cb);
      }
    }
    flag |= block_nonfinite<K>(amax, s, nonfinite != 0, div);
  }
  return flag;
}

template <QuantKind K, bool E8M0> void encode_k(const BlockQPlan& p, const EncodeArgs& a) {
  uint8_t* codes = a.packet + p.layout.sections[0].offset;
  uint8_t* scales = a.packet + p.layout.sections[1].offset;
  uint32_t flag = 0;
  const keyed::Key key = keyed::derive(kIntSrTag, a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
  const keyed::Key* sr = p.stochastic ? &key : nullptr;
  dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    const auto* xs = a.x.ptr<const typename In::storage>();
    const bool div1 = a.divisor == 1.0f;
    if (a.residual) {
      flag = div1 ? encode_blocks<In, K, E8M0, true, true>(p, Src<In, true, true>{xs, a.residual, a.divisor}, codes, scales, sr)
                  : encode_blocks<In, K, E8M0, true, false>(p, Src<In, true, false>{xs, a.residual, a.divisor}, codes, scales, sr);
    } else {
      flag = div1 ? encode_blocks<In, K, E8M0, false, true>(p, Src<In, false, true>{xs, nullptr, a.divisor}, codes, scales, sr)
                  : encode_blocks<In, K, E8M0, false, false>(p, Src<In, false, false>{xs, nullptr, a.divisor}, codes, scales, sr);
    }
  }, "blockq: input");
  finish_packet(a.packet, p.layout, flag ? kFlagNonFinite : 0, a.ctx);
}

void encode(const BlockQPlan& p, const EncodeArgs& a) {
  switch (p.kind) {
    case QuantKind::e4m3: return p.e8m0 ? encode_k<QuantKind::e4m3, true>(p, a) : encode_k<QuantKind::e4m3, false>(p, a);
    case QuantKind::e5m2: return p.e8m0 ? encode_k<QuantKind::e5m2, true>(p, a) : encode_k<QuantKind::e5m2, false>(p, a);
    case QuantKind::int8: return encode_k<QuantKind::int8, false>(p, a);
    case QuantKind::int4: return encode_k<QuantKind::int4, false>(p, a);
  }
}

// ---- decode ----------------------------------------------------------------------------------------------------
//! D = fl(code * d)
template <QuantKind K> float code_value(uint8_t code, float d) {
  const uint32_t c = is_int(K) ? uint32_t(int32_t(int8_t(code))) : uint32_t(code);
  return mul_rn(Quant<K>::value(c), d);
}

//! Decode `len` codes (one byte each) with per-element scales db into o.
template <QuantKind K, class O>
void decode_piece(int64_t len, const uint8_t* __restrict c, const float* __restrict db, float alpha, bool acc,
                  bool alpha1, typename O::storage* __restrict o) {
#if defined(GRADCOMP_BLOCKQ_AVX512)
  if constexpr (std::is_same_v<O, common::F32> || std::is_same_v<O, common::BF16>)
    return simd::decode<K, std::is_same_v<O, common::F32>>(len, c, db, alpha, acc, alpha1, o);
#endif
  if (acc) {
    for (int64_t j = 0; j < len; ++j) o[j] = O::store(add_rn(O::load(o[j]), mul_rn(code_value<K>(c[j], db[j]), alpha)));
  } else if (alpha1) {
    for (int64_t j = 0; j < len; ++j) o[j] = O::store(code_value<K>(c[j], db[j]));
  } else {
    for (int64_t j = 0; j < len; ++j) o[j] = O::store(mul_rn(code_value<K>(c[j], db[j]), alpha));
  }
}

template <QuantKind K, bool E8M0, class O>
void decode_k(const BlockQPlan& p, const DecodeArgs& a) {
  const uint8_t* codes = a.packet + p.layout.sections[0].offset;
  const uint8_t* scales = a.packet + p.layout.sections[1].offset;
  auto* out = a.out.ptr<typename O::storage>();
  const int64_t n = p.numel, B = p.block;
  const bool acc = a.mode == DecodeMode::accumulate;
  const float alpha = a.alpha;
  // D * 1 is D for every D (a NaN D is already quiet): replace with alpha 1 skips the product
  const bool alpha1 = alpha == 1.0f;
  const int T = p.threads;
  // pieces of up to kLocal elements: whole blocks (B <= kLocal) or parts of one block, even-sized
  const int64_t P = B <= kLocal ? kLocal / B * B : kLocal;
  const int64_t per_block = B <= kLocal ? 1 : (B + kLocal - 1) / kLocal;
  const int64_t pieces = B <= kLocal ? (n + P - 1) / P : p.nblocks * per_block;
  TeamClock clock;
#pragma omp parallel num_threads(T)
  {
    clock.arrive();
    alignas(64) uint8_t cb[kLocal];
    alignas(64) float db[kLocal];
#pragma omp for schedule(static)
    for (int64_t q = 0; q < pieces; ++q) {
      int64_t i0, len;
      if (B <= kLocal) {
        i0 = q * P;
        len = std::min(P, n - i0);
        for (int64_t j0 = 0; j0 < len; j0 += B) {
          const float d = load_scale<E8M0>(scales, (i0 + j0) / B);
          const int64_t bl = std::min(B, len - j0);
          for (int64_t j = 0; j < bl; ++j) db[j0 + j] = d;
        }
      } else {
        const int64_t b = q / per_block;
        i0 = b * B + (q % per_block) * kLocal;
        len = std::min({kLocal, n - i0, (b + 1) * B - i0});
        const float d = load_scale<E8M0>(scales, b);
        for (int64_t j = 0; j < len; ++j) db[j] = d;
      }
      if (len <= 0) continue;
      const uint8_t* c = codes + i0;
      if constexpr (K == QuantKind::int4) {
        load_int4(codes, i0, len, cb);
        c = cb;
      }
      decode_piece<K, O>(len, c, db, alpha, acc, alpha1, out + i0);
    }
    clock.finish();
  }
  clock.report(T);
}

void decode(const BlockQPlan& p, const DecodeArgs& a) {
  dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    switch (p.kind) {
      case QuantKind::e4m3: return p.e8m0 ? decode_k<QuantKind::e4m3, true, O>(p, a) : decode_k<QuantKind::e4m3, false, O>(p, a);
      case QuantKind::e5m2: return p.e8m0 ? decode_k<QuantKind::e5m2, true, O>(p, a) : decode_k<QuantKind::e5m2, false, O>(p, a);
      case QuantKind::int8: return decode_k<QuantKind::int8, false, O>(p, a);
      case QuantKind::int4: return decode_k<QuantKind::int4, false, O>(p, a);
    }
  }, "decode: out");
  PacketHeader h;
  std::memcpy(&h, a.packet, sizeof h);
  // a non-finite value travels as a NaN/inf code (fp8) or a NaN scale (int8/int4): nothing more to write
  if ((h.flags & kFlagNonFinite) && a.workspace) *reinterpret_cast<uint32_t*>(a.workspace) |= kStatusNonFinite;
}

int64_t workspace_bytes(const BlockQPlan&) { return kStatusBytes; }

} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE

GRADCOMP_CPU_TABLE(BlockQPlan, blockq, workspace_bytes, encode, decode)
