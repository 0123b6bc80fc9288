#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The quick tier: what a developer runs after each change (the README's test command is the whole
# suite, what CI runs). Needs tests/setup.sh to have run once (.venv, the Debian packages).
#   1. a CPU-only build with one ISA variant (-DGRADCOMP_NATIVE=ON) kept in build/quick between
#      runs (only what changed recompiles): the C++ core, the GoogleTest suite and the Python
#      module gradcomp._C, which is copied beside the sources (bindings/python/gradcomp/, ignored
#      by git) so that the tests import the sources as they are, not the installed package;
#   2. ctest -LE slow on that build (the GoogleTest entries labelled slow, tests/cpp/CMakeLists.txt,
#      are left to the whole suite);
#   3. pytest -m "not slow" on the sources (every codec's contract through the bindings, every
#      scheme on 2 gloo ranks, the hooks, the planner; the slow modules, the DeepSpeed trainings,
#      the failure cases and the main job's end-to-end runs are left to the whole suite) and the
#      codec contract suite (pytest --pyargs gradcomp.testing).
# Prints the time of each stage. Exits non-zero on any failure.
# Usage: tests/quick.sh [extra pytest arguments, e.g. -k topk]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if [ ! -x .venv/bin/python ]; then
  echo "quick: .venv is missing: run 'bash tests/setup.sh' once first" >&2; exit 1
fi
build=build/quick
times=()
stage() { # name command...
  local name=$1; shift
  local t0=$SECONDS rc=0
  echo "== quick: $name"
  "$@" || rc=$?
  times+=("$name $((SECONDS - t0)) s$([ $rc -eq 0 ] || echo ' (FAILED)')")
  return $rc
}
run_ctest() {
  if ctest --test-dir "$build" --output-on-failure -j2 -LE slow > "$build/ctest.log" 2>&1; then
    grep -E "tests passed|tests failed" "$build/ctest.log"
  else
    tail -60 "$build/ctest.log"; return 1
  fi
}
configure() {
  if [ ! -f "$build/build.ninja" ]; then
    cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_CUDA=OFF -DGRADCOMP_NATIVE=ON \
      -DGRADCOMP_TESTS=ON -DGRADCOMP_PYTHON=ON -DPython_EXECUTABLE="$root/.venv/bin/python" \
      -Dpybind11_DIR="$(.venv/bin/python -m pybind11 --cmakedir)" >/dev/null
  fi
  cmake --build "$build" -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
  local so
  so=$(find "$build" -maxdepth 2 -name '_C*.so' | head -1)
  [ -n "$so" ] || { echo "quick: the build made no gradcomp._C module" >&2; return 1; }
  cp -f "$so" bindings/python/gradcomp/
}
status=0
start=$SECONDS
stage "build (build/quick, CPU only, one ISA variant)" configure || exit 1
stage "ctest" run_ctest || status=1
export PYTHONPATH="$root/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
stage "pytest -m 'not slow'" .venv/bin/python -m pytest tests/python -q -p no:cacheprovider -m "not slow" "$@" || status=1
stage "contract suite" .venv/bin/python -m pytest --pyargs gradcomp.testing -q -p no:cacheprovider || status=1
echo "== quick: where the time went"
printf '   %s\n' "${times[@]}"
echo "   total $((SECONDS - start)) s"
exit $status
