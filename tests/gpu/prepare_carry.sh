#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fills gpu-carry/ (git-ignored) with the build dependencies a GPU runner without network may lack,
# copied from this machine's Debian packages: GoogleTest sources (googletest), Google Benchmark
# (libbenchmark-dev: headers, libraries and its CMake package) and OpenBLAS (libopenblas-dev,
# pthread flavour, for the CPU low-rank GEMMs: cblas.h, openblas_config.h, f77blas.h and
# libopenblas.so.0 with the two libraries it needs, libgfortran.so.5 and libquadmath.so.0; about
# 40 MB of the 64 MiB a device call carries). Random123 and DLPack are not needed (gradcomp has
# its own Philox and DLPack ABI). tests/gpu/run.sh points CMake at them.
# Usage: tests/gpu/prepare_carry.sh [DEST]   (default: <repo>/gpu-carry)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest=${1:-$root/gpu-carry}
rm -rf "$dest"
mkdir -p "$dest"

copy_dir() { # src dst what
  if [[ -d "$1" ]]; then cp -a "$1" "$2"; echo "prepare_carry: $3 <- $1"; else echo "prepare_carry: $3 not found at $1 (skipped)"; fi
}
copy_dir /usr/src/googletest "$dest/googletest" "GoogleTest sources"

# Google Benchmark, in the Debian layout so that its CMake package finds itself relative to
# <dest>/benchmark (headers, lib/<multiarch>/libbenchmark*, lib/<multiarch>/cmake/benchmark).
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
libdir=/usr/lib/$multiarch
if [[ -d /usr/include/benchmark && -d $libdir/cmake/benchmark ]]; then
  mkdir -p "$dest/benchmark/include" "$dest/benchmark/lib/$multiarch/cmake"
  cp -a /usr/include/benchmark "$dest/benchmark/include/"
  cp -a "$libdir"/libbenchmark* "$dest/benchmark/lib/$multiarch/"
  cp -a "$libdir/cmake/benchmark" "$dest/benchmark/lib/$multiarch/cmake/"
  echo "prepare_carry: Google Benchmark <- /usr/include/benchmark, $libdir/libbenchmark*"
else
  echo "prepare_carry: Google Benchmark not installed here (skipped; the CUDA benchmarks will not build)"
fi

# OpenBLAS: <dest>/openblas/include/{cblas.h,openblas_config.h,f77blas.h} and
# <dest>/openblas/lib/{libopenblas.so.0,libgfortran.so.5,libquadmath.so.0} (plain files: the
# library's soname is libopenblas.so.0); run.sh sets GRADCOMP_OPENBLAS_INCLUDE_DIR /
# GRADCOMP_OPENBLAS_LIBRARY (CMakeLists.txt's cache variables) and LD_LIBRARY_PATH to them.
ob_inc=/usr/include/$multiarch/openblas-pthread
ob_lib=/usr/lib/$multiarch/openblas-pthread/libopenblas.so.0
if [[ -f $ob_inc/cblas.h && -f $ob_inc/openblas_config.h && -e $ob_lib ]]; then
  mkdir -p "$dest/openblas/include" "$dest/openblas/lib"
  for h in cblas.h openblas_config.h f77blas.h; do
    [[ -f $ob_inc/$h ]] && cp -L "$ob_inc/$h" "$dest/openblas/include/"
  done
  cp -L "$ob_lib" "$dest/openblas/lib/libopenblas.so.0"
  for dep in libgfortran.so.5 libquadmath.so.0; do
    path=$(ldd "$ob_lib" | awk -v n="$dep" '$1 == n { print $3 }')
    if [[ -n $path && -f $path ]]; then cp -L "$path" "$dest/openblas/lib/$dep"
    else echo "prepare_carry: $dep (needed by OpenBLAS) not found (skipped)"; fi
  done
  echo "prepare_carry: OpenBLAS <- $ob_inc, $(readlink -f "$ob_lib") and its libgfortran / libquadmath"
else
  echo "prepare_carry: OpenBLAS (libopenblas-dev, openblas-pthread) not installed here (skipped; the build will fail there)"
fi
du -sh "$dest" | awk '{print "prepare_carry: " $1 " in " $2}'
bytes=$(du -sb "$dest" | awk '{print $1}')
if (( bytes > 60 * 1024 * 1024 )); then
  echo "prepare_carry: WARNING: $dest holds $bytes bytes; a device call carries 64 MiB in all (tree included)"
fi
