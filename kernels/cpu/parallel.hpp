// SPDX-License-Identifier: Apache-2.0
// CPU helpers: static partitioning of an index range over OpenMP threads. The element tags are
// kernels/common/elem.hpp; a call's thread count comes from its plan (fixed once per call).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "../common/elem.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace gradcomp::detail {
//! A team of `threads` threads started a parallel region `skew_ns` apart (core/runtime.cpp).
void note_team_skew(int threads, int64_t skew_ns) noexcept;
} // namespace gradcomp::detail

namespace gradcomp::detail::cpu {

using common::BF16;
using common::dispatch_float;
using common::F16;
using common::F32;

//! This thread's number in its OpenMP team, and the team's size (0 and 1 outside a region or
//! without OpenMP).
inline int thread_id() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}
inline int team_size() {
#if defined(_OPENMP)
  return omp_get_num_threads();
#else
  return 1;
#endif
}

//! [begin, end) of part t of T equal contiguous parts of [0, n).
inline void partition(int64_t n, int T, int t, int64_t& begin, int64_t& end) {
  const int64_t q = n / T, rem = n % T;
  begin = t * q + std::min<int64_t>(t, rem);
  end = begin + q + (t < rem ? 1 : 0);
}

namespace {
//! When the threads of a team start and finish their equal shares of a parallel region: the larger
//! spread (a thread that waited for a core, or lost it midway: another process holds it) goes to
//! note_team_skew (core/runtime.cpp), which then runs the next calls on one thread for a while
//! (cpu_threads_for). Local to each file (anonymous namespace): the file is compiled once per CPU
//! variant.
class TeamClock {
 public:
  void arrive() { stamp(start_); }  //!< each thread, first thing in the region
  void finish() { stamp(end_); }    //!< each thread, after its share, before the region's barrier
  //! After the region: report the skew of a team of T threads (nothing for T == 1).
  void report(int T) const {
    if (T > 1) note_team_skew(T, std::max(start_.spread(), end_.spread()));
  }

 private:
  struct Span {
    std::atomic<int64_t> first{INT64_MAX}, last{INT64_MIN};
    int64_t spread() const {
      const int64_t f = first.load(), l = last.load();
      return l >= f ? l - f : 0;
    }
  };
  static void stamp(Span& s) {
    const int64_t t = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
    int64_t f = s.first.load(std::memory_order_relaxed);
    while (t < f && !s.first.compare_exchange_weak(f, t, std::memory_order_relaxed)) {
    }
    int64_t l = s.last.load(std::memory_order_relaxed);
    while (t > l && !s.last.compare_exchange_weak(l, t, std::memory_order_relaxed)) {
    }
  }
  Span start_, end_;
};
} // namespace

} // namespace gradcomp::detail::cpu
