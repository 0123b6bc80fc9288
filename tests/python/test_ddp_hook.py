"""gradcomp.torch DDP hook with real gloo process groups (2 or 4 CPU processes, spawn).

The processes live in a pool (gradcomp.experiments.pool.GlooPool) shared by the session (gloo_pools.py);
each test runs a job function in every rank and the assertions run inside the ranks.

The hook exempts parameters with fewer than 2 dimensions by default (they go dense); these tests
are about the codec path, so they pass ``exempt=()`` (every parameter compressed) -- the exemption
itself is tested in test_policies.py.

Bitwise comparisons (exact bits; floats compared as integer views so NaN and -0.0 count):
  - codec none vs PyTorch's allreduce_hook (W=2: a two-term sum is order-free, and both divide by W
    before one SUM allreduce);
  - top-k (gather scheme) vs an independent numpy reference: every rank's x' = g + r (float32),
    q = x' / W (IEEE float32), exact top-k by |q| (NaN first, ties to the lowest index), values
    rounded to the bucket dtype, summed in rank order into a float32 accumulator starting at +0.0,
    rounded once into the bucket dtype (docs/contracts.md section 2: D = float(code), out = fl(out + D));
    residual r_new = x' - W * D at sent indices, x' elsewhere;
  - the returned bucket on every rank; residual remapping across a bucket rebuild; checkpoint round
    trip; no_sync accumulation; join(); non-finite restore/reset; dense flush;
  - float64 buckets and world size 1 against plain allreduce / pass-through.
Tolerances:
  - fp16 vs fp16_compress_hook: at most one fp16 ulp of the hook's value, on elements where the
    hook did not overflow;
  - topk:ratio=1.0 vs allreduce_hook: |a - b| <= 1e-6 * |b| (it is exact for W=2; the tolerance
    allows for another summation order).
"""

import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

import gradcomp.torch as gt  # noqa: E402


from ddp_helpers import (  # noqa: E402
    Params, Reordered, Zoo, check_topk_logs, check_world_size_change_drops, ddp, grads_for, no_host_sync, recording,
    run)


# ---------------------------------------------------------------------------------------------
# jobs (module level: pickled by reference into the ranks)


def job_none_vs_allreduce_hook(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8)).to(dtype)
    m_ref = ddp(_copy(base), bucket_cap_mb=0.001)
    m_gc = ddp(_copy(base), bucket_cap_mb=0.001)
    m_ref.register_comm_hook(None, default_hooks.allreduce_hook)
    st = gt.register(m_gc, codec="none", error_feedback=False, scheme="sum", min_compress_numel=0, exempt=())
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randn(4, 16, generator=g).to(dtype)
        for m in (m_ref, m_gc):
            m.zero_grad()
            m(x).float().square().mean().backward()
        for p, q in zip(m_ref.parameters(), m_gc.parameters()):
            assert torch.equal(p.grad.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               q.grad.view(torch.int16 if dtype != torch.float32 else torch.int32)), (step, p.shape)
    s = st.stats()
    assert s["total"]["compressed_buckets"] >= 3 and s["total"]["dense_buckets"] == 0
    return True


def _copy(m):
    import copy

    return copy.deepcopy(m)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_none_bitwise_equals_allreduce_hook(dtype):
    """Bitwise: gradients equal allreduce_hook's on both ranks (W=2)."""
    assert run(2, job_none_vs_allreduce_hook, dtype) == [True, True]


