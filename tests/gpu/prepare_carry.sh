#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fills gpu-carry/ (git-ignored) with the build dependencies a GPU runner without network may lack,
# copied from this machine's Debian packages: GoogleTest sources (googletest), DLPack headers
# (libdlpack-dev), Random123 headers (librandom123-dev) and Google Benchmark (libbenchmark-dev:
# headers, libraries and its CMake package). tests/gpu/run.sh points CMake at them.
# Usage: tests/gpu/prepare_carry.sh [DEST]   (default: <repo>/gpu-carry)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest=${1:-$root/gpu-carry}
rm -rf "$dest"
mkdir -p "$dest/include"

copy_dir() { # src dst what
  if [[ -d "$1" ]]; then cp -a "$1" "$2"; echo "prepare_carry: $3 <- $1"; else echo "prepare_carry: $3 not found at $1 (skipped)"; fi
}
copy_dir /usr/src/googletest "$dest/googletest" "GoogleTest sources"
copy_dir /usr/include/dlpack "$dest/include/dlpack" "DLPack headers"
copy_dir /usr/include/Random123 "$dest/include/Random123" "Random123 headers"

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
du -sh "$dest" | awk '{print "prepare_carry: " $1 " in " $2}'
