// SPDX-License-Identifier: Apache-2.0
// CUDA side of integrity=crc32c (kernels/core/integrity.hpp, kernels/common/crc32c.hpp): the CRC-32C
// of packet[0, n), n the checksum section's offset (a multiple of 16).
//
// crc_block_kernel: each thread the raw register (initial value 0) of its 256 bytes (16-byte loads,
// the byte table in shared memory), then the block folds its 256 registers pairwise in a tree
// (raw(A || B) = shift(raw(A), |B|) ^ raw(B)) into one per 64 KiB. crc_combine_kernel (one block)
// folds those the same way, 1024 at a time, and either writes the checksum section (encode) or
// compares it (decode: a mismatch or a non-zero reserved byte sets kStatusCorrupt and the veto word
// the decode kernels' prologue reads). For a decode n comes from the header's input dtype on the
// device (resolve_kernel); a header that selects no layout, or a buffer shorter than it, leaves the
// report to the decode prologue.
#include "../common/crc32c.hpp"
#include "../core/integrity.hpp"
#include "common.cuh"

namespace gradcomp::detail::cuda {
namespace {

constexpr int kT = 256;                             //!< threads of crc_block_kernel
constexpr int kChunk = 256;                         //!< bytes per thread
constexpr int64_t kBlockBytes = int64_t(kT) * kChunk; //!< bytes per CUDA block
constexpr int kCombineT = 1024;
//! Scratch: a decode's int64 n at byte 0, the per-block registers from byte 16.
constexpr int64_t kPartialsOffset = 16;

__device__ __forceinline__ void load_table(uint32_t* t) {
  for (int i = int(threadIdx.x); i < 256; i += int(blockDim.x)) t[i] = crc32c::table_entry(uint32_t(i));
  __syncthreads();
}

//! Fold the registers c[0, m) of consecutive pieces of lengths len[0, m) into c[0] / len[0] (a
//! shared-memory tree; m <= blockDim.x, every thread calls it).
__device__ __forceinline__ void fold(uint32_t* c, int64_t* len, int m, const crc32c::X2n& x2n) {
  for (int s = 1; s < m; s *= 2) {
    const int i = int(threadIdx.x) * 2 * s;
    if (i + s < m) {
      c[i] = crc32c::shift(c[i], uint64_t(len[i + s]), x2n) ^ c[i + s];
      len[i] += len[i + s];
    }
    __syncthreads();
  }
}

__global__ void resolve_kernel(const uint8_t* __restrict__ packet, HeaderExpect e, int64_t* __restrict__ n_out) {
  const PacketHeader h = load_header(packet);
  int64_t n = -1;
  if (h.input_dtype <= 2) {
    GRADCOMP_UNROLL
    for (int i = 0; i < 3; ++i) {
      const PacketLayout& l = e.by_input[i];
      if (i == int(h.input_dtype) && l.checksum_section >= 0 && l.bytes <= e.capacity)
        n = expect_section(e, i, l.checksum_section).offset;
    }
  }
  *n_out = n;
}

//! n: `n_ptr` when not null (a decode: resolve_kernel's), else `n_fixed` (an encode).
__global__ void __launch_bounds__(kT) crc_block_kernel(const uint8_t* __restrict__ p, int64_t n_fixed,
                                                       const int64_t* __restrict__ n_ptr, uint32_t* __restrict__ partial,
                                                       crc32c::X2n x2n) {
  __shared__ uint32_t table[256];
  __shared__ uint32_t c[kT];
  __shared__ int64_t len[kT];
  load_table(table);
  const int64_t n = n_ptr ? *n_ptr : n_fixed;
  const int64_t base = int64_t(blockIdx.x) * kBlockBytes;
  if (n < 0 || base >= n) return; // the whole block: n is the same in every thread
  const int64_t lo = base + int64_t(threadIdx.x) * kChunk, hi = min(lo + kChunk, n);
  uint32_t r = 0;
  for (int64_t i = lo; i < hi; i += 16) { // n is a multiple of 16
    const uint4 v = *reinterpret_cast<const uint4*>(p + i);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int b = 0; b < 4; ++b) r = table[(r ^ (w[k] >> (8 * b))) & 0xFFu] ^ (r >> 8);
  }
  c[threadIdx.x] = r;
  len[threadIdx.x] = hi > lo ? hi - lo : 0;
  __syncthreads();
  fold(c, len, kT, x2n);
  if (threadIdx.x == 0) partial[blockIdx.x] = c[0];
}

//! Encode (verify false): write the checksum section at packet + n; decode: compare with it.
__global__ void __launch_bounds__(kCombineT) crc_combine_kernel(uint8_t* __restrict__ packet, int64_t n_fixed,
                                                                const int64_t* __restrict__ n_ptr,
                                                                const uint32_t* __restrict__ partial, crc32c::X2n x2n,
                                                                bool verify, uint32_t* status, uint32_t* veto) {
  __shared__ uint32_t c[kCombineT];
  __shared__ int64_t len[kCombineT];
  const int64_t n = n_ptr ? *n_ptr : n_fixed;
  if (n < 0) return;
  const int64_t blocks = (n + kBlockBytes - 1) / kBlockBytes;
  uint32_t acc = 0;
  for (int64_t t0 = 0; t0 < blocks; t0 += kCombineT) {
    const int64_t b = t0 + threadIdx.x;
    c[threadIdx.x] = b < blocks ? partial[b] : 0u;
    len[threadIdx.x] = b < blocks ? min(kBlockBytes, n - b * kBlockBytes) : 0;
    __syncthreads();
    fold(c, len, kCombineT, x2n);
    if (threadIdx.x == 0) acc = crc32c::shift(acc, uint64_t(len[0]), x2n) ^ c[0];
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  const uint32_t crc = crc32c::finish(acc, uint64_t(n), x2n);
  uint8_t* s = packet + n;
  if (!verify) {
    for (int i = 0; i < int(kChecksumBytes); ++i) s[i] = i < 4 ? uint8_t(crc >> (8 * i)) : 0;
    return;
  }
  uint32_t stored = 0, reserved = 0;
  for (int i = 0; i < 4; ++i) stored |= uint32_t(s[i]) << (8 * i);
  for (int i = 4; i < int(kChecksumBytes); ++i) reserved |= s[i];
  if (stored != crc || reserved != 0) {
    *veto = 1;
    if (status) atomicOr(status, kStatusCorrupt);
  }
}

int64_t blocks_for(int64_t nbytes) { return std::max<int64_t>(1, (nbytes + kBlockBytes - 1) / kBlockBytes); }

int64_t scratch_bytes(int64_t nbytes) { return kPartialsOffset + align16(4 * blocks_for(nbytes)); }

//! n_dev null: an encode of n_fixed bytes; else a decode whose n resolve_kernel wrote there
//! (grid_bytes: the most it may be).
void run(uint8_t* packet, int64_t n_fixed, const int64_t* n_dev, int64_t grid_bytes, uint8_t* scratch, bool verify,
         uint32_t* status, uint32_t* veto, cudaStream_t s) {
  static const crc32c::X2n x2n = crc32c::make_x2n();
  auto* partial = reinterpret_cast<uint32_t*>(scratch + kPartialsOffset);
  crc_block_kernel<<<unsigned(blocks_for(grid_bytes)), kT, 0, s>>>(packet, n_fixed, n_dev, partial, x2n);
  GRADCOMP_CUDA_CHECK_LAUNCH("crc_block_kernel");
  crc_combine_kernel<<<1, kCombineT, 0, s>>>(packet, n_fixed, n_dev, partial, x2n, verify, status, veto);
  GRADCOMP_CUDA_CHECK_LAUNCH("crc_combine_kernel");
}

void write(uint8_t* packet, const PacketLayout& l, uint8_t* scratch, int device, Stream stream) {
  DeviceGuard guard(device);
  const cudaStream_t s = to_cuda(stream);
  const int64_t n = l.sections[l.checksum_section].offset;
  run(packet, n, nullptr, n, scratch, false, nullptr, nullptr, s);
}

void verify(const uint8_t* packet, const HeaderExpect& e, uint8_t* workspace, int64_t family_bytes, int device,
            Stream stream) {
  DeviceGuard guard(device);
  const cudaStream_t s = to_cuda(stream);
  uint8_t* scratch = workspace + family_bytes;
  int64_t most = 0; // the grid covers the largest layout; blocks past the packet's n return
  for (const PacketLayout& l : e.by_input) most = std::max(most, l.sections[l.checksum_section].offset);
  auto* veto = reinterpret_cast<uint32_t*>(workspace + kChecksumVetoOffset);
  GRADCOMP_CUDA_CHECK(cudaMemsetAsync(veto, 0, 4, s));
  resolve_kernel<<<1, 1, 0, s>>>(packet, e, reinterpret_cast<int64_t*>(scratch));
  GRADCOMP_CUDA_CHECK_LAUNCH("resolve_kernel");
  run(const_cast<uint8_t*>(packet), 0, reinterpret_cast<const int64_t*>(scratch), most, scratch, true,
      reinterpret_cast<uint32_t*>(workspace), veto, s);
}

} // namespace

const ChecksumRuntime checksum = {&scratch_bytes, &write, &verify};

} // namespace gradcomp::detail::cuda
