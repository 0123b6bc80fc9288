// SPDX-License-Identifier: Apache-2.0
// Low rank (PowerSGD steps, include/gradcomp/lowrank.hpp; Vogels et al., NeurIPS 2019, algorithm 1)
// on the CPU against references written here, independently of kernels/cpu/lowrank.cpp:
//  - project / back_project vs plain binary64 loops; tolerance |ref - got| <= 1e-5 * |row of M| *
//    |column of Q| (project) and 1e-5 * |column of M| * |column of P| (back_project) + 1e-30, on
//    every CPU variant, at ranks 1 (sgemv), 2..16 (gradcomp's kernels: ranks on both sides of
//    their blockings, columns not a multiple of 16, several column chunks / blocks) and 17, 20
//    (sgemm; gradcomp's kernels in a GRADCOMP_BLAS=OFF build, which also runs ranks 1, 17, 32, 40
//    through the bits test); NaN in M reaches exactly its row of P / column of Q; ranks 2..16 (all
//    ranks without OpenBLAS) give the same bits at 1, 2 and 3 threads and on every CPU variant
//    (kernels/cpu/lowrank.cpp's fixed order per element: the header promises only a GEMM's
//    tolerance); OpenBLAS's thread count is left as it was (GRADCOMP_HAVE_BLAS builds);
//  - orthogonalize: |Q^T Q - I| < 1e-5 and the Gram-Schmidt triangular span (column k of X in the
//    span of output columns 0..k, residual < 1e-5 |x_k|, positive diagonal) for well-conditioned
//    input; vs a binary64 Gram-Schmidt within 1e-5; zero columns (exact, and exactly cancelled by
//    the projection) stay +0.0 at epsilon 0 and 0.5, Redraw fills them (vs the reference normals,
//    projected in binary64, within 1e-5), NaN / inf make the matrix non-finite, epsilon divides
//    by norm + epsilon, bits independent of the thread count and of the batch;
//  - reconstruct: bitwise vs a scalar float loop in k order (no FMA: this file is built with
//    -ffp-contract=off), float16 / bfloat16 rounding vs ref.hpp's nearest-value search, the
//    residual update fl(e - T), the status bit (ORed, kept), untouched gaps between matrices, on
//    every CPU variant (avx512 / avx2 / generic) and thread count;
//  - random_normal: Philox4x64-10 written out here from the Salmon et al. 2011 constants (checked
//    against the Random123 known-answer vectors), Box-Muller in binary64: bitwise;
//  - shapes 1 x n, n x 1, rank = min(rows, cols), count 1 and 5, offsets with gaps in any order;
//  - bad arguments: InvalidArgument naming the value; Unsupported for CUDA tensors in a CPU build.
// The random inputs come from GRADCOMP_TEST_SEED (printed on failure).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "gradcomp/lowrank.hpp"
#include "ref.hpp"

namespace lr = gradcomp::lowrank;
using gradcomp::Device;
using gradcomp::DeviceKind;
using gradcomp::DType;
using gradcomp::InvalidArgument;
using gradcomp::Tensor;

namespace {

std::string seed_trace() { return "GRADCOMP_TEST_SEED=" + std::to_string(ref::test_seed()); }

Tensor f32(std::vector<float>& v) { return {v.data(), DType::float32, int64_t(v.size()), {}}; }

// ---- Philox4x64-10 (Salmon, Moraes, Dror & Shaw, SC 2011), written out ------------------------
struct U4 {
  uint64_t v[4];
};
void mulhilo(uint64_t a, uint64_t b, uint64_t& hi, uint64_t& lo) {
  const unsigned __int128 p = (unsigned __int128)a * b;
  hi = uint64_t(p >> 64);
  lo = uint64_t(p);
}
U4 philox4x64_10(U4 c, uint64_t k0, uint64_t k1) {
  constexpr uint64_t M0 = 0xD2E7470EE14C6C93ull, M1 = 0xCA5A826395121157ull;
  constexpr uint64_t W0 = 0x9E3779B97F4A7C15ull, W1 = 0xBB67AE8584CAA73Bull;
  for (int r = 0; r < 10; ++r) {
    if (r > 0) k0 += W0, k1 += W1;
    uint64_t hi0, lo0, hi1, lo1;
    mulhilo(M0, c.v[0], hi0, lo0);
    mulhilo(M1, c.v[2], hi1, lo1);
    c = U4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
  }
  return c;
}
float ref_normal(uint64_t e, uint64_t seed, uint64_t stream) {
  const U4 r = philox4x64_10(U4{{e, stream, 0, 0}}, seed, 0x9E3779B97F4A7C15ull);
  const double u1 = double((r.v[0] >> 11) + 1) * std::ldexp(1.0, -53);
  const double u2 = double(r.v[1] >> 11) * std::ldexp(1.0, -53);
  const double two_pi = 2.0 * 3.141592653589793;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(two_pi * u2));
}

// ---- matrices ----------------------------------------------------------------------------------
struct Batch {
  int64_t rows, cols;
  std::vector<int64_t> offsets;
  std::vector<float> base;
  lr::MatrixBatch view() {
    return {f32(base), offsets.data(), int64_t(offsets.size()), rows, cols};
  }
  float at(int64_t b, int64_t i, int64_t j) const { return base[size_t(offsets[b] + i * cols + j)]; }
};

//! count matrices with gaps of 0..7 elements between them, in reversed order in the buffer when
//! `shuffle` (so offsets are neither contiguous nor ascending); gap elements are 1234.5.
Batch make_batch(int64_t count, int64_t rows, int64_t cols, std::mt19937_64& g, bool shuffle = true) {
  Batch b{rows, cols, {}, {}};
  std::uniform_int_distribution<int> gap(0, 7);
  std::vector<int64_t> starts;
  int64_t pos = gap(g);
  for (int64_t i = 0; i < count; ++i) {
    starts.push_back(pos);
    pos += rows * cols + gap(g);
  }
  b.base.assign(size_t(pos + 3), 1234.5f);
  if (shuffle) std::reverse(starts.begin(), starts.end());
  b.offsets = starts;
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < count; ++i)
    for (int64_t e = 0; e < rows * cols; ++e) b.base[size_t(starts[i] + e)] = nd(g);
  return b;
}

