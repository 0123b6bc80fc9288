// SPDX-License-Identifier: Apache-2.0
// Google Benchmark of the CUDA codecs (none / fp16 / bf16 encode and decode at 2^20, 2^26 and 2^28;
// the block quantizers fp8 e4m3 / e5m2 / e8m0, int8, int4 and onebit -- the defaults and the slow
// paths fp8:block=0, int8:block=2048, onebit:chunk=4096 -- encode of float32 and bfloat16 with and
// without error feedback and decode into float32 / bfloat16, at 2^26 and 2^28; top-k encode at
// ratios 0.01 and 0.1), timed with CUDA events (manual time). Every benchmark reports the
// compulsory bytes of one call (`bytes`: inputs read once, outputs written once), GB/s of them and,
// as the floor to compare with, the device-to-device copy bandwidth measured in the same run
// (cudaMemcpyAsync D2D of the same number of input bytes, counted read + write). The bytes the
// kernels actually move come from Nsight Compute: tests/gpu/run.py runs a few rows under
// `ncu --profile-from-start off` with GRADCOMP_BENCH_PROFILE=1 (only the timed calls are profiled)
// and GRADCOMP_BENCH_ITERATIONS=1, and sets DRAM bytes read + written beside `bytes`.
// Without a GPU the program prints a message and exits 0.
#include <benchmark/benchmark.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cuda_profiler_api.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "gradcomp/gradcomp.hpp"

namespace {

using gradcomp::Codec;
using gradcomp::Device;
using gradcomp::DeviceKind;
using gradcomp::DType;
using gradcomp::Tensor;

const Device kGpu{DeviceKind::cuda, 0};

#define BCK(x)                                                                                     \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_));                        \
      std::abort();                                                                                \
    }                                                                                              \
  } while (0)

struct Buf {
  uint8_t* p = nullptr;
  explicit Buf(size_t bytes) { BCK(cudaMalloc(&p, bytes < 16 ? 16 : bytes)); }
  ~Buf() { cudaFree(p); }
};

// Gradient-like values: a hash of the index shaped to a rough bell with a spread of exponents.
__global__ void fill_kernel(float* x, int64_t n, uint32_t seed) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed ^ uint32_t(i >> 32) * 40503u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float u = float(h & 0xFFFFFF) / 16777216.0f;
    const float scale = __uint_as_float(((100u + (h >> 27)) << 23)); // 2^-27 .. 2^4
    x[i] = (u - 0.5f) * scale;
  }
}
__global__ void to_half_kernel(const float* x, uint16_t* y, int64_t n, bool bf16) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = bf16 ? uint16_t(__float_as_uint(x[i]) >> 16) : __half_as_ushort(__float2half_rn(x[i]));
}

//! Timed iterations per benchmark: `dflt`, or GRADCOMP_BENCH_ITERATIONS (tests/gpu/run.py sets 1
//! under Nsight Compute).
int iterations(int dflt) {
  const char* v = std::getenv("GRADCOMP_BENCH_ITERATIONS");
  return v && std::atoi(v) > 0 ? std::atoi(v) : dflt;
}
//! GRADCOMP_BENCH_PROFILE=1: only the timed calls run inside cudaProfilerStart / Stop, so that
//! `ncu --profile-from-start off` measures the DRAM bytes the codec itself moves (tests/gpu/run.py).
const bool kProfile = std::getenv("GRADCOMP_BENCH_PROFILE") && std::getenv("GRADCOMP_BENCH_PROFILE")[0] == '1';

