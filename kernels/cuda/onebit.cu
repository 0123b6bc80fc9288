// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the onebit codec (kernels/core/codecs/onebit.hpp) with fused error feedback.
// Packets are byte-for-byte those of kernels/cpu/onebit.cpp: the same fixed reduction tree
// (kernels/common/reduce.hpp: lane l of a warp adds elements l, l + 32, ... of a tile of 4096 in
// binary64, then the shuffle-down tree), the same float32 expressions (common/math.hpp).
//
// Encode: one warp per unit (chunk, tile). Each step the warp loads 32 consecutive elements
// (coalesced), packs their signs with a ballot (lanes 0-3 store the four MSB-first bytes) and adds
// the terms. Chunks of one tile: the warp then takes the scale and rewrites the residual from x and r
// (a second read that hits L1/L2), one kernel in all. Larger chunks: tile sums into the workspace,
// a warp per chunk folds them into the scale, and an element-wise kernel writes r_new (8 elements
// per thread and step, x and r through 16-byte vectors when aligned). The last block of the last
// kernel (atomic counter) writes the header and zeroes the padding.
// Decode: element-wise, 8 elements per thread and step (one byte of the bit section, one scale,
// out through 16-byte vectors when aligned; D * alpha with the plain rounding, the NaN rule redone
// only for a NaN result: mul_acc_rn, bitwise the rule's); the header is checked on the device
// (decode_prologue).
// The element-wise kernels find chunks with a BlockCursor (common.cuh): one division per thread,
// then additions; no per-element division. Grids: one wave of each kernel (occupancy x SMs,
// wave_blocks); no result depends on the grid size (per-unit sums use a fixed lane tree).
#include "../common/reduce.hpp"
#include "../core/codecs/onebit.hpp"
#include "common.cuh"

