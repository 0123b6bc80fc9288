// SPDX-License-Identifier: Apache-2.0
// The declarative packet layout (docs/contracts.md section 3) and everything derived from it, written
// once: building a layout, the header of a packet, the header check (the same function runs on
// the host, which turns its verdict into a CorruptPacket message, and in the CUDA decode kernels,
// which set the status word instead), the padding ranges that encoders zero, and the 32-byte key
// section of codecs that draw random numbers.
//
// A layout is a plain struct (gradcomp::PacketLayout, include/gradcomp/codec.hpp) so that it can be
// passed to a CUDA kernel by value. The GRADCOMP_HD functions below are __host__ __device__ under
// nvcc; the rest is host code.
#pragma once

#include <cstdint>
#include <string>

#include "../common/math.hpp"
#include "gradcomp/codec.hpp"

namespace gradcomp::detail {

// ---- building ---------------------------------------------------------------------------------------
//! Builds a PacketLayout: the header fields, then sections appended at 16-byte aligned offsets.
class LayoutBuilder {
 public:
  LayoutBuilder(const Codec& c, int64_t numel, DType input);
  LayoutBuilder& wire(DType t);
  LayoutBuilder& index(DType t);
  LayoutBuilder& main_param(int64_t v, MainParamKind kind = MainParamKind::exact);
  //! Let packets carry kFlagFallback (a codec with a fallback format).
  LayoutBuilder& fallback_flag();
  //! Append a section of `count` elements of `dtype`; returns its index.
  int section(const char* name, int64_t count, DType dtype);
  //! Append the section an allreduce may sum (linear codecs); returns its index.
  int payload(const char* name, int64_t count, DType dtype);
  //! Append the 32-byte EncodeContext section (kKeyBytes); returns its index.
  int key();
  PacketLayout build() const;

