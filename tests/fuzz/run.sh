#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the libFuzzer targets with clang (CPU only, AddressSanitizer + UBSan) into build/fuzz,
# writes their seed corpora (valid packets of every registered codec, fuzz_seeds) and runs each
# target for a fixed number of executions: fuzz_decode once per registry example spec
# (GRADCOMP_FUZZ_SPEC) and once over all of them, fuzz_header over all of them. A crash fails the
# run; its input is kept in build/fuzz/crashes/ (turn it into a regression test in
# tests/cpp/test_fuzz_regressions.cpp).
# Usage: tests/fuzz/run.sh [RUNS_PER_TARGET]   (default 2^17; the total is printed, >= 2^20)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
runs=${1:-131072}
build=build/fuzz
if ! command -v clang++ >/dev/null; then echo "fuzz: clang++ not found (tests/setup.sh installs it)" >&2; exit 1; fi
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADCOMP_CUDA=OFF \
  -DGRADCOMP_FUZZ=ON -DGRADCOMP_NATIVE=OFF >/dev/null
cmake --build "$build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" --target fuzz_decode fuzz_header fuzz_seeds
rm -rf "$build/corpus" && mkdir -p "$build/corpus/decode" "$build/corpus/header" "$build/crashes"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
"$build/tests/fuzz/fuzz_seeds" "$build/corpus/decode" "$build/corpus/header"
# the seeds' encodes once more on each lower CPU variant (the call above ran the best one this
# processor has; a variant it lacks is ignored): UBSan sees each variant's conversions
for isa in avx2 generic; do
  mkdir -p "$build/corpus/isa_$isa/d" "$build/corpus/isa_$isa/h"
  GRADCOMP_CPU_ISA=$isa "$build/tests/fuzz/fuzz_seeds" "$build/corpus/isa_$isa/d" "$build/corpus/isa_$isa/h" >/dev/null
done
total=0
fuzz() { # name corpus [env]
  local name=$1 corpus=$2; shift 2
  echo "== fuzz: $name ($runs runs) $*"
  local log="$build/crashes/$name.log"
  if ! env "$@" "$build/tests/fuzz/$name" -runs="$runs" -seed=1 -max_len=4096 -artifact_prefix="$build/crashes/" \
      -print_final_stats=1 "$corpus" >"$log" 2>&1; then
    tail -40 "$log"; echo "fuzz: $name FAILED (input in $build/crashes/)" >&2; exit 1
  fi
  grep -E "stat::number_of_executed_units|Done" "$log" | tail -2
  total=$((total + runs))
}
mapfile -t specs < <(.venv/bin/python -c 'import gradcomp; [print(e) for c in gradcomp.codecs() for e in c["examples"]]' 2>/dev/null ||
                     printf '%s\n' none fp16 bf16 topk:ratio=0.01)
for s in "${specs[@]}"; do
  # one corpus copy per spec: libFuzzer adds what it finds to the corpus folder
  d="$build/corpus/decode_${s//[^a-zA-Z0-9]/_}"; cp -r "$build/corpus/decode" "$d"
  fuzz fuzz_decode "$d" GRADCOMP_FUZZ_SPEC="$s"
done
fuzz fuzz_decode "$build/corpus/decode"
fuzz fuzz_header "$build/corpus/header"
echo "fuzz: OK, $total executions in all"
