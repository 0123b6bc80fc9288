// SPDX-License-Identifier: Apache-2.0
// The contract every codec must pass (the C++ twin of the Python suite gradcomp.testing),
// parametrised over every example spec of gradcomp::list_codecs() and the three input dtypes, on
// the CPU backend (CUDA: tests/cpp/test_cuda_codecs.cu and tests/python/test_cuda.py):
//   spec round trip; packet_bytes a multiple of 16, the same on every call, equal to the layout's;
//   the layout's sections 16-byte aligned, in order, inside the packet; every single-field
//   corruption of the header raising CorruptPacket with nothing written; guard bytes around the
//   packet, workspace and out never touched; padding zeroed; r_new == fl(x' - divisor * D) bitwise
//   (D the decoded packet, x' = fl(x + r_old), computed here with plain float arithmetic), and
//   x' == D + r_new exactly for codecs whose properties say so; a non-finite input giving a
//   non-finite decoded result and the status bit; packets identical at 1, 2 and 3 threads; sizes
//   0, 1, 7, 2^k +- 1; two encodes on one workspace; encode never touching the status word; the
//   EncodeContext: for keyed codecs the key read back from the packet, the same packet for the same
//   key, another for the next step, a non-zero reserved key byte refused; no effect on the others.
// Inputs are seeded from ref::test_seed() (GRADCOMP_TEST_SEED), printed on failure.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

using gradcomp::Codec;
using gradcomp::CorruptPacket;
using gradcomp::DecodeMode;
using gradcomp::DType;
using gradcomp::PacketLayout;
using gradcomp::Tensor;

namespace {

struct Case {
  std::string spec;
  DType dtype;
};

void PrintTo(const Case& c, std::ostream* os) { *os << "'" << c.spec << "' " << gradcomp::dtype_name(c.dtype); }

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const gradcomp::CodecInfo& info : gradcomp::list_codecs())
    for (const std::string& spec : info.examples)
      for (DType dt : {DType::float32, DType::float16, DType::bfloat16}) out.push_back({spec, dt});
  return out;
}

std::string case_name(const testing::TestParamInfo<Case>& p) {
  std::string s = p.param.spec + "_" + std::string(gradcomp::dtype_name(p.param.dtype));
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s + "_" + std::to_string(p.index);
}

//! A byte buffer with kGuard guard bytes on both sides, filled with a pattern.
struct GuardedBytes {
  static constexpr int64_t kGuard = 64;
  ref::Bytes buf;
  int64_t n;
  uint8_t fill;
  GuardedBytes(int64_t bytes, uint8_t pattern) : buf(bytes + 2 * kGuard), n(bytes), fill(pattern) {
    std::memset(buf.data(), pattern, size_t(bytes + 2 * kGuard));
  }
  uint8_t* data() const { return buf.data() + kGuard; }
  Tensor tensor() const { return {data(), DType::uint8, n, {}}; }
  bool guards_intact() const {
    for (int64_t i = 0; i < kGuard; ++i)
      if (buf.data()[i] != fill || buf.data()[kGuard + n + i] != fill) return false;
    return true;
  }
};

struct Encoded {
  GuardedBytes packet;
  GuardedBytes ws;
  std::vector<float> residual;
};

ref::Input random_input(DType dt, int64_t n, std::mt19937_64& g, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& f : v) f = nd(g);
  return ref::Input::from_floats(dt, v);
}

std::vector<float> random_residual(int64_t n, std::mt19937_64& g) {
  std::normal_distribution<float> nd(0.0f, 0.25f);
  std::vector<float> r(static_cast<size_t>(n));
  for (auto& f : r) f = nd(g);
  return r;
}

