"""The ``hierarchical`` scheme (gradcomp.schemes.hierarchical) through the scheme, the Compressor
and the DDP hook, on 4 real gloo ranks as 2 nodes x 2 (L = 2 ranks per node, N = 2 nodes; rank
r on node r // 2 with local rank r % 2), plus L = 1 and L = 4. The pools are the session's (gloo_pools.py)
(GlooPool(4), one thread per rank). Ranks return their inputs, outputs and residuals; the checks
run here, against this file's own numpy references. Every message names the seed.

References (independent of the library: chunking, node sums, divisions, top-k and the error
bounds are written here; ``gradcomp`` is not called to compute an expected value):
  - node sum of chunk j (c = ceil(n / L), chunk j = [j c, min(n, (j+1) c))) on node k:
    fl32(g_{kL} + g_{kL+1}) (two terms: the same whatever the order gloo sums in); x' = fl32(s + r)
    with r the worker residual of rank (k, j) (a joined rank: x' = s, r kept); q = fl32(x' / W);
  - codec none (inner sum, W = 4): the result is fl32(q_0 + q_1) rounded once into the bucket
    dtype: compared BITWISE (float32 and bfloat16 buckets), and within float32 rounding of the
    float64 average; with small-integer data every sum is exact, so it is also bitwise equal to
    the dense scheme and to the exact average;
  - top-k (inner gather): per node exact top-k of |q| (k = ceil(0.1 count) on the chunk), the
    float32 accumulator 0 + D_0 + D_1, residual x' - W D: output and residuals BITWISE over 3
    steps, with a joined rank;
  - fp16 / bf16 (inner sum): |out - (q_0 + q_1)| <= 2 ((2u + u^2) X + 3 t / 2) + F, X = |q_0| +
    |q_1|, u / t the unit roundoff and smallest subnormal (fp16 2^-11 / 2^-24, bf16 2^-8 / 2^-133);
  - int8 / fp8 e4m3 (inner two_phase: blocks of 128 from the start of each piece of ceil(count /
    N) elements of a node chunk): |out - (q_0 + q_1)| <= step(q_0) + step(q_1) + step(acc) + F,
    a full quantization step per element (RNE errs by half of it: a factor 2 to spare): int8 d =
    max(amax / 127, 2^-126) (times 1 + 2^-20), fp8 2^-3 |v| + d 2^-9 with d = amax / 448; the acc
    step from the upper bound |q_0| + |q_1| + the first steps;
  - F = 8 2^-24 (X + |out|) + 2^-140 covers the float32 operations.
Error feedback (3 steps, float64): sum of the applied averages + the residual mass (sum over ranks
of residual / W, plus the server residuals) = sum of the true averages, within 1e-5 (float32
buckets) or the bfloat16 output rounding (bfloat16 buckets, which error feedback does not see).
Bytes: stats() against the formulas written out here for gloo: intra allreduce 2 (L-1)/L D, the
inner scheme over N ranks, the all-gather (L-1) (c + 1) * element size (each chunk travels with
its rank's status element).
"""

import math
import os
import pickle
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import gradcomp  # noqa: E402
import gradcomp.torch as gt  # noqa: E402
from gradcomp.schemes import SchemeContext, hierarchical  # noqa: E402
from gradcomp.torch import Compressor  # noqa: E402

# the gloo pools of the DDP hook tests (the session's: gloo_pools.py)
from ddp_helpers import bits, ddp, run  # noqa: E402, F401

SEED = 20261212
W, L, N = 4, 2, 2
NUMELS = [1, 3, 13, 1001, 4099]  # n < L, n not divisible by L, ragged chunks and pieces
f32 = np.float32


# ---------------------------------------------------------------------------------------------
# references (numpy; nothing here calls the library)


