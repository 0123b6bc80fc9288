// SPDX-License-Identifier: Apache-2.0
// CPU backend of the block quantizers fp8 / int8 / int4 (kernels/core/codecs/blockq.hpp) with
// fused error feedback.
//
// Encode reads x (and the residual) once: a block of up to kLocal elements is loaded into a local
// buffer (x' and y = x' / divisor), its finite amax taken there, then quantized from the buffer:
// codes, the block's scale, and r_new = fl(x' - D) (fl(x' - fl(divisor * D))). Blocks are split
// over the threads in contiguous ranges. Larger blocks (and block=0, the whole tensor) take two
// passes: a parallel amax, then a parallel quantization.
// Decode: D = fl(float(code) * d); out = fl(D * alpha) or out = fl(out + fl(D * alpha)).
#include <algorithm>
#include <cstring>

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
  static uint32_t code(float q) {
    const float r = common::round_half_even(q);
    const float c = r > kMax ? kMax : (r < -kMax ? -kMax : r);
    return uint32_t(int32_t(c));
  }
  static float value(uint32_t c) { return float(int32_t(c)); }
};
template <> struct Quant<QuantKind::int8> : IntQuant<127> {};
template <> struct Quant<QuantKind::int4> : IntQuant<7> {};

constexpr bool is_int(QuantKind k) { return k == QuantKind::int8 || k == QuantKind::int4; }

// ---- codes and scales in the packet ------------------------------------------------------------------------
template <QuantKind K> void store_code(uint8_t* codes, int64_t i, uint32_t c) {
  if constexpr (K == QuantKind::int4) {
    uint8_t& b = codes[i >> 1];
    b = (i & 1) ? uint8_t((b & 0x0Fu) | ((c & 0xFu) << 4)) : uint8_t(c & 0xFu);  // low nibble first
  } else {
    codes[i] = uint8_t(c);
  }
}
template <QuantKind K> uint32_t load_code(const uint8_t* codes, int64_t i) {
  if constexpr (K == QuantKind::int4) {
    const uint32_t nib = (i & 1) ? uint32_t(codes[i >> 1] >> 4) : uint32_t(codes[i >> 1] & 0xFu);
    return nib & 8u ? nib | 0xFFFFFFF0u : nib;  // sign-extend
  } else if constexpr (K == QuantKind::int8) {
    return uint32_t(int32_t(int8_t(codes[i])));
  } else {
    return codes[i];
  }
}

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

//! Quantize elements [i0, i0 + len) of one block with scale s, x' and y from `xp_at` / `y_at`;
//! returns 1 when a decoded value is non-finite.
template <QuantKind K, bool HasRes, bool Div1, class XpAt, class YAt>
uint32_t quantize(const Scale& s, int64_t i0, int64_t len, XpAt&& xp_at, YAt&& y_at, float div, float* r,
                  uint8_t* codes, bool int_nonfinite) {
  uint32_t nf = 0;
  for (int64_t j = 0; j < len; ++j) {
    const float xp = xp_at(j);
    uint32_t c = 0;
    if (!(is_int(K) && int_nonfinite)) c = Quant<K>::code(div_rn(y_at(j), s.d));
    const float d = mul_rn(Quant<K>::value(c), s.d);
    store_code<K>(codes, i0 + j, c);
    if constexpr (HasRes) r[i0 + j] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(div, d));
    nf |= uint32_t(!is_finite_bits(float_bits(d)));
  }
  return nf;
}

template <class In, QuantKind K, bool E8M0, bool HasRes, bool Div1>
uint32_t encode_blocks(const BlockQPlan& p, const Src<In, HasRes, Div1>& src, uint8_t* codes, uint8_t* scales) {
  const int64_t n = p.numel, B = p.block, nb = p.nblocks;
  const int T = p.threads;
  uint32_t flag = 0;
  if (B <= kLocal) {
    TeamClock clock;
#pragma omp parallel num_threads(T) reduction(| : flag)
    {
      clock.arrive();
      alignas(64) float xb[kLocal];
      alignas(64) float yb[kLocal];
#pragma omp for schedule(static)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i0 = b * B, len = std::min(B, n - i0);
        float amax = 0.0f;
        uint32_t nonfinite = 0;
        for (int64_t j = 0; j < len; ++j) {
          const float xp = src.xprime(i0 + j);
          const float y = src.y(xp);
          xb[j] = xp;
          yb[j] = y;
          amax = std::max(amax, common::finite_abs(y));
          nonfinite |= uint32_t(!is_finite_bits(float_bits(y)));
        }
        const Scale s = block_scale<K, E8M0>(amax, nonfinite != 0);
        store_scale<E8M0>(scales, b, s);
        quantize<K, HasRes, Div1>(
            s, i0, len, [&](int64_t j) { return xb[j]; }, [&](int64_t j) { return yb[j]; }, src.div, src.r, codes,
            nonfinite != 0);
        flag |= nonfinite;
      }
      clock.finish();
    }
    clock.report(T);
    return flag;
  }
  // large blocks: per block a parallel amax, then a parallel quantization (two reads)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * B, len = std::min(B, n - i0);
    float amax = 0.0f;
    uint32_t nonfinite = 0;