 private:
  PacketLayout l_{};
  int64_t end_ = kHeaderBytes;
};

//! The expected layouts of a packet for each input dtype it may come from (index 0 / 1 / 2 =
//! float32 / float16 / bfloat16: the header's input dtype selects one), and the bytes the packet
//! buffer holds. What a decode checks a header against, on the host and on the device.
struct HeaderExpect {
  PacketLayout by_input[3];
  int64_t capacity = 0;
  //! CUDA, integrity=crc32c: the veto word the checksum kernel sets on a mismatch (device memory;
  //! null: none). The decode kernels' prologue then treats the packet as corrupt and writes nothing.
  const uint32_t* veto = nullptr;
};

// ---- the header check (host and device) ---------------------------------------------------------
enum class HeaderFault : int32_t {
  ok = 0,
  magic,
  version,
  codec_id,
  spec_hash,
  numel,
  input_dtype,
  wire_dtype,
  index_dtype,
  main_param,
  flags,
  size,
};

//! Check a header against the expectation. On success returns HeaderFault::ok and sets `*input` to
//! the header's input dtype code (0..2), which selects e.by_input[*input]. (The layout is selected
//! by an unrolled loop over constant indices, so that a CUDA kernel never indexes its parameters
//! dynamically, which would copy them to local memory.)
GRADCOMP_HD HeaderFault check_header(const PacketHeader& h, const HeaderExpect& e, int* input) {
  const PacketHeader& x = e.by_input[0].header;
  if (h.magic != x.magic) return HeaderFault::magic;
  if (h.version != x.version) return HeaderFault::version;
  if (h.codec_id != x.codec_id) return HeaderFault::codec_id;
  if (h.spec_hash != x.spec_hash) return HeaderFault::spec_hash;
  if (h.numel != x.numel) return HeaderFault::numel;
  if (h.input_dtype > 2) return HeaderFault::input_dtype;
  HeaderFault f = HeaderFault::ok;
  GRADCOMP_UNROLL
  for (int i = 0; i < 3; ++i) {
    if (i != int(h.input_dtype)) continue;
    const PacketLayout& l = e.by_input[i];
    if (h.wire_dtype != l.header.wire_dtype) f = HeaderFault::wire_dtype;
    else if (h.index_dtype != l.header.index_dtype) f = HeaderFault::index_dtype;
    else if (l.main_kind == MainParamKind::exact && h.main_param != l.header.main_param) f = HeaderFault::main_param;
    else if ((h.flags & ~l.flags_defined) != 0) f = HeaderFault::flags;
    else if (l.bytes > e.capacity) f = HeaderFault::size;
  }
  if (f == HeaderFault::ok) *input = h.input_dtype;
  return f;
}

//! Section `s` of the layout for input dtype code `input` (0..2), by value (unrolled constant
//! indices, see check_header).
GRADCOMP_HD PacketSection expect_section(const HeaderExpect& e, int input, int s) {
  PacketSection out{};
  GRADCOMP_UNROLL
  for (int i = 0; i < 3; ++i) {
    GRADCOMP_UNROLL
    for (int j = 0; j < kMaxSections; ++j)
      if (i == input && j == s) out = e.by_input[i].sections[j];
  }
  return out;
}

//! The main parameter a decoder may use: the header's, clamped to the layout's value when that is a
//! maximum (variable-count codecs), else the layout's (equal to the header's after check_header).
GRADCOMP_HD uint64_t effective_main_param(const PacketHeader& h, const PacketLayout& l) {
  if (l.main_kind == MainParamKind::maximum) return h.main_param < l.header.main_param ? h.main_param : l.header.main_param;
  return l.header.main_param;
}

// ---- padding ------------------------------------------------------------------------------------------
//! Calls f(begin, end) for each byte range [begin, end) of the packet that no section covers
//! (between the header and the first section, between sections, after the last one up to l.bytes);
//! at most kMaxSections + 1 ranges, each shorter than 16 bytes.
template <class F> GRADCOMP_HD void for_each_padding(const PacketLayout& l, F&& f) {
  int64_t at = kHeaderBytes;
  GRADCOMP_UNROLL
  for (int s = 0; s <= kMaxSections; ++s) {
    if (s > l.nsections) continue;
    const int64_t next = s < l.nsections ? l.sections[s].offset : l.bytes;
    if (next > at) f(at, next);
    if (s < l.nsections) at = l.sections[s].offset + storage_bytes(l.sections[s].dtype, l.sections[s].count);
  }
}

// ---- the key section ------------------------------------------------------------------------------
//! Write ctx into the 32-byte key section at `p`: little-endian u64 seed (bytes 0-7), u32 step
//! (8-11), u32 bucket (12-15), u32 chunk (16-19), then 12 zero bytes (20-31, reserved).
GRADCOMP_HD void store_key(uint8_t* p, const EncodeContext& ctx) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(ctx.seed >> (8 * i));
  for (int i = 0; i < 4; ++i) p[8 + i] = uint8_t(ctx.step >> (8 * i));
  for (int i = 0; i < 4; ++i) p[12 + i] = uint8_t(ctx.bucket >> (8 * i));
  for (int i = 0; i < 4; ++i) p[16 + i] = uint8_t(ctx.chunk >> (8 * i));
  for (int i = int(kKeyUsedBytes); i < int(kKeyBytes); ++i) p[i] = 0;
}
GRADCOMP_HD EncodeContext load_key(const uint8_t* p) {
  EncodeContext c{};
  for (int i = 0; i < 8; ++i) c.seed |= uint64_t(p[i]) << (8 * i);
  for (int i = 0; i < 4; ++i) c.step |= uint32_t(p[8 + i]) << (8 * i);
  for (int i = 0; i < 4; ++i) c.bucket |= uint32_t(p[12 + i]) << (8 * i);
  for (int i = 0; i < 4; ++i) c.chunk |= uint32_t(p[16 + i]) << (8 * i);
  return c;
}
//! Whether the reserved bytes 20-31 of the key section at `p` are zero (decode refuses the packet
//! otherwise: CorruptPacket on the CPU, kStatusCorrupt on CUDA).
GRADCOMP_HD bool key_reserved_zero(const uint8_t* p) {
  uint8_t any = 0;
  for (int i = int(kKeyUsedBytes); i < int(kKeyBytes); ++i) any |= p[i];
  return any == 0;
}
//! The byte offset of the key section in the layout for input dtype code `input` (0..2), or -1 when
//! the codec has none (unrolled constant indices, see check_header).
GRADCOMP_HD int64_t expect_key_offset(const HeaderExpect& e, int input) {
  int64_t off = -1;
  GRADCOMP_UNROLL
  for (int i = 0; i < 3; ++i) {
    const int ks = e.by_input[i].key_section;
    GRADCOMP_UNROLL
    for (int j = 0; j < kMaxSections; ++j)
      if (i == input && j == ks) off = e.by_input[i].sections[j].offset;
  }
  return off;
}
//! The device-side check of a packet whose header passed check_header: the key section's reserved
//! bytes (keyed codecs). True when the packet may be decoded.
GRADCOMP_HD bool check_key_section(const uint8_t* packet, const HeaderExpect& e, int input) {
  const int64_t off = expect_key_offset(e, input);
  return off < 0 || key_reserved_zero(packet + off);
}

// ---- host side ----------------------------------------------------------------------------------------
//! The expectation for a decode of `numel` elements into a packet buffer of `capacity` bytes;
//! `layout_of(input)` gives the codec's layout for an input dtype.
template <class LayoutOf> HeaderExpect make_expect(int64_t capacity, LayoutOf&& layout_of) {
  HeaderExpect e{};
  e.by_input[0] = layout_of(DType::float32);
  e.by_input[1] = layout_of(DType::float16);
  e.by_input[2] = layout_of(DType::bfloat16);
  e.capacity = capacity;
  return e;
}

//! Host validation of a CPU packet: check_header, turned into a CorruptPacket naming the field, the
//! packet's value and what the codec expects. Returns the header's input dtype.
DType validate_header(const PacketHeader& h, const HeaderExpect& e, const Codec& c);
//! Host validation of the key section of a CPU packet whose header passed validate_header (`l` the
//! layout of its input dtype): CorruptPacket naming the first non-zero reserved byte. No-op for
//! codecs without a key section.
void validate_key(const uint8_t* packet, const PacketLayout& l, const Codec& c);

//! CPU encoders: write the header (with `flags`), the key section (keyed codecs) and zero the padding.
void finish_packet(uint8_t* packet, const PacketLayout& l, uint8_t flags, const EncodeContext& ctx);

} // namespace gradcomp::detail