def job_fp16_vs_fp16_hook(rank, world):
    n = 4096
    shapes = [(n,)]
    m_ref, m_gc = ddp(Params(shapes)), ddp(Params(shapes))
    m_ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
    gt.register(m_gc, codec="fp16", error_feedback=False, min_compress_numel=0, exempt=())
    for step in range(2):
        gs = grads_for(m_gc.module, rank, step, scale=10.0)
        if step == 1:  # |g| > 65504 on one rank while g / W fits in fp16
            gs[0][7] = 1.0e5 if rank == 0 else 3.0
        outs = []
        for m in (m_ref, m_gc):
            m.zero_grad()
            m([g.clone() for g in gs]).backward()
            outs.append(m.module.ps[0].grad.clone())
        ref, got = outs[0].numpy(), outs[1].numpy()
        fin = np.isfinite(ref)
        ulp = np.spacing(np.abs(ref[fin]).astype(np.float16)).astype(np.float32)
        assert np.all(np.abs(got[fin] - ref[fin]) <= ulp), step
        assert np.isfinite(got).all(), step
        if step == 1:
            assert not np.isfinite(ref[7])  # the PyTorch hook overflows ...
            assert got[7] == np.float32(np.float16(5.0e4) + np.float16(1.5))  # ... gradcomp does not (fp16 sum)
    return True


def test_fp16_within_one_ulp_of_fp16_hook_and_no_overflow():
    """Tolerance: one fp16 ulp of fp16_compress_hook where it is finite; exact value where it overflows."""
    assert run(2, job_fp16_vs_fp16_hook) == [True, True]


def job_topk_reference(rank, world, dtype_name, ratio, steps):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    m = ddp(Reordered().to(dtype), bucket_cap_mb=1200 * 4 / 2**20)
    st = gt.CompressionState(m, codec=f"topk:ratio={ratio}", min_compress_numel=0, exempt=(), scheme="gather")
    log = recording(st, m)
    layouts = []
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        m.zero_grad()
        m(torch.randn(16, 8, generator=g).to(dtype)).float().square().mean().backward()
        layouts.append([(lay["index"], tuple(lay["params"])) for lay in st.bucket_layouts()])
    assert layouts[0] != layouts[-1], "the bucket layout was expected to be rebuilt"
    # the public parameter map is the bucket's: names, offsets and lengths of the last step's calls
    last = {rc["index"]: rc for rc in log if rc["step"] == steps - 1}
    for lay in st.bucket_layouts():
        rc = last[lay["index"]]
        assert lay["params"] == list(zip(rc["names"], rc["offsets"], rc["lengths"])), lay
        assert (lay["numel"], lay["scheme"]) == (rc["buf"].numel(), "gather"), lay
    checked = check_topk_logs(rank, world, log, ratio)
    assert checked == len({(r["step"], r["index"]) for r in log})
    return checked


@pytest.mark.parametrize("world,dtype,ratio", [(2, "float32", 0.05), (2, "float16", 0.1), (4, "float32", 0.02)])
def test_topk_bitwise_reference_with_rebuild(world, dtype, ratio):
    """Bitwise: output, residuals and carry-over across the rebuild vs the numpy reference; ranks agree."""
    res = run(world, job_topk_reference, dtype, ratio, 4)
    assert len(set(res)) == 1 and res[0] >= 4


def job_ratio1_vs_dense(rank, world):
    shapes = [(300,), (17, 9)]
    m_ref, m_gc = ddp(Params(shapes)), ddp(Params(shapes))
    m_ref.register_comm_hook(None, default_hooks.allreduce_hook)
    gt.register(m_gc, codec="topk:ratio=1.0", scheme="gather", min_compress_numel=0, exempt=())
    for step in range(3):
        gs = grads_for(m_gc.module, rank, step)
        for m in (m_ref, m_gc):
            m.zero_grad()
            m([g.clone() for g in gs]).backward()
        for p, q in zip(m_ref.parameters(), m_gc.parameters()):
            assert torch.allclose(q.grad, p.grad, rtol=1e-6, atol=0.0)
    return True


def test_topk_ratio1_matches_dense():
    """Tolerance: rel 1e-6 against allreduce_hook."""
    assert run(2, job_ratio1_vs_dense) == [True, True]


