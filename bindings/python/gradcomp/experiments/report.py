"""The report of ``gradcomp-experiment``: from the runs of :func:`gradcomp.experiments.sweep.run`,
per task one row per run (:func:`digits_rows`, :func:`charlm_rows`), the summary over seeds
(:func:`summarize`), the Markdown table (:func:`format_table`, :func:`format_charlm_table`), the
CSV, the JSON and one PNG plot (:func:`plot`, both tasks), written into ``--out`` under the names of
:data:`OUTPUT_FILES`, and what goes to stdout (:func:`write`).

Units: accuracies in percent, bits per character, ratios as fractions (the tables print them as
percentages), bytes per step, times in seconds (per run, summed over its steps).
"""

import argparse
import csv
import json
import math
import os
import statistics
from typing import Callable, Dict, List, Optional, TextIO

from .args import CHARLM_METHOD_OPTIMIZERS, OPTIMIZERS
from .fsdp2 import DENSE, MIN_COMPRESS_NUMEL

CSV_COLUMNS = ["codec", "optimizer", "scheme", "error_feedback", "seed", "test_accuracy", "network_share", "final_loss",
               "packet_ratio", "wire_ratio", "bits_per_element", "packet_bytes_per_step", "sent_bytes_per_step",
               "dense_bytes_per_step", "numel", "buckets", "steps", "nonfinite_steps", "encode_s",
               "decode_s", "comm_s", "train_s", "wall_s", "workers", "epochs"]

CHARLM_CSV_COLUMNS = ["codec", "optimizer", "scheme", "error_feedback", "seed", "val_bpc", "network_share", "final_loss",
                      "packet_ratio",
                      "wire_ratio", "bits_per_element", "packet_bytes_per_step", "sent_bytes_per_step",
                      "dense_bytes_per_step", "numel", "buckets", "steps", "nonfinite_steps", "encode_s",
                      "decode_s", "comm_s", "train_s", "eval_s", "wall_s", "workers", "params"]

# output file names per task: table, csv, json, plot
OUTPUT_FILES = {
    "digits": {"table": "table.md", "csv": "results.csv", "json": "results.json", "plot": "accuracy_vs_bits.png"},
    "charlm": {"table": "charlm_table.md", "csv": "charlm_results.csv", "json": "charlm_results.json",
               "plot": "charlm_bpc_vs_bits.png"},
}
# the same under --engine fsdp2 (beside the DDP sweep's in the same --out)
OUTPUT_FILES_FSDP2 = {
    "digits": {"table": "fsdp2_table.md", "csv": "fsdp2_results.csv", "json": "fsdp2_results.json",
               "plot": "fsdp2_accuracy_vs_bits.png"},
    "charlm": {"table": "charlm_fsdp2_table.md", "csv": "charlm_fsdp2_results.csv",
               "json": "charlm_fsdp2_results.json", "plot": "charlm_fsdp2_bpc_vs_bits.png"},
}


def output_files(task: str, engine: str = "ddp") -> Dict[str, str]:
    """The file names of one task's outputs (:data:`OUTPUT_FILES`, or :data:`OUTPUT_FILES_FSDP2`
    under ``--engine fsdp2``)."""
    return (OUTPUT_FILES_FSDP2 if engine == "fsdp2" else OUTPUT_FILES)[task]


def fsdp2_lines(summary: List[dict], prefix: str, unit: str, units: str, params: Optional[int],
                exempt: Optional[int], workers: int) -> List[str]:
    """The footer of an ``--engine fsdp2`` table: the setup (``units``: the fully_shard units), what
    the byte ratios are relative to (a ring reduce-scatter), the exempt parameters, and each row's
    metric (``prefix``: acc or bpc, in ``unit``) relative to the dense row's (FSDP2 without
    gradcomp), when the sweep has one."""
    out = [f"W = {workers} gloo ranks (CPU) under FSDP2: fully_shard of {units}, then of the root, on a 1-D CPU "
           f"mesh (parameters, gradients and optimizer state sharded). Ratios are totals over all units and steps "
           f"of the gradient reduce-scatters (the parameter all-gathers are the same in every run and not "
           f"counted): packet_ratio = the W slots a rank encodes / FSDP2's padded dense reduce-scatter input; "
           f"wire_ratio = the W-1 slots a rank sends in gradcomp's all-to-all / what it sends in a ring "
           f"reduce-scatter of the dense input ((W-1)/W x dense bytes); bits/elem = 8 x packet bytes / elements "
           f"of that input. {DENSE} = FSDP2's own reduce-scatter without gradcomp (its times are not measured: "
           f"0). Times are per run, summed over steps, seconds. net share = the time gradcomp's reduce-scatters "
           f"held the loop up, communicating, over the steps' wall time ({DENSE}: not measured, '-')."]
    if exempt is not None and params:
        out.append(f"Sent raw in the same all-to-all (exempt: fewer than 2 dimensions or fewer than "
                   f"{MIN_COMPRESS_NUMEL} elements, gradcomp.torch.fsdp's default): {exempt} of {params} "
                   f"parameter elements.")
    dense = [s[f"{prefix}_mean"] for s in summary if s["codec"] == DENSE]
    if dense:
        rel = ", ".join(f"{s['codec']}{' +EF' if s['error_feedback'] else ''} "
                        f"{100 * (s[f'{prefix}_mean'] - dense[0]) / dense[0]:+.2f}%"
                        for s in summary if s["codec"] != DENSE)
        shown = f"{dense[0]:.2f}%" if prefix == "acc" else f"{dense[0]:.4f}"
        out.append(f"Relative to {DENSE} ({shown} {unit}): {rel}.")
    return out