//! Time `f` (which enqueues work on `s`) with events; returns milliseconds.
template <class F> float time_ms(cudaStream_t s, F&& f) {
  cudaEvent_t a, b;
  BCK(cudaEventCreate(&a));
  BCK(cudaEventCreate(&b));
  if (kProfile) BCK(cudaProfilerStart());
  BCK(cudaEventRecord(a, s));
  f();
  BCK(cudaEventRecord(b, s));
  if (kProfile) BCK(cudaProfilerStop());
  BCK(cudaEventSynchronize(b));
  float ms = 0;
  BCK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

//! Device-to-device copy bandwidth (read + write bytes per second) for `bytes`, cached per size.
double copy_gbps(size_t bytes) {
  static std::map<size_t, double> cache;
  if (auto it = cache.find(bytes); it != cache.end()) return it->second;
  Buf a(bytes), b(bytes);
  cudaStream_t s;
  BCK(cudaStreamCreate(&s));
  BCK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s)); // warm-up
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    cudaEvent_t e0, e1;
    BCK(cudaEventCreate(&e0));
    BCK(cudaEventCreate(&e1));
    BCK(cudaEventRecord(e0, s));
    BCK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s));
    BCK(cudaEventRecord(e1, s));
    BCK(cudaEventSynchronize(e1));
    float ms = 0;
    BCK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  cudaStreamDestroy(s);
  return cache[bytes] = 2.0 * double(bytes) / (double(best) * 1e-3) / 1e9;
}

void report(benchmark::State& st, double bytes_per_iter, double total_ms, size_t copy_bytes) {
  const double gbps = bytes_per_iter * double(st.iterations()) / (total_ms * 1e-3) / 1e9;
  const double floor = copy_gbps(copy_bytes);
  st.counters["GB/s"] = gbps;
  st.counters["bytes"] = bytes_per_iter;  // the compulsory bytes of one call (what GB/s counts)
  st.counters["copy_GB/s"] = floor;
  st.counters["of_copy"] = gbps / floor;
}

const char* kCastSpecs[] = {"none", "fp16", "bf16"};

// ---- D2D copy: the floor -----------------------------------------------------------------------------
void BM_CopyD2D(benchmark::State& st) {
  const size_t bytes = size_t(st.range(0)) * 4;
  Buf a(bytes), b(bytes);
  cudaStream_t s;
  BCK(cudaStreamCreate(&s));
  double total = 0;
  for (auto _ : st) {
    const float ms = time_ms(s, [&] { BCK(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, s)); });
    st.SetIterationTime(ms * 1e-3);
    total += ms;
  }
  report(st, 2.0 * double(bytes), total, bytes);
  cudaStreamDestroy(s);
}

// ---- cast encode with error feedback (float32 in, residual) --------------------------------------------
void BM_CastEncode(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto c = Codec::create(kCastSpecs[st.range(1)]);
  st.SetLabel(std::string(c->spec()) + " float32 + residual");
  const int64_t pb = c->packet_bytes(n, DType::float32), wb = c->workspace_bytes(n, DType::float32, kGpu);
  Buf x(static_cast<size_t>(n) * 4), r(static_cast<size_t>(n) * 4), p(static_cast<size_t>(pb)), w(static_cast<size_t>(wb));
  fill_kernel<<<1024, 256>>>(reinterpret_cast<float*>(x.p), n, 1);
  BCK(cudaMemset(r.p, 0, size_t(n) * 4));
  cudaStream_t s;
  BCK(cudaStreamCreate(&s));
  Tensor xt{x.p, DType::float32, n, kGpu}, rt{r.p, DType::float32, n, kGpu}, pt{p.p, DType::uint8, pb, kGpu},
      wt{w.p, DType::uint8, wb, kGpu};
  c->encode(xt, &rt, pt, wt, 1.0f, {}, gradcomp::Stream{s});
  double total = 0;
  for (auto _ : st) {
    const float ms = time_ms(s, [&] { c->encode(xt, &rt, pt, wt, 1.0f, {}, gradcomp::Stream{s}); });
    st.SetIterationTime(ms * 1e-3);
    total += ms;
  }
  // x read, residual read + written, packet written
  report(st, double(n) * 12.0 + double(pb), total, size_t(n) * 4);
  cudaStreamDestroy(s);
}

