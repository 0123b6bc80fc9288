// SPDX-License-Identifier: Apache-2.0
// The `integrity=crc32c` spec key every codec accepts (docs/contracts.md section 3): a 16-byte
// "checksum" section appended after a codec's own sections, holding the little-endian CRC-32C
// (kernels/common/crc32c.hpp) of every packet byte before it (header, sections, padding), then 12 zero
// bytes. Encode writes it after the codec's kernels; decode checks it before the codec's own checks
// (CPU: CorruptPacket before anything is written; CUDA: a kernel sets kStatusCorrupt and the veto
// word the decode kernels' prologue reads, so nothing is written).
#pragma once

#include <cstdint>

#include "gradcomp/codec.hpp"

namespace gradcomp::detail {

//! Bytes of the checksum section: u32 CRC-32C, then zeros.
inline constexpr int64_t kChecksumBytes = 16;
//! The decode veto word of a CUDA decode with a checksum: u32 at workspace byte 8.
inline constexpr int64_t kChecksumVetoOffset = 8;

//! Append the checksum section to a codec's layout; a packet with one is not summable (no payload).
void append_checksum(PacketLayout& l);

//! CRC-32C of p[0, n) on the host (SSE4.2 crc32 instructions where the CPU has them, else a table;
//! OpenMP threads above 1 MiB, combined by crc32c::shift).
uint32_t crc32c_host(const uint8_t* p, int64_t n);

//! Host: write the checksum of packet[0, checksum offset) into its section.
void write_checksum_host(uint8_t* packet, const PacketLayout& l);
//! Host: throw CorruptPacket naming both values when the checksum section does not match.
void check_checksum_host(const uint8_t* packet, const PacketLayout& l, const Codec& c);

} // namespace gradcomp::detail
