// SPDX-License-Identifier: Apache-2.0
// Packet header contents, validation of corrupt packets on decode (CorruptPacket, nothing
// written), and argument validation of encode/decode/packet_bytes (InvalidArgument naming the
// values). docs/contracts.md sections 2 and 3.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

using gradcomp::Codec;
using gradcomp::CorruptPacket;
using gradcomp::DecodeMode;
using gradcomp::DType;
using gradcomp::InvalidArgument;
using gradcomp::PacketHeader;
using gradcomp::Tensor;

namespace {

bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

template <class Exc, class F> std::string error_of(F&& f) {
  try {
    f();
  } catch (const Exc& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("WRONG EXCEPTION TYPE: ") + e.what();
  }
  return "NO EXCEPTION";
}

// An output buffer of n elements of dtype `dt` with kGuard guard elements on both sides; the whole
// buffer is filled with a byte pattern so that any write shows.
struct Guarded {
  static constexpr int64_t kGuard = 64;
  DType dt;
  int64_t n;
  ref::Bytes buf;
  std::vector<uint8_t> before;
  Guarded(DType dt_, int64_t n_) : dt(dt_), n(n_), buf((n_ + 2 * kGuard) * ref::esize(dt_)) {
    for (int64_t i = 0; i < buf.n; ++i) buf.data()[i] = uint8_t(0xA5 ^ (i * 7));
    before.assign(buf.data(), buf.data() + buf.n);
  }
  Tensor out() const { return {buf.data() + kGuard * ref::esize(dt), dt, n, {}}; }
  bool untouched() const { return std::memcmp(before.data(), buf.data(), size_t(buf.n)) == 0; }
};

// Copy of a packet in a fresh aligned buffer.
ref::Bytes copy_packet(const ref::Bytes& p) {
  ref::Bytes q(p.n);
  std::memcpy(q.data(), p.data(), size_t(p.n));
  return q;
}

// Expect decode of `packet` (its first `bytes` bytes) into n elements to raise CorruptPacket for
// every output dtype and both modes, leaving the output and its guards untouched.
void expect_corrupt(const Codec& c, const ref::Bytes& packet, int64_t n, const std::string& what,
                    int64_t bytes = -1) {
  SCOPED_TRACE(what + " (codec " + c.spec() + ")");
  Tensor pt = packet.tensor();
  if (bytes >= 0) pt.numel = bytes;
  for (DType odt : {DType::float32, DType::float16, DType::bfloat16}) {
    for (DecodeMode mode : {DecodeMode::assign, DecodeMode::accumulate}) {
      Guarded g(odt, n);
      ref::Bytes ws(16);
      const std::string msg = error_of<CorruptPacket>([&] { c.decode(pt, g.out(), ws.tensor(), mode, 0.5f); });
      EXPECT_FALSE(contains(msg, "NO EXCEPTION") || contains(msg, "WRONG EXCEPTION")) << msg;
      EXPECT_TRUE(g.untouched()) << "decode wrote into out or its guards";
      // and without a workspace
      Guarded g2(odt, n);
      EXPECT_THROW(c.decode(pt, g2.out(), Tensor{}, mode, 1.0f), CorruptPacket);
      EXPECT_TRUE(g2.untouched());
    }
  }
}

//! `salt` tells the callers' draws apart; the seed is ref::test_seed() + salt.
ref::Input normal_input(DType dt, int64_t n, uint64_t salt) {
  std::mt19937_64 g(ref::test_seed() + salt);
  return ref::Input::from_floats(dt, ref::make_values(ref::Dist::normal, n, g));
}

template <class T> void poke(ref::Bytes& p, int64_t off, T v) { std::memcpy(p.data() + off, &v, sizeof v); }

} // namespace

