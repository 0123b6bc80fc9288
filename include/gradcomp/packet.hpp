// SPDX-License-Identifier: Apache-2.0
//! @file packet.hpp
//! The 32-byte packet header, little-endian:
//!   offset 0 u32 magic "GCP1"; 4 u16 version; 6 u16 codec id; 8 u8 input dtype; 9 u8 wire dtype;
//!   10 u8 index dtype; 11 u8 flags (bit 0: non-finite seen; bit 1: the codec's fallback format);
//!   12 u32 FNV-1a hash of the canonical spec; 16 u64 numel; 24 u64 main parameter (k for top-k, 0
//!   for casts).
//! Sections follow, each starting at a 16-byte aligned offset. Packets are a multiple of 16 bytes.
#pragma once

#include <cstdint>
#include <string_view>

#include "gradcomp/types.hpp"

namespace gradcomp {

inline constexpr uint32_t kPacketMagic = 0x31504347u; //!< bytes 'G','C','P','1'
inline constexpr uint16_t kPacketVersion = 1;
inline constexpr int64_t kHeaderBytes = 32;
inline constexpr int64_t kPacketAlign = 16;
inline constexpr uint8_t kFlagNonFinite = 1u;
//! The packet carries its codec's fallback format (qsgd coding=elias: the dense int8 codes, because
//! the Elias stream would not fit its capacity).
inline constexpr uint8_t kFlagFallback = 2u;
//! Every defined flag bit. A codec's layout says which of them its packets may carry
//! (PacketLayout::flags_defined); a header with any other bit set is corrupt.
inline constexpr uint8_t kFlagsDefined = kFlagNonFinite | kFlagFallback;
//! Bytes of the EncodeContext section of keyed codecs: u64 seed, u32 step, u32 bucket, u32 chunk
//! (little-endian), then kKeyReservedBytes zero bytes (decode refuses a packet where they are not).
inline constexpr int64_t kKeyBytes = 32;
inline constexpr int64_t kKeyUsedBytes = 20;
inline constexpr int64_t kKeyReservedBytes = kKeyBytes - kKeyUsedBytes;

//! Status word bits, kept in the first 16 bytes of a workspace (u32 at offset 0).
inline constexpr uint32_t kStatusNonFinite = 1u; //!< a decoded packet carried the non-finite flag
inline constexpr uint32_t kStatusCorrupt = 2u;   //!< a packet failed validation (CUDA: entries skipped)
inline constexpr int64_t kStatusBytes = 16;

//! Codec ids written at header offset 6. Never renumbered. The registry line of a codec name
//! (kernels/core/registry.cpp) says which id its packets carry; the names below are reserved.
enum class CodecId : uint16_t {
  none = 1,
  fp16 = 2,
  bf16 = 3,
  topk = 4,
  randomk = 5,
  dgc = 6,
  fp8 = 7,
  int8 = 8,
  int4 = 9,
  qsgd = 10,
  onebit = 11,
  powersgd = 12,
  terngrad = 13,
};

struct PacketHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t codec_id;
  uint8_t input_dtype;
  uint8_t wire_dtype;
  uint8_t index_dtype;
  uint8_t flags;
  uint32_t spec_hash;
  uint64_t numel;
  uint64_t main_param;
};
static_assert(sizeof(PacketHeader) == 32, "packet header must be 32 bytes");

//! 32-bit FNV-1a of `s` (offset basis 2166136261, prime 16777619).
constexpr uint32_t fnv1a32(std::string_view s) noexcept {
  uint32_t h = 2166136261u;
  for (char c : s) {
    h ^= static_cast<uint8_t>(c);
    h *= 16777619u;
  }
  return h;
}

//! Round `bytes` up to a multiple of 16.
constexpr int64_t align16(int64_t bytes) noexcept { return (bytes + 15) / 16 * 16; }

} // namespace gradcomp
