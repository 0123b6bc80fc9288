// SPDX-License-Identifier: Apache-2.0
// CPU backend of the cast codecs none / fp16 / bf16 (docs/contracts.md section 3): round-to-nearest-even
// casts with error feedback fused into the same pass, and decode (assign / accumulate, alpha).
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define GRADCOMP_CPU_F16_HW 1
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own undefined-vector idiom.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "../common/sround.hpp"
#include "../core/codecs/cast.hpp"
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

#if defined(GRADCOMP_CPU_F16_HW)
// float32 -> float16 of y[0, n) with the hardware convert (round to nearest even; overflow to inf;
// exact for every input, as common::float_to_half_bits, which the scalar tail uses), NaN replaced by
// the canonical 0x7E00 with its sign. Returns 1 when a code is non-finite.
uint32_t f16_block(const float* y, uint16_t* out, int64_t n) {
  __mmask16 nf = 0;
  int64_t j = 0;
  const __m512i sign = _mm512_set1_epi32(0x8000), qnan = _mm512_set1_epi32(0x7E00);
  const __m256i expo = _mm256_set1_epi16(0x7C00);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(y + j);
    __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i canon = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 16), sign), qnan);
    h = _mm256_mask_blend_epi16(isnan, h, _mm512_cvtepi32_epi16(canon));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), h);
    nf |= _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, expo), expo);
  }
  uint32_t flag = nf != 0;
  for (; j < n; ++j) {
    out[j] = common::float_to_half_bits(y[j]);
    flag |= F16::nonfinite(out[j]);
  }
  return flag;
}

// The float16 wire with the hardware convert, without a residual: y in blocks (auto-vectorized),
// then the convert. (With a residual the fused generic loop below is faster: it needs the decoded
// value of every code anyway.)
template <class In, bool Div1>
uint32_t encode_f16_hw(const typename In::storage* __restrict x, uint16_t* __restrict out, int64_t n, float div,
                       int T) {
  constexpr int64_t kBlock = 2048;
  uint32_t flag = 0;
  TeamClock clock;
#pragma omp parallel num_threads(T) reduction(| : flag)
  {
    clock.arrive();
#pragma omp for schedule(static)
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = std::min(kBlock, n - b);
      alignas(64) float y[kBlock];
      for (int64_t j = 0; j < len; ++j) y[j] = Div1 ? In::load(x[b + j]) : div_rn(In::load(x[b + j]), div);
      flag |= f16_block(y, out + b, len);
    }
    clock.finish();
  }
  clock.report(T);
  return flag;
}
#endif

template <class In, class W, bool HasRes, bool Div1>
uint32_t encode_loop(const typename In::storage* __restrict x, float* __restrict r, typename W::storage* __restrict out,
                     int64_t n, float div, int T) {
#if defined(GRADCOMP_CPU_F16_HW)
  if constexpr (std::is_same_v<W, F16> && !HasRes) return encode_f16_hw<In, Div1>(x, out, n, div, T);
#endif
  uint32_t flag = 0;
  TeamClock clock;
#pragma omp parallel num_threads(T) reduction(| : flag)
  {
    clock.arrive();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      float xp = In::load(x[i]);
      if constexpr (HasRes) xp = add_rn(xp, r[i]);
      const float y = Div1 ? xp : div_rn(xp, div);
      const auto c = W::store(y);
      out[i] = c;
      if constexpr (HasRes) {
        const float d = W::load(c);
        r[i] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(div, d));
      }
      // the casts keep inf and NaN, so the code is non-finite iff y was or the cast overflowed
      flag |= static_cast<uint32_t>(W::nonfinite(c));
    }
    clock.finish();
  }
  clock.report(T);
  return flag;
}

// bf16:rounding=stochastic: one Philox4x32-10 call per group of 8 elements (kernels/common/sround.hpp),
// the groups split statically over the threads, so the packet does not depend on the thread count.
template <class In, bool HasRes, bool Div1>
uint32_t encode_sr_loop(const typename In::storage* __restrict x, float* __restrict r, uint16_t* __restrict out,
                        int64_t n, float div, const sround::Key key, int T) {
  constexpr int64_t G = sround::kGroup;
  const int64_t groups = (n + G - 1) / G;
  // the words of 256 groups (2048 elements) per batch call (philox4x32_10_groups: the same calls as
  // sround::group_bits), read as the elements' 16-bit units (little-endian, as sround::uniform16)
  constexpr int64_t kSpan = 256;
  static_assert(G == 8, "eight 16-bit units per Philox call");
  uint32_t flag = 0;
  TeamClock clock;
#pragma omp parallel num_threads(T) reduction(| : flag)
  {
    clock.arrive();
    alignas(64) uint32_t wbuf[4 * kSpan];
#pragma omp for schedule(static)
    for (int64_t jb = 0; jb < groups; jb += kSpan) {
      const int64_t je = std::min(groups, jb + kSpan);
      philox::philox4x32_10_groups(uint64_t(jb), je - jb, key.c2, key.c3, {key.k0, key.k1}, wbuf);
      const int64_t i0 = jb * G, len = std::min(n, je * G) - i0;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t i = i0 + t;
        const uint32_t u16 = (wbuf[t >> 1] >> (16 * (t & 1))) & 0xFFFFu;
        float xp = In::load(x[i]);
        if constexpr (HasRes) xp = add_rn(xp, r[i]);
        const float y = Div1 ? xp : div_rn(xp, div);
        const uint16_t c = sround::float_to_bf16_sr_bits(y, u16);
        out[i] = c;
        if constexpr (HasRes) {
          const float d = BF16::load(c);
          r[i] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(div, d));
        }
        flag |= static_cast<uint32_t>(BF16::nonfinite(c));
      }
    }
    clock.finish();
  }
  clock.report(T);
  return flag;
}

