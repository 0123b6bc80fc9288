"""FSDP2 (``fully_shard``) with gradcomp's compressed reduce-scatter (gradcomp.torch.fsdp), on real gloo
process groups (2 and 3 CPU ranks: the session's pools, gloo_pools.py) and real ``fully_shard`` on a CPU
mesh. The assertions on what the ranks computed run in this process against references written here.

References, independent of the code under test:
  - FSDP2 itself: the same model trained without gradcomp (FSDP2's own reduce-scatter over gloo);
  - :func:`simulate`, a numpy simulation of the protocol (docs/contracts.md, section 5.1): FSDP2's
    torch.chunk sharding (c = ceil(rows / W) rows per rank, padded), the rows' compressed segments
    encoded one packet per row with the sender's residual, the receiver's rank-order float32 sums from
    +0.0, AVG as one division by W, exempt parameters summed raw. It calls ``gradcomp.Codec`` only to
    encode and decode one packet (the codecs have their own tests against numpy / ml_dtypes).

Which comparisons are bitwise (floats as integer views):
  - codec none vs FSDP2: every gradient shard at W = 2 (the sum of two terms does not depend on the
    order), float32 and bfloat16 reduce dtype, a real MLP's gradients; at W = 3, gradients whose sums are
    exact (multiples of 2^-3 below 2^5), so gloo's ring order and gradcomp's rank order agree; with real
    gradients at W = 3 gradcomp equals the rank-order simulation bitwise and FSDP2 within the rounding
    of the two additions (gloo adds in ring order: a different float32 sum, not a worse one);
  - fp8, int8, top-k, onebit: every rank's shard and residuals vs the simulation over 3 steps; the
    error-feedback identity g + r_old == D + r_new per element; exempt parameters equal the float32
    rank-order average of their raw gradients.
"""

import math
import os
import tempfile
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import gradcomp  # noqa: E402
import gradcomp.torch as gt  # noqa: E402

fsdp = pytest.importorskip("gradcomp.torch.fsdp")
if gradcomp.torch.fsdp.torch_version() < (2, 9):  # pragma: no cover - the pinned torch is 2.15
    pytest.skip("FSDP2's comm API needs torch >= 2.9", allow_module_level=True)

from ddp_helpers import run  # noqa: E402

SEED = 20261203
STEPS = 3

# unit "a": a compressed matrix, a 1-D (exempt), a (1, 1500) matrix (fewer rows than ranks: empty shards);
# unit "b": an odd-sized matrix, a matrix below min_compress_numel (exempt), one element (fewer than W: empty
# shards); the root: a vector (exempt)
SHAPES_A = [(40, 30), (7,), (1, 1500)]
SHAPES_B = [(5, 301), (3, 100), (1,)]
SHAPE_ROOT = (5,)


class Params(nn.Module):
    """Parameters of given shapes; forward(gs) = sum_i (p_i * g_i).sum(), so p_i's gradient is g_i."""

    def __init__(self, shapes):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, gs):
        return sum((p * g).sum() for p, g in zip(self.ps, gs))


class Net(nn.Module):
    """Two Params units and a root parameter: three FSDP units."""

    def __init__(self, a=SHAPES_A, b=SHAPES_B, root=SHAPE_ROOT):
        super().__init__()
        self.a = Params(a)
        self.b = Params(b)
        self.c = nn.Parameter(torch.zeros(root))

    def forward(self, gs):
        na = len(self.a.ps)
        nb = len(self.b.ps)
        return self.a(gs[:na]) + self.b(gs[na: na + nb]) + (self.c * gs[na + nb]).sum()


def names_shapes(a=SHAPES_A, b=SHAPES_B, root=SHAPE_ROOT):
    return ([(f"a.ps.{i}", s) for i, s in enumerate(a)] + [(f"b.ps.{i}", s) for i, s in enumerate(b)]
            + [("c", root)])


def units(a=SHAPES_A, b=SHAPES_B, root=SHAPE_ROOT):
    """The FSDP units in the order FSDP2 reduces them does not matter here: each unit is its own call."""
    ns = names_shapes(a, b, root)
    return [ns[:len(a)], ns[len(a): len(a) + len(b)], ns[len(a) + len(b):]]


def grad_of(name, shape, rank, step, kind="randn"):
    """Rank ``rank``'s gradient of ``name`` at ``step`` (float32 numpy), the same in the ranks and here."""
    g = np.random.default_rng([SEED, rank, step, sum(map(ord, name))])
    if kind == "dyadic":  # multiples of 2^-3 in [-8, 8]: sums of up to 4 of them are exact in float32 and bfloat16
        return (g.integers(-64, 65, size=shape) / 8.0).astype(np.float32)
    x = g.standard_normal(shape).astype(np.float32)
    return (x * np.float32(2.0) ** g.integers(-3, 4)).astype(np.float32)


def build(world, kind="net", mp=None, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    pol = {} if mp is None else {"mp_policy": MixedPrecisionPolicy(reduce_dtype=getattr(torch, mp))}
    if kind == "net":
        m = Net(**kw)
        fully_shard(m.a, mesh=mesh, **pol)
        fully_shard(m.b, mesh=mesh, **pol)
    else:  # a small MLP with real gradients: Linear(5, 7), LayerNorm, Linear(7, 1) (one row: empty shards), Linear(1, 33)
        m = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 1), nn.Linear(1, 33))
        for i in (0, 2, 3):
            fully_shard(m[i], mesh=mesh, **pol)
    fully_shard(m, mesh=mesh, **pol)
    return m


def step_net(m, rank, step, grad_kind="randn"):
    gs = [torch.from_numpy(grad_of(n, s, rank, step, grad_kind)) for n, s in names_shapes()]
    m(gs).backward()


