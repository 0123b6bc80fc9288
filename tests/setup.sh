#!/usr/bin/env bash
# Set up everything gradcomp needs, idempotently, as root and non-interactively:
#   Debian packages (compilers, CMake, DLPack, Random123, OpenBLAS, GoogleTest, Google Benchmark,
#   clang with its sanitizer and libFuzzer runtimes for tests/sanitize.sh and tests/fuzz/run.sh),
#   a project virtualenv .venv with pinned Python packages (tests/requirements.txt), and the
#   gradcomp package built by scikit-build-core into .venv (build tree: build/py, which also holds
#   the C++ tests, as 8 ctest entries per test program (GRADCOMP_CTEST_SHARDS: its test process
#   links cuBLAS, slow to start), and benchmarks; CUDA is built whenever nvcc is found,
#   GRADCOMP_CUDA=AUTO).
set -euo pipefail
cd "$(dirname "$0")/.."

debs=(cmake ninja-build g++ make libdlpack-dev librandom123-dev libopenblas-dev googletest libgtest-dev
      libbenchmark-dev libomp-dev clang libclang-rt-14-dev)
missing=()
for p in "${debs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv 2>/dev/null || {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null; "$PY" -m venv .venv; }
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r tests/requirements.txt
# DeepSpeed 0.19.8 (no 1-bit optimizers: gradcomp.optim's run as its client optimizers in
# test_deepspeed_integration.py), pure Python, beside 0.19.6 in its own folder (--no-deps: its
# dependencies are 0.19.6's, pinned above), put first on PYTHONPATH by that test only.
if [ ! -f .venv/deepspeed-0.19.8/deepspeed-0.19.8.dist-info/METADATA ]; then
  rm -rf .venv/deepspeed-0.19.8
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    --target .venv/deepspeed-0.19.8 deepspeed==0.19.8
fi

# The nvcc of the CUDA toolkit, when installed, is found through PATH.
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
# CUDA for one architecture here (GRADCOMP_CUDA_ARCHS, default 80: sm_80 code and compute_80 PTX,
# which the driver compiles for newer GPUs): the PTX check of the test command compiles every
# kernel for sm_90 (tests/gpu/check_ptx.sh), and tests/gpu/run.sh builds for sm_90 on a GPU
# machine; a plain `pip install .` builds 80 and 90.
archs=${GRADCOMP_CUDA_ARCHS:-80}
echo "setup: building gradcomp (GRADCOMP_CUDA=${GRADCOMP_CUDA:-AUTO}, CUDA architectures $archs) into build/py"
GRADCOMP_TESTS=ON GRADCOMP_BENCH=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
  -Cbuild-dir=build/py -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$archs" -Ccmake.define.GRADCOMP_CTEST_SHARDS=8 .
echo "setup: done ($(.venv/bin/python -c 'import gradcomp, json; print(json.dumps(gradcomp.build_info()))'))"
