// SPDX-License-Identifier: Apache-2.0
// CPU backend of low-rank (PowerSGD) compression (include/gradcomp/lowrank.hpp; Vogels et al.,
// NeurIPS 2019, algorithm 1): the cpu_* entry points of kernels/core/lowrank_backend.hpp, which
// receive validated arguments.
//
// kernels/cpu/*.cpp are compiled once per CPU variant (kernels/cpu/isa.hpp). The loops that touch
// every element of M are compiled in every variant (namespace cpu::<variant>):
// lowrank_reconstruct_units (reconstruct's inner loop: r products and sums per element, and the
// float16 / bfloat16 rounding), lowrank_project_rows and lowrank_back_project_cols (project /
// back_project: at ranks kSmallRankMin..kSmallRankMax = 2..16 in a build with OpenBLAS, at every
// rank without it). Everything else is defined once, in the dispatching compilation
// (GRADCOMP_CPU_EMIT_TABLES: the generic variant, or the single one of a GRADCOMP_NATIVE=ON build),
// which also picks the variant's loops (cpu_isa()). OpenBLAS is optional (CMake GRADCOMP_BLAS:
// AUTO uses it where found, ON requires it, OFF never; GRADCOMP_HAVE_BLAS=1/0 here,
// build_info().blas "openblas" / "none"): with it rank 1 calls its sgemv and ranks above 16 its
// sgemm (OpenBLAS picks its own kernels per CPU); without it gradcomp's loops serve ranks 1 and
// > 16 as well (they take any rank: project's passes go over the ranks K at a time, the chunk of
// Qt and back_project's block shrink to 8192 / rank and 65536 / rank columns, at least 16).
// orthogonalize and random_normal are cheap next to them. Every variant computes the same fixed
// float32 expressions, so neither reconstruct's bits nor those of project / back_project on
// gradcomp's loops (ranks 2..16; every rank without OpenBLAS) depend on the variant (or on the
// thread count).
//
// gradcomp's project / back_project loops read M once (OpenBLAS's sgemm packs M first, a copy;
// the timings: bench/RESULTS.md, section "kernels/cpu/lowrank.cpp: the loops against OpenBLAS").
// No FMA: binary32 products and sums, never contracted (-ffp-contract=off), in a fixed order per
// output element:
//  - project, P[i][k] = sum_j M[i][j] Q[j][k]: 16 partial sums per (i, k), lane l summing
//    j = l, l + 16, ... ascending from +0 (fl(s + fl(M[i][j] Q[j][k]))), then added in a fixed
//    tree (lanes 8 apart, then 4, 2, 1). Q_b is first transposed into a thread's scratch by groups
//    of 16 columns ([cols / 16][rank][16]), then passes take R rows of M by K ranks at a time (the
//    R * K partial-sum vectors in registers: 8 x 2 up to rank 8 and 4 x 4 above with AVX-512, 4 x
//    1 with AVX2 and in generic), over chunks of 8192 / rank columns; the cols % 16 last columns
//    go to lanes 0.. of the same sums in scalar code.
//  - back_project, Q[j][k] = sum_i M[i][j] P[i][k]: sequential in i ascending from +0. Threads
//    own slices of whole 16-column groups of every row (no reduction between threads). A slice's
//    Qt [rank][block of 65536 / rank columns] (a thread's scratch, L2) takes 8 rows of M at a time
//    held in registers, each row's product added in turn, then is written to Q transposed.
// Against OpenBLAS (bench/bench_cpu.cpp BM_Lowrank; bench/RESULTS.md, section "kernels/cpu/lowrank.cpp:
// the loops against OpenBLAS"): faster at ranks 2..16 on large matrices, slower above 16 where
// project is compute-bound and sgemm's FMA kernel wins (hence the bound), rank 1 on sgemv.
//
// Threads. Every step on gradcomp's loops runs on gradcomp's thread count (cpu_threads_for: 1
// below 64 Ki elements, else get_num_threads(), or 1 while a core is found contended), in OpenMP
// regions of this file. OpenBLAS (ranks 1 and > 16 where built with it) is called once per matrix
// from the calling thread, outside any team of gradcomp's, and runs on its own threads: whatever
// the user or another library in the process gave it (OPENBLAS_NUM_THREADS,
// openblas_set_num_threads); gradcomp never changes that setting (issue 20: it is process-wide, and
// the system OpenBLAS may be shared with numpy or the user's code). Why not the team, each thread
// on its own slice, as before: without setting OpenBLAS to one thread, T team threads each calling
// a multi-threaded OpenBLAS would oversubscribe the cores (T times OpenBLAS's threads; Debian's
// pthreads OpenBLAS also serializes concurrent callers on its server). The cost: at those ranks
// gradcomp's set_num_threads / adaptive threads do not apply (OpenBLAS's own setting does), and a
// batch of matrices runs one matrix at a time (each on OpenBLAS's threads). A build without
// OpenBLAS has no such exception.
//  - project, P_b = M_b Q_b: the work units are (matrix, slice of its rows); back_project,
//    Q_b = M_b^T P_b: (matrix, slice of its columns: of whole 16-column groups at ranks 2..16).
//    One unit per matrix when count >= threads. Each unit's scratch (project: Qt and the partial
//    sums; back_project: a block of Qt) is a thread_local buffer of the thread that runs it, kept
//    between calls. At ranks 1 and > 16 with OpenBLAS the order of the sums is OpenBLAS's, which
//    may depend on its thread count and CPU kernel (the header promises nothing more); without
//    OpenBLAS every rank has the fixed order above.
//  - orthogonalize: one matrix per thread (a matrix's arithmetic is sequential, so its bits do not
//    depend on the thread count).
//  - reconstruct: units of (matrix, row, block of 4096 columns); Q is first transposed into a
//    [count, rank, cols] scratch (rank > 1; a thread_local buffer of the calling thread, kept
//    between calls) so the inner loops run over contiguous columns.
//  - random_normal: contiguous slices of the elements.
// Sizes: a dimension above 2^31 - 1 (OpenBLAS's int) raises Unsupported in project/back_project
// (at every rank and in builds without OpenBLAS too, so that the limit depends on neither).
#include <algorithm>
#include <cstdint>
#include <cstring>

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

