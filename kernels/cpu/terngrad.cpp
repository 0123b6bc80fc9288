// SPDX-License-Identifier: Apache-2.0
// CPU backend of TernGrad (kernels/core/codecs/terngrad.hpp, docs/contracts.md section 3): three
// passes over y = x' / W (OpenMP, static schedules): the tile sums of y and y^2 (common/reduce.hpp's
// lane rule) and the non-finite bit, then (after the fixed-order fold and the clip threshold) the
// max of |y_c|, then the 2-bit codes (one byte and one Philox call per 4 elements), D and the
// residual. Decode checks every code byte for the pattern 10 before writing anything.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../common/terngrad.hpp"
#include "../core/codecs/terngrad.hpp"
#include "isa.hpp"
#include "parallel.hpp"

namespace GRADCOMP_CPU_NAMESPACE {
namespace {

using common::add_rn;
using common::bits_float;
using common::div_rn;
using common::float_bits;
using common::is_finite_bits;
using common::kSumLanes;
using common::kSumTile;
using common::mul_rn;
using common::sub_rn;

template <class In, bool HasRes, bool Div1> struct Y {
  const typename In::storage* x;
  const float* r;
  float div;
  float xp(int64_t i) const {
    float v = In::load(x[i]);
    if constexpr (HasRes) v = add_rn(v, r[i]);
    return v;
  }
  float y(float xpv) const { return Div1 ? xpv : div_rn(xpv, div); }
  // the same without the NaN rule: where a NaN result is discarded, or none can occur (finite x')
  float xp_raw(int64_t i) const {
    float v = In::load(x[i]);
    if constexpr (HasRes) v = common::add_raw(v, r[i]);
    return v;
  }
  float y_raw(float xpv) const { return Div1 ? xpv : common::div_raw(xpv, div); }
};

template <class In, bool HasRes, bool Div1>
uint32_t encode_loop(const Y<In, HasRes, Div1>& src, float* __restrict r, uint8_t* __restrict codes, float* scale,
                     const TernGradPlan& p, const terngrad::Key& key) {
  const int64_t n = p.numel;
  const int T = p.threads;
  // 1. tile sums of y and y^2, the non-finite bit
  std::vector<double> s1(size_t(p.ntiles)), s2(size_t(p.ntiles));
  uint32_t nf = 0;
#pragma omp parallel for num_threads(T) schedule(static) reduction(| : nf)
  for (int64_t t = 0; t < p.ntiles; ++t) {
    double l1[kSumLanes] = {}, l2[kSumLanes] = {};
    alignas(64) float yb[kSumTile];
    const int64_t lo = t * kSumTile, hi = std::min(n, lo + kSumTile);
    for (int64_t i = lo; i < hi; ++i) {  // a NaN's bits do not matter here: the flag discards the sums
      yb[i - lo] = src.y_raw(src.xp_raw(i));
      nf |= uint32_t((float_bits(yb[i - lo]) & 0x7F800000u) == 0x7F800000u);
    }
    // lane l adds elements l, l + 32, ... in order: rows of 32 (vectorized across the lanes)
    for (int64_t t0 = 0; t0 < hi - lo; t0 += kSumLanes) {
      const int m = int(std::min<int64_t>(kSumLanes, hi - lo - t0));
      for (int l = 0; l < m; ++l) {
        const double d = double(yb[t0 + l]);
        l1[l] = common::dadd(l1[l], d);
        l2[l] = common::dadd(l2[l], common::dmul(d, d));
      }
    }
    s1[size_t(t)] = common::lane_tree(l1);
    s2[size_t(t)] = common::lane_tree(l2);
  }
  // 2. the tile sums folded by the same lane rule; the clip threshold
  double f1[kSumLanes] = {}, f2[kSumLanes] = {};
  for (int64_t t = 0; t < p.ntiles; ++t) {
    f1[t % kSumLanes] = common::dadd(f1[t % kSumLanes], s1[size_t(t)]);
    f2[t % kSumLanes] = common::dadd(f2[t % kSumLanes], s2[size_t(t)]);
  }
  const float clip = p.clip_c == 0.0 ? std::numeric_limits<float>::infinity()
                                     : terngrad::clip_threshold(common::lane_tree(f1), common::lane_tree(f2), n, p.clip_c);
  // 3. s = max |y_c| (finite y only; a non-finite one makes s NaN)
  // (the max of the float bits: non-negative floats order as integers, and the integer max vectorizes)
  uint32_t smax = 0;
  if (!nf) {
#pragma omp parallel for num_threads(T) schedule(static) reduction(max : smax)
    for (int64_t i = 0; i < n; ++i)
      smax = std::max(smax, float_bits(std::min(std::max(src.y_raw(src.xp_raw(i)), -clip), clip)) & 0x7FFFFFFFu);
  }
  const float s = nf ? bits_float(0x7FC00000u) : bits_float(smax);
  const bool draw = !nf && s > 0.0f;
  // 4. the codes, D and the residual, four elements (one byte, one Philox call) per step, the
  // words of 256 bytes' groups at a time (one batch call)
  const int64_t nbytes = (n + 3) / 4;
  constexpr int64_t kSpan = 256;
#pragma omp parallel for num_threads(T) schedule(static)
  for (int64_t jb = 0; jb < nbytes; jb += kSpan) {
    alignas(64) uint32_t wbuf[4 * kSpan];
    const int64_t je = std::min(nbytes, jb + kSpan);
    if (draw) philox::philox4x32_10_groups(uint64_t(jb), je - jb, key.c2, key.c3, {key.k0, key.k1}, wbuf);
    if (draw && 4 * je <= n) {
      // every x', y, y_c, p and D is finite here (s finite and > 0), so the plain float32 operations
      // are the fixed expressions' (no NaN for the rule to act on): a flat, branch-free loop over
      // the span's elements (vectorized), then the packing of four codes per byte
      alignas(64) uint8_t cb[4 * kSpan];
      const int64_t i0 = 4 * jb, m = 4 * (je - jb);
      for (int64_t t = 0; t < m; ++t) {
        const float xp = src.xp_raw(i0 + t);
        const float yc = std::min(std::max(src.y_raw(xp), -clip), clip);
        const uint32_t yb = float_bits(yc);
        const bool on = terngrad::uniform(wbuf[t]) < common::div_raw(bits_float(yb & 0x7FFFFFFFu), s);
        cb[t] = uint8_t(on ? ((yb >> 31) ? 3u : 1u) : 0u);
        if constexpr (HasRes) {
          const float d = on ? ((yb >> 31) ? -s : s) : 0.0f;
          r[i0 + t] = Div1 ? common::sub_raw(xp, d) : common::sub_raw(xp, common::mul_raw(src.div, d));
        }
      }
      for (int64_t j = jb; j < je; ++j) {
        const uint8_t* q = cb + 4 * (j - jb);
        codes[j] = uint8_t(q[0] | (q[1] << 2) | (q[2] << 4) | (q[3] << 6));
      }
      continue;
    }
    for (int64_t j = jb; j < je; ++j) {
      uint32_t byte = 0;
      for (int t = 0; t < 4 && 4 * j + t < n; ++t) {
        const int64_t i = 4 * j + t;
        const float xp = src.xp(i);
        const float yc = terngrad::clamp(src.y(xp), clip);
        const uint32_t c = draw ? terngrad::code(yc, s, terngrad::uniform(wbuf[4 * (j - jb) + t])) : 0u;
        byte |= c << (2 * t);
        if constexpr (HasRes) {
          const float d = terngrad::value(c, s);
          r[i] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(src.div, d));
        }
      }
      codes[j] = uint8_t(byte);
    }
  }
  std::memcpy(scale, &s, 4);
  return nf;
}

void encode(const TernGradPlan& p, const EncodeArgs& a) {
  const terngrad::Key key = terngrad::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
  auto* codes = a.packet + p.layout.sections[0].offset;
  auto* scale = reinterpret_cast<float*>(a.packet + p.layout.sections[1].offset);
  uint32_t flag = 0;
  dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    const auto* xs = a.x.ptr<const typename In::storage>();
    float* r = a.residual;
    const float d = a.divisor;
    if (r) {
      flag = d == 1.0f ? encode_loop(Y<In, true, true>{xs, r, d}, r, codes, scale, p, key)
                       : encode_loop(Y<In, true, false>{xs, r, d}, r, codes, scale, p, key);
    } else {
      flag = d == 1.0f ? encode_loop(Y<In, false, true>{xs, nullptr, d}, nullptr, codes, scale, p, key)
                       : encode_loop(Y<In, false, false>{xs, nullptr, d}, nullptr, codes, scale, p, key);
    }
  }, "terngrad: input");
  finish_packet(a.packet, p.layout, flag ? kFlagNonFinite : 0, a.ctx);
}

