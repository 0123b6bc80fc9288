// SPDX-License-Identifier: Apache-2.0
// CPU backend of the onebit codec (kernels/core/codecs/onebit.hpp) with fused error feedback.
//
// Work is cut into units = (chunk, reduce tile of kernels/common/reduce.hpp); chunks start on
// multiples of 8 elements, so units own whole bytes of the bit section and can run on any thread.
// A unit loads x' (and y = x' / divisor) into a local buffer, packs the signs of y (MSB first),
// and sums its terms in the fixed lane order. Chunks of one tile (chunk <= 4096): the same pass
// then takes the chunk's scale and writes the residual from L1 (one read of x and r). Larger
// chunks (and chunk=0 on large tensors): x' is kept in the residual (or nothing, without one), the
// tile sums go to the workspace, the scales follow per chunk, and a second pass over r writes
// r_new = x' - divisor * D. Packets do not depend on the thread count.
// Decode: D = bit ? s : -s; out = fl(D * alpha) (D when alpha is 1) or out = fl(out + fl(D * alpha)).
// Without accumulate every element of a chunk is one of two stored values: runs of 256 bytes and
// more copy each byte's 8 elements from a 256-entry table built once per chunk and thread.
#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>

#include "../common/reduce.hpp"
#include "../core/codecs/onebit.hpp"
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

//! D = bit ? s : -s
inline float signed_scale(bool bit, float s) { return bit ? s : bits_float(float_bits(s) ^ 0x80000000u); }

//! x'[0, len) into xb (x + r, or x), y into yb (xb itself when divisor is 1), zero-padded to a
//! multiple of 32 for the lane sums.
template <class In, bool HasRes, bool Div1>
void load_tile(const typename In::storage* __restrict x, const float* __restrict r, int64_t len, float div,
               float* __restrict xb, float* __restrict yb) {
  for (int64_t j = 0; j < len; ++j) {
    float v = In::load(x[j]);
    if constexpr (HasRes) v = add_rn(v, r[j]);
    xb[j] = v;
  }
  if constexpr (!Div1)
    for (int64_t j = 0; j < len; ++j) yb[j] = div_rn(xb[j], div);
  const int64_t padded = (len + kSumLanes - 1) / kSumLanes * kSumLanes;
  for (int64_t j = len; j < padded; ++j) yb[j] = 0.0f;
}

//! The fixed-order sum of the terms of yb[0, len) (zero-padded to a multiple of 32).
template <bool L2> double tile_sum(const float* __restrict yb, int64_t len) {
  double acc[kSumLanes] = {};
  const int64_t groups = (len + kSumLanes - 1) / kSumLanes;
  for (int64_t m = 0; m < groups; ++m)
    for (int l = 0; l < kSumLanes; ++l) {
      const double v = double(yb[m * kSumLanes + l]);
      acc[l] = common::dadd(acc[l], L2 ? common::dmul(v, v) : (v < 0 ? -v : v));
    }
  return common::lane_tree(acc);
}

//! Pack the signs of yb[0, len) into bytes starting at `bits` (element 0 = MSB of bits[0]); the last
//! byte's unused bits are 0. NaN and +-0.0 give 1.
void pack_signs(const float* __restrict yb, int64_t len, uint8_t* __restrict bits) {
  const int64_t whole = len / 8;
  // one 0/1 byte per element (a loop the compiler vectorizes), then 8 of them into one byte: in
  // w = sum_j f_j 2^(8j), the product w * 0x8040201008040201 puts f_j at bit 63 - j (every other
  // product bit lands below bit 56 or past bit 63, each on its own position: no carries)
  static_assert(std::endian::native == std::endian::little, "pack_signs reads 8 flag bytes as a little-endian word");
  alignas(64) uint8_t f[kSumTile];
  for (int64_t j = 0; j < 8 * whole; ++j) f[j] = uint8_t(!(yb[j] < 0.0f));
  for (int64_t k = 0; k < whole; ++k) {
    uint64_t w;
    std::memcpy(&w, f + 8 * k, 8);
    bits[k] = uint8_t((w * 0x8040201008040201ull) >> 56);
  }
  if (len % 8) {
    uint32_t b = 0;
    for (int64_t j = 0; j < len % 8; ++j) b |= uint32_t(!(yb[8 * whole + j] < 0.0f)) << (7 - j);
    bits[whole] = uint8_t(b);
  }
}

//! r_new = x' - D (x' - divisor * D) over a tile.
template <bool Div1>
void residual_tile(const float* __restrict xb, const float* __restrict yb, int64_t len, float s, float div,
                   float* __restrict r) {
  const float ds = Div1 ? s : mul_rn(div, s);  // divisor * (+-s) == +-(divisor * s)
  for (int64_t j = 0; j < len; ++j) r[j] = sub_rn(xb[j], signed_scale(!(yb[j] < 0.0f), ds));
}

