// SPDX-License-Identifier: Apache-2.0
// CUDA backend of exact top-k by magnitude (docs/contracts.md section 3) with fused error feedback; packets
// are byte-for-byte those of kernels/cpu/topk.cpp.
//
// Algorithm: multi-pass MSD radix select over the 31-bit |y| keys (common::abs_key), digits of 11,
// 11 and 9 bits (common::kRadixShift / kRadixBits), in the manner of AIR Top-K (Zhang et al.,
// SC'23), built from CUB block primitives (cub::DeviceTopK is not in CCCL 3.0):
//   * the grid is G blocks, block g owning the contiguous tile plan::tile_range(n, G, g);
//   * pass 0 reads x (+ residual: the first touch stores x' = fl(x + r) into the residual, which
//     is r_new for every element not sent) and builds the digit-0 histogram (shared-memory
//     atomics, merged into a global histogram); the last block to finish (atomic counter, no host
//     synchronization) scans the histogram and elects the bucket of the k-th key: the new prefix,
//     the keys still needed (k_rem) and the class size;
//   * passes 1 and 2 histogram the next digit over the class; while the elements at or above the
//     class fit the candidate buffer (plan::topk_fill_ok; its capacity, max(n/16, min(2k, n/4)) +
//     4096 entries and at most n, keeps ratios up to about 0.1 on this path) the pass also
//     filters them, in index order (CUB BlockScan), into the block's segment of the buffer, and
//     later passes read only the segment (a block whose tile overflows its segment re-reads its
//     tile instead); which path a block takes never changes the packet or the residual;
//   * early stop: once the class exactly fills k_rem (or the key is resolved) later passes exit;
//   * a count pass gives each tile its keys above the class and in the class; the last block scans
//     these per-tile counts (ties go to the lowest indices: tile g takes
//     clamp(k_rem - class elements of earlier tiles, 0, its class count)) into output offsets;
//   * the write pass compacts each tile's selection in index order (one packed BlockScan per
//     step), so indices ascend, writes values and the residual of sent elements
//     (r_new = fl(x' - D), or fl(x' - fl(divisor * D))), and the last block writes the header.
// Inputs of at most plan::kOneBlockMax elements run all passes in one kernel of one block;
// k == 0 and k == n take a single element-wise kernel. Offsets are 64-bit throughout. The
// element-wise kernels (dense encode, decode zero fill and scatter) run one wave of the kernel
// (occupancy x SMs, wave_blocks); the passes keep plan::topk_grid (one wave at kBlocksPerSM).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../core/codecs/topk.hpp"
#include "common.cuh"

