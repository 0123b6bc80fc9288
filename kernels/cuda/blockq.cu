// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the block quantizers fp8 / int8 / int4 (kernels/core/codecs/blockq.hpp) with fused
// error feedback. Packets are byte-for-byte those of kernels/cpu/blockq.cpp: the same scale rules
// and integer rounding (kernels/common/quant.hpp), the fixed float32 expressions (common/math.hpp),
// and for fp8 the hardware round-to-nearest-even convert (cuda_fp8.h, satfinite) applied only to
// finite quotients -- a non-finite one takes ml_dtypes' pattern first; finite quotients never
// exceed the largest finite value by more than a rounding, where satfinite and ml_dtypes agree.
//
// Encode, blocks of at most kTile elements (the defaults 128 and 32): one pass. A CUDA block owns
// a tile of whole data blocks (kTile / B of them); each thread loads 4 consecutive elements of x
// (and the residual) with 16-byte loads when aligned, keeps x' and y in registers, and takes the
// per-data-block finite amax with shared-memory atomicMax on the float bits (non-negative floats
// order as integers; max is order-free, so the result does not depend on scheduling), one atomic
// per run of the thread's elements in one data block (their data blocks in the tile are the same
// for every tile: found once per thread); after a barrier the scales are set and each thread
// quantizes its 4 elements (codes stored as one 32-bit word, int4 as 16 bits, the residual as a
// float4). Larger blocks and block=0: an amax kernel (per warp step the lanes' maxima / ORs per data
// block, a warp reduction, a running per-warp value flushed by one global atomicMax / atomicOr
// per data block change: block=0 takes one per warp in all), then an element-wise quantization
// kernel (one scale per quad that sits in one data block). The last CUDA block (atomic counter)
// writes the header, zeroes the padding.
// Decode: element-wise, 4 per thread (codes in one 4-byte / 2-byte load, one scale per quad in one
// data block, out through one 16-byte / 8-byte vector when aligned; the products with the plain
// roundings, the NaN rule redone only for a NaN result: mul2_acc_rn, bitwise the rule's); the
// header is checked on the device (decode_prologue).
// Element-wise loops find data blocks with a BlockCursor (common.cuh): one division per thread,
// then additions; no per-element division. Grids: one wave of each kernel (occupancy x SMs,
// wave_blocks); no result depends on the grid size.
#include "../common/keyed.hpp"
#include "../common/quant.hpp"
#include "../core/codecs/blockq.hpp"
#include "common.cuh"
#include "fp8.cuh"

