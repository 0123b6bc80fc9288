// SPDX-License-Identifier: Apache-2.0
// dtype names, devices, the CPU thread setting and build_info.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "backend.hpp"
#include "family.hpp"
#include "gradcomp/error.hpp"
#include "gradcomp/types.hpp"
#include "spec.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#ifndef GRADCOMP_CUDA_ARCHS
#define GRADCOMP_CUDA_ARCHS ""
#endif
#ifndef GRADCOMP_CPU_VARIANTS
#define GRADCOMP_CPU_VARIANTS "generic"
#endif


namespace gradcomp {

std::string_view dtype_name(DType t) noexcept {
  switch (t) {
    case DType::float32: return "float32";
    case DType::float16: return "float16";
    case DType::bfloat16: return "bfloat16";
    case DType::float8_e4m3fn: return "float8_e4m3fn";
    case DType::float8_e5m2: return "float8_e5m2";
    case DType::int8: return "int8";
    case DType::uint8: return "uint8";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
    case DType::uint32: return "uint32";
    case DType::uint64: return "uint64";
    case DType::int4: return "int4";
    case DType::uint1: return "uint1";
    case DType::float8_e8m0fnu: return "float8_e8m0fnu";
    case DType::none: return "none";
  }
  return "unknown";
}

DType dtype_from_name(std::string_view name) {
  std::string list;
  for (int i = 0; i <= kMaxDTypeCode; ++i) {
    const auto t = static_cast<DType>(i);
    if (dtype_name(t) == name) return t;
    list += (i ? ", " : "") + std::string(dtype_name(t));
  }
  throw InvalidArgument(detail::concat("unknown dtype '", name, "'; accepted: ", list));
}

std::string to_string(Device d) {
  return d.kind == DeviceKind::cpu ? std::string("cpu") : "cuda:" + std::to_string(d.index);
}

namespace {
int openmp_default() {
#if defined(_OPENMP)
  return std::clamp(omp_get_max_threads(), 1, kMaxThreads);
#else
  return 1;
#endif
}
struct ThreadSetting {
  std::atomic<int> n{1};
  std::string env_error;           //!< a GRADCOMP_NUM_THREADS that is not an integer in range
  std::atomic<bool> env_bad{false}; //!< cleared by set_num_threads
  ThreadSetting() {
    n.store(openmp_default());
    if (const char* env = std::getenv("GRADCOMP_NUM_THREADS")) {
      char* end = nullptr;
      errno = 0;
      const long v = std::strtol(env, &end, 10);
      if (end != env && *end == '\0' && errno == 0 && v >= 1 && v <= kMaxThreads) {
        n.store(static_cast<int>(v));
      } else {
        env_error = detail::concat("GRADCOMP_NUM_THREADS='", detail::display(env, 40),
                                   "' is not an integer in [1, ", kMaxThreads,
                                   "]; unset it or set a thread count in that range (or call set_num_threads)");
        env_bad.store(true);
      }
    }
  }
};
ThreadSetting& thread_setting() {
  static ThreadSetting s;
  return s;
}
} // namespace

void set_num_threads(int n) {
  GRADCOMP_CHECK(n >= 1 && n <= kMaxThreads, InvalidArgument, "set_num_threads(", n,
                 "): the thread count must be in [1, ", kMaxThreads, "]");
  thread_setting().n.store(n);
  thread_setting().env_bad.store(false);
}
int get_num_threads() noexcept { return thread_setting().n.load(); }

namespace {
const char* isa_name(detail::CpuIsa i) {
  switch (i) {
    case detail::CpuIsa::avx512: return "avx512";
    case detail::CpuIsa::avx2: return "avx2";
    case detail::CpuIsa::native: return "native";
    default: return "generic";
  }
}
bool variant_built(std::string_view name) {
  const std::string_view all = GRADCOMP_CPU_VARIANTS;
  size_t at = 0;
  while (at <= all.size()) {
    const size_t comma = all.find(',', at);
    if (all.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at) == name) return true;
    if (comma == std::string_view::npos) break;
    at = comma + 1;
  }
  return false;
}
//! The best variant this processor supports among those built.
detail::CpuIsa best_isa() {
  if (variant_built("native")) return detail::CpuIsa::native;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (variant_built("avx512") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return detail::CpuIsa::avx512;
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;  // clang's builtin lacks "f16c"
  if (variant_built("avx2") && __builtin_cpu_supports("avx2") && f16c && __builtin_cpu_supports("bmi2") &&
      __builtin_cpu_supports("popcnt"))
    return detail::CpuIsa::avx2;
#endif
  return detail::CpuIsa::generic;
}
std::atomic<int>& isa_setting() {
  static std::atomic<int> v{[] {
    const detail::CpuIsa best = best_isa();
    if (const char* env = std::getenv("GRADCOMP_CPU_ISA")) {
      // a lower variant may be asked for (never one the processor lacks); unknown names are ignored here
      // and reported by set_cpu_isa when called with them
      for (detail::CpuIsa i : {detail::CpuIsa::avx512, detail::CpuIsa::avx2, detail::CpuIsa::generic})
        if (std::string_view(env) == isa_name(i) && int(i) >= int(best) && best != detail::CpuIsa::native)
          return int(i);
    }
    return int(best);
  }()};
  return v;
}
} // namespace

namespace detail {
CpuIsa cpu_isa() noexcept { return static_cast<CpuIsa>(isa_setting().load(std::memory_order_relaxed)); }
} // namespace detail

std::string cpu_isa() { return isa_name(detail::cpu_isa()); }

std::vector<std::string> cpu_isas_supported() {
  std::vector<std::string> out;
  const detail::CpuIsa best = best_isa();
  if (best == detail::CpuIsa::native) return {"native"};
  for (detail::CpuIsa i : {detail::CpuIsa::avx512, detail::CpuIsa::avx2, detail::CpuIsa::generic})
    if (int(i) >= int(best)) out.emplace_back(isa_name(i));
  return out;
}

void set_cpu_isa(std::string_view name) {
  const std::vector<std::string> ok = cpu_isas_supported();
  std::string list;
  for (const auto& o : ok) {
    if (o == name) {
      for (detail::CpuIsa i : {detail::CpuIsa::avx512, detail::CpuIsa::avx2, detail::CpuIsa::generic, detail::CpuIsa::native})
        if (name == isa_name(i)) isa_setting().store(int(i));
      return;
    }
    list += (list.empty() ? "" : ", ") + o;
  }
  throw InvalidArgument(detail::concat("set_cpu_isa('", detail::display(name, 40),
                                       "'): not a CPU kernel variant of this build that this processor runs; accepted: ",
                                       list));
}

BuildInfo build_info() {
  BuildInfo b;
  b.version = GRADCOMP_VERSION;
  b.cpu_isa = cpu_isa();
  b.cpu_variants = GRADCOMP_CPU_VARIANTS;
  b.blas = GRADCOMP_HAVE_BLAS ? "openblas" : "none";
  if (const detail::DeviceRuntime* rt = detail::cuda_runtime()) {
    b.cuda = true;
    b.cuda_architectures = GRADCOMP_CUDA_ARCHS;
    b.cuda_version = rt->version();
  }
#if defined(_OPENMP)
  b.openmp = true;
#endif
  return b;
}

namespace detail {

void throw_not_gradient_dtype(const char* what, DType t) {
  throw InvalidArgument(concat(what, " ", dtype_name(t), " is not a gradient dtype; accepted: float32, float16, bfloat16"));
}

void throw_corrupt_packet(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  throw CorruptPacket(buf);
}

namespace {
// Contention (issue: with another process holding one of two cores, OpenMP teams wait for the
// thread that shares a core, and 2 threads run far slower than 1). A kernel's team reports how far
// apart its threads started or finished their shares of a parallel region (note_team_skew); two
// regions in a row skewed by more than kSkewBusy mean a thread waits for a core, and the next calls
// run on one thread for kBusyHold, except every kProbeEvery-th call, which tries the full team
// again and clears the state when its threads keep together. Packets do not depend on the thread
// count, so this changes only the speed.
constexpr int64_t kSkewBusy = 1'000'000;    // 1 ms
constexpr int64_t kSkewQuiet = 200'000;     // 0.2 ms
constexpr int64_t kBusyHold = 500'000'000;  // 0.5 s
constexpr uint32_t kProbeEvery = 16;
constexpr uint32_t kSkewedToBusy = 2;  // consecutive skewed regions that mean a busy core
std::atomic<uint32_t> skewed_in_a_row{0};
std::atomic<int64_t> busy_until{0};
std::atomic<uint32_t> busy_calls{0};
std::atomic<bool> adaptive{[] {
  const char* e = std::getenv("GRADCOMP_ADAPTIVE_THREADS");
  return !(e && std::string_view(e) == "0");
}()};
int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
} // namespace

void note_team_skew(int threads, int64_t skew_ns) noexcept {
  if (threads <= 1 || !adaptive.load(std::memory_order_relaxed)) return;
  if (skew_ns > kSkewBusy) {
    // two skewed regions in a row (one alone is scheduler noise on a shared machine: bench/RESULTS.md,
    // section "kernels/core/runtime.cpp: one skewed region")
    if (skewed_in_a_row.fetch_add(1, std::memory_order_relaxed) + 1 >= kSkewedToBusy)
      busy_until.store(steady_ns() + kBusyHold, std::memory_order_relaxed);
  } else {
    skewed_in_a_row.store(0, std::memory_order_relaxed);
    if (skew_ns < kSkewQuiet) busy_until.store(0, std::memory_order_relaxed);
  }
}

int cpu_threads_for(int64_t n) {
  const ThreadSetting& t = thread_setting();
  if (t.env_bad.load()) throw InvalidArgument(t.env_error);
  if (n < (int64_t(1) << 16)) return 1;
  const int T = std::max(1, t.n.load());
  if (T > 1 && adaptive.load(std::memory_order_relaxed)) {
    const int64_t until = busy_until.load(std::memory_order_relaxed);
    if (until != 0 && steady_ns() < until && busy_calls.fetch_add(1, std::memory_order_relaxed) % kProbeEvery != 0)
      return 1;
  }
  return T;
}

int cpu_threads_max(int64_t n) { return n < (int64_t(1) << 16) ? 1 : std::max(1, thread_setting().n.load()); }

} // namespace detail

std::string cpu_threads_state() {
  const int64_t until = detail::busy_until.load();
  return until != 0 && detail::steady_ns() < until ? "contended" : "idle";
}

void set_adaptive_threads(bool on) noexcept {
  detail::adaptive.store(on);
  if (!on) detail::busy_until.store(0);
}

namespace detail {

void check_numel_dtype(int64_t numel, DType dtype, const char* call) {
  GRADCOMP_CHECK(numel >= 0 && numel < kMaxNumel, InvalidArgument, call, ": numel ", numel,
                 " is out of range; accepted: 0 <= numel < 2^56");
  GRADCOMP_CHECK(is_gradient_dtype(dtype), InvalidArgument, call, ": dtype ", dtype_name(dtype),
                 " is not accepted; accepted: float32, float16, bfloat16");
}

} // namespace detail
} // namespace gradcomp
