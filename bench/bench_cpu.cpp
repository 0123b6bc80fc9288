// SPDX-License-Identifier: Apache-2.0
// CPU kernel benchmarks (Google Benchmark) on 2^24 elements at 1 and 2 threads
// (gradcomp::set_num_threads), next to a memcpy of the same buffer in the same run:
//   encode, with and without error feedback: top-k (k = 1% and 0.1%) and the fp16 / bf16 casts of
//     float32; the block quantizers fp8 (e4m3 and e5m2, block 128; e4m3 with e8m0 scales, block
//     32), int8 and int4 (block 128), and onebit (one l2 scale) of float32 and bfloat16 input;
//   decode (replace, into the input's dtype): the same codecs, float32 and bfloat16;
//   lowrank::project (P = M Q) and back_project (Q = M^T P) of PowerSGD (gradcomp/lowrank.hpp) at
//     ranks 1 (OpenBLAS sgemv), 2..16 (gradcomp's kernels) and 32 (OpenBLAS sgemm), on batches
//     of 1 and 8 matrices of 4096 x 4096, 1024 x 25088 (a VGG fc layer) and 2048 x 512.
//
// Every benchmark reports bytes_per_second from the compulsory traffic (encode: x read, packet
// written, residual read and written; decode: packet read, out written; project / back_project:
// M, Q and P each read or written once), and the counters
//   GBps       the same figure in 1e9 bytes/s,
//   copy_GBps  what the most recent memcpy run measured at the same thread count (bytes read +
//              written; with --benchmark_repetitions, the last repetition's figure),
//   of_copy    GBps / copy_GBps: the fraction of copy bandwidth the kernel reaches.
// Run e.g.: ./bench_cpu --benchmark_min_time=1 (the memcpy benchmarks are registered first, so
// their figures are known when the kernels run; a --benchmark_filter that drops them leaves
// copy_GBps at 0).
// Inputs are normal(0, 1) float32 from a fixed seed (bfloat16: the same values, truncated). Times are measured manually around the
// encode call only (the residual is restored between iterations outside the timed region, so the
// CPU column of the residual runs includes that copy while Time does not).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"
#include "gradcomp/lowrank.hpp"

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

// The same input as bfloat16 (the top 16 bits of each float32: a truncation, good enough here).
const std::vector<uint16_t>& input_bf16() {
  static const std::vector<uint16_t> x = [] {
    std::vector<uint16_t> v(input().size());
    for (size_t i = 0; i < v.size(); ++i) {
      uint32_t b;
      std::memcpy(&b, &input()[i], 4);
      v[i] = uint16_t(b >> 16);
    }
    return v;
  }();
  return x;
}
gradcomp::DType dtype_arg(int64_t a) { return a == 0 ? gradcomp::DType::float32 : gradcomp::DType::bfloat16; }
void* input_ptr(gradcomp::DType t) {
  return t == gradcomp::DType::float32 ? static_cast<void*>(const_cast<float*>(input().data()))
                                       : static_cast<void*>(const_cast<uint16_t*>(input_bf16().data()));
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

// encode of kN elements with `spec`; args: threads, residual (0/1), input dtype (0 float32, 1 bfloat16).
void run_encode(benchmark::State& state, const std::string& spec) {
  const int threads = int(state.range(0));
  const bool with_res = state.range(1) != 0;
  const gradcomp::DType t = dtype_arg(state.range(2));
  gradcomp::set_num_threads(threads);
  auto codec = gradcomp::Codec::create(spec);
  state.SetLabel(std::string(codec->spec()) + " " + std::string(gradcomp::dtype_name(t)));
  const int64_t pb = codec->packet_bytes(kN, t);
  const int64_t wb = codec->workspace_bytes(kN, t, {});
  Buf packet = alloc(pb), ws = alloc(wb), res = alloc(kN * 4);
  const gradcomp::Tensor x{input_ptr(t), t, kN, {}};
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
  const double bytes = double(kN) * double(gradcomp::dtype_size(t)) + double(pb) + (with_res ? double(kN) * 8 : 0.0);
  state.counters["packet_bytes"] = double(pb);
  report(state, threads, bytes, total);
}

// decode (replace) of a packet of kN elements into the input's dtype; args: threads, dtype.
void run_decode(benchmark::State& state, const std::string& spec) {
  const int threads = int(state.range(0));
  const gradcomp::DType t = dtype_arg(state.range(1));
  gradcomp::set_num_threads(threads);
  auto codec = gradcomp::Codec::create(spec);
  state.SetLabel(std::string(codec->spec()) + " -> " + std::string(gradcomp::dtype_name(t)));
  const int64_t pb = codec->packet_bytes(kN, t);
  const int64_t wb = codec->workspace_bytes(kN, t, {});
  const int64_t eb = gradcomp::dtype_size(t);
  Buf packet = alloc(pb), ws = alloc(wb), out = alloc(kN * eb);
  const gradcomp::Tensor x{input_ptr(t), t, kN, {}};
  const gradcomp::Tensor pt{packet.get(), gradcomp::DType::uint8, pb, {}};
  const gradcomp::Tensor wt{ws.get(), gradcomp::DType::uint8, wb, {}};
  const gradcomp::Tensor ot{out.get(), t, kN, {}};
  codec->encode(x, nullptr, pt, wt);
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    codec->decode(pt, ot, wt);
    benchmark::ClobberMemory();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    total += s;
    state.SetIterationTime(s);
  }
  state.counters["packet_bytes"] = double(pb);
  report(state, threads, double(pb) + double(kN) * double(eb), total);
}

