// SPDX-License-Identifier: Apache-2.0
// CUDA backend of none / fp16 / bf16 / topk: packets byte-for-byte equal to the CPU backend's and to
// independent references (a plain loop over cuda_fp16 / cuda_bf16 host conversions for the casts,
// std::stable_sort for top-k), residuals bit-exact, decode equal to the CPU's, corrupt packets
// reported through the status word without writes out of bounds. Every test skips without a GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/quant.hpp"
#include "cuda/plan.hpp"
#include "gradcomp/gradcomp.hpp"
#include "gpu_guard.hpp"
#include "seed.hpp"

namespace {

using gradcomp::Codec;
using gradcomp::DecodeMode;
using gradcomp::Device;
using gradcomp::DeviceKind;
using gradcomp::DType;
using gradcomp::Tensor;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

const Device kGpu{DeviceKind::cuda, 0};

// ---- device buffers ------------------------------------------------------------------------------
struct DevBuf {
  uint8_t* p = nullptr;
  size_t bytes = 0;
  explicit DevBuf(size_t b) : bytes(b) {
    if (cudaMalloc(&p, std::max<size_t>(b, 16)) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};
void upload(uint8_t* d, const void* h, size_t n) { ASSERT_EQ(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), cudaSuccess); }
std::vector<uint8_t> download(const uint8_t* d, size_t n) {
  std::vector<uint8_t> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// ---- independent reference conversions (cuda_fp16 / cuda_bf16 host code, NaN handled here) ------
uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bitsf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t ref_to_half(float f) {
  if (std::isnan(f)) return uint16_t((std::signbit(f) ? 0x8000u : 0u) | 0x7E00u);
  return __half_as_ushort(__float2half_rn(f));
}
float ref_from_half(uint16_t h) { return __half2float(__ushort_as_half(h)); }
uint16_t ref_to_bf16(float f) {
  if (std::isnan(f)) return uint16_t((std::signbit(f) ? 0x8000u : 0u) | 0x7FC0u);
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
float ref_from_bf16(uint16_t h) { return bitsf(uint32_t(h) << 16); }
int64_t dsize(DType t) { return gradcomp::dtype_size(t); }

//! Element i of a buffer of dtype t as float.
float ref_load(const std::vector<uint8_t>& b, DType t, int64_t i) {
  if (t == DType::float32) {
    float f;
    std::memcpy(&f, b.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, b.data() + 2 * i, 2);
  return t == DType::float16 ? ref_from_half(h) : ref_from_bf16(h);
}
//! Store v as dtype t at element i; returns the decoded value.
float ref_store(std::vector<uint8_t>& b, DType t, int64_t i, float v) {
  if (t == DType::float32) {
    std::memcpy(b.data() + 4 * i, &v, 4);
    return v;
  }
  const uint16_t h = t == DType::float16 ? ref_to_half(v) : ref_to_bf16(v);
  std::memcpy(b.data() + 2 * i, &h, 2);
  return t == DType::float16 ? ref_from_half(h) : ref_from_bf16(h);
}
std::vector<uint8_t> to_dtype(const std::vector<float>& v, DType t) {
  std::vector<uint8_t> b(v.size() * dsize(t));
  for (size_t i = 0; i < v.size(); ++i) ref_store(b, t, int64_t(i), v[i]);
  return b;
}

// ---- inputs ----------------------------------------------------------------------------------------
enum class Kind { normal, zeros, constant, outlier, edges, ties, skewed };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::normal: return "normal";
    case Kind::zeros: return "zeros";
    case Kind::constant: return "constant";
    case Kind::outlier: return "outlier";
    case Kind::edges: return "edges";
    case Kind::ties: return "ties";
    case Kind::skewed: return "skewed";
  }
  return "?";
}
std::vector<float> make_values(int64_t n, Kind kind, uint32_t seed) {
  std::mt19937 rng(uint32_t(ref::test_seed()) + seed);  // seed.hpp: fixed by default, GRADCOMP_TEST_SEED
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  const float edge[] = {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        bitsf(0x7FC00000u), bitsf(0xFFC00000u), bitsf(0x7F800123u), 1e-40f, -1e-42f, 65504.0f,
                        -65504.0f, 65519.0f, 65520.0f, -65520.0f, 6.0e-8f, 2.9e-8f, 3.0e38f, -1.5f, 1e-5f};
  for (int64_t i = 0; i < n; ++i) {
    switch (kind) {
      case Kind::normal: v[i] = nd(rng); break;
      case Kind::zeros: v[i] = 0.0f; break;
      case Kind::constant: v[i] = -0.75f; break;
      case Kind::outlier: v[i] = nd(rng) * 1e-3f; break;
      case Kind::edges: v[i] = (rng() % 4 == 0) ? edge[rng() % (sizeof edge / sizeof edge[0])] : nd(rng); break;
      case Kind::ties: v[i] = float(int(rng() % 5) - 2) * 0.5f; break; // few distinct magnitudes
      case Kind::skewed: v[i] = (i >= n / 3 && i < n / 3 + n / 50 + 1) ? nd(rng) * 100.0f : nd(rng) * 1e-4f; break;
    }
  }
  if (kind == Kind::outlier && n > 0) v[size_t(n / 2)] = 1e30f;
  return v;
}

// ---- running codecs on CPU and GPU ---------------------------------------------------------------
struct Encoded {
  std::vector<uint8_t> packet;
  std::vector<float> residual;
};
Encoded encode_cpu(const Codec& c, const std::vector<uint8_t>& x, DType t, int64_t n, const std::vector<float>* r,
                   float divisor) {
  Encoded e;
  std::vector<uint8_t> xs = x;
  e.packet.assign(size_t(c.packet_bytes(n, t)) + 16, 0xAB);
  std::vector<uint8_t> ws(static_cast<size_t>(c.workspace_bytes(n, t, Device{})) + 64);
  auto* pk = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(e.packet.data()) + 15) & ~uintptr_t(15));
  auto* wp = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(ws.data()) + 15) & ~uintptr_t(15));
  Tensor xt{xs.data(), t, n, Device{}};
  Tensor pt{pk, DType::uint8, c.packet_bytes(n, t), Device{}};
  Tensor wt{wp, DType::uint8, c.workspace_bytes(n, t, Device{}), Device{}};
  if (r) {
    e.residual = *r;
    Tensor rt{e.residual.data(), DType::float32, n, Device{}};
    c.encode(xt, &rt, pt, wt, divisor);
  } else {
    c.encode(xt, nullptr, pt, wt, divisor);
  }
  e.packet = std::vector<uint8_t>(pk, pk + c.packet_bytes(n, t));
  return e;
}
//! `elem_offset` shifts x and the residual by that many elements from a 256-byte aligned
//! allocation (1: not 16-byte aligned, exercising the scalar paths).
Encoded encode_gpu(const Codec& c, const std::vector<uint8_t>& x, DType t, int64_t n, const std::vector<float>* r,
                   float divisor, int elem_offset = 0, cudaStream_t stream = nullptr) {
  Encoded e;
  const int64_t pb = c.packet_bytes(n, t), wb = c.workspace_bytes(n, t, kGpu);
  DevBuf dx(static_cast<size_t>((n + elem_offset) * dsize(t))), dr(static_cast<size_t>((n + elem_offset) * 4)),
      dp(static_cast<size_t>(pb)), dw(static_cast<size_t>(wb));
  EXPECT_TRUE(dx.p && dr.p && dp.p && dw.p);
  if (!(dx.p && dr.p && dp.p && dw.p)) return e;
  uint8_t* xp = dx.p + elem_offset * dsize(t);
  float* rp = reinterpret_cast<float*>(dr.p) + elem_offset;
  if (n) cudaMemcpy(xp, x.data(), size_t(n * dsize(t)), cudaMemcpyHostToDevice);
  if (r && n) cudaMemcpy(rp, r->data(), size_t(n * 4), cudaMemcpyHostToDevice);
  cudaMemset(dp.p, 0xCD, size_t(pb));
  cudaMemset(dw.p, 0xFF, size_t(wb)); // garbage workspace: encode must not rely on zeroed scratch
  cudaMemset(dw.p, 0, 16);
  Tensor xt{xp, t, n, kGpu};
  Tensor pt{dp.p, DType::uint8, pb, kGpu};
  Tensor wt{dw.p, DType::uint8, wb, kGpu};
  Tensor rt{rp, DType::float32, n, kGpu};
  c.encode(xt, r ? &rt : nullptr, pt, wt, divisor, {}, gradcomp::Stream{stream});
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  e.packet = download(dp.p, size_t(pb));
  if (r) {
    e.residual.resize(size_t(n));
    if (n) cudaMemcpy(e.residual.data(), rp, size_t(n * 4), cudaMemcpyDeviceToHost);
  }
  return e;
}

