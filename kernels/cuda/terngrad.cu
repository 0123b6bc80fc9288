// SPDX-License-Identifier: Apache-2.0
// CUDA backend of TernGrad (kernels/core/codecs/terngrad.hpp, docs/contracts.md section 3). Packets
// and residuals are byte-for-byte those of kernels/cpu/terngrad.cpp: the same sum order
// (common/reduce.hpp: a warp per 4096-element tile, lane l adding elements l, l + 32, ... in order,
// the shuffle-down tree; then one warp folding the tile sums by the same rule), the same clip
// threshold and Philox words (common/terngrad.hpp, the key derived once on the host) and the same
// float32 expressions. Encode, four kernels on the caller's stream:
//   1. tile sums of y and y^2 (binary64, into the workspace) and the non-finite bit;
//   2. one warp folds them, computes the clip threshold (+inf for clip=0);
//   3. s = max |y_c|: per-warp max of the float bits (non-negative floats order as integers), one
//      atomicMax per warp (order-free);
//   4. the 2-bit codes (one byte and one Philox call per 4 elements), D, the residual; the scale;
//      the last block (atomic counter) writes the header, the key section and the padding.
// Decode: element-wise; the header and the key section's reserved bytes checked on the device
// (a mismatch sets kStatusCorrupt and writes nothing); a code 10 (which no encoder writes) sets
// kStatusCorrupt and leaves that element unwritten.
#include "../common/terngrad.hpp"
#include "../core/codecs/terngrad.hpp"
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
// workspace: [0, 4) status, [4, 8) the non-finite flag, [8, 12) the block counter of kernel 4,
// [12, 16) the max bits of |y_c|, [16, 20) the clip threshold's bits, [32, ...) tile sums (2 doubles)
constexpr int64_t kFlagOffset = plan::kCastFlagOffset;
constexpr int64_t kCounterOffset = plan::kCastCounterOffset;
constexpr int64_t kMaxOffset = 12;
constexpr int64_t kClipOffset = 16;
constexpr int64_t kSumsOffset = 32;

template <class In, bool HasRes, bool Div1> struct Src {
  const typename In::storage* __restrict__ x;
  const float* __restrict__ r;
  float div;
  __device__ __forceinline__ float xp(int64_t i) const {
    float v = In::load(x[i]);
    if constexpr (HasRes) v = add_rn(v, r[i]);
    return v;
  }
  __device__ __forceinline__ float y(float v) const { return Div1 ? v : div_rn(v, div); }
};

template <class S>
__global__ void __launch_bounds__(kThreads) tern_tiles_kernel(S src, int64_t n, int64_t ntiles, uint8_t* ws) {
  const int lane = int(threadIdx.x) & 31;
  auto* sums = reinterpret_cast<double*>(ws + kSumsOffset);
  uint32_t nf = 0;
  for (int64_t t = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); t < ntiles; t += int64_t(gridDim.x) * kWarps) {
    const int64_t lo = t * kSumTile, len = min(kSumTile, n - lo);
    double a1 = 0.0, a2 = 0.0;
    for (int64_t k = lane; k < len; k += 32) {
      const float y = src.y(src.xp(lo + k));
      nf |= nonfinite_bit(y);
      const double d = double(y);
      a1 = common::dadd(a1, d);
      a2 = common::dadd(a2, common::dmul(d, d));
    }
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) {
      a1 = common::dadd(a1, __shfl_down_sync(0xFFFFFFFFu, a1, o));
      a2 = common::dadd(a2, __shfl_down_sync(0xFFFFFFFFu, a2, o));
    }
    if (lane == 0) {
      sums[2 * t] = a1;
      sums[2 * t + 1] = a2;
    }
  }
  if (__syncthreads_or(nf) && threadIdx.x == 0) atomicOr(reinterpret_cast<uint32_t*>(ws + kFlagOffset), 1u);
}

