// The NaN rule of the fixed expressions (kernels/common/math.hpp), which keeps CPU and CUDA
// packets byte-identical: a NaN result is the first NaN operand, else the second, quieted with
// sign and payload kept; an invalid operation on non-NaN operands gives 0xFFC00000. Expected bits
// are written out by hand here.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

using gradcomp::Codec;
using gradcomp::DType;
using gradcomp::Tensor;

namespace {

float f(uint32_t bits) { return ref::from_bits(bits); }
uint32_t u(float v) { return ref::bits(v); }

// Encode one float32 element with a residual through `spec`; return the wire bits and r_new.
struct One {
  uint32_t wire;
  uint32_t residual;
};
One encode_one(const char* spec, uint32_t x, uint32_t r, float divisor) {
  auto c = Codec::create(spec);
  std::vector<float> xs{f(x)}, rs{f(r)};
  alignas(16) uint8_t packet[64] = {};
  const int64_t pb = c->packet_bytes(1, DType::float32);
  const int64_t wb = c->workspace_bytes(1, DType::float32, {});
  std::vector<uint8_t> wraw(size_t(wb) + 16);
  auto* ws = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wraw.data()) + 15) & ~uintptr_t(15));
  Tensor residual{rs.data(), DType::float32, 1, {}};
  c->encode({xs.data(), DType::float32, 1, {}}, &residual, {packet, DType::uint8, pb, {}}, {ws, DType::uint8, wb, {}},
            divisor);
  One o{};
  const int64_t off = std::string(spec).rfind("topk", 0) == 0 ? 48 : 32;  // k = 1: index at 32, value at 48
  if (std::string(spec) == "fp16" || std::string(spec).find("float16") != std::string::npos) {
    uint16_t h;
    std::memcpy(&h, packet + off, 2);
    o.wire = h;
  } else {
    std::memcpy(&o.wire, packet + off, 4);
  }
  o.residual = u(rs[0]);
  return o;
}

} // namespace

TEST(NanRule, FirstNaNOperandKeepsSignAndPayload) {
  // x' = x + r with x a negative quiet NaN: the cast keeps the sign (fp16 0xFE00)
  EXPECT_EQ(encode_one("fp16", 0xFFC00000u, 0, 1.0f).wire, 0xFE00u);
  // signalling NaN with payload, divided by 3: quieted, payload kept
  EXPECT_EQ(encode_one("none", 0x7F800123u, 0, 3.0f).wire, 0x7FC00123u);
  // both operands NaN: the first (x) wins
  EXPECT_EQ(encode_one("none", 0xFFC00001u, 0x7FC00002u, 1.0f).wire, 0xFFC00001u);
  // only the residual is NaN: it is the result
  EXPECT_EQ(encode_one("none", u(1.0f), 0x7F800042u, 1.0f).wire, 0x7FC00042u);
  // the same through top-k (value_dtype float32)
  EXPECT_EQ(encode_one("topk:k=1", 0x7F800123u, 0, 3.0f).wire, 0x7FC00123u);
}

TEST(NanRule, InvalidOperationGivesNegativeDefaultNaN) {
  // x = +inf, r = -inf: x' = inf - inf is invalid -> 0xFFC00000; fp16 keeps the sign: 0xFE00
  const One a = encode_one("fp16", 0x7F800000u, 0xFF800000u, 1.0f);
  EXPECT_EQ(a.wire, 0xFE00u);
  EXPECT_EQ(a.residual, 0xFFC00000u);  // r_new = x' - D = NaN - NaN: x' (first operand) wins
  // x = +inf, no NaN anywhere until r_new = fl(x' - D) = inf - inf -> 0xFFC00000
  const One b = encode_one("none", 0x7F800000u, 0, 1.0f);
  EXPECT_EQ(b.wire, 0x7F800000u);
  EXPECT_EQ(b.residual, 0xFFC00000u);
}

TEST(NanRule, FlaggedPacketDecodesNaNIntoOutZero) {
  auto c = Codec::create("none");
  std::vector<float> x{f(0xFFC00005u), 2.0f};
  alignas(16) uint8_t packet[64] = {};
  alignas(16) uint8_t ws[64] = {};
  c->encode({x.data(), DType::float32, 2, {}}, nullptr, {packet, DType::uint8, 48, {}}, {ws, DType::uint8, 64, {}});
  std::vector<float> out{1.0f, 1.0f};
  c->decode({packet, DType::uint8, 48, {}}, {out.data(), DType::float32, 2, {}}, {ws, DType::uint8, 64, {}},
            gradcomp::DecodeMode::accumulate, 0.5f);
  // decode writes NaN into out[0] for a flagged packet: the canonical quiet NaN
  EXPECT_TRUE(out[0] != out[0]);
  EXPECT_EQ(u(out[1]), u(2.0f));  // 1 + 2 * 0.5
}