namespace gradcomp::detail::cuda {
namespace {

using common::abs_key;
using common::add_rn;
using common::div_rn;
using common::mul_rn;
using common::sub_rn;
using plan::kChunk;
using plan::kItems;
using plan::kThreads;
using plan::Range;
using plan::TopKState;
constexpr int kB = common::kRadixBuckets;

struct TopKArgs {
  const void* x;
  float* r;
  int64_t n;
  int64_t k;
  float div;
  int div1;
  int vec; //!< x (and the residual) 16-byte aligned: vector loads
  int64_t G;
  int64_t seg_cap;
  TopKState* st;
  unsigned long long* hist; //!< [kRadixLevels][kB]
  int64_t* seg_count;
  int64_t* above;
  int64_t* cls;
  int64_t* out_off;
  int64_t* take;
  uint32_t* cand_key;
  uint32_t* cand_idx;
  uint8_t* packet;
  int64_t index_offset;
  int64_t values_offset;
  int index_u64;
  int value_dtype; //!< 0 float32, 1 float16, 2 bfloat16
  PacketLayout layout; //!< header (flags 0), sections, padding
  EncodeContext ctx;
};

struct Shared {
  uint32_t hist[kB];
  union {
    cub::BlockScan<int, kThreads>::TempStorage scan_int;
    cub::BlockScan<unsigned long long, kThreads>::TempStorage scan_ull;
    cub::BlockScan<long long, kThreads>::TempStorage scan_ll;
    cub::BlockReduce<long long, kThreads>::TempStorage reduce_ll;
  } tmp;
  unsigned long long acc;
  uint32_t bucket;
  bool last;
};

__device__ __forceinline__ float y_of(const TopKArgs& a, float xp) { return a.div1 ? xp : div_rn(xp, a.div); }
__device__ __forceinline__ float settle(const TopKArgs& a, float xp, float d) {
  return a.div1 ? sub_rn(xp, d) : sub_rn(xp, mul_rn(a.div, d));
}

//! x' of one element after the first touch (the residual holds it when there is one).
template <class In, bool HasRes> __device__ __forceinline__ float xprime(const TopKArgs& a, int64_t i) {
  if constexpr (HasRes) return a.r[i];
  else return In::load(static_cast<const typename In::storage*>(a.x)[i]);
}
//! x' of the nv <= 8 elements at base (vector loads for a full aligned group).
template <class In, bool HasRes>
__device__ __forceinline__ void xprime8(const TopKArgs& a, int64_t base, int nv, float (&v)[kItems]) {
  if (a.vec && nv == kItems) {
    if constexpr (HasRes) load8<F32>(a.r + base, v);
    else load8<In>(static_cast<const typename In::storage*>(a.x) + base, v);
  } else {
#pragma unroll
    for (int j = 0; j < kItems; ++j) v[j] = j < nv ? xprime<In, HasRes>(a, base + j) : 0.0f;
  }
}

//! Store one value of the runtime value dtype at pos; returns its decoded float D.
__device__ __forceinline__ float store_value(const TopKArgs& a, int64_t pos, float y) {
  uint8_t* vals = a.packet + a.values_offset;
  if (a.value_dtype == 0) {
    reinterpret_cast<float*>(vals)[pos] = y;
    return y;
  }
  const uint16_t c = a.value_dtype == 1 ? common::float_to_half_bits(y) : common::float_to_bf16_bits(y);
  reinterpret_cast<uint16_t*>(vals)[pos] = c;
  return a.value_dtype == 1 ? common::half_bits_to_float(c) : common::bf16_bits_to_float(c);
}
__device__ __forceinline__ void store_index(const TopKArgs& a, int64_t pos, int64_t i) {
  uint8_t* idx = a.packet + a.index_offset;
  if (a.index_u64) reinterpret_cast<uint64_t*>(idx)[pos] = uint64_t(i);
  else reinterpret_cast<uint32_t*>(idx)[pos] = uint32_t(i);
}

// ---- pass 0: first touch + digit-0 histogram over the tile ---------------------------------------
template <class In, bool HasRes> __device__ void pass0_block(const TopKArgs& a, int64_t g, Shared& sh) {
  for (int d = threadIdx.x; d < kB; d += kThreads) sh.hist[d] = 0;
  __syncthreads();
  const Range t = plan::tile_range(a.n, a.G, g);
  const auto* xs = static_cast<const typename In::storage*>(a.x);
  for (int64_t base = t.begin + int64_t(threadIdx.x) * kItems; base < t.end; base += kChunk) {
    const int nv = int(plan::min64(kItems, t.end - base));
    float v[kItems];
    if (a.vec && nv == kItems) {
      load8<In>(xs + base, v);
      if constexpr (HasRes) {
        float rv[kItems];
        load8<F32>(a.r + base, rv);
#pragma unroll
        for (int j = 0; j < kItems; ++j) v[j] = add_rn(v[j], rv[j]);
        store8f(a.r + base, v);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        float xp = 0.0f;
        if (j < nv) {
          xp = In::load(xs[base + j]);
          if constexpr (HasRes) {
            xp = add_rn(xp, a.r[base + j]);
            a.r[base + j] = xp;
          }
        }
        v[j] = xp;
      }
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j)
      if (j < nv) atomicAdd(&sh.hist[abs_key(y_of(a, v[j])) >> plan::radix_shift(0)], 1u);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kB; d += kThreads)
    if (const uint32_t c = sh.hist[d]) atomicAdd(&a.hist[d], (unsigned long long)c);
  if (threadIdx.x == 0) a.seg_count[g] = -1;
}

// ---- passes over the class: histogram of digit `level` (do_hist) or per-tile counts ---------------
// Reads the block's segment when it holds the candidates, else the tile; when the state allows
// and the block has no segment yet, filters the keys >= lo into the segment in index order.
template <class In, bool HasRes>
__device__ void filter_block(const TopKArgs& a, int64_t g, Shared& sh, bool do_hist, int level) {
  const uint32_t lo = a.st->lo, hi = a.st->hi;
  const bool fill_ok = a.st->fill_ok != 0;
  const int shift = do_hist ? plan::radix_shift(level) : 0;
  const uint32_t mask = do_hist ? (1u << plan::radix_bits(level)) - 1u : 0u;
  if (do_hist)
    for (int d = threadIdx.x; d < kB; d += kThreads) sh.hist[d] = 0;
  const int64_t seg = a.seg_count[g];
  const int64_t seg0 = g * a.seg_cap;
  __syncthreads();
  long long n_above = 0, n_cls = 0;
  auto visit = [&](uint32_t key) {
    if (key > hi) {
      ++n_above;
    } else if (key >= lo) {
      ++n_cls;
      if (do_hist) atomicAdd(&sh.hist[(key >> shift) & mask], 1u);
    }
  };
  int64_t new_seg = seg;
  if (seg >= 0) {
    for (int64_t i = threadIdx.x; i < seg; i += kThreads) visit(a.cand_key[seg0 + i]);
  } else {
    const Range t = plan::tile_range(a.n, a.G, g);
    const bool fill = fill_ok && a.seg_cap > 0;
    int64_t written = 0;
    bool overflow = false;
    for (int64_t base0 = t.begin; base0 < t.end; base0 += kChunk) { // uniform trip count
      const int64_t base = base0 + int64_t(threadIdx.x) * kItems;
      const int nv = int(plan::max64(0, plan::min64(kItems, t.end - base)));
      float v[kItems];
      xprime8<In, HasRes>(a, base, nv, v);
      uint32_t key[kItems];
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        key[j] = abs_key(y_of(a, v[j]));
        if (j < nv) visit(key[j]);
      }
      if (fill) {
        int c = 0;
#pragma unroll
        for (int j = 0; j < kItems; ++j) c += (j < nv && key[j] >= lo) ? 1 : 0;
        int off = 0, total = 0;
        cub::BlockScan<int, kThreads>(sh.tmp.scan_int).ExclusiveSum(c, off, total);
        if (!overflow && written + total <= a.seg_cap) {
          int64_t o = seg0 + written + off;
#pragma unroll
          for (int j = 0; j < kItems; ++j) {
            if (j < nv && key[j] >= lo) {
              a.cand_key[o] = key[j];
              a.cand_idx[o] = uint32_t(base + j - t.begin);
              ++o;
            }
          }
        } else {
          overflow = true;
        }
        written += total;
        __syncthreads();
      }
    }
    if (fill) new_seg = overflow ? -1 : written;
  }
  __syncthreads();
  if (do_hist) {
    unsigned long long* gh = a.hist + int64_t(level) * kB;
    for (int d = threadIdx.x; d < kB; d += kThreads)
      if (const uint32_t c = sh.hist[d]) atomicAdd(&gh[d], (unsigned long long)c);
  } else {
    const long long ta = cub::BlockReduce<long long, kThreads>(sh.tmp.reduce_ll).Sum(n_above);
    __syncthreads();
    const long long tc = cub::BlockReduce<long long, kThreads>(sh.tmp.reduce_ll).Sum(n_cls);
    if (threadIdx.x == 0) {
      a.above[g] = ta;
      a.cls[g] = tc;
    }
  }
  if (threadIdx.x == 0) a.seg_count[g] = new_seg;
}

// ---- the elected block: pick the bucket of the k-th key at `level` ----------------------------------
__device__ void choose(const TopKArgs& a, int level, Shared& sh) {
  const unsigned long long* h = a.hist + int64_t(level) * kB;
  const long long k_rem = level == 0 ? a.k : a.st->k_rem;
  constexpr int kPer = kB / kThreads;
  unsigned long long v[kPer];
  unsigned long long s = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) { // thread t owns buckets 2047 - 8t ... 2040 - 8t (from the top)
    v[j] = __ldcg(h + (kB - 1 - (int(threadIdx.x) * kPer + j)));
    s += v[j];
  }
  // Defaults for a histogram in which no bucket reaches k_rem (cannot happen for 1 <= k_rem <=
  // the class size; keeps the state defined if it did): bucket 0, everything above it taken.
  if (threadIdx.x == 0) {
    sh.bucket = 0;
    sh.acc = 0;
  }
  __syncthreads();
  unsigned long long acc = 0;
  cub::BlockScan<unsigned long long, kThreads>(sh.tmp.scan_ull).ExclusiveSum(s, acc);
  const unsigned long long need = (unsigned long long)k_rem;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (acc < need && acc + v[j] >= need) {
      sh.bucket = uint32_t(kB - 1 - (int(threadIdx.x) * kPer + j));
      sh.acc = acc;
    }
    acc += v[j];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t b = sh.bucket;
    TopKState* st = a.st;
    const long long rem = k_rem - (long long)sh.acc;
    const long long cls = (long long)__ldcg(h + b);
    const uint32_t prefix = level == 0 ? b : ((st->prefix << plan::radix_bits(level)) | b);
    st->prefix = prefix;
    st->lo = plan::class_lo(prefix, level);
    st->hi = plan::class_hi(prefix, level);
    st->k_rem = rem;
    st->cls = cls;
    st->level = level;
    st->done = (cls == rem || level == common::kRadixLevels - 1) ? 1 : 0;
    st->fill_ok = plan::topk_fill_ok(a.n, a.k - rem, cls, a.k) ? 1 : 0;
    if (level == 0 && __ldcg(h + common::kNonFiniteDigit0) != 0) atomicOr(&st->flag, 1u);
  }
  __threadfence();
  __syncthreads();
}

