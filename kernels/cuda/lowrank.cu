// SPDX-License-Identifier: Apache-2.0
// CUDA backend of low-rank (PowerSGD) compression: the cuda_* entry points of
// kernels/core/lowrank_backend.hpp (validated arguments; contract include/gradcomp/lowrank.hpp;
// Vogels, Karimireddy & Jaggi, NeurIPS 2019, algorithm 1). Everything is enqueued on the caller's
// stream; nothing allocates device memory per call, synchronizes the host or reads device memory.
//
// project / back_project: cuBLAS SGEMM. Row-major matrices are column-major transposes, so with
// M_b row-major [rows, cols] (column-major M_b^T, ld cols), Q_b [cols, rank] (column-major
// Q_b^T [rank, cols], ld rank) and P_b [rows, rank] (P_b^T [rank, rows], ld rank):
//   project       P_b^T = Q_b^T M_b^T    gemm(N, N, m = rank, n = rows, k = cols, A = Q_b, B = M_b)
//   back_project  Q_b^T = P_b^T M_b      gemm(N, T, m = rank, n = cols, k = rows, A = P_b, B = M_b)
// Batching: the offsets are cut greedily into maximal runs in which consecutive offsets grow by one
// constant stride (an arithmetic progression; P and Q are always contiguous), and each run is one
// cublasSgemmStridedBatched_64 (a single matrix is a run of one). Offsets in ascending steps of one
// stride, the usual layout of same-shape parameters in a bucket, take one call; arbitrary offsets
// take up to `count` calls. No pointer array is ever built, so there is no device scratch and no
// host buffer that must outlive an asynchronous copy. The 64-bit API takes any dimension.
//
// The cuBLAS handle: one per device in Resources::Impl::devices (created on first use under
// Impl::mutex on that device; cublasSetMathMode(CUBLAS_PEDANTIC_MATH), pointer mode host). The
// mutex is held from cublasSetStream to the last GEMM enqueued, because the stream is handle state
// shared by every thread (the cuBLAS guide: changing a shared handle's configuration affects all
// its users). cuBLAS's default workspace pool is used (cublasSetStream resets to it each call).
// Math mode: PEDANTIC pins the SGEMMs to standard binary32 arithmetic (CUBLAS_COMPUTE_32F_PEDANTIC):
// no TF32, no BF16x9 emulation, whatever the process environment (NVIDIA_TF32_OVERRIDE,
// CUBLAS_EMULATE_SINGLE_PRECISION / CUBLAS_EMULATION_STRATEGY) or a future default says;
// CUBLAS_DEFAULT_MATH already excludes TF32 today but promises only "at least" binary32
// precision. These GEMMs are bound by memory (rank <= 32 typical), where the pedantic kernels are
// not expected to cost anything (not measured yet).
// Lifetime: ~Resources::Impl calls release_device() per device: cublasDestroy on that device.
// During process exit (an atexit hook registered when the first handle is created, so it runs
// before the CUDA runtime's own teardown and before destructors of statics created earlier) the
// handles are deliberately leaked: the static CUDA runtime may already be gone when a static
// Resources is destroyed (default_resources() is never destroyed at all).
//
// orthogonalize: one block of kOrthoThreads threads per matrix (grid-stride over the matrices),
// exactly the CPU's classical Gram-Schmidt with two passes in binary64 (kernels/cpu/lowrank.cpp:
// orthogonalize_one), except that the sums are block reductions (fixed tree: per-warp shuffle-down
// 16, 8, 4, 2, 1, then the warps in index order), so the bits are those of this backend (the same
// on every run and rank), not the CPU's. The binary64 working column w is never stored: element
// i of w after 0, 1 or 2 passes is recomputed from the float32 row i of X (column k still holds
// its input; columns j < k hold the float32 outputs q_j, which are what the CPU's widened copy
// holds) and the projection coefficients d1[j], d2[j] (binary64, shared memory), in the CPU's
// order: w = double(X[i][k]); for pass: for j < k: w = w - d[j] * q_j[i]. Sweeps per column k:
// ceil(k / kGroup) per pass for the coefficients (kGroup binary64 accumulators per thread), one for
// s = sum w^2, one to write q_k = float(w / (sqrt(s) + eps)) (binary64 division, rounded once);
// s == 0 -> zero column (with a redraw: the column is first overwritten with random_normal values
// at its flat indices, exactly the floats the CPU widens, and projected again); s not finite ->
// the canonical quiet NaN. A matrix of rows x (rank | 1) floats that fits kOrthoSmemBytes with
// the coefficients is staged in shared memory (rows padded to an odd stride: no bank conflicts).
// Coefficients need 16 * rank bytes of shared memory: rank > kOrthoMaxRank raises Unsupported.
//
// reconstruct: one launch per kMaxMatrices matrices: grid (column tiles, row tiles, matrices), the
// offsets in a __grid_constant__ by-value kernel parameter (read in place, never copied to local
// memory). Tile kRecRows x kRecCols with 32 x 8 threads, each thread 4 rows x 2 columns (j and
// j + 32: lanes write consecutive columns, coalesced); P and Q tiles of kRecK ranks at a time in
// shared memory (rows padded to 33 words). T is the header's fixed expression with common::mul_rn
// / add_rn in k order (no FMA; the same NaN rule as the CPU), computed as plain binary32 roundings
// (common::mul_raw / add_raw) and redone with the rule, from P and Q in global memory, only for an
// output whose plain sum is NaN (the rule changes NaN bits only, and NaN propagates: the other
// outputs are the rule's bit for bit); __launch_bounds__(256, 6) keeps it at 40 registers (6 blocks
// per SM) despite the slow path's call. out is rounded with the common element tags (round to
// nearest even; NaN -> the canonical quiet NaN with its sign, the CPU's and the casts' rule:
// bitwise __float2half_rn / __float2bfloat16_rn on every other value); the residual
// e = common::sub_rn(e, T) in the same pass (one read of e). Status bit 0: block-level OR
// (__syncthreads_or), then one atomicOr per block that saw a non-finite stored value.
//
// random_normal: grid-stride over one wave of the kernel (occupancy x SMs, gradcomp::detail::cuda::
// wave_blocks), one Philox4x64-10 block per element (kernels/common/philox.hpp;
// Salmon et al., SC 2011) and the header's Box-Muller in binary64 (CUDA's log and cos, __dsqrt_rn, rounded once
// with __double2float_rn). CUDA's log/cos are not glibc's, so a value may differ from the CPU's in
// its last float bit in rare cases; every CUDA device gives the same bits. The Box-Muller function
// is __noinline__ so that tests/gpu/check_ptx.sh can exempt it, and it alone, from the rule that no
// kernel holds an fma.rn (CUDA's binary64 log and cos are built from FMAs).
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#include "../common/philox.hpp"
#include "../core/lowrank_backend.hpp"
#include "common.cuh"