std::vector<float> randn(int64_t n, std::mt19937_64& g) {
  std::normal_distribution<float> nd;
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = nd(g);
  return v;
}

struct Shape {
  int64_t count, rows, cols, rank;
};
const Shape kShapes[] = {{1, 1, 1, 1},   {1, 1, 37, 1},  {1, 41, 1, 1},   {5, 1, 64, 1},  {5, 64, 1, 1},
                         {1, 13, 9, 9},  {5, 9, 13, 9},  {5, 33, 17, 4},  {1, 300, 200, 4}, {5, 40, 70, 2},
                         {3, 1000, 130, 8}, {2, 4, 4, 4}};
//! project / back_project: kShapes and the small-rank kernels' edges (ranks 2..16, 2 x n and n x 2,
//! cols % 16 != 0, more rows than a register block, several chunks of Qt: 8192 / rank columns in
//! project, 65536 / rank in back_project), and OpenBLAS's sgemm above rank 16.
const Shape kGemmShapes[] = {
    {3, 2, 45, 2},   {3, 45, 2, 2},    {2, 19, 50, 3},  {2, 50, 19, 5},   {3, 17, 31, 7},  {1, 16, 16, 16},
    {4, 23, 48, 12}, {2, 37, 129, 16}, {1, 9, 5000, 2}, {1, 17, 700, 16}, {1, 19, 4200, 16}, {2, 3, 70, 3},
    {1, 33, 20, 17}, {2, 24, 40, 20},  {1, 70, 300, 6}, {2, 12, 257, 4}, {1, 70, 301, 32}, {2, 45, 90, 45},
    {1, 40, 9000, 24}, {1, 3, 70000, 1}, {1, 70000, 3, 1}};

// ---- project / back_project ---------------------------------------------------------------------
struct IsaScope {
  std::string old = gradcomp::cpu_isa();
  ~IsaScope() { gradcomp::set_cpu_isa(old); }
};

//! Checks project and back_project of one shape against binary64 loops (the current CPU variant).
void check_gemms(const Shape& s, std::mt19937_64& g) {
  {
    SCOPED_TRACE(::testing::Message() << "count " << s.count << " shape [" << s.rows << ", " << s.cols << "] rank "
                                      << s.rank);
    Batch m = make_batch(s.count, s.rows, s.cols, g);
    const std::vector<float> base0 = m.base;
    std::vector<float> q = randn(s.count * s.cols * s.rank, g);
    // outputs start as NaN: beta = 0 must not read them (torch.empty may hold any bits)
    std::vector<float> p(size_t(s.count * s.rows * s.rank), std::numeric_limits<float>::quiet_NaN());
    lr::project(m.view(), f32(q), f32(p), s.rank);
    for (int64_t b = 0; b < s.count; ++b)
      for (int64_t i = 0; i < s.rows; ++i) {
        double rn = 0;
        for (int64_t j = 0; j < s.cols; ++j) rn += double(m.at(b, i, j)) * m.at(b, i, j);
        for (int64_t k = 0; k < s.rank; ++k) {
          double ref = 0, qn = 0;
          for (int64_t j = 0; j < s.cols; ++j) {
            const double qv = q[size_t((b * s.cols + j) * s.rank + k)];
            ref += double(m.at(b, i, j)) * qv;
            qn += qv * qv;
          }
          const double got = p[size_t((b * s.rows + i) * s.rank + k)];
          ASSERT_NEAR(got, ref, 1e-5 * std::sqrt(rn * qn) + 1e-30) << "P[" << b << "][" << i << "][" << k << "]";
        }
      }
    // back_project with the P just computed
    std::vector<float> q2(q.size(), std::numeric_limits<float>::quiet_NaN());
    lr::back_project(m.view(), f32(p), f32(q2), s.rank);
    for (int64_t b = 0; b < s.count; ++b)
      for (int64_t j = 0; j < s.cols; ++j) {
        double cn = 0;
        for (int64_t i = 0; i < s.rows; ++i) cn += double(m.at(b, i, j)) * m.at(b, i, j);
        for (int64_t k = 0; k < s.rank; ++k) {
          double ref = 0, pn = 0;
          for (int64_t i = 0; i < s.rows; ++i) {
            const double pv = p[size_t((b * s.rows + i) * s.rank + k)];
            ref += double(m.at(b, i, j)) * pv;
            pn += pv * pv;
          }
          const double got = q2[size_t((b * s.cols + j) * s.rank + k)];
          ASSERT_NEAR(got, ref, 1e-5 * std::sqrt(cn * pn) + 1e-30) << "Q[" << b << "][" << j << "][" << k << "]";
        }
      }
    EXPECT_EQ(m.base, base0) << "M must not be written";
  }
}

TEST(Lowrank, ProjectAndBackProjectMatchBinary64Loops) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed());
  IsaScope keep;
  for (const std::string& isa : gradcomp::cpu_isas_supported()) {  // every CPU variant of the kernels
    SCOPED_TRACE("cpu isa " + isa);
    gradcomp::set_cpu_isa(isa);
    for (const Shape& s : kShapes) check_gemms(s, g);
    for (const Shape& s : kGemmShapes) check_gemms(s, g);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(Lowrank, ProjectOnManyThreadsMatchesReference) {
  // Large enough for a team (>= 64 Ki elements); count 1 splits rows/columns over the threads,
  // count 5 splits matrices.
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 1);
  for (int threads : {1, 2, 3}) {
    ref::Threads th(threads);
    for (int64_t count : {1, 5}) {
      const int64_t rows = 257, cols = 301, rank = 3;
      Batch m = make_batch(count, rows, cols, g);
      std::vector<float> q = randn(count * cols * rank, g), p(size_t(count * rows * rank));
      lr::project(m.view(), f32(q), f32(p), rank);
      std::vector<float> q2(q.size());
      lr::back_project(m.view(), f32(p), f32(q2), rank);
      for (int64_t b = 0; b < count; ++b)
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t k = 0; k < rank; ++k) {
            double ref = 0, an = 0, bn = 0;
            for (int64_t j = 0; j < cols; ++j) {
              const double qv = q[size_t((b * cols + j) * rank + k)];
              ref += double(m.at(b, i, j)) * qv;
              an += double(m.at(b, i, j)) * m.at(b, i, j);
              bn += qv * qv;
            }
            ASSERT_NEAR(p[size_t((b * rows + i) * rank + k)], ref, 1e-5 * std::sqrt(an * bn))
                << "threads " << threads << " count " << count;
          }
      for (int64_t b = 0; b < count; ++b)
        for (int64_t j = 0; j < cols; ++j)
          for (int64_t k = 0; k < rank; ++k) {
            double ref = 0, an = 0, bn = 0;
            for (int64_t i = 0; i < rows; ++i) {
              const double pv = p[size_t((b * rows + i) * rank + k)];
              ref += double(m.at(b, i, j)) * pv;
              an += double(m.at(b, i, j)) * m.at(b, i, j);
              bn += pv * pv;
            }
            ASSERT_NEAR(q2[size_t((b * cols + j) * rank + k)], ref, 1e-5 * std::sqrt(an * bn))
                << "threads " << threads << " count " << count;
          }
    }
  }
}

