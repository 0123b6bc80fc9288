// SPDX-License-Identifier: Apache-2.0
// Fused error feedback (docs/contracts.md sections 2-4), for every codec:
//   x' = fl(x + r_old) equals fl(D + r_new) bitwise (finite values that do not overflow the wire;
//   zeros compare by value, since +0 + -0 = +0), r_new = fl(x' - D) where D is sent and x' where
//   top-k sent nothing; with a divisor: y = fl(x' / divisor) is what is encoded and
//   r_new = fl(x' - fl(divisor * D)).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

using gradcomp::Codec;
using gradcomp::DType;
using ref::Input;

namespace {

std::string seed_trace() { return "GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()); }

const char* kSpecs[] = {"none",
                        "fp16",
                        "bf16",
                        "topk:ratio=0.01",
                        "topk:ratio=0.1,value_dtype=float16",
                        "topk:ratio=0.5,value_dtype=bfloat16,index=u64",
                        "topk:k=3,value_dtype=float32",
                        "topk:ratio=1,value_dtype=float16",
                        "topk:k=0"};

bool same_or_both_zero(float a, float b) { return (a == 0.0f && b == 0.0f) || ref::bits(a) == ref::bits(b); }

// One encode with residual; checks the identity and r_new against D from decode.
void ef_step(const Codec& c, const Input& x, std::vector<float>& r, float divisor, const std::string& what) {
  SCOPED_TRACE(what + " | " + c.spec() + " in " + std::string(gradcomp::dtype_name(x.dt)) + " n " +
               std::to_string(x.n()) + " div " + std::to_string(divisor));
  const int64_t n = x.n();
  std::vector<float> xp(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) xp[size_t(i)] = x.at(i) + r[size_t(i)];
  const ref::Encoded e = ref::encode(c, x, &r, divisor);
  const std::vector<float> D = ref::decode_f32(c, e.packet, n);
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 5; ++i) {
    const float d = D[size_t(i)], rn = e.residual[size_t(i)], xpi = xp[size_t(i)];
    const float want_r = divisor == 1.0f ? xpi - d : xpi - divisor * d;
    if (ref::bits(rn) != ref::bits(want_r)) {
      ADD_FAILURE() << "r_new[" << i << "] = " << rn << " want " << want_r << " (x' " << xpi << ", D " << d << ")";
      ++bad;
    }
    if (divisor == 1.0f && !same_or_both_zero(d + rn, xpi)) {
      ADD_FAILURE() << "D + r_new != x' at " << i << ": " << d << " + " << rn << " vs " << xpi;
      ++bad;
    }
  }
  r = e.residual;
}

} // namespace

// Several steps of error feedback with fresh gradients, for every codec and input dtype, at a small
// size and at a threaded size.
TEST(ErrorFeedback, Identity) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 400);
  for (int64_t n : {int64_t(1), int64_t(5), int64_t(1000), (int64_t(1) << 17) + 3}) {
    for (const char* spec : kSpecs) {
      auto c = Codec::create(spec);
      for (DType dt : {DType::float32, DType::float16, DType::bfloat16}) {
        std::vector<float> r = ref::make_values(ref::Dist::normal, n, g);
        for (auto& v : r) v *= 0.1f;
        for (int step = 0; step < 3; ++step) {
          const Input x = Input::from_floats(dt, ref::make_values(step == 1 ? ref::Dist::ties : ref::Dist::normal, n, g));
          ef_step(*c, x, r, 1.0f, "step " + std::to_string(step));
          if (HasFailure()) return;
        }
      }
    }
  }
}

