// SPDX-License-Identifier: Apache-2.0
// CUDA backend of random-k (kernels/core/codecs/randomk.hpp, docs/contracts.md section 3). Packets
// and residuals are byte-for-byte those of kernels/cpu/randomk.cpp: the same indices
// (kernels/common/randomk.hpp, the key derived once on the host), the same fixed expressions
// (common::add_rn / sub_rn / mul_rn / div_rn) and conversions.
//
// Encode, two kernels on the caller's stream:
//   1. every element (grid-stride, coalesced): x' = x + r, y = x' / W; the non-finite bit of y
//      OR-reduced into the workspace; with a residual r = x' (the value off the selection);
//   2. every stratum j (one thread each): i_j from the key, x' read back from r (or x), the value
//      and r at i_j = x' - W D; the last block (atomic counter) applies the non-finite rule (value 0
//      = NaN, r at i_0 from x'_{i_0}, which stratum 0's thread left in the workspace), writes the
//      header, the key section and the padding.
// Decode: assign zeroes every element (alpha * 0) in one element-wise kernel, then one thread per
// stratum writes its value (accumulate: the stratum kernel alone, out[i_j] += alpha * value; k = 0
// and a flagged packet: out[0] = NaN, as the CPU). Every
// kernel checks the header and the key section's reserved bytes on the device (a mismatch sets
// kStatusCorrupt, in the first kernel only, and writes nothing).
#include "../common/randomk.hpp"
#include "../core/codecs/randomk.hpp"
#include "common.cuh"

namespace gradcomp::detail::cuda {
namespace {

using common::add_rn;
using common::div_rn;
using common::mul_rn;
using common::sub_rn;
using plan::kThreads;

// workspace: [0, 4) status word, [4, 8) the non-finite flag, [8, 12) the block counter of kernel 2,
// [16, 20) the float32 bits of x' at i_0
constexpr int64_t kFlagOffset = plan::kCastFlagOffset;
constexpr int64_t kCounterOffset = plan::kCastCounterOffset;
constexpr int64_t kXp0Offset = 16;
constexpr int64_t kWorkspaceBytes = 32;

template <class In, bool HasRes, bool Div1>
__global__ void __launch_bounds__(kThreads) rk_pass_kernel(const typename In::storage* __restrict__ x,
                                                           float* __restrict__ r, int64_t n, float div,
                                                           uint32_t* flag_word) {
  uint32_t nf = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    float xp = In::load(x[i]);
    if constexpr (HasRes) xp = add_rn(xp, r[i]);
    nf |= nonfinite_bit(Div1 ? xp : div_rn(xp, div));
    if constexpr (HasRes) r[i] = xp;
  }
  if (__syncthreads_or(nf) && threadIdx.x == 0) atomicOr(flag_word, 1u);
}

template <class In, bool HasRes, bool Div1>
__global__ void __launch_bounds__(kThreads) rk_select_kernel(const typename In::storage* __restrict__ x,
                                                             float* __restrict__ r,
                                                             typename In::storage* __restrict__ vals, int64_t k,
                                                             randomk::Strata st, randomk::Key key, bool unbiased,
                                                             float div, uint8_t* __restrict__ packet,
                                                             PacketLayout layout, EncodeContext ctx,
                                                             uint8_t* __restrict__ ws) {
  auto* flag_word = reinterpret_cast<uint32_t*>(ws + kFlagOffset);
  auto* xp0_word = reinterpret_cast<uint32_t*>(ws + kXp0Offset);
  uint32_t nf = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x; j < k; j += stride) {
    const int64_t at = randomk::index_of(key, st, j);
    const float xp = HasRes ? r[at] : In::load(x[at]);  // kernel 1 left x' in r
    if (j == 0) *xp0_word = __float_as_uint(xp);
    const float y = Div1 ? xp : div_rn(xp, div);
    const auto c = In::store(unbiased ? mul_rn(y, float(st.size(j))) : y);
    vals[j] = c;
    const float d = In::load(c);
    nf |= nonfinite_bit(d);
    if constexpr (HasRes) r[at] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(div, d));
  }
  if (__syncthreads_or(nf) && threadIdx.x == 0) atomicOr(flag_word, 1u);
  __shared__ bool s_last;
  if (!elect_last_block(reinterpret_cast<uint32_t*>(ws + kCounterOffset), &s_last)) return;
  __shared__ uint32_t s_flag;
  if (threadIdx.x == 0) {
    s_flag = atomicOr(flag_word, 0u);
    if (s_flag && k > 0) {  // the non-finite rule: value 0 = NaN, r at i_0 = x' - W D with it
      vals[0] = In::store(__uint_as_float(0x7FC00000u));
      if constexpr (HasRes) {
        const float xp = __uint_as_float(atomicOr(xp0_word, 0u));
        const float d = In::load(vals[0]);
        r[randomk::index_of(key, st, 0)] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(div, d));
      }
    }
  }
  __syncthreads();
  finish_packet_block(packet, layout, s_flag ? kFlagNonFinite : 0, ctx);
}

