"""Helpers shared by the modules that run DDP jobs on real gloo ranks (test_ddp_hook and the
scheme, hook, optimizer and DeepSpeed-backend modules): ``run`` (a job on the session's pool of
``world`` ranks, the library's shared pools: ``gradcomp.experiments.pool.shared``), the models
(Params, Reordered, Zoo), deterministic gradients, the DDP wrapper, the recording hook, bit views,
the independent numpy reference of top-k through the gather scheme (topk_average_ref / ref_topk /
check_topk_logs), the no-host-sync guard and the world-size-change check. A module of its own, so
that no test module imports another (issue 20)."""

import math
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import gradcomp.torch as gt
from gradcomp.experiments.pool import shared


def run(world, fn, *args):
    """``fn(rank, world, *args)`` on every rank of the session's pool of ``world`` ranks (spawned
    on first use, closed at the session's end by conftest.py); the W results in rank order."""
    return shared(world).run(fn, *args, timeout=240)


# ---------------------------------------------------------------------------------------------
# helpers used inside the ranks


class Params(nn.Module):
    """Parameters of given shapes; forward(gs) = sum_i (p_i * g_i).sum(), so p_i.grad == g_i exactly."""

    def __init__(self, shapes, dtype=torch.float32):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes])

    def forward(self, gs):
        return sum((p * g).sum() for p, g in zip(self.ps, gs))


class Reordered(nn.Module):
    """Registered out, a, b but used a, b, out: DDP rebuilds its buckets after step 1."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(32, 4)
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        return self.out(torch.relu(self.b(torch.relu(self.a(x)))))


class Zoo(nn.Module):
    """A channels_last conv weight, a 0-dim parameter and an unused parameter."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.conv.weight.data = self.conv.weight.data.contiguous(memory_format=torch.channels_last)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.unused = nn.Parameter(torch.randn(5))
        self.fc = nn.Linear(8 * 6 * 6, 10)

    def forward(self, x):
        return self.fc((torch.relu(self.conv(x)) * self.scale).flatten(1))


def grads_for(model, rank, step, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed * 100003 + step * 101 + rank)
    return [torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * scale for p in model.parameters()]


def ddp(model, **kw):
    kw.setdefault("bucket_cap_mb", 1)
    return nn.parallel.DistributedDataParallel(model, **kw)


