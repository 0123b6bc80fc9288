"""gradcomp.torch as PyTorch users meet it: checkpoints (pickled state, strict loads), complex
parameters, GradScaler, wrong model types, a required codec, 16-bit warnings, visible log lines.

Real gloo groups (2 CPU processes, spawn; the session's pools, gloo_pools.py). Assertions run in the ranks.

Bitwise comparisons (floats compared as integer views):
  - a pickled CompressionState (torch.save / pickle, PowerSGDState's checkpoint recipe) or
    Compressor against the original: residuals, iter and stats after loading, then gradients and
    residuals over two more steps of both;
  - complex parameters: gradients of the complex bucket against PyTorch's allreduce_hook;
  - GradScaler (bf16 autocast on CPU, growth every 2 steps, an inf injected on rank 0 at step 4,
    so the scale goes 2^8, 2^9, 2^10, then back to 2^9): residuals / scale, gradients after
    ``scaler.step`` (unscaled) and parameters against the same run with no loss scaling (which
    skips the optimizer on the same non-finite step). GradScaler's scales are powers of two and
    nothing over- or underflows, so scaling commutes with every rounding and top-k's choice:
    equality is exact. The same run without attach_grad_scaler must differ (the bug it fixes).
No tolerances.
"""

import contextlib
import copy
import logging
import os
import pickle
import sys
import tempfile
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

import gradcomp  # noqa: E402
import gradcomp.torch as gt  # noqa: E402
from gradcomp.torch import Compressor  # noqa: E402

# the gloo pools and helpers of the DDP hook tests (the session's pools: gloo_pools.py)
from ddp_helpers import (  # noqa: E402, F401
    Params, check_world_size_change_drops, ddp, grads_for, no_host_sync, run)

SEED = 20261202