// ---- cast decode (accumulate into float32) ----------------------------------------------------------------
void BM_CastDecode(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto c = Codec::create(kCastSpecs[st.range(1)]);
  st.SetLabel(std::string(c->spec()) + " -> float32 accumulate");
  const int64_t pb = c->packet_bytes(n, DType::float32), wb = c->workspace_bytes(n, DType::float32, kGpu);
  Buf x(static_cast<size_t>(n) * 4), o(static_cast<size_t>(n) * 4), p(static_cast<size_t>(pb)), w(static_cast<size_t>(wb));
  fill_kernel<<<1024, 256>>>(reinterpret_cast<float*>(x.p), n, 2);
  BCK(cudaMemset(o.p, 0, size_t(n) * 4));
  BCK(cudaMemset(w.p, 0, size_t(wb)));
  Tensor xt{x.p, DType::float32, n, kGpu}, ot{o.p, DType::float32, n, kGpu}, pt{p.p, DType::uint8, pb, kGpu},
      wt{w.p, DType::uint8, wb, kGpu};
  c->encode(xt, nullptr, pt, wt);
  cudaStream_t s;
  BCK(cudaStreamCreate(&s));
  double total = 0;
  for (auto _ : st) {
    const float ms = time_ms(s, [&] {
      c->decode(pt, ot, wt, gradcomp::DecodeMode::accumulate, 0.5f, gradcomp::Stream{s});
    });
    st.SetIterationTime(ms * 1e-3);
    total += ms;
  }
  report(st, double(pb) + double(n) * 8.0, total, size_t(n) * 4);
  cudaStreamDestroy(s);
}

// ---- top-k encode (ratio 1% or 10%, with error feedback) ------------------------------------------------
// args: n, dtype (0 float32, 1 bfloat16), ratio (0: 0.01, 1: 0.1 -- the experiment's largest, which
// must stay on the candidate path)
void BM_TopKEncode(benchmark::State& st) {
  const int64_t n = st.range(0);
  const DType t = st.range(1) == 0 ? DType::float32 : DType::bfloat16;
  auto c = Codec::create(st.range(2) == 0 ? "topk:ratio=0.01" : "topk:ratio=0.1");
  st.SetLabel(std::string(c->spec()) + " " + std::string(gradcomp::dtype_name(t)) + " + residual, k=" +
              std::to_string(c->main_param(n)));
  const int64_t pb = c->packet_bytes(n, t), wb = c->workspace_bytes(n, t, kGpu);
  Buf xf(static_cast<size_t>(n) * 4), x(static_cast<size_t>(n) * gradcomp::dtype_size(t)), r(static_cast<size_t>(n) * 4), p(static_cast<size_t>(pb)), w(static_cast<size_t>(wb));
  fill_kernel<<<1024, 256>>>(reinterpret_cast<float*>(xf.p), n, 3);
  if (t == DType::float32) BCK(cudaMemcpy(x.p, xf.p, size_t(n) * 4, cudaMemcpyDeviceToDevice));
  else to_half_kernel<<<1024, 256>>>(reinterpret_cast<float*>(xf.p), reinterpret_cast<uint16_t*>(x.p), n, true);
  BCK(cudaMemset(r.p, 0, size_t(n) * 4));
  cudaStream_t s;
  BCK(cudaStreamCreate(&s));
  Tensor xt{x.p, t, n, kGpu}, rt{r.p, DType::float32, n, kGpu}, pt{p.p, DType::uint8, pb, kGpu},
      wt{w.p, DType::uint8, wb, kGpu};
  double total = 0;
  for (auto _ : st) {
    BCK(cudaMemsetAsync(r.p, 0, size_t(n) * 4, s)); // the same selection every iteration
    const float ms = time_ms(s, [&] { c->encode(xt, &rt, pt, wt, 1.0f, {}, gradcomp::Stream{s}); });
    st.SetIterationTime(ms * 1e-3);
    total += ms;
  }
  // the floor: x read once, residual read + written once, the packet written
  report(st, double(n) * double(gradcomp::dtype_size(t) + 8) + double(pb), total,
         size_t(n) * size_t(gradcomp::dtype_size(t)));
  cudaStreamDestroy(s);
}

