// SPDX-License-Identifier: Apache-2.0
// CPU backend of QSGD (kernels/core/codecs/qsgd.hpp, docs/contracts.md section 3): one task per
// block (OpenMP, static schedule): y and its fixed-order sum of squares (common/reduce.hpp's lane
// rule), the norm, then the codes from the block's Philox words (common/qsgd.hpp), D and the
// residual; decode element-wise.
#include <algorithm>
#include <cstring>

#include "../common/qsgd.hpp"
#include "../common/reduce.hpp"
#include "../core/codecs/qsgd.hpp"
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
uint32_t encode_loop(const typename In::storage* __restrict x, float* __restrict r, int8_t* __restrict codes,
                     float* __restrict norms, const QsgdPlan& p, const qsgd::Key& key, float div) {
  const int64_t n = p.numel, B = p.block;
  const float levels = float(p.levels);
  uint32_t flag = 0;
  TeamClock clock;
  const int T = p.threads;
#pragma omp parallel num_threads(T) reduction(| : flag)
  {
    clock.arrive();
    alignas(64) float y[qsgd::kMaxBlock];
    alignas(64) float xp[qsgd::kMaxBlock];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < p.nblocks; ++b) {
      const int64_t lo = b * B, len = std::min(B, n - lo);
      double lanes[common::kSumLanes] = {};
      uint32_t nf = 0;
      for (int64_t t = 0; t < len; ++t) {
        float v = In::load(x[lo + t]);
        if constexpr (HasRes) v = add_rn(v, r[lo + t]);
        xp[t] = v;
        y[t] = Div1 ? v : div_rn(v, div);
        nf |= uint32_t(!is_finite_bits(float_bits(y[t])));
        const double d = double(y[t]);
        lanes[t % common::kSumLanes] = common::dadd(lanes[t % common::kSumLanes], common::dmul(d, d));
      }
      const float norm = qsgd::block_norm(common::lane_tree(lanes), nf != 0);
      norms[b] = norm;
      const bool usable = is_finite_bits(float_bits(norm)) && norm != 0.0f;
      const float ratio = usable ? div_rn(levels, norm) : 0.0f;
      const float dscale = div_rn(norm, levels);
      flag |= uint32_t(!is_finite_bits(float_bits(norm)));
      uint64_t cur = ~uint64_t(0);
      philox::Ctr4x32 w{};
      for (int64_t t = 0; t < len; ++t) {
        const int64_t i = lo + t;
        const uint64_t g = uint64_t(i) / qsgd::kGroup;
        if (g != cur) {
          w = qsgd::group_bits(key, g);
          cur = g;
        }
        const uint32_t word = (i & 3) == 0 ? w[0] : (i & 3) == 1 ? w[1] : (i & 3) == 2 ? w[2] : w[3];
        const int32_t c = nf ? 0 : qsgd::code(y[t], ratio, qsgd::uniform(word), p.levels);
        codes[i] = int8_t(c);
        if constexpr (HasRes) {
          const float d = mul_rn(dscale, float(c));
          r[i] = Div1 ? sub_rn(xp[t], d) : sub_rn(xp[t], mul_rn(div, d));
        }
      }
    }
    clock.finish();
  }
  clock.report(T);
  return flag;
}

void encode(const QsgdPlan& p, const EncodeArgs& a) {
  const qsgd::Key key = qsgd::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
  auto* codes = reinterpret_cast<int8_t*>(a.packet + p.layout.sections[0].offset);
  auto* norms = reinterpret_cast<float*>(a.packet + p.layout.sections[1].offset);
  uint32_t flag = 0;
  dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    const auto* xs = a.x.ptr<const typename In::storage>();
    const float d = a.divisor;
    float* r = a.residual;
    if (r) flag = d == 1.0f ? encode_loop<In, true, true>(xs, r, codes, norms, p, key, d)
                            : encode_loop<In, true, false>(xs, r, codes, norms, p, key, d);
    else flag = d == 1.0f ? encode_loop<In, false, true>(xs, nullptr, codes, norms, p, key, d)
                          : encode_loop<In, false, false>(xs, nullptr, codes, norms, p, key, d);
  }, "qsgd: input");
  finish_packet(a.packet, p.layout, flag ? kFlagNonFinite : 0, a.ctx);
}

void decode(const QsgdPlan& p, const DecodeArgs& a) {
  PacketHeader h;
  std::memcpy(&h, a.packet, sizeof h);
  const auto* codes = reinterpret_cast<const int8_t*>(a.packet + p.layout.sections[0].offset);
  const auto* norms = reinterpret_cast<const float*>(a.packet + p.layout.sections[1].offset);
  const bool acc = a.mode == DecodeMode::accumulate;
  const float alpha = a.alpha, levels = float(p.levels);
  const int64_t n = p.numel, B = p.block;
  const int T = p.threads;
  dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* out = a.out.ptr<typename O::storage>();
    TeamClock clock;
#pragma omp parallel num_threads(T)
    {
      clock.arrive();
#pragma omp for schedule(static)
      for (int64_t b = 0; b < p.nblocks; ++b) {
        const float dscale = div_rn(norms[b], levels);
        for (int64_t i = b * B, e = std::min(n, i + B); i < e; ++i) {
          const float v = mul_rn(mul_rn(dscale, float(codes[i])), alpha);
          out[i] = O::store(acc ? add_rn(O::load(out[i]), v) : v);
        }
      }
      clock.finish();
    }
    clock.report(T);
  }, "decode: out");
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  if ((h.flags & kFlagNonFinite) && status) *status |= kStatusNonFinite;
}

int64_t workspace_bytes(const QsgdPlan&) { return kStatusBytes; }

} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE

GRADCOMP_CPU_TABLE(QsgdPlan, qsgd, workspace_bytes, encode, decode)