class LogRecords(logging.Handler):
    """Collect the messages of the "gradcomp" logger at WARNING and above while active."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.msgs = []

    def __enter__(self):
        logging.getLogger("gradcomp").addHandler(self)
        return self

    def emit(self, record):
        self.msgs.append(record.getMessage())

    def __exit__(self, *exc):
        logging.getLogger("gradcomp").removeHandler(self)


def ibits(t):
    return t.detach().contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def same_bits(a, b):
    return torch.equal(ibits(a), ibits(b))


def counts(stats):
    """The totals of ``stats()`` without the times (which differ between two runs)."""
    return {k: v for k, v in stats["total"].items() if not k.endswith("_s")}


def step_params(m, gs):
    m.zero_grad()
    m([g.clone() for g in gs]).backward()


# ---------------------------------------------------------------------------------------------
# item 2: pickling


def trained(shapes, rank, steps):
    """A Params model of ``shapes`` (seed 0) in DDP with top-k 0.05 registered on every parameter
    (``exempt=()``: the checkpoint tests follow every residual), after ``steps`` steps of seeded
    gradients. Returns (the initial module, the DDP model, the state)."""
    torch.manual_seed(0)
    base = Params(shapes)
    m = ddp(copy.deepcopy(base))
    st = gt.register(m, codec="topk:ratio=0.05", min_compress_numel=0, exempt=())
    for step in range(steps):
        step_params(m, grads_for(base, rank, step, seed=SEED))
    return base, m, st


def job_pickle_state(rank, world, tmp):
    base, m1, st1 = trained([(500,), (20, 30), ()], rank, 3)
    stats1 = st1.stats()
    res1 = st1.state_dict()["residuals"]
    assert set(res1) == {"ps.0", "ps.1", "ps.2"}
    # PowerSGDState's recipe: save model, hook and hook state together, one file per rank
    path = os.path.join(tmp, f"ckpt_rank{rank}.pt")
    with LogRecords() as lr:
        torch.save({"state_dict": m1.state_dict(), "comm_hook": gt.compression_hook, "comm_hook_state": st1}, path)
    assert any("DDP model" in m and "process group" in m for m in lr.msgs), lr.msgs
    with LogRecords() as lr:
        ck = torch.load(path, weights_only=False)
    assert any("default process group" in m for m in lr.msgs), lr.msgs
    st2 = ck["comm_hook_state"]
    assert isinstance(st2, gt.CompressionState) and not st2.bound
    assert st2.iter == 3 and st2.codec.spec == "topk:ratio=0.05" and st2.min_compress_numel == 0
    assert st2.stats() == stats1
    with pytest.raises(RuntimeError, match="bind"):
        st2.residual("ps.0")
    m2 = ddp(copy.deepcopy(base))
    m2.load_state_dict(ck["state_dict"])
    assert st2.bind(m2) is st2 and st2.bound
    m2.register_comm_hook(st2, ck["comm_hook"])
    res2 = st2.state_dict()["residuals"]
    assert res2.keys() == res1.keys()
    for k in res1:
        assert same_bits(res1[k], res2[k]), k
    assert st2.stats() == stats1 and st2.process_group is m2.process_group
    # plain pickle, registered through register(state=)
    st3 = pickle.loads(pickle.dumps(st1))
    m3 = ddp(copy.deepcopy(base))
    m3.load_state_dict(m1.state_dict())
    assert gt.register(m3, state=st3) is st3
    for step in range(3, 5):  # all three continue identically
        gs = grads_for(base, rank, step, seed=SEED)
        for m in (m1, m2, m3):
            step_params(m, gs)
        for p, q, r in zip(m1.parameters(), m2.parameters(), m3.parameters()):
            assert same_bits(p.grad, q.grad) and same_bits(p.grad, r.grad), step
        for k, v in st1.state_dict()["residuals"].items():
            assert same_bits(v, st2.state_dict()["residuals"][k]) and same_bits(v, st3.state_dict()["residuals"][k])
    assert st1.iter == st2.iter == st3.iter == 5
    s1, s2 = st1.stats(), st2.stats()
    assert counts(s1) == counts(s2) and s1["steps"] == s2["steps"] == 5, (s1, s2)
    # an unbound state registered as is: the hook says what to do (both ranks, before any collective)
    m4 = ddp(copy.deepcopy(base))
    m4.register_comm_hook(pickle.loads(pickle.dumps(st1)), gt.compression_hook)
    with pytest.raises(RuntimeError, match=r"register\(new_ddp, state=state\)"):
        step_params(m4, grads_for(base, rank, 0, seed=SEED))
    with pytest.raises(TypeError, match="not both"):
        gt.register(ddp(copy.deepcopy(base)), codec="none", state=st3)
    return True


def test_pickled_state_powersgd_recipe():
    """Bitwise: a state through torch.save/torch.load (and pickle) on a new DDP model has the
    original's residuals, iter and stats, and continues identically."""
    with tempfile.TemporaryDirectory() as tmp:
        assert run(2, job_pickle_state, tmp) == [True, True]


def job_pickle_compressor(rank, world):
    comp = Compressor("topk:ratio=0.02", min_compress_numel=0)
    g = torch.Generator().manual_seed(SEED + rank)
    inputs = [{n: torch.randn(s, generator=g) for n, s in (("a", (3000,)), ("b", (40, 30)))} for _ in range(5)]

    def steps(c, first, last):
        outs = []
        for i in range(first, last):
            for name, t in inputs[i].items():
                x = t.clone()
                c.allreduce(x, name).wait()
                outs.append(x)
        return outs

    steps(comp, 0, 3)
    blob = pickle.dumps(comp)
    comp2 = pickle.loads(blob)
    assert comp2.iter == comp.iter and comp2.stats() == comp.stats()
    for name in ("a", "b"):
        assert same_bits(comp.residual(name), comp2.residual(name)), name
    for x, y in zip(steps(comp, 3, 5), steps(comp2, 3, 5)):
        assert same_bits(x, y)
    assert comp.iter == comp2.iter == 4 and counts(comp.stats()) == counts(comp2.stats())
    for name in ("a", "b"):
        assert same_bits(comp.residual(name), comp2.residual(name)), name
    # an explicit group is dropped (a warning) and set again; the residuals are loaded then
    group = dist.new_group(list(range(world)))
    comp3 = Compressor("topk:ratio=0.02", group=group, min_compress_numel=0)
    steps(comp3, 0, 2)
    with LogRecords() as lr:
        comp4 = pickle.loads(pickle.dumps(comp3))
    assert any("cannot be pickled" in m for m in lr.msgs) and any("set_process_group" in m for m in lr.msgs)
    assert comp4.group is None
    comp4.set_process_group(group)
    assert comp4.group is group and same_bits(comp4.residual("a"), comp3.residual("a"))
    return True