#pragma omp parallel for num_threads(T) schedule(static) reduction(max : amax) reduction(| : nonfinite)
    for (int64_t j = 0; j < len; ++j) {
      // without a residual first touch: x' = x (+ r) is not stored, the second pass recomputes it
      const float y = src.y(src.xprime(i0 + j));
      amax = std::max(amax, common::finite_abs(y));
      nonfinite |= uint32_t(!is_finite_bits(float_bits(y)));
    }
    const Scale s = block_scale<K, E8M0>(amax, nonfinite != 0);
    store_scale<E8M0>(scales, b, s);
    // split the block in even-sized parts so int4 bytes are never shared by two threads
    const int64_t parts = std::min<int64_t>(T, (len + 1) / 2);
    const int64_t per = ((len + parts - 1) / parts + 1) / 2 * 2;
#pragma omp parallel for num_threads(T) schedule(static)
    for (int64_t t = 0; t < parts; ++t) {
      const int64_t j0 = t * per, j1 = std::min(len, j0 + per);
      if (j0 >= j1) continue;
      quantize<K, HasRes, Div1>(
          s, i0 + j0, j1 - j0, [&](int64_t j) { return src.xprime(i0 + j0 + j); },
          [&](int64_t j) { return src.y(src.xprime(i0 + j0 + j)); }, src.div, src.r, codes, nonfinite != 0);
    }
    flag |= nonfinite;
  }
  return flag;
}

template <QuantKind K, bool E8M0> void encode_k(const BlockQPlan& p, const EncodeArgs& a) {
  uint8_t* codes = a.packet + p.layout.sections[0].offset;
  uint8_t* scales = a.packet + p.layout.sections[1].offset;
  uint32_t flag = 0;
  dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    const auto* xs = a.x.ptr<const typename In::storage>();
    const bool div1 = a.divisor == 1.0f;
    if (a.residual) {
      flag = div1 ? encode_blocks<In, K, E8M0, true, true>(p, Src<In, true, true>{xs, a.residual, a.divisor}, codes, scales)
                  : encode_blocks<In, K, E8M0, true, false>(p, Src<In, true, false>{xs, a.residual, a.divisor}, codes, scales);
    } else {
      flag = div1 ? encode_blocks<In, K, E8M0, false, true>(p, Src<In, false, true>{xs, nullptr, a.divisor}, codes, scales)
                  : encode_blocks<In, K, E8M0, false, false>(p, Src<In, false, false>{xs, nullptr, a.divisor}, codes, scales);
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
template <QuantKind K, bool E8M0, class O>
void decode_k(const BlockQPlan& p, const DecodeArgs& a) {
  const uint8_t* codes = a.packet + p.layout.sections[0].offset;
  const uint8_t* scales = a.packet + p.layout.sections[1].offset;
  auto* out = a.out.ptr<typename O::storage>();
  const int64_t n = p.numel, B = p.block, nb = p.nblocks;
  const bool acc = a.mode == DecodeMode::accumulate;
  const float alpha = a.alpha;
  const int T = p.threads;
  TeamClock clock;
#pragma omp parallel num_threads(T)
  {
    clock.arrive();
    // parts of whole blocks (even-sized for int4), so each element's scale is its block's
    const int64_t chunk = std::max<int64_t>(B, 2048 / B * B);
    const int64_t nchunks = (n + chunk - 1) / chunk;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t i0 = c * chunk, i1 = std::min(n, i0 + chunk);
      for (int64_t b = i0 / B; b < nb && b * B < i1; ++b) {
        const float d = load_scale<E8M0>(scales, b);
        const int64_t j0 = b * B, j1 = std::min(i1, j0 + B);
        for (int64_t i = j0; i < j1; ++i) {
          const float v = mul_rn(mul_rn(Quant<K>::value(load_code<K>(codes, i)), d), alpha);
          out[i] = O::store(acc ? add_rn(O::load(out[i]), v) : v);
        }
      }
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
