"""Policies the DDP hook and the Compressor accept (gradcomp.torch.policy): per-parameter exemptions
(``exempt=``) and a codec ramp (``ramp=``), on real gloo process groups (2 and 3 CPU processes,
spawn; the session's pools, gloo_pools.py). The assertions run inside the ranks; inputs are seeded
(SEED, rank, step) and the messages name the seed.

Bitwise comparisons (floats compared as integer views, so NaN and -0.0 count):
  - exempt parameters of a bucket (the hook's default: fewer than 2 dimensions) against PyTorch's
    allreduce_hook on a twin DDP model (W = 2: a two-term sum is order-free) and, on every W,
    against ``dist.all_reduce(x / W)`` of the same exempt elements in bucket order (what the dense
    part is: the same length, so gloo sums every element in the same order);
  - the compressed parameters of the same buckets against the independent numpy reference of
    ddp_helpers.topk_average_ref over the compressed part (x' = g + r over the non-exempt elements
    in bucket order, q = x' / W, exact top-k, rank-order float32 sums, residual x' - W * D), over
    several steps (residuals carry over, across DDP's rebuild), outputs and residuals;
  - a bias in a bucket with a large weight: exempt, it is allreduce_hook's average; compressed
    (``exempt=()``) through int8 it takes the block's scale (error checked, not bitwise);
  - name patterns and callables (Compressor buckets, a single exempt name, the DDP hook's
    callable given the Parameter): the same two references;
  - a parameter that becomes exempt while it holds a residual (the setter; a checkpoint from a
    run with ``exempt=()``): its output is sum_r fl(fl(g_r + r_r) / W) (W = 2), with a two_phase
    server residual folded first (r_r + fl(W * s_r) on the rank's chunk), and it holds no residual
    after;
  - the ramp: each step's codec and packet bytes (the planner's per-codec formulas) on every rank;
    a Compressor switched by its ramp against one of the new codec loaded with the old one's
    state_dict (top-k: as saved; two_phase: the server residual folded by hand, W x s added to the
    worker residual of its chunk), outputs and residuals, two steps after the switch;
  - the byte totals of a run with a dense warm-up (the ramp's "dense" steps, the hook's start_iter)
    against sums written here from the formulas (dense: 2 (W-1)/W of the bytes; gather: (W-1)
    packets; two_phase: (W-1) (P1 + P2)).
Bad arguments (ramp entries, exempt types) are checked without a process group. No tolerances
except the bias-scale test's error bounds (stated there).
"""

import copy
import logging
import pickle
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402

import gradcomp  # noqa: E402
import gradcomp.torch as gt  # noqa: E402
from gradcomp import planner  # noqa: E402
from gradcomp.torch import Compressor  # noqa: E402

from ddp_helpers import Params, bits, ddp, grads_for, no_host_sync, recording, run, topk_average_ref  # noqa: E402

SEED = 20261230


# ---------------------------------------------------------------------------------------------
# helpers used inside the ranks


def same_bits(a, b) -> bool:
    return np.array_equal(bits(np.asarray(a, dtype=np.float32)), bits(np.asarray(b, dtype=np.float32)))


def tensor_for(shape, rank, step, tag, scale=1.0):
    g = torch.Generator().manual_seed(SEED + 1000003 * tag + 101 * step + rank)
    return torch.randn(shape, generator=g) * scale


def parts(rec, exempt):
    """(exempt element indices, compressed element indices, [(name, staged offset, length)] of the
    compressed parameters) of a recorded bucket call: the exempt parameters' elements in bucket
    order, and every other element in bucket order (the compressed part)."""
    n = rec["buf"].numel()
    is_ex = np.zeros(n, dtype=bool)
    for nm, o, ln in zip(rec["names"], rec["offsets"], rec["lengths"]):
        if nm in exempt:
            is_ex[o: o + ln] = True
    ex_idx, comp_idx = np.nonzero(is_ex)[0], np.nonzero(~is_ex)[0]
    staged = np.cumsum(~is_ex) - 1
    comp_params = sorted(((nm, int(staged[o]), ln) for nm, o, ln in zip(rec["names"], rec["offsets"], rec["lengths"])
                          if nm not in exempt and ln), key=lambda e: e[1])
    return ex_idx, comp_idx, comp_params


