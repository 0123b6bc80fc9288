// SPDX-License-Identifier: Apache-2.0
//! @file error.hpp
//! Exceptions thrown by gradcomp. Every message names the failing call and
//! the offending values, and for bad arguments lists what is accepted.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace gradcomp {

//! Base class of every gradcomp exception.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
//! A bad argument: unknown codec or key, out-of-range value, wrong dtype/size/device/alignment.
//! Python: gradcomp.InvalidArgumentError (a ValueError).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};
//! A packet that does not match the codec, numel or spec, or carries an index out of range, out of
//! order or repeated. Python: gradcomp.CorruptPacketError (a ValueError).
class CorruptPacket : public Error {
 public:
  using Error::Error;
};
//! A valid request this build cannot serve, e.g. a CUDA tensor in a CPU-only build.
//! Python: gradcomp.UnsupportedError (a RuntimeError).
class Unsupported : public Error {
 public:
  using Error::Error;
};
//! A failed CUDA runtime call or launch. Python: gradcomp.CudaError (a RuntimeError).
class CudaError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class... Args> std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
} // namespace detail

} // namespace gradcomp

//! Throw ExcType with the streamed message parts when `cond` is false.
#define GRADCOMP_CHECK(cond, ExcType, ...)                                                        \
  do {                                                                                            \
    if (!(cond)) throw ::gradcomp::ExcType(::gradcomp::detail::concat(__VA_ARGS__));              \
  } while (0)
