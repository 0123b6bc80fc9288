// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: Codec::decode of arbitrary packets (fuzz::decode_input, fuzz_common.hpp), for
// every codec of the registry. A packet may be rejected (CorruptPacket), never crash or write out of
// bounds: the packet and the output are heap buffers of exactly their size, so AddressSanitizer
// reports any access past them; any exception other than CorruptPacket aborts.
#include "fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::decode_input(data, size);
  return 0;
}
