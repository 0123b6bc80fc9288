// SPDX-License-Identifier: Apache-2.0
// The declarative packet layout (kernels/core/layout.hpp): section offsets and sizes for every wire
// dtype (packed int4 and bits included), the padding ranges, finish_packet (header, key, zeroed
// padding), the header check's verdict for each field (the same function runs on the device), the
// host messages, a maximum main parameter, and the EncodeContext key bytes (32: seed, step, bucket,
// chunk, 12 reserved zero bytes that decode checks). References: byte
// arithmetic written here.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/layout.hpp"
#include "gradcomp/gradcomp.hpp"

using gradcomp::DType;
using gradcomp::PacketHeader;
using gradcomp::detail::check_header;
using gradcomp::detail::HeaderExpect;
using gradcomp::detail::HeaderFault;
using gradcomp::detail::LayoutBuilder;

namespace {

gradcomp::PacketLayout sample(const gradcomp::Codec& c, int64_t n, DType in, gradcomp::MainParamKind kind) {
  LayoutBuilder b(c, n, in);
  b.wire(DType::float8_e4m3fn).index(DType::none).main_param(128, kind);
  b.section("codes", 7, DType::int4);          // 4 bytes at 32
  b.section("bits", 13, DType::uint1);         // 2 bytes at 48
  b.key();                                     // 32 bytes at 64
  b.section("scales", 3, DType::float8_e8m0fnu); // 3 bytes at 96
  return b.build();
}

HeaderExpect expect_for(const gradcomp::Codec& c, int64_t n, int64_t capacity, gradcomp::MainParamKind kind) {
  return gradcomp::detail::make_expect(capacity, [&](DType in) { return sample(c, n, in, kind); });
}

} // namespace

