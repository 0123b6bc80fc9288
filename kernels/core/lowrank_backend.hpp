// SPDX-License-Identifier: Apache-2.0
// The interface between kernels/core/lowrank.cpp (argument validation, dispatch) and the low-rank
// backends: kernels/cpu/lowrank.cpp defines the cpu_* functions, kernels/cuda/lowrank.cu the cuda_*
// ones (CUDA builds only; a CPU-only build references no cuda_* symbol). The public contract is
// include/gradcomp/lowrank.hpp (PowerSGD, Vogels et al., NeurIPS 2019, algorithm 1).
//
// Every argument reaching a backend has been validated by the core:
//  - every tensor is on one device (the CPU for cpu_*, one CUDA device for cuda_*), non-null
//    when it has elements, aligned to its element size;
//  - m.base, q, p, x, residual: float32; out: float32, float16 or bfloat16;
//  - 1 <= rank <= min(rows, cols) (orthogonalize: 1 <= rank <= rows), count >= 1, rows, cols >= 1
//    (a call with count == 0 never reaches a backend);
//  - m.offsets: a host array of m.count offsets, each >= 0 with offset + rows * cols <= m.base.numel
//    (reconstruct: <= out.numel, and <= the residual's numel when given); the matrices may come in
//    any order and with gaps, and do not overlap;
//  - q holds exactly count * cols * rank elements and p exactly count * rows * rank ([count, cols,
//    rank] / [count, rows, rank], rank fastest); x exactly count * rows * rank.
//  - reconstruct: m.base is `out` (the core sets it; backends write `out`, never read m.base);
//    `residual` (float32, out's device, the same offsets) and `status` (one uint32 in the
//    tensors' memory) may be null.
// Sizes are int64 elements. The backends throw only CudaError (a failed CUDA / cuBLAS call) or
// Unsupported (a size the backend cannot serve, e.g. a GEMM dimension above cuBLAS's int range).
//
// Numerics every backend follows (lowrank.hpp): project / back_project are GEMMs (the order of sums
// is the BLAS's); reconstruct is the fixed k-order expression with common::mul_rn / add_rn / sub_rn
// (kernels/common/math.hpp: no FMA, one NaN rule, so the CPU and CUDA write the same bits, NaN
// included) and the common element tags for float16 / bfloat16 (round to nearest even);
// random_normal uses kLowrankPhiloxKey1 as the second Philox key word.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "gradcomp/lowrank.hpp"

namespace gradcomp::lowrank {

//! State of a Resources object (defined here so that a CPU-only build has no CUDA symbol). The
//! CPU keeps none. The CUDA backend owns the contents of `devices`: it creates an entry's state on
//! the first call for that device (under `mutex`), sets `release` to its function that frees one
//! entry (cublasDestroy, cudaFree of the scratch, whatever it keeps in `extra`), and ~Impl calls
//! `release` on every entry that holds anything.
struct Resources::Impl {
  //! Per CUDA device ordinal. All pointers opaque here (cublasHandle_t, device / pinned memory).
  struct DeviceState {
    void* handle = nullptr;       //!< cublasHandle_t, created on first use
    void* scratch = nullptr;      //!< device memory (e.g. batched-GEMM pointer arrays, offsets)
    int64_t scratch_bytes = 0;
    void* host_scratch = nullptr; //!< pinned host memory (staging for async H2D copies), if any
    int64_t host_scratch_bytes = 0;
    void* extra = nullptr;        //!< anything else the CUDA side keeps (events, ...)
  };
  std::mutex mutex;                 //!< guards `devices` and their contents
  std::vector<DeviceState> devices; //!< indexed by device ordinal; grown by the CUDA side
  void (*release)(DeviceState&) noexcept = nullptr;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (release == nullptr) return;
    for (DeviceState& d : devices)
      if (d.handle != nullptr || d.scratch != nullptr || d.host_scratch != nullptr || d.extra != nullptr) release(d);
  }
};

namespace detail {

//! The second key word of random_normal's Philox4x64-10 (lowrank.hpp): key = {seed, this}.
inline constexpr uint64_t kLowrankPhiloxKey1 = 0x9E3779B97F4A7C15ull;

// ---- CPU (kernels/cpu/lowrank.cpp): OpenMP on gradcomp's thread count (+ OpenBLAS: GRADCOMP_BLAS)
void cpu_project(const MatrixBatch& m, const Tensor& q, const Tensor& p, int64_t rank);
void cpu_back_project(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank);
void cpu_orthogonalize(const Tensor& x, int64_t count, int64_t rows, int64_t rank, float epsilon,
                       const Redraw* redraw);
void cpu_reconstruct(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, const Tensor& out,
                     float* residual, uint32_t* status);
void cpu_random_normal(const Tensor& x, uint64_t seed, uint64_t stream_id);

// ---- CUDA (kernels/cuda/lowrank.cu): cuBLAS + gradcomp kernels on `stream`, no host sync -------
// The tensors' device is m.base.device / x.device (DeviceKind::cuda); `res` is the caller's
// Resources (its mutex not held on entry).
void cuda_project(const MatrixBatch& m, const Tensor& q, const Tensor& p, int64_t rank, Stream stream,
                  Resources::Impl& res);
void cuda_back_project(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, Stream stream,
                       Resources::Impl& res);
void cuda_orthogonalize(const Tensor& x, int64_t count, int64_t rows, int64_t rank, float epsilon,
                        const Redraw* redraw, Stream stream, Resources::Impl& res);
void cuda_reconstruct(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, const Tensor& out,
                      float* residual, uint32_t* status, Stream stream, Resources::Impl& res);
void cuda_random_normal(const Tensor& x, uint64_t seed, uint64_t stream_id, Stream stream, Resources::Impl& res);

} // namespace detail
} // namespace gradcomp::lowrank
