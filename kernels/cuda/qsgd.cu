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
//
// coding=elias (common/elias.hpp): the encode kernel writes the codes to the workspace; then one
// warp per data block counts its bits (a ballot finds each non-zero's previous one, 32 elements at a
// time) into the packet's ends, one CUDA block turns the counts into ends in place (cub::BlockScan
// over tiles of 8192 counts; the sum stays below 2^32: 13 bits per element at most), one thread
// patches the header (bit count, or the fallback flag), and one warp per data block ORs its entries
// into the zeroed stream (32-bit atomics: blocks share words), or copies its codes in the fallback.
// Decode: one warp per data block, lane 0 parses the block's bits into shared memory, then the warp
// writes D; a block whose bits do not parse is skipped and sets kStatusCorrupt. Before it, a check
// kernel vetoes the whole decode (nothing written, kStatusCorrupt) for a header bit count that does
// not match the last end, a fallback packet with a non-zero count or end, or a non-zero bit past
// the stream.
#include <cub/block/block_scan.cuh>

#include "../common/elias.hpp"
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
//! elias: u32 at workspace byte 12: the stream passed its capacity (the fallback); the codes from
//! byte kCodesOffset.
constexpr int64_t kFallbackOffset = 12;
//! elias decode: u32 at workspace byte 12: elias_check_kernel found the packet corrupt (write nothing).
constexpr int64_t kVetoOffset = 12;
constexpr int64_t kCodesOffset = plan::kStatusBytes;
constexpr int kScanThreads = 1024, kScanItems = 8;

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

//! Entry t of chunk [t0, t0 + 32) of a block: its (bits, width), width 0 for a zero code. `prev` is the
//! position of the block's last non-zero before the chunk (-1: none), the same in every lane.
__device__ __forceinline__ elias::Entry chunk_entry(int32_t c, int64_t t, int lane, int64_t prev, uint32_t mask) {
  if (c == 0) return elias::Entry{0, 0};
  const uint32_t below = mask & ((1u << lane) - 1u);
  const int64_t p = below ? t - lane + (31 - __clz(int(below))) : prev;
  return elias::entry(uint32_t(t - p), c);
}
//! The position of the chunk's last non-zero, or `prev` when it has none.
__device__ __forceinline__ int64_t chunk_last(int64_t t0, int64_t prev, uint32_t mask) {
  return mask ? t0 + (31 - __clz(int(mask))) : prev;
}

__global__ void __launch_bounds__(kThreads) elias_count_kernel(const int8_t* __restrict__ codes,
                                                               uint32_t* __restrict__ ends, int64_t n, int64_t B,
                                                               int64_t nblocks) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t b = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); b < nblocks; b += warps) {
    const int64_t lo = b * B, len = min(B, n - lo);
    int64_t prev = -1;
    uint32_t bits = 0;
    for (int64_t t0 = 0; t0 < len; t0 += 32) {
      const int64_t t = t0 + lane;
      const int32_t c = t < len ? codes[lo + t] : 0;
      const uint32_t mask = __ballot_sync(0xFFFFFFFFu, c != 0);
      bits += uint32_t(chunk_entry(c, t, lane, prev, mask).width);
      prev = chunk_last(t0, prev, mask);
    }
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) bits += __shfl_down_sync(0xFFFFFFFFu, bits, o);
    if (lane == 0) ends[b] = bits;
  }
}

//! The block bit counts into their inclusive prefix sums (the ends), in place: one CUDA block.
__global__ void __launch_bounds__(kScanThreads) elias_scan_kernel(uint32_t* __restrict__ ends, int64_t nblocks) {
  using Scan = cub::BlockScan<uint32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  uint32_t carry = 0;
  for (int64_t base = 0; base < nblocks; base += int64_t(kScanThreads) * kScanItems) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kScanItems;
    uint32_t v[kScanItems];
#pragma unroll
    for (int k = 0; k < kScanItems; ++k) v[k] = i0 + k < nblocks ? ends[i0 + k] : 0u;
    uint32_t tile = 0;
    Scan(tmp).InclusiveSum(v, v, tile);
#pragma unroll
    for (int k = 0; k < kScanItems; ++k)
      if (i0 + k < nblocks) ends[i0 + k] = v[k] + carry;
    carry += tile;
    __syncthreads(); // tmp is reused by the next tile
  }
}