def job_checkpoint(rank, world):
    shapes = [(500,), (20, 30), ()]
    torch.manual_seed(0)
    base = Params(shapes)
    m1 = ddp(_copy(base))
    st1 = gt.register(m1, codec="topk:ratio=0.05", min_compress_numel=0, exempt=())
    for step in range(3):
        m1.zero_grad()
        m1(grads_for(base, rank, step)).backward()
    buf = io.BytesIO()
    torch.save(st1.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    m2 = ddp(_copy(base))
    st2 = gt.register(m2, codec="topk:ratio=0.05", min_compress_numel=0, exempt=())
    st2.load_state_dict(sd)
    assert st2.iter == st1.iter == 3
    a, b = st1.state_dict()["residuals"], st2.state_dict()["residuals"]
    assert a.keys() == b.keys() == {"ps.0", "ps.1", "ps.2"}
    for k in a:
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k
        assert a[k].abs().sum() > 0 or k == "ps.2"
    for step in range(3, 5):  # both continue identically
        for m in (m1, m2):
            m.zero_grad()
            m(grads_for(base, rank, step)).backward()
        for p, q in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p.grad.view(torch.int32), q.grad.view(torch.int32))
    for k, v in st1.state_dict()["residuals"].items():
        assert torch.equal(v.view(torch.int32), st2.state_dict()["residuals"][k].view(torch.int32))
    # another world size: residuals dropped with a warning
    check_world_size_change_drops(gt.register(ddp(_copy(base)), codec="topk:ratio=0.05", min_compress_numel=0,
                                              exempt=()),
                                  sd, world)
    return True


def test_checkpoint_round_trip_bit_exact():
    """Bitwise: residuals after save/load and two more steps on both models."""
    assert run(2, job_checkpoint) == [True, True]


def job_no_sync(rank, world):
    shapes = [(400,), (10, 10)]
    m = ddp(Params(shapes))
    st = gt.CompressionState(m, codec="topk:ratio=0.1", min_compress_numel=0, exempt=())
    log = recording(st, m)
    gsteps = [grads_for(m.module, rank, s) for s in range(3)]
    with m.no_sync():
        for s in range(2):
            m(gsteps[s]).backward()
    m(gsteps[2]).backward()
    assert st.iter == 1 and len(log) == 1
    acc = [(a + b) + c for a, b, c in zip(*gsteps)]  # autograd's accumulation order
    rec = log[0]
    for nm, o, n in zip(rec["names"], rec["offsets"], rec["lengths"]):
        want = acc[int(nm.split(".")[1])].reshape(-1)
        assert torch.equal(rec["buf"][o: o + n].view(torch.int32), want.view(torch.int32)), nm
    check_topk_logs(rank, world, log, 0.1)
    return True


def test_no_sync_accumulation():
    """Bitwise: the hook sees the accumulated gradient once; output vs the numpy reference."""
    assert run(2, job_no_sync) == [True, True]


def job_join(rank, world):
    shapes = [(600,)]
    m = ddp(Params(shapes))
    st = gt.CompressionState(m, codec="topk:ratio=0.05", min_compress_numel=0, exempt=())
    log = recording(st, m)
    steps = 2 if rank == 0 else 4
    with m.join():
        for s in range(steps):
            m.zero_grad()
            m(grads_for(m.module, rank, s)).backward()
    joined = [rc["step"] for rc in log if rc["joined"]]
    if rank == 0:
        assert joined == [2, 3], joined
        # the joined rank kept its residual
        assert torch.equal(log[-1]["res_after"]["ps.0"].view(torch.int32), log[1]["res_after"]["ps.0"].view(torch.int32))
    else:
        assert joined == []
    assert len(log) == 4
    check_topk_logs(rank, world, log, 0.05)
    return True


def test_join_uneven_inputs():
    """Bitwise: joined rank sends zeros and keeps its residual; outputs vs the numpy reference."""
    assert run(2, job_join) == [True, True]