TEST(Packet, HeaderFields) {
  const int64_t n = 1000;
  for (const char* spec : {"none", "fp16", "bf16", "topk:ratio=0.01", "topk:k=17,index=u64,value_dtype=bfloat16"}) {
    auto c = Codec::create(spec);
    for (DType dt : {DType::float32, DType::float16, DType::bfloat16}) {
      SCOPED_TRACE(std::string(spec) + " " + std::string(gradcomp::dtype_name(dt)));
      auto e = ref::encode(*c, normal_input(dt, n, 3), nullptr);
      const PacketHeader h = ref::header_of(e.packet.data());
      const uint8_t* b = e.packet.data();
      EXPECT_EQ(b[0], 'G');
      EXPECT_EQ(b[1], 'C');
      EXPECT_EQ(b[2], 'P');
      EXPECT_EQ(b[3], '1');
      EXPECT_EQ(h.magic, gradcomp::kPacketMagic);
      EXPECT_EQ(h.version, 1);
      EXPECT_EQ(h.codec_id, uint16_t(c->id()));
      EXPECT_EQ(h.input_dtype, uint8_t(dt));
      EXPECT_EQ(h.flags, 0);
      EXPECT_EQ(h.spec_hash, gradcomp::fnv1a32(c->spec()));
      EXPECT_EQ(h.numel, uint64_t(n));
      EXPECT_EQ(h.main_param, uint64_t(c->main_param(n)));
      const std::string s = spec;
      if (s == "none") {
        EXPECT_EQ(h.wire_dtype, uint8_t(dt));
      } else if (s == "fp16") {
        EXPECT_EQ(h.wire_dtype, uint8_t(DType::float16));
      } else if (s == "bf16") {
        EXPECT_EQ(h.wire_dtype, uint8_t(DType::bfloat16));
      }
      if (s.rfind("topk", 0) == 0) {
        EXPECT_EQ(h.index_dtype, uint8_t(s.find("u64") != std::string::npos ? DType::uint64 : DType::uint32));
        EXPECT_EQ(h.wire_dtype, uint8_t(s.find("bfloat16") != std::string::npos ? DType::bfloat16 : dt));
        EXPECT_EQ(h.main_param, s.find("k=17") != std::string::npos ? 17u : 10u);
      } else {
        EXPECT_EQ(h.index_dtype, uint8_t(DType::none));
        EXPECT_EQ(h.main_param, 0u);
      }
      // the fnv1a32 constants: offset basis 2166136261, prime 16777619
      uint32_t hh = 2166136261u;
      for (char ch : c->spec()) hh = (hh ^ uint8_t(ch)) * 16777619u;
      EXPECT_EQ(h.spec_hash, hh);
    }
  }
  EXPECT_EQ(gradcomp::fnv1a32(""), 2166136261u);
  EXPECT_EQ(gradcomp::fnv1a32("a"), 0xE40C292Cu);
}