void decode(const TernGradPlan& p, const DecodeArgs& a) {
  PacketHeader h;
  std::memcpy(&h, a.packet, sizeof h);
  const uint8_t* codes = a.packet + p.layout.sections[0].offset;
  float s;
  std::memcpy(&s, a.packet + p.layout.sections[1].offset, 4);
  const int64_t n = p.numel, nbytes = (n + 3) / 4;
  // a code 10 never comes from an encoder: refuse the packet before writing anything
  int64_t bad = -1;
  for (int64_t j = 0; j < nbytes && bad < 0; ++j) {
    const uint32_t b = codes[j];
    if (((b & 0xAAu) & ~((b & 0x55u) << 1)) != 0u) bad = j;
  }
  if (bad >= 0) {  // (throw_corrupt_packet: defined once in the core, no exception code in the ISA variants)
    throw_corrupt_packet("terngrad packet: code byte %lld holds the 2-bit pattern 10, which no encoder writes "
                         "(accepted: 00, 01, 11)", (long long)bad);
  }
  const bool acc = a.mode == DecodeMode::accumulate;
  const float alpha = a.alpha;
  dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* out = a.out.ptr<typename O::storage>();
    // alpha * D of the three codes (code 2 was refused above)
    const float lut[4] = {mul_rn(terngrad::value(0u, s), alpha), mul_rn(terngrad::value(1u, s), alpha), 0.0f,
                          mul_rn(terngrad::value(3u, s), alpha)};
#pragma omp parallel for num_threads(p.threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float v = lut[(codes[i >> 2] >> (2 * (i & 3))) & 3u];
      out[i] = O::store(acc ? add_rn(O::load(out[i]), v) : v);
    }
  }, "decode: out");
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  if ((h.flags & kFlagNonFinite) && status) *status |= kStatusNonFinite;
}

int64_t workspace_bytes(const TernGradPlan&) { return kStatusBytes; }

} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE

GRADCOMP_CPU_TABLE(TernGradPlan, terngrad, workspace_bytes, encode, decode)