namespace gradcomp::lowrank::detail {
namespace {

namespace gcuda = ::gradcomp::detail::cuda;
using common::add_rn;
using common::mul_rn;
using common::sub_rn;
using gcuda::DeviceGuard;
using gcuda::to_cuda;
using gradcomp::detail::concat;

// ---- cuBLAS errors and handles --------------------------------------------------------------------

[[noreturn]] void throw_cublas_error(cublasStatus_t s, const char* call, const char* file, int line) {
  throw CudaError(concat("gradcomp cuBLAS error: ", call, " failed with ", cublasGetStatusName(s), " (",
                         cublasGetStatusString(s), ") at ", file, ":", line));
}
#define GRADCOMP_CUBLAS_CHECK(expr)                                                                \
  do {                                                                                             \
    const cublasStatus_t gradcomp_st_ = (expr);                                                    \
    if (gradcomp_st_ != CUBLAS_STATUS_SUCCESS) throw_cublas_error(gradcomp_st_, #expr, __FILE__, __LINE__); \
  } while (0)

//! What DeviceState::extra points to: the device of the entry (release needs it) and the cuBLAS
//! workspace of each stream the handle has run on. One handle serves every stream of its device
//! (under Resources::Impl::mutex); with one shared workspace, GEMMs still running on one stream
//! and GEMMs enqueued on another would use the same scratch memory. So each stream gets its own,
//! set after every cublasSetStream (which resets the handle to the default workspace), as
//! PyTorch's handle pool does.
struct DeviceExtra {
  int device = 0;
  int64_t workspace_bytes = 0;  //!< per stream: cublas_workspace_bytes(device), set with the handle
  std::unordered_map<cudaStream_t, void*> workspaces;
};

//! cuBLAS's advised workspace: 32 MiB on Hopper and newer, 4 MiB before (the cuBLAS documentation,
//! cublasSetWorkspace).
int64_t cublas_workspace_bytes(int device) {
  int major = 0;
  GRADCOMP_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 9 ? (int64_t(32) << 20) : (int64_t(4) << 20);
}

std::atomic<bool> g_exiting{false};
void mark_exiting() noexcept { g_exiting.store(true, std::memory_order_relaxed); }

//! Resources::Impl::release: frees one device's state. Leaks during process exit (see the top).
void release_device(Resources::Impl::DeviceState& d) noexcept {
  auto* extra = static_cast<DeviceExtra*>(d.extra);
  if (!g_exiting.load(std::memory_order_relaxed) && d.handle != nullptr) {
    int prev = -1;
    const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
    const bool switched = extra != nullptr && extra->device != prev && cudaSetDevice(extra->device) == cudaSuccess;
    (void)cublasDestroy(static_cast<cublasHandle_t>(d.handle));
    if (extra != nullptr)
      for (auto& e : extra->workspaces) (void)cudaFree(e.second);
    if (switched && have_prev && gcuda::primary_context_active(prev)) (void)cudaSetDevice(prev);
  }
  if (!g_exiting.load(std::memory_order_relaxed)) delete extra;
  d.handle = nullptr;
  d.extra = nullptr;
}

//! The handle of `device` in `res`, created on first use. The caller holds res.mutex and has made
//! `device` current.
cublasHandle_t device_handle(Resources::Impl& res, int device) {
  if (device < 0) throw CudaError(concat("lowrank: invalid CUDA device ordinal ", device));
  if (res.devices.size() <= size_t(device)) res.devices.resize(size_t(device) + 1);
  res.release = &release_device;
  Resources::Impl::DeviceState& d = res.devices[size_t(device)];
  if (d.handle != nullptr) return static_cast<cublasHandle_t>(d.handle);
  if (d.extra == nullptr) d.extra = new DeviceExtra{device, cublas_workspace_bytes(device), {}};
  static std::once_flag hook;
  std::call_once(hook, [] { std::atexit(&mark_exiting); });
  cublasHandle_t h = nullptr;
  GRADCOMP_CUBLAS_CHECK(cublasCreate(&h));
  d.handle = h;  // released by release_device from here on, also if a setting below fails
  GRADCOMP_CUBLAS_CHECK(cublasSetMathMode(h, CUBLAS_PEDANTIC_MATH));
  GRADCOMP_CUBLAS_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  return h;
}

//! One run of matrices whose offsets grow by a constant stride: [b0, b0 + n), stride `stride`.
struct Run {
  int64_t b0, n, stride;
};
//! The greedy maximal arithmetic runs of offsets[0..count) (strides > 0 only).
template <class F> void for_each_run(const int64_t* off, int64_t count, F&& f) {
  int64_t b = 0;
  while (b < count) {
    int64_t n = 1, stride = 0;
    if (b + 1 < count && off[b + 1] > off[b]) {
      stride = off[b + 1] - off[b];
      n = 2;
      while (b + n < count && off[b + n] - off[b + n - 1] == stride) ++n;
    }
    f(Run{b, n, stride});
    b += n;
  }
}

//! P = M Q (back = false) or Q = M^T P (back = true) for every matrix of m.
void gemms(const MatrixBatch& m, const float* in, float* out, int64_t rank, bool back, Stream stream,
           Resources::Impl& res) {
  const int device = m.base.device.index;
  DeviceGuard guard(device);
  const float* base = m.base.ptr<const float>();
  const float one = 1.0f, zero = 0.0f;
  // in / out per matrix: project reads Q [cols, rank], writes P [rows, rank]; back_project the reverse.
  const int64_t in_stride = (back ? m.rows : m.cols) * rank;
  const int64_t out_stride = (back ? m.cols : m.rows) * rank;
  std::lock_guard<std::mutex> lock(res.mutex);
  cublasHandle_t h = device_handle(res, device);
  const cudaStream_t cs = to_cuda(stream);
  GRADCOMP_CUBLAS_CHECK(cublasSetStream(h, cs));
  {  // this stream's own workspace (DeviceExtra), allocated on its first GEMM
    auto* extra = static_cast<DeviceExtra*>(res.devices[size_t(device)].extra);
    auto it = extra->workspaces.find(cs);
    if (it == extra->workspaces.end()) {
      void* ws = nullptr;
      GRADCOMP_CUDA_CHECK(cudaMalloc(&ws, size_t(extra->workspace_bytes)));
      it = extra->workspaces.emplace(cs, ws).first;
    }
    GRADCOMP_CUBLAS_CHECK(cublasSetWorkspace(h, it->second, size_t(extra->workspace_bytes)));
  }
  for_each_run(m.offsets, m.count, [&](const Run& r) {
    const float* M = base + m.offsets[r.b0];
    const float* A = in + r.b0 * in_stride;
    float* C = out + r.b0 * out_stride;
    if (!back) {
      // P_b^T [rank, rows] = Q_b^T [rank, cols] * M_b^T [cols, rows]
      GRADCOMP_CUBLAS_CHECK(cublasSgemmStridedBatched_64(h, CUBLAS_OP_N, CUBLAS_OP_N, rank, m.rows, m.cols, &one, A,
                                                         rank, in_stride, M, m.cols, r.stride, &zero, C, rank,
                                                         out_stride, r.n));
    } else {
      // Q_b^T [rank, cols] = P_b^T [rank, rows] * (M_b^T)^T, M_b^T column-major [cols, rows]
      GRADCOMP_CUBLAS_CHECK(cublasSgemmStridedBatched_64(h, CUBLAS_OP_N, CUBLAS_OP_T, rank, m.cols, m.rows, &one, A,
                                                         rank, in_stride, M, m.cols, r.stride, &zero, C, rank,
                                                         out_stride, r.n));
    }
  });
}

// ---- random_normal --------------------------------------------------------------------------------

//! random_normal's element e (lowrank.hpp): Philox4x64-10 of counter {e, stream, 0, 0}, key {seed,
//! kLowrankPhiloxKey1}; u1 = ((x0 >> 11) + 1) 2^-53, u2 = (x1 >> 11) 2^-53;
//! float(sqrt(-2 log u1) * cos(kTwoPi * u2)) in binary64 (kTwoPi = binary64(2 pi)), rounded once.
//! __noinline__: the one function whose FMAs (CUDA's log and cos) check_ptx.sh accepts.
__device__ __noinline__ float lowrank_box_muller(uint64_t e, uint64_t seed, uint64_t stream_id) {
  const gradcomp::philox::Ctr4x64 r = gradcomp::philox::philox4x64_10({e, stream_id, 0, 0}, {seed, kLowrankPhiloxKey1});
  constexpr double kInv53 = 1.0 / 9007199254740992.0;  // 2^-53
  constexpr double kTwoPi = 6.283185307179586;         // binary64(2 pi)
  // the integers are below 2^53 + 1: converted exactly
  const double u1 = __dmul_rn(__ull2double_rn((r[0] >> 11) + 1), kInv53);
  const double u2 = __dmul_rn(__ull2double_rn(r[1] >> 11), kInv53);
  return __double2float_rn(__dmul_rn(__dsqrt_rn(__dmul_rn(-2.0, log(u1))), cos(__dmul_rn(kTwoPi, u2))));
}

__global__ void __launch_bounds__(gcuda::plan::kThreads)
    lowrank_normal_kernel(float* __restrict__ x, int64_t n, uint64_t seed, uint64_t stream_id) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += stride)
    x[e] = lowrank_box_muller(uint64_t(e), seed, stream_id);
}

// ---- orthogonalize ------------------------------------------------------------------------------

constexpr int kOrthoThreads = 512;
constexpr int kOrthoWarps = kOrthoThreads / 32;
constexpr int kGroup = 16;                       //!< coefficient accumulators per thread and sweep
constexpr int64_t kOrthoSmemBytes = 96 * 1024;   //!< dynamic shared memory at most (staged X + coefficients)
constexpr int64_t kOrthoMaxRank = 2048;          //!< coefficients: 16 * rank bytes of shared memory

struct OrthoArgs {
  float* x;
  int64_t count, rows, rank;
  int64_t lds;          //!< row stride of the staged copy (staged kernel only)
  double eps;
  int redraw;
  uint64_t seed, stream_id;
};

//! The block's fixed-order sum of v[0..G) (each thread's partials): per warp the shuffle-down tree,
//! then warps 0..kOrthoWarps-1 in order; thread g < G writes sum g to out[g]. Ends with a barrier.
template <int G> __device__ __forceinline__ void block_sums(double (&v)[G], double* red, double* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int o = 16; o >= 1; o /= 2) v[g] = __dadd_rn(v[g], __shfl_down_sync(0xFFFFFFFFu, v[g], o));
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) red[warp * G + g] = v[g];
  }
  __syncthreads();
  if (threadIdx.x < G) {
    double s = red[threadIdx.x];
    for (int w = 1; w < kOrthoWarps; ++w) s = __dadd_rn(s, red[w * G + threadIdx.x]);
    out[threadIdx.x] = s;
  }
  __syncthreads();
}