__global__ void __launch_bounds__(32) tern_fold_kernel(int64_t n, int64_t ntiles, double clip_c, uint8_t* ws) {
  const int lane = int(threadIdx.x);
  const auto* sums = reinterpret_cast<const double*>(ws + kSumsOffset);
  double a1 = 0.0, a2 = 0.0;
  for (int64_t t = lane; t < ntiles; t += 32) {
    a1 = common::dadd(a1, sums[2 * t]);
    a2 = common::dadd(a2, sums[2 * t + 1]);
  }
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) {
    a1 = common::dadd(a1, __shfl_down_sync(0xFFFFFFFFu, a1, o));
    a2 = common::dadd(a2, __shfl_down_sync(0xFFFFFFFFu, a2, o));
  }
  if (lane == 0) {
    const float clip = clip_c == 0.0 ? __uint_as_float(0x7F800000u) : terngrad::clip_threshold(a1, a2, n, clip_c);
    *reinterpret_cast<uint32_t*>(ws + kClipOffset) = __float_as_uint(clip);
  }
}

template <class S> __global__ void __launch_bounds__(kThreads) tern_max_kernel(S src, int64_t n, uint8_t* ws) {
  if (*reinterpret_cast<volatile uint32_t*>(ws + kFlagOffset)) return;  // s is NaN: kernel 4 knows
  const float clip = __uint_as_float(*reinterpret_cast<const uint32_t*>(ws + kClipOffset));
  uint32_t m = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
    m = max(m, __float_as_uint(terngrad::clamp(src.y(src.xp(i)), clip)) & 0x7FFFFFFFu);
  m = warp_max_u32(m);
  if ((threadIdx.x & 31) == 0 && m) atomicMax(reinterpret_cast<uint32_t*>(ws + kMaxOffset), m);
}

template <class S, bool HasRes, bool Div1>
__global__ void __launch_bounds__(kThreads) tern_code_kernel(S src, float* __restrict__ r, int64_t n,
                                                             terngrad::Key key, uint8_t* __restrict__ codes,
                                                             float* __restrict__ scale, uint8_t* __restrict__ packet,
                                                             PacketLayout layout, EncodeContext ctx, uint8_t* ws) {
  const uint32_t nf = *reinterpret_cast<volatile uint32_t*>(ws + kFlagOffset);
  const float clip = __uint_as_float(*reinterpret_cast<const uint32_t*>(ws + kClipOffset));
  const float s = nf ? __uint_as_float(0x7FC00000u) : __uint_as_float(*reinterpret_cast<const uint32_t*>(ws + kMaxOffset));
  const bool draw = !nf && s > 0.0f;
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale = s;
  const int64_t nbytes = (n + 3) / 4;
  for (int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x; j < nbytes; j += int64_t(gridDim.x) * kThreads) {
    const philox::Ctr4x32 w = draw ? terngrad::group_bits(key, uint64_t(j)) : philox::Ctr4x32{};
    uint32_t byte = 0;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const int64_t i = 4 * j + t;
      if (i >= n) break;
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
  __shared__ bool s_last;
  if (!elect_last_block(reinterpret_cast<uint32_t*>(ws + kCounterOffset), &s_last)) return;
  finish_packet_block(packet, layout, nf ? kFlagNonFinite : 0, ctx);
}

template <class O, bool Acc>
__global__ void __launch_bounds__(kThreads) tern_decode_kernel(const uint8_t* __restrict__ packet,
                                                               typename O::storage* __restrict__ out, int64_t n,
                                                               float alpha, HeaderExpect e, uint32_t* status) {
  const DecodeHead& head = decode_prologue(packet, e, status);
  if (head.input < 0) return;
  const uint8_t* codes = packet + head.offset[0];
  const float s = *reinterpret_cast<const float*>(packet + head.offset[1]);
  uint32_t bad = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    const uint32_t c = (codes[i >> 2] >> (2 * (i & 3))) & 3u;
    if (c == 2u) {
      bad = 1;
      continue;
    }
    const float v = mul_rn(terngrad::value(c, s), alpha);
    out[i] = O::store(Acc ? add_rn(O::load(out[i]), v) : v);
  }
  if (bad && status != nullptr) atomicOr(status, kStatusCorrupt);
}