TEST(Lowrank, SmallRankBitsDoNotDependOnThreadsOrVariant) {
  // Ranks 2..16 (gradcomp's kernels): a fixed order per element, so 1, 2 and 3 threads and every
  // CPU variant write the same bits. Sizes >= 64 Ki elements (a team): count 1 splits rows
  // (project) and columns (back_project) over the threads, count 3 splits matrices.
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 3);
  IsaScope keep;
  const Shape shapes[] = {{1, 300, 517, 2}, {1, 263, 301, 5}, {1, 130, 1001, 16}, {3, 130, 260, 4},
                          {3, 97, 250, 9}, {1, 2, 40000, 2}, {1, 40000, 2, 2},
#if !GRADCOMP_HAVE_BLAS  // without OpenBLAS every rank runs on gradcomp's kernels
                          {1, 300, 517, 1}, {3, 130, 260, 1}, {1, 1, 70000, 1}, {1, 70000, 1, 1},
                          {1, 130, 1001, 17}, {3, 97, 250, 32}, {1, 40, 40000, 40}
#endif
  };
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "count " << s.count << " shape [" << s.rows << ", " << s.cols << "] rank "
                                      << s.rank);
    Batch m = make_batch(s.count, s.rows, s.cols, g);
    const std::vector<float> q = randn(s.count * s.cols * s.rank, g), p = randn(s.count * s.rows * s.rank, g);
    std::vector<float> p0, q0;
    for (const std::string& isa : gradcomp::cpu_isas_supported())
      for (int threads : {1, 2, 3}) {
        SCOPED_TRACE(::testing::Message() << "cpu isa " << isa << " threads " << threads);
        gradcomp::set_cpu_isa(isa);
        ref::Threads th(threads);
        std::vector<float> qin = q, pin = p;
        std::vector<float> pout(p.size(), std::numeric_limits<float>::quiet_NaN());
        std::vector<float> qout(q.size(), std::numeric_limits<float>::quiet_NaN());
        lr::project(m.view(), f32(qin), f32(pout), s.rank);
        lr::back_project(m.view(), f32(pin), f32(qout), s.rank);
        if (p0.empty()) {
          p0 = pout, q0 = qout;
          for (float v : p0) ASSERT_TRUE(std::isfinite(v));
          for (float v : q0) ASSERT_TRUE(std::isfinite(v));
          continue;
        }
        ASSERT_EQ(0, std::memcmp(pout.data(), p0.data(), p0.size() * 4)) << "project bits";
        ASSERT_EQ(0, std::memcmp(qout.data(), q0.data(), q0.size() * 4)) << "back_project bits";
      }
  }
}

#if GRADCOMP_HAVE_BLAS
extern "C" int openblas_get_num_threads(void);
extern "C" void openblas_set_num_threads(int);
TEST(Lowrank, OpenBlasThreadCountIsUntouched) {
  // issue 20: the OpenBLAS of the process may be shared (numpy, the user's own code): project /
  // back_project at ranks 1 (sgemv) and 32 (sgemm) leave its thread count as it was, on 1 and 2
  // gradcomp threads (a team: >= 64 Ki elements).
  std::mt19937_64 g(ref::test_seed() + 4);
  openblas_set_num_threads(2);  // this test's own setting (one process per test: gtest_discover_tests)
  const int before = openblas_get_num_threads();
  for (int threads : {1, 2})
    for (int64_t rank : {1, 32}) {
      ref::Threads th(threads);
      Batch m = make_batch(2, 300, 517, g);
      std::vector<float> q = randn(2 * 517 * rank, g), p(size_t(2 * 300 * rank)), q2(q.size());
      lr::project(m.view(), f32(q), f32(p), rank);
      lr::back_project(m.view(), f32(p), f32(q2), rank);
      EXPECT_EQ(openblas_get_num_threads(), before) << "rank " << rank << " threads " << threads;
    }
}
#endif

TEST(Lowrank, ProjectAndBackProjectPropagateNaN) {
  std::mt19937_64 g(ref::test_seed() + 2);
  Batch m = make_batch(2, 5, 6, g);
  m.base[size_t(m.offsets[1] + 2 * 6 + 3)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> q = randn(2 * 6 * 2, g), p(2 * 5 * 2);
  lr::project(m.view(), f32(q), f32(p), 2);
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t k = 0; k < 2; ++k) {
      EXPECT_TRUE(std::isfinite(p[size_t((0 * 5 + i) * 2 + k)]));
      EXPECT_EQ(std::isnan(p[size_t((1 * 5 + i) * 2 + k)]), i == 2) << "row " << i;
    }
  // back_project: the NaN at M_1[2][3] makes column 3 of Q_1 NaN, nothing else
  std::vector<float> p2 = randn(2 * 5 * 2, g), q2(2 * 6 * 2);
  lr::back_project(m.view(), f32(p2), f32(q2), 2);
  for (int64_t j = 0; j < 6; ++j)
    for (int64_t k = 0; k < 2; ++k) {
      EXPECT_TRUE(std::isfinite(q2[size_t((0 * 6 + j) * 2 + k)]));
      EXPECT_EQ(std::isnan(q2[size_t((1 * 6 + j) * 2 + k)]), j == 3) << "column " << j;
    }
}

