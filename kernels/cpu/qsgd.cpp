// SPDX-License-Identifier: Apache-2.0
// CPU backend of QSGD (kernels/core/codecs/qsgd.hpp, docs/contracts.md section 3): one task per
// block (OpenMP, static schedule): y and its fixed-order sum of squares (common/reduce.hpp's lane
// rule), the norm, then the codes from the block's Philox words (common/qsgd.hpp), D and the
// residual; decode element-wise. coding=elias (common/elias.hpp): the codes go to the workspace,
// then per block (OpenMP) their bit counts, a serial prefix sum into the block ends, and per block
// the bits at their offset (the bytes a block shares with its neighbours OR-ed atomically); decode
// parses every block into n bytes (the workspace from byte 16 when it holds them, else the heap),
// checking it, before anything is written, then decodes the codes as coding=dense does.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>

#include "../common/elias.hpp"
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

//! Bytes [16, 16 + n) of an elias encode's workspace hold the codes.
constexpr int64_t kCodesOffset = kStatusBytes;

//! Write the Elias stream of `codes` (p.numel int8) into the packet, or the dense fallback; returns
//! the header flag bits it adds and sets `*main` to the header's main parameter.
uint8_t elias_pack(const QsgdPlan& p, const int8_t* codes, uint8_t* packet, uint64_t* main) {
  const int64_t n = p.numel, B = p.block, nb = p.nblocks;
  uint8_t* stream = packet + p.layout.sections[0].offset;
  auto* ends = reinterpret_cast<uint32_t*>(packet + p.layout.sections[2].offset);
  const int T = p.threads;
#pragma omp parallel for num_threads(T) schedule(static)
  for (int64_t b = 0; b < nb; ++b) ends[b] = elias::block_bits(codes + b * B, std::min(B, n - b * B));
  uint64_t total = 0; // <= 13 n < 2^32: make_plan bounds n below 2^28
  for (int64_t b = 0; b < nb; ++b) ends[b] = uint32_t(total += ends[b]);
  if (total > uint64_t(8 * n)) {
    std::memcpy(stream, codes, size_t(n));
    std::memset(ends, 0, size_t(nb) * 4);
    *main = 0;
    return kFlagFallback;
  }
  std::memset(stream, 0, size_t(n));
#pragma omp parallel num_threads(T)
  {
    alignas(64) uint8_t buf[(13 * qsgd::kMaxBlock + 64) / 8 + 16];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < nb; ++b) {
      const uint64_t at = b ? ends[b - 1] : 0, bits = ends[b] - at;
      if (bits == 0) continue;
      // the block's bits into buf, starting at bit (at mod 8) of buf[0]
      const int64_t len = std::min(B, n - b * B);
      const int8_t* c = codes + b * B;
      const int s0 = int(at & 7);
      const int64_t nbytes = int64_t((uint64_t(s0) + bits + 7) / 8);
      uint64_t acc = 0; // the pending `pend` bits, right-aligned
      int pend = s0;
      int64_t out = 0, prev = -1;
      for (int64_t i = 0; i < len; ++i) {
        if (c[i] == 0) continue;
        const elias::Entry e = elias::entry(uint32_t(i - prev), c[i]);
        prev = i;
        acc = (acc << e.width) | e.value;
        pend += e.width;
        while (pend >= 8) {
          pend -= 8;
          buf[out++] = uint8_t(acc >> pend);
        }
        acc &= (uint64_t(1) << pend) - 1;
      }
      if (pend > 0) buf[out++] = uint8_t(acc << (8 - pend));
      // the first and last bytes may hold a neighbouring block's bits
      uint8_t* dst = stream + (at >> 3);
      for (int64_t j = 0; j < nbytes; ++j) {
        if (j == 0 || j == nbytes - 1) std::atomic_ref<uint8_t>(dst[j]).fetch_or(buf[j], std::memory_order_relaxed);
        else dst[j] = buf[j];
      }
    }
  }
  *main = total;
  return 0;
}

void encode(const QsgdPlan& p, const EncodeArgs& a) {
  const qsgd::Key key = qsgd::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
  auto* codes = p.elias ? reinterpret_cast<int8_t*>(a.workspace + kCodesOffset)
                        : reinterpret_cast<int8_t*>(a.packet + p.layout.sections[0].offset);
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
  uint8_t flags = flag ? kFlagNonFinite : 0;
  if (p.elias) {
    uint64_t main = 0;
    flags |= elias_pack(p, codes, a.packet, &main);
    finish_packet(a.packet, p.layout, flags, a.ctx);
    std::memcpy(a.packet + offsetof(PacketHeader, main_param), &main, sizeof main);
  } else {
    finish_packet(a.packet, p.layout, flags, a.ctx);
  }
}