// ---- the elected block: per-tile output offsets and tie quotas --------------------------------------
__device__ void count_finalize(const TopKArgs& a, Shared& sh) {
  const long long k_rem = a.st->k_rem;
  const int64_t per = plan::ceil_div(a.G, kThreads);
  const int64_t g0 = plan::min64(a.G, int64_t(threadIdx.x) * per), g1 = plan::min64(a.G, g0 + per);
  long long c = 0;
  for (int64_t g = g0; g < g1; ++g) c += __ldcg(reinterpret_cast<const long long*>(a.cls + g));
  long long before = 0;
  cub::BlockScan<long long, kThreads>(sh.tmp.scan_ll).ExclusiveSum(c, before);
  __syncthreads();
  long long sel = 0;
  for (int64_t g = g0; g < g1; ++g) {
    const long long cg = __ldcg(reinterpret_cast<const long long*>(a.cls + g));
    const long long tk = plan::tile_take(k_rem, before, cg);
    a.take[g] = tk;
    sel += __ldcg(reinterpret_cast<const long long*>(a.above + g)) + tk;
    before += cg;
  }
  long long o = 0;
  cub::BlockScan<long long, kThreads>(sh.tmp.scan_ll).ExclusiveSum(sel, o);
  for (int64_t g = g0; g < g1; ++g) {
    a.out_off[g] = o;
    o += __ldcg(reinterpret_cast<const long long*>(a.above + g)) + a.take[g];
  }
  __threadfence();
  __syncthreads();
}

