// SPDX-License-Identifier: Apache-2.0
// CPU backend of low-rank (PowerSGD) compression (include/gradcomp/lowrank.hpp; Vogels et al.,
// NeurIPS 2019, algorithm 1): the cpu_* entry points of kernels/core/lowrank_backend.hpp, which
// receive validated arguments.
//
// kernels/cpu/*.cpp are compiled once per CPU variant (kernels/cpu/isa.hpp). Only reconstruct's
// inner loop (compute-bound at rank > 1: r products and sums per element, and the float16 /
// bfloat16 rounding) is compiled in every variant (lowrank_reconstruct_units, in namespace
// cpu::<variant>); everything else is defined once, in the dispatching compilation
// (GRADCOMP_CPU_EMIT_TABLES: the generic variant, or the single one of a GRADCOMP_NATIVE=ON build),
// which also picks the variant's loop (cpu_isa()). The GEMMs are OpenBLAS's (which picks its own
// kernels per CPU); orthogonalize and random_normal are cheap next to them. Every variant computes
// the same fixed float32 expression, so reconstruct's bits do not depend on the variant.
//
// Threads. Every step runs on gradcomp's thread count (cpu_threads_for: 1 below 64 Ki elements,
// else get_num_threads(), or 1 while a core is found contended), in OpenMP regions of this file;
// OpenBLAS is set to one thread (openblas_set_num_threads(1), once, process-wide for the system
// OpenBLAS) and called from the team's threads, each on its own slice, so that OpenBLAS's threads
// never compete with the team's (four processes on two cores in the benchmarks).
//  - project, P_b = M_b Q_b: the work units are (matrix, slice of its rows); back_project,
//    Q_b = M_b^T P_b: (matrix, slice of its columns). One unit per matrix when count >= threads.
//    Rank 1 calls sgemv (OpenBLAS's sgemm packs its operands: 2-3x slower for one column). The
//    order of the sums is OpenBLAS's (the header promises nothing more).
//  - orthogonalize: one matrix per thread (a matrix's arithmetic is sequential, so its bits do not
//    depend on the thread count).
//  - reconstruct: units of (matrix, row, block of 4096 columns); Q is first transposed into a
//    [count, rank, cols] scratch (rank > 1; a thread_local buffer of the calling thread, kept
//    between calls) so the inner loops run over contiguous columns.
//  - random_normal: contiguous slices of the elements.
// Sizes: a dimension above 2^31 - 1 (OpenBLAS's int) raises Unsupported in project/back_project.
#include <algorithm>
#include <cstdint>

#include "gradcomp/types.hpp"
#include "isa.hpp"
#include "parallel.hpp"

namespace gradcomp::lowrank::detail {
//! One reconstruct call as the variants' loop sees it (the same definition in every variant).
struct ReconstructJob {
  const float* P;         //!< [count, rows, rank]
  const float* Qt;        //!< [count, rank, cols]: Q transposed per matrix (Q itself for rank 1)
  const int64_t* offsets; //!< count element offsets into out / residual
  int64_t rows, cols, rank, nblk;  //!< nblk = ceil(cols / kColBlock)
  DType dtype;            //!< out's: float32, float16 or bfloat16
  void* out;
  float* residual;        //!< or null
};
inline constexpr int64_t kColBlock = 4096;  //!< columns per reconstruct unit
} // namespace gradcomp::lowrank::detail

