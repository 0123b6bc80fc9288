#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One script for a GPU machine (an H200; no network). In order, within 5 minutes there:
#   1. prints the tool versions it finds;
#   2. configures for sm_90 with the tests, the Python module and (when Google Benchmark is there)
#      the benchmarks in build-gpu/, and builds -- the tests never need Google Benchmark;
#   3. the CUDA gtests (GRADCOMP_REQUIRE_GPU=1: a test that would skip for want of a GPU fails;
#      gradcomp_cuda_tests holds the codecs' and low rank's, CudaLowrank.*);
#   4. tests/python/test_cuda.py, the CUDA cases of tests/python/test_lowrank.py and
#      test_stochastic_rounding.py (-k cuda), test_fsdp.py (-k cuda) and the
#      codec contract suite on CUDA (pytest --pyargs gradcomp.testing -k cuda) against the module
#      just built, GRADCOMP_REQUIRE_GPU=1;
#   5. the CUDA benchmarks (bench_cuda, JSON into the log);
#   6. gradcomp-bench on CUDA (every codec beside torch and the copy floor, 2^20, 2^24, 2^28;
#      bench_cuda.json / .png / .txt into $GRADCOMP_GPU_LOG/bench; timeout 300 s).
# It FAILS (exit 1) when anything fails, when the Python module cannot be built, when pytest
# collects no CUDA test, or when no GPU is visible: a run cannot pass empty.
# Everything is tee'd into $GRADCOMP_GPU_LOG (default gpu-log/; the caller collects it from there).
# Dependencies the machine lacks come from gpu-carry/ (fill it first with
# tests/gpu/prepare_carry.sh on a machine that has them).
#
# Usage: tests/gpu/run.sh [--build-only] [--jobs N] [--no-python]
#   --build-only  configure and build, run nothing (works without a GPU)
#   --no-python   leave the Python module out (the run then fails: use it only to debug a build)
# Environment: GRADCOMP_GPU_LOG (log folder), GRADCOMP_GPU_BUILD (build folder, default build-gpu),
#              GRADCOMP_CUDA_ARCHS (default 90).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
build_only=0
python=ON
jobs=$(nproc 2>/dev/null || echo 4)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-only) build_only=1; shift ;;
    --jobs) jobs=$2; shift 2 ;;
    --no-python) python=OFF; shift ;;
    -h|--help) sed -n 2,25p "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
log=${GRADCOMP_GPU_LOG:-gpu-log}
build=${GRADCOMP_GPU_BUILD:-build-gpu}
archs=${GRADCOMP_CUDA_ARCHS:-90}
mkdir -p "$log"
log=$(cd "$log" && pwd)
exec > >(tee -a "$log/run.log") 2>&1
t0=$(date +%s)
section() { echo; echo "=== $* ($(( $(date +%s) - t0 )) s) ==="; }
failures=()

section "versions"
echo "date:   $(date -u +%FT%TZ)   host: $(hostname)"
echo "nvcc:   $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*, V[0-9.]*' || echo 'not found')"
echo "cmake:  $(cmake --version 2>/dev/null | head -1 || echo 'not found')"
echo "ninja:  $(ninja --version 2>/dev/null || echo 'not found')"
echo "gcc:    $(gcc -dumpfullversion 2>/dev/null || echo 'not found')"
# Python: $PYTHON, else the repo's .venv (tests/setup.sh), else python3 on PATH.
py=${PYTHON:-}
[[ -z $py && -x $root/.venv/bin/python ]] && py=$root/.venv/bin/python
py=${py:-python3}
echo "python: $py: $("$py" --version 2>&1 || echo 'not found')"
echo "torch:  $("$py" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())' 2>&1 | tail -1)"
echo "pybind11: $("$py" -c 'import pybind11; print(pybind11.__version__)' 2>&1 | tail -1)"
echo "pytest: $("$py" -m pytest --version 2>&1 | tail -1)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: no GPU visible"

section "configure ($build, sm_$archs)"
carry=$root/gpu-carry
args=(-S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$archs"
      -DGRADCOMP_TESTS=ON -DGRADCOMP_BENCH=ON -DPython_EXECUTABLE="$(command -v "$py" || echo "$py")")
