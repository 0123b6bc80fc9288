// SPDX-License-Identifier: Apache-2.0
// The element math of the block quantizers (kernels/common/quant.hpp) against references written
// here from the definitions: float8 conversion by a search over all codes (nearest value, ties to
// the even code, the code above the largest finite value standing for NaN (e4m3fn) or inf (e5m2)),
// the e8m0 scale rule in float64 (frexp), rounding to an integer with std::nearbyint, the exact
// decoding of every code; then fp8/int8/int4 packets of the codec against a plain-loop reference.
#include <gtest/gtest.h>

#include <cfenv>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/quant.hpp"
#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

namespace c = gradcomp::common;

namespace {

// value of a float8 magnitude code (no sign), from the definition
double fp8_value(int code, int M, int bias) {
  const int e = code >> M, m = code & ((1 << M) - 1);
  return e == 0 ? std::ldexp(double(m), 1 - bias - M) : std::ldexp(1.0 + double(m) / (1 << M), e - bias);
}

// reference conversion: the nearest of the codes 0..top (top = the first non-finite code, valued as
// the next point of the grid), ties to the even code; beyond the grid's last point: the top code
uint8_t ref_fp8(float v, int M, int bias, int top, uint8_t nan_code) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  if (std::isnan(v)) return uint8_t(sign | nan_code);
  const double a = std::fabs(double(v));
  int best = 0;
  double bd = a;
  for (int code = 1; code <= top; ++code) {
    const double d = std::fabs(a - fp8_value(code, M, bias));
    if (d < bd || (d == bd && (code % 2 == 0))) {
      bd = d;
      best = code;
    }
  }
  if (a > fp8_value(top, M, bias)) best = top;
  return uint8_t(sign | best);
}
uint8_t ref_e4m3fn(float v) { return std::isinf(v) ? uint8_t((std::signbit(v) ? 0x80 : 0) | 0x7F) : ref_fp8(v, 3, 7, 0x7F, 0x7F); }
uint8_t ref_e5m2(float v) { return ref_fp8(v, 2, 15, 0x7C, 0x7E); }

std::vector<float> probe_values() {
  std::vector<float> v = {0.0f, -0.0f, 448.0f, 449.0f, 463.99997f, 464.0f, 464.00003f, 465.0f, 479.0f, 480.0f, 481.0f,
                          1e6f, -464.0f, -465.0f, 57344.0f, 57345.0f, 61439.996f, 61440.0f, 61440.004f, 65536.0f,
                          -61440.0f, 1e30f, std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::min(), 1e-40f, -1e-40f};
  // every value near every code's midpoints, in both formats
  for (int M : {3, 2}) {
    const int bias = M == 3 ? 7 : 15;
    for (int code = 0; code < (M == 3 ? 127 : 124); ++code) {
      const float lo = float(fp8_value(code, M, bias)), hi = float(fp8_value(code + 1, M, bias));
      const float mid = float((double(lo) + double(hi)) / 2);
      for (float x : {lo, hi, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
        v.push_back(x);
        v.push_back(-x);
      }
    }
  }
  return v;
}

} // namespace