//! Encode through the public API into guarded buffers (packet filled 0xCD, workspace 0xEE with a
//! zero status word unless `status` is given).
std::unique_ptr<Encoded> encode_guarded(const Codec& c, const ref::Input& x, const std::vector<float>* r, float divisor = 1.0f,
                            gradcomp::EncodeContext ctx = {}, uint32_t status = 0) {
  const int64_t pb = c.packet_bytes(x.n(), x.dt);
  const int64_t wb = c.workspace_bytes(x.n(), x.dt, {});
  auto run = std::make_unique<Encoded>(Encoded{GuardedBytes(pb, 0xCD), GuardedBytes(wb, 0xEE), {}});
  std::memcpy(run->ws.data(), &status, 4);
  Tensor rt;
  if (r) {
    run->residual = *r;
    rt = ref::f32_tensor(run->residual);
  }
  c.encode(x.tensor(), r ? &rt : nullptr, run->packet.tensor(), run->ws.tensor(), divisor, ctx);
  EXPECT_TRUE(run->packet.guards_intact()) << "encode wrote outside the packet";
  EXPECT_TRUE(run->ws.guards_intact()) << "encode wrote outside the workspace";
  return run;
}

//! Decode into float32 with guards around out; returns the n values.
std::vector<float> decode_guarded(const Codec& c, const GuardedBytes& packet, int64_t n, uint32_t* status = nullptr,
                          DecodeMode mode = DecodeMode::assign, std::vector<float> init = {}) {
  GuardedBytes out(n * 4, 0x5A);
  if (!init.empty() && n > 0) std::memcpy(out.data(), init.data(), size_t(n) * 4);
  GuardedBytes ws(16, 0);
  c.decode(packet.tensor(), {out.data(), DType::float32, n, {}}, ws.tensor(), mode, 1.0f);
  EXPECT_TRUE(out.guards_intact()) << "decode wrote outside out";
  EXPECT_TRUE(ws.guards_intact()) << "decode wrote outside the workspace";
  std::vector<float> v(static_cast<size_t>(n));
  if (n > 0) std::memcpy(v.data(), out.data(), size_t(n) * 4);
  if (status) std::memcpy(status, ws.data(), 4);
  return v;
}

class Contract : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    codec = Codec::create(GetParam().spec);
    dt = GetParam().dtype;
  }
  std::unique_ptr<Codec> codec;
  DType dt = DType::float32;
};

TEST_P(Contract, SpecRoundTrip) {
  EXPECT_EQ(codec->spec(), GetParam().spec) << "example specs are canonical";
  auto again = Codec::create(codec->spec());
  EXPECT_EQ(again->spec(), codec->spec());
  EXPECT_EQ(again->id(), codec->id());
  EXPECT_EQ(codec->spec_hash(), gradcomp::fnv1a32(codec->spec()));
}

TEST_P(Contract, PacketBytesAndLayout) {
  for (int64_t n : {0, 1, 7, 15, 16, 17, 1000, 65537}) {
    SCOPED_TRACE("n " + std::to_string(n));
    const int64_t pb = codec->packet_bytes(n, dt);
    EXPECT_EQ(pb % 16, 0);
    EXPECT_GE(pb, gradcomp::kHeaderBytes);
    EXPECT_EQ(pb, codec->packet_bytes(n, dt));
    const PacketLayout l = codec->layout(n, dt);
    EXPECT_EQ(l.bytes, pb);
    EXPECT_EQ(l.header.codec_id, uint16_t(codec->id()));
    EXPECT_EQ(l.header.spec_hash, codec->spec_hash());
    EXPECT_EQ(l.header.numel, uint64_t(n));
    EXPECT_EQ(l.header.input_dtype, uint8_t(dt));
    EXPECT_EQ(int64_t(l.header.main_param), codec->main_param(n));
    int64_t at = gradcomp::kHeaderBytes;
    for (int s = 0; s < l.nsections; ++s) {
      EXPECT_EQ(l.sections[s].offset % 16, 0) << l.sections[s].name;
      EXPECT_GE(l.sections[s].offset, at) << l.sections[s].name;
      at = l.sections[s].offset + gradcomp::storage_bytes(l.sections[s].dtype, l.sections[s].count);
    }
    EXPECT_LE(at, pb);
    EXPECT_LT(pb - at, 16) << "the packet ends within 16 bytes of its last section";
    EXPECT_EQ(l.key_section >= 0, codec->properties().keyed);
    EXPECT_EQ(l.payload_section >= 0, codec->properties().linear);
    if (auto pv = codec->payload(n, dt)) {
      EXPECT_EQ(pv->byte_offset, l.sections[l.payload_section].offset);
      EXPECT_EQ(pv->count, l.sections[l.payload_section].count);
    }
  }
}