command -v ninja >/dev/null && args+=(-G Ninja)
prefix=()
if [[ -d $carry ]]; then
  echo "using gpu-carry/: $(ls "$carry" | tr '\n' ' ')"
  [[ -d $carry/googletest ]] && args+=(-DGRADCOMP_GTEST_SOURCE_DIR="$carry/googletest")
  if [[ -d $carry/benchmark ]]; then
    bdir=$(dirname "$(find "$carry/benchmark" -name benchmarkConfig.cmake | head -1)")
    [[ -n $bdir ]] && args+=(-Dbenchmark_DIR="$bdir")
    prefix+=("$carry/benchmark")
    export LD_LIBRARY_PATH="$(dirname "$(dirname "$bdir")")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  prefix+=("$carry")
  # OpenBLAS (the CPU low-rank GEMMs): CMakeLists.txt's cache variables, and the loader path for
  # libopenblas.so.0 and its libgfortran / libquadmath (the linker resolves them through it too)
  if [[ -f $carry/openblas/lib/libopenblas.so.0 ]]; then
    args+=(-DGRADCOMP_OPENBLAS_INCLUDE_DIR="$carry/openblas/include"
           -DGRADCOMP_OPENBLAS_LIBRARY="$carry/openblas/lib/libopenblas.so.0")
    export LD_LIBRARY_PATH="$carry/openblas/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
else
  echo "no gpu-carry/ (run tests/gpu/prepare_carry.sh where the dependencies are installed)"
