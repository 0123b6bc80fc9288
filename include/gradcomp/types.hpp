// SPDX-License-Identifier: Apache-2.0
//! @file types.hpp
//! Core value types of gradcomp: element types, devices, non-owning tensor views, streams.
//! Compiles with any C++20 compiler; includes no CUDA or CCCL header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace gradcomp {

//! Element types, named as in PyTorch / ml_dtypes. The numeric values are the codes written into
//! packet headers (bytes 8-10) and never change.
enum class DType : uint8_t {
  float32 = 0,
  float16 = 1,
  bfloat16 = 2,
  float8_e4m3fn = 3,
  float8_e5m2 = 4,
  int8 = 5,
  uint8 = 6,
  int32 = 7,
  int64 = 8,
  uint32 = 9,          //!< packet index sections
  uint64 = 10,         //!< packet index sections
  int4 = 11,           //!< packet sections only: two signed 4-bit codes per byte, low nibble first
  uint1 = 12,          //!< packet sections only: one bit per element, most significant bit first
  float8_e8m0fnu = 13, //!< packet sections only: power-of-two scales (OCP MX), ml_dtypes' name
  none = 255,          //!< "no such section" in a packet header
};
//! The largest defined DType code (the codes 0..kMaxDTypeCode have names).
inline constexpr int kMaxDTypeCode = 13;

//! Bits per element of `t` (0 for DType::none).
constexpr int64_t dtype_bits(DType t) noexcept {
  switch (t) {
    case DType::float32: case DType::int32: case DType::uint32: return 32;
    case DType::float16: case DType::bfloat16: return 16;
    case DType::float8_e4m3fn: case DType::float8_e5m2: case DType::int8: case DType::uint8:
    case DType::float8_e8m0fnu: return 8;
    case DType::int64: case DType::uint64: return 64;
    case DType::int4: return 4;
    case DType::uint1: return 1;
    case DType::none: return 0;
  }
  return 0;
}

//! Bytes per element of `t` for the byte-addressable dtypes; 0 for DType::none and for the packed
//! sub-byte dtypes int4 and uint1 (use storage_bytes for those).
constexpr int64_t dtype_size(DType t) noexcept { return dtype_bits(t) >= 8 ? dtype_bits(t) / 8 : 0; }

//! Bytes that `count` elements of `t` occupy when packed (sub-byte dtypes rounded up to whole bytes).
constexpr int64_t storage_bytes(DType t, int64_t count) noexcept { return (count * dtype_bits(t) + 7) / 8; }

//! True for the three gradient dtypes every codec accepts: float32, float16, bfloat16.
constexpr bool is_gradient_dtype(DType t) noexcept {
  return t == DType::float32 || t == DType::float16 || t == DType::bfloat16;
}

//! Name as PyTorch / ml_dtypes spell it ("float32", "bfloat16", "float8_e4m3fn", ...).
std::string_view dtype_name(DType t) noexcept;
//! Inverse of dtype_name. Throws InvalidArgument naming `name` and listing the accepted names.
DType dtype_from_name(std::string_view name);

enum class DeviceKind : uint8_t { cpu = 0, cuda = 1 };

//! Where a tensor lives: {cpu, 0} or {cuda, ordinal}.
struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};
std::string to_string(Device d);

//! Non-owning view of a C-contiguous tensor, taken as flat: `numel` elements of `dtype` starting
//! at `data` (may be null when numel == 0). Sizes are 64-bit; tensors of 2^31 elements and more work.
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::float32;
  int64_t numel = 0;
  Device device{};

  int64_t nbytes() const noexcept { return numel * dtype_size(dtype); }
  template <class T> T* ptr() const noexcept { return static_cast<T*>(data); }
};

//! A CUDA stream as an opaque handle (the `cudaStream_t` value; null = legacy default stream).
//! Ignored on the CPU.
struct Stream {
  void* handle = nullptr;
};

//! Threads used by the CPU backend (OpenMP). Default: GRADCOMP_NUM_THREADS if set, else
//! the OpenMP default. set_num_threads(n) with n outside [1, kMaxThreads] throws InvalidArgument.
inline constexpr int kMaxThreads = 1024;
void set_num_threads(int n);
int get_num_threads() noexcept;
//! Adaptive threads (default on; GRADCOMP_ADAPTIVE_THREADS=0 turns it off): when the threads of a
//! CPU kernel start a parallel region more than 1 ms apart (a thread waited for a core another
//! process holds), the next calls run on one thread for 0.5 s, every 16th call trying the full
//! count again. Packets do not depend on it.
void set_adaptive_threads(bool on) noexcept;
//! "contended" while calls run on one thread because a core was found busy, else "idle".
std::string cpu_threads_state();

//! What this build contains (gradcomp.build_info() in Python).
struct BuildInfo {
  std::string version;
  bool cuda = false;
  std::string cuda_architectures; //!< e.g. "80;90", empty without CUDA
  std::string cuda_version;       //!< toolkit version the kernels were built with
  bool openmp = false;
  int dlpack_version = 0; //!< filled by the Python bindings
  std::string cpu_isa;      //!< the CPU kernel variant that runs: "avx512", "avx2", "generic" or "native"
  std::string cpu_variants; //!< the variants compiled in, e.g. "avx512,avx2,generic"
  std::string blas;         //!< the CPU BLAS low rank calls at ranks 1 and > 16: "openblas" or "none" (GRADCOMP_BLAS)
};
BuildInfo build_info();

//! The CPU kernel variant in use ("avx512", "avx2", "generic"; "native" in a GRADCOMP_NATIVE=ON
//! build): the best one this processor supports, unless GRADCOMP_CPU_ISA (environment) or
//! set_cpu_isa asked for a lower one. Every variant produces byte-identical packets.
std::string cpu_isa();
//! The variants of this build this processor can run, best first.
std::vector<std::string> cpu_isas_supported();
//! Use variant `name` (one of cpu_isas_supported()); InvalidArgument otherwise, listing them.
void set_cpu_isa(std::string_view name);

} // namespace gradcomp