// ---- write pass: ordered compaction of the tile's selection ------------------------------------------
template <class In, bool HasRes> __device__ void write_block(const TopKArgs& a, int64_t g, Shared& sh) {
  const uint32_t lo = a.st->lo, hi = a.st->hi;
  const long long take = __ldcg(reinterpret_cast<const long long*>(a.take + g));
  const long long out_base = __ldcg(reinterpret_cast<const long long*>(a.out_off + g));
  const int64_t seg = a.seg_count[g];
  const int64_t seg0 = g * a.seg_cap;
  const Range t = plan::tile_range(a.n, a.G, g);
  const int64_t count = seg >= 0 ? seg : t.end - t.begin;
  long long above_base = 0, tie_base = 0;
  uint32_t nf = 0;
  for (int64_t base0 = 0; base0 < count; base0 += kChunk) { // uniform trip count
    const int64_t base = base0 + int64_t(threadIdx.x) * kItems;
    const int nv = int(plan::max64(0, plan::min64(kItems, count - base)));
    uint32_t key[kItems], off[kItems];
    float v[kItems];
    if (seg >= 0) {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        key[j] = j < nv ? a.cand_key[seg0 + base + j] : 0u;
        off[j] = j < nv ? a.cand_idx[seg0 + base + j] : 0u;
        v[j] = 0.0f;
      }
    } else {
      xprime8<In, HasRes>(a, t.begin + base, nv, v);
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        key[j] = abs_key(y_of(a, v[j]));
        off[j] = uint32_t(base + j);
      }
    }
    uint32_t na = 0, nt = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (j < nv) {
        na += key[j] > hi ? 1u : 0u;
        nt += (key[j] >= lo && key[j] <= hi) ? 1u : 0u;
      }
    }
    unsigned long long ex = 0, agg = 0;
    cub::BlockScan<unsigned long long, kThreads>(sh.tmp.scan_ull)
        .ExclusiveSum((static_cast<unsigned long long>(nt) << 32) | na, ex, agg);
    long long ea = above_base + (long long)(ex & 0xFFFFFFFFull);
    long long et = tie_base + (long long)(ex >> 32);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (j < nv) {
        const bool is_above = key[j] > hi;
        const bool is_tie = !is_above && key[j] >= lo;
        if (is_above || (is_tie && et < take)) {
          const long long pos = out_base + ea + (et < take ? et : take);
          const int64_t i = t.begin + int64_t(off[j]);
          const float xp = seg >= 0 ? xprime<In, HasRes>(a, i) : v[j];
          const float d = store_value(a, pos, y_of(a, xp));
          store_index(a, pos, i);
          if constexpr (HasRes) a.r[i] = settle(a, xp, d);
          nf |= nonfinite_bit(d);
        }
        ea += is_above ? 1 : 0;
        et += is_tie ? 1 : 0;
      }
    }
    above_base += (long long)(agg & 0xFFFFFFFFull);
    tie_base += (long long)(agg >> 32);
    __syncthreads();
  }
  if (__syncthreads_or(nf) && threadIdx.x == 0) atomicOr(&a.st->flag, 1u);
}

