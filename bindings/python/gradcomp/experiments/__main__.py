"""``gradcomp-experiment`` / ``python -m gradcomp.experiments``: accuracy versus compression ratio.

Spawns W DDP worker processes on gloo (default 4, spawn start method, one thread each, reused for
every run; a new model, DDP wrapper and hook state per run), trains an MLP on scikit-learn's digits
(see :mod:`gradcomp.experiments.runner`) and sweeps codecs x error feedback x seeds. Default sweep:
none, fp16, bf16, topk at ratios 0.1, 0.01, 0.001, the block quantizers fp8 (e4m3 and e5m2, block
128), fp8 with e8m0 scales (block 32), int8 and int4 (block 128), and onebit (1-bit signs with one
l2 scale per packet; with error feedback, EF-signSGD with a scale, Karimireddy et al. 2019), each
with and without error feedback, except that under ``--ef both`` codec none runs without it only:
its residual is exactly zero, so the run with error feedback repeats the one without bit for bit.
3 seeds (``--seeds``) for none, top-k and onebit, whose accuracy moves with the seed and with error
feedback; 1 (``--quant-seeds``) for the casts and the block quantizers, whose test accuracy matched
the dense run's on every seed tried: 41 runs with SGD and the gradcomp hook. The hook's scheme is
``auto`` (sum for the casts, gather for top-k, two_phase for the quantizers and onebit, with worker
and server residuals under error feedback); the table and the CSV say which scheme each run used.
Then the optimizer rows (``--optimizers``, 2 seeds each): torch's Adam under plain DDP and
gradcomp.optim.OnebitAdam (1-bit Adam, Tang et al., ICML 2021) with its DDP hook, a dense warm-up
of 15 % of the steps and then the 1-bit compressed momentum, on the same model (peak lr 1e-3, eps
1e-4, cosine decay, no weight decay; the first layer's weights of constant pixels masked with
``exp_avg_mask``). 45 runs, about 4 minutes on 2 cores (the budget is 5; the README's "The main
job" has the measured time).

Writes into ``--out`` (default ``results/``): ``results.csv`` (one row per run), ``results.json``
(configuration, every run with its loss curve, and the summary), ``table.md`` (the printed table:
mean and spread over seeds) and ``accuracy_vs_bits.png`` (test accuracy against bits per element).
Progress bars (tqdm) go to stderr; the table and the file paths go to stdout.

Byte accounting, summed over all buckets and steps of a run, as the hook's ``stats()`` reports it
from :mod:`gradcomp.planner` (the one home of these formulas; the README's "The main job"):
packet_ratio = packet bytes / dense bytes; wire_ratio = bytes one rank sends under the scheme /
bytes it sends in a ring allreduce of the dense buckets (2(W-1)/W * dense bytes); bits per element
= 8 * packet bytes / numel.

Exit status 0 on success; 2 on bad arguments (argparse); a failed run raises RuntimeError with the
worker's traceback.
"""

import argparse
import csv
import json
import logging
import math
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

from ..codec import Codec

DEFAULT_CODECS = ["none", "fp16", "bf16", "topk:ratio=0.1", "topk:ratio=0.01", "topk:ratio=0.001",
                  "fp8", "fp8:format=e5m2", "fp8:scale=e8m0", "int8", "int4", "onebit"]

# codec families that run over --quant-seeds (the others over --seeds)
QUANT_SEED_FAMILIES = ("fp16", "bf16", "fp8", "int8", "int4")

# the optimizer rows: label in the codec column, and whether the run has error feedback
OPTIMIZERS = {"adam": ("Adam", False), "onebit_adam": ("1-bit Adam", True)}

