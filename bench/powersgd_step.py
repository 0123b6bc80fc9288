"""Training-step time of gradcomp's PowerSGD DDP hook beside PyTorch's ``powerSGD_hook``.

What is measured: one DDP training step (zero_grad, forward, backward; the hook runs inside
backward and DDP waits for its futures at the end of it) on W gloo processes (default 4;
torch.multiprocessing spawn through gradcomp.experiments.pool.GlooPool, one thread each, the CPU of this
machine shared), for two models:

  mlp25m  a synthetic MLP 1024 -> 4096 -> 4096 -> 1024 (25.2M parameters, float32), batch 2;
  charlm  the charlm task's model of ``gradcomp-experiment`` (gradcomp.experiments.charlm), its
          default size, batch 2 of its sequence length.

and, for each rank r in --ranks (default 1 2 4 8), the hooks below on the same model, gradients and
buckets: --bucket-cap-mb (default 256: every model here in ONE bucket). Why not DDP's 25 MiB: with
several buckets PyTorch's powerSGD_hook deadlocks on gloo -- its callbacks block in
``Future.wait()`` on the next allreduce while running on gloo's two runloop threads, so with two
buckets in flight no thread is left to run that allreduce (seen here with mlp25m at 25 MiB: both
``pt_gloo_runloop`` threads in ``unpack_uncompressed_tensors_and_allreduce_ps`` and
``compute_qs``, every rank stuck). gradcomp's hook waits only in the calling thread and runs at
any bucket size (``--bucket-cap-mb 25 --hooks gradcomp`` measures it there):
  gradcomp   gradcomp.torch.PowerSGDState(matrix_approximation_rank=r, start_powerSGD_iter=2,
             error feedback, warm start) + gradcomp.torch.powersgd_hook;
  pytorch    torch's PowerSGDState with the same options + powerSGD_hook (the baseline a user
             would otherwise call);
and once per model:
  allreduce  no hook: DDP's own float32 allreduce;
  noop       PyTorch's debugging noop_hook (returns the bucket, communicates nothing): forward +
             backward alone.
"hook ms" = step ms - noop step ms: what compression and communication add to a step, the number
the 2x goal is about. Timing: 3 warm-up steps (two dense ones, then the first compressed), then
--steps steps; each step starts after a barrier, is timed with time.perf_counter on every rank,
and a step's time is the max over ranks. Each rank r runs gradcomp, pytorch and noop in turn,
--repeats rounds (default 2), and prints the median over all their steps (ms); "hook ms" subtracts
the noop median measured in the same rounds, so load that drifts during a run hits both alike.

Floor (per rank, memory traffic of the PowerSGD kernels once each, over a measured copy bandwidth):
the compressed matrices' M is read by P = M Q, by Q = M^T P and by the fused output pass, which
also reads and writes the residual and writes the bucket: 4 B x numel x (1 + 1 + 1 + 2 + 1) =
24 B per compressed element, plus the bucket read when M = g + e is formed (4 + 4 + 4 B: read g
and e, write M). Bandwidth: torch ``dst.copy_(src)`` of 64 MiB float32 in one worker (median of
9 after a warm-up, 2 x 64 MiB moved per copy; ``gradcomp.bench.timing.copy_bandwidth``). The floor
leaves out communication and the small P, Q and orthogonalization work, so it is a lower bound for
the compute part of "hook ms".

Usage: python bench/powersgd_step.py [--models mlp25m charlm] [--ranks 1 2 4 8] [--world 4] [--steps 7]
                                    [--bucket-cap-mb 256] [--hooks gradcomp pytorch] [--repeats 2]
"""

import argparse
import os
import statistics
import sys