def gathered_calls(world, log):
    """Every rank's recorded calls, by (step, bucket index): [record of rank 0, 1, ...]."""
    logs = [None] * world
    dist.all_gather_object(logs, log)
    calls = {}
    for r, lg in enumerate(logs):
        for rec in lg:
            calls.setdefault((rec["step"], rec["index"]), [None] * world)[r] = rec
    return calls


def check_split_calls(rank, world, log, exempt, ratio, what):
    """Each recorded call of a hook with exempt parameters: the compressed part vs the numpy top-k
    reference (gather; outputs and residuals), the exempt part vs dist.all_reduce(x / W) of the
    same elements, exempt parameters with no residual after. Returns the number of calls checked."""
    checked = 0
    for (step, index), recs in sorted(gathered_calls(world, log).items()):
        assert all(rc is not None for rc in recs), f"{what} step {step} bucket {index}: not every rank ran the hook"
        mine = recs[rank]
        ex_idx, comp_idx, comp_params = parts(mine, exempt)
        where = f"{what} step {step} bucket {index} seed {SEED}"
        xps = []
        for rc in recs:
            buf = rc["buf"].numpy()
            rb = np.zeros(comp_idx.size, dtype=np.float32)
            for nm, at, ln in comp_params:
                rb[at: at + ln] = rc["res_before"][nm].numpy()
            xps.append((buf[comp_idx] + rb).astype(np.float32))
        if comp_idx.size:
            exp, res = topk_average_ref(xps, ratio, mine["dtype"])
            out = mine["out"].numpy()
            assert same_bits(out[comp_idx], exp), where + ": compressed part != reference"
            for nm, at, ln in comp_params:
                assert same_bits(mine["res_after"][nm].numpy(), res[rank][at: at + ln]), where + f": residual {nm}"
        if ex_idx.size:
            t = torch.from_numpy(mine["buf"].numpy()[ex_idx].copy()) / world
            dist.all_reduce(t)  # the same length on every rank: gloo sums each element alike
            assert same_bits(mine["out"].numpy()[ex_idx], t.numpy()), where + ": exempt part != dense allreduce"
            for nm in mine["names"]:
                if nm in exempt:
                    assert float(mine["res_after"][nm].abs().sum()) == 0.0, where + f": {nm} holds a residual"
        checked += 1
    return checked


# ---------------------------------------------------------------------------------------------
# exemptions through the DDP hook


INTERLEAVED = [(300,), (20, 30), (7,), (40, 25), ()]  # exempt: ps.0, ps.2, ps.4 (not contiguous: staged)
GROUPED = [(30, 20), (40, 25), (300,), (50,)]  # exempt: ps.2, ps.3 (contiguous: views)


def job_exempt_default(rank, world, shapes):
    ratio = 0.1
    torch.manual_seed(0)
    base = Params(shapes)
    m = ddp(copy.deepcopy(base))
    st = gt.CompressionState(m, codec=f"topk:ratio={ratio}", scheme="gather", min_compress_numel=0)
    assert st.exempt is None
    log = recording(st, m)
    ref = ddp(copy.deepcopy(base))
    ref.register_comm_hook(None, default_hooks.allreduce_hook)
    exempt = {n for n, p in base.named_parameters() if p.dim() < 2}
    W = world
    for step in range(4):
        gs = grads_for(base, rank, step, seed=SEED)
        for mm in (m, ref):
            mm.zero_grad()
            with no_host_sync():
                mm([g.clone() for g in gs]).backward()
        if W == 2:  # allreduce_hook itself: (a / 2) + (b / 2) in any order
            for (n, p), q in zip(m.module.named_parameters(), ref.module.parameters()):
                if n in exempt:
                    assert same_bits(p.grad.numpy(), q.grad.numpy()), f"step {step} {n}: != allreduce_hook ({SEED})"
        bks = st.stats()["buckets"]
        assert sorted(b.get("part", "") for b in bks) == ["compressed", "exempt"], bks
        by = {b["part"]: b for b in bks}
        n_ex = sum(p.numel() for n, p in base.named_parameters() if n in exempt)
        n_all = sum(p.numel() for p in base.parameters())
        assert (by["exempt"]["scheme"], by["exempt"]["numel"]) == ("dense", n_ex)
        assert (by["compressed"]["scheme"], by["compressed"]["numel"]) == ("gather", n_all - n_ex)
        assert by["exempt"]["sent_bytes"] == 2 * (W - 1) / W * 4 * n_ex  # a dense ring allreduce
        assert by["compressed"]["sent_bytes"] == (W - 1) * st.codec.packet_bytes(n_all - n_ex)
        assert st.stats()["step"]["codec"] == f"topk:ratio={ratio}"
    assert st.exempted() == sorted(exempt)
    (lay,) = st.bucket_layouts()
    assert sorted(lay["exempt"]) == sorted(exempt), lay
    assert lay["numel"] == n_all and lay["compressed_numel"] == n_all - n_ex and lay["scheme"] == "gather"
    assert set(st.state_dict()["residuals"]) == {n for n, _ in base.named_parameters()} - exempt
    for n in exempt:
        assert float(st.residual(n).abs().sum()) == 0.0
    return check_split_calls(rank, world, log, exempt, ratio, f"W={W} {shapes}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shapes", [INTERLEAVED, GROUPED], ids=["staged", "views"])