CSV_COLUMNS = ["codec", "optimizer", "scheme", "error_feedback", "seed", "test_accuracy", "final_loss",
               "packet_ratio", "wire_ratio", "bits_per_element", "packet_bytes_per_step", "sent_bytes_per_step",
               "dense_bytes_per_step", "numel", "buckets", "steps", "nonfinite_steps", "encode_s",
               "decode_s", "comm_s", "train_s", "wall_s", "workers", "epochs"]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gradcomp-experiment",
                                description="Accuracy versus compression ratio on scikit-learn digits "
                                            "with real DDP processes (gloo, CPU).")
    p.add_argument("--workers", type=int, default=4, help="DDP processes (default 4)")
    p.add_argument("--codecs", default=";".join(DEFAULT_CODECS),
                   help="codec specs separated by ';' (a spec itself may hold commas, e.g. "
                        "'topk:k=50,value_dtype=float16'; default: %(default)s)")
    p.add_argument("--ef", choices=["both", "on", "off"], default="both",
                   help="error feedback: both (default; codec none without it only, where it would "
                        "repeat the same run bit for bit), on, off")
    p.add_argument("--seeds", type=int, default=3,
                   help="seeds per setting, 0..N-1, for none, top-k and onebit (default 3)")
    p.add_argument("--quant-seeds", type=int, default=1,
                   help="seeds for the casts fp16/bf16 and the block quantizers fp8/int8/int4, at most "
                        "--seeds (default 1: the default sweep of 41 runs stays well within 5 minutes "
                        "on 2 cores)")
    p.add_argument("--epochs", type=int, default=30, help="epochs per run (default 30)")
    p.add_argument("--lr", type=float, default=0.07, help="peak learning rate, cosine decay (default 0.07)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batch-size", type=int, default=48, help="per-rank batch (default 48)")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay (default 5e-4)")
    p.add_argument("--hidden", type=int, default=256, help="MLP hidden width (default 256)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.1,
                   help="DDP bucket_cap_mb (default 0.1: two buckets, rebuilt after step 1)")
    p.add_argument("--optimizers", default="adam;onebit_adam",
                   help="optimizer rows separated by ';', beside the SGD codec sweep: adam (torch.optim.Adam, "
                        "plain DDP) and onebit_adam (gradcomp.optim.OnebitAdam with its DDP hook: dense "
                        "warm-up, then 1-bit compressed momentum); '' for none (default: %(default)s)")
    p.add_argument("--optimizer-seeds", type=int, default=2, help="seeds of each optimizer row (default 2)")
    p.add_argument("--adam-lr", type=float, default=1e-3, help="peak learning rate of the Adam rows (default 1e-3)")
    p.add_argument("--adam-eps", type=float, default=1e-4,
                   help="eps of the Adam rows (default 1e-4: with 1e-8, 1-bit Adam diverges on this ReLU MLP, "
                        "whose dead units keep a frozen variance of 0)")
    p.add_argument("--freeze-fraction", type=float, default=0.15,
                   help="1-bit Adam's warm-up as a fraction of the run's steps (default 0.15, DeepSpeed's advice)")
    p.add_argument("--out", default="results", help="output folder (default results/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true", help="log gradcomp INFO messages")
    a = p.parse_args(argv)
    if a.workers < 1 or a.seeds < 1 or a.quant_seeds < 1 or a.epochs < 1 or a.batch_size < 1 or a.hidden < 1:
        p.error("--workers, --seeds, --quant-seeds, --epochs, --batch-size and --hidden must be >= 1")
    a.codec_list = [c.strip() for c in a.codecs.split(";") if c.strip()]
    a.optimizer_list = [c.strip() for c in a.optimizers.split(";") if c.strip()]
    for o in a.optimizer_list:
        if o not in OPTIMIZERS:
            p.error(f"--optimizers: {o!r}; accepted: {', '.join(OPTIMIZERS)}")
    if a.optimizer_seeds < 1 or not 0.0 < a.freeze_fraction < 1.0 or not a.adam_lr > 0 or not a.adam_eps > 0:
        p.error("--optimizer-seeds must be >= 1, --freeze-fraction in (0, 1), --adam-lr and --adam-eps > 0")
    if not a.codec_list and not a.optimizer_list:
        p.error("--codecs and --optimizers are empty")
    for spec in a.codec_list:
        try:
            Codec(spec)
        except ValueError as e:
            p.error(f"--codecs: {e}")
    return a


def seeds_for(codec: str, a: argparse.Namespace) -> int:
    """Seeds of a codec's runs: ``--quant-seeds`` (capped at ``--seeds``) for the casts fp16 / bf16
    and the block quantizers fp8 / int8 / int4, ``--seeds`` for the others (none, top-k, onebit)."""
    family = codec.partition(":")[0].strip()
    return min(a.seeds, a.quant_seeds) if family in QUANT_SEED_FAMILIES else a.seeds


def efs_for(codec: str, a: argparse.Namespace) -> List[bool]:
    """Error-feedback settings of a codec's runs, from ``--ef``; under ``both``, codec none runs
    without error feedback only (its residual is exactly zero, so the run with it is the same run)."""
    efs = {"both": [False, True], "on": [True], "off": [False]}[a.ef]
    if a.ef == "both" and codec.partition(":")[0].strip() == "none":
        return [False]
    return efs


