"""``gradcomp-plan``: bytes, link time and exposed time of a training step's gradient
synchronization per codec and scheme, from :mod:`gradcomp.planner`'s cost model.

Examples::

    gradcomp-plan --params 70e9 --gpus 512 --step-time 2          # 280 GB/step, 1.12 Tb/s
    gradcomp-plan --params 1.3B --gpus 64 --gpus-per-node 8 --link-gbps network=100 \\
        --codec none --codec bf16 --codec topk:ratio=0.01 --scheme all --out results/plan
    gradcomp-plan --model torch.nn:Transformer --gpus 16 --json
    gradcomp-plan --figures                                        # the published figures
    gradcomp-plan --engine fsdp2 --gpus 512 --gpus-per-node 8 --params 70B   # FSDP2 over 64 nodes
    gradcomp-plan --engine hsdp --gpus 512 --gpus-per-node 8 --params 70B    # shard in a node, replicate across

``--engine`` is the training engine: ``ddp`` (the default: DDP's buckets, below), ``fsdp2``
(``fully_shard`` over all W ranks) or ``hsdp`` (``fully_shard`` inside each node of L ranks and an
all-reduce of every shard across the W / L replicas); ``--backend nccl|gloo`` is the collective
backend. ``--engine nccl`` / ``--engine gloo`` keep their former meaning: DDP on that backend.

Prints a table (one row per codec and scheme: bytes one rank sends per synchronization inside
nodes and across nodes, communication / encode / decode / exposed time in ms, the step time and
the speed-up over the flat dense allreduce, split into the part the scheme gives and the part the
codec gives), writes ``plan.json`` and ``plan_step_vs_bandwidth.png`` (against the bandwidth of
the slowest link level, 1 to 800 Gb/s: the step time of each codec, and its speed-up over dense
with the bandwidth where it stops paying) under ``--out``. ``--json`` prints the JSON to stdout
instead of the table. Units: bytes, seconds (ms in the table), bits/s for link rates.

For ``--engine fsdp2|hsdp`` (:func:`plan_fsdp`, :func:`print_fsdp_table`) the table has, per codec
and per place compression goes (``dense``; ``reduce_scatter``, gradcomp's all-to-all; ``hsdp``
also ``replica_all_reduce`` and ``both``): the bytes one rank sends per step in the parameter
all-gather (AG), the gradient reduce-scatter (RS) and the replica all-reduce (AR) by link level,
the bytes one node sends into the network, the predicted times and the ratios to dense
(:func:`gradcomp.planner.plan_fsdp_variants`); ``--param-dtype`` (all-gather, default bfloat16),
``--reduce-dtype`` (default each parameter's: FSDP2 2.15's ``reduce_dtype=None``; float32 for
``--params``), ``--reshard-after-forward true|false``, ``--units`` (FSDP units a ``--params``
count is cut into, default 1; a ``--model``'s are its ModuleList blocks and the root),
``--min-compress-numel``; ``--scheme`` is hsdp's replica all-reduce scheme. ``--out`` writes
``plan.json`` only.

Like for like: the first row is the flat dense allreduce (every byte at the slowest link's rate,
what a plain DDP allreduce is modelled as); every codec, ``none`` (uncompressed) included, then
gets the same scheme candidates (``--scheme auto``: the cost model's choice per bucket, the
hierarchical two-level reduction included when there is more than one node). ``x total`` =
dense (flat)'s time / the row's = ``x scheme`` (dense (flat) / codec ``none`` under the row's
scheme: what the topology alone gives) times ``x codec`` (``none`` under that scheme / the row's:
what compression adds). The times compared are step times with ``--step-time`` (compute
included, so a speed-up is what a user sees), else the exposed communication times without
overlap (communication + kernels, marked ``(comm)``): the time left after ``--backward`` can be
near zero, and a ratio of it means nothing (the ``overlap`` column shows it).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from typing import List, Optional

from . import planner

ENGINES = ("ddp",) + planner.FSDP_ENGINES
BACKENDS = ("nccl", "gloo")
DEFAULT_CODECS = ("none", "bf16", "fp8", "int8", "int4", "onebit", "topk:ratio=0.01")
SWEEP_GBPS = [1, 2, 5, 10, 20, 50, 100, 200, 400, 800]
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> int:
    """A parameter count: ``70e9``, ``70B``, ``1.3b``, ``125M``, ``25000000``.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    t = str(text).strip().lower()
    mult = _SUFFIX.get(t[-1:], 1.0)
    num = t[:-1] if t[-1:] in _SUFFIX else t
    try:
        v = float(num) * mult
    except ValueError:
        v = float("nan")
    if not (v >= 0 and math.isfinite(v)) or abs(v - round(v)) > 1e-6 * max(1.0, v):
        raise argparse.ArgumentTypeError(f"--params {text!r}: expected a whole number such as 70e9, 70B, 125M")
    return int(round(v))


