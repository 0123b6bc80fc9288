// SPDX-License-Identifier: Apache-2.0
// CPU kernel benchmarks (Google Benchmark): top-k (k = 1% and 0.1%, with and without error
// feedback) and the fp16 / bf16 casts of 2^24 float32 values, at 1 and 2 threads
// (gradcomp::set_num_threads), next to a memcpy of the same buffer in the same run.
//
// Every benchmark reports bytes_per_second from the compulsory traffic (x read, packet written,
// residual read and written), and the counters
//   GBps       the same figure in 1e9 bytes/s,
//   copy_GBps  what the most recent memcpy run measured at the same thread count (bytes read +
//              written; with --benchmark_repetitions, the last repetition's figure),
//   of_copy    GBps / copy_GBps: the fraction of copy bandwidth the kernel reaches.
// Run e.g.: ./bench_cpu --benchmark_min_time=1 (the memcpy benchmarks are registered first, so
// their figures are known when the kernels run; a --benchmark_filter that drops them leaves
// copy_GBps at 0).
// Inputs are normal(0, 1) float32 from a fixed seed. Times are measured manually around the
// encode call only (the residual is restored between iterations outside the timed region, so the
// CPU column of the residual runs includes that copy while Time does not).
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

constexpr int64_t kN = int64_t(1) << 24;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buf = std::unique_ptr<uint8_t[], FreeDeleter>;

Buf alloc(int64_t bytes) {
  const size_t sz = size_t((bytes + 4095) / 4096 * 4096);
  Buf b(static_cast<uint8_t*>(std::aligned_alloc(4096, sz)));
  std::memset(b.get(), 0, sz);  // touch every page before timing
  return b;
}

// The shared input: kN normal(0, 1) float32 values from a fixed seed, and a residual.
const std::vector<float>& input() {
  static const std::vector<float> x = [] {
    std::vector<float> v(static_cast<size_t>(kN));
    std::mt19937_64 g(20240601);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& f : v) f = nd(g);
    return v;
  }();
  return x;
}
const std::vector<float>& residual0() {
  static const std::vector<float> r = [] {
    std::vector<float> v(static_cast<size_t>(kN));
    std::mt19937_64 g(7);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (auto& f : v) f = nd(g);
    return v;
  }();
  return r;
}

std::map<int, double>& copy_gbps() {
  static std::map<int, double> m;
  return m;
}

void report(benchmark::State& state, int threads, double bytes_per_iter, double seconds) {
  const double iters = double(state.iterations());
  state.SetBytesProcessed(int64_t(bytes_per_iter * iters));
  const double gbps = seconds > 0 ? bytes_per_iter * iters / seconds / 1e9 : 0.0;
  const double copy = copy_gbps().count(threads) ? copy_gbps()[threads] : 0.0;
  state.counters["GBps"] = gbps;
  state.counters["copy_GBps"] = copy;
  state.counters["of_copy"] = copy > 0 ? gbps / copy : 0.0;
  state.counters["threads"] = threads;
}

using Clock = std::chrono::steady_clock;

// memcpy of kN float32 (64 MiB), split over `threads` OpenMP threads. Bytes = read + written.
void BM_Memcpy(benchmark::State& state) {
  const int threads = int(state.range(0));
  const int64_t bytes = kN * 4;
  Buf src = alloc(bytes), dst = alloc(bytes);
  std::memcpy(src.get(), input().data(), size_t(bytes));
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; ++t) {
      const int64_t b = bytes / threads * t, e = t + 1 == threads ? bytes : bytes / threads * (t + 1);
      std::memcpy(dst.get() + b, src.get() + b, size_t(e - b));
    }
    benchmark::ClobberMemory();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    total += s;
    state.SetIterationTime(s);
  }
  copy_gbps()[threads] = total > 0 ? 2.0 * double(bytes) * double(state.iterations()) / total / 1e9 : 0.0;
  report(state, threads, 2.0 * double(bytes), total);
}

// encode of kN float32 with `spec`; args: threads, residual (0/1).
void run_encode(benchmark::State& state, const std::string& spec) {
  const int threads = int(state.range(0));
  const bool with_res = state.range(1) != 0;
  gradcomp::set_num_threads(threads);
  auto codec = gradcomp::Codec::create(spec);
  const int64_t pb = codec->packet_bytes(kN, gradcomp::DType::float32);
  const int64_t wb = codec->workspace_bytes(kN, gradcomp::DType::float32, {});
  Buf packet = alloc(pb), ws = alloc(wb), res = alloc(kN * 4);
  const gradcomp::Tensor x{const_cast<float*>(input().data()), gradcomp::DType::float32, kN, {}};
  const gradcomp::Tensor pt{packet.get(), gradcomp::DType::uint8, pb, {}};
  const gradcomp::Tensor wt{ws.get(), gradcomp::DType::uint8, wb, {}};
  const gradcomp::Tensor rt{res.get(), gradcomp::DType::float32, kN, {}};
  double total = 0;
  for (auto _ : state) {
    if (with_res) std::memcpy(res.get(), residual0().data(), size_t(kN) * 4);  // untimed
    const auto t0 = Clock::now();
    codec->encode(x, with_res ? &rt : nullptr, pt, wt);
    benchmark::ClobberMemory();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    total += s;
    state.SetIterationTime(s);
  }
  // compulsory traffic: x read, packet written, residual read and written
  const double bytes = double(kN) * 4 + double(pb) + (with_res ? double(kN) * 8 : 0.0);
  state.counters["packet_bytes"] = double(pb);
  report(state, threads, bytes, total);
}

void BM_TopK_1pct(benchmark::State& s) { run_encode(s, "topk:ratio=0.01"); }
void BM_TopK_0p1pct(benchmark::State& s) { run_encode(s, "topk:ratio=0.001"); }
void BM_Cast_fp16(benchmark::State& s) { run_encode(s, "fp16"); }
void BM_Cast_bf16(benchmark::State& s) { run_encode(s, "bf16"); }

void thread_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"threads", "residual"});
  for (int t : {1, 2})
    for (int r : {0, 1}) b->Args({t, r});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

} // namespace

BENCHMARK(BM_Memcpy)->ArgName("threads")->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TopK_1pct)->Apply(thread_args);
BENCHMARK(BM_TopK_0p1pct)->Apply(thread_args);
BENCHMARK(BM_Cast_fp16)->Apply(thread_args);
BENCHMARK(BM_Cast_bf16)->Apply(thread_args);

BENCHMARK_MAIN();