def test_exempt_parameters_dense_others_compressed(world, shapes):
    """Bitwise: with the default exempt=None the 1-D and 0-D parameters are allreduce_hook's average
    (W = 2) and the dense allreduce of their elements (every W), the 2-D ones the top-k reference of
    the compressed part; outputs and residuals over 4 steps; stats count both parts."""
    res = run(world, job_exempt_default, shapes)
    assert len(set(res)) == 1 and res[0] >= 4


def job_exempt_dense_steps(rank, world):
    """Exempt parameters with dense steps between compressed ones (start_iter, a "dense" step of the
    ramp): the compressed parameters' residuals live on across them (flushed by the dense step,
    then homed again in the compressed part's layout)."""
    ratio = 0.1
    W = world
    torch.manual_seed(0)
    base = Params(INTERLEAVED)
    m = ddp(copy.deepcopy(base))
    st = gt.CompressionState(m, codec=f"topk:ratio={ratio}", scheme="gather", min_compress_numel=0, start_iter=1,
                             ramp=[(3, "dense"), (4, f"topk:ratio={ratio}")])
    log = recording(st, m)
    exempt = {n for n, p in base.named_parameters() if p.dim() < 2}
    codecs = []
    for step in range(7):
        m.zero_grad()
        m(grads_for(base, rank, step, seed=SEED)).backward()
        codecs.append(st.stats()["step"]["codec"])
        held = {k for k, v in st.state_dict()["residuals"].items() if float(v.abs().sum()) > 0}
        if codecs[-1] != "dense":
            assert held == {n for n, _ in base.named_parameters()} - exempt, (step, held)
    assert codecs == ["dense", f"topk:ratio={ratio}", f"topk:ratio={ratio}", "dense"] + [f"topk:ratio={ratio}"] * 3
    dense_steps = {0, 3}
    # the dense steps: every residual flushed into the bucket, then divide by W and SUM allreduce
    for (step, index), recs in sorted(gathered_calls(world, log).items()):
        if step not in dense_steps:
            continue
        rec = recs[rank]
        x = rec["buf"].clone()
        for nm, o, ln in zip(rec["names"], rec["offsets"], rec["lengths"]):
            x[o: o + ln] += rec["res_before"][nm]
        t = x / W
        dist.all_reduce(t)
        assert same_bits(rec["out"].numpy(), t.numpy()), f"dense step {step} (seed {SEED})"
        assert all(float(v.abs().sum()) == 0.0 for v in rec["res_after"].values())
    compressed = [rc for rc in log if rc["step"] not in dense_steps]
    return check_split_calls(rank, world, compressed, exempt, ratio, "dense steps")


def test_exempt_across_dense_steps():
    """Bitwise: dense steps (start_iter, the ramp's "dense") flush every residual into the dense
    allreduce; the compressed steps around them vs the reference, residuals carried over."""
    res = run(2, job_exempt_dense_steps)
    assert res[0] == res[1] and res[0] >= 5


