// SPDX-License-Identifier: Apache-2.0
// Every float32 bit pattern (2^32) through the DEVICE conversions, compared with the HOST ones:
//  - fp8_e4m3_code / fp8_e5m2_code (kernels/cuda/fp8.cuh: the sm_89+/sm_90 cvt.rn.satfinite convert
//    the CUDA fp8 encoder uses, non-finite inputs through the common functions) against
//    common::float_to_e4m3fn / float_to_e5m2 on the host (ml_dtypes' conversion). The contract
//    (fp8.cuh) holds for non-finite inputs and for |v| below 464 (e4m3fn) / 61440 (e5m2); a finite
//    |v| at or above those thresholds is clamped by satfinite to +-448 (0x7E|sign) / +-57344
//    (0x7B|sign) where ml_dtypes gives NaN / inf: those are counted ("clamped"), checked to be the
//    clamped code, and are not failures;
//  - common::float_to_half_bits / float_to_bf16_bits compiled for the device against the same
//    functions on the host (bitwise, NaN included);
//  - independently, the CUDA intrinsics __float2half_rn / __float2bfloat16_rn on the device against
//    the host common functions: bitwise for every non-NaN input. A NaN input must give a NaN.
//    Our functions (kernels/common/math.hpp, included through elem.hpp / quant.hpp) map every NaN
//    to the canonical quiet NaN with the input's sign kept and the payload dropped (0x7E00|sign
//    for float16, 0x7FC0|sign for bfloat16); the hardware convert returns its own canonical NaN
//    (0x7FFF with the sign dropped, as the host implementation of cuda_fp16.h / cuda_bf16.h does here), so a NaN of the other
//    sign is counted and printed ("NaN sign differs") but is not a failure.
// And every code through the decoders (256 per fp8 format, 65536 float16 / bfloat16 patterns):
// common::e4m3fn_to_float / e5m2_to_float / half_bits_to_float / bf16_bits_to_float on the device
// against the host, bitwise (NaN: the host function's bits); __half2float / __bfloat162float against
// the host functions, bitwise for non-NaN codes, NaN for NaN codes (sign counted, as above).
//
// The patterns go through in chunks of 2^27 (one launch, one copy to pinned host memory each, the
// next chunk's kernel and copy running while the host compares this one on every core). Each
// conversion prints one summary line (patterns, mismatches, clamped, NaN sign differs, host
// seconds summed over the threads) and its first 10 mismatches with the input bits. About 40 GiB
// cross PCIe in all; well under a minute on an H200 host with 16 cores. Skips without a GPU.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/elem.hpp"
#include "common/quant.hpp"
#include "cuda/fp8.cuh"
#include "gpu_guard.hpp"

