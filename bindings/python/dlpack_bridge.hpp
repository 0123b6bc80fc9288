// SPDX-License-Identifier: Apache-2.0
// DLPack bridge (docs/contracts.md section 6): turns any object with __dlpack__ (torch, numpy, ...) into a
// zero-copy gradcomp::Tensor view. Calls __dlpack__(stream=...) without max_version, accepts only
// legacy "dltensor" capsules (DLPack 0.6 to 0.8's ABI, dlpack_abi.hpp), renames them "used_dltensor"
// and calls their deleter when the view is released.
#pragma once

#include <pybind11/pybind11.h>

#include <sstream>
#include <string>

#include "dlpack_abi.hpp"
#include "gradcomp/gradcomp.hpp"

namespace gradcomp::python {

namespace py = pybind11;

//! Owns a consumed dlpack::DLManagedTensor and calls its deleter exactly once.
class DLOwner {
 public:
  DLOwner() = default;
  DLOwner(const DLOwner&) = delete;
  DLOwner& operator=(const DLOwner&) = delete;
  DLOwner(DLOwner&& o) noexcept : m_(o.m_) { o.m_ = nullptr; }
  ~DLOwner() {
    if (m_ && m_->deleter) m_->deleter(m_);
  }
  dlpack::DLManagedTensor* m_ = nullptr;
};

inline std::string shape_str(const int64_t* v, int n) {
  std::ostringstream os;
  os << "(";
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << v[i];
  os << (n == 1 ? ",)" : ")");
  return os.str();
}

inline DType dtype_from_dl(dlpack::DLDataType t, const char* what) {
  if (t.lanes == 1) {
    if (t.code == dlpack::kDLFloat && t.bits == 32) return DType::float32;
    if (t.code == dlpack::kDLFloat && t.bits == 16) return DType::float16;
    if (t.code == dlpack::kDLBfloat && t.bits == 16) return DType::bfloat16;
    if (t.code == dlpack::kDLUInt && t.bits == 8) return DType::uint8;
    if (t.code == dlpack::kDLInt && t.bits == 8) return DType::int8;
    if (t.code == dlpack::kDLInt && t.bits == 32) return DType::int32;
    if (t.code == dlpack::kDLInt && t.bits == 64) return DType::int64;
    if (t.code == dlpack::kDLUInt && t.bits == 32) return DType::uint32;
    if (t.code == dlpack::kDLUInt && t.bits == 64) return DType::uint64;
    if (t.code == dlpack::kDLUInt && t.bits == 16) return DType::none;  // only with a dtype override (bfloat16 numpy)
  }
  throw InvalidArgument(detail::concat(what, ": DLPack dtype (code ", int(t.code), ", bits ", int(t.bits), ", lanes ",
                                       int(t.lanes),
                                       ") is not supported; accepted: float32, float16, bfloat16, uint8, int8, int32, "
                                       "int64, uint32, uint64"));
}

//! View `obj` as a flat C-contiguous gradcomp::Tensor. `stream` is the CUDA stream the caller will
//! use (passed to __dlpack__ for CUDA producers). `override_dtype` reinterprets a uint16 tensor
//! (numpy arrays of ml_dtypes.bfloat16 cannot be exported through DLPack, so Python passes a
//! uint16 view and "bfloat16").
inline Tensor from_dlpack(py::handle obj, DLOwner& owner, const char* what, intptr_t stream,
                          DType override_dtype = DType::none) {
  if (!py::hasattr(obj, "__dlpack__") || !py::hasattr(obj, "__dlpack_device__"))
    throw InvalidArgument(detail::concat(what, ": expected a tensor with __dlpack__ (torch.Tensor, numpy.ndarray, ...), got ",
                                         std::string(py::str(py::type::of(obj).attr("__name__")))));
  py::tuple dev = obj.attr("__dlpack_device__")();
  const int dev_type = dev[0].cast<int>();
  py::object cap;
  try {
    if (dev_type == dlpack::kDLCUDA) cap = obj.attr("__dlpack__")(py::arg("stream") = stream == 0 ? 1 : stream);
    else cap = obj.attr("__dlpack__")();
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_BufferError)) {
      // Only a read-only array gets the read-only hint (an ml_dtypes.bfloat16 residual, say, fails
      // here too, for its dtype).
      bool read_only = false;
      try {
        read_only = py::hasattr(obj, "flags") && !obj.attr("flags").attr("writeable").cast<bool>();
      } catch (py::error_already_set&) {
      }
      throw InvalidArgument(detail::concat(
          what, ": cannot take the array through DLPack: ", e.what(),
          read_only ? " (a read-only numpy array cannot be exported through legacy DLPack; pass a writable array, "
                      "e.g. a.copy())"
                    : ""));
    }
    throw;
  }
  PyObject* c = cap.ptr();
  if (!PyCapsule_IsValid(c, "dltensor"))
    throw InvalidArgument(detail::concat(what, ": __dlpack__ returned a capsule that is not an unused legacy 'dltensor'"));
  auto* m = static_cast<dlpack::DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
  PyCapsule_SetName(c, "used_dltensor");
  owner.m_ = m;
  const dlpack::DLTensor& t = m->dl_tensor;

  Tensor out;
  DType dt = dtype_from_dl(t.dtype, what);
  if (dt == DType::none) {
    if (override_dtype == DType::none)
      throw InvalidArgument(detail::concat(what, ": dtype uint16 is not supported; accepted: float32, float16, bfloat16"));
    dt = override_dtype;
  }
  out.dtype = dt;
  int64_t numel = 1;
  for (int i = 0; i < t.ndim; ++i) numel *= t.shape[i];
  out.numel = numel;
  if (t.strides != nullptr && numel > 1) {
    int64_t expect = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && t.strides[i] != expect)
        throw InvalidArgument(detail::concat(what, ": tensor of shape ", shape_str(t.shape, t.ndim), " has strides ",
                                             shape_str(t.strides, t.ndim),
                                             " (in elements) and is not C-contiguous; pass a contiguous tensor "
                                             "(e.g. .contiguous())"));
      expect *= t.shape[i];
    }
  }
  out.data = t.data ? static_cast<char*>(t.data) + t.byte_offset : nullptr;
  switch (t.device.device_type) {
    case dlpack::kDLCPU:
    case dlpack::kDLCUDAHost: out.device = {DeviceKind::cpu, 0}; break;
    case dlpack::kDLCUDA: out.device = {DeviceKind::cuda, t.device.device_id}; break;
    default:
      throw Unsupported(detail::concat(what, ": DLPack device type ", int(t.device.device_type),
                                       " is not supported; accepted: CPU, CUDA"));
  }
  return out;
}

} // namespace gradcomp::python