// ---- block quantizers: encode (float32 / bfloat16 in, with and without error feedback), decode ----------
// the defaults, then the slow paths a review named: the two-pass block quantizer (block = 0: one
// scale for the tensor; block > 1024) and onebit with chunks of one 4096-element tile (the default
// onebit, chunk = 0, is the whole tensor: x and the residual read twice)
const char* const kQuantSpecs[] = {"fp8:format=e4m3", "fp8:format=e5m2", "fp8:scale=e8m0", "int8", "int4", "onebit",
                                   "fp8:block=0", "int8:block=2048", "onebit:chunk=4096"};
constexpr int kQuantCount = int(sizeof(kQuantSpecs) / sizeof(kQuantSpecs[0]));

// args: n, codec, input dtype (0 float32, 1 bfloat16), residual (0/1)
void BM_QuantEncode(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto c = Codec::create(kQuantSpecs[st.range(1)]);
  const DType t = st.range(2) == 0 ? DType::float32 : DType::bfloat16;
  const bool res = st.range(3) != 0;
  st.SetLabel(std::string(c->spec()) + " " + std::string(gradcomp::dtype_name(t)) + (res ? " + residual" : ""));
  const int64_t eb = gradcomp::dtype_size(t);
  const int64_t pb = c->packet_bytes(n, t), wb = c->workspace_bytes(n, t, kGpu);
  Buf xf(static_cast<size_t>(n) * 4), x(static_cast<size_t>(n * eb)), r(static_cast<size_t>(n) * 4),
      p(static_cast<size_t>(pb)), w(static_cast<size_t>(wb));
  fill_kernel<<<1024, 256>>>(reinterpret_cast<float*>(xf.p), n, 4);
  if (t == DType::float32) BCK(cudaMemcpy(x.p, xf.p, size_t(n) * 4, cudaMemcpyDeviceToDevice));
  else to_half_kernel<<<1024, 256>>>(reinterpret_cast<float*>(xf.p), reinterpret_cast<uint16_t*>(x.p), n, true);
  BCK(cudaMemset(r.p, 0, size_t(n) * 4));
  BCK(cudaMemset(w.p, 0, size_t(wb)));
  cudaStream_t s;
  BCK(cudaStreamCreate(&s));
  Tensor xt{x.p, t, n, kGpu}, rt{r.p, DType::float32, n, kGpu}, pt{p.p, DType::uint8, pb, kGpu},
      wt{w.p, DType::uint8, wb, kGpu};
  c->encode(xt, res ? &rt : nullptr, pt, wt, 1.0f, {}, gradcomp::Stream{s});
  double total = 0;
  for (auto _ : st) {
    const float ms = time_ms(s, [&] { c->encode(xt, res ? &rt : nullptr, pt, wt, 1.0f, {}, gradcomp::Stream{s}); });
    st.SetIterationTime(ms * 1e-3);
    total += ms;
  }
  // x read, packet written, residual read + written
  report(st, double(n * eb) + double(pb) + (res ? double(n) * 8.0 : 0.0), total, size_t(n * eb));
  cudaStreamDestroy(s);
}

