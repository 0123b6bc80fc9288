// SPDX-License-Identifier: Apache-2.0
// CUDA backend of QSGD (kernels/core/codecs/qsgd.hpp, docs/contracts.md section 3). Packets and
// residuals are byte-for-byte those of kernels/cpu/qsgd.cpp: the same sum order (common/reduce.hpp:
// lane l of a warp adds elements l, l + 32, ... of the block in order into a binary64 accumulator,
// then the shuffle-down tree of lane_tree), the same Philox words (common/qsgd.hpp, the key derived
// once on the host) and the same fixed float32 expressions.
//
// Encode: one warp per data block (grid-stride over the blocks, 8 warps per CUDA block): pass 1
// reads the block's y for the sum and the non-finite bit, pass 2 reads it again (from L1 / L2: a
// block is at most 4096 elements) for the codes, D and the residual; the non-finite flag is OR-ed
// into the workspace and the last CUDA block (atomic counter) writes the header, the key section
// and the padding. Decode: element-wise, the header and the key section's reserved bytes checked
// on the device (a mismatch sets kStatusCorrupt and writes nothing).
#include "../common/qsgd.hpp"
#include "../common/reduce.hpp"
#include "../core/codecs/qsgd.hpp"
#include "common.cuh"

namespace gradcomp::detail::cuda {
namespace {

using common::add_rn;
using common::div_rn;
using common::mul_rn;
using common::sub_rn;
using plan::kThreads;

constexpr int kWarps = kThreads / 32;
constexpr int64_t kFlagOffset = plan::kCastFlagOffset;
constexpr int64_t kCounterOffset = plan::kCastCounterOffset;

template <class In, bool HasRes, bool Div1>
__device__ __forceinline__ float load_xp(const typename In::storage* __restrict__ x, const float* __restrict__ r,
                                         int64_t i) {
  float v = In::load(x[i]);
  if constexpr (HasRes) v = add_rn(v, r[i]);
  return v;
}

template <class In, bool HasRes, bool Div1>
__global__ void __launch_bounds__(kThreads) qsgd_encode_kernel(const typename In::storage* __restrict__ x,
                                                               float* __restrict__ r, int8_t* __restrict__ codes,
                                                               float* __restrict__ norms, int64_t n, int64_t B,
                                                               int64_t nblocks, int levels, float div,
                                                               qsgd::Key key, uint8_t* __restrict__ packet,
                                                               PacketLayout layout, EncodeContext ctx,
                                                               uint8_t* __restrict__ ws) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warp = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const float flevels = float(levels);
  uint32_t flag = 0;
  for (int64_t b = warp; b < nblocks; b += warps) {
    const int64_t lo = b * B, len = min(B, n - lo);
    double acc = 0.0;
    uint32_t nf = 0;
    for (int64_t t = lane; t < len; t += 32) {
      const float xp = load_xp<In, HasRes, Div1>(x, r, lo + t);
      const float y = Div1 ? xp : div_rn(xp, div);
      nf |= nonfinite_bit(y);
      const double d = double(y);
      acc = common::dadd(acc, common::dmul(d, d));
    }
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) acc = common::dadd(acc, __shfl_down_sync(0xFFFFFFFFu, acc, o));
    const double S = __shfl_sync(0xFFFFFFFFu, acc, 0);
    nf = warp_or_u32(nf);
    const float norm = qsgd::block_norm(S, nf != 0);
    if (lane == 0) norms[b] = norm;
    const bool usable = common::is_finite_bits(__float_as_uint(norm)) && norm != 0.0f;
    const float ratio = usable ? div_rn(flevels, norm) : 0.0f;
    const float dscale = div_rn(norm, flevels);
    flag |= uint32_t(!common::is_finite_bits(__float_as_uint(norm)));
    for (int64_t t = lane; t < len; t += 32) {
      const int64_t i = lo + t;
      const float xp = load_xp<In, HasRes, Div1>(x, r, i);
      const float y = Div1 ? xp : div_rn(xp, div);
      const philox::Ctr4x32 w = qsgd::group_bits(key, uint64_t(i) / qsgd::kGroup);
      const uint32_t word = (i & 3) == 0 ? w[0] : (i & 3) == 1 ? w[1] : (i & 3) == 2 ? w[2] : w[3];
      const int32_t c = nf ? 0 : qsgd::code(y, ratio, qsgd::uniform(word), levels);
      codes[i] = int8_t(c);
      if constexpr (HasRes) {
        const float d = mul_rn(dscale, float(c));
        r[i] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(div, d));
      }
    }
  }
  if (__syncthreads_or(flag) && threadIdx.x == 0) atomicOr(reinterpret_cast<uint32_t*>(ws + kFlagOffset), 1u);
  __shared__ bool s_last;
  if (!elect_last_block(reinterpret_cast<uint32_t*>(ws + kCounterOffset), &s_last)) return;
  __shared__ uint32_t s_flag;
  if (threadIdx.x == 0) s_flag = atomicOr(reinterpret_cast<uint32_t*>(ws + kFlagOffset), 0u);
  __syncthreads();
  finish_packet_block(packet, layout, s_flag ? kFlagNonFinite : 0, ctx);
}

