// SPDX-License-Identifier: Apache-2.0
// Host-side checks of the CUDA backend's launch configuration, pass planning and workspace layout
// (kernels/cuda/plan.hpp includes no CUDA header, so these run on any machine).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "common/math.hpp"
#include "cuda/plan.hpp"

namespace P = gradcomp::detail::cuda::plan;
namespace C = gradcomp::common;

namespace {

const int64_t kSizes[] = {0, 1, 7, 8, 9, 2047, 2048, 2049, P::kOneBlockMax, P::kOneBlockMax + 1, 1 << 20,
                          (1 << 20) + 1, 3000017, int64_t(1) << 28, (int64_t(1) << 31) + 64,
                          (int64_t(1) << 32) + 5, int64_t(1) << 40};
const int kSms[] = {1, 2, 108, 132, 1000};

TEST(CudaPlan, ElementwiseBlocks) {
  for (int64_t n : kSizes)
    for (int sm : kSms) {
      const int64_t b = P::elementwise_blocks(n, sm);
      EXPECT_GE(b, 1);
      EXPECT_LE(b, std::max<int64_t>(1, int64_t(sm) * P::kBlocksPerSM * 2));
      EXPECT_LE(b, std::max<int64_t>(1, P::ceil_div(n, P::kChunk))); // no idle blocks
      EXPECT_LT(b, int64_t(1) << 31);                                 // gridDim.x
    }
  EXPECT_EQ(P::elementwise_blocks(0, 132), 1); // a header-only launch still runs
  EXPECT_EQ(P::elementwise_blocks(1 << 30, 0), P::kBlocksPerSM * 2);
}

TEST(CudaPlan, TopKGrid) {
  for (int64_t n : kSizes)
    for (int sm : kSms) {
      const int64_t G = P::topk_grid(n, sm);
      SCOPED_TRACE(testing::Message() << "n=" << n << " sm=" << sm << " G=" << G);
      EXPECT_GE(G, 1);
      EXPECT_LE(G, P::kMaxGrid);
      if (n <= P::kOneBlockMax) EXPECT_EQ(G, 1);
      // every tile holds at least one element and fewer than 2^31 (u32 candidate offsets)
      for (int64_t g : {int64_t(0), G / 2, G - 1}) {
        const auto r = P::tile_range(n, G, g);
        if (n > 0) EXPECT_GT(r.end, r.begin);
        EXPECT_LT(r.end - r.begin, P::kMaxTile);
      }
    }
  // One wave on an H200, fewer blocks for smaller inputs.
  EXPECT_EQ(P::topk_grid(int64_t(1) << 28, 132), 132 * P::kBlocksPerSM);
  EXPECT_EQ(P::topk_grid(P::kOneBlockMax + 1, 132), P::ceil_div(P::kOneBlockMax + 1, P::kMinElemsPerBlock));
  EXPECT_GE(P::topk_grid(int64_t(1) << 40, 1), (int64_t(1) << 40) / P::kMaxTile);
}

TEST(CudaPlan, TileRangesPartitionInOrder) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(8), int64_t(9), int64_t(100), int64_t(65537),
                    int64_t(1000003)})
    for (int64_t G : {int64_t(1), int64_t(2), int64_t(3), int64_t(7), int64_t(64), int64_t(528)}) {
      SCOPED_TRACE(testing::Message() << "n=" << n << " G=" << G);
      int64_t expect_begin = 0, lo = INT64_MAX, hi = 0;
      for (int64_t g = 0; g < G; ++g) {
        const auto r = P::tile_range(n, G, g);
        EXPECT_EQ(r.begin, expect_begin); // contiguous, in index order
        EXPECT_LE(r.begin, r.end);
        if (r.begin != n) EXPECT_EQ(r.begin % P::kItems, 0); // 16-byte vector loads stay aligned
        if (r.end != n) EXPECT_EQ(r.end % P::kItems, 0);
        lo = std::min(lo, r.end - r.begin);
        hi = std::max(hi, r.end - r.begin);
        expect_begin = r.end;
      }
      EXPECT_EQ(expect_begin, n); // covers [0, n)
      if (G * P::kItems <= n) EXPECT_LE(hi - lo, 2 * P::kItems); // balanced
    }
}

