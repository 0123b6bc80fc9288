// SPDX-License-Identifier: Apache-2.0
// The generic interface between kernels/core and the backends (kernels/cpu, kernels/cuda).
//
// A codec family declares a Plan (what its kernels need: sizes, dtypes, the packet layout, the CPU
// thread count) and one Kernels<Plan> table per backend (three function pointers). The core picks
// the table with select(), which holds the only `#if GRADCOMP_WITH_CUDA` of the core: a backend
// missing from the build raises Unsupported naming the codec and the device, never a silent no-op.
// Arguments reaching a table are validated; the backends never include each other.
#pragma once

#include <cstdint>

#include "gradcomp/codec.hpp"
#include "layout.hpp"

namespace gradcomp::detail {

//! What an encode kernel gets besides its plan. The plan's layout gives the header (flags 0), the
//! sections and the padding the kernel writes; on CUDA the kernel writes the header itself.
struct EncodeArgs {
  Tensor x;                      //!< float32/float16/bfloat16, plan's numel and input dtype
  float* residual = nullptr;     //!< float32 [numel] on x's device, or null (no error feedback)
  uint8_t* packet = nullptr;     //!< >= layout.bytes, 16-byte aligned
  uint8_t* workspace = nullptr;  //!< >= Kernels::workspace_bytes(plan); status word in bytes 0-3
  int64_t workspace_bytes = 0;
  float divisor = 1.0f;
  EncodeContext ctx{};
  Stream stream{};
};

//! What a decode kernel gets. On the CPU the header has been validated on the host (`input` is
//! its input dtype and the plan was built for it); on CUDA the host cannot read the packet, so the
//! kernel checks the header against `expect` (check_header) and takes the layout of the header's
//! input dtype from it, and the plan was built for float32 input (fields that do not depend on the
//! input dtype only).
struct DecodeArgs {
  const uint8_t* packet = nullptr;
  int64_t packet_capacity = 0;   //!< bytes the packet buffer holds
  Tensor out;                    //!< float32/float16/bfloat16, numel elements
  uint8_t* workspace = nullptr;  //!< status word at bytes 0-3; may be null on the CPU
  int64_t workspace_bytes = 0;   //!< bytes the workspace holds (0 when null)
  DecodeMode mode = DecodeMode::assign;
  float alpha = 1.0f;
  Stream stream{};
  DType input = DType::none;     //!< CPU: the validated header's input dtype
  const HeaderExpect* expect = nullptr; //!< CUDA: what the kernel checks the header against
};

//! A backend's kernels for one family.
template <class Plan> struct Kernels {
  int64_t (*workspace_bytes)(const Plan&);
  void (*encode)(const Plan&, const EncodeArgs&);
  void (*decode)(const Plan&, const DecodeArgs&);
};

//! A family's kernel tables; null where the build has no such backend.
template <class Plan> struct Backends {
  const Kernels<Plan>* cpu = nullptr;
  const Kernels<Plan>* cuda = nullptr;
};

//! Host helpers of a CUDA build that are not per family (kernels/cuda/runtime.cu).
struct DeviceRuntime {
  uint32_t (*read_status)(const Tensor& workspace, Stream stream, bool clear);
  const char* (*version)();
};

//! The CUDA side of integrity=crc32c (kernels/cuda/integrity.cu; kernels/core/integrity.hpp).
struct ChecksumRuntime {
  //! Workspace bytes the kernels need for a checksum over `nbytes` packet bytes.
  int64_t (*workspace_bytes)(int64_t nbytes);
  //! Write the CRC-32C of packet[0, checksum offset) into the layout's checksum section; `scratch`
  //! holds workspace_bytes(offset) bytes.
  void (*write)(uint8_t* packet, const PacketLayout& l, uint8_t* scratch, int device, Stream stream);
  //! Check it on the device (the layout of the header's input dtype, from `e`): a mismatch sets
  //! kStatusCorrupt in the status word and the veto word at workspace byte kChecksumVetoOffset
  //! (zeroed first), which the decode kernels' prologue reads through e.veto. The partial sums go
  //! to the workspace after the family's part (`family_bytes`).
  void (*verify)(const uint8_t* packet, const HeaderExpect& e, uint8_t* workspace, int64_t family_bytes,
                 int device, Stream stream);
};

#if defined(GRADCOMP_WITH_CUDA)
//! The CUDA table of a family, or null in a CPU-only build (where it is never referenced).
#define GRADCOMP_CUDA_KERNELS(table) (&(table))
namespace cuda {
extern const DeviceRuntime runtime;
extern const ChecksumRuntime checksum;
} // namespace cuda
inline const DeviceRuntime* cuda_runtime() { return &cuda::runtime; }
inline const ChecksumRuntime* checksum_runtime() { return &cuda::checksum; }
#else
#define GRADCOMP_CUDA_KERNELS(table) nullptr
inline const DeviceRuntime* cuda_runtime() { return nullptr; }
inline const ChecksumRuntime* checksum_runtime() { return nullptr; }
#endif

//! The CPU kernel variants (kernels/cpu/isa.hpp), best first; `native` alone in a
//! GRADCOMP_NATIVE=ON build.
enum class CpuIsa : int { avx512 = 0, avx2 = 1, generic = 2, native = 3 };
//! The variant the CPU kernels use now (core/runtime.cpp: detected once, set_cpu_isa).
CpuIsa cpu_isa() noexcept;

[[noreturn]] void throw_no_backend(const Codec& c, Device d);

//! The kernels of `b` for `device`; throws Unsupported naming the codec and the device when the
//! build has none.
template <class Plan> const Kernels<Plan>& select(const Backends<Plan>& b, Device device, const Codec& c) {
  const Kernels<Plan>* k = device.kind == DeviceKind::cpu ? b.cpu : device.kind == DeviceKind::cuda ? b.cuda : nullptr;
  if (k == nullptr) throw_no_backend(c, device);
  return *k;
}

} // namespace gradcomp::detail
