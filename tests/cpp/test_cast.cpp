// SPDX-License-Identifier: Apache-2.0
// The cast codecs none / fp16 / bf16 against the reference conversion (nearest-value search over
// the sorted 16-bit values, ties to even; canonical quiet NaN with the sign kept), decode (assign /
// accumulate with alpha into float32 / float16 / bfloat16), the non-finite sentinel and header
// flag, the status word, and payload(). docs/contracts.md sections 3 and 4.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

using gradcomp::Codec;
using gradcomp::DecodeMode;
using gradcomp::DType;
using gradcomp::Tensor;
using ref::Input;

namespace {

std::string seed_trace() { return "GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()); }

DType wire_of(const std::string& spec, DType in) {
  return spec == "fp16" ? DType::float16 : spec == "bf16" ? DType::bfloat16 : in;
}

// The float32 values that matter for a 16-bit format: every finite pattern's value, the exact
// midpoints to the next pattern and their float32 neighbours, with both signs.
std::vector<float> boundary_values(const ref::Table16& t) {
  std::vector<float> v;
  for (uint32_t b = 0; b < t.top; ++b) {
    const float lo = float(t.v[b]);
    const float mid = float((t.v[b] + t.v[b + 1]) / 2);  // exact in float32
    EXPECT_EQ(double(mid), (t.v[b] + t.v[b + 1]) / 2);
    for (float f : {lo, std::nextafter(lo, INFINITY), mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) {
      v.push_back(f);
      v.push_back(-f);
    }
  }
  return v;
}

std::vector<float> special_values() {
  return {0.0f,
          -0.0f,
          INFINITY,
          -INFINITY,
          std::numeric_limits<float>::quiet_NaN(),
          -std::numeric_limits<float>::quiet_NaN(),
          ref::from_bits(0x7F800001u),  // signalling NaN
          ref::from_bits(0xFF800001u),
          ref::from_bits(0x7FBFFFFFu),
          ref::from_bits(0xFFC00001u),
          ref::from_bits(0x7FFFFFFFu),
          ref::from_bits(0xFFFFFFFFu),
          ref::from_bits(0x7F802000u),  // payload in the bits a 16-bit NaN keeps
          65504.0f,
          -65504.0f,
          65519.99f,
          -65519.99f,
          std::nextafter(65520.0f, 0.0f),
          65520.0f,
          -65520.0f,
          65536.0f,
          3.3895314e38f,
          3.3961776e38f,  // the bfloat16 overflow midpoint, rounded to float32
          std::numeric_limits<float>::max(),
          -std::numeric_limits<float>::max(),
          std::numeric_limits<float>::min(),
          std::numeric_limits<float>::denorm_min(),
          -std::numeric_limits<float>::denorm_min(),
          5.9604645e-8f,   // smallest float16 subnormal
          2.9802322e-8f,   // half of it: ties to 0
          2.9802326e-8f,   // just above: rounds up
          8.940697e-8f,    // 1.5 x smallest: ties to even (2)
          6.097555e-5f,    // largest float16 subnormal
          6.1035156e-5f};  // smallest float16 normal
}

// Random float32 bit patterns over every class: uniform bits, plus exponents concentrated on the
// float16 range and NaNs with random payloads.
std::vector<float> random_values(int64_t n, std::mt19937_64& g) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = uint32_t(g());
    switch (i % 4) {
      case 0: break;  // anything
      case 1: u = (u & 0x807FFFFFu) | ((96u + uint32_t(g() % 48)) << 23); break;  // around the float16 range
      case 2: u = (u & 0x807FFFFFu) | (uint32_t(g() % 4) << 23); break;  // subnormal / tiny
      case 3: u = (u & 0x807FFFFFu) | 0x7F800000u | ((g() & 1) ? 1u : 0u); break;  // inf / NaN payloads
    }
    v[size_t(i)] = ref::from_bits(u);
  }
  return v;
}

// Encode float32 values with a cast codec and compare every wire element with the reference.
void check_cast_values(const std::string& spec, const std::vector<float>& vals) {
  SCOPED_TRACE(spec);
  auto c = Codec::create(spec);
  const Input x = Input::from_floats(DType::float32, vals);
  const DType w = wire_of(spec, DType::float32);
  const ref::Encoded e = ref::encode(*c, x, nullptr);
  const uint8_t* wire = e.packet.data() + 32;
  bool nonfinite = false;
  int bad = 0;
  for (size_t i = 0; i < vals.size(); ++i) {
    const uint32_t want = ref::to_dtype_bits(w, vals[i]);
    const uint32_t got = ref::load_value_bits(wire, w, int64_t(i));
    nonfinite = nonfinite || !std::isfinite(vals[i]) || !std::isfinite(ref::from_dtype_bits(w, want));
    const bool ok = w == DType::float32 ? ref::same_f32(ref::from_bits(got), ref::from_bits(want)) : got == want;
    if (!ok && bad++ < 10)
      ADD_FAILURE() << "element " << i << " x=" << vals[i] << " (0x" << std::hex << ref::bits(vals[i]) << "): got 0x"
                    << got << " want 0x" << want << std::dec;
  }
  EXPECT_EQ(ref::header_of(e.packet.data()).flags, nonfinite ? 1 : 0);
  // exactly numel wire elements, then zero padding up to the 16-byte boundary
  const int64_t used = 32 + int64_t(vals.size()) * gradcomp::dtype_size(w);
  EXPECT_EQ(e.packet_bytes, ref::align16(used));
  for (int64_t b = used; b < e.packet_bytes; ++b) EXPECT_EQ(e.packet.data()[b], 0) << "padding byte " << b;
}

} // namespace