//! One project / back_project call of the small-rank kernels as the variants see it (the same
//! definition in every variant).
struct GemmJob {
  const float* base;       //!< M_b: row-major [rows, cols] at base + offsets[b]
  const int64_t* offsets;
  const float* in;         //!< project: Q [count, cols, rank]; back_project: P [count, rows, rank]
  float* out;              //!< project: P [count, rows, rank]; back_project: Q [count, cols, rank]
  int64_t rows, cols, rank;
};
//! The ranks the small-rank kernels serve: rank 1 stays on sgemv, above kSmallRankMax sgemm.
inline constexpr int64_t kSmallRankMin = 2, kSmallRankMax = 16;
inline constexpr int64_t kLanes = 16;       //!< project: partial sums per dot product
inline constexpr int64_t kProjectRows = 8;  //!< project: the most rows one pass over M serves
//! project: columns per chunk of Qt (rank * chunk floats = 32 KiB).
inline int64_t project_chunk(int64_t rank) { return std::max<int64_t>(kLanes, 8192 / rank / kLanes * kLanes); }
//! back_project: columns per block of Qt (rank * block floats = 256 KiB, L2).
inline int64_t back_project_block(int64_t rank) { return std::max<int64_t>(kLanes, 65536 / rank / kLanes * kLanes); }
//! Scratch floats of a project unit (Qt of the matrix's first cols / 16 * 16 columns, then the
//! partial sums of kProjectRows rows) and of a back_project unit over `width` columns (one block
//! of Qt, its rows padded by one line).
inline int64_t project_scratch(int64_t cols, int64_t rank) {
  return cols / kLanes * kLanes * rank + kProjectRows * rank * kLanes;
}
inline int64_t back_project_scratch(int64_t width, int64_t rank) {
  return rank * ((std::min(width, back_project_block(rank)) + kLanes - 1) / kLanes * kLanes + kLanes);
}
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