TEST(Packet, CorruptTopK) {
  const int64_t n = 1000;
  for (const char* spec : {"topk:ratio=0.01", "topk:ratio=0.01,index=u64,value_dtype=float16"}) {
    auto c = Codec::create(spec);
    const bool u64 = std::string(spec).find("u64") != std::string::npos;
    const int64_t isz = u64 ? 8 : 4;
    auto e = ref::encode(*c, normal_input(DType::float32, n, 5), nullptr);
    // sanity: the packet itself decodes
    ASSERT_NO_THROW(ref::decode_f32(*c, e.packet, n));
    auto put_index = [&](ref::Bytes& p, int64_t j, uint64_t v) {
      if (u64) poke<uint64_t>(p, 32 + 8 * j, v);
      else poke<uint32_t>(p, 32 + 4 * j, uint32_t(v));
    };
    auto idx = [&](int64_t j) { return ref::load_index(e.packet.data() + 32, u64 ? DType::uint64 : DType::uint32, j); };
    {
      auto p = copy_packet(e.packet);
      poke<uint32_t>(p, 0, 0x31504348u);
      expect_corrupt(*c, p, n, "bad magic");
    }
    {
      auto p = copy_packet(e.packet);
      poke<uint16_t>(p, 4, 2);
      expect_corrupt(*c, p, n, "wrong version");
    }
    {
      auto p = copy_packet(e.packet);
      poke<uint16_t>(p, 6, uint16_t(gradcomp::CodecId::fp16));
      expect_corrupt(*c, p, n, "wrong codec id");
    }
    {
      auto p = copy_packet(e.packet);
      poke<uint32_t>(p, 12, ref::header_of(p.data()).spec_hash ^ 1u);
      expect_corrupt(*c, p, n, "wrong spec hash");
    }
    {
      auto p = copy_packet(e.packet);
      poke<uint8_t>(p, 8, 5);  // int8 input dtype
      expect_corrupt(*c, p, n, "bad input dtype");
      poke<uint8_t>(p, 8, 200);
      expect_corrupt(*c, p, n, "bad input dtype code");
    }
    {
      auto p = copy_packet(e.packet);
      poke<uint8_t>(p, 9, uint8_t(DType::bfloat16));
      expect_corrupt(*c, p, n, "wrong value dtype");
    }
    {
      auto p = copy_packet(e.packet);
      poke<uint8_t>(p, 10, uint8_t(u64 ? DType::uint32 : DType::uint64));
      expect_corrupt(*c, p, n, "wrong index dtype");
    }
    {
      auto p = copy_packet(e.packet);
      poke<uint64_t>(p, 24, 11);
      expect_corrupt(*c, p, n, "wrong k");
    }
    {
      auto p = copy_packet(e.packet);
      poke<uint64_t>(p, 16, uint64_t(n) + 1);
      expect_corrupt(*c, p, n, "wrong numel in header");
    }
    // wrong numel: decoding into an output of another size
    expect_corrupt(*c, e.packet, n - 1, "out smaller than numel");
    expect_corrupt(*c, e.packet, n + 1, "out larger than numel");
    for (uint64_t bad : {uint64_t(n), uint64_t(n) + 1, uint64_t(0xFFFFFFFFu), ~uint64_t(0)}) {
      if (!u64 && bad > 0xFFFFFFFFu) continue;
      auto p = copy_packet(e.packet);
      put_index(p, 9, bad);  // the last index
      expect_corrupt(*c, p, n, "index >= numel: " + std::to_string(bad));
    }
    {
      auto p = copy_packet(e.packet);
      put_index(p, 3, idx(5));
      put_index(p, 5, idx(3));
      expect_corrupt(*c, p, n, "indices out of order");
    }
    {
      auto p = copy_packet(e.packet);
      put_index(p, 4, idx(3));
      expect_corrupt(*c, p, n, "repeated index");
    }
    {
      auto p = copy_packet(e.packet);
      put_index(p, 0, idx(1));
      expect_corrupt(*c, p, n, "repeated first index");
    }
    // a packet buffer smaller than the header says
    expect_corrupt(*c, e.packet, n, "buffer short by 16 bytes", e.packet_bytes - 16);
    expect_corrupt(*c, e.packet, n, "buffer holds only the header", 32);
    expect_corrupt(*c, e.packet, n, "buffer shorter than the header", 16);
    expect_corrupt(*c, e.packet, n, "empty buffer", 0);
    (void)isz;
  }
  // a packet from topk:ratio=0.01 decoded by topk:ratio=0.02 (spec hash), and by another codec
  auto c1 = Codec::create("topk:ratio=0.01");
  auto c2 = Codec::create("topk:ratio=0.02");
  auto e = ref::encode(*c1, normal_input(DType::float32, n, 6), nullptr);
  expect_corrupt(*c2, e.packet, n, "spec hash: ratio 0.01 packet, ratio 0.02 codec");
  expect_corrupt(*Codec::create("topk:k=10"), e.packet, n, "spec hash: same k, other spec");
  expect_corrupt(*Codec::create("topk:ratio=0.01,value_dtype=float32"), e.packet, n, "spec hash: value dtype");
  expect_corrupt(*Codec::create("fp16"), e.packet, n, "codec id: topk packet, fp16 codec");
  expect_corrupt(*Codec::create("none"), e.packet, n, "codec id: topk packet, none codec");
}

