// SPDX-License-Identifier: Apache-2.0
// Host-side helpers of the CUDA backend: errors, device guard, SM count cache, the per (device,
// kernel) occupancy cache behind the grid sizes (blocks_per_sm), the status word, version string
// (the DeviceRuntime table the core reaches through cuda_runtime()).
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "common.cuh"

namespace gradcomp::detail::cuda {

void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  throw CudaError(detail::concat("gradcomp CUDA error: ", call, " failed with ", cudaGetErrorName(e), " (",
                                 cudaGetErrorString(e), ") at ", file, ":", line));
}

bool primary_context_active(int device) {
  using GetState = int (*)(int, unsigned int*, int*); // CUresult cuDevicePrimaryCtxGetState(CUdevice, unsigned*, int*)
  static const GetState fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<GetState>(f);
  }();
  if (fn == nullptr) return false;
  unsigned int flags = 0;
  int active = 0;
  return fn(device, &flags, &active) == 0 && active != 0;
}

DeviceGuard::DeviceGuard(int device) {
  int cur = 0;
  GRADCOMP_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != device) {
    // Remember the previous device only if the thread really used it: cudaGetDevice reports 0 for
    // a thread that never touched a device, and making device 0 current again on exit would
    // create a context there.
    if (primary_context_active(cur)) prev_ = cur;
    GRADCOMP_CUDA_CHECK(cudaSetDevice(device));
  }
}
DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0) (void)cudaSetDevice(prev_);
}

int sm_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < 64) {
    if (const int v = cache[device].load(std::memory_order_relaxed); v > 0) return v;
  }
  int v = 0;
  GRADCOMP_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
  if (v < 1) v = 1;
  if (device >= 0 && device < 64) cache[device].store(v, std::memory_order_relaxed);
  return v;
}

int blocks_per_sm(int device, const void* kernel) {
  using Key = std::pair<int, const void*>;
  static std::mutex mu;
  static std::map<Key, int> cache;
  const Key key{device, kernel};
  {
    const std::lock_guard<std::mutex> lock(mu);
    if (const auto it = cache.find(key); it != cache.end()) return it->second;
  }
  int v = 0;
  GRADCOMP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, plan::kThreads, 0));
  if (v < 1) v = 1;
  const std::lock_guard<std::mutex> lock(mu);
  return cache.emplace(key, v).first->second;
}

namespace {
uint32_t read_status(const Tensor& workspace, Stream stream, bool clear) {
  // The one entry point that synchronizes (docs/contracts.md section 3: gradcomp.check). On the
  // workspace's device: the stream belongs to it.
  DeviceGuard guard(workspace.device.index);
  const cudaStream_t s = to_cuda(stream);
  auto* w = static_cast<uint8_t*>(workspace.data);
  uint32_t v = 0;
  GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(&v, w, sizeof v, cudaMemcpyDeviceToHost, s));
  GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(s));
  if (clear) GRADCOMP_CUDA_CHECK(cudaMemsetAsync(w, 0, sizeof v, s));
  return v;
}

const char* cuda_version() {
  static const std::string v =
      std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  return v.c_str();
}
} // namespace

const DeviceRuntime runtime = {&read_status, &cuda_version};

} // namespace gradcomp::detail::cuda
