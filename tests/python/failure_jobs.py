"""Rank-side code of test_failures.py: fault injection into torch.distributed's collectives, the
scenarios (one per scheme and integration) and the state they compare.

:class:`Faults` wraps the collectives of ``torch.distributed`` in this process, counts the calls
once armed, and at the armed call index does one of:
  - ``kill_before``: SIGKILL this process instead of issuing the collective;
  - ``kill_during``: sleep 0.3 s first, so the other ranks are inside the collective waiting for
    this one (and the step's earlier collectives have completed), then SIGKILL;
  - ``stall``: sleep far longer than the process group's timeout, then issue it (the peers time out);
  - ``raise``: fail it in place, as a closed connection does (a RuntimeError at once for a
    blocking call, a Work whose Future fails for an async one); armed on every rank at the same
    index, so the ranks stay in step without a process dying;
  - ``corrupt``: run it, then overwrite bytes 32-35 of its output (a top-k packet's first index)
    with 0xFF, on every rank: the decode then fails the same way everywhere.

A scenario runs ``good`` steps, saves the state it must not lose, arms the faults (on the victim
rank, or on every rank for ``raise``), runs one more step, and reports whether it raised, the
error's type and message, the seconds it took, and where the state differs from the saved one.
With ``retry`` it then disarms, runs the failed step again and more steps, and returns the final
state, which the test compares with a run that never failed.
"""

import os
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor", "all_gather",
               "broadcast")
SEED = 20261202


class FailedWork:
    """What an async collective returns when its connection is closed: a Work whose Future fails."""

    def __init__(self, e):
        self.e = e

    def get_future(self):
        f = torch.futures.Future()
        f.set_exception(self.e)
        return f

    def wait(self, timeout=None):
        raise self.e

    def is_completed(self):
        return True


