"""``gradcomp-experiment`` / ``python -m gradcomp.experiments``: model quality versus compression.

Spawns W DDP worker processes on gloo (default 4, spawn start method, one thread each, reused for
every run of every task; a new model, DDP wrapper and hook state per run) and sweeps codecs x
error feedback x seeds on two tasks (``--task digits,charlm``, the default, or ``all``; or one):

``digits`` (:mod:`gradcomp.experiments.runner`): an MLP 64-256-256-10 on scikit-learn's digits,
SGD with momentum, 30 epochs; metric test accuracy. Codecs: none, fp16, bf16, topk at ratios 0.1,
0.01, 0.001, the block quantizers fp8 (e4m3, block 128), int8 and int4 (block 128), and onebit
(1-bit signs with one l2 scale per packet; with error feedback, EF-signSGD with a scale,
Karimireddy et al. 2019); ``--full`` adds the fp8 variants e5m2 (block 128) and e8m0 scales (block
32). Each with and without error feedback, except that under ``--ef both`` codec none runs without
it only: its residual is exactly zero, so the run with error feedback repeats the one without bit
for bit. none, top-k and onebit run over ``--seeds`` seeds (default 2; 3 with ``--full``): their
accuracy moves with the seed and with error feedback; the casts and the block quantizers over
``--quant-seeds`` (1), their test accuracy matched the dense run's on every seed tried. Then the
optimizer rows (``--optimizers``, ``--optimizer-seeds`` seeds each, default 1; 2 with ``--full``):
torch's Adam under plain DDP and gradcomp.optim.OnebitAdam (1-bit Adam, Tang et al., ICML 2021)
with its DDP hook, a dense warm-up of 15 % of the steps and then the 1-bit compressed momentum, on
the same model (peak lr 1e-3, eps 1e-4, cosine decay, no weight decay; the first layer's weights
of constant pixels masked with ``exp_avg_mask``). Default: 28 SGD runs + 2 optimizer runs = 30;
``--full``: 41 + 4 = 45, the sweep that was the default before the charlm task came (the same runs
give the same results: the default's runs are a subset of the full sweep's).

``charlm`` (:mod:`gradcomp.experiments.charlm`): a character-level 2-layer LSTM language model
(embed 48, hidden 192: 505,681 parameters) on the Python standard library's own source text (the
running interpreter's, a fixed file list, 4 MiB at most; validation split by file); Adam (peak lr
2e-2, cosine decay, clip 1), ``--charlm-steps`` steps (default 150) of 8 windows x 64 characters
per rank; metric validation bits per character. Default: none (dense), then fp16, topk:ratio=0.01,
powersgd:rank=2 and powersgd:rank=4 with error feedback (``--ef auto``: error feedback on except
for codec none), 1 seed: 5 runs. ``--full``: none, fp16, bf16, topk at 0.1, 0.01 and 0.001, int8,
int4, onebit and PowerSGD at ranks 1, 2, 4 and 8, each with and without error feedback (codec none
without only), 2 seeds: 50 runs. The ``powersgd:rank=R`` specs go to gradcomp.torch's low-rank
hook (Vogels et al., NeurIPS 2019; PyTorch's PowerSGD hook protocol); when
``gradcomp.torch.powersgd`` cannot be imported, the default lists leave those rows out (the table
says so) and an explicit ``--codecs`` with one is an argparse error.

The hook's scheme is ``auto`` (sum for the casts, gather for top-k, two_phase for the quantizers
and onebit, with worker and server residuals under error feedback; powersgd for the low-rank
hook); the tables and the CSVs say which scheme each run used. ``--codecs``, ``--ef``, ``--seeds``
and ``--quant-seeds`` apply to every selected task (default: each task's own); the ``--charlm-*``
flags to charlm only, the other training flags (``--epochs``, ``--lr``, ...) to digits only.

Writes into ``--out`` (default ``results/``), for digits: ``results.csv`` (one row per run),
``results.json`` (configuration, every run with its loss curve, and the summary), ``table.md``
(the printed table: mean and spread over seeds) and ``accuracy_vs_bits.png`` (test accuracy
against bits per element); for charlm the same with a ``charlm_`` prefix and
``charlm_bpc_vs_bits.png`` (validation bits per character against bits per element).
Progress bars (tqdm) go to stderr; the tables and the file paths go to stdout. The README's "The
main job" has the measured times (the default: within 5 minutes on 2 cores).

Byte accounting, summed over all buckets and steps of a run, as the hook's ``stats()`` reports it
from :mod:`gradcomp.planner` (the one home of these formulas; the README's "The main job"):
packet_ratio = packet bytes / dense bytes; wire_ratio = bytes one rank sends under the scheme /
bytes it sends in a ring allreduce of the dense buckets (2(W-1)/W * dense bytes); bits per element
= 8 * packet bytes / numel.

Slow links (``--link RATE``, e.g. ``100mbit``, ``1gbit``, ``10gbit``, ``unlimited``; needs root,
``ip`` and ``tc``): the W workers run inside a network namespace this command creates, whose
loopback is rate-limited by a tc token-bucket filter at RATE (every rank's traffic shares it;
:func:`gradcomp.experiments.links.shaped_loopback`), or with ``--link-nodes 2`` in two namespaces
("nodes", W/2 ranks each) joined by a veth pair rate-limited at RATE in each direction
(:func:`gradcomp.experiments.links.two_nodes`); the namespaces are removed at the end, also on
errors, and nothing leaves the machine. The digits table then also has, per codec, the wall-clock
time to a target accuracy: the target is 98 % of the mean final test accuracy of the dense run
(codec none, SGD, no error feedback) of the same sweep, and a run's time to target is the wall
time from its start (model build) to the end of the first epoch whose test accuracy reaches it,
the per-epoch evaluation excluded (:func:`gradcomp.experiments.links.timed_train_run`), with the
epoch, how many seeds reached it, and the run's wall time; charlm runs under the same link with
its usual table. Without ``--link`` nothing changes.

Exit status 0 on success; 2 on bad arguments (argparse) or when ``--link`` cannot build the
namespaces here (the reason is printed); a failed run raises RuntimeError with the worker's
traceback.
"""