using gradcomp_test::first_diff;
using gradcomp_test::first_diff_f;
using gradcomp_test::kSmallMaxNumel;
using gradcomp_test::small_sizes;

gradcomp::PacketHeader make_ref_header(const Codec& c, int64_t n, DType in, DType wire, DType index, int64_t main) {
  gradcomp::PacketHeader h{};
  h.magic = gradcomp::kPacketMagic;
  h.version = gradcomp::kPacketVersion;
  h.codec_id = uint16_t(c.id());
  h.input_dtype = uint8_t(in);
  h.wire_dtype = uint8_t(wire);
  h.index_dtype = uint8_t(index);
  h.spec_hash = gradcomp::fnv1a32(c.spec());
  h.numel = uint64_t(n);
  h.main_param = uint64_t(main);
  return h;
}

// ---- cast reference: a plain loop ------------------------------------------------------------------
Encoded cast_reference(const Codec& c, DType wire, const std::vector<uint8_t>& x, DType t, int64_t n,
                       const std::vector<float>* r, float divisor) {
  Encoded e;
  e.packet.assign(size_t(c.packet_bytes(n, t)), 0);
  std::vector<uint8_t> payload(static_cast<size_t>(n * dsize(wire)));
  if (r) e.residual = *r;
  bool nf = false;
  for (int64_t i = 0; i < n; ++i) {
    float xp = ref_load(x, t, i);
    if (r) xp = xp + (*r)[size_t(i)];
    const float y = divisor == 1.0f ? xp : xp / divisor;
    const float d = ref_store(payload, wire, i, y);
    if (r) e.residual[size_t(i)] = divisor == 1.0f ? xp - d : xp - divisor * d;
    nf = nf || !std::isfinite(y) || !std::isfinite(d);
  }
  auto h = make_ref_header(c, n, t, wire, DType::none, 0);
  h.flags = nf ? 1 : 0;
  std::memcpy(e.packet.data(), &h, 32);
  std::memcpy(e.packet.data() + 32, payload.data(), payload.size());
  return e;
}

// ---- top-k reference: std::stable_sort ---------------------------------------------------------------
uint32_t ref_key(float y) {
  if (std::isnan(y)) return 0x7F800001u;
  return fbits(y) & 0x7FFFFFFFu;
}
Encoded topk_reference(const Codec& c, DType value_dtype, DType index_dtype, const std::vector<uint8_t>& x, DType t,
                       int64_t n, const std::vector<float>* r, float divisor) {
  const int64_t k = c.main_param(n);
  Encoded e;
  e.packet.assign(size_t(c.packet_bytes(n, t)), 0);
  std::vector<float> xp(static_cast<size_t>(n)), y(static_cast<size_t>(n));
  bool nf = false;
  for (int64_t i = 0; i < n; ++i) {
    xp[i] = r ? ref_load(x, t, i) + (*r)[size_t(i)] : ref_load(x, t, i);
    y[i] = divisor == 1.0f ? xp[i] : xp[i] / divisor;
    nf = nf || !std::isfinite(y[i]);
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ref_key(y[a]) > ref_key(y[b]); });
  order.resize(size_t(k));
  std::sort(order.begin(), order.end());
  if (r) e.residual = xp;
  const int64_t isz = dsize(index_dtype);
  const int64_t voff = 32 + gradcomp::align16(k * isz);
  std::vector<uint8_t> vals(static_cast<size_t>(k * dsize(value_dtype)));
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = order[size_t(j)];
    const uint64_t i64 = uint64_t(i);
    std::memcpy(e.packet.data() + 32 + j * isz, &i64, size_t(isz)); // little-endian
    const float d = ref_store(vals, value_dtype, j, y[i]);
    nf = nf || !std::isfinite(d);
    if (r) e.residual[size_t(i)] = divisor == 1.0f ? xp[i] - d : xp[i] - divisor * d;
  }
  if (!vals.empty()) std::memcpy(e.packet.data() + voff, vals.data(), vals.size());
  auto h = make_ref_header(c, n, t, value_dtype, index_dtype, k);
  h.flags = nf ? 1 : 0;
  std::memcpy(e.packet.data(), &h, 32);
  return e;
}

const DType kDtypes[] = {DType::float32, DType::float16, DType::bfloat16};
const char* dn(DType t) { return gradcomp::dtype_name(t).data(); }

// ---- decode on CPU and GPU ------------------------------------------------------------------------------
std::vector<uint8_t> decode_cpu(const Codec& c, const std::vector<uint8_t>& packet, DType out_t, int64_t n,
                                const std::vector<uint8_t>& init, DecodeMode mode, float alpha, uint32_t* status) {
  std::vector<uint8_t> pk(packet.size() + 16);
  auto* p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(pk.data()) + 15) & ~uintptr_t(15));
  std::memcpy(p, packet.data(), packet.size());
  std::vector<uint8_t> out = init;
  alignas(16) uint32_t ws[4] = {0, 0, 0, 0};
  c.decode(Tensor{p, DType::uint8, int64_t(packet.size()), Device{}}, Tensor{out.data(), out_t, n, Device{}},
           Tensor{ws, DType::uint8, 16, Device{}}, mode, alpha);
  if (status) *status = ws[0];
  return out;
}
//! Decodes on the GPU into out (with 256 guard bytes after it that must stay untouched).
std::vector<uint8_t> decode_gpu(const Codec& c, const std::vector<uint8_t>& packet, DType out_t, int64_t n,
                                const std::vector<uint8_t>& init, DecodeMode mode, float alpha, uint32_t* status,
                                int64_t packet_bytes = -1) {
  const size_t ob = size_t(n * dsize(out_t));
  DevBuf dp(packet.size()), dout(ob + 256), dw(64);
  upload(dp.p, packet.data(), packet.size());
  cudaMemset(dout.p, 0x5A, ob + 256);
  if (ob) upload(dout.p, init.data(), ob);
  cudaMemset(dw.p, 0, 64);
  c.decode(Tensor{dp.p, DType::uint8, packet_bytes >= 0 ? packet_bytes : int64_t(packet.size()), kGpu},
           Tensor{dout.p, out_t, n, kGpu}, Tensor{dw.p, DType::uint8, 64, kGpu}, mode, alpha);
  const uint32_t st = gradcomp::read_status(Tensor{dw.p, DType::uint8, 64, kGpu});
  if (status) *status = st;
  EXPECT_EQ(gradcomp::read_status(Tensor{dw.p, DType::uint8, 64, kGpu}), 0u) << "read_status must clear the word";
  auto all = download(dout.p, ob + 256);
  for (size_t i = ob; i < ob + 256; ++i) EXPECT_EQ(all[i], 0x5A) << "guard byte " << i - ob << " overwritten";
  all.resize(ob);
  return all;
}

// Mismatches collected over a whole sweep instead of stopping at the first (ASSERT in a loop): the
// test fails once at the end with the count and the first 20, each naming its spec, dtype, n,
// variant and the first differing byte or element, so one GPU run shows every failing combination.
struct Failures {
  int64_t count = 0;
  std::vector<std::string> first;
  //! `diff`: -1 when equal, else the first differing position (or a status word).
  void check(int64_t diff, const std::string& what) {
    if (diff < 0) return;
    if (++count <= 20) first.push_back(what + " " + std::to_string(diff));
  }
  void report() const {
    std::string msg;
    for (const auto& f : first) msg += "\n  " + f;
    EXPECT_EQ(count, 0) << count << " mismatches; the first " << first.size() << ":" << msg;
  }
};

// ==========================================================================================================
// Casts
// ==========================================================================================================
TEST(CudaCast, MatchesCpuAndReference) {
  REQUIRE_GPU();
  Failures fails;
  const int64_t sizes[] = {0, 1, 7, 8, 9, 15, 16, 17, 255, 257, 2047, 2048, 2049, 4095, 4097, 65535, 65537, (1 << 20) + 3};
  const char* specs[] = {"none", "fp16", "bf16"};
  uint32_t seed = 1;
  for (const char* spec : specs) {
    auto c = Codec::create(spec);
    for (DType t : kDtypes) {
      const DType wire = std::string(spec) == "none" ? t : std::string(spec) == "fp16" ? DType::float16 : DType::bfloat16;
      for (int64_t n : sizes) {
        for (Kind kind : {Kind::normal, Kind::edges, Kind::zeros, Kind::outlier}) {
          if (kind != Kind::normal && kind != Kind::edges && n > 5000) continue;
          const auto vals = make_values(n, kind, seed++);
          const auto x = to_dtype(vals, t);
          std::vector<float> r = make_values(n, kind == Kind::edges ? Kind::edges : Kind::normal, seed++);
          for (int variant = 0; variant < 4; ++variant) {
            const bool with_r = variant & 1;
            const float div = (variant & 2) ? 3.0f : 1.0f;
            const std::string where = std::string(spec) + " " + dn(t) + " n=" + std::to_string(n) + " " +
                                      kind_name(kind) + (with_r ? " residual" : "") + " div=" + std::to_string(div) +
                                      " variant " + std::to_string(variant);
            const auto ref = cast_reference(*c, wire, x, t, n, with_r ? &r : nullptr, div);
            const auto cpu = encode_cpu(*c, x, t, n, with_r ? &r : nullptr, div);
            const auto gpu = encode_gpu(*c, x, t, n, with_r ? &r : nullptr, div, variant == 3 ? 1 : 0);
            fails.check(first_diff(cpu.packet, ref.packet), where + ": CPU packet vs the reference, byte");
            fails.check(first_diff(gpu.packet, ref.packet), where + ": GPU packet vs the reference, byte");
            fails.check(first_diff_f(gpu.residual, ref.residual), where + ": GPU residual vs the reference, element");
            fails.check(first_diff_f(cpu.residual, gpu.residual), where + ": CPU vs GPU residual, element");
          }
        }
      }
    }
  }
  fails.report();
}