// ---- orthogonalize -------------------------------------------------------------------------------
//! Binary64 modified Gram-Schmidt, twice (PyTorch's order: each earlier output column subtracted in
//! turn), of one [rows, rank] matrix, then w / (norm + eps); zero columns stay zero.
std::vector<double> ref_gram_schmidt(const std::vector<double>& X, int64_t rows, int64_t rank, double eps) {
  std::vector<double> Q(X.size(), 0.0);
  for (int64_t k = 0; k < rank; ++k) {
    std::vector<double> w(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) w[size_t(i)] = X[size_t(i * rank + k)];
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t j = 0; j < k; ++j) {
        double d = 0;
        for (int64_t i = 0; i < rows; ++i) d += Q[size_t(i * rank + j)] * w[size_t(i)];
        for (int64_t i = 0; i < rows; ++i) w[size_t(i)] -= d * Q[size_t(i * rank + j)];
      }
    double s = 0;
    for (double v : w) s += v * v;
    if (s == 0) continue;
    for (int64_t i = 0; i < rows; ++i) Q[size_t(i * rank + k)] = w[size_t(i)] / (std::sqrt(s) + eps);
  }
  return Q;
}

//! max |Q^T Q - I| of matrix b of x (zero columns, listed in `zero`, get 0 on the diagonal).
double orthonormality_error(const std::vector<float>& x, int64_t b, int64_t rows, int64_t rank,
                            const std::vector<int64_t>& zero = {}) {
  double worst = 0;
  const float* X = x.data() + b * rows * rank;
  for (int64_t a = 0; a < rank; ++a)
    for (int64_t c = 0; c < rank; ++c) {
      double d = 0;
      for (int64_t i = 0; i < rows; ++i) d += double(X[i * rank + a]) * X[i * rank + c];
      const bool z = std::count(zero.begin(), zero.end(), a) > 0;
      worst = std::max(worst, std::abs(d - (a == c && !z ? 1.0 : 0.0)));
    }
  return worst;
}

TEST(Lowrank, OrthogonalizeGivesOrthonormalColumnsSpanningTheInput) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 3);
  const Shape shapes[] = {{1, 1, 0, 1}, {5, 7, 0, 1}, {1, 9, 0, 9}, {5, 16, 0, 4}, {3, 1000, 0, 8}, {2, 64, 0, 32}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "count " << s.count << " rows " << s.rows << " rank " << s.rank);
    std::vector<float> x0 = randn(s.count * s.rows * s.rank, g);
    if (s.rows == s.rank && s.rows > 1) {  // square: keep it well conditioned (X = 3 I + noise / 4)
      for (int64_t b = 0; b < s.count; ++b)
        for (int64_t i = 0; i < s.rows; ++i)
          for (int64_t k = 0; k < s.rank; ++k) {
            float& v = x0[size_t((b * s.rows + i) * s.rank + k)];
            v = v * 0.25f + (i == k ? 3.0f : 0.0f);
          }
    }
    std::vector<float> x = x0;
    lr::orthogonalize(f32(x), s.count, s.rows, s.rank, 0.0f);
    for (int64_t b = 0; b < s.count; ++b) {
      EXPECT_LT(orthonormality_error(x, b, s.rows, s.rank), 1e-5) << "matrix " << b;
      const float* X = x0.data() + b * s.rows * s.rank;
      const float* Q = x.data() + b * s.rows * s.rank;
      std::vector<double> Xd(X, X + s.rows * s.rank);
      const std::vector<double> Qref = ref_gram_schmidt(Xd, s.rows, s.rank, 0.0);
      for (int64_t e = 0; e < s.rows * s.rank; ++e) ASSERT_NEAR(Q[e], Qref[size_t(e)], 1e-5) << "element " << e;
      // Gram-Schmidt's triangular structure: x_k in span(q_0..q_k), with q_k . x_k > 0
      for (int64_t k = 0; k < s.rank; ++k) {
        std::vector<double> r(size_t(s.rows));
        double xn = 0;
        for (int64_t i = 0; i < s.rows; ++i) r[size_t(i)] = X[i * s.rank + k], xn += r[size_t(i)] * r[size_t(i)];
        for (int64_t j = 0; j <= k; ++j) {
          double d = 0;
          for (int64_t i = 0; i < s.rows; ++i) d += double(Q[i * s.rank + j]) * X[i * s.rank + k];
          if (j == k) EXPECT_GT(d, 0.0) << "column " << k;
          for (int64_t i = 0; i < s.rows; ++i) r[size_t(i)] -= d * Q[i * s.rank + j];
        }
        double rn = 0;
        for (double v : r) rn += v * v;
        EXPECT_LT(std::sqrt(rn), 1e-5 * std::sqrt(xn)) << "column " << k << " leaves the span";
      }
    }
  }
}

TEST(Lowrank, OrthogonalizeBitsDoNotDependOnThreadsOrBatch) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 4);
  const int64_t count = 5, rows = 5000, rank = 4;  // 100k elements: a team of threads
  const std::vector<float> x0 = randn(count * rows * rank, g);
  std::vector<float> one = x0, two = x0;
  {
    ref::Threads t(1);
    lr::orthogonalize(f32(one), count, rows, rank, 1e-8f);
  }
  {
    ref::Threads t(2);
    lr::orthogonalize(f32(two), count, rows, rank, 1e-8f);
  }
  EXPECT_EQ(0, std::memcmp(one.data(), two.data(), one.size() * 4));
  // matrix 3 alone gives the same bits as in the batch
  std::vector<float> m3(x0.begin() + 3 * rows * rank, x0.begin() + 4 * rows * rank);
  lr::orthogonalize(f32(m3), 1, rows, rank, 1e-8f);
  EXPECT_EQ(0, std::memcmp(m3.data(), one.data() + 3 * rows * rank, m3.size() * 4));
}