// The reference itself, on hand-checked values (so that a wrong table cannot pass silently).
TEST(CastReference, KnownValues) {
  EXPECT_EQ(ref::f32_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(ref::f32_to_f16(-2.0f), 0xC000);
  EXPECT_EQ(ref::f32_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(ref::f32_to_f16(65519.99f), 0x7BFF);
  EXPECT_EQ(ref::f32_to_f16(65520.0f), 0x7C00);
  EXPECT_EQ(ref::f32_to_f16(-65520.0f), 0xFC00);
  EXPECT_EQ(ref::f32_to_f16(5.9604645e-8f), 0x0001);
  EXPECT_EQ(ref::f32_to_f16(2.9802322e-8f), 0x0000);
  EXPECT_EQ(ref::f32_to_f16(8.940697e-8f), 0x0002);
  EXPECT_EQ(ref::f32_to_f16(1.0f + 1.0f / 2048), 0x3C00);      // tie to even (down)
  EXPECT_EQ(ref::f32_to_f16(1.0f + 3.0f / 2048), 0x3C02);      // tie to even (up)
  EXPECT_EQ(ref::f32_to_f16(-std::numeric_limits<float>::quiet_NaN()), 0xFE00);
  EXPECT_EQ(ref::f32_to_f16(ref::from_bits(0x7F800001u)), 0x7E00);
  EXPECT_EQ(ref::f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(ref::f32_to_bf16(ref::from_bits(0x3F808000u)), 0x3F80);  // tie to even (down)
  EXPECT_EQ(ref::f32_to_bf16(ref::from_bits(0x3F818000u)), 0x3F82);  // tie to even (up)
  EXPECT_EQ(ref::f32_to_bf16(ref::from_bits(0x3F808001u)), 0x3F81);
  EXPECT_EQ(ref::f32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(ref::f32_to_bf16(ref::from_bits(0x7F7F7FFFu)), 0x7F7F);
  EXPECT_EQ(ref::f32_to_bf16(ref::from_bits(0xFFC12345u)), 0xFFC0);
  EXPECT_EQ(ref::f32_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(ref::f32_to_bf16(ref::from_bits(0x00008000u)), 0x0000);
  EXPECT_EQ(ref::f32_to_bf16(ref::from_bits(0x00018000u)), 0x0002);
  EXPECT_EQ(ref::f16_to_f32(0x0001), 5.9604644775390625e-8f);
  EXPECT_EQ(ref::f16_to_f32(0xFBFF), -65504.0f);
  EXPECT_EQ(ref::bf16_to_f32(0xC2AB), -85.5f);
}

TEST(Cast, Float16Boundaries) { check_cast_values("fp16", boundary_values(ref::half_table())); }
TEST(Cast, BFloat16Boundaries) { check_cast_values("bf16", boundary_values(ref::bf16_table())); }
TEST(Cast, SpecialValues) {
  for (const char* s : {"fp16", "bf16", "none"}) check_cast_values(s, special_values());
  // finite-only input: flag clear
  for (const char* s : {"fp16", "bf16", "none"}) check_cast_values(s, {1.0f, -2.0f, 0.0f, 65504.0f, 1e-40f});
}
TEST(Cast, RandomBits) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 200);
  const auto v = random_values(int64_t(1) << 20, g);
  for (const char* s : {"fp16", "bf16", "none"}) check_cast_values(s, v);
}

// 16-bit inputs, every bit pattern, through each cast codec: float16 -> bfloat16 rounds, the
// identity casts canonicalize NaN.
TEST(Cast, AllSixteenBitInputs) {
  for (DType in : {DType::float16, DType::bfloat16}) {
    Input x;
    x.dt = in;
    for (uint32_t b = 0; b < 65536; ++b) x.h.push_back(uint16_t(b));
    for (const char* spec : {"fp16", "bf16", "none"}) {
      SCOPED_TRACE(std::string(spec) + " from " + std::string(gradcomp::dtype_name(in)));
      auto c = Codec::create(spec);
      const DType w = wire_of(spec, in);
      const ref::Encoded e = ref::encode(*c, x, nullptr);
      EXPECT_EQ(ref::header_of(e.packet.data()).flags, 1);
      int bad = 0;
      for (int64_t i = 0; i < 65536; ++i) {
        const uint32_t want = ref::to_dtype_bits(w, x.at(i));
        const uint32_t got = ref::load_value_bits(e.packet.data() + 32, w, i);
        if (got != want && bad++ < 10)
          ADD_FAILURE() << "input 0x" << std::hex << i << ": got 0x" << got << " want 0x" << want << std::dec;
      }
    }
  }
}

TEST(Cast, ThreadsIdentical) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 201);
  const int64_t n = (int64_t(1) << 17) + 9;
  const Input x = Input::from_floats(DType::float32, random_values(n, g));
  std::vector<float> r(size_t(n), 0.125f);
  for (const char* spec : {"fp16", "bf16", "none"}) {
    auto c = Codec::create(spec);
    ref::Encoded base;
    {
      ref::Threads t(1);
      base = ref::encode(*c, x, &r, 3.0f);
    }
    ref::Threads t(2);
    ref::Encoded e = ref::encode(*c, x, &r, 3.0f);
    EXPECT_EQ(std::memcmp(e.packet.data(), base.packet.data(), size_t(e.packet_bytes)), 0) << spec;
    EXPECT_EQ(std::memcmp(e.residual.data(), base.residual.data(), r.size() * 4), 0) << spec;
  }
}

// ---- decode: assign / accumulate, alpha, output dtypes --------------------------------------------
namespace {

struct Out {
  DType dt;
  std::vector<uint32_t> b;  // element bits
  ref::Bytes buf;
  Out(DType dt_, const std::vector<float>& init) : dt(dt_), buf(int64_t(init.size()) * ref::esize(dt_)) {
    for (size_t i = 0; i < init.size(); ++i) {
      const uint32_t v = ref::to_dtype_bits(dt, init[i]);
      b.push_back(v);
      if (dt == DType::float32) std::memcpy(buf.data() + 4 * i, &v, 4);
      else {
        const uint16_t h = uint16_t(v);
        std::memcpy(buf.data() + 2 * i, &h, 2);
      }
    }
  }
  Tensor tensor() const { return {buf.data(), dt, int64_t(b.size()), {}}; }
  uint32_t got(size_t i) const { return ref::load_value_bits(buf.data(), dt, int64_t(i)); }
};

// out = round_out(fl(out + fl(D * alpha))) at the decoded positions (all of them for casts);
// assign: round_out(fl(D * alpha)), and +0 where top-k sent nothing.
void check_decode(const Codec& c, const ref::Encoded& e, int64_t n, const std::vector<float>& D,
                  const std::vector<uint8_t>& sent, const std::string& what) {
  std::mt19937_64 g(ref::test_seed() + 300);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> init(static_cast<size_t>(n));
  for (auto& v : init) v = nd(g);
  if (n > 3) init[3] = -0.0f;
  for (DType odt : {DType::float32, DType::float16, DType::bfloat16}) {
    std::vector<float> alphas = {1.0f, 0.5f, -1.25f, 1.0f / 3.0f, 1e-3f, 3e5f, 0.0f};
    if (n > 10000) alphas = {1.0f, -1.25f};  // large sizes: the threaded loops, fewer variants
    for (float alpha : alphas) {
      for (DecodeMode mode : {DecodeMode::assign, DecodeMode::accumulate}) {
        SCOPED_TRACE(what + " out " + std::string(gradcomp::dtype_name(odt)) + " alpha " + std::to_string(alpha) +
                     (mode == DecodeMode::assign ? " assign" : " accumulate"));
        Out o(odt, init);
        ref::Bytes ws(16);
        c.decode(e.packet.tensor(), o.tensor(), ws.tensor(), mode, alpha);
        EXPECT_EQ(gradcomp::read_status(ws.tensor()), 0u);
        int bad = 0;
        for (int64_t i = 0; i < n; ++i) {
          uint32_t want;
          if (!sent[size_t(i)]) {
            want = mode == DecodeMode::assign ? 0u : o.b[size_t(i)];
          } else {
            const float v = D[size_t(i)] * alpha;
            const float r = mode == DecodeMode::assign ? v : ref::from_dtype_bits(odt, o.b[size_t(i)]) + v;
            want = ref::to_dtype_bits(odt, r);
          }
          const uint32_t got = o.got(size_t(i));
          const bool ok = odt == DType::float32 ? ref::same_f32(ref::from_bits(got), ref::from_bits(want)) : got == want;
          if (!ok && bad++ < 5)
            ADD_FAILURE() << "element " << i << ": got 0x" << std::hex << got << " want 0x" << want << std::dec;
        }
      }
    }
  }
}

} // namespace

TEST(Decode, CastAssignAccumulate) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 301);
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(1000), (int64_t(1) << 16) + 1}) {
    for (DType in : {DType::float32, DType::float16, DType::bfloat16}) {
      std::vector<float> v = ref::make_values(ref::Dist::normal, n, g);
      for (auto& f : v) f *= 100.0f;
      const Input x = Input::from_floats(in, v);
      for (const char* spec : {"none", "fp16", "bf16"}) {
        auto c = Codec::create(spec);
        const DType w = wire_of(spec, in);
        const ref::Encoded e = ref::encode(*c, x, nullptr);
        std::vector<float> D(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) D[size_t(i)] = ref::from_dtype_bits(w, ref::to_dtype_bits(w, x.at(i)));
        check_decode(*c, e, n, D, std::vector<uint8_t>(size_t(n), 1),
                     std::string(spec) + " in " + std::string(gradcomp::dtype_name(in)) + " n " + std::to_string(n));
        if (HasFailure()) return;
      }
    }
  }
}