def summarize(rows: List[dict], metric: str = "test_accuracy", prefix: str = "acc") -> List[dict]:
    """Group runs by (codec, optimizer, error_feedback) (rows without ``optimizer``: by codec and
    error feedback; a group's ``optimizer`` is its rows'): mean, std (sample, 0 for one seed), min and max of
    ``metric`` (keys ``{prefix}_mean``, ``_std``, ``_min``, ``_max``; digits: test accuracy, acc_*;
    charlm: val_bpc, bpc_*), and the means of the final loss, the ratios, times and network share
    (None when no run of the group has one: :func:`gradcomp.experiments.runner.hook_totals`)."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["codec"], r.get("optimizer"), r["error_feedback"]), []).append(r)
    out = []
    for (codec, optimizer, ef), rs in groups.items():
        vals = [r[metric] for r in rs]

        def mean(k):
            return statistics.fmean(r[k] for r in rs)

        s = {"codec": codec, "scheme": "/".join(sorted({r.get("scheme", "") for r in rs})),
             "error_feedback": ef, "runs": len(rs),
             f"{prefix}_mean": statistics.fmean(vals),
             f"{prefix}_std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
             f"{prefix}_min": min(vals), f"{prefix}_max": max(vals)}
        if optimizer is not None:
            s["optimizer"] = optimizer
        for k in ("final_loss", "packet_ratio", "wire_ratio", "bits_per_element", "encode_s", "decode_s",
                  "comm_s", "train_s", "wall_s"):
            s[k] = mean(k)
        shares = [r["network_share"] for r in rs if r.get("network_share") is not None]
        s["network_share"] = statistics.fmean(shares) if shares else None
        if all("eval_s" in r for r in rs):
            s["eval_s"] = mean("eval_s")
        out.append(s)
    return out


def format_table(summary: List[dict], workers: int, link: Optional[dict] = None, engine: str = "ddp",
                 params: Optional[int] = None, exempt: Optional[int] = None) -> str:
    """The digits Markdown table of the summary (accuracy in percent, mean +- sample std over seeds).
    With ``link`` (:func:`link_target`'s dict, under ``--link``) four more columns: the mean time
    to the target accuracy over the seeds that reached it (s), its mean epoch, how many seeds
    reached it, and the mean wall time of a run (s); and a line saying what the target is. Under
    ``engine`` fsdp2 the footer is :func:`fsdp2_lines`' (``params``, ``exempt``: elements of the
    model and of its exempt parameters)."""
    head = ("| codec | scheme | EF | runs | test acc % (mean ± std) | min–max | net share | final loss | "
            "packet_ratio | wire_ratio | bits/elem | encode s | comm s | decode s | train s |")
    ncol = 15
    if link is not None:
        goal = "target" if link["target"] is None else f"{link['target']:.2f}%"
        head += f" time to {goal} s | epoch | reached | run wall s |"
        ncol += 4
    sep = "|" + "---|" * ncol
    lines = [head, sep]
    for s in summary:
        line = (
            f"| {s['codec']} | {s['scheme']} | {'on' if s['error_feedback'] else 'off'} | {s['runs']} | "
            f"{s['acc_mean']:.2f} ± {s['acc_std']:.2f} | {s['acc_min']:.2f}–{s['acc_max']:.2f} | "
            f"{share(s)} | {s['final_loss']:.4f} | {100 * s['packet_ratio']:.3f}% | {100 * s['wire_ratio']:.3f}% | "
            f"{s['bits_per_element']:.3f} | {s['encode_s']:.2f} | {s['comm_s']:.2f} | "
            f"{s['decode_s']:.2f} | {s['train_s']:.2f} |")
        if link is not None:
            t, e = s.get("time_to_target_s"), s.get("epochs_to_target")
            line += (f" {'-' if t is None else f'{t:.2f}'} | {'-' if e is None else f'{e:.1f}'} | "
                     f"{s.get('reached', 0)}/{s['runs']} | {s['wall_s']:.2f} |")
        lines.append(line)
    lines.append("")
    if engine == "fsdp2":
        for ln in fsdp2_lines(summary, "acc", "test accuracy", "each Linear layer", params, exempt, workers):
            lines += [ln, ""]
        lines.pop()
    else:
        lines.append(f"W = {workers} gloo workers (CPU). Ratios are totals over all buckets and steps; "
                     f"wire_ratio is against a ring allreduce of the dense buckets (2(W-1)/W x dense bytes). "
                     f"Times are per run, summed over steps, seconds; comm s is launch-to-completion per "
                     f"bucket and overlaps the backward pass. {SHARE_NOTE}")
    if link is not None:
        lines.append("")
        lines.append(f"Link: {link['description']}. Target accuracy {link['target']:.2f}% = 98% of the mean final "
                     f"test accuracy of the dense run (codec none, SGD, no error feedback) of this sweep, "
                     f"{link['dense']:.2f}%; time to target = wall time from a run's start (model build) to the end "
                     f"of the first epoch whose test accuracy reaches it, per-epoch evaluation excluded, mean over "
                     f"the seeds that reached it ('-': none did); run wall s = the whole run (mean)."
                     if link["target"] is not None else
                     f"Link: {link['description']}. No target accuracy: the sweep has no dense run (codec none, "
                     f"SGD, no error feedback) to take 98% of.")
    return "\n".join(lines)


SHARE_NOTE = ("net share = the network's share of the training step: the communication that held the loop up "
              "(DDP's backward waiting for a collective, not overlapped) over the step's wall time, summed over a "
              "run's steps (gradcomp.torch.stats; the per-step reports of each run are in stats/*.jsonl under "
              "--out, for gradcomp-report); '-' for runs without the gradcomp hook.")


def share(s: dict) -> str:
    """A summary's network share as the tables print it: a percentage, or ``-`` without one."""
    v = s.get("network_share")
    return "-" if v is None else f"{100 * v:.1f}%"