TEST(Packet, CorruptCast) {
  const int64_t n = 333;
  for (const char* spec : {"none", "fp16", "bf16"}) {
    auto c = Codec::create(spec);
    for (DType dt : {DType::float32, DType::bfloat16}) {
      auto e = ref::encode(*c, normal_input(dt, n, 7), nullptr);
      ASSERT_NO_THROW(ref::decode_f32(*c, e.packet, n));
      {
        auto p = copy_packet(e.packet);
        p.data()[3] = '2';
        expect_corrupt(*c, p, n, "bad magic");
      }
      {
        auto p = copy_packet(e.packet);
        poke<uint16_t>(p, 4, 0);
        expect_corrupt(*c, p, n, "wrong version");
      }
      {
        auto p = copy_packet(e.packet);
        poke<uint16_t>(p, 6, uint16_t(gradcomp::CodecId::topk));
        expect_corrupt(*c, p, n, "wrong codec id");
      }
      {
        auto p = copy_packet(e.packet);
        poke<uint32_t>(p, 12, 0);
        expect_corrupt(*c, p, n, "wrong spec hash");
      }
      {
        auto p = copy_packet(e.packet);
        poke<uint8_t>(p, 9, uint8_t(DType::float8_e4m3fn));
        expect_corrupt(*c, p, n, "wrong wire dtype");
      }
      {
        auto p = copy_packet(e.packet);
        poke<uint64_t>(p, 24, 1);
        expect_corrupt(*c, p, n, "wrong main parameter");
      }
      expect_corrupt(*c, e.packet, n + 1, "wrong numel");
      expect_corrupt(*c, e.packet, n - 1, "wrong numel");
      expect_corrupt(*c, e.packet, n, "short buffer", e.packet_bytes - 16);
      expect_corrupt(*c, e.packet, n, "short buffer", 31);
    }
    for (const char* other : {"none", "fp16", "bf16"}) {
      if (std::string(other) == spec) continue;
      auto e = ref::encode(*c, normal_input(DType::float32, n, 8), nullptr);
      expect_corrupt(*Codec::create(other), e.packet, n, std::string("codec id: ") + spec + " packet");
    }
  }
}

// Decode of a valid packet into a guarded buffer writes exactly the n elements.
TEST(Packet, DecodeStaysInBounds) {
  for (const char* spec : {"none", "fp16", "bf16", "topk:ratio=0.1"}) {
    auto c = Codec::create(spec);
    for (int64_t n : {0, 1, 7, 100}) {
      auto e = ref::encode(*c, normal_input(DType::float32, n, 9), nullptr);
      for (DType odt : {DType::float32, DType::float16, DType::bfloat16}) {
        for (DecodeMode mode : {DecodeMode::assign, DecodeMode::accumulate}) {
          Guarded g(odt, n);
          ref::Bytes ws(16);
          c->decode(e.packet.tensor(), g.out(), ws.tensor(), mode, 1.0f);
          const int64_t gb = Guarded::kGuard * ref::esize(odt);
          EXPECT_EQ(std::memcmp(g.before.data(), g.buf.data(), size_t(gb)), 0) << spec << " n " << n;
          EXPECT_EQ(std::memcmp(g.before.data() + g.buf.n - gb, g.buf.data() + g.buf.n - gb, size_t(gb)), 0)
              << spec << " n " << n;
        }
      }
    }
  }
}

