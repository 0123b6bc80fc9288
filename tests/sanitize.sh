#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole GoogleTest suite under AddressSanitizer + UndefinedBehaviorSanitizer with LeakSanitizer
# on: a CPU-only g++ build (GRADCOMP_SANITIZE=address,undefined, GRADCOMP_CUDA=OFF) in build/asan,
# with one ISA variant for this machine (GRADCOMP_NATIVE=ON: test_isa compares the variants in the
# normal build, and tests/fuzz/run.sh runs every variant's encodes under clang's ASan + UBSan).
# Any report fails the run (-fno-sanitize-recover=all, halt_on_error). ctest runs the suite as 8
# GoogleTest shards (GRADCOMP_CTEST_SHARDS, tests/cpp/CMakeLists.txt): an ASan process takes 0.18 s
# to start, most of the time of one process per test.
# Compiled at -O1 with line tables (CMakeLists.txt: GRADCOMP_OPT for sanitizer builds; ASan's
# recommended level, the same result bits). On this 2-core machine (2026-12-05, from scratch, in
# the test command): 128 s (190 s before the shards and the lighter top-k build; 286 s at -O3 -g).
# The slowest entries under ASan are CpuIsa.VariantsGiveIdenticalPackets, TopKLarge.SampledPrefilter,
# BlockQ.PacketsMatchAPlainLoop, TopK.SmallSweep and TopKLarge.FourMillion (the ctest label slow).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=build/asan
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADCOMP_CUDA=OFF -DGRADCOMP_TESTS=ON \
  -DGRADCOMP_NATIVE=ON -DGRADCOMP_SANITIZE=address,undefined -DGRADCOMP_CTEST_SHARDS=8 >/dev/null
cmake --build "$build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" --target gradcomp_tests
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS=report_objects=1
ctest --test-dir "$build" --output-on-failure -j2
