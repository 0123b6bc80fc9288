"""gradcomp.torch.powersgd_hook / PowerSGDState / Compressor("powersgd:...") on real gloo groups.

References, each written independently of the code under test:
  - PyTorch's own ``powerSGD_hook`` (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook)
    on the same gradients, seed and options (``q_init="torch"`` draws the initial Qs as it does),
    over 5 steps on 2 ranks: tolerance below (TOL), because the orthogonalizations differ in their
    rounding (PyTorch: Gram-Schmidt in float32 for r <= 2, Householder QR for r > 2, whose column
    signs differ -- M_hat = P Q^T does not depend on them; gradcomp: Gram-Schmidt with float64
    sums) and PyTorch keeps the residual in the bucket dtype and for the dense tensors too (local
    minus average, which sums to zero over the ranks);
  - a float64 numpy PowerSGD of the first step (P = M Q summed, QR, Q = M^T P averaged, P Q^T);
  - the per-tensor ``Compressor("powersgd:...")`` against the bucketed hook (with a DDP rebuild):
    bitwise, since each matrix's result depends only on its own M, Q and name;
  - bf16 buckets against the float32 run of the same values: bitwise after one rounding;
  - a NaN step against the same run without that step: bitwise afterwards.
"""

import copy
import math
import os
import pickle
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as pt_psgd  # noqa: E402

import gradcomp.torch as gt  # noqa: E402
from gradcomp import planner  # noqa: E402

from ddp_helpers import Params, Reordered, ddp, grads_for, run  # noqa: E402, F401

SEED = 20261201
# |ours - PyTorch's| <= TOL * max|PyTorch's output of that step|, per tensor: float32 Gram-Schmidt /
# QR rounding (a few float32 ulps, ~1e-7 relative, per orthogonalization) carried through 5
# warm-started steps; measured worst 5.1e-7 (r=1), 6.4e-7 (r=2), 6.9e-7 (r=4), 7.9e-7 (r=2 batched).
# With q_init="philox" (other initial Qs) the same comparison fails by O(1) (test below).
TOL = 1e-5
# matrices (two of the same shape: batched), vectors, a 4-D weight, one too small to compress at r >= 2
SHAPES = [(40, 30), (30,), (40, 30), (24, 3, 3, 5), (24,), (50, 36), (7, 7), (36,)]


def ibits(t):
    return t.detach().contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def same_bits(a, b):
    return torch.equal(ibits(a), ibits(b))


def step(m, gs):
    m.zero_grad()
    m([g.clone() for g in gs]).backward()
    return [p.grad.detach().clone() for p in m.module.parameters()]


# ---------------------------------------------------------------------------------------------
# against PyTorch's hook


def job_vs_pytorch(rank, world, r, batch, start, shapes, q_init="torch"):
    torch.manual_seed(0)
    base = Params(shapes)
    ours, theirs = ddp(copy.deepcopy(base)), ddp(copy.deepcopy(base))
    st = gt.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=start, random_seed=7,
                          batch_tensors_with_same_shape=batch, q_init=q_init, ddp_model=ours)
    ours.register_comm_hook(st, gt.powersgd_hook)
    pst = pt_psgd.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=max(start, 2),
                                random_seed=7, batch_tensors_with_same_shape=batch)
    theirs.register_comm_hook(pst, pt_psgd.powerSGD_hook)
    worst = 0.0
    for s in range(5):
        gs = grads_for(base, rank, s, seed=SEED)
        a, b = step(ours, gs), step(theirs, gs)
        for x, y in zip(a, b):
            scale = max(float(y.abs().max()), 1e-30)
            err = float((x - y).abs().max()) / scale
            worst = max(worst, err)
            assert err <= TOL, (s, x.shape, err)
    assert st.iter == pst.iter == 5
    # PyTorch's element counts of the compressed steps (its compression_stats), exactly
    assert st.compression_stats()[1:] == (pst.total_numel_before_compression, pst.total_numel_after_compression)
    return worst


