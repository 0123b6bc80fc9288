// SPDX-License-Identifier: Apache-2.0
// Shared by the fuzz targets and the seed writer: the codecs under test (every example spec of the
// registry, or GRADCOMP_FUZZ_SPEC) and the input format of fuzz_decode:
//   byte 0: which codec (index into specs(), modulo its size)
//   byte 1: bits 0-1 the output dtype (0 float32, 1 float16, 2 bfloat16, 3 float32), bit 2
//           accumulate, bits 3-4 how numel is chosen (0: the header's numel when <= kMaxNumel,
//           1: header numel + 1, 2: header numel - 1, 3: the packet's byte count)
//   bytes 2..: the packet
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "gradcomp/gradcomp.hpp"

namespace fuzz {

inline constexpr int64_t kMaxNumel = int64_t(1) << 16;

inline const std::vector<std::string>& specs() {
  static const std::vector<std::string> s = [] {
    std::vector<std::string> v;
    if (const char* one = std::getenv("GRADCOMP_FUZZ_SPEC")) {
      v.emplace_back(one);
      return v;
    }
    for (const auto& info : gradcomp::list_codecs())
      for (const auto& ex : info.examples) v.push_back(ex);
    return v;
  }();
  return s;
}

struct Free {
  void operator()(void* p) const { std::free(p); }
};

//! A heap buffer of exactly `bytes` bytes (16-byte aligned), so that AddressSanitizer sees any
//! access past its end.
inline std::unique_ptr<uint8_t[], Free> exact(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 16, bytes ? bytes : 1) != 0) std::abort();
  return std::unique_ptr<uint8_t[], Free>(static_cast<uint8_t*>(p));
}

//! Decode one fuzz input (format above, byte 0 ignored) with codec `c`. Returns 1 when the packet
//! was decoded, 0 when it was rejected with CorruptPacket (or the input is too short); aborts on
//! any other exception.
inline int decode_with(const gradcomp::Codec& c, const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const gradcomp::DType dts[4] = {gradcomp::DType::float32, gradcomp::DType::float16, gradcomp::DType::bfloat16,
                                  gradcomp::DType::float32};
  const gradcomp::DType odt = dts[data[1] & 3];
  const auto mode = (data[1] & 4) ? gradcomp::DecodeMode::accumulate : gradcomp::DecodeMode::assign;
  const size_t pbytes = size - 2;
  auto packet = exact(pbytes);
  std::memcpy(packet.get(), data + 2, pbytes);
  uint64_t hn = 0;
  if (pbytes >= 24) std::memcpy(&hn, packet.get() + 16, 8);
  int64_t n = 0;
  switch ((data[1] >> 3) & 3) {
    case 0: n = int64_t(hn <= uint64_t(kMaxNumel) ? hn : 17); break;
    case 1: n = int64_t(hn < uint64_t(kMaxNumel) ? hn + 1 : 3); break;
    case 2: n = int64_t(hn > 0 && hn <= uint64_t(kMaxNumel) ? hn - 1 : 0); break;
    default: n = int64_t(pbytes); break;
  }
  const int64_t esize = gradcomp::dtype_size(odt);
  auto out = exact(size_t(n * esize));
  std::memset(out.get(), 0, size_t(n * esize));
  auto ws = exact(16);
  std::memset(ws.get(), 0, 16);
  try {
    c.decode({packet.get(), gradcomp::DType::uint8, int64_t(pbytes), {}}, {out.get(), odt, n, {}},
             {ws.get(), gradcomp::DType::uint8, 16, {}}, mode, 0.5f);
  } catch (const gradcomp::CorruptPacket&) {
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: unexpected exception from decode of '%s': %s\n", c.spec().c_str(), e.what());
    std::abort();
  }
  return 1;
}

//! Decode one fuzz input with the codec its byte 0 selects from specs().
inline int decode_input(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  static std::vector<std::unique_ptr<gradcomp::Codec>> codecs = [] {
    std::vector<std::unique_ptr<gradcomp::Codec>> v;
    for (const auto& s : specs()) v.push_back(gradcomp::Codec::create(s));
    return v;
  }();
  return decode_with(*codecs[data[0] % codecs.size()], data, size);
}

} // namespace fuzz
