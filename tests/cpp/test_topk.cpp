// SPDX-License-Identifier: Apache-2.0
// Top-k against a plain reference (std::stable_sort by (|y| desc, NaN above +inf, index asc)), over
// the input dtypes, value dtypes and index widths, fresh random inputs of several distributions,
// the docs/contracts.md section-7 edge set, and sizes that take the multi-threaded, candidate-buffer,
// no-buffer, three-level and early-stop paths of the CPU radix select. Packets must be byte for
// byte identical for every thread count.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

using gradcomp::Codec;
using gradcomp::DecodeMode;
using gradcomp::DType;
using ref::Dist;
using ref::Input;

namespace {

std::string seed_trace() { return "GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()); }

DType value_dtype_of(const std::string& spec, DType in) {
  if (spec.find("value_dtype=float32") != std::string::npos) return DType::float32;
  if (spec.find("value_dtype=float16") != std::string::npos) return DType::float16;
  if (spec.find("value_dtype=bfloat16") != std::string::npos) return DType::bfloat16;
  return in;
}
DType index_dtype_of(const std::string& spec, int64_t n) {
  return spec.find("index=u64") != std::string::npos || n > (int64_t(1) << 32) ? DType::uint64 : DType::uint32;
}

// Encode x (with residual r and divisor) and check the packet, the residual and a decode against
// the reference. Returns the encoded packet for further comparisons.
ref::Encoded check_topk(const Codec& c, const Input& x, const std::vector<float>* r, float divisor,
                        const std::string& what) {
  SCOPED_TRACE(what + " | " + c.spec() + " | in " + std::string(gradcomp::dtype_name(x.dt)) + " n " +
               std::to_string(x.n()) + (r ? " +residual" : "") + " div " + std::to_string(divisor));
  const int64_t n = x.n();
  const DType vdt = value_dtype_of(c.spec(), x.dt);
  const DType idt = index_dtype_of(c.spec(), n);
  const int64_t k = c.main_param(n);
  const int64_t isz = gradcomp::dtype_size(idt), vsz = gradcomp::dtype_size(vdt);
  const int64_t voff = 32 + ref::align16(k * isz);
  const int64_t total = voff + ref::align16(k * vsz);

  ref::Encoded e = ref::encode(c, x, r, divisor);
  const ref::TopKRef want = ref::topk_ref(x, r, divisor, k, vdt);
  EXPECT_EQ(e.packet_bytes, total);
  const uint8_t* p = e.packet.data();
  const gradcomp::PacketHeader h = ref::header_of(p);
  EXPECT_EQ(h.magic, gradcomp::kPacketMagic);
  EXPECT_EQ(h.version, 1);
  EXPECT_EQ(h.codec_id, uint16_t(gradcomp::CodecId::topk));
  EXPECT_EQ(h.input_dtype, uint8_t(x.dt));
  EXPECT_EQ(h.wire_dtype, uint8_t(vdt));
  EXPECT_EQ(h.index_dtype, uint8_t(idt));
  EXPECT_EQ(h.flags, want.nonfinite ? 1 : 0);
  EXPECT_EQ(h.spec_hash, gradcomp::fnv1a32(c.spec()));
  EXPECT_EQ(h.numel, uint64_t(n));
  EXPECT_EQ(h.main_param, uint64_t(k));

  int64_t bad = 0;
  for (int64_t j = 0; j < k && bad < 5; ++j) {
    const uint64_t gi = ref::load_index(p + 32, idt, j);
    if (gi != want.idx[size_t(j)]) {
      ADD_FAILURE() << "index " << j << ": got " << gi << " want " << want.idx[size_t(j)];
      ++bad;
    }
    const uint32_t gv = ref::load_value_bits(p + voff, vdt, j);
    const uint32_t wv = want.vals[size_t(j)];
    const bool ok = vdt == DType::float32 ? ref::same_f32(ref::from_bits(gv), ref::from_bits(wv)) : gv == wv;
    if (!ok) {
      ADD_FAILURE() << "value " << j << " (index " << want.idx[size_t(j)] << "): got 0x" << std::hex << gv
                    << " want 0x" << wv << std::dec;
      ++bad;
    }
  }
  for (int64_t b = 32 + k * isz; b < voff; ++b) EXPECT_EQ(p[b], 0) << "index padding byte " << b;
  for (int64_t b = voff + k * vsz; b < total; ++b) EXPECT_EQ(p[b], 0) << "value padding byte " << b;
  if (r) {
    int64_t rb = 0;
    for (int64_t i = 0; i < n && rb < 5; ++i)
      if (!ref::same_f32(e.residual[size_t(i)], want.r_new[size_t(i)])) {
        ADD_FAILURE() << "residual " << i << ": got " << e.residual[size_t(i)] << " (0x" << std::hex
                      << ref::bits(e.residual[size_t(i)]) << ") want " << want.r_new[size_t(i)] << " (0x"
                      << ref::bits(want.r_new[size_t(i)]) << std::dec << ")";
        ++rb;
      }
  }
  // decode (assign, alpha 1) into float32: D at the sent indices, +0 elsewhere, NaN in out[0] if flagged
  uint32_t status = 0;
  std::vector<float> out = ref::decode_f32(c, e.packet, n, &status);
  EXPECT_EQ(status, want.nonfinite ? gradcomp::kStatusNonFinite : 0u);
  std::vector<float> dec(size_t(n), 0.0f);
  for (int64_t j = 0; j < k; ++j) dec[want.idx[size_t(j)]] = ref::from_dtype_bits(vdt, want.vals[size_t(j)]);
  if (want.nonfinite && n > 0) dec[0] = NAN;
  int64_t db = 0;
  for (int64_t i = 0; i < n && db < 5; ++i) {
    const bool ok = (i == 0 && want.nonfinite) ? std::isnan(out[0]) : ref::same_f32(out[size_t(i)], dec[size_t(i)]);
    if (!ok) {
      ADD_FAILURE() << "decoded " << i << ": got " << out[size_t(i)] << " want " << dec[size_t(i)];
      ++db;
    }
  }
  return e;
}

std::vector<float> residual_for(int64_t n, std::mt19937_64& g) {
  std::vector<float> r(static_cast<size_t>(n));
  std::normal_distribution<float> nd(0.0f, 0.3f);
  for (auto& v : r) v = nd(g);
  return r;
}

const std::vector<std::string>& small_specs() {
  static const std::vector<std::string> s = [] {
    std::vector<std::string> out;
    for (const char* k : {"k=0", "k=1", "k=3", "ratio=0.01", "ratio=0.5", "ratio=0.99", "ratio=1", "k=100000"})
      for (const char* v : {"", ",value_dtype=float32", ",value_dtype=float16", ",value_dtype=bfloat16"})
        for (const char* ix : {"", ",index=u64"}) out.push_back(std::string("topk:") + k + ix + v);
    return out;
  }();
  return s;
}

} // namespace

// Every small size of the edge set, every spec variant, every distribution, three input dtypes.
TEST(TopK, SmallSweep) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 100);
  const int64_t sizes[] = {0, 1, 2, 7, 15, 16, 17, 31, 33, 255, 257, 1023, 1025};
  const Dist dists[] = {Dist::normal, Dist::ties, Dist::constant, Dist::zeros, Dist::wide, Dist::outlier,
                        Dist::specials};
  int iter = 0;
  for (const auto& spec : small_specs()) {
    auto c = Codec::create(spec);
    for (int64_t n : sizes) {
      for (Dist d : dists) {
        for (DType dt : {DType::float32, DType::float16, DType::bfloat16}) {
          const Input x = Input::from_floats(dt, ref::make_values(d, n, g));
          const int mode = iter++ % 4;  // rotate: plain, residual, divisor, residual + divisor
          std::vector<float> r = residual_for(n, g);
          const float div = (mode >= 2) ? 3.0f : 1.0f;
          check_topk(*c, x, (mode & 1) ? &r : nullptr, div, ref::dist_name(d));
          if (HasFailure()) return;
        }
      }
    }
  }
}

