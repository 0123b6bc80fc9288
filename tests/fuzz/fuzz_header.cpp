// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the parsers of untrusted input other than packet bodies:
//   * the header check (detail::check_header / validate_header): the first 32 bytes of the input
//     are a header, checked against every registered codec's expectation for the header's own
//     numel (so the accepting path is reachable); the verdicts of the host message builder and of
//     check_header must agree, and an accepted header must describe a packet that fits;
//   * the spec parser (Codec::create) on the rest of the input as a string: InvalidArgument or a
//     codec whose canonical spec parses back to itself.
#include <cstring>
#include <exception>
#include <string>

#include "core/layout.hpp"
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradcomp;
  if (size >= sizeof(PacketHeader)) {
    PacketHeader h;
    std::memcpy(&h, data, sizeof h);
    const int64_t n = int64_t(h.numel % uint64_t(fuzz::kMaxNumel + 1));
    const int64_t capacity = int64_t(size);
    for (const auto& spec : fuzz::specs()) {
      auto c = Codec::create(spec);
      const detail::HeaderExpect e =
          detail::make_expect(capacity, [&](DType in) { return c->layout(n, in); });
      int input = -1;
      const bool ok = detail::check_header(h, e, &input) == detail::HeaderFault::ok;
      bool accepted = true;
      try {
        const DType in = detail::validate_header(h, e, *c);
        if (int(in) != input) std::abort();
      } catch (const CorruptPacket&) {
        accepted = false;
      }
      if (ok != accepted) std::abort();
      if (ok && c->layout(n, DType(input)).bytes > capacity) std::abort();
    }
  }
  const size_t off = size >= sizeof(PacketHeader) ? sizeof(PacketHeader) : 0;
  const std::string text(reinterpret_cast<const char*>(data + off), size - off);
  try {
    auto c = Codec::create(text);
    if (Codec::create(c->spec())->spec() != c->spec()) std::abort();
  } catch (const InvalidArgument&) {
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz_header: unexpected exception for spec of %zu bytes: %s\n", text.size(), e.what());
    std::abort();
  }
  return 0;
}