def step_mlp(m, rank, step):
    g = torch.Generator().manual_seed(SEED + 7 * step + rank)
    x = torch.randn(4, 5, generator=g) * 3
    m(x).pow(2).sum().backward()


def shards(m):
    return {n: p.grad.to_local().detach().float().reshape(-1).clone().numpy() for n, p in m.named_parameters()}


def job_parity(rank, world, spec, kind, grad_kind, mp, opts):
    """Train without gradcomp, then the same with gradcomp: both runs' shards per step."""
    out = []
    for with_gc in (False, True):
        m = build(world, kind, mp)
        state = fsdp.register(m, spec, **opts) if with_gc else None
        got = []
        for step in range(STEPS):
            m.zero_grad()
            if kind == "net":
                step_net(m, rank, step, grad_kind)
            else:
                step_mlp(m, rank, step)
            got.append(shards(m))
        out.append(got)
        if state is not None:
            out.append(state.stats())
    return out


def assert_bits(a, b, what):
    a = np.asarray(a)
    b = np.asarray(b)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    ai = a.view(np.int32) if a.dtype == np.float32 else a
    bi = b.view(np.int32) if b.dtype == np.float32 else b
    bad = np.flatnonzero(ai != bi)
    assert bad.size == 0, (f"{what}: {bad.size} of {a.size} elements differ, first at {bad[0]}: {a.flat[bad[0]]!r} vs "
                           f"{b.flat[bad[0]]!r} (seed {SEED})")


@pytest.mark.parametrize("mp", [None, "bfloat16"])
@pytest.mark.parametrize("opts", [{}, {"min_compress_numel": 0, "exempt": []}], ids=["default-exempt", "all-compressed"])
def test_codec_none_bitwise_equal_to_fsdp2_w2(mp, opts):
    """W = 2: real MLP gradients and the Params net (empty shards, odd sizes): bitwise equal to FSDP2."""
    for kind in ("mlp", "net"):
        res = run(2, job_parity, "none", kind, "randn", mp, opts)
        for rank, (plain, gc, st) in enumerate(res):
            for step in range(STEPS):
                for n in plain[step]:
                    assert_bits(gc[step][n], plain[step][n], f"{kind} rank {rank} step {step} {n} reduce {mp}")
            assert st["steps"] == STEPS and st["reduce_scatter"]["total"]["sent_bytes"] > 0


@pytest.mark.parametrize("world", [3])
@pytest.mark.parametrize("mp", [None, "bfloat16"])
def test_codec_none_bitwise_equal_to_fsdp2_exact_sums(world, mp):
    """W = 3, gradients whose sums are exact in any order: bitwise equal to FSDP2 on every rank, every
    parameter compressed or exempt."""
    for opts in ({}, {"min_compress_numel": 0, "exempt": []}):
        res = run(world, job_parity, "none", "net", "dyadic", mp, opts)
        for rank, (plain, gc, _) in enumerate(res):
            for step in range(STEPS):
                for n in plain[step]:
                    assert_bits(gc[step][n], plain[step][n], f"rank {rank} step {step} {n} reduce {mp} {opts}")


@pytest.mark.parametrize("world", [3])
def test_codec_none_w3_real_gradients(world):
    """W = 3, real MLP gradients: gradcomp equals the rank-order float32 average of the ranks' raw
    gradient shards bitwise; FSDP2 (gloo's ring order) within the rounding of its two additions."""
    res = run(world, job_raw_and_parity, "mlp")
    for rank in range(world):
        plain, gc, raw = res[rank]
        for step in range(STEPS):
            for n in plain[step]:
                # rank-order sum from +0.0, then / W, in float32: computed here from every rank's raw shard
                acc = np.zeros_like(res[0][2][step][n][rank])
                for s in range(world):
                    acc = (acc + res[s][2][step][n][rank]).astype(np.float32)
                want = (acc / np.float32(world)).astype(np.float32)
                assert_bits(gc[step][n], want, f"rank {rank} step {step} {n}")
                # any order of three float32 additions is within 2 units of roundoff of the exact sum
                mag = sum(np.abs(res[s][2][step][n][rank].astype(np.float64)) for s in range(world)) / world
                assert np.all(np.abs(plain[step][n] - gc[step][n]) <= 2 * 2.0 ** -24 * 2 * mag + 1e-45), n