TARGET_FRACTION = 0.98
"""Under ``--link``: the target accuracy is this fraction of the dense run's mean final accuracy."""


def link_target(rows: List[dict], summary: List[dict], description: str) -> dict:
    """Under ``--link``: the target accuracy (``TARGET_FRACTION`` of the mean final test accuracy
    of the SGD runs of codec none without error feedback; None when the sweep has none), each
    run's ``time_to_target_s`` / ``epochs_to_target`` (None: not reached; from its ``curve``),
    and per summary group ``time_to_target_s`` / ``epochs_to_target`` (means over the seeds that
    reached it, None if none did) and ``reached`` (how many did). Rows and groups are updated in
    place; returns ``{"description", "target" (percent or None), "dense" (percent or None)}``."""
    from .links import time_to_target

    dense = [r["test_accuracy"] for r in rows
             if r["codec"] == "none" and r.get("optimizer", "sgd") == "sgd" and not r["error_feedback"]]
    base = statistics.fmean(dense) if dense else None
    target = TARGET_FRACTION * base if base is not None else None
    for r in rows:
        t, e = time_to_target(r.get("curve", []), target) if target is not None else (None, None)
        r["time_to_target_s"], r["epochs_to_target"] = t, e
    for s in summary:
        mine = [r for r in rows if r["codec"] == s["codec"] and r["error_feedback"] == s["error_feedback"]]
        hit = [r for r in mine if r["time_to_target_s"] is not None]
        s["reached"] = len(hit)
        s["time_to_target_s"] = statistics.fmean(r["time_to_target_s"] for r in hit) if hit else None
        s["epochs_to_target"] = statistics.fmean(r["epochs_to_target"] for r in hit) if hit else None
    return {"description": description, "target": target, "dense": base}


