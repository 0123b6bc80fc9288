// SPDX-License-Identifier: Apache-2.0
// CUDA backend of low rank (include/gradcomp/lowrank.hpp, kernels/cuda/lowrank.cu) against
// references written here, independently of the library (no library function computes an
// expected value):
//  - project / back_project: binary64 loops; |GPU - ref| <= cols (rows) * 2^-23 * sum |terms|
//    (the float32 GEMM error bound with a factor 2 to spare; the order of cuBLAS's sums is its own);
//  - orthogonalize: the header's classical Gram-Schmidt (two passes, the float32 output columns
//    projected out, w / (norm + eps)) in long double; |GPU - ref| <= 1e-6 on well-conditioned
//    inputs, plus orthonormality (eps = 0); zero columns bitwise +0.0, NaN / inf columns NaN;
//  - reconstruct: BITWISE against a scalar float loop in k order written here (binary32 products
//    and sums with the NaN rule of docs/contracts.md section 2 spelled out, cuda_fp16 / cuda_bf16 host
//    conversions for the output dtypes), the residual likewise; the status bit; out and residual
//    untouched outside the matrices;
//  - random_normal: a Philox4x64-10 written here (checked against Random123's known-answer
//    vectors, which runs without a GPU) and the header's Box-Muller with the host's log/cos:
//    bitwise except where CUDA's binary64 log/cos (1-2 ulp) round to the other float (rare, <= 1 ulp).
// Every test that needs a GPU skips without one (fails with GRADCOMP_REQUIRE_GPU=1). The same
// bodies also run as LowrankHarnessOnCpu.* on CPU tensors against the CPU backend: that checks
// the references of this file where no GPU is (it is not a test of the CUDA kernels).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "gradcomp/lowrank.hpp"
#include "gpu_guard.hpp"
#include "seed.hpp"