def job_raw_and_parity(rank, world, kind):
    """FSDP2 and gradcomp codec none on the MLP, plus every rank's raw gradients cut into the W row pieces
    FSDP2 reduces (torch.chunk rows), from the same MLP without FSDP (fully_shard does not change the
    parameters' values, so the unsharded gradients are the plain model's)."""
    plain, gc, _ = job_parity(rank, world, "none", kind, "randn", None, {})
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 1), nn.Linear(1, 33))
    raw = []
    for step in range(STEPS):
        ref.zero_grad()
        step_mlp(ref, rank, step)
        got = {}
        for n, p in ref.named_parameters():
            g = p.grad.detach()
            c = -(-g.shape[0] // world)
            got[n] = [g[j * c: (j + 1) * c].reshape(-1).clone().numpy() for j in range(world)]
        raw.append(got)
    return plain, gc, raw


# ---------------------------------------------------------------------------------------------
# the numpy simulation of the protocol

def shard_rows(numel, dim0, W, j):
    """(count, padded) of rank j's shard: torch.chunk rows, c = ceil(dim0 / W) per rank."""
    per_row = numel // dim0
    c = -(-dim0 // W)
    rows = max(0, min(c, dim0 - j * c))
    return rows * per_row, c * per_row


def is_exempt(shape, min_numel=1024):
    return len(shape) < 2 or int(np.prod(shape)) < min_numel


def simulate(spec, W, steps, grad_kind="randn", alpha=1.0, divide=True, min_numel=1024, accumulate=1):
    """Per step and rank: ``{fqn: shard float32}`` and ``{fqn: residual float32 (the parameter's numel)}``.
    ``alpha``: every contribution times alpha (PREMUL_SUM); ``divide``: AVG (/ W) after the sum.
    ``accumulate``: micro-batches per step (their gradients summed in float32 in order, as FSDP2's
    unsharded accumulation does)."""
    codec = gradcomp.Codec(spec)
    res = [{n: np.zeros(int(np.prod(s)), np.float32) for n, s in names_shapes() if not is_exempt(s, min_numel)}
           for _ in range(W)]
    out = []
    for step in range(steps):
        g = []
        for s in range(W):
            gs = {}
            for n, shp in names_shapes():
                acc = None
                for mb in range(accumulate):
                    x = grad_of(n, shp, s, step * accumulate + mb, grad_kind).reshape(-1)
                    acc = x if acc is None else (acc + x).astype(np.float32)
                gs[n] = acc
            g.append(gs)
        shards_out = [dict() for _ in range(W)]
        for unit in units():
            comp = [(n, shp) for n, shp in unit if not is_exempt(shp, min_numel)]
            ex = [(n, shp) for n, shp in unit if is_exempt(shp, min_numel)]
            # every sender encodes row j (its compressed pieces of shard j, concatenated)
            decoded = [[None] * W for _ in range(W)]
            for s in range(W):
                for j in range(W):
                    pieces = []
                    for n, shp in comp:
                        cnt, pad = shard_rows(int(np.prod(shp)), shp[0], W, j)
                        pieces.append((n, j * pad, cnt))
                    total = sum(c for _, _, c in pieces)
                    if not total:
                        continue
                    x = np.concatenate([g[s][n][a: a + c] for n, a, c in pieces]).astype(np.float32)
                    r = torch.from_numpy(np.concatenate([res[s][n][a: a + c] for n, a, c in pieces]).copy())
                    pk = codec.encode(torch.from_numpy(x), residual=r)
                    decoded[s][j] = codec.decode(pk, numel=total, dtype=torch.float32).numpy()
                    at = 0
                    for n, a, c in pieces:
                        res[s][n][a: a + c] = r.numpy()[at: at + c]
                        at += c
            for j in range(W):
                pieces = []
                for n, shp in comp:
                    cnt, pad = shard_rows(int(np.prod(shp)), shp[0], W, j)
                    pieces.append((n, cnt))
                total = sum(c for _, c in pieces)
                acc = np.zeros(total, np.float32)
                for s in range(W):
                    if total:
                        acc = (acc + (decoded[s][j] * np.float32(alpha)).astype(np.float32)).astype(np.float32)
                if divide:
                    acc = (acc / np.float32(W)).astype(np.float32)
                at = 0
                for n, c in pieces:
                    shards_out[j][n] = acc[at: at + c]
                    at += c
                for n, shp in ex:
                    cnt, pad = shard_rows(int(np.prod(shp)), shp[0] if shp else 1, W, j)
                    acc_e = np.zeros(cnt, np.float32)
                    for s in range(W):
                        acc_e = (acc_e + (g[s][n][j * pad: j * pad + cnt] * np.float32(alpha)).astype(np.float32)
                                 ).astype(np.float32)
                    if divide:
                        acc_e = (acc_e / np.float32(W)).astype(np.float32)
                    shards_out[j][n] = acc_e
        out.append((shards_out, [{k: v.copy() for k, v in r.items()} for r in res], g))
    return out


def job_codec(rank, world, spec, opts, grad_kind="randn"):
    m = build(world)
    state = fsdp.register(m, spec, **opts)
    got = []
    for step in range(STEPS):
        m.zero_grad()
        step_net(m, rank, step, grad_kind)
        res = {}
        for n, s in names_shapes():
            try:
                res[n] = state.residual(n).numpy()
            except KeyError:
                pass
        got.append((shards(m), res))
    return got, state.stats(), state.reduce_scatter.exempted()


LOSSY = ["fp8", "int8", "topk:ratio=0.1", "onebit"]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("spec", LOSSY)
def test_lossy_codecs_match_the_simulation(world, spec):
    res = run(world, job_codec, spec, {})
    sim = simulate(spec, world, STEPS)
    comp_names = [n for n, s in names_shapes() if not is_exempt(s)]
    for rank, (got, st, exempted) in enumerate(res):
        assert exempted == sorted(n for n, s in names_shapes() if is_exempt(s))
        for step in range(STEPS):
            sh, r = got[step]
            want_sh, want_r, g = sim[step]
            for n, _ in names_shapes():
                assert_bits(sh[n], want_sh[rank][n], f"{spec} W={world} rank {rank} step {step} shard of {n}")
            assert sorted(r) == sorted(comp_names)
            for n in comp_names:
                assert_bits(r[n], want_r[rank][n], f"{spec} W={world} rank {rank} step {step} residual of {n}")
        assert st["steps"] == STEPS and st["reduce_scatter"]["nonfinite_steps"] == 0


@pytest.mark.parametrize("spec", ["fp8", "int8"])
def test_error_feedback_identity_and_exempt_exact(spec):
    """g + r_old == D + r_new per element (exact_residual codecs) with D = x' - r_new what was sent, from
    the residuals the ranks report (the simulation checks the decoded rows bitwise); exempt parameters are
    the exact float32 average of the two ranks' raw gradients."""
    world = 2
    res = run(world, job_codec, spec, {})
    sim = simulate(spec, world, STEPS)
    codec = gradcomp.Codec(spec)
    assert codec.properties["exact_residual"]
    for rank in range(world):
        r_old = {n: np.zeros(int(np.prod(s)), np.float32) for n, s in names_shapes() if not is_exempt(s)}
        for step in range(STEPS):
            _, r_new = res[rank][0][step]
            g = sim[step][2][rank]
            for n in r_old:
                xp = (g[n] + r_old[n]).astype(np.float32)
                d = (xp - r_new[n]).astype(np.float32)  # what was sent: x' - r_new, exact for exact_residual codecs
                assert np.array_equal((d + r_new[n]).astype(np.float32), xp), n
                assert np.count_nonzero(r_new[n]) > 0, n  # the codec dropped something, kept here
            r_old = {n: r_new[n].copy() for n in r_old}
            sh = res[rank][0][step][0]
            for n, s in names_shapes():
                if is_exempt(s):
                    cnt, pad = shard_rows(int(np.prod(s)), s[0] if s else 1, world, rank)
                    want = ((sim[step][2][0][n][rank * pad: rank * pad + cnt]
                             + sim[step][2][1][n][rank * pad: rank * pad + cnt]).astype(np.float32) / np.float32(2))
                    assert_bits(sh[n], want.astype(np.float32), f"exempt {n}")


# ---------------------------------------------------------------------------------------------
# ops, accumulation, world size 1


def job_ops(rank, world, spec, how):
    m = build(world)
    for mod in (m, m.a, m.b):  # both setters act on one module's parameter group
        if how == "premul":
            mod.set_gradient_divide_factor(5.0)  # PREMUL_SUM(1/5) for float32
        elif how == "sum":
            mod.set_force_sum_reduction_for_comms(True)  # SUM, then FSDP's own post-divide by W
    ops = []
    state = fsdp.register(m, spec)
    inner = state.reduce_scatter.__class__.__call__

    def spy(self, output_tensor, input_tensor, group, op, async_op=False):
        ops.append(str(getattr(op, "op", op)))
        return inner(self, output_tensor, input_tensor, group, op, async_op)

    state.reduce_scatter.__class__ = type("Spy", (state.reduce_scatter.__class__,), {"__call__": spy})
    got = []
    for step in range(STEPS):
        m.zero_grad()
        step_net(m, rank, step)
        got.append(shards(m))
    return got, sorted(set(ops))


@pytest.mark.parametrize("how", ["premul", "sum"])
def test_ops_premul_sum_and_sum(how):
    """PREMUL_SUM(1/f) (set_gradient_divide_factor: each contribution times fl32(1/f), then the sum) and
    SUM (force-sum: the sum, FSDP2 divides by W afterwards in float32) against the simulation; gloo's own
    reduce-scatter cannot run PREMUL_SUM at all."""
    world = 2
    res = run(world, job_ops, "int8", how)
    if how == "premul":
        sim = simulate("int8", world, STEPS, alpha=float(np.float32(1 / 5.0)), divide=False)
    else:
        sim = simulate("int8", world, STEPS, divide=False)
    for rank, (got, ops) in enumerate(res):
        assert ops == (["RedOpType.PREMUL_SUM"] if how == "premul" else ["RedOpType.SUM"]), ops
        for step in range(STEPS):
            for n, _ in names_shapes():
                want = sim[step][0][rank][n]
                if how == "sum":
                    want = (want / np.float32(world)).astype(np.float32)  # FSDP2's post-divide (_div_if_needed)
                assert_bits(got[step][n], want, f"{how} rank {rank} step {step} {n}")


def job_accumulate(rank, world, spec):
    """4 micro-batches per step, gradient sync only on the last: the reduce-scatter runs once per step."""
    m = build(world)
    state = fsdp.register(m, spec)
    got = []
    calls = []
    for step in range(2):
        m.zero_grad()
        for mb in range(4):
            m.set_requires_gradient_sync(mb == 3)
            gs = [torch.from_numpy(grad_of(n, s, rank, step * 4 + mb)) for n, s in names_shapes()]
            before = {n: state.residual(n).clone() for n, s in names_shapes() if step and not is_exempt(s)}
            m(gs).backward()
            if mb < 3:  # nothing compressed, no residual changed
                for n, t in before.items():
                    assert torch.equal(t, state.residual(n)), n
            calls.append(len(state.reduce_scatter.stats()["buckets"]) if state.iter == step else -1)
        res = {n: state.residual(n).numpy() for n, s in names_shapes() if not is_exempt(s)}
        got.append((shards(m), res))
    return got, state.stats()["steps"]


def test_gradient_accumulation_no_sync_micro_batches():
    world = 2
    res = run(world, job_accumulate, "fp8")
    sim = simulate("fp8", world, 2, accumulate=4)
    for rank, (got, steps) in enumerate(res):
        assert steps == 2
        for step in range(2):
            for n, _ in names_shapes():
                assert_bits(got[step][0][n], sim[step][0][rank][n], f"rank {rank} step {step} {n}")
            for n, r in got[step][1].items():
                assert_bits(r, sim[step][1][rank][n], f"residual rank {rank} step {step} {n}")


def job_world1(rank, world):
    """A mesh of one rank per process: FSDP2 bypasses the comm; register works and sends nothing."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    groups = [dist.new_group([r]) for r in range(world)]
    mesh = DeviceMesh.from_group(groups[rank], "cpu")
    torch.manual_seed(0)
    m = Net()
    fully_shard(m.a, mesh=mesh)
    fully_shard(m.b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    state = fsdp.register(m, "fp8")
    step_net(m, rank, 0)
    return shards(m), state.stats()


def test_world_size_one():
    for rank, (sh, st) in enumerate(run(2, job_world1)):
        for n, s in names_shapes():
            assert_bits(sh[n], grad_of(n, s, rank, 0).reshape(-1), n)
        assert st["steps"] == 0 and st["reduce_scatter"]["buckets"] == []


# ---------------------------------------------------------------------------------------------
# non-finite steps, ranks that disagree


def job_nonfinite(rank, world, spec, mode):
    m = build(world)
    state = fsdp.register(m, spec, nonfinite=mode)
    before = None
    out = []
    for step in range(3):
        m.zero_grad()
        gs = [torch.from_numpy(grad_of(n, s, rank, step)) for n, s in names_shapes()]
        if step == 1 and rank == 0:
            gs[0][3, 4] = float("nan")  # one rank, one element of unit "a"
        if step == 1:
            before = {n: state.residual(n).clone() for n, s in names_shapes() if not is_exempt(s)}
        m(gs).backward()
        out.append({n: state.residual(n).clone() for n, s in names_shapes() if not is_exempt(s)})
    st = state.stats()
    return before, out, st["reduce_scatter"]["nonfinite_steps"], shards(m)


@pytest.mark.parametrize("mode", ["restore", "reset"])
def test_nonfinite_step_restores_or_resets_on_every_rank(mode):
    world = 2
    for rank, (before, out, nfs, _) in enumerate(run(world, job_nonfinite, "int8", mode)):
        assert nfs == 1, (rank, nfs)
        for n in before:
            if n.startswith("a."):  # the unit that saw the NaN (on rank 0 only): every rank
                if mode == "restore":
                    assert torch.equal(out[1][n], before[n]), (rank, n)
                else:
                    assert not out[1][n].any(), (rank, n)
            else:  # other units were finite: their residuals moved on
                assert not torch.equal(out[1][n], before[n]), (rank, n)
            assert torch.isfinite(out[2][n]).all()


def job_mismatch(rank, world):
    m = build(world)
    fsdp.register(m, "fp8" if rank == 0 else "int8")
    try:
        step_net(m, rank, 0)
    except Exception as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e)
    return None, ""


def test_ranks_with_different_codecs_fail_on_every_rank():
    for rank, (kind, msg) in enumerate(run(2, job_mismatch)):
        assert kind is not None, f"rank {rank} did not fail"
        assert "ranks disagree" in msg and "codec" in msg and "reduce-scatter" in msg, msg


# ---------------------------------------------------------------------------------------------
# errors


def job_errors(rank, world):
    from torch.distributed.fsdp import fully_shard

    errs = {}
    m = build(world)
    try:
        gt.register(m, codec="fp8")
    except TypeError as e:
        errs["ddp_register"] = str(e)
    try:
        fsdp.register(nn.Linear(2, 2), "fp8")
    except TypeError as e:
        errs["not_fsdp"] = str(e)
    try:
        fsdp.register(m, "fp8", reduce_scatter=False)
    except ValueError as e:
        errs["nothing"] = str(e)
    m2 = build(world)
    m2.a.set_allocate_memory_from_process_group_for_comm(True)
    try:
        fsdp.register(m2, "fp8")
    except ValueError as e:
        errs["pg_alloc"] = str(e)
    comm = fsdp.CompressedReduceScatter("fp8")
    try:
        comm(torch.zeros(2), torch.zeros(4), None, dist.ReduceOp.SUM, async_op=True)
    except ValueError as e:
        errs["async"] = str(e)
    m3 = build(world)
    m3.a.set_custom_reduce_scatter(comm)  # not installed: FSDP calls it without the layout
    fsdp._current.unit = None
    try:
        step_net(m3, rank, 0)
    except RuntimeError as e:
        errs["uninstalled"] = str(e)
    del fully_shard
    return errs


def test_errors_name_what_is_accepted():
    errs = run(2, job_errors)[0]
    assert "gradcomp.torch.fsdp.register" in errs["ddp_register"]
    assert "fully_shard" in errs["not_fsdp"] and "Linear" in errs["not_fsdp"]
    assert "nothing to install" in errs["nothing"]
    assert "ProcessGroupAllocReduceScatter" in errs["pg_alloc"] and "set_allocate_memory_from_process_group" in errs["pg_alloc"]
    assert "async_op=False" in errs["async"]
    assert ".install(module)" in errs["uninstalled"]


def test_torch_version_and_ops_checks():
    with pytest.raises(RuntimeError, match=r"torch >= 2\.9.*this is torch 2\.8\.1"):
        fsdp.check_torch("2.8.1")
    fsdp.check_torch("2.9.0")
    fsdp.check_torch("2.15.0+cu130")
    from gradcomp.schemes.reduce_scatter import op_parts

    assert op_parts(dist.ReduceOp.SUM, 4) == (1.0, None, "SUM")
    assert op_parts(dist.ReduceOp.AVG, 4) == (1.0, 4, "AVG")
    assert op_parts(dist.ReduceOp.PREMUL_SUM(0.25), 4) == (0.25, None, "PREMUL_SUM")
    with pytest.raises(ValueError, match="accepted: ReduceOp.SUM, ReduceOp.AVG"):
        op_parts(dist.ReduceOp.MAX, 4)
    with pytest.raises(TypeError, match="exempt"):
        fsdp._Exempt("norm", 0)


def test_several_parameter_groups_are_refused():
    """A module with two FSDP parameter groups (per-parameter meshes): the check FSDP2's own
    set_custom_reduce_scatter makes, with gradcomp's message (a stand-in module: no public torch API
    builds one on a CPU mesh)."""

    class State:
        _fsdp_param_groups = [object(), object()]

    class Two:
        def _get_fsdp_state(self):
            return State()

    with pytest.raises(ValueError, match="2 FSDP parameter groups.*supported: one parameter group"):
        fsdp._unit_of(Two(), "blocks.0")


# ---------------------------------------------------------------------------------------------
# custom HSDP: 4 ranks as 2 replicas x 2 shards


def hsdp_groups(rank, world, shard):
    """Shard groups of ``shard`` consecutive ranks (a node), replicate groups of the ranks with the same
    position in their node; every rank creates every group in the same order."""
    shard_groups = [dist.new_group(list(range(n * shard, (n + 1) * shard))) for n in range(world // shard)]
    rep_groups = [dist.new_group(list(range(j, world, shard))) for j in range(shard)]
    return shard_groups[rank // shard], rep_groups[rank % shard]


def job_hsdp(rank, world, spec, compress_rs, steps=2):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    shard_pg, rep_pg = hsdp_groups(rank, world, 2)
    mesh = DeviceMesh.from_group(shard_pg, "cpu")
    torch.manual_seed(0)
    m = Net()
    fully_shard(m.a, mesh=mesh)
    fully_shard(m.b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    state = fsdp.register(m, spec, reduce_scatter=compress_rs, replicate_group=rep_pg)
    got = []
    for step in range(steps):
        m.zero_grad()
        step_net(m, rank, step)
        got.append(shards(m))
    sd = state.state_dict()
    j = dist.get_rank(shard_pg)
    rep = {n: state.residual(n, level="replica").numpy() for n, s in names_shapes()
           if not is_exempt(s) and shard_rows(int(np.prod(s)), s[0], 2, j)[0]}
    # round trip: a new model and state on the same groups load this rank's state bit for bit
    torch.manual_seed(0)
    m2 = Net()
    fully_shard(m2.a, mesh=mesh)
    fully_shard(m2.b, mesh=mesh)
    fully_shard(m2, mesh=mesh)
    st2 = fsdp.register(m2, spec, reduce_scatter=compress_rs, replicate_group=rep_pg)
    st2.load_state_dict(sd)
    rep2 = {n: st2.residual(n, level="replica").numpy() for n in rep}
    return got, rep, rep2, state.stats(), st2.iter


def node_average(n, shp, node, step, shard=2):
    """What FSDP2's own reduce-scatter leaves on the node's ranks: the float32 (a + b) / 2 of its two ranks'
    gradients (gloo: the sum, then / 2), whole parameter."""
    a = grad_of(n, shp, node * shard, step).reshape(-1)
    b = grad_of(n, shp, node * shard + 1, step).reshape(-1)
    return ((a + b).astype(np.float32) / np.float32(2)).astype(np.float32)


@pytest.mark.parametrize("world", [4])
def test_custom_hsdp_codec_none_equals_the_average(world):
    """Codec none across replicas (FSDP2's reduce-scatter inside the node): every shard within one
    float32 rounding per operation of the float64 average of the 4 ranks' gradients."""
    res = run(world, job_hsdp, "none", False)
    for rank, (got, _, _, st, _) in enumerate(res):
        j = rank % 2
        assert st["replicas"] == 2 and st["world_size"] == 2 and st["reduce_scatter"] is None
        assert st["replica"]["total"]["sent_bytes"] > 0
        for step in range(2):
            for n, shp in names_shapes():
                cnt, pad = shard_rows(int(np.prod(shp)), shp[0], 2, j)
                xs = [grad_of(n, shp, r, step).reshape(-1)[j * pad: j * pad + cnt].astype(np.float64) for r in range(4)]
                exact = sum(xs) / 4
                bound = 6 * 2.0 ** -24 * sum(np.abs(x) for x in xs) / 4 + 1e-45
                err = np.abs(got[step][n].astype(np.float64) - exact)
                assert np.all(err <= bound), (rank, step, n, float(err.max()), float(bound.max()))


@pytest.mark.parametrize("world", [4])
def test_custom_hsdp_quantizer_within_its_bound_and_residuals_round_trip(world):
    """int8 across replicas (two_phase: each node's shard average encoded with the worker residual, the
    chunk sum re-encoded with the server residual): at the first step (zero residuals) every element within
    half a quantization step of each of the three encodes, d = amax / 127 of its block, bounded here by the
    amax of the whole shard; the replica residuals survive state_dict / load_state_dict bit for bit."""
    res = run(world, job_hsdp, "int8", False, 1)
    for rank, (got, rep, rep2, st, it2) in enumerate(res):
        j = rank % 2
        assert st["replica"]["buckets"] and {b["scheme"] for b in st["replica"]["buckets"]} <= {"two_phase", "dense"}
        for n, shp in names_shapes():
            cnt, pad = shard_rows(int(np.prod(shp)), shp[0], 2, j)
            nodes = [node_average(n, shp, node, 0)[j * pad: j * pad + cnt].astype(np.float64) for node in range(2)]
            exact = sum(nodes) / 2
            err = np.abs(got[0][n].astype(np.float64) - exact)
            if is_exempt(shp):  # dense across replicas: the float32 average of the two node averages
                assert np.all(err <= 2.0 ** -23 * np.abs(exact) + 1e-45), (rank, n)
                continue
            # the unit's compressed elements of this shard, all parameters: the amax of each encode's input
            allc = [np.concatenate([node_average(m_, s_, node, 0)[j * p_: j * p_ + c_]
                                    for m_, s_ in names_shapes() if not is_exempt(s_)
                                    for c_, p_ in [shard_rows(int(np.prod(s_)), s_[0], 2, j)]]) for node in range(2)]
            d = (sum(np.abs(a).max() / 2 for a in allc) + np.abs(sum(allc) / 2).max()) / 127
            assert np.all(err <= 0.5 * d * 1.001 + 1e-30), (rank, n, float(err.max()), d)
            if cnt:
                assert np.any(rep[n] != 0)
                assert_bits(rep2[n], rep[n], f"replica residual of {n} after load_state_dict")
        assert it2 == 1  # one step saved: the loaded state starts step 1


@pytest.mark.parametrize("world", [4])
def test_custom_hsdp_both_levels_compressed(world):
    """fp8 inside the node (the compressed reduce-scatter) and across replicas: both levels account bytes
    and both keep residuals; the result stays close to the exact average (fp8 e4m3: 3 mantissa bits)."""
    res = run(world, job_hsdp, "fp8", True)
    for rank, (got, rep, _, st, _) in enumerate(res):
        rs, ar = st["reduce_scatter"]["total"], st["replica"]["total"]
        assert rs["sent_bytes"] > 0 and ar["sent_bytes"] > 0
        assert st["total"]["sent_bytes"] == rs["sent_bytes"] + ar["sent_bytes"]
        j = rank % 2
        for n, shp in names_shapes():
            cnt, pad = shard_rows(int(np.prod(shp)), shp[0], 2, j)
            xs = [grad_of(n, shp, r, 0).reshape(-1)[j * pad: j * pad + cnt].astype(np.float64) for r in range(4)]
            exact = sum(xs) / 4
            scale = max(np.abs(x).max() for x in xs) if cnt else 0.0
            assert np.all(np.abs(got[0][n] - exact) <= 0.25 * scale + 1e-30), (rank, n)


# ---------------------------------------------------------------------------------------------
# distributed checkpoints


def _make_trainer(world, spec):
    m = build(world)
    st = fsdp.register(m, spec)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    return m, st, opt


def _train(m, opt, rank, steps, start):
    got = []
    for step in range(start, start + steps):
        opt.zero_grad()
        step_net(m, rank, step)
        got.append(shards(m))
        opt.step()
    params = {n: p.to_local().detach().clone().numpy() for n, p in m.named_parameters()}
    return got, params


def job_dcp(rank, world, spec, path, load_gradcomp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    m, st, opt = _make_trainer(world, spec)
    whole, whole_params = _train(m, opt, rank, 5, 0)
    m, st, opt = _make_trainer(world, spec)
    _train(m, opt, rank, 2, 0)
    msd, osd = get_state_dict(m, opt)
    res_saved = {n: st.residual(n).clone() for n, s in names_shapes() if not is_exempt(s)}
    dcp.save({"model": msd, "optim": osd, "gradcomp": st}, checkpoint_id=path)
    m2, st2, opt2 = _make_trainer(world, spec)
    msd2, osd2 = get_state_dict(m2, opt2)
    state = {"model": msd2, "optim": osd2}
    if load_gradcomp:
        state["gradcomp"] = st2
    dcp.load(state, checkpoint_id=path)
    set_state_dict(m2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    loaded = {n: st2.residual(n).clone() for n in res_saved} if load_gradcomp else {}
    same = all(torch.equal(loaded[n].view(torch.int32), res_saved[n].view(torch.int32)) for n in loaded)
    rest, rest_params = _train(m2, opt2, rank, 3, 2)
    return whole[2:], whole_params, rest, rest_params, same, st2.iter


@pytest.mark.parametrize("spec", ["int8", "topk:ratio=0.1"])
def test_distributed_checkpoint_restores_residuals_and_the_run_continues_bitwise(spec, tmp_path):
    world = 2
    res = run(world, job_dcp, spec, str(tmp_path / "ckpt"), True)
    for rank, (whole, whole_p, rest, rest_p, same, it) in enumerate(res):
        assert same, f"rank {rank}: residuals not restored bit for bit"
        assert it == 1 + 3, it  # steps 0, 1 saved (iter 1), then 3 more steps
        for step in range(3):
            for n in whole[step]:
                assert_bits(rest[step][n], whole[step][n], f"rank {rank} step {step + 2} {n}")
        for n in whole_p:
            assert_bits(rest_p[n], whole_p[n], f"rank {rank} parameter {n}")


def test_distributed_checkpoint_without_the_residuals_differs(tmp_path):
    """The comparison above can fail: without gradcomp's state the continued run is another run."""
    res = run(2, job_dcp, "int8", str(tmp_path / "ckpt"), False)
    diff = False
    for whole, _, rest, _, _, _ in res:
        diff |= any(not np.array_equal(rest[0][n], whole[0][n]) for n in whole[0])
    assert diff


def job_dcp_save(rank, world, spec, path):
    import torch.distributed.checkpoint as dcp

    m, st, opt = _make_trainer(world, spec)
    _train(m, opt, rank, 2, 0)
    dcp.save({"gradcomp": st}, checkpoint_id=path)
    return True


def job_dcp_other_world(rank, world, spec, path):
    import torch.distributed.checkpoint as dcp

    m, st, opt = _make_trainer(world, spec)
    _train(m, opt, rank, 1, 0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        dcp.load({"gradcomp": st}, checkpoint_id=path, planner=fsdp.load_planner())
    msgs = [str(x.message) for x in w if "gradcomp" in str(x.message)]
    left = [n for n, s in names_shapes() if not is_exempt(s) and st.residual(n).any()]
    return msgs, left


@pytest.mark.parametrize("world", [3])
def test_distributed_checkpoint_at_another_world_size_drops_residuals(world, tmp_path):
    path = str(tmp_path / "ckpt")
    assert run(2, job_dcp_save, "int8", path) == [True, True]
    for msgs, left in run(world, job_dcp_other_world, "int8", path):
        assert any("saved at world size 2, loaded at 3" in m and "residuals dropped" in m for m in msgs), msgs
        assert left == []


# ---------------------------------------------------------------------------------------------
# loss scaling


def job_grad_scaler(rank, world, spec, scales):
    """Gradients times the loss scale S_t of each step (GradScaler's ``_scale`` set by hand, powers of two)
    with the scaler attached, against the unscaled run: residuals / S_t and shards / S_t bit for bit."""
    out = []
    for scaled in (False, True):
        m = build(world)
        state = fsdp.register(m, spec)
        sc = torch.amp.GradScaler("cpu", init_scale=1.0)
        if scaled:
            state.attach_grad_scaler(sc)
        got = []
        for step, s in enumerate(scales):
            if scaled:
                sc._scale = torch.tensor(float(s))
            m.zero_grad()
            gs = [torch.from_numpy(grad_of(n, shp, rank, step)) * (s if scaled else 1.0) for n, shp in names_shapes()]
            m(gs).backward()
            got.append((shards(m), {n: state.residual(n).numpy() for n, shp in names_shapes() if not is_exempt(shp)}))
        out.append(got)
    return out


def test_grad_scaler_residuals_follow_the_loss_scale():
    scales = [4.0, 8.0, 2.0]
    for rank, (plain, scaled) in enumerate(run(2, job_grad_scaler, "int8", scales)):
        for step, s in enumerate(scales):
            for n in plain[step][0]:
                assert_bits((scaled[step][0][n] / np.float32(s)).astype(np.float32), plain[step][0][n],
                            f"rank {rank} step {step} shard {n}")
            for n in plain[step][1]:
                assert_bits((scaled[step][1][n] / np.float32(s)).astype(np.float32), plain[step][1][n],
                            f"rank {rank} step {step} residual {n}")


# ---------------------------------------------------------------------------------------------
# the scheme on CUDA (tests/gpu/run.sh runs -k cuda); on the CPU the same checks run here


def _device_job(device: str, path: str) -> None:
    """One process, a 1-rank group (gloo for CPU tensors, NCCL for CUDA tensors): the reduce-scatter of two
    parameters (one compressed, one exempt) with error feedback over 2 calls, then a call with a NaN:
    writes shards, residuals and flags to ``path`` (torch.save)."""
    import gradcomp.schemes.reduce_scatter as rs

    store = dist.FileStore(path + ".store", 1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        rows = [rs.RowLayout(((0, 3000),), ((3008, 10),))]  # a padded shard: 3000 compressed, 10 exempt
        ctx = rs.ReduceScatterContext(gradcomp.Codec("fp8"), rows, torch.float32, device, None, 1, 0)
        res = torch.zeros(3000, dtype=torch.float32, device=device)
        out = []
        g = np.random.default_rng(SEED)
        for call in range(3):
            x = torch.from_numpy(g.standard_normal(3018).astype(np.float32)).to(device)
            if call == 2:
                x[17] = float("nan")
            y = torch.empty(3018, dtype=torch.float32, device=device)
            ctx.key = (0, call, 7)
            nf = rs.reduce_scatter(y, x, ctx, res, dist.ReduceOp.AVG)
            out.append((x.cpu(), y.cpu(), res.cpu().clone(), bool(nf.cpu())))
        torch.save(out, path)
    finally:
        dist.destroy_process_group()


def _run_device_job(device, tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / f"{device}.pt")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_fsdp; test_fsdp._device_job({device!r}, {path!r})"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), here) if p)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return torch.load(path, weights_only=False)


_HAVE_CUDA = torch.cuda.is_available() and gradcomp.build_info()["cuda"]
if os.environ.get("GRADCOMP_REQUIRE_GPU") == "1" and not _HAVE_CUDA:
    raise RuntimeError("GRADCOMP_REQUIRE_GPU=1 but no CUDA build of gradcomp or no GPU")


def test_one_rank_reduce_scatter_cpu(tmp_path):
    """W = 1 through the scheme itself: the compressed part is the decoded packet (fp8's own decode of
    the same input and residual), the exempt part the input, padding zero, error feedback r = x' - D,
    and a NaN sets the flag."""
    out = _run_device_job("cpu", tmp_path)
    codec = gradcomp.Codec("fp8")
    r = torch.zeros(3000)
    for call, (x, y, res, nf) in enumerate(out):
        pk = codec.encode(x[:3000].clone(), residual=r)
        assert_bits(y[:3000].numpy(), codec.decode(pk, numel=3000, dtype=torch.float32).numpy(), f"call {call}")
        assert_bits(res.numpy(), r.numpy(), f"residual {call}")
        assert_bits(y[3008:].numpy(), x[3008:].numpy(), f"exempt {call}")
        assert not y[3000:3008].any()
        assert nf == (call == 2)
    # the scheme returns the flag and leaves the residual as encoded (the comm object restores it)
    assert torch.isnan(out[2][1][:3000]).any()


@pytest.mark.skipif(not _HAVE_CUDA, reason="needs a CUDA build of gradcomp and a GPU")
def test_cuda_reduce_scatter_matches_cpu(tmp_path):
    """The same calls on CUDA (NCCL, one rank): shards, residuals and flags bitwise equal to the CPU's."""
    cpu = _run_device_job("cpu", tmp_path)
    cuda = _run_device_job("cuda", tmp_path)
    for call, ((_, y0, r0, f0), (_, y1, r1, f1)) in enumerate(zip(cpu, cuda)):
        assert_bits(y1.numpy(), y0.numpy(), f"cuda shard, call {call}")
        assert_bits(r1.numpy(), r0.numpy(), f"cuda residual, call {call}")
        assert f0 == f1