def job_vs_pytorch_other_q(rank, world):
    try:
        job_vs_pytorch(rank, world, 2, False, 2, SHAPES, q_init="philox")
    except AssertionError:
        return True
    return False


def test_comparison_with_pytorch_can_fail():
    """The same comparison with gradcomp's own initial Qs (Philox) must fail: it is not vacuous."""
    assert run(2, job_vs_pytorch_other_q) == [True, True]


@pytest.mark.parametrize("r,batch", [(1, False), (2, False), (4, False), (2, True)])
def test_matches_pytorch_powersgd_hook(r, batch):
    """5 steps, 2 ranks, error feedback and warm start, start_powerSGD_iter=2 (PyTorch's minimum):
    every gradient within TOL of PyTorch's hook (batch_tensors_with_same_shape=True included)."""
    worst = run(2, job_vs_pytorch, r, batch, 2, SHAPES)
    print(f"r={r} batch={batch}: worst relative difference {max(worst):.2e}")


def job_numpy_first_step(rank, world, r):
    """One compressed step (start 0) against a float64 numpy PowerSGD from the same initial Q."""
    shapes = [(40, 30), (30,), (24, 3, 3, 5)]
    torch.manual_seed(0)
    m = ddp(Params(shapes))
    st = gt.PowerSGDState(None, matrix_approximation_rank=r, start_powerSGD_iter=0, random_seed=3, ddp_model=m)
    m.register_comm_hook(st, gt.powersgd_hook)
    gs = grads_for(m.module, rank, 0, seed=SEED)
    out = step(m, gs)
    alls = [None] * world
    dist.all_gather_object(alls, [g.double().numpy() for g in gs])
    # the initial Q of each matrix: the documented Philox draw (tested in test_lowrank.py)
    import zlib

    from gradcomp import lowrank
    for i, shape in enumerate(shapes):
        Ms = [a[i] for a in alls]
        if len(shape) < 2:
            assert np.array_equal(out[i].numpy(), (sum(torch.from_numpy(x).float() for x in Ms) / world).numpy())
            continue
        n = shape[0]
        mcols = int(np.prod(shape[1:]))
        q0 = torch.empty(mcols, r)
        lowrank.random_normal(q0, 3, (zlib.crc32(f"ps.{i}".encode()) << 32) | 0)
        Q, _ = np.linalg.qr(q0.double().numpy())
        P = sum(x.reshape(n, mcols) @ Q for x in Ms)
        P, _ = np.linalg.qr(P)
        Qn = sum(x.reshape(n, mcols).T @ P for x in Ms) / world
        ref = (P @ Qn.T).reshape(shape)
        got = out[i].double().numpy()
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 1e-5, (i, err)
        # the residual is this rank's M minus the applied average
        res = st.residual(f"ps.{i}").double().numpy().reshape(shape)
        assert np.abs(res - (alls[rank][i] - got)).max() < 1e-5 * np.abs(alls[rank][i]).max()
    return True


@pytest.mark.parametrize("r", [1, 3])
def test_first_step_against_numpy_float64(r):
    """Relative 1e-5 of the largest output (float32 GEMMs and orthogonalization vs float64)."""
    assert run(2, job_numpy_first_step, r) == [True, True]


# ---------------------------------------------------------------------------------------------
# PyTorch's faults, fixed