def job_nonfinite(rank, world):
    shapes = [(300,), (5, 7)]
    # top-k, restore: NaN on rank 0 at step 2
    m = ddp(Params(shapes))
    st = gt.CompressionState(m, codec="topk:ratio=0.1", min_compress_numel=0, exempt=(), nonfinite="restore")
    log = recording(st, m)
    for s in range(5):
        gs = grads_for(m.module, rank, s)
        if s == 2 and rank == 0:
            gs[0][11] = float("nan")
        m.zero_grad()
        with no_host_sync():
            m(gs).backward()
        fin = all(torch.isfinite(p.grad).all() for p in m.parameters())
        assert fin == (s != 2), (s, fin)
    bad = [rc for rc in log if rc["step"] == 2]
    for rc in bad:
        for nm in rc["names"]:
            assert torch.equal(rc["res_after"][nm].view(torch.int32), rc["res_before"][nm].view(torch.int32))
    check_topk_logs(rank, world, log, 0.1, nonfinite_steps=(2,))
    assert st.stats()["nonfinite_steps"] == 1
    # bf16 (sum scheme), reset: inf on rank 1 at step 1
    m2 = ddp(Params(shapes))
    st2 = gt.CompressionState(m2, codec="bf16", min_compress_numel=0, exempt=(), nonfinite="reset")
    log2 = recording(st2, m2)
    for s in range(3):
        gs = grads_for(m2.module, rank, s)
        if s == 1 and rank == 1:
            gs[1][2, 3] = float("inf")
        m2.zero_grad()
        m2(gs).backward()
        fin = all(torch.isfinite(p.grad).all() for p in m2.parameters())
        assert fin == (s != 1), (s, fin)
    for rc in log2:
        if rc["step"] == 1:
            assert all(float(t.abs().sum()) == 0.0 for t in rc["res_after"].values())
        else:
            assert all(torch.isfinite(t).all() for t in rc["res_after"].values())
    outs = [None] * world
    dist.all_gather_object(outs, [rc["out"] for rc in log2])
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    return True


def test_nonfinite_restore_and_reset():
    """Bitwise: restored residuals, identical non-finite outputs on both ranks, later steps vs reference."""
    assert run(2, job_nonfinite) == [True, True]


def job_zoo(rank, world):
    torch.manual_seed(0)
    m = ddp(Zoo(), find_unused_parameters=True, bucket_cap_mb=0.004)
    st = gt.CompressionState(m, codec="topk:ratio=0.1", min_compress_numel=0, exempt=(), scheme="gather")
    log = recording(st, m)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        m.zero_grad(set_to_none=True)
        m(torch.randn(2, 3, 8, 8, generator=g)).square().mean().backward()
        recs = [rc for rc in log if rc["step"] == step]
        for rc in recs:
            for nm, o, n in zip(rc["names"], rc["offsets"], rc["lengths"]):
                p = dict(m.module.named_parameters())[nm]
                if nm == "unused":
                    assert p.grad is None
                    continue
                view = rc["out"][o: o + n].as_strided(p.shape, p.stride())
                assert torch.equal(view.view(torch.int32), p.grad.view(torch.int32)), (step, nm)
        w = m.module.conv.weight.grad
        assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
        assert m.module.scale.grad.dim() == 0
    check_topk_logs(rank, world, log, 0.1)
    return True


def test_unused_param_zero_dim_and_channels_last():
    """Bitwise: p.grad equals the bucket output through p's strides; output vs the numpy reference."""
    assert run(2, job_zoo) == [True, True]