import argparse
import contextlib
import csv
import json
import logging
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

from ..codec import Codec
from . import charlm

TASKS = ("digits", "charlm")

DEFAULT_CODECS = ["none", "fp16", "bf16", "topk:ratio=0.1", "topk:ratio=0.01", "topk:ratio=0.001",
                  "fp8", "int8", "int4", "onebit"]
DIGITS_FULL_CODECS = ["none", "fp16", "bf16", "topk:ratio=0.1", "topk:ratio=0.01", "topk:ratio=0.001",
                      "fp8", "fp8:format=e5m2", "fp8:scale=e8m0", "int8", "int4", "onebit"]

CHARLM_CODECS = ["none", "fp16", "topk:ratio=0.01", "powersgd:rank=2", "powersgd:rank=4"]
CHARLM_FULL_CODECS = ["none", "fp16", "bf16", "topk:ratio=0.1", "topk:ratio=0.01", "topk:ratio=0.001", "int8",
                      "int4", "onebit", "powersgd:rank=1", "powersgd:rank=2", "powersgd:rank=4", "powersgd:rank=8"]

# each task's defaults of the shared sweep flags: (default, --full)
SWEEP_DEFAULTS = {
    "digits": {"codecs": (DEFAULT_CODECS, DIGITS_FULL_CODECS), "ef": ("both", "both"), "seeds": (2, 3),
               "quant_seeds": (1, 1)},
    "charlm": {"codecs": (CHARLM_CODECS, CHARLM_FULL_CODECS), "ef": ("auto", "both"), "seeds": (1, 2),
               "quant_seeds": (1, 2)},
}
DIGITS_OPTIMIZER_SEEDS = (1, 2)  # (default, --full)
CL = charlm.DEFAULTS  # the charlm task's defaults (one home: gradcomp.experiments.charlm)
CHARLM_LR = {"adam": CL["lr"], "sgd": 4.0}  # default peak learning rate per --charlm-optimizer

# codec families that run over --quant-seeds (the others over --seeds)
QUANT_SEED_FAMILIES = ("fp16", "bf16", "fp8", "int8", "int4")

# the optimizer rows: label in the codec column, and whether the run has error feedback
OPTIMIZERS = {"adam": ("Adam", False), "onebit_adam": ("1-bit Adam", True)}

CSV_COLUMNS = ["codec", "optimizer", "scheme", "error_feedback", "seed", "test_accuracy", "final_loss",
               "packet_ratio", "wire_ratio", "bits_per_element", "packet_bytes_per_step", "sent_bytes_per_step",
               "dense_bytes_per_step", "numel", "buckets", "steps", "nonfinite_steps", "encode_s",
               "decode_s", "comm_s", "train_s", "wall_s", "workers", "epochs"]

CHARLM_CSV_COLUMNS = ["codec", "scheme", "error_feedback", "seed", "val_bpc", "final_loss", "packet_ratio",
                      "wire_ratio", "bits_per_element", "packet_bytes_per_step", "sent_bytes_per_step",
                      "dense_bytes_per_step", "numel", "buckets", "steps", "nonfinite_steps", "encode_s",
                      "decode_s", "comm_s", "train_s", "eval_s", "wall_s", "workers", "params"]

# output file names per task: table, csv, json, plot
OUTPUT_FILES = {
    "digits": {"table": "table.md", "csv": "results.csv", "json": "results.json", "plot": "accuracy_vs_bits.png"},
    "charlm": {"table": "charlm_table.md", "csv": "charlm_results.csv", "json": "charlm_results.json",
               "plot": "charlm_bpc_vs_bits.png"},
}


def _family(codec: str) -> str:
    return codec.partition(":")[0].strip()


def check_powersgd_spec(spec: str) -> None:
    """Check a ``powersgd:rank=R[,key=value...]`` spec's syntax here (R an int >= 1; the other
    keys are the hook's, which checks them when a run registers it).

    Raises:
        ValueError: no ``rank``, a rank that is not an int >= 1, or an option without ``=``.
    """
    opts = {}
    for item in spec.partition(":")[2].split(","):
        item = item.strip()
        if not item:
            continue
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"codec spec {spec!r}: option {item!r} is not key=value")
        opts[k.strip()] = v.strip()
    try:
        rank = int(opts["rank"])
    except KeyError:
        raise ValueError(f"codec spec {spec!r}: powersgd needs rank=R (an int >= 1), e.g. 'powersgd:rank=2'") from None
    except ValueError:
        raise ValueError(f"codec spec {spec!r}: rank={opts['rank']!r} is not an int") from None
    if rank < 1:
        raise ValueError(f"codec spec {spec!r}: rank={rank}; accepted: an int >= 1")


