// SPDX-License-Identifier: Apache-2.0
// CPU backend of QSGD (kernels/core/codecs/qsgd.hpp, docs/contracts.md section 3): one task per
// block (OpenMP, static schedule): y and its fixed-order sum of squares (common/reduce.hpp's lane
// rule), the norm, then the codes from the block's Philox words (common/qsgd.hpp), D and the
// residual; decode element-wise.
#include <algorithm>
#include <cmath>
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
    alignas(64) uint32_t wbuf[qsgd::kMaxBlock + 8];
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
        nf |= uint32_t((float_bits(y[t]) & 0x7F800000u) == 0x7F800000u);
      }
      // lane l adds elements l, l + 32, ... in order: rows of 32 (vectorized across the lanes)
      for (int64_t t0 = 0; t0 < len; t0 += common::kSumLanes) {
        const int m = int(std::min<int64_t>(common::kSumLanes, len - t0));
        for (int l = 0; l < m; ++l) {
          const double d = double(y[t0 + l]);
          lanes[l] = common::dadd(lanes[l], common::dmul(d, d));
        }
      }
      const float norm = qsgd::block_norm(common::lane_tree(lanes), nf != 0);
      norms[b] = norm;
      const bool usable = is_finite_bits(float_bits(norm)) && norm != 0.0f;
      const float ratio = usable ? div_rn(levels, norm) : 0.0f;
      const float dscale = div_rn(norm, levels);
      flag |= uint32_t(!is_finite_bits(float_bits(norm)));
      // the block's Philox words, element i's at wbuf[i - 4 g_lo] (one batch call per block)
      const uint64_t glo = uint64_t(lo) / qsgd::kGroup;
      if (!nf) {
        const int64_t ng = int64_t((uint64_t(lo + len - 1) / qsgd::kGroup) - glo + 1);
        philox::philox4x32_10_groups(glo, ng, key.c2, key.c3, {key.k0, key.k1}, wbuf);
      }
      if (!nf && is_finite_bits(float_bits(norm))) {
        // every y, q, D and x' is finite here, so the plain float32 operations are the fixed
        // expressions' (the NaN rule never applies): a branch-free loop the compiler vectorizes
        const uint32_t* wb = wbuf + (lo - int64_t(4 * glo));
        const int32_t L = p.levels;
        int8_t* cb = codes + lo;
        for (int64_t t = 0; t < len; ++t) {
          const uint32_t yb = float_bits(y[t]);
          const float q = common::mul_raw(ratio, bits_float(yb & 0x7FFFFFFFu));
          const float l = std::floor(q);
          const int32_t up = qsgd::uniform(wb[t]) < common::sub_raw(q, l) ? 1 : 0;
          const int32_t level = std::min(int32_t(l) + up, L);
          const int32_t c = (yb >> 31) ? -level : level;
          cb[t] = int8_t(c);
          if constexpr (HasRes) {
            const float d = common::mul_raw(dscale, float(c));
            r[lo + t] = Div1 ? common::sub_raw(xp[t], d) : common::sub_raw(xp[t], common::mul_raw(div, d));
          }
        }
      } else {
        for (int64_t t = 0; t < len; ++t) {
          const int64_t i = lo + t;
          const int32_t c = nf ? 0 : qsgd::code(y[t], ratio, qsgd::uniform(wbuf[i - int64_t(4 * glo)]), p.levels);
          codes[i] = int8_t(c);
          if constexpr (HasRes) {
            const float d = mul_rn(dscale, float(c));
            r[i] = Div1 ? sub_rn(xp[t], d) : sub_rn(xp[t], mul_rn(div, d));
          }
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
