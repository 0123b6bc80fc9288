// SPDX-License-Identifier: Apache-2.0
// tests/consumer: top-k (ratio 0.25) with error feedback on 64 float32 values through the installed
// C++ API, checked against a plain loop: the decoded vector holds exactly the 16 largest
// magnitudes at their indices (zeros elsewhere), and x == decoded + residual element by element.
// Also: a bad spec raises InvalidArgument naming it. Prints "consumer: OK" and exits 0, else 1.
#include <gradcomp/gradcomp.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <vector>

namespace {
int fail(const char* what) {
  std::fprintf(stderr, "consumer: FAILED: %s\n", what);
  return 1;
}
} // namespace

int main() {
  using namespace gradcomp;
  constexpr int64_t n = 64, k = 16;
  std::vector<float> x(n), residual(n, 0.0f), out(n, -1.0f);
  for (int64_t i = 0; i < n; ++i)  // distinct magnitudes 1/8 .. 8 in a scrambled order, alternating signs
    x[size_t(i)] = float((i * 37) % 64 + 1) * (i % 2 ? -0.125f : 0.125f);
  const std::vector<float> x0 = x;

  const auto codec = Codec::create("topk:ratio=0.25");
  const int64_t pbytes = codec->packet_bytes(n, DType::float32);
  const int64_t wbytes = codec->workspace_bytes(n, DType::float32, Device{});
  std::vector<std::byte> packet_mem(size_t(pbytes) + 16), work_mem(size_t(wbytes) + 16);
  auto align16 = [](std::vector<std::byte>& v) {
    auto p = reinterpret_cast<uintptr_t>(v.data());
    return reinterpret_cast<void*>((p + 15) / 16 * 16);
  };
  const Tensor xt{x.data(), DType::float32, n}, rt{residual.data(), DType::float32, n};
  const Tensor pt{align16(packet_mem), DType::uint8, pbytes}, wt{align16(work_mem), DType::uint8, wbytes};
  const Tensor ot{out.data(), DType::float32, n};
  codec->encode(xt, &rt, pt, wt);
  codec->decode(pt, ot, wt);

  // reference: the k largest |x| (all distinct), by a plain sort
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return std::fabs(x0[size_t(a)]) > std::fabs(x0[size_t(b)]); });
  std::vector<float> expect(n, 0.0f);
  for (int64_t j = 0; j < k; ++j) expect[size_t(order[size_t(j)])] = x0[size_t(order[size_t(j)])];
  for (int64_t i = 0; i < n; ++i) {
    if (out[size_t(i)] != expect[size_t(i)]) return fail("decoded values differ from the k largest magnitudes");
    if (out[size_t(i)] + residual[size_t(i)] != x0[size_t(i)]) return fail("decoded + residual != x");
  }
  try {
    Codec::create("topk:ratio=7");
    return fail("topk:ratio=7 was accepted");
  } catch (const InvalidArgument& e) {
    if (std::string(e.what()).find("ratio") == std::string::npos) return fail("the error does not name ratio");
  }
  std::printf("consumer: OK (gradcomp %s, %s, packet %lld bytes for %lld float32)\n", build_info().version.c_str(),
              codec->spec().c_str(), (long long)pbytes, (long long)n);
  return 0;
}