def load_model(spec: str):
    """``module:attr`` -> a torch module: attr is a module instance, or a class / function
    called with no arguments.

    Raises:
        ValueError: not ``module:attr``, or attr does not give a module with named_parameters.
    """
    if ":" not in spec:
        raise ValueError(f"--model {spec!r}: expected module:attr (e.g. torch.nn:Transformer)")
    mod, attr = spec.split(":", 1)
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import {mod!r}: {e}") from None
    for part in attr.split("."):
        obj = getattr(obj, part)
    import torch

    if not isinstance(obj, torch.nn.Module) and callable(obj):
        try:
            obj = obj()
        except TypeError as e:
            raise ValueError(f"--model {spec!r}: calling it with no arguments failed: {e}") from None
    if not isinstance(obj, torch.nn.Module):
        raise ValueError(f"--model {spec!r} gives a {type(obj).__name__}, not a torch module")
    return obj


def parse_levels(items: Optional[List[str]], kind: str) -> dict:
    """``["network=100", "nvlink=3600"]`` -> ``{level: float}``; levels are planner.LINK_LEVELS
    and ``intra`` / ``inter``.

    Raises:
        ValueError: a malformed item or an unknown level.
    """
    out = {}
    accepted = tuple(planner.LINK_LEVELS) + ("intra", "inter")
    for it in items or []:
        for part in str(it).split(","):
            if "=" not in part:
                raise ValueError(f"{kind} {part!r}: expected LEVEL=VALUE with LEVEL one of {', '.join(accepted)}")
            lv, v = part.split("=", 1)
            lv = lv.strip().lower()
            if lv not in accepted:
                raise ValueError(f"{kind} level {lv!r}; accepted: {', '.join(accepted)}")
            try:
                out[lv] = float(v)
            except ValueError:
                raise ValueError(f"{kind} {part!r}: {v!r} is not a number") from None
    return out


def parse_engine_cost(text: Optional[str]) -> Optional[planner.EngineCost]:
    """``--engine-cost US,ALPHA_US,GBYTES_PER_S[,ALL_GATHER_GBYTES_PER_S[,ALL_TO_ALL_US]]`` as a
    :class:`gradcomp.planner.EngineCost` (None without one); the optional fourth number is the
    all-gather's own rate (``kind_bytes_per_s["all_gather"]``), the optional fifth the
    all-to-all's measured fixed time in microseconds (``kind_fixed_s["all_to_all"]``).

    Raises:
        ValueError: not three to five numbers, or values EngineCost refuses (the message names
            them).
    """
    if text is None:
        return None
    parts = str(text).split(",")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        nums = []
    if len(nums) not in (3, 4, 5):
        raise ValueError(f"--engine-cost {text!r}; accepted: three to five numbers "
                         f"US,ALPHA_US,GBYTES_PER_S[,ALL_GATHER_GBYTES_PER_S[,ALL_TO_ALL_US]] "
                         f"(e.g. 1800,500,1.0 or 1800,500,1.0,0.4 or 1800,500,1.0,0.4,2000)")
    us, alpha_us, gbs = nums[:3]
    kinds = {"all_gather": nums[3] * 1e9} if len(nums) >= 4 else None
    fixed = {"all_to_all": nums[4] * 1e-6} if len(nums) == 5 else None
    return planner.EngineCost(us * 1e-6, gbs * 1e9, alpha_us * 1e-6, kinds, fixed)


def build_model(args, W: int, L: int, rate_gbps: Optional[float] = None) -> planner.CostModel:
    """The cost model of the command line (``rate_gbps``: override the slowest level's rate)."""
    gb = parse_levels(args.link_gbps, "--link-gbps")
    lat = parse_levels(args.latency_us, "--latency-us")

    def level(name, alias):
        base = planner.LINK_LEVELS[name]
        g = gb.get(alias, gb.get(name))
        us = lat.get(alias, lat.get(name))
        return planner.Link(base.bytes_per_s if g is None else g * 1e9 / 8,
                            base.latency_s if us is None else us * 1e-6, name=name)

    intra = level(args.intra, "intra")
    nodes = W // L
    inter = level("network", "inter") if nodes > 1 else None
    if inter is not None and args.nic_per_node:
        inter = planner.Link(inter.bytes_per_s, inter.latency_s, name=inter.name, per_node=True)
    if rate_gbps is not None:
        slow = inter if inter is not None else intra
        slow = planner.Link(rate_gbps * 1e9 / 8, slow.latency_s, name=slow.name, per_node=slow.per_node)
        if inter is not None:
            inter = slow
        else:
            intra = slow
    if args.throughput:
        from .bench import load

        tp = planner.Throughput(table=load(args.throughput))
    else:
        tp = planner.Throughput(device=args.gpu)
    return planner.CostModel(intra, inter, L if nodes > 1 else 0, tp, args.backend, not args.no_error_feedback,
                             parse_engine_cost(args.engine_cost))