# the charlm optimizers: label in the table, and the optimizer whose dense run (codec none, no
# error feedback) a row is read against (the "vs dense" column, the --link target)
CHARLM_OPTIMIZERS = dict({"adam": ("Adam", "adam")}, **CHARLM_METHOD_OPTIMIZERS)

CHARLM_TARGET_FRACTION = 1.02
"""Under ``--link``: a charlm row's target is this times the final val bits/char of the dense run
of its base optimizer (:data:`CHARLM_OPTIMIZERS`)."""


def charlm_dense(summary: List[dict]) -> Dict[str, float]:
    """Base optimizer -> the mean val bits/char of its dense group (codec none, no error
    feedback) in ``summary``; optimizers without one are absent."""
    return {s.get("optimizer", "adam"): s["bpc_mean"] for s in summary
            if s["codec"] == "none" and not s["error_feedback"]}


def charlm_link_target(rows: List[dict], summary: List[dict], description: str) -> dict:
    """Under ``--link``: each run's ``time_to_target_s`` / ``steps_to_target`` (None: not reached)
    from its ``curve``, the target being :data:`CHARLM_TARGET_FRACTION` x the dense val bits/char
    of its base optimizer (:func:`charlm_dense`), and per summary group ``target``,
    ``time_to_target_s`` / ``steps_to_target`` (means over the seeds that reached it; None if
    none did) and ``reached``. Rows and groups are updated in place; returns
    ``{"description", "targets": {optimizer: bits/char}, "dense": {optimizer: bits/char}}``."""
    dense = charlm_dense(summary)
    targets = {o: CHARLM_TARGET_FRACTION * d for o, d in dense.items()}
    for r in rows:
        goal = targets.get(CHARLM_OPTIMIZERS.get(r.get("optimizer", "adam"), ("", ""))[1])
        r["time_to_target_s"] = r["steps_to_target"] = None
        for c in (r.get("curve", []) if goal is not None else []):
            if c["val_bpc"] <= goal:
                r["time_to_target_s"], r["steps_to_target"] = c["wall_s"], c["step"]
                break
    for s in summary:
        mine = [r for r in rows if r["codec"] == s["codec"] and r.get("optimizer") == s.get("optimizer")
                and r["error_feedback"] == s["error_feedback"]]
        hit = [r for r in mine if r["time_to_target_s"] is not None]
        s["target"] = targets.get(CHARLM_OPTIMIZERS.get(s.get("optimizer", "adam"), ("", ""))[1])
        s["reached"] = len(hit)
        s["time_to_target_s"] = statistics.fmean(r["time_to_target_s"] for r in hit) if hit else None
        s["steps_to_target"] = statistics.fmean(r["steps_to_target"] for r in hit) if hit else None
    return {"description": description, "targets": targets, "dense": dense}