//! After the scan: the header's bit count, or the fallback flag (and bit count 0).
__global__ void elias_total_kernel(uint8_t* __restrict__ packet, const uint32_t* __restrict__ ends, int64_t n,
                                   int64_t nblocks, uint8_t* __restrict__ ws) {
  const uint64_t total = nblocks ? ends[nblocks - 1] : 0;
  const bool fallback = total > uint64_t(8 * n);
  *reinterpret_cast<uint32_t*>(ws + kFallbackOffset) = fallback;
  *reinterpret_cast<uint64_t*>(packet + offsetof(PacketHeader, main_param)) = fallback ? 0 : total;
  if (fallback) packet[offsetof(PacketHeader, flags)] |= kFlagFallback;
}

//! OR `width` (<= 31) bits of `value` into the stream at bit `at` (bit p: bit 7 - p mod 8 of byte p / 8;
//! `words` the stream as little-endian u32).
__device__ __forceinline__ void or_bits(uint32_t* words, uint64_t at, uint32_t value, int width) {
  const uint64_t w = at >> 5;
  const uint64_t v = uint64_t(value) << (64 - int(at & 31) - width);
  const uint32_t hi = uint32_t(v >> 32), lo = uint32_t(v);
  atomicOr(words + w, __byte_perm(hi, 0, 0x0123));
  if (lo) atomicOr(words + w + 1, __byte_perm(lo, 0, 0x0123));
}

__global__ void __launch_bounds__(kThreads) elias_write_kernel(const int8_t* __restrict__ codes,
                                                               uint8_t* __restrict__ stream,
                                                               uint32_t* __restrict__ ends, int64_t n, int64_t B,
                                                               int64_t nblocks, const uint8_t* __restrict__ ws) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  const bool fallback = *reinterpret_cast<const uint32_t*>(ws + kFallbackOffset) != 0;
  auto* words = reinterpret_cast<uint32_t*>(stream);
  for (int64_t b = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); b < nblocks; b += warps) {
    const int64_t lo = b * B, len = min(B, n - lo);
    if (fallback) {
      for (int64_t t = lane; t < len; t += 32) stream[lo + t] = uint8_t(codes[lo + t]);
      __syncwarp();
      if (lane == 0) ends[b] = 0; // read by no one in the fallback
      continue;
    }
    uint64_t at = b ? ends[b - 1] : 0;
    int64_t prev = -1;
    for (int64_t t0 = 0; t0 < len; t0 += 32) {
      const int64_t t = t0 + lane;
      const int32_t c = t < len ? codes[lo + t] : 0;
      const uint32_t mask = __ballot_sync(0xFFFFFFFFu, c != 0);
      const elias::Entry e = chunk_entry(c, t, lane, prev, mask);
      uint32_t incl = uint32_t(e.width);
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const uint32_t v = __shfl_up_sync(0xFFFFFFFFu, incl, o);
        if (lane >= o) incl += v;
      }
      if (e.width) or_bits(words, at + incl - uint32_t(e.width), e.value, e.width);
      at += __shfl_sync(0xFFFFFFFFu, incl, 31);
      prev = chunk_last(t0, prev, mask);
    }
  }
}