TEST(CudaCast, DecodeMatchesCpu) {
  REQUIRE_GPU();
  Failures fails;
  uint32_t seed = 100;
  for (const char* spec : {"none", "fp16", "bf16"}) {
    auto c = Codec::create(spec);
    for (DType t : kDtypes) {
      for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(4097), int64_t(100003)}) {
        for (Kind kind : {Kind::normal, Kind::edges}) {
          const auto x = to_dtype(make_values(n, kind, seed++), t);
          const auto packet = encode_cpu(*c, x, t, n, nullptr, 1.0f).packet;
          for (DType out_t : kDtypes) {
            const auto init = to_dtype(make_values(n, Kind::normal, seed++), out_t);
            for (DecodeMode mode : {DecodeMode::assign, DecodeMode::accumulate}) {
              for (float alpha : {1.0f, 0.25f, -3.0f}) {
                const std::string where = std::string(spec) + " in=" + dn(t) + " out=" + dn(out_t) + " n=" +
                                          std::to_string(n) + " " + kind_name(kind) + " alpha=" +
                                          std::to_string(alpha) + (mode == DecodeMode::accumulate ? " acc" : " assign");
                uint32_t s_cpu = 0, s_gpu = 0;
                const auto a = decode_cpu(*c, packet, out_t, n, init, mode, alpha, &s_cpu);
                const auto b = decode_gpu(*c, packet, out_t, n, init, mode, alpha, &s_gpu);
                fails.check(first_diff(a, b), where + ": decoded byte");
                fails.check(s_cpu == s_gpu ? -1 : int64_t(s_gpu), where + ": status");
                // independent check of a few elements
                if (n > 0 && !(packet[11] & 1) && mode == DecodeMode::assign) {
                  const DType wire = static_cast<DType>(packet[9]);
                  std::vector<uint8_t> pl(packet.begin() + 32, packet.end());
                  for (int64_t i = 0; i < n; i += std::max<int64_t>(1, n / 17)) {
                    std::vector<uint8_t> one(4);
                    const float expect = ref_store(one, out_t, 0, ref_load(pl, wire, i) * alpha);
                    fails.check(fbits(ref_load(b, out_t, i)) == fbits(expect) ? -1 : i,
                                where + ": element vs the plain-loop reference");
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  fails.report();
}

// The casts carry every non-finite value in the payload (no sentinel): the decoded bucket holds them
// where they were, nothing is overwritten, and the header flag alone sets the status word.
TEST(CudaCast, NonFiniteFlagCarriedValues) {
  REQUIRE_GPU();
  auto c = Codec::create("fp16");
  // 70000 overflows fp16: finite input, non-finite wire value (the documented exception).
  std::vector<float> v(1000, 1.0f);
  v[500] = 70000.0f;
  const auto x = to_dtype(v, DType::float32);
  const auto gpu = encode_gpu(*c, x, DType::float32, 1000, nullptr, 1.0f);
  EXPECT_EQ(gpu.packet[11] & 1, 1);
  EXPECT_EQ(gpu.packet.size(), size_t(32 + 2000));
  uint32_t st = 0;
  const auto out = decode_gpu(*c, gpu.packet, DType::float32, 1000, std::vector<uint8_t>(4000, 0), DecodeMode::assign,
                              1.0f, &st);
  EXPECT_EQ(st, gradcomp::kStatusNonFinite);
  EXPECT_EQ(ref_load(out, DType::float32, 0), 1.0f);
  EXPECT_TRUE(std::isinf(ref_load(out, DType::float32, 500)));
  // the flag alone (as a rank's own header after a sum allreduce): status set, values untouched
  auto clean = encode_gpu(*c, to_dtype(std::vector<float>(1000, 2.0f), DType::float32), DType::float32, 1000, nullptr,
                          1.0f);
  EXPECT_EQ(clean.packet[11] & 1, 0);
  clean.packet[11] = 1;
  const auto out2 = decode_gpu(*c, clean.packet, DType::float32, 1000, std::vector<uint8_t>(4000, 0),
                               DecodeMode::assign, 1.0f, &st);
  EXPECT_EQ(st, gradcomp::kStatusNonFinite);
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(ref_load(out2, DType::float32, i), 2.0f) << i;
}

TEST(CudaCast, CorruptHeaderWritesNothing) {
  REQUIRE_GPU();
  const int64_t n = 5000;
  for (const char* spec : {"none", "bf16"}) {
    auto c = Codec::create(spec);
    const auto good = encode_cpu(*c, to_dtype(make_values(n, Kind::normal, 7), DType::float32), DType::float32, n,
                                 nullptr, 1.0f)
                          .packet;
    const std::vector<uint8_t> init(static_cast<size_t>(n * 4), 0x11);
    struct Mut {
      const char* what;
      int offset;
      uint8_t value;
    };
    for (Mut m : {Mut{"magic", 0, 0x00}, Mut{"version", 4, 9}, Mut{"codec id", 6, 4}, Mut{"input dtype", 8, 7},
                  Mut{"wire dtype", 9, 1}, Mut{"spec hash", 12, 0x42}, Mut{"numel", 16, 0x99},
                  Mut{"main param", 24, 1}}) {
      SCOPED_TRACE(std::string(spec) + ": corrupt " + m.what);
      auto bad = good;
      if (bad[size_t(m.offset)] == m.value) bad[size_t(m.offset)] ^= 0x80;
      else bad[size_t(m.offset)] = m.value;
      uint32_t st = 0;
      const auto out = decode_gpu(*c, bad, DType::float32, n, init, DecodeMode::assign, 1.0f, &st);
      EXPECT_EQ(st, gradcomp::kStatusCorrupt);
      EXPECT_EQ(first_diff(out, init), -1) << "a corrupt packet wrote into out";
    }
    // A packet buffer shorter than its header says: corrupt, nothing written.
    uint32_t st = 0;
    const auto out = decode_gpu(*c, good, DType::float32, n, init, DecodeMode::assign, 1.0f, &st, 64);
    EXPECT_EQ(st, gradcomp::kStatusCorrupt);
    EXPECT_EQ(first_diff(out, init), -1);
  }
}

TEST(CudaCast, NonDefaultStream) {
  REQUIRE_GPU();
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto c = Codec::create("bf16");
  const int64_t n = 300001;
  const auto x = to_dtype(make_values(n, Kind::normal, 9), DType::float32);
  std::vector<float> r = make_values(n, Kind::normal, 10);
  const auto gpu = encode_gpu(*c, x, DType::float32, n, &r, 2.0f, 0, s);
  const auto ref = cast_reference(*c, DType::bfloat16, x, DType::float32, n, &r, 2.0f);
  EXPECT_EQ(first_diff(gpu.packet, ref.packet), -1);
  EXPECT_EQ(first_diff_f(gpu.residual, ref.residual), -1);
  cudaStreamDestroy(s);
}

// ==========================================================================================================
// Top-k
// ==========================================================================================================
//! One top-k case on both backends against the stable_sort reference, added to `fails` (named by
//! spec, dtype, n, k, input kind, residual, divisor and the GPU's element offset).
void check_topk(Failures& fails, const std::string& spec, DType t, int64_t n, Kind kind, uint32_t seed, bool with_r,
                float div, int elem_offset = 0) {
  auto c = Codec::create(spec);
  const auto x = to_dtype(make_values(n, kind, seed), t);
  std::vector<float> r = make_values(n, kind == Kind::edges ? Kind::edges : Kind::normal, seed + 1);
  if (kind == Kind::zeros || kind == Kind::constant || kind == Kind::ties)
    std::fill(r.begin(), r.end(), 0.0f); // keep the ties exact
  const std::vector<float>* rp = with_r ? &r : nullptr;
  const std::string where = spec + " " + dn(t) + " n=" + std::to_string(n) + " k=" + std::to_string(c->main_param(n)) +
                            " " + kind_name(kind) + (with_r ? " residual" : "") + " div=" + std::to_string(div) +
                            " offset " + std::to_string(elem_offset);
  const auto cpu = encode_cpu(*c, x, t, n, rp, div);
  const auto gpu = encode_gpu(*c, x, t, n, rp, div, elem_offset);
  const DType vt = static_cast<DType>(cpu.packet[9]), it = static_cast<DType>(cpu.packet[10]);
  const auto ref = topk_reference(*c, vt, it, x, t, n, rp, div);
  fails.check(first_diff(cpu.packet, ref.packet), where + ": CPU packet vs the stable_sort reference, byte");
  fails.check(first_diff(gpu.packet, cpu.packet), where + ": GPU packet vs the CPU packet, byte");
  if (with_r) {
    fails.check(first_diff_f(cpu.residual, ref.residual), where + ": CPU residual vs the reference, element");
    fails.check(first_diff_f(gpu.residual, cpu.residual), where + ": GPU residual vs the CPU residual, element");
  }
}

TEST(CudaTopK, EveryKOnSmallInputs) {
  REQUIRE_GPU();
  Failures fails;
  uint32_t seed = 1000;
  for (int64_t n : {1, 2, 3, 7, 8, 9, 16, 17, 33}) {
    for (int64_t k = 0; k <= n; ++k) {
      for (Kind kind : {Kind::normal, Kind::ties, Kind::edges, Kind::zeros}) {
        check_topk(fails, "topk:k=" + std::to_string(k), DType::float32, n, kind, seed++, k % 2 == 1, 1.0f);
      }
    }
  }
  fails.report();
}

TEST(CudaTopK, SizesAroundPassBoundaries) {
  REQUIRE_GPU();
  namespace P = gradcomp::detail::cuda::plan;
  std::vector<int64_t> sizes = {0, 1, 7, 255, 256, 257, 2047, 2048, 2049, 8191, 8193,
                                P::kOneBlockMax - 1, P::kOneBlockMax, P::kOneBlockMax + 1, P::kOneBlockMax + 9,
                                4 * P::kChunk * 3 + 5, (1 << 20) - 1, (1 << 20) + 1, 3000017};
  Failures fails;
  uint32_t seed = 5000;
  for (int64_t n : sizes) {
    for (Kind kind : {Kind::normal, Kind::ties, Kind::zeros, Kind::constant, Kind::outlier, Kind::edges, Kind::skewed}) {
      for (const char* ratio : {"0.01", "0.3", "1"}) {
        check_topk(fails, std::string("topk:ratio=") + ratio, DType::float32, n, kind, seed++, true, 1.0f);
      }
    }
  }
  fails.report();
}

TEST(CudaTopK, DtypesIndexAndValueTypes) {
  REQUIRE_GPU();
  Failures fails;
  uint32_t seed = 9000;
  for (DType t : kDtypes) {
    for (const char* opt : {"", ",value_dtype=float32", ",value_dtype=float16", ",value_dtype=bfloat16", ",index=u64"}) {
      for (int64_t n : {int64_t(1000), int64_t(100003)}) {
        for (Kind kind : {Kind::normal, Kind::edges, Kind::ties}) {
          for (int variant = 0; variant < 4; ++variant) {
            check_topk(fails, std::string("topk:ratio=0.01") + opt, t, n, kind, seed++, variant & 1,
                       (variant & 2) ? 3.0f : 1.0f, variant == 3 ? 1 : 0);
          }
        }
      }
    }
    // multi-block with every dtype, misaligned, with a residual and a divisor
    check_topk(fails, "topk:ratio=0.01", t, 1500001, Kind::normal, seed++, true, 3.0f, 1);
    check_topk(fails, "topk:ratio=0.002,value_dtype=float16", t, 1500000, Kind::edges, seed++, true, 1.0f, 0);
  }
  fails.report();
}

TEST(CudaTopK, DecodeMatchesCpu) {
  REQUIRE_GPU();
  Failures fails;
  uint32_t seed = 12000;
  for (const char* spec : {"topk:ratio=0.05", "topk:k=0", "topk:ratio=1,value_dtype=float16", "topk:ratio=0.1,index=u64"}) {
    auto c = Codec::create(spec);
    for (DType t : kDtypes) {
      for (int64_t n : {int64_t(1), int64_t(100), int64_t(70001)}) {
        const auto x = to_dtype(make_values(n, Kind::edges, seed++), t);
        const auto packet = encode_cpu(*c, x, t, n, nullptr, 1.0f).packet;
        for (DType out_t : kDtypes) {
          const auto init = to_dtype(make_values(n, Kind::normal, seed++), out_t);
          for (DecodeMode mode : {DecodeMode::assign, DecodeMode::accumulate}) {
            for (float alpha : {1.0f, 0.5f}) {
              const std::string where = std::string(spec) + " in=" + dn(t) + " out=" + dn(out_t) + " n=" +
                                        std::to_string(n) + (mode == DecodeMode::accumulate ? " acc" : " assign") +
                                        " alpha=" + std::to_string(alpha);
              uint32_t s_cpu = 0, s_gpu = 0;
              const auto a = decode_cpu(*c, packet, out_t, n, init, mode, alpha, &s_cpu);
              const auto b = decode_gpu(*c, packet, out_t, n, init, mode, alpha, &s_gpu);
              fails.check(first_diff(a, b), where + ": decoded byte");
              fails.check(s_cpu == s_gpu ? -1 : int64_t(s_gpu), where + ": status (GPU's; the CPU's " +
                                                                    std::to_string(s_cpu) + ")");
            }
          }
        }
      }
    }
  }
  fails.report();
}

TEST(CudaTopK, CorruptPacketsSetStatusAndStayInBounds) {
  REQUIRE_GPU();
  const int64_t n = 1000;
  auto c = Codec::create("topk:k=10");
  const auto good = encode_cpu(*c, to_dtype(make_values(n, Kind::normal, 77), DType::float32), DType::float32, n,
                               nullptr, 1.0f)
                        .packet;
  uint32_t idx[10];
  std::memcpy(idx, good.data() + 32, sizeof idx);
  const std::vector<uint8_t> init(static_cast<size_t>(n * 4), 0x22);
  auto with_index = [&](int j, uint32_t v) {
    auto p = good;
    std::memcpy(p.data() + 32 + 4 * j, &v, 4);
    return p;
  };
  for (auto [what, pkt] : {std::pair{"index == numel", with_index(9, uint32_t(n))},
                           std::pair{"index huge", with_index(3, 0xFFFFFFF0u)},
                           std::pair{"out of order", with_index(5, idx[4] > 0 ? idx[4] - 1 : 0)},
                           std::pair{"repeated", with_index(6, idx[5])}}) {
    SCOPED_TRACE(what);
    for (DecodeMode mode : {DecodeMode::assign, DecodeMode::accumulate}) {
      uint32_t st = 0;
      const auto out = decode_gpu(*c, pkt, DType::float32, n, init, mode, 1.0f, &st);
      EXPECT_TRUE(st & gradcomp::kStatusCorrupt);
      // the untouched valid entries were still applied
      EXPECT_NE(fbits(ref_load(out, DType::float32, idx[0])), fbits(ref_load(init, DType::float32, idx[0])));
      EXPECT_THROW(decode_cpu(*c, pkt, DType::float32, n, init, mode, 1.0f, nullptr), gradcomp::CorruptPacket);
    }
  }
  for (int offset : {0, 6, 9, 10, 12, 16, 24}) {
    SCOPED_TRACE("header byte " + std::to_string(offset));
    auto bad = good;
    bad[size_t(offset)] ^= 0x40;
    uint32_t st = 0;
    const auto out = decode_gpu(*c, bad, DType::float32, n, init, DecodeMode::assign, 1.0f, &st);
    EXPECT_EQ(st, gradcomp::kStatusCorrupt);
    EXPECT_EQ(first_diff(out, init), -1) << "a packet with a corrupt header wrote into out";
  }
  uint32_t st = 0;
  const auto out = decode_gpu(*c, good, DType::float32, n, init, DecodeMode::assign, 1.0f, &st, 48);
  EXPECT_EQ(st, gradcomp::kStatusCorrupt);
  EXPECT_EQ(first_diff(out, init), -1);
}

TEST(CudaTopK, NonFiniteFlag) {
  REQUIRE_GPU();
  auto c = Codec::create("topk:k=3");
  std::vector<float> v(50000, 0.5f);
  v[1234] = -std::numeric_limits<float>::quiet_NaN();
  v[40000] = std::numeric_limits<float>::infinity();
  const auto x = to_dtype(v, DType::float32);
  const auto gpu = encode_gpu(*c, x, DType::float32, 50000, nullptr, 1.0f);
  EXPECT_EQ(gpu.packet[11] & 1, 1);
  uint32_t i0, i1, i2;
  std::memcpy(&i0, gpu.packet.data() + 32, 4);
  std::memcpy(&i1, gpu.packet.data() + 36, 4);
  std::memcpy(&i2, gpu.packet.data() + 40, 4);
  EXPECT_EQ(i0, 0u); // the tie among 0.5 goes to the lowest index
  EXPECT_EQ(i1, 1234u);
  EXPECT_EQ(i2, 40000u);
  uint32_t st = 0;
  const auto out = decode_gpu(*c, gpu.packet, DType::float32, 50000, std::vector<uint8_t>(200000, 0),
                              DecodeMode::accumulate, 1.0f, &st);
  EXPECT_EQ(st, gradcomp::kStatusNonFinite);
  EXPECT_TRUE(std::isnan(ref_load(out, DType::float32, 0)));
}

// Top-k of a large zero bfloat16 input with 64 planted values (magnitudes 1..64, bf16-exact,
// alternating signs) at `where`: the packet holds the planted indices plus the lowest zero indices
// up to k = 100, ascending, in `index_dtype`; decode (accumulate, alpha) adds the planted values back.
void check_planted_topk(int64_t n, const std::vector<int64_t>& where, DType index_dtype, float alpha) {
  auto c = Codec::create("topk:k=100");
  ASSERT_EQ(c->layout(n, DType::bfloat16).header.index_dtype, uint8_t(index_dtype));
  const int64_t pb = c->packet_bytes(n, DType::bfloat16), wb = c->workspace_bytes(n, DType::bfloat16, kGpu);
  size_t free_b = 0, total_b = 0;
  CK(cudaMemGetInfo(&free_b, &total_b));
  const size_t need = size_t(n) * 2 + size_t(pb) + size_t(wb) + (size_t(1) << 28);
  if (free_b < need) {
    if (::gradcomp_test::gpu_required() && total_b >= need) FAIL() << "needs " << need / (1 << 20) << " MiB, " << free_b / (1 << 20) << " free";
    GTEST_SKIP() << "needs " << need / (1 << 20) << " MiB of device memory, " << free_b / (1 << 20) << " free";
  }
  DevBuf dx(static_cast<size_t>(n) * 2), dp(static_cast<size_t>(pb)), dw(static_cast<size_t>(wb));
  ASSERT_TRUE(dx.p && dp.p && dw.p);
  CK(cudaMemset(dx.p, 0, size_t(n) * 2));
  CK(cudaMemset(dw.p, 0xFF, size_t(wb)));
  CK(cudaMemset(dw.p, 0, 16));
  auto planted = [&](size_t j) { return (j % 2 ? -1.0f : 1.0f) * float(j + 1); };
  for (size_t j = 0; j < where.size(); ++j) {
    const uint16_t b = ref_to_bf16(planted(j));
    CK(cudaMemcpy(dx.p + where[j] * 2, &b, 2, cudaMemcpyHostToDevice));
  }
  c->encode(Tensor{dx.p, DType::bfloat16, n, kGpu}, nullptr, Tensor{dp.p, DType::uint8, pb, kGpu},
            Tensor{dw.p, DType::uint8, wb, kGpu});
  CK(cudaDeviceSynchronize());
  const auto pk = download(dp.p, size_t(pb));
  std::vector<int64_t> expect = where;
  for (int64_t i = 0; int64_t(expect.size()) < 100; ++i)
    if (std::find(where.begin(), where.end(), i) == where.end()) expect.push_back(i);
  std::sort(expect.begin(), expect.end());
  ASSERT_EQ(pk[10], uint8_t(index_dtype));
  const int64_t isz = dsize(index_dtype);
  const int64_t voff = 32 + gradcomp::align16(100 * isz);
  for (int j = 0; j < 100; ++j) {
    uint64_t i = 0;
    std::memcpy(&i, pk.data() + 32 + isz * j, size_t(isz)); // little-endian
    ASSERT_EQ(int64_t(i), expect[size_t(j)]) << "entry " << j;
    uint16_t v;
    std::memcpy(&v, pk.data() + voff + 2 * j, 2);
    const auto it = std::find(where.begin(), where.end(), int64_t(i));
    EXPECT_EQ(ref_from_bf16(v), it == where.end() ? 0.0f : planted(size_t(it - where.begin()))) << "entry " << j;
  }
  DevBuf dws(64);
  CK(cudaMemset(dws.p, 0, 64));
  c->decode(Tensor{dp.p, DType::uint8, pb, kGpu}, Tensor{dx.p, DType::bfloat16, n, kGpu},
            Tensor{dws.p, DType::uint8, 64, kGpu}, DecodeMode::accumulate, alpha);
  EXPECT_EQ(gradcomp::read_status(Tensor{dws.p, DType::uint8, 64, kGpu}), 0u);
  for (size_t j = 0; j < where.size(); ++j) {
    uint16_t b;
    CK(cudaMemcpy(&b, dx.p + where[j] * 2, 2, cudaMemcpyDeviceToHost));
    EXPECT_EQ(ref_from_bf16(b), (1.0f + alpha) * planted(j)) << "index " << where[j];
  }
}

// 2^31 + 64 elements: 32 planted values around 2^31 (21 past it), uint32 indices.
TEST(CudaTopK, Huge2To31Plus64Bfloat16) {
  REQUIRE_GPU();
  std::vector<int64_t> where;
  for (int j = 0; j < 64; ++j)
    where.push_back(j < 32 ? int64_t(j) * 7919 * 4099 + 5 : (int64_t(1) << 31) - 32 + int64_t(j - 32) * 3);
  check_planted_topk((int64_t(1) << 31) + 64, where, DType::uint32, 2.0f);
}

// Two encodes on one workspace, not cleared in between (the kernels must reset what they use), on
// the one-block and the multi-block top-k and on the casts: the same packet twice, equal to the CPU's.
TEST(CudaWorkspace, TwoEncodesOnOneWorkspace) {
  REQUIRE_GPU();
  namespace P = gradcomp::detail::cuda::plan;
  uint32_t seed = 31000;
  for (const char* spec : {"topk:ratio=0.01", "topk:k=7", "fp16", "bf16", "none"}) {
    auto c = Codec::create(spec);
    for (int64_t n : {int64_t(1000), P::kOneBlockMax + 1, int64_t(3000017)}) {
      SCOPED_TRACE(std::string(spec) + " n=" + std::to_string(n));
      const auto x = to_dtype(make_values(n, Kind::normal, seed++), DType::float32);
      const auto want = encode_cpu(*c, x, DType::float32, n, nullptr, 1.0f).packet;
      const int64_t pb = c->packet_bytes(n, DType::float32), wb = c->workspace_bytes(n, DType::float32, kGpu);
      DevBuf dx(static_cast<size_t>(n) * 4), dp(static_cast<size_t>(pb)), dw(static_cast<size_t>(wb));
      ASSERT_TRUE(dx.p && dp.p && dw.p);
      upload(dx.p, x.data(), x.size());
      CK(cudaMemset(dw.p, 0xFF, size_t(wb)));
      CK(cudaMemset(dw.p, 0, 16));
      for (int rep = 0; rep < 2; ++rep) {
        CK(cudaMemset(dp.p, 0xCD, size_t(pb)));
        c->encode(Tensor{dx.p, DType::float32, n, kGpu}, nullptr, Tensor{dp.p, DType::uint8, pb, kGpu},
                  Tensor{dw.p, DType::uint8, wb, kGpu});
        CK(cudaDeviceSynchronize());
        EXPECT_EQ(first_diff(download(dp.p, size_t(pb)), want), -1) << "encode " << rep + 1;
      }
    }
  }
}

// A kernel that spins for `cycles` clock cycles, then writes x[i] = fill(i): the input of an encode
// queued behind it on the same stream. If any part of the encode (kernels, memsets) ran on another
// stream, it would read x before this kernel wrote it.
__global__ void spin_then_fill(float* x, int64_t n, long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) x[i] = float((i * 7919) % 1000003) * 1e-3f - 500.0f;
}

TEST(CudaStreams, NonDefaultStreamBehindALongKernel) {
  REQUIRE_GPU();
  const int64_t n = 1 << 20;
  std::vector<float> host_x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) host_x[size_t(i)] = float((i * 7919) % 1000003) * 1e-3f - 500.0f;
  const auto x = to_dtype(host_x, DType::float32);
  cudaStream_t s = nullptr;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); // no implicit sync with the default stream
  int clock_khz = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const long long cycles = (long long)clock_khz * 100; // about 100 ms
  for (const char* spec : {"topk:ratio=0.01", "topk:k=50", "fp16", "bf16"}) {
    SCOPED_TRACE(spec);
    auto c = Codec::create(spec);
    std::vector<float> r0(static_cast<size_t>(n), 0.125f);
    const auto want = encode_cpu(*c, x, DType::float32, n, &r0, 2.0f);
    const int64_t pb = c->packet_bytes(n, DType::float32), wb = c->workspace_bytes(n, DType::float32, kGpu);
    DevBuf dx(static_cast<size_t>(n) * 4), dr(static_cast<size_t>(n) * 4), dp(static_cast<size_t>(pb)),
        dw(static_cast<size_t>(wb)), dout(static_cast<size_t>(n) * 4), dws(16);
    ASSERT_TRUE(dx.p && dr.p && dp.p && dw.p && dout.p && dws.p);
    CK(cudaMemset(dx.p, 0, size_t(n) * 4));
    upload(dr.p, r0.data(), size_t(n) * 4);
    CK(cudaMemset(dw.p, 0xFF, size_t(wb)));
    CK(cudaMemset(dw.p, 0, 16));
    CK(cudaMemset(dws.p, 0, 16));
    CK(cudaDeviceSynchronize());
    spin_then_fill<<<1, 256, 0, s>>>(reinterpret_cast<float*>(dx.p), n, cycles);
    CK(cudaGetLastError());
    Tensor rt{dr.p, DType::float32, n, kGpu};
    c->encode(Tensor{dx.p, DType::float32, n, kGpu}, &rt, Tensor{dp.p, DType::uint8, pb, kGpu},
              Tensor{dw.p, DType::uint8, wb, kGpu}, 2.0f, {}, gradcomp::Stream{s});
    c->decode(Tensor{dp.p, DType::uint8, pb, kGpu}, Tensor{dout.p, DType::float32, n, kGpu},
              Tensor{dws.p, DType::uint8, 16, kGpu}, DecodeMode::assign, 1.0f, gradcomp::Stream{s});
    // read_status synchronizes the stream it is given: the whole chain, in order
    EXPECT_EQ(gradcomp::read_status(Tensor{dws.p, DType::uint8, 16, kGpu}, gradcomp::Stream{s}), 0u);
    EXPECT_EQ(first_diff(download(dp.p, size_t(pb)), want.packet), -1) << "the encode did not wait for the input";
    std::vector<float> r(static_cast<size_t>(n));
    CK(cudaMemcpy(r.data(), dr.p, size_t(n) * 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(first_diff_f(r, want.residual), -1);
    const auto out = download(dout.p, size_t(n) * 4);
    const auto cpu_out = decode_cpu(*c, want.packet, DType::float32, n, std::vector<uint8_t>(size_t(n) * 4, 0),
                                    DecodeMode::assign, 1.0f, nullptr);
    EXPECT_EQ(first_diff(out, cpu_out), -1);
  }
  CK(cudaStreamDestroy(s));
}

// 64-bit indices chosen by index=auto: a planted bfloat16 input of 2^32 + 64 elements (8 GiB; it
// fits on an H200), half of the planted values past 2^32.
TEST(CudaTopK, Index64AutoPlanted2To32Plus64Bfloat16) {
  REQUIRE_GPU();
  std::vector<int64_t> where;
  for (int j = 0; j < 64; ++j)
    where.push_back(j < 32 ? int64_t(j) * 104729 * 1031 + 11 : (int64_t(1) << 32) - 16 + int64_t(j - 32) * 2);
  check_planted_topk((int64_t(1) << 32) + 64, where, DType::uint64, 1.0f);
}

// The multi-device fixes that can be told on one GPU: read_status works from a thread that never
// touched a device, and leaves no device made current behind it.
TEST(CudaDevices, ReadStatusAndGuardOnAFreshThread) {
  REQUIRE_GPU();
  DevBuf dws(16);
  CK(cudaMemset(dws.p, 0, 16));
  CK(cudaDeviceSynchronize());
  uint32_t got = 99;
  std::thread([&] { got = gradcomp::read_status(Tensor{dws.p, DType::uint8, 16, kGpu}); }).join();
  EXPECT_EQ(got, 0u);
}

// The hardware convert the CUDA fp8 encoder uses (cuda_fp8.h, satfinite, round to nearest even;
// its host implementation here, no GPU needed) gives the codes of common::float_to_e4m3fn /
// float_to_e5m2 for every finite quotient a block scale can produce (|q| below the overflow
// thresholds 464 / 61440; the kernel handles non-finite quotients before the convert).
TEST(CudaFp8Convert, HardwareConvertMatchesTheCommonRounding) {
  std::mt19937_64 g(ref::test_seed() + 4242);
  std::vector<float> vals;
  for (uint32_t e = 90; e < 147; ++e)
    for (int k = 0; k < 4000; ++k) vals.push_back(bitsf((uint32_t(g()) & 0x807FFFFFu) | (e << 23)));
  for (float v : {0.0f, -0.0f, 448.0f, -448.0f, 463.99997f, 57344.0f, 61439.996f, 1e-40f, 1.4e-45f}) vals.push_back(v);
  int bad = 0;
  for (float v : vals) {
    if (std::fabs(v) < 464.0f) {
      const uint8_t hw = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
      if (hw != gradcomp::common::float_to_e4m3fn(v) && bad++ < 10)
        ADD_FAILURE() << "e4m3 " << v << ": hw 0x" << std::hex << int(hw);
    }
    if (std::fabs(v) < 61440.0f) {
      const uint8_t hw = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
      if (hw != gradcomp::common::float_to_e5m2(v) && bad++ < 10)
        ADD_FAILURE() << "e5m2 " << v << ": hw 0x" << std::hex << int(hw);
    }
  }
}

// One input through encode and decode on both backends, added to `fails`: with and without a
// residual (0.03125 everywhere; the no-EF path too), divisor 3 for variant 1 (which also encodes at
// a misaligned offset on the GPU), else 1; the packets, the residuals, and the CPU packet decoded
// (accumulate, alpha 0.5) into every dtype on both, with the status word. The blockq and onebit
// sweeps call it.
void encode_decode_vs_cpu(Failures& fails, const Codec& c, const std::string& spec, const std::vector<uint8_t>& x,
                          DType t, int64_t n, int variant, uint32_t& seed) {
  std::vector<float> r(static_cast<size_t>(n), 0.03125f);
  const float div = variant == 1 ? 3.0f : 1.0f;
  for (bool with_r : {false, true}) {
    const std::string where = spec + " " + dn(t) + " n=" + std::to_string(n) + " variant " + std::to_string(variant) +
                              (with_r ? " residual" : " no residual");
    const auto cpu = encode_cpu(c, x, t, n, with_r ? &r : nullptr, div);
    const auto gpu = encode_gpu(c, x, t, n, with_r ? &r : nullptr, div, variant == 1 ? 1 : 0);
    fails.check(first_diff(gpu.packet, cpu.packet), where + ": packet byte");
    if (with_r) fails.check(first_diff_f(gpu.residual, cpu.residual), where + ": residual element");
    for (DType out_t : kDtypes) {
      const auto init = to_dtype(make_values(n, Kind::normal, seed++), out_t);
      uint32_t s_cpu = 0, s_gpu = 0;
      const auto a = decode_cpu(c, cpu.packet, out_t, n, init, DecodeMode::accumulate, 0.5f, &s_cpu);
      const auto b = decode_gpu(c, cpu.packet, out_t, n, init, DecodeMode::accumulate, 0.5f, &s_gpu);
      fails.check(first_diff(a, b), where + ": decode to " + dn(out_t) + " byte");
      fails.check(s_cpu == s_gpu ? -1 : int64_t(s_gpu), where + ": decode status");
    }
  }
}

// Block quantizers: CUDA packets, residuals and decoded values byte-for-byte equal to the CPU
// backend's (whose semantics tests/cpp/test_quant.cpp and tests/python/test_quant.py check against
// independent references), for every example spec, input dtype, divisor, sizes around the tile and
// block boundaries, edge values, aligned and misaligned inputs.
TEST(CudaBlockQ, PacketsAndResidualsEqualTheCpu) {
  REQUIRE_GPU();
  Failures fails;
  uint32_t seed = 51000;
  std::vector<std::string> specs;
  for (const auto& info : gradcomp::list_codecs())
    if (info.name == "fp8" || info.name == "int8" || info.name == "int4")
      for (const auto& e : info.examples) specs.push_back(e);
  specs.push_back("fp8:block=1024");
  specs.push_back("int4:block=1026");
  for (const std::string& spec : specs) {
    auto c = Codec::create(spec);
    for (DType t : kDtypes) {
      for (int64_t n : {int64_t(1), int64_t(7), int64_t(33), int64_t(1023), int64_t(1025), int64_t(70001),
                        int64_t(1) << 20}) {
        if (small_sizes() && n > kSmallMaxNumel) continue;  // GRADCOMP_TEST_SMALL=1 (compute-sanitizer)
        for (int variant = 0; variant < 3; ++variant) {
          SCOPED_TRACE(spec + " " + dn(t) + " n=" + std::to_string(n) + " variant " + std::to_string(variant));
          const auto x = to_dtype(make_values(n, variant == 2 ? Kind::edges : Kind::normal, seed++), t);
          encode_decode_vs_cpu(fails, *c, spec, x, t, n, variant, seed);
        }
      }
    }
  }
  fails.report();
}

TEST(CudaBlockQ, CorruptHeaderWritesNothing) {
  REQUIRE_GPU();
  const int64_t n = 4000;
  for (const char* spec : {"fp8", "int4", "fp8:scale=e8m0"}) {
    auto c = Codec::create(spec);
    const auto good = encode_cpu(*c, to_dtype(make_values(n, Kind::normal, 9), DType::float32), DType::float32, n,
                                 nullptr, 1.0f).packet;
    const std::vector<uint8_t> init(static_cast<size_t>(n * 4), 0x33);
    for (int offset : {0, 6, 8, 9, 11, 12, 16, 24}) {
      SCOPED_TRACE(std::string(spec) + " header byte " + std::to_string(offset));
      auto bad = good;
      bad[size_t(offset)] ^= 0x40;
      uint32_t st = 0;
      const auto out = decode_gpu(*c, bad, DType::float32, n, init, DecodeMode::assign, 1.0f, &st);
      EXPECT_EQ(st, gradcomp::kStatusCorrupt);
      EXPECT_EQ(first_diff(out, init), -1);
    }
  }
}

// onebit: CUDA packets (bits from warp ballots, scales from the warp-shuffle form of the fixed
// reduction tree), residuals and decoded values byte-for-byte equal to the CPU backend's (checked
// against numpy in tests/python/test_onebit.py), for every example spec plus chunks of several
// reduce tiles and chunk=0 on 2^20 elements (three kernels), every dtype, divisors 1 and 3, edges.
TEST(CudaOnebit, PacketsAndResidualsEqualTheCpu) {
  REQUIRE_GPU();
  Failures fails;
  uint32_t seed = 61000;
  std::vector<std::string> specs;
  for (const auto& info : gradcomp::list_codecs())
    if (info.name == "onebit")
      for (const auto& e : info.examples) specs.push_back(e);
  specs.push_back("onebit:chunk=12296");
  specs.push_back("onebit:chunk=262144,scale=mean_abs");
  for (const std::string& spec : specs) {
    auto c = Codec::create(spec);
    for (DType t : kDtypes) {
      for (int64_t n : {int64_t(1), int64_t(7), int64_t(33), int64_t(4097), int64_t(70001), int64_t(1) << 20}) {
        if (small_sizes() && n > kSmallMaxNumel) continue;  // GRADCOMP_TEST_SMALL=1 (compute-sanitizer)
        for (int variant = 0; variant < 3; ++variant) {
          SCOPED_TRACE(spec + " " + dn(t) + " n=" + std::to_string(n) + " variant " + std::to_string(variant));
          const auto x = to_dtype(make_values(n, variant == 2 ? Kind::edges : Kind::normal, seed++), t);
          encode_decode_vs_cpu(fails, *c, spec, x, t, n, variant, seed);
        }
      }
    }
  }
  fails.report();
}

// The header's non-finite flag (byte 11, bit 0) with one NaN in 2^20 elements, with and without a
// residual, for chunks of one reduce tile and of several (the three-kernel path, whose scale pass
// once computed the flag and dropped it when the residual pass finished the packet): set on the GPU
// exactly as on the CPU. GRADCOMP_TEST_SMALL=1: 70001 elements (still 18 reduce tiles of 4096).
TEST(CudaOnebit, NonFiniteFlagOnEveryPath) {
  REQUIRE_GPU();
  const int64_t n = small_sizes() ? kSmallMaxNumel : int64_t(1) << 20;
  std::vector<float> v(static_cast<size_t>(n), 0.25f);
  v[size_t(small_sizes() ? 44444 : 777777)] = std::numeric_limits<float>::quiet_NaN();
  const auto x = to_dtype(v, DType::float32);
  std::vector<float> r(static_cast<size_t>(n), 0.0f);
  for (const std::string spec : {"onebit", "onebit:chunk=4096", "onebit:chunk=12296"}) {  // whole tensor, 1 and 4 tiles
    auto c = Codec::create(spec);
    for (bool with_r : {false, true}) {
      SCOPED_TRACE(spec + (with_r ? " with a residual" : " without a residual"));
      const auto cpu = encode_cpu(*c, x, DType::float32, n, with_r ? &r : nullptr, 1.0f);
      const auto gpu = encode_gpu(*c, x, DType::float32, n, with_r ? &r : nullptr, 1.0f);
      EXPECT_EQ(cpu.packet[11] & 1, 1);
      EXPECT_EQ(gpu.packet[11] & 1, 1);
      EXPECT_EQ(first_diff(gpu.packet, cpu.packet), -1);
    }
  }
}

// ==========================================================================================================
// n > 2^31: the block quantizers and onebit
// ==========================================================================================================
GRADCOMP_HD uint64_t mix64(uint64_t z) {  // splitmix64's finalizer
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
//! Element i of the huge test's inputs, the same bits on the host and the device (integer hash, then
//! exact conversions only): a sum of two uniform 24-bit integers (triangular on (-2, 2): normal-ish)
//! times 2^e, e in [-8, 7] constant over each 4096 elements (block scales that differ); 1 in 256 zero.
GRADCOMP_HD float huge_value(uint64_t i, uint64_t salt) {
  const uint64_t h = mix64(i ^ salt);
  if ((h & 0xFFu) == 0) return 0.0f;
  const int32_t k = int32_t((h >> 40) & 0xFFFFFFu) + int32_t((h >> 16) & 0xFFFFFFu) - 0x1000000;  // |k| < 2^24
  const int32_t e = int32_t(mix64((i >> 12) ^ salt ^ 0x5555u) >> 60) - 8;
  return float(k) * gradcomp::common::bits_float(uint32_t(127 - 23 + e) << 23);  // exact: k * 2^(e - 23)
}
constexpr float kHugeResidualScale = 0.0625f;

__global__ void fill_huge(uint16_t* x, float* r, int64_t n, uint64_t salt_x, uint64_t salt_r) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = gradcomp::common::float_to_bf16_bits(huge_value(uint64_t(i), salt_x));
    r[i] = huge_value(uint64_t(i), salt_r) * kHugeResidualScale;
  }
}

//! f(begin, end) over [0, n) split among every host thread.
template <class F> void parallel_for(int64_t n, F&& f) {
  const int64_t nt = std::max(1u, std::thread::hardware_concurrency());
  const int64_t step = (n + nt - 1) / nt;
  std::vector<std::thread> threads;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t b = std::min(n, t * step), e = std::min(n, b + step);
    threads.emplace_back([&f, b, e] { f(b, e); });
  }
  for (auto& th : threads) th.join();
}

//! Uninitialized 64-byte aligned host memory (a std::vector would zero gigabytes first).
struct HostBuf {
  uint8_t* p = nullptr;
  explicit HostBuf(size_t b) : p(static_cast<uint8_t*>(std::aligned_alloc(64, (std::max<size_t>(b, 1) + 63) / 64 * 64))) {}
  ~HostBuf() { std::free(p); }
  HostBuf(const HostBuf&) = delete;
  HostBuf& operator=(const HostBuf&) = delete;
  template <class T> T* as() const { return reinterpret_cast<T*>(p); }
};

//! The first element (`elem` bytes each) at which a device array and a host array of `count`
//! elements differ bitwise, or -1. Reads the device array in 256 MiB pieces (no host copy of it all).
int64_t first_diff_device(const uint8_t* dev, const uint8_t* host, int64_t count, size_t elem) {
  const size_t total = size_t(count) * elem, piece = size_t(1) << 28;  // a multiple of every elem
  const size_t staging = std::max<size_t>(1, std::min(piece, total));
  uint8_t* pinned = nullptr;
  std::vector<uint8_t> pageable;
  if (cudaMallocHost(&pinned, staging) != cudaSuccess) {
    pinned = nullptr;
    pageable.resize(staging);
  }
  uint8_t* buf = pinned ? pinned : pageable.data();
  int64_t diff = -1;
  for (size_t off = 0; off < total && diff < 0; off += piece) {
    const size_t len = std::min(piece, total - off);
    if (cudaMemcpy(buf, dev + off, len, cudaMemcpyDeviceToHost) != cudaSuccess) {
      ADD_FAILURE() << "cudaMemcpy of " << len << " bytes at " << off << " failed";
      diff = int64_t(off / elem);
    } else if (std::memcmp(buf, host + off, len) != 0) {
      for (size_t j = 0; j < len; ++j)
        if (buf[j] != host[off + j]) {
          diff = int64_t((off + j) / elem);
          break;
        }
    }
  }
  if (pinned) cudaFreeHost(pinned);
  return diff;
}

// n = 2^31 + 4099 bfloat16 elements with a float32 residual (the residual dtype of every codec:
// Codec::encode accepts float32 only), divisor 2: int4, fp8 and onebit (default specs) encode on the
// GPU and on the CPU (OpenMP) to the same packet and the same residual, and the CPU packet decodes
// (accumulate, alpha 0.5, into x itself: the GPU's copy and the host's) to the same bfloat16 values,
// with the same status word. The inputs come from a hash of the index, generated on both sides
// (huge_value: no 12 GiB upload per codec; a few windows are compared to show both sides agree),
// with finite extremes planted around 2^31 and at both ends. Host memory: x (4 GiB), the residual
// (8 GiB), the CPU packet and workspace (at most about 2.2 GiB), a 256 MiB staging buffer: the GPU's
// packet, residual and decoded values are compared piece by piece. Device: about 15 GiB. Skips
// without a GPU, with less than 24 GiB of free device memory, and under GRADCOMP_TEST_SMALL=1.
TEST(CudaHuge, Int4Fp8OnebitBfloat16WithResidual2To31Plus4099) {
  REQUIRE_GPU();
  if (small_sizes()) GTEST_SKIP() << "GRADCOMP_TEST_SMALL=1: the 2^31-element test skips";
  const int64_t n = (int64_t(1) << 31) + 4099;
  const DType t = DType::bfloat16;
  const float divisor = 2.0f, alpha = 0.5f;
  const char* const specs[] = {"int4", "fp8", "onebit"};
  int64_t max_pb = 0, max_wb = 0;
  for (const char* spec : specs) {
    auto c = Codec::create(spec);
    max_pb = std::max(max_pb, c->packet_bytes(n, t));
    max_wb = std::max(max_wb, c->workspace_bytes(n, t, kGpu));
  }
  size_t free_b = 0, total_b = 0;
  CK(cudaMemGetInfo(&free_b, &total_b));
  const size_t need = std::max(size_t(n) * (2 + 4) + size_t(max_pb) + size_t(max_wb) + (size_t(1) << 28), size_t(24) << 30);
  if (free_b < need)
    GTEST_SKIP() << "needs " << need / (1 << 20) << " MiB of free device memory (at least 24 GiB), " << free_b / (1 << 20)
                 << " MiB free";

  const int64_t mid = int64_t(1) << 31;
  const std::pair<int64_t, float> planted[] = {
      {0, 3.0e37f},         {mid - 3, -2.5e35f},    {mid - 2, 65504.0f}, {mid - 1, -1.0e-40f},
      {mid, 3.0e37f},       {mid + 1, -448.0f},     {mid + 2, 1.0e-30f}, {mid + 7, -0.0f},
      {mid + 4095, 57344.0f}, {mid + 4096, -1.0e30f}, {n - 2, 12345.678f}, {n - 1, -3.0e37f}};
  const uint64_t salt_x = ref::test_seed() * 0x9E3779B97F4A7C15ull + 71000, salt_r = salt_x ^ 0xA5A5A5A5A5A5A5A5ull;
  Failures fails;
  HostBuf x(size_t(n) * 2), r(size_t(n) * 4);
  ASSERT_TRUE(x.p && r.p) << "cannot allocate 12 GiB of host memory";
  uint16_t* const xh = x.as<uint16_t>();
  float* const rh = r.as<float>();
  for (const char* spec : specs) {
    const auto t0 = std::chrono::steady_clock::now();
    auto c = Codec::create(spec);
    const std::string where = std::string(spec) + " bfloat16 n=" + std::to_string(n) + " residual divisor 2";
    const int64_t pb = c->packet_bytes(n, t), wb = c->workspace_bytes(n, t, kGpu);
    // inputs: on the host (threads) and on the device (a kernel), then the planted values on both
    parallel_for(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        xh[i] = gradcomp::common::float_to_bf16_bits(huge_value(uint64_t(i), salt_x));
        rh[i] = huge_value(uint64_t(i), salt_r) * kHugeResidualScale;
      }
    });
    DevBuf dx(size_t(n) * 2), dr(size_t(n) * 4), dp(static_cast<size_t>(pb)), dw(static_cast<size_t>(wb));
    ASSERT_TRUE(dx.p && dr.p && dp.p && dw.p) << where << ": cudaMalloc";
    fill_huge<<<4096, 256>>>(reinterpret_cast<uint16_t*>(dx.p), reinterpret_cast<float*>(dr.p), n, salt_x, salt_r);
    CK(cudaGetLastError());
    for (const auto& [i, v] : planted) {
      xh[i] = gradcomp::common::float_to_bf16_bits(v);
      CK(cudaMemcpy(dx.p + i * 2, &xh[i], 2, cudaMemcpyHostToDevice));
    }
    for (int64_t w0 : {int64_t(0), mid - 2048, n - 4096}) {
      fails.check(first_diff_device(dx.p + w0 * 2, x.p + w0 * 2, 4096, 2), where + ": generated x (window at " +
                                                                               std::to_string(w0) + "), element");
      fails.check(first_diff_device(dr.p + w0 * 4, r.p + w0 * 4, 4096, 4), where + ": generated residual (window at " +
                                                                               std::to_string(w0) + "), element");
    }
    // the GPU encode
    CK(cudaMemset(dp.p, 0xCD, size_t(pb)));
    CK(cudaMemset(dw.p, 0xFF, size_t(wb)));  // garbage workspace: encode must not rely on zeroed scratch
    CK(cudaMemset(dw.p, 0, 16));
    Tensor drt{dr.p, DType::float32, n, kGpu};
    c->encode(Tensor{dx.p, t, n, kGpu}, &drt, Tensor{dp.p, DType::uint8, pb, kGpu}, Tensor{dw.p, DType::uint8, wb, kGpu},
              divisor);
    CK(cudaDeviceSynchronize());
    // the CPU encode (residual in place in r), then the comparisons
    const int64_t cwb = c->workspace_bytes(n, t, Device{});
    HostBuf pk(static_cast<size_t>(pb)), ws(static_cast<size_t>(cwb));
    ASSERT_TRUE(pk.p && ws.p);
    Tensor rt{r.p, DType::float32, n, Device{}};
    c->encode(Tensor{x.p, t, n, Device{}}, &rt, Tensor{pk.p, DType::uint8, pb, Device{}},
              Tensor{ws.p, DType::uint8, cwb, Device{}}, divisor);
    fails.check(first_diff_device(dp.p, pk.p, pb, 1), where + ": GPU packet vs the CPU packet, byte");
    fails.check(first_diff_device(dr.p, r.p, n, 4), where + ": GPU residual vs the CPU residual, element");
    // the CPU packet decoded on both, accumulated into x
    CK(cudaMemcpy(dp.p, pk.p, size_t(pb), cudaMemcpyHostToDevice));
    DevBuf dws(64);
    CK(cudaMemset(dws.p, 0, 64));
    c->decode(Tensor{dp.p, DType::uint8, pb, kGpu}, Tensor{dx.p, t, n, kGpu}, Tensor{dws.p, DType::uint8, 64, kGpu},
              DecodeMode::accumulate, alpha);
    const uint32_t s_gpu = gradcomp::read_status(Tensor{dws.p, DType::uint8, 64, kGpu});
    alignas(16) uint32_t cws[4] = {0, 0, 0, 0};
    c->decode(Tensor{pk.p, DType::uint8, pb, Device{}}, Tensor{x.p, t, n, Device{}}, Tensor{cws, DType::uint8, 16, Device{}},
              DecodeMode::accumulate, alpha);
    fails.check(s_gpu == cws[0] ? -1 : int64_t(s_gpu), where + ": decode status (GPU's; the CPU's " +
                                                          std::to_string(cws[0]) + ")");
    fails.check(first_diff_device(dx.p, x.p, n, 2), where + ": decoded bfloat16 (GPU vs CPU), element");
    std::printf("[CudaHuge] %s: %lld elements, packet %lld bytes, %.1f s\n", spec, (long long)n, (long long)pb,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
  }
  fails.report();
}

TEST(CudaInfo, BuildInfo) {
  const auto b = gradcomp::build_info();
  EXPECT_TRUE(b.cuda);
  EXPECT_FALSE(b.cuda_version.empty());
  EXPECT_NE(b.cuda_version.find('.'), std::string::npos);
  EXPECT_FALSE(b.cuda_architectures.empty());
}

} // namespace
