// SPDX-License-Identifier: Apache-2.0
// Codec specs: parsing, canonical form and round trip, error messages, and the top-k k rule
// (docs/contracts.md section 3).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

using gradcomp::Codec;
using gradcomp::DType;
using gradcomp::InvalidArgument;

namespace {

std::string create_error(const std::string& spec) {
  try {
    Codec::create(spec);
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("WRONG EXCEPTION TYPE: ") + e.what();
  }
  return "NO EXCEPTION";
}

bool contains(const std::string& s, const std::string& sub) { return s.find(sub) != std::string::npos; }

} // namespace

TEST(Spec, CanonicalForms) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"topk:ratio=0.01", "topk:ratio=0.01"},
      {"topk:ratio=0.010", "topk:ratio=0.01"},
      {"topk:ratio=1e-2", "topk:ratio=0.01"},
      {"topk:ratio=0.1", "topk:ratio=0.1"},
      {"topk:ratio=5e-1", "topk:ratio=0.5"},
      {"topk:ratio=1", "topk:ratio=1"},
      {"topk:ratio=1.0", "topk:ratio=1"},
      {"topk:ratio=0.30000000000000004", "topk:ratio=0.30000000000000004"},
      {"topk:k=5,index=u64,value_dtype=float16", "topk:k=5,index=u64,value_dtype=float16"},
      {"topk:value_dtype=float16,index=u64,k=5", "topk:k=5,index=u64,value_dtype=float16"},
      {"topk:k=0", "topk:k=0"},
      {"topk:k=007", "topk:k=7"},
      {"topk:ratio=0.25,index=auto,value_dtype=auto", "topk:ratio=0.25"},
      {"topk:ratio=0.25,index=u32", "topk:ratio=0.25,index=u32"},
      {"topk:ratio=0.25,value_dtype=float32", "topk:ratio=0.25,value_dtype=float32"},
      {"topk:ratio=0.25,value_dtype=bfloat16", "topk:ratio=0.25,value_dtype=bfloat16"},
      {"none", "none"},
      {"fp16", "fp16"},
      {"bf16", "bf16"},
  };
  for (const auto& [in, canon] : cases) {
    SCOPED_TRACE(in);
    auto c = Codec::create(in);
    EXPECT_EQ(c->spec(), canon);
    auto c2 = Codec::create(c->spec());
    EXPECT_EQ(c2->spec(), c->spec());
    EXPECT_EQ(c2->spec_hash(), c->spec_hash());
    EXPECT_EQ(c->spec_hash(), gradcomp::fnv1a32(canon));
    EXPECT_EQ(c2->id(), c->id());
  }
}

TEST(Spec, RoundTripRandomRatios) {
  std::mt19937_64 g(ref::test_seed());
  SCOPED_TRACE("seed " + std::to_string(ref::test_seed()));
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int i = 0; i < 2000; ++i) {
    double r = i % 2 ? u(g) : std::ldexp(u(g), -int(g() % 60));
    if (r <= 0) continue;
    char buf[64];
    std::snprintf(buf, sizeof buf, "topk:ratio=%.17g", r);
    auto c = Codec::create(buf);
    const std::string s = c->spec();
    EXPECT_EQ(Codec::create(s)->spec(), s) << buf;
    // the canonical number parses back to exactly r, and no shorter %.{p}g form would
    const std::string num = s.substr(std::string("topk:ratio=").size());
    EXPECT_EQ(std::strtod(num.c_str(), nullptr), r) << buf;
    int digits = 0;
    for (char ch : num) {
      if (ch == 'e') break;
      digits += (ch >= '0' && ch <= '9');
    }
    // leading zeros of fixed notation are not significant digits
    int lead = 0;
    for (char ch : num) {
      if (ch == '0' || ch == '.') ++lead;
      else break;
    }
    if (num.find('e') == std::string::npos) digits -= std::count(num.begin(), num.begin() + lead, '0');
    for (int p = 1; p < digits; ++p) {
      std::snprintf(buf, sizeof buf, "%.*g", p, r);
      EXPECT_NE(std::strtod(buf, nullptr), r) << "a " << p << "-digit form round-trips but spec() gave " << num;
    }
  }
}