TEST(Fp8Convert, MatchesTheCodeSearch) {
  std::vector<float> vals = probe_values();
  std::mt19937_64 g(ref::test_seed());
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = uint32_t(g());
    // bias towards the formats' ranges: exponents 2^-30 .. 2^20
    const uint32_t e = 97u + uint32_t(g() % 51u);
    vals.push_back(ref::from_bits((u & 0x807FFFFFu) | (e << 23)));
    vals.push_back(ref::from_bits(u));
  }
  vals.push_back(ref::from_bits(0x7FC00001u));
  vals.push_back(ref::from_bits(0xFFA00000u));
  int bad = 0;
  for (float v : vals) {
    const uint8_t a = c::float_to_e4m3fn(v), b = ref_e4m3fn(v);
    const uint8_t x = c::float_to_e5m2(v), y = ref_e5m2(v);
    if ((a != b || x != y) && bad++ < 10)
      ADD_FAILURE() << "v=" << v << " (0x" << std::hex << ref::bits(v) << "): e4m3fn 0x" << int(a) << " want 0x"
                    << int(b) << ", e5m2 0x" << int(x) << " want 0x" << int(y);
  }
  // the boundaries of the issue, spelled out
  EXPECT_EQ(c::float_to_e4m3fn(448.0f), 0x7E);
  EXPECT_EQ(c::float_to_e4m3fn(464.0f), 0x7E);  // tie to even
  EXPECT_EQ(c::float_to_e4m3fn(465.0f), 0x7F);  // NaN
  EXPECT_EQ(c::float_to_e4m3fn(-std::numeric_limits<float>::infinity()), 0xFF);
  EXPECT_EQ(c::float_to_e5m2(57344.0f), 0x7B);
  EXPECT_EQ(c::float_to_e5m2(61440.0f), 0x7C);  // tie to even: inf
  EXPECT_EQ(c::float_to_e5m2(-std::numeric_limits<float>::quiet_NaN()), 0xFE);
  EXPECT_EQ(c::float_to_e4m3fn(-0.0f), 0x80);
  EXPECT_EQ(c::float_to_e4m3fn(0.001953125f), 0x01);  // the smallest subnormal, 2^-9
  EXPECT_EQ(c::float_to_e4m3fn(0.0009765625f), 0x00);  // half of it: tie to even (zero)
}

TEST(Fp8Convert, DecodesEveryCodeExactly) {
  for (int code = 0; code < 256; ++code) {
    const int mag = code & 0x7F;
    const double sign = code & 0x80 ? -1.0 : 1.0;
    const float a = c::e4m3fn_to_float(uint8_t(code));
    if (mag == 0x7F) EXPECT_TRUE(std::isnan(a) && std::signbit(a) == bool(code & 0x80)) << code;
    else EXPECT_EQ(double(a), sign * fp8_value(mag, 3, 7)) << code;
    const float b = c::e5m2_to_float(uint8_t(code));
    if (mag == 0x7C) EXPECT_TRUE(std::isinf(b) && std::signbit(b) == bool(code & 0x80)) << code;
    else if (mag > 0x7C) EXPECT_TRUE(std::isnan(b)) << code;
    else EXPECT_EQ(double(b), sign * fp8_value(mag, 2, 15)) << code;
    // every finite code converts back to itself
    if (mag < 0x7F) EXPECT_EQ(c::float_to_e4m3fn(a), uint8_t(code)) << code;
    if (mag < 0x7C) EXPECT_EQ(c::float_to_e5m2(b), uint8_t(code)) << code;
  }
}

TEST(BlockScale, Float32AndE8m0Rules) {
  std::mt19937_64 g(ref::test_seed() + 1);
  std::vector<float> amaxes = {0.0f, 1.0f, 448.0f, 448.00003f, 447.99997f, 896.0f, 1e-30f, 1e-38f, 1e-40f, 1e-45f,
                               std::numeric_limits<float>::max(), 3e38f, 5.3e-36f};
  for (int i = 0; i < 20000; ++i) amaxes.push_back(std::fabs(ref::from_bits(uint32_t(g()) & 0x7F7FFFFFu)));
  for (float amax : amaxes) {
    for (float mx : {448.0f, 57344.0f, 127.0f, 7.0f}) {
      // float32: fl(amax / max), 1 for 0, raised to FLT_MIN
      float want = amax == 0.0f ? 1.0f : amax / mx;
      if (want < std::numeric_limits<float>::min()) want = std::numeric_limits<float>::min();
      EXPECT_EQ(ref::bits(c::block_scale(amax, mx)), ref::bits(want)) << amax << " / " << mx;
      // e8m0: 2^ceil(log2 q), q = fl(amax / max), clamped to [2^-127, 2^127]; byte e + 127
      int e = 0;
      if (amax != 0.0f) {
        const float q = amax / mx;
        int k = 0;
        const double f = std::frexp(double(q), &k);  // q = f 2^k, f in [0.5, 1)
        e = q == 0.0f ? -127 : f == 0.5 ? k - 1 : k;  // q underflowed to 0: log2 is -inf, clamped
        e = std::clamp(e, -127, 127);
      }
      const uint8_t byte = c::block_scale_e8m0(amax, mx);
      EXPECT_EQ(int(byte), e + 127) << amax << " / " << mx;
      EXPECT_EQ(double(c::e8m0_to_float(byte)), std::ldexp(1.0, e));
    }
  }
  EXPECT_EQ(c::block_scale_e8m0(0.0f, 448.0f), 127);  // an all-zero block: d = 1, never byte 0
  EXPECT_TRUE(std::isnan(c::e8m0_to_float(255)));
}