namespace gradcomp::detail::cuda {
namespace {

using common::add_rn;
using common::div_rn;
using common::kSumLanes;
using common::kSumTile;
using common::mul_rn;
using common::sub_rn;
using plan::kChunk;
using plan::kItems;
using plan::kThreads;

constexpr int kWarps = kThreads / 32;
constexpr int64_t kFlagOffset = plan::kCastFlagOffset;
constexpr int64_t kCounterOffset = plan::kCastCounterOffset;
constexpr int64_t kSumsOffset = 16;  // binary64 tile sums (chunks of more than one tile)

struct EncArgs {
  const void* x;
  float* r;
  int64_t n;
  int64_t C;        //!< chunk
  int64_t U;        //!< tiles per chunk
  int64_t nchunks;
  float div;
  int div1;
  int l2;
  int vec;          //!< x and r 16-byte aligned: vector loads in the residual pass
  uint8_t* bits;
  float* scales;
  double* sums;
  uint32_t* flag;
  uint32_t* counter;
  PacketLayout layout;
  EncodeContext ctx;
};

__device__ __forceinline__ float signed_scale(bool bit, float s) {
  return bit ? s : __uint_as_float(__float_as_uint(s) ^ 0x80000000u);
}

template <class In, bool HasRes> __device__ __forceinline__ float xprime(const EncArgs& a, int64_t i) {
  float v = In::load(static_cast<const typename In::storage*>(a.x)[i]);
  if constexpr (HasRes) v = add_rn(v, a.r[i]);
  return v;
}

__device__ __forceinline__ double warp_tree(double v) {
  // lane l += lane l + o for o = 16, 8, 4, 2, 1: lane 0 ends with common::lane_tree's total
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) v = common::dadd(v, __shfl_down_sync(0xFFFFFFFFu, v, o));
  return v;
}

__device__ __forceinline__ uint32_t chunk_nonfinite(float s, float div) {
  return (nonfinite_bit(s) | nonfinite_bit(mul_rn(div, s))) != 0u;
}

__device__ void finish(const EncArgs& a, uint32_t nf) {
  if (__syncthreads_or(nf) && threadIdx.x == 0) atomicOr(a.flag, 1u);
  __shared__ bool s_last;
  if (!elect_last_block(a.counter, &s_last)) return;
  __shared__ uint32_t s_flag;
  if (threadIdx.x == 0) s_flag = atomicOr(a.flag, 0u);
  __syncthreads();
  finish_packet_block(a.bits - a.layout.sections[0].offset, a.layout, s_flag ? kFlagNonFinite : 0, a.ctx);
}

// ---- pass 1: a warp per (chunk, tile): signs, the tile sum; one-tile chunks finish here ---------------------------
template <class In, bool HasRes, bool Last> __global__ void __launch_bounds__(kThreads) tile_kernel(EncArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t units = a.nchunks * a.U;
  uint32_t nf = 0;
  for (int64_t u = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); u < units; u += int64_t(gridDim.x) * kWarps) {
    const int64_t c = u / a.U, t = u % a.U;
    const int64_t c0 = c * a.C, c1 = plan::min64(a.n, c0 + a.C);
    const int64_t i0 = c0 + t * kSumTile;
    if (i0 >= c1) {  // a tile past the end of the last chunk
      if (a.U > 1 && lane == 0) a.sums[u] = 0.0;
      continue;
    }
    const int64_t len = plan::min64(kSumTile, c1 - i0);
    double acc = 0.0;
    for (int64_t g = 0; g < len; g += 32) {
      const int64_t j = g + lane;
      float y = 0.0f;
      if (j < len) {
        const float xp = xprime<In, HasRes>(a, i0 + j);
        y = a.div1 ? xp : div_rn(xp, a.div);
      }
      const uint32_t w = __ballot_sync(0xFFFFFFFFu, j < len && !(y < 0.0f));
      if (lane < 4 && g + 8 * lane < len) a.bits[(i0 + g) / 8 + lane] = uint8_t(__brev((w >> (8 * lane)) & 0xFFu) >> 24);
      const double v = double(y);
      acc = common::dadd(acc, a.l2 ? common::dmul(v, v) : fabs(v));
    }
    const double S = warp_tree(acc);
    if (a.U > 1) {
      if (lane == 0) a.sums[u] = S;
      continue;
    }
    float s = 0.0f;
    if (lane == 0) {
      s = common::chunk_scale(S, c1 - c0, a.l2 != 0);
      a.scales[c] = s;
      nf |= chunk_nonfinite(s, a.div1 ? 1.0f : a.div);
    }
    if constexpr (HasRes) {
      s = __shfl_sync(0xFFFFFFFFu, s, 0);
      const float ds = a.div1 ? s : mul_rn(a.div, s);
      for (int64_t j = lane; j < len; j += 32) {
        const float xp = xprime<In, true>(a, i0 + j);
        const float y = a.div1 ? xp : div_rn(xp, a.div);
        a.r[i0 + j] = sub_rn(xp, signed_scale(!(y < 0.0f), ds));
      }
    }
  }
  if constexpr (Last) finish(a, nf);
}

// ---- pass 2: a warp per chunk folds its tile sums ------------------------------------------------------------------
template <bool Last> __global__ void __launch_bounds__(kThreads) scale_kernel(EncArgs a) {
  const int lane = threadIdx.x & 31;
  uint32_t nf = 0;
  for (int64_t c = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); c < a.nchunks; c += int64_t(gridDim.x) * kWarps) {
    double acc = 0.0;
    for (int64_t t = lane; t < a.U; t += 32) acc = common::dadd(acc, a.sums[c * a.U + t]);
    const double S = warp_tree(acc);
    if (lane == 0) {
      const int64_t c0 = c * a.C, c1 = plan::min64(a.n, c0 + a.C);
      const float s = common::chunk_scale(S, c1 - c0, a.l2 != 0);
      a.scales[c] = s;
      nf |= chunk_nonfinite(s, a.div1 ? 1.0f : a.div);
    }
  }
  if constexpr (Last) {
    finish(a, nf);
  } else if (__syncthreads_or(nf) && threadIdx.x == 0) {
    atomicOr(a.flag, 1u);  // the residual pass finishes the packet: the flag must be set before it
  }
}