void BM_TopK_1pct(benchmark::State& s) { run_encode(s, "topk:ratio=0.01"); }
void BM_TopK_0p1pct(benchmark::State& s) { run_encode(s, "topk:ratio=0.001"); }
void BM_Cast_fp16(benchmark::State& s) { run_encode(s, "fp16"); }
void BM_Cast_bf16(benchmark::State& s) { run_encode(s, "bf16"); }

const char* const kQuant[] = {"fp8:format=e4m3", "fp8:format=e5m2", "fp8:scale=e8m0", "int8", "int4", "onebit"};
constexpr int kQuantCodecs = int(sizeof(kQuant) / sizeof(kQuant[0]));
void BM_Quant_Encode(benchmark::State& s) { run_encode(s, kQuant[s.range(3)]); }
void BM_Quant_Decode(benchmark::State& s) { run_decode(s, kQuant[s.range(2)]); }

// lowrank::project (op 0) or back_project (op 1) of `count` float32 matrices of one shape, stored
// back to back (M: the shared input, repeated); args: threads, rank, shape, count, op.
constexpr int64_t kLowrankShapes[][2] = {{4096, 4096}, {1024, 25088}, {2048, 512}};
void BM_Lowrank(benchmark::State& state) {
  const int threads = int(state.range(0));
  const int64_t rank = state.range(1), rows = kLowrankShapes[state.range(2)][0], cols = kLowrankShapes[state.range(2)][1];
  const int64_t count = state.range(3);
  const bool back = state.range(4) != 0;
  gradcomp::set_num_threads(threads);
  state.SetLabel(std::string(back ? "back_project " : "project ") + std::to_string(count) + " x " +
                 std::to_string(rows) + "x" + std::to_string(cols) + " rank " + std::to_string(rank));
  const int64_t n = count * rows * cols, nq = count * cols * rank, np = count * rows * rank;
  Buf m = alloc(n * 4), q = alloc(nq * 4), p = alloc(np * 4);
  const auto fill = [](uint8_t* dst, int64_t elems) {
    for (int64_t e = 0; e < elems; e += kN)
      std::memcpy(dst + e * 4, input().data(), size_t(std::min(kN, elems - e)) * 4);
  };
  fill(m.get(), n);
  fill(back ? p.get() : q.get(), back ? np : nq);
  std::vector<int64_t> offsets(static_cast<size_t>(count));
  for (int64_t b = 0; b < count; ++b) offsets[size_t(b)] = b * rows * cols;
  const gradcomp::lowrank::MatrixBatch mb{{m.get(), gradcomp::DType::float32, n, {}}, offsets.data(), count, rows, cols};
  const gradcomp::Tensor qt{q.get(), gradcomp::DType::float32, nq, {}}, pt{p.get(), gradcomp::DType::float32, np, {}};
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    if (back) gradcomp::lowrank::back_project(mb, pt, qt, rank);
    else gradcomp::lowrank::project(mb, qt, pt, rank);
    benchmark::ClobberMemory();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    total += s;
    state.SetIterationTime(s);
  }
  report(state, threads, double(n + nq + np) * 4.0, total);
}
void lowrank_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"threads", "rank", "shape", "count", "back"});
  for (int op : {0, 1})
    for (int shape = 0; shape < 3; ++shape)
      for (int count : {1, 8})
        for (int rank : {1, 2, 4, 8, 16, 32})
          for (int t : {1, 2}) b->Args({t, rank, shape, count, op});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

void thread_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"threads", "residual", "bf16"});
  for (int t : {1, 2})
    for (int r : {0, 1}) b->Args({t, r, 0});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}
void quant_encode_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"threads", "residual", "bf16", "codec"});
  for (int c = 0; c < kQuantCodecs; ++c)
    for (int d : {0, 1})
      for (int t : {1, 2})
        for (int r : {0, 1}) b->Args({t, r, d, c});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}
void quant_decode_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"threads", "bf16", "codec"});
  for (int c = 0; c < kQuantCodecs; ++c)
    for (int d : {0, 1})
      for (int t : {1, 2}) b->Args({t, d, c});
  b->UseManualTime()->Unit(benchmark::kMillisecond);
}

} // namespace

BENCHMARK(BM_Memcpy)->ArgName("threads")->Arg(1)->Arg(2)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TopK_1pct)->Apply(thread_args);
BENCHMARK(BM_TopK_0p1pct)->Apply(thread_args);
BENCHMARK(BM_Cast_fp16)->Apply(thread_args);
BENCHMARK(BM_Cast_bf16)->Apply(thread_args);
BENCHMARK(BM_Quant_Encode)->Apply(quant_encode_args);
BENCHMARK(BM_Quant_Decode)->Apply(quant_decode_args);
BENCHMARK(BM_Lowrank)->Apply(lowrank_args);

BENCHMARK_MAIN();
