// Argument guards of Codec::encode / decode: overlapping buffers and element counts whose byte
// sizes would not fit an int64 raise InvalidArgument naming the values, and nothing is written.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"

using gradcomp::Codec;
using gradcomp::DType;
using gradcomp::InvalidArgument;
using gradcomp::Tensor;

namespace {

// One 16-byte aligned arena that the test slices into (possibly overlapping) views.
struct Arena {
  std::vector<uint8_t> raw;
  uint8_t* base;
  explicit Arena(size_t n) : raw(n + 64) { base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw.data()) + 15) & ~uintptr_t(15)); }
  Tensor view(size_t off, DType dt, int64_t numel) { return {base + off, dt, numel, {}}; }
};

template <class F> std::string message_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

} // namespace

TEST(Guards, EncodeRejectsOverlappingBuffers) {
  for (const char* spec : {"fp16", "topk:ratio=0.1"}) {
    auto c = Codec::create(spec);
    const int64_t n = 256;
    const int64_t pb = c->packet_bytes(n, DType::float32), wb = c->workspace_bytes(n, DType::float32, {});
    Arena a(size_t(4 * n * 4 + pb + wb + 256));
    const size_t xo = 0, ro = 4 * n, po = 8 * n, wo = 8 * n + size_t(gradcomp::align16(pb));
    for (int64_t i = 0; i < n; ++i) reinterpret_cast<float*>(a.base)[i] = float(i) - 100.0f;
    Tensor x = a.view(xo, DType::float32, n), r = a.view(ro, DType::float32, n);
    Tensor p = a.view(po, DType::uint8, pb), w = a.view(wo, DType::uint8, wb);
    const std::vector<uint8_t> before(a.base, a.base + a.raw.size() - 64);
    // residual is x
    std::string m = message_of([&] { c->encode(x, &x, p, w); });
    EXPECT_NE(m.find("residual"), std::string::npos) << spec << ": " << m;
    EXPECT_NE(m.find("overlap"), std::string::npos) << m;
    // packet inside x
    m = message_of([&] { c->encode(x, nullptr, a.view(16, DType::uint8, pb), w); });
    EXPECT_NE(m.find("overlap"), std::string::npos) << spec << ": " << m;
    // workspace overlapping the packet
    m = message_of([&] { c->encode(x, &r, p, a.view(po + 16, DType::uint8, wb)); });
    EXPECT_NE(m.find("overlap"), std::string::npos) << spec << ": " << m;
    // residual overlapping the packet
    Tensor r_in_packet = a.view(po, DType::float32, n);
    m = message_of([&] { c->encode(x, &r_in_packet, p, w); });
    EXPECT_NE(m.find("overlap"), std::string::npos) << spec << ": " << m;
    EXPECT_EQ(0, std::memcmp(before.data() + xo, a.base + xo, size_t(4 * n))) << "x was modified";
  }
}

TEST(Guards, DecodeRejectsOutInsidePacket) {
  auto c = Codec::create("fp16");
  const int64_t n = 64;
  std::vector<float> x(n, 1.5f);
  Arena a(4096);
  const int64_t pb = c->packet_bytes(n, DType::float32);
  Tensor p = a.view(0, DType::uint8, pb), w = a.view(2048, DType::uint8, 16);
  c->encode({x.data(), DType::float32, n, {}}, nullptr, p, w);
  const std::vector<uint8_t> packet(a.base, a.base + pb);
  const std::string m = message_of([&] { c->decode(p, a.view(32, DType::float32, n), w); });
  EXPECT_NE(m.find("out"), std::string::npos) << m;
  EXPECT_NE(m.find("overlap"), std::string::npos) << m;
  EXPECT_EQ(0, std::memcmp(packet.data(), a.base, size_t(pb))) << "the packet was written";
}

TEST(Guards, HugeElementCountsRaise) {
  for (const char* spec : {"none", "fp16", "topk:ratio=1", "topk:k=5"}) {
    auto c = Codec::create(spec);
    for (int64_t n : {int64_t(1) << 56, int64_t(1) << 61, INT64_MAX, int64_t(-1)}) {
      const std::string m = message_of([&] { (void)c->packet_bytes(n, DType::float32); });
      EXPECT_NE(m.find(std::to_string(n)), std::string::npos) << spec << " n=" << n << ": " << m;
      EXPECT_NE(m.find("2^56"), std::string::npos) << m;
      EXPECT_THROW((void)c->workspace_bytes(n, DType::float32, {}), InvalidArgument);
    }
    // just below the limit the sizes are exact and positive
    const int64_t n = (int64_t(1) << 56) - 1;
    EXPECT_GT(c->packet_bytes(n, DType::float32), 0) << spec;
    EXPECT_EQ(c->packet_bytes(n, DType::float32) % 16, 0) << spec;
  }
  EXPECT_THROW((void)Codec::create("topk:ratio=1")->main_param(INT64_MAX), InvalidArgument);
}

TEST(Guards, MisalignedElementsAndWorkspaceRaise) {
  auto c = Codec::create("fp16");
  const int64_t n = 16;
  Arena a(1024);
  const int64_t pb = c->packet_bytes(n, DType::float32);
  // float32 x starting 2 bytes into the arena: not aligned to its 4-byte elements
  std::string m = message_of([&] { c->encode(a.view(2, DType::float32, n), nullptr, a.view(256, DType::uint8, pb), a.view(512, DType::uint8, 16)); });
  EXPECT_NE(m.find("not aligned"), std::string::npos) << m;
  c->encode(a.view(0, DType::float32, n), nullptr, a.view(256, DType::uint8, pb), a.view(512, DType::uint8, 16));
  // decode with a workspace that is not 16-byte aligned
  m = message_of([&] { c->decode(a.view(256, DType::uint8, pb), a.view(0, DType::float32, n), a.view(520, DType::uint8, 16)); });
  EXPECT_NE(m.find("workspace address"), std::string::npos) << m;
}