// The identity with values spread over the float32 range that the wire can hold: tiny values
// (float16 subnormals and below, where D may be 0) and values up to the largest float16.
TEST(ErrorFeedback, IdentityWideRange) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 401);
  const int64_t n = 5000;
  for (const char* spec : kSpecs) {
    auto c = Codec::create(spec);
    std::vector<float> xv(static_cast<size_t>(n)), r(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const int e1 = int(g() % 60) - 45, e2 = int(g() % 60) - 45;  // 2^-45 .. 2^14
      xv[size_t(i)] = std::ldexp(float(int64_t(g() % 2000001) - 1000000) / 1e6f, e1);
      r[size_t(i)] = std::ldexp(float(int64_t(g() % 2000001) - 1000000) / 1e6f, e2);
    }
    ef_step(*c, Input::from_floats(DType::float32, xv), r, 1.0f, "wide");
  }
}

// divisor != 1: the wire carries y = fl(x' / divisor) and r_new = fl(x' - fl(divisor * D)).
TEST(ErrorFeedback, Divisor) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 402);
  for (float div : {2.0f, 3.0f, 0.75f, 8.0f, 7.0f}) {
    for (int64_t n : {int64_t(7), int64_t(1000), (int64_t(1) << 16) + 7}) {
      for (const char* spec : kSpecs) {
        auto c = Codec::create(spec);
        for (DType dt : {DType::float32, DType::bfloat16}) {
          std::vector<float> r = ref::make_values(ref::Dist::normal, n, g);
          const Input x = Input::from_floats(dt, ref::make_values(ref::Dist::normal, n, g));
          std::vector<float> r0 = r;
          ef_step(*c, x, r, div, "divisor");
          // the wire values are the rounded quotients
          const std::string s = spec;
          const ref::Encoded e = ref::encode(*c, x, &r0, div);
          const int64_t k = c->main_param(n);
          if (s.rfind("topk", 0) == 0) {
            const DType vdt = s.find("value_dtype=float16") != std::string::npos    ? DType::float16
                              : s.find("value_dtype=bfloat16") != std::string::npos ? DType::bfloat16
                              : s.find("value_dtype=float32") != std::string::npos  ? DType::float32
                                                                                    : dt;
            const DType idt = s.find("u64") != std::string::npos ? DType::uint64 : DType::uint32;
            const int64_t voff = 32 + ref::align16(k * gradcomp::dtype_size(idt));
            for (int64_t j = 0; j < k; ++j) {
              const uint64_t i = ref::load_index(e.packet.data() + 32, idt, j);
              ASSERT_LT(i, uint64_t(n));
              const float y = (x.at(int64_t(i)) + r0[i]) / div;
              ASSERT_EQ(ref::load_value_bits(e.packet.data() + voff, vdt, j), ref::to_dtype_bits(vdt, y))
                  << spec << " entry " << j;
            }
          } else {
            const DType w = s == "fp16" ? DType::float16 : s == "bf16" ? DType::bfloat16 : dt;
            for (int64_t i = 0; i < n; ++i) {
              const float y = (x.at(i) + r0[size_t(i)]) / div;
              ASSERT_EQ(ref::load_value_bits(e.packet.data() + 32, w, i), ref::to_dtype_bits(w, y)) << spec << " " << i;
            }
          }
          if (HasFailure()) return;
        }
      }
    }
  }
}

// Without a residual the same packet comes out as with a zero residual (x' = x), and a zero
// residual yields r_new = x - D.
TEST(ErrorFeedback, NoResidualMatchesZeroResidual) {
  std::mt19937_64 g(ref::test_seed() + 403);
  const int64_t n = 3000;
  for (const char* spec : kSpecs) {
    auto c = Codec::create(spec);
    const Input x = Input::from_floats(DType::float32, ref::make_values(ref::Dist::normal, n, g));
    std::vector<float> z(size_t(n), 0.0f);
    const ref::Encoded a = ref::encode(*c, x, nullptr);
    const ref::Encoded b = ref::encode(*c, x, &z);
    ASSERT_EQ(a.packet_bytes, b.packet_bytes);
    EXPECT_EQ(std::memcmp(a.packet.data(), b.packet.data(), size_t(a.packet_bytes)), 0) << spec;
  }
}
