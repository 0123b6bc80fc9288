// SPDX-License-Identifier: Apache-2.0
// bindings/python/dlpack_abi.hpp, gradcomp's own copy of DLPack's legacy C ABI: every struct's size
// and alignment, every field's offset and size, every enum value.
//  - Where DLPack's header is installed (__has_include(<dlpack/dlpack.h>); the package does not
//    need it), against it: static_asserts (a mismatch does not compile) and the same as EXPECTs.
//  - Always: the values of the specification (dlpack.h v0.6 / v0.8) written here, and the LP64
//    layout (x86-64: DLTensor 48 bytes, DLManagedTensor 64).
// Both headers in one translation unit also shows that they do not clash.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../bindings/python/dlpack_abi.hpp"

#if __has_include(<dlpack/dlpack.h>)
#include <dlpack/dlpack.h>
#define GRADCOMP_TEST_HAVE_DLPACK 1
#endif

namespace dl = gradcomp::python::dlpack;

namespace {

// ---- the specification's values and the LP64 layout (with or without dlpack.h) --------------------
static_assert(dl::kDLCPU == 1 && dl::kDLCUDA == 2 && dl::kDLCUDAHost == 3 && dl::kDLOpenCL == 4 &&
              dl::kDLVulkan == 7 && dl::kDLMetal == 8 && dl::kDLVPI == 9 && dl::kDLROCM == 10 &&
              dl::kDLROCMHost == 11 && dl::kDLExtDev == 12 && dl::kDLCUDAManaged == 13 && dl::kDLOneAPI == 14 &&
              dl::kDLWebGPU == 15 && dl::kDLHexagon == 16);
static_assert(dl::kDLInt == 0 && dl::kDLUInt == 1 && dl::kDLFloat == 2 && dl::kDLOpaqueHandle == 3 &&
              dl::kDLBfloat == 4 && dl::kDLComplex == 5 && dl::kDLBool == 6);
static_assert(std::is_standard_layout_v<dl::DLTensor> && std::is_trivially_copyable_v<dl::DLTensor>);
static_assert(std::is_standard_layout_v<dl::DLManagedTensor>);

TEST(DlpackAbi, SpecLayoutLP64) {
  static_assert(sizeof(void*) == 8, "the layout below is LP64's");
  EXPECT_EQ(sizeof(dl::DLDeviceType), 4u);
  EXPECT_EQ(sizeof(dl::DLDataTypeCode), 4u);
  EXPECT_EQ(sizeof(dl::DLDevice), 8u);
  EXPECT_EQ(alignof(dl::DLDevice), 4u);
  EXPECT_EQ(offsetof(dl::DLDevice, device_type), 0u);
  EXPECT_EQ(offsetof(dl::DLDevice, device_id), 4u);
  EXPECT_EQ(sizeof(dl::DLDataType), 4u);
  EXPECT_EQ(alignof(dl::DLDataType), 2u);
  EXPECT_EQ(offsetof(dl::DLDataType, code), 0u);
  EXPECT_EQ(offsetof(dl::DLDataType, bits), 1u);
  EXPECT_EQ(offsetof(dl::DLDataType, lanes), 2u);
  EXPECT_EQ(sizeof(dl::DLTensor), 48u);
  EXPECT_EQ(alignof(dl::DLTensor), 8u);
  EXPECT_EQ(offsetof(dl::DLTensor, data), 0u);
  EXPECT_EQ(offsetof(dl::DLTensor, device), 8u);
  EXPECT_EQ(offsetof(dl::DLTensor, ndim), 16u);
  EXPECT_EQ(offsetof(dl::DLTensor, dtype), 20u);
  EXPECT_EQ(offsetof(dl::DLTensor, shape), 24u);
  EXPECT_EQ(offsetof(dl::DLTensor, strides), 32u);
  EXPECT_EQ(offsetof(dl::DLTensor, byte_offset), 40u);
  EXPECT_EQ(sizeof(dl::DLManagedTensor), 64u);
  EXPECT_EQ(alignof(dl::DLManagedTensor), 8u);
  EXPECT_EQ(offsetof(dl::DLManagedTensor, dl_tensor), 0u);
  EXPECT_EQ(offsetof(dl::DLManagedTensor, manager_ctx), 48u);
  EXPECT_EQ(offsetof(dl::DLManagedTensor, deleter), 56u);
}

#if defined(GRADCOMP_TEST_HAVE_DLPACK)
// ---- against the installed dlpack.h ------------------------------------------------------------------
#define GRADCOMP_SAME_TYPE_LAYOUT(T)                                                                   \
  static_assert(sizeof(dl::T) == sizeof(::T) && alignof(dl::T) == alignof(::T), #T ": size or alignment")
#define GRADCOMP_SAME_FIELD(T, f)                                                                      \
  static_assert(offsetof(dl::T, f) == offsetof(::T, f) && sizeof(dl::T::f) == sizeof(::T::f) &&         \
                    alignof(decltype(dl::T::f)) == alignof(decltype(::T::f)),                          \
                #T "::" #f ": offset, size or alignment")
#define GRADCOMP_SAME_ENUM(e) static_assert(int64_t(dl::e) == int64_t(::e), #e)

GRADCOMP_SAME_TYPE_LAYOUT(DLDeviceType);
GRADCOMP_SAME_TYPE_LAYOUT(DLDataTypeCode);
GRADCOMP_SAME_TYPE_LAYOUT(DLDevice);
GRADCOMP_SAME_TYPE_LAYOUT(DLDataType);
GRADCOMP_SAME_TYPE_LAYOUT(DLTensor);
GRADCOMP_SAME_TYPE_LAYOUT(DLManagedTensor);
GRADCOMP_SAME_FIELD(DLDevice, device_type);
GRADCOMP_SAME_FIELD(DLDevice, device_id);
GRADCOMP_SAME_FIELD(DLDataType, code);
GRADCOMP_SAME_FIELD(DLDataType, bits);
GRADCOMP_SAME_FIELD(DLDataType, lanes);
GRADCOMP_SAME_FIELD(DLTensor, data);
GRADCOMP_SAME_FIELD(DLTensor, device);
GRADCOMP_SAME_FIELD(DLTensor, ndim);
GRADCOMP_SAME_FIELD(DLTensor, dtype);
GRADCOMP_SAME_FIELD(DLTensor, shape);
GRADCOMP_SAME_FIELD(DLTensor, strides);
GRADCOMP_SAME_FIELD(DLTensor, byte_offset);
GRADCOMP_SAME_FIELD(DLManagedTensor, dl_tensor);
GRADCOMP_SAME_FIELD(DLManagedTensor, manager_ctx);
GRADCOMP_SAME_FIELD(DLManagedTensor, deleter);
// the field types themselves (signedness included)
static_assert(std::is_same_v<decltype(dl::DLDevice::device_id), decltype(::DLDevice::device_id)>);
static_assert(std::is_same_v<decltype(dl::DLDataType::code), decltype(::DLDataType::code)>);
static_assert(std::is_same_v<decltype(dl::DLDataType::bits), decltype(::DLDataType::bits)>);
static_assert(std::is_same_v<decltype(dl::DLDataType::lanes), decltype(::DLDataType::lanes)>);
static_assert(std::is_same_v<decltype(dl::DLTensor::data), decltype(::DLTensor::data)>);
static_assert(std::is_same_v<decltype(dl::DLTensor::ndim), decltype(::DLTensor::ndim)>);
static_assert(std::is_same_v<decltype(dl::DLTensor::shape), decltype(::DLTensor::shape)>);
static_assert(std::is_same_v<decltype(dl::DLTensor::strides), decltype(::DLTensor::strides)>);
static_assert(std::is_same_v<decltype(dl::DLTensor::byte_offset), decltype(::DLTensor::byte_offset)>);
static_assert(std::is_same_v<decltype(dl::DLManagedTensor::manager_ctx), decltype(::DLManagedTensor::manager_ctx)>);

GRADCOMP_SAME_ENUM(kDLCPU);
GRADCOMP_SAME_ENUM(kDLCUDA);
GRADCOMP_SAME_ENUM(kDLCUDAHost);
GRADCOMP_SAME_ENUM(kDLOpenCL);
GRADCOMP_SAME_ENUM(kDLVulkan);
GRADCOMP_SAME_ENUM(kDLMetal);
GRADCOMP_SAME_ENUM(kDLVPI);
GRADCOMP_SAME_ENUM(kDLROCM);
GRADCOMP_SAME_ENUM(kDLROCMHost);
GRADCOMP_SAME_ENUM(kDLExtDev);
GRADCOMP_SAME_ENUM(kDLCUDAManaged);
GRADCOMP_SAME_ENUM(kDLInt);
GRADCOMP_SAME_ENUM(kDLUInt);
GRADCOMP_SAME_ENUM(kDLFloat);
GRADCOMP_SAME_ENUM(kDLOpaqueHandle);
GRADCOMP_SAME_ENUM(kDLBfloat);
GRADCOMP_SAME_ENUM(kDLComplex);
// Not in v0.6 (Debian's 0.6-1): kDLOneAPI, kDLWebGPU, kDLHexagon, kDLBool; compared from v0.8 on
// (DLPACK_VERSION 80; v1.x defines DLPACK_MAJOR_VERSION instead).
#if defined(DLPACK_MAJOR_VERSION) || (defined(DLPACK_VERSION) && DLPACK_VERSION >= 80)
GRADCOMP_SAME_ENUM(kDLOneAPI);
GRADCOMP_SAME_ENUM(kDLWebGPU);
GRADCOMP_SAME_ENUM(kDLHexagon);
GRADCOMP_SAME_ENUM(kDLBool);
#endif

TEST(DlpackAbi, MatchesInstalledHeader) {
#if defined(DLPACK_VERSION)
  // the version the bridge reports is that of the ABI it speaks; 0.6 to 0.8 share it
  EXPECT_GE(DLPACK_VERSION, dl::kDLPackVersion);
#endif
  EXPECT_EQ(sizeof(dl::DLDevice), sizeof(::DLDevice));
  EXPECT_EQ(sizeof(dl::DLDataType), sizeof(::DLDataType));
  EXPECT_EQ(sizeof(dl::DLTensor), sizeof(::DLTensor));
  EXPECT_EQ(sizeof(dl::DLManagedTensor), sizeof(::DLManagedTensor));
  EXPECT_EQ(offsetof(dl::DLTensor, byte_offset), offsetof(::DLTensor, byte_offset));
  EXPECT_EQ(offsetof(dl::DLManagedTensor, deleter), offsetof(::DLManagedTensor, deleter));
  // A producer's tensor read through gradcomp's structs (what the bridge does with a capsule).
  int64_t shape[2] = {3, 5}, strides[2] = {5, 1};
  static int deleted = 0;
  ::DLManagedTensor m{};
  m.dl_tensor.data = shape;
  m.dl_tensor.device = {::kDLCUDA, 3};
  m.dl_tensor.ndim = 2;
  m.dl_tensor.dtype = {::kDLBfloat, 16, 1};
  m.dl_tensor.shape = shape;
  m.dl_tensor.strides = strides;
  m.dl_tensor.byte_offset = 24;
  m.manager_ctx = &deleted;
  m.deleter = [](::DLManagedTensor* self) { ++*static_cast<int*>(self->manager_ctx); };
  const auto* g = reinterpret_cast<const dl::DLManagedTensor*>(static_cast<const void*>(&m));
  EXPECT_EQ(g->dl_tensor.data, static_cast<void*>(shape));
  EXPECT_EQ(g->dl_tensor.device.device_type, dl::kDLCUDA);
  EXPECT_EQ(g->dl_tensor.device.device_id, 3);
  EXPECT_EQ(g->dl_tensor.ndim, 2);
  EXPECT_EQ(g->dl_tensor.dtype.code, dl::kDLBfloat);
  EXPECT_EQ(g->dl_tensor.dtype.bits, 16);
  EXPECT_EQ(g->dl_tensor.dtype.lanes, 1);
  EXPECT_EQ(g->dl_tensor.shape[1], 5);
  EXPECT_EQ(g->dl_tensor.strides[0], 5);
  EXPECT_EQ(g->dl_tensor.byte_offset, 24u);
  EXPECT_EQ(g->manager_ctx, static_cast<void*>(&deleted));
  EXPECT_NE(g->deleter, nullptr);
}
#else
TEST(DlpackAbi, MatchesInstalledHeader) { GTEST_SKIP() << "dlpack/dlpack.h not installed: the spec's layout only"; }
#endif

} // namespace
