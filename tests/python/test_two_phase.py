"""The ``two_phase`` scheme (gradcomp.schemes.two_phase) through the scheme itself, the Compressor
and the DDP hook, on real gloo process groups (2, 3 and 4 CPU processes, spawn; the session's
pools, gloo_pools.py). The assertions run inside the ranks; every message names the seed.

The reference is an independent numpy simulation of the protocol written here (:func:`simulate`):
the chunking, the slot layout, the rank-order float32 sums, the residual updates and the folding
of server residuals are this file's own code; it calls ``gradcomp.Codec`` only to encode and decode
one chunk (the codecs have their own tests). Bitwise comparisons (floats as integer views, so NaN
and -0.0 count):
  - the result on every rank, and run to run;
  - result, worker residual and server residual against the simulation, over several steps in a
    row (both residuals carry over), for W = 2, 3, 4 and numel 1, 13, 1000, 2^16 + 3, every codec
    (float32 buckets; none, fp16, bf16, topk:ratio=0.1, fp8, fp8:format=e5m2, fp8:scale=e8m0,
    int8, int4, onebit, onebit:chunk=8,scale=mean_abs), and bfloat16 buckets;
  - the scheme's buffers against the slot layout: send slots, received slots, gathered slots;
  - the Compressor across a bucket rebuild, a dense flush, a checkpoint round trip (bit-exact, and
    folded into another layout), a non-finite step (restore / reset of both residuals);
  - the DDP hook across DDP's bucket rebuild, a rebuild into a dense bucket (flush), a checkpoint
    (round trip, a pickled state, another bucketing), a non-finite step, join() -- with
    ``exempt=()`` (every parameter compressed; the hook's default exempts 1-D parameters, which
    test_policies.py tests);
  - with a GradScaler (scales 4, 8, 2), worker and server residuals / scale against the unscaled
    run (powers of two commute with every rounding and block scale).

Bounds of the result against the exact average m = sum_r x'_r / W + s (x'_r = fl(g_r + r_r) the
worker's input, s the server residual of the element's chunk; float64), float32 buckets:
  - none: exact: the result equals fl(acc + s) with acc the float32 sum, in rank order from +0.0,
    of fl(x'_r / W) (computed here without the codec);
  - fp16 / bf16: |err| <= (2 u + u^2) X + (W + 1) t / 2 + F, with u = 2^-11 / 2^-8 the unit
    roundoff, t = 2^-24 / 2^-133 the smallest subnormal spacing, X = sum_r |x'_r / W| + |s|;
  - int8 / int4 / fp8 (blocks of the chunk, 128 elements; e8m0: 32): |err| <= sum_r step(q_r) +
    step(x'') + F: the per-rank quantization steps of q_r = fl(x'_r / W) (already divided by W)
    and the step of the second quantization of x'' = fl(acc + s); int: d = max(amax / 127 (7),
    2^-126) per block (times 1 + 2^-20 for the float32 rounding of d); fp8: 2^-m |v| + d 2^-s per element (m = 3 / 2 mantissa bits, 2^-s the
    subnormal spacing 2^-9 / 2^-16, d = amax / 448 (57344), e8m0 d <= 2 amax / 448); RNE errs
    by at most half a step, so these are bounds with a factor 2 to spare;
  - F = (W + 3) 2^-24 (X + |x''|) + 2^-140 covers the float32 operations;
  - top-k and onebit have no such bound (what they drop stays in the residuals); they are checked
    bitwise against the simulation only.
"""

import copy
import io
import pickle
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import gradcomp  # noqa: E402
import gradcomp.torch as gt  # noqa: E402
from gradcomp.schemes import SchemeContext, two_phase  # noqa: E402
from gradcomp.torch import Compressor  # noqa: E402

# the gloo pools and helpers of the DDP hook tests (the session's pools: gloo_pools.py)
from ddp_helpers import (  # noqa: E402, F401
    Params, Reordered, bits, check_world_size_change_drops, ddp, grads_for, no_host_sync, run)

SEED = 20261203
CASTS = ["none", "fp16", "bf16"]
QUANTIZERS = ["fp8", "fp8:format=e5m2", "fp8:scale=e8m0", "int8", "int4"]
ONEBIT = ["onebit", "onebit:chunk=8,scale=mean_abs"]  # bitwise vs the simulation; no elementwise bound
CODECS = CASTS + ["topk:ratio=0.1"] + QUANTIZERS + ONEBIT
NUMELS = [1, 13, 1000, 2 ** 16 + 3]
STEPS = 3

# quantizer -> (kind, block, qmax or (mantissa bits, subnormal exponent, max finite), e8m0)
QUANT = {"int8": ("int", 128, 127.0), "int4": ("int", 128, 7.0),
         "fp8": ("fp8", 128, (3, -9, 448.0)), "fp8:format=e5m2": ("fp8", 128, (2, -16, 57344.0)),
         "fp8:scale=e8m0": ("fp8", 32, (3, -9, 448.0))}


# ---------------------------------------------------------------------------------------------
# the independent simulation


def chunk_bounds(n, W):
    """[(start, stop)] of the W chunks: c = ceil(n / W), chunk j = [j c, min(n, (j+1) c))."""
    c = (n + W - 1) // W
    return [(min(n, j * c), min(n, (j + 1) * c)) for j in range(W)]


def f32(a):
    return np.asarray(a, dtype=np.float32)