//! Parse an Elias stream (header `h`) into `codes` (p.numel int8) before anything is written to
//! out: the block ends never decrease and the last is the header's bit count, within the capacity;
//! every block parses to exactly its bits. Throws CorruptPacket naming what is wrong.
void elias_check(const QsgdPlan& p, const PacketHeader& h, const uint8_t* packet, int8_t* codes) {
  const int64_t n = p.numel, B = p.block, nb = p.nblocks;
  const uint8_t* stream = packet + p.layout.sections[0].offset;
  const auto* ends = reinterpret_cast<const uint32_t*>(packet + p.layout.sections[2].offset);
  const uint64_t total = nb ? ends[nb - 1] : 0;
  if (total != h.main_param || total > uint64_t(8 * n))
    throw_corrupt_packet("decode: qsgd coding=elias: the last block ends at stream bit %llu but the header says %llu "
                         "(capacity %lld bits)", (unsigned long long)total, (unsigned long long)h.main_param,
                         (long long)(8 * n));
  for (int64_t b = 1; b < nb; ++b)
    if (ends[b] < ends[b - 1])
      throw_corrupt_packet("decode: qsgd coding=elias: block %lld ends at stream bit %u, before block %lld (%u)",
                           (long long)b, ends[b], (long long)(b - 1), ends[b - 1]);
  // the bits past the stream are zero (so a fallback packet that lost its flag is refused)
  const int64_t used = int64_t((total + 7) / 8);
  const bool tail_clean = (total % 8 == 0 || (stream[used - 1] & (0xFFu >> (total % 8))) == 0) &&
                          std::all_of(stream + used, stream + n, [](uint8_t v) { return v == 0; });
  if (!tail_clean)
    throw_corrupt_packet("decode: qsgd coding=elias: the stream has non-zero bits past its %llu bits (capacity %lld)",
                         (unsigned long long)total, (long long)(8 * n));
  int64_t bad = -1;
#pragma omp parallel for num_threads(p.threads) schedule(static) reduction(max : bad)
  for (int64_t b = 0; b < nb; ++b)
    if (!elias::parse_block(stream, b ? ends[b - 1] : 0, ends[b], codes + b * B, std::min(B, n - b * B), p.levels))
      bad = std::max(bad, b);
  if (bad >= 0)
    throw_corrupt_packet("decode: qsgd coding=elias: block %lld's stream bits [%u, %u) are not a valid sequence of "
                         "(gap, sign, level) codes with positions inside the block and levels in [1, %d]",
                         (long long)bad, bad ? ends[bad - 1] : 0u, ends[bad], p.levels);
}

void decode(const QsgdPlan& p, const DecodeArgs& a) {
  PacketHeader h;
  std::memcpy(&h, a.packet, sizeof h);
  const auto* codes = reinterpret_cast<const int8_t*>(a.packet + p.layout.sections[0].offset);
  const auto* norms = reinterpret_cast<const float*>(a.packet + p.layout.sections[1].offset);
  const bool parse = p.elias && !(h.flags & kFlagFallback);
  const auto* ends = reinterpret_cast<const uint32_t*>(a.packet + p.layout.sections[p.elias ? 2 : 0].offset);
  // the parsed codes (n bytes): in the workspace from byte kCodesOffset when it holds them (as
  // workspace_bytes sizes it), else on the heap (a CPU decode may be given no workspace)
  std::unique_ptr<int8_t[]> heap;
  int8_t* parsed = nullptr;
  if (parse) {
    if (a.workspace && a.workspace_bytes >= kCodesOffset + p.numel) parsed = reinterpret_cast<int8_t*>(a.workspace + kCodesOffset);
    else parsed = (heap = std::unique_ptr<int8_t[]>(new int8_t[size_t(p.numel) + 1])).get();
    elias_check(p, h, a.packet, parsed);
  }
  if (p.elias && !parse && (h.main_param != 0 || std::any_of(ends, ends + p.nblocks, [](uint32_t e) { return e != 0; })))
    throw_corrupt_packet("decode: qsgd coding=elias: a fallback packet (header flag bit 1) must have main parameter 0 "
                         "and zero ends; this one has %llu", (unsigned long long)h.main_param);
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
        const int64_t lo = b * B, len = std::min(B, n - lo);
        const int8_t* c = (parse ? parsed : codes) + lo;
        for (int64_t t = 0; t < len; ++t) {
          const float v = mul_rn(mul_rn(dscale, float(c[t])), alpha);
          out[lo + t] = O::store(acc ? add_rn(O::load(out[lo + t]), v) : v);
        }
      }
      clock.finish();
    }
    clock.report(T);
  }, "decode: out");
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  if ((h.flags & kFlagNonFinite) && status) *status |= kStatusNonFinite;
}

int64_t workspace_bytes(const QsgdPlan& p) { return p.elias ? kCodesOffset + (p.numel + 15) / 16 * 16 : kStatusBytes; }

} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE

GRADCOMP_CPU_TABLE(QsgdPlan, qsgd, workspace_bytes, encode, decode)