void encode(const TernGradPlan& p, const EncodeArgs& a) {
  DeviceGuard guard(a.x.device.index);
  const cudaStream_t st = to_cuda(a.stream);
  const int dev = a.x.device.index;
  uint8_t* ws = a.workspace;
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(ws + kFlagOffset, 0, 16, st));  // flag, counter, max, clip
  const terngrad::Key key = terngrad::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
  uint8_t* codes = a.packet + p.layout.sections[0].offset;
  auto* scale = reinterpret_cast<float*>(a.packet + p.layout.sections[1].offset);
  common::dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    const auto* xs = static_cast<const typename In::storage*>(a.x.data);
    auto go = [&](auto hasres, auto div1) {
      constexpr bool HasRes = decltype(hasres)::value, Div1 = decltype(div1)::value;
      using S = Src<In, HasRes, Div1>;
      const S src{xs, a.residual, a.divisor};
      if (p.ntiles > 0) {
        auto tiles = tern_tiles_kernel<S>;
        tiles<<<unsigned(plan::wave_grid(p.ntiles, kWarps, wave_blocks(dev, tiles))), kThreads, 0, st>>>(
            src, p.numel, p.ntiles, ws);
        GRADCOMP_CUDA_CHECK_LAUNCH("tern_tiles_kernel");
      }
      tern_fold_kernel<<<1, 32, 0, st>>>(p.numel, p.ntiles, p.clip_c, ws);
      GRADCOMP_CUDA_CHECK_LAUNCH("tern_fold_kernel");
      if (p.numel > 0) {
        auto mx = tern_max_kernel<S>;
        mx<<<unsigned(plan::wave_grid(p.numel, kThreads, wave_blocks(dev, mx))), kThreads, 0, st>>>(src, p.numel, ws);
        GRADCOMP_CUDA_CHECK_LAUNCH("tern_max_kernel");
      }
      auto code = tern_code_kernel<S, HasRes, Div1>;
      code<<<unsigned(plan::wave_grid((p.numel + 3) / 4, kThreads, wave_blocks(dev, code))), kThreads, 0, st>>>(
          src, a.residual, p.numel, key, codes, scale, a.packet, p.layout, a.ctx, ws);
      GRADCOMP_CUDA_CHECK_LAUNCH("tern_code_kernel");
    };
    using T = std::true_type;
    using F = std::false_type;
    const bool div1 = a.divisor == 1.0f;
    if (a.residual) {
      if (div1) go(T{}, T{});
      else go(T{}, F{});
    } else {
      if (div1) go(F{}, T{});
      else go(F{}, F{});
    }
  }, "terngrad: input");
}

void decode(const TernGradPlan& p, const DecodeArgs& a) {
  DeviceGuard guard(a.out.device.index);
  const cudaStream_t st = to_cuda(a.stream);
  const int dev = a.out.device.index;
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  common::dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* op = static_cast<typename O::storage*>(a.out.data);
    auto go = [&](auto kernel) {
      kernel<<<unsigned(plan::wave_grid(p.numel, kThreads, wave_blocks(dev, kernel))), kThreads, 0, st>>>(
          a.packet, op, p.numel, a.alpha, *a.expect, status);
      GRADCOMP_CUDA_CHECK_LAUNCH("tern_decode_kernel");
    };
    if (a.mode == DecodeMode::accumulate) go(tern_decode_kernel<O, true>);
    else go(tern_decode_kernel<O, false>);
  }, "decode: out");
}

int64_t workspace_bytes(const TernGradPlan& p) { return kSumsOffset + 16 * p.ntiles; }

} // namespace

const Kernels<TernGradPlan> terngrad = {&workspace_bytes, &encode, &decode};

} // namespace gradcomp::detail::cuda
