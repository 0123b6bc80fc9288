// SPDX-License-Identifier: Apache-2.0
// bf16:rounding=stochastic (docs/contracts.md section 3), the first keyed codec, on the CPU backend:
// packets and residuals bitwise equal to the independent plain-loop reference sround_ref.hpp (its
// own Philox4x32-10, checked against Random123's known answers here, and the rounding rule by
// value) for every input dtype, with and without a residual, at divisor 1 and 3, over sizes around
// the 8-element Philox groups and the threaded sizes; the same key gives the same bytes at 1, 2 and
// 3 threads, another seed / step / bucket / chunk other bytes; NaN and inf pass as in the nearest
// mode; the top of the finite range (|y| above the largest finite bfloat16 becomes inf with
// probability (low 16 bits) / 65536, the packet then flagged); the rounding probability (a binomial
// count within 5 sigma); the spec, the properties and the layout (payload, then the 32-byte key).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"
#include "sround_ref.hpp"

using gradcomp::Codec;
using gradcomp::DType;
using gradcomp::EncodeContext;
using gradcomp::Tensor;

namespace {

const char* kSpec = "bf16:rounding=stochastic";

struct KeyedRun {
  std::vector<uint8_t> packet;
  std::vector<float> residual;
};

//! Encode through the public API with a key; the packet buffer filled with 0xCD first.
KeyedRun encode_keyed(const Codec& c, const ref::Input& x, const std::vector<float>* r, float divisor,
                      const EncodeContext& ctx) {
  const int64_t pb = c.packet_bytes(x.n(), x.dt);
  ref::Bytes packet(pb), ws(c.workspace_bytes(x.n(), x.dt, {}));
  std::memset(packet.data(), 0xCD, size_t(pb));
  KeyedRun out;
  Tensor rt;
  if (r) {
    out.residual = *r;
    rt = ref::f32_tensor(out.residual);
  }
  c.encode(x.tensor(), r ? &rt : nullptr, packet.tensor(), ws.tensor(), divisor, ctx);
  out.packet.assign(packet.data(), packet.data() + pb);
  return out;
}

//! The reference packet payload and residual (plain loop over sround_ref.hpp).
struct RefRun {
  std::vector<uint16_t> codes;
  std::vector<float> residual;
  bool nonfinite = false;
};
RefRun reference(const ref::Input& x, const std::vector<float>* r, float divisor, const EncodeContext& ctx) {
  const sref::Stream st(ctx.seed, ctx.step, ctx.bucket, ctx.chunk);
  RefRun o;
  for (int64_t i = 0; i < x.n(); ++i) {
    const float xp = r ? x.at(i) + (*r)[size_t(i)] : x.at(i);  // fl(x + r): -ffp-contract=off
    const float y = divisor == 1.0f ? xp : xp / divisor;
    const uint16_t c = sref::round_sr(y, st.uniform(uint64_t(i)));
    o.codes.push_back(c);
    o.nonfinite = o.nonfinite || (c & 0x7F80) == 0x7F80;
    if (r) {
      const float d = ref::from_bits(uint32_t(c) << 16);
      o.residual.push_back(divisor == 1.0f ? xp - d : xp - divisor * d);
    }
  }
  return o;
}

uint16_t code_at(const std::vector<uint8_t>& p, int64_t i) {
  uint16_t v;
  std::memcpy(&v, p.data() + 32 + 2 * i, 2);
  return v;
}

//! Compare an encode with the reference: codes, residual, flag, padding and key section.
void check_against_reference(const Codec& c, const ref::Input& x, const std::vector<float>* r, float divisor,
                             const EncodeContext& ctx, const std::string& what) {
  SCOPED_TRACE(what);
  const KeyedRun got = encode_keyed(c, x, r, divisor, ctx);
  const RefRun want = reference(x, r, divisor, ctx);
  const int64_t n = x.n();
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 8; ++i) {
    if (code_at(got.packet, i) != want.codes[size_t(i)]) {
      ++bad;
      ADD_FAILURE() << "element " << i << " y from x=" << x.at(i) << ": code 0x" << std::hex << code_at(got.packet, i)
                    << " want 0x" << want.codes[size_t(i)] << std::dec;
    }
    if (r && !ref::same_f32(got.residual[size_t(i)], want.residual[size_t(i)])) {
      ++bad;
      ADD_FAILURE() << "element " << i << ": residual " << got.residual[size_t(i)] << " want "
                    << want.residual[size_t(i)];
    }
  }
  const auto h = ref::header_of(got.packet.data());
  EXPECT_EQ(h.flags, want.nonfinite ? 1 : 0);
  EXPECT_EQ(h.wire_dtype, uint8_t(DType::bfloat16));
  // payload at 32, zero padding, the key section at the next 16-byte boundary, the packet's end
  const int64_t key_at = ref::align16(32 + 2 * n);
  ASSERT_EQ(int64_t(got.packet.size()), key_at + 32);
  for (int64_t b = 32 + 2 * n; b < key_at; ++b) ASSERT_EQ(got.packet[size_t(b)], 0) << "padding byte " << b;
  uint8_t key[32] = {};
  for (int i = 0; i < 8; ++i) key[i] = uint8_t(ctx.seed >> (8 * i));
  for (int i = 0; i < 4; ++i) {
    key[8 + i] = uint8_t(ctx.step >> (8 * i));
    key[12 + i] = uint8_t(ctx.bucket >> (8 * i));
    key[16 + i] = uint8_t(ctx.chunk >> (8 * i));
  }
  EXPECT_EQ(std::memcmp(got.packet.data() + key_at, key, 32), 0) << "key section";
}

