// SPDX-License-Identifier: Apache-2.0
// CPU backend of random-k (kernels/core/codecs/randomk.hpp, docs/contracts.md section 3): one pass
// over the strata (OpenMP, static schedule), each stratum's index from kernels/common/randomk.hpp,
// error feedback fused: a branch-free loop over the stratum (the non-finite bit, r = x'), then its
// selected element (x' read back from r); decode scatters (accumulate) or writes every element
// (assign: the stratum's alpha * 0, then its value).
#include <cstring>

#include "../common/randomk.hpp"
#include "../core/codecs/randomk.hpp"
#include "isa.hpp"
#include "parallel.hpp"

namespace GRADCOMP_CPU_NAMESPACE {
namespace {

using common::add_rn;
using common::bits_float;
using common::div_rn;
using common::float_bits;
using common::is_finite_bits;
using common::mul_rn;
using common::sub_rn;

template <class In, bool HasRes, bool Div1>
uint32_t encode_loop(const typename In::storage* __restrict x, float* __restrict r, typename In::storage* __restrict vals,
                     const RandomKPlan& p, const randomk::Key& key, float div) {
  const int64_t n = p.numel, k = p.k;
  uint32_t flag = 0;
  TeamClock clock;
  const int T = p.threads;
  if (k == 0) {  // nothing is sent: the residual keeps x', the flag still reports non-finite input
#pragma omp parallel num_threads(T) reduction(| : flag)
    {
      clock.arrive();
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        float xp = In::load(x[i]);
        if constexpr (HasRes) xp = add_rn(xp, r[i]);
        const float y = Div1 ? xp : div_rn(xp, div);
        flag |= uint32_t(!is_finite_bits(float_bits(y)));
        if constexpr (HasRes) r[i] = xp;
      }
      clock.finish();
    }
    clock.report(T);
    return flag;
  }
  const randomk::Strata s = randomk::strata(n, k);
  float xp0 = 0.0f;  // x' at i_0 (for the non-finite fix-up below; one writer: stratum 0)
#pragma omp parallel num_threads(T) reduction(| : flag)
  {
    clock.arrive();
#pragma omp for schedule(static)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t lo = s.lo(j), hi = lo + s.size(j), at = randomk::index_of(key, s, j);
      // the stratum, branch-free (vectorized): the non-finite bit of every y, r = x' everywhere
      uint32_t nf = 0;
      for (int64_t i = lo; i < hi; ++i) {
        float xp = In::load(x[i]);
        if constexpr (HasRes) xp = add_rn(xp, r[i]);
        const float y = Div1 ? xp : div_rn(xp, div);
        nf |= uint32_t((float_bits(y) & 0x7F800000u) == 0x7F800000u);
        if constexpr (HasRes) r[i] = xp;
      }
      // then its selected element: x' is in r (or x)
      const float xp = HasRes ? r[at] : In::load(x[at]);
      if (j == 0) xp0 = xp;
      const float y = Div1 ? xp : div_rn(xp, div);
      const auto c = In::store(p.unbiased ? mul_rn(y, float(hi - lo)) : y);
      vals[j] = c;
      nf |= uint32_t(In::nonfinite(c));
      if constexpr (HasRes) {
        const float d = In::load(c);
        r[at] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(div, d));
      }
      flag |= nf;
    }
    clock.finish();
  }
  clock.report(T);
  if (flag) {  // values_0 = NaN: the bucket stays non-finite after a sum of payloads
    vals[0] = In::store(bits_float(0x7FC00000u));
    if constexpr (HasRes) {  // r_{i_0} = x' - W D_{i_0} with the value now sent
      const float d = In::load(vals[0]);
      r[randomk::index_of(key, s, 0)] = Div1 ? sub_rn(xp0, d) : sub_rn(xp0, mul_rn(div, d));
    }
  }
  return flag;
}

void encode(const RandomKPlan& p, const EncodeArgs& a) {
  const randomk::Key key = randomk::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
  uint32_t flag = 0;
  dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    const auto* xs = a.x.ptr<const typename In::storage>();
    auto* vals = reinterpret_cast<typename In::storage*>(a.packet + p.layout.sections[0].offset);
    const float d = a.divisor;
    float* r = a.residual;
    if (r) flag = d == 1.0f ? encode_loop<In, true, true>(xs, r, vals, p, key, d) : encode_loop<In, true, false>(xs, r, vals, p, key, d);
    else flag = d == 1.0f ? encode_loop<In, false, true>(xs, nullptr, vals, p, key, d)
                          : encode_loop<In, false, false>(xs, nullptr, vals, p, key, d);
  }, "randomk: input");
  finish_packet(a.packet, p.layout, flag ? kFlagNonFinite : 0, a.ctx);
}

void decode(const RandomKPlan& p, const DecodeArgs& a) {
  PacketHeader h;
  std::memcpy(&h, a.packet, sizeof h);
  const EncodeContext ctx = load_key(a.packet + p.layout.sections[p.layout.key_section].offset);
  const randomk::Key key = randomk::derive(ctx.seed, ctx.step, ctx.bucket, ctx.chunk);
  const int64_t n = p.numel, k = p.k;
  const bool acc = a.mode == DecodeMode::accumulate;
  const float alpha = a.alpha;
  const float zero = mul_rn(0.0f, alpha);  // alpha * D_i off the selection (assign)
  const int T = p.threads;
  dispatch_float(p.input, [&](auto w) {
    using W = decltype(w);
    const auto* vals = reinterpret_cast<const typename W::storage*>(a.packet + p.layout.sections[0].offset);
    dispatch_float(a.out.dtype, [&](auto o) {
      using O = decltype(o);
      auto* out = a.out.ptr<typename O::storage>();
      TeamClock clock;
      if (k == 0) {
        if (!acc) {
#pragma omp parallel for num_threads(T) schedule(static)
          for (int64_t i = 0; i < n; ++i) out[i] = O::store(zero);
        }
        // nothing was sent: a flagged packet makes out[0] NaN, as top-k's decode does
        if ((h.flags & kFlagNonFinite) && n > 0) out[0] = O::store(bits_float(0x7FC00000u));
        return;
      }
      const randomk::Strata s = randomk::strata(n, k);
#pragma omp parallel num_threads(T)
      {
        clock.arrive();
#pragma omp for schedule(static)
        for (int64_t j = 0; j < k; ++j) {
          const int64_t at = randomk::index_of(key, s, j);
          const float v = mul_rn(W::load(vals[j]), alpha);
          if (acc) {
            out[at] = O::store(add_rn(O::load(out[at]), v));
          } else {  // the stratum: alpha * 0, then its value
            const typename O::storage z = O::store(zero);
            for (int64_t i = s.lo(j), hi = i + s.size(j); i < hi; ++i) out[i] = z;
            out[at] = O::store(v);
          }
        }
        clock.finish();
      }
      clock.report(T);
    }, "decode: out");
  }, "randomk: wire");
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  if ((h.flags & kFlagNonFinite) && status) *status |= kStatusNonFinite;
}

int64_t workspace_bytes(const RandomKPlan&) { return kStatusBytes; }

} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE

GRADCOMP_CPU_TABLE(RandomKPlan, randomk, workspace_bytes, encode, decode)