TEST(Spec, Properties) {
  EXPECT_TRUE(Codec::create("none")->properties().linear);
  EXPECT_TRUE(Codec::create("fp16")->properties().linear);
  EXPECT_TRUE(Codec::create("bf16")->properties().linear);
  EXPECT_FALSE(Codec::create("topk:ratio=0.1")->properties().linear);
  EXPECT_TRUE(Codec::create("topk:ratio=0.1")->properties().deterministic);
  EXPECT_EQ(Codec::create("none")->id(), gradcomp::CodecId::none);
  EXPECT_EQ(Codec::create("fp16")->id(), gradcomp::CodecId::fp16);
  EXPECT_EQ(Codec::create("bf16")->id(), gradcomp::CodecId::bf16);
  EXPECT_EQ(Codec::create("topk:k=1")->id(), gradcomp::CodecId::topk);
}

// Each bad spec: InvalidArgument whose message names the offending text and says what is accepted.
TEST(Spec, Errors) {
  struct Case {
    std::string spec;
    std::vector<std::string> must_contain;
  };
  const std::vector<Case> cases = {
      {"foo", {"foo", "accepted", "topk", "fp16"}},
      {"topK:ratio=0.1", {"topK", "accepted"}},
      {"", {"expected"}},
      {":ratio=0.1", {"expected"}},
      {"topk:", {"topk:", "expected"}},
      {"topk", {"ratio", "k="}},
      {"topk:ratio=0.1,k=3", {"ratio", "k="}},
      {"topk:ratio=0", {"ratio=0", "accepted", "0 < ratio <= 1"}},
      {"topk:ratio=-0.5", {"-0.5", "accepted", "0 < ratio <= 1"}},
      {"topk:ratio=1.5", {"1.5", "accepted", "0 < ratio <= 1"}},
      {"topk:ratio=1.0000000000000002", {"1.0000000000000002", "accepted"}},
      {"topk:ratio=nan", {"nan", "accepted", "0 < ratio <= 1"}},
      {"topk:ratio=inf", {"inf", "accepted", "0 < ratio <= 1"}},
      {"topk:ratio=abc", {"abc", "accepted"}},
      {"topk:ratio=0.1x", {"0.1x", "accepted"}},
      {"topk:ratio=", {"ratio=", "expected"}},
      {"topk:ratio", {"ratio", "expected"}},
      {"topk:=0.1", {"=0.1", "expected"}},
      {"topk:ratio=0.1,", {"expected"}},
      {"topk:k=-1", {"-1", "accepted", ">= 0"}},
      {"topk:k=1.5", {"1.5", "accepted"}},
      {"topk:k=99999999999999999999999", {"99999999999999999999999", "accepted"}},
      {"topk:ratio=0.1,index=u16", {"u16", "accepted", "u32", "u64", "auto"}},
      {"topk:ratio=0.1,value_dtype=int8", {"int8", "accepted", "float16", "bfloat16"}},
      {"topk:ratio=0.1,value_dtype=float64", {"float64", "accepted"}},
      {"topk:ratio=0.1,foo=1", {"foo", "accepted", "ratio", "value_dtype"}},
      {"topk:ratio=0.1,ratio=0.2", {"ratio", "twice"}},
      {"topk:k=1,k=1", {"'k'", "twice"}},
      {"fp16:ratio=0.1", {"ratio", "accepted"}},
      {"none:x=1", {"x", "accepted"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("spec '" + c.spec + "'");
    const std::string msg = create_error(c.spec);
    EXPECT_FALSE(contains(msg, "NO EXCEPTION") || contains(msg, "WRONG EXCEPTION")) << msg;
    for (const auto& s : c.must_contain) EXPECT_TRUE(contains(msg, s)) << "message lacks '" << s << "': " << msg;
  }
  EXPECT_THROW(gradcomp::set_num_threads(0), InvalidArgument);
  EXPECT_THROW(gradcomp::dtype_from_name("float64"), InvalidArgument);
  EXPECT_EQ(gradcomp::dtype_from_name("bfloat16"), DType::bfloat16);
}

// ---- the k rule -------------------------------------------------------------------------------
namespace {
int64_t k_of_ratio(double ratio, int64_t n) {
  // docs/contracts.md section 3: k = min(n, max(1, ceil(ratio * n))) in binary64
  const double prod = ratio * double(n);
  double k = std::ceil(prod);
  if (k < 1) k = 1;
  if (k > double(n)) k = double(n);
  return int64_t(k);
}
int64_t header_k(const Codec& c, int64_t n) {
  ref::Input x = ref::Input::from_floats(DType::float32, std::vector<float>(size_t(n), 1.0f));
  auto e = ref::encode(c, x, nullptr);
  return int64_t(ref::header_of(e.packet.data()).main_param);
}
} // namespace

TEST(TopKRule, PythonTable) {
  // math.ceil(float(r) * n) in Python, where r * n is an integer in real arithmetic but the
  // binary64 product is not (above or below).
  struct Row {
    const char* r;
    int64_t n, k;
  };
  const Row rows[] = {{"0.07", 100, 8},       {"0.07", 10000, 701},   {"0.07", 100000, 7001},
                      {"0.14", 100, 15},      {"0.14", 10000, 1401},  {"0.14", 100000, 14001},
                      {"0.28", 100, 29},      {"0.28", 10000, 2801},  {"0.28", 100000, 28001},
                      {"0.29", 100, 29},      {"0.29", 100000, 29000}, {"0.57", 100, 57},
                      {"0.57", 10000, 5700},  {"0.57", 100000, 57000}, {"0.58", 100, 58},
                      {"0.58", 100000, 58000}, {"0.035", 10000, 351},  {"0.035", 100000, 3501},
                      {"0.1", 10, 1},         {"0.1", 30, 3},         {"0.01", 1, 1},
                      {"1e-300", 5, 1},       {"1", 7, 7},            {"0.5", 0, 0},
                      {"0.5", 1, 1},          {"0.5", 3, 2}};
  for (const auto& row : rows) {
    auto c = Codec::create(std::string("topk:ratio=") + row.r);
    EXPECT_EQ(c->main_param(row.n), row.k) << "ratio " << row.r << " n " << row.n;
    if (row.n <= 100000) EXPECT_EQ(header_k(*c, row.n), row.k) << "ratio " << row.r << " n " << row.n;
  }
}

TEST(TopKRule, ManyRatiosAndSizes) {
  std::mt19937_64 g(ref::test_seed() + 1);
  SCOPED_TRACE("seed " + std::to_string(ref::test_seed()));
  std::vector<double> ratios = {1e-9, 1e-4, 0.001, 0.01, 0.02, 0.05, 0.07, 0.1, 0.14, 0.2, 0.28, 0.29,
                                0.3, 0.33, 0.5, 0.57, 0.58, 0.7, 0.9, 0.99, 1.0};
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int i = 0; i < 40; ++i) ratios.push_back(u(g) + 1e-12);
  std::vector<int64_t> sizes = {0, 1, 2, 3, 7, 10, 15, 16, 17, 99, 100, 101, 1000, 1023, 1024, 1025,
                                10000, 65535, 65536, 65537, 100000, 1000000, 1 << 24, int64_t(1) << 31,
                                (int64_t(1) << 31) + 64, (int64_t(1) << 32) + 1, int64_t(1e12) + 3};
  for (int i = 0; i < 60; ++i) sizes.push_back(int64_t(g() % 10000000));
  for (double r : ratios) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "topk:ratio=%.17g", r);
    auto c = Codec::create(buf);
    for (int64_t n : sizes) ASSERT_EQ(c->main_param(n), k_of_ratio(r, n)) << buf << " n " << n;
  }
}