// ---- project / back_project at ranks kSmallRankMin..kSmallRankMax ------------------------------
// VN: the variant's native vector of float32 (GCC / Clang vector extension): a zmm register
// (avx512, 16 lanes), a ymm (avx2, 8) or an xmm (generic, 4: SSE2 or NEON). Its operations are
// lane-wise binary32 multiplies and adds, never contracted (-ffp-contract=off). project's 16
// partial sums per dot product are kParts VNs, lane l of the 16 always summing columns j = l mod 16,
// so every variant computes the same bits; only the register blocking (rows and ranks per pass)
// differs, which changes no sum.
#if defined(__AVX512F__)
typedef float VN __attribute__((vector_size(64)));
#elif defined(__AVX2__)
typedef float VN __attribute__((vector_size(32)));
#else
typedef float VN __attribute__((vector_size(16)));
#endif
//! The same at any float's address (unaligned, aliasing float: as __m512_u).
typedef float VNu __attribute__((vector_size(sizeof(VN)), aligned(4), may_alias));
constexpr int kN = int(sizeof(VN) / sizeof(float));
constexpr int kParts = int(lowrank::detail::kLanes) / kN;
#define GRADCOMP_LOADN(p) (*reinterpret_cast<const VNu*>(p))
#define GRADCOMP_STOREN(p, v) (*reinterpret_cast<VNu*>(p) = (v))

//! project's register blocking: R rows of M by K ranks of Qt per pass (R * K * kParts
//! accumulators, R + 1 more VNs), kLow up to rank kSplitRank, kHigh above. Measured (Zen 4, 4096 x
//! 4096 and 1024 x 25088): more rows keep more streams of M in flight and share each Qt load, which
//! matters most at low rank; more ranks per pass read the rows' chunk fewer times.
struct Blocking {
  int R, K;
};
constexpr int64_t kSplitRank = 8;
#if defined(__AVX512F__)
constexpr Blocking kLow{8, 2}, kHigh{4, 4};  // 16 accumulators + 8 rows (+ 1) of 32 zmm
#elif defined(__AVX2__)
constexpr Blocking kLow{4, 1}, kHigh{4, 1};  // 8 accumulators + 4 rows (+ 1) of 16 ymm
#else
constexpr Blocking kLow{4, 1}, kHigh{4, 1};  // 16 accumulators of 16 xmm (some rows reloaded)
#endif
constexpr int kAxpyRows = 8;  // back_project: 8 rows of M in registers (VNs), then one accumulator
static_assert(kLow.R <= lowrank::detail::kProjectRows && kHigh.R <= lowrank::detail::kProjectRows);

//! acc_r[k] (16 lanes at acc + (r * lda + k) * 16) += M_r[j] * Qt[k][j] lane by lane (lane j mod
//! 16) for j in [0, n) (n a multiple of 16), r < R (M_r = m + r * ldm), k < K; Qt[k][j] at
//! qt + (j / 16 * ld + k) * 16 + j % 16 (the 16-column groups of Qt, each [rank][16]).
template <int R, int K>
void dot_rows(const float* __restrict m, int64_t ldm, const float* __restrict qt, int64_t ld, int64_t n,
              float* __restrict acc, int64_t lda) {
  VN a[R][K][kParts];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k)
      for (int h = 0; h < kParts; ++h) a[r][k][h] = GRADCOMP_LOADN(acc + (r * lda + k) * 16 + h * kN);
  for (int64_t j = 0; j < n; j += 16, qt += ld * 16)
    for (int h = 0; h < kParts; ++h) {
      VN x[R];
      for (int r = 0; r < R; ++r) x[r] = GRADCOMP_LOADN(m + r * ldm + j + h * kN);
      for (int k = 0; k < K; ++k) {
        const VN q = GRADCOMP_LOADN(qt + k * 16 + h * kN);
        for (int r = 0; r < R; ++r) a[r][k][h] += x[r] * q;
      }
    }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k)
      for (int h = 0; h < kParts; ++h) GRADCOMP_STOREN(acc + (r * lda + k) * 16 + h * kN, a[r][k][h]);
}
//! dot_rows<nr, g> for 1 <= nr <= R, 1 <= g <= K.
template <int R, int K, int r = 1, int k = 1>
void dot_block(int nr, int g, const float* m, int64_t ldm, const float* qt, int64_t ld, int64_t n, float* acc,
               int64_t lda) {
  if constexpr (r < R) {
    if (nr != r) return dot_block<R, K, r + 1, k>(nr, g, m, ldm, qt, ld, n, acc, lda);
  }
  if constexpr (k < K) {
    if (g != k) return dot_block<R, K, r, k + 1>(nr, g, m, ldm, qt, ld, n, acc, lda);
  }
  dot_rows<r, k>(m, ldm, qt, ld, n, acc, lda);
}