fi
[[ ${#prefix[@]} -gt 0 ]] && args+=(-DCMAKE_PREFIX_PATH="$(IFS=';'; echo "${prefix[*]}")")
if ! cmake "${args[@]}" -DGRADCOMP_PYTHON=$python; then
  if [[ $python == ON ]]; then
    echo "run.sh: configure with GRADCOMP_PYTHON=ON failed; building the C++ tests without the Python module"
    failures+=("the Python module could not be configured")
    python=OFF
    rm -f "$build/CMakeCache.txt"
    cmake "${args[@]}" -DGRADCOMP_PYTHON=OFF || { echo "run.sh: configure failed"; exit 1; }
  else
    echo "run.sh: configure failed"; exit 1
  fi
fi
[[ $python == OFF ]] && failures+=("no Python module (--no-python or configure failure): test_cuda.py not run")

section "build (-j$jobs)"
if ! cmake --build "$build" -j "$jobs"; then
  echo "run.sh: build failed"
  exit 1
fi
if [[ $build_only == 1 ]]; then
  section "done (--build-only)"
  exit 0
fi
export GRADCOMP_REQUIRE_GPU=1
nvidia-smi -L >/dev/null 2>&1 || failures+=("no GPU visible (nvidia-smi -L)")

section "CUDA gtests"
if [[ -x $build/tests/cpp/gradcomp_cuda_tests ]]; then
  timeout 150 "$build/tests/cpp/gradcomp_cuda_tests" --gtest_output="xml:$log/gradcomp_cuda_tests.xml" ||
    failures+=("gradcomp_cuda_tests")
else
  echo "gradcomp_cuda_tests was not built"; failures+=("gradcomp_cuda_tests (not built)")
fi
if [[ -x $build/tests/cpp/gradcomp_tests ]]; then
  timeout 60 "$build/tests/cpp/gradcomp_tests" --gtest_filter='CudaPlan*' --gtest_output="xml:$log/cuda_plan_tests.xml" ||
    failures+=("gradcomp_tests CudaPlan*")
fi

section "pytest: test_cuda.py, test_lowrank.py -k cuda and the contract suite on CUDA"
so=$(compgen -G "$build/_C*.so" | head -1 || true)
if [[ $python == ON && -n $so ]]; then
  # Stage the package with the module just built (the source tree may hold another build's _C).
  stage=$root/$build/pystage
  rm -rf "$stage" && mkdir -p "$stage"
  cp -r "$root/bindings/python/gradcomp" "$stage/"
  rm -f "$stage"/gradcomp/_C*.so && cp "$so" "$stage/gradcomp/"
  export PYTHONPATH="$stage${PYTHONPATH:+:$PYTHONPATH}"
  timeout 120 "$py" -m pytest tests/python/test_cuda.py -q -p no:cacheprovider --junitxml="$log/pytest_cuda.xml"
  rc=$?
  [[ $rc == 5 ]] && echo "pytest: test_cuda.py collected no test"
  [[ $rc != 0 ]] && failures+=("pytest tests/python/test_cuda.py (rc $rc)")
  if [[ -f tests/python/test_lowrank.py ]]; then
    timeout 120 "$py" -m pytest tests/python/test_lowrank.py -k cuda -q -p no:cacheprovider \
      --junitxml="$log/pytest_lowrank_cuda.xml"
    rc=$?
    [[ $rc == 5 ]] && echo "pytest: test_lowrank.py collected no CUDA case"
    [[ $rc != 0 ]] && failures+=("pytest tests/python/test_lowrank.py -k cuda (rc $rc)")
  else
    echo "tests/python/test_lowrank.py is missing"; failures+=("tests/python/test_lowrank.py (missing)")
  fi
  # the keyed codec: CUDA packets against the CPU's and the numpy reference
  timeout 120 "$py" -m pytest tests/python/test_stochastic_rounding.py -k cuda -q -p no:cacheprovider
  rc=$?
  [[ $rc == 5 ]] && echo "pytest: test_stochastic_rounding.py collected no CUDA case"
  [[ $rc != 0 ]] && failures+=("pytest tests/python/test_stochastic_rounding.py -k cuda (rc $rc)")
  # FSDP2's compressed reduce-scatter on CUDA (one rank, NCCL) against the CPU's, bitwise
  timeout 120 "$py" -m pytest tests/python/test_fsdp.py -k cuda -q -p no:cacheprovider
  rc=$?
  [[ $rc == 5 ]] && echo "pytest: test_fsdp.py collected no CUDA case"
  [[ $rc != 0 ]] && failures+=("pytest tests/python/test_fsdp.py -k cuda (rc $rc)")
  # the plugin: the installed package's pytest11 entry point, or by name from the staged sources
  plug=$("$py" -c 'import importlib.metadata as m; print("" if any(e.name == "gradcomp" for e in m.entry_points(group="pytest11")) else "-p gradcomp.testing.plugin")')
  (cd "$log" && timeout 90 "$py" -m pytest $plug --pyargs gradcomp.testing -k cuda -q \
     -p no:cacheprovider --junitxml="$log/pytest_contract_cuda.xml")
  rc=$?
  [[ $rc == 5 ]] && echo "pytest: the contract suite collected no CUDA case"
  [[ $rc != 0 ]] && failures+=("pytest --pyargs gradcomp.testing -k cuda (rc $rc)")
elif [[ $python == ON ]]; then
  echo "the Python module was configured but not built"; failures+=("the Python module was not built")
fi

section "CUDA benchmarks"
if [[ -x $build/bench/bench_cuda ]]; then
  timeout 90 "$build/bench/bench_cuda" --benchmark_out="$log/bench_cuda.json" --benchmark_out_format=json ||
    failures+=("bench_cuda")
else
  echo "bench_cuda was not built (Google Benchmark missing: prepare gpu-carry/ with tests/gpu/prepare_carry.sh)"
fi

section "gradcomp-bench --device cuda (python -m gradcomp.bench)"
if [[ $python == ON && -n $so ]]; then
  # the staged package of the pytest section (PYTHONPATH), after the correctness tests
  timeout 300 "$py" -m gradcomp.bench --device cuda --sizes 20 24 28 --reps 5 --out "$log/bench" ||
    failures+=("gradcomp-bench --device cuda")
else
  echo "gradcomp-bench not run: no Python module"
fi

section "summary"
if [[ ${#failures[@]} -eq 0 ]]; then
  echo "run.sh: all passed; logs in $log"
  exit 0
fi
printf 'run.sh: FAILED: %s\n' "${failures[@]}"
exit 1