def build(model_name):
    import torch

    torch.manual_seed(0)
    if model_name == "mlp25m":
        m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                torch.nn.ReLU(), torch.nn.Linear(4096, 1024))

        def batch(step, rank):
            g = torch.Generator().manual_seed(step * 31 + rank)
            x = torch.randn(2, 1024, generator=g)
            return lambda mod: (mod(x) - x).square().mean()
        return m, batch
    from gradcomp.experiments import charlm

    cfg = charlm.DEFAULTS
    m = charlm.make_model(cfg["embed"], cfg["hidden"], cfg.get("layers", 2))
    vocab = charlm.VOCAB_SIZE

    def batch(step, rank):
        g = torch.Generator().manual_seed(step * 31 + rank)
        x = torch.randint(0, vocab, (2, cfg["seq_len"] + 1), generator=g)
        return lambda mod: torch.nn.functional.cross_entropy(mod(x[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1))
    return m, batch


def job(rank, world, model_name, hook, r, steps, bucket_cap_mb):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as pt

    import gradcomp
    import gradcomp.torch as gt
    from gradcomp.bench import timing

    gradcomp.set_num_threads(1)
    model, batch = build(model_name)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if hook == "gradcomp":
        st = gt.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2, ddp_model=ddp)
        ddp.register_comm_hook(st, gt.powersgd_hook)
    elif hook == "pytorch":
        ddp.register_comm_hook(pt.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=2),
                               pt.powerSGD_hook)
    elif hook == "noop":
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    losses = (batch(s, rank) for s in range(3 + steps))  # one batch per step, made outside the timing
    cur = {}

    def before():  # the step's batch, then every rank starts the step together
        cur["loss"] = next(losses)
        dist.barrier()

    def step():
        ddp.zero_grad()
        cur["loss"](ddp).backward()

    times = timing.time_calls(step, steps, warmup=3, before=before)
    out = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    nparams = sum(p.numel() for p in model.parameters())
    comp = 0
    if hook == "gradcomp":
        comp = sum(n for lay in st.bucket_layouts() for _, _, n in lay["compressed"])
    return {"times": out.tolist(), "numel": nparams, "compressed": comp}


def bandwidth(rank, world):
    """Rank 0's copy bandwidth (``gradcomp.bench.timing.copy_bandwidth``: 64 MiB float32, median
    of 9, bytes read + written per second); None on the other ranks."""
    from gradcomp.bench import timing

    return timing.copy_bandwidth() if rank == 0 else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["mlp25m", "charlm"], choices=["mlp25m", "charlm"])
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--bucket-cap-mb", type=float, default=256.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--hooks", nargs="+", default=["gradcomp", "pytorch"], choices=["gradcomp", "pytorch"])
    a = ap.parse_args(argv)
    from gradcomp.experiments.pool import GlooPool

    pool = GlooPool(a.world, threads=1)
    try:
        bw = pool.run(bandwidth)[0]
        print(f"# W={a.world} gloo ranks on {os.cpu_count()} cores; copy bandwidth {bw / 1e9:.2f} GB/s (one worker)")
        print("model   hook       rank   step ms   hook ms   floor ms   vs pytorch (hook ms)")
        for model in a.models:
            def measure(hooks, r):
                """Per hook: the median step ms over --repeats rounds, the hooks interleaved."""
                times, info = {h: [] for h in hooks}, {}
                for _ in range(a.repeats):
                    for h in hooks:
                        out = pool.run(job, model, h, r, a.steps, a.bucket_cap_mb, timeout=900)[0]
                        times[h] += out["times"]
                        info[h] = out
                return {h: dict(info[h], ms=1e3 * statistics.median(times[h])) for h in hooks}

            base = measure(("noop", "allreduce"), 1)
            noop = base["noop"]["ms"]
            print(f"{model:7s} noop          -  {noop:8.1f}         -          -")
            print(f"{model:7s} allreduce     -  {base['allreduce']['ms']:8.1f}  {base['allreduce']['ms'] - noop:8.1f}"
                  f"          -")
            for r in a.ranks:
                res = measure(tuple(a.hooks) + ("noop",), r)
                noop_r = res["noop"]["ms"]  # forward + backward measured beside this rank's runs
                p, g = res.get("pytorch"), res.get("gradcomp")
                if p is not None:
                    print(f"{model:7s} pytorch    {r:4d}  {p['ms']:8.1f}  {p['ms'] - noop_r:8.1f}          -")
                if g is not None:
                    floor = 1e3 * (24 * g["compressed"] + 12 * g["numel"]) / bw
                    hg = g["ms"] - noop_r
                    ratio = f"{(p['ms'] - noop_r) / hg:5.2f}x" if p is not None and hg > 0 else "    -"
                    print(f"{model:7s} gradcomp   {r:4d}  {g['ms']:8.1f}  {hg:8.1f}  {floor:9.2f}   {ratio}")
                sys.stdout.flush()
    finally:
        pool.close()


if __name__ == "__main__":
    main()