def format_charlm_table(summary: List[dict], a: argparse.Namespace, corpus: dict, params: int,
                        notes: List[str], exempt: Optional[int] = None, link: Optional[dict] = None) -> str:
    """The charlm Markdown table: the optimizer (:data:`CHARLM_OPTIMIZERS`' label), validation
    bits per character (mean +- sample std over seeds, min-max), under DDP relative to the dense
    run of the row's base optimizer ("vs dense"), the final training loss (bits per character,
    the last 10 steps' mean), the ratios and the times (seconds per run); a footer with the
    corpus, the model and the training setup. Under ``a.engine`` fsdp2 the footer says what the
    ratios are there (:func:`fsdp2_lines`; ``exempt``: elements of the exempt parameters) and each
    row against the dense row. With ``link`` (:func:`charlm_link_target`'s dict) four more
    columns: the target, the mean time to it (s) and its mean step over the seeds that reached
    it, how many did, and the mean wall time of a run."""
    fsdp2 = getattr(a, "engine", "ddp") == "fsdp2"
    dense = {} if fsdp2 else charlm_dense(summary)
    head = ("| codec | optimizer | scheme | EF | runs | val bits/char (mean ± std) | min–max | vs dense | "
            "net share | final train bits/char | packet_ratio | wire_ratio | bits/elem | encode s | comm s | "
            "decode s | train s |")
    ncol = 17
    if link is not None:
        head += " target bits/char | time to target s | step | reached | run wall s |"
        ncol += 5
    lines = [head, "|" + "---|" * ncol]
    for s in summary:
        label, base = CHARLM_OPTIMIZERS.get(s.get("optimizer", a.optimizer), (s.get("optimizer", "?"), None))
        d = dense.get(base)
        rel = "-" if d is None else f"{100 * (s['bpc_mean'] - d) / d:+.2f}%"
        line = (f"| {s['codec']} | {label} | {s['scheme']} | {'on' if s['error_feedback'] else 'off'} | {s['runs']} | "
                f"{s['bpc_mean']:.4f} ± {s['bpc_std']:.4f} | {s['bpc_min']:.4f}–{s['bpc_max']:.4f} | "
                f"{rel} | {share(s)} | "
                f"{s['final_loss']:.4f} | {100 * s['packet_ratio']:.3f}% | {100 * s['wire_ratio']:.3f}% | "
                f"{s['bits_per_element']:.3f} | {s['encode_s']:.2f} | {s['comm_s']:.2f} | "
                f"{s['decode_s']:.2f} | {s['train_s']:.2f} |")
        if link is not None:
            t, st, g = s.get("time_to_target_s"), s.get("steps_to_target"), s.get("target")
            line += (f" {'-' if g is None else f'{g:.4f}'} | {'-' if t is None else f'{t:.2f}'} | "
                     f"{'-' if st is None else f'{st:.0f}'} | {s.get('reached', 0)}/{s['runs']} | "
                     f"{s['wall_s']:.2f} |")
        lines.append(line)
    lines.append("")
    workers = "" if fsdp2 else f"W = {a.workers} gloo workers (CPU). "  # fsdp2: its own lines below
    lines.append(
        f"{workers}Corpus: {corpus['train_files'] + corpus['val_files']} *.py files of "
        f"{corpus['stdlib']} ({corpus['bytes']} bytes, sha256 {corpus['sha256'][:16]}...), "
        f"{corpus['train_files']} for training ({corpus['train_chars']} characters), {corpus['val_files']} "
        f"held out ({corpus['val_chars']} characters); vocabulary {corpus['vocab_size']} classes (uniform: "
        f"{math.log2(corpus['vocab_size']):.3f} bits/char). Model: 2-layer LSTM, embed {a.embed}, hidden "
        f"{a.hidden}, {params} parameters. {a.steps} steps of {a.batch_size} windows x {a.seq_len} characters "
        f"per rank, {a.optimizer} (peak lr {a.lr:g}, cosine decay, clip {a.clip:g}); val bits/char over "
        f"{a.val_windows} windows ({a.val_windows * a.seq_len} characters)."
        + ("" if fsdp2 else " Ratios are totals over all buckets and steps; wire_ratio is against a ring allreduce "
                            "of the dense buckets. Times are per run, seconds. " + SHARE_NOTE))
    if fsdp2:
        for ln in fsdp2_lines(summary, "bpc", "bits/char", "embed, lstm (both layers) and head", params, exempt,
                              a.workers):
            lines += ["", ln]
    methods = {o for o, _ in getattr(a, "method_list", [])}
    if methods:
        warm = ", ".join(f"{d:g} from step {st}" for st, d in getattr(a, "dgc_warmup", [])) or "none"
        lines += ["", "Method rows (--charlm-methods): " + "; ".join(
            {"sgd": f"SGD = torch.optim.SGD with momentum {a.momentum:g}, peak lr {a.sgd_lr:g} (tuned once for "
                    f"dense SGD), the loop's clipping at {a.clip:g}, codec none",
             "dgc": f"DGC (SGD) = gradcomp.optim.DGC (Lin et al., ICLR 2018: momentum correction, momentum factor "
                    f"masking, local clipping at {a.clip:g} / sqrt(W), 1-D parameters dense), the SGD row's lr and "
                    f"momentum, density = the top-k ratio, density warm-up: {warm}",
             "compressed_adam": f"CompressedAdam = gradcomp.optim.CompressedAdam (1-bit Adam's recipe, Tang et al. "
                                f"2021, for any codec): dense Adam for {a.freeze_step} steps, then the variance "
                                f"frozen and the momentum exchanged through the codec with worker and server "
                                f"error feedback, peak lr {a.adam_lr:g}"}[o] for o in ("sgd", "dgc", "compressed_adam")
            if o in methods) + ". vs dense: against the dense run (codec none) of the same optimizer (Adam for "
            "Adam and CompressedAdam, SGD for SGD and DGC); bits/elem over the whole run, warm-up included."]
    if link is not None:
        tg = ", ".join(f"{CHARLM_OPTIMIZERS[o][0]} {t:.4f}" for o, t in link["targets"].items())
        lines += ["", f"Link: {link['description']}. Target = {CHARLM_TARGET_FRACTION:g} x the final val bits/char "
                      f"of the dense run of the row's optimizer ({tg or 'no dense run in this sweep'}); time to "
                      f"target = training-loop seconds from the first step to the end of the first step whose "
                      f"validation (every {getattr(a, 'curve_every', 0)} steps, evaluation time left out) reaches "
                      f"it, mean over the seeds that reached it ('-': none did); run wall s = the whole run (mean)."]
    for n in notes:
        lines.append("")
        lines.append(f"Note: {n}.")
    return "\n".join(lines)