TEST(Lowrank, OrthogonalizeKeepsZeroColumnsZero) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 5);
  const int64_t rows = 12, rank = 4;
  for (float eps : {0.0f, 0.5f}) {
    SCOPED_TRACE(::testing::Message() << "epsilon " << eps);
    // matrix 0: column 1 zero; matrix 1: all zero; matrix 2: column 2 = 3 * column 0 = 3 e_0 (exactly
    // cancelled by the projection), column 0 = e_0
    std::vector<float> x = randn(3 * rows * rank, g);
    for (int64_t i = 0; i < rows; ++i) x[size_t(i * rank + 1)] = 0.0f;
    std::fill(x.begin() + rows * rank, x.begin() + 2 * rows * rank, 0.0f);
    float* X2 = x.data() + 2 * rows * rank;
    for (int64_t i = 0; i < rows; ++i) X2[i * rank + 0] = i == 0 ? 1.0f : 0.0f, X2[i * rank + 2] = i == 0 ? 3.0f : 0.0f;
    lr::orthogonalize(f32(x), 3, rows, rank, eps);
    for (float v : x) ASSERT_FALSE(std::isnan(v));
    for (int64_t i = 0; i < rows; ++i) {
      EXPECT_EQ(ref::bits(x[size_t(i * rank + 1)]), 0u) << "matrix 0 column 1 row " << i;
      if (eps == 0.0f) EXPECT_EQ(ref::bits(X2[i * rank + 2]), 0u) << "matrix 2 column 2 row " << i;
    }
    for (int64_t e = rows * rank; e < 2 * rows * rank; ++e) EXPECT_EQ(ref::bits(x[size_t(e)]), 0u);
    if (eps == 0.0f) {  // (with epsilon > 0 the columns are shorter than 1 and 3 e_0 does not cancel)
      EXPECT_LT(orthonormality_error(x, 0, rows, rank, {1}), 1e-5);
      EXPECT_LT(orthonormality_error(x, 2, rows, rank, {2}), 1e-5);
      EXPECT_EQ(X2[0], 1.0f);
    }
  }
}

TEST(Lowrank, OrthogonalizeRedrawsZeroColumns) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 6);
  const int64_t count = 2, rows = 10, rank = 3;
  const lr::Redraw rd{0x1234567890ull, 77};
  std::vector<float> x = randn(count * rows * rank, g);
  for (int64_t i = 0; i < rows; ++i) x[size_t(rows * rank + i * rank + 1)] = 0.0f;  // matrix 1, column 1
  std::fill(x.begin(), x.begin() + rows * rank, 0.0f);                           // matrix 0: all zero
  std::vector<double> expect[count];
  for (int64_t b = 0; b < count; ++b) {  // the reference: zero columns replaced by the normals first
    std::vector<double> Xd(size_t(rows * rank));
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t k = 0; k < rank; ++k) {
        const int64_t e = b * rows * rank + i * rank + k;
        const bool zero_col = b == 0 || k == 1;
        Xd[size_t(i * rank + k)] =
            zero_col ? double(ref_normal(uint64_t(e), rd.seed, rd.stream)) : double(x[size_t(e)]);
      }
    expect[b] = ref_gram_schmidt(Xd, rows, rank, 0.0);
  }
  lr::orthogonalize(f32(x), count, rows, rank, 0.0f, &rd);
  for (int64_t b = 0; b < count; ++b) {
    EXPECT_LT(orthonormality_error(x, b, rows, rank), 1e-5) << "matrix " << b;
    for (int64_t e = 0; e < rows * rank; ++e)
      ASSERT_NEAR(x[size_t(b * rows * rank + e)], expect[b][size_t(e)], 1e-5) << "matrix " << b << " element " << e;
  }
  // without a zero column, a Redraw changes nothing
  std::vector<float> y = randn(rows * rank, g), z = y;
  lr::orthogonalize(f32(y), 1, rows, rank, 0.0f, &rd);
  lr::orthogonalize(f32(z), 1, rows, rank, 0.0f);
  EXPECT_EQ(y, z);
}

TEST(Lowrank, OrthogonalizeEpsilonDividesByNormPlusEpsilon) {
  std::mt19937_64 g(ref::test_seed() + 7);
  const int64_t rows = 20, rank = 3;
  std::vector<float> x = randn(rows * rank, g);
  std::vector<double> Xd(x.begin(), x.end());
  const std::vector<double> Qref = ref_gram_schmidt(Xd, rows, rank, 0.5);
  lr::orthogonalize(f32(x), 1, rows, rank, 0.5f);
  for (int64_t e = 0; e < rows * rank; ++e) ASSERT_NEAR(x[size_t(e)], Qref[size_t(e)], 1e-6) << e;
  double n0 = 0;
  for (int64_t i = 0; i < rows; ++i) n0 += double(x[size_t(i * rank)]) * x[size_t(i * rank)];
  EXPECT_LT(std::sqrt(n0), 1.0);  // norm / (norm + 0.5)
}

TEST(Lowrank, OrthogonalizePropagatesNaNAndInf) {
  std::mt19937_64 g(ref::test_seed() + 8);
  const int64_t rows = 8, rank = 3;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), INFINITY, -INFINITY}) {
    SCOPED_TRACE(::testing::Message() << "value " << bad);
    std::vector<float> x = randn(3 * rows * rank, g);
    const std::vector<float> x0 = x;
    x[size_t(0 * rows * rank + 5 * rank + 0)] = bad;  // matrix 0, column 0: every column non-finite
    x[size_t(1 * rows * rank + 2 * rank + 2)] = bad;  // matrix 1, last column: that column non-finite
    lr::orthogonalize(f32(x), 3, rows, rank, 0.0f);
    for (int64_t e = 0; e < rows * rank; ++e) EXPECT_TRUE(std::isnan(x[size_t(e)])) << "matrix 0 element " << e;
    for (int64_t i = 0; i < rows; ++i) {
      EXPECT_TRUE(std::isnan(x[size_t(rows * rank + i * rank + 2)]));
      EXPECT_TRUE(std::isfinite(x[size_t(rows * rank + i * rank + 0)]));
    }
    std::vector<float> m2(x0.begin() + 2 * rows * rank, x0.end());
    lr::orthogonalize(f32(m2), 1, rows, rank, 0.0f);
    EXPECT_EQ(0, std::memcmp(m2.data(), x.data() + 2 * rows * rank, m2.size() * 4)) << "matrix 2 is unaffected";
  }
}

// ---- reconstruct ----------------------------------------------------------------------------------
//! T of the header's fixed expression, in plain binary32 (x86 SSE, no contraction).
float ref_T(const float* prow, const float* Q, int64_t j, int64_t rank) {
  float t = prow[0] * Q[j * rank + 0];
  for (int64_t k = 1; k < rank; ++k) {
    const float prod = prow[k] * Q[j * rank + k];
    t = t + prod;
  }
  return t;
}