namespace GRADCOMP_CPU_NAMESPACE {
namespace {

constexpr int64_t kChunk = 256;      // columns per inner pass (the T values stay in L1)

//! out[j] / e[j] for j in [0, n) of one row: T[j] = fl(...fl(fl(p[0] q0[j]) + fl(p[1] q1[j])) ...)
//! with qk = qt + k * ldq (the transposed Q of the matrix, rank-major). Returns 1 when a value
//! written to out is non-finite.
template <class Tag>
uint32_t reconstruct_row(const float* __restrict prow, const float* __restrict qt, int64_t ldq, int64_t rank,
                         typename Tag::storage* __restrict out, float* __restrict e, int64_t n) {
  using common::add_rn;
  using common::mul_rn;
  using common::sub_rn;
  uint32_t flag = 0;
  alignas(64) float t[kChunk];
  for (int64_t j0 = 0; j0 < n; j0 += kChunk) {
    const int64_t len = std::min(kChunk, n - j0);
    const float p0 = prow[0];
    const float* q0 = qt + j0;
    for (int64_t j = 0; j < len; ++j) t[j] = mul_rn(p0, q0[j]);
    for (int64_t k = 1; k < rank; ++k) {
      const float pk = prow[k];
      const float* qk = qt + k * ldq + j0;
      for (int64_t j = 0; j < len; ++j) t[j] = add_rn(t[j], mul_rn(pk, qk[j]));
    }
    typename Tag::storage* o = out + j0;
    for (int64_t j = 0; j < len; ++j) {
      const typename Tag::storage v = Tag::store(t[j]);
      o[j] = v;
      flag |= static_cast<uint32_t>(Tag::nonfinite(v));
    }
    if (e != nullptr) {
      float* er = e + j0;
      for (int64_t j = 0; j < len; ++j) er[j] = sub_rn(er[j], t[j]);
    }
  }
  return flag;
}


template <class Tag> uint32_t units(const lowrank::detail::ReconstructJob& j, int64_t u0, int64_t u1) {
  using S = typename Tag::storage;
  S* O = static_cast<S*>(j.out);
  uint32_t flag = 0;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t jb = u % j.nblk, g = u / j.nblk, b = g / j.rows, i = g % j.rows;
    const int64_t j0 = jb * lowrank::detail::kColBlock, len = std::min(lowrank::detail::kColBlock, j.cols - j0);
    const int64_t at = j.offsets[b] + i * j.cols + j0;
    flag |= reconstruct_row<Tag>(j.P + (b * j.rows + i) * j.rank, j.Qt + b * j.cols * j.rank + j0, j.cols, j.rank,
                                 O + at, j.residual != nullptr ? j.residual + at : nullptr, len);
  }
  return flag;
}

} // namespace

//! Units [u0, u1) of a reconstruct job (unit = (matrix, row, block of kColBlock columns), in that
//! order, the block fastest); returns 1 when a value written to out is non-finite.
uint32_t lowrank_reconstruct_units(const lowrank::detail::ReconstructJob& j, int64_t u0, int64_t u1) {
  switch (j.dtype) {
    case DType::float16: return units<common::F16>(j, u0, u1);
    case DType::bfloat16: return units<common::BF16>(j, u0, u1);
    default: return units<common::F32>(j, u0, u1);  // float32 (the core accepts no other)
  }
}

} // namespace GRADCOMP_CPU_NAMESPACE

#if defined(GRADCOMP_CPU_EMIT_TABLES)

#include <cblas.h>
#include <omp.h>

#include <Random123/philox.h>

#include <climits>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "../core/family.hpp"
#include "../core/lowrank_backend.hpp"
#include "gradcomp/packet.hpp"

namespace gradcomp::detail::cpu {
#if !defined(GRADCOMP_CPU_SINGLE_VARIANT)
namespace avx512 {
uint32_t lowrank_reconstruct_units(const lowrank::detail::ReconstructJob&, int64_t, int64_t);
}
namespace avx2 {
uint32_t lowrank_reconstruct_units(const lowrank::detail::ReconstructJob&, int64_t, int64_t);
}
#endif
namespace {
using ReconstructUnits = uint32_t (*)(const lowrank::detail::ReconstructJob&, int64_t, int64_t);
//! The variant's loop that runs now (cpu_isa(): the best this processor supports, or the one asked for).
ReconstructUnits reconstruct_units() {
#if defined(GRADCOMP_CPU_SINGLE_VARIANT)
  return &GRADCOMP_CPU_ISA::lowrank_reconstruct_units;
#else
  switch (cpu_isa()) {
    case CpuIsa::avx512: return &avx512::lowrank_reconstruct_units;
    case CpuIsa::avx2: return &avx2::lowrank_reconstruct_units;
    default: return &generic::lowrank_reconstruct_units;
  }
#endif
}
} // namespace
} // namespace gradcomp::detail::cpu