//! w after `passes` projection passes for row `row` (X row, column k its input), in the CPU's order.
__device__ __forceinline__ double w_at(const float* row, int64_t k, int passes, const double* d1, const double* d2) {
  double w = double(row[k]);
  if (passes >= 1)
    for (int64_t j = 0; j < k; ++j) w = __dsub_rn(w, __dmul_rn(d1[j], double(row[j])));
  if (passes == 2)
    for (int64_t j = 0; j < k; ++j) w = __dsub_rn(w, __dmul_rn(d2[j], double(row[j])));
  return w;
}

template <bool Staged> __global__ void __launch_bounds__(kOrthoThreads) lowrank_ortho_kernel(OrthoArgs a) {
  extern __shared__ double dyn[];
  __shared__ double red[kOrthoWarps * kGroup];
  __shared__ double s_sum[kGroup];
  const int64_t rows = a.rows, rank = a.rank, mat = rows * rank;
  double* d1 = dyn;
  double* d2 = dyn + rank;
  float* xs = reinterpret_cast<float*>(dyn + 2 * rank);
  const int64_t ld = Staged ? a.lds : rank;
  const int64_t tid = threadIdx.x;
  for (int64_t b = blockIdx.x; b < a.count; b += gridDim.x) {
    float* xg = a.x + b * mat;
    float* X = Staged ? xs : xg;
    if constexpr (Staged) {
      for (int64_t e = tid; e < mat; e += kOrthoThreads) xs[(e / rank) * ld + e % rank] = xg[e];
      __syncthreads();
    }
    for (int64_t k = 0; k < rank; ++k) {
      bool redrawn = false;
      double s = 0.0;
      for (;;) {
        // two passes of classical Gram-Schmidt: d_p[j] = sum_i q_j[i] w_{p}[i] for every j < k
        for (int pass = 0; pass < 2; ++pass) {
          double* d = pass == 0 ? d1 : d2;
          for (int64_t g0 = 0; g0 < k; g0 += kGroup) {
            double acc[kGroup];
#pragma unroll
            for (int g = 0; g < kGroup; ++g) acc[g] = 0.0;
            for (int64_t i = tid; i < rows; i += kOrthoThreads) {
              const float* row = X + i * ld;
              const double w = w_at(row, k, pass, d1, d2);
#pragma unroll
              for (int g = 0; g < kGroup; ++g)
                if (g0 + g < k) acc[g] = __dadd_rn(acc[g], __dmul_rn(double(row[g0 + g]), w));
            }
            block_sums<kGroup>(acc, red, s_sum);
            if (tid < kGroup && g0 + tid < k) d[g0 + tid] = s_sum[tid];
            __syncthreads();
          }
        }
        double acc1[1] = {0.0};
        for (int64_t i = tid; i < rows; i += kOrthoThreads) {
          const double w = w_at(X + i * ld, k, 2, d1, d2);
          acc1[0] = __dadd_rn(acc1[0], __dmul_rn(w, w));
        }
        block_sums<1>(acc1, red, s_sum);
        s = s_sum[0];
        if (s != 0.0 || a.redraw == 0 || redrawn) break;
        // redraw: column k becomes random_normal values at its flat indices of x (the floats the
        // CPU widens), then the two passes again
        redrawn = true;
        for (int64_t i = tid; i < rows; i += kOrthoThreads)
          X[i * ld + k] = lowrank_box_muller(uint64_t(b * mat + i * rank + k), a.seed, a.stream_id);
        __syncthreads();
      }
      const bool zero = s == 0.0, bad = !isfinite(s);
      const double denom = (zero || bad) ? 1.0 : __dadd_rn(__dsqrt_rn(s), a.eps);
      // Each thread rewrites the column k entries of its own rows: reads (w) and the write of one
      // element are the same thread's; the barrier orders them before the next column's sweeps.
      for (int64_t i = tid; i < rows; i += kOrthoThreads) {
        float* row = X + i * ld;
        float v;
        if (zero) v = 0.0f;
        else if (bad) v = gcuda::quiet_nan();
        else v = __double2float_rn(__ddiv_rn(w_at(row, k, 2, d1, d2), denom));
        row[k] = v;
      }
      __syncthreads();
    }
    if constexpr (Staged) {
      for (int64_t e = tid; e < mat; e += kOrthoThreads) xg[e] = xs[(e / rank) * ld + e % rank];
      __syncthreads();
    }
  }
}