TEST_P(Contract, EveryHeaderFieldIsChecked) {
  SCOPED_TRACE("seed " + std::to_string(ref::test_seed()));
  std::mt19937_64 g(ref::test_seed());
  const int64_t n = 100;
  const ref::Input x = random_input(dt, n, g);
  const auto run = encode_guarded(*codec, x, nullptr);
  const PacketLayout l = codec->layout(n, dt);
  ASSERT_NO_THROW(decode_guarded(*codec, run->packet, n));
  struct Field {
    const char* name;
    int offset, size;
    std::vector<uint64_t> values;
  };
  auto h = ref::header_of(run->packet.data());
  std::vector<Field> fields = {
      {"magic", 0, 4, {h.magic ^ 1u, 0}},
      {"version", 4, 2, {uint64_t(h.version + 1), 0}},
      {"codec_id", 6, 2, {uint64_t(h.codec_id + 1), 0xFFFF, 0}},
      {"input_dtype", 8, 1, {3, 9, 0xFE, 0xFF}},
      {"wire_dtype", 9, 1, {uint64_t((h.wire_dtype + 1) & 0xFF), 0xFE}},
      {"index_dtype", 10, 1, {uint64_t((h.index_dtype + 1) & 0xFF), 0xFE}},
      // bit 1 flipped: a codec without a fallback refuses it, qsgd coding=elias finds its stream
      // (or its fallback codes) read the other way inconsistent
      {"flags", 11, 1, {uint64_t(h.flags ^ 0x02), uint64_t(h.flags ^ 0x80), 0xFE}},
      {"spec_hash", 12, 4, {h.spec_hash ^ 1u, h.spec_hash ^ 0x80000000u}},
      {"numel", 16, 8, {uint64_t(n + 1), uint64_t(n - 1), ~uint64_t(0)}},
  };
  if (l.main_kind == gradcomp::MainParamKind::exact)
    fields.push_back({"main_param", 24, 8, {h.main_param + 1, h.main_param ^ (uint64_t(1) << 63)}});
  for (const Field& f : fields) {
    for (uint64_t v : f.values) {
      SCOPED_TRACE(std::string(f.name) + " = " + std::to_string(v));
      GuardedBytes bad(run->packet.n, 0xCD);
      std::memcpy(bad.data(), run->packet.data(), size_t(run->packet.n));
      std::memcpy(bad.data() + f.offset, &v, size_t(f.size)); // little-endian
      GuardedBytes out(n * 4, 0x5A);
      GuardedBytes ws(16, 0);
      EXPECT_THROW(codec->decode(bad.tensor(), {out.data(), DType::float32, n, {}}, ws.tensor()), CorruptPacket);
      for (int64_t i = 0; i < n * 4; ++i) ASSERT_EQ(out.data()[i], 0x5A) << "decode wrote into out";
      EXPECT_TRUE(out.guards_intact());
      uint32_t st = 0;
      std::memcpy(&st, ws.data(), 4);
      EXPECT_EQ(st, 0u) << "the CPU reports by raising, not through the status word";
    }
  }
  // Another gradient input dtype: rejected, or decoded to the very same values (the input dtype
  // does not change what the packet holds for this codec).
  for (uint8_t other : {uint8_t(0), uint8_t(1), uint8_t(2)}) {
    if (other == uint8_t(dt)) continue;
    GuardedBytes alt(run->packet.n, 0xCD);
    std::memcpy(alt.data(), run->packet.data(), size_t(run->packet.n));
    alt.data()[8] = other;
    try {
      const auto a = decode_guarded(*codec, alt, n);
      const auto b = decode_guarded(*codec, run->packet, n);
      for (int64_t i = 0; i < n; ++i) EXPECT_TRUE(ref::same_f32(a[i], b[i])) << i;
    } catch (const CorruptPacket&) {
    }
  }
  // A packet buffer shorter than the packet.
  if (run->packet.n > gradcomp::kHeaderBytes) {
    GuardedBytes short_p(run->packet.n - 16, 0xCD);
    std::memcpy(short_p.data(), run->packet.data(), size_t(run->packet.n - 16));
    GuardedBytes out(n * 4, 0x5A);
    EXPECT_THROW(codec->decode(short_p.tensor(), {out.data(), DType::float32, n, {}}, Tensor{}), CorruptPacket);
    for (int64_t i = 0; i < n * 4; ++i) ASSERT_EQ(out.data()[i], 0x5A);
  }
}

