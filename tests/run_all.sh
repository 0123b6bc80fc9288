#!/usr/bin/env bash
# Set up and run every test: the GoogleTest suite (CUDA tests are built whenever nvcc is found
# and skip without a GPU), the portable-build check, the PTX check of the CUDA kernels, the pytest suite (with the codec
# contract suite gradcomp.testing), the GoogleTest suite again under AddressSanitizer + UBSan +
# LeakSanitizer (tests/sanitize.sh), and the libFuzzer targets (tests/fuzz/run.sh).
# Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/setup.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
status=0
echo "== GoogleTest (ctest)"
ctest --test-dir build/py --output-on-failure -j2 || status=1
echo "== portable build check (tests/check_portable.sh)"
bash tests/check_portable.sh build/py || status=1
if command -v nvcc >/dev/null 2>&1 && [ -f tests/gpu/check_ptx.sh ]; then
  echo "== PTX check of the CUDA kernels"
  bash tests/gpu/check_ptx.sh || status=1
fi
echo "== pytest"
.venv/bin/python -m pytest tests/python -q -p no:cacheprovider || status=1
echo "== the codec contract suite (pytest --pyargs gradcomp.testing)"
.venv/bin/python -m pytest --pyargs gradcomp.testing -q -p no:cacheprovider || status=1
echo "== GoogleTest under AddressSanitizer + UBSan + LeakSanitizer (tests/sanitize.sh)"
bash tests/sanitize.sh || status=1
echo "== libFuzzer targets (tests/fuzz/run.sh)"
bash tests/fuzz/run.sh || status=1
exit $status
