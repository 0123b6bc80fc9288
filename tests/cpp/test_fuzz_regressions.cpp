// SPDX-License-Identifier: Apache-2.0
// Every input the fuzzers ever crashed on (tests/fuzz/regressions/, one file per input, named for
// the defect) runs through the fuzz harness (fuzz::decode_with of tests/fuzz/fuzz_common.hpp)
// with every example spec of the registry: it must be rejected or decoded, never crash (under the
// sanitizer build, never access memory out of bounds). The verdict for the spec a crash was found
// with is checked as well.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "../fuzz/fuzz_common.hpp"

#ifndef GRADCOMP_FUZZ_REGRESSIONS
#error "GRADCOMP_FUZZ_REGRESSIONS (the folder of regression inputs) must be defined"
#endif

TEST(FuzzRegressions, EveryInputIsRejectedOrDecoded) {
  // (input, spec) -> verdict: 0 = rejected (CorruptPacket)
  const std::map<std::pair<std::string, std::string>, int> expected = {
      {{"topk_index_out_of_range", "topk:ratio=0.01"}, 0}, // planted defect: no index range check
      // a valid packet; the CPU decode formed a pointer before its block buffer (UBSan)
      {{"qsgd_elias_decode_pointer_past_block_buffer", "qsgd:block=5,coding=elias"}, 1},
  };
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(GRADCOMP_FUZZ_REGRESSIONS)) {
    std::ifstream f(entry.path(), std::ios::binary);
    const std::vector<uint8_t> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const std::string name = entry.path().filename().string();
    for (const std::string& spec : fuzz::specs()) {
      SCOPED_TRACE(name + " with " + spec);
      const int verdict = fuzz::decode_with(*gradcomp::Codec::create(spec), data.data(), data.size());
      if (auto it = expected.find({name, spec}); it != expected.end()) EXPECT_EQ(verdict, it->second);
    }
    ++files;
  }
  EXPECT_GE(files, 1);
}