# the plot of each task: the summary's metric (key prefix; mean with min..max bars over seeds)
# against bits per element (log x). "series": (error feedback: True / False, or None for the
# optimizer rows of OPTIMIZERS; marker; colour; legend label; vertical label offset in points);
# "best": where a label shared by points of the same bits per element goes (max or min of their
# means); "x_margin": matplotlib's x margin (None: its default)
PLOTS = {
    "digits": {"prefix": "acc", "best": max, "legend": "lower right", "x_margin": None,
               "series": ((False, "o", "tab:red", "SGD, no error feedback", 5),
                          (True, "s", "tab:blue", "SGD, error feedback", -10),
                          (None, "^", "tab:green", "Adam / 1-bit Adam", 5)),
               "ylabel": "test accuracy, % (mean; bars: min-max over seeds)",
               "title": "digits MLP, {workers} DDP workers: accuracy vs compression"},
    "charlm": {"prefix": "bpc", "best": min, "legend": "upper right", "x_margin": 0.1,
               "series": ((False, "o", "tab:red", "no error feedback", -10),
                          (True, "s", "tab:blue", "error feedback", 5),
                          (None, "^", "tab:green", "method rows: SGD / DGC / CompressedAdam", 5)),
               "ylabel": "validation bits per character (mean; bars: min-max over seeds)",
               "title": "char-level LSTM on the Python stdlib, {workers} DDP workers: bits/char vs compression"},
}
ENGINE_TITLES = {"ddp": "DDP workers", "fsdp2": "FSDP2 ranks"}  # what {workers} counts in a plot's title


def plot(summary: List[dict], path: str, workers: int, task: str = "digits", engine: str = "ddp") -> None:
    """PNG (``path``) of one task's summary (:func:`summarize`): the mean metric (digits: test
    accuracy, %; charlm: validation bits per character, lower is better) against bits per element,
    log x, error bars min..max over seeds, one series per error-feedback setting (digits also the
    optimizer rows, charlm its method rows), each point labelled with its codec (method rows: and
    optimizer); the dense run (codec none without error
    feedback; under ``engine`` fsdp2 the dense row, FSDP2 without gradcomp, when the sweep has one)
    as a dashed line. ``task``: a key of :data:`PLOTS`.

    Raises:
        KeyError: an unknown task.
    """
    spec = PLOTS[task]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = spec["prefix"] + "_mean"
    lo, hi = spec["prefix"] + "_min", spec["prefix"] + "_max"
    opt_labels = {label for label, _ in OPTIMIZERS.values()}

    def method(s):  # a digits optimizer row or a charlm method row
        return s["codec"] in opt_labels or s.get("optimizer") in CHARLM_METHOD_OPTIMIZERS

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for ef, marker, color, label, dy in spec["series"]:
        pts = sorted((s for s in summary if (method(s) if ef is None else
                                             s["error_feedback"] == ef and not method(s))),
                     key=lambda s: s["bits_per_element"])
        if not pts:
            continue
        x = [s["bits_per_element"] for s in pts]
        y = [s[key] for s in pts]
        yerr = [[s[key] - s[lo] for s in pts], [s[hi] - s[key] for s in pts]]
        ax.errorbar(x, y, yerr=yerr, fmt=marker, color=color, capsize=3, linestyle="none", label=label)
        # under fsdp2 dense (32.000) and none (headers: 32.01) share a label: round to 0.1 bit
        _annotate(ax, pts, key, color, dy, spec["best"], 6 if engine == "ddp" else 1)
    dense = [s[key] for s in summary if s["codec"] == DENSE]
    label = f"{DENSE} (FSDP2 without gradcomp)"
    if not dense:
        dense = [s[key] for s in summary if s["codec"] == "none" and not s["error_feedback"] and not method(s)]
        label = "dense (codec none)"
    if dense:
        ax.axhline(dense[0], color="gray", linestyle="--", linewidth=0.8, label=label)
    ax.set_xscale("log")
    if spec["x_margin"] is not None:
        ax.margins(x=spec["x_margin"])
    ax.set_xlabel("bits per gradient element (8 x packet bytes / numel, log scale)")
    ax.set_ylabel(spec["ylabel"])
    title = spec["title"].format(workers=workers)
    ax.set_title(title if engine == "ddp" else title.replace(ENGINE_TITLES["ddp"], ENGINE_TITLES[engine]))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc=spec["legend"])
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _annotate(ax, pts: List[dict], key: str, color: str, dy: int, pick: Callable, ndigits: int = 6) -> None:
    """One label per point; codecs with the same bits per element (fp16, bf16; rounded to
    ``ndigits`` decimals) share it, placed at ``pick`` (max or min) of their ``key`` values."""
    labels: Dict[float, List[str]] = {}
    for s in pts:
        name = s["codec"].replace("topk:ratio=", "top-k ").replace("powersgd:rank=", "PowerSGD r")
        if s.get("optimizer") in CHARLM_METHOD_OPTIMIZERS:  # charlm method rows: the optimizer's label first
            name = CHARLM_METHOD_OPTIMIZERS[s["optimizer"]][0].split(" ")[0] + " " + name
        labels.setdefault(round(s["bits_per_element"], ndigits), []).append(name)
    for s in pts:
        k = round(s["bits_per_element"], ndigits)
        if k not in labels:
            continue
        same = [t for t in pts if round(t["bits_per_element"], ndigits) == k]
        ax.annotate("/".join(labels.pop(k)), (s["bits_per_element"], pick(t[key] for t in same)),
                    textcoords="offset points", xytext=(4, dy), fontsize=7, color=color)