class DoneWork:
    """A completed Work holding ``tensor`` (what ``corrupt`` returns for an async collective)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def get_future(self):
        f = torch.futures.Future()
        f.set_result([self.tensor])
        return f

    def wait(self, timeout=None):
        return True


class Faults:
    """The wrapped collectives of this process (module docstring); :meth:`install` once."""

    _installed = None

    @classmethod
    def install(cls) -> "Faults":
        if cls._installed is None:
            cls._installed = cls()
        cls._installed.disarm()
        return cls._installed

    def __init__(self):
        self.real = {n: getattr(dist, n) for n in COLLECTIVES}
        self.plan = None
        self.count = 0
        self.stall_s = 0.0
        for n in COLLECTIVES:
            setattr(dist, n, self._wrap(n))

    def arm(self, mode: str, at: int = 0, stall_s: float = 30.0) -> None:
        self.plan, self.count, self.stall_s = (mode, int(at)), 0, stall_s

    def count_only(self) -> None:
        self.plan, self.count = ("count", -1), 0

    def disarm(self) -> None:
        self.plan = None

    def _wrap(self, name):
        real = self.real[name]

        def call(*args, **kwargs):
            plan = self.plan
            if plan is None:
                return real(*args, **kwargs)
            i = self.count
            self.count += 1
            mode, at = plan
            if i != at:
                return real(*args, **kwargs)
            if mode == "kill_before":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "kill_during":  # the peers are inside the collective, waiting for this rank
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "stall":
                time.sleep(self.stall_s)
                return real(*args, **kwargs)
            if mode == "raise":
                e = RuntimeError(f"injected: connection closed during {name} (collective {i} of the step)")
                if kwargs.get("async_op"):
                    return FailedWork(e)
                raise e
            if mode == "corrupt":  # the collective completes, then bytes 32-35 of what it delivered flip
                work = real(*args, **kwargs)
                if work is not None:
                    work.wait()
                out = args[0].view(-1).view(torch.uint8)
                out[32:36] = 0xFF
                return DoneWork(args[0]) if kwargs.get("async_op") else None
            raise AssertionError(f"unknown fault mode {mode!r}")

        call.__name__ = name
        return call


# ---- state snapshots ---------------------------------------------------------------------------
def snap(x):
    """A deep copy of ``x`` with every tensor cloned (for comparing states before and after)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: snap(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(snap(v) for v in x)
    if isinstance(x, np.ndarray):
        return x.copy()
    return x


def differences(a, b, path="state"):
    """Where ``a`` and ``b`` differ ([] when they are identical; tensors bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{path}: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"]
        if a.numel() and not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            return [f"{path}: values differ"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}[{k!r}]: only in {'after' if k not in a else 'before'}")
            else:
                out += differences(a[k], b[k], f"{path}[{k!r}]")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return [] if np.array_equal(np.asarray(a), np.asarray(b)) else [f"{path}: arrays differ"]
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def grad_for(shape, rank, step, tag):
    g = torch.Generator().manual_seed(SEED + 7919 * tag + 101 * step + rank)
    return torch.randn(shape, generator=g)


# ---- the integrations as steppers --------------------------------------------------------------
# Each builder returns an object with .step(k) (runs step k, raising what the step raises; returns
# the averaged tensors, for the clean/retried comparison) and .state() (what a checkpoint holds).

SHAPES = {"w": (64, 64), "b": (2048,)}


class CompressorRun:
    """A hand-written loop: two named tensors per step through one Compressor."""

    def __init__(self, rank, world, codec, scheme, **kw):
        import gradcomp.torch as gt

        self.rank = rank
        self.comp = gt.Compressor(codec, scheme=scheme, **kw) if scheme else gt.Compressor(codec, **kw)

    def step(self, k):
        futs, outs, errors = [], {}, []
        for tag, (name, shape) in enumerate(SHAPES.items()):
            t = grad_for(shape, self.rank, k, tag)
            try:
                futs.append((name, self.comp.allreduce(t, name)))
            except Exception as e:  # noqa: BLE001 - a collective issued in the calling thread
                errors.append(e)
                break
        for name, f in futs:
            try:
                outs[name] = f.wait().clone()
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]
        self.comp.end_step()
        return outs

    def state(self):
        sd = self.comp.state_dict()
        return {"state_dict": sd, "iter": self.comp.iter}


class Model(nn.Module):
    """Two 64 x 64 layers and their biases: with a 20 kB bucket cap, DDP puts each weight in a
    bucket of its own (several buckets per step)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class DDPRun:
    """A DDP model with gradcomp's hook (``codec`` a codec or a powersgd spec)."""

    def __init__(self, rank, world, codec, **kw):
        import gradcomp.torch as gt

        self.rank = rank
        self.model = Model()
        self.ddp = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=0.02)
        self.hook_state = gt.register(self.ddp, codec=codec, **kw)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def recover(self):
        """After a failed backward DDP's reducer cannot go on: a new DDP wrapper of the same module,
        the same hook state bound to it (what a user does to retry the step)."""
        import gc

        import gradcomp.torch as gt

        self.ddp = None  # the old reducer's autograd hooks go with it
        gc.collect()
        self.ddp = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=0.02)
        gt.register(self.ddp, state=self.hook_state)

    def step(self, k):
        g = torch.Generator().manual_seed(SEED + 31 * k + self.rank)
        x = torch.randn(16, 64, generator=g)
        self.opt.zero_grad()
        loss = self.ddp(x).square().mean()
        loss.backward()
        outs = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        self.opt.step()
        return outs

    def state(self):
        return {"hook": self.hook_state.state_dict(), "iter": self.hook_state.iter,
                "params": {n: p.detach().clone() for n, p in self.model.named_parameters()}}