def simulate(spec, gs, r0s, s0s):
    """One two_phase step over W ranks.

    gs[i]: rank i's flat input (torch, the bucket dtype); r0s[i]: its worker residual (float32
    numpy, n); s0s[j]: rank j's server residual (float32 numpy, chunk j's count). Returns a dict:
    out (float32 numpy, rounded to the bucket dtype), r1s, s1s (as the inputs), xpp (x'' =
    fl(acc + s) per element, float32), send[i] (rank i's W * P1 bytes), received[j] (rank j's),
    gathered (W * P2 bytes)."""
    codec = gradcomp.Codec(spec)
    W, n, dtype = len(gs), gs[0].numel(), gs[0].dtype
    bounds = chunk_bounds(n, W)
    c = (n + W - 1) // W
    P1, P2 = codec.packet_bytes(c, dtype), codec.packet_bytes(c, torch.float32)
    r1s = [f32(r).copy() for r in r0s]
    send = [np.zeros(W * P1, np.uint8) for _ in range(W)]
    packets = [[None] * W for _ in range(W)]
    for i in range(W):
        for j, (a, b) in enumerate(bounds):
            if b == a:
                continue
            res = torch.from_numpy(r1s[i][a:b].copy())
            p = codec.encode(gs[i][a:b].clone(), residual=res, divisor=W)
            r1s[i][a:b] = res.numpy()
            packets[i][j] = p
            send[i][j * P1: j * P1 + p.numel()] = p.numpy()
    received = [np.concatenate([send[i][j * P1: (j + 1) * P1] for i in range(W)]) for j in range(W)]
    out = np.zeros(n, np.float32)
    xpp = np.zeros(n, np.float32)
    s1s = []
    gathered = np.zeros(W * P2, np.uint8)
    for j, (a, b) in enumerate(bounds):
        if b == a:
            s1s.append(f32(s0s[j]).copy())
            continue
        acc = np.zeros(b - a, np.float32)
        for i in range(W):  # rank order, float32, from +0.0
            acc = f32(acc + codec.decode(packets[i][j], numel=b - a).numpy())
        xpp[a:b] = f32(acc + f32(s0s[j]))
        s = torch.from_numpy(f32(s0s[j]).copy())
        p2 = codec.encode(torch.from_numpy(acc), residual=s, divisor=1)
        s1s.append(s.numpy())
        gathered[j * P2: j * P2 + p2.numel()] = p2.numpy()
        d2 = codec.decode(p2, numel=b - a)  # float32, then rounded once into the bucket dtype
        out[a:b] = d2.to(dtype).float().numpy()
    return {"out": out, "r1s": r1s, "s1s": s1s, "xpp": xpp, "send": send, "received": received,
            "gathered": gathered}


def fold(residuals, entry, W):
    """Fold a server residual into per-name worker residuals (numpy float32, in place): for
    element e of its chunk, the parameter (name, off, len) holding e gets fl(r + fl(W * s))."""
    start, s = entry["start"], f32(entry["residual"])
    for name, off, length in entry["params"]:
        for e in range(max(off, start), min(off + length, start + s.size)):
            r = residuals.setdefault(name, np.zeros(length, np.float32))
            r[e - off] = f32(r[e - off] + f32(np.float32(W) * s[e - start]))


# ---------------------------------------------------------------------------------------------
# bounds against the exact average


def block_amax(v, bounds, block):
    """Per element: the max |v| over its quantization block (blocks of ``block`` elements from
    the start of its chunk; non-finite values ignored)."""
    out = np.zeros(v.size, np.float64)
    a64 = np.where(np.isfinite(v), np.abs(v.astype(np.float64)), 0.0)
    for a, b in bounds:
        for s in range(a, b, block):
            e = min(b, s + block)
            out[s:e] = a64[s:e].max()
    return out


def quant_step(spec, v, bounds):
    """Per element: an upper bound of one quantization step of ``v`` (float32) under ``spec``."""
    kind, block, p = QUANT[spec]
    amax = block_amax(v, bounds, block)
    v64 = np.abs(v.astype(np.float64))
    if kind == "int":
        return np.maximum(amax / p, 2.0 ** -126) * (1 + 2.0 ** -20)
    mant, sub, fmax = p
    d = np.maximum(amax / fmax, 2.0 ** -126) * (1 + 2.0 ** -20)
    if spec.endswith("e8m0"):
        d = np.maximum(2 * amax / fmax * (1 + 2.0 ** -20), 2.0 ** -127)
    return 2.0 ** -mant * v64 + d * 2.0 ** sub


def check_bound(spec, xps, s_full, out, xpp, bounds, what):
    """The stated bound of the module docstring (float32 buckets)."""
    W = len(xps)
    qs = [f32(x / np.float32(W)) for x in xps]
    m = sum(x.astype(np.float64) for x in xps) / W + s_full.astype(np.float64)
    if spec == "none":
        acc = np.zeros(out.size, np.float32)
        for q in qs:
            acc = f32(acc + q)
        exp = f32(acc + s_full)
        assert np.array_equal(bits(out), bits(exp)), what + ": none != the float32 rank-order sum"
        return
    X = sum(np.abs(q.astype(np.float64)) for q in qs) + np.abs(s_full.astype(np.float64))
    F = (W + 3) * 2.0 ** -24 * (X + np.abs(xpp.astype(np.float64))) + 2.0 ** -140
    if spec in ("fp16", "bf16"):
        u, t = (2.0 ** -11, 2.0 ** -24) if spec == "fp16" else (2.0 ** -8, 2.0 ** -133)
        bound = (2 * u + u * u) * X + (W + 1) * t / 2 + F
    else:
        bound = sum(quant_step(spec, q, bounds) for q in qs) + quant_step(spec, xpp, bounds) + F
    err = np.abs(out.astype(np.float64) - m)
    bad = np.flatnonzero(~(err <= bound))
    assert bad.size == 0, (f"{what}: |result - mean| above the bound at {bad[:5]}: err {err[bad[:5]]}, "
                           f"bound {bound[bad[:5]]}")


# ---------------------------------------------------------------------------------------------
# helpers used inside the ranks


def gen(*tags):
    return torch.Generator().manual_seed(SEED + sum(t * 1000003 ** k for k, t in enumerate(tags)))


def worker_res(comp, name, n):
    """comp.residual(name) as float32 numpy (zeros before its first reduction)."""
    try:
        return comp.residual(name).numpy()
    except KeyError:
        return np.zeros(n, np.float32)


def server_of(comp, count, **key):
    """The server residual of the layout ``key`` (name= or index=) as float32 numpy (zeros when
    it has none yet)."""
    (k, v), = key.items()
    for e in comp.server_residuals():
        if e.get(k) == v:
            assert e["count"] == count, (e["count"], count)
            return e["residual"].numpy()
    return np.zeros(count, np.float32)