def job_faults(rank, world):
    shapes = [(), (20, 30), (20, 30), (30,)]
    torch.manual_seed(0)
    m = ddp(Params(shapes))
    st = gt.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0, orthogonalization_epsilon=0,
                          ddp_model=m)
    m.register_comm_hook(st, gt.powersgd_hook)
    for s in range(3):
        gs = grads_for(m.module, rank, s, seed=SEED)
        gs[1].zero_()  # a layer whose gradient is exactly zero on every rank
        out = step(m, gs)
        assert all(torch.isfinite(g).all() for g in out), s
        assert float(out[1].abs().max()) == 0.0
        alls = [None] * world
        dist.all_gather_object(alls, gs[0])
        assert same_bits(out[0], sum(alls) / world)  # the 0-dim parameter: dense, exact average
    # the zero layer: its Q was redrawn, so it is compressed again as soon as it has a gradient
    gs = grads_for(m.module, rank, 3, seed=SEED)
    out = step(m, gs)
    assert float(out[1].abs().max()) > 0.0
    # PyTorch's hook on the same zero layer (without the 0-dim parameter, on which it crashes): NaN
    m2 = ddp(Params(shapes[1:]))
    pst = pt_psgd.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    m2.register_comm_hook(pst, pt_psgd.powerSGD_hook)
    for s in range(3):
        gs = grads_for(m2.module, rank, s, seed=SEED)
        gs[0].zero_()
        out2 = step(m2, gs)
    return bool(torch.isnan(out2[0]).any())


def test_zero_dim_parameter_and_zero_layer_at_epsilon_0():
    """A 0-dim parameter is averaged exactly; a zero layer gives 0, not NaN (PyTorch's gives NaN),
    and gets compressed again once it has a gradient."""
    assert run(2, job_faults) == [True, True]


def job_batched_start2(rank, world):
    torch.manual_seed(0)
    m = ddp(Params(SHAPES))
    st = gt.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                          batch_tensors_with_same_shape=True, ddp_model=m)
    m.register_comm_hook(st, gt.powersgd_hook)
    outs = []
    for s in range(4):
        gs = grads_for(m.module, rank, s, seed=SEED)
        out = step(m, gs)
        alls = [None] * world
        dist.all_gather_object(alls, gs)
        avg = [sum(a[i] for a in alls) / world for i in range(len(gs))]
        exact = all(same_bits(x, y) for x, y in zip(out, avg))
        assert exact == (s < 2), s  # dense warm-up steps are the exact average, then compressed
        outs.append(out)
    layouts = st.bucket_layouts()
    assert any(cnt == 2 for lay in layouts for (_, _, _, cnt) in lay["groups"])  # the two (40, 30) batched
    gathered = [None] * world
    dist.all_gather_object(gathered, outs)
    for a, b in zip(gathered[0], gathered[1]):
        assert all(same_bits(x, y) for x, y in zip(a, b))  # every rank applies the same bits
    return True


def test_start_iter_2_with_batched_same_shape():
    assert run(2, job_batched_start2) == [True, True]


def job_nan(rank, world, nonfinite):
    torch.manual_seed(0)
    base = Params(SHAPES)
    runs = {}
    for label, steps in (("nan", [0, 1, 2, 3, 4, 5]), ("skip", [0, 1, 2, 4, 5])):
        m = ddp(copy.deepcopy(base))
        st = gt.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0, ddp_model=m,
                              nonfinite=nonfinite)
        m.register_comm_hook(st, gt.powersgd_hook)
        outs = {}
        for s in steps:
            gs = grads_for(base, rank, s, seed=SEED)
            if label == "nan" and s == 3 and rank == 1:
                gs[0][2, 3] = float("nan")
            outs[s] = step(m, gs)
            if label == "nan":
                fin = all(bool(torch.isfinite(g).all()) for g in outs[s])
                assert fin == (s != 3), (s, fin)
        runs[label] = (outs, st)
    (a, sa), (b, sb) = runs["nan"], runs["skip"]
    if nonfinite == "restore":  # the NaN step left residuals and Qs as they were: bitwise the skipping run
        for s in (4, 5):
            assert all(same_bits(x, y) for x, y in zip(a[s], b[s])), s
        for k, v in sa.state_dict()["residuals"].items():
            assert same_bits(v, sb.state_dict()["residuals"][k]), k
    else:  # reset: zero residuals after the NaN step, and finite from then on
        for s in (4, 5):
            assert all(bool(torch.isfinite(g).all()) for g in a[s])
    assert sa.stats()["nonfinite_steps"] == 1 and sa.nonfinite_steps == 1
    return True