// args: n, codec, output dtype (0 float32, 1 bfloat16); decode replaces out
void BM_QuantDecode(benchmark::State& st) {
  const int64_t n = st.range(0);
  auto c = Codec::create(kQuantSpecs[st.range(1)]);
  const DType t = st.range(2) == 0 ? DType::float32 : DType::bfloat16;
  st.SetLabel(std::string(c->spec()) + " -> " + std::string(gradcomp::dtype_name(t)));
  const int64_t eb = gradcomp::dtype_size(t);
  const int64_t pb = c->packet_bytes(n, t), wb = c->workspace_bytes(n, t, kGpu);
  Buf xf(static_cast<size_t>(n) * 4), x(static_cast<size_t>(n * eb)), o(static_cast<size_t>(n * eb)),
      p(static_cast<size_t>(pb)), w(static_cast<size_t>(wb));
  fill_kernel<<<1024, 256>>>(reinterpret_cast<float*>(xf.p), n, 5);
  if (t == DType::float32) BCK(cudaMemcpy(x.p, xf.p, size_t(n) * 4, cudaMemcpyDeviceToDevice));
  else to_half_kernel<<<1024, 256>>>(reinterpret_cast<float*>(xf.p), reinterpret_cast<uint16_t*>(x.p), n, true);
  BCK(cudaMemset(w.p, 0, size_t(wb)));
  Tensor xt{x.p, t, n, kGpu}, ot{o.p, t, n, kGpu}, pt{p.p, DType::uint8, pb, kGpu}, wt{w.p, DType::uint8, wb, kGpu};
  c->encode(xt, nullptr, pt, wt);
  cudaStream_t s;
  BCK(cudaStreamCreate(&s));
  double total = 0;
  for (auto _ : st) {
    const float ms = time_ms(s, [&] { c->decode(pt, ot, wt, gradcomp::DecodeMode::assign, 1.0f, gradcomp::Stream{s}); });
    st.SetIterationTime(ms * 1e-3);
    total += ms;
  }
  report(st, double(pb) + double(n * eb), total, size_t(n * eb));
  cudaStreamDestroy(s);
}

void QuantEncodeArgs(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t(1) << 26, int64_t(1) << 28})
    for (int c = 0; c < kQuantCount; ++c)
      for (int d : {0, 1})
        for (int r : {0, 1}) b->Args({n, c, d, r});
  b->Args({int64_t(1) << 20, 0, 0, 1});
}
void QuantDecodeArgs(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t(1) << 26, int64_t(1) << 28})
    for (int c = 0; c < kQuantCount; ++c)
      for (int d : {0, 1}) b->Args({n, c, d});
}

void CastArgs(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t(1) << 20, int64_t(1) << 26, int64_t(1) << 28})
    for (int spec = 0; spec < 3; ++spec) b->Args({n, spec});
}

BENCHMARK(BM_CopyD2D)->Arg(1 << 20)->Arg(1 << 26)->Arg(1 << 28)->UseManualTime()->Iterations(iterations(20))->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CastEncode)->Apply(CastArgs)->UseManualTime()->Iterations(iterations(20))->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CastDecode)->Apply(CastArgs)->UseManualTime()->Iterations(iterations(20))->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_QuantEncode)->Apply(QuantEncodeArgs)->UseManualTime()->Iterations(iterations(20))->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_QuantDecode)->Apply(QuantDecodeArgs)->UseManualTime()->Iterations(iterations(20))->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_TopKEncode)
    ->Args({1 << 16, 0, 0})
    ->Args({1 << 20, 0, 0})
    ->Args({1 << 24, 0, 0})
    ->Args({1 << 26, 0, 1})
    ->Args({1 << 28, 0, 0})
    ->Args({1 << 28, 1, 0})
    ->Args({1 << 28, 0, 1})
    ->UseManualTime()
    ->Iterations(iterations(10))
    ->Unit(benchmark::kMicrosecond);

} // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("bench_cuda: no CUDA device found; skipping the CUDA benchmarks\n");
    return 0;
  }
  cudaDeviceProp prop{};
  BCK(cudaGetDeviceProperties(&prop, 0));
  std::printf("bench_cuda: %s, %d SMs, gradcomp %s (CUDA %s)\n", prop.name, prop.multiProcessorCount,
              gradcomp::build_info().version.c_str(), gradcomp::build_info().cuda_version.c_str());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
