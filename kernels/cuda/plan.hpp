// SPDX-License-Identifier: Apache-2.0
// Launch configuration, pass planning and workspace layout of the CUDA backend.
//
// This header includes no CUDA or CCCL header: g++ compiles it, and tests/cpp/test_cuda_plan.cpp
// checks it on the CPU. The functions are constexpr and, under nvcc, __host__ __device__, so the
// kernels use exactly the numbers the host planned (the same tile boundaries, the same segment
// capacities).
#pragma once

#include <cstdint>

#include "../common/math.hpp"

#if defined(__CUDACC__)
#define GRADCOMP_PLAN_HD __host__ __device__
#else
#define GRADCOMP_PLAN_HD
#endif

namespace gradcomp::detail::cuda::plan {

// ---- shared constants ---------------------------------------------------------------------------
inline constexpr int kThreads = 256;                 //!< threads per block (every kernel here)
inline constexpr int kItems = 8;                     //!< consecutive elements per thread per step
inline constexpr int64_t kChunk = int64_t(kThreads) * kItems; //!< elements per block step (2048)
inline constexpr int kBlocksPerSM = 4;               //!< resident 256-thread blocks per SM the top-k passes plan for (64 regs)
inline constexpr int64_t kStatusBytes = 16;          //!< the status word's slot at the workspace start

GRADCOMP_PLAN_HD constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
GRADCOMP_PLAN_HD constexpr int64_t align_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
GRADCOMP_PLAN_HD constexpr int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
GRADCOMP_PLAN_HD constexpr int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// ---- grid-stride kernels (casts, block quantizers, onebit, decode, zero fill) ---------------------
//! Blocks of a grid-stride kernel over n items, `per_block` items per block and step: enough to
//! cover n in one step, at most `wave` (the kernel's resident blocks per SM times the SMs, from the
//! occupancy query: cuda::wave_blocks), at least one block (so that a kernel over 0 elements still
//! runs and can write a header or a status bit). Every kernel launched this way gives the same
//! bytes for any grid size (element-wise work, order-free max / OR, fixed per-unit trees). At most
//! kMaxWaveBlocks blocks, so that a thread's first element and the grid's elements per step stay
//! below 2^32 (cuda::BlockCursor's 32-bit divisions; a wave is far smaller).
inline constexpr int64_t kMaxWaveBlocks = int64_t(1) << 20; //!< wave_grid's cap: grid * kChunk <= 2^31
GRADCOMP_PLAN_HD constexpr int64_t wave_grid(int64_t n, int64_t per_block, int64_t wave) {
  return max64(1, min64(ceil_div(n, per_block), min64(kMaxWaveBlocks, max64(1, wave))));
}
//! wave_grid over n elements at kChunk per block with a wave of kBlocksPerSM blocks per SM taken
//! `waves` times: the plan where no occupancy figure is at hand (tests/cpp/test_cuda_plan.cpp).
GRADCOMP_PLAN_HD constexpr int64_t elementwise_blocks(int64_t n, int sm_count, int waves = 2) {
  return wave_grid(n, kChunk, int64_t(sm_count > 0 ? sm_count : 1) * kBlocksPerSM * waves);
}

// ---- cast workspace: status word, then the encode's non-finite flag and last-block counter -------
inline constexpr int64_t kCastFlagOffset = 4;    //!< u32: OR of the blocks' non-finite bits
inline constexpr int64_t kCastCounterOffset = 8; //!< u32: blocks done (last-block election)

// ---- top-k ---------------------------------------------------------------------------------------
inline constexpr int64_t kOneBlockMax = int64_t(1) << 15; //!< n up to this: one-block kernel
inline constexpr int64_t kMaxGrid = 4096;                 //!< per-block arrays are sized for this
inline constexpr int64_t kMinElemsPerBlock = 4 * kChunk;  //!< multi-block: at least 4 steps per block
inline constexpr int64_t kMaxTile = int64_t(1) << 31;     //!< tile lengths stay below 2^31 (u32 offsets)

//! Blocks of the multi-block top-k kernels for n elements: one wave of the device (the last-block
//! election wants every block resident), at most kMaxGrid, at least ceil(n / 2^31) so that
//! in-tile offsets fit 32 bits; 1 for the one-block path.
GRADCOMP_PLAN_HD constexpr int64_t topk_grid(int64_t n, int sm_count) {
  if (n <= kOneBlockMax) return 1;
  const int64_t wave = max64(1, int64_t(sm_count > 0 ? sm_count : 1) * kBlocksPerSM);
  int64_t g = min64(ceil_div(n, kMinElemsPerBlock), wave);
  g = max64(g, ceil_div(ceil_div(n, kItems), kMaxTile / kItems - 1)); // tiles < 2^31 elements
  return max64(1, min64(g, kMaxGrid));
}

//! The largest n the multi-block top-k serves: kMaxGrid tiles of fewer than 2^31 elements each
//! (about 2^43; the core accepts up to 2^56 elements, so the host refuses larger inputs with
//! Unsupported rather than letting the in-tile u32 offsets wrap).
GRADCOMP_PLAN_HD constexpr int64_t topk_max_numel() { return kMaxGrid * (kMaxTile / kItems - 1) * kItems; }

//! Tile [begin, end) of block g out of G: contiguous, in index order, boundaries at multiples of
//! kItems (so 16-byte vector loads stay aligned) except the final end = n.
struct Range {
  int64_t begin;
  int64_t end;
};
GRADCOMP_PLAN_HD constexpr Range tile_range(int64_t n, int64_t G, int64_t g) {
  const int64_t groups = ceil_div(n, kItems);
  const int64_t q = groups / G, rem = groups % G;
  const int64_t gb = g * q + min64(g, rem);
  const int64_t ge = gb + q + (g < rem ? 1 : 0);
  return Range{min64(n, gb * kItems), min64(n, ge * kItems)};
}

//! Candidate buffer entries in total for k of n (AIR's adaptive buffer: candidates are buffered
//! only while they fit): max(n/16, min(2k, n/4)) + 4096, at most n. The elements at or above the
//! class after pass 0 are k plus part of one 11-bit bucket (1/8 of a binade of |y|), so 2k keeps
//! ratios up to about 0.1 on the buffered path for smooth data (Gaussian at ratio 0.1: about
//! 0.14 n); a larger class re-reads the tiles. The n/4 cap bounds the buffer (8 bytes an entry) at
//! 2n bytes, where it still costs less than a re-read of x'. The encoder, its workspace size and
//! the device's fill decision all pass the plan's k (no default: k = 0 gives the k-independent
//! floor min(n, n/16 + 4096)).
GRADCOMP_PLAN_HD constexpr int64_t topk_candidate_capacity(int64_t n, int64_t k) {
  return min64(n, max64(n / 16, min64(2 * k, n / 4)) + 4096);
}
//! Entries of block g's segment of the candidate buffer (block g buffers only its own tile, in
//! index order, at g * segment_capacity); a multiple of kItems.
GRADCOMP_PLAN_HD constexpr int64_t topk_segment_capacity(int64_t n, int64_t G, int64_t k) {
  return topk_candidate_capacity(n, k) / G / kItems * kItems;
}
//! Whether the next pass should buffer candidates: the elements at or above the class (the sure
//! ones plus the class) fit the buffer.
GRADCOMP_PLAN_HD constexpr bool topk_fill_ok(int64_t n, int64_t above, int64_t cls, int64_t k) {
  return above + cls <= topk_candidate_capacity(n, k);
}

//! Class elements tile g sends: ties at the threshold go to the lowest indices, so the tiles in
//! index order take what is left of k_rem, `before` being the class elements of earlier tiles.
GRADCOMP_PLAN_HD constexpr int64_t tile_take(int64_t k_rem, int64_t before, int64_t cls_g) {
  return k_rem - before <= 0 ? 0 : (k_rem - before >= cls_g ? cls_g : k_rem - before);
}

//! Selection state kept in the workspace (written by the last block of each pass).
struct TopKState {
  uint32_t counter[8]; //!< last-block election counters, one per kernel
  uint32_t flag;       //!< non-finite seen (header bit 0)
  int32_t level;       //!< radix level of the current class (0..2)
  int32_t done;        //!< 1: the class is final (fully resolved, or it exactly fills k_rem)
  int32_t fill_ok;     //!< 1: the next pass may buffer candidates
  uint32_t prefix;     //!< digits fixed so far
  uint32_t lo, hi;     //!< key range of the current class
  uint32_t pad;
  int64_t k_rem;       //!< still to take from the class
  int64_t cls;         //!< elements in the class
};
static_assert(sizeof(TopKState) == 80, "TopKState layout");

inline constexpr int kCounterPass0 = 0, kCounterPass1 = 1, kCounterPass2 = 2, kCounterCount = 3,
                     kCounterWrite = 4, kCounterDense = 5;

//! Shift and width of the radix digit at `level` (common::kRadixShift / kRadixBits; written as
//! selects so that device code never indexes a host array).
inline constexpr int kShift0 = common::kRadixShift[0], kShift1 = common::kRadixShift[1],
                     kShift2 = common::kRadixShift[2];
inline constexpr int kBits0 = common::kRadixBits[0], kBits1 = common::kRadixBits[1], kBits2 = common::kRadixBits[2];
static_assert(common::kRadixLevels == 3, "three radix levels");
GRADCOMP_PLAN_HD constexpr int radix_shift(int level) { return level == 0 ? kShift0 : level == 1 ? kShift1 : kShift2; }
GRADCOMP_PLAN_HD constexpr int radix_bits(int level) { return level == 0 ? kBits0 : level == 1 ? kBits1 : kBits2; }
//! Key range [lo, hi] of the class with `prefix` at `level` (the CPU backend's Selection).
GRADCOMP_PLAN_HD constexpr uint32_t class_lo(uint32_t prefix, int level) { return prefix << radix_shift(level); }
GRADCOMP_PLAN_HD constexpr uint32_t class_hi(uint32_t prefix, int level) {
  return radix_shift(level) == 0 ? prefix : (((prefix + 1u) << radix_shift(level)) - 1u);
}

//! Byte layout of the top-k workspace. Every section starts 256-byte aligned.
struct TopKLayout {
  int64_t state;      //!< TopKState
  int64_t hist;       //!< u64 [kRadixLevels][kRadixBuckets] global histograms
  int64_t seg_count;  //!< i64 [kMaxGrid] entries in block g's segment, -1: not buffered
  int64_t above;      //!< i64 [kMaxGrid] keys above the final class in tile g
  int64_t cls;        //!< i64 [kMaxGrid] keys in the final class in tile g
  int64_t out_off;    //!< i64 [kMaxGrid] where tile g's selection starts in the packet
  int64_t take;       //!< i64 [kMaxGrid] class elements tile g sends (ties: lowest index first)
  int64_t cand_key;   //!< u32 [capacity] candidate keys
  int64_t cand_idx;   //!< u32 [capacity] candidate offsets inside their tile
  int64_t zero_begin; //!< [zero_begin, zero_end) is cleared (async memset) before each encode
  int64_t zero_end;
  int64_t capacity;   //!< candidate entries
  int64_t bytes;      //!< total workspace bytes
};
//! The layout for k of n elements (the candidate buffer grows with k: topk_candidate_capacity).
GRADCOMP_PLAN_HD constexpr TopKLayout topk_layout(int64_t n, int64_t k) {
  TopKLayout l{};
  int64_t o = 256;
  l.state = o;
  o += align_up(int64_t(sizeof(TopKState)), 256);
  l.hist = o;
  o += int64_t(common::kRadixLevels) * common::kRadixBuckets * 8;
  l.seg_count = o;
  o += kMaxGrid * 8;
  l.above = o;
  o += kMaxGrid * 8;
  l.cls = o;
  o += kMaxGrid * 8;
  l.out_off = o;
  o += kMaxGrid * 8;
  l.take = o;
  o += kMaxGrid * 8;
  l.capacity = topk_candidate_capacity(n, k);
  l.cand_key = o;
  o += align_up(l.capacity * 4, 256);
  l.cand_idx = o;
  o += align_up(l.capacity * 4, 256);
  l.zero_begin = l.state;
  l.zero_end = l.seg_count;
  l.bytes = o;
  return l;
}

//! Blocks of the top-k decode scatter over k entries (grid-stride, one entry per thread per step)
//! without an occupancy figure (the kernel takes wave_grid(k, kThreads, its wave)); at least one:
//! global thread 0 owns entry 0 and also reports the non-finite flag and writes out[0].
GRADCOMP_PLAN_HD constexpr int64_t scatter_blocks(int64_t k, int sm_count) {
  return wave_grid(k, kThreads, int64_t(sm_count > 0 ? sm_count : 1) * kBlocksPerSM * 2);
}

} // namespace gradcomp::detail::cuda::plan