TEST(Decode, TopKAssignAccumulate) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 302);
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(1000), (int64_t(1) << 16) + 1}) {
    for (const char* spec : {"topk:ratio=0.1", "topk:ratio=0.3,value_dtype=float16", "topk:k=5,value_dtype=bfloat16",
                             "topk:ratio=1,index=u64"}) {
      auto c = Codec::create(spec);
      const Input x = Input::from_floats(DType::float32, ref::make_values(ref::Dist::normal, n, g));
      const std::string s = spec;
      const DType vdt = s.find("value_dtype=float16") != std::string::npos    ? DType::float16
                        : s.find("value_dtype=bfloat16") != std::string::npos ? DType::bfloat16
                                                                              : DType::float32;
      const ref::TopKRef want = ref::topk_ref(x, nullptr, 1.0f, c->main_param(n), vdt);
      const ref::Encoded e = ref::encode(*c, x, nullptr);
      std::vector<float> D(size_t(n), 0.0f);
      std::vector<uint8_t> sent(size_t(n), 0);
      for (size_t j = 0; j < want.idx.size(); ++j) {
        D[want.idx[j]] = ref::from_dtype_bits(vdt, want.vals[j]);
        sent[want.idx[j]] = 1;
      }
      check_decode(*c, e, n, D, sent, s + " n " + std::to_string(n));
      if (HasFailure()) return;
    }
  }
}

