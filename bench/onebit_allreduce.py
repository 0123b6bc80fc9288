"""gradcomp's DeepSpeed-style 1-bit compressed allreduce on 2 CPU ranks, beside the pure-torch
re-implementation a CPU user would otherwise run and beside a dense float32 allreduce.

What is measured: one call of ``gradcomp.deepspeed.OnebitBackend.compressed_allreduce(buffer_m,
worker_error, server_error, local_rank)`` (the error-compensated 1-bit allreduce of Tang et al.,
"1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML
2021, section 4; DeepSpeed <= 0.19.6's ``CompressedBackend`` / ``NcclBackend``), on W = 2 gloo
processes (torch.multiprocessing spawn, MASTER_ADDR 127.0.0.1, a free port, OMP_NUM_THREADS=1,
``torch.set_num_threads(1)``, ``gradcomp.set_num_threads(1)``: one core per rank), for float32
buffers of --numel elements (default 2^16, 2^20, 2^22; normal(0, 1), a different seed per rank;
Np = numel rounded up to a multiple of 8 W, worker_error float32 Np, server_error float32 Np / W,
both carried from call to call as in training), beside:

  baseline  DeepSpeed's algorithm (docs/contracts.md section 6.1) written here in torch +
            numpy, step for step: buf = buffer (+ zero padding) + worker_error; scale =
            ||buf||_2 / sqrt(Np) (as ``(buf * buf).sum().sqrt()``: DeepSpeed's float32
            ``torch.norm`` is off by more than the check's tolerance on this CPU, see ``_rms``);
            worker_error := buf - scale * sign, sign = +1 where ``(torch.sign(x) + 1).bool()``,
            else -1; the bool signs packed with
            ``numpy.packbits`` (bitorder big, first element = MSB) into W chunks of Np / (8 W)
            bytes; ``all_to_all_single`` of the chunks and ``all_gather`` of the scales; the
            server (rank r owns chunk r, C = Np / W elements) unpacks with ``numpy.unpackbits``,
            sums sign_j * (scale_j * (1 / W)) over j, adds server_error, scale = ||.||_2 /
            sqrt(C), server_error := compensated - scale * sign, packs the signs, ``all_gather``
            of the server bits and of the server scales, unpacks: out chunk j = scale_j * sign.
  dense     ``dist.all_reduce`` (sum) of the same float32 Np buffer (what the warm-up does).

Before timing, every size is checked once (two calls, so the second runs on carried errors): the
gradcomp result and the baseline's must have equal signs and agree to 1e-5 relative, and the
error buffers to 1e-5 of their largest magnitude (the scales may differ by a float32 ulp: gradcomp
sums the RMS in binary64). The script exits non-zero if not.

Timing: for each call, the input is restored outside the timed region, then ``dist.barrier()``,
then one call timed with time.perf_counter on rank 0 (the call ends with collectives, so both
ranks finish together). Median of --reps calls after 2 warm-up calls
(``gradcomp.bench.timing.median_s``). Units: ms per call.

Bytes sent per rank per call (wire, not memory):
  gradcomp  ``gradcomp.planner.onebit_allreduce_bytes(Codec("onebit"), Np, W)``: (W-1) (C/8 + 4)
            in the all-to-all plus (W-1) onebit packets of C elements (bits + header) in the
            all-gather;
  baseline  2 (W-1) (C/8 + 4): the same sign bytes, the scales in separate all_gathers;
  dense     ``gradcomp.planner.ring_allreduce_bytes(4 Np, W)`` = 2 (W-1)/W 4 Np.

Floor: the bytes one rank must move through memory for its part of the encode + decode, once
each, divided by a single-thread copy bandwidth. Per rank: read the buffer and worker_error
(8 Np), write worker_error (4 Np), read and write server_error (8 C = 8 Np / W), write the output
(4 Np): 16 Np + 8 Np / W bytes (the packed bits, Np / 8 + C / 8 + W C / 8 bytes, are left out:
under 3%). The bandwidth: torch's ``dst.copy_(src)`` on a 64 MiB float32 buffer timed in rank
0's process (median of 9; ``gradcomp.bench.timing.copy_bandwidth``), counted as 2 x 64 MiB moved
per copy. The floor is a lower bound for the compute alone (communication is not in it); gradcomp
ms / floor says how far from memory-bound a call is on this machine.

Usage:
  python bench/onebit_allreduce.py [--numel 65536 1048576 4194304] [--reps 101] [--profile]
--profile: after the table, cProfile one call of each (gradcomp, baseline) at the largest size on
rank 0 and print the top entries by total time.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import gradcomp  # noqa: E402
from gradcomp import planner  # noqa: E402

try:
    from gradcomp.bench import timing  # noqa: E402
    from gradcomp.deepspeed import OnebitBackend  # noqa: E402
except ImportError as _e:  # an installed gradcomp older than gradcomp.deepspeed / gradcomp.bench.timing
    raise SystemExit(f"onebit_allreduce: {_e} (gradcomp at {gradcomp.__file__}); rebuild it with "
                     f"`bash tests/setup.sh`, or put a current build first on PYTHONPATH")

WORLD = 2


# -- the baseline: DeepSpeed's CompressedBackend algorithm in torch + numpy -------------------------
def _sign_bool(x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's sign rule: True (+1) where sign(x) + 1 != 0, i.e. x >= 0, -0.0 and NaN."""
    return (torch.sign(x) + 1).bool()