// ---- the elected block: header, padding -------------------------------------------------------------
__device__ void write_header(const TopKArgs& a) {
  __shared__ uint32_t s_flag;
  if (threadIdx.x == 0) s_flag = atomicOr(&a.st->flag, 0u);
  __syncthreads();
  finish_packet_block(a.packet, a.layout, s_flag ? kFlagNonFinite : 0, a.ctx);
}

// ---- kernels ----------------------------------------------------------------------------------------
template <class In, bool HasRes> __global__ void __launch_bounds__(kThreads) topk_pass0_kernel(TopKArgs a) {
  __shared__ Shared sh;
  pass0_block<In, HasRes>(a, blockIdx.x, sh);
  if (elect_last_block(&a.st->counter[plan::kCounterPass0], &sh.last)) choose(a, 0, sh);
}

template <class In, bool HasRes>
__global__ void __launch_bounds__(kThreads) topk_pass_kernel(TopKArgs a, int level) {
  __shared__ Shared sh;
  if (a.st->done) return; // early stop (written by the previous kernel: uniform over the grid)
  filter_block<In, HasRes>(a, blockIdx.x, sh, true, level);
  if (elect_last_block(&a.st->counter[level], &sh.last)) choose(a, level, sh);
}

template <class In, bool HasRes> __global__ void __launch_bounds__(kThreads) topk_count_kernel(TopKArgs a) {
  __shared__ Shared sh;
  filter_block<In, HasRes>(a, blockIdx.x, sh, false, 0);
  if (elect_last_block(&a.st->counter[plan::kCounterCount], &sh.last)) count_finalize(a, sh);
}