// ---- reconstruct ----------------------------------------------------------------------------------

constexpr int kMaxMatrices = 256;  //!< offsets per launch (2 KiB of kernel parameters)
constexpr int kRecRows = 32, kRecCols = 64, kRecK = 32;
constexpr int kRecThreads = 256;   //!< 32 (columns) x 8 (rows)

struct RecArgs {
  const float* p;   //!< [count, rows, rank], matrix 0 of this launch first
  const float* q;   //!< [count, cols, rank]
  void* out;
  float* residual;
  uint32_t* status;
  int64_t rows, cols, rank;
  int64_t offsets[kMaxMatrices];
};

//! T of one output with the NaN rule at every step (common::mul_rn / add_rn in k order, from -0.0):
//! the reconstruct kernel's slow path, for an output whose plain sum came out NaN.
__device__ __noinline__ float lowrank_rec_rule(const float* prow, const float* qrow, int64_t rank) {
  float acc = -0.0f;
  for (int64_t k = 0; k < rank; ++k) acc = add_rn(acc, mul_rn(prow[k], qrow[k]));
  return acc;
}

template <class O, bool HasRes>
__global__ void __launch_bounds__(kRecThreads, 6) lowrank_reconstruct_kernel(const __grid_constant__ RecArgs a) {
  using S = typename O::storage;
  __shared__ float sp[kRecRows][kRecK + 1];
  __shared__ float sq[kRecCols][kRecK + 1];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t b = blockIdx.z;
  const int64_t rows = a.rows, cols = a.cols, rank = a.rank;
  const float* P = a.p + b * rows * rank;
  const float* Q = a.q + b * cols * rank;
  const int64_t off = a.offsets[b];
  S* out = static_cast<S*>(a.out) + off;
  float* e = HasRes ? a.residual + off : nullptr;
  const int64_t row_tiles = (rows + kRecRows - 1) / kRecRows, col_tiles = (cols + kRecCols - 1) / kRecCols;
  uint32_t nf = 0;
  for (int64_t ti = blockIdx.y; ti < row_tiles; ti += gridDim.y) {
    for (int64_t tj = blockIdx.x; tj < col_tiles; tj += gridDim.x) {
      const int64_t i0 = ti * kRecRows, j0 = tj * kRecCols;
      const int64_t ni = gcuda::plan::min64(rows - i0, kRecRows), nj = gcuda::plan::min64(cols - j0, kRecCols);
      // -0.0 + x == x for every x (both zeros, inf, NaN: add_rn keeps x's NaN), so starting at
      // -0.0 gives T = fl(P0 Q0) + ... exactly as the header writes it. The sums run without the
      // NaN rule (add_raw / mul_raw, the same roundings): an operation's rule changes only a NaN
      // result's bits, a NaN operand makes every later result NaN, so a sum that ends non-NaN went
      // through no NaN and equals the rule's bit for bit; one that ends NaN is redone with the rule
      // (lowrank_rec_rule, from P and Q in global memory, in the same k order).
      float acc[4][2];
#pragma unroll
      for (int s = 0; s < 4; ++s) acc[s][0] = acc[s][1] = -0.0f;
      for (int64_t c0 = 0; c0 < rank; c0 += kRecK) {
        const int kc = int(gcuda::plan::min64(rank - c0, kRecK));
        __syncthreads();  // the previous chunk's reads are done
        for (int t = threadIdx.x; t < kRecRows * kc; t += kRecThreads) {
          const int ii = t / kc, kk = t % kc;
          sp[ii][kk] = ii < ni ? P[(i0 + ii) * rank + c0 + kk] : 0.0f;
        }
        for (int t = threadIdx.x; t < kRecCols * kc; t += kRecThreads) {
          const int jj = t / kc, kk = t % kc;
          sq[jj][kk] = jj < nj ? Q[(j0 + jj) * rank + c0 + kk] : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < kc; ++kk) {
          const float q0 = sq[tx][kk], q1 = sq[tx + 32][kk];
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const float pv = sp[ty + 8 * s][kk];
            acc[s][0] = common::add_raw(acc[s][0], common::mul_raw(pv, q0));
            acc[s][1] = common::add_raw(acc[s][1], common::mul_raw(pv, q1));
          }
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int ii = ty + 8 * s;
        if (ii >= ni) continue;
        const int64_t at = (i0 + ii) * cols + j0;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int jj = tx + 32 * t;
          if (jj >= nj) continue;
          float T = acc[s][t];
          if (common::is_nan_bits(__float_as_uint(T))) T = lowrank_rec_rule(P + (i0 + ii) * rank, Q + (j0 + jj) * rank, rank);
          const S v = O::store(T);
          out[at + jj] = v;
          nf |= O::nonfinite(v) ? 1u : 0u;
          if constexpr (HasRes) e[at + jj] = sub_rn(e[at + jj], T);
        }
      }
    }
  }
  if (__syncthreads_or(int(nf)) && threadIdx.x == 0 && a.status != nullptr) atomicOr(a.status, kStatusNonFinite);
}