//! The 16 lanes of a[0, 16) summed in a fixed order: lanes 8 apart, then 4, 2, 1.
inline float lane_sum(const float* a) {
  float t[16];
  std::memcpy(t, a, sizeof t);
  for (int h = 8; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) t[l] = t[l] + t[l + h];
  return t[0];
}

//! project's rows [r0, r1) of one matrix with blocking B (see lowrank_project_rows).
template <Blocking B>
void project_rows(const float* M, const float* Q, float* P, int64_t cols, int64_t rank, int64_t r0, int64_t r1,
                  float* scratch) {
  using lowrank::detail::kLanes;
  const int64_t C = lowrank::detail::project_chunk(rank), n16 = cols / kLanes * kLanes;
  // Qt by groups of 16 columns: Qt[k][j] (j < n16) at qt + (j / 16 * rank + k) * 16 + j % 16
  float* qt = scratch;
  float* acc = scratch + n16 * rank;  // [B.R][rank][16], 64-byte aligned
  for (int64_t j = 0; j < n16; ++j)
    for (int64_t k = 0; k < rank; ++k) qt[(j / kLanes * rank + k) * kLanes + j % kLanes] = Q[j * rank + k];
  for (int64_t i0 = r0; i0 < r1; i0 += B.R) {
    const int nb = int(std::min<int64_t>(B.R, r1 - i0));
    std::fill(acc, acc + nb * rank * kLanes, 0.0f);
    for (int64_t j0 = 0; j0 < n16; j0 += C) {
      const int64_t w = std::min(C, n16 - j0);
      for (int64_t kg = 0; kg < rank; kg += B.K)
        dot_block<B.R, B.K>(nb, int(std::min<int64_t>(B.K, rank - kg)), M + i0 * cols + j0, cols,
                            qt + (j0 * rank + kg * kLanes), rank, w, acc + kg * kLanes, rank);
    }
    for (int r = 0; r < nb; ++r) {
      const float* row = M + (i0 + r) * cols;
      float* a = acc + r * rank * kLanes;
      for (int64_t j = n16; j < cols; ++j)  // the last cols % 16 columns: lanes 0.. of the same sums
        for (int64_t k = 0; k < rank; ++k) a[k * kLanes + (j - n16)] += row[j] * Q[j * rank + k];
      for (int64_t k = 0; k < rank; ++k) P[(i0 + r) * rank + k] = lane_sum(a + k * kLanes);
    }
  }
}

//! qt[k * ld + j] = qt[k * ld + j] + M_0[j] p_0[k] + M_1[j] p_1[k] + ... (left to right; rows
//! r < R: M_r = m + r * ldm, p_r = p + r * rank) for j in [0, n), k < rank.
template <int R>
void axpy_rows(float* __restrict qt, int64_t ld, const float* __restrict m, int64_t ldm, const float* __restrict p,
               int64_t rank, int64_t n) {
  int64_t j = 0;
  for (; j + kN <= n; j += kN) {
    VN x[R];
    for (int r = 0; r < R; ++r) x[r] = GRADCOMP_LOADN(m + r * ldm + j);
    for (int64_t k = 0; k < rank; ++k) {
      float* q = qt + k * ld + j;
      VN a = GRADCOMP_LOADN(q);
      for (int r = 0; r < R; ++r) a += x[r] * p[r * rank + k];
      GRADCOMP_STOREN(q, a);
    }
  }
  for (; j < n; ++j)
    for (int64_t k = 0; k < rank; ++k) {
      float a = qt[k * ld + j];
      for (int r = 0; r < R; ++r) a = a + m[r * ldm + j] * p[r * rank + k];
      qt[k * ld + j] = a;
    }
}
template <int R = 1>
void axpy_group(int nr, float* qt, int64_t ld, const float* m, int64_t ldm, const float* p, int64_t rank, int64_t n) {
  if constexpr (R < kAxpyRows) {
    if (nr != R) return axpy_group<R + 1>(nr, qt, ld, m, ldm, p, rank, n);
  }
  axpy_rows<R>(qt, ld, m, ldm, p, rank, n);
}

} // namespace