def job_bias_scale(rank, world):
    shapes = [(64, 64), (100,)]
    torch.manual_seed(0)
    base = Params(shapes)
    models = {"default": ddp(copy.deepcopy(base)), "all": ddp(copy.deepcopy(base)), "ref": ddp(copy.deepcopy(base))}
    gt.register(models["default"], codec="int8", min_compress_numel=0)
    gt.register(models["all"], codec="int8", min_compress_numel=0, exempt=())
    models["ref"].register_comm_hook(None, default_hooks.allreduce_hook)
    g = torch.Generator().manual_seed(SEED + rank)
    gs = [torch.randn(64, 64, generator=g) * 1000.0, torch.randn(100, generator=g) * 0.01]
    for mm in models.values():
        mm([x.clone() for x in gs]).backward()
    bias = {k: mm.module.ps[1].grad for k, mm in models.items()}
    weight = {k: mm.module.ps[0].grad for k, mm in models.items()}
    # exempt (the default): the dense average itself
    assert same_bits(bias["default"].numpy(), bias["ref"].numpy()), f"seed {SEED}"
    # compressed with its 1000x larger block-mates: int8's block scale (amax / 127, about 25 here)
    # is 10^4 times the bias, which rounds to nothing: relative error near 1
    rel = float((bias["all"] - bias["ref"]).abs().mean() / bias["ref"].abs().mean())
    assert rel > 0.5, rel
    # the weight is compressed either way (a few int8 steps of error)
    for k in ("default", "all"):
        assert float((weight[k] - weight["ref"]).abs().max()) < 0.05 * float(weight["ref"].abs().max()), k
    return rel


def test_bias_no_longer_takes_a_large_block_scale():
    """Bitwise: the exempt bias equals allreduce_hook's; error bound: with exempt=() int8 shares a
    block scale with 1000x larger weights and the bias's mean relative error exceeds 50%."""
    res = run(2, job_bias_scale)
    assert res[0] == res[1]


# ---------------------------------------------------------------------------------------------
# patterns and callables


CALLS = []


def vectors_and_heads(name, shape):
    """A module-level rule (pickles by reference): a map entry with a length only, or fewer than 2
    dimensions, or a name ending in head.weight."""
    CALLS.append(name)
    return isinstance(shape, int) or len(shape) < 2 or name.endswith("head.weight")


SEEN = []


def param_rule(name, p):
    SEEN.append(type(p).__name__)
    return p.dim() < 2 and name != "ps.3"


