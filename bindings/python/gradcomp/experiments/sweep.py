"""The sweep of ``gradcomp-experiment``: which runs each task makes (:func:`plan_runs`,
:func:`plan_charlm_runs`, from :func:`gradcomp.experiments.args.parse_args`'s per-task settings)
and running them on one :class:`gradcomp.experiments.pool.GlooPool` of W workers, optionally
behind a rate-limited link (:func:`run`). The tables, files and plots of the results:
:mod:`gradcomp.experiments.report`.
"""

import argparse
import contextlib
import os
import time
from typing import Callable, Dict, List, Optional

from . import charlm
from .args import OPTIMIZERS, QUANT_SEED_FAMILIES, family
from .fsdp2 import DENSE


def seeds_for(codec: str, a: argparse.Namespace) -> int:
    """Seeds of a codec's runs: ``quant_seeds`` (capped at ``seeds``) for the families of
    :data:`gradcomp.experiments.args.QUANT_SEED_FAMILIES` (the casts fp16 / bf16 and the block
    quantizers fp8 / int8 / int4), ``seeds`` for the others (none, top-k, onebit, powersgd).
    ``a``: a task's namespace (``parse_args(...).digits`` or ``.charlm``)."""
    return min(a.seeds, a.quant_seeds) if family(codec) in QUANT_SEED_FAMILIES else a.seeds


def efs_for(codec: str, a: argparse.Namespace) -> List[bool]:
    """Error-feedback settings of a codec's runs, from the task's ``ef``: both (under which codec
    none runs without error feedback only: its residual is exactly zero, so the run with it is the
    same run), on, off, auto (on; codec none off). ``dense`` (FSDP2's own reduce-scatter, no
    gradcomp) runs without error feedback whatever ``ef`` says."""
    if family(codec) == DENSE:
        return [False]
    none = family(codec) == "none"
    if a.ef == "auto":
        return [not none]
    if a.ef == "both" and none:
        return [False]
    return {"both": [False, True], "on": [True], "off": [False]}[a.ef]


def plan_runs(a: argparse.Namespace) -> List[dict]:
    """The digits runs, in order (``a``: ``parse_args(...).digits``): codec, then error feedback,
    then seed (SGD with the gradcomp hook); then the optimizer rows (``--optimizers``), seed by
    seed."""
    common = dict(epochs=a.epochs, lr=a.lr, momentum=a.momentum, batch_size=a.batch_size, hidden=a.hidden,
                  bucket_cap_mb=a.bucket_cap_mb, weight_decay=a.weight_decay, engine=getattr(a, "engine", "ddp"))
    runs = [dict(common, codec=c, optimizer="sgd", error_feedback=ef, seed=s)
            for c in a.codec_list for ef in efs_for(c, a) for s in range(seeds_for(c, a))]
    for o in a.optimizer_list:
        label, ef = OPTIMIZERS[o]
        runs += [dict(common, codec=label, optimizer=o, error_feedback=ef, seed=s, adam_lr=a.adam_lr,
                      adam_eps=a.adam_eps, freeze_fraction=a.freeze_fraction)
                 for s in range(a.optimizer_seeds)]
    return runs


def plan_charlm_runs(a: argparse.Namespace) -> List[dict]:
    """The charlm runs, in order (``a``: ``parse_args(...).charlm``): codec, then error feedback,
    then seed (the task's optimizer with the codec's hook); then the method rows
    (``a.method_list``, ``(optimizer, codec)`` pairs of ``--charlm-methods``) seed by seed: sgd
    at ``a.sgd_lr`` (dense), dgc at ``a.sgd_lr`` with ``a.dgc_warmup``, compressed_adam at
    ``a.adam_lr`` with ``freeze_step`` = ``a.freeze_step``, error feedback on (off for codec
    none). Each is a :func:`gradcomp.experiments.charlm.train_run` configuration (with the task's
    ``engine``: the same settings under DDP and FSDP2)."""
    common = dict(steps=a.steps, optimizer=a.optimizer, lr=a.lr, momentum=a.momentum, clip=a.clip,
                  batch_size=a.batch_size, seq_len=a.seq_len, embed=a.embed, hidden=a.hidden,
                  bucket_cap_mb=a.bucket_cap_mb, start_iter=a.start_iter, val_windows=a.val_windows,
                  corpus_max_bytes=a.corpus_bytes, progress_every=10, engine=getattr(a, "engine", "ddp"))
    if getattr(a, "curve_every", 0):
        common["curve_every"] = a.curve_every
    runs = [dict(common, codec=c, error_feedback=ef, seed=s)
            for c in a.codec_list for ef in efs_for(c, a) for s in range(seeds_for(c, a))]
    for opt, c in getattr(a, "method_list", []):
        extra = {"sgd": dict(lr=a.sgd_lr), "dgc": dict(lr=a.sgd_lr, dgc_warmup=list(a.dgc_warmup)),
                 "compressed_adam": dict(lr=a.adam_lr, freeze_step=a.freeze_step)}[opt]
        runs += [dict(common, optimizer=opt, codec=c, error_feedback=family(c) != "none", start_iter=0, seed=s,
                      **extra) for s in range(a.seeds)]
    return runs