def _json_default(o):
    return None if isinstance(o, float) and math.isnan(o) else str(o)


def write_files(paths: Dict[str, str], table: str, wall: float, columns: List[str], rows: List[dict],
                js: dict) -> None:
    """Write one task's table (with the sweep's wall time, seconds), CSV (``columns`` of
    ``rows``; other keys left out) and JSON (``js``; NaN as null) to ``paths``."""
    with open(paths["table"], "w") as f:
        f.write(table + f"\n\nSweep wall time: {wall:.1f} s\n")
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    with open(paths["json"], "w") as f:
        json.dump(js, f, indent=1, default=_json_default)


def _stats_log(row: dict, cfg: dict) -> None:
    """The JSON's ``stats_log`` of a run: the path of its step reports, when its hook wrote one
    (:func:`gradcomp.experiments.sweep.assign_stats_logs`)."""
    path = cfg.get("stats_log")
    if path and os.path.exists(path):
        row["stats_log"] = os.path.abspath(path)


def digits_rows(plans: List[dict], results: List[list], workers: int, epochs: int) -> List[dict]:
    """One row per digits run: rank 0's result's :data:`CSV_COLUMNS`, the run's codec, optimizer,
    error feedback and seed, W, the epochs, the per-epoch training loss, (under ``--link``) the
    per-epoch ``curve`` and the path of its ``stats_log`` when it wrote one."""
    rows = []
    for cfg, res in zip(plans, results):
        r0 = res[0]
        row = {k: r0[k] for k in CSV_COLUMNS if k in r0}
        row.update(codec=cfg["codec"], optimizer=cfg["optimizer"], error_feedback=cfg["error_feedback"],
                   seed=cfg["seed"], workers=workers, epochs=epochs, train_loss=r0["train_loss"])
        if "curve" in r0:
            row["curve"] = r0["curve"]
        for k in ("exempt_numel", "params"):  # --engine fsdp2 (the JSON; not CSV columns)
            if k in r0:
                row[k] = r0[k]
        _stats_log(row, cfg)
        rows.append(row)
    return rows


def charlm_rows(plans: List[dict], results: List[list], workers: int) -> List[dict]:
    """One row per charlm run: rank 0's result's :data:`CHARLM_CSV_COLUMNS`, the run's codec,
    optimizer, error feedback and seed, W, the training loss per progress interval and (under
    ``--link``) the validation ``curve``."""
    rows = []
    for cfg, res in zip(plans, results):
        r0 = res[0]
        row = {k: r0[k] for k in CHARLM_CSV_COLUMNS if k in r0}
        row.update(codec=cfg["codec"], optimizer=cfg["optimizer"], error_feedback=cfg["error_feedback"],
                   seed=cfg["seed"], workers=workers, train_loss=r0["train_loss"])
        for k in ("exempt_numel", "curve"):  # --engine fsdp2, --link (the JSON; not CSV columns)
            if k in r0:
                row[k] = r0[k]
        _stats_log(row, cfg)
        rows.append(row)
    return rows