def _pm1(bits01: np.ndarray) -> torch.Tensor:
    """0/1 uint8 -> float32 -1/+1, as DeepSpeed: (b - 0.5) * 2."""
    return torch.from_numpy(bits01).float().add_(-0.5).mul_(2.0)


def _rms(x: torch.Tensor, n: int) -> torch.Tensor:
    """||x||_2 / sqrt(n), the norm as ``(x * x).sum().sqrt()`` (torch's cascade sum: within a few
    float32 ulps of the binary64 norm). DeepSpeed calls ``torch.linalg.norm`` / ``torch.norm``;
    on the CPU that float32 norm was measured off from the binary64 one by more than the check's
    tolerance of 1e-5 relative at 2^20 and 2^22 elements (the figures, and what the cascade sum
    costs instead, are in bench/RESULTS.md, section "2026-12-01 — CPU, DeepSpeed's 1-bit
    compressed allreduce on 2 gloo ranks"), so the baseline does not use it."""
    return x.mul(x).sum().sqrt() / np.sqrt(n)


def baseline_allreduce(buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor) -> torch.Tensor:
    """docs/contracts.md section 6.1, step for step, with numpy's packbits / unpackbits."""
    W, r = dist.get_world_size(), dist.get_rank()
    shape, n = buffer_m.shape, buffer_m.numel()
    Np = worker_error.numel()
    buf = buffer_m.reshape(-1)
    if n != Np:
        buf = torch.cat([buf, torch.zeros(Np - n, dtype=buf.dtype)])
    buf.add_(worker_error)
    worker_scale = _rms(buf, Np)
    sb = _sign_bool(buf)
    worker_error.set_(buf - worker_scale * sb.float().add_(-0.5).mul_(2.0))
    send = torch.from_numpy(np.packbits(sb.numpy())).view(W, -1)  # chunk j = elements [j C, (j+1) C)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    scales = [torch.empty(1) for _ in range(W)]
    dist.all_gather(scales, worker_scale.reshape(1))
    C = Np // W
    signs = _pm1(np.unpackbits(recv.numpy().reshape(-1))).view(W, C)
    comp = signs.mul_(torch.stack(scales).mul_(1 / W)).sum(0)
    comp.add_(server_error)
    server_scale = _rms(comp, C)
    ssb = _sign_bool(comp)
    server_error.set_(comp - server_scale * ssb.float().add_(-0.5).mul_(2.0))
    sbits = torch.from_numpy(np.packbits(ssb.numpy()))
    gbits = [torch.empty_like(sbits) for _ in range(W)]
    dist.all_gather(gbits, sbits)
    gscales = [torch.empty(1) for _ in range(W)]
    dist.all_gather(gscales, server_scale.reshape(1))
    out = _pm1(np.unpackbits(torch.stack(gbits).numpy().reshape(-1))).view(W, C).mul_(torch.stack(gscales))
    buf.copy_(out.reshape(-1))
    if n != Np:
        return buf[:n].reshape(shape)
    return buf.reshape(shape)


# -- helpers --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(call, restore, reps: int) -> float:
    """Median seconds of ``call`` on this rank over ``reps`` calls after 2 warm-ups; ``restore``
    (outside the timing) puts the input back; a barrier before each call."""
    def before():
        restore()
        dist.barrier()

    return timing.median_s(call, reps, warmup=2, before=before)


def _check(rank: int, n: int, Np: int, backend: OnebitBackend, x0: torch.Tensor):
    """Two calls of each from zero errors: ('', largest output relative difference) when they
    agree, else (what differs, that difference so far)."""
    C = Np // WORLD
    eg, sg = torch.zeros(Np), torch.zeros(C)
    eb, sb = torch.zeros(Np), torch.zeros(C)
    worst = 0.0
    for call in (1, 2):
        g = backend.compressed_allreduce(x0.clone(), eg, sg, rank)
        b = baseline_allreduce(x0.clone(), eb, sb)
        if not torch.equal(torch.signbit(g), torch.signbit(b)):
            k = int((torch.signbit(g) != torch.signbit(b)).sum())
            return f"call {call}: {k} output signs differ", worst
        rel = float(((g - b).abs() / b.abs().clamp_min(1e-30)).max())
        worst = max(worst, rel)
        if rel > 1e-5:
            return f"call {call}: output relative difference {rel:.3g} > 1e-5", worst
        for name, a, c in (("worker_error", eg, eb), ("server_error", sg, sb)):
            d = float((a - c).abs().max())
            if d > 1e-5 * max(float(c.abs().max()), 1e-30):
                return f"call {call}: {name} differs by {d:.3g} (max |{name}| {float(c.abs().max()):.3g})", worst
    return "", worst