template <class O, bool Acc>
__global__ void __launch_bounds__(kThreads) qsgd_decode_kernel(const uint8_t* __restrict__ packet,
                                                               typename O::storage* __restrict__ out, int64_t n,
                                                               int64_t B, int levels, float alpha, HeaderExpect e,
                                                               uint32_t* status) {
  const DecodeHead& head = decode_prologue(packet, e, status);
  if (head.input < 0) return;
  const auto* codes = reinterpret_cast<const int8_t*>(packet + head.offset[0]);
  const auto* norms = reinterpret_cast<const float*>(packet + head.offset[1]);
  const float flevels = float(levels);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const float v = mul_rn(mul_rn(div_rn(norms[i / B], flevels), float(codes[i])), alpha);
    out[i] = O::store(Acc ? add_rn(O::load(out[i]), v) : v);
  }
}

void encode(const QsgdPlan& p, const EncodeArgs& a) {
  DeviceGuard guard(a.x.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int dev = a.x.device.index;
  uint8_t* ws = a.workspace;
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(ws + kFlagOffset, 0, 8, s));
  const qsgd::Key key = qsgd::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
  auto* codes = reinterpret_cast<int8_t*>(a.packet + p.layout.sections[0].offset);
  auto* norms = reinterpret_cast<float*>(a.packet + p.layout.sections[1].offset);
  common::dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    const auto* xs = static_cast<const typename In::storage*>(a.x.data);
    auto go = [&](auto kernel) {
      const auto blocks = unsigned(plan::wave_grid(p.nblocks, kWarps, wave_blocks(dev, kernel)));
      kernel<<<blocks, kThreads, 0, s>>>(xs, a.residual, codes, norms, p.numel, p.block, p.nblocks, p.levels,
                                         a.divisor, key, a.packet, p.layout, a.ctx, ws);
      GRADCOMP_CUDA_CHECK_LAUNCH("qsgd_encode_kernel");
    };
    const bool div1 = a.divisor == 1.0f;
    if (a.residual) {
      if (div1) go(qsgd_encode_kernel<In, true, true>);
      else go(qsgd_encode_kernel<In, true, false>);
    } else {
      if (div1) go(qsgd_encode_kernel<In, false, true>);
      else go(qsgd_encode_kernel<In, false, false>);
    }
  }, "qsgd: input");
}

void decode(const QsgdPlan& p, const DecodeArgs& a) {
  DeviceGuard guard(a.out.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int dev = a.out.device.index;
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  common::dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* op = static_cast<typename O::storage*>(a.out.data);
    auto go = [&](auto kernel) {
      const auto blocks = unsigned(plan::wave_grid(p.numel, kThreads, wave_blocks(dev, kernel)));
      kernel<<<blocks, kThreads, 0, s>>>(a.packet, op, p.numel, p.block, p.levels, a.alpha, *a.expect, status);
      GRADCOMP_CUDA_CHECK_LAUNCH("qsgd_decode_kernel");
    };
    if (a.mode == DecodeMode::accumulate) go(qsgd_decode_kernel<O, true>);
    else go(qsgd_decode_kernel<O, false>);
  }, "decode: out");
}

int64_t workspace_bytes(const QsgdPlan&) { return plan::kStatusBytes; }

} // namespace

const Kernels<QsgdPlan> qsgd = {&workspace_bytes, &encode, &decode};

} // namespace gradcomp::detail::cuda