def test_pickled_compressor():
    """Bitwise: a pickled Compressor has the residuals, iter and stats and continues identically."""
    assert run(2, job_pickle_compressor) == [True, True]


# ---------------------------------------------------------------------------------------------
# item 3: strict load_state_dict


def job_strict_load(rank, world):
    base, m, st = trained([(800,), (10, 30)], rank, 2)
    mine = st.state_dict()
    assert mine["rank"] == rank and mine["codec"] == "topk:ratio=0.05" and mine["error_feedback"] is True
    obj = [mine if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)  # the habit: rank 0's file loaded on every rank
    rank0 = obj[0]
    before = {k: v.clone() for k, v in st.state_dict()["residuals"].items()}

    def unchanged():
        return all(same_bits(v, st.state_dict()["residuals"][k]) for k, v in before.items())

    if rank == 0:
        st.load_state_dict(rank0)
    else:
        with pytest.raises(ValueError, match=r"rank: saved 0, current 1.*strict=False"):
            st.load_state_dict(rank0)
        assert unchanged()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            st.load_state_dict(rank0, strict=False)
        assert any("rank: saved 0, current 1" in str(x.message) for x in w)
        for k, v in rank0["residuals"].items():
            assert same_bits(v, st.state_dict()["residuals"][k])
        st.load_state_dict(mine)
    # codec (by canonical spec) and error_feedback
    st.load_state_dict(dict(mine, codec="topk:ratio=5e-2"))  # the same codec written otherwise
    with pytest.raises(ValueError, match=r"codec: saved 'topk:ratio=0.1', current 'topk:ratio=0.05'"):
        st.load_state_dict(dict(mine, codec="topk:ratio=0.1"))
    with pytest.raises(ValueError, match=r"error_feedback: saved False, current True"):
        st.load_state_dict(dict(mine, error_feedback=False))
    with pytest.raises(ValueError, match=r"codec: .*; error_feedback: "):
        st.load_state_dict(dict(mine, codec="fp16", error_feedback=False))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        st.load_state_dict(dict(mine, codec="fp16"), strict=False)
    assert any("codec: saved 'fp16'" in str(x.message) for x in w)
    # another world size: residuals dropped with a warning, the rank not compared
    check_world_size_change_drops(gt.register(ddp(copy.deepcopy(base)), codec="topk:ratio=0.05"), rank0, world)
    # the Compressor checks alike
    comp = Compressor("fp16", error_feedback=False)
    comp.allreduce(torch.ones(2000), "x").wait()
    sd = comp.state_dict()
    other = dict(sd, rank=1 - rank)
    with pytest.raises(ValueError, match=rf"rank: saved {1 - rank}, current {rank}"):
        comp.load_state_dict(other)
    with pytest.raises(ValueError, match="error_feedback: saved True, current False"):
        comp.load_state_dict(dict(sd, error_feedback=True))
    comp.load_state_dict(sd)
    return True


def test_strict_load_state_dict():
    """No numerics: rank / codec / error_feedback mismatches raise (strict) or warn and load."""
    assert run(2, job_strict_load) == [True, True]


# ---------------------------------------------------------------------------------------------
# item 4: complex parameters