template <class In, bool HasRes> __global__ void __launch_bounds__(kThreads) topk_write_kernel(TopKArgs a) {
  __shared__ Shared sh;
  write_block<In, HasRes>(a, blockIdx.x, sh);
  if (elect_last_block(&a.st->counter[plan::kCounterWrite], &sh.last)) write_header(a);
}

//! Small inputs: every pass in one block, one launch.
template <class In, bool HasRes> __global__ void __launch_bounds__(kThreads) topk_one_block_kernel(TopKArgs a) {
  __shared__ Shared sh;
  pass0_block<In, HasRes>(a, 0, sh);
  __threadfence();
  __syncthreads();
  choose(a, 0, sh);
  for (int level = 1; level < common::kRadixLevels; ++level) {
    if (a.st->done) break;
    filter_block<In, HasRes>(a, 0, sh, true, level);
    __threadfence();
    __syncthreads();
    choose(a, level, sh);
  }
  filter_block<In, HasRes>(a, 0, sh, false, 0);
  __threadfence();
  __syncthreads();
  count_finalize(a, sh);
  write_block<In, HasRes>(a, 0, sh);
  __threadfence();
  __syncthreads();
  write_header(a);
}

//! k == 0 (nothing sent) and k == n (everything sent, index i at position i).
template <class In, bool HasRes> __global__ void __launch_bounds__(kThreads) topk_dense_kernel(TopKArgs a) {
  __shared__ bool s_last;
  const auto* xs = static_cast<const typename In::storage*>(a.x);
  const bool all = a.k == a.n;
  uint32_t nf = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < a.n; i += stride) {
    float xp = In::load(xs[i]);
    if constexpr (HasRes) xp = add_rn(xp, a.r[i]);
    const float y = y_of(a, xp);
    nf |= nonfinite_bit(y);
    if (all) {
      const float d = store_value(a, i, y);
      store_index(a, i, i);
      nf |= nonfinite_bit(d);
      if constexpr (HasRes) a.r[i] = settle(a, xp, d);
    } else if constexpr (HasRes) {
      a.r[i] = xp;
    }
  }
  if (__syncthreads_or(nf) && threadIdx.x == 0) atomicOr(&a.st->flag, 1u);
  if (elect_last_block(&a.st->counter[plan::kCounterDense], &s_last)) write_header(a);
}

int dtype_code(DType t) { return t == DType::float16 ? 1 : t == DType::bfloat16 ? 2 : 0; }

// ---- decode --------------------------------------------------------------------------------------------
template <class O>
__global__ void __launch_bounds__(kThreads) topk_zero_kernel(const uint8_t* __restrict__ packet,
                                                             typename O::storage* __restrict__ out, int64_t n,
                                                             bool vec, HeaderExpect e) {
  if (decode_prologue(packet, e, nullptr).input < 0) return; // corrupt: write nothing (the scatter kernel reports it)
  using OS = typename O::storage;
  const int64_t stride = int64_t(gridDim.x) * kChunk;
  for (int64_t base = int64_t(blockIdx.x) * kChunk + int64_t(threadIdx.x) * kItems; base < n; base += stride) {
    if (vec && base + kItems <= n) {
      const OS z[kItems] = {};
      store8<O>(out + base, z);
    } else {
#pragma unroll 1
      for (int j = 0; j < kItems && base + j < n; ++j) out[base + j] = OS{};
    }
  }
}