// ---- non-finite values, header flag, status word -----------------------------------------------------
// The casts carry every non-finite value in the payload (no sentinel): the decoded result holds them
// where they were, nothing else is overwritten, and the header flag sets the status word.
TEST(NonFinite, FlagAndStatus) {
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    std::vector<float> v;
    bool nonfinite_fp16, nonfinite_bf16, nonfinite_none;
  };
  const std::vector<Case> cases = {
      {{1.0f, 2.0f, qnan, 4.0f}, true, true, true},
      {{1.0f, -qnan, 3.0f}, true, true, true},
      {{1.0f, 2.0f, 3.0f, -INFINITY}, true, true, true},
      {{1.0f, 70000.0f, 3.0f}, true, false, false},  // overflows the float16 wire only
      {{1.0f, 65504.0f, 3.0f}, false, false, false},
      {{0.0f, -0.0f, 1e-45f}, false, false, false},
  };
  for (const auto& cs : cases) {
    for (const char* spec : {"fp16", "bf16", "none"}) {
      const std::string s = spec;
      const bool want = s == "fp16" ? cs.nonfinite_fp16 : s == "bf16" ? cs.nonfinite_bf16 : cs.nonfinite_none;
      auto c = Codec::create(spec);
      const Input x = Input::from_floats(DType::float32, cs.v);
      const int64_t n = x.n();
      const ref::Encoded e = ref::encode(*c, x, nullptr);
      const DType w = wire_of(s, DType::float32);
      EXPECT_EQ(ref::header_of(e.packet.data()).flags, want ? 1 : 0) << spec;
      for (DType odt : {DType::float32, DType::float16, DType::bfloat16}) {
        for (DecodeMode mode : {DecodeMode::assign, DecodeMode::accumulate}) {
          Out o(odt, std::vector<float>(size_t(n), 1.0f));
          ref::Bytes ws(16);
          uint32_t pre = gradcomp::kStatusCorrupt;  // bits are ORed in, never cleared by decode
          std::memcpy(ws.data(), &pre, 4);
          c->decode(e.packet.tensor(), o.tensor(), ws.tensor(), mode, 1.0f);
          const uint32_t st = gradcomp::read_status(ws.tensor());
          EXPECT_EQ(st, pre | (want ? gradcomp::kStatusNonFinite : 0u)) << spec;
          EXPECT_EQ(gradcomp::read_status(ws.tensor()), 0u) << "read_status clears";
          bool nonfinite = false;
          for (int64_t i = 0; i < n; ++i) {
            const float d = ref::from_dtype_bits(odt, o.got(i));
            // each element decodes to its own wire value (nothing forced to NaN); the wire carries
            // every non-finite value
            const float wv = ref::from_dtype_bits(w, ref::load_value_bits(e.packet.data() + 32, w, i));
            nonfinite = nonfinite || !std::isfinite(wv);
            const float want_i = mode == DecodeMode::assign ? wv : 1.0f + wv;
            EXPECT_TRUE(ref::same_f32(d, ref::from_dtype_bits(odt, ref::to_dtype_bits(odt, want_i)))) << spec << " " << i;
          }
          EXPECT_EQ(nonfinite, want) << spec;
        }
      }
    }
  }
}