namespace gradcomp::lowrank::detail {
namespace {

using gradcomp::detail::cpu_threads_for;
using gradcomp::detail::concat;
using gradcomp::detail::cpu::partition;
using gradcomp::detail::cpu::TeamClock;

void blas_single_thread() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

void check_blas_dims(const MatrixBatch& m, const char* call) {
  constexpr int64_t kInt = INT_MAX;
  if (m.rows > kInt || m.cols > kInt)
    throw Unsupported(concat(call, ": matrices of shape [", m.rows, ", ", m.cols,
                             "]: the CPU backend (OpenBLAS, 32-bit int sizes) takes rows and cols up to 2^31 - 1"));
}

//! Slices per matrix (of its n rows or columns): enough for `T` threads over `count` matrices.
int64_t slices_per_matrix(int64_t count, int T, int64_t n) {
  const int64_t s = count >= T ? 1 : (T + count - 1) / count;
  return std::max<int64_t>(1, std::min(s, n));
}

//! Runs unit(u) for u in [0, units): on the calling thread when T <= 1, else contiguous ranges of
//! units on a team of min(T, units) threads (which reports its skew: adaptive threads).

template <class Unit> void run_units(int64_t units, int T, Unit&& unit) {
  if (T <= 1 || units <= 1) {
    for (int64_t u = 0; u < units; ++u) unit(u);
    return;
  }
  T = int(std::min<int64_t>(T, units));
  TeamClock clock;
#pragma omp parallel num_threads(T)
  {
    clock.arrive();
    int64_t u0 = 0, u1 = 0;
    partition(units, T, omp_get_thread_num(), u0, u1);
    for (int64_t u = u0; u < u1; ++u) unit(u);
    clock.finish();
  }
  clock.report(T);
}

} // namespace

void cpu_project(const MatrixBatch& m, const Tensor& q, const Tensor& p, int64_t rank) {
  check_blas_dims(m, "lowrank::project");
  blas_single_thread();
  const float* base = m.base.ptr<const float>();
  const float* Q = q.ptr<const float>();
  float* P = p.ptr<float>();
  const int T = cpu_threads_for(m.count * m.rows * m.cols);
  const int64_t S = slices_per_matrix(m.count, T, m.rows);
  run_units(m.count * S, T, [&](int64_t u) {
    const int64_t b = u / S, s = u % S;
    int64_t r0 = 0, r1 = 0;
    partition(m.rows, int(S), int(s), r0, r1);
    if (r1 <= r0) return;
    // P_b[r0:r1] (rows x rank) = M_b[r0:r1] (rows x cols, row-major, ld cols) Q_b (cols x rank, ld rank)
    if (rank == 1) {  // matrix-vector (OpenBLAS's GEMM packs its operands: slower for one column)
      cblas_sgemv(CblasRowMajor, CblasNoTrans, int(r1 - r0), int(m.cols), 1.0f, base + m.offsets[b] + r0 * m.cols,
                  int(m.cols), Q + b * m.cols, 1, 0.0f, P + b * m.rows + r0, 1);
      return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(r1 - r0), int(rank), int(m.cols), 1.0f,
                base + m.offsets[b] + r0 * m.cols, int(m.cols), Q + b * m.cols * rank, int(rank), 0.0f,
                P + (b * m.rows + r0) * rank, int(rank));
  });
}

void cpu_back_project(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank) {
  check_blas_dims(m, "lowrank::back_project");
  blas_single_thread();
  const float* base = m.base.ptr<const float>();
  const float* P = p.ptr<const float>();
  float* Q = q.ptr<float>();
  const int T = cpu_threads_for(m.count * m.rows * m.cols);
  const int64_t S = slices_per_matrix(m.count, T, m.cols);
  run_units(m.count * S, T, [&](int64_t u) {
    const int64_t b = u / S, s = u % S;
    int64_t c0 = 0, c1 = 0;
    partition(m.cols, int(S), int(s), c0, c1);
    if (c1 <= c0) return;
    // Q_b[c0:c1] (cols x rank) = (M_b[:, c0:c1])^T (M_b: rows x cols, ld cols) P_b (rows x rank)
    if (rank == 1) {
      cblas_sgemv(CblasRowMajor, CblasTrans, int(m.rows), int(c1 - c0), 1.0f, base + m.offsets[b] + c0, int(m.cols),
                  P + b * m.rows, 1, 0.0f, Q + b * m.cols + c0, 1);
      return;
    }
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(c1 - c0), int(rank), int(m.rows), 1.0f,
                base + m.offsets[b] + c0, int(m.cols), P + b * m.rows * rank, int(rank), 0.0f,
                Q + (b * m.cols + c0) * rank, int(rank));
  });
}