def job_patterns_and_callables(rank, world):
    W = world
    ratio = 0.1
    # (a) a Compressor bucket with name patterns: tok_embed.weight (pattern) and head.bias (a name)
    params = [("tok_embed.weight", 0, (50, 20)), ("body.weight", 1000, (40, 40)), ("head.bias", 2600, 10),
              ("head.weight", 2610, (10, 40))]
    comp = Compressor(f"topk:ratio={ratio}", scheme="gather", min_compress_numel=0, exempt=["*embed*", "head.bias"])
    assert comp.exempt == ("*embed*", "head.bias")
    for step in range(3):
        t = tensor_for(3010, rank, step, 1)
        t0 = t.clone()
        held = comp.state_dict()["residuals"]
        res_before = {n: held[n] if n in held else torch.zeros(ln if isinstance(ln, int) else int(np.prod(ln)))
                      for n, _, ln in params}
        comp.allreduce_bucket(t, 0, params).wait()
        comp.end_step()
        ex = torch.cat([t0[0:1000], t0[2600:2610]]) / W
        dist.all_reduce(ex)
        got_ex = torch.cat([t[0:1000], t[2600:2610]])
        assert same_bits(got_ex.numpy(), ex.numpy()), f"patterns step {step} seed {SEED}"
        xp = torch.cat([t0[1000:2600] + res_before["body.weight"], t0[2610:3010] + res_before["head.weight"]])
        xps = [None] * W
        dist.all_gather_object(xps, xp.numpy())
        exp, res = topk_average_ref(xps, ratio, "torch.float32")
        assert same_bits(torch.cat([t[1000:2600], t[2610:3010]]).numpy(), exp), f"patterns step {step}"
        assert same_bits(comp.residual("body.weight").numpy(), res[rank][:1600])
        assert same_bits(comp.residual("head.weight").numpy(), res[rank][1600:])
    assert comp.exempted() == ["head.bias", "tok_embed.weight"]
    assert set(comp.state_dict()["residuals"]) == {"body.weight", "head.weight"}
    (lay,) = comp.layouts()
    assert lay["exempt"] == ["tok_embed.weight", "head.bias"] and lay["compressed_numel"] == 2000
    assert [(b["part"], b["scheme"], b["numel"]) for b in comp.stats()["buckets"]] == [
        ("compressed", "gather", 2000), ("exempt", "dense", 1010)]
    # a single exempt name goes dense: dist.all_reduce(x / W) itself
    x = tensor_for((30, 40), rank, 9, 2)
    want = x / W
    dist.all_reduce(want)
    comp.allreduce(x, "word_embed").wait()
    assert comp.scheme_of("word_embed") == "dense" and same_bits(x.numpy(), want.numpy())
    # (b) a callable, given the entry's shape (or its length); called once per parameter
    CALLS.clear()
    comp2 = Compressor(f"topk:ratio={ratio}", scheme="gather", min_compress_numel=0, exempt=vectors_and_heads)
    params2 = [("a.weight", 0, (30, 40)), ("a.bias", 1200, (30,)), ("n", 1230, 5), ("head.weight", 1235, (4, 30))]
    for step in range(3):
        comp2.allreduce_bucket(tensor_for(1355, rank, step, 3), 7, params2).wait()
        comp2.end_step()
    assert sorted(CALLS) == sorted(n for n, _, _ in params2), CALLS
    assert comp2.exempted() == ["a.bias", "head.weight", "n"]
    # (c) the DDP hook's callable gets the Parameter; a pickled state keeps exempt and ramp
    SEEN.clear()
    torch.manual_seed(0)
    base = Params([(300,), (20, 30), (50,), (40,)])
    m = ddp(copy.deepcopy(base))
    st = gt.register(m, codec="topk:ratio=0.1", min_compress_numel=0, exempt=param_rule)
    m(grads_for(base, rank, 0, seed=SEED)).backward()
    assert set(SEEN) == {"Parameter"} and len(SEEN) == 4, SEEN
    assert st.exempted() == ["ps.0", "ps.2"]
    st.exempt = ["ps.1"]  # the setter
    assert st.exempt == ("ps.1",)
    st2 = pickle.loads(pickle.dumps(st))
    assert st2.exempt == ("ps.1",) and st2.compressor.exempt == ("ps.1",)
    st.exempt = param_rule
    assert pickle.loads(pickle.dumps(st)).exempt is param_rule
    st.exempt = lambda n, p: True  # cannot be pickled: left out, with a warning; the default rule then
    records = []
    h = logging.Handler(logging.WARNING)
    h.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("gradcomp").addHandler(h)
    try:
        st3 = pickle.loads(pickle.dumps(st))
    finally:
        logging.getLogger("gradcomp").removeHandler(h)
    assert st3.exempt is None and any("cannot be pickled" in r for r in records), records
    st4 = gt.CompressionState(ddp(copy.deepcopy(base)), codec="topk:ratio=0.1", exempt=["ps.*"],
                              ramp=[(0, "dense"), (2, "topk:ratio=0.25")])
    st5 = pickle.loads(pickle.dumps(st4))
    assert st5.exempt == ("ps.*",) and st5.ramp == [(0, "dense"), (2, "topk:ratio=0.25")]
    return True


def test_patterns_and_callables():
    """Bitwise: pattern-exempt parameters of a Compressor bucket vs dist.all_reduce(x / W), the
    others vs the top-k reference; a single exempt name goes dense; a callable runs once per
    parameter and, in the DDP hook, receives the Parameter; exempt and ramp survive a pickle."""
    assert run(2, job_patterns_and_callables) == [True, True]


def no_residual(st, name) -> bool:
    """``name`` holds no residual: zeros (a flushed residual waits as zeros until its step is known
    finite -- one step later -- to come back if it was not; the store's rule for the dense path)."""
    kept = st.state_dict()["residuals"].get(name)
    return float(st.residual(name).abs().sum()) == 0.0 and (kept is None or float(kept.abs().sum()) == 0.0)