def _codec(spec: str):
    if spec == "none":
        try:
            import gradcomp

            return gradcomp.Codec("none")
        except Exception:  # noqa: BLE001 - the planner's own none works without the native module
            return planner._NoneCodec()
    import gradcomp

    return gradcomp.Codec(spec)


def _schemes(args, codec, nodes: int) -> List[str]:
    if args.scheme != "all":
        return [args.scheme]
    # the flat schemes auto's cost model considers for this codec, then (over nodes) the others
    out = ["auto"] + list(planner.schemes.candidates(codec))
    return out + (list(planner.schemes.names(flat=False)) if nodes > 1 else [])


def _row(params, codec, W, model, sch, kw, args) -> dict:
    p = planner.plan_step(params, codec, W, model, sch, **kw)
    used = {}
    for b in p["buckets"]:
        nm = b["scheme"] + (f"({b['inner']})" if b["inner"] else "")
        used[nm] = used.get(nm, 0) + b["count"]
    row = {k: v for k, v in p.items() if k != "buckets"}
    row["schemes_used"] = used
    row["buckets"] = p["buckets"] if args.buckets else len(p["buckets"])
    return row


def plan(args) -> dict:
    """The whole plan as a JSON-able dict (what ``--json`` prints): ``rows`` (the flat dense
    allreduce first, then one per codec and scheme, each with ``speedup_vs_dense``,
    ``scheme_gain``, ``codec_gain`` and ``compared`` = the time they divide: "step_s" or
    "exposed_s"), ``sweep`` (per bandwidth and codec, on the cost model's scheme choice:
    step and exposed times, ``speedup_vs_dense`` over the flat dense allreduce and ``codec_gain``
    over codec none on the same scheme candidates, at that bandwidth)."""
    params = planner.parameter_list(load_model(args.model) if args.model else args.params)
    W = int(args.gpus)
    L = int(args.gpus_per_node) if args.gpus_per_node else min(W, 8)
    if W < 1 or L < 1 or W % L:
        raise ValueError(f"--gpus {W} / --gpus-per-node {L}: both >= 1 and gpus-per-node must divide gpus")
    nodes = W // L
    model = build_model(args, W, L)
    kw = dict(dtype=args.dtype, accumulate=args.accumulate, step_time_s=args.step_time, backward_s=args.backward,
              bucket_cap_bytes=int(args.bucket_mb * (1 << 20)), min_compress_numel=args.min_compress_numel)
    key = "step_s" if args.step_time is not None else "exposed_s"  # never the overlap residue
    none = _codec("none")
    dense = _row(params, none, W, model, "dense", kw, args)
    dense["reference"] = True
    rows = [dense]
    baselines = {"dense": dense}  # codec none under each scheme: what the scheme alone gives
    for spec in args.codec or DEFAULT_CODECS:
        codec = _codec(spec)
        for sch in _schemes(args, codec, nodes):
            if sch == "hierarchical" and nodes < 2:
                continue
            if spec == "none" and sch == "dense":
                continue  # the reference row
            if sch not in baselines:
                baselines[sch] = _row(params, none, W, model, sch, kw, args)
            row = baselines[sch] if spec == "none" else _row(params, codec, W, model, sch, kw, args)
            rows.append(dict(row))
    for r in rows:
        base = baselines[r["scheme"]][key]
        r["compared"] = key
        r["speedup_vs_dense"] = _ratio(dense[key], r[key])
        r["scheme_gain"] = _ratio(dense[key], base)
        r["codec_gain"] = _ratio(base, r[key])
    sweep = []
    for g in SWEEP_GBPS:
        m = build_model(args, W, L, rate_gbps=g)
        ref = planner.plan_step(params, none, W, m, "dense", **kw)
        best = planner.plan_step(params, none, W, m, "auto", **kw)  # uncompressed on the same candidates
        for spec in ["dense (flat)"] + list(args.codec or DEFAULT_CODECS):
            p = ref if spec == "dense (flat)" else best if spec == "none" else planner.plan_step(
                params, _codec(spec), W, m, "auto", **kw)
            sweep.append({"gbps": g, "codec": spec, "exposed_s": p["exposed_s"],
                          "exposed_overlap_s": p["exposed_overlap_s"],
                          "step_s": p["step_s"], "speedup_vs_dense": _ratio(ref[key], p[key]),
                          "codec_gain": _ratio(best[key], p[key])})
    gb = rows[0]["gradient_bytes"]  # the same for every codec (plan_step's dense gradient)
    return {"format": "gradcomp-plan/1",
            "inputs": {"params": sum(n for _, n, _ in params), "tensors": len(params), "dtype": args.dtype,
                       "gpus": W, "gpus_per_node": L, "nodes": nodes, "accumulate": args.accumulate,
                       "step_time_s": args.step_time, "backward_s": args.backward, "bucket_mb": args.bucket_mb,
                       "cost_model": model.describe()},
            "gradient_bytes": gb,
            "required_bytes_per_s": gb / (args.accumulate * args.step_time) if args.step_time else None,
            "required_bits_per_s": 8 * gb / (args.accumulate * args.step_time) if args.step_time else None,
            "rows": rows, "sweep": sweep}


