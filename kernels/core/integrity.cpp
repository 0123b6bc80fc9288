// SPDX-License-Identifier: Apache-2.0
#include "integrity.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../common/crc32c.hpp"
#include "gradcomp/error.hpp"
#include "layout.hpp"

namespace gradcomp::detail {
namespace {

struct Tables {
  uint32_t byte[256];
  crc32c::X2n x2n;
  Tables() : x2n(crc32c::make_x2n()) {
    for (uint32_t i = 0; i < 256; ++i) byte[i] = crc32c::table_entry(i);
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// The crc32 instruction (SSE4.2) computes the same register update as the table, 8 bytes at a time.
__attribute__((target("sse4.2"))) uint32_t raw_sse42_one(uint32_t crc, const uint8_t* p, int64_t n) {
  uint64_t c = crc;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  uint32_t c32 = uint32_t(c);
  for (; i < n; ++i) c32 = __builtin_ia32_crc32qi(c32, p[i]);
  return c32;
}
// Three independent streams hide the instruction's 3-cycle latency; their registers are combined
// with crc32c::shift (raw(A || B || C) = shift(shift(raw(A), |B|) ^ raw(B), |C|) ^ raw(C)).
__attribute__((target("sse4.2"))) uint32_t raw_sse42(const uint8_t* p, int64_t n) {
  const int64_t part = n / 3 / 8 * 8;
  if (part < 4096) return raw_sse42_one(0, p, n);
  uint64_t a = 0, b = 0, c = 0;
  const uint8_t *pa = p, *pb = p + part, *pc = p + 2 * part;
  for (int64_t i = 0; i < part; i += 8) {
    uint64_t va, vb, vc;
    std::memcpy(&va, pa + i, 8);
    std::memcpy(&vb, pb + i, 8);
    std::memcpy(&vc, pc + i, 8);
    a = __builtin_ia32_crc32di(a, va);
    b = __builtin_ia32_crc32di(b, vb);
    c = __builtin_ia32_crc32di(c, vc);
  }
  const uint32_t rc = raw_sse42_one(uint32_t(c), pc + part, n - 3 * part); // C: [2 part, n)
  const crc32c::X2n& x2n = tables().x2n;
  return crc32c::shift(crc32c::shift(uint32_t(a), uint64_t(part), x2n) ^ uint32_t(b), uint64_t(n - 2 * part), x2n) ^ rc;
}
bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

//! The raw register (initial value 0) of p[0, n).
uint32_t raw(const uint8_t* p, int64_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (have_sse42()) return raw_sse42(p, n);
#endif
  return crc32c::update(0, p, size_t(n), tables().byte);
}

} // namespace

void append_checksum(PacketLayout& l) {
  GRADCOMP_CHECK(l.nsections < kMaxSections, InvalidArgument, "packet layout: no room for the checksum section");
  const int i = l.nsections++;
  PacketSection& s = l.sections[i];
  s.name = "checksum";
  s.offset = l.bytes;
  s.count = kChecksumBytes;
  s.dtype = DType::uint8;
  l.bytes += kChecksumBytes;
  l.checksum_section = i;
  l.payload_section = -1;
}

uint32_t crc32c_host(const uint8_t* p, int64_t n) {
  constexpr int64_t kPart = int64_t(1) << 20;
  int T = 1;
#if defined(_OPENMP)
  if (n >= 2 * kPart) T = std::max(1, std::min<int>(omp_get_max_threads(), int(n / kPart)));
#endif
  uint32_t r = 0;
  if (T == 1) {
    r = raw(p, n);
  } else {
    std::vector<uint32_t> part(size_t(T), 0);
#pragma omp parallel for num_threads(T) schedule(static)
    for (int t = 0; t < T; ++t) {
      const int64_t lo = n * t / T, hi = n * (t + 1) / T;
      part[size_t(t)] = raw(p + lo, hi - lo);
    }
    for (int t = 0; t < T; ++t) {
      const int64_t lo = n * t / T, hi = n * (t + 1) / T;
      r = crc32c::shift(r, uint64_t(hi - lo), tables().x2n) ^ part[size_t(t)];
    }
  }
  return crc32c::finish(r, uint64_t(n), tables().x2n);
}

void write_checksum_host(uint8_t* packet, const PacketLayout& l) {
  const int64_t off = l.sections[l.checksum_section].offset;
  const uint32_t c = crc32c_host(packet, off);
  uint8_t* s = packet + off;
  std::memset(s, 0, size_t(kChecksumBytes));
  for (int i = 0; i < 4; ++i) s[i] = uint8_t(c >> (8 * i));
}

void check_checksum_host(const uint8_t* packet, const PacketLayout& l, const Codec& c) {
  const int64_t off = l.sections[l.checksum_section].offset;
  const uint8_t* s = packet + off;
  uint32_t stored = 0;
  for (int i = 0; i < 4; ++i) stored |= uint32_t(s[i]) << (8 * i);
  const uint32_t got = crc32c_host(packet, off);
  bool zero = true;
  for (int64_t i = 4; i < kChecksumBytes; ++i) zero = zero && s[i] == 0;
  if (got != stored || !zero)
    throw CorruptPacket(concat("decode: packet checksum mismatch: CRC-32C of bytes 0-", off - 1, " is 0x", std::hex,
                               got, " but the packet's checksum section (bytes ", std::dec, off, "-",
                               off + kChecksumBytes - 1, ") holds 0x", std::hex, stored,
                               zero ? "" : " with non-zero reserved bytes", std::dec, "; codec '", c.spec(),
                               "': bytes changed after encode (in transit or in memory)"));
}

} // namespace gradcomp::detail