def setting(codec: str, ef: bool) -> str:
    """A run's setting for the progress bar: the codec spec, `` +EF`` with error feedback."""
    return f"{codec}{' +EF' if ef else ''}"


def run_sweep(pool, runs: List[dict], fn: Callable, unit_total: int, bars,
              describe: Callable[[dict], str]) -> List[list]:
    """Run each configuration of ``runs`` on the pool (``fn(rank, world, cfg)``, a pool job),
    with two tqdm bars ``bars = (runs, progress within a run)``: ``unit_total`` progress units
    per run (digits epochs, charlm steps), ``describe(cfg)`` the runs bar's postfix. After each
    run, checks that all ranks' final parameters agree bitwise (``param_checksum``). Returns the
    per-rank results (W dicts) of each run, in order.

    Raises:
        RuntimeError: the ranks' checksums differ, or the job failed (the worker's traceback;
            :meth:`GlooPool.run`, timeout 600 s per run).
    """
    bar_runs, bar_in = bars
    out = []
    for cfg in runs:
        bar_runs.set_postfix_str(describe(cfg))
        bar_in.reset(total=unit_total)

        def progress(rank, msg):
            bar_in.update(1 if "epoch" in msg else msg["step"] - bar_in.n)
            bar_in.set_postfix_str(f"loss {msg['loss']:.4f}")

        res = pool.run(fn, cfg, on_progress=progress, timeout=600)
        sums = {r["param_checksum"] for r in res}
        if len(sums) != 1:
            raise RuntimeError(f"ranks disagree on the final parameters for {cfg}: checksums {sums}")
        out.append(res)
        bar_runs.update(1)
    return out


def describe_link(net, workers: int) -> str:
    """One line for the tables: the link setup (a :class:`gradcomp.experiments.links.Setup`) the
    workers ran behind."""
    shaped = f"tc tbf at {net.rate}" if net.tbf is not None else "no rate limit"
    if net.kind == "loopback":
        return f"{workers} workers on one network namespace's loopback, {shaped} (shared by all ranks)"
    return (f"two network namespaces of {net.ranks_per_node} workers joined by a veth pair (MTU {net.mtu}), "
            f"{shaped} in each direction")


STATS_DIR = "stats"
"""The folder under ``--out`` holding each DDP run's stats log (:func:`assign_stats_logs`)."""


def assign_stats_logs(plans: Dict[str, List[dict]], out: str) -> None:
    """Give every DDP run of ``plans`` (task -> run configurations) the path of its stats log,
    ``cfg["stats_log"]`` = ``OUT/stats/TASK_III.jsonl`` (III: the run's index in its task), where
    the gradcomp hook appends its step reports (every rank, every
    :data:`gradcomp.experiments.runner.STATS_LOG_EVERY` steps; ``gradcomp-report`` reads it).
    Runs without the hook (the optimizer and method rows) write none; FSDP2 runs get no path.
    Creates the folder and removes a log left by an earlier sweep into the same ``--out``."""
    folder = os.path.join(out, STATS_DIR)
    for task, runs in plans.items():
        for i, cfg in enumerate(runs):
            if cfg.get("engine", "ddp") != "ddp":
                continue
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"{task}_{i:03d}.jsonl")
            if os.path.exists(path):
                os.remove(path)
            cfg["stats_log"] = path