def _ratio(a, b):
    return a / b if a is not None and b else None


def _fmt_bytes(b: float) -> str:
    for unit, s in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= s:
            return f"{b / s:.3g} {unit}"
    return f"{b:.3g} B"


def print_table(res: dict, out=None) -> None:
    """The human-readable table of a :func:`plan` result, to ``out`` (default stdout)."""
    out = out or sys.stdout
    i = res["inputs"]
    print(f"gradcomp-plan: {i['params']:,} parameters in {i['tensors']} tensors, W = {i['gpus']} "
          f"({i['nodes']} nodes x {i['gpus_per_node']}), accumulate {i['accumulate']}; gradient "
          f"{_fmt_bytes(res['gradient_bytes'])} per step", file=out)
    cm = i["cost_model"]
    links = [f"intra {cm['intra']['name']} {cm['intra']['bits_per_s'] / 1e9:g} Gb/s"]
    if cm["inter"]:
        links.append(f"inter {cm['inter']['name']} {cm['inter']['bits_per_s'] / 1e9:g} Gb/s")
    print("links: " + ", ".join(links) + f"; kernels: {cm['throughput']}; engine {cm['engine']}", file=out)
    if res["required_bytes_per_s"] is not None:
        print(f"required bandwidth at {i['step_time_s']:g} s per micro-batch: "
              f"{_fmt_bytes(res['required_bytes_per_s'])}/s = {res['required_bits_per_s'] / 1e12:.4g} Tb/s", file=out)
    comm = res["rows"][0]["compared"] != "step_s"
    hdr = (f"{'codec':<18} {'scheme':<12} {'intra/rank':>11} {'inter/rank':>11} {'comm ms':>9} {'enc ms':>8} "
           f"{'dec ms':>8} {'exposed':>9} {'overlap':>9} {'step s':>8} {'x total':>8} {'x scheme':>8} "
           f"{'x codec':>8}  schemes")
    print(hdr, file=out)
    what = ("exposed times without overlap (comm: no --step-time given)" if comm else "step times")
    print(f"(bytes one rank sends per synchronization; exposed = communication + kernels with no overlap; "
          f"overlap = what is left after --backward; x total = dense (flat)'s / the row's {what} = x scheme "
          f"(codec none under the row's scheme) * x codec (the codec under that scheme))", file=out)

    def x(v):
        return "" if v is None else f"{v:.3g}x"

    for r in res["rows"]:
        step = "" if r["step_s"] is None else f"{r['step_s']:.4g}"
        used = ", ".join(f"{k} x{v}" for k, v in r["schemes_used"].items())
        scheme = "dense(flat)" if r.get("reference") else r["scheme"]
        print(f"{r['codec']:<18} {scheme:<12} {_fmt_bytes(r['bytes']['intra']):>11} "
              f"{_fmt_bytes(r['bytes']['inter']):>11} {1e3 * r['comm_s']:9.4g} {1e3 * r['encode_s']:8.3g} "
              f"{1e3 * r['decode_s']:8.3g} {1e3 * r['exposed_s']:9.4g} {1e3 * r['exposed_overlap_s']:9.4g} "
              f"{step:>8} {x(r['speedup_vs_dense']):>8} {x(r['scheme_gain']):>8} {x(r['codec_gain']):>8}  {used}",
              file=out)


_VARIANT_NAMES = {"dense": "(dense)", "reduce_scatter": "reduce-scatter", "replica_all_reduce": "replica AR",
                  "both": "RS + AR"}
_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "replica_all_reduce": "AR"}


def _layout(args):
    """(W, L, nodes) of the command line, checked for ``args.engine``.

    Raises:
        ValueError: W or L < 1, or L not dividing W (named, with what is accepted).
    """
    W = int(args.gpus)
    L = int(args.gpus_per_node) if args.gpus_per_node else min(W, 8)
    if W < 1 or L < 1:
        raise ValueError(f"--gpus {W} / --gpus-per-node {L}: both must be >= 1")
    if W % L:
        what = {"hsdp": "HSDP shards inside a node and replicates across whole nodes",
                "fsdp2": "FSDP2 over whole nodes"}.get(args.engine, "whole nodes")
        raise ValueError(f"--engine {args.engine}: --gpus {W} is not a multiple of --gpus-per-node {L}; accepted: "
                         f"--gpus = a multiple of --gpus-per-node ({what}), e.g. {W - W % L or L} or {W + L - W % L}")
    return W, L, W // L