std::vector<float> normal_values(int64_t n, std::mt19937_64& g, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& f : v) f = nd(g);
  return v;
}

} // namespace

// The reference's Philox4x32-10 against Random123's kat_vectors (philox4x32, 10 rounds), so that a
// wrong reference cannot agree with a wrong library.
TEST(StochasticRounding, ReferencePhiloxKnownAnswers) {
  auto eq = [](sref::U4 a, std::initializer_list<uint32_t> b) { return std::equal(b.begin(), b.end(), a.v); };
  EXPECT_TRUE(eq(sref::philox4x32_10({{0, 0, 0, 0}}, 0, 0), {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  const uint32_t ones = ~0u;
  EXPECT_TRUE(eq(sref::philox4x32_10({{ones, ones, ones, ones}}, ones, ones),
                 {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_TRUE(eq(sref::philox4x32_10({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u),
                 {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
  // the rounding reference on hand-checked values
  EXPECT_EQ(sref::round_sr(1.0f, 0xFFFF), 0x3F80);  // a bfloat16 value never moves
  EXPECT_EQ(sref::round_sr(ref::from_bits(0x3F808000u), 0x7FFF), 0x3F80);
  EXPECT_EQ(sref::round_sr(ref::from_bits(0x3F808000u), 0x8000), 0x3F81);
  EXPECT_EQ(sref::round_sr(ref::from_bits(0xBF80FFFFu), 0x0000), 0xBF80);
  EXPECT_EQ(sref::round_sr(ref::from_bits(0xBF80FFFFu), 0x0001), 0xBF81);
  EXPECT_EQ(sref::round_sr(ref::from_bits(0x3F7FFFFFu), 0x0001), 0x3F80);  // up into the next binade
  EXPECT_EQ(sref::round_sr(ref::from_bits(0x00000001u), 0xFFFF), 0x0001);  // subnormal
  EXPECT_EQ(sref::round_sr(ref::from_bits(0x007FFFFFu), 0x0001), 0x0080);  // to the smallest normal
  EXPECT_EQ(sref::round_sr(std::numeric_limits<float>::max(), 0x0000), 0x7F7F);
  EXPECT_EQ(sref::round_sr(std::numeric_limits<float>::max(), 0x0001), 0x7F80);
  EXPECT_EQ(sref::round_sr(-0.0f, 0xFFFF), 0x8000);
}

TEST(StochasticRounding, SpecPropertiesAndLayout) {
  auto c = Codec::create(kSpec);
  EXPECT_EQ(c->spec(), kSpec);
  EXPECT_EQ(c->id(), gradcomp::CodecId::bf16);
  EXPECT_EQ(Codec::create("bf16:rounding=nearest")->spec(), "bf16");
  EXPECT_EQ(Codec::create("bf16:rounding=stochastic")->spec_hash(), gradcomp::fnv1a32(kSpec));
  const auto p = c->properties();
  EXPECT_TRUE(p.keyed);
  EXPECT_TRUE(p.unbiased);
  EXPECT_TRUE(p.deterministic);
  EXPECT_TRUE(p.exact_residual);
  EXPECT_TRUE(p.linear);
  EXPECT_FALSE(p.sparse);
  const auto q = Codec::create("bf16")->properties();
  EXPECT_FALSE(q.keyed);
  EXPECT_FALSE(q.unbiased);
  for (const char* bad : {"bf16:rounding=up", "bf16:rounding=", "bf16:rounding=Stochastic"}) {
    try {
      Codec::create(bad);
      ADD_FAILURE() << bad << ": no exception";
    } catch (const gradcomp::InvalidArgument& e) {
      if (std::string(bad) != "bf16:rounding=")
        EXPECT_NE(std::string(e.what()).find("accepted: nearest (default), stochastic"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(Codec::create("fp16:rounding=stochastic"), gradcomp::InvalidArgument);
  EXPECT_THROW(Codec::create("none:rounding=stochastic"), gradcomp::InvalidArgument);
  for (DType dt : {DType::float32, DType::float16, DType::bfloat16}) {
    for (int64_t n : {0, 1, 7, 8, 9, 1000}) {
      const auto l = c->layout(n, dt);
      ASSERT_EQ(l.nsections, 2);
      EXPECT_EQ(l.payload_section, 0);
      EXPECT_EQ(l.key_section, 1);
      EXPECT_EQ(l.sections[0].offset, 32);
      EXPECT_EQ(l.sections[0].count, n);
      EXPECT_EQ(l.sections[0].dtype, DType::bfloat16);
      EXPECT_EQ(l.sections[1].offset, ref::align16(32 + 2 * n));
      EXPECT_EQ(l.sections[1].count, 32);
      EXPECT_EQ(l.bytes, ref::align16(32 + 2 * n) + 32);
      auto pv = c->payload(n, dt);
      ASSERT_TRUE(pv.has_value());
      EXPECT_EQ(pv->byte_offset, 32);
      EXPECT_EQ(pv->count, n);
    }
  }
}

TEST(StochasticRounding, BitwiseAgainstReference) {
  SCOPED_TRACE("GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()));
  std::mt19937_64 g(ref::test_seed() + 700);
  auto c = Codec::create(kSpec);
  const EncodeContext keys[] = {{0, 0, 0, 0}, {0x0123456789ABCDEFull, 7, 3, 1}, {~uint64_t(0), ~0u, ~0u, ~0u}};
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(8), int64_t(9), int64_t(15), int64_t(17),
                    int64_t(1000), (int64_t(1) << 16) + 5, (int64_t(1) << 17) + 3}) {
    for (DType dt : {DType::float32, DType::float16, DType::bfloat16}) {
      const ref::Input x = ref::Input::from_floats(dt, normal_values(n, g, 3.0f));
      const std::vector<float> r0 = normal_values(n, g, 0.01f);
      for (const EncodeContext& k : keys) {
        for (float divisor : {1.0f, 3.0f}) {
          const std::string what = "n " + std::to_string(n) + " " + std::string(gradcomp::dtype_name(dt)) + " seed " +
                                   std::to_string(k.seed) + " divisor " + std::to_string(divisor);
          check_against_reference(*c, x, nullptr, divisor, k, what + " no residual");
          check_against_reference(*c, x, &r0, divisor, k, what + " residual");
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Random bit patterns of every class (subnormals, near the binade edges, NaN payloads, inf, the top
// of the finite range), against the reference.
TEST(StochasticRounding, RandomBitsAndSpecials) {
  SCOPED_TRACE("GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()));
  std::mt19937_64 g(ref::test_seed() + 701);
  auto c = Codec::create(kSpec);
  std::vector<float> v;
  for (int i = 0; i < (1 << 16); ++i) {
    uint32_t u = uint32_t(g());
    switch (i % 5) {
      case 0: break;
      case 1: u = (u & 0x807FFFFFu) | (uint32_t(g() % 3) << 23); break;          // subnormal / tiny
      case 2: u = (u & 0x8000FFFFu) | 0x7F7F0000u; break;                       // above the top bfloat16
      case 3: u = (u & 0x807FFFFFu) | 0x7F800000u | ((g() & 1) ? 1u : 0u); break; // inf / NaN payloads
      case 4: u = (u & 0x80FF0000u) | 0x0000FFFFu; break;                       // just below a bfloat16
    }
    v.push_back(ref::from_bits(u));
  }
  for (float s : {0.0f, -0.0f, INFINITY, -INFINITY, std::numeric_limits<float>::max(),
                  -std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN()})
    v.push_back(s);
  const ref::Input x = ref::Input::from_floats(DType::float32, v);
  check_against_reference(*c, x, nullptr, 1.0f, {5, 6, 7, 8}, "random bits");
  // NaN and inf as the nearest mode; +-0 stay
  const KeyedRun run = encode_keyed(*c, ref::Input::from_floats(DType::float32,
                                                                {std::numeric_limits<float>::quiet_NaN(),
                                                                 -std::numeric_limits<float>::quiet_NaN(),
                                                                 ref::from_bits(0x7F800001u), INFINITY, -INFINITY,
                                                                 0.0f, -0.0f}),
                                    nullptr, 1.0f, {1, 2, 3, 4});
  const uint16_t want[] = {0x7FC0, 0xFFC0, 0x7FC0, 0x7F80, 0xFF80, 0x0000, 0x8000};
  for (int i = 0; i < 7; ++i) EXPECT_EQ(code_at(run.packet, i), want[i]) << i;
  EXPECT_EQ(ref::header_of(run.packet.data()).flags, 1);
}

// The top of the finite range: |y| in (0x7F7F0000, FLT_MAX] rounds to the largest finite bfloat16
// (0x7F7F) or to inf (0x7F80), to inf with probability (low 16 bits) / 65536: inf plays the next
// grid point 2^128. An overflow flags the packet (and leaves a -inf / +inf residual), as an
// overflowing round-to-nearest cast does; a packet where no element overflowed is not flagged.
TEST(StochasticRounding, TopOfTheFiniteRange) {
  auto c = Codec::create(kSpec);
  const int64_t n = 1 << 16;
  for (uint32_t low : {0x0001u, 0x8000u, 0xFFFFu}) {
    SCOPED_TRACE("low 16 bits 0x" + std::to_string(low));
    const float big = ref::from_bits(0x7F7F0000u | low);
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = (i & 1) ? -big : big;
    const ref::Input x = ref::Input::from_floats(DType::float32, v);
    check_against_reference(*c, x, nullptr, 1.0f, {11, 0, 0, 0}, "top");
    std::vector<float> r(size_t(n), 0.0f);
    const KeyedRun run = encode_keyed(*c, x, &r, 1.0f, {11, 0, 0, 0});
    int64_t up = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t code = code_at(run.packet, i);
      ASSERT_TRUE((code & 0x7FFF) == 0x7F7F || (code & 0x7FFF) == 0x7F80) << std::hex << code;
      ASSERT_EQ(code >> 15, uint16_t(i & 1)) << "sign";
      if ((code & 0x7FFF) == 0x7F80) {
        ++up;
        EXPECT_TRUE(std::isinf(run.residual[size_t(i)]));
      } else {
        EXPECT_EQ(run.residual[size_t(i)], (i & 1 ? -1.0f : 1.0f) * (big - ref::from_bits(0x7F7F0000u)));
      }
    }
    const double p = double(low) / 65536, mean = p * double(n), sd = std::sqrt(double(n) * p * (1 - p));
    EXPECT_LE(std::fabs(double(up) - mean), 5 * sd + 1) << up << " infinities of " << n;
    EXPECT_EQ(ref::header_of(run.packet.data()).flags, up > 0 ? 1 : 0);
  }
  // the largest finite bfloat16 itself never overflows
  const ref::Input top = ref::Input::from_floats(DType::float32, std::vector<float>(4096, ref::from_bits(0x7F7F0000u)));
  const KeyedRun run = encode_keyed(*c, top, nullptr, 1.0f, {12, 0, 0, 0});
  for (int64_t i = 0; i < 4096; ++i) ASSERT_EQ(code_at(run.packet, i), 0x7F7F);
  EXPECT_EQ(ref::header_of(run.packet.data()).flags, 0);
}

// The same key: the same bytes, at 1, 2 and 3 threads; another seed, step, bucket or chunk: other
// bytes (the payloads differ, not just the key sections).
TEST(StochasticRounding, KeyDeterminesTheBytes) {
  SCOPED_TRACE("GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()));
  std::mt19937_64 g(ref::test_seed() + 702);
  auto c = Codec::create(kSpec);
  const int64_t n = (int64_t(1) << 17) + 11;
  const ref::Input x = ref::Input::from_floats(DType::float32, normal_values(n, g));
  const std::vector<float> r0 = normal_values(n, g, 0.01f);
  const EncodeContext k{0xDEADBEEFCAFEF00Dull, 100, 2, 0};
  KeyedRun base;
  for (int t : {1, 2, 3}) {
    ref::Threads threads(t);
    KeyedRun run = encode_keyed(*c, x, &r0, 2.0f, k);
    if (t == 1) {
      base = run;
      continue;
    }
    EXPECT_EQ(run.packet, base.packet) << t << " threads";
    EXPECT_EQ(std::memcmp(run.residual.data(), base.residual.data(), size_t(n) * 4), 0) << t << " threads";
  }
  EXPECT_EQ(encode_keyed(*c, x, &r0, 2.0f, k).packet, base.packet);
  const int64_t payload = 2 * n;
  auto payload_differs = [&](const KeyedRun& a) {
    return std::memcmp(a.packet.data() + 32, base.packet.data() + 32, size_t(payload)) != 0;
  };
  EncodeContext o = k;
  o.seed ^= 1;
  EXPECT_TRUE(payload_differs(encode_keyed(*c, x, &r0, 2.0f, o))) << "seed";
  o = k;
  ++o.step;
  EXPECT_TRUE(payload_differs(encode_keyed(*c, x, &r0, 2.0f, o))) << "step";
  o = k;
  ++o.bucket;
  EXPECT_TRUE(payload_differs(encode_keyed(*c, x, &r0, 2.0f, o))) << "bucket";
  o = k;
  ++o.chunk;
  EXPECT_TRUE(payload_differs(encode_keyed(*c, x, &r0, 2.0f, o))) << "chunk";
  o = k;
  o.seed += uint64_t(1) << 32;  // the seed's high word is part of the key too
  EXPECT_TRUE(payload_differs(encode_keyed(*c, x, &r0, 2.0f, o))) << "seed high word";
}

// The rounding probability: 2^16 copies of one value whose low 16 bits are L round up L / 65536 of
// the time (a binomial count within 5 sigma), and decode gives the two neighbours exactly.
TEST(StochasticRounding, RoundsUpWithTheRightProbability) {
  auto c = Codec::create(kSpec);
  const int64_t n = 1 << 16;
  for (uint32_t bits : {0x3F80C000u, 0xC0491234u, 0x00400001u, 0x3F7FFFFFu}) {
    const float y = ref::from_bits(bits);
    const ref::Input x = ref::Input::from_floats(DType::float32, std::vector<float>(size_t(n), y));
    const KeyedRun run = encode_keyed(*c, x, nullptr, 1.0f, {uint64_t(bits), 1, 2, 3});
    const std::vector<float> D = [&] {
      ref::Bytes p(int64_t(run.packet.size()));
      std::memcpy(p.data(), run.packet.data(), run.packet.size());
      return ref::decode_f32(*c, p, n);
    }();
    const float lo = ref::from_bits(bits & 0xFFFF0000u), hi = ref::from_bits((bits & 0xFFFF0000u) + 0x10000u);
    int64_t up = 0;
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(D[size_t(i)] == lo || D[size_t(i)] == hi) << D[size_t(i)];
      up += D[size_t(i)] == hi;
      sum += double(D[size_t(i)]);
    }
    const double p = double(bits & 0xFFFFu) / 65536, sd = std::sqrt(double(n) * p * (1 - p));
    EXPECT_LE(std::fabs(double(up) - p * double(n)), 5 * sd) << std::hex << bits << std::dec << ": " << up;
    // the mean of the decoded values is y within the same bound (unbiased)
    const double gap = double(hi) - double(lo);
    EXPECT_LE(std::fabs(sum / double(n) - double(y)), 5 * sd / double(n) * std::fabs(gap) + 1e-300);
  }
}