TEST(RoundHalfEven, MatchesNearbyint) {
  ASSERT_EQ(std::fegetround(), FE_TONEAREST);
  std::mt19937_64 g(ref::test_seed() + 2);
  std::uniform_real_distribution<float> u(-200.0f, 200.0f);
  std::vector<float> v = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, 127.5f, -127.5f, 0.49999997f, 7.5f, 6.5f};
  for (int i = 0; i < 100000; ++i) v.push_back(u(g));
  for (float q : v) EXPECT_EQ(c::round_half_even(q), std::nearbyint(q)) << q;
}

// ---- packets of the codec against a plain loop ----------------------------------------------------------
namespace {
struct QRef {
  std::vector<uint8_t> codes;   // one byte per element (int4: the nibble value, sign-extended byte)
  std::vector<float> scales;
  std::vector<uint8_t> scale_bytes;
  std::vector<float> residual, decoded;
};
QRef quant_ref(const std::string& kind, bool e8m0, int64_t B, const ref::Input& x, const std::vector<float>& r0,
               float div) {
  const int64_t n = x.n();
  if (B == 0) B = std::max<int64_t>(n, 1);
  const float mx = kind == "e4m3" ? 448.0f : kind == "e5m2" ? 57344.0f : kind == "int8" ? 127.0f : 7.0f;
  const bool is_int = kind == "int8" || kind == "int4";
  QRef q;
  q.codes.resize(size_t(n));
  q.residual.resize(size_t(n));
  q.decoded.resize(size_t(n));
  for (int64_t b0 = 0; b0 < n; b0 += B) {
    const int64_t b1 = std::min(n, b0 + B);
    std::vector<float> xp, y;
    float amax = 0.0f;
    bool nf = false;
    for (int64_t i = b0; i < b1; ++i) {
      xp.push_back(x.at(i) + r0[size_t(i)]);
      y.push_back(div == 1.0f ? xp.back() : xp.back() / div);
      if (std::isfinite(y.back())) amax = std::max(amax, std::fabs(y.back()));
      else nf = true;
    }
    float d;
    if (is_int && nf) {
      d = std::numeric_limits<float>::quiet_NaN();
    } else if (e8m0) {
      int e = 0;
      if (amax != 0.0f) {
        int k;
        const float qq = amax / mx;
        const double f = std::frexp(double(qq), &k);
        e = qq == 0.0f ? -127 : std::clamp(f == 0.5 ? k - 1 : k, -127, 127);
      }
      d = float(std::ldexp(1.0, e));
      q.scale_bytes.push_back(uint8_t(e + 127));
    } else {
      d = amax == 0.0f ? 1.0f : std::max(amax / mx, std::numeric_limits<float>::min());
    }
    q.scales.push_back(d);
    for (int64_t i = b0; i < b1; ++i) {
      const float yy = y[size_t(i - b0)];
      float val;
      if (is_int) {
        int code = 0;
        if (!nf) code = int(std::clamp(std::nearbyint(yy / d), -mx, mx));
        q.codes[size_t(i)] = uint8_t(int8_t(code));
        val = float(code);
      } else {
        const uint8_t code = kind == "e4m3" ? ref_e4m3fn(yy / d) : ref_e5m2(yy / d);
        q.codes[size_t(i)] = code;
        val = kind == "e4m3" ? c::e4m3fn_to_float(code) : c::e5m2_to_float(code);  // exact (DecodesEveryCodeExactly)
      }
      const float D = val * d;
      q.decoded[size_t(i)] = D;
      const float xpi = xp[size_t(i - b0)];
      q.residual[size_t(i)] = div == 1.0f ? xpi - D : xpi - div * D;
    }
  }
  return q;
}
} // namespace