class LinkUnavailable(RuntimeError):
    """``--link`` was given but this process cannot build the shaped namespaces (the message says
    why: :func:`gradcomp.experiments.links.available`)."""


def run(a: argparse.Namespace) -> argparse.Namespace:
    """Plan and run the sweep of every task of ``a`` (:func:`gradcomp.experiments.args.parse_args`)
    on one pool of ``a.workers`` gloo workers (one thread each), digits with
    :func:`gradcomp.experiments.runner.train_run` (under ``--link``
    :func:`gradcomp.experiments.links.timed_train_run`), charlm with
    :func:`gradcomp.experiments.charlm.train_run`, in ``a.tasks`` order. Builds the charlm corpus
    in this process first (its description goes to the results) and creates ``a.out``.

    Each DDP run's hook writes its step reports to ``cfg["stats_log"]`` (:func:`assign_stats_logs`).

    Returns a namespace: ``plans`` (task -> run configurations; [] for a task not selected),
    ``results`` (task -> per run, the W ranks' result dicts), ``walls`` (task -> seconds of its
    sweep), ``wall_all`` (seconds, the workers' start included), ``total_runs``, ``corpus`` (the
    charlm corpus' description, None without charlm), ``link_desc`` / ``link_setup`` (the
    link's line for the tables and :meth:`Setup.describe`; None without ``--link``).

    Raises:
        LinkUnavailable: ``--link`` cannot build the namespaces here (before anything runs).
        RuntimeError: a run failed (:func:`run_sweep`), or the workers did not start.
    """
    from tqdm import tqdm

    from . import runner
    from .pool import GlooPool

    link_ctx = contextlib.nullcontext(None)
    if a.link is not None:
        from . import links

        ok, why = links.available()
        if not ok:
            raise LinkUnavailable(why)
        link_ctx = (links.shaped_loopback(a.link) if a.link_nodes == 1
                    else links.two_nodes(a.link, ranks_per_node=a.workers // 2))
    plans = {"digits": plan_runs(a.digits) if "digits" in a.tasks else [],
             "charlm": plan_charlm_runs(a.charlm) if "charlm" in a.tasks else []}
    corpus = None
    if "charlm" in a.tasks:
        corpus = charlm.build_corpus(None, a.charlm.corpus_bytes).describe()
    os.makedirs(a.out, exist_ok=True)
    assign_stats_logs(plans, a.out)
    total_runs = sum(len(plans[t]) for t in a.tasks)
    t_all = time.perf_counter()
    results: Dict[str, list] = {}
    walls: Dict[str, float] = {}
    link_desc: Optional[str] = None
    link_setup: Optional[dict] = None
    with link_ctx as net, \
            tqdm(total=total_runs, desc="runs", unit="run", disable=a.no_progress, position=0) as bar_runs, \
            tqdm(total=1, desc="progress", disable=a.no_progress, position=1, leave=False) as bar_in:
        bar_runs.set_postfix_str(f"starting {a.workers} workers")
        pool_kw = {}
        jobs = {"digits": (runner.train_run, a.digits.epochs, "digits epochs"),
                "charlm": (charlm.train_run, a.charlm.steps, "charlm steps")}
        if net is not None:
            pool_kw = {"netns": net.rank_netns(a.workers), "env": net.rank_env(a.workers)}
            jobs["digits"] = (links.timed_train_run,) + jobs["digits"][1:]
            link_desc, link_setup = describe_link(net, a.workers), net.describe()
        with GlooPool(a.workers, threads=1, **pool_kw) as pool:
            for task in a.tasks:
                t0 = time.perf_counter()
                fn, units, label = jobs[task]
                bar_in.set_description(label)
                results[task] = run_sweep(
                    pool, plans[task], fn, units, (bar_runs, bar_in),
                    lambda c, task=task: f"{task} {c['optimizer']} {setting(c['codec'], c['error_feedback'])} "
                                         f"seed {c['seed']}")
                walls[task] = time.perf_counter() - t0
    wall_all = time.perf_counter() - t_all
    return argparse.Namespace(plans=plans, results=results, walls=walls, wall_all=wall_all, total_runs=total_runs,
                              corpus=corpus, link_desc=link_desc, link_setup=link_setup)
