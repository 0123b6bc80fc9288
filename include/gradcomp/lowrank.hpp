// SPDX-License-Identifier: Apache-2.0
//! @file lowrank.hpp
//! The steps of PowerSGD low-rank compression (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical
//! Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019, algorithm 1: one step
//! of subspace iteration with a warm-started Q), batched over matrices of the same shape. Low rank
//! is not a Codec (docs/contracts.md section 3): it is a two-round protocol (allreduce P, then Q), so the
//! caller (gradcomp.torch's PowerSGD hook) runs the collectives between these steps:
//!
//!   M  = g + e                       (the caller; e the float32 residual, held in M's buffer)
//!   P  = M Q                         project()
//!   allreduce(P) (sum)               the caller
//!   P  = orthonormal columns of P    orthogonalize()
//!   Q  = M^T P                       back_project()
//!   allreduce(Q), Q /= W             the caller
//!   out = P Q^T, e = M - P Q^T       reconstruct() (one pass over M; the residual update fused)
//!
//! Matrices. A MatrixBatch is `count` row-major float32 matrices of shape [rows, cols], matrix b
//! starting at element `offsets[b]` of one flat buffer `base` (a bucket, its residual, a scratch
//! copy); the matrices must not overlap. P is one contiguous float32 tensor [count, rows, rank] and
//! Q one [count, cols, rank] (rank fastest: PyTorch's [b, n, r] / [b, m, r] views). All sizes are
//! elements; offsets are int64 on the host. Everything runs on the device of the tensors (CPU:
//! gradcomp's loops on OpenMP, and OpenBLAS at ranks 1 and > 16 where the build has it, see
//! build_info().blas; CUDA: cuBLAS and gradcomp kernels, on `stream`, never synchronizing the
//! host), and all tensors of one call must be on the same device.
//!
//! Floating point. project() and back_project() are BLAS GEMMs (float32 in and out; the order of
//! their sums is the library's). reconstruct() is a fixed expression, in binary32 round to nearest
//! without FMA contraction, so every rank holding the same P and Q writes the same bits, on the
//! CPU and on CUDA alike:
//!   T[i][j] = fl(...fl(fl(P[i][0] * Q[j][0]) + fl(P[i][1] * Q[j][1])) + ... + fl(P[i][r-1] * Q[j][r-1]))
//!   out[i][j] = T[i][j] rounded to out's dtype;  with a residual: e[i][j] = fl(e[i][j] - T[i][j]).
//! orthogonalize() is Gram-Schmidt with float64 accumulation (below); the same input gives the same
//! bits on every rank of one backend.
//!
//! Errors: InvalidArgument (naming the value and what is accepted) for a dtype other than those
//! stated, sizes that do not match, rank outside [1, min(rows, cols)], a matrix reaching past the
//! end of its buffer, tensors on different devices; Unsupported for a CUDA tensor in a CPU-only
//! build; CudaError for a failed CUDA or cuBLAS call.
#pragma once

#include <cstdint>
#include <memory>

#include "gradcomp/error.hpp"
#include "gradcomp/types.hpp"

namespace gradcomp::lowrank {

//! `count` row-major [rows, cols] float32 matrices at element offsets `offsets[0..count)` of the
//! flat float32 tensor `base` (offsets: a host array; each offset + rows * cols <= base.numel).
struct MatrixBatch {
  Tensor base;
  const int64_t* offsets = nullptr;
  int64_t count = 0;
  int64_t rows = 0;
  int64_t cols = 0;
};

//! What orthogonalize() draws into a column that is exactly zero after projection, instead of
//! leaving it zero (used for Q at warm start, so that a layer whose gradient was once zero does
//! not keep a zero Q forever): random_normal() values of (seed, stream) at the column's flat
//! indices of X, then projected and normalized like any other column.
struct Redraw {
  uint64_t seed = 0;
  uint64_t stream = 0;
};

//! Owns the per-device library state: the cuBLAS handle of each CUDA device (created on first
//! use, bound to the caller's stream at each call) and scratch memory for batched GEMM pointer
//! arrays. Thread-safe. The CPU needs none; default_resources() serves every call that passes none.
class Resources {
 public:
  Resources();
  ~Resources();
  Resources(const Resources&) = delete;
  Resources& operator=(const Resources&) = delete;
  struct Impl;
  Impl& impl() noexcept { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};
//! The process-wide Resources.
Resources& default_resources();

//! P[b] = M_b Q[b].  q: float32 [count, cols, rank]; p: float32 [count, rows, rank] (written).
void project(const MatrixBatch& m, const Tensor& q, const Tensor& p, int64_t rank, Stream stream = {},
             Resources& res = default_resources());

//! Q[b] = M_b^T P[b].  p: float32 [count, rows, rank]; q: float32 [count, cols, rank] (written).
void back_project(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, Stream stream = {},
                  Resources& res = default_resources());

//! Orthonormalize the columns of each X[b] of x (float32 [count, rows, rank], 1 <= rank <= rows) in
//! place: column k minus its projections on columns 0..k-1 (subtracted twice, "twice is enough",
//! sums in float64), then divided by fl(norm + epsilon) (PyTorch's _orthogonalize_gram_schmidt
//! rule; epsilon >= 0). A column whose norm after projection is exactly zero stays zero whatever
//! epsilon (PyTorch gives NaN at epsilon 0), unless `redraw` is given (see Redraw). NaN or inf in a
//! matrix makes that matrix's output non-finite (never hidden as zero).
void orthogonalize(const Tensor& x, int64_t count, int64_t rows, int64_t rank, float epsilon,
                   const Redraw* redraw = nullptr, Stream stream = {}, Resources& res = default_resources());

//! out_b = P[b] Q[b]^T (the fixed expression above) written at offsets[b] of `out` (float32,
//! float16 or bfloat16, flat; the matrices of `m` give the offsets and shape, m.base is not
//! read); when `residual` is not null (float32 flat, the same offsets; it holds M = g + e), also
//! e = fl(M - T) in the same pass. `status`: a uint32 in the tensors' memory (device memory for
//! CUDA), or null; bit 0 is ORed in when any value written to `out` is non-finite (after rounding
//! to its dtype), so the caller learns of a non-finite step without reading `out`.
void reconstruct(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, const Tensor& out,
                 float* residual, uint32_t* status, Stream stream = {}, Resources& res = default_resources());

//! Fill `x` (float32, flat) with standard normal values: element e is
//!   (x0, x1, x2, x3) = Philox4x64-10(counter = {e, stream, 0, 0}, key = {seed, 0x9E3779B97F4A7C15})
//!   u1 = ((x0 >> 11) + 1) * 2^-53,  u2 = (x1 >> 11) * 2^-53
//!   x[e] = float(sqrt(-2 log u1) * cos(2 pi u2))   (binary64, rounded once to binary32)
//! (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011; Box & Muller 1958), so
//! every rank with the same (seed, stream) draws the same Q without communicating.
void random_normal(const Tensor& x, uint64_t seed, uint64_t stream_id, Stream stream = {},
                   Resources& res = default_resources());

} // namespace gradcomp::lowrank