//! project's rows [r0, r1) of matrix b: P[i][k] = sum_j M[i][j] Q[j][k] as 16 partial sums, lane
//! l over j = l, l + 16, ... ascending (binary32, each partial fl(s + fl(M[i][j] Q[j][k])) from +0),
//! then lane_sum. A row's result depends on nothing but the row and Q: not on r0, r1, the thread
//! count or the variant. M is read once: Q is transposed into `scratch` (project_scratch floats,
//! 64-byte aligned) by groups of 16 columns; each pass takes B.R rows of M (kLow up to rank
//! kSplitRank, else kHigh) over a chunk of project_chunk columns for B.K ranks at a time.
void lowrank_project_rows(const lowrank::detail::GemmJob& J, int64_t b, int64_t r0, int64_t r1, float* scratch) {
  const float* M = J.base + J.offsets[b];
  const float* Q = J.in + b * J.cols * J.rank;
  float* P = J.out + b * J.rows * J.rank;
  if (J.rank <= kSplitRank) project_rows<kLow>(M, Q, P, J.cols, J.rank, r0, r1, scratch);
  else project_rows<kHigh>(M, Q, P, J.cols, J.rank, r0, r1, scratch);
}

//! back_project's columns [c0, c1) of matrix b: Q[j][k] = fl(...fl(fl(+0 + fl(M[0][j] P[0][k])) +
//! fl(M[1][j] P[1][k])) ... + fl(M[rows-1][j] P[rows-1][k])) (rows ascending, binary32), whatever c0,
//! c1, the thread count or the variant. Blocks of back_project_block columns: Qt [rank][block] in
//! `scratch` (back_project_scratch floats) accumulates kAxpyRows rows of M at a time (held in
//! registers), then is written to Q transposed.
void lowrank_back_project_cols(const lowrank::detail::GemmJob& J, int64_t b, int64_t c0, int64_t c1,
                               float* scratch) {
  using lowrank::detail::kLanes;
  const int64_t rows = J.rows, cols = J.cols, rank = J.rank;
  const float* M = J.base + J.offsets[b];
  const float* P = J.in + b * rows * rank;
  float* Q = J.out + b * cols * rank;
  const int64_t block = lowrank::detail::back_project_block(rank);
  for (int64_t jb = c0; jb < c1; jb += block) {
    const int64_t w = std::min(block, c1 - jb);
    const int64_t ld = (w + kLanes - 1) / kLanes * kLanes + kLanes;  // + one line: Qt's rows apart in L1's sets
    float* qt = scratch;
    std::fill(qt, qt + rank * ld, 0.0f);
    for (int64_t i0 = 0; i0 < rows; i0 += kAxpyRows)
      axpy_group(int(std::min<int64_t>(kAxpyRows, rows - i0)), qt, ld, M + i0 * cols + jb, cols, P + i0 * rank, rank, w);
    for (int64_t j = 0; j < w; ++j)
      for (int64_t k = 0; k < rank; ++k) Q[(jb + j) * rank + k] = qt[k * ld + j];
  }
}

#undef GRADCOMP_LOADN
#undef GRADCOMP_STOREN

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

#if GRADCOMP_HAVE_BLAS
#include <cblas.h>
#endif
#include <omp.h>

#include <climits>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "../common/philox.hpp"
#include "../core/family.hpp"
#include "../core/lowrank_backend.hpp"
#include "gradcomp/packet.hpp"

