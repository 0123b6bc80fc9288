// SPDX-License-Identifier: Apache-2.0
// The CUDA tests' guard: without a GPU every test skips, unless GRADCOMP_REQUIRE_GPU=1
// (tests/gpu/run.sh sets it on the GPU machine, so that a run cannot pass empty): then it fails.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

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

} // namespace gradcomp_test

#define REQUIRE_GPU()                                                                              \
  do {                                                                                             \
    if (!::gradcomp_test::has_gpu()) {                                                             \
      if (::gradcomp_test::gpu_required()) FAIL() << "GRADCOMP_REQUIRE_GPU=1 but cudaGetDeviceCount reports no device"; \
      GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount reports none)";                          \
    }                                                                                              \
  } while (0)