// The header flag alone (a packet whose values are finite) reaches the status word and writes
// nothing: after a sum allreduce the local header says what this rank sent, and every rank must
// decode the summed payload to the same bits.
TEST(NonFinite, CastFlagAloneOnlySetsTheStatus) {
  for (const char* spec : {"fp16", "bf16", "none"}) {
    auto c = Codec::create(spec);
    const Input x = Input::from_floats(DType::float32, {1.0f, 2.0f, 3.0f, 4.0f, 5.0f});
    ref::Encoded e = ref::encode(*c, x, nullptr);
    e.packet.data()[11] = gradcomp::kFlagNonFinite;
    std::vector<float> out(5, 0.0f);
    ref::Bytes ws(16);
    c->decode(e.packet.tensor(), ref::f32_tensor(out), ws.tensor());
    for (int i = 0; i < 5; ++i) EXPECT_EQ(out[size_t(i)], float(i + 1)) << spec;
    EXPECT_EQ(gradcomp::read_status(ws.tensor()), gradcomp::kStatusNonFinite);
  }
}

TEST(NonFinite, TopKFlag) {
  // an unsent infinity still flags the packet; a sent value overflowing the float16 wire flags it
  struct Case {
    const char* spec;
    std::vector<float> v;
    bool flagged;
  };
  const std::vector<Case> cases = {
      {"topk:k=1", {INFINITY, 1.0f, -INFINITY, 2.0f}, true},
      {"topk:k=1", {std::numeric_limits<float>::quiet_NaN(), 1.0f, 2.0f}, true},
      {"topk:k=1,value_dtype=float16", {1e5f, 1.0f, 2.0f}, true},
      {"topk:k=1,value_dtype=float16", {65504.0f, 1.0f, 2.0f}, false},
      {"topk:k=0", {INFINITY, 1.0f}, true},
      {"topk:k=2", {5.0f, 1.0f, 2.0f}, false},
  };
  for (const auto& cs : cases) {
    auto c = Codec::create(cs.spec);
    const Input x = Input::from_floats(DType::float32, cs.v);
    const ref::Encoded e = ref::encode(*c, x, nullptr);
    EXPECT_EQ(ref::header_of(e.packet.data()).flags, cs.flagged ? 1 : 0) << cs.spec;
    uint32_t status = 0;
    auto out = ref::decode_f32(*c, e.packet, x.n(), &status);
    EXPECT_EQ(std::isnan(out[0]), cs.flagged) << cs.spec;
    EXPECT_EQ(status, cs.flagged ? gradcomp::kStatusNonFinite : 0u) << cs.spec;
  }
}

