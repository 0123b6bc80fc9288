// SPDX-License-Identifier: Apache-2.0
// CPU helpers: static partitioning of an index range over OpenMP threads. The element tags are
// kernels/common/elem.hpp; a call's thread count comes from its plan (fixed once per call).
#pragma once

#include <algorithm>
#include <cstdint>

#include "../common/elem.hpp"

namespace gradcomp::detail::cpu {

using common::BF16;
using common::dispatch_float;
using common::F16;
using common::F32;

//! [begin, end) of part t of T equal contiguous parts of [0, n).
inline void partition(int64_t n, int T, int t, int64_t& begin, int64_t& end) {
  const int64_t q = n / T, rem = n % T;
  begin = t * q + std::min<int64_t>(t, rem);
  end = begin + q + (t < rem ? 1 : 0);
}

} // namespace gradcomp::detail::cpu