TEST(TopKRule, ExplicitK) {
  for (int64_t k : {0, 1, 5, 64, 1000}) {
    auto c = Codec::create("topk:k=" + std::to_string(k));
    for (int64_t n : {0, 1, 4, 5, 6, 64, 999, 1000, 1001, 100000}) {
      EXPECT_EQ(c->main_param(n), std::min(k, n)) << "k " << k << " n " << n;
      if (n <= 1001) EXPECT_EQ(header_k(*c, n), std::min(k, n));
    }
  }
  // k = 0 only through k=0: the smallest ratio still sends one element of a non-empty tensor.
  auto tiny = Codec::create("topk:ratio=4.9406564584124654e-324");
  EXPECT_EQ(tiny->main_param(1), 1);
  EXPECT_EQ(tiny->main_param(int64_t(1) << 40), 1);
  EXPECT_EQ(tiny->main_param(0), 0);
}

TEST(TopKRule, PacketBytes) {
  // header + align16(k * index bytes) + align16(k * value bytes)
  for (const char* spec : {"topk:ratio=0.01", "topk:k=7,index=u64", "topk:ratio=0.3,value_dtype=bfloat16",
                           "topk:k=3,value_dtype=float32", "topk:k=0"}) {
    auto c = Codec::create(spec);
    for (DType dt : {DType::float32, DType::float16, DType::bfloat16}) {
      for (int64_t n : {0, 1, 5, 7, 100, 1001, 65537}) {
        const int64_t k = c->main_param(n);
        const int64_t isz = std::string(spec).find("u64") != std::string::npos ? 8 : 4;
        int64_t vsz = ref::esize(dt);
        if (std::string(spec).find("float32") != std::string::npos) vsz = 4;
        if (std::string(spec).find("bfloat16") != std::string::npos) vsz = 2;
        const int64_t want = 32 + ref::align16(k * isz) + ref::align16(k * vsz);
        EXPECT_EQ(c->packet_bytes(n, dt), want) << spec << " n " << n;
        EXPECT_EQ(c->packet_bytes(n, dt) % 16, 0);
        EXPECT_GE(c->workspace_bytes(n, dt, {}), 16);
      }
    }
  }
  // above 2^32 elements automatic indices are 64-bit; index=u32 refuses such sizes
  auto c = Codec::create("topk:k=1");
  EXPECT_EQ(c->packet_bytes((int64_t(1) << 32), DType::float32), 32 + 16 + 16);
  EXPECT_EQ(c->packet_bytes((int64_t(1) << 32) + 1, DType::float32), 32 + 16 + 16);
  auto c3 = Codec::create("topk:k=3");
  EXPECT_EQ(c3->packet_bytes((int64_t(1) << 32), DType::float32), 32 + 16 + 16);
  EXPECT_EQ(c3->packet_bytes((int64_t(1) << 32) + 1, DType::float32), 32 + 32 + 16);
  EXPECT_THROW(Codec::create("topk:k=3,index=u32")->packet_bytes((int64_t(1) << 32) + 1, DType::float32),
               InvalidArgument);
  // casts: header + align16(n * wire bytes)
  for (int64_t n : {0, 1, 7, 8, 1000}) {
    EXPECT_EQ(Codec::create("none")->packet_bytes(n, DType::float32), 32 + ref::align16(n * 4));
    EXPECT_EQ(Codec::create("none")->packet_bytes(n, DType::bfloat16), 32 + ref::align16(n * 2));
    EXPECT_EQ(Codec::create("fp16")->packet_bytes(n, DType::float32), 32 + ref::align16(n * 2));
    EXPECT_EQ(Codec::create("bf16")->packet_bytes(n, DType::float16), 32 + ref::align16(n * 2));
  }
}