//! Raises the ortho kernel's dynamic shared memory cap on `device` (current) to `limit`, the most
//! any call on that device asks for, once per (kernel, device): setting it per call to the call's
//! own size raced with another thread's launch of a larger size between the set and the launch.
template <bool Staged> void allow_ortho_smem(int device, int64_t limit) {
  static std::array<std::once_flag, 64> done;
  const auto set = [limit] {
    GRADCOMP_CUDA_CHECK(cudaFuncSetAttribute(&lowrank_ortho_kernel<Staged>,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, int(limit)));
  };
  if (device >= 0 && device < 64)
    std::call_once(done[size_t(device)], set);  // a throw leaves the flag unset: the next call retries
  else
    set();
}

template <bool Staged> void launch_ortho(const OrthoArgs& a, int64_t smem, int64_t limit, int device, cudaStream_t s) {
  const auto kernel = &lowrank_ortho_kernel<Staged>;
  if (smem > 48 * 1024) allow_ortho_smem<Staged>(device, limit);
  const auto grid = unsigned(gcuda::plan::min64(a.count, int64_t(1) << 30));
  kernel<<<grid, kOrthoThreads, size_t(smem), s>>>(a);
  GRADCOMP_CUDA_CHECK_LAUNCH("lowrank_ortho_kernel");
}

