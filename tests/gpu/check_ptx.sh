#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI check of the CUDA kernels that needs no GPU (docs/contracts.md section 2, floating-point rules):
#   1. compiles every kernels/cuda/*.cu to PTX for sm_90 with nvcc's DEFAULT --fmad=true (stricter
#      than the build's --fmad=false: the fixed expressions must not contract into FMA through the
#      __f*_rn intrinsics alone) and fails if any kernel entry holds an `fma.rn`;
#   2. compiles them to cubins with -Xptxas -v (the build's flags) and prints registers, stack
#      frame and spills per kernel; fails on any spill or stack frame.
# FMAs are counted per function: in every .entry and in every .func (device functions the compiler
# kept out of line). One exemption, by name: binary64 fma.rn inside the functions of $FMA64_OK
# (lowrank.cu's __noinline__ Box-Muller, which calls CUDA's binary64 log and cos, built from FMAs
# by design, and CUDA's own trig argument reduction). Kernels of $STACK_OK (the ones calling that
# Box-Muller) may have a stack frame: the 40-byte local array of CUDA's cos slow path (Payne-Hanek
# reduction for large |x|; the arguments there lie in [0, 2 pi)); spills still fail.
# Usage: tests/gpu/check_ptx.sh [--arch sm_90] [--keep DIR] [--no-fail-spills]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
arch=sm_90
keep=""
fail_spills=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --arch) arch=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    --no-fail-spills) fail_spills=0; shift ;;
    -h|--help) sed -n 2,16p "$0"; exit 0 ;;
    *) echo "check_ptx.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
NVCC=${NVCC:-nvcc}
command -v "$NVCC" >/dev/null || { echo "check_ptx.sh: nvcc not found (set NVCC)" >&2; exit 2; }
FILT=$(command -v cu++filt || true)
[[ -z "$FILT" && -x "$(dirname "$(command -v "$NVCC")")/cu++filt" ]] && FILT="$(dirname "$(command -v "$NVCC")")/cu++filt"
demangle() { if [[ -n "$FILT" ]]; then "$FILT"; else c++filt; fi; }
# shorten "gradcomp::detail::cuda::(anonymous namespace)::" and argument lists for the report
shorten() { sed -E 's/gradcomp::detail::cuda::\(anonymous namespace\):://g; s/gradcomp::detail::cuda:://g;
                   s/gradcomp::lowrank::detail::\(anonymous namespace\):://g; s/\(.*$//'; }

FMA64_OK='lowrank_box_muller|__internal_trig_reduction_slowpathd'
STACK_OK='lowrank_normal_kernel|lowrank_ortho_kernel'

out=${keep:-$(mktemp -d)}
mkdir -p "$out"
[[ -z "$keep" ]] && trap 'rm -rf "$out"' EXIT
flags=(-std=c++20 --expt-relaxed-constexpr -DGRADCOMP_WITH_CUDA=1 -I"$root/include" -I"$root/kernels")
status=0
printf '%-8s %-72s %5s %6s %7s\n' file kernel regs stack spills

# the compiles first, on every core (CHECK_PTX_JOBS, default nproc): per file the PTX with the
# default fmad (step 1) and the cubin with the build's flags under -Xptxas -v (step 2); the checks
# below read their outputs in file order
jobs_max=${CHECK_PTX_JOBS:-$(nproc 2>/dev/null || echo 2)}
for cu in "$root"/kernels/cuda/*.cu; do
  name=$(basename "$cu" .cu)
  ( "$NVCC" "${flags[@]}" -arch="$arch" -ptx "$cu" -o "$out/$name.ptx" &&
    "$NVCC" "${flags[@]}" --fmad=false -arch="$arch" -cubin -Xptxas -v "$cu" -o "$out/$name.cubin" 2> "$out/$name.ptxas" ||
    { touch "$out/$name.failed"; cat "$out/$name.ptxas" 2>/dev/null || true; } ) > "$out/$name.log" 2>&1 &
  while (( $(jobs -rp | wc -l) >= jobs_max )); do wait -n || true; done
done
wait
for cu in "$root"/kernels/cuda/*.cu; do
  name=$(basename "$cu" .cu)
  if [[ -e "$out/$name.failed" ]]; then
    cat "$out/$name.log" >&2; echo "check_ptx: $name.cu did not compile" >&2; exit 1
  fi
done

for cu in "$root"/kernels/cuda/*.cu; do
  name=$(basename "$cu" .cu)
  # --- 1. PTX, default fmad: count fma.rn per .entry and per .func ----------------------------------
  awk -v ok="$FMA64_OK" '
    /^(\.visible |\.weak )?\.entry/ { fn = $0; sub(/.*\.entry[ \t]+/, "", fn); sub(/\(.*/, "", fn) }
    /^(\.visible |\.weak |\.extern )?\.func/ {
      fn = $0; sub(/.*\.func[ \t]*/, "", fn); sub(/^\([^)]*\)[ \t]*/, "", fn); sub(/[( \t;].*/, "", fn) }
    /fma\.rn/ { if (fn != "" && !($0 ~ /fma\.rn\.f64/ && fn ~ ok)) n[fn]++ }
    END { for (f in n) print n[f], f }' "$out/$name.ptx" > "$out/$name.fma"
  if [[ -s "$out/$name.fma" ]]; then
    while read -r cnt fn; do
      echo "FAIL $name.cu: $cnt fma.rn in kernel $(echo "$fn" | demangle | shorten)" >&2
    done < "$out/$name.fma"
    status=1
  fi
  # --- 2. ptxas -v with the build's flags ----------------------------------------------------------------
  awk '
    /Compiling entry function/ { fn = $0; sub(/.*function \x27/, "", fn); sub(/\x27.*/, "", fn) }
    /bytes stack frame/ { stack = $1; spill = $5 + $9 }
    /Used [0-9]+ registers/ { for (i = 1; i <= NF; i++) if ($i == "Used") regs = $(i+1); print fn, regs, stack, spill }
  ' "$out/$name.ptxas" > "$out/$name.res"
  while read -r fn regs stack spill; do
    pretty=$(echo "$fn" | demangle | shorten)
    printf '%-8s %-72s %5s %6s %7s\n' "$name" "${pretty:0:72}" "$regs" "$stack" "$spill"
    if [[ "$spill" == 0 && "$stack" != 0 && "$fn" =~ $STACK_OK ]]; then
      echo "  (allowed: $pretty: ${stack} bytes stack frame of CUDA's cos slow path, no spills)"
    elif [[ "$stack" != 0 || "$spill" != 0 ]]; then
      echo "SPILL $name.cu: $pretty: ${stack} bytes stack frame, ${spill} bytes spilled" >&2
      [[ $fail_spills == 1 ]] && status=1
    fi
  done < "$out/$name.res"
done

if [[ $status == 0 ]]; then
  echo "check_ptx: OK (no fma.rn in any kernel or device function beyond the binary64 log/cos exemption, no spills, no stack frames beyond the cos slow path's) [$arch]"
else
  echo "check_ptx: FAILED" >&2
fi
exit $status