class BackendRun:
    """DeepSpeed's compressed_allreduce contract: one buffer per step with its error buffers (the
    backend's unit is the call: DeepSpeed's optimizer owns the buffers of its other calls)."""

    def __init__(self, rank, world, **kw):
        from gradcomp.deepspeed import OnebitBackend

        self.rank, self.world = rank, world
        self.be = OnebitBackend()
        Np = 24 * 100
        self.errors = {"m0": (torch.zeros(Np), torch.zeros(Np // world))}

    def step(self, k):
        outs = {}
        for tag, (name, (we, se)) in enumerate(self.errors.items()):
            buf = grad_for((2400,), self.rank, k, tag)
            outs[name] = self.be.compressed_allreduce(buf, we, se, None).clone()
        return outs

    def state(self):
        return {"errors": {k: (we.clone(), se.clone()) for k, (we, se) in self.errors.items()}}


class OptimRun:
    """A gradcomp.optim optimizer in a plain loop (it averages the warm-up gradients itself)."""

    def __init__(self, rank, world, kind="OnebitAdam", **kw):
        import gradcomp.optim as go

        self.rank = rank
        self.model = Model()
        cls = getattr(go, kind)
        extra = {"var_freeze_step": 3, "var_update_scaler": 1} if kind == "ZeroOneAdam" else {"freeze_step": 2}
        self.opt = cls(self.model.parameters(), lr=1e-2, **extra, **kw)

    def step(self, k):
        g = torch.Generator().manual_seed(SEED + 31 * k + self.rank)
        x = torch.randn(16, 64, generator=g)
        self.opt.zero_grad()
        self.model(x).square().mean().backward()
        self.opt.step()
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def state(self):
        return {"opt": self.opt.state_dict(), "params": {n: p.detach().clone() for n, p in
                                                         self.model.named_parameters()}}


def build(rank, world, integration: str):
    """The stepper of ``integration`` (names as in test_failures.INTEGRATIONS)."""
    kind, _, arg = integration.partition(":")
    if kind == "compressor":
        codec, scheme = {"dense": ("topk:ratio=0.1", "dense"), "sum": ("fp16", "sum"),
                         "gather": ("topk:ratio=0.05", "gather"), "two_phase": ("int8", "two_phase"),
                         "hierarchical": ("int8", "hierarchical"), "powersgd": ("powersgd:rank=2", None)}[arg]
        kw = {"local_world_size": 2, "inner_scheme": "two_phase"} if arg == "hierarchical" else {}
        return CompressorRun(rank, world, codec, scheme, **kw)
    if kind == "ddp":
        return DDPRun(rank, world, {"topk": "topk:ratio=0.05", "int8": "int8", "powersgd": "powersgd:rank=2"}[arg])
    if kind == "deepspeed":
        return BackendRun(rank, world)
    if kind == "optim":
        return OptimRun(rank, world, arg or "OnebitAdam")
    raise ValueError(integration)


def collectives_per_step(run, k) -> int:
    """How many collectives this rank issues in step ``k`` (the step is run)."""
    faults = Faults.install()
    faults.count_only()
    try:
        run.step(k)
    finally:
        n = faults.count
        faults.disarm()
    return n


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        return {"raised": True, "type": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0}
    return {"raised": False, "type": "", "msg": "", "seconds": time.monotonic() - t0}


# ---- the jobs ----------------------------------------------------------------------------------
def dead_peer_job(rank, world, integration, mode, victim=1, good=3, plant_bug=False, during_back=0):
    """One rank dies (or stalls) in step ``good``; what the survivors see (module docstring).
    ``during_back``: kill_during dies at the step's collective that many before its last."""
    faults = Faults.install()
    if plant_bug:
        plant_ignored_future()
    run = build(rank, world, integration)
    for k in range(good - 1):
        run.step(k)
    n = collectives_per_step(run, good - 1)  # the last good step, counted
    before = snap(run.state())
    if rank == victim:
        at = 0 if mode in ("kill_before", "stall") else n - 1 - during_back  # during: the step's last collective
        faults.arm(mode, at, stall_s=60.0)
    out = _outcome(lambda: run.step(good))
    faults.disarm()
    out["diff"] = differences(before, snap(run.state()))
    out["collectives"] = n
    return out


def injected_job(rank, world, integration, at, steps=4, fail_step=2, mode="raise"):
    """Every rank fails collective ``at`` of step ``fail_step`` (``raise``); the failure must be
    seen on every rank with the state as before the step, and the retried run must end in
    exactly the state of a run that never failed (module docstring)."""
    faults = Faults.install()
    clean = build(rank, world, integration)
    clean_outs = []
    for k in range(steps):
        if k == fail_step and hasattr(clean, "recover"):
            clean.recover()  # the same DDP wrapper history as the retried run (bucketing changes sums)
        clean_outs.append(clean.step(k))
    clean_state = snap(clean.state())
    run = build(rank, world, integration)
    for k in range(fail_step):
        run.step(k)
    before = snap(run.state())
    faults.arm(mode, at)
    out = _outcome(lambda: run.step(fail_step))
    fired = faults.count > at
    faults.disarm()
    out["fired"] = fired
    out["diff"] = differences(before, snap(run.state()))
    if hasattr(run, "recover"):
        run.recover()
    outs = []
    for k in range(fail_step, steps):
        outs.append(run.step(k))
    out["retry_diff"] = differences(clean_state, snap(run.state()))
    out["outs_diff"] = differences(clean_outs[fail_step:], outs)
    return out


def plant_ignored_future():
    """The bug of issue 18, planted back: a callback that ignores its future (never reads it, so a
    failed collective's error is dropped and the buffer decoded as if it held the sum)."""
    import gradcomp.schemes.allreduce as allreduce_mod
    import gradcomp.schemes.context as context_mod
    import gradcomp.torch.compressor as compressor_mod

    def chain(fut, fn, what="", on_error=None, device=None):
        return fut.then(lambda f: fn(None))  # the bug: f.value() is never read

    for m in (context_mod, allreduce_mod, compressor_mod):
        m.chain = chain


# ---- ranks that disagree -------------------------------------------------------------------------
def mismatch_job(rank, world, case):
    """One kind of disagreement between the ranks (test_failures.MISMATCHES); every rank reports
    the error it raised and whether its tensor and residuals kept their values."""
    import gradcomp
    import gradcomp.torch as gt

    t = grad_for((4096,), rank, 0, 0)
    orig = t.clone()
    odd = rank == 1
    res_before = res_after = None
    comp = None

    def reduce(comp, t, name="g"):
        return comp.allreduce(t, name).wait()

    def go():
        nonlocal comp, res_before, res_after
        if case == "codec":  # fp16 against bf16 on the sum scheme: the payloads have the same size
            comp = gt.Compressor("bf16" if odd else "fp16", scheme="sum")
            reduce(comp, t)
        elif case == "spec":  # another int8 block on two_phase
            comp = gt.Compressor("int8:block=256" if odd else "int8:block=128", scheme="two_phase")
            reduce(comp, t)
        elif case == "numel":
            comp = gt.Compressor("topk:ratio=0.05", scheme="gather")
            reduce(comp, t[:4000] if odd else t)
        elif case == "layout":  # the same bucket with the parameters in another order
            comp = gt.Compressor("int8", scheme="two_phase")
            params = [("a", 0, 2048), ("b", 2048, 2048)]
            if odd:
                params = [("b", 0, 2048), ("a", 2048, 2048)]
            comp.allreduce_bucket(t, 0, params).wait()
        elif case == "scheme":
            comp = gt.Compressor("int8", scheme="gather" if odd else "two_phase")
            reduce(comp, t)
        elif case == "order":
            comp = gt.Compressor("fp16", scheme="sum")
            u = grad_for((4096,), rank, 0, 1)
            names = ("u", "g") if odd else ("g", "u")
            futs = [comp.allreduce(u if n == "u" else t, n) for n in names]
            for f in futs:
                f.wait()
        elif case == "skip":  # rank 1 ends step 1 without reducing (its step counter runs ahead)
            comp = gt.Compressor("topk:ratio=0.05", scheme="gather")
            for k in range(3):
                if odd and k == 1:
                    comp.end_step()
                    continue
                if k:
                    res_before = comp.residual("g")
                t.copy_(grad_for((4096,), rank, k, 0))
                orig.copy_(t)
                comp.allreduce(t, "g").wait()
                comp.end_step()
        elif case == "powersgd":
            comp = gt.Compressor("powersgd:rank=4" if odd else "powersgd:rank=2")
            comp.allreduce(t.view(64, 64), "g").wait()
        elif case == "ddp":
            model = Model()
            ddp = nn.parallel.DistributedDataParallel(model)
            gt.register(ddp, codec="bf16" if odd else "fp16")
            ddp(torch.randn(8, 64)).square().mean().backward()
        elif case == "headers":  # schemes called directly (no call descriptor): the packet headers
            from gradcomp.schemes import SchemeContext, gather
            codec = gradcomp.Codec("fp8:format=e5m2" if odd else "fp8:format=e4m3")
            ctx = SchemeContext.for_layout("gather", codec, t.numel(), t.dtype, t.device, None, world)
            gather(t, ctx).wait()
        else:
            raise ValueError(case)

    out = _outcome(go)
    out["tensor_kept"] = bool(torch.equal(t, orig))
    if case == "skip" and comp is not None:
        res_after = comp.residual("g")
        out["residual_kept"] = bool(torch.equal(res_before, res_after))
    return out


def scan_job(rank, world):
    """Nothing: a job that proves the pool still works after the mismatch jobs."""
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    return float(t[0])
