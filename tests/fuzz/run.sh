#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the libFuzzer targets with clang (CPU only, AddressSanitizer + UBSan, every ISA variant)
# into build/fuzz, writes their seed corpora (fuzz_seeds: valid packets of every registry example
# spec, each seed's first byte naming its spec, so one corpus covers every codec; the seeds are
# encoded once more on each lower ISA variant so that UBSan sees every variant's encodes) and runs
# each target for a fixed time on both cores (-jobs=2 -workers=2, sharing one corpus):
# fuzz_decode over every spec for 30 s, then fuzz_header for 10 s. The build is -O1 with line
# tables (CMakeLists.txt: GRADCOMP_OPT; every ISA variant). From scratch on this 2-core machine
# (2026-12-05) the stage took 123 s with 2.26 million executions (167-182 s before the top-k
# kernel's lighter build; 236 s and 1.94 million at -O3 -g);
# with the build kept it is the fuzzing alone, about 50 s. The executions are
# read from libFuzzer's final stats (stat::number_of_executed_units); fewer than
# GRADCOMP_FUZZ_MIN_EXECS (default 10^6) in all fail the run. A crash fails the run; its input is
# kept in build/fuzz/crashes/ (turn it into a regression test in
# tests/cpp/test_fuzz_regressions.cpp) and the job's log in build/fuzz/logs/.
# Environment: GRADCOMP_FUZZ_DECODE_SECONDS (default 30), GRADCOMP_FUZZ_HEADER_SECONDS (default 10),
# GRADCOMP_FUZZ_JOBS (default 2), GRADCOMP_FUZZ_MIN_EXECS (default 1000000).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
decode_s=${GRADCOMP_FUZZ_DECODE_SECONDS:-30}
header_s=${GRADCOMP_FUZZ_HEADER_SECONDS:-10}
jobs=${GRADCOMP_FUZZ_JOBS:-2}
min_execs=${GRADCOMP_FUZZ_MIN_EXECS:-1000000}
build=build/fuzz
if ! command -v clang++ >/dev/null; then echo "fuzz: clang++ not found (tests/setup.sh installs it)" >&2; exit 1; fi
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADCOMP_CUDA=OFF \
  -DGRADCOMP_FUZZ=ON -DGRADCOMP_NATIVE=OFF >/dev/null
cmake --build "$build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" --target fuzz_decode fuzz_header fuzz_seeds
rm -rf "$build/corpus" "$build/logs" && mkdir -p "$build/corpus/decode" "$build/corpus/header" "$build/crashes" "$build/logs"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# no GRADCOMP_FUZZ_SPEC: fuzz::specs() is every registry example, and byte 0 of an input picks one
unset GRADCOMP_FUZZ_SPEC
"$build/tests/fuzz/fuzz_seeds" "$build/corpus/decode" "$build/corpus/header"
# the seeds' encodes once more on each lower CPU variant (the call above ran the best one this
# processor has; a variant it lacks is ignored): UBSan sees each variant's conversions
for isa in avx2 generic; do
  mkdir -p "$build/corpus/isa_$isa/d" "$build/corpus/isa_$isa/h"
  GRADCOMP_CPU_ISA=$isa "$build/tests/fuzz/fuzz_seeds" "$build/corpus/isa_$isa/d" "$build/corpus/isa_$isa/h" >/dev/null
done
total=0
fuzz() { # name corpus seconds
  local name=$1 corpus=$2 secs=$3
  echo "== fuzz: $name for $secs s on $jobs jobs"
  local logs="$root/$build/logs/$name" rc=0
  mkdir -p "$logs"
  # -jobs writes each job's output to fuzz-<job>.log in the current directory
  (cd "$logs" && "$root/$build/tests/fuzz/$name" -jobs="$jobs" -workers="$jobs" -max_total_time="$secs" \
     -max_len=4096 -artifact_prefix="$root/$build/crashes/" -print_final_stats=1 "$root/$corpus" >driver.log 2>&1) || rc=$?
  local n=0 e
  for e in $(sed -n 's/^stat::number_of_executed_units: *//p' "$logs"/fuzz-*.log); do n=$((n + e)); done
  if [ $rc -ne 0 ] || grep -qE "ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:" "$logs"/fuzz-*.log; then
    local f; f=$(grep -lE "ERROR: |runtime error:" "$logs"/fuzz-*.log | head -1 || true)
    tail -60 "${f:-$logs/driver.log}"
    echo "fuzz: $name FAILED (input in $build/crashes/, logs in $build/logs/$name/)" >&2; exit 1
  fi
  grep -hE "^#[0-9]+.*DONE" "$logs"/fuzz-*.log || true
  echo "fuzz: $name: $n executions"
  total=$((total + n))
}
fuzz fuzz_decode "$build/corpus/decode" "$decode_s"
fuzz fuzz_header "$build/corpus/header" "$header_s"
if [ "$total" -lt "$min_execs" ]; then
  echo "fuzz: only $total executions in all (expected >= $min_execs)" >&2; exit 1
fi
echo "fuzz: OK, $total executions in all"