def _worker(rank: int, port: int, sizes, reps: int, profile: bool) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    gradcomp.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    backend = OnebitBackend()
    codec = gradcomp.Codec("onebit")
    bw = 0.0
    if rank == 0:
        bw = timing.copy_bandwidth()
    dist.barrier()
    rows = []
    failed = ""
    for n in sizes:
        Np = -(-n // (8 * WORLD)) * 8 * WORLD
        C = Np // WORLD
        x0 = torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + n % 997))
        msg, worst = _check(rank, n, Np, backend, x0)
        flag = torch.tensor([1 if msg else 0])
        dist.all_reduce(flag)
        worst_t = torch.tensor([worst], dtype=torch.float64)
        dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
        if int(flag):
            failed = f"numel {n}: gradcomp and the baseline disagree" + (f" on rank {rank}: {msg}" if msg else "")
            print(failed, file=sys.stderr, flush=True)
            break
        buf = x0.clone()
        eg, sg = torch.zeros(Np), torch.zeros(C)
        eb, sb = torch.zeros(Np), torch.zeros(C)
        dense = torch.zeros(Np)
        dense[:n] = x0

        def restore_buf():
            buf.copy_(x0)

        def restore_dense():
            dense[:n].copy_(x0)

        t_g = _timed(lambda: backend.compressed_allreduce(buf, eg, sg, rank), restore_buf, reps)
        t_b = _timed(lambda: baseline_allreduce(buf, eb, sb), restore_buf, reps)
        t_d = _timed(lambda: dist.all_reduce(dense), restore_dense, reps)
        if rank == 0:
            floor_bytes = 16 * Np + 8 * C
            rows.append(dict(numel=n, Np=Np, g=t_g * 1e3, b=t_b * 1e3, d=t_d * 1e3,
                             gbytes=planner.onebit_allreduce_bytes(codec, Np, WORLD),
                             bbytes=2 * (WORLD - 1) * (C // 8 + 4),
                             dbytes=planner.ring_allreduce_bytes(4 * Np, WORLD),
                             floor=floor_bytes / bw * 1e3, rel=float(worst_t)))
    if rank == 0 and rows:
        print(f"gradcomp {gradcomp.build_info()['version']}, torch {torch.__version__}, numpy {np.__version__}; "
              f"W = {WORLD} gloo ranks, 1 thread each; median of {reps} calls after 2 warm-ups; "
              f"copy bandwidth (torch dst.copy_(src), 64 MiB, 1 thread, read + written) {bw / 1e9:.1f} GB/s")
        print()
        print("| numel | gradcomp ms | baseline ms | speedup | dense allreduce ms | gradcomp bytes sent | "
              "baseline bytes sent | dense bytes sent | floor ms | gradcomp / floor |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['numel']} | {r['g']:.3f} | {r['b']:.3f} | {r['b'] / r['g']:.1f}x | {r['d']:.3f} | "
                  f"{r['gbytes']:.0f} | {r['bbytes']} | {r['dbytes']:.0f} | {r['floor']:.3f} | "
                  f"{r['g'] / r['floor']:.1f} |")
        print()
        print("checked before timing (2 calls per size, both ranks): signs equal, largest output relative "
              "difference gradcomp vs baseline " + ", ".join(f"{r['numel']}: {r['rel']:.2g}" for r in rows))
        sys.stdout.flush()
    if profile and not failed:
        _profile(rank, backend, max(sizes))
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        raise SystemExit(2)


def _profile(rank: int, backend: OnebitBackend, n: int) -> None:
    import cProfile
    import io
    import pstats

    Np = -(-n // (8 * WORLD)) * 8 * WORLD
    C = Np // WORLD
    x0 = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    for name, fn in (("gradcomp", lambda b, e, s: backend.compressed_allreduce(b, e, s, rank)),
                     ("baseline", baseline_allreduce)):
        e, s = torch.zeros(Np), torch.zeros(C)
        fn(x0.clone(), e, s)
        b = x0.clone()
        dist.barrier()
        pr = cProfile.Profile()
        pr.enable()
        fn(b, e, s)
        pr.disable()
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(12)
            print(f"\n--- cProfile, one {name} call, numel {n}, rank 0 (by tottime) ---")
            print("\n".join(out.getvalue().splitlines()[:30]), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 22])
    ap.add_argument("--reps", type=int, default=101)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    if min(args.numel) < 1 or args.reps < 1:
        ap.error("--numel and --reps must be positive")
    try:
        mp.spawn(_worker, args=(_free_port(), args.numel, args.reps, args.profile), nprocs=WORLD, join=True)
    except Exception as e:  # a rank exited non-zero (disagreement or an error)
        print(f"onebit_allreduce: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