//! Whether a chunk leaves a non-finite r_new: s or divisor * s not finite (x' is finite otherwise).
inline uint32_t chunk_nonfinite(float s, float div) {
  return uint32_t(!is_finite_bits(float_bits(s)) || !is_finite_bits(float_bits(mul_rn(div, s))));
}

template <class In, bool HasRes, bool Div1>
uint32_t encode_t(const OnebitPlan& p, const EncodeArgs& a, uint8_t* bits, float* scales, double* tile_sums) {
  const auto* xs = a.x.ptr<const typename In::storage>();
  float* r = a.residual;
  const float div = a.divisor;
  const int64_t n = p.numel, C = p.chunk, U = p.tiles, units = p.nchunks * U;
  const int T = p.threads;
  const bool l2 = p.l2;
  uint32_t flag = 0;
  TeamClock clock;
#pragma omp parallel num_threads(T) reduction(| : flag)
  {
    clock.arrive();
    alignas(64) float xb[kSumTile];
    alignas(64) float ybuf[kSumTile];
    float* yb = Div1 ? xb : ybuf;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t c = u / U, t = u % U;
      const int64_t c0 = c * C, c1 = std::min(n, c0 + C);
      const int64_t i0 = c0 + t * kSumTile;
      if (i0 >= c1) {  // a tile past the end of the last (shorter) chunk
        if (U > 1) tile_sums[u] = 0.0;
        continue;
      }
      const int64_t len = std::min(kSumTile, c1 - i0);
      const float* y = yb;
      // float32 input, no residual, divisor 1: y is x itself (whole lane groups need no padding)
      if constexpr (std::is_same_v<In, F32> && !HasRes && Div1) {
        if (len % kSumLanes == 0) y = reinterpret_cast<const float*>(xs) + i0;
        else load_tile<In, HasRes, Div1>(xs + i0, nullptr, len, div, xb, yb);
      } else {
        load_tile<In, HasRes, Div1>(xs + i0, HasRes ? r + i0 : nullptr, len, div, xb, yb);
      }
      pack_signs(y, len, bits + i0 / 8);
      const double S = l2 ? tile_sum<true>(y, len) : tile_sum<false>(y, len);
      if (U == 1) {  // the chunk is this tile: scale and residual now
        const float s = common::chunk_scale(S, c1 - c0, l2);  // one tile: the lane rule over tiles is S + 0s
        scales[c] = s;
        flag |= chunk_nonfinite(s, div);
        if constexpr (HasRes) residual_tile<Div1>(xb, yb, len, s, div, r + i0);
      } else {
        tile_sums[u] = S;
        if constexpr (HasRes) std::memcpy(r + i0, xb, size_t(len) * 4);  // r := x' for the second pass
      }
    }
    clock.finish();
  }
  clock.report(T);
  if (U == 1) return flag;
  // the scales: the lane rule over each chunk's tile sums
  for (int64_t c = 0; c < p.nchunks; ++c) {
    double v[kSumLanes] = {};
    for (int64_t t = 0; t < U; ++t) v[t % kSumLanes] = common::dadd(v[t % kSumLanes], tile_sums[c * U + t]);
    const int64_t c0 = c * C, c1 = std::min(n, c0 + C);
    scales[c] = common::chunk_scale(common::lane_tree(v), c1 - c0, l2);
    flag |= chunk_nonfinite(scales[c], div);
  }
  if constexpr (HasRes) {
    TeamClock clock2;
#pragma omp parallel num_threads(T)
    {
      clock2.arrive();
      alignas(64) float ybuf2[kSumTile];
#pragma omp for schedule(static)
      for (int64_t u = 0; u < units; ++u) {
        const int64_t c = u / U, t = u % U;
        const int64_t c0 = c * C, c1 = std::min(n, c0 + C);
        const int64_t i0 = c0 + t * kSumTile;
        if (i0 >= c1) continue;
        const int64_t len = std::min(kSumTile, c1 - i0);
        float* rp = r + i0;
        const float* y = rp;
        if constexpr (!Div1) {
          for (int64_t j = 0; j < len; ++j) ybuf2[j] = div_rn(rp[j], div);
          y = ybuf2;
        }
        const float ds = Div1 ? scales[c] : mul_rn(div, scales[c]);
        for (int64_t j = 0; j < len; ++j) rp[j] = sub_rn(rp[j], signed_scale(!(y[j] < 0.0f), ds));
      }
      clock2.finish();
    }
    clock2.report(T);
  }
  return flag;
}

void encode(const OnebitPlan& p, const EncodeArgs& a) {
  uint8_t* bits = a.packet + p.layout.sections[0].offset;
  auto* scales = reinterpret_cast<float*>(a.packet + p.layout.sections[1].offset);
  auto* tile_sums = reinterpret_cast<double*>(a.workspace + kStatusBytes);
  uint32_t flag = 0;
  dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    const bool div1 = a.divisor == 1.0f;
    if (a.residual) flag = div1 ? encode_t<In, true, true>(p, a, bits, scales, tile_sums)
                                : encode_t<In, true, false>(p, a, bits, scales, tile_sums);
    else flag = div1 ? encode_t<In, false, true>(p, a, bits, scales, tile_sums)
                     : encode_t<In, false, false>(p, a, bits, scales, tile_sums);
  }, "onebit: input");
  finish_packet(a.packet, p.layout, flag ? kFlagNonFinite : 0, a.ctx);
}