template <class O, bool HasRes> void launch_reconstruct(const RecArgs& a, int64_t nmat, cudaStream_t s) {
  const int64_t row_tiles = gcuda::plan::ceil_div(a.rows, kRecRows), col_tiles = gcuda::plan::ceil_div(a.cols, kRecCols);
  const dim3 grid(unsigned(gcuda::plan::min64(col_tiles, INT_MAX)), unsigned(gcuda::plan::min64(row_tiles, 65535)),
                  unsigned(nmat));
  lowrank_reconstruct_kernel<O, HasRes><<<grid, kRecThreads, 0, s>>>(a);
  GRADCOMP_CUDA_CHECK_LAUNCH("lowrank_reconstruct_kernel");
}

} // namespace

void cuda_project(const MatrixBatch& m, const Tensor& q, const Tensor& p, int64_t rank, Stream stream,
                  Resources::Impl& res) {
  gemms(m, q.ptr<const float>(), p.ptr<float>(), rank, false, stream, res);
}

void cuda_back_project(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, Stream stream,
                       Resources::Impl& res) {
  gemms(m, p.ptr<const float>(), q.ptr<float>(), rank, true, stream, res);
}

void cuda_orthogonalize(const Tensor& x, int64_t count, int64_t rows, int64_t rank, float epsilon,
                        const Redraw* redraw, Stream stream, Resources::Impl& /*res*/) {
  if (rank > kOrthoMaxRank)
    throw Unsupported(concat("lowrank::orthogonalize: rank ", rank, " on ", to_string(x.device),
                             ": the CUDA backend takes rank up to ", kOrthoMaxRank,
                             " (its projection coefficients live in shared memory)"));
  const int device = x.device.index;
  DeviceGuard guard(device);
  const cudaStream_t s = to_cuda(stream);
  OrthoArgs a{};
  a.x = x.ptr<float>();
  a.count = count;
  a.rows = rows;
  a.rank = rank;
  a.lds = rank | 1;  // odd row stride of the staged copy: a warp's 32 rows hit 32 banks
  a.eps = double(epsilon);
  a.redraw = redraw != nullptr;
  a.seed = redraw != nullptr ? redraw->seed : 0;
  a.stream_id = redraw != nullptr ? redraw->stream : 0;
  const int64_t coeff = 16 * rank;
  int optin = 0;
  GRADCOMP_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const int64_t limit = gcuda::plan::min64(kOrthoSmemBytes, int64_t(optin) - 4096);  // static: 2.2 KB
  const int64_t staged = coeff + rows * a.lds * 4;
  if (rows <= limit / 4 && staged <= limit)
    launch_ortho<true>(a, staged, limit, device, s);
  else if (coeff <= limit)
    launch_ortho<false>(a, coeff, limit, device, s);
  else
    throw Unsupported(concat("lowrank::orthogonalize: rank ", rank, " needs ", coeff, " bytes of shared memory on ",
                             to_string(x.device), ", which offers ", limit));
}

