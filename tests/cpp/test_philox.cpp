// SPDX-License-Identifier: Apache-2.0
// kernels/common/philox.hpp: Philox4x32-10 and Philox4x64-10 (Salmon et al., SC'11).
//  - Known answers: Random123's kat_vectors for philox4x32 and philox4x64 with 10 rounds (counter
//    and key zero, all ones, and the digits of pi), checked against Random123 1.14's
//    philox4x32_R / philox4x64_R when they were written down here.
//  - Where Random123 is installed (__has_include(<Random123/philox.h>); the library itself does not
//    need it), bitwise against r123::Philox4x32_R<10> / r123::Philox4x64_R<10> over random
//    counters and keys (GRADCOMP_TEST_SEED reproduces a run), with carries through every word.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/philox.hpp"
#include "ref.hpp"

#if __has_include(<Random123/philox.h>)
#include <Random123/philox.h>
#define GRADCOMP_TEST_HAVE_RANDOM123 1
#endif

namespace ph = gradcomp::philox;

namespace {

TEST(Philox, KnownAnswers4x32) {
  EXPECT_EQ(ph::philox4x32_10({0, 0, 0, 0}, {0, 0}), (ph::Ctr4x32{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  const uint32_t ones = ~0u;
  EXPECT_EQ(ph::philox4x32_10({ones, ones, ones, ones}, {ones, ones}),
            (ph::Ctr4x32{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(ph::philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
            (ph::Ctr4x32{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

// The host batch form gives the scalar function's words for every group of a range (counters whose
// low word wraps included) and any count, not a multiple of its 16 lanes too.
TEST(Philox, GroupsBatchMatchesTheScalarCalls) {
  std::mt19937_64 g(ref::test_seed() + 99);
  for (int trial = 0; trial < 40; ++trial) {
    const uint64_t g0 = trial % 3 == 0 ? 0xFFFFFFF0ull + uint64_t(trial) : g() >> (trial % 40);
    const int64_t count = int64_t(g() % 70);
    const uint32_t c2 = uint32_t(g()), c3 = uint32_t(g());
    const gradcomp::philox::Key4x32 key{uint32_t(g()), uint32_t(g())};
    std::vector<uint32_t> out(size_t(4 * count + 4), 0xDEADBEEFu);
    gradcomp::philox::philox4x32_10_groups(g0, count, c2, c3, key, out.data());
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t gi = g0 + uint64_t(i);
      const auto want = gradcomp::philox::philox4x32_10({uint32_t(gi), uint32_t(gi >> 32), c2, c3}, key);
      for (int w = 0; w < 4; ++w) ASSERT_EQ(out[size_t(4 * i + w)], want[size_t(w)]) << "group " << gi << " word " << w;
    }
    for (int w = 0; w < 4; ++w) EXPECT_EQ(out[size_t(4 * count + w)], 0xDEADBEEFu);  // nothing past count
  }
}

TEST(Philox, KnownAnswers4x64) {
  EXPECT_EQ(ph::philox4x64_10({0, 0, 0, 0}, {0, 0}),
            (ph::Ctr4x64{0x16554d9eca36314cull, 0xdb20fe9d672d0fdcull, 0xd7e772cee186176bull, 0x7e68b68aec7ba23bull}));
  const uint64_t ones = ~0ull;
  EXPECT_EQ(ph::philox4x64_10({ones, ones, ones, ones}, {ones, ones}),
            (ph::Ctr4x64{0x87b092c3013fe90bull, 0x438c3c67be8d0224ull, 0x9cc7d7c69cd777b6ull, 0xa09caebf594f0ba0ull}));
  EXPECT_EQ(ph::philox4x64_10({0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull},
                              {0x452821e638d01377ull, 0xbe5466cf34e90c6cull}),
            (ph::Ctr4x64{0xa528f45403e61d95ull, 0x38c72dbd566e9788ull, 0xa5a1610e72fd18b5ull, 0x57bd43b5e52b7fe6ull}));
}

TEST(Philox, MulhiMatchesWideProduct) {
  // the host's mulhi64 (unsigned __int128 here) and the portable fallback, against the wide product
  std::mt19937_64 g(ref::test_seed());
  SCOPED_TRACE("GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()));
  for (int i = 0; i < 4000; ++i) {
    const uint64_t a = i < 2 ? ~0ull : g(), b = i < 1 ? ~0ull : g();
    const uint64_t want = uint64_t(((unsigned __int128)a * b) >> 64);
    ASSERT_EQ(ph::mulhi64(a, b), want) << a << " " << b;
    ASSERT_EQ(ph::mulhi64_portable(a, b), want) << a << " " << b;
    const uint32_t a32 = uint32_t(a), b32 = uint32_t(b);
    ASSERT_EQ(ph::mulhi32(a32, b32), uint32_t((uint64_t(a32) * b32) >> 32)) << a32 << " " << b32;
  }
}

#if defined(GRADCOMP_TEST_HAVE_RANDOM123)
// Counters and keys: random words, and words near 0 and 2^w - 1 (carries in the key bumps).
template <class W>
W draw(std::mt19937_64& g, int i) {
  switch (i % 4) {
    case 0: return W(g());
    case 1: return W(g() % 4);
    case 2: return W(~W(0) - W(g() % 4));
    default: return W(g() >> (g() % 64));
  }
}

TEST(Philox, MatchesRandom123For4x32) {
  std::mt19937_64 g(ref::test_seed());
  SCOPED_TRACE("GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()));
  using G = r123::Philox4x32_R<10>;
  for (int i = 0; i < 5000; ++i) {
    const G::ctr_type c = {{draw<uint32_t>(g, i), draw<uint32_t>(g, i >> 2), draw<uint32_t>(g, i >> 4),
                            draw<uint32_t>(g, i >> 6)}};
    const G::key_type k = {{draw<uint32_t>(g, i >> 1), draw<uint32_t>(g, i >> 3)}};
    const G::ctr_type want = G()(c, k);
    const ph::Ctr4x32 got = ph::philox4x32_10({c.v[0], c.v[1], c.v[2], c.v[3]}, {k.v[0], k.v[1]});
    ASSERT_EQ(got, (ph::Ctr4x32{want.v[0], want.v[1], want.v[2], want.v[3]}))
        << "counter " << c << " key " << k;
  }
}

TEST(Philox, MatchesRandom123For4x64) {
  std::mt19937_64 g(ref::test_seed() ^ 0x5bd1e995u);
  SCOPED_TRACE("GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()));
  using G = r123::Philox4x64_R<10>;
  for (int i = 0; i < 5000; ++i) {
    const G::ctr_type c = {{draw<uint64_t>(g, i), draw<uint64_t>(g, i >> 2), draw<uint64_t>(g, i >> 4),
                            draw<uint64_t>(g, i >> 6)}};
    const G::key_type k = {{draw<uint64_t>(g, i >> 1), draw<uint64_t>(g, i >> 3)}};
    const G::ctr_type want = G()(c, k);
    const ph::Ctr4x64 got = ph::philox4x64_10({c.v[0], c.v[1], c.v[2], c.v[3]}, {k.v[0], k.v[1]});
    ASSERT_EQ(got, (ph::Ctr4x64{want.v[0], want.v[1], want.v[2], want.v[3]}))
        << "counter " << c << " key " << k;
  }
}
#else
TEST(Philox, MatchesRandom123) { GTEST_SKIP() << "Random123 headers not installed: known answers only"; }
#endif

} // namespace
