// SPDX-License-Identifier: Apache-2.0
// The Elias-delta wire format of QSGD (`qsgd:...,coding=elias`, docs/contracts.md section 3), shared
// by the CPU and CUDA backends so that both write the same bits. Alistarh et al., "QSGD:
// Communication-efficient SGD via gradient quantization and encoding", NeurIPS 2017, section 3.2
// (coding the positions and levels of the non-zero entries with Elias integer codes); Elias, "Universal
// codeword sets and representations of the integers", IEEE Trans. Inf. Theory 21(2), 1975 (the
// delta code).
//
// Elias delta of an integer v >= 1: N = floor(log2 v), L = floor(log2(N + 1)); L zero bits, then
// N + 1 in L + 1 bits, then the low N bits of v: N + 2L + 1 bits, i.e. the (N + 2L + 1)-bit
// big-endian integer ((N + 1) << N) | (v - 2^N).
//
// The stream: the qsgd int8 codes c_0 .. c_{n-1} (common/qsgd.hpp), block by block (B elements, the
// last one shorter). Block b's bits are, for each non-zero code in index order: delta(gap), one sign
// bit (1: negative), delta(|c|), where gap = t - t_prev with t the position in the block and t_prev
// the previous non-zero's position (-1 for the first). Zero codes send nothing. Block b's bit count
// is lengths[b]; the blocks follow each other with no padding; bits are numbered from the most
// significant bit of stream byte 0 (bit p is bit 7 - p mod 8 of byte p / 8). Bits past the last
// block are zero.
//
// Bounds (B <= 4096, |c| <= 127): gap <= 4096 gives at most 19 bits, |c| <= 127 at most 11, so one
// entry is at most 31 bits; a block is at most 13 B bits (every gap 1, every |c| >= 64).
#pragma once

#include <cstdint>

#include "math.hpp"

namespace gradcomp::elias {

//! floor(log2 v) for v >= 1.
GRADCOMP_HD int floor_log2(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return 31 - __clz(int(v));
#else
  return 31 - __builtin_clz(v);
#endif
}

//! Bits of delta(v), v >= 1.
GRADCOMP_HD int delta_bits(uint32_t v) {
  const int N = floor_log2(v);
  return N + 2 * floor_log2(uint32_t(N + 1)) + 1;
}

//! delta(v) as an integer of delta_bits(v) bits (leading zeros implicit).
GRADCOMP_HD uint32_t delta_value(uint32_t v) {
  const int N = floor_log2(v);
  return (uint32_t(N + 1) << N) | (v - (1u << N));
}

//! The bits of one entry, (value, width <= 31): delta(gap), sign, delta(level).
struct Entry {
  uint32_t value;
  int width;
};
GRADCOMP_HD Entry entry(uint32_t gap, int32_t code) {
  const uint32_t level = uint32_t(code < 0 ? -code : code);
  const int wl = delta_bits(level);
  const int wg = delta_bits(gap);
  const uint32_t v = (delta_value(gap) << (wl + 1)) | (uint32_t(code < 0) << wl) | delta_value(level);
  return Entry{v, wg + 1 + wl};
}

//! Bits of block `codes[0, len)`.
GRADCOMP_HD uint32_t block_bits(const int8_t* codes, int64_t len) {
  uint32_t bits = 0;
  int64_t prev = -1;
  for (int64_t t = 0; t < len; ++t) {
    if (codes[t] == 0) continue;
    bits += uint32_t(entry(uint32_t(t - prev), codes[t]).width);
    prev = t;
  }
  return bits;
}

//! Reads bits [at, end) of a stream, most significant bit of byte 0 first. A code running past `end`
//! sets `bad`. peek() loads the 8 bytes from byte at / 8: the caller's buffer must hold 7 bytes past
//! the last byte of the stream (a qsgd packet's norms, ends and key follow its stream).
struct Reader {
  const uint8_t* s;
  uint64_t at, end;
  bool bad = false;
  //! The next 57 or more bits, most significant first (zeros below them).
  GRADCOMP_HD uint64_t peek() const {
    const uint8_t* p = s + (at >> 3);
#if defined(__CUDA_ARCH__)
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
#else
    uint64_t v;
    __builtin_memcpy(&v, p, 8);
    v = __builtin_bswap64(v); // big-endian: byte 0 most significant
#endif
    return v << (at & 7);
  }
  GRADCOMP_HD uint32_t bit() {
    const uint32_t b = uint32_t(peek() >> 63);
    if (++at > end) bad = true;
    return b;
  }
  //! One delta code; 0 (never a valid value) with `bad` set when it is malformed, runs past `end`
  //! or is above `limit`.
  GRADCOMP_HD uint32_t delta(uint32_t limit) {
    const uint64_t w = peek();
#if defined(__CUDA_ARCH__)
    const int L = w ? __clzll((long long)w) : 64;
#else
    const int L = w ? __builtin_clzll(w) : 64;
#endif
    if (L > 4) { // N + 1 <= 31 needs L <= 4
      bad = true;
      return 0;
    }
    const int N = int((w << L) >> (63 - L)) - 1; // N + 1: the L + 1 bits after the zeros
    if (N > 30) {
      bad = true;
      return 0;
    }
    const uint32_t low = N ? uint32_t((w << (2 * L + 1)) >> (64 - N)) : 0u;
    const uint32_t v = (1u << N) | low;
    at += uint64_t(2 * L + 1 + N);
    if (at > end || v > limit) {
      bad = true;
      return 0;
    }
    return v;
  }
};

//! Parse block bits [at, end) into codes[0, len) (zeros where nothing is sent). Returns false when
//! the bits are not exactly a valid sequence of entries: a gap past the block, a level outside [1,
//! levels], a code running past `end`. codes[] is fully written either way.
GRADCOMP_HD bool parse_block(const uint8_t* stream, uint64_t at, uint64_t end, int8_t* codes, int64_t len,
                             int levels) {
  for (int64_t t = 0; t < len; ++t) codes[t] = 0;
  Reader r{stream, at, end};
  int64_t prev = -1;
  while (r.at < end) {
    const uint32_t gap = r.delta(uint32_t(len - prev - 1 > 0 ? len - prev - 1 : 0));
    if (r.bad) return false;
    const uint32_t neg = r.bit();
    const uint32_t level = r.delta(uint32_t(levels));
    if (r.bad) return false;
    prev += int64_t(gap);
    codes[prev] = int8_t(neg ? -int32_t(level) : int32_t(level));
  }
  return true;
}

} // namespace gradcomp::elias