void cuda_reconstruct(const MatrixBatch& m, const Tensor& p, const Tensor& q, int64_t rank, const Tensor& out,
                      float* residual, uint32_t* status, Stream stream, Resources::Impl& /*res*/) {
  DeviceGuard guard(out.device.index);
  const cudaStream_t s = to_cuda(stream);
  common::dispatch_float(out.dtype, [&](auto tag) {
    using O = decltype(tag);
    for (int64_t b0 = 0; b0 < m.count; b0 += kMaxMatrices) {
      const int64_t n = gcuda::plan::min64(kMaxMatrices, m.count - b0);
      RecArgs a{};
      a.p = p.ptr<const float>() + b0 * m.rows * rank;
      a.q = q.ptr<const float>() + b0 * m.cols * rank;
      a.out = out.data;
      a.residual = residual;
      a.status = status;
      a.rows = m.rows;
      a.cols = m.cols;
      a.rank = rank;
      for (int64_t i = 0; i < n; ++i) a.offsets[i] = m.offsets[b0 + i];
      if (residual != nullptr) launch_reconstruct<O, true>(a, n, s);
      else launch_reconstruct<O, false>(a, n, s);
    }
  }, "lowrank::reconstruct: out");
}

void cuda_random_normal(const Tensor& x, uint64_t seed, uint64_t stream_id, Stream stream, Resources::Impl& /*res*/) {
  const int device = x.device.index;
  DeviceGuard guard(device);
  // one wave of the kernel (occupancy x SMs); every element is its own Philox block: any grid
  // gives the same values
  const auto grid = unsigned(gcuda::plan::wave_grid(x.numel, gcuda::plan::kThreads,
                                                    gcuda::wave_blocks(device, lowrank_normal_kernel)));
  lowrank_normal_kernel<<<grid, gcuda::plan::kThreads, 0, to_cuda(stream)>>>(x.ptr<float>(), x.numel, seed, stream_id);
  GRADCOMP_CUDA_CHECK_LAUNCH("lowrank_normal_kernel");
}

} // namespace gradcomp::lowrank::detail
