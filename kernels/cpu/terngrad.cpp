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
#include "gradcomp/error.hpp"
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
    const int64_t lo = t * kSumTile, hi = std::min(n, lo + kSumTile);
    for (int64_t i = lo; i < hi; ++i) {
      const float y = src.y(src.xp(i));
      nf |= uint32_t(!is_finite_bits(float_bits(y)));
      const double d = double(y);
      l1[(i - lo) % kSumLanes] = common::dadd(l1[(i - lo) % kSumLanes], d);
      l2[(i - lo) % kSumLanes] = common::dadd(l2[(i - lo) % kSumLanes], common::dmul(d, d));
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
  float smax = 0.0f;
  if (!nf) {
#pragma omp parallel for num_threads(T) schedule(static) reduction(max : smax)
    for (int64_t i = 0; i < n; ++i) smax = std::max(smax, std::fabs(terngrad::clamp(src.y(src.xp(i)), clip)));
  }
  const float s = nf ? bits_float(0x7FC00000u) : smax;
  const bool draw = !nf && s > 0.0f;
  // 4. the codes, D and the residual, four elements (one byte, one Philox call) per step
  const int64_t nbytes = (n + 3) / 4;
#pragma omp parallel for num_threads(T) schedule(static)
  for (int64_t j = 0; j < nbytes; ++j) {
    const philox::Ctr4x32 w = draw ? terngrad::group_bits(key, uint64_t(j)) : philox::Ctr4x32{};
    uint32_t byte = 0;
    for (int t = 0; t < 4 && 4 * j + t < n; ++t) {
      const int64_t i = 4 * j + t;
      const float xp = src.xp(i);
      const float yc = terngrad::clamp(src.y(xp), clip);
      const uint32_t word = t == 0 ? w[0] : t == 1 ? w[1] : t == 2 ? w[2] : w[3];
      const uint32_t c = draw ? terngrad::code(yc, s, terngrad::uniform(word)) : 0u;
      byte |= c << (2 * t);
      if constexpr (HasRes) {
        const float d = terngrad::value(c, s);
        r[i] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(src.div, d));
      }
    }
    codes[j] = uint8_t(byte);
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
  if (bad >= 0) {
    throw CorruptPacket(concat("terngrad packet: code byte ", bad, " holds the 2-bit pattern 10, which no encoder "
                               "writes (accepted: 00, 01, 11)"));
  }
  const bool acc = a.mode == DecodeMode::accumulate;
  const float alpha = a.alpha;
  dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* out = a.out.ptr<typename O::storage>();
#pragma omp parallel for num_threads(p.threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float v = mul_rn(terngrad::value((codes[i >> 2] >> (2 * (i & 3))) & 3u, s), alpha);
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