namespace {

namespace gc = gradcomp::common;

#define CK(x) ASSERT_EQ((x), cudaSuccess) << #x

// ---- host side: plain C++ ---------------------------------------------------------------------------
enum Conv : int { kE4M3, kE5M2, kHalf, kBf16, kHalfIntrinsic, kBf16Intrinsic, kNumConv };
// Each summary line starts with the conversion's name (tests/gpu/run.py excerpts the lines that
// start with e4m3 / e5m2 / fp16 / bf16 / half / decode).
const char* const kConvName[kNumConv] = {
    "e4m3 fp8_e4m3_code (device) vs float_to_e4m3fn (host)",
    "e5m2 fp8_e5m2_code (device) vs float_to_e5m2 (host)",
    "fp16 float_to_half_bits (device) vs float_to_half_bits (host)",
    "bf16 float_to_bf16_bits (device) vs float_to_bf16_bits (host)",
    "fp16 __float2half_rn (device) vs float_to_half_bits (host)",
    "bf16 __float2bfloat16_rn (device) vs float_to_bf16_bits (host)"};

struct Mismatch {
  uint32_t input, got, want;
};
//! One conversion's tally over a range of inputs.
struct Stats {
  uint64_t checked = 0, mismatches = 0, clamped = 0, nan_sign = 0;
  double seconds = 0;             // host comparison time, summed over threads
  std::vector<Mismatch> first;    // the first 10 mismatches, in input order
  void bad(uint32_t input, uint32_t got, uint32_t want) {
    if (++mismatches <= 10) first.push_back({input, got, want});
  }
  //! Adds the tally of a range that follows this one's.
  void merge(const Stats& o) {
    checked += o.checked, mismatches += o.mismatches, clamped += o.clamped, nan_sign += o.nan_sign;
    seconds += o.seconds;
    for (const Mismatch& m : o.first)
      if (first.size() < 10) first.push_back(m);
  }
};

//! A chunk of device results: element i is the conversion of the float32 pattern base + i.
struct ChunkView {
  const uint8_t* e4m3;
  const uint8_t* e5m2;
  const uint16_t* half;
  const uint16_t* bf16;
  const uint16_t* half_intrinsic;
  const uint16_t* bf16_intrinsic;
};

const uint32_t kE4M3ClampBits = gc::float_bits(464.0f);    // 0x43E80000
const uint32_t kE5M2ClampBits = gc::float_bits(61440.0f);  // 0x47700000

bool half_is_nan(uint32_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0; }
bool bf16_is_nan(uint32_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x7Fu) != 0; }
bool f32_is_nan(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

//! fp8: the host code below the threshold and for non-finite inputs; the clamped code at or above it.
template <class Host>
void check_fp8(const uint8_t* got, uint32_t base, uint32_t begin, uint32_t end, uint32_t clamp_bits, uint32_t max_code,
               Host host, Stats& s) {
  for (uint32_t i = begin; i < end; ++i) {
    const uint32_t u = base + i, a = u & 0x7FFFFFFFu;
    const uint32_t want = host(gc::bits_float(u)), g = got[i];
    if (a >= clamp_bits && a < 0x7F800000u) {
      const uint32_t clamped = max_code | ((u >> 24) & 0x80u);
      if (g != clamped) s.bad(u, g, clamped);
      else if (g != want) ++s.clamped;
    } else if (g != want) {
      s.bad(u, g, want);
    }
  }
  s.checked += end - begin;
}
//! The common float16 / bfloat16 conversion on the device: the host's bits for every input.
template <class Host>
void check_exact16(const uint16_t* got, uint32_t base, uint32_t begin, uint32_t end, Host host, Stats& s) {
  for (uint32_t i = begin; i < end; ++i) {
    const uint32_t u = base + i, want = host(gc::bits_float(u));
    if (got[i] != want) s.bad(u, got[i], want);
  }
  s.checked += end - begin;
}
//! A CUDA intrinsic: the host's bits for non-NaN inputs; a NaN for NaN inputs (sign counted).
template <class Host, class IsNan>
void check_intrinsic16(const uint16_t* got, uint32_t base, uint32_t begin, uint32_t end, Host host, IsNan is_nan,
                       Stats& s) {
  for (uint32_t i = begin; i < end; ++i) {
    const uint32_t u = base + i, want = host(gc::bits_float(u)), g = got[i];
    if (!f32_is_nan(u)) {
      if (g != want) s.bad(u, g, want);
    } else if (!is_nan(g)) {
      s.bad(u, g, want);
    } else if ((g ^ want) & 0x8000u) {
      ++s.nan_sign;
    }
  }
  s.checked += end - begin;
}

//! Compares elements [begin, end) of a chunk whose element i is the pattern base + i, adding to
//! s[kNumConv] (each conversion timed on its own).
void compare_range(const ChunkView& d, uint32_t base, uint32_t begin, uint32_t end, Stats* s) {
  using clock = std::chrono::steady_clock;
  auto timed = [&](Conv c, auto&& body) {
    const auto t0 = clock::now();
    body(s[c]);
    s[c].seconds += std::chrono::duration<double>(clock::now() - t0).count();
  };
  timed(kE4M3, [&](Stats& st) {
    check_fp8(d.e4m3, base, begin, end, kE4M3ClampBits, 0x7Eu, [](float v) { return uint32_t(gc::float_to_e4m3fn(v)); }, st);
  });
  timed(kE5M2, [&](Stats& st) {
    check_fp8(d.e5m2, base, begin, end, kE5M2ClampBits, 0x7Bu, [](float v) { return uint32_t(gc::float_to_e5m2(v)); }, st);
  });
  auto to_half = [](float v) { return uint32_t(gc::float_to_half_bits(v)); };
  auto to_bf16 = [](float v) { return uint32_t(gc::float_to_bf16_bits(v)); };
  timed(kHalf, [&](Stats& st) { check_exact16(d.half, base, begin, end, to_half, st); });
  timed(kBf16, [&](Stats& st) { check_exact16(d.bf16, base, begin, end, to_bf16, st); });
  timed(kHalfIntrinsic, [&](Stats& st) { check_intrinsic16(d.half_intrinsic, base, begin, end, to_half, half_is_nan, st); });
  timed(kBf16Intrinsic, [&](Stats& st) { check_intrinsic16(d.bf16_intrinsic, base, begin, end, to_bf16, bf16_is_nan, st); });
}

unsigned host_threads() { return std::max(1u, std::thread::hardware_concurrency()); }

//! A whole chunk of `count` patterns from `base`, on every host thread, added to total[kNumConv].
void compare_chunk(const ChunkView& d, uint32_t base, uint32_t count, Stats* total) {
  const unsigned nt = host_threads();
  std::vector<std::vector<Stats>> part(nt, std::vector<Stats>(kNumConv));
  std::vector<std::thread> threads;
  const uint32_t step = (count + nt - 1) / nt;
  for (unsigned t = 0; t < nt; ++t) {
    const uint32_t begin = uint32_t(std::min<uint64_t>(uint64_t(t) * step, count));
    const uint32_t end = uint32_t(std::min<uint64_t>(uint64_t(begin) + step, count));
    threads.emplace_back([&d, &part, base, begin, end, t] { compare_range(d, base, begin, end, part[t].data()); });
  }
  for (auto& th : threads) th.join();
  for (unsigned t = 0; t < nt; ++t)  // in range order: the first mismatches stay the first
    for (int c = 0; c < kNumConv; ++c) total[c].merge(part[t][size_t(c)]);
}

void print_stats(const char* name, const Stats& s, int hex_digits) {
  std::printf("%s: %llu patterns, %llu mismatches, %llu clamped, %llu NaN sign differs, %.2f host s\n",
              name, (unsigned long long)s.checked, (unsigned long long)s.mismatches, (unsigned long long)s.clamped,
              (unsigned long long)s.nan_sign, s.seconds);
  for (const Mismatch& m : s.first)
    std::printf("    input 0x%08X: device 0x%0*X, expected 0x%0*X\n", m.input, hex_digits, m.got, hex_digits, m.want);
  std::fflush(stdout);
}

// ---- device side ----------------------------------------------------------------------------------------
constexpr uint32_t kChunk = uint32_t(1) << 27;  // patterns per launch
constexpr size_t kChunkBytes = size_t(kChunk) * (1 + 1 + 2 + 2 + 2 + 2);

//! The six output arrays of a chunk laid out one after another in `p` (device or host).
struct ChunkArrays {
  uint8_t* e4m3;
  uint8_t* e5m2;
  uint16_t* half;
  uint16_t* bf16;
  uint16_t* half_intrinsic;
  uint16_t* bf16_intrinsic;
};
ChunkArrays arrays_at(uint8_t* p) {
  ChunkArrays a;
  a.e4m3 = p;
  a.e5m2 = p + kChunk;
  a.half = reinterpret_cast<uint16_t*>(p + 2 * size_t(kChunk));
  a.bf16 = a.half + kChunk;
  a.half_intrinsic = a.bf16 + kChunk;
  a.bf16_intrinsic = a.half_intrinsic + kChunk;
  return a;
}

__global__ void convert_chunk(ChunkArrays o, uint32_t base) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;  // the grid covers kChunk exactly
  const float f = __uint_as_float(base + i);
  o.e4m3[i] = uint8_t(gradcomp::detail::cuda::fp8_e4m3_code(f));
  o.e5m2[i] = uint8_t(gradcomp::detail::cuda::fp8_e5m2_code(f));
  o.half[i] = gc::float_to_half_bits(f);
  o.bf16[i] = gc::float_to_bf16_bits(f);
  o.half_intrinsic[i] = __half_as_ushort(__float2half_rn(f));
  o.bf16_intrinsic[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

struct PinnedBuf {
  uint8_t* p = nullptr;
  explicit PinnedBuf(size_t b) {
    if (cudaMallocHost(&p, b) != cudaSuccess) p = nullptr;
  }
  ~PinnedBuf() {
    if (p) cudaFreeHost(p);
  }
  PinnedBuf(const PinnedBuf&) = delete;
  PinnedBuf& operator=(const PinnedBuf&) = delete;
};
struct DeviceBuf {
  uint8_t* p = nullptr;
  explicit DeviceBuf(size_t b) {
    if (cudaMalloc(&p, b) != cudaSuccess) p = nullptr;
  }
  ~DeviceBuf() {
    if (p) cudaFree(p);
  }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
};
struct StreamHolder {
  cudaStream_t s = nullptr;
  ~StreamHolder() {
    if (s) cudaStreamDestroy(s);
  }
};

TEST(CudaConvertAll, EveryFloat32PatternEncodes) {
  REQUIRE_GPU();
  const auto t0 = std::chrono::steady_clock::now();
  DeviceBuf dev(kChunkBytes);
  PinnedBuf host[2] = {PinnedBuf(kChunkBytes), PinnedBuf(kChunkBytes)};
  ASSERT_TRUE(dev.p && host[0].p && host[1].p) << "cannot allocate " << kChunkBytes / (1 << 20) << " MiB device + 2x pinned";
  StreamHolder stream;
  CK(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));
  const ChunkArrays dev_arrays = arrays_at(dev.p);
  auto enqueue = [&](uint32_t chunk) {  // kernel, then the copy into host[chunk % 2], in stream order
    convert_chunk<<<kChunk / 256, 256, 0, stream.s>>>(dev_arrays, chunk * kChunk);
    return cudaMemcpyAsync(host[chunk % 2].p, dev.p, kChunkBytes, cudaMemcpyDeviceToHost, stream.s);
  };
  constexpr uint32_t kChunks = uint32_t((uint64_t(1) << 32) / kChunk);
  Stats total[kNumConv];
  CK(enqueue(0));
  for (uint32_t chunk = 0; chunk < kChunks; ++chunk) {
    CK(cudaStreamSynchronize(stream.s));  // host[chunk % 2] holds this chunk
    CK(cudaGetLastError());
    if (chunk + 1 < kChunks) CK(enqueue(chunk + 1));  // overlaps the comparison below
    const ChunkArrays h = arrays_at(host[chunk % 2].p);
    const ChunkView view{h.e4m3, h.e5m2, h.half, h.bf16, h.half_intrinsic, h.bf16_intrinsic};
    compare_chunk(view, chunk * kChunk, kChunk, total);
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int c = 0; c < kNumConv; ++c) {
    print_stats(kConvName[c], total[c], c < kHalf ? 2 : 4);
    EXPECT_EQ(total[c].checked, uint64_t(1) << 32) << kConvName[c];
    EXPECT_EQ(total[c].mismatches, 0u) << kConvName[c] << " (the first 10 are printed above)";
  }
  std::printf("[CudaConvertAll] 2^32 patterns x %d conversions in %.1f s wall (%u host threads)\n", kNumConv, wall,
              host_threads());
  // Where ml_dtypes overflows and satfinite clamps: e4m3fn, every finite |v| above 464 (464 itself
  // rounds to 448 in both); e5m2, every finite |v| from 61440 (which rounds to inf) up. Both signs.
  EXPECT_EQ(total[kE4M3].clamped, 2 * uint64_t(0x7F800000u - kE4M3ClampBits - 1));
  EXPECT_EQ(total[kE5M2].clamped, 2 * uint64_t(0x7F800000u - kE5M2ClampBits));
  // The only inputs whose intrinsic result may differ in sign are the NaNs (2 * (2^23 - 1)).
  EXPECT_LE(total[kHalfIntrinsic].nan_sign, 2 * uint64_t(0x7FFFFF));
  EXPECT_LE(total[kBf16Intrinsic].nan_sign, 2 * uint64_t(0x7FFFFF));
}

// ---- decoders -------------------------------------------------------------------------------------------
enum Dec : int { kDecE4M3, kDecE5M2, kDecHalf, kDecBf16, kDecHalfIntrinsic, kDecBf16Intrinsic, kNumDec };
const char* const kDecName[kNumDec] = {
    "decode e4m3 e4m3fn_to_float (device) vs (host)", "decode e5m2 e5m2_to_float (device) vs (host)",
    "decode fp16 half_bits_to_float (device) vs (host)", "decode bf16 bf16_bits_to_float (device) vs (host)",
    "decode fp16 __half2float (device) vs half_bits_to_float (host)",
    "decode bf16 __bfloat162float (device) vs bf16_bits_to_float (host)"};

constexpr uint32_t kCodes16 = 65536;

//! out[d * 65536 + c]: decoder d applied to code c (the fp8 decoders to codes below 256 only).
__global__ void decode_all(uint32_t* out) {
  const uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;  // the grid covers 65536 exactly
  if (c < 256) {
    out[kDecE4M3 * kCodes16 + c] = __float_as_uint(gc::e4m3fn_to_float(uint8_t(c)));
    out[kDecE5M2 * kCodes16 + c] = __float_as_uint(gc::e5m2_to_float(uint8_t(c)));
  }
  out[kDecHalf * kCodes16 + c] = __float_as_uint(gc::half_bits_to_float(uint16_t(c)));
  out[kDecBf16 * kCodes16 + c] = __float_as_uint(gc::bf16_bits_to_float(uint16_t(c)));
  out[kDecHalfIntrinsic * kCodes16 + c] = __float_as_uint(__half2float(__ushort_as_half(uint16_t(c))));
  out[kDecBf16Intrinsic * kCodes16 + c] = __float_as_uint(__bfloat162float(__ushort_as_bfloat16(uint16_t(c))));
}

//! Plain C++: the decoders' device results (`dev`, laid out as decode_all writes them) against the
//! host functions, one Stats per decoder.
void compare_decoders(const std::vector<uint32_t>& dev, Stats* s) {
  for (int d = 0; d < kNumDec; ++d) {
    const uint32_t codes = d <= kDecE5M2 ? 256u : kCodes16;
    for (uint32_t c = 0; c < codes; ++c) {
      const uint32_t g = dev[size_t(d) * kCodes16 + c];
      uint32_t want = 0;
      switch (d) {
        case kDecE4M3: want = gc::float_bits(gc::e4m3fn_to_float(uint8_t(c))); break;
        case kDecE5M2: want = gc::float_bits(gc::e5m2_to_float(uint8_t(c))); break;
        case kDecHalf: case kDecHalfIntrinsic: want = gc::float_bits(gc::half_bits_to_float(uint16_t(c))); break;
        default: want = gc::float_bits(gc::bf16_bits_to_float(uint16_t(c))); break;
      }
      ++s[d].checked;
      if (d >= kDecHalfIntrinsic && f32_is_nan(want)) {  // NaN code: a NaN (sign counted only)
        if (!f32_is_nan(g)) s[d].bad(c, g, want);
        else if ((g ^ want) & 0x80000000u) ++s[d].nan_sign;
      } else if (g != want) {
        s[d].bad(c, g, want);
      }
    }
  }
}

TEST(CudaConvertAll, EveryCodeDecodes) {
  REQUIRE_GPU();
  const size_t bytes = size_t(kNumDec) * kCodes16 * 4;
  DeviceBuf dev(bytes);
  ASSERT_TRUE(dev.p);
  CK(cudaMemset(dev.p, 0, bytes));
  decode_all<<<kCodes16 / 256, 256>>>(reinterpret_cast<uint32_t*>(dev.p));
  CK(cudaGetLastError());
  std::vector<uint32_t> got(size_t(kNumDec) * kCodes16);
  CK(cudaMemcpy(got.data(), dev.p, bytes, cudaMemcpyDeviceToHost));
  Stats s[kNumDec];
  compare_decoders(got, s);
  for (int d = 0; d < kNumDec; ++d) {
    print_stats(kDecName[d], s[d], 8);
    EXPECT_EQ(s[d].checked, d <= kDecE5M2 ? 256u : uint64_t(kCodes16)) << kDecName[d];
    EXPECT_EQ(s[d].mismatches, 0u) << kDecName[d] << " (the first 10 are printed above)";
  }
}

} // namespace