template <class O, bool Acc>
__global__ void __launch_bounds__(kThreads) topk_scatter_kernel(const uint8_t* __restrict__ packet,
                                                                typename O::storage* __restrict__ out, int64_t n,
                                                                int64_t k, float alpha, HeaderExpect e,
                                                                uint32_t* status) {
  const DecodeHead& head = decode_prologue(packet, e, status);  // sections 0, 1: indices, values
  if (head.input < 0) return;  // corrupt: write nothing
  const uint8_t* idx = packet + head.offset[0];
  const uint8_t* vals = packet + head.offset[1];
  const DType values_dtype = head.dtype[1];
  const bool index_u64 = head.dtype[0] == DType::uint64;
  auto index_at = [&](int64_t j) -> uint64_t {
    return index_u64 ? reinterpret_cast<const uint64_t*>(idx)[j] : reinterpret_cast<const uint32_t*>(idx)[j];
  };
  uint32_t bad = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  for (int64_t j = first; j < k; j += stride) {
    const uint64_t i = index_at(j);
    // Skip entries out of range, out of order or repeated (an index can reach 0 only at j == 0).
    if (i >= uint64_t(n) || (j > 0 && index_at(j - 1) >= i)) {
      bad = 1;
      continue;
    }
    const float t = mul_rn(load_dyn(vals, values_dtype, j), alpha);
    out[i] = O::store(Acc ? add_rn(O::load(out[i]), t) : t);
  }
  // Global thread 0 handled entry 0, the only one that may write out[0].
  if (first == 0 && head.nonfinite && n > 0) out[0] = O::store(quiet_nan());
  if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(status, kStatusCorrupt);
}

int64_t workspace_bytes(const TopKPlan& p) { return plan::topk_layout(p.numel, p.k).bytes; }

void encode(const TopKPlan& p, const EncodeArgs& args) {
  GRADCOMP_CHECK(p.numel <= plan::topk_max_numel(), Unsupported, "topk encode on CUDA: ", p.numel,
                 " elements; the CUDA top-k handles at most ", plan::topk_max_numel(),
                 " (per-tile offsets are 32-bit)");
  DeviceGuard guard(args.x.device.index);
  const cudaStream_t s = to_cuda(args.stream);
  const plan::TopKLayout L = plan::topk_layout(p.numel, p.k);
  uint8_t* workspace = args.workspace;
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(workspace + L.zero_begin, 0, size_t(L.zero_end - L.zero_begin), s));
  const int sms = sm_count(args.x.device.index);
  TopKArgs a{};
  a.x = args.x.data;
  a.r = args.residual;
  a.n = p.numel;
  a.k = p.k;
  a.div = args.divisor;
  a.div1 = args.divisor == 1.0f;
  a.vec = aligned16(args.x.data) && (args.residual == nullptr || aligned16(args.residual));
  a.G = plan::topk_grid(p.numel, sms);
  a.seg_cap = plan::topk_segment_capacity(p.numel, a.G, p.k);
  a.st = reinterpret_cast<TopKState*>(workspace + L.state);
  a.hist = reinterpret_cast<unsigned long long*>(workspace + L.hist);
  a.seg_count = reinterpret_cast<int64_t*>(workspace + L.seg_count);
  a.above = reinterpret_cast<int64_t*>(workspace + L.above);
  a.cls = reinterpret_cast<int64_t*>(workspace + L.cls);
  a.out_off = reinterpret_cast<int64_t*>(workspace + L.out_off);
  a.take = reinterpret_cast<int64_t*>(workspace + L.take);
  a.cand_key = reinterpret_cast<uint32_t*>(workspace + L.cand_key);
  a.cand_idx = reinterpret_cast<uint32_t*>(workspace + L.cand_idx);
  a.packet = args.packet;
  a.index_offset = p.layout.sections[0].offset;
  a.values_offset = p.values_offset;
  a.index_u64 = p.index_dtype == DType::uint64 ? 1 : 0;
  a.value_dtype = dtype_code(p.value_dtype);
  a.layout = p.layout;
  a.ctx = args.ctx;
  const unsigned G = unsigned(a.G);
  auto run = [&](auto in, auto has_res) {
    using In = decltype(in);
    constexpr bool R = decltype(has_res)::value;
    if (p.k == 0 || p.k == p.numel) {
      const auto blocks =
          unsigned(plan::wave_grid(p.numel, kThreads, wave_blocks(args.x.device.index, topk_dense_kernel<In, R>)));
      topk_dense_kernel<In, R><<<blocks, kThreads, 0, s>>>(a);
      GRADCOMP_CUDA_CHECK_LAUNCH("topk_dense_kernel");
    } else if (G == 1) {
      topk_one_block_kernel<In, R><<<1, kThreads, 0, s>>>(a);
      GRADCOMP_CUDA_CHECK_LAUNCH("topk_one_block_kernel");
    } else {
      topk_pass0_kernel<In, R><<<G, kThreads, 0, s>>>(a);
      GRADCOMP_CUDA_CHECK_LAUNCH("topk_pass0_kernel");
      for (int level = 1; level < common::kRadixLevels; ++level) {
        topk_pass_kernel<In, R><<<G, kThreads, 0, s>>>(a, level);
        GRADCOMP_CUDA_CHECK_LAUNCH("topk_pass_kernel");
      }
      topk_count_kernel<In, R><<<G, kThreads, 0, s>>>(a);
      GRADCOMP_CUDA_CHECK_LAUNCH("topk_count_kernel");
      topk_write_kernel<In, R><<<G, kThreads, 0, s>>>(a);
      GRADCOMP_CUDA_CHECK_LAUNCH("topk_write_kernel");
    }
  };
  common::dispatch_float(p.input, [&](auto in) {
    if (args.residual) run(in, std::true_type{});
    else run(in, std::false_type{});
  }, "topk: input");
}

