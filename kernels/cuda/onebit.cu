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
// a warp per chunk folds them into the scale, and an element-wise kernel writes r_new. The last
// block of the last kernel (atomic counter) writes the header and zeroes the padding.
// Decode: element-wise; the header is checked on the device (checked_input).
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
template <class In> __global__ void __launch_bounds__(kThreads) residual_kernel(EncArgs a) {
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < a.n; i += stride) {
    const float s = a.scales[i / a.C];
    const float ds = a.div1 ? s : mul_rn(a.div, s);
    const float xp = xprime<In, true>(a, i);
    const float y = a.div1 ? xp : div_rn(xp, a.div);
    a.r[i] = sub_rn(xp, signed_scale(!(y < 0.0f), ds));
  }
  finish(a, 0u);
}

// ---- decode -------------------------------------------------------------------------------------------------------
template <class O, bool Acc>
__global__ void __launch_bounds__(kThreads) decode_kernel(const uint8_t* __restrict__ packet,
                                                          typename O::storage* __restrict__ out, int64_t n, int64_t C,
                                                          float alpha, HeaderExpect e, uint32_t* status) {
  // a non-finite scale travels in the packet: the flag only reaches the status word
  const DecodeHead& head = decode_prologue(packet, e, status);
  if (head.input < 0) return;  // corrupt: write nothing
  const uint8_t* bits = packet + head.offset[0];
  const float* scales = reinterpret_cast<const float*>(packet + head.offset[1]);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t k = int64_t(blockIdx.x) * kThreads + threadIdx.x; k < n; k += stride) {
    const float D = signed_scale((bits[k >> 3] >> (7 - (k & 7))) & 1u, scales[k / C]);
    const float v = mul_rn(D, alpha);
    out[k] = O::store(Acc ? add_rn(O::load(out[k]), v) : v);
  }
}

// ---- host side ----------------------------------------------------------------------------------------------------
int64_t workspace_bytes(const OnebitPlan& p) {
  return p.tiles > 1 ? kSumsOffset + plan::align_up(p.nchunks * p.tiles * 8, 16) : plan::kStatusBytes;
}

void encode(const OnebitPlan& p, const EncodeArgs& args) {
  DeviceGuard guard(args.x.device.index);
  const cudaStream_t s = to_cuda(args.stream);
  const int sms = sm_count(args.x.device.index);
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
  a.bits = args.packet + p.layout.sections[0].offset;
  a.scales = reinterpret_cast<float*>(args.packet + p.layout.sections[1].offset);
  a.sums = reinterpret_cast<double*>(ws + kSumsOffset);
  a.flag = reinterpret_cast<uint32_t*>(ws + kFlagOffset);
  a.counter = reinterpret_cast<uint32_t*>(ws + kCounterOffset);
  a.layout = p.layout;
  a.ctx = args.ctx;
  const int64_t cap = int64_t(sms) * plan::kBlocksPerSM * 2;
  const auto grid_units = unsigned(plan::max64(1, plan::min64(plan::ceil_div(p.nchunks * p.tiles, kWarps), cap)));
  const auto grid_chunks = unsigned(plan::max64(1, plan::min64(plan::ceil_div(p.nchunks, kWarps), cap)));
  const auto grid_elems = unsigned(plan::max64(1, plan::min64(plan::ceil_div(p.numel, kThreads), cap)));
  const bool one = p.tiles == 1;
  common::dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    // each launch checked on its own, so an error names the kernel that caused it
    if (args.residual) {
      if (one) {
        tile_kernel<In, true, true><<<grid_units, kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit tile_kernel");
      } else {
        tile_kernel<In, true, false><<<grid_units, kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit tile_kernel");
        scale_kernel<false><<<grid_chunks, kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit scale_kernel");
        residual_kernel<In><<<grid_elems, kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit residual_kernel");
      }
    } else {
      if (one) {
        tile_kernel<In, false, true><<<grid_units, kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit tile_kernel");
      } else {
        tile_kernel<In, false, false><<<grid_units, kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit tile_kernel");
        scale_kernel<true><<<grid_chunks, kThreads, 0, s>>>(a);
        GRADCOMP_CUDA_CHECK_LAUNCH("onebit scale_kernel");
      }
    }
  }, "onebit: input");
}

void decode(const OnebitPlan& p, const DecodeArgs& a) {
  DeviceGuard guard(a.out.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int sms = sm_count(a.out.device.index);
  const auto grid = unsigned(plan::max64(1, plan::min64(plan::ceil_div(p.numel, kThreads), int64_t(sms) * plan::kBlocksPerSM * 2)));
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  common::dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* op = static_cast<typename O::storage*>(a.out.data);
    if (a.mode == DecodeMode::accumulate)
      decode_kernel<O, true><<<grid, kThreads, 0, s>>>(a.packet, op, p.numel, p.chunk, a.alpha, *a.expect, status);
    else
      decode_kernel<O, false><<<grid, kThreads, 0, s>>>(a.packet, op, p.numel, p.chunk, a.alpha, *a.expect, status);
    GRADCOMP_CUDA_CHECK_LAUNCH("onebit decode_kernel");
  }, "decode: out");
}

} // namespace

const Kernels<OnebitPlan> onebit = {&workspace_bytes, &encode, &decode};

} // namespace gradcomp::detail::cuda