class Complexes(nn.Module):
    """A complex64 parameter and two float32 ones; forward(gs) makes p.grad == gs[i] (complex)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Parameter(torch.zeros(700, dtype=torch.complex64))
        self.w = nn.Parameter(torch.zeros(30, 40))
        self.b = nn.Parameter(torch.zeros(1500))

    def forward(self, gs):
        gc, gw, gb = gs
        # for a real loss L, PyTorch's gradient of a complex z is dL/dRe(z) + i dL/dIm(z)
        lc = (torch.view_as_real(self.c) * torch.view_as_real(gc)).sum()
        return lc + (self.w * gw).sum() + (self.b * gb).sum()


def job_complex(rank, world):
    m_ref, m_gc = ddp(Complexes()), ddp(Complexes())
    m_ref.register_comm_hook(None, default_hooks.allreduce_hook)
    st = gt.register(m_gc, codec="topk:ratio=0.05", min_compress_numel=0, exempt=())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(3):
            g = torch.Generator().manual_seed(SEED + 10 * step + rank)
            gs = [torch.randn(700, dtype=torch.complex64, generator=g), torch.randn(30, 40, generator=g),
                  torch.randn(1500, generator=g)]
            for m in (m_ref, m_gc):
                m.zero_grad()
                with no_host_sync():
                    m([x.clone() for x in gs]).backward()
            c_ref, c_gc = m_ref.module.c.grad, m_gc.module.c.grad
            assert c_gc.dtype == torch.complex64
            assert same_bits(torch.view_as_real(c_ref), torch.view_as_real(c_gc)), step
            assert not same_bits(m_ref.module.b.grad, m_gc.module.b.grad), step  # the real buckets compress
            schemes = {b["numel"]: b["scheme"] for b in st.stats()["buckets"]}
            assert schemes[1400] == "dense" and set(schemes.values()) == {"dense", "gather"}, schemes
    msgs = [str(x.message) for x in w if "complex" in str(x.message)]
    assert len(msgs) == 1 and "c: complex64" in msgs[0] and "view_as_real" in msgs[0], msgs
    return True


def test_complex_parameters_go_dense():
    """Bitwise: the complex parameter's gradient equals allreduce_hook's; one warning."""
    assert run(2, job_complex) == [True, True]


# ---------------------------------------------------------------------------------------------
# item 5: GradScaler


def _amp_run(rank, scaler, attach, steps=7, overflow_step=4):
    """Train a small MLP under bf16 autocast on CPU with the hook (top-k 0.1, gather). With
    ``scaler``: scaler.scale(loss).backward(), scaler.step, scaler.update; without: plain
    backward and the optimizer skipped on a non-finite step. On ``overflow_step`` rank 0's
    gradient of the first weight gets an inf. Returns per step: (scale used, {name: residual},
    [grads after the step], [params after the step])."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 10))
    m = ddp(model)
    st = gt.register(m, codec="topk:ratio=0.1", scheme="gather", min_compress_numel=0, exempt=())
    if attach:
        st.attach_grad_scaler(scaler)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    inject = {"on": False}

    def hook(g):
        if inject["on"] and rank == 0:
            g = g.clone()
            g.view(-1)[3] = float("inf")
        return g

    model[0].weight.register_hook(hook)
    data = torch.Generator().manual_seed(SEED + rank)
    out = []
    for step in range(steps):
        x = torch.randn(16, 24, generator=data)
        y = torch.randint(0, 10, (16,), generator=data)
        inject["on"] = step == overflow_step
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(m(x), y)
        scale = scaler.get_scale() if scaler is not None else 1.0
        with no_host_sync():
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif all(bool(torch.isfinite(p.grad).all()) for p in m.parameters()):
            opt.step()
        res = {n: st.residual(n) for n, _ in model.named_parameters()}
        out.append((scale, res, [p.grad.clone() for p in model.parameters()],
                    [p.detach().clone() for p in model.parameters()]))
    return out