def gather_all(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def assert_same_bits(a, b, what):
    assert np.array_equal(bits(f32(a)), bits(f32(b))), what


def compressed_step(comp, rank, world, spec, t, name, what):
    """One ``comp.allreduce(t, name)`` checked bitwise against the simulation (result on every
    rank, this rank's worker and server residuals). Returns (the simulation, every rank's x' =
    fl(g + r), the server residuals of all chunks end to end, the result), numpy float32."""
    n = t.numel()
    bounds = chunk_bounds(n, world)
    count = bounds[rank][1] - bounds[rank][0]
    r0, s0 = worker_res(comp, name, n), server_of(comp, count, name=name)
    g = t.clone()
    with no_host_sync():
        fut = comp.allreduce(t, name)
    assert fut.wait() is t
    rec = {"g": g, "r0": r0, "s0": s0, "out": t.float().numpy().copy(), "r1": worker_res(comp, name, n),
           "s1": server_of(comp, count, name=name)}
    recs = gather_all(rec)
    for r in range(world):
        assert_same_bits(recs[r]["out"], rec["out"], f"{what}: rank {r}'s result differs from rank {rank}'s")
    sim = simulate(spec, [x["g"] for x in recs], [x["r0"] for x in recs], [x["s0"] for x in recs])
    assert_same_bits(rec["out"], sim["out"], f"{what}: result != simulation")
    assert_same_bits(rec["r1"], sim["r1s"][rank], f"{what}: worker residual != simulation")
    assert_same_bits(rec["s1"], sim["s1s"][rank], f"{what}: server residual != simulation")
    xps = [f32(x["g"].float().numpy() + x["r0"]) for x in recs]
    s_full = np.concatenate([x["s0"] for x in recs]).astype(np.float32)
    return sim, xps, s_full, rec["out"]


def seeded_input(n, rank, step, tag, dtype=torch.float32):
    t = torch.randn(n, generator=gen(tag, n, step, rank)) * 2.0 ** (step - 1)
    if n >= 13 and step == 1 and rank == 0:
        t[5] = 30.0  # an outlier in one block of one rank
    return t.to(dtype)


# ---------------------------------------------------------------------------------------------
# jobs (module level: pickled by reference into the ranks)


def job_matrix(rank, world, spec):
    checked = 0
    for n in NUMELS:
        comp = Compressor(spec, scheme="two_phase", min_compress_numel=0)
        again = Compressor(spec, scheme="two_phase", min_compress_numel=0)
        name = f"t{n}"
        for step in range(STEPS):
            what = f"{spec} W={world} n={n} step {step} seed {SEED}"
            t = seeded_input(n, rank, step, 1)
            t2 = t.clone()
            sim, xps, s_full, out = compressed_step(comp, rank, world, spec, t, name, what)
            if spec != "topk:ratio=0.1" and spec not in ONEBIT:
                check_bound(spec, xps, s_full, out, sim["xpp"], chunk_bounds(n, world), what)
            again.allreduce(t2, name).wait()  # run to run: a second compressor, the same inputs
            assert torch.equal(t2.view(torch.int32), t.view(torch.int32)), what + ": not deterministic run to run"
            checked += 1
        assert comp.scheme_of(name) == "two_phase", what
        s = comp.stats()
        c = (n + world - 1) // world
        p = comp.codec.packet_bytes(c)
        assert s["step"]["packet_bytes"] == world * p and s["step"]["sent_bytes"] == 2 * (world - 1) * p, (what, s)
    return checked


@pytest.mark.parametrize("spec", CODECS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_matrix_bitwise_vs_simulation(world, spec):
    """Bitwise vs the simulation (result on every rank, worker and server residuals, 3 steps in a
    row), run to run; the stated bound against the exact average (all codecs but top-k)."""
    assert run(world, job_matrix, spec) == [len(NUMELS) * STEPS] * world


def job_bf16_bucket(rank, world):
    for spec in ("none", "int8", "topk:ratio=0.1", "fp16"):
        for n in (13, 1000):
            comp = Compressor(spec, scheme="two_phase", min_compress_numel=0)
            for step in range(STEPS):
                what = f"{spec} bfloat16 W={world} n={n} step {step} seed {SEED}"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # fp16 on a bfloat16 tensor warns
                    compressed_step(comp, rank, world, spec, seeded_input(n, rank, step, 2, torch.bfloat16),
                                    f"b{n}", what)
            if spec in ("none", "topk:ratio=0.1") and n == 1000:  # the float32 sum goes back as float32: P2 > P1
                c = (n + world - 1) // world
                p1, p2 = comp.codec.packet_bytes(c, torch.bfloat16), comp.codec.packet_bytes(c)
                assert p2 > p1 and comp.stats()["step"]["sent_bytes"] == (world - 1) * (p1 + p2), spec
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_bfloat16_bucket_bitwise_vs_simulation(world):
    """Bitwise: bfloat16 buckets (rounded once from the float32 decode of the second packet)."""
    assert run(world, job_bf16_bucket) == [True] * world


def job_slots(rank, world):
    """The scheme on its own context: its send, received and gathered slots against the layout
    built here (packet at the start of its slot, zeros after; empty chunks all zero)."""
    for spec in ("int4", "topk:ratio=0.3", "fp16"):
        codec = gradcomp.Codec(spec)
        for n in (1, 13, 1000):
            ctx = SchemeContext.for_layout("two_phase", codec, n, torch.float32, torch.device("cpu"), None, world)
            bounds = chunk_bounds(n, world)
            count = bounds[rank][1] - bounds[rank][0]
            r = torch.randn(n, generator=gen(3, n, rank)) * 0.1
            s = torch.randn(count, generator=gen(4, n, rank)) * 0.01
            g = torch.randn(n, generator=gen(5, n, rank))
            rec = {"g": g.clone(), "r0": r.numpy().copy(), "s0": s.numpy().copy()}
            t = g.clone()
            two_phase(t, ctx, {"residual": r, "server": s}).wait()
            recs = gather_all(rec)
            sim = simulate(spec, [x["g"] for x in recs], [x["r0"] for x in recs], [x["s0"] for x in recs])
            what = f"{spec} W={world} n={n} seed {SEED}"
            c = (n + world - 1) // world
            assert ctx.slot_bytes == (codec.packet_bytes(c), codec.packet_bytes(c)), what
            assert np.array_equal(ctx.packet.numpy(), sim["send"][rank]), what + ": send slots"
            assert np.array_equal(ctx.received.numpy(), sim["received"][rank]), what + ": received slots"
            assert np.array_equal(ctx.gathered.numpy(), sim["gathered"]), what + ": gathered slots"
            assert_same_bits(t.numpy(), sim["out"], what + ": result")
            assert_same_bits(r.numpy(), sim["r1s"][rank], what + ": worker residual")
            assert_same_bits(s.numpy(), sim["s1s"][rank], what + ": server residual")
    return True


@pytest.mark.parametrize("world", [3, 4])
def test_slot_layout(world):
    """Bitwise: the scheme's buffers are the slot layout (n = 1 leaves chunks empty)."""
    assert run(world, job_slots) == [True] * world


def job_nonfinite(rank, world, spec):
    n = 3001
    bounds = chunk_bounds(n, world)
    count = bounds[rank][1] - bounds[rank][0]
    for mode in ("restore", "reset"):
        comp = Compressor(spec, scheme="two_phase", nonfinite=mode, min_compress_numel=0)
        for step in range(4):
            what = f"{spec} {mode} W={world} step {step} seed {SEED}"
            t = seeded_input(n, rank, step, 6)
            if step == 2 and rank == 0:
                t[bounds[1][0] + 3] = float("nan")  # in chunk 1: the server of rank 1 sees it
            if step == 2:
                r0, s0 = worker_res(comp, "g", n), server_of(comp, count, name="g")
                with no_host_sync():
                    comp.allreduce(t, "g").wait()
                outs = gather_all(t.numpy().copy())
                for o in outs:
                    assert_same_bits(o, outs[0], what + ": ranks differ")
                assert not np.isfinite(outs[0]).all(), what
                r1, s1 = worker_res(comp, "g", n), server_of(comp, count, name="g")
                if mode == "restore":
                    assert_same_bits(r1, r0, what + ": worker residual not restored")
                    assert_same_bits(s1, s0, what + ": server residual not restored")
                    assert np.abs(r0).sum() > 0 and (count == 0 or np.abs(s0).sum() > 0), what
                else:
                    assert np.abs(r1).sum() == 0 and np.abs(s1).sum() == 0, what + ": not reset"
            else:
                compressed_step(comp, rank, world, spec, t, "g", what)
        assert comp.stats()["nonfinite_steps"] == 1, (mode, comp.stats()["nonfinite_steps"])
    return True


@pytest.mark.parametrize("world,spec", [(2, "int8"), (3, "fp8"), (3, "topk:ratio=0.1")])
def test_nonfinite_restores_worker_and_server(world, spec):
    """Bitwise: a NaN on rank 0 in rank 1's chunk makes every rank's result non-finite (identical
    bits); worker and server residuals restored (restore) or zeroed (reset), no host sync; the
    steps after it vs the simulation."""
    assert run(world, job_nonfinite, spec) == [True] * world


PARAMS_A = [("a", 0, 600), ("b", 600, 401)]
PARAMS_B = [("b", 0, 401), ("a", 401, 600)]


def bucket_input(rank, step, order):
    """The flat bucket holding a (600) and b (401) in ``order``, seeded per name."""
    parts = {"a": torch.randn(600, generator=gen(7, step, rank)), "b": torch.randn(401, generator=gen(8, step, rank))}
    return torch.cat([parts[k] for k, _, _ in order])


def by_name(comp, params):
    return {k: worker_res(comp, k, n) for k, _, n in params}


def flat_of(res, params):
    return np.concatenate([res[k] for k, _, _ in sorted(params, key=lambda p: p[1])]).astype(np.float32)


def bucket_step(comp, rank, world, spec, params, step, res0, s0, what, dense=False):
    """One allreduce_bucket(index 0) step checked bitwise against the simulation started from the
    worker residuals ``res0`` ({name: numpy}) and this rank's server residual ``s0``. Returns
    the residuals after it (by name) and the server residual after it."""
    t = bucket_input(rank, step, params)
    n = t.numel()
    g = t.clone()
    with no_host_sync():
        comp.allreduce_bucket(t, 0, params, dense=dense).wait()
    comp.end_step()
    bounds = chunk_bounds(n, world)
    count = bounds[rank][1] - bounds[rank][0]
    rec = {"g": g, "r0": flat_of(res0, params), "s0": s0, "out": t.numpy().copy()}
    recs = gather_all(rec)
    for r in range(world):
        assert_same_bits(recs[r]["out"], rec["out"], f"{what}: ranks differ")
    r1 = by_name(comp, params)
    s1 = server_of(comp, count, index=0)
    if dense:  # the flushed residual rides the dense allreduce: sum of fl(fl(g + r) / W)
        exp = f32(g.numpy() + rec["r0"]) / np.float32(world)
        exp = torch.from_numpy(f32(exp))
        dist.all_reduce(exp)
        assert_same_bits(rec["out"], exp.numpy(), what + ": dense flush != allreduce of (g + r) / W")
        assert all(np.abs(v).sum() == 0 for v in r1.values()) and np.abs(s1).sum() == 0, what
        return r1, s1
    sim = simulate(spec, [x["g"] for x in recs], [x["r0"] for x in recs], [x["s0"] for x in recs])
    assert_same_bits(rec["out"], sim["out"], f"{what}: result != simulation")
    assert_same_bits(flat_of(r1, params), sim["r1s"][rank], f"{what}: worker residual != simulation")
    assert_same_bits(s1, sim["s1s"][rank], f"{what}: server residual != simulation")
    return r1, s1


def job_rebuild_flush(rank, world, spec):
    """(a) a new layout at the same bucket index folds the server residual into the worker
    residuals; (b) a dense call flushes the folded residuals; then compression resumes."""
    W = world
    comp = Compressor(spec, scheme="two_phase", min_compress_numel=0)
    count_a = chunk_bounds(1001, W)[rank]
    count = count_a[1] - count_a[0]
    res, s = {"a": np.zeros(600, np.float32), "b": np.zeros(401, np.float32)}, np.zeros(count, np.float32)
    step = 0
    for _ in range(2):
        res, s = bucket_step(comp, rank, W, spec, PARAMS_A, step, res, s, f"{spec} layout A step {step} seed {SEED}")
        step += 1
    assert np.abs(s).sum() > 0 or count == 0
    # (a) rebuild: the test folds W * server into the residuals of the elements' parameters
    folded = {k: v.copy() for k, v in res.items()}
    fold(folded, {"start": count_a[0], "residual": s, "params": PARAMS_A}, W)
    layouts = comp.layouts()
    s = np.zeros(count, np.float32)  # the new layout's server residual starts at zero
    for _ in range(2):
        folded, s = bucket_step(comp, rank, W, spec, PARAMS_B, step, folded, s,
                                f"{spec} layout B step {step} seed {SEED}")
        step += 1
    assert comp.layouts() != layouts and comp.layouts()[0]["params"] == PARAMS_B
    # (b) a dense call: W * server folded, then every residual flushed into the bucket
    flushed = {k: v.copy() for k, v in folded.items()}
    fold(flushed, {"start": count_a[0], "residual": s, "params": PARAMS_B}, W)
    bucket_step(comp, rank, W, spec, PARAMS_B, step, flushed, None, f"{spec} dense step {step} seed {SEED}",
                dense=True)
    step += 1
    # compression resumes on the same layout from zero residuals, which are kept again
    zero = {"a": np.zeros(600, np.float32), "b": np.zeros(401, np.float32)}
    r1, s1 = bucket_step(comp, rank, W, spec, PARAMS_B, step, zero, np.zeros(count, np.float32),
                         f"{spec} after the flush step {step} seed {SEED}")
    assert np.abs(r1["a"]).sum() > 0 and set(comp.state_dict()["residuals"]) == {"a", "b"}
    return True


@pytest.mark.parametrize("world,spec", [(2, "int8"), (3, "int4"), (3, "topk:ratio=0.1"), (4, "fp8:scale=e8m0")])
def test_compressor_rebuild_and_dense_flush_fold_server(world, spec):
    """Bitwise: across a new layout at the same index (W * server folded into the worker residuals
    of the same elements, new server at zero) and a dense call (folded, then flushed: the
    allreduce of fl(g + r) / W), vs the simulation started from the folded residuals."""
    assert run(world, job_rebuild_flush, spec) == [True] * world


def job_checkpoint(rank, world, spec):
    W = world
    comp = Compressor(spec, scheme="two_phase", min_compress_numel=0)
    bounds = chunk_bounds(1001, W)
    count = bounds[rank][1] - bounds[rank][0]
    res, s = {"a": np.zeros(600, np.float32), "b": np.zeros(401, np.float32)}, np.zeros(count, np.float32)
    for step in range(3):
        res, s = bucket_step(comp, rank, W, spec, PARAMS_A, step, res, s, f"{spec} step {step} seed {SEED}")
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    entries = sd["server_residuals"]
    assert len(entries) == 1 and entries[0]["key"] == ("index", 0) and entries[0]["params"] == PARAMS_A
    assert (entries[0]["start"], entries[0]["count"], entries[0]["world_size"]) == (bounds[rank][0], count, W)
    assert_same_bits(entries[0]["residual"].numpy(), s, "saved server residual")
    # (d) the same layout: bit-exact, and both continue identically
    comp2 = Compressor(spec, scheme="two_phase", min_compress_numel=0)
    comp2.load_state_dict(sd)
    again = comp2.state_dict()["server_residuals"]  # pending until its layout comes: saved again
    assert len(again) == 1
    assert_same_bits(again[0]["residual"].numpy(), entries[0]["residual"].numpy(), "pending server residual")
    r2, s2 = res, s
    for step in range(3, 5):
        res, s = bucket_step(comp, rank, W, spec, PARAMS_A, step, res, s, f"{spec} original step {step} seed {SEED}")
        r2, s2 = bucket_step(comp2, rank, W, spec, PARAMS_A, step, r2, s2, f"{spec} loaded step {step} seed {SEED}")
        assert_same_bits(s, s2, f"step {step}: server residuals differ")
        for k in res:
            assert_same_bits(res[k], r2[k], f"step {step}: residual {k} differs")
    # (d) another layout at that index: the saved server residual is folded by its parameter map
    sd = comp.state_dict()
    comp3 = Compressor(spec, scheme="two_phase", min_compress_numel=0)
    comp3.load_state_dict(sd)
    folded = {k: v.copy() for k, v in res.items()}
    fold(folded, sd["server_residuals"][0], W)
    bucket_step(comp3, rank, W, spec, PARAMS_B, 5, folded, np.zeros(count, np.float32),
                f"{spec} loaded into another layout seed {SEED}")
    # (d) loaded into a live compressor whose layout differs: folded at once
    comp4 = Compressor(spec, scheme="two_phase", min_compress_numel=0)
    bucket_step(comp4, rank, W, spec, PARAMS_B, 0, {"a": np.zeros(600, np.float32), "b": np.zeros(401, np.float32)},
                np.zeros(count, np.float32), f"{spec} live seed {SEED}")
    comp4.load_state_dict(sd)
    assert comp4.state_dict()["server_residuals"][0]["params"] == PARAMS_B  # its own, zeroed
    assert float(comp4.server_residuals()[0]["residual"].abs().sum()) == 0.0
    folded4 = {k: worker_res(comp4, k, n) for k, _, n in PARAMS_A}
    for k in folded:
        assert_same_bits(folded4[k], folded[k], f"live load: residual {k} not folded")
    # (c) another world size: every residual dropped, server residuals too, with a warning
    check_world_size_change_drops(Compressor(spec, scheme="two_phase"), sd, world)
    comp5 = Compressor(spec, scheme="two_phase", min_compress_numel=0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        comp5.load_state_dict(dict(sd, world_size=world + 1))
    assert any("server residuals too" in str(x.message) for x in w)
    assert comp5.state_dict()["server_residuals"] == [] and comp5.state_dict()["residuals"] == {}
    with pytest.raises(ValueError, match="server residual of bucket 0 has"):
        bad = dict(sd, server_residuals=[dict(sd["server_residuals"][0], count=count + 1)])
        Compressor(spec, scheme="two_phase").load_state_dict(bad)
    return True


@pytest.mark.parametrize("world,spec", [(2, "int8"), (3, "topk:ratio=0.1")])
def test_compressor_checkpoint_server_residuals(world, spec):
    """Bitwise: the server residual saved with its layout, restored bit-exact (both continue
    identically), folded into another layout (vs the simulation from the folded residuals),
    dropped at another world size (a warning)."""
    assert run(world, job_checkpoint, spec) == [True] * world


def job_grad_scaler(rank, world, spec):
    """Loss scales 4, 8, 2 (powers of two, nothing near the limits: scaling commutes with the
    block scales and every rounding): the scaled run's worker and server residuals / scale equal
    those of the unscaled run, bitwise."""
    ts = [torch.randn(3000, generator=gen(10, step, rank)) for step in range(3)]
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    comp = Compressor(spec, scheme="two_phase", min_compress_numel=0)
    ref = Compressor(spec, scheme="two_phase", min_compress_numel=0)
    comp.attach_grad_scaler(scaler)
    for step, (t, sc) in enumerate(zip(ts, (4.0, 8.0, 2.0))):
        scaler.update(sc)
        with no_host_sync():
            comp.allreduce(t * sc, "g").wait()
        ref.allreduce(t.clone(), "g").wait()
        what = f"{spec} step {step} scale {sc} seed {SEED}"
        assert_same_bits(comp.residual("g").numpy() / np.float32(sc), ref.residual("g").numpy(), what + ": worker")
        a, b = comp.server_residuals()[0]["residual"], ref.server_residuals()[0]["residual"]
        assert_same_bits(a.numpy() / np.float32(sc), b.numpy(), what + ": server")
        assert float(b.abs().sum()) > 0, what
    return True


@pytest.mark.parametrize("spec", ["int8", "fp8"])
def test_grad_scaler_rescales_server_residuals(spec):
    """Bitwise: with attach_grad_scaler, worker and server residuals follow the loss scale."""
    assert run(2, job_grad_scaler, spec) == [True, True]


def job_auto(rank, world):
    for spec, n, want in (("int8", 4096, "two_phase"), ("fp8", 4096, "two_phase"), ("int4", 100, "dense"),
                          ("topk:ratio=0.01", 4096, "gather"), ("fp16", 4096, "sum")):
        comp = Compressor(spec, min_compress_numel=1024)
        comp.allreduce(torch.randn(n, generator=gen(9, n, rank)), "x").wait()
        assert comp.scheme_of("x") == want, (spec, n, comp.scheme_of("x"))
    return True


def test_auto_picks_two_phase_for_quantizers():
    """No numerics: auto's choice per codec family, through the Compressor."""
    assert run(2, job_auto) == [True, True]


# ---------------------------------------------------------------------------------------------
# the DDP hook


def recording(state, ddp_model):
    """A hook wrapper that records per call: input bucket, parameter map, worker residuals before
    and after, this rank's server residual after, output and scheme."""
    log = []

    def hook(st, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        params = bucket.parameters()
        base = buf.storage_offset()
        names = [st.param_name(p) for p in params]
        pmap = [(nm, g.storage_offset() - base, p.numel()) for nm, g, p in zip(names, bucket.gradients(), params)]
        rec = {"step": st.iter, "index": bucket.index(), "params": pmap, "buf": buf.detach().float().clone(),
               "joined": st.joined}
        fut = gt.compression_hook(st, bucket)
        rec["scheme"] = st.stats()["buckets"][-1]["scheme"]

        def after(f):
            out = f.value()
            rec["out"] = out.detach().float().clone()
            rec["res_after"] = {nm: st.residual(nm).numpy() for nm, _, _ in pmap}
            rec["server_after"] = [e for e in st.compressor.server_residuals() if e.get("index") == rec["index"]]
            log.append(rec)
            return out

        return fut.then(after)

    ddp_model.register_comm_hook(state, hook)
    return log


def check_hook_log(rank, world, spec, log, init=None, nonfinite_steps=(), zero_after=()):
    """Every call of every rank: ranks agree; compressed calls vs the simulation, dense calls vs
    the allreduce of fl(g + r) / W (W = 2: order-free). The expected residuals are tracked here
    from the previous step: a layout that changed (another parameter map at its index, or a
    parameter of it now elsewhere) has its server residual folded into the worker residuals by
    its map and a new layout starts from server zero. ``init``: ({name: residual}, [server
    entries]) before the first step (a loaded checkpoint, folded unless its layout recurs)."""
    logs = gather_all(log)
    calls = {}
    for r, lg in enumerate(logs):
        for rec in lg:
            calls.setdefault((rec["step"], rec["index"]), [None] * world)[r] = rec
    res = [{} for _ in range(world)]  # per rank: {name: expected worker residual}
    prev = {}  # index -> (parameter map, [server entry per rank]) of the last step's two_phase layouts
    if init:
        inits = gather_all(init)
        res = [{k: f32(v).copy() for k, v in ini[0].items()} for ini in inits]
        for r, ini in enumerate(inits):
            for e in ini[1]:
                prev.setdefault(e["key"][1], (e["params"], [None] * world))[1][r] = e
    checked = 0
    for step in sorted({s for s, _ in calls}):
        here = {i: calls[(step, i)] for s, i in calls if s == step}
        homes = {nm: (i, o) for i, recs in here.items() for nm, o, _ in recs[0]["params"]}
        servers = {}
        for i, (params, entries) in prev.items():
            same = i in here and here[i][0]["params"] == params and here[i][0]["scheme"] == "two_phase"
            if same and all(homes.get(nm) == (i, o) for nm, o, _ in params):
                servers[i] = entries
                continue
            for r in range(world):  # folded: W * server into the worker residuals of its elements
                if entries[r] is not None:
                    fold(res[r], dict(entries[r], params=params), world)
        for i, recs in sorted(here.items()):
            what = f"{spec} step {step} bucket {i} seed {SEED}"
            assert all(rc is not None for rc in recs), what + ": not every rank ran the hook"
            for rc in recs:
                assert_same_bits(rc["out"].numpy(), recs[0]["out"].numpy(), what + ": ranks differ")
            params = recs[0]["params"]
            n = recs[0]["buf"].numel()
            r0s = [np.concatenate([res[r].get(nm, np.zeros(ln, np.float32)) for nm, _, ln in
                                   sorted(params, key=lambda p: p[1])]).astype(np.float32) for r in range(world)]
            for r in range(world):
                if recs[r]["joined"]:
                    r0s[r] = np.zeros(n, np.float32)
            if recs[0]["scheme"] == "dense":
                assert world == 2, "dense calls are checked for W = 2 (a two-term sum)"
                terms = [f32(f32(rc["buf"].numpy() + r0) / np.float32(world)) for rc, r0 in zip(recs, r0s)]
                assert_same_bits(recs[rank]["out"].numpy(), f32(terms[0] + terms[1]), what + ": dense flush")
                for r in range(world):
                    for nm, _, ln in params:
                        res[r][nm] = np.zeros(ln, np.float32)
                checked += 1
                continue
            assert recs[0]["scheme"] == "two_phase", what
            bounds = chunk_bounds(n, world)
            s0s = [servers[i][r]["residual"].numpy() if i in servers else np.zeros(b - a, np.float32)
                   for r, (a, b) in enumerate(bounds)]
            gs = [torch.zeros(n) if rc["joined"] else rc["buf"].to(torch.float32) for rc in recs]
            sim = simulate(spec, gs, r0s, s0s)
            if step not in nonfinite_steps:
                assert_same_bits(recs[rank]["out"].numpy(), sim["out"], what + ": result != simulation")
            for r in range(world):
                rc = recs[r]
                if step in nonfinite_steps or step in zero_after:
                    kept = {nm: r0s[r][o: o + ln] for nm, o, ln in params}
                    if step in zero_after:
                        kept = {nm: np.zeros(ln, np.float32) for nm, _, ln in params}
                    new_s = np.zeros_like(s0s[r]) if step in zero_after else s0s[r]
                else:
                    kept = {nm: sim["r1s"][r][o: o + ln] for nm, o, ln in params}
                    new_s = sim["s1s"][r]
                if rc["joined"]:
                    kept = {nm: res[r].get(nm, np.zeros(ln, np.float32)) for nm, _, ln in params}
                for nm, v in kept.items():
                    res[r][nm] = v.copy()
                    if r == rank:
                        assert_same_bits(rc["res_after"][nm], v, f"{what}: worker residual {nm}")
                got = rc["server_after"][0]
                assert (got["start"], got["start"] + got["count"]) == bounds[r], what
                if r == rank:
                    assert_same_bits(got["residual"].numpy(), new_s, what + ": server residual")
                rc["server_after"][0]["residual"] = torch.from_numpy(np.asarray(new_s, np.float32).copy())
            checked += 1
        prev = {i: (recs[0]["params"], [rc["server_after"][0] if rc["server_after"] else None for rc in recs])
                for i, recs in here.items() if recs[0]["scheme"] == "two_phase"}
    return checked, res[rank]


def job_hook_rebuild(rank, world, spec, min_numel):
    torch.manual_seed(0)
    m = ddp(Reordered(), bucket_cap_mb=1200 * 4 / 2 ** 20)
    st = gt.CompressionState(m, codec=spec, scheme="two_phase", min_compress_numel=min_numel, exempt=())
    log = recording(st, m)
    g = torch.Generator().manual_seed(SEED + rank)
    layouts = []
    for step in range(4):
        m.zero_grad()
        x = torch.randn(16, 8, generator=g)
        with no_host_sync():
            m(x).square().mean().backward()
        layouts.append([(lay["index"], tuple(lay["params"])) for lay in st.bucket_layouts()])
    assert layouts[0] != layouts[-1], "the bucket layout was expected to be rebuilt"
    if min_numel:  # a.weight went into a bucket of its own, below min_compress_numel: flushed
        flushed = [rc for rc in log if rc["step"] == 1 and [p[0] for p in rc["params"]] == ["a.weight"]]
        assert len(flushed) == 1 and flushed[0]["scheme"] == "dense", [(rc["step"], rc["params"]) for rc in log]
    checked, _ = check_hook_log(rank, world, spec, log)
    assert checked == len(log)
    return checked


@pytest.mark.parametrize("world,spec,min_numel", [(2, "int8", 500), (2, "topk:ratio=0.1", 500), (3, "fp8", 0)])
def test_hook_rebuild_and_flush(world, spec, min_numel):
    """Bitwise: every bucket of 4 steps across DDP's rebuild vs the simulation with the server
    residuals folded by the test; with min_compress_numel=500 a.weight moves into a dense bucket
    and its folded residual is flushed into it (W = 2, vs the sum of fl(g + r) / W)."""
    res = run(world, job_hook_rebuild, spec, min_numel)
    assert len(set(res)) == 1 and res[0] >= 4


class InOrder(Params):
    """Params whose gradients become ready in registration order (the sum runs backwards), so
    DDP's rebuilt buckets equal its initial ones: a new DDP model's first step then has the
    saved layout (with Params the rebuild reverses the bucket, and a loaded server residual is
    folded, as the test of another bucketing checks)."""

    def forward(self, gs):
        return sum((p * g).sum() for p, g in reversed(list(zip(self.ps, gs))))


def _params_model(rank, shapes, cap, spec, steps, **kw):
    torch.manual_seed(0)
    base = InOrder(shapes)
    m = ddp(copy.deepcopy(base), bucket_cap_mb=cap)
    st = gt.register(m, codec=spec, scheme="two_phase", min_compress_numel=0, exempt=(), **kw)
    for step in range(steps):
        m.zero_grad()
        m(grads_for(base, rank, step, seed=SEED)).backward()
    return base, m, st


def job_hook_checkpoint(rank, world, spec):
    shapes = [(500,), (20, 30), ()]
    base, m1, st1 = _params_model(rank, shapes, 1, spec, 3)
    buf = io.BytesIO()
    torch.save(st1.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    assert len(sd["server_residuals"]) == 1 and sd["server_residuals"][0]["world_size"] == world
    # the same bucketing: bit-exact, and both continue identically; so does a pickled state
    assert [p for _, _, p in sorted(st1.bucket_layouts()[0]["params"], key=lambda q: q[1])] == [500, 600, 1]
    m2 = ddp(copy.deepcopy(base))
    st2 = gt.register(m2, codec=spec, scheme="two_phase", min_compress_numel=0, exempt=())
    st2.load_state_dict(sd)
    m5 = ddp(copy.deepcopy(base))
    st5 = gt.register(m5, state=pickle.loads(pickle.dumps(st1)))
    for step in range(3, 5):
        for m in (m1, m2, m5):
            m.zero_grad()
            m(grads_for(base, rank, step, seed=SEED)).backward()
        for p, q, r in zip(m1.parameters(), m2.parameters(), m5.parameters()):
            assert torch.equal(p.grad.view(torch.int32), q.grad.view(torch.int32)), f"step {step} seed {SEED}"
            assert torch.equal(p.grad.view(torch.int32), r.grad.view(torch.int32)), f"pickled: step {step} seed {SEED}"
        a, b, c = (st.compressor.server_residuals() for st in (st1, st2, st5))
        assert len(a) == len(b) == len(c) == 1
        assert torch.equal(a[0]["residual"].view(torch.int32), b[0]["residual"].view(torch.int32))
        assert torch.equal(a[0]["residual"].view(torch.int32), c[0]["residual"].view(torch.int32))
    # another bucketing (several small buckets): folded by the saved parameter map; first steps
    # vs the simulation started from the folded residuals
    sd = st1.state_dict()
    m3 = ddp(copy.deepcopy(base), bucket_cap_mb=2000 / 2 ** 20)
    st3 = gt.CompressionState(m3, codec=spec, scheme="two_phase", min_compress_numel=0, exempt=())
    log = recording(st3, m3)
    st3.load_state_dict(sd)
    for step in range(5, 7):
        m3.zero_grad()
        with no_host_sync():
            m3(grads_for(base, rank, step, seed=SEED)).backward()
    assert len({rc["index"] for rc in log}) > 1
    init = ({k: v.numpy() for k, v in sd["residuals"].items()}, sd["server_residuals"])
    checked, _ = check_hook_log(rank, world, spec, log, init=init)
    assert checked == len(log)
    # (c) another world size: residuals and server residuals dropped, with a warning
    st4 = gt.register(ddp(copy.deepcopy(base)), codec=spec, scheme="two_phase", min_compress_numel=0, exempt=())
    check_world_size_change_drops(st4, sd, world)
    assert st4.state_dict()["server_residuals"] == []
    # a server residual naming a parameter the model does not have
    with pytest.raises(KeyError, match="server residual names no parameter"):
        st4.load_state_dict(dict(sd, residuals={}, server_residuals=[
            dict(sd["server_residuals"][0], params=[("nope", 0, 5)])]))
    return checked


@pytest.mark.parametrize("world,spec", [(2, "int4"), (3, "int8")])
def test_hook_checkpoint_server_residuals(world, spec):
    """Bitwise: a hook checkpoint restores the server residual into the same bucket layout (both
    models continue identically), folds it into another bucketing (vs the simulation), and drops
    it at another world size."""
    res = run(world, job_hook_checkpoint, spec)
    assert len(set(res)) == 1 and res[0] >= 2


def job_hook_nonfinite(rank, world, spec, mode):
    shapes = [(300,), (5, 7), (700,)]
    m = ddp(Params(shapes))
    st = gt.CompressionState(m, codec=spec, scheme="two_phase", min_compress_numel=0, nonfinite=mode, exempt=())
    log = recording(st, m)
    for s in range(5):
        gs = grads_for(m.module, rank, s, seed=SEED)
        if s == 2 and rank == 0:
            gs[2][650] = float("nan")
        m.zero_grad()
        with no_host_sync():
            m(gs).backward()
        fin = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
        assert fin == (s != 2), (s, fin)
    bad = [rc for rc in log if rc["step"] == 2]
    assert bad
    checked, _ = check_hook_log(rank, world, spec, log, nonfinite_steps=(2,),
                                zero_after=(2,) if mode == "reset" else ())
    assert st.stats()["nonfinite_steps"] == 1
    return checked


@pytest.mark.parametrize("world,spec,mode", [(2, "fp8", "restore"), (3, "int8", "reset")])
def test_hook_nonfinite_worker_and_server(world, spec, mode):
    """Bitwise: the non-finite step restores (zeroes) worker and server residuals, the others vs
    the simulation; no host synchronization inside backward."""
    res = run(world, job_hook_nonfinite, spec, mode)
    assert len(set(res)) == 1 and res[0] == 5


def job_hook_join(rank, world, spec):
    shapes = [(600,), (41,)]
    m = ddp(Params(shapes))
    st = gt.CompressionState(m, codec=spec, scheme="two_phase", min_compress_numel=0, exempt=())
    log = recording(st, m)
    steps = 2 if rank == 0 else 4
    with m.join():
        for s in range(steps):
            m.zero_grad()
            m(grads_for(m.module, rank, s, seed=SEED)).backward()
    assert [rc["step"] for rc in log if rc["joined"]] == ([2, 3] if rank == 0 else [])
    checked, _ = check_hook_log(rank, world, spec, log)
    return checked


def test_hook_join_serves_its_chunk():
    """Bitwise: a joined rank sends zeros, keeps its worker residual and still sums its chunk with
    its server residual (vs the simulation)."""
    res = run(2, job_hook_join, "int8")
    assert res == [4, 4]
