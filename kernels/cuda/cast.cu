// SPDX-License-Identifier: Apache-2.0
// CUDA backend of the cast codecs none / fp16 / bf16 (docs/contracts.md section 3). Packets are byte-for-
// byte those of kernels/cpu/cast.cpp: the same fixed expressions through common::add_rn / sub_rn /
// mul_rn / div_rn (never contracted into FMA) and the same conversions (common::float_to_*_bits).
//
// Grids: one wave of the kernel (occupancy x SMs, cuda::wave_blocks), fewer blocks for small inputs;
// every result is independent of the grid size.
// Encode: one grid-stride kernel, 8 consecutive elements per thread through 16-byte vectors;
// the non-finite bit is OR-reduced per block (__syncthreads_or) and across blocks (atomicOr into
// the workspace); the last block (atomic counter) writes the padding and the header.
// Decode: every block checks the header (and the key section's reserved bytes of the keyed
// bf16:rounding=stochastic) on the device; a mismatch sets kStatusCorrupt and writes nothing; the
// wire dtype of codec none comes from the header.
// bf16:rounding=stochastic: the same kernel with the stochastic rounding of kernels/common/sround.hpp
// (the stream derived once on the host, one Philox4x32-10 call per thread step of 8 elements).
#include <type_traits>

#include "../common/sround.hpp"
#include "../core/codecs/cast.hpp"
#include "common.cuh"

namespace gradcomp::detail::cuda {
namespace {

using plan::kChunk;
using plan::kItems;
using plan::kThreads;
using common::add_rn;
using common::div_rn;
using common::mul_rn;
using common::sub_rn;

//! The code of y: W's round-to-nearest store, or (SR: bf16:rounding=stochastic) the stochastic
//! rounding with uniform r16 (kernels/common/sround.hpp).
template <class W, bool SR> __device__ __forceinline__ typename W::storage cast_code(float y, uint32_t r16) {
  if constexpr (SR) {
    static_assert(std::is_same_v<W, BF16>, "stochastic rounding has a bfloat16 wire");
    return sround::float_to_bf16_sr_bits(y, r16);
  } else {
    return W::store(y);
  }
}

// SR: each thread's 8 consecutive elements start at a multiple of 8 (kItems == sround::kGroup), so
// they are exactly one Philox group: one philox4x32_10 call per step, as the CPU's loop.
template <class In, class W, bool HasRes, bool Div1, bool SR>
__global__ void __launch_bounds__(kThreads) cast_encode_kernel(const typename In::storage* __restrict__ x,
                                                               float* __restrict__ r,
                                                               typename W::storage* __restrict__ out, int64_t n,
                                                               float div, bool vec, uint8_t* __restrict__ packet,
                                                               PacketLayout layout, EncodeContext ctx,
                                                               sround::Key key, uint32_t* flag_word,
                                                               uint32_t* counter) {
  static_assert(kItems == sround::kGroup, "one Philox group per thread step");
  using WS = typename W::storage;
  uint32_t nf = 0;
  const int64_t stride = int64_t(gridDim.x) * kChunk;
  for (int64_t base = int64_t(blockIdx.x) * kChunk + int64_t(threadIdx.x) * kItems; base < n; base += stride) {
    philox::Ctr4x32 rb{};
    if constexpr (SR) rb = sround::group_bits(key, uint64_t(base) / kItems);
    if (vec && base + kItems <= n) {
      float v[kItems];
      load8<In>(x + base, v);
      float rv[kItems];
      if constexpr (HasRes) load8<F32>(r + base, rv);
      WS c[kItems];
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const float xp = HasRes ? add_rn(v[j], rv[j]) : v[j];
        const float y = Div1 ? xp : div_rn(xp, div);
        c[j] = cast_code<W, SR>(y, SR ? sround::uniform16(rb, j) : 0u);
        const float d = W::load(c[j]);
        if constexpr (HasRes) rv[j] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(div, d));
        nf |= nonfinite_bit(y) | nonfinite_bit(d);
      }
      store8<W>(out + base, c);
      if constexpr (HasRes) store8f(r + base, rv);
    } else {
#pragma unroll 1
      for (int j = 0; j < kItems && base + j < n; ++j) {
        const int64_t i = base + j;
        float xp = In::load(x[i]);
        if constexpr (HasRes) xp = add_rn(xp, r[i]);
        const float y = Div1 ? xp : div_rn(xp, div);
        const WS c = cast_code<W, SR>(y, SR ? sround::uniform16(rb, j) : 0u);
        const float d = W::load(c);
        out[i] = c;
        if constexpr (HasRes) r[i] = Div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(div, d));
        nf |= nonfinite_bit(y) | nonfinite_bit(d);
      }
    }
  }
  if (__syncthreads_or(nf) && threadIdx.x == 0) atomicOr(flag_word, 1u);
  __shared__ bool s_last;
  if (!elect_last_block(counter, &s_last)) return;
  __shared__ uint32_t s_flag;
  if (threadIdx.x == 0) s_flag = atomicOr(flag_word, 0u);
  __syncthreads();
  finish_packet_block(packet, layout, s_flag ? kFlagNonFinite : 0, ctx);
}