TEST(Spec, BuildInfo) {
  const gradcomp::BuildInfo b = gradcomp::build_info();
  EXPECT_FALSE(b.version.empty());
#if defined(_OPENMP)
  EXPECT_TRUE(b.openmp);
#endif
#if !defined(GRADCOMP_WITH_CUDA)
  EXPECT_FALSE(b.cuda);
  EXPECT_THROW(Codec::create("topk:k=1")->workspace_bytes(10, DType::float32, {gradcomp::DeviceKind::cuda, 0}),
               gradcomp::Unsupported);
  ref::Bytes ws(16);
  gradcomp::Tensor w = ws.tensor();
  w.device = {gradcomp::DeviceKind::cuda, 0};
  EXPECT_THROW(gradcomp::read_status(w), gradcomp::Unsupported);
#endif
}

// What each spec message says is wrong (issue: integers only too large, numbers out of binary64's
// range, a leading '+', NUL bytes, huge specs).
TEST(Spec, MessagesSayWhatIsWrong) {
  std::string m = create_error("topk:k=99999999999999999999999");
  EXPECT_TRUE(contains(m, "does not fit a 64-bit integer")) << m;
  EXPECT_FALSE(contains(m, "is not an integer")) << m;
  m = create_error("topk:ratio=1e-400");
  EXPECT_TRUE(contains(m, "1e-400") && contains(m, "underflows to 0") && contains(m, "0 < ratio <= 1")) << m;
  EXPECT_FALSE(contains(m, "not a finite number")) << m;
  m = create_error("topk:ratio=1e400");
  EXPECT_TRUE(contains(m, "overflows to infinity")) << m;
  m = create_error("topk:ratio=abc");
  EXPECT_TRUE(contains(m, "'abc' is not a number")) << m;
  m = create_error("topk:k=1.5");
  EXPECT_TRUE(contains(m, "'1.5' is not an integer")) << m;
  // a leading '+' is a number: accepted, and dropped from the canonical spec
  EXPECT_EQ(Codec::create("topk:ratio=+0.5")->spec(), "topk:ratio=0.5");
  EXPECT_EQ(Codec::create("topk:k=+7")->spec(), "topk:k=7");
  EXPECT_TRUE(contains(create_error("topk:ratio=++0.5"), "is not a number"));
  EXPECT_TRUE(contains(create_error("topk:ratio=+-0.5"), "is not a number"));
  // a NUL byte is shown escaped and the reason follows it
  m = create_error(std::string("topk:ratio=0.1\0x", 16));
  EXPECT_TRUE(contains(m, "0.1\\x00x") && contains(m, "is not a number")) << m;
  m = create_error(std::string("to\0pk", 5));
  EXPECT_TRUE(contains(m, "to\\x00pk") && contains(m, "accepted codecs")) << m;
  // a 1 MB spec is not echoed whole
  m = create_error("topk:ratio=0.1,x=" + std::string(1 << 20, 'y'));
  EXPECT_LT(m.size(), 800u) << m.size();
  EXPECT_TRUE(contains(m, "(1048593 bytes)") && contains(m, "unknown key")) << m.substr(0, 300);
  m = create_error(std::string(1 << 20, 'z'));
  EXPECT_LT(m.size(), 800u);
  EXPECT_TRUE(contains(m, "unknown codec")) << m.substr(0, 300);
}

TEST(Spec, ThreadCountRange) {
  EXPECT_THROW(gradcomp::set_num_threads(0), InvalidArgument);
  EXPECT_THROW(gradcomp::set_num_threads(gradcomp::kMaxThreads + 1), InvalidArgument);
  try {
    gradcomp::set_num_threads(100000);
    ADD_FAILURE() << "no exception";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(contains(e.what(), "100000") && contains(e.what(), "[1, 1024]")) << e.what();
  }
  const int old = gradcomp::get_num_threads();
  gradcomp::set_num_threads(gradcomp::kMaxThreads);
  EXPECT_EQ(gradcomp::get_num_threads(), gradcomp::kMaxThreads);
  gradcomp::set_num_threads(old);
}