void decode(const TopKPlan& p, const DecodeArgs& a) {
  DeviceGuard guard(a.out.device.index);
  const cudaStream_t s = to_cuda(a.stream);
  const int dev = a.out.device.index;
  auto* status = reinterpret_cast<uint32_t*>(a.workspace);
  const bool vec = aligned16(a.out.data);
  const HeaderExpect& e = *a.expect;
  // one wave of each kernel (occupancy x SMs), fewer blocks for small inputs
  auto scatter = [&](auto kernel) { return unsigned(plan::wave_grid(p.k, kThreads, wave_blocks(dev, kernel))); };
  common::dispatch_float(a.out.dtype, [&](auto o) {
    using O = decltype(o);
    auto* op = static_cast<typename O::storage*>(a.out.data);
    if (a.mode == DecodeMode::assign) {
      const auto blocks = unsigned(plan::wave_grid(p.numel, kChunk, wave_blocks(dev, topk_zero_kernel<O>)));
      topk_zero_kernel<O><<<blocks, kThreads, 0, s>>>(a.packet, op, p.numel, vec, e);
      GRADCOMP_CUDA_CHECK_LAUNCH("topk_zero_kernel");
      topk_scatter_kernel<O, false><<<scatter(topk_scatter_kernel<O, false>), kThreads, 0, s>>>(a.packet, op, p.numel,
                                                                                                p.k, a.alpha, e, status);
    } else {
      topk_scatter_kernel<O, true><<<scatter(topk_scatter_kernel<O, true>), kThreads, 0, s>>>(a.packet, op, p.numel,
                                                                                              p.k, a.alpha, e, status);
    }
    GRADCOMP_CUDA_CHECK_LAUNCH("topk_scatter_kernel");
  }, "decode: out");
}

} // namespace

const Kernels<TopKPlan> topk = {&workspace_bytes, &encode, &decode};

} // namespace gradcomp::detail::cuda
