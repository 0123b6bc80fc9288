#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Checks that a portable build (GRADCOMP_NATIVE=OFF) runs on any x86-64 CPU:
#   1. the core objects and the generic CPU variant hold no AVX/AVX-512 instruction (no ymm/zmm
#      register in their code);
#   2. no avx2/avx512 variant object defines a weak or unique function symbol (an inline or template
#      function the linker could merge with the generic variant's copy and then call on a CPU without
#      the instructions) -- weak data (constants) is fine;
#   3. the avx512 variant really holds AVX-512 code (the flags took effect).
# Usage: tests/check_portable.sh [BUILD_DIR]   (default build/py)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build/py}
cm=$build/CMakeFiles
status=0
if [[ -d $cm/gradcomp_cpu_native.dir ]]; then
  echo "check_portable: $build is a GRADCOMP_NATIVE=ON build (not portable by design): skipped"; exit 0
fi
shopt -s nullglob
# objects of sources that still exist (a build folder may keep objects of deleted files)
current() { for o in "$@"; do local src=${o#*.dir/}; [[ -f $root/${src%.o} ]] && echo "$o"; done; }
mapfile -t base < <(current "$cm"/gradcomp_core.dir/kernels/core/*.o "$cm"/gradcomp_core.dir/kernels/core/codecs/*.o \
                            "$cm"/gradcomp_cpu_generic.dir/kernels/cpu/*.o)
[[ ${#base[@]} -gt 0 ]] || { echo "check_portable: no objects under $cm" >&2; exit 1; }
for o in "${base[@]}"; do
  n=$(objdump -d --no-show-raw-insn "$o" | grep -cE '%[yz]mm[0-9]' || true)
  if [[ $n != 0 ]]; then echo "FAIL ${o#$build/}: $n instructions on ymm/zmm registers in baseline code" >&2; status=1; fi
done
for o in $(current "$cm"/gradcomp_cpu_avx2.dir/kernels/cpu/*.o "$cm"/gradcomp_cpu_avx512.dir/kernels/cpu/*.o); do
  weak=$(readelf -sW "$o" | awk '$4=="FUNC" && ($5=="WEAK" || $5=="UNIQUE") && $7!="UND" {print $8}' | c++filt || true)
  if [[ -n $weak ]]; then
    echo "FAIL ${o#$build/}: weak function symbols the linker may share with the generic variant:" >&2
    echo "$weak" | head -10 >&2; status=1
  fi
done
z=0
for o in "$cm"/gradcomp_cpu_avx512.dir/kernels/cpu/*.o; do z=$((z + $(objdump -d --no-show-raw-insn "$o" | grep -cE '%zmm[0-9]' || true))); done
if [[ -d $cm/gradcomp_cpu_avx512.dir && $z == 0 ]]; then echo "FAIL: the avx512 variant holds no zmm instruction" >&2; status=1; fi
[[ $status == 0 ]] && echo "check_portable: OK (${#base[@]} baseline objects without AVX; variants share no code symbol; avx512 variant: $z zmm instructions)"
exit $status