def plan_runs(a: argparse.Namespace) -> List[dict]:
    """The runs of the sweep, in order: codec, then error feedback, then seed (SGD with the
    gradcomp hook); then the optimizer rows (``--optimizers``), seed by seed."""
    common = dict(epochs=a.epochs, lr=a.lr, momentum=a.momentum, batch_size=a.batch_size, hidden=a.hidden,
                  bucket_cap_mb=a.bucket_cap_mb, weight_decay=a.weight_decay)
    runs = [dict(common, codec=c, optimizer="sgd", error_feedback=ef, seed=s)
            for c in a.codec_list for ef in efs_for(c, a) for s in range(seeds_for(c, a))]
    for o in a.optimizer_list:
        label, ef = OPTIMIZERS[o]
        runs += [dict(common, codec=label, optimizer=o, error_feedback=ef, seed=s, adam_lr=a.adam_lr,
                      adam_eps=a.adam_eps, freeze_fraction=a.freeze_fraction)
                 for s in range(a.optimizer_seeds)]
    return runs


def _setting(codec: str, ef: bool) -> str:
    return f"{codec}{' +EF' if ef else ''}"


def summarize(rows: List[dict]) -> List[dict]:
    """Group runs by (codec, error_feedback): mean, std (sample, 0 for one seed), min and max of
    test accuracy, and the means of the ratios and times."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["codec"], r["error_feedback"]), []).append(r)
    out = []
    for (codec, ef), rs in groups.items():
        accs = [r["test_accuracy"] for r in rs]

        def mean(k):
            return statistics.fmean(r[k] for r in rs)

        out.append({
            "codec": codec, "scheme": "/".join(sorted({r.get("scheme", "") for r in rs})),
            "error_feedback": ef, "runs": len(rs),
            "acc_mean": statistics.fmean(accs), "acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "acc_min": min(accs), "acc_max": max(accs),
            "final_loss": mean("final_loss"), "packet_ratio": mean("packet_ratio"),
            "wire_ratio": mean("wire_ratio"), "bits_per_element": mean("bits_per_element"),
            "encode_s": mean("encode_s"), "decode_s": mean("decode_s"), "comm_s": mean("comm_s"),
            "train_s": mean("train_s"), "wall_s": mean("wall_s"),
        })
    return out


def format_table(summary: List[dict], workers: int) -> str:
    """A Markdown table of the summary (accuracy in percent, mean +- sample std over seeds)."""
    head = ("| codec | scheme | EF | runs | test acc % (mean ± std) | min–max | final loss | packet_ratio | "
            "wire_ratio | bits/elem | encode s | comm s | decode s | train s |")
    sep = "|" + "---|" * 14
    lines = [head, sep]
    for s in summary:
        lines.append(
            f"| {s['codec']} | {s['scheme']} | {'on' if s['error_feedback'] else 'off'} | {s['runs']} | "
            f"{s['acc_mean']:.2f} ± {s['acc_std']:.2f} | {s['acc_min']:.2f}–{s['acc_max']:.2f} | "
            f"{s['final_loss']:.4f} | {100 * s['packet_ratio']:.3f}% | {100 * s['wire_ratio']:.3f}% | "
            f"{s['bits_per_element']:.3f} | {s['encode_s']:.2f} | {s['comm_s']:.2f} | "
            f"{s['decode_s']:.2f} | {s['train_s']:.2f} |")
    lines.append("")
    lines.append(f"W = {workers} gloo workers (CPU). Ratios are totals over all buckets and steps; "
                 f"wire_ratio is against a ring allreduce of the dense buckets (2(W-1)/W x dense bytes). "
                 f"Times are per run, summed over steps, seconds; comm s is launch-to-completion per "
                 f"bucket and overlaps the backward pass.")
    return "\n".join(lines)


def plot(summary: List[dict], path: str, workers: int) -> None:
    """PNG: mean test accuracy (error bars: min..max over seeds) against bits per element, log x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    opt_labels = {label for label, _ in OPTIMIZERS.values()}
    for ef, marker, color in ((False, "o", "tab:red"), (True, "s", "tab:blue"), (None, "^", "tab:green")):
        pts = sorted((s for s in summary if (s["codec"] in opt_labels if ef is None else
                                             s["error_feedback"] == ef and s["codec"] not in opt_labels)),
                     key=lambda s: s["bits_per_element"])
        if not pts:
            continue
        x = [s["bits_per_element"] for s in pts]
        y = [s["acc_mean"] for s in pts]
        yerr = [[s["acc_mean"] - s["acc_min"] for s in pts], [s["acc_max"] - s["acc_mean"] for s in pts]]
        ax.errorbar(x, y, yerr=yerr, fmt=marker, color=color, capsize=3, linestyle="none",
                    label={None: "Adam / 1-bit Adam", True: "SGD, error feedback",
                           False: "SGD, no error feedback"}[ef])
        labels: Dict[float, List[str]] = {}
        for s in pts:  # one label per point; codecs with the same bits (fp16, bf16) share it
            labels.setdefault(round(s["bits_per_element"], 6), []).append(
                s["codec"].replace("topk:ratio=", "top-k "))
        for s in pts:
            key = round(s["bits_per_element"], 6)
            if key not in labels:
                continue
            same = [t for t in pts if round(t["bits_per_element"], 6) == key]
            ax.annotate("/".join(labels.pop(key)), (s["bits_per_element"], max(t["acc_mean"] for t in same)),
                        textcoords="offset points", xytext=(4, -10 if ef else 5), fontsize=7, color=color)
    dense = [s["acc_mean"] for s in summary if s["codec"] == "none" and not s["error_feedback"]]
    if dense:
        ax.axhline(dense[0], color="gray", linestyle="--", linewidth=0.8, label="dense (codec none)")
        ax.legend(loc="lower right")
    ax.set_xscale("log")
    ax.set_xlabel("bits per gradient element (8 x packet bytes / numel, log scale)")
    ax.set_ylabel("test accuracy, % (mean; bars: min-max over seeds)")
    ax.set_title(f"digits MLP, {workers} DDP workers: accuracy vs compression")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``gradcomp-experiment``; returns the exit status."""
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from tqdm import tqdm

    from ..torch.pool import GlooPool
    from .runner import train_run

    runs = plan_runs(a)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    rows = []
    with tqdm(total=len(runs), desc="runs", unit="run", disable=a.no_progress, position=0) as bar_runs, \
            tqdm(total=a.epochs, desc="epochs", unit="ep", disable=a.no_progress, position=1, leave=False) as bar_ep:
        bar_runs.set_postfix_str(f"starting {a.workers} workers")
        with GlooPool(a.workers, threads=1) as pool:
            for cfg in runs:
                bar_runs.set_postfix_str(f"{_setting(cfg['codec'], cfg['error_feedback'])} seed {cfg['seed']}")
                bar_ep.reset(total=a.epochs)

                def progress(rank, msg):
                    bar_ep.update(1)
                    bar_ep.set_postfix_str(f"loss {msg['loss']:.4f}")

                res = pool.run(train_run, cfg, on_progress=progress, timeout=600)
                sums = {r["param_checksum"] for r in res}
                if len(sums) != 1:
                    raise RuntimeError(f"ranks disagree on the final parameters for {cfg}: checksums {sums}")
                r0 = res[0]
                row = {k: r0[k] for k in CSV_COLUMNS if k in r0}
                row.update(codec=cfg["codec"], optimizer=cfg["optimizer"], error_feedback=cfg["error_feedback"],
                           seed=cfg["seed"],
                           workers=a.workers, epochs=a.epochs,
                           train_loss=r0["train_loss"])
                rows.append(row)
                bar_runs.update(1)
    wall = time.perf_counter() - t0

    summary = summarize(rows)
    table = format_table(summary, a.workers)
    paths = {k: os.path.join(a.out, f) for k, f in
             (("table", "table.md"), ("csv", "results.csv"), ("json", "results.json"),
              ("plot", "accuracy_vs_bits.png"))}
    with open(paths["table"], "w") as f:
        f.write(table + f"\n\nSweep wall time: {wall:.1f} s\n")
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    with open(paths["json"], "w") as f:
        json.dump({"config": {k: v for k, v in vars(a).items()}, "wall_s": wall, "runs": rows,
                   "summary": summary}, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    plot(summary, paths["plot"], a.workers)
    out = sys.stdout
    out.write(table + "\n\n")
    out.write(f"{len(rows)} runs in {wall:.1f} s\n")
    for k in ("table", "csv", "json", "plot"):
        out.write(f"{k:6s}: {os.path.abspath(paths[k])}\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