namespace gradcomp::detail::cpu {
#if !defined(GRADCOMP_CPU_SINGLE_VARIANT)
#define GRADCOMP_LOWRANK_VARIANT_DECLS                                                            \
  uint32_t lowrank_reconstruct_units(const lowrank::detail::ReconstructJob&, int64_t, int64_t);   \
  void lowrank_project_rows(const lowrank::detail::GemmJob&, int64_t, int64_t, int64_t, float*);  \
  void lowrank_back_project_cols(const lowrank::detail::GemmJob&, int64_t, int64_t, int64_t, float*);
namespace avx512 {
GRADCOMP_LOWRANK_VARIANT_DECLS
}
namespace avx2 {
GRADCOMP_LOWRANK_VARIANT_DECLS
}
#undef GRADCOMP_LOWRANK_VARIANT_DECLS
#endif
namespace {
using ReconstructUnits = uint32_t (*)(const lowrank::detail::ReconstructJob&, int64_t, int64_t);
using GemmUnit = void (*)(const lowrank::detail::GemmJob&, int64_t, int64_t, int64_t, float*);
//! The variant's loops that run now (cpu_isa(): the best this processor supports, or the one asked for).
struct LowrankLoops {
  ReconstructUnits reconstruct;
  GemmUnit project, back_project;
};
LowrankLoops lowrank_loops() {
#if defined(GRADCOMP_CPU_SINGLE_VARIANT)
  namespace v = GRADCOMP_CPU_ISA;
  return {&v::lowrank_reconstruct_units, &v::lowrank_project_rows, &v::lowrank_back_project_cols};
#else
  switch (cpu_isa()) {
    case CpuIsa::avx512:
      return {&avx512::lowrank_reconstruct_units, &avx512::lowrank_project_rows, &avx512::lowrank_back_project_cols};
    case CpuIsa::avx2:
      return {&avx2::lowrank_reconstruct_units, &avx2::lowrank_project_rows, &avx2::lowrank_back_project_cols};
    default:
      return {&generic::lowrank_reconstruct_units, &generic::lowrank_project_rows, &generic::lowrank_back_project_cols};
  }
#endif
}
ReconstructUnits reconstruct_units() { return lowrank_loops().reconstruct; }
} // namespace
} // namespace gradcomp::detail::cpu