@pytest.mark.parametrize("nonfinite", ["restore", "reset"])
def test_nan_on_one_rank_at_step_3_does_not_poison(nonfinite):
    assert run(2, job_nan, nonfinite) == [True, True]


# ---------------------------------------------------------------------------------------------
# layout independence, rebuild, checkpoints


def job_rebuild_vs_compressor(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    base = Reordered().to(dtype)
    m = ddp(copy.deepcopy(base), bucket_cap_mb=0.002)
    st = gt.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0, ddp_model=m,
                          min_compression_rate=1)
    m.register_comm_hook(st, gt.powersgd_hook)
    comp = gt.Compressor("powersgd:rank=2,min_rate=1")
    assert isinstance(comp, gt.PowerSGDCompressor)
    g = torch.Generator().manual_seed(SEED + rank)
    seen = set()
    for s in range(5):
        x = torch.randn(4, 8, generator=g).to(dtype)
        m.zero_grad()
        m(x).square().mean().backward()
        seen.add(tuple(tuple(sorted(n for n, _, _ in lay["compressed"])) for lay in st.bucket_layouts()))
        # the reference: the same local gradients, one tensor at a time
        ref = copy.deepcopy(base)
        ref.load_state_dict(m.module.state_dict())
        ref.zero_grad()
        ref(x).square().mean().backward()
        for (name, p), q in zip(m.module.named_parameters(), ref.parameters()):
            comp.allreduce(q.grad, name).wait()
            assert same_bits(p.grad, q.grad), (s, name)
        comp.end_step()
        for name, _ in m.module.named_parameters():
            r1, r2 = st.residual(name), comp.residual(name)
            assert r1.numel() == r2.numel() and same_bits(r1, r2), (s, name)
    assert len(seen) >= 2  # DDP rebuilt its buckets after the first step
    return True


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bucket_rebuild_matches_per_tensor_compressor(dtype):
    """Bitwise: the DDP hook through a bucket rebuild equals Compressor("powersgd") per tensor."""
    assert run(2, job_rebuild_vs_compressor, dtype) == [True, True]


def job_bf16_vs_f32(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    outs = {}
    for dt in (torch.float32, dtype):
        m = ddp(Params(SHAPES, dtype=dt))
        st = gt.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0, ddp_model=m)
        m.register_comm_hook(st, gt.powersgd_hook)
        res = []
        for s in range(3):
            gs = [g.to(dtype).to(dt) for g in grads_for(m.module, rank, s, seed=SEED)]
            res.append(step(m, gs))
        outs[dt] = (res, st.state_dict()["residuals"])
    for s in range(1):  # the first step: the same float32 input values, one rounding at the end
        for x, y in zip(outs[torch.float32][0][s], outs[dtype][0][s]):
            assert same_bits(x.to(dtype), y), s
    for s in range(3):
        for x, y in zip(outs[torch.float32][0][s], outs[dtype][0][s]):
            assert y.dtype == dtype and bool(torch.isfinite(y).all())
    return True


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_buckets(dtype):
    """16-bit buckets: float32 M, P, Q and residuals; step 1 equals the float32 run rounded once."""
    assert run(2, job_bf16_vs_f32, dtype) == [True, True]