// ---- pass 3: r_new = x' - divisor * D, element-wise --------------------------------------------------------------
// 8 consecutive elements per thread and step, starting at a multiple of 8. The chunk comes from a
// BlockCursor (no division per step). A full group inside one chunk (always, unless it holds the end of
// the tensor: chunks are multiples of 8 or one chunk holds the tensor) with aligned x and r takes one
// scale and 16-byte vectors; any other group goes element by element.
template <class In> __global__ void __launch_bounds__(kThreads) residual_kernel(EncArgs a) {
  const int64_t stride = int64_t(gridDim.x) * kChunk;
  const int64_t i0 = int64_t(blockIdx.x) * kChunk + int64_t(threadIdx.x) * kItems;
  if (i0 < a.n) {
    BlockCursor cur(i0, stride, a.C);
    for (int64_t i = i0; i < a.n; i += stride, cur.advance()) {
      const int nv = int(plan::min64(kItems, a.n - i));
      if (a.vec && nv == kItems && cur.r + kItems <= a.C) {
        const float s = a.scales[cur.b];
        const float ds = a.div1 ? s : mul_rn(a.div, s);
        float xp[kItems], rv[kItems];
        load8<In>(static_cast<const typename In::storage*>(a.x) + i, xp);
        load8<F32>(a.r + i, rv);
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          const float x = add_rn(xp[j], rv[j]);
          const float y = a.div1 ? x : div_rn(x, a.div);
          rv[j] = sub_rn(x, signed_scale(!(y < 0.0f), ds));
        }
        store8f(a.r + i, rv);
      } else {
        int64_t c = cur.b, r = cur.r;
#pragma unroll 1
        for (int j = 0; j < nv; ++j) {
          const float s = a.scales[c];
          const float ds = a.div1 ? s : mul_rn(a.div, s);
          const float xp = xprime<In, true>(a, i + j);
          const float y = a.div1 ? xp : div_rn(xp, a.div);
          a.r[i + j] = sub_rn(xp, signed_scale(!(y < 0.0f), ds));
          if (++r == a.C) {
            r = 0;
            ++c;
          }
        }
      }
    }
  }
  finish(a, 0u);
}