TEST(BlockQ, PacketsMatchAPlainLoop) {
  std::mt19937_64 g(ref::test_seed() + 3);
  SCOPED_TRACE("seed " + std::to_string(ref::test_seed()));
  struct Spec {
    const char* spec;
    const char* kind;
    bool e8m0;
    int64_t block;
  };
  const Spec specs[] = {{"fp8", "e4m3", false, 128},           {"fp8:format=e5m2", "e5m2", false, 128},
                        {"fp8:scale=e8m0", "e4m3", true, 32},   {"fp8:format=e5m2,scale=e8m0", "e5m2", true, 32},
                        {"fp8:block=0", "e4m3", false, 0},      {"fp8:block=5", "e4m3", false, 5},
                        {"int8", "int8", false, 128},           {"int8:block=0", "int8", false, 0},
                        {"int4", "int4", false, 128},           {"int4:block=6", "int4", false, 6},
                        {"fp8:block=3000", "e4m3", false, 3000}, {"int8:block=2500", "int8", false, 2500}};
  for (const Spec& s : specs) {
    auto codec = gradcomp::Codec::create(s.spec);
    for (gradcomp::DType dt : {gradcomp::DType::float32, gradcomp::DType::bfloat16}) {
      for (int64_t n : {int64_t(1), int64_t(7), int64_t(13), int64_t(1000), int64_t(70001)}) {
        for (float div : {1.0f, 3.0f}) {
          SCOPED_TRACE(std::string(s.spec) + " n " + std::to_string(n) + " div " + std::to_string(div));
          std::vector<float> v = ref::make_values(ref::Dist::wide, n, g);
          if (n > 20) {  // edge blocks: zeros, denormals, 1e-40, one inf, a NaN
            for (int64_t i = 0; i < std::min<int64_t>(n, 8); ++i) v[size_t(i)] = 0.0f;
            v[10] = 1e-40f;
            v[n / 2] = std::numeric_limits<float>::infinity();
            v[n - 1] = -std::numeric_limits<float>::quiet_NaN();
          }
          const ref::Input x = ref::Input::from_floats(dt, v);
          std::vector<float> r0(static_cast<size_t>(n));
          std::normal_distribution<float> nd(0.0f, 0.01f);
          for (auto& f : r0) f = nd(g);
          const QRef want = quant_ref(s.kind, s.e8m0, s.block, x, r0, div);
          ref::Encoded e = ref::encode(*codec, x, &r0, div);
          const gradcomp::PacketLayout l = codec->layout(n, dt);
          const uint8_t* codes = e.packet.data() + l.sections[0].offset;
          const uint8_t* scales = e.packet.data() + l.sections[1].offset;
          for (int64_t i = 0; i < n; ++i) {
            uint8_t got;
            if (std::string(s.kind) == "int4") {  // two codes per byte: only n/2 bytes exist
              const int nib = (i & 1) ? codes[i / 2] >> 4 : codes[i / 2] & 15;
              got = uint8_t(int8_t(nib & 8 ? nib - 16 : nib));
            } else {
              got = codes[i];
            }
            ASSERT_EQ(int(got), int(want.codes[size_t(i)])) << "code " << i << " of " << v[size_t(i)];
            ASSERT_TRUE(ref::same_f32(e.residual[size_t(i)], want.residual[size_t(i)])) << "residual " << i;
          }
          for (size_t b = 0; b < want.scales.size(); ++b) {
            if (s.e8m0) {
              ASSERT_EQ(int(scales[b]), int(want.scale_bytes[b])) << "scale " << b;
            } else {
              float d;
              std::memcpy(&d, scales + 4 * b, 4);
              ASSERT_TRUE(ref::same_f32(d, want.scales[b])) << "scale " << b;
            }
          }
          const auto dec = ref::decode_f32(*codec, e.packet, n);
          for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(ref::same_f32(dec[size_t(i)], want.decoded[size_t(i)])) << i;
          bool want_flag = false;  // some new residual non-finite (BlockQ.FlagMarksExactly...)
          for (int64_t i = 0; i < n; ++i) want_flag = want_flag || !std::isfinite(want.residual[size_t(i)]);
          if (n > 20) EXPECT_TRUE(want_flag);  // the planted inf and NaN
          EXPECT_EQ(ref::header_of(e.packet.data()).flags, want_flag ? 1 : 0);
        }
      }
    }
  }
}