TEST(CudaPlan, CandidateSegments) {
  for (int64_t n : kSizes)
    for (int sm : kSms)
      for (int64_t k : {int64_t(0), int64_t(1), n / 100, n / 10, n / 2, n}) {
        const int64_t G = P::topk_grid(n, sm);
        const int64_t cap = P::topk_candidate_capacity(n, k), seg = P::topk_segment_capacity(n, G, k);
        EXPECT_LE(cap, n);
        EXPECT_GE(cap, std::min(n, n / 16 + 4096)); // never below the k-independent floor
        EXPECT_GE(seg, 0);
        EXPECT_EQ(seg % P::kItems, 0);
        EXPECT_LE(seg * G, cap); // segments never overlap past the buffer
      }
  EXPECT_EQ(P::topk_candidate_capacity(1000, 10), 1000);
  const int64_t n28 = int64_t(1) << 28;
  EXPECT_EQ(P::topk_candidate_capacity(n28, 0), (int64_t(1) << 24) + 4096);
  EXPECT_EQ(P::topk_candidate_capacity(n28, n28 / 100), (int64_t(1) << 24) + 4096); // 2k below n/16
  // ratio 0.1 (the experiment's largest): 2k = 0.2 n, so Gaussian data's ~0.14 n after pass 0 fit
  const int64_t k10 = (n28 + 9) / 10;
  EXPECT_EQ(P::topk_candidate_capacity(n28, k10), 2 * k10 + 4096);
  EXPECT_TRUE(P::topk_fill_ok(n28, k10 / 2, int64_t(0.14 * double(n28)) - k10 / 2, k10));
  EXPECT_FALSE(P::topk_fill_ok(n28, k10 / 2, int64_t(0.14 * double(n28)) - k10 / 2, 0)); // the old capacity
  EXPECT_EQ(P::topk_candidate_capacity(n28, n28 / 2), n28 / 4 + 4096);                   // the n/4 cap
  EXPECT_TRUE(P::topk_fill_ok(1 << 20, 100, (1 << 16), 100));
  EXPECT_FALSE(P::topk_fill_ok(1 << 20, 100, (1 << 20) - 100, 100));
}

TEST(CudaPlan, WorkspaceLayout) {
  for (int64_t n : kSizes)
    for (int64_t k : {int64_t(0), n / 10}) {
    const auto l = P::topk_layout(n, k);
    SCOPED_TRACE(testing::Message() << "n=" << n << " k=" << k);
    const std::vector<int64_t> starts = {l.state, l.hist, l.seg_count, l.above, l.cls, l.out_off, l.take, l.cand_key,
                                         l.cand_idx, l.bytes};
    EXPECT_GE(l.state, P::kStatusBytes); // the status word's 16 bytes stay the caller's
    for (size_t i = 0; i + 1 < starts.size(); ++i) {
      EXPECT_EQ(starts[i] % 256, 0) << "section " << i;
      EXPECT_LE(starts[i], starts[i + 1]) << "section " << i;
    }
    EXPECT_GE(l.hist - l.state, int64_t(sizeof(P::TopKState)));
    EXPECT_GE(l.seg_count - l.hist, int64_t(C::kRadixLevels) * C::kRadixBuckets * 8);
    EXPECT_GE(l.above - l.seg_count, P::kMaxGrid * 8);
    EXPECT_GE(l.cand_key - l.take, P::kMaxGrid * 8);
    EXPECT_GE(l.cand_idx - l.cand_key, l.capacity * 4);
    EXPECT_GE(l.bytes - l.cand_idx, l.capacity * 4);
    // the async memset clears the state and the histograms, nothing of the status word
    EXPECT_EQ(l.zero_begin, l.state);
    EXPECT_EQ(l.zero_end, l.seg_count);
    EXPECT_EQ(l.capacity, P::topk_candidate_capacity(n, k));
    }
  // The cast codecs' encode uses the status slot's spare words: flag and counter after the status.
  EXPECT_GE(P::kCastFlagOffset, 4);
  EXPECT_LE(P::kCastCounterOffset + 4, P::kStatusBytes);
  EXPECT_EQ(P::kStatusBytes, 16);
}

TEST(CudaPlan, ClassRangesMatchTheRadixDigits) {
  // Walking the three digits of a key down the levels gives classes that contain it and shrink to it.
  for (uint32_t key : {0u, 1u, 0x3F800000u, 0x7F7FFFFFu, C::kInfKey, C::kNaNKey, 0x00000800u, 0x7FFFFFFFu}) {
    uint32_t prefix = 0;
    for (int level = 0; level < C::kRadixLevels; ++level) {
      const uint32_t digit = (key >> P::radix_shift(level)) & ((1u << P::radix_bits(level)) - 1u);
      prefix = level == 0 ? digit : (prefix << P::radix_bits(level)) | digit;
      const uint32_t lo = P::class_lo(prefix, level), hi = P::class_hi(prefix, level);
      EXPECT_LE(lo, key);
      EXPECT_GE(hi, key);
      EXPECT_EQ(uint64_t(hi) - lo + 1, uint64_t(1) << P::radix_shift(level));
    }
    EXPECT_EQ(P::class_lo(prefix, 2), key);
    EXPECT_EQ(P::class_hi(prefix, 2), key);
  }
  EXPECT_EQ(P::radix_shift(0), 20);
  EXPECT_EQ(P::radix_bits(0) + P::radix_bits(1) + P::radix_bits(2), 31);
}