def plan_fsdp(args) -> dict:
    """The plan of ``--engine fsdp2|hsdp`` as a JSON-able dict (what ``--json`` prints): ``inputs``
    (the layout, dtypes, cost model), ``param_bytes`` / ``gradient_bytes`` (unpadded, in the
    all-gather / reduce dtype), ``rows`` (the dense variant first, ``reference``; then per codec
    its other variants: :func:`gradcomp.planner.plan_fsdp_step`'s dict with the ratios to that
    dense row and ``fastest``, the codec's variant of least time, dense included), and for
    fsdp2 over several nodes ``reduce_scatter_per_node`` (the bytes one node sends into the
    network in the reduce-scatter: the dense ring's, the all-to-all's with codec ``none``, their
    ratio and the formula's L (W-L)/(W-1)).

    Raises:
        ValueError: as :func:`_layout` and :func:`gradcomp.planner.plan_fsdp_step`.
    """
    W, L, nodes = _layout(args)
    src = load_model(args.model) if args.model else args.params
    units = planner.fsdp_units(src, None if args.model else (args.units or 1))
    model = build_model(args, W, L)
    kw = dict(param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype,
              reshard_after_forward=args.reshard_after_forward != "false", scheme=args.scheme,
              min_compress_numel=args.min_compress_numel, step_time_s=args.step_time)
    rows, ref = [], None
    for spec in args.codec or DEFAULT_CODECS:
        vs = planner.plan_fsdp_variants(units, _codec(spec), W, model, engine=args.engine, **kw)
        if ref is None:
            ref = dict(vs[0], codec="none", reference=True)
            rows.append(ref)
        rows += vs[1:]  # a codec none of whose rows is ``fastest``: dense is faster
    key = "step_s" if args.step_time is not None else "total_s"
    for r in rows[1:]:
        r["inter_bytes_vs_dense"] = _ratio(r["bytes"]["inter"], ref["bytes"]["inter"])
        r["node_inter_bytes_vs_dense"] = _ratio(r["node_inter_bytes"], ref["node_inter_bytes"])
        r["speedup_vs_dense"] = _ratio(ref[key], r[key])
    ref["fastest"] = None  # the codecs' rows say which of them beats it
    out = {"format": "gradcomp-plan/1",
           "inputs": {"engine": args.engine, "params": ref["params"], "tensors": ref["tensors"], "units": ref["units"],
                      "gpus": W, "gpus_per_node": L, "nodes": nodes, "shard_size": ref["shard_size"],
                      "replicas": ref["replicas"], "param_dtype": ref["param_dtype"],
                      "reduce_dtype": ref["reduce_dtype"], "reshard_after_forward": ref["reshard_after_forward"],
                      "min_compress_numel": args.min_compress_numel, "exempt_params": ref["exempt_params"],
                      "step_time_s": args.step_time, "compared": key, "cost_model": model.describe()},
           "param_bytes": ref["param_bytes"], "gradient_bytes": ref["gradient_bytes"], "rows": rows,
           "reduce_scatter_per_node": None}
    if args.engine == "fsdp2" and nodes > 1:
        a2a = planner.plan_fsdp_step(units, _codec("none"), W, model, engine="fsdp2", variant="reduce_scatter", **kw)
        ring_b = ref["collectives"]["reduce_scatter"]["node_inter_bytes"]
        a2a_b = a2a["collectives"]["reduce_scatter"]["node_inter_bytes"]
        out["reduce_scatter_per_node"] = {"ring_bytes": ring_b, "all_to_all_bytes": a2a_b,
                                          "ratio": _ratio(a2a_b, ring_b), "formula": L * (W - L) / (W - 1)}
    return out


def _n(count: int, word: str) -> str:
    return f"{count:,} {word}" + ("" if count == 1 else "s")


