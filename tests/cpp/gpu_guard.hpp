// SPDX-License-Identifier: Apache-2.0
// The CUDA tests' guard and their bitwise comparisons (first_diff, first_diff_f): without a GPU every test skips, unless GRADCOMP_REQUIRE_GPU=1
// (tests/gpu/run.sh sets it on the GPU machine, so that a run cannot pass empty): then it fails.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace gradcomp_test {

inline bool has_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

inline bool gpu_required() {
  const char* e = std::getenv("GRADCOMP_REQUIRE_GPU");
  return e != nullptr && std::string(e) == "1";
}

//! GRADCOMP_TEST_SMALL=1: the CUDA sweeps keep their small cases only (inputs of at most 70001
//! elements, the smallest low rank matrices) and the huge-input tests skip, so that a run under
//! compute-sanitizer (GRADCOMP_TEST_SMALL=1 compute-sanitizer --tool memcheck gradcomp_cuda_tests
//! --gtest_filter='CudaBlockQ.*:CudaOnebit.*:CudaLowrank.*') finishes in about a minute.
inline bool small_sizes() {
  const char* e = std::getenv("GRADCOMP_TEST_SMALL");
  return e != nullptr && std::string(e) == "1";
}
//! The largest input the sweeps keep under GRADCOMP_TEST_SMALL=1.
inline constexpr int64_t kSmallMaxNumel = 70001;

//! Index of the first differing byte, or -1 (sizes that differ: the shorter size).
inline int64_t first_diff(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return int64_t(std::min(a.size(), b.size()));
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return int64_t(i);
  return -1;
}

//! Index of the first float whose bits differ (NaN payloads and -0.0 included), or -1.
inline int64_t first_diff_f(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return int64_t(std::min(a.size(), b.size()));
  for (size_t i = 0; i < a.size(); ++i) {
    uint32_t x, y;
    std::memcpy(&x, &a[i], 4);
    std::memcpy(&y, &b[i], 4);
    if (x != y) return int64_t(i);
  }
  return -1;
}

} // namespace gradcomp_test

#define REQUIRE_GPU()                                                                              \
  do {                                                                                             \
    if (!::gradcomp_test::has_gpu()) {                                                             \
      if (::gradcomp_test::gpu_required()) FAIL() << "GRADCOMP_REQUIRE_GPU=1 but cudaGetDeviceCount reports no device"; \
      GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";                          \
    }                                                                                              \
  } while (0)
