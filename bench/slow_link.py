"""Measured versus predicted gradient-exchange time on rate-limited links (issue 12, "Measured, not
only predicted"): the planner's cost model (:mod:`gradcomp.planner`) against gloo ranks whose
traffic crosses a ``tc`` token-bucket filter on this machine.

Setups (:mod:`gradcomp.experiments.links`; created by this script and removed after, nothing
leaves the machine; needs root, ``ip`` and ``tc``):

  lo RATE     4 gloo ranks in one network namespace whose loopback carries a tbf at RATE
              (100mbit, 1gbit, 10gbit): every byte any rank sends crosses that one queue, the
              planner's ``CostModel.loopback(RATE, alpha)`` (a shared link: W senders, RATE / W each);
  nodes RATE  two namespaces ("nodes") joined by a veth pair with a tbf at RATE on each end
              (1gbit, 100mbit), ranks 0, 1 in node A and 2, 3 in node B (their own traffic over
              the node's unshaped loopback): ``CostModel(Link(inf, alpha, name="lo"),
              Link(RATE, alpha, per_node=True), local_world_size=2, engine="gloo")``; rows of the
              ``hierarchical`` scheme when ``gradcomp.torch.compressor.SCHEME_CHOICES`` has it.
  (lo unlimited: the calibration setup below.)

Models: ``digits`` -- the main job's MLP (``gradcomp.experiments.runner.make_model(256)``: 64-256-
256-10, 85,002 parameters, DDP ``bucket_cap_mb`` 0.1, batch 48 per rank of the digits data);
``mlp25m`` -- a synthetic MLP 1024-4096-4096-1024 (25,178,112 parameters, DDP's default 25 MiB
buckets, batch 8 of normal inputs, loss ||f(x) - x||^2). digits rows take 40 measured steps
(their per-step times on 4 processes sharing 2 cores spread by +-40 %), mlp25m rows 3. The
gradient buckets of each model are the ones DDP builds (read from the gradcomp hook's ``stats()``
after DDP's bucket rebuild, on the calibration setup), so the direct measurement and the DDP step
reduce the same buckets.

Codecs (:func:`codec_list`, from ``gradcomp.codecs()``): ``none`` (scheme dense: PyTorch's
allreduce_hook), the first other linear codec (``fp16``, sum), the first sparse one
(``topk:ratio=0.01``, gather) and every codec that is neither (the quantizers fp8, int8, int4,
onebit; two_phase), all with error feedback except none, every bucket compressed
(``min_compress_numel=0``, as the experiment harness). The scheme each bucket took is read from
the compressor's stats and the prediction uses the same one.

Calibration, once per run, unshaped (stated in the output): for each setup kind, on its unshaped
setup (``lo:unlimited``; ``nodes:unlimited``), gloo's engine cost per group shape
(``planner.EngineCost.calibrate``, :func:`measure_engine`): the W ranks ("flat"), and on two
nodes also ``hierarchical``'s 2-rank groups inside a node ("intra") and across the nodes
("inter"), each timed with its sibling group running at once, as the scheme runs them. Per
shape: an allreduce of 2p float32 elements (p: the group's ranks; per collective + 2 (p-1)
alpha: every ring segment holds data, unlike a 1-element allreduce, which gloo runs as a shorter
exchange), an all-gather of 8 bytes per rank (per collective + (p-1) alpha), an allreduce of
``CALIB_LARGE_NUMEL`` float32 (the engine's bytes/s) and an all-gather of as many bytes per rank
(the all-gather's own bytes/s: gloo copies every part into the output, where an allreduce sums
in place; 0.4 against 1.0 GB/s here) and an all-to-all of 8 bytes per slot (the all-to-all's
fixed time, which ``two_phase`` pays: gloo posts its p-1 sends at once, so neither the allreduce
nor the all-gather describes it), each call after a barrier, means over --alpha-reps calls of
the mean over ranks (not medians: a step's collectives add up, so the model needs each one's
expected time; on 4 ranks sharing 2 cores a small collective's time is skewed and bimodal, e.g.
a 2-rank all-gather of 8 B: 10th percentile 0.4 ms, median 0.7 or 1.0 ms from one pool to the
next, mean 1.4 ms in both, 90th percentile 3.1-3.5 ms; bench/RESULTS.md); on two nodes after
creating ``hierarchical``'s groups (:func:`job_groups`: the state every row of the setup runs
in). On the loopback also the DDP bucket layouts and the compute time of a DDP step with
PyTorch's ``noop_hook`` (forward + backward + SGD step, no communication; 4 ranks computing at
once). The model of each setup (:func:`cost_model`) takes the engine costs (every collective
takes the slower of the link and its group's engine), links without latency of their own (a tbf
queues; alpha is the engine's) with the tbf's burst (lent once per collective), and on ``nodes``
the node's loopback at the measured engine rate of the groups inside the nodes.
``--repredict JSON`` judges a saved run again under the planner as it is now (:func:`judge`),
measuring nothing.

Per row (setup x model x codec [x scheme]):
  comm   the model's buckets reduced through ``gradcomp.torch.Compressor.allreduce`` one at a
         time, each waited (bucket contents: fixed normal values per rank, restored before each
         step outside the timing); per step and rank the compressor's stats split the time into
         ``comm_s`` (collectives, launch to completion), ``encode_s`` and ``decode_s``. Every
         collective begins after a ``dist.barrier()`` (:class:`AlignedProbe`, wrapped around the
         compressor's probes), so all ranks launch it together: without it, ranks sharing cores
         finish their encodes far apart (how far: bench/RESULTS.md, section "2026-12-01 — CPU,
         issue 12") and ``comm_s`` would hold the wait for the last rank (rank mean) or miss
         the traffic that flowed before it arrived (rank min). The measured comm per step is the
         sum over buckets of the mean over ranks, then the median over --steps steps (after
         --warmup steps); the JSON also has the min and max over ranks. Predicted: the sum over
         buckets of ``CostModel.predict(scheme, codec, numel, dtype, 4, inner)["comm_s"]`` plus
         the compressor's once-per-step descriptor all-gather (``CostModel.peer_check_s``).
         ratio = measured / predicted; "yes" when |ratio - 1| <= 0.15 (not judged on the
         unshaped setups, where the link is not what is tested: their rows are the "floor" of the
         shaped rows of the same kind, model, codec and scheme: gloo's own time on this CPU).
         The token bucket lends an idle link's unused bytes, up to its burst: the model's links
         carry it (``Link(burst_bytes=)``, lent once per collective); the JSON's
         ``tbf_credit_ms`` = comm phases per step x burst / rate is the most it can lend a step
         (:mod:`gradcomp.experiments.links`).
  bytes  tc's "Sent N bytes" counter of the shaped devices, read before and after the measured
         steps (a timing-free check of the byte formulas), beside the predicted bytes: lo, the sum
         over ranks of the bytes each sends (W x the planner's per-rank bytes); nodes, the bytes
         that leave a node (both veth directions): gloo's rings run rank r -> r + 1, so a flat
         allreduce or all-gather crosses each direction once (one rank's bytes per direction),
         an all-to-all sends L (W - L) of its W (W - 1) slots across, and hierarchical's cross-
         node step sends every rank's inter-node bytes across. tc counts IP/TCP headers and ACKs
         (their share: bench/RESULTS.md, section "2026-12-01 — CPU, issue 12") and gloo's own
         message headers; the alignment barriers' bytes
         (measured once per setup over 200 barriers) are taken off.
  ddp    the DDP step (zero_grad, forward, backward with the gradcomp hook, SGD step; a barrier
         before each step; the step's time is the max over ranks; median over steps), beside
         predicted = compute (the calibration's noop-hook step) + predicted comm + the encode /
         decode time measured in this row's comm run (kernels do not depend on the link; the
         planner's CPU kernel estimates are in the JSON as ``pred_kernel_ms``). Informative:
         DDP overlaps communication with backward and adds its own work.

Time bounds: a row whose predicted time would exceed --row-limit-s (default 60 s) runs fewer
steps (at least 2 measured, 1 for a step predicted longer than LONG_STEP_S; the warm-up dropped
first) or is skipped (listed, with the predicted step time); rows left when --budget-s (default
1800 s) is spent are skipped (listed). The rows this rule shortened in the recorded run (mlp25m at
100mbit, dense and fp16) are in bench/RESULTS.md, section "2026-12-01 — CPU, issue 12".

Usage (root):
  python bench/slow_link.py [--quick] [--out results/slow_link] [--setups lo:1gbit,nodes:1gbit]
      [--models digits,mlp25m] [--codecs 'none;fp16;topk:ratio=0.01;int8'] [--steps 5] [--warmup 2]
      [--row-limit-s 60] [--budget-s 1800] [--no-ddp] [--repredict SAVED/slow_link.json]
--quick: lo:1gbit and nodes:1gbit, digits only (plus mlp25m with topk and int4 at lo:1gbit),
codecs none, fp16, topk:ratio=0.01, int8; 3 steps. Writes ``--out``/slow_link.json and
``--out``/slow_link.md (the tables). Exit status 0; 2 when the links cannot be built here (the
reason is printed).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

W = 4
L = 2  # ranks per node in the two-node setup
TOLERANCE = 0.15
LONG_STEP_S = 10.0  # a row whose step is predicted longer may run a single measured step
SETUPS = ("lo:unlimited", "lo:100mbit", "lo:1gbit", "lo:10gbit", "nodes:unlimited", "nodes:1gbit", "nodes:100mbit")
QUICK_SETUPS = ("lo:unlimited", "lo:1gbit", "nodes:1gbit")
MODELS = {
    "digits": {"bucket_cap_mb": 0.1, "batch": 48, "steps": 40, "warmup": 3, "ddp_steps": 5, "ddp_warmup": 2},
    "mlp25m": {"bucket_cap_mb": 25.0, "batch": 8, "steps": 5, "warmup": 1, "ddp_steps": 2, "ddp_warmup": 0},
}
"""Per model: DDP bucket_cap_mb, batch per rank, measured / warm-up steps of the comm rows, and of
the DDP rows (``ddp_warmup`` warm-up steps beyond the one every DDP run takes: DDP rebuilds its
buckets after step 1)."""


# ==============================================================================================
# worker side (pool jobs: module-level, run in every rank)
# ==============================================================================================

_STATE = {}


def build_model(name):
    """``(model, batch(step, rank) -> loss_fn(module))`` of a model name (same init everywhere)."""
    import torch

    torch.manual_seed(0)
    if name == "digits":
        from gradcomp.experiments import runner

        model = runner.make_model(256)
        xtr, ytr, _, _ = runner.load_data()
        bs = MODELS["digits"]["batch"]

        def batch(step, rank):
            i = ((step * W + rank) * bs) % (xtr.shape[0] - bs)
            x, y = xtr[i: i + bs], ytr[i: i + bs]
            return lambda m: torch.nn.functional.cross_entropy(m(x), y)
        return model, batch
    if name == "mlp25m":
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                    torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
        bs = MODELS["mlp25m"]["batch"]

        def batch(step, rank):
            x = torch.randn(bs, 1024, generator=torch.Generator().manual_seed(step * 31 + rank))
            return lambda m: (m(x) - x).square().mean()
        return model, batch
    raise ValueError(f"slow_link: model {name!r}; accepted: {', '.join(MODELS)}")


def job_collective(rank, world, kind, numel, reps, level="flat"):
    """Times (s) of ``reps`` collectives, each started after a ``dist.barrier()`` of the whole
    world (as every collective of a row, :class:`AlignedProbe`), after 10 warm-up calls: ``kind``
    "allreduce" of ``numel`` float32 elements, "all_gather" of ``numel`` bytes per rank or
    "all_to_all" (``dist.all_to_all_single``, as ``two_phase``) of ``numel`` bytes per slot, over
    ``level``'s group: "flat" the W ranks; "intra" this rank's node (L ranks; the N nodes'
    groups run at once) or "inter" its local rank's group across the nodes (N ranks; L groups at
    once), the groups of ``hierarchical`` (``gradcomp.schemes.groups``)."""
    import torch
    import torch.distributed as dist

    from gradcomp.bench import timing

    group = None
    if level != "flat":
        from gradcomp.schemes.groups import hierarchical_groups_for

        hg = hierarchical_groups_for(None, L)
        group = {"intra": hg.intra, "inter": hg.cross}[level]
    p = dist.get_world_size(group)
    if kind == "allreduce":
        x = torch.ones(numel)

        def call():
            dist.all_reduce(x, group=group)
    elif kind == "all_gather":
        x = torch.ones(numel, dtype=torch.uint8)
        out = torch.empty(numel * p, dtype=torch.uint8)

        def call():
            dist.all_gather_into_tensor(out, x, group=group)
    elif kind == "all_to_all":
        x = torch.ones(numel * p, dtype=torch.uint8)
        out = torch.empty(numel * p, dtype=torch.uint8)

        def call():
            dist.all_to_all_single(out, x, group=group)
    else:
        raise ValueError(f"slow_link: calibration collective {kind!r}; accepted: allreduce, all_gather, all_to_all")
    return timing.time_calls(call, reps, warmup=10, before=dist.barrier)


def job_groups(rank, world):
    """Creates ``hierarchical``'s process groups (nodes of L ranks; cached by
    ``gradcomp.schemes.groups``) at the start of a two-node pool, before its calibration and its
    first row. The two-node rows create them at their first hierarchical row anyway, and gloo's
    collectives on the W ranks run faster once the processes hold the extra groups (a digits
    two_phase step 14.6 ms before, 12.7 ms after; bench/RESULTS.md): created first, every row and
    the calibration of the setup run in the same state. The loopback rows, which never create
    them, run without them, as their calibration does."""
    from gradcomp.schemes.groups import hierarchical_groups_for

    hierarchical_groups_for(None, L)


def job_ddp(rank, world, model_name, codec, scheme, ef, warmup, steps, local_world_size=0):
    """DDP steps of ``model_name``: with PyTorch's noop_hook (``codec=None``: compute only) or
    the gradcomp hook. Returns per-step seconds (max over ranks) and, for the gradcomp hook, the
    buckets of the last step ``[(numel, dtype, scheme, inner)]``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

    import gradcomp
    import gradcomp.torch as gt
    from gradcomp.bench import timing

    gradcomp.set_num_threads(1)
    model, batch = build_model(model_name)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=MODELS[model_name]["bucket_cap_mb"])
    state = None
    if codec is None:
        ddp.register_comm_hook(None, debugging_hooks.noop_hook)
    else:
        kw = {"local_world_size": local_world_size} if scheme == "hierarchical" else {}
        state = gt.register(ddp, codec=codec, scheme=scheme, error_feedback=ef, min_compress_numel=0, start_iter=0,
                            **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    losses = (batch(s, rank) for s in range(warmup + steps))  # one batch per step, made outside the timing
    cur = {}

    def before():  # the step's batch, then every rank starts the step together
        cur["loss"] = next(losses)
        dist.barrier()

    def step():
        opt.zero_grad(set_to_none=False)
        cur["loss"](ddp).backward()
        opt.step()

    t = torch.tensor(timing.time_calls(step, steps, warmup=warmup, before=before), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out = {"times": t.tolist(), "numel": sum(p.numel() for p in model.parameters())}
    if state is not None:
        out["buckets"] = [(int(b["numel"]), b["dtype"], b["scheme"], b.get("inner", ""))
                          for b in state.stats()["buckets"]]
    return out


class AlignedProbe:
    """A compressor probe (``gradcomp.schemes.NullProbe``'s interface) around the real one, made
    per bucket call, that starts every collective after a ``dist.barrier()``: a ``clock("comm_s")``
    on the main thread that opens a communication phase -- the first of the call (dense's
    allreduce, hierarchical's intra-node step) or the first after local work (an encode: the
    collective that sends what was encoded; a decode: hierarchical's all-gather inside the node
    after its inner scheme's decodes) -- waits in a barrier first, so every rank launches the
    collective together (within the barrier's exit skew) and its ``comm_s`` is the collective
    itself, not the wait for a rank still encoding or decoding. Encode and decode clocks, and a
    collective that follows a collective, do not wait. The rule depends only on the order of the
    probe's own events, the same on every rank (a scheme waits for its earlier collectives before
    a later main-thread one), so every rank takes the same barriers; a clock outside the main
    thread never waits (a completion callback may run inline on one rank and in gloo's thread on
    another). Counts the barriers and the comm phases in ``counts``."""

    def __init__(self, probe, counts):
        self._p, self._c = probe, counts
        self._last = None  # the field of the last tock

    def clock(self, field=None):
        import threading

        import torch.distributed as dist

        if field == "comm_s" and self._last != "comm_s" and threading.current_thread() is threading.main_thread():
            dist.barrier()
            self._c["barriers"] += 1
        return self._p.clock(field)

    def tock(self, field, start):
        self._last = field
        if field == "comm_s":
            self._c["comm_phases"] += 1
        self._p.tock(field, start)

    def decoded(self, workspace):
        self._p.decoded(workspace)


def job_barrier_bytes(rank, world, n):
    """``n`` barriers (the parent reads the qdisc counters around them)."""
    import torch.distributed as dist

    for _ in range(n):
        dist.barrier()


def job_comm_prepare(rank, world, buckets, codec, scheme, ef, warmup, local_world_size=0):
    """Build a Compressor whose probes are :class:`AlignedProbe`, and the bucket tensors (normal
    values, seed per rank and bucket); run ``warmup`` steps, then a barrier. The state stays in
    this worker for :func:`job_comm_measure`."""
    import torch
    import torch.distributed as dist

    import gradcomp
    from gradcomp.torch import Compressor

    gradcomp.set_num_threads(1)
    kw = {"local_world_size": local_world_size} if scheme == "hierarchical" else {}
    comp = Compressor(codec, scheme=scheme, error_feedback=ef, min_compress_numel=0, **kw)
    counts = {"barriers": 0, "comm_phases": 0}
    stats = comp._stats  # the compressor's step records: its probes come from here
    real_probe = stats.probe
    stats.probe = lambda *args, **kwargs: AlignedProbe(real_probe(*args, **kwargs), counts)
    orig, bufs = [], []
    for i, (n, dt) in enumerate(buckets):
        g = torch.Generator().manual_seed(1000 * rank + i)
        x = (torch.randn(n, generator=g) * 1e-2).to(getattr(torch, dt))
        orig.append(x)
        bufs.append(x.clone())
    _STATE.clear()
    _STATE.update(comp=comp, orig=orig, bufs=bufs, counts=counts)
    for _ in range(warmup):
        _comm_step()
    dist.barrier()
    return None


def _comm_step():
    comp, orig, bufs, counts = _STATE["comp"], _STATE["orig"], _STATE["bufs"], _STATE["counts"]
    for b, o in zip(bufs, orig):
        b.copy_(o)
    c0 = dict(counts)
    t0 = time.perf_counter()
    for i, b in enumerate(bufs):
        comp.allreduce(b, f"bucket{i}").wait()
    wall = time.perf_counter() - t0
    comp.end_step()
    st = comp.stats()
    return {"wall_s": wall, "barriers": counts["barriers"] - c0["barriers"],
            "comm_phases": counts["comm_phases"] - c0["comm_phases"],
            "buckets": [(int(b["numel"]), b["dtype"], b["scheme"], b.get("inner", "")) for b in st["buckets"]],
            "times": [(b.get("comm_s", 0.0), b.get("encode_s", 0.0), b.get("decode_s", 0.0)) for b in st["buckets"]]}


def job_comm_measure(rank, world, steps):
    """``steps`` timed steps of the prepared compressor; per step the stats split."""
    out = [_comm_step() for _ in range(steps)]
    return out


def job_release(rank, world):
    _STATE.clear()
    import gc

    gc.collect()
    return None


# ==============================================================================================
# parent side
# ==============================================================================================

def codec_list(quick):
    """One codec per scheme ``auto`` takes, from the registry (``gradcomp.codecs()``, registry
    order, each codec's first example spec): ``none`` (dense, the reference), the first other
    linear codec (sum: fp16), the first sparse one (gather: topk:ratio=0.01), then every codec
    that is neither (the quantizers, two_phase); --quick keeps int8 of the quantizers."""
    import gradcomp

    cs = gradcomp.codecs()
    linear = [c["examples"][0] for c in cs if c["properties"].get("linear") and c["name"] != "none"]
    sparse = [c["examples"][0] for c in cs if c["properties"].get("sparse")]
    base = ["none"] + linear[:1] + sparse[:1]
    quant = [c["examples"][0] for c in cs
             if not c["properties"].get("linear") and not c["properties"].get("sparse")]
    if quick:
        return base + [q for q in quant if q.startswith("int8")][:1]
    return base + quant


def parse_setup(text):
    kind, _, rate = text.partition(":")
    if kind not in ("lo", "nodes") or not rate:
        raise ValueError(f"slow_link: setup {text!r}; accepted: lo:RATE or nodes:RATE (e.g. lo:1gbit)")
    from gradcomp.experiments import links

    links.parse_rate(rate)  # raises with the accepted forms
    return kind, rate


def cost_model(kind, rate, engine):
    """The planner's model of a setup: its links and gloo with the calibrated ``engine``
    (``planner.EngineCost``: a cost per collective, alpha and the engine's bytes/s; on two nodes
    a dict of one per group shape, ``planner.ENGINE_LEVELS``). The links add no latency of their
    own (a tbf queues, it does not delay an idle link): alpha is gloo's, in the engine. A node's
    unshaped loopback (the intra level of ``nodes``) runs at the measured engine rate of the
    groups inside the nodes."""
    from gradcomp import planner
    from gradcomp.experiments import links

    tp = planner.Throughput(device="cpu")
    tbf = links.tbf_params(rate)
    burst = tbf["burst_bytes"] if tbf else 0.0
    if kind == "lo":
        return planner.CostModel(planner.Link.parse(rate, 0.0, shared=True, name=f"loopback {rate}", burst_bytes=burst),
                                 None, 0, tp, "gloo", engine_cost=engine)
    intra = engine.get("intra", engine["flat"]) if isinstance(engine, dict) else engine
    return planner.CostModel(planner.Link(intra.bytes_per_s, 0.0, name="lo (measured)"),
                             planner.Link(planner.parse_rate(rate), 0.0, per_node=True, name=f"veth {rate}",
                                          burst_bytes=burst),
                             local_world_size=L, throughput=tp, engine="gloo", engine_cost=engine)


def predict_buckets(model, codec, buckets, kind):
    """Sum over buckets ``[(numel, dtype, scheme, inner)]`` of the planner's prediction, plus the
    compressor's once-per-step descriptor all-gather (``CostModel.peer_check_s``): comm_s,
    encode_s, decode_s (seconds per step) and the bytes tc should count per step (see the module
    docstring)."""
    from gradcomp import planner

    tot = {"comm_s": model.peer_check_s(W), "encode_s": 0.0, "decode_s": 0.0, "wire_bytes": 0.0}
    check = planner.all_gather_bytes(planner.PEER_CHECK_BYTES, W)  # one rank's bytes of the check
    tot["wire_bytes"] += W * check if kind == "lo" else (W // L) * check
    for n, dt, scheme, inner in buckets:
        p = model.predict(scheme, codec, n, dt, W, inner)
        for k in ("comm_s", "encode_s", "decode_s"):
            tot[k] += p[k]
        if kind == "lo":
            tot["wire_bytes"] += W * (p["bytes"]["intra"] + p["bytes"]["inter"])
        elif scheme == "hierarchical":
            tot["wire_bytes"] += W * p["bytes"]["inter"]
        else:
            nodes = W // L
            for _, k, _, _, sent in planner.scheme_steps(scheme, codec, n, dt, W):
                per_dir = sent * (L * (W - L) / (W - 1) if k == "all_to_all" else 1.0)
                tot["wire_bytes"] += nodes * per_dir
    return tot


class Bench:
    """Rows, skips and the time budget of one bench run."""

    def __init__(self, a):
        self.a = a
        self.t0 = time.perf_counter()
        self.rows = []
        self.skipped = []
        self.floors = {}  # (kind, model, codec, scheme) -> measured comm s on the unshaped setup
        self.barrier_bytes = {}  # setup -> {"bytes", "packets"} of one barrier through its qdiscs

    def left(self):
        return self.a.budget_s - (time.perf_counter() - self.t0)

    def log(self, msg):
        print(f"[{time.perf_counter() - self.t0:7.1f} s] {msg}", file=sys.stderr, flush=True)

    def fit(self, per_step_s, warmup, steps, limit_s, min_steps=None):
        """(warmup, steps) that fit ``limit_s`` and the budget at ``per_step_s`` seconds per
        step, or None: the warm-up goes first, then steps down to ``min_steps`` (default 2; 1
        for steps predicted over :data:`LONG_STEP_S`, whose single transfer already averages)."""
        if min_steps is None:
            min_steps = 1 if per_step_s > LONG_STEP_S else 2
        limit = min(limit_s, self.left())
        while (warmup + steps) * per_step_s > limit:
            if warmup > 0:
                warmup -= 1
            elif steps > min_steps:
                steps -= 1
            else:
                return None
        return warmup, steps


def run_setup(bench, kind, rate, calib, codecs, models, hier):
    """One setup: its namespace(s), a pool of W ranks inside, every (model, codec, scheme) row."""
    from gradcomp import Codec
    from gradcomp.experiments import links
    from gradcomp.experiments.pool import GlooPool

    ctx = links.shaped_loopback(rate) if kind == "lo" else links.two_nodes(rate, ranks_per_node=L)
    model = cost_model(kind, rate, calib["engine"][kind])
    with ctx as net:
        bench.log(f"setup {kind}:{rate}: namespaces {net.namespaces}, tbf {net.tbf}")
        with GlooPool(W, threads=1, gloo_timeout_s=600, netns=net.rank_netns(W), env=net.rank_env(W)) as pool:
            if kind == "nodes":
                pool.run(job_groups)
            net_calib = {"bytes": 0.0, "packets": 0.0}
            if net.tbf is not None:  # bytes and packets of one barrier through the shaped devices
                nb = 200
                pool.run(job_barrier_bytes, 5)
                q0 = net.qdisc_stats()
                pool.run(job_barrier_bytes, nb)
                q1 = net.qdisc_stats()
                net_calib = {k: (sum(x[k] for x in q1) - sum(x[k] for x in q0)) / nb for k in ("bytes", "packets")}
                bench.log(f"  one barrier: {net_calib['bytes']:.0f} B in {net_calib['packets']:.1f} packets")
            bench.barrier_bytes[f"{kind}:{rate}"] = net_calib
            for mname, spec in ((m, c) for m in models for c in codecs[m]):
                schemes = ["dense" if spec == "none" else "auto"]
                if kind == "nodes" and hier:
                    schemes.append("hierarchical")
                for scheme in schemes:
                    row = run_row(bench, pool, net, net_calib, model, kind, rate, mname, Codec(spec), scheme, calib)
                    if row is not None:
                        bench.rows.append(row)
                        print(fmt_row(row), flush=True)


def run_row(bench, pool, net, net_calib, model, kind, rate, mname, codec, scheme, calib):
    """Measure one row (see the module docstring); None when it is skipped."""
    from gradcomp import planner

    a = bench.a
    mc = MODELS[mname]
    layout = calib["layouts"][mname]
    ef = codec.spec != "none"
    setup = f"{kind}:{rate}"
    label = f"{setup} {mname} {codec.spec} {scheme}"
    lw = L if scheme == "hierarchical" else 0
    # the schemes the compressor will take, predicted before running to size the row
    pre = []
    for n, dt in layout:
        sc = planner.choose_scheme(codec, n, dt, W, scheme, 0)
        inner = planner.hierarchical_inner(codec, n, dt, W, L, "auto", 0) if sc == "hierarchical" else ""
        pre.append((n, dt, sc, inner))
    guess = predict_buckets(model, codec, pre, kind)
    # the planner's CPU kernel estimate, doubled, and the engine floor when known, for sizing only
    floor = bench.floors.get((kind, mname, codec.spec, scheme), 0.0)
    per_step = max(guess["comm_s"], floor) + 2.0 * (guess["encode_s"] + guess["decode_s"]) + 0.01
    fit = bench.fit(per_step, a.warmup if a.warmup is not None else mc["warmup"],
                    a.steps if a.steps is not None else mc["steps"], a.row_limit_s)
    if fit is None:
        need = per_step * (1 if per_step > LONG_STEP_S else 2)
        why = (f"predicted {per_step:.1f} s per step: the fewest steps ({need:.0f} s) exceed the row limit of "
               f"{a.row_limit_s:g} s" if need > a.row_limit_s else f"time budget spent ({bench.left():.0f} s left)")
        bench.skipped.append({"row": label, "why": why})
        bench.log(f"skip {label}: {why}")
        return None
    warmup, steps = fit
    bench.log(f"row {label}: {warmup} warm-up + {steps} steps (about {per_step:.2f} s per step)")
    t_row = time.perf_counter()
    tmo = 120 + 4 * (warmup + steps) * per_step
    pool.run(job_comm_prepare, layout, codec.spec, scheme, ef, warmup, lw, timeout=tmo)
    q0 = net.qdisc_stats()
    res = pool.run(job_comm_measure, steps, timeout=tmo)
    q1 = net.qdisc_stats()
    pool.run(job_release)
    buckets = res[0][0]["buckets"]
    nb = len(buckets)
    pred = predict_buckets(model, codec, buckets, kind)

    def per_step_values(f):
        return [f(s) for s in range(steps)]

    # per step: sum over buckets of the mean over ranks of comm_s (each collective started after
    # a barrier: AlignedProbe), the spread over ranks, and the kernels (mean over ranks)
    comm_mean = per_step_values(lambda s: sum(statistics.fmean(r[s]["times"][b][0] for r in res) for b in range(nb)))
    comm_min = per_step_values(lambda s: sum(min(r[s]["times"][b][0] for r in res) for b in range(nb)))
    comm_max = per_step_values(lambda s: sum(max(r[s]["times"][b][0] for r in res) for b in range(nb)))
    kern = per_step_values(lambda s: sum(statistics.fmean(r[s]["times"][b][1] + r[s]["times"][b][2] for r in res)
                                         for b in range(nb)))
    wall = per_step_values(lambda s: statistics.fmean(r[s]["wall_s"] for r in res))
    comm = statistics.median(comm_mean)
    barriers = res[0][0]["barriers"]
    phases = res[0][0]["comm_phases"]
    d = {k: sum(x[k] for x in q1) - sum(x[k] for x in q0) for k in ("bytes", "packets", "dropped")} if q0 else None
    if d is not None:  # the alignment barriers' own packets, measured on this setup
        d["bytes"] -= steps * barriers * net_calib["bytes"]
        d["packets"] -= steps * barriers * net_calib["packets"]
    row = {"setup": setup, "kind": kind, "rate": rate, "model": mname, "codec": codec.spec,
           "scheme_requested": scheme,
           "scheme": "+".join(sorted({b[2] + (f"({b[3]})" if b[3] else "") for b in buckets})),
           "buckets": [list(b) for b in buckets], "warmup": warmup, "steps": steps,
           "meas_comm_ms": 1e3 * comm, "meas_comm_min_ms": 1e3 * statistics.median(comm_min),
           "meas_comm_max_ms": 1e3 * statistics.median(comm_max),
           "comm_per_step_ms": [1e3 * c for c in comm_mean], "barriers_per_step": barriers,
           "comm_phases_per_step": phases,
           "tbf_credit_ms": (1e3 * phases * net.tbf["burst_bytes"] / net.tbf["bytes_per_s"] if net.tbf else 0.0),
           "meas_kernel_ms": 1e3 * statistics.median(kern), "meas_wall_ms": 1e3 * statistics.median(wall)}
    if d is not None:
        row.update(qdisc_bytes=d["bytes"] / steps, qdisc_packets=d["packets"] / steps, qdisc_dropped=d["dropped"])
    if net.tbf is None:
        bench.floors[(kind, mname, codec.spec, scheme)] = comm
    elif (kind, mname, codec.spec, scheme) in bench.floors:
        row["floor_ms"] = 1e3 * bench.floors[(kind, mname, codec.spec, scheme)]
    if not a.no_ddp:
        comp_s = calib["compute_s"][mname]
        guess_ddp = comp_s + max(pred["comm_s"], floor) + statistics.median(kern) + 0.02
        left = a.row_limit_s - (time.perf_counter() - t_row)
        dfit = bench.fit(guess_ddp, mc["ddp_warmup"], mc["ddp_steps"], left - guess_ddp, min_steps=1)
        if dfit is None:
            row["ddp_skipped"] = (f"1 warm-up + 1 DDP step (about {guess_ddp:.1f} s each) do not fit the "
                                  f"{max(left, 0):.0f} s left of the row limit / budget")
            bench.log(f"  DDP of {label} skipped: {row['ddp_skipped']}")
        else:
            dw, ds = dfit[0] + 1, dfit[1]  # one warm-up at least (DDP rebuilds its buckets after step 1)
            out = pool.run(job_ddp, mname, codec.spec, scheme, ef, dw, ds, lw, timeout=120 + 4 * (dw + ds) * guess_ddp)
            row.update(ddp_meas_ms=1e3 * statistics.median(out[0]["times"]), ddp_compute_ms=1e3 * comp_s,
                       ddp_steps=ds, ddp_warmup=dw, ddp_buckets=[list(b) for b in out[0].get("buckets", [])])
    row["row_s"] = time.perf_counter() - t_row
    judge(row, model, codec)
    return row


def _ratio(num, den):
    return num / den if den else float("nan")


def judge(row, model, codec):
    """The model's figures of a measured ``row`` (in place): the predicted comm, kernels and bytes
    of its buckets (:func:`predict_buckets` with ``model``, the setup's :func:`cost_model`),
    ratio and "within" (shaped setups only), the bytes ratios (with tc's counts), measured /
    (predicted + floor) (with a floor) and the DDP step's prediction: compute + predicted comm +
    the row's measured kernels (with a DDP measurement). Nothing here is measured, so a saved
    run can be judged again under a changed model (``--repredict``)."""
    pred = predict_buckets(model, codec, [tuple(b) for b in row["buckets"]], row["kind"])
    p_ms, wire = 1e3 * pred["comm_s"], pred["wire_bytes"]
    ratio = _ratio(row["meas_comm_ms"], p_ms)
    row.update(pred_comm_ms=p_ms, ratio=ratio,
               within=bool(abs(ratio - 1.0) <= TOLERANCE) if row["rate"] != "unlimited" else None,
               pred_kernel_ms=1e3 * (pred["encode_s"] + pred["decode_s"]), pred_bytes=wire)
    if row.get("qdisc_bytes") is not None:
        row.update(bytes_ratio=_ratio(row["qdisc_bytes"], wire),
                   payload_ratio=_ratio(row["qdisc_bytes"] - HEADER_BYTES * row["qdisc_packets"], wire))
    if row.get("floor_ms") is not None:
        row["ratio_pred_plus_floor"] = row["meas_comm_ms"] / (p_ms + row["floor_ms"])
    if row.get("ddp_meas_ms") is not None:
        row["ddp_pred_ms"] = row["ddp_compute_ms"] + p_ms + row["meas_kernel_ms"]
        row["ddp_ratio"] = row["ddp_meas_ms"] / row["ddp_pred_ms"]
    return row


HEADER_BYTES = 66
"""Bytes tc counts per packet beyond the TCP payload: Ethernet 14 (loopback and veth both carry
one), IPv4 20, TCP with timestamps 32."""


CALIB_LARGE_NUMEL = 1 << 22
"""Elements of the calibration's large float32 allreduce (16 MiB)."""
CALIB_LARGE_BYTES = 4 * CALIB_LARGE_NUMEL
"""Bytes per rank of the calibration's large all-gather (as many as the large allreduce)."""


def group_ranks(level):
    """Ranks of a calibrated group shape: the W ranks ("flat"), a node's L ("intra"), one per
    node, W / L ("inter")."""
    return {"flat": W, "intra": L, "inter": W // L}[level]


ENGINE_LEVELS = {"lo": ("flat",), "nodes": ("flat", "intra", "inter")}
"""The group shapes calibrated per setup kind (``planner.ENGINE_LEVELS``): the W ranks, and on two
nodes also ``hierarchical``'s groups inside a node and across the nodes."""


def measure_engine(bench, pool, label, levels):
    """``({level: planner.EngineCost}, {level: timings})`` of the gloo ranks of ``pool`` (an
    unshaped setup), for each group shape of ``levels`` (:func:`job_collective`: "flat" the W
    ranks; "intra" / "inter" hierarchical's groups, the sibling groups running at once):
    ``EngineCost.calibrate`` from an allreduce of 2p float32 (p: the group's ranks), an all-gather
    of 8 B per rank, an allreduce of :data:`CALIB_LARGE_NUMEL` float32 and an all-gather of as many
    bytes per rank (16 MiB: its own rate, gloo copies an all-gather's parts into the output) and
    an all-to-all of 8 B per slot (its fixed time, which ``two_phase`` pays; gloo posts an
    all-to-all's sends at once, so the allreduce and the all-gather do not describe it), means
    over --alpha-reps calls (the expected time a step's collectives add up to; see the module
    docstring), the large ones a thirtieth as many, at least 5; each call after a barrier of the
    W ranks, the mean over ranks."""
    a = bench.a
    engines, timings = {}, {}
    big = CALIB_LARGE_BYTES
    for level in levels:
        p = group_ranks(level)
        t = {}
        for key, kind, n in (("small_allreduce_s", "allreduce", 2 * p), ("small_all_gather_s", "all_gather", 8),
                             ("large_allreduce_s", "allreduce", CALIB_LARGE_NUMEL),
                             ("large_all_gather_s", "all_gather", big), ("small_all_to_all_s", "all_to_all", 8)):
            reps = a.alpha_reps if n < CALIB_LARGE_NUMEL else max(5, a.alpha_reps // 30)
            ts = pool.run(job_collective, kind, n, reps, level, timeout=600)
            t[key] = expected_s(ts)
        eng = engine_from_timings(t, level)
        bench.log(f"engine on {label}, {level} ({p} ranks): {eng!r} ({describe_timings(t, p)})")
        engines[level], timings[level] = eng, t
    return engines, timings


def expected_s(per_rank):
    """The expected time (s) of a calibration collective from ``per_rank`` (one list of call
    times per rank, :func:`job_collective`, as many calls on each): the mean of them all, which
    is the mean over calls of the mean over ranks. A mean, not a median: the model adds up a
    step's collectives, and the sum of many skewed times tends to the sum of their means (on this
    host the median of a 2-rank all-gather also jumps between the two modes of its time from one
    pool to the next; module docstring)."""
    return statistics.fmean(t for times in per_rank for t in times)


def engine_from_timings(t, level):
    """``planner.EngineCost.calibrate`` of one group shape's timings ``t`` (:func:`measure_engine`;
    a run saved before the all-to-all was timed has no ``small_all_to_all_s``: the model then
    infers the all-to-all's fixed time, as it did)."""
    from gradcomp import planner

    big = CALIB_LARGE_BYTES
    return planner.EngineCost.calibrate(group_ranks(level), t["small_allreduce_s"], t["small_all_gather_s"], t["large_allreduce_s"], big,
                                        large_all_gather=(t["large_all_gather_s"], big),
                                        small_all_to_all_s=t.get("small_all_to_all_s"))


def describe_timings(t, p):
    """One calibration's timings, as the preamble and the log print them."""
    return (f"allreduce of {2 * p} float32 {1e6 * t['small_allreduce_s']:.0f} us, all-gather of 8 B per rank "
            f"{1e6 * t['small_all_gather_s']:.0f} us, allreduce of {CALIB_LARGE_NUMEL} float32 "
            f"{1e3 * t['large_allreduce_s']:.1f} ms, all-gather of {CALIB_LARGE_BYTES} B per rank "
            f"{1e3 * t['large_all_gather_s']:.1f} ms"
            + (f", all-to-all of 8 B per slot {1e6 * t['small_all_to_all_s']:.0f} us" if "small_all_to_all_s" in t else ""))


def calibrate(bench, models, kinds):
    """Once per run, unshaped: the engine cost of each setup kind in ``kinds`` (``lo``: one
    namespace; ``nodes``: the two joined by an unshaped veth pair; :func:`measure_engine`), and
    on the loopback the DDP bucket layouts and the compute times."""
    from gradcomp.experiments import links
    from gradcomp.experiments.pool import GlooPool

    out = {"layouts": {}, "compute_s": {}, "params": {}, "engine": {}, "engine_timings": {}}
    for kind in sorted(set(kinds) | {"lo"}):
        ctx = links.shaped_loopback("unlimited") if kind == "lo" else links.two_nodes("unlimited", ranks_per_node=L)
        with ctx as net:
            with GlooPool(W, threads=1, gloo_timeout_s=600, netns=net.rank_netns(W), env=net.rank_env(W)) as pool:
                if kind == "nodes":
                    pool.run(job_groups)  # before the flat calibration: the state the rows run in
                out["engine"][kind], out["engine_timings"][kind] = measure_engine(bench, pool, f"{kind}:unlimited",
                                                                                  ENGINE_LEVELS[kind])
                if kind != "lo":
                    continue
                for m in models:
                    r = pool.run(job_ddp, m, "none", "dense", False, 2, 1, timeout=600)
                    out["layouts"][m] = [(n, dt) for n, dt, _, _ in r[0]["buckets"]]
                    out["params"][m] = r[0]["numel"]
                    c = pool.run(job_ddp, m, None, None, False, 2, 5 if m == "digits" else 3, timeout=600)
                    out["compute_s"][m] = statistics.median(c[0]["times"])
                    bench.log(f"{m}: {r[0]['numel']} parameters, DDP buckets {out['layouts'][m]}, compute "
                              f"{1e3 * out['compute_s'][m]:.1f} ms per DDP step (noop hook)")
    return out


HEAD = ("| setup | model | codec | scheme | steps | comm meas ms | comm pred ms | ratio | within 15% | "
        "floor ms | meas/(pred+floor) | tbf credit ms | kernels ms | tc MB/step | pred MB/step | bytes ratio | payload ratio | "
        "drops | DDP meas ms | DDP pred ms | DDP ratio |")
NCOLS = HEAD.count("|") - 1


def _f(v, fmt):
    return "-" if v is None or isinstance(v, float) and math.isnan(v) else format(v, fmt)


def fmt_row(r):
    within = "n/a (unshaped)" if r["within"] is None else ("yes" if r["within"] else "NO")
    return (f"| {r['setup']} | {r['model']} | {r['codec']} | {r['scheme']} | {r['steps']} | "
            f"{r['meas_comm_ms']:.2f} | {r['pred_comm_ms']:.2f} | {_f(r['ratio'], '.3f')} | {within} | "
            f"{_f(r.get('floor_ms'), '.2f')} | {_f(r.get('ratio_pred_plus_floor'), '.3f')} | "
            f"{r['tbf_credit_ms']:.1f} | "
            f"{r['meas_kernel_ms']:.2f} | {_f(r.get('qdisc_bytes', None) and r['qdisc_bytes'] / 1e6, '.4f')} | "
            f"{r['pred_bytes'] / 1e6:.4f} | {_f(r.get('bytes_ratio'), '.4f')} | {_f(r.get('payload_ratio'), '.4f')} | "
            f"{_f(r.get('qdisc_dropped'), 'd')} | {_f(r.get('ddp_meas_ms'), '.1f')} | {_f(r.get('ddp_pred_ms'), '.1f')} | "
            f"{_f(r.get('ddp_ratio'), '.2f')} |")


def _clean(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def preamble_lines(calib, tbf, alpha_reps, hier, cores):
    """The table's heading lines: the calibration, the tbf devices, the compute times, the method."""
    lines = [
        f"# slow_link: W = {W} gloo ranks (one thread each) on {cores} cores. Engine cost per setup kind "
        f"and group shape (flat: the {W} ranks; intra / inter: hierarchical's 2-rank groups inside / across the "
        f"nodes, both at once), calibrated once on its unshaped setup (planner.EngineCost.calibrate; each collective "
        f"after a barrier, means over {alpha_reps} calls): " + "; ".join(
            f"{k} {lv}: {describe_timings(t, group_ranks(lv))}: {calib['engine'][k][lv]!r}"
            for k, ts in calib["engine_timings"].items() for lv, t in ts.items()) + ".",
        "# tbf per shaped device: " + "; ".join(
            f"{r}: rate {t['rate_bits_per_s']} bit/s, burst {t['burst_bytes']} B, limit {t['limit_bytes']} B (HZ {t['hz']})"
            for r, t in tbf.items() if t),
        "# compute per DDP step (noop hook, unshaped): " + ", ".join(
            f"{m} {1e3 * v:.1f} ms" for m, v in calib["compute_s"].items()),
        "# comm meas = median over steps of the sum over buckets of the compressor's comm_s (mean over ranks), every "
        "collective started after a barrier; floor = the same row measured on the unshaped setup of the same kind; "
        "tbf credit = comm phases per step x burst / rate, the most a token bucket can lend an idle link; "
        "bytes: tc's Sent bytes per step (the alignment barriers' taken off) vs the planner's; payload ratio takes "
        "66 B per packet off first.",
    ]
    if not hier:
        lines.append("# hierarchical rows missing: 'hierarchical' is not in gradcomp.torch.compressor.SCHEME_CHOICES")
    return lines


def write_outputs(out, preamble, rows, skipped, wall, config):
    """``out``/slow_link.md (the preamble, the table, the summary, the skipped rows) and
    ``out``/slow_link.json (``config``, every row, the skipped ones); returns the summary lines."""
    shaped = [r for r in rows if r["within"] is not None]
    summary = (f"{sum(r['within'] for r in shaped)} of {len(shaped)} shaped rows within 15 %; "
               f"{len(rows) - len(shaped)} unshaped (floor) rows; {len(skipped)} skipped; {wall:.0f} s")
    skip = [f"- skipped {x['row']}: {x['why']}" for x in skipped]
    lines = preamble + ["", HEAD, "|" + "---|" * NCOLS] + [fmt_row(r) for r in rows] + ["", summary] + skip
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "slow_link.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "slow_link.json"), "w") as f:
        json.dump(_clean({"config": config, "rows": rows, "skipped": skipped, "wall_s": wall}), f, indent=1)
    return [summary] + skip


def calibration_json(calib):
    """:func:`calibrate`'s output with its engine costs as dicts (the JSON's ``calibration``)."""
    return dict(calib, engine={k: {lv: e.to_dict() for lv, e in es.items()} for k, es in calib["engine"].items()})


def repredict(path, out):
    """Judge the rows of a saved run (``path``: its slow_link.json) again under the planner as it
    is now (:func:`judge`; the engine costs recalibrated from the saved timings): rewrites
    ``out``/slow_link.md and slow_link.json. Nothing is measured.

    Raises:
        ValueError: a JSON without the per-group-shape timings this version saves.
    """
    from gradcomp import Codec

    with open(path) as f:
        saved = json.load(f)
    cfg = saved["config"]
    calib = cfg["calibration"]
    try:
        calib["engine"] = {k: {lv: engine_from_timings(t, lv) for lv, t in ts.items()}
                           for k, ts in calib["engine_timings"].items()}
    except (KeyError, AttributeError, TypeError) as e:
        raise ValueError(f"slow_link: {path}: no per-group-shape calibration timings ({e!r}); accepted: the "
                         f"slow_link.json of this version of the bench") from e
    models = {}
    for r in saved["rows"]:
        if r["setup"] not in models:
            models[r["setup"]] = cost_model(r["kind"], r["rate"], calib["engine"][r["kind"]])
        judge(r, models[r["setup"]], Codec(r["codec"]))
    preamble = preamble_lines(calib, cfg["tbf"], cfg["args"]["alpha_reps"], cfg["hierarchical"], cfg.get("cores", "?"))
    preamble.insert(1, f"# judged again (--repredict {path}) under the planner as it is now; measured as saved")
    config = dict(cfg, calibration=calibration_json(calib))
    return write_outputs(out, preamble, saved["rows"], saved.get("skipped", []), saved.get("wall_s", 0.0), config)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short subset (see the docstring)")
    ap.add_argument("--out", default="results/slow_link", help="output folder (default results/slow_link)")
    ap.add_argument("--setups", default=None, help="comma-separated lo:RATE / nodes:RATE (default: "
                    + ",".join(SETUPS) + ")")
    ap.add_argument("--models", default=None, help="comma-separated: digits, mlp25m (default both)")
    ap.add_argument("--codecs", default=None, help="';'-separated codec specs (default: none, fp16, "
                    "topk:ratio=0.01 and the registered quantizers)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per row (default: digits 40, mlp25m 5)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per row (default: digits 3, mlp25m 1)")
    ap.add_argument("--alpha-reps", type=int, default=300, help="small collectives timed for the engine cost "
                    "(300; the large allreduce and all-gather: a thirtieth, at least 5)")
    ap.add_argument("--row-limit-s", type=float, default=60.0, help="seconds one row may take (60)")
    ap.add_argument("--budget-s", type=float, default=1800.0, help="seconds for the whole bench (1800)")
    ap.add_argument("--no-ddp", action="store_true", help="skip the DDP step measurements")
    ap.add_argument("--repredict", metavar="JSON", default=None,
                    help="measure nothing: judge a saved run's slow_link.json again under the planner as it is now, "
                         "writing --out")
    a = ap.parse_args(argv)
    if a.repredict:
        try:
            print("\n".join(repredict(a.repredict, a.out)))
        except (OSError, ValueError) as e:
            ap.error(f"--repredict: {e}")
        print(f"wrote {os.path.join(a.out, 'slow_link.md')} and slow_link.json")
        return 0
    if a.steps is not None and a.steps < 1 or a.warmup is not None and a.warmup < 0 or a.alpha_reps < 1:
        ap.error("--steps and --alpha-reps must be >= 1, --warmup >= 0")
    if a.quick:
        a.steps = a.steps or 3
        a.warmup = 1 if a.warmup is None else a.warmup
    try:
        setups = [parse_setup(x.strip()) for x in (a.setups.split(",") if a.setups else
                                                    (QUICK_SETUPS if a.quick else SETUPS)) if x.strip()]
    except ValueError as e:
        ap.error(str(e))
    models = [m.strip() for m in a.models.split(",")] if a.models else (["digits"] if a.quick else list(MODELS))
    for m in models:
        if m not in MODELS:
            ap.error(f"--models: {m!r}; accepted: {', '.join(MODELS)}")
    from gradcomp import Codec
    from gradcomp.experiments import links
    from gradcomp.torch import compressor

    codecs = [c.strip() for c in a.codecs.split(";") if c.strip()] if a.codecs else codec_list(a.quick)
    for c in codecs:
        try:
            Codec(c)
        except Exception as e:  # noqa: BLE001 - the codec's own message
            ap.error(f"--codecs: {c!r}: {e}")
    ok, why = links.available()
    if not ok:
        print(f"slow_link: cannot build the shaped links here: {why}", file=sys.stderr)
        return 2
    hier = "hierarchical" in compressor.SCHEME_CHOICES
    per_model = {m: list(codecs) for m in models}
    if a.quick and "mlp25m" not in per_model:
        per_model["mlp25m"] = ["topk:ratio=0.01", "int4"]
    bench = Bench(a)
    calib = calibrate(bench, sorted(per_model), [k for k, _ in setups])
    tbf = {r: links.tbf_params(r) for _, r in setups}
    preamble = preamble_lines(calib, tbf, a.alpha_reps, hier, os.cpu_count())
    print("\n".join(preamble))
    print(HEAD)
    print("|" + "---|" * NCOLS, flush=True)
    try:
        for kind, rate in setups:
            run_setup(bench, kind, rate, calib, per_model, [m for m in MODELS if m in per_model], hier)
    except KeyboardInterrupt:
        bench.log("interrupted: writing what was measured")
    wall = time.perf_counter() - bench.t0
    config = {"world_size": W, "ranks_per_node": L, "tolerance": TOLERANCE, "cores": os.cpu_count(),
              "calibration": calibration_json(calib),
              "tbf": tbf, "args": vars(a), "hierarchical": hier, "barrier_bytes": bench.barrier_bytes,
              "header_bytes_per_packet": HEADER_BYTES}
    summary = write_outputs(a.out, preamble, bench.rows, bench.skipped, wall, config)
    print()
    print("\n".join(summary))
    print(f"wrote {os.path.join(a.out, 'slow_link.md')} and slow_link.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