def print_fsdp_table(res: dict, out=None) -> None:
    """The human-readable table of a :func:`plan_fsdp` result, to ``out`` (default stdout)."""
    out = out or sys.stdout
    i = res["inputs"]
    rows = res["rows"]
    twice = "non-root units twice: reshard after forward" if i["reshard_after_forward"] else "once: no reshard"
    print(f"gradcomp-plan --engine {i['engine']}: {i['params']:,} parameters in {_n(i['tensors'], 'tensor')}, "
          f"{_n(i['units'], 'FSDP unit')}; W = {i['gpus']} ({_n(i['nodes'], 'node')} x {i['gpus_per_node']}), shard "
          f"groups of {i['shard_size']}, {_n(i['replicas'], 'replica')}", file=out)
    print(f"parameters all-gathered in {i['param_dtype']} ({twice}), {_fmt_bytes(res['param_bytes'])}; gradients "
          f"reduced in {i['reduce_dtype']}, {_fmt_bytes(res['gradient_bytes'])}; {i['exempt_params']:,} elements "
          f"exempt (< 2 dims or < {i['min_compress_numel']} elements)", file=out)
    cm = i["cost_model"]
    links = [f"intra {cm['intra']['name']} {cm['intra']['bits_per_s'] / 1e9:g} Gb/s"]
    if cm["inter"]:
        per = ", one NIC per node" if cm["inter"]["per_node"] else ""
        links.append(f"inter {cm['inter']['name']} {cm['inter']['bits_per_s'] / 1e9:g} Gb/s{per}")
    print("links: " + ", ".join(links) + f"; kernels: {cm['throughput']}; backend {cm['engine']}", file=out)
    cols = [(c, lv) for c in planner.FSDP_COLLECTIVES for lv in ("intra", "inter")
            if any(r["collectives"][c]["bytes"][lv] for r in rows)]
    step = i["compared"] == "step_s"
    print("(per step: bytes one rank sends in each collective by link level -- AG parameter all-gather, RS gradient "
          "reduce-scatter, AR replica all-reduce; inter/node = bytes one node sends into the network; times in s, "
          "summed without overlap" + ("; step = --step-time + total" if step else "") + "; node/dense = the row's "
          "inter/node / dense's; x time = dense's " + ("step" if step else "total") + " time / the row's; * = the "
          "codec's fastest variant; a codec without one: dense is faster)", file=out)
    hdr = f"{'codec':<18} {'compress':<15}" + "".join(f" {_SHORT[c] + ' ' + lv:>10}" for c, lv in cols)
    hdr += (f" {'inter/node':>10} {'comm s':>8} {'enc s':>7} {'dec s':>7} {'total s':>8}"
            + (f" {'step s':>8}" if step else "") + f" {'node/dense':>10} {'x time':>8}")
    if i["engine"] == "hsdp":
        hdr += "  AR schemes"
    print(hdr, file=out)

    def x(v):
        return "" if v is None else f"{v:.3g}x"

    for r in rows:
        line = f"{r['codec']:<18} {_VARIANT_NAMES[r['variant']]:<15}"
        line += "".join(f" {_fmt_bytes(r['collectives'][c]['bytes'][lv]):>10}" for c, lv in cols)
        line += (f" {_fmt_bytes(r['node_inter_bytes']):>10} {r['comm_s']:8.4g} {r['encode_s']:7.3g} "
                 f"{r['decode_s']:7.3g} {r['total_s']:8.4g}" + (f" {r['step_s']:8.4g}" if step else ""))
        best = "*" if r["fastest"] else ""
        line += f" {x(r.get('node_inter_bytes_vs_dense', 1.0)):>10} {x(r.get('speedup_vs_dense', 1.0)) + best:>8}"
        if i["engine"] == "hsdp":
            line += "  " + ", ".join(f"{k} x{v}" for k, v in r["collectives"]["replica_all_reduce"]["schemes"].items())
        print(line.rstrip(), file=out)
    rs = res.get("reduce_scatter_per_node")
    if rs:
        print(f"reduce-scatter across nodes, bytes one node sends into the network per step: dense ring "
              f"{_fmt_bytes(rs['ring_bytes'])}, all-to-all (codec none) {_fmt_bytes(rs['all_to_all_bytes'])} = "
              f"{rs['ratio']:.3g}x (every one of a node's {i['gpus_per_node']} ranks sends (W-L)/(W-1) of its slots "
              f"off the node: L (W-L)/(W-1) = {rs['formula']:.3g})", file=out)


PAYS = 1.01
"""A codec pays where it is at least 1 % faster than the uncompressed allreduce (a tie, e.g. when
backward hides both, is not paying)."""


def crossover_gbps(points) -> Optional[float]:
    """The bandwidth (Gb/s) where a codec stops paying: where its gain over the uncompressed
    allreduce, over the sweep's ``[(gbps, gain)]`` in ascending bandwidth, falls through
    :data:`PAYS` (interpolated in log bandwidth). ``float("inf")`` when it pays over the whole
    sweep, None when it never pays."""
    pts = [(g, v) for g, v in points if v is not None]
    if not pts or all(v < PAYS for _, v in pts):
        return None
    if all(v >= PAYS for _, v in pts):
        return float("inf")
    for (g0, v0), (g1, v1) in zip(pts, pts[1:]):
        if v0 >= PAYS > v1:
            t = (v0 - PAYS) / (v0 - v1)
            return float(math.exp(math.log(g0) + t * (math.log(g1) - math.log(g0))))
    return None


def curve_groups(sweep: list, key: str) -> list:
    """``[(labels, points)]``: the sweep's curves, one per codec in order, codecs whose ``key``
    values are equal at every bandwidth merged into one (e.g. fp8 and int8, which send the same
    bytes); dense (flat) stays alone."""
    by: dict = {}
    for s_ in sweep:
        by.setdefault(s_["codec"], []).append(s_)
    groups: list = []
    for spec, pts in by.items():
        pts = sorted(pts, key=lambda p: p["gbps"])
        for g in groups:
            if spec != "dense (flat)" and "dense (flat)" not in g[0] and all(
                    math.isclose(a[key], b[key], rel_tol=1e-9) for a, b in zip(g[1], pts)):
                g[0].append(spec)
                break
        else:
            groups.append(([spec], pts))
    return groups