TEST_P(Contract, ErrorFeedbackIdentityAndPadding) {
  SCOPED_TRACE("seed " + std::to_string(ref::test_seed()));
  std::mt19937_64 g(ref::test_seed() + 1);
  for (int64_t n : {0, 1, 7, 15, 17, 1023, 1025, 65535, 65537}) {
    for (float divisor : {1.0f, 3.0f}) {
      SCOPED_TRACE("n " + std::to_string(n) + " divisor " + std::to_string(divisor));
      const ref::Input x = random_input(dt, n, g);
      const std::vector<float> r0 = random_residual(n, g);
      const auto run = encode_guarded(*codec, x, &r0, divisor);
      // padding: every byte outside the header and the sections is zero
      const PacketLayout l = codec->layout(n, dt);
      std::vector<bool> covered(size_t(l.bytes), false);
      for (int64_t i = 0; i < gradcomp::kHeaderBytes; ++i) covered[size_t(i)] = true;
      for (int s = 0; s < l.nsections; ++s)
        for (int64_t i = 0; i < gradcomp::storage_bytes(l.sections[s].dtype, l.sections[s].count); ++i)
          covered[size_t(l.sections[s].offset + i)] = true;
      for (int64_t i = 0; i < l.bytes; ++i)
        if (!covered[size_t(i)]) ASSERT_EQ(run->packet.data()[i], 0) << "padding byte " << i << " not zeroed";
      const std::vector<float> D = decode_guarded(*codec, run->packet, n);
      for (int64_t i = 0; i < n; ++i) {
        const float xp = x.at(i) + r0[size_t(i)];  // fl(x + r_old): -ffp-contract=off
        const float want = divisor == 1.0f ? xp - D[size_t(i)] : xp - divisor * D[size_t(i)];
        ASSERT_TRUE(ref::same_f32(run->residual[size_t(i)], want))
            << "element " << i << ": r_new " << run->residual[size_t(i)] << " != fl(x' - divisor * D) " << want;
        if (codec->properties().exact_residual && divisor == 1.0f && std::isfinite(xp)) {
          ASSERT_EQ(double(xp), double(D[size_t(i)]) + double(run->residual[size_t(i)])) << "element " << i;
        }
      }
    }
  }
}

TEST_P(Contract, NonFiniteInputGivesNonFiniteResult) {
  SCOPED_TRACE("seed " + std::to_string(ref::test_seed()));
  std::mt19937_64 g(ref::test_seed() + 2);
  const int64_t n = 300;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                    std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
    std::vector<float> v(static_cast<size_t>(n));
    std::normal_distribution<float> nd;
    for (auto& f : v) f = nd(g);
    const int64_t at = int64_t(g() % uint64_t(n));
    v[size_t(at)] = bad;
    const ref::Input x = ref::Input::from_floats(dt, v);
    const auto run = encode_guarded(*codec, x, nullptr);
    EXPECT_EQ(ref::header_of(run->packet.data()).flags & gradcomp::kFlagNonFinite, gradcomp::kFlagNonFinite);
    uint32_t st = 0;
    const auto D = decode_guarded(*codec, run->packet, n, &st);
    bool nonfinite = false;
    for (float d : D) nonfinite = nonfinite || !std::isfinite(d);
    EXPECT_TRUE(nonfinite) << "a non-finite input at " << at << " vanished";
    EXPECT_EQ(st & gradcomp::kStatusNonFinite, gradcomp::kStatusNonFinite);
  }
}