def powersgd_available() -> bool:
    """Whether gradcomp.torch's PowerSGD hook is installed (``import gradcomp.torch.powersgd``)."""
    try:
        import gradcomp.torch.powersgd  # noqa: F401
    except ImportError:
        return False
    return True


def _split_list(s: str) -> List[str]:
    return [c.strip() for c in s.split(";") if c.strip()]


def parse_tasks(s: str) -> List[str]:
    """``--task``: a comma-separated list of digits, charlm, all (= digits,charlm); returns the
    tasks in the order given, each once.

    Raises:
        ValueError: an unknown name, or an empty list.
    """
    out: List[str] = []
    for t in (x.strip() for x in s.split(",")):
        if not t:
            continue
        names = TASKS if t == "all" else (t,)
        for n in names:
            if n not in TASKS:
                raise ValueError(f"--task: {t!r}; accepted: {', '.join(TASKS)}, all (comma-separated)")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError(f"--task is empty; accepted: {', '.join(TASKS)}, all (comma-separated)")
    return out


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse the command line. Returns the namespace with ``tasks`` (list), ``digits`` and
    ``charlm`` (each a namespace of that task's resolved settings: ``codec_list``, ``ef``,
    ``seeds``, ``quant_seeds`` and its training flags; both always present) and ``notes``
    (strings for the tables: powersgd rows left out of a default list)."""
    p = argparse.ArgumentParser(
        prog="gradcomp-experiment",
        description="Model quality versus compression ratio with real DDP processes (gloo, CPU): test accuracy "
                    "of an MLP on scikit-learn digits, validation bits per character of a character-level "
                    "LSTM on the Python standard library's source.",
        epilog="Default: both tasks, a sweep that fits in 5 minutes on 2 cores; --full: the whole sweeps "
               "(digits 45 runs, charlm 50).")
    p.add_argument("--task", default="all",
                   help="tasks to run, comma-separated: digits, charlm, or all (= digits,charlm; default)")
    p.add_argument("--full", action="store_true",
                   help="the whole sweeps: digits 12 codecs (with the fp8 variants e5m2 and e8m0), 3 seeds and 2 "
                        "per optimizer row (45 runs); charlm 13 codecs (PowerSGD at ranks 1, 2, 4, 8), error "
                        "feedback on and off, 2 seeds (50 runs)")
    p.add_argument("--workers", type=int, default=4, help="DDP processes (default 4)")
    g = p.add_argument_group("sweep (every selected task; default: each task's own)")
    g.add_argument("--codecs", default=None,
                   help="codec specs separated by ';' (a spec itself may hold commas, e.g. "
                        "'topk:k=50,value_dtype=float16'; 'powersgd:rank=R' for the low-rank hook). digits: "
                        + ";".join(DEFAULT_CODECS) + " (--full: also fp8:format=e5m2;fp8:scale=e8m0). charlm: "
                        + ";".join(CHARLM_CODECS)
                        + " (--full: " + ";".join(CHARLM_FULL_CODECS) + ")")
    g.add_argument("--ef", choices=["both", "on", "off", "auto"], default=None,
                   help="error feedback: both (codec none without it only, where it would repeat the same run "
                        "bit for bit), on, off, auto (on, except codec none: off). Default: digits both; charlm "
                        "auto (--full: both)")
    g.add_argument("--seeds", type=int, default=None,
                   help="seeds per setting, 0..N-1 (the casts and block quantizers: --quant-seeds). Default: "
                        "digits 2 (--full 3), charlm 1 (--full 2)")
    g.add_argument("--quant-seeds", type=int, default=None,
                   help="seeds for the casts fp16/bf16 and the block quantizers fp8/int8/int4, at most --seeds. "
                        "Default: digits 1, charlm 1 (--full 2)")
    d = p.add_argument_group("digits task")
    d.add_argument("--epochs", type=int, default=30, help="epochs per run (default 30)")
    d.add_argument("--lr", type=float, default=0.07, help="peak learning rate, cosine decay (default 0.07)")
    d.add_argument("--momentum", type=float, default=0.9)
    d.add_argument("--batch-size", type=int, default=48, help="per-rank batch (default 48)")
    d.add_argument("--weight-decay", type=float, default=5e-4, help="SGD weight decay (default 5e-4)")
    d.add_argument("--hidden", type=int, default=256, help="MLP hidden width (default 256)")
    d.add_argument("--bucket-cap-mb", type=float, default=0.1,
                   help="DDP bucket_cap_mb (default 0.1: two buckets, rebuilt after step 1)")
    d.add_argument("--optimizers", default="adam;onebit_adam",
                   help="optimizer rows separated by ';', beside the SGD codec sweep: adam (torch.optim.Adam, "
                        "plain DDP) and onebit_adam (gradcomp.optim.OnebitAdam with its DDP hook: dense "
                        "warm-up, then 1-bit compressed momentum); '' for none (default: %(default)s)")
    d.add_argument("--optimizer-seeds", type=int, default=None,
                   help="seeds of each optimizer row (default 1; --full: 2)")
    d.add_argument("--adam-lr", type=float, default=1e-3, help="peak learning rate of the Adam rows (default 1e-3)")
    d.add_argument("--adam-eps", type=float, default=1e-4,
                   help="eps of the Adam rows (default 1e-4: with 1e-8, 1-bit Adam diverges on this ReLU MLP, "
                        "whose dead units keep a frozen variance of 0)")
    d.add_argument("--freeze-fraction", type=float, default=0.15,
                   help="1-bit Adam's warm-up as a fraction of the run's steps (default 0.15, DeepSpeed's advice)")
    c = p.add_argument_group("charlm task")
    c.add_argument("--charlm-steps", type=int, default=CL["steps"],
                   help=f"training steps per run (default {CL['steps']})")
    c.add_argument("--charlm-optimizer", choices=["adam", "sgd"], default=CL["optimizer"],
                   help="adam (torch.optim.Adam, betas (momentum, 0.999); default) or sgd (with momentum)")
    c.add_argument("--charlm-lr", type=float, default=None,
                   help="peak learning rate, cosine decay to 0 (default: adam 2e-2, sgd 4.0)")
    c.add_argument("--charlm-momentum", type=float, default=CL["momentum"],
                   help="Adam's beta1 or SGD's momentum (default 0.9)")
    c.add_argument("--charlm-clip", type=float, default=CL["clip"],
                   help="clip the averaged gradient to this l2 norm, 0 for none (default 1.0)")
    c.add_argument("--charlm-batch-size", type=int, default=CL["batch_size"],
                   help=f"windows per rank per step (default {CL['batch_size']})")
    c.add_argument("--charlm-seq-len", type=int, default=CL["seq_len"],
                   help=f"characters predicted per window (default {CL['seq_len']})")
    c.add_argument("--charlm-embed", type=int, default=CL["embed"], help=f"embedding width (default {CL['embed']})")
    c.add_argument("--charlm-hidden", type=int, default=CL["hidden"],
                   help=f"LSTM hidden units per layer (default {CL['hidden']})")
    c.add_argument("--charlm-bucket-cap-mb", type=float, default=CL["bucket_cap_mb"],
                   help="DDP bucket_cap_mb (default 4.0: one bucket after DDP's rebuild at step 1; the "
                        "model's gradients are 2 MB)")
    c.add_argument("--charlm-start-iter", type=int, default=CL["start_iter"],
                   help="dense steps before compression starts, every codec (default 0)")
    c.add_argument("--charlm-val-windows", type=int, default=CL["val_windows"],
                   help="validation windows of seq-len characters, evenly spaced (default 512)")
    c.add_argument("--charlm-corpus-bytes", type=int, default=None,
                   help="cap on the corpus size in bytes, whole files (default 4194304 = 4 MiB)")
    lk = p.add_argument_group("slow links (root; see the module docstring)")
    lk.add_argument("--link", default=None, metavar="RATE",
                    help="run the workers behind a tc-rate-limited link at RATE (e.g. 100mbit, 1gbit, 10gbit, "
                         "unlimited); the digits table adds the wall-clock time to 98%% of the dense run's accuracy")
    lk.add_argument("--link-nodes", type=int, choices=(1, 2), default=1,
                    help="1: all workers on one shaped loopback (default); 2: two namespaces of W/2 workers "
                         "joined by a veth pair shaped at RATE")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="results", help="output folder (default results/)")
    o.add_argument("--no-progress", action="store_true", help="no progress bars")
    o.add_argument("-v", "--verbose", action="store_true", help="log gradcomp INFO messages")
    a = p.parse_args(argv)
    try:
        a.tasks = parse_tasks(a.task)
    except ValueError as e:
        p.error(str(e))
    if a.workers < 1:
        p.error(f"--workers={a.workers}; accepted: >= 1")
    for name in ("seeds", "quant_seeds", "optimizer_seeds"):
        v = getattr(a, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')}={v}; accepted: >= 1")
    if a.epochs < 1 or a.batch_size < 1 or a.hidden < 1:
        p.error("--epochs, --batch-size and --hidden must be >= 1")
    for name in ("charlm_steps", "charlm_batch_size", "charlm_seq_len", "charlm_embed", "charlm_hidden",
                 "charlm_val_windows"):
        v = getattr(a, name)
        if v < 1:
            p.error(f"--{name.replace('_', '-')}={v}; accepted: >= 1")
    if a.charlm_start_iter < 0 or a.charlm_clip < 0 or not a.charlm_bucket_cap_mb > 0:
        p.error("--charlm-start-iter and --charlm-clip must be >= 0, --charlm-bucket-cap-mb > 0")
    if a.charlm_lr is not None and not a.charlm_lr > 0:
        p.error(f"--charlm-lr={a.charlm_lr}; accepted: > 0")
    if not 0.0 <= a.charlm_momentum < 1.0:
        p.error(f"--charlm-momentum={a.charlm_momentum}; accepted: [0, 1)")
    if a.charlm_corpus_bytes is not None and a.charlm_corpus_bytes < 1:
        p.error(f"--charlm-corpus-bytes={a.charlm_corpus_bytes}; accepted: >= 1")
    if a.link is not None:
        from . import links

        try:
            links.parse_rate(a.link)
        except ValueError as e:
            p.error(f"--link: {e}")
        if a.link_nodes == 2 and a.workers % 2:
            p.error(f"--link-nodes 2 needs an even --workers (W/2 per node); got {a.workers}")
    elif a.link_nodes != 1:
        p.error("--link-nodes needs --link RATE")
    optimizer_list = _split_list(a.optimizers)
    for opt in optimizer_list:
        if opt not in OPTIMIZERS:
            p.error(f"--optimizers: {opt!r}; accepted: {', '.join(OPTIMIZERS)}")
    if not 0.0 < a.freeze_fraction < 1.0 or not a.adam_lr > 0 or not a.adam_eps > 0:
        p.error("--freeze-fraction must be in (0, 1), --adam-lr and --adam-eps > 0")

    full = 1 if a.full else 0
    a.notes = []
    explicit = _split_list(a.codecs) if a.codecs is not None else None
    if explicit is not None:
        for spec in explicit:
            try:
                if _family(spec) == "powersgd":
                    check_powersgd_spec(spec)
                else:
                    Codec(spec)
            except ValueError as e:
                p.error(f"--codecs: {e}")
        if any(_family(s) == "powersgd" for s in explicit) and not powersgd_available():
            p.error("--codecs: powersgd needs gradcomp.torch's PowerSGD hook (gradcomp.torch.powersgd), "
                    "which cannot be imported here")
    psgd_ok = None
    for task in TASKS:
        dflt = SWEEP_DEFAULTS[task]
        t = argparse.Namespace(task=task, workers=a.workers)
        if explicit is not None:
            t.codec_list = list(explicit)
        else:
            t.codec_list = list(dflt["codecs"][full])
            if any(_family(s) == "powersgd" for s in t.codec_list):
                psgd_ok = powersgd_available() if psgd_ok is None else psgd_ok
                if not psgd_ok:
                    left = [s for s in t.codec_list if _family(s) == "powersgd"]
                    t.codec_list = [s for s in t.codec_list if _family(s) != "powersgd"]
                    if task in a.tasks:
                        a.notes.append(f"{task}: left out {', '.join(left)}: gradcomp.torch.powersgd cannot be "
                                       f"imported (the PowerSGD hook is not installed)")
        t.ef = a.ef if a.ef is not None else dflt["ef"][full]
        t.seeds = a.seeds if a.seeds is not None else dflt["seeds"][full]
        t.quant_seeds = a.quant_seeds if a.quant_seeds is not None else dflt["quant_seeds"][full]
        setattr(a, task, t)
    dg = a.digits
    for k in ("epochs", "lr", "momentum", "batch_size", "weight_decay", "hidden", "bucket_cap_mb", "adam_lr",
              "adam_eps", "freeze_fraction"):
        setattr(dg, k, getattr(a, k))
    dg.optimizer_list = optimizer_list
    dg.optimizer_seeds = a.optimizer_seeds if a.optimizer_seeds is not None else DIGITS_OPTIMIZER_SEEDS[full]
    cl = a.charlm
    for k in ("steps", "optimizer", "momentum", "clip", "batch_size", "seq_len", "embed", "hidden", "bucket_cap_mb",
              "start_iter", "val_windows"):
        setattr(cl, k, getattr(a, "charlm_" + k))
    cl.lr = a.charlm_lr if a.charlm_lr is not None else CHARLM_LR[a.charlm_optimizer]
    cl.corpus_bytes = a.charlm_corpus_bytes if a.charlm_corpus_bytes is not None else charlm.CORPUS_MAX_BYTES
    if "digits" in a.tasks and not dg.codec_list and not dg.optimizer_list:
        p.error("digits: --codecs and --optimizers are empty")
    if "charlm" in a.tasks and not cl.codec_list:
        p.error("charlm: --codecs is empty")
    return a


def seeds_for(codec: str, a: argparse.Namespace) -> int:
    """Seeds of a codec's runs: ``quant_seeds`` (capped at ``seeds``) for the casts fp16 / bf16
    and the block quantizers fp8 / int8 / int4, ``seeds`` for the others (none, top-k, onebit,
    powersgd). ``a``: a task's namespace (``parse_args(...).digits`` or ``.charlm``)."""
    return min(a.seeds, a.quant_seeds) if _family(codec) in QUANT_SEED_FAMILIES else a.seeds