def job_checkpoint(rank, world, tmp):
    torch.manual_seed(0)
    base = Params(SHAPES)
    m1 = ddp(copy.deepcopy(base))
    st1 = gt.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=1, ddp_model=m1)
    m1.register_comm_hook(st1, gt.powersgd_hook)
    for s in range(3):
        step(m1, grads_for(base, rank, s, seed=SEED))
    sd = st1.state_dict()
    # compressed at r = 3: (40, 30) twice, (24, 45), (50, 36); (7, 7) is not ((7 + 7) 3 * 2 >= 49)
    assert sd["iter"] == 3 and set(sd["q"]) == {"ps.0", "ps.2", "ps.3", "ps.5"}
    assert set(sd["residuals"]) == set(sd["q"])
    path = os.path.join(tmp, f"psgd_rank{rank}.pt")
    torch.save({"model": m1.state_dict(), "hook": sd}, path)
    ck = torch.load(path, weights_only=False)
    m2 = ddp(copy.deepcopy(base))
    m2.load_state_dict(ck["model"])
    st2 = gt.PowerSGDState(None, matrix_approximation_rank=3, start_powerSGD_iter=1, ddp_model=m2)
    st2.load_state_dict(ck["hook"])
    m2.register_comm_hook(st2, gt.powersgd_hook)
    # a pickled state, PyTorch's recipe (process group and model not pickled), bound to a third model
    st3 = pickle.loads(pickle.dumps(st1))
    m3 = ddp(copy.deepcopy(base))
    st3.bind(m3)
    m3.register_comm_hook(st3, gt.powersgd_hook)
    for s in range(3, 6):
        gs = grads_for(base, rank, s, seed=SEED)
        a, b, c = step(m1, gs), step(m2, gs), step(m3, gs)
        assert all(same_bits(x, y) and same_bits(x, z) for x, y, z in zip(a, b, c)), s
    for k, v in st1.state_dict()["residuals"].items():
        assert same_bits(v, st2.state_dict()["residuals"][k]) and same_bits(v, st3.state_dict()["residuals"][k])
    # strict checks: another rank's file, other options
    other = dict(sd, rank=1 - rank)
    with pytest.raises(ValueError, match="rank"):
        st2.load_state_dict(other)
    st4 = gt.PowerSGDState(None, matrix_approximation_rank=2, ddp_model=ddp(copy.deepcopy(base)))
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        st4.load_state_dict(sd)
    with pytest.raises(ValueError, match="kind"):
        st4.load_state_dict({"residuals": {}})
    return True


def test_checkpoint_round_trip_bit_exact():
    with tempfile.TemporaryDirectory() as tmp:
        assert run(2, job_checkpoint, tmp) == [True, True]


# ---------------------------------------------------------------------------------------------
# the wire: two collectives per bucket, bytes


def job_collectives(rank, world):
    torch.manual_seed(0)
    m = ddp(Params(SHAPES), bucket_cap_mb=25)
    st = gt.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0, ddp_model=m)
    m.register_comm_hook(st, gt.powersgd_hook)
    calls = []
    real = dist.all_reduce

    def counting(t, *a, **k):
        calls.append(t.numel())
        return real(t, *a, **k)

    dist.all_reduce = counting
    try:
        step(m, grads_for(m.module, rank, 0, seed=SEED))
    finally:
        dist.all_reduce = real
    lay = st.bucket_layouts()
    assert len(lay) == 1
    # the planner's decision, re-derived here: dense = 1-D tensors and (7, 7) at rank 2
    dense = sum(int(np.prod(s)) for s in SHAPES if len(s) < 2 or s == (7, 7))
    comp = [s for s in SHAPES if len(s) >= 2 and s != (7, 7)]
    p = sum(s[0] * 2 for s in comp)
    q = sum(int(np.prod(s[1:])) * 2 for s in comp)
    assert calls == [dense + p, q], calls
    b = st.stats()["buckets"][0]
    assert b["scheme"] == "powersgd" and b["packet_bytes"] == 4 * (dense + p + q)
    ring = lambda x: 2.0 * (world - 1) / world * x  # noqa: E731
    assert b["sent_bytes"] == ring(4 * (dense + p)) + ring(4 * q)
    numel = sum(int(np.prod(s)) for s in SHAPES)
    assert b["dense_bytes"] == 4 * numel
    rate, before, after = st.compression_stats()
    assert before == numel and after == dense + p + q and rate == before / after
    return True