//! Assign: out = alpha * 0 everywhere (the stratum kernel then writes the k values).
template <class O>
__global__ void __launch_bounds__(kThreads) rk_zero_kernel(const uint8_t* __restrict__ packet,
                                                           typename O::storage* __restrict__ out, int64_t n,
                                                           float alpha, HeaderExpect e, uint32_t* status) {
  const DecodeHead& head = decode_prologue(packet, e, status);
  if (head.input < 0) return;
  const typename O::storage z = O::store(mul_rn(0.0f, alpha));
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) out[i] = z;
}

template <class O, bool Acc>
__global__ void __launch_bounds__(kThreads) rk_scatter_kernel(const uint8_t* __restrict__ packet,
                                                              typename O::storage* __restrict__ out, int64_t n,
                                                              int64_t k, randomk::Strata st, float alpha, HeaderExpect e,
                                                              uint32_t* status) {
  const DecodeHead& head = decode_prologue(packet, e, status);
  if (head.input < 0) return;
  const EncodeContext ctx = load_key(packet + head.offset[1]);
  const randomk::Key key = randomk::derive(ctx.seed, ctx.step, ctx.bucket, ctx.chunk);
  const uint8_t* vals = packet + head.offset[0];
  const DType wire = head.dtype[0];
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x; j < k; j += stride) {
    const int64_t at = randomk::index_of(key, st, j);
    const float v = mul_rn(load_dyn(vals, wire, j), alpha);
    out[at] = O::store(Acc ? add_rn(O::load(out[at]), v) : v);
  }
  // k = 0: nothing was sent; a flagged packet makes out[0] NaN (as the CPU, and top-k's decode)
  if (k == 0 && head.nonfinite && n > 0 && blockIdx.x == 0 && threadIdx.x == 0) out[0] = O::store(quiet_nan());
}

void encode(const RandomKPlan& p, const EncodeArgs& a) {
  DeviceGuard guard(a.x.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int dev = a.x.device.index;
  uint8_t* ws = a.workspace;
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(ws + kFlagOffset, 0, 8, s));
  const randomk::Key key = randomk::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
  const randomk::Strata st = p.k > 0 ? randomk::strata(p.numel, p.k) : randomk::Strata{};
  auto* flag = reinterpret_cast<uint32_t*>(ws + kFlagOffset);
  common::dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    const auto* xs = static_cast<const typename In::storage*>(a.x.data);
    auto* vals = reinterpret_cast<typename In::storage*>(a.packet + p.layout.sections[0].offset);
    auto go = [&](auto pass, auto select) {
      if (p.numel > 0) {
        const auto blocks = unsigned(plan::wave_grid(p.numel, kThreads, wave_blocks(dev, pass)));
        pass<<<blocks, kThreads, 0, s>>>(xs, a.residual, p.numel, a.divisor, flag);
        GRADCOMP_CUDA_CHECK_LAUNCH("rk_pass_kernel");
      }
      const auto blocks = unsigned(plan::wave_grid(p.k, kThreads, wave_blocks(dev, select)));
      select<<<blocks, kThreads, 0, s>>>(xs, a.residual, vals, p.k, st, key, p.unbiased, a.divisor, a.packet,
                                         p.layout, a.ctx, ws);
      GRADCOMP_CUDA_CHECK_LAUNCH("rk_select_kernel");
    };
    const bool div1 = a.divisor == 1.0f;
    if (a.residual) {
      if (div1) go(rk_pass_kernel<In, true, true>, rk_select_kernel<In, true, true>);
      else go(rk_pass_kernel<In, true, false>, rk_select_kernel<In, true, false>);
    } else {
      if (div1) go(rk_pass_kernel<In, false, true>, rk_select_kernel<In, false, true>);
      else go(rk_pass_kernel<In, false, false>, rk_select_kernel<In, false, false>);
    }
  }, "randomk: input");
}

void decode(const RandomKPlan& p, const DecodeArgs& a) {
  DeviceGuard guard(a.out.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int dev = a.out.device.index;
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  const randomk::Strata st = p.k > 0 ? randomk::strata(p.numel, p.k) : randomk::Strata{};
  const bool acc = a.mode == DecodeMode::accumulate;
  common::dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* op = static_cast<typename O::storage*>(a.out.data);
    uint32_t* scatter_status = status;  // the first kernel of the decode reports
    if (!acc) {
      auto zero = rk_zero_kernel<O>;
      const auto blocks = unsigned(plan::wave_grid(p.numel, kThreads, wave_blocks(dev, zero)));
      zero<<<blocks, kThreads, 0, s>>>(a.packet, op, p.numel, a.alpha, *a.expect, status);
      GRADCOMP_CUDA_CHECK_LAUNCH("rk_zero_kernel");
      scatter_status = nullptr;
    }
    auto go = [&](auto kernel) {
      const auto blocks = unsigned(plan::wave_grid(p.k, kThreads, wave_blocks(dev, kernel)));
      kernel<<<blocks, kThreads, 0, s>>>(a.packet, op, p.numel, p.k, st, a.alpha, *a.expect, scatter_status);
      GRADCOMP_CUDA_CHECK_LAUNCH("rk_scatter_kernel");
    };
    if (acc) go(rk_scatter_kernel<O, true>);
    else go(rk_scatter_kernel<O, false>);
  }, "decode: out");
}

int64_t workspace_bytes(const RandomKPlan&) { return kWorkspaceBytes; }

} // namespace

const Kernels<RandomKPlan> randomk = {&workspace_bytes, &encode, &decode};

} // namespace gradcomp::detail::cuda
