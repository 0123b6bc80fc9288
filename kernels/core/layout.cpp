// SPDX-License-Identifier: Apache-2.0
#include "layout.hpp"

#include <cstring>

#include "gradcomp/error.hpp"

namespace gradcomp::detail {

LayoutBuilder::LayoutBuilder(const Codec& c, int64_t numel, DType input) {
  PacketHeader& h = l_.header;
  h.magic = kPacketMagic;
  h.version = kPacketVersion;
  h.codec_id = static_cast<uint16_t>(c.id());
  h.input_dtype = static_cast<uint8_t>(input);
  h.wire_dtype = static_cast<uint8_t>(DType::none);
  h.index_dtype = static_cast<uint8_t>(DType::none);
  h.flags = 0;
  h.spec_hash = c.spec_hash();
  h.numel = static_cast<uint64_t>(numel);
  h.main_param = 0;
}

LayoutBuilder& LayoutBuilder::wire(DType t) {
  l_.header.wire_dtype = static_cast<uint8_t>(t);
  return *this;
}
LayoutBuilder& LayoutBuilder::index(DType t) {
  l_.header.index_dtype = static_cast<uint8_t>(t);
  return *this;
}
LayoutBuilder& LayoutBuilder::main_param(int64_t v, MainParamKind kind) {
  l_.header.main_param = static_cast<uint64_t>(v);
  l_.main_kind = kind;
  return *this;
}

LayoutBuilder& LayoutBuilder::fallback_flag() {
  l_.flags_defined = uint8_t(l_.flags_defined | kFlagFallback);
  return *this;
}

int LayoutBuilder::section(const char* name, int64_t count, DType dtype) {
  GRADCOMP_CHECK(l_.nsections < kMaxSections, InvalidArgument, "packet layout: more than ", kMaxSections,
                 " sections");
  GRADCOMP_CHECK(count >= 0 && dtype_bits(dtype) > 0, InvalidArgument, "packet layout: section '", name,
                 "' has count ", count, " of dtype ", dtype_name(dtype));
  const int i = l_.nsections++;
  PacketSection& s = l_.sections[i];
  s.name = name;
  s.offset = end_;
  s.count = count;
  s.dtype = dtype;
  end_ = align16(end_ + storage_bytes(dtype, count));
  return i;
}

int LayoutBuilder::payload(const char* name, int64_t count, DType dtype) {
  const int i = section(name, count, dtype);
  l_.payload_section = i;
  return i;
}

int LayoutBuilder::key() {
  const int i = section("key", kKeyBytes, DType::uint8);
  l_.key_section = i;
  return i;
}

PacketLayout LayoutBuilder::build() const {
  PacketLayout l = l_;
  l.bytes = end_;
  return l;
}

DType validate_header(const PacketHeader& h, const HeaderExpect& e, const Codec& c) {
  int input = -1;
  const HeaderFault f = check_header(h, e, &input);
  if (f == HeaderFault::ok) return static_cast<DType>(input);
  const PacketHeader& x = e.by_input[0].header;
  const char* call = "decode";
  const std::string& spec = c.spec();
  auto dtype_str = [](uint8_t code) {
    return code <= kMaxDTypeCode || code == uint8_t(DType::none) ? std::string(dtype_name(DType(code)))
                                                                 : "code " + std::to_string(int(code));
  };
  switch (f) {
    case HeaderFault::magic:
      throw CorruptPacket(concat(call, ": bad magic 0x", std::hex, h.magic, " (expected 0x", kPacketMagic, " 'GCP1')"));
    case HeaderFault::version:
      throw CorruptPacket(concat(call, ": packet version ", h.version, " (expected ", kPacketVersion, ")"));
    case HeaderFault::codec_id:
      throw CorruptPacket(concat(call, ": packet codec id ", h.codec_id, " but this codec ('", spec, "') has id ",
                                 x.codec_id));
    case HeaderFault::spec_hash:
      throw CorruptPacket(concat(call, ": packet spec hash 0x", std::hex, h.spec_hash, " does not match codec '", spec,
                                 "' (hash 0x", x.spec_hash, "): the packet was made by a codec with other parameters"));
    case HeaderFault::numel:
      throw CorruptPacket(concat(call, ": packet numel ", h.numel, " but out has ", x.numel, " elements"));
    case HeaderFault::input_dtype:
      throw CorruptPacket(concat(call, ": packet input dtype code ", int(h.input_dtype),
                                 " is not float32/float16/bfloat16"));
    default: break;
  }
  const PacketLayout& l = e.by_input[h.input_dtype];
  switch (f) {
    case HeaderFault::wire_dtype:
      throw CorruptPacket(concat(call, ": packet wire dtype code ", int(h.wire_dtype), " but codec '", spec, "' sends ",
                                 dtype_str(l.header.wire_dtype), " (code ", int(l.header.wire_dtype), ") for ",
                                 dtype_name(DType(h.input_dtype)), " input"));
    case HeaderFault::index_dtype:
      throw CorruptPacket(concat(call, ": packet index dtype code ", int(h.index_dtype), " but codec '", spec,
                                 "' uses ", dtype_str(l.header.index_dtype), " (code ", int(l.header.index_dtype),
                                 ") for ", x.numel, " elements"));
    case HeaderFault::main_param:
      throw CorruptPacket(concat(call, ": packet main parameter ", h.main_param, " but codec '", spec, "' uses ",
                                 l.header.main_param, " for ", x.numel, " elements"));
    case HeaderFault::flags:
      throw CorruptPacket(concat(call, ": packet flags 0x", std::hex, int(h.flags), " set bits codec '", spec,
                                 "' does not define (defined: 0x", int(l.flags_defined), ")"));
    case HeaderFault::size:
      throw CorruptPacket(concat(call, ": packet buffer holds ", e.capacity, " bytes but its header describes a ",
                                 l.bytes, "-byte packet"));
    default: break;
  }
  throw CorruptPacket(concat(call, ": packet header rejected (fault ", int(f), ")"));
}

void validate_key(const uint8_t* packet, const PacketLayout& l, const Codec& c) {
  if (l.key_section < 0) return;
  const int64_t off = l.sections[l.key_section].offset;
  const uint8_t* k = packet + off;
  if (key_reserved_zero(k)) return;
  int64_t at = kKeyUsedBytes;
  while (k[at] == 0) ++at;
  throw CorruptPacket(concat("decode: packet key section (bytes ", off, "-", off + kKeyBytes - 1, ") has 0x", std::hex,
                             int(k[at]), std::dec, " at reserved byte ", at, " (packet byte ", off + at,
                             "); codec '", c.spec(), "' expects bytes ", kKeyUsedBytes, "-", kKeyBytes - 1,
                             " of its key section to be zero"));
}

void finish_packet(uint8_t* packet, const PacketLayout& l, uint8_t flags, const EncodeContext& ctx) {
  PacketHeader h = l.header;
  h.flags = flags;
  std::memcpy(packet, &h, sizeof h);
  if (l.key_section >= 0) store_key(packet + l.sections[l.key_section].offset, ctx);
  for_each_padding(l, [&](int64_t b, int64_t e) { std::memset(packet + b, 0, size_t(e - b)); });
}

} // namespace gradcomp::detail