//! Returns whether a value written to out is non-finite.
bool check_reconstruct(const Shape& s, DType dt, bool with_residual, std::mt19937_64& g, float scale = 1.0f,
                       float qscale = 1.0f) {
  SCOPED_TRACE(::testing::Message() << "count " << s.count << " shape [" << s.rows << ", " << s.cols << "] rank "
                                    << s.rank << " out " << gradcomp::dtype_name(dt) << " residual " << with_residual);
  Batch m = make_batch(s.count, s.rows, s.cols, g);  // m.base: the residual M (gap elements 1234.5)
  std::vector<float> p = randn(s.count * s.rows * s.rank, g), q = randn(s.count * s.cols * s.rank, g);
  for (float& v : p) v *= scale;
  for (float& v : q) v *= qscale;
  const int64_t n = int64_t(m.base.size());
  const int64_t es = dt == DType::float32 ? 4 : 2;
  ref::Bytes out(n * es);
  std::memset(out.data(), 0xAB, size_t(n * es));  // sentinel in the gaps
  const std::vector<float> e0 = m.base;
  uint32_t status = 0x4;
  const Tensor to{out.data(), dt, n, {}};
  lr::reconstruct(m.view(), f32(p), f32(q), s.rank, to, with_residual ? m.base.data() : nullptr, &status);
  bool nonfinite = false;
  std::vector<bool> covered(size_t(n), false);
  for (int64_t b = 0; b < s.count; ++b)
    for (int64_t i = 0; i < s.rows; ++i)
      for (int64_t j = 0; j < s.cols; ++j) {
        const int64_t at = m.offsets[b] + i * s.cols + j;
        covered[size_t(at)] = true;
        const float T = ref_T(p.data() + (b * s.rows + i) * s.rank, q.data() + b * s.cols * s.rank, j, s.rank);
        const uint32_t want = ref::to_dtype_bits(dt, T);
        uint32_t got = 0;
        std::memcpy(&got, out.data() + at * es, size_t(es));
        if (!std::isnan(T)) EXPECT_EQ(got, want) << "out at " << at << " T " << T;
        else EXPECT_TRUE(std::isnan(ref::from_dtype_bits(dt, got)));
        nonfinite |= !std::isfinite(ref::from_dtype_bits(dt, want));
        const float e_want = with_residual ? e0[size_t(at)] - T : e0[size_t(at)];
        EXPECT_TRUE(ref::same_f32(m.base[size_t(at)], e_want)) << "residual at " << at;
        if (::testing::Test::HasFailure()) return nonfinite;
      }
  for (int64_t at = 0; at < n; ++at)
    if (!covered[size_t(at)]) {
      for (int64_t c = 0; c < es; ++c) EXPECT_EQ(out.data()[at * es + c], 0xAB) << "gap element " << at << " written";
      EXPECT_EQ(m.base[size_t(at)], 1234.5f) << "residual gap element " << at << " written";
      if (::testing::Test::HasFailure()) return nonfinite;
    }
  EXPECT_EQ(status, nonfinite ? 0x5u : 0x4u) << "status";
  return nonfinite;
}

TEST(Lowrank, ReconstructIsTheFixedExpression) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 9);
  IsaScope keep;
  for (const std::string& isa : gradcomp::cpu_isas_supported()) {  // every CPU variant of the loop
    SCOPED_TRACE("cpu isa " + isa);
    gradcomp::set_cpu_isa(isa);
    for (const Shape& s : kShapes)
      for (DType dt : {DType::float32, DType::float16, DType::bfloat16})
        for (bool res : {false, true}) check_reconstruct(s, dt, res, g);
  }
}

TEST(Lowrank, ReconstructStatusAndOverflow) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 10);
  IsaScope keep;
  for (const std::string& isa : gradcomp::cpu_isas_supported()) {
    SCOPED_TRACE("cpu isa " + isa);
    gradcomp::set_cpu_isa(isa);
    // P ~ 1e5 N(0, 1): T finite in float32 and bfloat16, some above 65504 (inf) in float16
    EXPECT_FALSE(check_reconstruct({2, 9, 30, 3}, DType::float32, true, g, 1e5f));
    EXPECT_FALSE(check_reconstruct({2, 9, 30, 3}, DType::bfloat16, true, g, 1e5f));
    EXPECT_TRUE(check_reconstruct({2, 9, 30, 3}, DType::float16, true, g, 1e5f));
    // P ~ 1e38 N(0, 1), Q ~ 100 N(0, 1): products and sums overflow float32 (inf, and NaN from inf - inf)
    EXPECT_TRUE(check_reconstruct({1, 7, 8, 2}, DType::float32, true, g, 1e38f, 100.0f));
    EXPECT_TRUE(check_reconstruct({1, 7, 8, 2}, DType::bfloat16, false, g, 1e38f, 100.0f));
    // NaN in P: that row NaN, status set
    Batch m = make_batch(1, 3, 4, g);
    std::vector<float> p = randn(3 * 2, g), q = randn(4 * 2, g), out(m.base.size(), 0.0f);
    p[2 * 2 + 1] = std::numeric_limits<float>::quiet_NaN();
    uint32_t st = 0;
    lr::reconstruct(m.view(), f32(p), f32(q), 2, f32(out), m.base.data(), &st);
    EXPECT_EQ(st, 1u);
    for (int64_t j = 0; j < 4; ++j) {
      EXPECT_TRUE(std::isnan(out[size_t(m.offsets[0] + 2 * 4 + j)]));
      EXPECT_TRUE(std::isnan(m.base[size_t(m.offsets[0] + 2 * 4 + j)]));
      EXPECT_TRUE(std::isfinite(out[size_t(m.offsets[0] + 1 * 4 + j)]));
    }
    // no status pointer: fine
    lr::reconstruct(m.view(), f32(p), f32(q), 2, f32(out), nullptr, nullptr);
  }
}

TEST(Lowrank, ReconstructOnManyThreadsIsBitwiseTheSame) {
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 11);
  for (int threads : {2, 3}) {
    ref::Threads t(threads);
    check_reconstruct({5, 130, 5000, 4}, DType::bfloat16, true, g);  // columns over several 4096-blocks
    check_reconstruct({1, 1, 70001, 1}, DType::float32, true, g);
    check_reconstruct({1, 70001, 1, 1}, DType::float16, false, g);
  }
}

