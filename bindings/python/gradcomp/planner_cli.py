"""``gradcomp-plan``: bytes, link time and exposed time of a training step's gradient
synchronization per codec and scheme, from :mod:`gradcomp.planner`'s cost model.

Examples::

    gradcomp-plan --params 70e9 --gpus 512 --step-time 2          # 280 GB/step, 1.12 Tb/s
    gradcomp-plan --params 1.3B --gpus 64 --gpus-per-node 8 --link-gbps network=100 \\
        --codec none --codec bf16 --codec topk:ratio=0.01 --scheme all --out results/plan
    gradcomp-plan --model torch.nn:Transformer --gpus 16 --json
    gradcomp-plan --figures                                        # the published figures

Prints a table (one row per codec and scheme: bytes one rank sends per synchronization inside
nodes and across nodes, communication / encode / decode / exposed time in ms, the step time and
the speed-up over the flat dense allreduce, split into the part the scheme gives and the part the
codec gives), writes ``plan.json`` and ``plan_step_vs_bandwidth.png`` (against the bandwidth of
the slowest link level, 1 to 800 Gb/s: the step time of each codec, and its speed-up over dense
with the bandwidth where it stops paying) under ``--out``. ``--json`` prints the JSON to stdout
instead of the table. Units: bytes, seconds (ms in the table), bits/s for link rates.

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
    return planner.CostModel(intra, inter, L if nodes > 1 else 0, tp, args.engine, not args.no_error_feedback)


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
              bucket_cap_bytes=int(args.bucket_mb * (1 << 20)))
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
    ap.add_argument("--nic-per-node", action="store_true",
                    help="one NIC per node shared by its ranks (default: a NIC per GPU; --link-gbps network= is "
                         "then the node's NIC)")
    ap.add_argument("--step-time", type=float, default=None, help="compute seconds of one micro-batch")
    ap.add_argument("--backward", type=float, default=None, help="backward seconds to overlap with")
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per synchronization")
    ap.add_argument("--codec", action="append", metavar="SPEC", help=f"repeatable (default: {', '.join(DEFAULT_CODECS)})")
    ap.add_argument("--scheme", default="auto", choices=("auto", "all") + planner.schemes.names())
    ap.add_argument("--engine", default="nccl", choices=("nccl", "gloo"))
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
    if args.params is not None and args.dtype is None:
        args.dtype = "float32"
    try:
        res = plan(args)
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        json.dump(res, sys.stdout, indent=1)
        print()
    else:
        print_table(res)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plan.json"), "w") as f:
            json.dump(res, f, indent=1)
        png = plot(res, os.path.join(args.out, "plan_step_vs_bandwidth.png"))
        print(f"wrote {os.path.join(args.out, 'plan.json')} and {png}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
