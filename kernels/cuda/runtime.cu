// SPDX-License-Identifier: Apache-2.0
// Host-side helpers of the CUDA backend: errors, device guard, SM count cache, the status word,
// version string.
#include <array>
#include <atomic>
#include <string>

#include "common.cuh"

namespace gradcomp::detail::cuda {

void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  throw CudaError(detail::concat("gradcomp CUDA error: ", call, " failed with ", cudaGetErrorName(e), " (",
                                 cudaGetErrorString(e), ") at ", file, ":", line));
}

DeviceGuard::DeviceGuard(int device) {
  int cur = 0;
  GRADCOMP_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != device) {
    GRADCOMP_CUDA_CHECK(cudaSetDevice(device));
    prev_ = cur;
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

uint32_t read_status(const uint8_t* workspace, Stream stream, bool clear) {
  // The one entry point that synchronizes (DESIGN.md section 3: gradcomp.check).
  const cudaStream_t s = to_cuda(stream);
  uint32_t v = 0;
  GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(&v, workspace, sizeof v, cudaMemcpyDeviceToHost, s));
  GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(s));
  if (clear) GRADCOMP_CUDA_CHECK(cudaMemsetAsync(const_cast<uint8_t*>(workspace), 0, sizeof v, s));
  return v;
}

const char* cuda_version() {
  static const std::string v =
      std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  return v.c_str();
}

} // namespace gradcomp::detail::cuda