// ---- random_normal ------------------------------------------------------------------------------
TEST(Lowrank, ReferencePhiloxMatchesKnownAnswers) {
  // Random123's kat_vectors (philox4x64, 10 rounds): counter 0 / key 0, all ones, and pi's digits.
  U4 r = philox4x64_10(U4{{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(r.v[0], 0x16554d9eca36314cull);
  EXPECT_EQ(r.v[1], 0xdb20fe9d672d0fdcull);
  EXPECT_EQ(r.v[2], 0xd7e772cee186176bull);
  EXPECT_EQ(r.v[3], 0x7e68b68aec7ba23bull);
  const uint64_t ones = ~0ull;
  r = philox4x64_10(U4{{ones, ones, ones, ones}}, ones, ones);
  EXPECT_EQ(r.v[0], 0x87b092c3013fe90bull);
  EXPECT_EQ(r.v[3], 0xa09caebf594f0ba0ull);
  r = philox4x64_10(U4{{0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull}},
                    0x452821e638d01377ull, 0xbe5466cf34e90c6cull);
  EXPECT_EQ(r.v[0], 0xa528f45403e61d95ull);
  EXPECT_EQ(r.v[1], 0x38c72dbd566e9788ull);
  EXPECT_EQ(r.v[2], 0xa5a1610e72fd18b5ull);
  EXPECT_EQ(r.v[3], 0x57bd43b5e52b7fe6ull);
}

TEST(Lowrank, RandomNormalIsPhiloxBoxMuller) {
  for (int threads : {1, 2}) {
    ref::Threads t(threads);
    for (auto [seed, stream] : {std::pair<uint64_t, uint64_t>{0, 0}, {42, 7}, {~0ull, 1ull << 40}}) {
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " stream " << stream << " threads " << threads);
      const int64_t n = 100003;
      std::vector<float> x(size_t(n), -99.0f);
      lr::random_normal(f32(x), seed, stream);
      double sum = 0, sq = 0;
      for (int64_t e = 0; e < n; ++e) {
        ASSERT_EQ(ref::bits(x[size_t(e)]), ref::bits(ref_normal(uint64_t(e), seed, stream))) << "element " << e;
        sum += x[size_t(e)];
        sq += double(x[size_t(e)]) * x[size_t(e)];
      }
      EXPECT_LT(std::abs(sum / n), 0.02);  // mean 0 (5 sigma: 5 / sqrt(n) = 0.016)
      EXPECT_NEAR(sq / n, 1.0, 0.03);      // variance 1 (sd of the estimate: sqrt(2 / n) = 0.0045)
    }
  }
  std::vector<float> a(16), b(16);
  lr::random_normal(f32(a), 5, 0);
  lr::random_normal(f32(b), 5, 1);
  EXPECT_NE(a, b) << "another stream draws other values";
  std::vector<float> empty;
  lr::random_normal(f32(empty), 1, 2);  // nothing to do
}

// ---- chained: one PowerSGD step --------------------------------------------------------------------
TEST(Lowrank, PowerStepOfARankTwoMatrixIsExactUpToRounding) {
  // M = A B^T of rank 2: one power step from a random Q reconstructs M (to float32 rounding times
  // the condition of the step) and leaves a residual ~ 0; a wrong step is off by O(|M|).
  SCOPED_TRACE(seed_trace());
  std::mt19937_64 g(ref::test_seed() + 12);
  const int64_t rows = 30, cols = 20, rank = 2;
  std::vector<float> A = randn(rows * rank, g), B = randn(cols * rank, g);
  std::vector<float> M(size_t(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      M[size_t(i * cols + j)] = float(double(A[size_t(i * 2)]) * B[size_t(j * 2)] +
                                      double(A[size_t(i * 2 + 1)]) * B[size_t(j * 2 + 1)]);
  const std::vector<float> M0 = M;
  std::vector<int64_t> off{0};
  lr::MatrixBatch mb{f32(M), off.data(), 1, rows, cols};
  std::vector<float> q(size_t(cols * rank)), p(size_t(rows * rank)), out(M.size());
  lr::random_normal(f32(q), 3, 4);
  lr::project(mb, f32(q), f32(p), rank);
  lr::orthogonalize(f32(p), 1, rows, rank, 0.0f);
  lr::back_project(mb, f32(p), f32(q), rank);
  lr::reconstruct(mb, f32(p), f32(q), rank, f32(out), M.data(), nullptr);
  double mn = 0;
  for (float v : M0) mn = std::max(mn, double(std::abs(v)));
  for (size_t e = 0; e < M.size(); ++e) {
    // float32 rounding amplified by the condition of the random 2 x 2 B^T Q: 2e-4 of max |M|
    ASSERT_NEAR(out[e], M0[e], 2e-4 * mn) << e;
    ASSERT_NEAR(M[e], 0.0, 2e-4 * mn) << "residual " << e;
  }
}

// ---- bad arguments ---------------------------------------------------------------------------------
template <class F> std::string invalid_message(F&& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected InvalidArgument, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected InvalidArgument, nothing thrown";
  return "";
}
#define EXPECT_INVALID(stmt, ...)                                                   \
  do {                                                                              \
    const std::string msg_ = invalid_message([&] { stmt; });                        \
    for (const char* part : {__VA_ARGS__})                                          \
      EXPECT_NE(msg_.find(part), std::string::npos) << "message: " << msg_ << "\nmissing: " << part; \
  } while (0)

TEST(Lowrank, BadArgumentsAreInvalidArgument) {
  std::mt19937_64 g(ref::test_seed() + 13);
  Batch m = make_batch(2, 4, 6, g, false);  // offsets ascending
  std::vector<float> q(2 * 6 * 3), p(2 * 4 * 3);
  const int64_t r = 3;
  // rank
  EXPECT_INVALID(lr::project(m.view(), f32(q), f32(p), 0), "rank 0", "[1, 4]");
  {
    std::vector<float> q5(2 * 6 * 5), p5(2 * 4 * 5);
    EXPECT_INVALID(lr::project(m.view(), f32(q5), f32(p5), 5), "rank 5", "[1, 4]");
    EXPECT_INVALID(lr::back_project(m.view(), f32(p5), f32(q5), 5), "rank 5");
  }
  // sizes of P / Q
  std::vector<float> qs(2 * 6 * 3 - 1);
  EXPECT_INVALID(lr::project(m.view(), f32(qs), f32(p), r), "q has 35 elements", "needs 36");
  EXPECT_INVALID(lr::back_project(m.view(), f32(p), f32(qs), r), "q has 35 elements");
  // dtypes
  std::vector<uint16_t> h(36);
  const Tensor th{h.data(), DType::float16, 36, {}};
  EXPECT_INVALID(lr::project(m.view(), th, f32(p), r), "q has dtype float16", "accepted: float32");
  {
    lr::MatrixBatch mb = m.view();
    mb.base.dtype = DType::bfloat16;
    EXPECT_INVALID(lr::project(mb, f32(q), f32(p), r), "m.base has dtype bfloat16");
  }
  // offsets
  {
    std::vector<int64_t> o = m.offsets;
    lr::MatrixBatch mb = m.view();
    mb.offsets = o.data();
    o[1] = -1;
    EXPECT_INVALID(lr::project(mb, f32(q), f32(p), r), "matrix 1 at offset -1");
    o[1] = int64_t(m.base.size()) - 23;
    EXPECT_INVALID(lr::project(mb, f32(q), f32(p), r), "reaches past the end of m.base");
    o[1] = o[0] + 23;  // overlaps matrix 0 by one element
    EXPECT_INVALID(lr::back_project(mb, f32(p), f32(q), r), "overlap", "24 elements apart");
    mb.offsets = nullptr;
    EXPECT_INVALID(lr::project(mb, f32(q), f32(p), r), "offsets is null");
  }
  {
    lr::MatrixBatch mb = m.view();
    mb.rows = 0;
    EXPECT_INVALID(lr::project(mb, f32(q), f32(p), r), "rows 0");
    mb = m.view();
    mb.count = -1;
    EXPECT_INVALID(lr::project(mb, f32(q), f32(p), r), "count -1");
  }
  // P written over M or Q
  {
    lr::MatrixBatch mb = m.view();
    const Tensor over{m.base.data(), DType::float32, 24, {}};
    EXPECT_INVALID(lr::project(mb, f32(q), over, r), "overlap");
  }
  // devices
  {
    const Tensor qc{q.data(), DType::float32, int64_t(q.size()), Device{DeviceKind::cuda, 0}};
    EXPECT_INVALID(lr::project(m.view(), qc, f32(p), r), "q is on cuda:0", "m.base is on cpu");
  }
  // orthogonalize
  std::vector<float> x(2 * 4 * 3);
  EXPECT_INVALID(lr::orthogonalize(f32(x), 2, 4, 5, 0.0f), "rank 5", "[1, 4]");
  EXPECT_INVALID(lr::orthogonalize(f32(x), 2, 4, 0, 0.0f), "rank 0");
  EXPECT_INVALID(lr::orthogonalize(f32(x), 2, 4, 3, -1.0f), "epsilon -1");
  EXPECT_INVALID(lr::orthogonalize(f32(x), 2, 4, 3, std::numeric_limits<float>::quiet_NaN()), "epsilon nan");
  EXPECT_INVALID(lr::orthogonalize(f32(x), 3, 4, 3, 0.0f), "x has 24 elements", "needs 36");
  // reconstruct
  std::vector<float> out(m.base.size());
  std::vector<int32_t> ints(m.base.size());
  const Tensor ti{ints.data(), DType::int32, int64_t(ints.size()), {}};
  EXPECT_INVALID(lr::reconstruct(m.view(), f32(p), f32(q), r, ti, nullptr, nullptr), "out has dtype int32",
                 "accepted: float32, float16, bfloat16");
  std::vector<float> small(size_t(m.offsets[1] + 23));
  EXPECT_INVALID(lr::reconstruct(m.view(), f32(p), f32(q), r, f32(small), nullptr, nullptr),
                 "reaches past the end of out");
  EXPECT_INVALID(lr::reconstruct(m.view(), f32(p), f32(q), r, f32(out), out.data(), nullptr), "residual", "overlap");
  {
    const Tensor pin{out.data(), DType::float32, int64_t(p.size()), {}};  // P inside out
    EXPECT_INVALID(lr::reconstruct(m.view(), pin, f32(q), r, f32(out), nullptr, nullptr), "overlap");
  }
  // random_normal
  EXPECT_INVALID(lr::random_normal(th, 1, 2), "x has dtype float16");
  // nothing was written by the rejected calls
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

TEST(Lowrank, CudaTensorsWithoutCudaAreUnsupported) {
  if (gradcomp::build_info().cuda) GTEST_SKIP() << "a CUDA build (tests/cpp/test_cuda_lowrank.cu covers CUDA)";
  std::vector<float> v(64);
  const Tensor c{v.data(), DType::float32, 64, Device{DeviceKind::cuda, 0}};
  std::vector<int64_t> off{0};
  lr::MatrixBatch mb{c, off.data(), 1, 4, 4};
  const Tensor q{v.data(), DType::float32, 8, Device{DeviceKind::cuda, 0}};
  EXPECT_THROW(lr::project(mb, q, q, 2), gradcomp::Unsupported);
  EXPECT_THROW(lr::back_project(mb, q, q, 2), gradcomp::Unsupported);
  EXPECT_THROW(lr::orthogonalize(q, 1, 4, 2, 0.0f), gradcomp::Unsupported);
  EXPECT_THROW(lr::reconstruct(mb, q, q, 2, c, nullptr, nullptr), gradcomp::Unsupported);
  try {
    lr::random_normal(c, 1, 2);
    ADD_FAILURE() << "nothing thrown";
  } catch (const gradcomp::Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA support"), std::string::npos) << e.what();
  }
}

TEST(Lowrank, EmptyBatchesAreNoOps) {
  std::vector<float> base(10), none;
  lr::MatrixBatch mb{f32(base), nullptr, 0, 3, 3};
  lr::project(mb, f32(none), f32(none), 2);
  lr::back_project(mb, f32(none), f32(none), 2);
  lr::reconstruct(mb, f32(none), f32(none), 2, f32(base), nullptr, nullptr);
  lr::orthogonalize(f32(none), 0, 3, 2, 0.0f);
  for (float v : base) EXPECT_EQ(v, 0.0f);
}

} // namespace
