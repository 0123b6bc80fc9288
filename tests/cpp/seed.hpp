// SPDX-License-Identifier: Apache-2.0
// The one seed of the C++ tests' random inputs (tests/cpp and the CUDA tests; the fuzz seed
// corpus generator tests/fuzz/fuzz_seeds.cpp keeps its own fixed generator, its files must not
// move). Every generator of a test is seeded from ref::test_seed() (plus a constant per test, so
// that tests draw different values):
//   * fixed by default: 0, so that two runs draw the same values (and the default run is the one
//     CI has run);
//   * overridable: GRADCOMP_TEST_SEED=N (a decimal uint64) draws other values, e.g.
//       GRADCOMP_TEST_SEED=12345 ctest --test-dir build/quick -R TopK
//     (a value that is not a decimal uint64 fails the tests that use it, naming it);
//   * printed: once per process, on first use, as "gradcomp tests: GRADCOMP_TEST_SEED=N", and in
//     the SCOPED_TRACE of the tests that draw values, so that a failing run can be repeated.
// Header-only, no library or GoogleTest dependency (nvcc compiles it for the CUDA tests too).
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace ref {

inline constexpr uint64_t kDefaultTestSeed = 0;

//! GRADCOMP_TEST_SEED if set (a decimal uint64), else kDefaultTestSeed; printed on first use.
inline uint64_t test_seed() {
  static const uint64_t s = [] {
    uint64_t v = kDefaultTestSeed;
    const char* e = std::getenv("GRADCOMP_TEST_SEED");
    if (e != nullptr && *e != '\0') {
      char* end = nullptr;
      errno = 0;
      const unsigned long long x = std::strtoull(e, &end, 10);
      if (*e < '0' || *e > '9' || *end != '\0' || errno == ERANGE)
        throw std::invalid_argument(std::string("GRADCOMP_TEST_SEED='") + e + "' is not a decimal uint64");
      v = uint64_t(x);
    }
    std::printf("gradcomp tests: GRADCOMP_TEST_SEED=%llu (%s)\n", static_cast<unsigned long long>(v),
                e != nullptr && *e != '\0' ? "from the environment" : "the default; set GRADCOMP_TEST_SEED to change it");
    std::fflush(stdout);
    return v;
  }();
  return s;
}

} // namespace ref