namespace gradcomp::detail::cuda {
namespace {

using common::add_rn;
using common::div_rn;
using common::mul_rn;
using common::sub_rn;
using plan::kThreads;

constexpr int kQuad = 4;
constexpr int64_t kTile = int64_t(kThreads) * kQuad;  // 1024 elements per CUDA block and step

// workspace: [0, 16) status word, flag (4), counter (8); [16, ...) for the two-pass path: per data
// block the amax bits (u32) and the non-finite bit (u32)
constexpr int64_t kFlagOffset = plan::kCastFlagOffset;
constexpr int64_t kCounterOffset = plan::kCastCounterOffset;
constexpr int64_t kAmaxOffset = 16;

template <QuantKind K> struct DQ;
template <> struct DQ<QuantKind::e4m3> {
  static constexpr float kMax = common::kE4M3Max;
  __device__ static uint32_t code(float q) { return fp8_e4m3_code(q); }
  __device__ static float value(uint32_t c) { return common::e4m3fn_to_float(uint8_t(c)); }
};
template <> struct DQ<QuantKind::e5m2> {
  static constexpr float kMax = common::kE5M2Max;
  __device__ static uint32_t code(float q) { return fp8_e5m2_code(q); }
  __device__ static float value(uint32_t c) { return common::e5m2_to_float(uint8_t(c)); }
};
template <int Max> struct DIntQ {
  static constexpr float kMax = float(Max);
  __device__ static uint32_t code(float q) {
    const float r = common::round_half_even(q);
    return uint32_t(int32_t(fminf(fmaxf(r, -kMax), kMax)));
  }
  __device__ static float value(uint32_t c) { return float(int32_t(c)); }
};
template <> struct DQ<QuantKind::int8> : DIntQ<127> {};
template <> struct DQ<QuantKind::int4> : DIntQ<7> {};
constexpr bool is_int(QuantKind k) { return k == QuantKind::int8 || k == QuantKind::int4; }

struct EncArgs {
  const void* x;
  float* r;
  int64_t n;
  int64_t B;
  int64_t nblocks;
  float div;
  int div1;
  int e8m0;
  int vec;          //!< x, r and the tiles 16-byte aligned: vector loads
  uint8_t* packet;
  int64_t codes_off;
  int64_t scales_off;
  uint32_t* flag;
  uint32_t* counter;
  uint32_t* amax;   //!< two-pass path: [nblocks] amax bits, then [nblocks] non-finite bits
  PacketLayout layout;
  EncodeContext ctx;
  int sr;           //!< int8 / int4 rounding=stochastic: codes from common::int_code_sr
  keyed::Key key;   //!< its stream (derived once on the host, tag kIntSrTag)
};

//! The scale of a data block from its amax bits and non-finite bit; writes it into the packet.
template <QuantKind K> __device__ float set_scale(const EncArgs& a, int64_t b, uint32_t amax_bits, bool nonfinite) {
  const float amax = __uint_as_float(amax_bits);
  float d;
  if (is_int(K) && nonfinite) {
    d = __uint_as_float(0x7FC00000u);
    reinterpret_cast<float*>(a.packet + a.scales_off)[b] = d;
  } else if (a.e8m0) {
    const uint8_t byte = common::block_scale_e8m0(amax, DQ<K>::kMax);
    d = common::e8m0_to_float(byte);
    a.packet[a.scales_off + b] = byte;
  } else {
    d = common::block_scale(amax, DQ<K>::kMax);
    reinterpret_cast<float*>(a.packet + a.scales_off)[b] = d;
  }
  return d;
}

//! Store the codes of the 4 (or fewer, nv) consecutive elements starting at element i.
template <QuantKind K> __device__ void store_codes(const EncArgs& a, int64_t i, const uint32_t (&c)[kQuad], int nv) {
  uint8_t* codes = a.packet + a.codes_off;
  if constexpr (K == QuantKind::int4) {
    if (nv == kQuad && (i % 4) == 0) {
      const uint16_t w = uint16_t((c[0] & 15u) | ((c[1] & 15u) << 4) | ((c[2] & 15u) << 8) | ((c[3] & 15u) << 12));
      reinterpret_cast<uint16_t*>(codes)[i / 2 / 2] = w;
    } else {  // i is even (blocks are even), so the quad's bytes are its own
#pragma unroll
      for (int j = 0; j < kQuad; j += 2) {
        if (j < nv) {
          const uint32_t hi = j + 1 < nv ? (c[j + 1] & 15u) << 4 : 0u;
          codes[(i + j) / 2] = uint8_t((c[j] & 15u) | hi);
        }
      }
    }
  } else {
    if (nv == kQuad && (i % 4) == 0) {
      reinterpret_cast<uint32_t*>(codes)[i / 4] =
          (c[0] & 255u) | ((c[1] & 255u) << 8) | ((c[2] & 255u) << 16) | ((c[3] & 255u) << 24);
    } else {
#pragma unroll
      for (int j = 0; j < kQuad; ++j)
        if (j < nv) codes[i + j] = uint8_t(c[j]);
    }
  }
}

template <class In, bool HasRes>
__device__ void load_quad(const EncArgs& a, int64_t i, int nv, bool vec, float (&xp)[kQuad], float (&y)[kQuad]) {
  const auto* xs = static_cast<const typename In::storage*>(a.x);
  if (vec && nv == kQuad) {
    if constexpr (sizeof(typename In::storage) == 4) {
      const float4 v = *reinterpret_cast<const float4*>(xs + i);
      xp[0] = v.x; xp[1] = v.y; xp[2] = v.z; xp[3] = v.w;
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(xs + i);
      xp[0] = In::load(uint16_t(v.x & 0xFFFFu)); xp[1] = In::load(uint16_t(v.x >> 16));
      xp[2] = In::load(uint16_t(v.y & 0xFFFFu)); xp[3] = In::load(uint16_t(v.y >> 16));
    }
    if constexpr (HasRes) {
      const float4 r = *reinterpret_cast<const float4*>(a.r + i);
      xp[0] = add_rn(xp[0], r.x); xp[1] = add_rn(xp[1], r.y); xp[2] = add_rn(xp[2], r.z); xp[3] = add_rn(xp[3], r.w);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kQuad; ++j) {
      float v = 0.0f;
      if (j < nv) {
        v = In::load(xs[i + j]);
        if constexpr (HasRes) v = add_rn(v, a.r[i + j]);
      }
      xp[j] = v;
    }
  }
#pragma unroll
  for (int j = 0; j < kQuad; ++j) y[j] = a.div1 ? xp[j] : div_rn(xp[j], a.div);
}

//! Quantize a quad with per-element scales d[j]; stores codes and the residual; returns 1 when a
//! new residual x' - div * D is non-finite (computed whether or not a residual is stored).
template <QuantKind K, bool HasRes>
__device__ uint32_t quantize_quad(const EncArgs& a, int64_t i, int nv, bool vec, const float (&xp)[kQuad],
                                  const float (&y)[kQuad], const float (&d)[kQuad], const bool (&nfb)[kQuad]) {
  uint32_t c[kQuad];
  float rn[kQuad];
  uint32_t nf = 0;
  // rounding=stochastic: element i + j's word, from the groups (i + j) / 4 (the quad may straddle two)
  philox::Ctr4x32 wa{}, wb{};
  if (is_int(K) && a.sr) {
    wa = keyed::group_bits(a.key, uint64_t(i) / 4);
    if ((i & 3) != 0) wb = keyed::group_bits(a.key, uint64_t(i) / 4 + 1);
  }
#pragma unroll
  for (int j = 0; j < kQuad; ++j) {
    if (is_int(K) && a.sr) {
      const int64_t e = (i & 3) + j;
      const uint32_t word = e < 4 ? keyed::word_of(wa, e) : keyed::word_of(wb, e - 4);
      c[j] = nfb[j] || j >= nv ? 0u
                               : uint32_t(common::int_code_sr(div_rn(y[j], d[j]), keyed::uniform(word), DQ<K>::kMax));
    } else {
      c[j] = (is_int(K) && nfb[j]) || j >= nv ? 0u : DQ<K>::code(div_rn(y[j], d[j]));
    }
    const float dv = mul_rn(DQ<K>::value(c[j]), d[j]);
    rn[j] = a.div1 ? sub_rn(xp[j], dv) : sub_rn(xp[j], mul_rn(a.div, dv));
    if (j < nv) nf |= nonfinite_bit(rn[j]);  // x' or D or div * D non-finite (CPU: block_nonfinite)
  }
  store_codes<K>(a, i, c, nv);
  if constexpr (HasRes) {
    if (vec && nv == kQuad) {
      *reinterpret_cast<float4*>(a.r + i) = make_float4(rn[0], rn[1], rn[2], rn[3]);
    } else {
#pragma unroll
      for (int j = 0; j < kQuad; ++j)
        if (j < nv) a.r[i + j] = rn[j];
    }
  }
  return nf;
}

__device__ void finish(const EncArgs& a, uint32_t nf) {
  if (__syncthreads_or(nf) && threadIdx.x == 0) atomicOr(a.flag, 1u);
  __shared__ bool s_last;
  if (!elect_last_block(a.counter, &s_last)) return;
  __shared__ uint32_t s_flag;
  if (threadIdx.x == 0) s_flag = atomicOr(a.flag, 0u);
  __syncthreads();
  finish_packet_block(a.packet, a.layout, s_flag ? kFlagNonFinite : 0, a.ctx);
}

// ---- one pass: tiles of whole data blocks ------------------------------------------------------------------
template <class In, QuantKind K, bool HasRes> __global__ void __launch_bounds__(kThreads) tile_kernel(EncArgs a) {
  __shared__ uint32_t s_amax[kTile];
  __shared__ uint32_t s_nf[kTile];
  const int64_t per_tile = kTile / a.B;  // data blocks per tile (>= 1)
  const int64_t tile_elems = per_tile * a.B;
  const int64_t ntiles = (a.nblocks + per_tile - 1) / per_tile;
  // the thread's 4 elements sit at offsets 4 * threadIdx.x + j of every tile: their data blocks in
  // the tile, once (one 32-bit division, then steps)
  uint32_t lbj[kQuad];
  {
    const uint32_t B = uint32_t(a.B), o = uint32_t(threadIdx.x) * kQuad;
    uint32_t lb = o / B, r = o - lb * B;
#pragma unroll
    for (int j = 0; j < kQuad; ++j) {
      lbj[j] = lb;
      if (++r == B) {
        r = 0;
        ++lb;
      }
    }
  }
  uint32_t nf = 0;
  for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {  // uniform over the CUDA block
    const int64_t t0 = t * tile_elems;
    const int64_t t1 = plan::min64(a.n, t0 + tile_elems);
    const int64_t b0 = t * per_tile;
    const int64_t nb = plan::min64(per_tile, a.nblocks - b0);
    for (int64_t j = threadIdx.x; j < nb; j += kThreads) {
      s_amax[j] = 0u;
      s_nf[j] = 0u;
    }
    __syncthreads();
    const int64_t i = t0 + int64_t(threadIdx.x) * kQuad;
    const int nv = int(plan::max64(0, plan::min64(kQuad, t1 - i)));
    const bool vec = a.vec && (t0 % kQuad) == 0;
    float xp[kQuad], y[kQuad];
    if (nv > 0) load_quad<In, HasRes>(a, i, nv, vec, xp, y);
    // the max (and OR) of a run of elements in one data block first, then one shared atomic per run
    uint32_t m = 0, f = 0;
#pragma unroll
    for (int j = 0; j < kQuad; ++j) {
      if (j < nv) {
        m = max(m, __float_as_uint(common::finite_abs(y[j])));
        f |= common::is_finite_bits(__float_as_uint(y[j])) ? 0u : 1u;
        if (j + 1 == kQuad || j + 1 == nv || lbj[j + 1] != lbj[j]) {
          atomicMax(&s_amax[lbj[j]], m);
          if (f) atomicOr(&s_nf[lbj[j]], 1u);
          m = 0;
          f = 0;
        }
      }
    }
    __syncthreads();
    for (int64_t j = threadIdx.x; j < nb; j += kThreads) {
      const float d = set_scale<K>(a, b0 + j, s_amax[j], s_nf[j] != 0u);
      s_amax[j] = __float_as_uint(d);  // the scale, for the quantization below
    }
    __syncthreads();
    if (nv > 0) {
      float d[kQuad];
      bool nfb[kQuad];
#pragma unroll
      for (int j = 0; j < kQuad; ++j) {
        const uint32_t lb = j < nv ? lbj[j] : 0u;
        d[j] = __uint_as_float(s_amax[lb]);
        nfb[j] = s_nf[lb] != 0u;
      }
      nf |= quantize_quad<K, HasRes>(a, i, nv, vec, xp, y, d, nfb);
    }
    __syncthreads();
  }
  finish(a, nf);
}

// ---- two passes: large blocks (B > kTile) and block=0 ------------------------------------------------------------
//! The scale of data block b from its amax bits and non-finite bit, as set_scale computes it (without the store).
template <QuantKind K> __device__ __forceinline__ float block_d(const EncArgs& a, uint32_t amax_bits, bool nonfinite) {
  if (is_int(K) && nonfinite) return __uint_as_float(0x7FC00000u);
  if (a.e8m0) return common::e8m0_to_float(common::block_scale_e8m0(__uint_as_float(amax_bits), DQ<K>::kMax));
  return common::block_scale(__uint_as_float(amax_bits), DQ<K>::kMax);
}

// A warp's step covers 128 consecutive elements (4 per lane), so with B > 128 (here B > kTile) they sit in
// the warp's first data block bw or in bw + 1: each lane takes its max / OR per block, the warp reduces
// them (redux.sync), and the warp keeps a running (block, max, OR) across its steps, flushed by lane 0
// with one global atomicMax / atomicOr when the block changes and at the end (block=0: one per warp in
// all). max and OR are order-free: the words end as the per-element atomics left them. Elements beyond
// bw + 1 (blocks shorter than 128, which the host never sends here) take per-element atomics.
template <class In, QuantKind K, bool HasRes> __global__ void __launch_bounds__(kThreads) amax_kernel(EncArgs a) {
  constexpr uint32_t kFull = 0xFFFFFFFFu;
  const int lane = threadIdx.x & 31;
  const int64_t stride = int64_t(gridDim.x) * kThreads * kQuad;
  const int64_t w0 = (int64_t(blockIdx.x) * kThreads + (threadIdx.x & ~31u)) * kQuad;  // the warp's first element
  int64_t acc_b = -1;  // warp-uniform running block, max and OR
  uint32_t acc_m = 0, acc_f = 0;
  auto flush = [&] {
    if (lane == 0 && acc_b >= 0) {
      if (acc_m != 0u) atomicMax(&a.amax[acc_b], acc_m);
      if (acc_f != 0u) atomicOr(&a.amax[a.nblocks + acc_b], 1u);
    }
  };
  auto add = [&](int64_t b, uint32_t m, uint32_t f) {
    if (b != acc_b) {
      flush();
      acc_b = b;
      acc_m = 0;
      acc_f = 0;
    }
    acc_m = max(acc_m, m);
    acc_f |= f;
  };
  if (w0 < a.n) {
    const int64_t i0 = w0 + int64_t(lane) * kQuad;
    BlockCursor cur(i0, stride, a.B);
    for (int64_t w = w0, i = i0; w < a.n; w += stride, i += stride, cur.advance()) {  // warp-uniform trip count
      const int64_t bw = __shfl_sync(kFull, cur.b, 0);
      const int nv = int(plan::max64(0, plan::min64(kQuad, a.n - i)));
      uint32_t m0 = 0, f0 = 0, m1 = 0, f1 = 0;
      if (nv > 0) {
        float xp[kQuad], y[kQuad];
        load_quad<In, HasRes>(a, i, nv, a.vec != 0, xp, y);
        int64_t b = cur.b, r = cur.r;
#pragma unroll
        for (int j = 0; j < kQuad; ++j) {
          if (j < nv) {
            const uint32_t m = __float_as_uint(common::finite_abs(y[j]));
            const uint32_t f = common::is_finite_bits(__float_as_uint(y[j])) ? 0u : 1u;
            if (b == bw) {
              m0 = max(m0, m);
              f0 |= f;
            } else if (b == bw + 1) {
              m1 = max(m1, m);
              f1 |= f;
            } else {
              atomicMax(&a.amax[b], m);
              if (f) atomicOr(&a.amax[a.nblocks + b], 1u);
            }
            if (++r == a.B) {
              r = 0;
              ++b;
            }
          }
        }
      }
      const uint32_t M0 = warp_max_u32(m0), F0 = warp_or_u32(f0);
      const uint32_t M1 = warp_max_u32(m1), F1 = warp_or_u32(f1);
      add(bw, M0, F0);
      if ((M1 | F1) != 0u) add(bw + 1, M1, F1);
    }
  }
  flush();
}

// A thread's 4 elements take one scale when they share a data block (always unless B is not a multiple of 4
// or the quad crosses the end of a block); the block index from a BlockCursor, no division per step.
template <class In, QuantKind K, bool HasRes> __global__ void __launch_bounds__(kThreads) quant_kernel(EncArgs a) {
  uint32_t nf = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads * kQuad;
  const int64_t i0 = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * kQuad;
  if (i0 < a.n) {
    BlockCursor cur(i0, stride, a.B);
    for (int64_t i = i0; i < a.n; i += stride, cur.advance()) {
      const int nv = int(plan::min64(kQuad, a.n - i));
      float xp[kQuad], y[kQuad], d[kQuad];
      bool nfb[kQuad];
      load_quad<In, HasRes>(a, i, nv, a.vec != 0, xp, y);
      // every thread derives the scale; the one holding the block's first element stores it
      if (cur.r + nv <= a.B) {
        const uint32_t am = a.amax[cur.b];
        const bool bnf = a.amax[a.nblocks + cur.b] != 0u;
        const float s = cur.r == 0 ? set_scale<K>(a, cur.b, am, bnf) : block_d<K>(a, am, bnf);
#pragma unroll
        for (int j = 0; j < kQuad; ++j) {
          d[j] = s;
          nfb[j] = bnf;
        }
      } else {
        int64_t b = cur.b, r = cur.r;
#pragma unroll
        for (int j = 0; j < kQuad; ++j) {
          d[j] = 1.0f;  // j >= nv: unused
          nfb[j] = false;
          if (j < nv) {
            const uint32_t am = a.amax[b];
            nfb[j] = a.amax[a.nblocks + b] != 0u;
            d[j] = r == 0 ? set_scale<K>(a, b, am, nfb[j]) : block_d<K>(a, am, nfb[j]);
          }
          if (++r == a.B) {
            r = 0;
            ++b;
          }
        }
      }
      nf |= quantize_quad<K, HasRes>(a, i, nv, a.vec != 0, xp, y, d, nfb);
    }
  }
  finish(a, nf);
}

// ---- decode -------------------------------------------------------------------------------------------------------
//! The code value of a byte (fp8 / int8) or a nibble (int4) as DQ<K>::value takes it.
template <QuantKind K> __device__ __forceinline__ uint32_t code_of(uint32_t v) {
  if constexpr (K == QuantKind::int4) return v & 8u ? v | 0xFFFFFFF0u : v;
  else if constexpr (K == QuantKind::int8) return uint32_t(int32_t(int8_t(uint8_t(v))));
  else return v;
}
template <QuantKind K> __device__ __forceinline__ uint32_t code_at(const uint8_t* codes, int64_t k) {
  if constexpr (K == QuantKind::int4) return code_of<K>((k & 1) ? uint32_t(codes[k >> 1] >> 4) : uint32_t(codes[k >> 1] & 15u));
  else return code_of<K>(codes[k]);
}

// A thread decodes 4 consecutive elements i.. i+3 (i a multiple of 4) per step: their codes in one
// aligned 4-byte (2-byte for int4) load, one scale when they share a data block (the block index
// from a BlockCursor: no division per step), out through one 16-byte (8-byte) vector when aligned.
template <QuantKind K, class O, bool Acc>
__global__ void __launch_bounds__(kThreads) decode_kernel(const uint8_t* __restrict__ packet,
                                                          typename O::storage* __restrict__ out, int64_t n, int64_t B,
                                                          int e8m0, float alpha, bool vec, HeaderExpect e,
                                                          uint32_t* status) {
  using OS = typename O::storage;
  // a non-finite value travels as a NaN/inf code (fp8) or a NaN scale (int8/int4): the flag only
  // reaches the status word
  const DecodeHead& head = decode_prologue(packet, e, status);
  if (head.input < 0) return;  // corrupt: write nothing
  const uint8_t* codes = packet + head.offset[0];
  const uint8_t* scales = packet + head.offset[1];
  const bool cvec = (reinterpret_cast<uintptr_t>(codes) & (K == QuantKind::int4 ? 1u : 3u)) == 0;
  auto scale_at = [&](int64_t b) {
    return e8m0 ? common::e8m0_to_float(scales[b]) : reinterpret_cast<const float*>(scales)[b];
  };
  const int64_t stride = int64_t(gridDim.x) * kThreads * kQuad;
  const int64_t i0 = (int64_t(blockIdx.x) * kThreads + threadIdx.x) * kQuad;
  if (i0 >= n) return;
  BlockCursor cur(i0, stride, B);
  for (int64_t i = i0; i < n; i += stride, cur.advance()) {
    const int nv = int(plan::min64(kQuad, n - i));
    uint32_t c[kQuad];
    if (cvec && nv == kQuad) {
      if constexpr (K == QuantKind::int4) {
        const uint32_t w = reinterpret_cast<const uint16_t*>(codes)[i >> 2];
#pragma unroll
        for (int j = 0; j < kQuad; ++j) c[j] = code_of<K>((w >> (4 * j)) & 15u);
      } else {
        const uint32_t w = reinterpret_cast<const uint32_t*>(codes)[i >> 2];
#pragma unroll
        for (int j = 0; j < kQuad; ++j) c[j] = code_of<K>((w >> (8 * j)) & 255u);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kQuad; ++j) c[j] = j < nv ? code_at<K>(codes, i + j) : 0u;
    }
    float d[kQuad];
    if (cur.r + nv <= B) {  // one data block (always for blocks that are multiples of 4)
      const float s = scale_at(cur.b);
#pragma unroll
      for (int j = 0; j < kQuad; ++j) d[j] = s;
    } else {
      int64_t b = cur.b, r = cur.r;
#pragma unroll
      for (int j = 0; j < kQuad; ++j) {
        d[j] = j < nv ? scale_at(b) : 0.0f;
        if (++r == B) {
          r = 0;
          ++b;
        }
      }
    }
    // mul_rn(mul_rn(value, d), alpha) (Acc: add_rn(out, that)), the NaN rule only for a NaN result
    if (vec && nv == kQuad) {
      float o[kQuad] = {};
      if constexpr (Acc) load4<O>(out + i, o);
      OS s[kQuad];
#pragma unroll
      for (int j = 0; j < kQuad; ++j) s[j] = O::store(mul2_acc_rn<Acc>(o[j], DQ<K>::value(c[j]), d[j], alpha));
      store4<O>(out + i, s);
    } else {
#pragma unroll
      for (int j = 0; j < kQuad; ++j)
        if (j < nv)
          out[i + j] = O::store(mul2_acc_rn<Acc>(Acc ? O::load(out[i + j]) : 0.0f, DQ<K>::value(c[j]), d[j], alpha));
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------------------------
template <class F> void dispatch_kind(QuantKind k, F&& f) {
  switch (k) {
    case QuantKind::e4m3: return f(std::integral_constant<QuantKind, QuantKind::e4m3>{});
    case QuantKind::e5m2: return f(std::integral_constant<QuantKind, QuantKind::e5m2>{});
    case QuantKind::int8: return f(std::integral_constant<QuantKind, QuantKind::int8>{});
    case QuantKind::int4: return f(std::integral_constant<QuantKind, QuantKind::int4>{});
  }
}

int64_t workspace_bytes(const BlockQPlan& p) {
  return p.block <= kTile ? plan::kStatusBytes : kAmaxOffset + plan::align_up(p.nblocks * 8, 16);
}

void encode(const BlockQPlan& p, const EncodeArgs& args) {
  DeviceGuard guard(args.x.device.index);
  const cudaStream_t s = to_cuda(args.stream);
  const int dev = args.x.device.index;
  uint8_t* ws = args.workspace;
  const bool one_pass = p.block <= kTile;
  // the flag and the counter; the amax words of the two-pass path
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(ws + kFlagOffset, 0, 8, s));
  if (!one_pass) GRADCOMP_CUDA_CHECK(cudaMemsetAsync(ws + kAmaxOffset, 0, size_t(p.nblocks * 8), s));
  EncArgs a{};
  a.x = args.x.data;
  a.r = args.residual;
  a.n = p.numel;
  a.B = p.block;
  a.nblocks = p.nblocks;
  a.div = args.divisor;
  a.div1 = args.divisor == 1.0f;
  a.e8m0 = p.e8m0;
  a.vec = aligned16(args.x.data) && (args.residual == nullptr || aligned16(args.residual));
  a.packet = args.packet;
  a.codes_off = p.layout.sections[0].offset;
  a.scales_off = p.layout.sections[1].offset;
  a.flag = reinterpret_cast<uint32_t*>(ws + kFlagOffset);
  a.counter = reinterpret_cast<uint32_t*>(ws + kCounterOffset);
  a.amax = reinterpret_cast<uint32_t*>(ws + kAmaxOffset);
  a.layout = p.layout;
  a.ctx = args.ctx;
  a.sr = p.stochastic;
  a.key = keyed::derive(kIntSrTag, args.ctx.seed, args.ctx.step, args.ctx.bucket, args.ctx.chunk);
  // x of float16/bfloat16 is read 4 elements (8 bytes) at a time: 8-byte alignment suffices there
  if (p.input != DType::float32)
    a.vec = (reinterpret_cast<uintptr_t>(args.x.data) % 8 == 0) && (args.residual == nullptr || aligned16(args.residual));
  const int64_t per_tile = one_pass ? kTile / p.block : 1;
  const int64_t ntiles = one_pass ? (p.nblocks + per_tile - 1) / per_tile : 0;
  // one wave of each kernel (occupancy x SMs), fewer blocks for small inputs
  auto grid = [&](auto kernel) {
    return unsigned(one_pass ? plan::wave_grid(ntiles, 1, wave_blocks(dev, kernel))
                             : plan::wave_grid(p.numel, kTile, wave_blocks(dev, kernel)));
  };
  common::dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    dispatch_kind(p.kind, [&](auto kind) {
      constexpr QuantKind K = decltype(kind)::value;
      auto run = [&](auto has_res) {
        constexpr bool R = decltype(has_res)::value;
        if (one_pass) {
          tile_kernel<In, K, R><<<grid(tile_kernel<In, K, R>), kThreads, 0, s>>>(a);
          GRADCOMP_CUDA_CHECK_LAUNCH("blockq tile_kernel");
        } else {
          amax_kernel<In, K, R><<<grid(amax_kernel<In, K, R>), kThreads, 0, s>>>(a);
          GRADCOMP_CUDA_CHECK_LAUNCH("blockq amax_kernel");
          quant_kernel<In, K, R><<<grid(quant_kernel<In, K, R>), kThreads, 0, s>>>(a);
          GRADCOMP_CUDA_CHECK_LAUNCH("blockq quant_kernel");
        }
      };
      if (args.residual) run(std::true_type{});
      else run(std::false_type{});
    });
  }, "blockq: input");
}

void decode(const BlockQPlan& p, const DecodeArgs& a) {
  DeviceGuard guard(a.out.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int dev = a.out.device.index;
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  common::dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* op = static_cast<typename O::storage*>(a.out.data);
    // out through one vector per 4 elements: 16 bytes (float32) or 8 bytes (float16 / bfloat16)
    const bool vec = reinterpret_cast<uintptr_t>(op) % (4 * sizeof(typename O::storage)) == 0;
    dispatch_kind(p.kind, [&](auto kind) {
      constexpr QuantKind K = decltype(kind)::value;
      auto go = [&](auto kernel) {
        const auto grid = unsigned(plan::wave_grid(p.numel, kTile, wave_blocks(dev, kernel)));
        kernel<<<grid, kThreads, 0, s>>>(a.packet, op, p.numel, p.block, p.e8m0, a.alpha, vec, *a.expect, status);
        GRADCOMP_CUDA_CHECK_LAUNCH("blockq decode_kernel");
      };
      if (a.mode == DecodeMode::accumulate) go(decode_kernel<K, O, true>);
      else go(decode_kernel<K, O, false>);
    });
  }, "decode: out");
}

} // namespace

const Kernels<BlockQPlan> blockq = {&workspace_bytes, &encode, &decode};

} // namespace gradcomp::detail::cuda