def plot(res: dict, path: str) -> str:
    """Two panels against the slowest link's bandwidth: the step time (exposed communication
    time without --step-time) of each codec and of dense (flat), and each codec's gain over the
    uncompressed allreduce on the same schemes (codec none, the cost model's choice: the
    hierarchical reduction included), with the bandwidth where it stops paying marked and named
    in the legend. Codecs whose curves are identical (the same bytes, e.g. fp8 and int8) share
    one line and one label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "step_s" if res["inputs"]["step_time_s"] else "exposed_s"
    groups = curve_groups(res["sweep"], key)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = ["-", "--", "-.", ":"]
    markers = ["o", "s", "^", "v", "D", "P", "X", "<", ">"]
    for i, (labels, pts) in enumerate(groups):
        xs = [p["gbps"] for p in pts]
        ref = labels == ["dense (flat)"]
        name = ", ".join(labels)
        kw = dict(color="black", lw=2.2, ls="-", marker=None) if ref else dict(
            lw=1.4, ls=styles[i % len(styles)], marker=markers[i % len(markers)], ms=4)
        ax.plot(xs, [p[key] for p in pts], label=name, **kw)
        if ref or labels == ["none"]:
            continue
        sp = [p["codec_gain"] for p in pts]
        g = crossover_gbps(list(zip(xs, sp)))
        note = ("never pays" if g is None else f"pays over the whole range" if math.isinf(g)
                else f"pays below {g:.3g} Gb/s")
        (line,) = bx.plot(xs, sp, label=f"{name}: {note}", **kw)
        if g is not None and not math.isinf(g):
            bx.plot([g], [PAYS], marker="*", ms=13, color=line.get_color(), mec="black", mew=0.5, ls="none")
    bx.axhline(1.0, color="black", lw=1)
    bx.axhline(PAYS, color="black", lw=0.6, ls=":")
    for a_ in (ax, bx):
        a_.set_xscale("log")
        a_.set_yscale("log")
        a_.set_xlabel("bandwidth of the slowest link level (Gb/s per rank)")
        a_.grid(True, which="both", alpha=0.3)
    ax.set_ylabel("step time (s)" if key == "step_s" else "exposed communication time (s)")
    bx.set_ylabel("gain over uncompressed on the same schemes: " + ("step time" if key == "step_s" else "exposed time"))
    i = res["inputs"]
    fig.suptitle(f"{i['params'] / 1e6:,.1f}M params, W={i['gpus']} ({i['nodes']}x{i['gpus_per_node']}); "
                 f"codecs on the cost model's scheme choice; * = where a codec stops being 1 % faster than "
                 f"uncompressed (none) on the same schemes", fontsize=10)
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gradcomp-plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--params", type=parse_count, help="model size in parameters (70e9, 70B, 125M)")
    src.add_argument("--model", help="module:attr of a torch module (or a no-argument factory)")
    ap.add_argument("--dtype", default=None, help="gradient dtype (default: each parameter's; --params: float32)")
    ap.add_argument("--gpus", type=int, default=8, help="world size W")
    ap.add_argument("--gpus-per-node", type=int, default=0, help="ranks per node L (default min(W, 8))")
    ap.add_argument("--intra", default="nvlink", choices=("nvlink", "pcie"), help="the link inside a node")
    ap.add_argument("--link-gbps", action="append", metavar="LEVEL=GBPS",
                    help="per-rank bandwidth of a level (nvlink, pcie, network, intra, inter), Gb/s")
    ap.add_argument("--latency-us", action="append", metavar="LEVEL=US", help="per-message latency of a level")
    ap.add_argument("--engine-cost", default=None, metavar="US,ALPHA_US,GBYTES_PER_S[,AG_GBYTES_PER_S[,A2A_US]]",
                    help="a CPU host's collective engine (gloo): microseconds per collective, alpha in "
                         "microseconds per sequential message, GB/s of volume, optionally the all-gather's own "
                         "GB/s and then the all-to-all's measured fixed microseconds (planner.EngineCost; "
                         "bench/slow_link.py prints its calibration); every collective takes the slower of "
                         "its link and this")
    ap.add_argument("--nic-per-node", action="store_true",
                    help="one NIC per node shared by its ranks (default: a NIC per GPU; --link-gbps network= is "
                         "then the node's NIC)")
    ap.add_argument("--step-time", type=float, default=None, help="compute seconds of one micro-batch")
    ap.add_argument("--backward", type=float, default=None, help="backward seconds to overlap with")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per synchronization")
    ap.add_argument("--codec", action="append", metavar="SPEC", help=f"repeatable (default: {', '.join(DEFAULT_CODECS)})")
    ap.add_argument("--scheme", default="auto", choices=("auto", "all") + planner.schemes.names())
    ap.add_argument("--engine", default="ddp", choices=ENGINES + BACKENDS,
                    help="training engine: ddp (default), fsdp2, hsdp; nccl / gloo: the former meaning, DDP on that "
                         "backend")
    ap.add_argument("--backend", default=None, choices=BACKENDS, help="collective backend (default nccl)")
    ap.add_argument("--param-dtype", default=None,
                    help="fsdp2/hsdp: the parameters' all-gather dtype (MixedPrecisionPolicy.param_dtype; default "
                         "bfloat16)")
    ap.add_argument("--reduce-dtype", default=None,
                    help="fsdp2/hsdp: the gradients' reduce dtype (default: each parameter's own, FSDP2 2.15's "
                         "reduce_dtype=None; --params: float32)")
    ap.add_argument("--reshard-after-forward", default=None, choices=("true", "false"),
                    help="fsdp2/hsdp: true (default): non-root units all-gathered in forward and again in backward")
    ap.add_argument("--units", type=int, default=None,
                    help="fsdp2/hsdp with --params: FSDP units of equal size (default 1)")
    ap.add_argument("--min-compress-numel", type=int, default=1024,
                    help="tensors (DDP: buckets) of fewer elements are not compressed (default 1024)")
    ap.add_argument("--gpu", default="H200", choices=tuple(planner.DEVICE_BYTES_PER_S),
                    help="kernel times from this device's bandwidth (without --throughput)")
    ap.add_argument("--throughput", metavar="BENCH_JSON", help="kernel times from a gradcomp-bench JSON")
    ap.add_argument("--no-error-feedback", action="store_true")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap in MiB (default 25)")
    ap.add_argument("--buckets", action="store_true", help="list every distinct bucket in the JSON")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    ap.add_argument("--out", default=None, help="write plan.json and the PNG here")
    ap.add_argument("--figures", action="store_true", help="print the published figures the planner reproduces")
    return ap


def _check_fsdp_args(ap, args) -> None:
    """The options ``--engine fsdp2|hsdp`` takes: the DDP-only ones are refused by name."""
    e = args.engine
    ddp_only = [f for f, bad in (("--dtype", args.dtype is not None), ("--accumulate", args.accumulate != 1),
                                 ("--backward", args.backward is not None), ("--bucket-mb", args.bucket_mb != 25.0),
                                 ("--buckets", args.buckets)) if bad]
    if ddp_only:
        ap.error(f"{', '.join(ddp_only)}: options of --engine ddp, not of --engine {e} (for {e}: --param-dtype, "
                 f"--reduce-dtype, --reshard-after-forward, --units)")
    flat = planner.schemes.names(flat=True)
    if args.scheme != "auto" and (e == "fsdp2" or args.scheme not in flat):
        acc = "auto (its reduce-scatter is the all-to-all)" if e == "fsdp2" else "auto, " + ", ".join(flat)
        ap.error(f"--engine {e}: --scheme {args.scheme}; accepted: {acc}")
    if args.units is not None and (args.model or args.units < 1):
        ap.error(f"--units {args.units}: accepted: an int >= 1, with --params (a --model's units are its ModuleList "
                 f"blocks and the root)")
    if args.param_dtype is None:
        args.param_dtype = "bfloat16"
    if args.reduce_dtype is None and args.params is not None:
        args.reduce_dtype = "float32"
    for flag, v in (("--param-dtype", args.param_dtype), ("--reduce-dtype", args.reduce_dtype)):
        if v is not None and v not in planner._DTYPE_BYTES:
            ap.error(f"{flag} {v}; accepted: {', '.join(planner._DTYPE_BYTES)}")


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.figures:
        for claim, got, want in planner.published_figures():
            print(f"{claim}: {got} (published: {want})")
        return 0
    if args.params is None and args.model is None:
        ap.error("one of --params or --model is required")
    if args.accumulate < 1:
        ap.error(f"--accumulate {args.accumulate}: expected an int >= 1")
    if args.engine in BACKENDS:  # the former --engine nccl|gloo: DDP on that backend
        if args.backend is not None and args.backend != args.engine:
            ap.error(f"--engine {args.engine} (DDP on {args.engine}) and --backend {args.backend} disagree; accepted: "
                     f"--engine {{{','.join(ENGINES)}}} with --backend {{{','.join(BACKENDS)}}}")
        args.engine, args.backend = "ddp", args.engine
    args.backend = args.backend or "nccl"
    sharded = args.engine in planner.FSDP_ENGINES
    if sharded:
        _check_fsdp_args(ap, args)
    else:
        given = [f for f, v in (("--param-dtype", args.param_dtype), ("--reduce-dtype", args.reduce_dtype),
                                ("--reshard-after-forward", args.reshard_after_forward), ("--units", args.units))
                 if v is not None]
        if given:
            ap.error(f"{', '.join(given)}: options of --engine fsdp2|hsdp, not of --engine ddp (DDP's gradient dtype "
                     f"is --dtype)")
    if args.params is not None and args.dtype is None and not sharded:
        args.dtype = "float32"
    try:
        res = plan_fsdp(args) if sharded else plan(args)
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        print()
    elif sharded:
        print_fsdp_table(res)
    else:
        print_table(res)
    if args.out and sharded:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "plan.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    elif args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(res, f, indent=1)
        png = plot(res, os.path.join(args.out, "plan_step_vs_bandwidth.png"))
        print(f"wrote {os.path.join(args.out, 'plan.json')} and {png}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