// The non-finite flag (header bit 0) is set exactly when some new residual x' - divisor * D is not
// finite: x' = x + r non-finite, a decoded value D that overflows (a block whose largest code times
// its scale passes FLT_MAX), or divisor * D overflowing (x = FLT_MAX, divisor 3, e8m0's power of two
// above amax): blocks at and near FLT_MAX, a residual that carries a finite x to infinity, divisors 1
// and 3. An unflagged packet decodes to finite values and leaves finite residuals.
TEST(BlockQ, FlagMarksExactlyTheNonFiniteResiduals) {
  const float M = std::numeric_limits<float>::max();
  struct Spec {
    const char* spec;
    const char* kind;
    bool e8m0;
    int64_t block;
  };
  const Spec specs[] = {{"fp8:block=4", "e4m3", false, 4},        {"fp8:format=e5m2,block=4", "e5m2", false, 4},
                        {"fp8:scale=e8m0", "e4m3", true, 32},       {"fp8:format=e5m2,scale=e8m0", "e5m2", true, 32},
                        {"int8:block=4", "int8", false, 4},         {"int4:block=4", "int4", false, 4}};
  // Each case is one block: its first four values and residuals (the rest zero).
  const std::vector<std::pair<std::vector<float>, std::vector<float>>> cases = {
      {{M, 1.0f, -2.0f, 0.0f}, {0, 0, 0, 0}},
      {{-M, 1.0f, 0.5f, 3.0f}, {0, 0, 0, 0}},
      {{3.0e38f, 1.0f, 0.0f, 0.0f}, {0, 0, 0, 0}},
      {{M / 1.1f, 0.0f, 0.0f, 0.0f}, {0, 0, 0, 0}},
      {{1.7e38f, -1.7e38f, 1.0f, 0.0f}, {0, 0, 0, 0}},
      {{1.0e38f, 2.0f, 0.0f, 0.0f}, {0, 0, 0, 0}},
      {{M, 1.0f, 0.0f, 0.0f}, {M / 2, 0, 0, 0}},  // x' = inf
      {{1.0f, 2.0f, 3.0f, 4.0f}, {0, 0, 0, 0}},
      {{1e-40f, 0.0f, -1e-45f, 0.0f}, {0, 0, 0, 0}}};
  for (const Spec& s : specs) {
    auto codec = gradcomp::Codec::create(s.spec);
    for (const auto& [v4, r4] : cases) {
      std::vector<float> v(v4), r(r4);
      v.resize(size_t(s.block), 0.0f);
      r.resize(size_t(s.block), 0.0f);
      const size_t n = v.size();
      for (float div : {1.0f, 3.0f}) {
        SCOPED_TRACE(std::string(s.spec) + " x0 " + std::to_string(v[0]) + " r0 " + std::to_string(r[0]) + " div " +
                     std::to_string(div));
        const ref::Input x = ref::Input::from_floats(gradcomp::DType::float32, v);
        const QRef want = quant_ref(s.kind, s.e8m0, s.block, x, r, div);
        bool want_flag = false;
        for (size_t i = 0; i < n; ++i)
          want_flag = want_flag || !std::isfinite(v[i] + r[i]) || !std::isfinite(want.decoded[i]) ||
                      !std::isfinite(want.residual[i]);
        ref::Encoded e = ref::encode(*codec, x, &r, div);
        const bool flag = (ref::header_of(e.packet.data()).flags & 1) != 0;
        EXPECT_EQ(flag, want_flag);
        uint32_t status = 0;
        const auto dec = ref::decode_f32(*codec, e.packet, int64_t(n), &status);
        EXPECT_EQ(status != 0, flag);
        if (!flag) {
          for (size_t i = 0; i < n; ++i) {
            EXPECT_TRUE(std::isfinite(dec[i])) << i;
            EXPECT_TRUE(std::isfinite(e.residual[i])) << i;
            EXPECT_TRUE(ref::same_f32(dec[i], want.decoded[i])) << i;
          }
        }
      }
    }
  }
}