def chunks(n, parts):
    """[(start, count)] of ``parts`` chunks of ceil(n / parts), the last shorter or empty."""
    c = -(-n // parts)
    return [(min(n, i * c), min(n, (i + 1) * c) - min(n, i * c)) for i in range(parts)]


def to_dtype(a, dtype):
    """float32 numpy rounded (RNE) to the bucket dtype and back to float32 exactly."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=f32)).to(getattr(torch, dtype)).float().numpy()


def node_sum(xs, k, a, m):
    """fl32 of the two ranks of node k on [a, a + m) (float32 numpy)."""
    return (xs[k * L][a: a + m] + xs[k * L + 1][a: a + m]).astype(f32)


def topk_sel(q, ratio):
    """Indices (ascending) of the exact top-k of |q|, ties to the lowest index, NaN first."""
    n = q.size
    k = min(n, max(1, math.ceil(ratio * n)))
    prio = np.where(np.isnan(q), 1, 0)
    key = np.where(np.isnan(q), 0, np.abs(q)).astype(np.float64)
    return np.sort(np.lexsort((np.arange(n), -key, -prio))[:k])


def simulate_exact(spec, steps_xs, dtype, joined=None):
    """Bitwise simulation of ``steps`` reductions under hierarchical with codec none (inner sum)
    or topk:ratio=R (inner gather). steps_xs[t][r]: rank r's float32 input at step t (zeros for
    a joined rank); joined[t]: the joined rank of step t or None. Returns (outputs per step as
    float32 rounded to ``dtype``, final worker residual per rank)."""
    n = steps_xs[0][0].size
    res = [np.zeros(n, f32) for _ in range(W)]
    outs = []
    for t, xs in enumerate(steps_xs):
        jr = None if joined is None else joined[t]
        out = np.zeros(n, f32)
        for j, (a, m) in enumerate(chunks(n, L)):
            if not m:
                continue
            ds = []
            for k in range(N):
                r = k * L + j
                s = node_sum(xs, k, a, m)
                xp = s if r == jr else (s + res[r][a: a + m]).astype(f32)
                q = (xp / f32(W)).astype(f32)
                if spec == "none":
                    d = q
                else:
                    d = np.zeros(m, f32)
                    idx = topk_sel(q, float(spec.split("=")[1]))
                    d[idx] = q[idx]
                if r != jr:
                    res[r][a: a + m] = (xp - (f32(W) * d).astype(f32)).astype(f32)
                ds.append(d)
            if spec == "none":
                out[a: a + m] = (ds[0] + ds[1]).astype(f32)
            else:
                out[a: a + m] = ((f32(0.0) + ds[0]).astype(f32) + ds[1]).astype(f32)
        outs.append(to_dtype(out, dtype))
    return outs, res


def quant_step(v, kind, block):
    """Per-element full quantization step of the float64 magnitudes ``v`` (one encoded segment,
    blocks from its start): int8 d = max(amax / 127, 2^-126) (1 + 2^-20); fp8 e4m3 2^-3 |v| +
    d 2^-9, d = max(amax / 448, 2^-126) (1 + 2^-20)."""
    out = np.zeros_like(v)
    for b in range(0, v.size, block):
        blk = v[b: b + block]
        amax = float(blk.max()) if blk.size else 0.0
        if kind == "int8":
            out[b: b + block] = max(amax / 127.0, 2.0 ** -126) * (1 + 2.0 ** -20)
        else:
            d = max(amax / 448.0, 2.0 ** -126) * (1 + 2.0 ** -20)
            out[b: b + block] = 2.0 ** -3 * blk + d * 2.0 ** -9
    return out


CAST = {"fp16": (2.0 ** -11, 2.0 ** -24), "bf16": (2.0 ** -8, 2.0 ** -133)}
QUANT = {"int8": "int8", "fp8": "fp8"}


def one_step_bound(spec, xs, n):
    """(reference q_0 + q_1 as float64, per-element bound) of one step from zero residuals."""
    ref = np.zeros(n)
    bound = np.zeros(n)
    for j, (a, m) in enumerate(chunks(n, L)):
        if not m:
            continue
        qs = [(node_sum(xs, k, a, m) / f32(W)).astype(f32).astype(np.float64) for k in range(N)]
        X = np.abs(qs[0]) + np.abs(qs[1])
        ref[a: a + m] = qs[0] + qs[1]
        if spec in CAST:
            u, t = CAST[spec]
            b = 2 * ((2 * u + u * u) * X + 3 * t / 2)
        else:
            b = np.zeros(m)
            for pa, pm in chunks(m, N):  # the inner two_phase pieces, each encoded on its own
                sl = slice(pa, pa + pm)
                s0 = quant_step(np.abs(qs[0][sl]), QUANT[spec], 128)
                s1 = quant_step(np.abs(qs[1][sl]), QUANT[spec], 128)
                acc_ub = X[sl] + s0 + s1
                b[sl] = s0 + s1 + quant_step(acc_ub, QUANT[spec], 128)
        bound[a: a + m] = b + 8 * 2.0 ** -24 * (X + np.abs(ref[a: a + m]) + b) + 2.0 ** -140
    return ref, bound


def assert_same_on_ranks(outs, what):
    for r, o in enumerate(outs[1:], 1):
        assert np.array_equal(bits(o), bits(outs[0])), f"{what}: rank {r} differs from rank 0"


# ---------------------------------------------------------------------------------------------
# jobs (module level: pickled by reference into the ranks)


def seeded(n, rank, step, salt, dtype="float32", integers=False):
    g = torch.Generator().manual_seed(SEED + 1000003 * salt + 1009 * step + rank)
    if integers:
        x = torch.randint(-64, 65, (n,), generator=g).float()
    else:
        x = torch.randn(n, generator=g)
    return x.to(getattr(torch, dtype))


def job_reduce(rank, world, spec, inner, numels, dtype, steps, salt, joined_rank=None, integers=False,
               local=L, scheme="hierarchical"):
    """Per n: a Compressor, ``steps`` reductions of seeded data; returns per n the inputs (float32,
    zeros when joined), outputs, worker residual and server residuals after each step."""
    out = []
    for n in numels:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fp16/bf16 on a bfloat16 bucket warns
            comp = Compressor(spec, scheme=scheme, local_world_size=local, inner_scheme=inner, min_compress_numel=0)
            rec = {"n": n, "xs": [], "outs": [], "res": [], "server": [], "layouts": None}
            for step in range(steps):
                x = seeded(n, rank, step, salt, dtype, integers)
                joined = joined_rank is not None and step == steps - 1 and rank == joined_rank
                y = x.clone()
                comp.allreduce_bucket(y, 0, [("x", 0, n)], joined=joined).wait()
                rec["xs"].append(np.zeros(n, f32) if joined else x.float().numpy())
                rec["outs"].append(y.float().numpy())
                r = comp.store.residual("x")  # None: no residual (the dense path flushed it)
                rec["res"].append(np.zeros(n, f32) if r is None else r.numpy())
                rec["server"].append([(e["start"], e["count"], e["world_size"], e["residual"].numpy())
                                      for e in comp.server_residuals()])
            rec["layouts"] = comp.layouts()
            rec["buckets"] = comp.stats()["buckets"]
        out.append(rec)
    return out


def by_n(results):
    """[rank][n index] -> [n index][rank]."""
    return list(zip(*results))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_none_bitwise_vs_simulation(dtype):
    """Bitwise: codec none (inner sum) on every rank equals the simulation, float32 and bfloat16
    buckets; within float32 rounding of the float64 average (float32 buckets)."""
    res = run(W, job_reduce, "none", "auto", NUMELS, dtype, 2, 1)
    for recs in by_n(res):
        n = recs[0]["n"]
        what = f"none {dtype} n={n} seed {SEED}"
        assert recs[0]["layouts"][0]["scheme"] == "hierarchical" and recs[0]["layouts"][0]["inner"] == "sum", what
        exp, _ = simulate_exact("none", [[rc["xs"][t] for rc in recs] for t in range(2)], dtype)
        for t in range(2):
            outs = [rc["outs"][t] for rc in recs]
            assert_same_on_ranks(outs, what)
            assert np.array_equal(bits(outs[0]), bits(exp[t])), f"{what} step {t}: != simulation"
            if dtype == "float32":
                avg = np.mean([rc["xs"][t].astype(np.float64) for rc in recs], axis=0)
                tol = 4 * 2.0 ** -24 * np.sum([np.abs(rc["xs"][t]) for rc in recs], axis=0) / W + 2.0 ** -140
                assert np.all(np.abs(outs[0] - avg) <= tol), f"{what}: beyond float32 rounding of the average"


def test_none_integers_bitwise_equal_dense_and_exact():
    """Bitwise: small-integer data (every sum and division by 4 exact): hierarchical none equals
    the dense scheme and the exact average."""
    hier = run(W, job_reduce, "none", "auto", [13, 4099], "float32", 1, 2, None, True)
    dense = run(W, job_reduce, "none", "auto", [13, 4099], "float32", 1, 2, None, True, L, "dense")
    for i, n in enumerate([13, 4099]):
        avg = (np.sum([hier[r][i]["xs"][0].astype(np.float64) for r in range(W)], axis=0) / W).astype(f32)
        for r in range(W):
            assert np.array_equal(bits(hier[r][i]["outs"][0]), bits(dense[r][i]["outs"][0])), (n, r)
            assert np.array_equal(bits(hier[r][i]["outs"][0]), bits(avg)), (n, r)
        assert dense[0][i]["layouts"][0]["scheme"] == "dense" and hier[0][i]["layouts"][0]["scheme"] == "hierarchical"


def test_topk_gather_bitwise_three_steps_residuals():
    """Bitwise: top-k (inner gather) over 3 steps: outputs on every rank and every rank's worker
    residual (only its own chunk non-zero) equal the simulation."""
    spec = "topk:ratio=0.1"
    res = run(W, job_reduce, spec, "gather", NUMELS, "float32", 3, 3)
    for recs in by_n(res):
        n = recs[0]["n"]
        what = f"{spec} n={n} seed {SEED}"
        assert recs[0]["layouts"][0]["inner"] == "gather", what
        exp, exp_res = simulate_exact(spec, [[rc["xs"][t] for rc in recs] for t in range(3)], "float32")
        for t in range(3):
            outs = [rc["outs"][t] for rc in recs]
            assert_same_on_ranks(outs, what)
            assert np.array_equal(bits(outs[0]), bits(exp[t])), f"{what} step {t}: != simulation"
        for r, rc in enumerate(recs):
            assert np.array_equal(bits(rc["res"][-1]), bits(exp_res[r])), f"{what}: rank {r} residual"
            a, m = chunks(n, L)[r % L]
            outside = np.delete(rc["res"][-1], np.arange(a, a + m))
            assert not outside.any(), f"{what}: rank {r} holds a residual outside its chunk"


@pytest.mark.parametrize("spec,inner", [("fp16", "sum"), ("bf16", "sum"), ("int8", "two_phase"),
                                        ("fp8", "two_phase")])
def test_codec_bounds(spec, inner):
    """Within the codec's bound (module docstring) of q_0 + q_1, every rank bitwise identical."""
    res = run(W, job_reduce, spec, inner, NUMELS, "float32", 1, 4)
    for recs in by_n(res):
        n = recs[0]["n"]
        what = f"{spec} n={n} seed {SEED}"
        assert recs[0]["layouts"][0]["inner"] == inner, what
        outs = [rc["outs"][0] for rc in recs]
        assert_same_on_ranks(outs, what)
        ref, bound = one_step_bound(spec, [rc["xs"][0] for rc in recs], n)
        err = np.abs(outs[0].astype(np.float64) - ref)
        worst = int(np.argmax(err - bound))
        assert np.all(err <= bound), f"{what}: |err| {err[worst]} > bound {bound[worst]} at {worst}"