def _digits(a: argparse.Namespace, sw: argparse.Namespace):
    task = "digits"
    t = a.digits
    rows = digits_rows(sw.plans[task], sw.results[task], a.workers, t.epochs)
    summary = summarize(rows)
    columns, link = CSV_COLUMNS, None
    if sw.link_desc is not None:
        link = link_target(rows, summary, sw.link_desc)
        columns = CSV_COLUMNS + ["time_to_target_s", "epochs_to_target"]
    engine = getattr(t, "engine", "ddp")
    exempt = max((r["exempt_numel"] for r in rows if r.get("exempt_numel")), default=None)
    params = max((r["params"] for r in rows if r.get("params")), default=None)
    table = format_table(summary, a.workers, link, engine=engine, params=params, exempt=exempt)
    if a.notes and any(n.startswith("digits:") for n in a.notes):
        table += "".join(f"\n\nNote: {n}." for n in a.notes if n.startswith("digits:"))
    config = dict(vars(t), task=task, full=a.full, out=a.out)
    js = {"config": config, "wall_s": sw.walls[task], "runs": rows, "summary": summary}
    if link is not None:
        js["link"] = dict(link, rate=a.link, nodes=a.link_nodes, setup=sw.link_setup)
    return rows, summary, table, columns, js


def _charlm(a: argparse.Namespace, sw: argparse.Namespace):
    task = "charlm"
    t = a.charlm
    rows = charlm_rows(sw.plans[task], sw.results[task], a.workers)
    summary = summarize(rows, metric="val_bpc", prefix="bpc")
    params = rows[0]["params"]
    notes = [n for n in a.notes if n.startswith("charlm:")]
    link, columns = None, CHARLM_CSV_COLUMNS
    if sw.link_desc is not None and getattr(t, "curve_every", 0):
        link = charlm_link_target(rows, summary, sw.link_desc)
        columns = CHARLM_CSV_COLUMNS + ["time_to_target_s", "steps_to_target"]
    elif sw.link_desc is not None:
        notes.append(f"charlm: run behind {sw.link_desc} (no time to target under --engine fsdp2: the curve "
                     f"evaluates the whole model mid-run)")
    exempt = max((r["exempt_numel"] for r in rows if r.get("exempt_numel")), default=None)
    table = format_charlm_table(summary, t, sw.corpus, params, notes, exempt=exempt, link=link)
    config = dict(vars(t), task=task, full=a.full, out=a.out, params=params)
    js = {"config": config, "corpus": sw.corpus, "wall_s": sw.walls[task], "runs": rows, "summary": summary}
    if link is not None:
        js["link"] = dict(link, rate=a.link, nodes=a.link_nodes, setup=sw.link_setup)
    return rows, summary, table, columns, js


def write(a: argparse.Namespace, sw: argparse.Namespace, out: TextIO) -> List[Dict[str, str]]:
    """Write every task's files into ``a.out`` (:data:`OUTPUT_FILES`; ``a`` from
    :func:`gradcomp.experiments.args.parse_args`, ``sw`` from :func:`gradcomp.experiments.sweep.run`)
    and print to ``out`` each task's table with its run count and wall time, the total, and the
    absolute path of every file. Returns the paths written, per task in ``a.tasks`` order
    (``{"table", "csv", "json", "plot"}`` each; :func:`output_files`: under ``--engine fsdp2``
    :data:`OUTPUT_FILES_FSDP2`)."""
    written = []
    engine = getattr(a, "engine", "ddp")
    for task in a.tasks:
        paths = {k: os.path.join(a.out, f) for k, f in output_files(task, engine).items()}
        rows, summary, table, columns, js = (_digits if task == "digits" else _charlm)(a, sw)
        write_files(paths, table, sw.walls[task], columns, rows, js)
        plot(summary, paths["plot"], a.workers, task, engine)
        title = task if engine == "ddp" else f"{task} (--engine {engine})"
        out.write(f"## {title}\n\n{table}\n\n{len(rows)} {task} runs in {sw.walls[task]:.1f} s\n\n")
        written.append(paths)
    out.write(f"{sw.total_runs} runs in {sw.wall_all:.1f} s (with the workers' start)\n")
    for paths in written:
        for k in ("table", "csv", "json", "plot"):
            out.write(f"{k:6s}: {os.path.abspath(paths[k])}\n")
    out.flush()
    return written
