"""CPU kernels with a busy core beside them (issue: with another process holding one of the two
cores, OpenMP teams wait for the thread that shares that core, so 2 threads ran far slower than 1).

For each kernel (encode of 2^24 float32: top-k at k = 1% and 0.1%, fp16, bf16; with and without a
residual) at 1 and 2 gradcomp threads, the median time of --reps calls after a warm-up
(gradcomp.bench.timing.median_s), in three conditions: idle; one busy process pinned to the last
CPU with adaptive threads on (the default); the same with adaptive threads off
(GRADCOMP_ADAPTIVE_THREADS=0 behaviour, set_adaptive_threads).
Beside each row: the floor (numpy copy of the same bytes, in the same condition) and the baseline
a torch user would call (torch.topk(x.abs(), k, sorted=False); a cast into a preallocated tensor).
Usage: python bench/busy_core.py [--reps 9] [--numel 16777216] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time

import numpy as np
import torch

import gradcomp
from gradcomp import _C
from gradcomp.bench import timing


def _spin(cpu: int, stop) -> None:
    os.sched_setaffinity(0, {cpu})
    x = 0
    while not stop.is_set():
        for _ in range(100000):
            x += 1


def run(n: int, reps: int) -> list[dict]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n).astype(np.float32)
    r0 = (rng.standard_normal(n) * 0.1).astype(np.float32)
    r = r0.copy()
    xt = torch.from_numpy(x)
    h16, b16 = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
    ycopy = np.empty_like(x)
    rows = []
    kernels = [("top-k 1%", "topk:ratio=0.01"), ("top-k 0.1%", "topk:ratio=0.001"), ("fp16", "fp16"), ("bf16", "bf16")]
    cpus = sorted(os.sched_getaffinity(0))
    for cond in ("idle", "busy, adaptive", "busy, fixed"):
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        busy = None
        if cond != "idle":
            busy = ctx.Process(target=_spin, args=(cpus[-1], stop), daemon=True)
            busy.start()
            time.sleep(0.5)
        _C.set_adaptive_threads(cond != "busy, fixed")
        try:
            for threads in (1, 2):
                gradcomp.set_num_threads(threads)
                torch.set_num_threads(threads)
                copy_s = timing.median_s(lambda: np.copyto(ycopy, x), reps)
                for label, spec in kernels:
                    c = gradcomp.Codec(spec)
                    out = c.encode(x)
                    ws = c.workspace(x, n)
                    for res in (False, True):
                        def go():
                            if res:
                                np.copyto(r, r0)
                            c.encode(x, residual=r if res else None, out=out, workspace=ws)
                        t = timing.median_s(go, reps)
                        if res:
                            t -= timing.median_s(lambda: np.copyto(r, r0), reps)  # the reset is not the kernel
                        if spec.startswith("topk"):
                            k = c.main_param(n)
                            base = timing.median_s(lambda: torch.topk(xt.abs(), k, sorted=False), max(3, reps // 3))
                            base_name = "torch.topk(x.abs(), k, sorted=False)"
                        else:
                            dst = h16 if spec == "fp16" else b16
                            base = timing.median_s(lambda: dst.copy_(xt), reps)
                            base_name = f"{'h16' if spec == 'fp16' else 'b16'}.copy_(x)"
                        rows.append({"condition": cond, "threads": threads, "kernel": label, "residual": res,
                                     "ms": 1e3 * t, "copy_ms": 1e3 * copy_s, "baseline": base_name,
                                     "baseline_ms": 1e3 * base, "state": _C.cpu_threads_state()})
        finally:
            _C.set_adaptive_threads(True)
            if busy is not None:
                stop.set()
                busy.join(timeout=5)
                if busy.is_alive():
                    busy.terminate()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = run(a.numel, a.reps)
    print(f"n = {a.numel} float32, {os.cpu_count()} CPUs, busy process pinned to the last one; medians of {a.reps}")
    print("| condition | threads | kernel | residual | gradcomp ms | copy of x ms | copy / kernel | baseline | baseline ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        # the floor: the same-condition copy of x (4n bytes read, 4n written)
        print(f"| {r['condition']} | {r['threads']} | {r['kernel']} | {'yes' if r['residual'] else 'no'} | "
              f"{r['ms']:.2f} | {r['copy_ms']:.2f} | {r['copy_ms'] / r['ms']:.2f} | `{r['baseline']}` | "
              f"{r['baseline_ms']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