TEST(Layout, SectionsPaddingAndFinish) {
  auto c = gradcomp::Codec::create("none");
  const auto l = sample(*c, 99, DType::float16, gradcomp::MainParamKind::exact);
  ASSERT_EQ(l.nsections, 4);
  const int64_t want_off[] = {32, 48, 64, 96};
  for (int s = 0; s < 4; ++s) EXPECT_EQ(l.sections[s].offset, want_off[s]) << s;
  EXPECT_EQ(gradcomp::storage_bytes(DType::int4, 7), 4);
  EXPECT_EQ(gradcomp::storage_bytes(DType::uint1, 13), 2);
  EXPECT_EQ(gradcomp::storage_bytes(DType::uint1, 16), 2);
  EXPECT_EQ(gradcomp::storage_bytes(DType::uint1, 17), 3);
  EXPECT_EQ(l.bytes, 112);
  EXPECT_EQ(l.key_section, 2);
  EXPECT_EQ(gradcomp::kKeyBytes, 32);
  EXPECT_EQ(l.sections[2].count, 32);
  EXPECT_EQ(l.header.numel, 99u);
  EXPECT_EQ(l.header.input_dtype, uint8_t(DType::float16));
  EXPECT_EQ(l.header.wire_dtype, uint8_t(DType::float8_e4m3fn));
  std::vector<std::pair<int64_t, int64_t>> pads;
  gradcomp::detail::for_each_padding(l, [&](int64_t b, int64_t e) { pads.emplace_back(b, e); });
  const std::vector<std::pair<int64_t, int64_t>> want_pads = {{36, 48}, {50, 64}, {99, 112}};
  EXPECT_EQ(pads, want_pads);
  std::vector<uint8_t> p(112, 0xCD);
  const gradcomp::EncodeContext ctx{0x1122334455667788ull, 0xA1B2C3D4u, 0x01020304u, 0xF0E0D0C0u};
  gradcomp::detail::finish_packet(p.data(), l, gradcomp::kFlagNonFinite, ctx);
  for (auto [b, e] : want_pads)
    for (int64_t i = b; i < e; ++i) EXPECT_EQ(p[size_t(i)], 0) << i;
  for (int64_t i : {32, 35, 48, 49, 96, 98}) EXPECT_EQ(p[size_t(i)], 0xCD) << "a section byte was touched: " << i;
  // seed, step, bucket, chunk little-endian, then 12 reserved zero bytes (written over the 0xCD fill)
  const uint8_t key[32] = {0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0xD4, 0xC3, 0xB2, 0xA1, 4, 3, 2, 1,
                           0xC0, 0xD0, 0xE0, 0xF0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(std::memcmp(p.data() + 64, key, 32), 0);
  EXPECT_EQ(gradcomp::detail::load_key(p.data() + 64), ctx);
  EXPECT_TRUE(gradcomp::detail::key_reserved_zero(p.data() + 64));
  PacketHeader h;
  std::memcpy(&h, p.data(), 32);
  EXPECT_EQ(h.flags, gradcomp::kFlagNonFinite);
  EXPECT_EQ(h.magic, gradcomp::kPacketMagic);
  EXPECT_EQ(h.spec_hash, gradcomp::fnv1a32("none"));
  EXPECT_EQ(h.main_param, 128u);
}

TEST(Layout, HeaderCheckNamesEachField) {
  auto c = gradcomp::Codec::create("none");
  const int64_t n = 99;
  const HeaderExpect e = expect_for(*c, n, 112, gradcomp::MainParamKind::exact);
  const PacketHeader good = sample(*c, n, DType::bfloat16, gradcomp::MainParamKind::exact).header;
  int input = -1;
  ASSERT_EQ(check_header(good, e, &input), HeaderFault::ok);
  EXPECT_EQ(input, 2);
  struct Case {
    const char* what;
    void (*poke)(PacketHeader&);
    HeaderFault fault;
    const char* words;
  };
  const Case cases[] = {
      {"magic", [](PacketHeader& h) { h.magic ^= 1; }, HeaderFault::magic, "bad magic"},
      {"version", [](PacketHeader& h) { h.version = 2; }, HeaderFault::version, "version 2"},
      {"codec id", [](PacketHeader& h) { h.codec_id = 4; }, HeaderFault::codec_id, "codec id 4"},
      {"spec hash", [](PacketHeader& h) { h.spec_hash ^= 1; }, HeaderFault::spec_hash, "spec hash"},
      {"numel", [](PacketHeader& h) { h.numel = 98; }, HeaderFault::numel, "numel 98"},
      {"input", [](PacketHeader& h) { h.input_dtype = 3; }, HeaderFault::input_dtype, "input dtype code 3"},
      {"wire", [](PacketHeader& h) { h.wire_dtype = uint8_t(DType::float8_e5m2); }, HeaderFault::wire_dtype,
       "float8_e4m3fn"},
      {"index", [](PacketHeader& h) { h.index_dtype = uint8_t(DType::uint32); }, HeaderFault::index_dtype,
       "index dtype code 9"},
      {"main", [](PacketHeader& h) { h.main_param = 127; }, HeaderFault::main_param, "main parameter 127"},
      {"flags", [](PacketHeader& h) { h.flags = 0x40; }, HeaderFault::flags, "does not define"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    PacketHeader h = good;
    k.poke(h);
    EXPECT_EQ(check_header(h, e, &input), k.fault);
    try {
      gradcomp::detail::validate_header(h, e, *c);
      ADD_FAILURE() << "no exception";
    } catch (const gradcomp::CorruptPacket& ex) {
      EXPECT_NE(std::string(ex.what()).find(k.words), std::string::npos) << ex.what();
    }
  }
  // a packet buffer smaller than the layout
  const HeaderExpect small = expect_for(*c, n, 111, gradcomp::MainParamKind::exact);
  EXPECT_EQ(check_header(good, small, &input), HeaderFault::size);
  // the non-finite flag is defined
  PacketHeader nf = good;
  nf.flags = gradcomp::kFlagNonFinite;
  EXPECT_EQ(check_header(nf, e, &input), HeaderFault::ok);
}

TEST(Layout, MaximumMainParameterIsClamped) {
  auto c = gradcomp::Codec::create("none");
  const HeaderExpect e = expect_for(*c, 99, 112, gradcomp::MainParamKind::maximum);
  PacketHeader h = e.by_input[0].header;
  int input = -1;
  for (uint64_t count : {uint64_t(0), uint64_t(5), uint64_t(128), uint64_t(129), ~uint64_t(0)}) {
    h.main_param = count;
    EXPECT_EQ(check_header(h, e, &input), HeaderFault::ok) << count;
    EXPECT_EQ(gradcomp::detail::effective_main_param(h, e.by_input[0]), std::min<uint64_t>(count, 128)) << count;
  }
}

// The key section's 12 reserved bytes (20-31): every one of them non-zero is refused, by the host
// check (validate_key: CorruptPacket naming the byte) and by the device check (check_key_section,
// the function the CUDA decode kernels run); a layout without a key section has nothing to check.
TEST(Layout, KeyReservedBytesAreChecked) {
  auto c = gradcomp::Codec::create("none");
  const int64_t n = 99;
  const auto l = sample(*c, n, DType::float32, gradcomp::MainParamKind::exact);
  const HeaderExpect e = expect_for(*c, n, 112, gradcomp::MainParamKind::exact);
  EXPECT_EQ(gradcomp::detail::expect_key_offset(e, 0), 64);
  EXPECT_EQ(gradcomp::detail::expect_key_offset(e, 2), 64);
  std::vector<uint8_t> p(112, 0xCD);
  const gradcomp::EncodeContext ctx{~uint64_t(0), ~uint32_t(0), ~uint32_t(0), ~uint32_t(0)};
  gradcomp::detail::finish_packet(p.data(), l, 0, ctx);
  EXPECT_NO_THROW(gradcomp::detail::validate_key(p.data(), l, *c));
  EXPECT_TRUE(gradcomp::detail::check_key_section(p.data(), e, 0));
  EXPECT_EQ(gradcomp::detail::load_key(p.data() + 64), ctx);
  for (int b = 20; b < 32; ++b) {
    for (uint8_t v : {uint8_t(1), uint8_t(0x80)}) {
      SCOPED_TRACE("reserved byte " + std::to_string(b) + " = " + std::to_string(int(v)));
      std::vector<uint8_t> q = p;
      q[size_t(64 + b)] = v;
      EXPECT_FALSE(gradcomp::detail::key_reserved_zero(q.data() + 64));
      EXPECT_FALSE(gradcomp::detail::check_key_section(q.data(), e, 0));
      try {
        gradcomp::detail::validate_key(q.data(), l, *c);
        ADD_FAILURE() << "no exception";
      } catch (const gradcomp::CorruptPacket& ex) {
        EXPECT_NE(std::string(ex.what()).find("reserved byte " + std::to_string(b)), std::string::npos) << ex.what();
      }
    }
  }
  // no key section: nothing to check, whatever the bytes
  LayoutBuilder nb(*c, n, DType::float32);
  nb.section("payload", n, DType::float32);
  const auto nl = nb.build();
  EXPECT_EQ(nl.key_section, -1);
  std::vector<uint8_t> r(size_t(nl.bytes), 0xFF);
  EXPECT_NO_THROW(gradcomp::detail::validate_key(r.data(), nl, *c));
  const HeaderExpect ne = gradcomp::detail::make_expect(nl.bytes, [&](DType) { return nl; });
  EXPECT_EQ(gradcomp::detail::expect_key_offset(ne, 0), -1);
  EXPECT_TRUE(gradcomp::detail::check_key_section(r.data(), ne, 0));
}