namespace {

using gradcomp::Device;
using gradcomp::DeviceKind;
using gradcomp::DType;
using gradcomp::Stream;
using gradcomp::Tensor;
namespace lr = gradcomp::lowrank;
using gradcomp_test::small_sizes;
//! GRADCOMP_TEST_SMALL=1 (gpu_guard.hpp: for compute-sanitizer) keeps the matrices of at most this
//! many elements in the shape sweeps (their smallest few) and drops the inputs above 70001 elements.
constexpr int64_t kSmallMatrix = 4096;


const Device kGpu{DeviceKind::cuda, 0};
const Device kCpu{DeviceKind::cpu, 0};
//! The device the helpers below allocate on and run on: the GPU, except in the LowrankHarnessOnCpu
//! tests, which run the same checks on CPU tensors against the CPU backend to validate this file's
//! references where no GPU is (so that a failure on the GPU machine points at the kernels).
Device g_device = kGpu;
struct OnDevice {
  Device prev;
  explicit OnDevice(Device d) : prev(g_device) { g_device = d; }
  ~OnDevice() { g_device = prev; }
};
bool on_gpu() { return g_device.kind == DeviceKind::cuda; }

// ---- buffers on g_device -----------------------------------------------------------------------------
template <class T> struct Dev {
  T* p = nullptr;
  int64_t n = 0;
  bool gpu = on_gpu();
  explicit Dev(int64_t count) : n(count) {
    const size_t bytes = size_t(std::max<int64_t>(count, 1)) * sizeof(T);
    if (gpu) {
      if (cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
    } else {
      p = static_cast<T*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    }
  }
  Dev(const std::vector<T>& h) : Dev(int64_t(h.size())) { put(h); }
  ~Dev() {
    if (p && gpu) cudaFree(p);
    else std::free(p);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void put(const std::vector<T>& h) {
    if (gpu) EXPECT_EQ(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    else if (!h.empty()) std::memcpy(p, h.data(), h.size() * sizeof(T));
  }
  std::vector<T> get() const {
    std::vector<T> h(static_cast<size_t>(n));
    if (gpu) EXPECT_EQ(cudaMemcpy(h.data(), p, h.size() * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    else if (n > 0) std::memcpy(h.data(), p, h.size() * sizeof(T));
    return h;
  }
  Tensor t(DType dt) const {
    return Tensor{p, dt, n * int64_t(sizeof(T)) / gradcomp::dtype_size(dt), gpu ? kGpu : kCpu};
  }
};

//! A non-blocking stream of its own on the GPU (nothing on the CPU).
struct StreamGuard {
  cudaStream_t s = nullptr;
  StreamGuard() {
    if (on_gpu()) EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  }
  ~StreamGuard() {
    if (s) cudaStreamDestroy(s);
  }
  Stream stream() const { return Stream{s}; }
  void sync() const {
    if (s) ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  }
};

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

std::vector<float> normals(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(uint32_t(ref::test_seed()) + seed);  // seed.hpp: fixed by default, GRADCOMP_TEST_SEED
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = nd(rng);
  return v;
}

// ---- GEMM references ---------------------------------------------------------------------------------
struct Shape {
  int64_t rows, cols, rank;
};

//! Checks P (project) or Q (back_project) against binary64 loops over the same M and factors.
void expect_gemm(const std::vector<float>& M, const std::vector<int64_t>& off, const Shape& s, const std::vector<float>& in,
                 const std::vector<float>& got, bool back, const std::string& what) {
  const int64_t n_out = back ? s.cols : s.rows, n_sum = back ? s.rows : s.cols;
  int bad = 0;
  for (size_t b = 0; b < off.size(); ++b) {
    const float* Mb = M.data() + off[b];
    for (int64_t o = 0; o < n_out; ++o)
      for (int64_t k = 0; k < s.rank; ++k) {
        double ref = 0.0, mag = 0.0;
        for (int64_t t = 0; t < n_sum; ++t) {
          const double m = back ? Mb[t * s.cols + o] : Mb[o * s.cols + t];
          const double f = in[(b * n_sum + t) * s.rank + k];
          ref += m * f;
          mag += std::fabs(m * f);
        }
        const double g = got[(b * n_out + o) * s.rank + k];
        const double tol = double(n_sum + 2) * 0x1p-23 * mag + 1e-35;
        if (!(std::fabs(g - ref) <= tol) && bad++ < 5)
          ADD_FAILURE() << what << ": matrix " << b << " [" << o << "][" << k << "] = " << g << ", reference " << ref
                        << " (tolerance " << tol << ")";
      }
  }
  EXPECT_EQ(bad, 0) << what;
}

void run_gemms(const Shape& s, const std::vector<int64_t>& off, uint32_t seed) {
  const int64_t mat = s.rows * s.cols;
  int64_t extent = 0;
  for (int64_t o : off) extent = std::max(extent, o + mat);
  const int64_t count = int64_t(off.size());
  const std::vector<float> M = normals(extent + 3, seed);
  const std::vector<float> Q = normals(count * s.cols * s.rank, seed + 1);
  const std::vector<float> P = normals(count * s.rows * s.rank, seed + 2);
  Dev<float> dM(M), dQ(Q), dP(count * s.rows * s.rank), dP2(P), dQ2(count * s.cols * s.rank);
  ASSERT_TRUE(dM.p && dQ.p && dP.p && dP2.p && dQ2.p);
  StreamGuard sg;
  lr::MatrixBatch m{dM.t(DType::float32), off.data(), count, s.rows, s.cols};
  const std::string tag = "[" + std::to_string(s.rows) + " x " + std::to_string(s.cols) + "] rank " +
                          std::to_string(s.rank) + " count " + std::to_string(count);
  lr::project(m, dQ.t(DType::float32), dP.t(DType::float32), s.rank, sg.stream());
  lr::back_project(m, dP2.t(DType::float32), dQ2.t(DType::float32), s.rank, sg.stream());
  sg.sync();
  expect_gemm(M, off, s, Q, dP.get(), false, "project " + tag);
  expect_gemm(M, off, s, P, dQ2.get(), true, "back_project " + tag);
}

// ---- Philox4x64-10 and Box-Muller, written here ---------------------------------------------------------
struct U64x4 {
  uint64_t v[4];
};
U64x4 philox4x64_10(U64x4 c, uint64_t k0, uint64_t k1) {
  constexpr uint64_t kM0 = 0xD2E7470EE14C6C93ull, kM1 = 0xCA5A826395121157ull;
  constexpr uint64_t kW0 = 0x9E3779B97F4A7C15ull, kW1 = 0xBB67AE8584CAA73Bull;
  for (int r = 0; r < 10; ++r) {
    if (r > 0) k0 += kW0, k1 += kW1;
    const unsigned __int128 p0 = (unsigned __int128)kM0 * c.v[0], p1 = (unsigned __int128)kM1 * c.v[2];
    const uint64_t hi0 = uint64_t(p0 >> 64), lo0 = uint64_t(p0), hi1 = uint64_t(p1 >> 64), lo1 = uint64_t(p1);
    c = U64x4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
  }
  return c;
}
float ref_normal(uint64_t e, uint64_t seed, uint64_t stream_id) {
  const U64x4 r = philox4x64_10(U64x4{{e, stream_id, 0, 0}}, seed, 0x9E3779B97F4A7C15ull);
  const double u1 = double((r.v[0] >> 11) + 1) * 0x1p-53;
  const double u2 = double(r.v[1] >> 11) * 0x1p-53;
  const double two_pi = 6.283185307179586;
  const double v = std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2);
  return float(v);
}

// ---- orthogonalize reference: the header's rule in long double ---------------------------------------------
//! X: count matrices [rows, rank] (row-major). Column k is computed from input column k and the
//! float32 output columns j < k (the header projects out the outputs). `basis`: take those columns
//! j < k from here (the GPU's result) instead of from the reference's own outputs, so that each
//! column is checked on its own and a last-bit difference in one column is not amplified through
//! the following ones (ill-conditioned inputs, e.g. square matrices).
std::vector<float> ref_orthogonalize(const std::vector<float>& X, int64_t count, int64_t rows, int64_t rank, float eps,
                                     const lr::Redraw* redraw, const std::vector<float>* basis = nullptr) {
  using LD = long double;
  std::vector<float> out = X;
  for (int64_t b = 0; b < count; ++b) {
    const float* x = X.data() + b * rows * rank;
    float* o = out.data() + b * rows * rank;
    const float* q = basis != nullptr ? basis->data() + b * rows * rank : o;
    std::vector<LD> w(static_cast<size_t>(rows)), d(static_cast<size_t>(rank));
    auto project = [&](int64_t k) {
      for (int pass = 0; pass < 2; ++pass) {
        for (int64_t j = 0; j < k; ++j) {
          LD s = 0;
          for (int64_t i = 0; i < rows; ++i) s += LD(q[i * rank + j]) * w[size_t(i)];
          d[size_t(j)] = s;
        }
        for (int64_t j = 0; j < k; ++j)
          for (int64_t i = 0; i < rows; ++i) w[size_t(i)] -= d[size_t(j)] * LD(q[i * rank + j]);
      }
    };
    auto sumsq = [&] {
      LD s = 0;
      for (int64_t i = 0; i < rows; ++i) s += w[size_t(i)] * w[size_t(i)];
      return s;
    };
    for (int64_t k = 0; k < rank; ++k) {
      for (int64_t i = 0; i < rows; ++i) w[size_t(i)] = x[i * rank + k];
      project(k);
      LD s = sumsq();
      if (s == 0 && redraw) {
        for (int64_t i = 0; i < rows; ++i)
          w[size_t(i)] = ref_normal(uint64_t(b * rows * rank + i * rank + k), redraw->seed, redraw->stream);
        project(k);
        s = sumsq();
      }
      for (int64_t i = 0; i < rows; ++i) {
        float& v = o[i * rank + k];
        if (s == 0) v = 0.0f;
        else if (!std::isfinite(double(s))) v = std::numeric_limits<float>::quiet_NaN();
        else v = float(w[size_t(i)] / (std::sqrt(s) + LD(eps)));
      }
    }
  }
  return out;
}

std::vector<float> gpu_orthogonalize(const std::vector<float>& X, int64_t count, int64_t rows, int64_t rank, float eps,
                                     const lr::Redraw* redraw) {
  Dev<float> d(X);
  EXPECT_TRUE(d.p);
  StreamGuard sg;
  lr::orthogonalize(d.t(DType::float32), count, rows, rank, eps, redraw, sg.stream());
  sg.sync();
  return d.get();
}

void expect_close(const std::vector<float>& got, const std::vector<float>& ref, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size());
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool both_nan = std::isnan(got[i]) && std::isnan(ref[i]);
    if (!both_nan && !(std::fabs(double(got[i]) - double(ref[i])) <= tol) && bad++ < 5)
      ADD_FAILURE() << what << ": element " << i << " = " << got[i] << ", reference " << ref[i];
  }
  EXPECT_EQ(bad, 0) << what;
}

//! max |X_b^T X_b - I| over the matrices.
double orthonormality_error(const std::vector<float>& X, int64_t count, int64_t rows, int64_t rank) {
  double worst = 0.0;
  for (int64_t b = 0; b < count; ++b) {
    const float* x = X.data() + b * rows * rank;
    for (int64_t a = 0; a < rank; ++a)
      for (int64_t c = 0; c < rank; ++c) {
        double s = 0.0;
        for (int64_t i = 0; i < rows; ++i) s += double(x[i * rank + a]) * double(x[i * rank + c]);
        worst = std::max(worst, std::fabs(s - (a == c ? 1.0 : 0.0)));
      }
  }
  return worst;
}

// ---- reconstruct reference: binary32 in k order, the NaN rule spelled out -----------------------------
float quiet(float a) { return bitsf(fbits(a) | 0x400000u); }
//! docs/contracts.md section 2: a NaN result is the first operand if NaN (quieted), else the second
//! (quieted), else (an invalid operation) 0xFFC00000.
float nan_result(float a, float b) {
  if (std::isnan(a)) return quiet(a);
  if (std::isnan(b)) return quiet(b);
  return bitsf(0xFFC00000u);
}
float ref_mul(float a, float b) {
  volatile float r = a * b;
  return std::isnan(r) ? nan_result(a, b) : float(r);
}
float ref_add(float a, float b) {
  volatile float r = a + b;
  return std::isnan(r) ? nan_result(a, b) : float(r);
}
float ref_sub(float a, float b) {
  volatile float r = a - b;
  return std::isnan(r) ? nan_result(a, b) : float(r);
}
uint16_t ref_half(float f) {
  if (std::isnan(f)) return uint16_t((std::signbit(f) ? 0x8000u : 0u) | 0x7E00u);
  return __half_as_ushort(__float2half_rn(f));
}
uint16_t ref_bf16(float f) {
  if (std::isnan(f)) return uint16_t((std::signbit(f) ? 0x8000u : 0u) | 0x7FC0u);
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
float ref_T(const float* prow, const float* qrow, int64_t rank) {
  float t = ref_mul(prow[0], qrow[0]);
  for (int64_t k = 1; k < rank; ++k) t = ref_add(t, ref_mul(prow[k], qrow[k]));
  return t;
}

struct RecCase {
  Shape s;
  std::vector<int64_t> off;
  DType out;
  bool residual;
};

//! Runs reconstruct on (P, Q) and compares out (all of it: untouched outside the matrices),
//! residual and status bitwise with the loop here. status_in: the status word before the call.
void check_reconstruct(const RecCase& c, const std::vector<float>& P, const std::vector<float>& Q,
                       const std::vector<float>& E0, uint32_t status_in, const std::string& what) {
  const Shape& s = c.s;
  const int64_t mat = s.rows * s.cols, count = int64_t(c.off.size());
  int64_t extent = 0;
  for (int64_t o : c.off) extent = std::max(extent, o + mat);
  extent += 5;  // a tail no matrix covers
  const int64_t es = gradcomp::dtype_size(c.out);
  std::vector<uint8_t> out0(size_t(extent * es), 0xAB);
  std::vector<float> E = E0;
  E.resize(size_t(extent), 0.25f);
  Dev<uint8_t> dout(out0);
  Dev<float> dP(P), dQ(Q), dE(E);
  Dev<uint32_t> dst(std::vector<uint32_t>{status_in});
  ASSERT_TRUE(dout.p && dP.p && dQ.p && dE.p && dst.p);
  StreamGuard sg;
  const Tensor out{dout.p, c.out, extent, g_device};
  lr::MatrixBatch m{out, c.off.data(), count, s.rows, s.cols};
  lr::reconstruct(m, dP.t(DType::float32), dQ.t(DType::float32), s.rank, out, c.residual ? dE.p : nullptr, dst.p,
                  sg.stream());
  sg.sync();
  const std::vector<uint8_t> got = dout.get();
  const std::vector<float> gotE = dE.get();
  const uint32_t gst = dst.get()[0];

  std::vector<uint8_t> want = out0;
  std::vector<float> wantE = E;
  bool nonfinite = false;
  for (int64_t b = 0; b < count; ++b)
    for (int64_t i = 0; i < s.rows; ++i)
      for (int64_t j = 0; j < s.cols; ++j) {
        const float T = ref_T(P.data() + (b * s.rows + i) * s.rank, Q.data() + (b * s.cols + j) * s.rank, s.rank);
        const int64_t at = c.off[size_t(b)] + i * s.cols + j;
        if (c.out == DType::float32) {
          std::memcpy(want.data() + at * 4, &T, 4);
          nonfinite |= !std::isfinite(T);
        } else {
          const uint16_t h = c.out == DType::float16 ? ref_half(T) : ref_bf16(T);
          std::memcpy(want.data() + at * 2, &h, 2);
          nonfinite |= c.out == DType::float16 ? (h & 0x7C00u) == 0x7C00u : (h & 0x7F80u) == 0x7F80u;
        }
        if (c.residual) wantE[size_t(at)] = ref_sub(E[size_t(at)], T);
      }
  int bad = 0;
  for (int64_t e = 0; e < extent; ++e) {
    if (std::memcmp(got.data() + e * es, want.data() + e * es, size_t(es)) != 0 && bad++ < 5) {
      uint32_t g = 0, w = 0;
      std::memcpy(&g, got.data() + e * es, size_t(es));
      std::memcpy(&w, want.data() + e * es, size_t(es));
      ADD_FAILURE() << what << ": out element " << e << " bits 0x" << std::hex << g << ", reference 0x" << w;
    }
  }
  EXPECT_EQ(bad, 0) << what << " (out)";
  bad = 0;
  for (int64_t e = 0; e < extent; ++e)
    if (fbits(gotE[size_t(e)]) != fbits(wantE[size_t(e)]) && bad++ < 5)
      ADD_FAILURE() << what << ": residual element " << e << " = " << gotE[size_t(e)] << " (0x" << std::hex
                    << fbits(gotE[size_t(e)]) << "), reference " << wantE[size_t(e)] << " (0x" << fbits(wantE[size_t(e)])
                    << ")";
  EXPECT_EQ(bad, 0) << what << " (residual)";
  EXPECT_EQ(gst, status_in | (nonfinite ? 1u : 0u)) << what << " (status)";
}

void run_reconstruct(const RecCase& c, uint32_t seed, const std::string& what) {
  const int64_t count = int64_t(c.off.size());
  const std::vector<float> P = normals(count * c.s.rows * c.s.rank, seed);
  const std::vector<float> Q = normals(count * c.s.cols * c.s.rank, seed + 1);
  int64_t extent = 0;
  for (int64_t o : c.off) extent = std::max(extent, o + c.s.rows * c.s.cols);
  const std::vector<float> E = normals(extent, seed + 2);
  check_reconstruct(c, P, Q, E, 0u, what);
}

std::vector<int64_t> packed(int64_t count, int64_t mat, int64_t gap = 0, int64_t first = 0) {
  std::vector<int64_t> o(static_cast<size_t>(count));
  for (int64_t b = 0; b < count; ++b) o[size_t(b)] = first + b * (mat + gap);
  return o;
}

// ==== tests ===============================================================================================
// LOWRANK_TEST(Name) defines CudaLowrank.Name (on the GPU; skips without one) and
// LowrankHarnessOnCpu.Name (the same body on CPU tensors against the CPU backend: it validates
// the references of this file, and runs everywhere).
#define LOWRANK_TEST(name)                                                                         \
  void name##_body();                                                                              \
  TEST(CudaLowrank, name) {                                                                        \
    REQUIRE_GPU();                                                                                 \
    name##_body();                                                                                 \
  }                                                                                                \
  TEST(LowrankHarnessOnCpu, name) {                                                                \
    OnDevice on(kCpu);                                                                             \
    name##_body();                                                                                 \
  }                                                                                                \
  void name##_body()

TEST(LowrankPhiloxReference, KnownAnswers) {
  // Random123's kat_vectors for philox4x64 with 10 rounds (runs without a GPU: it checks the test's
  // own reference generator).
  const U64x4 a = philox4x64_10(U64x4{{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(a.v[0], 0x16554d9eca36314cull);
  EXPECT_EQ(a.v[1], 0xdb20fe9d672d0fdcull);
  EXPECT_EQ(a.v[2], 0xd7e772cee186176bull);
  EXPECT_EQ(a.v[3], 0x7e68b68aec7ba23bull);
  const U64x4 b = philox4x64_10(U64x4{{0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull,
                                       0x082efa98ec4e6c89ull}},
                                0x452821e638d01377ull, 0xbe5466cf34e90c6cull);
  EXPECT_EQ(b.v[0], 0xa528f45403e61d95ull);
  EXPECT_EQ(b.v[1], 0x38c72dbd566e9788ull);
  EXPECT_EQ(b.v[2], 0xa5a1610e72fd18b5ull);
  EXPECT_EQ(b.v[3], 0x57bd43b5e52b7fe6ull);
}

LOWRANK_TEST(ProjectBackProjectShapes) {
  const Shape shapes[] = {{1, 1, 1},   {1, 37, 1},  {37, 1, 1},   {7, 5, 5},    {5, 7, 5},
                          {33, 65, 4}, {64, 64, 64}, {300, 200, 8}, {20000, 16, 4}, {16, 20000, 4}};
  uint32_t seed = 10;
  for (const Shape& s : shapes) {
    if (small_sizes() && s.rows * s.cols > kSmallMatrix) continue;  // GRADCOMP_TEST_SMALL=1: the smaller shapes
    const int64_t mat = s.rows * s.cols;
    run_gemms(s, packed(1, mat), seed++);
    run_gemms(s, packed(3, mat), seed++);
  }
}

LOWRANK_TEST(ProjectBackProjectOffsets) {
  const Shape s{10, 12, 3};
  const int64_t mat = 120;
  // arithmetic with gaps; arbitrary order (runs of 1, 3 and 1); descending; one far away
  run_gemms(s, {10, 10 + 150, 10 + 300, 10 + 450}, 1);
  run_gemms(s, {500, 0, 130, 260, 900}, 2);
  run_gemms(s, {3 * mat, 2 * mat, mat, 0}, 3);
  run_gemms(s, {7, 7 + mat, 5000, 5000 + mat, 5000 + 2 * mat, 2 * mat + 7}, 4);
  run_gemms(s, packed(40, mat, 1, 3), 5);
}

//! P = project(m, q) on four threads at once, each on a stream of its own, all through `res`, each
//! `iters` times into its own P; returns each thread's final P (downloaded after its stream synced).
std::vector<std::vector<float>> project_on_four_streams(const lr::MatrixBatch& m, const Tensor& q, int64_t rank,
                                                        lr::Resources& res, int iters) {
  std::vector<std::vector<float>> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      Dev<float> dP(m.count * m.rows * rank);
      StreamGuard sg;
      for (int it = 0; it < iters; ++it) lr::project(m, q, dP.t(DType::float32), rank, sg.stream(), res);
      sg.sync();
      results[size_t(t)] = dP.get();
    });
  for (auto& th : threads) th.join();
  return results;
}

LOWRANK_TEST(ResourcesOwnedAndThreads) {
  const Shape s{50, 40, 4};
  const int64_t mat = s.rows * s.cols, count = 5;
  const std::vector<int64_t> off = packed(count, mat, 3);
  const std::vector<float> M = normals(off.back() + mat, 77);
  const std::vector<float> Q = normals(count * s.cols * s.rank, 78);
  {
    // A Resources of the test's own: the handle is created on first use and destroyed with it.
    lr::Resources res;
    Dev<float> dM(M), dQ(Q), dP(count * s.rows * s.rank);
    StreamGuard sg;
    lr::MatrixBatch m{dM.t(DType::float32), off.data(), count, s.rows, s.cols};
    lr::project(m, dQ.t(DType::float32), dP.t(DType::float32), s.rank, sg.stream(), res);
    sg.sync();
    expect_gemm(M, off, s, Q, dP.get(), false, "project (own Resources)");
  }
  // Four threads, one Resources, four streams: every result right.
  lr::Resources res;
  Dev<float> dM(M), dQ(Q);
  const lr::MatrixBatch m{dM.t(DType::float32), off.data(), count, s.rows, s.cols};
  const auto results = project_on_four_streams(m, dQ.t(DType::float32), s.rank, res, 20);
  for (int t = 0; t < 4; ++t) expect_gemm(M, off, s, Q, results[size_t(t)], false, "project (thread " + std::to_string(t) + ")");
}

// One Resources (one cuBLAS handle per device) on four streams at once, with GEMMs large enough for
// cuBLAS to use its workspace (split-K over 4096; on the CPU the same body checks the harness against
// OpenBLAS's threads): every stream's P is bitwise the one of a run
// alone. With one workspace shared by every stream (cublasSetStream resets the handle to its
// default one) concurrent GEMMs could overwrite each other's partial sums.
LOWRANK_TEST(ConcurrentStreamsSameBits) {
  // GRADCOMP_TEST_SMALL=1: 16 rows (65536 elements), the same 4096-long sums
  const Shape s = small_sizes() ? Shape{16, 4096, 4} : Shape{2048, 4096, 4};
  const int64_t mat = s.rows * s.cols, count = 1;
  const std::vector<int64_t> off = packed(count, mat, 0);
  const std::vector<float> M = normals(off.back() + mat, 91);
  const std::vector<float> Q = normals(count * s.cols * s.rank, 92);
  lr::Resources res;
  Dev<float> dM(M), dQ(Q);
  lr::MatrixBatch m{dM.t(DType::float32), off.data(), count, s.rows, s.cols};
  std::vector<float> alone;
  {
    Dev<float> dP(count * s.rows * s.rank);
    StreamGuard sg;
    lr::project(m, dQ.t(DType::float32), dP.t(DType::float32), s.rank, sg.stream(), res);
    sg.sync();
    alone = dP.get();
  }
  const auto results = project_on_four_streams(m, dQ.t(DType::float32), s.rank, res, 5);
  for (int t = 0; t < 4; ++t) {
    ASSERT_EQ(results[size_t(t)].size(), alone.size());
    EXPECT_EQ(std::memcmp(results[size_t(t)].data(), alone.data(), alone.size() * sizeof(float)), 0) << "stream " << t;
  }
}

LOWRANK_TEST(OrthogonalizeMatchesReference) {
  struct C {
    int64_t count, rows, rank;
    float eps;
  };
  // staged in shared memory (small), more than one coefficient group (rank > 16), unstaged (rows *
  // rank too large for shared memory), rank == rows, one column, many matrices
  const C cases[] = {{1, 8, 3, 0.0f},   {3, 100, 4, 0.0f},  {2, 64, 20, 0.0f},  {1, 40, 33, 0.0f},
                     {2, 30000, 4, 0.0f}, {1, 5, 5, 0.0f},  {4, 17, 1, 0.0f},   {300, 8, 3, 0.0f},
                     {2, 100, 4, 1e-3f}, {1, 3000, 12, 1e-8f}, {1, 1, 1, 0.0f}};
  uint32_t seed = 100;
  for (const C& c : cases) {
    if (small_sizes() && c.count * c.rows * c.rank > gradcomp_test::kSmallMaxNumel) continue;  // keeps [3000, 12] (unstaged)
    const std::vector<float> X = normals(c.count * c.rows * c.rank, seed++);
    const std::string what = "orthogonalize count " + std::to_string(c.count) + " [" + std::to_string(c.rows) + ", " +
                             std::to_string(c.rank) + "] eps " + std::to_string(c.eps);
    const std::vector<float> got = gpu_orthogonalize(X, c.count, c.rows, c.rank, c.eps, nullptr);
    expect_close(got, ref_orthogonalize(X, c.count, c.rows, c.rank, c.eps, nullptr, &got), 1e-6, what);
    if (c.rows >= 4 * c.rank)  // well conditioned: also the reference's own columns throughout
      expect_close(got, ref_orthogonalize(X, c.count, c.rows, c.rank, c.eps, nullptr), 1e-5, what + " (own basis)");
    if (c.eps == 0.0f) EXPECT_LE(orthonormality_error(got, c.count, c.rows, c.rank), 2e-6) << what;
    // the same input, the same bits
    const std::vector<float> again = gpu_orthogonalize(X, c.count, c.rows, c.rank, c.eps, nullptr);
    EXPECT_EQ(0, std::memcmp(got.data(), again.data(), got.size() * 4)) << what << ": not deterministic";
  }
}

LOWRANK_TEST(OrthogonalizeZeroColumns) {
  const int64_t count = 2, rows = 50, rank = 4;
  std::vector<float> X = normals(count * rows * rank, 7);
  for (int64_t i = 0; i < rows; ++i) {
    X[size_t(i * rank + 1)] = 0.0f;                    // matrix 0: column 1 zero
    X[size_t(rows * rank + i * rank + 0)] = -0.0f;     // matrix 1: column 0 (negative) zero
    X[size_t(rows * rank + i * rank + 3)] = 0.0f;      // and column 3
  }
  for (float eps : {0.0f, 1e-8f}) {
    const std::vector<float> got = gpu_orthogonalize(X, count, rows, rank, eps, nullptr);
    const std::vector<float> ref = ref_orthogonalize(X, count, rows, rank, eps, nullptr, &got);
    expect_close(got, ref, 1e-6, "zero columns, eps " + std::to_string(eps));
    for (int64_t i = 0; i < rows; ++i) {
      EXPECT_EQ(fbits(got[size_t(i * rank + 1)]), 0u) << "matrix 0 column 1 row " << i << " not +0.0";
      EXPECT_EQ(fbits(got[size_t(rows * rank + i * rank + 0)]), 0u) << "matrix 1 column 0 row " << i;
      EXPECT_EQ(fbits(got[size_t(rows * rank + i * rank + 3)]), 0u) << "matrix 1 column 3 row " << i;
    }
  }
  // Redraw: the zero columns become normalized projections of random_normal values at their flat
  // indices; the whole matrix is then orthonormal.
  const lr::Redraw rd{1234, 5};
  const std::vector<float> got = gpu_orthogonalize(X, count, rows, rank, 0.0f, &rd);
  expect_close(got, ref_orthogonalize(X, count, rows, rank, 0.0f, &rd, &got), 1e-6, "redraw");
  EXPECT_LE(orthonormality_error(got, count, rows, rank), 2e-6) << "redraw";
  // a [rows, rows] matrix of zeros with a redraw: a random orthogonal matrix
  const std::vector<float> Z(size_t(6 * 6), 0.0f);
  const std::vector<float> gz = gpu_orthogonalize(Z, 1, 6, 6, 0.0f, &rd);
  expect_close(gz, ref_orthogonalize(Z, 1, 6, 6, 0.0f, &rd, &gz), 1e-6, "redraw of a zero square matrix");
  EXPECT_LE(orthonormality_error(gz, 1, 6, 6), 1e-5);
}

LOWRANK_TEST(OrthogonalizeNonFinite) {
  const int64_t count = 3, rows = 20, rank = 4;
  std::vector<float> X = normals(count * rows * rank, 9);
  X[size_t(5 * rank + 2)] = std::numeric_limits<float>::quiet_NaN();                   // matrix 0, column 2
  X[size_t(rows * rank + 7 * rank + 0)] = -std::numeric_limits<float>::infinity();     // matrix 1, column 0
  const std::vector<float> got = gpu_orthogonalize(X, count, rows, rank, 0.0f, nullptr);
  const std::vector<float> ref = ref_orthogonalize(X, count, rows, rank, 0.0f, nullptr, &got);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < rank; ++k) {
      const float g0 = got[size_t(i * rank + k)], g1 = got[size_t(rows * rank + i * rank + k)];
      if (k < 2) EXPECT_NEAR(g0, ref[size_t(i * rank + k)], 1e-6) << "matrix 0 before the NaN column";
      else EXPECT_TRUE(std::isnan(g0)) << "matrix 0 row " << i << " column " << k << " = " << g0;
      EXPECT_TRUE(std::isnan(g1)) << "matrix 1 row " << i << " column " << k << " = " << g1;
    }
  // matrix 2 is untouched by its neighbours
  expect_close(std::vector<float>(got.begin() + 2 * rows * rank, got.end()),
               std::vector<float>(ref.begin() + 2 * rows * rank, ref.end()), 1e-6, "matrix 2");
}

LOWRANK_TEST(ReconstructBitwise) {
  uint32_t seed = 1000;
  const Shape shapes[] = {{1, 1, 1},  {1, 100, 1}, {100, 1, 1}, {7, 5, 5},    {33, 65, 4},
                          {64, 64, 32}, {48, 48, 40}, {70, 130, 8}, {300, 200, 2}};
  for (const Shape& s : shapes) {
    if (small_sizes() && s.rows * s.cols > kSmallMatrix) continue;  // GRADCOMP_TEST_SMALL=1: the smaller shapes
    for (DType out : {DType::float32, DType::float16, DType::bfloat16})
      for (bool res : {false, true}) {
        const int64_t mat = s.rows * s.cols;
        const std::string what = "reconstruct [" + std::to_string(s.rows) + " x " + std::to_string(s.cols) + "] rank " +
                                 std::to_string(s.rank) + " " + std::string(gradcomp::dtype_name(out)) +
                                 (res ? " +residual" : "");
        run_reconstruct({s, packed(1, mat), out, res}, seed++, what + " count 1");
        run_reconstruct({s, {2 * mat + 9, 0, mat + 3}, out, res}, seed++, what + " count 3, arbitrary offsets");
      }
  }
}

LOWRANK_TEST(ReconstructManyMatricesAndTallGrid) {
  // more matrices than one launch takes (256), with gaps
  run_reconstruct({{3, 5, 2}, packed(300, 15, 2, 1), DType::float32, true}, 5, "300 matrices");
  run_reconstruct({{3, 5, 2}, packed(513, 15, 0, 0), DType::bfloat16, true}, 6, "513 matrices");
  // more row tiles than gridDim.y (65535 x 32 rows); not under GRADCOMP_TEST_SMALL=1
  if (!small_sizes()) run_reconstruct({{2100000, 1, 1}, packed(1, 2100000), DType::float32, true}, 7, "2.1M x 1");
}

LOWRANK_TEST(ReconstructSpecialValuesAndStatus) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const Shape s{4, 6, 2};
  const std::vector<int64_t> off = {0};
  std::vector<float> P = normals(s.rows * s.rank, 1), Q = normals(s.cols * s.rank, 2), E = normals(24, 3);
  for (DType out : {DType::float32, DType::float16, DType::bfloat16}) {
    const std::string dn(gradcomp::dtype_name(out));
    // finite: status stays as it was (bit 2 preset: kept, not cleared)
    check_reconstruct({s, off, out, true}, P, Q, E, 4u, dn + " finite");
    // zeros of both signs: T can be -0.0 (fl(-0 * 1) + ... ) and +0.0
    std::vector<float> Pz = P, Qz = Q;
    Pz[0] = -0.0f, Pz[1] = -0.0f, Qz[0] = 1.0f, Qz[1] = 2.0f, Pz[2] = 0.0f, Pz[3] = -0.0f;
    check_reconstruct({s, off, out, true}, Pz, Qz, E, 0u, dn + " signed zeros");
    // NaN of both signs and payloads, inf * 0 (invalid), inf - inf, in P, Q and the residual
    std::vector<float> Pn = P, Qn = Q, En = E;
    Pn[1 * 2 + 0] = bitsf(0xFFC01234u);   // row 1, k 0: negative NaN with a payload
    Qn[3 * 2 + 1] = bitsf(0x7F800001u);   // column 3, k 1: signalling NaN
    Pn[2 * 2 + 0] = inf, Qn[0 * 2 + 0] = 0.0f;  // row 2 x column 0: inf * 0
    Pn[3 * 2 + 0] = inf, Pn[3 * 2 + 1] = inf, Qn[5 * 2 + 0] = 1.0f, Qn[5 * 2 + 1] = -1.0f;  // inf - inf
    En[7] = nan, En[8] = inf;
    check_reconstruct({s, off, out, true}, Pn, Qn, En, 0u, dn + " NaN and inf");
    check_reconstruct({s, off, out, false}, Pn, Qn, En, 0u, dn + " NaN and inf, no residual");
  }
  // finite in float32 but not in the output dtype: the status bit only for that dtype
  std::vector<float> Pb = P, Qb = Q;
  Pb[0] = 70000.0f, Pb[1] = 0.0f, Qb[0] = 1.0f, Qb[1] = 0.0f;  // T[0][0] = 70000: fp16 inf
  check_reconstruct({s, off, DType::float32, false}, Pb, Qb, E, 0u, "70000 float32");
  check_reconstruct({s, off, DType::float16, false}, Pb, Qb, E, 0u, "70000 float16");
  check_reconstruct({s, off, DType::bfloat16, false}, Pb, Qb, E, 0u, "70000 bfloat16");
  Pb[0] = 3.4e38f;  // bfloat16 inf (above its largest finite, 3.3895e38, past the halfway point)
  check_reconstruct({s, off, DType::float32, false}, Pb, Qb, E, 0u, "3.4e38 float32");
  check_reconstruct({s, off, DType::bfloat16, false}, Pb, Qb, E, 0u, "3.4e38 bfloat16");
  // a null status pointer is accepted
  Dev<float> dP(P), dQ(Q), dout(24);
  StreamGuard sg;
  lr::MatrixBatch m{dout.t(DType::float32), off.data(), 1, s.rows, s.cols};
  lr::reconstruct(m, dP.t(DType::float32), dQ.t(DType::float32), s.rank, dout.t(DType::float32), nullptr, nullptr,
                  sg.stream());
  sg.sync();
}

LOWRANK_TEST(RandomNormal) {
  const int64_t n = (int64_t(1) << (small_sizes() ? 16 : 17)) + 3;  // GRADCOMP_TEST_SMALL=1: 65539
  Dev<float> d(n);
  ASSERT_TRUE(d.p);
  StreamGuard sg;
  for (auto [seed, sid] : {std::pair<uint64_t, uint64_t>{0, 0}, {42, 7}, {0xFFFFFFFFFFFFFFFFull, 0x123456789ull}}) {
    lr::random_normal(d.t(DType::float32), seed, sid, sg.stream());
    sg.sync();
    const std::vector<float> got = d.get();
    int64_t inexact = 0, far = 0;
    double sum = 0, sumsq = 0;
    for (int64_t e = 0; e < n; ++e) {
      const float r = ref_normal(uint64_t(e), seed, sid);
      const float g = got[size_t(e)];
      sum += g, sumsq += double(g) * g;
      if (fbits(g) == fbits(r)) continue;
      ++inexact;
      const int64_t ulps = std::llabs(int64_t(fbits(g) & 0x7FFFFFFFu) - int64_t(fbits(r) & 0x7FFFFFFFu));
      if (std::signbit(g) != std::signbit(r) || ulps > 1) {
        if (far++ < 5) ADD_FAILURE() << "seed " << seed << " element " << e << ": " << g << ", reference " << r;
      }
    }
    EXPECT_EQ(far, 0);
    EXPECT_LE(inexact, n / 10000 + 1) << "elements off by one ulp (CUDA's binary64 log/cos)";
    EXPECT_NEAR(sum / double(n), 0.0, 0.02);
    EXPECT_NEAR(sumsq / double(n), 1.0, 0.02);
  }
  // element e depends on e alone: a shorter tensor is a prefix
  Dev<float> d7(7);
  lr::random_normal(d7.t(DType::float32), 42, 7, sg.stream());
  lr::random_normal(d.t(DType::float32), 42, 7, sg.stream());
  sg.sync();
  const std::vector<float> a = d7.get(), b = d.get();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), 7 * 4));
}

