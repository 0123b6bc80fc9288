#!/usr/bin/env bash
# Set up and run every test: the GoogleTest suite (CUDA tests are built whenever nvcc is found
# and skip without a GPU), the portable-build check, the PTX check of the CUDA kernels, the pytest suite (with the codec
# contract suite gradcomp.testing), the GoogleTest suite again under AddressSanitizer + UBSan +
# LeakSanitizer (tests/sanitize.sh), the libFuzzer targets (tests/fuzz/run.sh), a C++ project
# built against the installed package (tests/consumer/run.sh) and the package built from PyPI alone
# with Debian's development packages and CUDA hidden, repaired by auditwheel and checked by the
# contract suite (tests/pypi_only.sh).
# Prints the time of each stage at the end. Exits non-zero on any failure.
# (After a change, tests/quick.sh is the quick tier: about 150 s with its build kept.)
set -euo pipefail
cd "$(dirname "$0")/.."
times=()
start=$SECONDS
stage() { # name command...: runs it, records its time; returns its status
  local name=$1; shift
  local t0=$SECONDS rc=0
  echo "== $name"
  "$@" || rc=$?
  times+=("$(printf '%5d s  %s%s' $((SECONDS - t0)) "$name" "$([ $rc -eq 0 ] || echo '  (FAILED)')")")
  return $rc
}
report() {
  echo "== where the time went"
  printf '   %s\n' "${times[@]}"
  echo "   total $((SECONDS - start)) s"
}
stage "setup (tests/setup.sh)" bash tests/setup.sh || { report; exit 1; }
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
status=0
stage "GoogleTest (ctest)" ctest --test-dir build/py --output-on-failure -j2 || status=1
stage "portable build check (tests/check_portable.sh)" bash tests/check_portable.sh build/py || status=1
if command -v nvcc >/dev/null 2>&1 && [ -f tests/gpu/check_ptx.sh ]; then
  stage "PTX check of the CUDA kernels" bash tests/gpu/check_ptx.sh || status=1
fi
stage "pytest" .venv/bin/python -m pytest tests/python -q -p no:cacheprovider --durations=30 || status=1
stage "the codec contract suite (pytest --pyargs gradcomp.testing)" \
  .venv/bin/python -m pytest --pyargs gradcomp.testing -q -p no:cacheprovider || status=1
stage "C++ consumer of the installed package (tests/consumer/run.sh)" bash tests/consumer/run.sh build/py || status=1
stage "pip wheel from PyPI alone, auditwheel, contract suite on the repaired wheel (tests/pypi_only.sh)" \
  bash tests/pypi_only.sh || status=1
stage "GoogleTest under AddressSanitizer + UBSan + LeakSanitizer (tests/sanitize.sh)" bash tests/sanitize.sh || status=1
stage "libFuzzer targets (tests/fuzz/run.sh)" bash tests/fuzz/run.sh || status=1
report
exit $status
