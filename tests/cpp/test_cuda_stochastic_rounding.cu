// SPDX-License-Identifier: Apache-2.0
// CUDA backend of bf16:rounding=stochastic (docs/contracts.md section 3): packets and residuals
// byte-for-byte equal to the CPU backend's and to the independent plain-loop reference
// sround_ref.hpp (its own Philox4x32-10 and the rounding rule by value), for every input dtype, with
// and without a residual, divisors 1 and 3, aligned and misaligned inputs (the vector and the
// scalar paths), sizes around the 8-element Philox groups and several grid strides; the same key
// gives the same bytes, the next step other bytes; decode equal to the CPU's; a non-zero reserved
// key byte sets kStatusCorrupt and writes nothing. Every test skips without a GPU (style of
// test_cuda_codecs.cu).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "gpu_guard.hpp"
#include "seed.hpp"
#include "sround_ref.hpp"

namespace {

using gradcomp::Codec;
using gradcomp::DecodeMode;
using gradcomp::Device;
using gradcomp::DeviceKind;
using gradcomp::DType;
using gradcomp::EncodeContext;
using gradcomp::Tensor;


const Device kGpu{DeviceKind::cuda, 0};
const char* kSpec = "bf16:rounding=stochastic";

struct DevBuf {
  uint8_t* p = nullptr;
  explicit DevBuf(size_t b) {
    if (cudaMalloc(&p, std::max<size_t>(b, 16)) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

int64_t dsize(DType t) { return gradcomp::dtype_size(t); }

//! float32 values stored as dtype t (round to nearest even through the library's own nearest bf16 /
//! fp16 casts is not needed: the inputs are drawn as bit patterns of t directly).
std::vector<uint8_t> random_input(int64_t n, DType t, uint64_t seed) {
  std::mt19937_64 g(ref::test_seed() + seed);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<uint8_t> b(static_cast<size_t>(n * dsize(t)));
  for (int64_t i = 0; i < n; ++i) {
    float v = nd(g);
    if (g() % 64 == 0) v = ref::from_bits(uint32_t(g()));  // any bit pattern: NaN, inf, subnormal, huge
    const uint32_t u = ref::bits(v);
    if (t == DType::float32) {
      std::memcpy(b.data() + 4 * i, &u, 4);
    } else {
      // a 16-bit pattern of t: bfloat16 = the top half; float16 = a random finite-or-not pattern
      const uint16_t h = t == DType::bfloat16 ? uint16_t(u >> 16) : uint16_t(g());
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

float load_input(const std::vector<uint8_t>& b, DType t, int64_t i) {
  if (t == DType::float32) {
    float f;
    std::memcpy(&f, b.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, b.data() + 2 * i, 2);
  if (t == DType::bfloat16) return ref::from_bits(uint32_t(h) << 16);
  // float16 -> float32, exact
  const uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e == 0x1F) return ref::from_bits(s | 0x7F800000u | (m << 13));
  if (e == 0) return (s ? -1.0f : 1.0f) * std::ldexp(float(m), -24);
  return ref::from_bits(s | ((e + 112) << 23) | (m << 13));
}

struct Run {
  std::vector<uint8_t> packet;
  std::vector<float> residual;
};

Run encode_cpu(const Codec& c, const std::vector<uint8_t>& x, DType t, int64_t n, const std::vector<float>* r,
               float divisor, const EncodeContext& ctx) {
  Run e;
  std::vector<uint8_t> xs = x;
  std::vector<uint8_t> pk(size_t(c.packet_bytes(n, t)) + 16), ws(size_t(c.workspace_bytes(n, t, Device{})) + 16);
  auto* p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(pk.data()) + 15) & ~uintptr_t(15));
  auto* w = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(ws.data()) + 15) & ~uintptr_t(15));
  Tensor xt{xs.data(), t, n, Device{}};
  Tensor pt{p, DType::uint8, c.packet_bytes(n, t), Device{}};
  Tensor wt{w, DType::uint8, c.workspace_bytes(n, t, Device{}), Device{}};
  Tensor rt;
  if (r) {
    e.residual = *r;
    rt = Tensor{e.residual.data(), DType::float32, n, Device{}};
  }
  c.encode(xt, r ? &rt : nullptr, pt, wt, divisor, ctx);
  e.packet.assign(p, p + c.packet_bytes(n, t));
  return e;
}

Run encode_gpu(const Codec& c, const std::vector<uint8_t>& x, DType t, int64_t n, const std::vector<float>* r,
               float divisor, const EncodeContext& ctx, int elem_offset) {
  Run e;
  const int64_t pb = c.packet_bytes(n, t), wb = c.workspace_bytes(n, t, kGpu);
  DevBuf dx(static_cast<size_t>((n + elem_offset) * dsize(t))), dr(static_cast<size_t>((n + elem_offset) * 4)),
      dp(static_cast<size_t>(pb)), dw(static_cast<size_t>(wb));
  EXPECT_TRUE(dx.p && dr.p && dp.p && dw.p);
  if (!(dx.p && dr.p && dp.p && dw.p)) return e;
  uint8_t* xp = dx.p + elem_offset * dsize(t);
  float* rp = reinterpret_cast<float*>(dr.p) + elem_offset;
  if (n) EXPECT_EQ(cudaMemcpy(xp, x.data(), size_t(n * dsize(t)), cudaMemcpyHostToDevice), cudaSuccess);
  if (r && n) EXPECT_EQ(cudaMemcpy(rp, r->data(), size_t(n * 4), cudaMemcpyHostToDevice), cudaSuccess);
  cudaMemset(dp.p, 0xCD, size_t(pb));
  cudaMemset(dw.p, 0xFF, size_t(wb));
  cudaMemset(dw.p, 0, 16);
  Tensor xt{xp, t, n, kGpu}, pt{dp.p, DType::uint8, pb, kGpu}, wt{dw.p, DType::uint8, wb, kGpu};
  Tensor rt{rp, DType::float32, n, kGpu};
  c.encode(xt, r ? &rt : nullptr, pt, wt, divisor, ctx);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  e.packet.resize(size_t(pb));
  EXPECT_EQ(cudaMemcpy(e.packet.data(), dp.p, size_t(pb), cudaMemcpyDeviceToHost), cudaSuccess);
  if (r) {
    e.residual.resize(size_t(n));
    if (n) EXPECT_EQ(cudaMemcpy(e.residual.data(), rp, size_t(n * 4), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return e;
}

//! Decode on the GPU (float32 out, assign); returns the values and the status word.
std::vector<float> decode_gpu(const Codec& c, const std::vector<uint8_t>& packet, int64_t n, uint32_t* status,
                              float fill = 7.0f) {
  DevBuf dp(packet.size()), dout(static_cast<size_t>(n * 4)), dw(16);
  std::vector<float> out(size_t(n), fill);
  if (!(dp.p && dout.p && dw.p)) {
    ADD_FAILURE() << "cudaMalloc";
    return out;
  }
  cudaMemcpy(dp.p, packet.data(), packet.size(), cudaMemcpyHostToDevice);
  if (n) cudaMemcpy(dout.p, out.data(), size_t(n * 4), cudaMemcpyHostToDevice);
  cudaMemset(dw.p, 0, 16);
  c.decode(Tensor{dp.p, DType::uint8, int64_t(packet.size()), kGpu}, Tensor{dout.p, DType::float32, n, kGpu},
           Tensor{dw.p, DType::uint8, 16, kGpu});
  *status = gradcomp::read_status(Tensor{dw.p, DType::uint8, 16, kGpu});
  if (n) cudaMemcpy(out.data(), dout.p, size_t(n * 4), cudaMemcpyDeviceToHost);
  return out;
}

using gradcomp_test::first_diff;
using gradcomp_test::first_diff_f;

} // namespace

TEST(CudaStochasticRounding, PacketsEqualTheCpuAndTheReference) {
  REQUIRE_GPU();
  auto c = Codec::create(kSpec);
  uint64_t seed = 81000;
  const EncodeContext keys[] = {{0, 0, 0, 0}, {0x0123456789ABCDEFull, 7, 3, 1}};
  for (DType t : {DType::float32, DType::float16, DType::bfloat16}) {
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(8), int64_t(9), int64_t(2049), int64_t(70001),
                      (int64_t(1) << 20) + 3}) {
      const auto x = random_input(n, t, seed++);
      std::vector<float> r(static_cast<size_t>(n));
      std::mt19937_64 g(ref::test_seed() + seed++);
      std::normal_distribution<float> nd(0.0f, 0.01f);
      for (auto& v : r) v = nd(g);
      for (const EncodeContext& k : keys) {
        for (int variant = 0; variant < 4; ++variant) {
          const bool with_r = variant & 1;
          const float div = variant & 2 ? 3.0f : 1.0f;
          SCOPED_TRACE(std::string(gradcomp::dtype_name(t)) + " n=" + std::to_string(n) + " seed " +
                       std::to_string(k.seed) + " variant " + std::to_string(variant));
          const auto cpu = encode_cpu(*c, x, t, n, with_r ? &r : nullptr, div, k);
          for (int off : {0, 1}) {
            const auto gpu = encode_gpu(*c, x, t, n, with_r ? &r : nullptr, div, k, off);
            ASSERT_EQ(first_diff(gpu.packet, cpu.packet), -1) << "offset " << off;
            if (with_r) ASSERT_EQ(first_diff_f(gpu.residual, cpu.residual), -1) << "offset " << off;
          }
          // the codes against the independent reference
          const sref::Stream st(k.seed, k.step, k.bucket, k.chunk);
          for (int64_t i = 0; i < n; ++i) {
            float xp = load_input(x, t, i);
            if (with_r) xp = xp + r[size_t(i)];
            const float y = div == 1.0f ? xp : xp / div;
            uint16_t got;
            std::memcpy(&got, cpu.packet.data() + 32 + 2 * i, 2);
            ASSERT_EQ(got, sref::round_sr(y, st.uniform(uint64_t(i)))) << "element " << i;
          }
          // decode equal to the CPU's (values and status)
          uint32_t st_gpu = 0;
          const auto dg = decode_gpu(*c, cpu.packet, n, &st_gpu);
          std::vector<float> dc(static_cast<size_t>(n));
          for (int64_t i = 0; i < n; ++i) {
            uint16_t code;
            std::memcpy(&code, cpu.packet.data() + 32 + 2 * i, 2);
            dc[size_t(i)] = ref::from_bits(uint32_t(code) << 16);
          }
          ASSERT_EQ(first_diff_f(dg, dc), -1);
          ASSERT_EQ(st_gpu, cpu.packet[11] ? gradcomp::kStatusNonFinite : 0u);
        }
      }
    }
  }
}

TEST(CudaStochasticRounding, KeyDeterminesTheBytes) {
  REQUIRE_GPU();
  auto c = Codec::create(kSpec);
  const int64_t n = (int64_t(1) << 18) + 5;
  const auto x = random_input(n, DType::float32, 82000);
  const EncodeContext k{99, 5, 1, 0};
  const auto a = encode_gpu(*c, x, DType::float32, n, nullptr, 1.0f, k, 0);
  const auto b = encode_gpu(*c, x, DType::float32, n, nullptr, 1.0f, k, 0);
  EXPECT_EQ(first_diff(a.packet, b.packet), -1) << "the same key gave other bytes";
  for (int field = 0; field < 4; ++field) {
    EncodeContext o = k;
    if (field == 0) ++o.seed;
    if (field == 1) ++o.step;
    if (field == 2) ++o.bucket;
    if (field == 3) ++o.chunk;
    const auto d = encode_gpu(*c, x, DType::float32, n, nullptr, 1.0f, o, 0);
    EXPECT_NE(std::memcmp(d.packet.data() + 32, a.packet.data() + 32, size_t(2 * n)), 0) << "field " << field;
  }
}

TEST(CudaStochasticRounding, CorruptKeySectionWritesNothing) {
  REQUIRE_GPU();
  auto c = Codec::create(kSpec);
  const int64_t n = 4000;
  const auto x = random_input(n, DType::float32, 83000);
  const auto good = encode_cpu(*c, x, DType::float32, n, nullptr, 1.0f, {1, 2, 3, 4}).packet;
  const int64_t key_at = c->layout(n, DType::float32).sections[1].offset;
  uint32_t st = 0;
  (void)decode_gpu(*c, good, n, &st);
  EXPECT_EQ(st & gradcomp::kStatusCorrupt, 0u);
  for (int b : {20, 25, 31}) {
    SCOPED_TRACE("reserved key byte " + std::to_string(b));
    auto bad = good;
    bad[size_t(key_at + b)] = 0x01;
    const auto out = decode_gpu(*c, bad, n, &st, 7.0f);
    EXPECT_EQ(st, gradcomp::kStatusCorrupt);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out[size_t(i)], 7.0f) << "decode wrote element " << i;
  }
}