TEST_P(Contract, ThreadCountDoesNotChangePackets) {
  SCOPED_TRACE("seed " + std::to_string(ref::test_seed()));
  std::mt19937_64 g(ref::test_seed() + 3);
  const int64_t n = (int64_t(1) << 17) + 3;
  const ref::Input x = random_input(dt, n, g);
  const std::vector<float> r0 = random_residual(n, g);
  std::unique_ptr<Encoded> first;
  for (int t : {1, 2, 3}) {
    SCOPED_TRACE("threads " + std::to_string(t));
    ref::Threads threads(t);
    auto run = encode_guarded(*codec, x, &r0);
    if (!first) {
      first = std::move(run);
      continue;
    }
    ASSERT_EQ(run->packet.n, first->packet.n);
    EXPECT_EQ(std::memcmp(run->packet.data(), first->packet.data(), size_t(run->packet.n)), 0);
    EXPECT_EQ(std::memcmp(run->residual.data(), first->residual.data(), size_t(n) * 4), 0);
  }
}

TEST_P(Contract, TwoEncodesOnOneWorkspace) {
  SCOPED_TRACE("seed " + std::to_string(ref::test_seed()));
  std::mt19937_64 g(ref::test_seed() + 4);
  for (int64_t n : {int64_t(5000), (int64_t(1) << 18) + 9}) {
    const ref::Input x = random_input(dt, n, g);
    const std::vector<float> r0 = random_residual(n, g);
    const int64_t pb = codec->packet_bytes(n, dt);
    GuardedBytes ws(codec->workspace_bytes(n, dt, {}), 0xEE);
    std::memset(ws.data(), 0, 4);
    std::vector<std::vector<uint8_t>> packets;
    for (int rep = 0; rep < 2; ++rep) {
      GuardedBytes p(pb, 0xCD);
      std::vector<float> r = r0;
      Tensor rt = ref::f32_tensor(r);
      codec->encode(x.tensor(), &rt, p.tensor(), ws.tensor());
      packets.emplace_back(p.data(), p.data() + pb);
    }
    EXPECT_EQ(packets[0], packets[1]) << "n " << n;
    EXPECT_TRUE(ws.guards_intact());
  }
}

TEST_P(Contract, EncodeLeavesTheStatusWord) {
  std::mt19937_64 g(ref::test_seed() + 5);
  for (uint32_t status : {0u, 1u, 2u, 3u, 0xA5A5A5A5u}) {
    const ref::Input x = random_input(dt, 777, g);
    const auto run = encode_guarded(*codec, x, nullptr, 1.0f, {}, status);
    uint32_t after = 0;
    std::memcpy(&after, run->ws.data(), 4);
    EXPECT_EQ(after, status);
  }
}

