// SPDX-License-Identifier: Apache-2.0
// The CPU kernel variants (kernels/cpu/isa.hpp: avx512 / avx2 / generic, chosen at run time) give
// byte-identical packets, residuals and decoded values (float32, and the input dtype with alpha and
// accumulate) for every registered codec example and input dtype, over normal, wide, outlier,
// special-value and tied inputs, divisors 1 and 3, with and without a residual, and on sizes that
// reach the vector loops and the prefilter of top-k. Only the variants this
// processor runs are compared; the test says which.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "ref.hpp"

namespace {

struct IsaScope {
  std::string old = gradcomp::cpu_isa();
  ~IsaScope() { gradcomp::set_cpu_isa(old); }
};

} // namespace

TEST(CpuIsa, VariantsGiveIdenticalPackets) {
  const auto isas = gradcomp::cpu_isas_supported();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(gradcomp::cpu_isa(), isas.front()) << "the best supported variant runs by default";
  std::cout << "CPU kernel variants compared:";
  for (const auto& i : isas) std::cout << " " << i;
  std::cout << " (built: " << gradcomp::build_info().cpu_variants << ")\n";
  IsaScope scope;
  std::mt19937_64 g(ref::test_seed());
  SCOPED_TRACE("seed " + std::to_string(ref::test_seed()));
  // Small inputs over every distribution (specials: NaN, inf, denormals, -0), divisor 1 and 3,
  // with and without a residual; a large one (vector loops, OpenMP, top-k's prefilter) on normal
  // values. Decoded both into float32 and into the input dtype (alpha 0.5, accumulate).
  struct Case {
    ref::Dist dist;
    int64_t n;
    float div;
    bool residual;
  };
  std::vector<Case> cases;
  for (ref::Dist d : {ref::Dist::normal, ref::Dist::wide, ref::Dist::outlier, ref::Dist::specials, ref::Dist::ties})
    for (float div : {1.0f, 3.0f})
      for (bool res : {false, true}) cases.push_back({d, 1000, div, res});
  cases.push_back({ref::Dist::normal, (int64_t(1) << 18) + 13, 3.0f, true});
  cases.push_back({ref::Dist::wide, (int64_t(1) << 18) + 13, 1.0f, false});
  for (const auto& info : gradcomp::list_codecs()) {
    for (const auto& spec : info.examples) {
      auto c = gradcomp::Codec::create(spec);
      for (gradcomp::DType dt : {gradcomp::DType::float32, gradcomp::DType::float16, gradcomp::DType::bfloat16}) {
        for (const Case& k : cases) {
          const int64_t n = k.n;
          const ref::Input x = ref::Input::from_floats(dt, ref::make_values(k.dist, n, g));
          std::vector<float> r0(static_cast<size_t>(n));
          std::normal_distribution<float> nd(0.0f, 0.1f);
          for (auto& v : r0) v = nd(g);
          std::vector<std::vector<uint8_t>> packets, in_dtype;
          std::vector<std::vector<float>> residuals, decoded;
          for (const auto& isa : isas) {
            gradcomp::set_cpu_isa(isa);
            ASSERT_EQ(gradcomp::cpu_isa(), isa);
            ref::Encoded e = ref::encode(*c, x, k.residual ? &r0 : nullptr, k.div);
            packets.emplace_back(e.packet.data(), e.packet.data() + e.packet_bytes);
            residuals.push_back(e.residual);
            decoded.push_back(ref::decode_f32(*c, e.packet, n));
            ref::Input out = x;  // accumulate into a copy of the input
            ref::Bytes ws(16);
            c->decode(e.packet.tensor(), out.tensor(), ws.tensor(), gradcomp::DecodeMode::accumulate, 0.5f);
            const auto* b = static_cast<const uint8_t*>(out.data());
            in_dtype.emplace_back(b, b + n * gradcomp::dtype_size(dt));
          }
          for (size_t i = 1; i < isas.size(); ++i) {
            SCOPED_TRACE(spec + " " + std::string(gradcomp::dtype_name(dt)) + " " + ref::dist_name(k.dist) + " n " +
                         std::to_string(n) + " div " + std::to_string(k.div) + (k.residual ? " residual" : "") +
                         ": " + isas[i] + " vs " + isas[0]);
            EXPECT_EQ(packets[i], packets[0]);
            if (k.residual) EXPECT_EQ(std::memcmp(residuals[i].data(), residuals[0].data(), size_t(n) * 4), 0);
            EXPECT_EQ(std::memcmp(decoded[i].data(), decoded[0].data(), size_t(n) * 4), 0);
            EXPECT_EQ(in_dtype[i], in_dtype[0]);
          }
        }
      }
    }
  }
  EXPECT_THROW(gradcomp::set_cpu_isa("sse9"), gradcomp::InvalidArgument);
}
