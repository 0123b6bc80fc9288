// SPDX-License-Identifier: Apache-2.0
// Writes the seed corpora of the fuzz targets: valid packets of every registered codec example
// for float32/float16/bfloat16 input and several sizes (some with error feedback and non-finite
// values), in fuzz_decode's format, and headers + specs for fuzz_header.
// Usage: fuzz_seeds DECODE_DIR HEADER_DIR
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "fuzz_common.hpp"

namespace {
void write(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}
} // namespace

int main(int argc, char** argv) {
  using namespace gradcomp;
  if (argc != 3) {
    std::fprintf(stderr, "usage: fuzz_seeds DECODE_DIR HEADER_DIR\n");
    return 2;
  }
  const std::string ddir = argv[1], hdir = argv[2];
  std::mt19937_64 g(1);
  std::normal_distribution<float> nd;
  int count = 0;
  const auto& specs = fuzz::specs();
  for (size_t ci = 0; ci < specs.size(); ++ci) {
    auto c = Codec::create(specs[ci]);
    for (int dt = 0; dt < 3; ++dt) {
      for (int64_t n : {0, 1, 7, 33, 200}) {
        std::vector<float> x(static_cast<size_t>(n));
        for (auto& v : x) v = nd(g);
        if (n > 5 && dt == 0) x[3] = NAN;
        std::vector<uint16_t> h(static_cast<size_t>(n));
        const DType in = DType(dt);
        Tensor xt{x.data(), DType::float32, n, {}};
        if (dt != 0) {  // float16/bfloat16 inputs: truncated bits are fine for seeds
          for (int64_t i = 0; i < n; ++i) {
            uint32_t u;
            std::memcpy(&u, &x[size_t(i)], 4);
            h[size_t(i)] = dt == 2 ? uint16_t(u >> 16) : uint16_t(0x3C00 | (u >> 20 & 0x3FF));
          }
          xt = {h.data(), in, n, {}};
        }
        const int64_t pb = c->packet_bytes(n, in);
        std::vector<uint8_t> packet(size_t(pb) + 16), ws(size_t(c->workspace_bytes(n, in, {})) + 16);
        auto* p16 = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(packet.data()) + 15) / 16 * 16);
        auto* w16 = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(ws.data()) + 15) / 16 * 16);
        std::vector<float> r(static_cast<size_t>(n), 0.125f);
        Tensor rt{r.data(), DType::float32, n, {}};
        c->encode(xt, n % 2 ? &rt : nullptr, {p16, DType::uint8, pb, {}}, {w16, DType::uint8, int64_t(ws.size() - 16), {}});
        std::vector<uint8_t> seed = {uint8_t(ci), uint8_t(dt | (n % 2 ? 4 : 0))};
        seed.insert(seed.end(), p16, p16 + pb);
        const std::string base = std::to_string(ci) + "_" + std::to_string(dt) + "_" + std::to_string(n);
        write(ddir + "/" + base, seed);
        std::vector<uint8_t> hs(p16, p16 + std::min<int64_t>(pb, 32));
        const std::string& sp = c->spec();
        hs.insert(hs.end(), sp.begin(), sp.end());
        write(hdir + "/" + base, hs);
        ++count;
      }
    }
  }
  std::printf("fuzz_seeds: %d packets of %zu codec specs\n", count, specs.size());
  return 0;
}
