#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole GoogleTest suite under AddressSanitizer + UndefinedBehaviorSanitizer with LeakSanitizer
# on: a CPU-only build (GRADCOMP_SANITIZE=address,undefined, GRADCOMP_CUDA=OFF) in build/asan.
# Any report fails the run (-fno-sanitize-recover=all, halt_on_error).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=build/asan
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADCOMP_CUDA=OFF -DGRADCOMP_TESTS=ON \
  -DGRADCOMP_SANITIZE=address,undefined >/dev/null
cmake --build "$build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" --target gradcomp_tests
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS=report_objects=1
ctest --test-dir "$build" --output-on-failure -j2
