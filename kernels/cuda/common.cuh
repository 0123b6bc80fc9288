// SPDX-License-Identifier: Apache-2.0
// Launch helpers shared by the CUDA kernels: error checking, device guard, SM count and occupancy
// caches (wave_blocks: the grid of one full wave of a kernel), vector loads/stores of 8 and 4
// elements, the decodes' multiply(-add) with the NaN rule redone only for a NaN result
// (mul_acc_rn / mul2_acc_rn), warp max / OR of 32-bit words, the BlockCursor (data block of an element in a
// grid-stride loop without a division per step), the on-device header load/store, the decode
// kernels' prologue (header and key check, status word) and packet finishing (header, key
// section, padding: all derived from the packet layout, kernels/core/layout.hpp), and the
// last-block election. Element tags are kernels/common/elem.hpp, the same set the CPU uses.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "../common/elem.hpp"
#include "../common/math.hpp"
#include "../core/backend.hpp"
#include "../core/layout.hpp"
#include "gradcomp/error.hpp"
#include "plan.hpp"

namespace gradcomp::detail::cuda {

//! Throws CudaError naming the call, the CUDA error name and cudaGetErrorString.
[[noreturn]] void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line);

#define GRADCOMP_CUDA_CHECK(expr)                                                                  \
  do {                                                                                             \
    const cudaError_t gradcomp_err_ = (expr);                                                      \
    if (gradcomp_err_ != cudaSuccess)                                                              \
      ::gradcomp::detail::cuda::throw_cuda_error(gradcomp_err_, #expr, __FILE__, __LINE__);        \
  } while (0)

//! Check the launch just made (configuration errors; asynchronous faults surface later).
#define GRADCOMP_CUDA_CHECK_LAUNCH(name)                                                           \
  do {                                                                                             \
    const cudaError_t gradcomp_err_ = cudaGetLastError();                                          \
    if (gradcomp_err_ != cudaSuccess)                                                              \
      ::gradcomp::detail::cuda::throw_cuda_error(gradcomp_err_, "launch of " name, __FILE__, __LINE__); \
  } while (0)

inline cudaStream_t to_cuda(Stream s) { return static_cast<cudaStream_t>(s.handle); }

//! Makes `device` current for the scope of a call. On exit the previous device is made current
//! again only when it has an active primary context (as PyTorch's c10::cuda::MaybeSetDevice
//! does): restoring a device the thread never used would create a context on it (e.g. on GPU 0 for
//! a thread that only ever touched GPU 3).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

//! Whether `device`'s primary context is active (cuDevicePrimaryCtxGetState, reached through the
//! runtime's driver entry point so that nothing links libcuda). False when it cannot be told.
bool primary_context_active(int device);

//! Multiprocessors of `device` (cached; a host attribute query, no synchronization).
int sm_count(int device);

//! Blocks of `kernel` (plan::kThreads threads, no dynamic shared memory) one SM of `device` holds
//! at once: cudaOccupancyMaxActiveBlocksPerMultiprocessor (registers, static shared memory),
//! at least 1. Cached per (device, kernel) under a mutex (the query runs outside it; two threads
//! that miss together store the same number). `device` must be current (the callers' DeviceGuard).
int blocks_per_sm(int device, const void* kernel);

//! One full wave of `kernel` on `device`: blocks_per_sm x sm_count, the grid of a grid-stride
//! kernel that reads memory once (plan::wave_grid caps it by the work).
template <class Kernel> int64_t wave_blocks(int device, Kernel* kernel) {
  return int64_t(blocks_per_sm(device, reinterpret_cast<const void*>(kernel))) * sm_count(device);
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

using common::BF16;
using common::F16;
using common::F32;

//! The canonical quiet NaN (what the CPU backend's std::numeric_limits<float>::quiet_NaN() is).
__device__ __forceinline__ float quiet_nan() { return __uint_as_float(0x7FC00000u); }
__device__ __forceinline__ uint32_t nonfinite_bit(float v) {
  return common::is_finite_bits(__float_as_uint(v)) ? 0u : 1u;
}

// ---- 8 consecutive elements through 16-byte vectors (p must be 16-byte aligned) -----------------
template <class T> __device__ __forceinline__ void load8(const typename T::storage* p, float (&v)[plan::kItems]) {
  if constexpr (sizeof(typename T::storage) == 4) {
    const float4 a = reinterpret_cast<const float4*>(p)[0];
    const float4 b = reinterpret_cast<const float4*>(p)[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    const uint4 a = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[2 * j] = T::load(static_cast<uint16_t>(w[j] & 0xFFFFu));
      v[2 * j + 1] = T::load(static_cast<uint16_t>(w[j] >> 16));
    }
  }
}
//! Store 8 already-converted codes.
template <class T> __device__ __forceinline__ void store8(typename T::storage* p, const typename T::storage (&c)[plan::kItems]) {
  if constexpr (sizeof(typename T::storage) == 4) {
    reinterpret_cast<float4*>(p)[0] = make_float4(c[0], c[1], c[2], c[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(c[4], c[5], c[6], c[7]);
  } else {
    uint4 a;
    a.x = uint32_t(c[0]) | (uint32_t(c[1]) << 16);
    a.y = uint32_t(c[2]) | (uint32_t(c[3]) << 16);
    a.z = uint32_t(c[4]) | (uint32_t(c[5]) << 16);
    a.w = uint32_t(c[6]) | (uint32_t(c[7]) << 16);
    *reinterpret_cast<uint4*>(p) = a;
  }
}
__device__ __forceinline__ void store8f(float* p, const float (&v)[plan::kItems]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// ---- 4 consecutive elements through one vector (p must be 4 * sizeof(storage) aligned) -----------
template <class T> __device__ __forceinline__ void load4(const typename T::storage* p, float (&v)[4]) {
  if constexpr (sizeof(typename T::storage) == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  } else {
    const uint2 a = *reinterpret_cast<const uint2*>(p);
    v[0] = T::load(static_cast<uint16_t>(a.x & 0xFFFFu));
    v[1] = T::load(static_cast<uint16_t>(a.x >> 16));
    v[2] = T::load(static_cast<uint16_t>(a.y & 0xFFFFu));
    v[3] = T::load(static_cast<uint16_t>(a.y >> 16));
  }
}
//! Store 4 already-converted codes.
template <class T> __device__ __forceinline__ void store4(typename T::storage* p, const typename T::storage (&c)[4]) {
  if constexpr (sizeof(typename T::storage) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(c[0], c[1], c[2], c[3]);
  } else {
    *reinterpret_cast<uint2*>(p) = make_uint2(uint32_t(c[0]) | (uint32_t(c[1]) << 16), uint32_t(c[2]) | (uint32_t(c[3]) << 16));
  }
}

// ---- decode arithmetic: the NaN rule only where a NaN comes out ------------------------------------
//! Acc ? fl(o + fl(fl(a * b) * c)) : fl(fl(a * b) * c), exactly as common::mul_rn / add_rn give it:
//! computed with the plain roundings (mul_raw / add_raw, never contracted) and redone with the rule
//! only when the result is NaN. Bitwise the same: the rule changes only a NaN result's bits and a
//! NaN operand makes every later result NaN, so a non-NaN plain result went through no NaN and each
//! step had the rule's operands and result.
template <bool Acc> __device__ __forceinline__ float mul2_acc_rn(float o, float a, float b, float c) {
  const float t = common::mul_raw(common::mul_raw(a, b), c);
  const float r = Acc ? common::add_raw(o, t) : t;
  if (!common::is_nan_bits(__float_as_uint(r))) return r;
  const float v = common::mul_rn(common::mul_rn(a, b), c);
  return Acc ? common::add_rn(o, v) : v;
}
//! Acc ? fl(o + fl(a * c)) : fl(a * c) with the NaN rule, the same way (mul2_acc_rn).
template <bool Acc> __device__ __forceinline__ float mul_acc_rn(float o, float a, float c) {
  const float t = common::mul_raw(a, c);
  const float r = Acc ? common::add_raw(o, t) : t;
  if (!common::is_nan_bits(__float_as_uint(r))) return r;
  const float v = common::mul_rn(a, c);
  return Acc ? common::add_rn(o, v) : v;
}

// ---- warp reductions of 32-bit words (every lane of the warp must call; all get the result) --------
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xFFFFFFFFu, v);
#else
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
#endif
}
__device__ __forceinline__ uint32_t warp_or_u32(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_or_sync(0xFFFFFFFFu, v);
#else
#pragma unroll
  for (int o = 16; o >= 1; o /= 2) v |= __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
#endif
}

// ---- data block (or chunk) of an element in a grid-stride loop, without a division per step ------
//! Block index b = i / B and offset r = i % B of a thread's current element i, for blocks of B >= 1
//! elements: two 32-bit divisions per thread (the thread's first element and the loop's stride,
//! both below 2^32: plan::wave_grid keeps a grid's elements per step at most 2^31; a block of
//! 2^32 or more elements holds them whole), then advance() moves i by the stride with additions
//! and one carry (i + stride = (b + stride / B) * B + r + stride % B, and r + stride % B < 2B).
//! Exact for every later i below 2^63.
struct BlockCursor {
  int64_t b;  //!< i / B
  int64_t r;  //!< i % B
  int64_t B, sb, sr;
  __device__ __forceinline__ BlockCursor(int64_t i, int64_t stride, int64_t block) : B(block) {
    if (block > int64_t(0xFFFFFFFFu)) {
      b = 0;
      r = i;
      sb = 0;
      sr = stride;
    } else {
      const uint32_t B32 = uint32_t(block), i32 = uint32_t(i), s32 = uint32_t(stride);
      const uint32_t bq = i32 / B32, sq = s32 / B32;
      b = bq;
      r = i32 - bq * B32;
      sb = sq;
      sr = s32 - sq * B32;
    }
  }
  __device__ __forceinline__ void advance() {
    b += sb;
    r += sr;
    if (r >= B) {
      r -= B;
      ++b;
    }
  }
};

//! Load one element of a gradient dtype known only at run time (a packet section's dtype).
__device__ __forceinline__ float load_dyn(const uint8_t* base, DType dtype, int64_t i) {
  if (dtype == DType::float32) return reinterpret_cast<const float*>(base)[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(base)[i];
  return dtype == DType::float16 ? common::half_bits_to_float(h) : common::bf16_bits_to_float(h);
}

// ---- packet header check on the device ------------------------------------------------------------
//! The header check on the device: check_header of kernels/core/layout.hpp, the same function the
//! host runs. Returns the header's input dtype code (0..2; expect_section(e, code, s) then gives
//! the packet's sections), or -1 when the header does not match (the caller sets kStatusCorrupt
//! and writes nothing).
__device__ __forceinline__ int checked_input(const PacketHeader& h, const HeaderExpect& e) {
  int input = -1;
  return check_header(h, e, &input) == HeaderFault::ok ? input : -1;
}

//! Read the 32-byte header at a 16-byte aligned address.
__device__ __forceinline__ PacketHeader load_header(const uint8_t* packet) {
  const uint4 a = reinterpret_cast<const uint4*>(packet)[0];
  const uint4 b = reinterpret_cast<const uint4*>(packet)[1];
  PacketHeader h;
  uint4 w[2] = {a, b};
  memcpy(&h, w, sizeof h);
  return h;
}

//! What a decode kernel's prologue (decode_prologue) learnt from the packet, the same in every
//! thread of the block.
struct DecodeHead {
  int input;          //!< the header's input dtype code (0..2); -1: corrupt, write nothing
  bool nonfinite;     //!< the header carries kFlagNonFinite (only when input >= 0)
  int64_t offset[2];  //!< byte offsets of sections 0 and 1 in the layout of that input dtype
  DType dtype[2];     //!< their dtypes
};

//! The prologue of every decode kernel: thread 0 loads the header and checks it against `e`
//! (checked_input, then check_key_section: the key section's reserved bytes of keyed codecs, then
//! the checksum kernel's veto word when e.veto is set),
//! takes sections 0 and 1 of the layout of the header's input dtype and, in block 0 when `status`
//! is not null, ORs kStatusCorrupt (a mismatch) or kStatusNonFinite (a packet flagged non-finite)
//! into the status word; the block then synchronizes and every thread reads the same DecodeHead
//! (a reference to the block's copy in shared memory).
//! Only the flag reaches the status word here: a codec that writes more for a flagged packet (top-k:
//! NaN into out[0]) does so in its own kernel. A kernel that must not report (a second kernel of
//! one decode) passes status = nullptr.
__device__ __forceinline__ const DecodeHead& decode_prologue(const uint8_t* packet, const HeaderExpect& e,
                                                             uint32_t* status) {
  __shared__ DecodeHead s_head;
  if (threadIdx.x == 0) {
    const PacketHeader h = load_header(packet);
    int input = checked_input(h, e);
    if (input >= 0 && !check_key_section(packet, e, input)) input = -1;
    // integrity=crc32c: the checksum kernel ran first on the stream and vetoes a mismatch
    if (input >= 0 && e.veto != nullptr && *reinterpret_cast<const volatile uint32_t*>(e.veto) != 0) input = -1;
    DecodeHead d{};
    d.input = input;
    d.nonfinite = input >= 0 && (h.flags & kFlagNonFinite) != 0;
    d.dtype[0] = d.dtype[1] = DType::none;
    if (input >= 0) {
      const PacketSection s0 = expect_section(e, input, 0), s1 = expect_section(e, input, 1);
      d.offset[0] = s0.offset;
      d.offset[1] = s1.offset;
      d.dtype[0] = s0.dtype;
      d.dtype[1] = s1.dtype;
    }
    if (status != nullptr && blockIdx.x == 0) {
      if (input < 0) atomicOr(status, kStatusCorrupt);
      else if (d.nonfinite) atomicOr(status, kStatusNonFinite);
    }
    s_head = d;
  }
  __syncthreads();
  return s_head;
}
//! Write the 32-byte header (one thread).
__device__ __forceinline__ void store_header(uint8_t* packet, const PacketHeader& h) {
  uint4 w[2];
  memcpy(w, &h, sizeof h);
  reinterpret_cast<uint4*>(packet)[0] = w[0];
  reinterpret_cast<uint4*>(packet)[1] = w[1];
}

//! Finish a packet from one block (the elected last block of an encode): thread 0 writes the header
//! with `flags` and the key section of keyed codecs; the block zeroes the padding of the layout.
__device__ __forceinline__ void finish_packet_block(uint8_t* packet, const PacketLayout& l, uint8_t flags,
                                                    const EncodeContext& ctx) {
  if (threadIdx.x == 0) {
    PacketHeader h = l.header;
    h.flags = flags;
    store_header(packet, h);
    if (l.key_section >= 0) store_key(packet + l.sections[l.key_section].offset, ctx);
  }
  for_each_padding(l, [&](int64_t b, int64_t e) {
    for (int64_t i = b + threadIdx.x; i < e; i += blockDim.x) packet[i] = 0;
  });
}

//! Last-block election: every block calls it once after its global writes; true in the block that
//! finishes last (all blocks' writes are then visible to it). `s_last` is a shared-memory flag.
__device__ __forceinline__ bool elect_last_block(uint32_t* counter, bool* s_last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    *s_last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  const bool last = *s_last;
  if (last) __threadfence();
  return last;
}

} // namespace gradcomp::detail::cuda
