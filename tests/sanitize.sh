#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole GoogleTest suite under AddressSanitizer + UndefinedBehaviorSanitizer with LeakSanitizer
# on: a CPU-only g++ build (GRADCOMP_SANITIZE=address,undefined, GRADCOMP_CUDA=OFF) in build/asan,
# with one ISA variant for this machine (GRADCOMP_NATIVE=ON: test_isa compares the variants in the
# normal build, and tests/fuzz/run.sh runs every variant's encodes under clang's ASan + UBSan).
# Any report fails the run (-fno-sanitize-recover=all, halt_on_error).
# On this 2-core machine: about 70 s with the build kept (ctest; 306-335 s with the three ISA
# variants before), the build from scratch about 5-6 min. The slowest entries under ASan are
# CpuIsa.VariantsGiveIdenticalPackets (~30 s), TopKLarge.SampledPrefilter, BlockQ.PacketsMatchAPlainLoop
# (~16 s each), TopK.SmallSweep and TopKLarge.FourMillion (~13 s each).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=build/asan
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADCOMP_CUDA=OFF -DGRADCOMP_TESTS=ON \
  -DGRADCOMP_NATIVE=ON -DGRADCOMP_SANITIZE=address,undefined >/dev/null
cmake --build "$build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" --target gradcomp_tests
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS=report_objects=1
ctest --test-dir "$build" --output-on-failure -j2
