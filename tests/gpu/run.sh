#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU run of gradcomp in one command, within 480 s (a GPU machine: one H200, no network, 10
# minutes per command, at most 8 files come back from $OUT):
#   GRADCOMP_GPU_LOG=$OUT tests/gpu/run.sh            # on the GPU machine
#   tests/gpu/run.sh --dry-run                        # here, without a GPU: every stage, GPU steps faked
# Stages (tests/gpu/run.py, standard-library Python): preflight, build (sm_90, one CPU ISA variant,
# only gradcomp_cuda_tests, _C and bench_cuda), the codec smoke matrix (tests/gpu/smoke.py), the CUDA
# gtests one suite per process, all 2^32 float32 patterns through the device conversions, the CUDA
# pytest cases, n >= 2^31, compute-sanitizer memcheck / racecheck, the benchmarks. Each stage gets
# min(its cap, time left - 30 s); the summary always prints; $OUT receives run.log, summary.json,
# bench.json, bench.txt and artifacts.tar.gz. Dependencies the GPU machine lacks come from gpu-carry/
# (tests/gpu/prepare_carry.sh fills it; pass it in the device call's carry).
# Options: tests/gpu/run.sh --help. Python: $PYTHON, else <repo>/.venv/bin/python, else python3.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
py=${PYTHON:-}
[[ -z $py && -x $root/.venv/bin/python ]] && py=$root/.venv/bin/python
py=${py:-python3}
export PYTHON=$py
exec "$py" "$root/tests/gpu/run.py" "$@"