namespace {

//! random_normal's element e (lowrank.hpp): Philox4x64-10 of counter {e, stream, 0, 0} and key
//! {seed, kLowrankPhiloxKey1} (Random123), Box-Muller on the first two words in binary64:
//!   u1 = ((x0 >> 11) + 1) * 2^-53 in (0, 1],  u2 = (x1 >> 11) * 2^-53 in [0, 1)
//!   value = float(sqrt(-2.0 * log(u1)) * cos(kTwoPi * u2)),  kTwoPi = binary64(2 pi)
//! (glibc's log and cos; the products in binary64, rounded once to binary32).
inline float normal_at(uint64_t e, uint64_t seed, uint64_t stream_id) {
  using G = r123::Philox4x64;
  const G::ctr_type c = {{e, stream_id, 0, 0}};
  const G::key_type k = {{seed, kLowrankPhiloxKey1}};
  const G::ctr_type r = G()(c, k);
  constexpr double kInv53 = 1.0 / 9007199254740992.0;  // 2^-53
  constexpr double kTwoPi = 6.283185307179586;         // binary64(2 pi) = 2 * binary64(pi)
  const double u1 = double((r.v[0] >> 11) + 1) * kInv53;
  const double u2 = double(r.v[1] >> 11) * kInv53;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2));
}

//! One matrix X (rows x rank, row-major float32, at flat element `flat0` of the whole x) in place.
//!
//! Exactly (every operation binary64 round to nearest, no FMA, sums in ascending index order):
//!   for k = 0 .. rank-1:
//!     w = column k of X (widened to binary64)
//!     2 times ("twice is enough"), in modified Gram-Schmidt order:
//!       for j = 0 .. k-1:  d = sum_i q_j[i] * w[i];  w[i] = w[i] - d * q_j[i]  (every i)
//!       (q_j the float32 output column j, widened; the first pass is PyTorch's
//!       _orthogonalize_gram_schmidt sequence, which subtracts each normalized column in turn)
//!     s = sum_i w[i] * w[i]
//!     s == 0 with a redraw: w = random_normal values at the column's flat indices of x
//!       (flat0 + i * rank + k), the two projection passes and s again
//!     s == 0: column k = +0.0 (whatever epsilon)
//!     s not finite (a NaN or inf reached the column): column k = NaN (so the following columns,
//!       projected on it, are NaN too: the matrix's output is non-finite, never zero)
//!     else: q_k[i] = float32(w[i] / (sqrt(s) + epsilon))  (the division in binary64, rounded once)
//! w, the dot products and s stay in binary64, so a column is rounded to float32 only once.
void orthogonalize_one(float* X, int64_t rows, int64_t rank, double eps, const Redraw* redraw, uint64_t flat0,
                       std::vector<double>& Wt, std::vector<double>& w) {
  Wt.resize(size_t(rows * rank));  // the output columns so far, widened, column-major [rank][rows]
  w.resize(size_t(rows));
  const auto project_out = [&](int64_t k) {
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t j = 0; j < k; ++j) {
        const double* qj = Wt.data() + j * rows;
        double dj = 0.0;
        for (int64_t i = 0; i < rows; ++i) dj += qj[i] * w[size_t(i)];
        for (int64_t i = 0; i < rows; ++i) w[size_t(i)] = w[size_t(i)] - dj * qj[i];
      }
  };
  const auto sumsq = [&] {
    double s = 0.0;
    for (int64_t i = 0; i < rows; ++i) s += w[size_t(i)] * w[size_t(i)];
    return s;
  };
  for (int64_t k = 0; k < rank; ++k) {
    for (int64_t i = 0; i < rows; ++i) w[size_t(i)] = double(X[i * rank + k]);
    project_out(k);
    double s = sumsq();
    if (s == 0.0 && redraw != nullptr) {
      for (int64_t i = 0; i < rows; ++i)
        w[size_t(i)] = double(normal_at(flat0 + uint64_t(i * rank + k), redraw->seed, redraw->stream));
      project_out(k);
      s = sumsq();
    }
    double* qk = Wt.data() + k * rows;
    if (s == 0.0) {
      for (int64_t i = 0; i < rows; ++i) X[i * rank + k] = 0.0f, qk[i] = 0.0;
    } else if (!std::isfinite(s)) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int64_t i = 0; i < rows; ++i) X[i * rank + k] = nan, qk[i] = double(nan);
    } else {
      const double denom = std::sqrt(s) + eps;
      for (int64_t i = 0; i < rows; ++i) {
        const float v = float(w[size_t(i)] / denom);
        X[i * rank + k] = v;
        qk[i] = double(v);
      }
    }
  }
}

} // namespace