def job_grad_scaler(rank, world):
    ref = _amp_run(rank, None, False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    amp = _amp_run(rank, scaler, True)
    scales = [s for s, *_ in amp]
    assert scales == [2.0 ** 8, 2.0 ** 8, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10, 2.0 ** 9, 2.0 ** 9], scales
    for step, ((_, r_ref, g_ref, p_ref), (s, r_amp, g_amp, p_amp)) in enumerate(zip(ref, amp)):
        nonfinite = step == 4
        for name in r_ref:
            assert float(r_ref[name].abs().sum()) > 0, (step, name)
            assert same_bits(r_amp[name] / s, r_ref[name]), f"step {step} {name}: residual / scale != reference"
        for a, b in zip(g_amp, g_ref):  # scaler.step unscaled the gradients in place
            assert same_bits(a, b) or (nonfinite and not bool(torch.isfinite(b).all())), step
        for a, b in zip(p_amp, p_ref):
            assert same_bits(a, b), step
    # without attach_grad_scaler the residuals of step 2 (first after a scale change) are off
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    plain = _amp_run(rank, scaler, False, steps=3)
    s, r_plain = plain[2][0], plain[2][1]
    assert not all(same_bits(r_plain[n] / s, ref[2][1][n]) for n in r_plain)
    return scales


def test_grad_scaler_rescales_residuals():
    """Bitwise: with attach_grad_scaler, residuals / scale, unscaled gradients and parameters equal
    the run without loss scaling, over growth, an overflow step (skipped, residuals restored)
    and the backoff that follows; not attaching shows the mismatch."""
    assert len(run(2, job_grad_scaler)) == 2


def job_grad_scaler_compressor(rank, world):
    g = torch.Generator().manual_seed(SEED + rank)
    ts = [torch.randn(4000, generator=g) for _ in range(3)]
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scaler's scale tensor exists once a loss was scaled
    comp, ref = Compressor("topk:ratio=0.01"), Compressor("topk:ratio=0.01")
    comp.attach_grad_scaler(scaler)
    assert comp.grad_scaler is scaler
    for step, (t, s) in enumerate(zip(ts, (4.0, 8.0, 2.0))):
        scaler.update(s)
        with no_host_sync():
            comp.allreduce(t * s, "g").wait()
        ref.allreduce(t.clone(), "g").wait()
        assert same_bits(comp.residual("g") / s, ref.residual("g")), step
    assert comp.state_dict()["grad_scale"] == 2.0 and ref.state_dict()["grad_scale"] == 1.0
    # a checkpoint keeps the scale the residuals are in; detaching brings them back to units of 1
    comp2 = Compressor("topk:ratio=0.01")
    comp2.load_state_dict(comp.state_dict())
    t = ts[0] + 1
    comp2.allreduce(t.clone(), "g").wait()  # no scaler: the residuals are divided by 2 first
    ref.allreduce(t.clone(), "g").wait()
    assert same_bits(comp2.residual("g"), ref.residual("g"))
    with pytest.raises(TypeError, match="GradScaler"):
        comp.attach_grad_scaler(object())
    return True


def test_grad_scaler_on_compressor():
    """Bitwise: the Compressor's residuals follow the scale (4, 8, 2) and a loaded grad_scale."""
    assert run(2, job_grad_scaler_compressor) == [True, True]


# ---------------------------------------------------------------------------------------------
# item 6: what register accepts


def job_model_types(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    fsdp1 = FullyShardedDataParallel(nn.Linear(8, 8), device_id=torch.device("cpu"))
    fsdp2 = nn.Sequential(nn.Linear(8, 8))
    fully_shard(fsdp2)
    cases = [(fsdp1, r"FullyShardedDataParallel \(FSDP1\) model, which gradcomp does not support; shard it with "
                     r"FSDP2's fully_shard and use gradcomp.torch.fsdp.register"),
             (fsdp2, r"fully_shard \(FSDP2, FSDPSequential\): use gradcomp.torch.fsdp.register\(model, codec\)"),
             (nn.Linear(8, 8), r"plain torch.nn.Module \(Linear\): wrap it first")]
    for model, what in cases:
        for make in (lambda: gt.register(model, codec="topk:ratio=0.01"),
                     lambda: gt.CompressionState(model, "topk:ratio=0.01")):
            with pytest.raises(TypeError, match=what) as e:
                make()
            msg = str(e.value)
            assert "torch.nn.parallel.DistributedDataParallel" in msg and "gradcomp.torch.Compressor" in msg, msg
    # with a DDP model, bad options still name the option
    m = ddp(Params([(100,)]))
    with pytest.raises(ValueError, match="linear"):
        gt.CompressionState(m, "topk:ratio=0.1", scheme="sum")
    return True


def test_fsdp_and_plain_modules_rejected_clearly():
    """No numerics: FSDP1, FSDP2 and plain modules raise TypeError at once, naming what to use."""
    assert run(2, job_model_types) == [True, True]


# ---------------------------------------------------------------------------------------------
# item 9: the codec is required; 16-bit casts on 16-bit buckets warn


def job_codec_required(rank, world):
    m = ddp(Params([(3000,)]))
    with pytest.raises(TypeError, match="codec is required"):
        gt.register(m)
    with pytest.raises(TypeError, match="codec"):
        gt.CompressionState(m)
    return True


def test_codec_required():
    """No numerics: register and CompressionState have no default codec."""
    assert run(2, job_codec_required) == [True, True]


def job_16bit_cast_warning(rank, world):
    cases = [(torch.bfloat16, "bf16", "saves nothing"), (torch.bfloat16, "fp16", "overflows beyond 65504"),
             (torch.float16, "bf16", "fewer mantissa bits"), (torch.float16, "fp16", "saves nothing"),
             (torch.float32, "bf16", None), (torch.bfloat16, "none", None)]
    for dtype, codec, what in cases:
        mm = ddp(Params([(3000,), (40, 50)], dtype))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            gt.register(mm, codec=codec, min_compress_numel=0)
            for step in range(2):
                step_params(mm, grads_for(mm.module, rank, step, seed=SEED))
        msgs = [str(x.message) for x in w if "saves nothing" in str(x.message)]
        if what is None:
            assert msgs == [], (dtype, codec, msgs)
        else:
            dt = str(dtype).replace("torch.", "")
            assert len(msgs) == 1 and what in msgs[0] and f"codec {codec} on a {dt} bucket" in msgs[0], msgs
            assert "codec 'none'" in msgs[0] and "smaller codec" in msgs[0]
    return True


def test_16bit_cast_on_16bit_buckets_warns_once():
    """No numerics: fp16/bf16 on float16/bfloat16 buckets warn once per (codec, dtype)."""
    assert run(2, job_16bit_cast_warning) == [True, True]


# ---------------------------------------------------------------------------------------------
# docs: log_every is visible without configuring logging


@contextlib.contextmanager
def _bare_stderr():
    """No handler on the "gradcomp" logger nor the root logger (level NOTSET), and file
    descriptor 2 captured; yields a function returning what reached it. Restores all."""
    lg, root = logging.getLogger("gradcomp"), logging.getLogger()
    saved = (list(lg.handlers), lg.level, list(root.handlers))
    for h in saved[0]:
        lg.removeHandler(h)
    for h in saved[2]:
        root.removeHandler(h)
    lg.setLevel(logging.NOTSET)
    sys.stderr.flush()
    fd = os.dup(2)
    out = tempfile.TemporaryFile()
    os.dup2(out.fileno(), 2)

    def text():
        sys.stderr.flush()
        out.seek(0)
        return out.read().decode()

    try:
        yield text
    finally:
        sys.stderr.flush()
        os.dup2(fd, 2)
        os.close(fd)
        lg.setLevel(saved[1])
        for h in saved[0]:
            lg.addHandler(h)
        for h in saved[2]:
            root.addHandler(h)


def job_log_every_visible(rank, world):
    lg = logging.getLogger("gradcomp")
    with _bare_stderr() as captured:
        assert not lg.hasHandlers()
        comp = Compressor("topk:ratio=0.01", log_every=1)
        for _ in range(3):
            comp.allreduce(torch.ones(2000), "x").wait()
        attached = [h for h in lg.handlers]
        # with a handler configured, none is added
        for h in attached:
            lg.removeHandler(h)
        mine = logging.Handler()
        lg.addHandler(mine)
        Compressor("none", log_every=1)
        assert lg.handlers == [mine]
        lg.removeHandler(mine)
        text = captured()
    assert len(attached) == 1, attached
    assert "gradcomp step 0: 2000 elements" in text and "gradcomp step 1:" in text, text
    return True


def test_log_every_visible_without_logging_config():
    """No numerics: with no handler anywhere, log_every lines reach stderr; none added otherwise."""
    assert run(2, job_log_every_visible) == [True, True]


# ---------------------------------------------------------------------------------------------
# the README's checkpoint recipe, run as is


def readme_checkpoint_block():
    """The python block of README.md's "Checkpoints, AMP and logging"."""
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")) as f:
        text = f.read()
    sec = text[text.index("### Checkpoints, AMP and logging"):]
    return re.search(r"```python\n(.*?)```", sec, re.S).group(1)


def job_readme_checkpoint(rank, world, code, tmp):
    base, ddp_model, state = trained([(3000,), (40, 30)], rank, 2)
    new_ddp = ddp(copy.deepcopy(base))
    ns = {"torch": torch, "gradcomp": __import__("gradcomp.torch"), "ddp_model": ddp_model, "state": state,
          "new_ddp": new_ddp, "rank": rank}
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GradScaler("cuda") without CUDA disables itself
            exec(compile(code, "README.md", "exec"), ns)
    finally:
        os.chdir(cwd)
    loaded = ns["state"]
    assert loaded is not state and loaded.bound and loaded.iter == 2
    assert loaded.compressor.grad_scaler is ns["scaler"]
    for k, v in state.state_dict()["residuals"].items():
        assert same_bits(v, loaded.state_dict()["residuals"][k]), k
    for step in range(2, 4):  # the loaded state on the new model continues as the original
        gs = grads_for(base, rank, step, seed=SEED)
        for m in (ddp_model, new_ddp):
            step_params(m, gs)
        for p, q in zip(ddp_model.parameters(), new_ddp.parameters()):
            assert same_bits(p.grad, q.grad), step
    return True


def test_readme_checkpoint_recipe():
    """Bitwise: the README's block, unchanged: the reloaded state on a new DDP model continues as
    the original."""
    with tempfile.TemporaryDirectory() as tmp:
        assert run(2, job_readme_checkpoint, readme_checkpoint_block(), tmp) == [True, True]


# ---------------------------------------------------------------------------------------------
# issue 19 (6): a group of one says so once and reports what it would send; warnings print once


def job_world_one_and_warnings_once(rank, world):
    groups = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    mine = groups[rank]
    codec = gradcomp.Codec("int8")
    comp = Compressor("int8", group=mine)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.randn(5000)
            got = comp.allreduce(x.clone(), "g").wait()
            assert torch.equal(got, x)  # the average of one rank: the tensor itself
    said = [str(m.message) for m in w if "one rank" in str(m.message)]
    assert len(said) == 1 and "nothing is sent or compressed" in said[0], said
    s = comp.stats()
    t = s["total"]
    assert t["numel"] == 3 * 5000 and t["sent_bytes"] == 0 and t["ring_bytes"] == 0
    assert t["packet_bytes"] == 3 * codec.packet_bytes(5000, "float32") and t["dense_bytes"] == 3 * 4 * 5000
    assert t["packet_ratio"] == t["packet_bytes"] / t["dense_bytes"]
    assert t["wire_ratio"] == t["packet_ratio"]  # what the packets would weigh (nothing crossed a wire)
    assert t["bits_per_element"] == 8 * t["packet_bytes"] / t["numel"]
    # a float64 tensor's dense-path warning reaches stderr once (not also as a log record)
    with _bare_stderr() as captured:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            c2 = Compressor("topk:ratio=0.1")
            for _ in range(3):
                c2.allreduce(torch.ones(2000, dtype=torch.float64), "d").wait()
        text = captured()
    assert text.count("takes the dense path") == 1, text
    return True


def test_world_size_one_and_warnings_print_once():
    """Issue 19 (6): a Compressor on a group of one returns the tensor, says once that nothing is
    sent, and its stats hold the packets it would send (packet and wire ratio finite); the
    float64 dense-path warning appears once on stderr."""
    assert run(2, job_world_one_and_warnings_once) == [True, True]