def recording(state, ddp_model):
    """Register a wrapper hook that records, per call: the input bucket, the residuals before and
    after, the output and the parameter map. Returns the log list."""
    log = []

    def hook(st, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        params = bucket.parameters()
        base = buf.storage_offset()
        offs = [g.storage_offset() - base for g in bucket.gradients()]
        names = [st.param_name(p) for p in params]
        rec = {"step": st.iter, "index": bucket.index(), "names": names, "offsets": offs,
               "lengths": [p.numel() for p in params], "dtype": str(buf.dtype), "joined": st.joined,
               "buf": buf.detach().float().clone(),
               "res_before": {nm: st.residual(p) for nm, p in zip(names, params)}}
        fut = gt.compression_hook(st, bucket)
        rec["scheme"] = st.stats()["buckets"][-1]["scheme"]  # accounted synchronously by the hook

        def after(f):
            out = f.value()
            rec["out"] = out.detach().float().clone()
            rec["res_after"] = {nm: st.residual(p) for nm, p in zip(names, params)}
            log.append(rec)
            return out

        return fut.then(after)

    ddp_model.register_comm_hook(state, hook)
    return log


def bits(t):
    """Exact bit pattern of a float32 tensor/array as int32 numpy."""
    a = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return a.astype(np.float32).view(np.int32)


def to_dtype_f32(a, dtype):
    """Round float32 numpy to the bucket dtype (RNE) and back to float32 exactly."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(getattr(torch, dtype.replace("torch.", ""))).float().numpy()


def topk_average_ref(xps, ratio, dtype):
    """numpy reference of the gather scheme with top-k over W ranks: xps[r] is rank r's
    x' = g + r (float32, 1-D; zeros for a joined rank). Returns (expected average as float32,
    [expected residual float32 per rank])."""
    world = len(xps)
    n = xps[0].size
    k = min(n, max(1, math.ceil(ratio * n)))
    acc = np.zeros(n, dtype=np.float32)
    res = []
    for xp in xps:
        q = (xp / np.float32(world)).astype(np.float32)
        prio = np.where(np.isnan(q), 1, 0)
        key = np.where(np.isnan(q), 0, np.abs(q)).astype(np.float64)
        sel = np.lexsort((np.arange(n), -key, -prio))[:k]
        idx = np.sort(sel)
        v = to_dtype_f32(q[idx], dtype)
        acc[idx] = (acc[idx] + v).astype(np.float32)
        rn = xp.copy()
        rn[idx] = (xp[idx] - (np.float32(world) * v).astype(np.float32)).astype(np.float32)
        res.append(rn)
    return to_dtype_f32(acc, dtype), res


def ref_topk(recs, world, ratio):
    """numpy reference of one bucket over all ranks; recs[r] is rank r's record.
    Returns (expected out as float32, [expected residual float32 per rank, None if joined])."""
    assert len(recs) == world
    n = recs[0]["buf"].numel()
    xps = []
    for rec in recs:
        if rec["joined"]:
            xps.append(np.zeros(n, dtype=np.float32))
            continue
        buf = rec["buf"].numpy().astype(np.float32)
        order = np.argsort(rec["offsets"], kind="stable")
        rb = np.concatenate([rec["res_before"][rec["names"][i]].numpy() for i in order]).astype(np.float32)
        xps.append((buf + rb).astype(np.float32))
    out, res = topk_average_ref(xps, ratio, recs[0]["dtype"])
    return out, [None if rec["joined"] else r for rec, r in zip(recs, res)]


class no_host_sync:
    """Make Tensor.item / cpu / nonzero / tolist / __bool__ raise while active (the hook must not
    read device values on the host)."""

    names = ("item", "cpu", "nonzero", "tolist", "__bool__")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.names}

        def boom(*a, **k):
            raise AssertionError("host synchronization inside the hook")

        for n in self.names:
            setattr(torch.Tensor, n, boom)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


def split_by_name(rec, flat):
    """Split a bucket-order flat vector into {name: slice} using the record's parameter map."""
    return {nm: flat[o: o + n] for nm, o, n in zip(rec["names"], rec["offsets"], rec["lengths"])}


def check_topk_logs(rank, world, log, ratio, nonfinite_steps=()):
    """Gather every rank's log and check each compressed call bitwise against ref_topk; also
    check that every parameter's residual carries over from one step to the next."""
    logs = [None] * world
    dist.all_gather_object(logs, log)
    calls = {}
    for r, lg in enumerate(logs):
        for rec in lg:
            calls.setdefault((rec["step"], rec["index"]), [None] * world)[r] = rec
    checked = 0
    for (step, index), recs in sorted(calls.items()):
        assert all(rc is not None for rc in recs), f"step {step} bucket {index}: not every rank ran the hook"
        outs = [bits(rc["out"]) for rc in recs]
        for o in outs[1:]:
            assert np.array_equal(o, outs[0]), f"step {step} bucket {index}: ranks differ"
        assert all(rc["scheme"] == "gather" for rc in recs), f"step {step} bucket {index}: not compressed"
        if step in nonfinite_steps:
            continue
        exp, res = ref_topk(recs, world, ratio)
        assert np.array_equal(bits(recs[rank]["out"]), bits(exp)), f"step {step} bucket {index}: output != reference"
        if res[rank] is not None:
            exp_res = split_by_name(recs[rank], res[rank])
            for nm, t in recs[rank]["res_after"].items():
                assert np.array_equal(bits(t), bits(exp_res[nm])), f"step {step} {nm}: residual != x' - W*sent"
        checked += 1
    # residuals carry over between steps (across bucket rebuilds), per parameter name
    mine = sorted(log, key=lambda rc: (rc["step"], rc["index"]))
    last = {}
    for rec in mine:
        for nm, t in rec["res_before"].items():
            if nm in last:
                assert np.array_equal(bits(t), bits(last[nm])), f"step {rec['step']} {nm}: residual not carried over"
        for nm, t in rec["res_after"].items():
            last[nm] = t
    return checked


def check_world_size_change_drops(state, sd, world):
    """Loading ``sd`` as if saved at another world size drops the residuals, with a warning."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        state.load_state_dict(dict(sd, world_size=world + 1))
    assert any("world size" in str(x.message) for x in w)
    assert state.state_dict()["residuals"] == {}
