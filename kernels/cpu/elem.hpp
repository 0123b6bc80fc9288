// SPDX-License-Identifier: Apache-2.0
// CPU helpers: element load/store by dtype, the thread count for a loop, and static partitioning.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../common/math.hpp"
#include "gradcomp/types.hpp"

namespace gradcomp::detail::cpu {

struct F32 {
  using storage = float;
  static constexpr DType dtype = DType::float32;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
  static bool nonfinite(float v) { return !common::is_finite_bits(common::float_bits(v)); }
};
struct F16 {
  using storage = uint16_t;
  static constexpr DType dtype = DType::float16;
  static float load(uint16_t v) { return common::half_bits_to_float(v); }
  static uint16_t store(float v) { return common::float_to_half_bits(v); }
  static bool nonfinite(uint16_t v) { return (v & 0x7C00u) == 0x7C00u; }
};
struct BF16 {
  using storage = uint16_t;
  static constexpr DType dtype = DType::bfloat16;
  static float load(uint16_t v) { return common::bf16_bits_to_float(v); }
  static uint16_t store(float v) { return common::float_to_bf16_bits(v); }
  static bool nonfinite(uint16_t v) { return (v & 0x7F80u) == 0x7F80u; }
};

//! Call f(Tag{}) with the tag type of a gradient dtype (float32/float16/bfloat16).
template <class F> decltype(auto) dispatch_float(DType t, F&& f) {
  switch (t) {
    case DType::float16: return f(F16{});
    case DType::bfloat16: return f(BF16{});
    default: return f(F32{});
  }
}

//! Threads for a loop over n elements: 1 below 64 Ki elements, else gradcomp::get_num_threads().
inline int threads_for(int64_t n) {
  return n < (int64_t(1) << 16) ? 1 : std::max(1, get_num_threads());
}

//! [begin, end) of part t of T equal contiguous parts of [0, n).
inline void partition(int64_t n, int T, int t, int64_t& begin, int64_t& end) {
  const int64_t q = n / T, rem = n % T;
  begin = t * q + std::min<int64_t>(t, rem);
  end = begin + q + (t < rem ? 1 : 0);
}

} // namespace gradcomp::detail::cpu