template <class W, class O, bool Acc>
__device__ __forceinline__ void cast_decode_body(const typename W::storage* __restrict__ in,
                                                 typename O::storage* __restrict__ out, int64_t n, float alpha,
                                                 bool vec) {
  using OS = typename O::storage;
  const int64_t stride = int64_t(gridDim.x) * kChunk;
  for (int64_t base = int64_t(blockIdx.x) * kChunk + int64_t(threadIdx.x) * kItems; base < n; base += stride) {
    if (vec && base + kItems <= n) {
      float v[kItems];
      load8<W>(in + base, v);
      float o[kItems];
      if constexpr (Acc) load8<O>(out + base, o);
      OS c[kItems];
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const float t = mul_rn(v[j], alpha);
        c[j] = O::store(Acc ? add_rn(o[j], t) : t);
      }
      store8<O>(out + base, c);
    } else {
#pragma unroll 1
      for (int j = 0; j < kItems && base + j < n; ++j) {
        const int64_t i = base + j;
        const float t = mul_rn(W::load(in[i]), alpha);
        OS c = O::store(Acc ? add_rn(O::load(out[i]), t) : t);
        out[i] = c;
      }
    }
  }
}

template <class O, bool Acc>
__global__ void __launch_bounds__(kThreads) cast_decode_kernel(const uint8_t* __restrict__ packet,
                                                               typename O::storage* __restrict__ out, int64_t n,
                                                               float alpha, bool vec, HeaderExpect e,
                                                               uint32_t* status) {
  // the header and (bf16:rounding=stochastic) the key section's reserved bytes; every non-finite
  // value travels in the payload: the flag only reaches the status word
  const DecodeHead& head = decode_prologue(packet, e, status);
  const int wire = head.input >= 0 ? common::gradient_code(head.dtype[0]) : -1;
  const uint8_t* payload = packet + head.offset[0];
  switch (wire) {
    case 0: cast_decode_body<F32, O, Acc>(reinterpret_cast<const float*>(payload), out, n, alpha, vec); break;
    case 1: cast_decode_body<F16, O, Acc>(reinterpret_cast<const uint16_t*>(payload), out, n, alpha, vec); break;
    case 2: cast_decode_body<BF16, O, Acc>(reinterpret_cast<const uint16_t*>(payload), out, n, alpha, vec); break;
    default: break; // corrupt: write nothing
  }
}

void encode(const CastPlan& p, const EncodeArgs& a) {
  DeviceGuard guard(a.x.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  uint8_t* workspace = a.workspace;
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(workspace + plan::kCastFlagOffset, 0, 8, s));
  const int dev = a.x.device.index;
  uint8_t* payload = a.packet + p.layout.sections[0].offset;
  const bool vec = aligned16(a.x.data) && (a.residual == nullptr || aligned16(a.residual));
  auto* flag = reinterpret_cast<uint32_t*>(workspace + plan::kCastFlagOffset);
  auto* counter = reinterpret_cast<uint32_t*>(workspace + plan::kCastCounterOffset);
  // the stream of bf16:rounding=stochastic, derived once on the host (the same function as the CPU's)
  const sround::Key key = p.stochastic ? sround::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk)
                                       : sround::Key{0, 0, 0, 0};
  common::dispatch_float(p.input, [&](auto in) {
    using In = decltype(in);
    common::dispatch_float(p.wire, [&](auto w) {
      using W = decltype(w);
      const auto* xs = static_cast<const typename In::storage*>(a.x.data);
      auto* out = reinterpret_cast<typename W::storage*>(payload);
      auto go = [&](auto kernel) {
        const auto blocks = unsigned(plan::wave_grid(p.numel, kChunk, wave_blocks(dev, kernel)));
        kernel<<<blocks, kThreads, 0, s>>>(xs, a.residual, out, p.numel, a.divisor, vec, a.packet, p.layout,
                                                     a.ctx, key, flag, counter);
        GRADCOMP_CUDA_CHECK_LAUNCH("cast_encode_kernel");
      };
      const bool div1 = a.divisor == 1.0f;
      if constexpr (std::is_same_v<W, BF16>) {
        if (p.stochastic) {
          if (a.residual) {
            if (div1) go(cast_encode_kernel<In, W, true, true, true>);
            else go(cast_encode_kernel<In, W, true, false, true>);
          } else {
            if (div1) go(cast_encode_kernel<In, W, false, true, true>);
            else go(cast_encode_kernel<In, W, false, false, true>);
          }
          return;
        }
      }
      if (a.residual) {
        if (div1) go(cast_encode_kernel<In, W, true, true, false>);
        else go(cast_encode_kernel<In, W, true, false, false>);
      } else {
        if (div1) go(cast_encode_kernel<In, W, false, true, false>);
        else go(cast_encode_kernel<In, W, false, false, false>);
      }
    }, "cast: wire");
  }, "cast: input");
}

void decode(const CastPlan& p, const DecodeArgs& a) {
  DeviceGuard guard(a.out.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int dev = a.out.device.index;
  const bool vec = aligned16(a.out.data);
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  common::dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* op = static_cast<typename O::storage*>(a.out.data);
    auto go = [&](auto kernel) {
      const auto blocks = unsigned(plan::wave_grid(p.numel, kChunk, wave_blocks(dev, kernel)));
      kernel<<<blocks, kThreads, 0, s>>>(a.packet, op, p.numel, a.alpha, vec, *a.expect, status);
      GRADCOMP_CUDA_CHECK_LAUNCH("cast_decode_kernel");
    };
    if (a.mode == DecodeMode::accumulate) go(cast_decode_kernel<O, true>);
    else go(cast_decode_kernel<O, false>);
  }, "decode: out");
}

int64_t workspace_bytes(const CastPlan&) { return plan::kStatusBytes; }

} // namespace

const Kernels<CastPlan> cast = {&workspace_bytes, &encode, &decode};

} // namespace gradcomp::detail::cuda