//! Before an elias decode writes anything: a fallback packet with a non-zero bit count or last end, a
//! stream whose last end is not the header's bit count or passes the capacity, or a non-zero bit past
//! the stream sets the veto word (workspace byte kVetoOffset, zeroed by the host) and kStatusCorrupt.
__global__ void __launch_bounds__(kThreads) elias_check_kernel(const uint8_t* __restrict__ packet, int64_t n,
                                                               int64_t nblocks, HeaderExpect e, uint32_t* status) {
  const DecodeHead& head = decode_prologue(packet, e, nullptr);
  if (head.input < 0) return; // the decode kernel's prologue reports it and writes nothing
  const uint8_t* stream = packet + head.offset[0];
  const auto* ends = reinterpret_cast<const uint32_t*>(packet + expect_section(e, head.input, 2).offset);
  const PacketHeader h = load_header(packet);
  const bool fallback = (h.flags & kFlagFallback) != 0;
  const uint64_t total = nblocks ? ends[nblocks - 1] : 0;
  auto* veto = reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(status) + kVetoOffset);
  bool bad = fallback ? (h.main_param != 0 || total != 0) : (total != h.main_param || total > uint64_t(8 * n));
  if (!fallback && !bad) {
    const int64_t used = int64_t((total + 7) / 8);
    for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
      const uint32_t v = stream[i];
      if (i >= used ? v != 0 : i == used - 1 && total % 8 && (v & (0xFFu >> (total % 8)))) bad = true;
    }
  }
  if (bad) {
    atomicOr(veto, 1u);
    atomicOr(status, kStatusCorrupt);
  }
}

template <class O, bool Acc>
__global__ void __launch_bounds__(kThreads) elias_decode_kernel(const uint8_t* __restrict__ packet,
                                                                typename O::storage* __restrict__ out, int64_t n,
                                                                int64_t B, int64_t nblocks, int levels, float alpha,
                                                                HeaderExpect e, uint32_t* status) {
  const DecodeHead& head = decode_prologue(packet, e, status);
  if (head.input < 0) return;
  if (*reinterpret_cast<const volatile uint32_t*>(reinterpret_cast<uint8_t*>(status) + kVetoOffset)) return;
  __shared__ int8_t s_codes[kWarps][qsgd::kMaxBlock];
  const int lane = int(threadIdx.x) & 31, wi = int(threadIdx.x >> 5);
  const uint8_t* stream = packet + head.offset[0];
  const auto* norms = reinterpret_cast<const float*>(packet + head.offset[1]);
  const auto* ends = reinterpret_cast<const uint32_t*>(packet + expect_section(e, head.input, 2).offset);
  const bool fallback = (load_header(packet).flags & kFlagFallback) != 0;
  const float flevels = float(levels);
  const int64_t warps = int64_t(gridDim.x) * kWarps;
  for (int64_t b = int64_t(blockIdx.x) * kWarps + wi; b < nblocks; b += warps) {
    const int64_t lo = b * B, len = min(B, n - lo);
    const int8_t* c = reinterpret_cast<const int8_t*>(stream) + lo;
    if (!fallback) {
      bool ok = false;
      if (lane == 0) {
        const uint64_t at = b ? ends[b - 1] : 0;
        ok = ends[b] >= at && elias::parse_block(stream, at, ends[b], s_codes[wi], len, levels);
        if (!ok) atomicOr(status, kStatusCorrupt);
      }
      ok = __shfl_sync(0xFFFFFFFFu, ok, 0);
      __syncwarp();
      if (!ok) continue;
      c = s_codes[wi];
    }
    const float dscale = div_rn(norms[b], flevels);
    for (int64_t t = lane; t < len; t += 32) {
      const float v = mul_rn(mul_rn(dscale, float(c[t])), alpha);
      out[lo + t] = O::store(Acc ? add_rn(O::load(out[lo + t]), v) : v);
    }
    __syncwarp();
  }
}