void cpu_orthogonalize(const Tensor& x, int64_t count, int64_t rows, int64_t rank, float epsilon,
                       const Redraw* redraw) {
  float* X = x.ptr<float>();
  const int64_t mat = rows * rank;
  const int T = int(std::min<int64_t>(cpu_threads_for(count * mat), count));
  const double eps = double(epsilon);
  if (T <= 1) {
    std::vector<double> Wt, w;
    for (int64_t b = 0; b < count; ++b)
      orthogonalize_one(X + b * mat, rows, rank, eps, redraw, uint64_t(b * mat), Wt, w);
    return;
  }
  TeamClock clock;
#pragma omp parallel num_threads(T)
  {
    clock.arrive();
    std::vector<double> Wt, w;
    int64_t b0 = 0, b1 = 0;
    partition(count, T, omp_get_thread_num(), b0, b1);
    for (int64_t b = b0; b < b1; ++b)
      orthogonalize_one(X + b * mat, rows, rank, eps, redraw, uint64_t(b * mat), Wt, w);
    clock.finish();
  }
  clock.report(T);
}


void cpu_reconstruct(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, const Tensor& out,
                     float* residual, uint32_t* status) {
  const float* Q = q.ptr<const float>();
  const int64_t rows = m.rows, cols = m.cols, count = m.count;
  const int64_t nblk = (cols + kColBlock - 1) / kColBlock;
  const int64_t units = count * rows * nblk;
  const int T = int(std::min<int64_t>(cpu_threads_for(count * rows * cols), units));

  // Q transposed per matrix: Qt[b][k][j] = Q[b][j][k] ([count, rank, cols]); rank 1 is already so.
  thread_local std::vector<float> scratch;
  if (rank > 1) scratch.resize(size_t(count * cols * rank));
  float* qt = rank > 1 ? scratch.data() : nullptr;
  const ReconstructJob job{p.ptr<const float>(), rank > 1 ? qt : Q, m.offsets, rows, cols, rank, nblk,
                           out.dtype, out.data, residual};
  const int64_t tunits = count * nblk;
  const auto transpose = [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / nblk, j0 = (u % nblk) * kColBlock, j1 = std::min(cols, j0 + kColBlock);
      const float* src = Q + b * cols * rank;
      float* dst = qt + b * cols * rank;
      for (int64_t k = 0; k < rank; ++k)
        for (int64_t j = j0; j < j1; ++j) dst[k * cols + j] = src[j * rank + k];
    }
  };
  const gradcomp::detail::cpu::ReconstructUnits run = gradcomp::detail::cpu::reconstruct_units();
  uint32_t flag = 0;
  if (T <= 1) {
    if (rank > 1) transpose(0, tunits);
    flag = run(job, 0, units);
  } else {
    TeamClock clock;
#pragma omp parallel num_threads(T) reduction(| : flag)
    {
      clock.arrive();
      const int t = omp_get_thread_num();
      int64_t u0 = 0, u1 = 0;
      if (rank > 1) {
        partition(tunits, T, t, u0, u1);
        transpose(u0, u1);
#pragma omp barrier
      }
      partition(units, T, t, u0, u1);
      flag |= run(job, u0, u1);
      clock.finish();
    }
    clock.report(T);
  }
  if (flag != 0 && status != nullptr) *status |= kStatusNonFinite;
}

void cpu_random_normal(const Tensor& x, uint64_t seed, uint64_t stream_id) {
  float* X = x.ptr<float>();
  const int64_t n = x.numel;
  const int T = cpu_threads_for(n);
  constexpr int64_t kBlock = 1 << 14;
  run_units((n + kBlock - 1) / kBlock, T, [&](int64_t u) {
    const int64_t e1 = std::min(n, (u + 1) * kBlock);
    for (int64_t e = u * kBlock; e < e1; ++e) X[e] = normal_at(uint64_t(e), seed, stream_id);
  });
}

} // namespace gradcomp::lowrank::detail

#endif // GRADCOMP_CPU_EMIT_TABLES