def test_two_collectives_per_bucket_and_bytes():
    assert run(2, job_collectives) == [True, True]


def test_powersgd_rank_rule():
    """The planner's compress rule is PyTorch's _should_compress (plus < 2 dims and min_numel)."""
    for shape in [(40, 30), (7, 7), (3, 100), (100, 3), (1, 50), (50, 1), (5, 5, 5), (8,), ()]:
        for r in (1, 2, 4, 8):
            n = shape[0] if shape else 1
            mm = int(np.prod(shape)) // n if shape else 1
            rr = min(n, mm, r)
            want = rr if len(shape) >= 2 and pt_psgd._should_compress(n, mm, rr, 2)[0] else 0
            assert planner.powersgd_rank(shape, r) == want, (shape, r)
    with pytest.raises(ValueError, match="rank=0"):
        planner.powersgd_rank((4, 4), 0)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="matrix_approximation_rank=0"):
        gt.powersgd._check(rank=0, min_compression_rate=2, use_error_feedback=True, warm_start=True,
                           orthogonalization_epsilon=0, random_seed=0, nonfinite="restore", q_init="philox",
                           min_compress_numel=0, log_every=0)
    with pytest.raises(ValueError, match="orthogonalization_epsilon=-1"):
        gt.powersgd._check(rank=1, min_compression_rate=2, use_error_feedback=True, warm_start=True,
                           orthogonalization_epsilon=-1, random_seed=0, nonfinite="restore", q_init="philox",
                           min_compress_numel=0, log_every=0)
    with pytest.raises(ValueError, match="q_init='numpy'"):
        gt.powersgd._check(rank=1, min_compression_rate=2, use_error_feedback=True, warm_start=True,
                           orthogonalization_epsilon=0, random_seed=0, nonfinite="restore", q_init="numpy",
                           min_compress_numel=0, log_every=0)
    with pytest.raises(ValueError, match="accepted keys: rank"):
        gt.powersgd._parse_spec("powersgd:ratio=2")
    with pytest.raises(ValueError, match="rank='x'"):
        gt.powersgd._parse_spec("powersgd:rank=x")


def job_join(rank, world):
    """Uneven inputs under ddp.join(): the joined rank sends zeros and keeps its residuals and Q;
    the other rank's steps equal a PowerSGD average of (its M + 0) / 2 (checked against a second
    run where rank 0 sends exact zero gradients instead of joining)."""
    torch.manual_seed(0)
    base = Params([(30, 20), (20,)])
    outs = {}
    for label in ("join", "zeros"):
        m = ddp(copy.deepcopy(base))
        st = gt.PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=0, ddp_model=m)
        m.register_comm_hook(st, gt.powersgd_hook)
        res = []
        with m.join(enable=(label == "join")):
            for s in range(2 if (rank == 0 and label == "join") else 4):
                gs = grads_for(base, rank, s, seed=SEED)
                if rank == 0 and s >= 2:
                    gs = [torch.zeros_like(g) for g in gs]
                res.append(step(m, gs))
                if rank == 0 and s == 1:
                    kept = st.state_dict()
        outs[label] = (res, st)
    (a, sa), (b, sb) = outs["join"], outs["zeros"]
    if rank == 1:  # the same averages whether rank 0 joined or sent zeros (its residual is not added)
        for s in (0, 1):
            assert all(same_bits(x, y) for x, y in zip(a[s], b[s])), s
        for s in (2, 3):
            assert all(bool(torch.isfinite(x).all()) for x in a[s])
    else:  # the joined rank kept its residuals and Qs from its last step
        after = sa.state_dict()
        for k in kept["residuals"]:
            assert same_bits(kept["residuals"][k], after["residuals"][k]), k
        assert sa.iter == 4
    return True


def test_join_uneven_inputs():
    assert run(2, job_join) == [True, True]