def test_auto_inner_choices():
    """The inner scheme auto takes is the planner's for the chunk (sum for linear codecs, gather
    for top-k, two_phase for the quantizers on a large bucket)."""
    n = 1 << 16
    for spec, want in (("none", "sum"), ("topk:ratio=0.01", "gather"), ("int8", "two_phase")):
        got = gradcomp.planner.hierarchical_inner(gradcomp.Codec(spec), n, "float32", W, L)
        assert got == want, (spec, got)
    res = run(W, job_reduce, "int8", "auto", [n], "float32", 1, 5)
    assert res[0][0]["layouts"][0]["inner"] == "two_phase"


def _mass(recs, step):
    """Residual mass per element after ``step``: sum_r worker_r / W + server residuals."""
    n = recs[0]["n"]
    m = np.zeros(n)
    for rc in recs:
        m += rc["res"][step].astype(np.float64) / W
        for start, count, world, s in rc["server"][step]:
            assert world == W
            m[start: start + count] += s.astype(np.float64)
    return m


@pytest.mark.parametrize("spec,inner,dtype", [("int8", "two_phase", "float32"), ("topk:ratio=0.1", "gather", "float32"),
                                              ("fp16", "sum", "float32"), ("int8", "two_phase", "bfloat16"),
                                              ("topk:ratio=0.1", "auto", "bfloat16")])