TEST_P(Contract, EncodeContextRoundTrip) {
  std::mt19937_64 g(ref::test_seed() + 6);
  const int64_t n = 4097;
  const ref::Input x = random_input(dt, n, g);
  const std::vector<float> r0 = random_residual(n, g);
  const gradcomp::EncodeContext a{0x0123456789ABCDEFull, 7, 3, 5}, b{42, 0xFFFFFFFFu, 0, 0xFFFFFFFFu};
  const auto pa = encode_guarded(*codec, x, nullptr, 1.0f, a);
  const auto pb = encode_guarded(*codec, x, nullptr, 1.0f, b);
  const PacketLayout l = codec->layout(n, dt);
  auto same = [](const Encoded& p, const Encoded& q) {
    return p.packet.n == q.packet.n && std::memcmp(p.packet.data(), q.packet.data(), size_t(p.packet.n)) == 0;
  };
  if (codec->properties().keyed) {
    ASSERT_GE(l.key_section, 0);
    EXPECT_EQ(l.sections[l.key_section].count, gradcomp::kKeyBytes);
    // the key read back from the packet: u64 seed, u32 step, bucket, chunk, 12 reserved zero bytes
    for (const auto& [run, key] : {std::pair{pa.get(), a}, std::pair{pb.get(), b}}) {
      const uint8_t* k = run->packet.data() + l.sections[l.key_section].offset;
      uint64_t seed = 0;
      uint32_t step = 0, bucket = 0, chunk = 0;
      std::memcpy(&seed, k, 8);
      std::memcpy(&step, k + 8, 4);
      std::memcpy(&bucket, k + 12, 4);
      std::memcpy(&chunk, k + 16, 4);
      EXPECT_EQ(seed, key.seed);
      EXPECT_EQ(step, key.step);
      EXPECT_EQ(bucket, key.bucket);
      EXPECT_EQ(chunk, key.chunk);
      for (int i = 20; i < 32; ++i) EXPECT_EQ(k[i], 0) << "reserved key byte " << i;
    }
    // the same key: the same packet (and residual) on every call; the next step: another packet
    const auto pa2 = encode_guarded(*codec, x, nullptr, 1.0f, a);
    EXPECT_TRUE(same(*pa, *pa2)) << "the same key gave another packet";
    gradcomp::EncodeContext next = a;
    ++next.step;
    const auto pn = encode_guarded(*codec, x, nullptr, 1.0f, next);
    EXPECT_FALSE(same(*pa, *pn)) << "the next step gave the same packet";
    const auto ra = encode_guarded(*codec, x, &r0, 3.0f, a), ra2 = encode_guarded(*codec, x, &r0, 3.0f, a);
    EXPECT_TRUE(same(*ra, *ra2));
    EXPECT_EQ(std::memcmp(ra->residual.data(), ra2->residual.data(), size_t(n) * 4), 0);
    // a non-zero reserved key byte: CorruptPacket, nothing written
    for (int i : {20, 31}) {
      GuardedBytes bad(pa->packet.n, 0xCD);
      std::memcpy(bad.data(), pa->packet.data(), size_t(pa->packet.n));
      bad.data()[l.sections[l.key_section].offset + i] = 1;
      GuardedBytes out(n * 4, 0x5A);
      EXPECT_THROW(codec->decode(bad.tensor(), {out.data(), DType::float32, n, {}}, Tensor{}), CorruptPacket) << i;
      for (int64_t j = 0; j < n * 4; ++j) ASSERT_EQ(out.data()[j], 0x5A) << "decode wrote into out";
    }
  } else {
    EXPECT_EQ(l.key_section, -1);
    EXPECT_TRUE(same(*pa, *pb)) << "the key changed the packet of a codec that draws no random numbers";
  }
}

INSTANTIATE_TEST_SUITE_P(Registry, Contract, testing::ValuesIn(all_cases()), case_name);

TEST(Registry, NamesAndIdsAreUnique) {
  const auto codecs = gradcomp::list_codecs();
  ASSERT_FALSE(codecs.empty());
  for (size_t i = 0; i < codecs.size(); ++i) {
    EXPECT_FALSE(codecs[i].examples.empty()) << codecs[i].name;
    EXPECT_FALSE(codecs[i].summary.empty()) << codecs[i].name;
    for (const std::string& ex : codecs[i].examples) EXPECT_EQ(Codec::create(ex)->id(), codecs[i].id) << ex;
    for (size_t j = i + 1; j < codecs.size(); ++j) {
      EXPECT_NE(codecs[i].name, codecs[j].name);
      EXPECT_NE(uint16_t(codecs[i].id), uint16_t(codecs[j].id)) << codecs[i].name << " " << codecs[j].name;
    }
  }
  // the unknown-codec message lists every registered name
  try {
    Codec::create("nosuchcodec");
    ADD_FAILURE() << "no exception";
  } catch (const gradcomp::InvalidArgument& e) {
    for (const auto& c : codecs) EXPECT_NE(std::string(e.what()).find(c.name), std::string::npos) << e.what();
  }
}

} // namespace
