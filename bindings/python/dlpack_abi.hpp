// SPDX-License-Identifier: Apache-2.0
// DLPack's C ABI, the part gradcomp's bridge uses (dlpack_bridge.hpp, module.cpp), written from the
// specification so that the package builds without DLPack's headers (Debian's libdlpack-dev is not
// on PyPI; issue 20). Source: dlpack.h of DLPack v0.6 and v0.8 (https://github.com/dmlc/dlpack,
// include/dlpack/dlpack.h; https://dmlc.github.io/dlpack/latest/c_api.html), the "legacy"
// unversioned ABI that a `__dlpack__()` call without max_version returns in a "dltensor" capsule.
// It is the same in v0.6, v0.7, v0.8 and v1.x (v1.0 adds DLManagedTensorVersioned and the
// "dltensor_versioned" capsule, which gradcomp does not take).
//
// Layout (C rules; x86-64 and aarch64 LP64, checked by tests/cpp/test_dlpack_abi.cpp against the
// real dlpack.h where it is installed):
//   DLDevice         8 bytes, align 4: device_type (int32 enum) @0, device_id (int32) @4
//   DLDataType       4 bytes, align 2: code (uint8) @0, bits (uint8) @1, lanes (uint16) @2
//   DLTensor        48 bytes, align 8: data @0, device @8, ndim (int32) @16, dtype @20, shape @24,
//                                      strides @32 (nullptr: compact row-major), byte_offset (uint64) @40
//   DLManagedTensor 64 bytes, align 8: dl_tensor @0, manager_ctx @48, deleter @56
// Shapes and strides are in elements, byte_offset in bytes. Everything is in namespace
// gradcomp::python::dlpack, so a translation unit that also includes <dlpack/dlpack.h> has no clash.
#pragma once

#include <cstdint>

namespace gradcomp::python::dlpack {

//! The DLPACK_VERSION the bridge reports (build_info()["dlpack_version"]): DLPack 0.6's, whose
//! legacy ABI this is (unchanged through 0.8).
inline constexpr int kDLPackVersion = 60;

//! DLDeviceType (int32_t as in dlpack.h v0.8's C++ declaration; v0.6's plain C enum has the same
//! size). 5 and 6 are not assigned.
enum DLDeviceType : int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,  //!< pinned CUDA host memory (cudaMallocHost)
  kDLOpenCL = 4,
  kDLVulkan = 7,
  kDLMetal = 8,
  kDLVPI = 9,
  kDLROCM = 10,
  kDLROCMHost = 11,
  kDLExtDev = 12,
  kDLCUDAManaged = 13,  //!< CUDA managed / unified memory
  kDLOneAPI = 14,       //!< not in v0.6 (in v0.8)
  kDLWebGPU = 15,       //!< not in v0.6 (in v0.8)
  kDLHexagon = 16,      //!< not in v0.6 (in v0.8)
};

struct DLDevice {
  DLDeviceType device_type;
  int32_t device_id;  //!< the device's ordinal (0 for the CPU)
};

//! DLDataTypeCode (a plain enum as in dlpack.h; DLDataType stores it as a uint8_t).
enum DLDataTypeCode {
  kDLInt = 0U,
  kDLUInt = 1U,
  kDLFloat = 2U,
  kDLOpaqueHandle = 3U,
  kDLBfloat = 4U,
  kDLComplex = 5U,
  kDLBool = 6U,  //!< not in v0.6 (in v0.8)
};

struct DLDataType {
  uint8_t code;    //!< a DLDataTypeCode
  uint8_t bits;    //!< bits per lane: 8, 16, 32, 64
  uint16_t lanes;  //!< 1 for scalars
};

struct DLTensor {
  void* data;  //!< the base pointer (element 0 is at data + byte_offset)
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;        //!< ndim extents
  int64_t* strides;      //!< ndim strides in elements, or nullptr (compact row-major)
  uint64_t byte_offset;  //!< bytes from data to element 0
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;                       //!< the producer's context
  void (*deleter)(DLManagedTensor* self);  //!< releases the tensor; may be nullptr
};

} // namespace gradcomp::python::dlpack