// The section-7 edge set, written out.
TEST(TopK, EdgeSet) {
  SCOPED_TRACE(seed_trace());
  const float qnan = std::numeric_limits<float>::quiet_NaN();
  const float inf = INFINITY;
  std::vector<std::pair<std::string, std::vector<float>>> cases = {
      {"all zeros", std::vector<float>(100, 0.0f)},
      {"negative zeros and zeros", {0.0f, -0.0f, 0.0f, -0.0f, -0.0f, 0.0f, -0.0f}},
      {"constant", std::vector<float>(100, 2.5f)},
      {"negative constant", std::vector<float>(100, -2.5f)},
      {"denormals", {ref::from_bits(1), -ref::from_bits(1), ref::from_bits(2), -ref::from_bits(0x7FFFFF),
                     ref::from_bits(0x400000), 0.0f, -0.0f, ref::from_bits(0x7FFFFF), ref::from_bits(0x800000)}},
      {"infinities", {1.0f, inf, -2.0f, -inf, 3.0f, inf, 0.0f}},
      {"nans of both signs", {1.0f, -qnan, 2.0f, qnan, -inf, ref::from_bits(0x7F800001), ref::from_bits(0xFFFFFFFF),
                              inf, -0.0f}},
      {"all nans", {qnan, -qnan, qnan, qnan, -qnan}},
      {"fp16 range", {65504.0f, -65504.0f, 65519.99f, -65520.0f, 65520.0f, 65535.0f, 1e5f, -3e38f, 6e-8f, 3e-8f,
                      2.9802322e-8f, 6.1035156e-5f}},
      {"bf16 negatives", {-1.0f, -3.0078125f, -1e-40f, -3.3895314e38f, -3.4e38f, -0.0f, -1.00390625f, -2.0f}},
  };
  {  // one huge outlier
    std::vector<float> v(1000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = 1e-3f * float(i % 17) - 8e-3f;
    v[617] = 3e38f;
    cases.push_back({"outlier", v});
  }
  for (const auto& [name, v] : cases) {
    for (const auto& spec : small_specs()) {
      auto c = Codec::create(spec);
      for (DType dt : {DType::float32, DType::float16, DType::bfloat16}) {
        const Input x = Input::from_floats(dt, v);
        check_topk(*c, x, nullptr, 1.0f, name);
        std::vector<float> r(v.size(), 0.5f);
        check_topk(*c, x, &r, 1.0f, name + " +0.5");
        if (HasFailure()) return;
      }
    }
  }
}

// float16 / bfloat16 inputs carrying NaN payloads of both signs and infinities.
TEST(TopK, HalfInputsWithSpecialBits) {
  std::vector<uint16_t> hv = {0x3C00, 0x7C01, 0xFE00, 0x7D55, 0xFC00, 0x7C00, 0x8000, 0x0001, 0x8001,
                              0x7BFF, 0xFBFF, 0x03FF, 0xFFFF, 0x3555};
  std::vector<uint16_t> bv = {0x3F80, 0x7F81, 0xFFC0, 0x7FAA, 0xFF80, 0x7F80, 0x8000, 0x0001, 0x8001,
                              0x7F7F, 0xFF7F, 0x007F, 0xFFFF, 0xC2AB};
  for (const auto& spec : small_specs()) {
    auto c = Codec::create(spec);
    Input xh;
    xh.dt = DType::float16;
    xh.h = hv;
    check_topk(*c, xh, nullptr, 1.0f, "float16 specials");
    Input xb;
    xb.dt = DType::bfloat16;
    xb.h = bv;
    check_topk(*c, xb, nullptr, 1.0f, "bfloat16 specials");
    if (HasFailure()) return;
  }
}

// Ties at the threshold go to the lowest index, whatever the thread count.
TEST(TopK, TiesGoToLowestIndex) {
  for (int threads : {1, 2, 3}) {
    ref::Threads t(threads);
    const int64_t n = (int64_t(1) << 17) + 5;
    std::vector<float> v(size_t(n), 1.0f);
    for (int64_t i = 0; i < n; i += 2) v[size_t(i)] = -1.0f;  // |x| all equal
    auto c = Codec::create("topk:k=1000");
    auto e = check_topk(*c, Input::from_floats(DType::float32, v), nullptr, 1.0f, "alternating +-1");
    for (int64_t j = 0; j < 1000; ++j) ASSERT_EQ(ref::load_index(e.packet.data() + 32, DType::uint32, j), uint64_t(j));
  }
}

namespace {

// Check one large case against the reference at 1 thread, then require identical packets and
// residuals at 2 and 3 threads.
void large_case(const std::string& spec, const Input& x, bool residual, float divisor, const std::string& what,
                bool reference = true) {
  SCOPED_TRACE(seed_trace());
  auto c = Codec::create(spec);
  std::mt19937_64 g(ref::test_seed() + uint64_t(x.n()));
  std::vector<float> r = residual_for(x.n(), g);
  ref::Encoded base;
  {
    ref::Threads t(1);
    if (reference) base = check_topk(*c, x, residual ? &r : nullptr, divisor, what);
    else base = ref::encode(*c, x, residual ? &r : nullptr, divisor);
  }
  for (int threads : {2, 3}) {
    ref::Threads t(threads);
    ref::Encoded e = ref::encode(*c, x, residual ? &r : nullptr, divisor);
    ASSERT_EQ(e.packet_bytes, base.packet_bytes);
    EXPECT_EQ(std::memcmp(e.packet.data(), base.packet.data(), size_t(e.packet_bytes)), 0)
        << what << ": packet differs between 1 and " << threads << " threads";
    if (residual)
      EXPECT_EQ(std::memcmp(e.residual.data(), base.residual.data(), e.residual.size() * 4), 0)
          << what << ": residual differs between 1 and " << threads << " threads";
  }
}

Input values(Dist d, DType dt, int64_t n, uint64_t salt) {
  std::mt19937_64 g(ref::test_seed() * 31 + salt);
  return Input::from_floats(dt, ref::make_values(d, n, g));
}

} // namespace

// Normal inputs at 2^17+: two threads, the candidate buffer after the first pass (k = 1%: the
// class of the threshold is small), three radix levels.
TEST(TopKLarge, NormalBuffered) {
  const int64_t n = (int64_t(1) << 17) + 3;
  large_case("topk:ratio=0.01", values(Dist::normal, DType::float32, n, 1), false, 1.0f, "normal 1%");
  large_case("topk:ratio=0.001,index=u64", values(Dist::normal, DType::float32, n, 2), true, 1.0f, "normal 0.1% res");
  large_case("topk:ratio=0.01,value_dtype=bfloat16", values(Dist::normal, DType::float16, n, 3), true, 4.0f,
             "fp16 normal res div");
  large_case("topk:ratio=0.02", values(Dist::normal, DType::bfloat16, n, 4), true, 1.0f, "bf16 normal res");
}

// k = 10% of normal values: the classes are too big for the buffer at the second level.
TEST(TopKLarge, NormalLateBuffer) {
  const int64_t n = (int64_t(1) << 18) - 1;
  large_case("topk:ratio=0.1", values(Dist::normal, DType::float32, n, 5), true, 1.0f, "normal 10%");
  large_case("topk:ratio=0.4,value_dtype=float16", values(Dist::wide, DType::float32, n, 6), false, 1.0f, "wide 40%");
}

// Many ties: the threshold class is far larger than n/16, so no pass can buffer the candidates and
// every pass re-reads the input; the tie is only resolved after all three levels.
TEST(TopKLarge, TiesNoBuffer) {
  const int64_t n = (int64_t(1) << 18) + 1;
  large_case("topk:ratio=0.3", values(Dist::ties, DType::float32, n, 7), false, 1.0f, "ties 30%");
  large_case("topk:ratio=0.01", values(Dist::ties, DType::bfloat16, n, 8), true, 1.0f, "bf16 ties 1% res");
  large_case("topk:k=12345", values(Dist::constant, DType::float32, n, 9), true, 1.0f, "constant");
  large_case("topk:ratio=0.05", values(Dist::zeros, DType::float16, n, 10), true, 1.0f, "zeros");
}

// Early stop: the k largest values are planted, so the class of the k-th key exactly fills k after
// the first pass (all planted values equal) or after the second (the last two differ only in
// mantissa bits of the second digit).
TEST(TopKLarge, EarlyStop) {
  const int64_t n = int64_t(1) << 18;
  const int64_t k = 2621;
  std::mt19937_64 g(ref::test_seed() + 11);
  std::vector<float> v = ref::make_values(Dist::normal, n, g);
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[size_t(i)] = i;
  std::shuffle(pos.begin(), pos.end(), g);
  std::vector<float> a = v;
  for (int64_t j = 0; j < k; ++j) a[size_t(pos[size_t(j)])] = (j % 2) ? 1000.0f : -1000.0f;
  large_case("topk:k=2621", Input::from_floats(DType::float32, a), true, 1.0f, "early stop level 0");
  std::vector<float> b = v;
  for (int64_t j = 0; j < k - 1; ++j) b[size_t(pos[size_t(j)])] = 1000.0f;
  b[size_t(pos[size_t(k - 1)])] = 500.0f;
  b[size_t(pos[size_t(k)])] = -500.25f;
  large_case("topk:k=2621", Input::from_floats(DType::float32, b), false, 1.0f, "early stop level 1");
  // and the planted NaN / inf always win
  std::vector<float> c = v;
  c[size_t(pos[0])] = -std::numeric_limits<float>::quiet_NaN();
  c[size_t(pos[1])] = INFINITY;
  c[size_t(pos[2])] = -INFINITY;
  large_case("topk:k=3", Input::from_floats(DType::float32, c), true, 1.0f, "nan and infs");
  large_case("topk:k=2", Input::from_floats(DType::float32, c), false, 1.0f, "nan and one inf");
  large_case("topk:k=1", Input::from_floats(DType::float32, c), false, 1.0f, "nan");
}

// k = 0 and k >= n on sizes that take the threaded trivial paths.
TEST(TopKLarge, TrivialK) {
  const int64_t n = (int64_t(1) << 17) + 1;
  large_case("topk:k=0", values(Dist::specials, DType::float32, n, 12), true, 1.0f, "k=0");
  large_case("topk:ratio=1,value_dtype=float16", values(Dist::normal, DType::float32, n, 13), true, 1.0f, "k=n");
  large_case("topk:k=99999999", values(Dist::normal, DType::bfloat16, n, 14), true, 2.0f, "k>n");
}

TEST(TopKLarge, Specials) {
  const int64_t n = (int64_t(1) << 17) + 17;
  large_case("topk:ratio=0.2", values(Dist::specials, DType::float32, n, 15), true, 1.0f, "specials");
  large_case("topk:ratio=0.01,value_dtype=float16", values(Dist::outlier, DType::float32, n, 16), true, 1.0f,
             "outlier");
}

// 2^22 elements: one full reference check, then the thread comparison.
TEST(TopKLarge, FourMillion) {
  const int64_t n = int64_t(1) << 22;
  large_case("topk:ratio=0.01", values(Dist::normal, DType::float32, n, 17), true, 1.0f, "2^22 normal 1%");
  large_case("topk:ratio=0.001", values(Dist::ties, DType::float32, n + 1, 18), false, 1.0f, "2^22+1 ties 0.1%",
             false);
}

// The sampled prefilter (n >= 2^18) on inputs built against its strided sample of 16384 elements:
// when the sample is right, when it overestimates the k-th key (fewer than k elements pass: the full
// radix select must take over), and when it underestimates it (the candidates overflow the buffer
// regions). The result must not depend on the sample.
TEST(TopKLarge, SampledPrefilter) {
  const int64_t n = int64_t(1) << 20;
  const int64_t stride = n / 16384;
  std::mt19937_64 g(ref::test_seed() + 19);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& f : v) f = nd(g);
    large_case("topk:ratio=0.01", Input::from_floats(DType::float32, v), true, 1.0f, "prefilter normal 1%");
  }
  {  // the sampled elements are huge, everything else small: far fewer than k pass the guess
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = i % stride == 0 ? 1000.0f + 100.0f * std::fabs(nd(g)) : 1e-2f * nd(g);
    large_case("topk:ratio=0.01", Input::from_floats(DType::float32, v), true, 1.0f, "prefilter overestimate");
  }
  {  // the sample sees mostly tiny values and a few ones, the rest of the input is larger: the
     // guess is too low and the candidates overflow the buffer
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (i % stride == 0) v[size_t(i)] = (i / stride) % 40 == 0 ? 1.0f : 1e-6f * nd(g);
      else v[size_t(i)] = (g() & 1 ? 2.0f : -2.0f) + 0.5f * std::fabs(nd(g));
    }
    large_case("topk:ratio=0.01", Input::from_floats(DType::float32, v), true, 1.0f, "prefilter underestimate");
    large_case("topk:ratio=0.001,value_dtype=float16", Input::from_floats(DType::float32, v), false, 3.0f,
               "prefilter underestimate 0.1% div");
  }
  {  // the large values all in the first half: one thread's region overflows while the total fits
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[size_t(i)] = i < n / 2 ? 5.0f + nd(g) : 1e-3f * nd(g);
    for (int64_t i = 0; i < n; i += stride) v[size_t(i)] = 1e-3f * nd(g);
    for (int64_t i = 0; i < n; i += 40 * stride) v[size_t(i)] = 4.0f;
    large_case("topk:ratio=0.01", Input::from_floats(DType::float32, v), false, 1.0f, "prefilter one-sided");
  }
  {  // non-finite values hidden between the sampled positions
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& f : v) f = nd(g);
    v[1] = std::numeric_limits<float>::quiet_NaN();
    v[size_t(stride + 1)] = -INFINITY;
    v[size_t(n - 1)] = -std::numeric_limits<float>::quiet_NaN();
    large_case("topk:ratio=0.001,value_dtype=bfloat16", Input::from_floats(DType::float32, v), true, 1.0f,
               "prefilter nonfinite");
    large_case("topk:k=2", Input::from_floats(DType::float32, v), true, 1.0f, "prefilter nonfinite k=2");
  }
  {  // ties everywhere with the sample on the threshold value
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& f : v) f = 0.5f * float(int(g() % 7) - 3);
    large_case("topk:ratio=0.2", Input::from_floats(DType::bfloat16, v), true, 1.0f, "prefilter ties bf16");
  }
}