TEST(CudaPlan, TieQuotasGoToTheLowestTiles) {
  // Four tiles with 3, 0, 5, 2 class elements; 6 still needed: 3 + 0 + 3 + 0.
  const int64_t cls[] = {3, 0, 5, 2};
  const int64_t want[] = {3, 0, 3, 0};
  int64_t before = 0, total = 0;
  for (int g = 0; g < 4; ++g) {
    EXPECT_EQ(P::tile_take(6, before, cls[g]), want[g]) << "tile " << g;
    total += P::tile_take(6, before, cls[g]);
    before += cls[g];
  }
  EXPECT_EQ(total, 6);
  EXPECT_EQ(P::tile_take(10, 0, 10), 10); // the class exactly fills k_rem (early stop)
  EXPECT_EQ(P::tile_take(1, 5, 100), 0);
}

TEST(CudaPlan, ScatterBlocks) {
  EXPECT_EQ(P::scatter_blocks(0, 132), 1); // reports the non-finite flag even with k = 0
  EXPECT_EQ(P::scatter_blocks(1, 132), 1);
  EXPECT_EQ(P::scatter_blocks(257, 132), 2);
  EXPECT_EQ(P::scatter_blocks(int64_t(1) << 40, 132), 132 * P::kBlocksPerSM * 2);
}

} // namespace

// The multi-block top-k keeps every tile below 2^31 elements (u32 in-tile offsets) up to
// topk_max_numel(); the core accepts up to 2^56 elements, so above that the CUDA backend refuses.
TEST(CudaPlan, TopKLargestInputKeepsTilesBelow2To31) {
  const int64_t m = P::topk_max_numel();
  EXPECT_GT(m, int64_t(1) << 42);
  EXPECT_LT(m, int64_t(1) << 44);
  for (int64_t n : {m - 1, m}) {
    for (int sm : kSms) {
      const int64_t G = P::topk_grid(n, sm);
      for (int64_t g : {int64_t(0), G / 2, G - 1}) {
        const auto r = P::tile_range(n, G, g);
        EXPECT_LT(r.end - r.begin, P::kMaxTile) << "n=" << n << " sm=" << sm;
      }
    }
  }
  // one more element would need a tile of 2^31 elements or more with the grid capped
  const int64_t G = P::topk_grid(m + P::kItems * P::kMaxGrid, 1);
  EXPECT_EQ(G, P::kMaxGrid);
  EXPECT_GE(P::tile_range(m + P::kItems * P::kMaxGrid, G, 0).end, P::kMaxTile);
}

#if defined(GRADCOMP_WITH_CUDA)
#include "gradcomp/gradcomp.hpp"
// The refusal happens on the host before any CUDA call, so it is checked here without a GPU: the
// tensors are fake device views (never dereferenced).
TEST(CudaPlan, TopKEncodeAboveTheLimitRaisesUnsupported) {
  using gradcomp::DType;
  const gradcomp::Device gpu{gradcomp::DeviceKind::cuda, 0};
  auto c = gradcomp::Codec::create("topk:k=10");
  const int64_t n = P::topk_max_numel() + 1;
  const int64_t pb = c->packet_bytes(n, DType::bfloat16), wb = c->workspace_bytes(n, DType::bfloat16, gpu);
  auto at = [](int64_t a) { return reinterpret_cast<void*>(static_cast<uintptr_t>(a)); };
  const gradcomp::Tensor x{at(int64_t(1) << 40), DType::bfloat16, n, gpu};
  const gradcomp::Tensor p{at(int64_t(1) << 46), DType::uint8, pb, gpu};
  const gradcomp::Tensor w{at(int64_t(1) << 47), DType::uint8, wb, gpu};
  try {
    c->encode(x, nullptr, p, w);
    ADD_FAILURE() << "no exception";
  } catch (const gradcomp::Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(P::topk_max_numel())), std::string::npos) << e.what();
  }
}
#endif