TEST(Packet, ArgumentValidation) {
  const int64_t n = 100;
  for (const char* spec : {"none", "fp16", "bf16", "topk:ratio=0.1"}) {
    SCOPED_TRACE(spec);
    auto c = Codec::create(spec);
    ref::Input x = normal_input(DType::float32, n, 10);
    const int64_t pb = c->packet_bytes(n, DType::float32);
    const int64_t wb = c->workspace_bytes(n, DType::float32, {});
    ref::Bytes packet(pb + 64), ws(wb + 64);
    std::vector<float> r(n, 0.0f);
    Tensor rt = ref::f32_tensor(r);
    auto enc = [&](const Tensor& xt, const Tensor* rr, const Tensor& pt, const Tensor& wt, float div = 1.0f) {
      return error_of<InvalidArgument>([&] { c->encode(xt, rr, pt, wt, div); });
    };
    Tensor pt = packet.tensor(), wt = ws.tensor();
    pt.numel = pb;
    wt.numel = wb;
    EXPECT_EQ(enc(x.tensor(), &rt, pt, wt), "NO EXCEPTION");
    // too small packet: names both sizes
    {
      Tensor small = pt;
      small.numel = pb - 1;
      const std::string m = enc(x.tensor(), nullptr, small, wt);
      EXPECT_TRUE(contains(m, std::to_string(pb - 1)) && contains(m, std::to_string(pb))) << m;
    }
    // misaligned packet
    {
      Tensor mis = packet.tensor();
      mis.data = packet.data() + 8;
      mis.numel = pb;
      const std::string m = enc(x.tensor(), nullptr, mis, wt);
      EXPECT_TRUE(contains(m, "aligned")) << m;
    }
    // workspace too small
    {
      Tensor w2 = wt;
      w2.numel = wb - 1;
      const std::string m = enc(x.tensor(), nullptr, pt, w2);
      EXPECT_TRUE(contains(m, std::to_string(wb - 1)) && contains(m, std::to_string(wb))) << m;
    }
    // residual of the wrong size / dtype
    {
      std::vector<float> r2(n + 1, 0.0f);
      Tensor rt2 = ref::f32_tensor(r2);
      const std::string m = enc(x.tensor(), &rt2, pt, wt);
      EXPECT_TRUE(contains(m, std::to_string(n + 1)) && contains(m, std::to_string(n))) << m;
      Tensor rt3 = rt;
      rt3.dtype = DType::float16;
      const std::string m3 = enc(x.tensor(), &rt3, pt, wt);
      EXPECT_TRUE(contains(m3, "float16") && contains(m3, "float32")) << m3;
    }
    // x of dtype int8
    {
      std::vector<int8_t> xi(n, 1);
      Tensor xt{xi.data(), DType::int8, n, {}};
      const std::string m = enc(xt, nullptr, pt, wt);
      EXPECT_TRUE(contains(m, "int8") && contains(m, "accepted")) << m;
    }
    // negative numel
    {
      Tensor xt = x.tensor();
      xt.numel = -5;
      const std::string m = enc(xt, nullptr, pt, wt);
      EXPECT_TRUE(contains(m, "-5")) << m;
      const std::string m2 = error_of<InvalidArgument>([&] { c->packet_bytes(-5, DType::float32); });
      EXPECT_TRUE(contains(m2, "-5")) << m2;
      const std::string m3 = error_of<InvalidArgument>([&] { c->workspace_bytes(-5, DType::float32, {}); });
      EXPECT_TRUE(contains(m3, "-5")) << m3;
    }
    {
      const std::string m = error_of<InvalidArgument>([&] { c->packet_bytes(10, DType::int8); });
      EXPECT_TRUE(contains(m, "int8") && contains(m, "accepted")) << m;
    }
    // divisor must be finite and > 0
    for (float d : {0.0f, -1.0f, INFINITY, NAN}) EXPECT_NE(enc(x.tensor(), nullptr, pt, wt, d), "NO EXCEPTION") << d;
    // decode: out dtype, alpha, workspace, alignment
    ASSERT_EQ(enc(x.tensor(), nullptr, pt, wt), "NO EXCEPTION");
    std::vector<float> out(n);
    ref::Bytes ws16(16);
    {
      std::vector<int32_t> oi(n);
      const std::string m =
          error_of<InvalidArgument>([&] { c->decode(pt, Tensor{oi.data(), DType::int32, n, {}}, ws16.tensor()); });
      EXPECT_TRUE(contains(m, "int32") && contains(m, "accepted")) << m;
    }
    EXPECT_THROW(c->decode(pt, ref::f32_tensor(out), ws16.tensor(), DecodeMode::assign, INFINITY), InvalidArgument);
    EXPECT_THROW(c->decode(pt, ref::f32_tensor(out), ws16.tensor(), DecodeMode::assign, NAN), InvalidArgument);
    {
      Tensor w8 = ws16.tensor();
      w8.numel = 8;
      const std::string m = error_of<InvalidArgument>([&] { c->decode(pt, ref::f32_tensor(out), w8); });
      EXPECT_TRUE(contains(m, "8") && contains(m, "16")) << m;
    }
    {
      ref::Bytes shifted(pb + 16);
      std::memcpy(shifted.data() + 4, packet.data(), size_t(pb));
      Tensor mis{shifted.data() + 4, DType::uint8, pb, {}};
      const std::string m = error_of<InvalidArgument>([&] { c->decode(mis, ref::f32_tensor(out), ws16.tensor()); });
      EXPECT_TRUE(contains(m, "aligned")) << m;
    }
    // CUDA tensors in a CPU-only build
#if !defined(GRADCOMP_WITH_CUDA)
    {
      Tensor xc = x.tensor();
      xc.device = {gradcomp::DeviceKind::cuda, 0};
      EXPECT_THROW(c->encode(xc, nullptr, pt, wt), gradcomp::Unsupported);
    }
#endif
    // x is not modified by encode
    {
      std::vector<float> before = x.f;
      std::vector<float> r4(n, 0.25f);
      Tensor rt4 = ref::f32_tensor(r4);
      c->encode(x.tensor(), &rt4, pt, wt);
      EXPECT_EQ(std::memcmp(before.data(), x.f.data(), size_t(n) * 4), 0);
    }
  }
}
