// SPDX-License-Identifier: Apache-2.0
// The declarative packet layout (kernels/core/layout.hpp): section offsets and sizes for every wire
// dtype (packed int4 and bits included), the padding ranges, finish_packet (header, key, zeroed
// padding), the header check's verdict for each field (the same function runs on the device), the
// host messages, a maximum main parameter, and the EncodeContext key bytes. References: byte
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
  b.key();                                     // 16 bytes at 64
  b.section("scales", 3, DType::float8_e8m0fnu); // 3 bytes at 80
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
  const int64_t want_off[] = {32, 48, 64, 80};
  for (int s = 0; s < 4; ++s) EXPECT_EQ(l.sections[s].offset, want_off[s]) << s;
  EXPECT_EQ(gradcomp::storage_bytes(DType::int4, 7), 4);
  EXPECT_EQ(gradcomp::storage_bytes(DType::uint1, 13), 2);
  EXPECT_EQ(gradcomp::storage_bytes(DType::uint1, 16), 2);
  EXPECT_EQ(gradcomp::storage_bytes(DType::uint1, 17), 3);
  EXPECT_EQ(l.bytes, 96);
  EXPECT_EQ(l.key_section, 2);
  EXPECT_EQ(l.header.numel, 99u);
  EXPECT_EQ(l.header.input_dtype, uint8_t(DType::float16));
  EXPECT_EQ(l.header.wire_dtype, uint8_t(DType::float8_e4m3fn));
  std::vector<std::pair<int64_t, int64_t>> pads;
  gradcomp::detail::for_each_padding(l, [&](int64_t b, int64_t e) { pads.emplace_back(b, e); });
  const std::vector<std::pair<int64_t, int64_t>> want_pads = {{36, 48}, {50, 64}, {83, 96}};
  EXPECT_EQ(pads, want_pads);
  std::vector<uint8_t> p(96, 0xCD);
  const gradcomp::EncodeContext ctx{0x1122334455667788ull, 0xA1B2C3D4u, 0x01020304u};
  gradcomp::detail::finish_packet(p.data(), l, gradcomp::kFlagNonFinite, ctx);
  for (auto [b, e] : want_pads)
    for (int64_t i = b; i < e; ++i) EXPECT_EQ(p[size_t(i)], 0) << i;
  for (int64_t i : {32, 35, 48, 49, 80, 82}) EXPECT_EQ(p[size_t(i)], 0xCD) << "a section byte was touched: " << i;
  const uint8_t key[16] = {0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, 0xD4, 0xC3, 0xB2, 0xA1, 4, 3, 2, 1};
  EXPECT_EQ(std::memcmp(p.data() + 64, key, 16), 0);
  EXPECT_EQ(gradcomp::detail::load_key(p.data() + 64), ctx);
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
  const HeaderExpect e = expect_for(*c, n, 96, gradcomp::MainParamKind::exact);
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
      {"flags", [](PacketHeader& h) { h.flags = 0x40; }, HeaderFault::flags, "undefined bits"},
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
  const HeaderExpect small = expect_for(*c, n, 95, gradcomp::MainParamKind::exact);
  EXPECT_EQ(check_header(good, small, &input), HeaderFault::size);
  // the non-finite flag is defined
  PacketHeader nf = good;
  nf.flags = gradcomp::kFlagNonFinite;
  EXPECT_EQ(check_header(nf, e, &input), HeaderFault::ok);
}

TEST(Layout, MaximumMainParameterIsClamped) {
  auto c = gradcomp::Codec::create("none");
  const HeaderExpect e = expect_for(*c, 99, 96, gradcomp::MainParamKind::maximum);
  PacketHeader h = e.by_input[0].header;
  int input = -1;
  for (uint64_t count : {uint64_t(0), uint64_t(5), uint64_t(128), uint64_t(129), ~uint64_t(0)}) {
    h.main_param = count;
    EXPECT_EQ(check_header(h, e, &input), HeaderFault::ok) << count;
    EXPECT_EQ(gradcomp::detail::effective_main_param(h, e.by_input[0]), std::min<uint64_t>(count, 128)) << count;
  }
}