def job_dense_paths(rank, world):
    # (a) start_iter: dense steps first, then compressed; stats formulas
    shapes = [(2000,), (50, 40)]
    m = ddp(Params(shapes))
    st = gt.register(m, codec="topk:ratio=0.01", start_iter=2, min_compress_numel=0, exempt=(), log_every=1)
    import logging

    msgs = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda r: msgs.append(r.getMessage())
    lg = logging.getLogger("gradcomp")
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    for s in range(3):
        m.zero_grad()
        m(grads_for(m.module, rank, s)).backward()
        b = st.stats()["step"]
        if s < 2:
            assert b["dense_buckets"] >= 1 and b["compressed_buckets"] == 0
        else:
            assert b["dense_buckets"] == 0 and b["compressed_buckets"] >= 1
            n = b["numel"]
            assert n == 4000
            pb = sum(st.codec.packet_bytes(bk["numel"]) for bk in st.stats()["buckets"])
            assert b["packet_bytes"] == pb
            assert b["packet_ratio"] == pb / (4 * n)
            assert b["bits_per_element"] == 8 * pb / n
            assert abs(b["wire_ratio"] - (world - 1) * pb / (2 * (world - 1) / world * 4 * n)) < 1e-12
    assert st.stats()["steps"] == 3
    lg.removeHandler(handler)
    assert sum("packet_ratio" in x for x in msgs) == 2  # steps 0 and 1 logged when closed
    # (b) rebuild moves a.weight into a bucket under min_compress_numel: its residual is flushed
    torch.manual_seed(0)
    m2 = ddp(Reordered(), bucket_cap_mb=1200 * 4 / 2**20)
    st2 = gt.CompressionState(m2, codec="topk:ratio=0.05", min_compress_numel=500, exempt=())
    log = recording(st2, m2)
    g = torch.Generator().manual_seed(rank)
    for s in range(3):
        m2.zero_grad()
        m2(torch.randn(16, 8, generator=g)).square().mean().backward()
    flushed = [rc for rc in log if rc["step"] == 1 and rc["names"] == ["a.weight"]]
    assert len(flushed) == 1, [(rc["step"], rc["names"]) for rc in log]
    rc = flushed[0]
    r_old = rc["res_before"]["a.weight"]
    assert float(r_old.abs().sum()) > 0
    assert float(rc["res_after"]["a.weight"].abs().sum()) == 0.0
    sent = ((rc["buf"] + r_old) / world)
    allsent = [None] * world
    dist.all_gather_object(allsent, sent)
    exp = allsent[0] + allsent[1]
    assert torch.equal(rc["out"].view(torch.int32), exp.view(torch.int32))
    # (c) float64 buckets take the dense path with one warning, equal to allreduce_hook
    m3, m4 = ddp(Params(shapes, torch.float64)), ddp(Params(shapes, torch.float64))
    m4.register_comm_hook(None, default_hooks.allreduce_hook)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        gt.register(m3, codec="topk:ratio=0.01", min_compress_numel=0)
        for s in range(2):
            gs = grads_for(m3.module, rank, s)
            for mm in (m3, m4):
                mm.zero_grad()
                mm([x.clone() for x in gs]).backward()
            for p, q in zip(m3.parameters(), m4.parameters()):
                assert torch.equal(p.grad, q.grad)
    assert sum("float64" in str(x.message) for x in w) == 1
    # (d) world size 1 passes the bucket through
    groups = [dist.new_group([r]) for r in range(world)]
    m5 = ddp(Params(shapes), process_group=groups[rank])
    gt.register(m5, codec="topk:ratio=0.01", min_compress_numel=0)
    gs = grads_for(m5.module, rank, 0)
    m5(gs).backward()
    for p, x in zip(m5.parameters(), gs):
        assert torch.equal(p.grad, x)
    return True


def test_dense_paths_start_iter_flush_float64_world1():
    """Bitwise: flush, float64 and world size 1 results; byte accounting formulas exact."""
    assert run(2, job_dense_paths) == [True, True]


def test_bad_arguments():
    """No numerics: argument validation."""
    # validated before any process-group call
    with pytest.raises(ValueError, match="scheme"):
        gt.CompressionState(None, "none", scheme="ring")
    with pytest.raises(ValueError, match="nonfinite"):
        gt.CompressionState(None, "none", nonfinite="ignore")
