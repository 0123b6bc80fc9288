// SPDX-License-Identifier: Apache-2.0
// The one set of element tags of gradcomp (both backends): load a gradient element as float32,
// store a float32 as the element (round to nearest even; NaN -> the canonical quiet NaN with its
// sign), and whether a stored element is non-finite. dispatch_float() maps a run-time DType to its
// tag; its default raises (a dtype switch never falls back silently to float32).
#pragma once

#include <cstdint>

#include "gradcomp/error.hpp"
#include "gradcomp/types.hpp"
#include "math.hpp"

namespace gradcomp::detail {
//! Out-of-line throws (kernels/core/runtime.cpp) for code compiled once per CPU variant: an inline
//! or template function that builds a message (detail::concat, std::ostringstream) would be
//! instantiated in every variant's object, and the linker keeps one copy for all, possibly the one
//! compiled with AVX-512 (kernels/cpu/isa.hpp; tests/check_portable.sh checks none is left).
[[noreturn]] void throw_not_gradient_dtype(const char* what, DType t);
//! Throws CorruptPacket with a printf-style message (integers only).
[[noreturn]] void throw_corrupt_packet(const char* fmt, ...);
} // namespace gradcomp::detail

namespace gradcomp::common {

struct F32 {
  using storage = float;
  static constexpr DType dtype = DType::float32;
  static GRADCOMP_HD float load(float v) { return v; }
  static GRADCOMP_HD float store(float v) { return v; }
  static GRADCOMP_HD bool nonfinite(float v) { return !is_finite_bits(float_bits(v)); }
};
struct F16 {
  using storage = uint16_t;
  static constexpr DType dtype = DType::float16;
  static GRADCOMP_HD float load(uint16_t v) { return half_bits_to_float(v); }
  static GRADCOMP_HD uint16_t store(float v) { return float_to_half_bits(v); }
  static GRADCOMP_HD bool nonfinite(uint16_t v) { return (v & 0x7C00u) == 0x7C00u; }
};
struct BF16 {
  using storage = uint16_t;
  static constexpr DType dtype = DType::bfloat16;
  static GRADCOMP_HD float load(uint16_t v) { return bf16_bits_to_float(v); }
  static GRADCOMP_HD uint16_t store(float v) { return float_to_bf16_bits(v); }
  static GRADCOMP_HD bool nonfinite(uint16_t v) { return (v & 0x7F80u) == 0x7F80u; }
};

//! Call f(Tag{}) with the tag of a gradient dtype (float32 / float16 / bfloat16). Host only.
//! Throws InvalidArgument naming `what` and the dtype for any other dtype.
template <class F> decltype(auto) dispatch_float(DType t, F&& f, const char* what = "dtype") {
  switch (t) {
    case DType::float32: return f(F32{});
    case DType::float16: return f(F16{});
    case DType::bfloat16: return f(BF16{});
    default: break;
  }
  detail::throw_not_gradient_dtype(what, t);
}

//! 0 / 1 / 2 for float32 / float16 / bfloat16 (the header's input dtype codes), -1 otherwise.
GRADCOMP_HD int gradient_code(DType t) {
  return t == DType::float32 ? 0 : t == DType::float16 ? 1 : t == DType::bfloat16 ? 2 : -1;
}

} // namespace gradcomp::common