TEST(Payload, Views) {
  for (int64_t n : {0, 1, 7, 1000}) {
    for (DType in : {DType::float32, DType::float16, DType::bfloat16}) {
      for (const char* spec : {"none", "fp16", "bf16"}) {
        auto c = Codec::create(spec);
        auto p = c->payload(n, in);
        ASSERT_TRUE(p.has_value()) << spec;
        EXPECT_EQ(p->byte_offset, 32);
        EXPECT_EQ(p->count, n);
        EXPECT_EQ(p->dtype, wire_of(spec, in));
        EXPECT_LE(p->byte_offset + p->count * gradcomp::dtype_size(p->dtype), c->packet_bytes(n, in));
      }
      EXPECT_FALSE(Codec::create("topk:ratio=0.1")->payload(n, in).has_value());
    }
  }
  EXPECT_THROW(Codec::create("fp16")->payload(-1, DType::float32), gradcomp::InvalidArgument);
  // the payload of a float32 packet is exactly the values
  auto c = Codec::create("none");
  const Input x = Input::from_floats(DType::float32, {1.5f, -2.0f, 3.25f});
  const ref::Encoded e = ref::encode(*c, x, nullptr);
  auto p = *c->payload(3, DType::float32);
  const float* f = reinterpret_cast<const float*>(e.packet.data() + p.byte_offset);
  EXPECT_EQ(f[0], 1.5f);
  EXPECT_EQ(f[1], -2.0f);
  EXPECT_EQ(f[2], 3.25f);
  EXPECT_EQ(ref::bits(f[3]), 0u);  // padding to the 16-byte boundary
}