// ---- decode ----------------------------------------------------------------------------------------------------
template <class O>
void decode_t(const OnebitPlan& p, const DecodeArgs& a) {
  const uint8_t* bits = a.packet + p.layout.sections[0].offset;
  const uint8_t* scales = a.packet + p.layout.sections[1].offset;
  auto* out = a.out.ptr<typename O::storage>();
  const int64_t n = p.numel, C = p.chunk;
  const bool acc = a.mode == DecodeMode::accumulate;
  const float alpha = a.alpha;
  const bool alpha1 = alpha == 1.0f;  // D * 1 is D (a NaN s is already quiet)
  const int T = p.threads;
  const int64_t nbytes = (n + 7) / 8;
  using St = typename O::storage;
  // the two values of a chunk, the per-element expressions hoisted: D = +-s, v = D or fl(D * alpha)
  auto value = [&](bool bit, float s) {
    const float D = signed_scale(bit, s);
    return alpha1 ? D : mul_rn(D, alpha);
  };
  // one element at a time (accumulate, short runs, the partial last byte)
  auto bytes_loop = [&](int64_t k0, int64_t k1, float s) {
    const float vp = value(true, s), vn = value(false, s);
    for (int64_t k = k0; k < k1; ++k) {
      const uint32_t b = bits[k];
      const int64_t i0 = 8 * k, len = std::min<int64_t>(8, n - i0);
      for (int64_t j = 0; j < len; ++j) {
        const float v = ((b >> (7 - j)) & 1u) ? vp : vn;
        out[i0 + j] = O::store(acc ? add_rn(O::load(out[i0 + j]), v) : v);
      }
    }
  };
  constexpr int64_t kBlock = 512;  // bytes (4096 elements) per scheduling unit
  constexpr int64_t kLutMin = 256;  // bytes of one chunk in a block worth a table (2048 outputs: its size)
  const int64_t nblocks = (nbytes + kBlock - 1) / kBlock;
  TeamClock clock;
#pragma omp parallel num_threads(T)
  {
    clock.arrive();
    // out = store(v) takes two values per chunk: a table of the 8 stored elements of every byte
    alignas(64) St lut[256][8];
    int64_t lut_chunk = -1;
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t b0 = blk * kBlock, b1 = std::min(nbytes, b0 + kBlock);
      for (int64_t k = b0; k < b1;) {
        // the chunk of byte k (a chunk of C < n elements is a multiple of 8; C = n for one chunk)
        const int64_t c = 8 * k / C;
        const int64_t kend = std::min(b1, (std::min(n, (c + 1) * C) + 7) / 8);  // its bytes in the block
        float s;
        std::memcpy(&s, scales + 4 * c, 4);
        // whole bytes only: the last byte of a tensor whose length is not a multiple of 8 is partial
        const int64_t kwhole = (n % 8 && kend == nbytes) ? kend - 1 : kend;
        if (acc || kwhole - k < kLutMin) {
          bytes_loop(k, kend, s);
        } else {
          if (lut_chunk != c) {
            const St sp = O::store(value(true, s)), sn = O::store(value(false, s));
            for (int b = 0; b < 256; ++b)
              for (int j = 0; j < 8; ++j) lut[b][j] = ((b >> (7 - j)) & 1) ? sp : sn;
            lut_chunk = c;
          }
          for (int64_t kk = k; kk < kwhole; ++kk) std::memcpy(out + 8 * kk, lut[bits[kk]], sizeof lut[0]);
          if (kwhole < kend) bytes_loop(kwhole, kend, s);
        }
        k = kend;
      }
    }
    clock.finish();
  }
  clock.report(T);
}

void decode(const OnebitPlan& p, const DecodeArgs& a) {
  dispatch_float(a.out.dtype, [&](auto o) { decode_t<decltype(o)>(p, a); }, "decode: out");
  PacketHeader h;
  std::memcpy(&h, a.packet, sizeof h);
  // a non-finite scale travels in the packet: nothing more to write
  if ((h.flags & kFlagNonFinite) && a.workspace) *reinterpret_cast<uint32_t*>(a.workspace) |= kStatusNonFinite;
}

int64_t workspace_bytes(const OnebitPlan& p) {
  return p.tiles > 1 ? kStatusBytes + p.nchunks * p.tiles * 8 : kStatusBytes;
}

} // namespace
} // namespace GRADCOMP_CPU_NAMESPACE

GRADCOMP_CPU_TABLE(OnebitPlan, onebit, workspace_bytes, encode, decode)