def efs_for(codec: str, a: argparse.Namespace) -> List[bool]:
    """Error-feedback settings of a codec's runs, from the task's ``ef``: both (under which codec
    none runs without error feedback only: its residual is exactly zero, so the run with it is the
    same run), on, off, auto (on; codec none off)."""
    none = _family(codec) == "none"
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
                  bucket_cap_mb=a.bucket_cap_mb, weight_decay=a.weight_decay)
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
    then seed; each a :func:`gradcomp.experiments.charlm.train_run` configuration."""
    common = dict(steps=a.steps, optimizer=a.optimizer, lr=a.lr, momentum=a.momentum, clip=a.clip,
                  batch_size=a.batch_size, seq_len=a.seq_len, embed=a.embed, hidden=a.hidden,
                  bucket_cap_mb=a.bucket_cap_mb, start_iter=a.start_iter, val_windows=a.val_windows,
                  corpus_max_bytes=a.corpus_bytes, progress_every=10)
    return [dict(common, codec=c, error_feedback=ef, seed=s)
            for c in a.codec_list for ef in efs_for(c, a) for s in range(seeds_for(c, a))]


def _setting(codec: str, ef: bool) -> str:
    return f"{codec}{' +EF' if ef else ''}"


def summarize(rows: List[dict], metric: str = "test_accuracy", prefix: str = "acc") -> List[dict]:
    """Group runs by (codec, error_feedback): mean, std (sample, 0 for one seed), min and max of
    ``metric`` (keys ``{prefix}_mean``, ``_std``, ``_min``, ``_max``; digits: test accuracy, acc_*;
    charlm: val_bpc, bpc_*), and the means of the final loss, the ratios and times."""
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["codec"], r["error_feedback"]), []).append(r)
    out = []
    for (codec, ef), rs in groups.items():
        vals = [r[metric] for r in rs]

        def mean(k):
            return statistics.fmean(r[k] for r in rs)

        s = {"codec": codec, "scheme": "/".join(sorted({r.get("scheme", "") for r in rs})),
             "error_feedback": ef, "runs": len(rs),
             f"{prefix}_mean": statistics.fmean(vals),
             f"{prefix}_std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
             f"{prefix}_min": min(vals), f"{prefix}_max": max(vals)}
        for k in ("final_loss", "packet_ratio", "wire_ratio", "bits_per_element", "encode_s", "decode_s",
                  "comm_s", "train_s", "wall_s"):
            s[k] = mean(k)
        if all("eval_s" in r for r in rs):
            s["eval_s"] = mean("eval_s")
        out.append(s)
    return out


def format_table(summary: List[dict], workers: int, link: Optional[dict] = None) -> str:
    """The digits Markdown table of the summary (accuracy in percent, mean +- sample std over seeds).
    With ``link`` (:func:`link_target`'s dict, under ``--link``) four more columns: the mean time
    to the target accuracy over the seeds that reached it (s), its mean epoch, how many seeds
    reached it, and the mean wall time of a run (s); and a line saying what the target is."""
    head = ("| codec | scheme | EF | runs | test acc % (mean ± std) | min–max | final loss | packet_ratio | "
            "wire_ratio | bits/elem | encode s | comm s | decode s | train s |")
    ncol = 14
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
            f"{s['final_loss']:.4f} | {100 * s['packet_ratio']:.3f}% | {100 * s['wire_ratio']:.3f}% | "
            f"{s['bits_per_element']:.3f} | {s['encode_s']:.2f} | {s['comm_s']:.2f} | "
            f"{s['decode_s']:.2f} | {s['train_s']:.2f} |")
        if link is not None:
            t, e = s.get("time_to_target_s"), s.get("epochs_to_target")
            line += (f" {'-' if t is None else f'{t:.2f}'} | {'-' if e is None else f'{e:.1f}'} | "
                     f"{s.get('reached', 0)}/{s['runs']} | {s['wall_s']:.2f} |")
        lines.append(line)
    lines.append("")
    lines.append(f"W = {workers} gloo workers (CPU). Ratios are totals over all buckets and steps; "
                 f"wire_ratio is against a ring allreduce of the dense buckets (2(W-1)/W x dense bytes). "
                 f"Times are per run, summed over steps, seconds; comm s is launch-to-completion per "
                 f"bucket and overlaps the backward pass.")
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


def format_charlm_table(summary: List[dict], a: argparse.Namespace, corpus: dict, params: int,
                        notes: List[str]) -> str:
    """The charlm Markdown table: validation bits per character (mean +- sample std over seeds,
    min-max), the final training loss (bits per character, the last 10 steps' mean), the ratios
    and the times (seconds per run); a footer with the corpus, the model and the training setup."""
    head = ("| codec | scheme | EF | runs | val bits/char (mean ± std) | min–max | final train bits/char | "
            "packet_ratio | wire_ratio | bits/elem | encode s | comm s | decode s | train s |")
    sep = "|" + "---|" * 14
    lines = [head, sep]
    for s in summary:
        lines.append(
            f"| {s['codec']} | {s['scheme']} | {'on' if s['error_feedback'] else 'off'} | {s['runs']} | "
            f"{s['bpc_mean']:.4f} ± {s['bpc_std']:.4f} | {s['bpc_min']:.4f}–{s['bpc_max']:.4f} | "
            f"{s['final_loss']:.4f} | {100 * s['packet_ratio']:.3f}% | {100 * s['wire_ratio']:.3f}% | "
            f"{s['bits_per_element']:.3f} | {s['encode_s']:.2f} | {s['comm_s']:.2f} | "
            f"{s['decode_s']:.2f} | {s['train_s']:.2f} |")
    lines.append("")
    lines.append(
        f"W = {a.workers} gloo workers (CPU). Corpus: {corpus['train_files'] + corpus['val_files']} *.py files of "
        f"{corpus['stdlib']} ({corpus['bytes']} bytes, sha256 {corpus['sha256'][:16]}...), "
        f"{corpus['train_files']} for training ({corpus['train_chars']} characters), {corpus['val_files']} "
        f"held out ({corpus['val_chars']} characters); vocabulary {corpus['vocab_size']} classes (uniform: "
        f"{math.log2(corpus['vocab_size']):.3f} bits/char). Model: 2-layer LSTM, embed {a.embed}, hidden "
        f"{a.hidden}, {params} parameters. {a.steps} steps of {a.batch_size} windows x {a.seq_len} characters "
        f"per rank, {a.optimizer} (peak lr {a.lr:g}, cosine decay, clip {a.clip:g}); val bits/char over "
        f"{a.val_windows} windows ({a.val_windows * a.seq_len} characters). Ratios are totals over all buckets "
        f"and steps; wire_ratio is against a ring allreduce of the dense buckets. Times are per run, seconds.")
    for n in notes:
        lines.append("")
        lines.append(f"Note: {n}.")
    return "\n".join(lines)


def plot(summary: List[dict], path: str, workers: int) -> None:
    """PNG of the digits task: mean test accuracy (error bars: min..max over seeds) against bits
    per element, log x."""
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
        _annotate(ax, pts, "acc_mean", color, -10 if ef else 5, max)
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


def _annotate(ax, pts: List[dict], key: str, color: str, dy: int, pick: Callable) -> None:
    """One label per point; codecs with the same bits per element (fp16, bf16) share it, placed at
    ``pick`` (max or min) of their ``key`` values."""
    labels: Dict[float, List[str]] = {}
    for s in pts:
        labels.setdefault(round(s["bits_per_element"], 6), []).append(
            s["codec"].replace("topk:ratio=", "top-k ").replace("powersgd:rank=", "PowerSGD r"))
    for s in pts:
        k = round(s["bits_per_element"], 6)
        if k not in labels:
            continue
        same = [t for t in pts if round(t["bits_per_element"], 6) == k]
        ax.annotate("/".join(labels.pop(k)), (s["bits_per_element"], pick(t[key] for t in same)),
                    textcoords="offset points", xytext=(4, dy), fontsize=7, color=color)


def plot_charlm(summary: List[dict], path: str, workers: int) -> None:
    """PNG of the charlm task: mean validation bits per character (error bars: min..max over
    seeds; lower is better) against bits per element, log x; dense (codec none) as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for ef, marker, color in ((False, "o", "tab:red"), (True, "s", "tab:blue")):
        pts = sorted((s for s in summary if s["error_feedback"] == ef), key=lambda s: s["bits_per_element"])
        if not pts:
            continue
        x = [s["bits_per_element"] for s in pts]
        y = [s["bpc_mean"] for s in pts]
        yerr = [[s["bpc_mean"] - s["bpc_min"] for s in pts], [s["bpc_max"] - s["bpc_mean"] for s in pts]]
        ax.errorbar(x, y, yerr=yerr, fmt=marker, color=color, capsize=3, linestyle="none",
                    label="error feedback" if ef else "no error feedback")
        _annotate(ax, pts, "bpc_mean", color, 5 if ef else -10, min)
    dense = [s["bpc_mean"] for s in summary if s["codec"] == "none" and not s["error_feedback"]]
    if dense:
        ax.axhline(dense[0], color="gray", linestyle="--", linewidth=0.8, label="dense (codec none)")
    ax.set_xscale("log")
    ax.margins(x=0.1)
    ax.set_xlabel("bits per gradient element (8 x packet bytes / numel, log scale)")
    ax.set_ylabel("validation bits per character (mean; bars: min-max over seeds)")
    ax.set_title(f"char-level LSTM on the Python stdlib, {workers} DDP workers: bits/char vs compression")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _json_default(o):
    return None if isinstance(o, float) and math.isnan(o) else str(o)


def _run_sweep(pool, runs: List[dict], fn, unit_total: int, bars, describe: Callable[[dict], str]) -> List[list]:
    """Run each configuration on the pool; check that all ranks' final parameters agree bitwise
    (``param_checksum``); return the per-rank results of each run."""
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


def _write(paths: Dict[str, str], table: str, wall: float, columns: List[str], rows: List[dict], js: dict) -> None:
    with open(paths["table"], "w") as f:
        f.write(table + f"\n\nSweep wall time: {wall:.1f} s\n")
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    with open(paths["json"], "w") as f:
        json.dump(js, f, indent=1, default=_json_default)


def _describe_link(net, workers: int) -> str:
    """One line for the tables: the link setup the workers ran behind."""
    shaped = f"tc tbf at {net.rate}" if net.tbf is not None else "no rate limit"
    if net.kind == "loopback":
        return f"{workers} workers on one network namespace's loopback, {shaped} (shared by all ranks)"
    return (f"two network namespaces of {net.ranks_per_node} workers joined by a veth pair (MTU {net.mtu}), "
            f"{shaped} in each direction")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``gradcomp-experiment``; returns the exit status."""
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from tqdm import tqdm

    from ..torch.pool import GlooPool
    from . import runner

    link_ctx = contextlib.nullcontext(None)
    if a.link is not None:
        from . import links

        ok, why = links.available()
        if not ok:
            sys.stderr.write(f"gradcomp-experiment: --link {a.link}: {why}\n")
            return 2
        link_ctx = (links.shaped_loopback(a.link) if a.link_nodes == 1
                    else links.two_nodes(a.link, ranks_per_node=a.workers // 2))
    plans = {"digits": plan_runs(a.digits) if "digits" in a.tasks else [],
             "charlm": plan_charlm_runs(a.charlm) if "charlm" in a.tasks else []}
    corpus = None
    if "charlm" in a.tasks:
        corpus = charlm.build_corpus(None, a.charlm.corpus_bytes).describe()
    os.makedirs(a.out, exist_ok=True)
    total_runs = sum(len(plans[t]) for t in a.tasks)
    t_all = time.perf_counter()
    results: Dict[str, list] = {}
    walls: Dict[str, float] = {}
    link_desc = link_setup = None
    with link_ctx as net, \
            tqdm(total=total_runs, desc="runs", unit="run", disable=a.no_progress, position=0) as bar_runs, \
            tqdm(total=1, desc="progress", disable=a.no_progress, position=1, leave=False) as bar_in:
        bar_runs.set_postfix_str(f"starting {a.workers} workers")
        pool_kw = {}
        digits_job = runner.train_run
        if net is not None:
            pool_kw = {"netns": net.rank_netns(a.workers), "env": net.rank_env(a.workers)}
            digits_job = links.timed_train_run
            link_desc, link_setup = _describe_link(net, a.workers), net.describe()
        with GlooPool(a.workers, threads=1, **pool_kw) as pool:
            for task in a.tasks:
                t0 = time.perf_counter()
                if task == "digits":
                    bar_in.set_description("digits epochs")
                    results[task] = _run_sweep(
                        pool, plans[task], digits_job, a.digits.epochs, (bar_runs, bar_in),
                        lambda c: f"digits {_setting(c['codec'], c['error_feedback'])} seed {c['seed']}")
                else:
                    bar_in.set_description("charlm steps")
                    results[task] = _run_sweep(
                        pool, plans[task], charlm.train_run, a.charlm.steps, (bar_runs, bar_in),
                        lambda c: f"charlm {_setting(c['codec'], c['error_feedback'])} seed {c['seed']}")
                walls[task] = time.perf_counter() - t0
    wall_all = time.perf_counter() - t_all

    out = sys.stdout
    written = []
    for task in a.tasks:
        paths = {k: os.path.join(a.out, f) for k, f in OUTPUT_FILES[task].items()}
        if task == "digits":
            t = a.digits
            rows = []
            for cfg, res in zip(plans[task], results[task]):
                r0 = res[0]
                row = {k: r0[k] for k in CSV_COLUMNS if k in r0}
                row.update(codec=cfg["codec"], optimizer=cfg["optimizer"], error_feedback=cfg["error_feedback"],
                           seed=cfg["seed"], workers=a.workers, epochs=t.epochs, train_loss=r0["train_loss"])
                if "curve" in r0:
                    row["curve"] = r0["curve"]
                rows.append(row)
            summary = summarize(rows)
            columns, link = CSV_COLUMNS, None
            if link_desc is not None:
                link = link_target(rows, summary, link_desc)
                columns = CSV_COLUMNS + ["time_to_target_s", "epochs_to_target"]
            table = format_table(summary, a.workers, link)
            if a.notes and any(n.startswith("digits:") for n in a.notes):
                table += "".join(f"\n\nNote: {n}." for n in a.notes if n.startswith("digits:"))
            config = dict(vars(t), task=task, full=a.full, out=a.out)
            js = {"config": config, "wall_s": walls[task], "runs": rows, "summary": summary}
            if link is not None:
                js["link"] = dict(link, rate=a.link, nodes=a.link_nodes, setup=link_setup)
            _write(paths, table, walls[task], columns, rows, js)
            plot(summary, paths["plot"], a.workers)
        else:
            t = a.charlm
            rows = []
            for cfg, res in zip(plans[task], results[task]):
                r0 = res[0]
                row = {k: r0[k] for k in CHARLM_CSV_COLUMNS if k in r0}
                row.update(codec=cfg["codec"], error_feedback=cfg["error_feedback"], seed=cfg["seed"],
                           workers=a.workers, train_loss=r0["train_loss"])
                rows.append(row)
            summary = summarize(rows, metric="val_bpc", prefix="bpc")
            params = rows[0]["params"]
            notes = [n for n in a.notes if n.startswith("charlm:")]
            if link_desc is not None:
                notes.append(f"charlm: run behind {link_desc} (the time to a target is reported for digits only)")
            table = format_charlm_table(summary, t, corpus, params, notes)
            config = dict(vars(t), task=task, full=a.full, out=a.out, params=params)
            _write(paths, table, walls[task], CHARLM_CSV_COLUMNS, rows,
                   {"config": config, "corpus": corpus, "wall_s": walls[task], "runs": rows, "summary": summary})
            plot_charlm(summary, paths["plot"], a.workers)
        out.write(f"## {task}\n\n{table}\n\n{len(rows)} {task} runs in {walls[task]:.1f} s\n\n")
        written.append(paths)
    out.write(f"{total_runs} runs in {wall_all:.1f} s (with the workers' start)\n")
    for paths in written:
        for k in ("table", "csv", "json", "plot"):
            out.write(f"{k:6s}: {os.path.abspath(paths[k])}\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