template <class W, class O>
void decode_loop(const typename W::storage* __restrict in, typename O::storage* __restrict out, int64_t n, float alpha,
                 bool accumulate, int T) {
  TeamClock clock;
#pragma omp parallel num_threads(T)
  {
    clock.arrive();
    if (accumulate) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) out[i] = O::store(add_rn(O::load(out[i]), mul_rn(W::load(in[i]), alpha)));
    } else {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) out[i] = O::store(mul_rn(W::load(in[i]), alpha));
    }
    clock.finish();
  }
  clock.report(T);
}

void encode(const CastPlan& p, const EncodeArgs& a) {
  uint32_t flag = 0;
  if (p.stochastic) {
    const sround::Key key = sround::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
    dispatch_float(p.input, [&](auto in) {
      using In = decltype(in);
      const auto* xs = a.x.ptr<const typename In::storage>();
      auto* out = reinterpret_cast<uint16_t*>(a.packet + p.layout.sections[0].offset);
      const float d = a.divisor;
      const int T = p.threads;
      float* r = a.residual;
      if (r) {
        flag = d == 1.0f ? encode_sr_loop<In, true, true>(xs, r, out, p.numel, d, key, T)
                         : encode_sr_loop<In, true, false>(xs, r, out, p.numel, d, key, T);
      } else {
        flag = d == 1.0f ? encode_sr_loop<In, false, true>(xs, nullptr, out, p.numel, d, key, T)
                         : encode_sr_loop<In, false, false>(xs, nullptr, out, p.numel, d, key, T);
      }
    }, "cast: input");
    finish_packet(a.packet, p.layout, flag ? kFlagNonFinite : 0, a.ctx);
    return;
  }
  dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    dispatch_float(p.wire, [&](auto w) {
      using W = decltype(w);
      const auto* xs = a.x.ptr<const typename In::storage>();
      auto* out = reinterpret_cast<typename W::storage*>(a.packet + p.layout.sections[0].offset);
      const bool div1 = a.divisor == 1.0f;
      const float d = a.divisor;
      float* r = a.residual;
      const int T = p.threads;
      if (r) {
        flag = div1 ? encode_loop<In, W, true, true>(xs, r, out, p.numel, d, T)
                    : encode_loop<In, W, true, false>(xs, r, out, p.numel, d, T);
      } else {
        flag = div1 ? encode_loop<In, W, false, true>(xs, nullptr, out, p.numel, d, T)
                    : encode_loop<In, W, false, false>(xs, nullptr, out, p.numel, d, T);
      }
    }, "cast: wire");
  }, "cast: input");
  finish_packet(a.packet, p.layout, flag ? kFlagNonFinite : 0, a.ctx);
}

void decode(const CastPlan& p, const DecodeArgs& a) {
  PacketHeader h;
  std::memcpy(&h, a.packet, sizeof h);
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  dispatch_float(p.wire, [&](auto w) {
    using W = decltype(w);
    const auto* in = reinterpret_cast<const typename W::storage*>(a.packet + p.layout.sections[0].offset);
    dispatch_float(a.out.dtype, [&](auto o) {
      using O = decltype(o);
      decode_loop<W, O>(in, a.out.ptr<typename O::storage>(), p.numel, a.alpha, a.mode == DecodeMode::accumulate,
                        p.threads);
    }, "decode: out");
  }, "cast: wire");
  // Every non-finite value travels in the payload itself: nothing to write into out[0].
  if ((h.flags & kFlagNonFinite) && status) *status |= kStatusNonFinite;
}

int64_t workspace_bytes(const CastPlan&) { return kStatusBytes; }

} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE

GRADCOMP_CPU_TABLE(CastPlan, cast, workspace_bytes, encode, decode)