namespace gradcomp::lowrank::detail {
namespace {

using gradcomp::detail::cpu_threads_for;
using gradcomp::detail::concat;
using gradcomp::detail::cpu::partition;
using gradcomp::detail::cpu::TeamClock;

void check_blas_dims(const MatrixBatch& m, const char* call) {
  constexpr int64_t kInt = INT_MAX;
  if (m.rows > kInt || m.cols > kInt)
    throw Unsupported(concat(call, ": matrices of shape [", m.rows, ", ", m.cols,
                             "]: the CPU backend (32-bit int sizes, OpenBLAS's) takes rows and cols up to 2^31 - 1"));
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

//! A thread's scratch of at least n floats, 64-byte aligned (kept between calls, grown as needed).
float* thread_scratch(int64_t n) {
  thread_local std::unique_ptr<float[]> buf;
  thread_local int64_t cap = 0;
  if (cap < n) {
    buf.reset();
    buf.reset(new float[size_t(n + 16)]);
    cap = n;
  }
  const uintptr_t a = reinterpret_cast<uintptr_t>(buf.get());
  return buf.get() + ((64 - a % 64) % 64) / sizeof(float);
}

//! Whether gradcomp's own loops serve `rank` (every rank without BLAS; 2..16 with it).
bool own_loops(int64_t rank) { return !GRADCOMP_HAVE_BLAS || (rank >= kSmallRankMin && rank <= kSmallRankMax); }

} // namespace

void cpu_project(const MatrixBatch& m, const Tensor& q, const Tensor& p, int64_t rank) {
  check_blas_dims(m, "lowrank::project");
  const float* base = m.base.ptr<const float>();
  const float* Q = q.ptr<const float>();
  float* P = p.ptr<float>();
  if (own_loops(rank)) {
    const int T = cpu_threads_for(m.count * m.rows * m.cols);
    const int64_t S = slices_per_matrix(m.count, T, m.rows);
    const GemmJob job{base, m.offsets, Q, P, m.rows, m.cols, rank};
    const auto unit = gradcomp::detail::cpu::lowrank_loops().project;
    const int64_t need = project_scratch(m.cols, rank);
    run_units(m.count * S, T, [&](int64_t u) {
      const int64_t b = u / S, s = u % S;
      int64_t r0 = 0, r1 = 0;
      partition(m.rows, int(S), int(s), r0, r1);
      if (r1 > r0) unit(job, b, r0, r1, thread_scratch(need));
    });
    return;
  }
#if GRADCOMP_HAVE_BLAS
  // OpenBLAS at ranks 1 and > 16: one call per matrix from the calling thread, outside any team of
  // gradcomp's, on OpenBLAS's own threads (its setting, never changed here: see Threads at the top)
  for (int64_t b = 0; b < m.count; ++b) {
    // P_b (rows x rank) = M_b (rows x cols, row-major, ld cols) Q_b (cols x rank, ld rank)
    if (rank == 1) {  // matrix-vector (OpenBLAS's GEMM packs its operands: slower for one column)
      cblas_sgemv(CblasRowMajor, CblasNoTrans, int(m.rows), int(m.cols), 1.0f, base + m.offsets[b], int(m.cols),
                  Q + b * m.cols, 1, 0.0f, P + b * m.rows, 1);
      continue;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(m.rows), int(rank), int(m.cols), 1.0f,
                base + m.offsets[b], int(m.cols), Q + b * m.cols * rank, int(rank), 0.0f, P + b * m.rows * rank,
                int(rank));
  }
#endif
}

void cpu_back_project(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank) {
  check_blas_dims(m, "lowrank::back_project");
  const float* base = m.base.ptr<const float>();
  const float* P = p.ptr<const float>();
  float* Q = q.ptr<float>();
  if (own_loops(rank)) {
    // slices of whole 16-column groups (a slice's bits do not depend on its bounds; aligned
    // groups only keep the vector loop full)
    const int T = cpu_threads_for(m.count * m.rows * m.cols);
    const int64_t groups = (m.cols + kLanes - 1) / kLanes;
    const int64_t S = slices_per_matrix(m.count, T, groups);
    const GemmJob job{base, m.offsets, P, Q, m.rows, m.cols, rank};
    const auto unit = gradcomp::detail::cpu::lowrank_loops().back_project;
    const int64_t need = back_project_scratch((groups + S - 1) / S * kLanes, rank);
    run_units(m.count * S, T, [&](int64_t u) {
      const int64_t b = u / S, s = u % S;
      int64_t g0 = 0, g1 = 0;
      partition(groups, int(S), int(s), g0, g1);
      const int64_t c0 = g0 * kLanes, c1 = std::min(m.cols, g1 * kLanes);
      if (c1 > c0) unit(job, b, c0, c1, thread_scratch(need));
    });
    return;
  }
#if GRADCOMP_HAVE_BLAS
  for (int64_t b = 0; b < m.count; ++b) {  // as in cpu_project: the calling thread, OpenBLAS's threads
    // Q_b (cols x rank) = M_b^T (M_b: rows x cols, ld cols) P_b (rows x rank)
    if (rank == 1) {
      cblas_sgemv(CblasRowMajor, CblasTrans, int(m.rows), int(m.cols), 1.0f, base + m.offsets[b], int(m.cols),
                  P + b * m.rows, 1, 0.0f, Q + b * m.cols, 1);
      continue;
    }
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(m.cols), int(rank), int(m.rows), 1.0f,
                base + m.offsets[b], int(m.cols), P + b * m.rows * rank, int(rank), 0.0f, Q + b * m.cols * rank,
                int(rank));
  }
#endif
}

namespace {

//! random_normal's element e (lowrank.hpp): Philox4x64-10 of counter {e, stream, 0, 0} and key
//! {seed, kLowrankPhiloxKey1} (kernels/common/philox.hpp), Box-Muller on the first two words in binary64:
//!   u1 = ((x0 >> 11) + 1) * 2^-53 in (0, 1],  u2 = (x1 >> 11) * 2^-53 in [0, 1)
//!   value = float(sqrt(-2.0 * log(u1)) * cos(kTwoPi * u2)),  kTwoPi = binary64(2 pi)
//! (glibc's log and cos; the products in binary64, rounded once to binary32).
inline float normal_at(uint64_t e, uint64_t seed, uint64_t stream_id) {
  const philox::Ctr4x64 r = philox::philox4x64_10({e, stream_id, 0, 0}, {seed, kLowrankPhiloxKey1});
  constexpr double kInv53 = 1.0 / 9007199254740992.0;  // 2^-53
  constexpr double kTwoPi = 6.283185307179586;         // binary64(2 pi) = 2 * binary64(pi)
  const double u1 = double((r[0] >> 11) + 1) * kInv53;
  const double u2 = double(r[1] >> 11) * kInv53;
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