//! The Elias stream of the codes in the workspace (after the encode kernel).
void elias_pack(const QsgdPlan& p, const EncodeArgs& a, cudaStream_t s, int dev) {
  uint8_t* ws = a.workspace;
  const auto* codes = reinterpret_cast<const int8_t*>(ws + kCodesOffset);
  uint8_t* stream = a.packet + p.layout.sections[0].offset;
  auto* ends = reinterpret_cast<uint32_t*>(a.packet + p.layout.sections[2].offset);
  if (p.nblocks > 0) {
    const auto grid = unsigned(plan::wave_grid(p.nblocks, kWarps, wave_blocks(dev, elias_count_kernel)));
    elias_count_kernel<<<grid, kThreads, 0, s>>>(codes, ends, p.numel, p.block, p.nblocks);
    GRADCOMP_CUDA_CHECK_LAUNCH("elias_count_kernel");
    elias_scan_kernel<<<1, kScanThreads, 0, s>>>(ends, p.nblocks);
    GRADCOMP_CUDA_CHECK_LAUNCH("elias_scan_kernel");
  }
  elias_total_kernel<<<1, 1, 0, s>>>(a.packet, ends, p.numel, p.nblocks, ws);
  GRADCOMP_CUDA_CHECK_LAUNCH("elias_total_kernel");
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(stream, 0, size_t(p.numel), s));
  if (p.nblocks > 0) {
    const auto grid = unsigned(plan::wave_grid(p.nblocks, kWarps, wave_blocks(dev, elias_write_kernel)));
    elias_write_kernel<<<grid, kThreads, 0, s>>>(codes, stream, ends, p.numel, p.block, p.nblocks, ws);
    GRADCOMP_CUDA_CHECK_LAUNCH("elias_write_kernel");
  }
}

void encode(const QsgdPlan& p, const EncodeArgs& a) {
  DeviceGuard guard(a.x.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int dev = a.x.device.index;
  uint8_t* ws = a.workspace;
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(ws + kFlagOffset, 0, 8, s));
  const qsgd::Key key = qsgd::derive(a.ctx.seed, a.ctx.step, a.ctx.bucket, a.ctx.chunk);
  auto* codes = p.elias ? reinterpret_cast<int8_t*>(ws + kCodesOffset)
                        : reinterpret_cast<int8_t*>(a.packet + p.layout.sections[0].offset);
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
  if (p.elias) elias_pack(p, a, s, dev);
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
    auto go_elias = [&](auto kernel) {
      GRADCOMP_CUDA_CHECK(cudaMemsetAsync(a.workspace + kVetoOffset, 0, 4, s));
      const auto cblocks = unsigned(plan::wave_grid(p.numel, kThreads, wave_blocks(dev, elias_check_kernel)));
      elias_check_kernel<<<cblocks, kThreads, 0, s>>>(a.packet, p.numel, p.nblocks, *a.expect, status);
      GRADCOMP_CUDA_CHECK_LAUNCH("elias_check_kernel");
      const auto blocks = unsigned(plan::wave_grid(std::max<int64_t>(p.nblocks, 1), kWarps, wave_blocks(dev, kernel)));
      kernel<<<blocks, kThreads, 0, s>>>(a.packet, op, p.numel, p.block, p.nblocks, p.levels, a.alpha, *a.expect,
                                         status);
      GRADCOMP_CUDA_CHECK_LAUNCH("elias_decode_kernel");
    };
    const bool acc = a.mode == DecodeMode::accumulate;
    if (p.elias) {
      if (acc) go_elias(elias_decode_kernel<O, true>);
      else go_elias(elias_decode_kernel<O, false>);
    } else if (acc) {
      go(qsgd_decode_kernel<O, true>);
    } else {
      go(qsgd_decode_kernel<O, false>);
    }
  }, "decode: out");
}

int64_t workspace_bytes(const QsgdPlan& p) {
  return p.elias ? kCodesOffset + (p.numel + 15) / 16 * 16 : plan::kStatusBytes;
}

} // namespace

const Kernels<QsgdPlan> qsgd = {&workspace_bytes, &encode, &decode};

} // namespace gradcomp::detail::cuda