// ---- decode -------------------------------------------------------------------------------------------------------
// 8 consecutive elements per thread and step, starting at a multiple of 8: one byte of the bit
// section; the chunk from a BlockCursor as in the residual pass. A full group inside one chunk takes
// one scale (and 16-byte vectors for out when aligned); any other group goes element by element.
template <class O, bool Acc>
__global__ void __launch_bounds__(kThreads) decode_kernel(const uint8_t* __restrict__ packet,
                                                          typename O::storage* __restrict__ out, int64_t n, int64_t C,
                                                          float alpha, bool vec, HeaderExpect e, uint32_t* status) {
  using OS = typename O::storage;
  // a non-finite scale travels in the packet: the flag only reaches the status word
  const DecodeHead& head = decode_prologue(packet, e, status);
  if (head.input < 0) return;  // corrupt: write nothing
  const uint8_t* bits = packet + head.offset[0];
  const float* scales = reinterpret_cast<const float*>(packet + head.offset[1]);
  const int64_t stride = int64_t(gridDim.x) * kChunk;
  const int64_t i0 = int64_t(blockIdx.x) * kChunk + int64_t(threadIdx.x) * kItems;
  if (i0 >= n) return;
  BlockCursor cur(i0, stride, C);
  for (int64_t i = i0; i < n; i += stride, cur.advance()) {
    const int nv = int(plan::min64(kItems, n - i));
    const uint32_t byte = bits[i >> 3];  // element i + j is bit 7 - j (MSB first)
    if (nv == kItems && cur.r + kItems <= C) {
      const float s = scales[cur.b];
      // mul_rn(D, alpha) (Acc: add_rn(out, that)), the NaN rule only for a NaN result
      if (vec) {
        float o[kItems] = {};
        if constexpr (Acc) load8<O>(out + i, o);
        OS c[kItems];
#pragma unroll
        for (int j = 0; j < kItems; ++j) c[j] = O::store(mul_acc_rn<Acc>(o[j], signed_scale((byte >> (7 - j)) & 1u, s), alpha));
        store8<O>(out + i, c);
      } else {
#pragma unroll
        for (int j = 0; j < kItems; ++j)
          out[i + j] = O::store(mul_acc_rn<Acc>(Acc ? O::load(out[i + j]) : 0.0f, signed_scale((byte >> (7 - j)) & 1u, s), alpha));
      }
    } else {
      int64_t c = cur.b, r = cur.r;
#pragma unroll 1
      for (int j = 0; j < nv; ++j) {
        out[i + j] = O::store(mul_acc_rn<Acc>(Acc ? O::load(out[i + j]) : 0.0f, signed_scale((byte >> (7 - j)) & 1u, scales[c]), alpha));
        if (++r == C) {
          r = 0;
          ++c;
        }
      }
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------------------------
int64_t workspace_bytes(const OnebitPlan& p) {
  return p.tiles > 1 ? kSumsOffset + plan::align_up(p.nchunks * p.tiles * 8, 16) : plan::kStatusBytes;
}

void encode(const OnebitPlan& p, const EncodeArgs& args) {
  DeviceGuard guard(args.x.device.index);
  const cudaStream_t s = to_cuda(args.stream);
  const int dev = args.x.device.index;
  uint8_t* ws = args.workspace;
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(ws + kFlagOffset, 0, 8, s));  // the flag and the counter
  EncArgs a{};
  a.x = args.x.data;
  a.r = args.residual;
  a.n = p.numel;
  a.C = p.chunk;
  a.U = p.tiles;
  a.nchunks = p.nchunks;
  a.div = args.divisor;
  a.div1 = args.divisor == 1.0f;
  a.l2 = p.l2;
  a.vec = aligned16(args.x.data) && (args.residual == nullptr || aligned16(args.residual));
  a.bits = args.packet + p.layout.sections[0].offset;
  a.scales = reinterpret_cast<float*>(args.packet + p.layout.sections[1].offset);
  a.sums = reinterpret_cast<double*>(ws + kSumsOffset);
  a.flag = reinterpret_cast<uint32_t*>(ws + kFlagOffset);
  a.counter = reinterpret_cast<uint32_t*>(ws + kCounterOffset);
  a.layout = p.layout;
  a.ctx = args.ctx;
  // one wave of each kernel (occupancy x SMs), fewer blocks for small inputs
  auto grid_units = [&](auto k) { return unsigned(plan::wave_grid(p.nchunks * p.tiles, kWarps, wave_blocks(dev, k))); };
  auto grid_chunks = [&](auto k) { return unsigned(plan::wave_grid(p.nchunks, kWarps, wave_blocks(dev, k))); };
  auto grid_elems = [&](auto k) { return unsigned(plan::wave_grid(p.numel, kChunk, wave_blocks(dev, k))); };
  const bool one = p.tiles == 1;
  common::dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    // each launch checked on its own, so an error names the kernel that caused it
    if (args.residual) {
      if (one) {
        tile_kernel<In, true, true><<<grid_units(tile_kernel<In, true, true>), kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit tile_kernel");
      } else {
        tile_kernel<In, true, false><<<grid_units(tile_kernel<In, true, false>), kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit tile_kernel");
        scale_kernel<false><<<grid_chunks(scale_kernel<false>), kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit scale_kernel");
        residual_kernel<In><<<grid_elems(residual_kernel<In>), kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit residual_kernel");
      }
    } else {
      if (one) {
        tile_kernel<In, false, true><<<grid_units(tile_kernel<In, false, true>), kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit tile_kernel");
      } else {
        tile_kernel<In, false, false><<<grid_units(tile_kernel<In, false, false>), kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit tile_kernel");
        scale_kernel<true><<<grid_chunks(scale_kernel<true>), kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit scale_kernel");
      }
    }
  }, "onebit: input");
}

void decode(const OnebitPlan& p, const DecodeArgs& a) {
  DeviceGuard guard(a.out.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int dev = a.out.device.index;
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  const bool vec = aligned16(a.out.data);
  common::dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* op = static_cast<typename O::storage*>(a.out.data);
    auto go = [&](auto kernel) {
      const auto grid = unsigned(plan::wave_grid(p.numel, kChunk, wave_blocks(dev, kernel)));
      kernel<<<grid, kThreads, 0, s>>>(a.packet, op, p.numel, p.chunk, a.alpha, vec, *a.expect, status);
      GRADCOMP_CUDA_CHECK_LAUNCH("onebit decode_kernel");
    };
    if (a.mode == DecodeMode::accumulate) go(decode_kernel<O, true>);
    else go(decode_kernel<O, false>);
  }, "decode: out");
}

} // namespace

const Kernels<OnebitPlan> onebit = {&workspace_bytes, &encode, &decode};

} // namespace gradcomp::detail::cuda