def job_becomes_exempt(rank, world, spec):
    W = world
    torch.manual_seed(0)
    base = Params([(300,), (20, 30)])
    m = ddp(copy.deepcopy(base))
    st = gt.register(m, codec=spec, min_compress_numel=0, exempt=())  # every parameter compressed
    for step in range(2):
        m.zero_grad()
        m(grads_for(base, rank, step, seed=SEED)).backward()
    r_old = st.residual("ps.0")
    assert float(r_old.abs().sum()) > 0
    (lay,) = st.bucket_layouts()
    off = {n: o for n, o, _ in lay["params"]}["ps.0"]
    folded = r_old.clone()
    for s in st.compressor.server_residuals():  # two_phase: W x server added on this rank's chunk
        lo, hi = max(off, s["start"]), min(off + 300, s["start"] + s["count"])
        if lo < hi:
            folded[lo - off: hi - off].add_(s["residual"][lo - s["start"]: hi - s["start"]] * float(W))
    sd = st.state_dict()
    # (a) the setter: ps.0 (1-D) becomes exempt
    st.exempt = None
    gs = grads_for(base, rank, 2, seed=SEED)
    m.zero_grad()
    m([g.clone() for g in gs]).backward()
    mine = (gs[0].reshape(-1) + folded) / W
    every = [None] * W
    dist.all_gather_object(every, mine)
    want = every[0] + every[1]
    assert same_bits(m.module.ps[0].grad.numpy(), want.numpy()), f"{spec}: flushed residual (seed {SEED})"
    assert no_residual(st, "ps.0")
    assert "ps.1" in st.state_dict()["residuals"] and st.bucket_layouts()[0]["exempt"] == ["ps.0"]
    # it stops being exempt: compressed again, from a zero residual
    st.exempt = ()
    m.zero_grad()
    m(grads_for(base, rank, 3, seed=SEED)).backward()
    assert "ps.0" in st.state_dict()["residuals"] and st.bucket_layouts()[0].get("exempt") is None
    # (b) a checkpoint of the exempt=() run loaded by a state with the default rule: flushed at its
    # first step, the same value
    m2 = ddp(copy.deepcopy(base))
    st2 = gt.register(m2, codec=spec, min_compress_numel=0)
    st2.load_state_dict(sd)
    m2([g.clone() for g in gs]).backward()
    assert st2.iter == 3
    assert no_residual(st2, "ps.0")
    # the saved server residual (int8) names ps.0 in a layout that is not the new one: folded by
    # its saved parameter map, the same fl(r + fl(W * s)), then flushed
    assert same_bits(m2.module.ps[0].grad.numpy(), want.numpy()), f"{spec}: loaded checkpoint (seed {SEED})"
    return True


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "int8"])
def test_parameter_becoming_exempt_flushes_its_residual(spec):
    """Bitwise (W = 2): the parameter's output is sum_r fl(fl(g_r + r_r) / W), r_r its residual
    with W x the server residual of its chunk folded in (int8: two_phase), and it holds no residual
    after; one that stops being exempt is compressed again; a checkpoint of an exempt=() run loaded
    with the default rule flushes alike."""
    assert run(2, job_becomes_exempt, spec) == [True, True]


# ---------------------------------------------------------------------------------------------
# the codec ramp


RAMP = [(0, "dense"), (2, "topk:ratio=0.25"), (4, "topk:ratio=0.0625"), (6, "int8")]
NAMES = {"a": (3000,), "b": (40, 50), "c": (100,)}  # c: below min_compress_numel, always dense