LOWRANK_TEST(PowerSgdStep) {
  // One PowerSGD round trip on device, every step checked above; here: the residual after
  // reconstruct equals M - P Q^T of the downloaded factors (the loop here), for a rank-2 matrix
  // recovered with rank 2 the residual is small.
  const int64_t rows = 64, cols = 48, rank = 2;
  const std::vector<float> U = normals(rows * rank, 1), V = normals(cols * rank, 2);
  std::vector<float> M(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) M[size_t(i * cols + j)] = float(double(U[size_t(i * rank)]) * V[size_t(j * rank)] +
                                                                        double(U[size_t(i * rank + 1)]) * V[size_t(j * rank + 1)]);
  const std::vector<int64_t> off = {0};
  Dev<float> dM(M), dQ(cols * rank), dP(rows * rank), dout(rows * cols);
  StreamGuard sg;
  lr::MatrixBatch m{dM.t(DType::float32), off.data(), 1, rows, cols};
  lr::random_normal(dQ.t(DType::float32), 3, 0, sg.stream());
  lr::project(m, dQ.t(DType::float32), dP.t(DType::float32), rank, sg.stream());
  lr::orthogonalize(dP.t(DType::float32), 1, rows, rank, 0.0f, nullptr, sg.stream());
  lr::back_project(m, dP.t(DType::float32), dQ.t(DType::float32), rank, sg.stream());
  lr::MatrixBatch mo{dout.t(DType::float32), off.data(), 1, rows, cols};
  lr::reconstruct(mo, dP.t(DType::float32), dQ.t(DType::float32), rank, dout.t(DType::float32), dM.p, nullptr, sg.stream());
  sg.sync();
  const std::vector<float> E = dM.get();
  double worst = 0, scale = 0;
  for (size_t i = 0; i < M.size(); ++i) worst = std::max(worst, std::fabs(double(E[i]))), scale = std::max(scale, std::fabs(double(M[i])));
  EXPECT_LE(worst, 1e-4 * scale) << "rank-2 matrix not recovered by a rank-2 PowerSGD step";
}

} // namespace