def test_error_feedback_conserves_mass(spec, inner, dtype):
    """float64: over 3 steps, sum of the applied averages + residual mass (worker / W + server) ==
    sum of the true averages; worker residuals only on the rank's own chunk; server residuals on
    its piece (inner two_phase)."""
    steps = 3
    res = run(W, job_reduce, spec, inner, [13, 1001, 4099], dtype, steps, 6)
    for recs in by_n(res):
        n = recs[0]["n"]
        resolved = recs[0]["layouts"][0]["inner"]
        what = f"{spec} {dtype} n={n} inner {resolved} seed {SEED}"
        applied = np.zeros(n)
        true = np.zeros(n)
        mag = np.zeros(n)
        for t in range(steps):
            assert_same_on_ranks([rc["outs"][t] for rc in recs], what)
            applied += recs[0]["outs"][t].astype(np.float64)
            true += np.mean([rc["xs"][t].astype(np.float64) for rc in recs], axis=0)
            mag += np.abs(recs[0]["outs"][t])
        mass = _mass(recs, steps - 1)
        assert resolved == "dense" or np.abs(mass).max() > 0, what + ": no residual kept"
        # not seen by error feedback: the rounding of the output into bfloat16, and the fp16
        # rounding of the wire sum in the sum scheme (both at most half an ulp per step)
        tol = 1e-5 + (2.0 ** -8 * mag if dtype == "bfloat16" else 0) + (2.0 ** -10 * mag if spec == "fp16" else 0)
        err = np.abs(applied + mass - true)
        assert np.all(err <= tol), f"{what}: mass off by {err.max()}"
        for r, rc in enumerate(recs):
            a, m = chunks(n, L)[r % L]
            assert not np.delete(rc["res"][-1], np.arange(a, a + m)).any(), f"{what}: rank {r} residual outside"
            for start, count, world, _ in rc["server"][-1]:
                pa, pm = chunks(m, N)[r // L]
                assert (start, count) == (a + pa, pm), f"{what}: rank {r} server slot {(start, count)}"
            assert bool(rc["server"][-1]) == (resolved == "two_phase"), what


def test_joined_rank_topk_bitwise_and_keeps_residual():
    """Bitwise: rank 1 joined at the last of 3 steps sends zeros and keeps its worker residual
    (its chunk of the node sum is encoded without it); every rank equals the simulation."""
    spec = "topk:ratio=0.1"
    res = run(W, job_reduce, spec, "gather", [13, 1001], "float32", 3, 7, 1)
    for recs in by_n(res):
        n = recs[0]["n"]
        what = f"joined {spec} n={n} seed {SEED}"
        exp, exp_res = simulate_exact(spec, [[rc["xs"][t] for rc in recs] for t in range(3)], "float32",
                                      joined=[None, None, 1])
        for t in range(3):
            assert_same_on_ranks([rc["outs"][t] for rc in recs], what)
            assert np.array_equal(bits(recs[0]["outs"][t]), bits(exp[t])), f"{what} step {t}"
        assert np.array_equal(bits(recs[1]["res"][2]), bits(recs[1]["res"][1])), what + ": joined residual changed"
        for r in range(W):
            assert np.array_equal(bits(recs[r]["res"][2]), bits(exp_res[r])), f"{what}: rank {r} residual"


def test_joined_rank_two_phase_serves_its_piece():
    """A joined rank under inner two_phase keeps its worker residual and still updates the server
    residual of its piece; every rank bitwise identical; the mass is conserved up to the joined
    rank's chunk (encoded without error feedback that step)."""
    res = run(W, job_reduce, "int8", "two_phase", [1001], "float32", 3, 8, 1)
    recs = by_n(res)[0]
    what = f"joined int8 seed {SEED}"
    for t in range(3):
        assert_same_on_ranks([rc["outs"][t] for rc in recs], what)
    assert np.array_equal(bits(recs[1]["res"][2]), bits(recs[1]["res"][1])), what + ": joined worker residual changed"
    s1, s2 = recs[1]["server"][1][0][3], recs[1]["server"][2][0][3]
    assert not np.array_equal(bits(s1), bits(s2)), what + ": the joined rank did not serve its piece"


def test_error_feedback_off_and_world_shapes():
    """error_feedback=False keeps no residual; L = 1 (inner over all 4 ranks) is bitwise the flat
    sum scheme; L = 4 (one node, exact) is within float32 rounding of the average."""
    def flat(results, i=0):
        return [results[r][i] for r in range(W)]

    l1 = flat(run(W, job_reduce, "none", "auto", [1001], "float32", 1, 9, None, False, 1))
    sm = flat(run(W, job_reduce, "none", "auto", [1001], "float32", 1, 9, None, False, 1, "sum"))
    for r in range(W):
        assert np.array_equal(bits(l1[r]["outs"][0]), bits(sm[r]["outs"][0])), r
    l4 = flat(run(W, job_reduce, "int8", "auto", [1001], "float32", 1, 10, None, False, 4))
    assert l4[0]["layouts"][0]["inner"] == "dense"
    avg = np.mean([rc["xs"][0].astype(np.float64) for rc in l4], axis=0)
    assert_same_on_ranks([rc["outs"][0] for rc in l4], "L=4")
    tol = 6 * 2.0 ** -24 * np.sum([np.abs(rc["xs"][0]) for rc in l4], axis=0) / W + 2.0 ** -140
    assert np.all(np.abs(l4[0]["outs"][0] - avg) <= tol)
    assert not any(rc["res"][0].any() for rc in l4)


def job_flush_and_nonfinite(rank, world, n):
    """int8, inner two_phase: step 0 hierarchical, step 1 rank 0 holds a NaN (non-finite: worker
    and server residuals restored), step 2 dense (the server residual folded with factor W into
    the worker residual, then flushed into the dense allreduce)."""
    comp = Compressor("int8", scheme="hierarchical", local_world_size=2, inner_scheme="two_phase",
                      min_compress_numel=0)
    rec = {"xs": [], "outs": [], "res": [], "server": []}
    for step in range(3):
        x = seeded(n, rank, step, 16)
        if step == 1 and rank == 0:
            x[5] = float("nan")
        y = x.clone()
        comp.allreduce_bucket(y, 0, [("x", 0, n)], dense=step == 2).wait()
        comp.end_step()
        rec["xs"].append(x.numpy())
        rec["outs"].append(y.numpy())
        r = comp.store.residual("x")
        rec["res"].append(np.zeros(n, f32) if r is None else r.numpy())
        rec["server"].append([e["residual"].numpy() for e in comp.server_residuals()])
    return rec


def test_dense_flush_folds_server_and_nonfinite_restores():
    """float64: a dense step after a hierarchical one sends the folded server residuals (W x
    server added to the worker residual of the same elements): applied averages of steps 0 and 2
    == true averages, nothing left; a non-finite step (NaN on rank 0) is non-finite on every
    rank and restores worker and server residuals bitwise."""
    n = 1001
    recs = run(W, job_flush_and_nonfinite, n)
    what = f"flush n={n} seed {SEED}"
    for t in range(3):
        assert_same_on_ranks([rc["outs"][t] for rc in recs], f"{what} step {t}")
    assert not np.isfinite(recs[0]["outs"][1]).all(), what + ": the NaN step is finite"
    for rc in recs:
        assert np.array_equal(bits(rc["res"][1]), bits(rc["res"][0])), what + ": worker residual not restored"
        assert all(np.array_equal(bits(a), bits(b)) for a, b in zip(rc["server"][1], rc["server"][0])), \
            what + ": server residual not restored"
        assert not rc["res"][2].any() and not any(s.any() for s in rc["server"][2]), what + ": mass left after flush"
    assert any(s.any() for rc in recs for s in rc["server"][0]), what + ": no server residual to fold"
    applied = recs[0]["outs"][0].astype(np.float64) + recs[0]["outs"][2]
    true = sum(np.mean([rc["xs"][t].astype(np.float64) for rc in recs], axis=0) for t in (0, 2))
    err = np.abs(applied - true)
    assert np.all(err <= 1e-5), f"{what}: the dense step lost {err.max()} (server residuals not folded by W?)"


def job_no_ef(rank, world):
    comp = Compressor("int8", scheme="hierarchical", error_feedback=False, local_world_size=2, min_compress_numel=0)
    x = seeded(1001, rank, 0, 11)
    comp.allreduce(x, "x").wait()
    return comp.store.empty() and comp.server_residuals() == [], x.numpy()


def test_no_error_feedback():
    res = run(W, job_no_ef)
    assert all(r[0] for r in res)
    assert_same_on_ranks([r[1] for r in res], "no EF")


# ---------------------------------------------------------------------------------------------
# the scheme itself: the NCCL-style path (reduce_scatter_tensor, which gloo also runs), n = 0


def job_engines(rank, world, n):
    codec = gradcomp.Codec("none")
    out = {}
    for engine in ("gloo", "nccl"):
        ctx = SchemeContext.for_layout("hierarchical", codec, n, torch.float32, torch.device("cpu"), None, W,
                                       local_world_size=L, inner="sum", engine=engine)
        x = seeded(n, rank, 0, 12)
        hierarchical(x, ctx).wait()
        out[engine] = x.numpy()
        out[engine + "_sizes"] = (ctx.acc.numel(), None if ctx.node_sum is None else ctx.node_sum.numel(),
                                  ctx.gathered.numel())
    e = torch.empty(0)
    ctx0 = SchemeContext.for_layout("hierarchical", codec, 0, torch.float32, torch.device("cpu"), None, W,
                                    local_world_size=L, inner="sum")
    out["empty"] = hierarchical(e, ctx0).wait().numel()
    return out


def test_engines_agree_and_empty():
    """Bitwise: the reduce-scatter path (engine nccl: a float32 buffer padded to L c) equals the
    allreduce path (gloo); n = 0 returns at once."""
    for n in (13, 1001):
        res = run(W, job_engines, n)
        c = -(-n // L)
        for r in range(W):
            assert np.array_equal(bits(res[r]["gloo"]), bits(res[r]["nccl"])), (n, r)
            # the all-gather holds L slots of c + 1: each chunk and its rank's status element
            assert res[r]["gloo_sizes"] == (n, None, L * (c + 1))
            assert res[r]["nccl_sizes"] == (L * c, c, L * (c + 1))
            assert res[r]["empty"] == 0
        assert_same_on_ranks([res[r]["gloo"] for r in range(W)], f"engines n={n}")


# ---------------------------------------------------------------------------------------------
# byte accounting


def job_bytes(rank, world, spec, inner, n):
    comp = Compressor(spec, scheme="hierarchical", local_world_size=2, inner_scheme=inner, min_compress_numel=0)
    x = seeded(n, rank, 0, 13)
    comp.allreduce(x, "x").wait()
    s = comp.stats()
    return s["buckets"][0], {k: s["step"][k] for k in ("dense_bytes", "packet_bytes", "sent_bytes", "ring_bytes")}


@pytest.mark.parametrize("spec,inner", [("int8", "two_phase"), ("topk:ratio=0.1", "gather"), ("fp16", "sum"),
                                        ("none", "dense")])
def test_bytes_gloo(spec, inner):
    """stats() == the formulas written out here (gloo, float32 bucket of 4096 elements): intra
    allreduce 2 (L-1)/L D, the inner scheme over N, the all-gather (L-1) (c + 1) 4 (the chunk and
    its rank's status element)."""
    n = 4096
    codec = gradcomp.Codec(spec)
    D, c = 4 * n, n // L
    intra = 2.0 * (L - 1) / L * D + (L - 1) * (c + 1) * 4
    if inner == "two_phase":
        p = codec.packet_bytes(c // N, torch.float32)
        inter, packet = (N - 1) * (p + p), N * p
    elif inner == "gather":
        p = codec.packet_bytes(c, torch.float32)
        inter, packet = (N - 1) * p, p
    elif inner == "sum":
        _, count, wire = codec.payload(c, torch.float32)
        inter, packet = 2.0 * (N - 1) / N * count * {"float16": 2, "bfloat16": 2, "float32": 4}[wire], \
            codec.packet_bytes(c, torch.float32)
    else:
        inter, packet = 2.0 * (N - 1) / N * c * 4, c * 4
    for b, step in run(W, job_bytes, spec, inner, n):
        assert b["scheme"] == "hierarchical" and b["inner"] == inner and b["local_world_size"] == L
        assert b["intra_bytes"] == intra and b["inter_bytes"] == inter, (spec, b)
        assert b["sent_bytes"] == intra + inter and b["packet_bytes"] == packet and b["dense_bytes"] == D, (spec, b)
        assert b["ring_bytes"] == 2.0 * (W - 1) / W * D
        assert step == {"dense_bytes": D, "packet_bytes": packet, "sent_bytes": intra + inter,
                        "ring_bytes": 2.0 * (W - 1) / W * D}


# ---------------------------------------------------------------------------------------------
# errors, configuration, pickling


def job_errors(rank, world):
    saved = os.environ.pop("LOCAL_WORLD_SIZE", None)
    msgs = {}
    try:
        def err(**kw):
            with pytest.raises(ValueError) as ei:
                Compressor(kw.pop("codec", "none"), **kw)
            return str(ei.value)

        msgs["not_dividing"] = err(scheme="hierarchical", local_world_size=3)
        msgs["zero"] = err(scheme="hierarchical", local_world_size=0)
        msgs["bool"] = err(scheme="hierarchical", local_world_size=True)
        msgs["missing"] = err(scheme="hierarchical")
        msgs["inner"] = err(scheme="hierarchical", local_world_size=2, inner_scheme="ring")
        msgs["inner_sum"] = err(codec="topk:ratio=0.1", scheme="hierarchical", local_world_size=2, inner_scheme="sum")
        os.environ["LOCAL_WORLD_SIZE"] = "3"
        msgs["env_bad"] = err(scheme="hierarchical")
        auto_l = Compressor("none").local_world_size  # auto ignores an L that does not divide W
        os.environ["LOCAL_WORLD_SIZE"] = "two"
        msgs["env_text"] = err(scheme="hierarchical")
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        env_l = Compressor("none", scheme="hierarchical").local_world_size
        msgs["explicit_wins"] = err(scheme="hierarchical", local_world_size=8)  # the argument, not the env
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        if saved is not None:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return msgs, auto_l, env_l


def test_errors():
    """L not dividing W, L < 1 or a bool, neither local_world_size nor LOCAL_WORLD_SIZE, a bad
    LOCAL_WORLD_SIZE, an unknown inner scheme, inner sum with a non-linear codec: ValueError
    naming the value and what is accepted; LOCAL_WORLD_SIZE is read when set."""
    msgs, auto_l, env_l = run(W, job_errors)[0]
    assert "local_world_size=3" in msgs["not_dividing"] and "world size 4" in msgs["not_dividing"]
    assert "local_world_size=0" in msgs["zero"] and "local_world_size=True" in msgs["bool"]
    assert "local_world_size=" in msgs["missing"] and "LOCAL_WORLD_SIZE" in msgs["missing"]
    assert "inner_scheme='ring'" in msgs["inner"] and "two_phase" in msgs["inner"] and "gather" in msgs["inner"]
    assert "inner_scheme='sum'" in msgs["inner_sum"] and "linear" in msgs["inner_sum"]
    assert "LOCAL_WORLD_SIZE" in msgs["env_bad"] and "'3'" in msgs["env_bad"]
    assert "'two'" in msgs["env_text"]
    assert "local_world_size=8" in msgs["explicit_wins"]
    assert auto_l == 0 and env_l == 2


def test_check_options_rejects_before_any_group():
    with pytest.raises(ValueError, match="hierarchical"):
        gt.compressor.check_options(scheme="ring", nonfinite="restore", ints=(), error_feedback=True, group=None)
    assert "hierarchical" in gt.compressor.SCHEME_CHOICES


def job_pickle(rank, world):
    comp = Compressor("int8", scheme="hierarchical", local_world_size=2, inner_scheme="two_phase",
                      min_compress_numel=0)
    x0, x1 = seeded(1001, rank, 0, 14), seeded(1001, rank, 1, 14)
    comp.allreduce(x0, "x").wait()
    comp.end_step()
    blob = pickle.dumps(comp)
    back = pickle.loads(blob)
    conf = (back.scheme, back.local_world_size, back.inner_scheme, back.cost_model)
    a, b = x1.clone(), x1.clone()
    comp.allreduce(a, "x").wait()
    back.allreduce(b, "x").wait()
    sd = comp.state_dict()
    # a version-1 pickle (before the hierarchical options) still loads
    old = Compressor("topk:ratio=0.1", scheme="gather", min_compress_numel=0)
    d = old.__getstate__()
    for k in ("local_world_size", "inner_scheme", "cost_model"):
        d.pop(k)
    d["version"] = 1
    v1 = Compressor.__new__(Compressor)
    v1.__setstate__(d)
    return (conf, bool(torch.equal(a.view(torch.int32), b.view(torch.int32))),
            (sd["scheme"], sd["local_world_size"], sd["inner_scheme"]), (v1.scheme, v1.inner_scheme))


def test_pickle_and_state_dict_keep_the_options():
    """A pickled hierarchical Compressor comes back with L, inner scheme and its residuals (its
    next step bitwise equal to the original's); state_dict records the options; a version-1
    pickle loads."""
    for conf, same, sd, v1 in run(W, job_pickle):
        assert conf == ("hierarchical", 2, "two_phase", None)
        assert same, "the unpickled compressor's next step differs"
        assert sd == ("hierarchical", 2, "two_phase")
        assert v1 == ("gather", "auto")


def job_subgroup(rank, world):
    sub = dist.new_group(list(range(world)))
    outs = []
    for group in (None, sub):
        comp = Compressor("none", scheme="hierarchical", group=group, local_world_size=2, min_compress_numel=0)
        x = seeded(1001, rank, 0, 15)
        comp.allreduce(x, "x").wait()
        outs.append(x.numpy())
    return outs


def test_subgroup_maps_ranks():
    """Bitwise: on a subgroup (its groups made with the ranks of the subgroup only) the result
    equals the default group's."""
    res = run(W, job_subgroup)
    for r in range(W):
        assert np.array_equal(bits(res[r][0]), bits(res[r][1])), r
    assert_same_on_ranks([res[r][1] for r in range(W)], "subgroup")


# ---------------------------------------------------------------------------------------------
# the DDP hook


def job_ddp(rank, world, codec):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    import copy

    models = {"hier": ddp(copy.deepcopy(base)), "plain": ddp(copy.deepcopy(base))}
    st = gt.register(models["hier"], codec=codec, scheme="hierarchical", local_world_size=2)
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.1) for k, m in models.items()}
    g = torch.Generator().manual_seed(SEED + rank)
    for step in range(2):
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 8, generator=g)
        for k, m in models.items():
            opts[k].zero_grad()
            (m(x) - y).square().mean().backward()
            opts[k].step()
    flat = {k: torch.cat([p.detach().reshape(-1) for p in m.parameters()]).numpy() for k, m in models.items()}
    lay = st.bucket_layouts()
    return flat, [(d["scheme"], d.get("inner")) for d in lay], st.stats()["total"]["compressed_buckets"]


@pytest.mark.parametrize("codec", ["int8", "none"])
def test_ddp_hook_two_steps(codec):
    """Through gradcomp.torch.register(ddp, scheme="hierarchical", local_world_size=2): parameters
    bitwise equal on every rank after 2 SGD steps, and close to plain DDP's (none: float32
    rounding; int8: its quantization)."""
    res = run(W, job_ddp, codec)
    assert_same_on_ranks([r[0]["hier"] for r in res], f"ddp {codec}")
    flat, lay, compressed = res[0]
    assert ("hierarchical", "sum" if codec == "none" else "two_phase") in lay, lay
    assert compressed >= 2
    tol = 1e-5 if codec == "none" else 2e-3
    assert np.abs(flat["hier"] - flat["plain"]).max() <= tol