def expected_bytes(spec, numel, W, scheme):
    """One tensor's (dense, packet, sent, ring) bytes, written out (float32)."""
    dense = 4 * numel
    ring = 2.0 * (W - 1) / W * dense  # the planner's ring_allreduce_bytes, evaluated alike
    if scheme == "dense":
        return dense, dense, ring, ring
    codec = gradcomp.Codec(spec)
    if scheme == "gather":
        p = int(codec.packet_bytes(numel, "float32"))
        return dense, p, (W - 1) * p, ring
    assert scheme == "two_phase", scheme
    c = -(-numel // W)  # chunks of ceil(n / W): a slot is the packet of one chunk
    p1, p2 = codec.packet_bytes(c, "float32"), codec.packet_bytes(c, "float32")
    return dense, W * p1, (W - 1) * (p1 + p2), ring


def job_ramp(rank, world):
    W = world
    comp = Compressor("topk:ratio=0.01", ramp=RAMP)
    assert comp.ramp == RAMP and comp.codec_at(1) is None and comp.codec_at(5).spec == "topk:ratio=0.0625"
    per_step = []
    keys = ("dense_bytes", "packet_bytes", "sent_bytes", "ring_bytes")
    totals = dict.fromkeys(keys, 0.0)
    by_codec = {}
    for step in range(8):
        for tag, (name, shape) in enumerate(NAMES.items()):
            comp.allreduce(tensor_for(shape, rank, step, tag), name).wait()
        s = comp.stats()
        spec = dict(RAMP)[max(k for k, _ in RAMP if k <= step)]
        assert s["step"]["codec"] == spec, (step, s["step"]["codec"])
        seen = []
        step_v = dict.fromkeys(keys, 0.0)  # summed as the records sum: per step, then over steps
        for b in s["buckets"]:
            n = b["numel"]
            scheme = "dense" if spec == "dense" or n < 1024 else planner.choose_scheme(gradcomp.Codec(spec), n,
                                                                                       "float32", W)
            want = expected_bytes(spec, n, W, scheme)
            assert (b["scheme"], b["codec"]) == (scheme, spec), (step, b)
            assert tuple(b[k] for k in keys) == want, (step, b, want)
            for k, v in zip(keys, want):
                step_v[k] += v
            seen.append((b["name"], b["scheme"], b["packet_bytes"]))
        by = by_codec.setdefault(spec, dict.fromkeys(keys, 0.0))
        for k in keys:
            totals[k] += step_v[k]
            by[k] += step_v[k]
        per_step.append((s["step"]["codec"], seen))
        comp.end_step()
    s = comp.stats()
    assert s["steps"] == 8

    def same(got, want, k):  # stats() reports the byte counts but ring_bytes as ints
        return got == (want if k == "ring_bytes" else int(want))

    for k, v in totals.items():
        assert same(s["total"][k], v, k), (k, s["total"][k], v)
    assert set(s["codecs"]) == {spec for _, spec in RAMP}
    for spec, v in by_codec.items():
        assert s["codecs"][spec]["steps"] == 2
        for k in keys:
            assert same(s["codecs"][spec][k], v[k], k), (spec, k, s["codecs"][spec][k], v[k])
    assert s["codecs"]["dense"]["packet_ratio"] == 1.0 and s["codecs"]["dense"]["wire_ratio"] == 1.0
    # the hook: register passes the ramp through; start_iter's warm-up steps are counted (dense)
    torch.manual_seed(0)
    base = Params([(3000,), (40, 50)])
    m = ddp(copy.deepcopy(base))
    st = gt.register(m, codec="topk:ratio=0.1", ramp=[(2, "fp16"), (3, "dense"), (4, "bf16")], start_iter=1,
                     exempt=())
    assert st.ramp == [(2, "fp16"), (3, "dense"), (4, "bf16")]
    codecs, sent = [], 0.0  # one bucket per step: summed as the records sum
    for step in range(5):
        m.zero_grad()
        m(grads_for(base, rank, step, seed=SEED)).backward()
        codecs.append(st.stats()["step"]["codec"])
        spec = codecs[-1]
        scheme = {"dense": "dense", "topk:ratio=0.1": "gather", "fp16": "sum", "bf16": "sum"}[spec]
        for b in st.stats()["buckets"]:
            assert b["scheme"] == scheme, (step, b)
            if scheme == "sum":
                s_ = 2.0 * (W - 1) / W * planner.payload_bytes(gradcomp.Codec(spec), b["numel"], "float32")
            else:
                s_ = expected_bytes(spec, b["numel"], W, scheme)[2]
            assert b["sent_bytes"] == s_
            sent += s_
    assert codecs == ["dense", "topk:ratio=0.1", "fp16", "dense", "bf16"], codecs
    assert st.stats()["total"]["sent_bytes"] == int(sent)
    return per_step, codecs


@pytest.mark.parametrize("world", [2, 3])
def test_ramp_switches_codecs_on_every_rank(world):
    """Exact: each step's codec, scheme and packet/sent bytes (the formulas written here) on every
    rank, the totals and the per-codec totals including the dense warm-up; the hook's ramp through
    register() with start_iter."""
    res = run(world, job_ramp)
    assert all(r == res[0] for r in res), "ranks differ"
    per_step, _ = res[0]
    assert [c for c, _ in per_step] == ["dense", "dense", "topk:ratio=0.25", "topk:ratio=0.25", "topk:ratio=0.0625",
                                         "topk:ratio=0.0625", "int8", "int8"]


def job_ramp_carry_over(rank, world, before, after, scheme):
    """A Compressor whose ramp switches ``before`` -> ``after`` at step 3 against one of ``before``
    for steps 0-2 and a new one of ``after`` loaded with its state_dict (server residuals folded
    by hand) for steps 3-4."""
    ramped = Compressor(before, scheme, ramp=[(3, after)])
    old = Compressor(before, scheme)
    new = None
    shapes = {"x": (5000,), "y": (30, 70)}
    for step in range(5):
        if step == 3:
            sd = old.state_dict()
            sd["residuals"] = {k: v.clone() for k, v in sd["residuals"].items()}
            for e in sd["server_residuals"]:  # the fold, as the store does it: res + fl(W * server)
                (name, _, _), = e["params"]
                sd["residuals"][name][e["start"]: e["start"] + e["count"]].add_(e["residual"] * float(e["world_size"]))
            sd["server_residuals"] = []
            new = Compressor(after, scheme)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # another codec: strict=False warns
                new.load_state_dict(sd, strict=False)
            assert new.iter == 3
        other = old if step < 3 else new
        for tag, (name, shape) in enumerate(shapes.items()):
            a = tensor_for(shape, rank, step, tag)
            b = a.clone()
            ramped.allreduce(a, name).wait()
            other.allreduce(b, name).wait()
            where = f"{before} -> {after}, step {step}, {name} (seed {SEED})"
            assert same_bits(a.numpy(), b.numpy()), where
            assert same_bits(ramped.residual(name).numpy(), other.residual(name).numpy()), where + ": residual"
        s_r, s_o = ramped.server_residuals(), other.server_residuals()
        assert len(s_r) == len(s_o)
        for x, y in zip(s_r, s_o):
            assert same_bits(x["residual"].numpy(), y["residual"].numpy())
        ramped.end_step()
        other.end_step()
        assert ramped.stats()["step"]["codec"] == (before if step < 3 else after)
    assert float(sum(r.abs().sum() for r in ramped.state_dict()["residuals"].values())) > 0
    return True


@pytest.mark.parametrize("world,before,after,scheme", [(2, "topk:ratio=0.25", "topk:ratio=0.05", "gather"),
                                                       (2, "int8", "int4", "two_phase"),
                                                       (3, "fp8", "int8", "two_phase")])
def test_ramp_residuals_carry_over_bitwise(world, before, after, scheme):
    """Bitwise: across the switch the ramped Compressor equals a Compressor of the new codec loaded
    with the old one's residuals (two_phase: the server residual folded into the worker residual,
    W x server on this rank's chunk), outputs, residuals and server residuals."""
    assert run(world, job_ramp_carry_over, before, after, scheme) == [True] * world


def test_bad_ramp_entries_and_exempt_types():
    """No process group: every bad entry is named; exempt of another type is a TypeError."""
    cases = [
        ([(0, "topk:ratio=0.1"), (0, "fp16")], r"ramp entry 1 \(0, 'fp16'\): the step 0 does not follow the step 0"),
        ([(5, "fp16"), (3, "bf16")], r"ramp entry 1 \(3, 'bf16'\).*does not follow"),
        ([(-1, "fp16")], r"ramp entry 0 \(-1, 'fp16'\): the step -1 is not an int >= 0"),
        ([(1.5, "fp16")], r"ramp entry 0 \(1.5, 'fp16'\): the step"),
        ([(True, "fp16")], r"ramp entry 0 \(True, 'fp16'\): the step"),
        ([(0, "fp16"), (10, "nonsense:x=1")], r"ramp entry 1 \(10, 'nonsense:x=1'\): the codec spec 'nonsense:x=1' "
                                              r"does not parse"),
        ([(0, "powersgd:rank=2")], r"ramp entry 0 .*does not parse"),
        ([(0, 3)], r"ramp entry 0 \(0, 3\): the codec 3 is not a codec spec"),
        ([(0,)], r"ramp entry 0 \(0,\): accepted: a \(step, codec spec\) pair"),
        ([[0, "fp16", 1]], r"ramp entry 0 \[0, 'fp16', 1\]"),
        ("fp16", r"ramp='fp16'; accepted: a list of \(step, codec spec\) pairs"),
    ]
    for ramp, match in cases:
        with pytest.raises(ValueError, match=match):
            Compressor("fp16", ramp=ramp)
    with pytest.raises(ValueError, match=r"scheme='sum' needs a linear codec; topk:ratio=0.1 \(a codec of the ramp\)"):
        Compressor("fp16", scheme="sum", ramp=[(5, "topk:ratio=0.1")])
    with pytest.raises(ValueError, match=r"inner_scheme='sum' needs a linear codec"):
        Compressor("none", scheme="hierarchical", inner_scheme="sum", local_world_size=1, ramp=[(1, "int8")])
    for bad in ("bias", 5, b"x"):
        with pytest.raises(TypeError, match="exempt="):
            Compressor("fp16", exempt=bad)
    with pytest.raises(TypeError, match=r"a single name: exempt=\['bias'\]"):
        Compressor("fp16", exempt="bias")
