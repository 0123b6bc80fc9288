"""Command line of ``gradcomp-experiment`` (:mod:`gradcomp.experiments.__main__`, whose docstring
describes the command): the flags, each task's default sweep (codec lists, error feedback, seeds)
and :func:`parse_args`, which resolves them into one namespace of settings per task.

Codec specs are checked here: a :class:`gradcomp.Codec` spec by building the codec, a
``powersgd:rank=R`` spec (the low-rank hook, not a codec) by :func:`check_powersgd_spec`, ``dense``
(FSDP2's own reduce-scatter) and powersgd against ``--engine`` (:data:`ENGINES`: ``dense`` is
``fsdp2`` only, PowerSGD ``ddp`` only); bad input is an argparse error (exit status 2).
"""

import argparse
from typing import List, Optional

from ..codec import Codec
from . import charlm
from .fsdp2 import DENSE
from .runner import family_of, split_scheme

TASKS = ("digits", "charlm")
ENGINES = ("ddp", "fsdp2")

# the defaults fit the main job's 5 minutes: top-k at 0.1 (digits) and PowerSGD rank 2 (charlm) are
# --full only since the charlm method rows came (each reads as its neighbours: top-k 0.1 = dense on
# digits, PowerSGD rank 2 between top-k 1% and rank 4)
DEFAULT_CODECS = ["none", "fp16", "bf16", "topk:ratio=0.01", "topk:ratio=0.001", "fp8", "int8", "int4", "onebit"]
# random-k 1%, QSGD s=16 (dense and Elias-coded), TernGrad and signSGD's majority vote (onebit@majority)
# are --full only: with error feedback on and off over 2 seeds they would add about two minutes to the
# default's 4 (each digits run is 6-7 s on 2 cores)
DIGITS_FULL_CODECS = ["none", "fp16", "bf16", "topk:ratio=0.1", "topk:ratio=0.01", "topk:ratio=0.001",
                      "randomk:ratio=0.01", "fp8", "fp8:format=e5m2", "fp8:scale=e8m0", "int8", "int4",
                      "qsgd:levels=16", "qsgd:levels=16,coding=elias", "terngrad", "onebit", "onebit@majority"]

CHARLM_CODECS = ["none", "fp16", "topk:ratio=0.01", "powersgd:rank=4"]
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
DEFAULT_OPTIMIZERS = "adam;onebit_adam"  # the digits optimizer rows (--engine ddp only)
CL = charlm.DEFAULTS  # the charlm task's defaults (one home: gradcomp.experiments.charlm)
CHARLM_LR = {"adam": CL["lr"], "sgd": 4.0}  # default peak learning rate per --charlm-optimizer

# the charlm method rows (--charlm-methods), beside the codec sweep: OPTIMIZER@CODEC. sgd@none is
# dense SGD with momentum (lr 4.0, tuned once for dense SGD: peak lr 1, 2, 4, 8 gave 3.327, 3.036,
# 2.816, 3.037 val bits/char at 150 steps), the baseline of the DGC rows; the CompressedAdam rows
# read against the codec sweep's dense Adam row
CHARLM_METHODS = ["sgd@none", "dgc@topk:ratio=0.01", "dgc@topk:ratio=0.001", "compressed_adam@topk:ratio=0.01",
                  "compressed_adam@topk:ratio=0.001"]
# what each method optimizer is: its label in the tables, and the optimizer whose dense run
# (codec none) it is read against
CHARLM_METHOD_OPTIMIZERS = {"sgd": ("SGD", "sgd"), "dgc": ("DGC (SGD)", "sgd"),
                            "compressed_adam": ("CompressedAdam", "adam")}

# codec families that run over --quant-seeds (the others over --seeds): the casts and the block
# quantizers. Each is the name of a registered codec (gradcomp.codecs(); test_experiment.py checks
# it, and every spec of the default lists above against the registry)
QUANT_SEED_FAMILIES = ("fp16", "bf16", "fp8", "int8", "int4")

# the optimizer rows: label in the codec column, and whether the run has error feedback
OPTIMIZERS = {"adam": ("Adam", False), "onebit_adam": ("1-bit Adam", True)}


def family(codec: str) -> str:
    """The family of a codec spec: its name before ``:`` (``"topk"`` of ``"topk:ratio=0.01"``,
    ``"powersgd"`` of ``"powersgd:rank=2"``, ``"onebit"`` of ``"onebit@majority"``)."""
    return family_of(codec)


def _fsdp2_list(ddp_list: List[str], add: List[str]) -> List[str]:
    return [DENSE] + [c for c in ddp_list if family(c) != "powersgd"] + [c for c in add if c not in ddp_list]


# --engine fsdp2's codec lists, per task (default, --full): FSDP2's own reduce-scatter first (the
# dense row, DENSE), then the DDP list without PowerSGD (a DDP hook: no FSDP2 path), and for charlm
# the block quantizers fp8 and int8 (the default; --full has int8 already)
FSDP2_CODECS = {
    "digits": (_fsdp2_list(DEFAULT_CODECS, []), _fsdp2_list(DIGITS_FULL_CODECS, [])),
    "charlm": (_fsdp2_list(CHARLM_CODECS, ["fp8", "int8"]), _fsdp2_list(CHARLM_FULL_CODECS, ["fp8"])),
}


def fsdp2_accepted() -> str:
    """The codecs ``--engine fsdp2`` accepts, for its error messages: dense and the registered
    codecs' names."""
    from ..codec import codecs

    return f"{DENSE} (FSDP2's own reduce-scatter) and the specs of the codecs " + ", ".join(
        c["name"] for c in codecs())


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
    """Whether the ``powersgd`` protocol is in gradcomp.torch's protocol table
    (:mod:`gradcomp.torch.protocol`; False when gradcomp.torch cannot be imported)."""
    try:
        import gradcomp.torch  # noqa: F401  (importing it fills the table)
        from gradcomp.torch import protocol
    except ImportError:
        return False
    return "powersgd" in protocol.names()


def parse_method(spec: str, engine: str = "ddp"):
    """One ``--charlm-methods`` entry ``OPTIMIZER@CODEC``: returns ``(optimizer, codec)``.
    ``sgd@none`` (dense SGD, the DGC rows' baseline), ``dgc@topk:ratio=D`` (gradcomp.optim.DGC at
    density D), ``compressed_adam@SPEC`` (gradcomp.optim.CompressedAdam with any codec spec).

    Raises:
        ValueError: no ``@``, an unknown optimizer, a codec the optimizer does not take (the
            message names it and what is accepted), or an ``engine`` other than ddp (both
            optimizers exchange through a DDP hook).
    """
    opt, at, codec = spec.partition("@")
    opt, codec = opt.strip(), codec.strip()
    if not at or not codec:
        raise ValueError(f"--charlm-methods: {spec!r}; accepted: OPTIMIZER@CODEC, e.g. 'dgc@topk:ratio=0.01'")
    if opt not in CHARLM_METHOD_OPTIMIZERS:
        raise ValueError(f"--charlm-methods: {spec!r}: optimizer {opt!r}; accepted: "
                         f"{', '.join(CHARLM_METHOD_OPTIMIZERS)}")
    if engine != "ddp":
        raise ValueError(f"--charlm-methods: {spec!r} needs --engine ddp (DGC and CompressedAdam exchange through "
                         f"their DDP hook); accepted under --engine {engine}: ''")
    if opt == "sgd" and codec != "none":
        raise ValueError(f"--charlm-methods: {spec!r}: sgd rows are dense; accepted: sgd@none (SGD with a codec: "
                         f"--charlm-optimizer sgd --codecs ...)")
    if opt == "dgc":
        d = codec[len("topk:ratio="):] if codec.startswith("topk:ratio=") else ""
        try:
            ok = 0.0 < float(d) <= 1.0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"--charlm-methods: {spec!r}: DGC sparsifies with its own top-k; accepted: "
                             f"dgc@topk:ratio=D with 0 < D <= 1")
    if opt == "compressed_adam":
        Codec(codec)  # ValueError naming the spec
    return opt, codec


def parse_dgc_warmup(s: str):
    """``--charlm-dgc-warmup``: ``STEP:DENSITY,...`` (steps ascending from 0, densities in (0, 1])
    -> ``[(step, density)]``; '' -> [] (no warm-up).

    Raises:
        ValueError: an entry that is not STEP:DENSITY."""
    out = []
    for item in (x.strip() for x in s.split(",")):
        if not item:
            continue
        st, colon, d = item.partition(":")
        try:
            out.append((int(st), float(d)))
        except ValueError:
            raise ValueError(f"--charlm-dgc-warmup: {item!r}; accepted: STEP:DENSITY entries separated by ',', "
                             f"e.g. '0:0.25,5:0.0625'") from None
        if not colon:
            raise ValueError(f"--charlm-dgc-warmup: {item!r}; accepted: STEP:DENSITY")
    return out


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
    """Parse the command line. Returns the namespace with ``tasks`` (list), ``engine`` ("ddp" or
    "fsdp2"), ``digits`` and ``charlm`` (each a namespace of that task's resolved settings:
    ``engine``, ``codec_list``, ``ef``, ``seeds``, ``quant_seeds`` and its training flags; both
    always present) and ``notes`` (strings for the tables: rows left out of a default list)."""
    p = argparse.ArgumentParser(
        prog="gradcomp-experiment",
        description="Model quality versus compression ratio with real DDP processes (gloo, CPU): test accuracy "
                    "of an MLP on scikit-learn digits, validation bits per character of a character-level "
                    "LSTM on the Python standard library's source.",
        epilog="Default: both tasks, a sweep that fits in 5 minutes on 2 cores; --full: the whole sweeps "
               "(digits 63 runs, charlm 60).")
    p.add_argument("--task", default="all",
                   help="tasks to run, comma-separated: digits, charlm, or all (= digits,charlm; default)")
    p.add_argument("--full", action="store_true",
                   help="the whole sweeps: digits 15 codecs (with the fp8 variants e5m2 and e8m0, random-k 1%%, "
                        "QSGD s=16 and TernGrad), 3 seeds and 2 per optimizer row (63 runs); charlm 13 codecs (PowerSGD at ranks 1, 2, 4, 8), error "
                        "feedback on and off, 2 seeds (50 runs), and the method rows over 2 seeds (10 runs)")
    p.add_argument("--workers", type=int, default=4, help="DDP processes (default 4)")
    p.add_argument("--engine", choices=ENGINES, default="ddp",
                   help="ddp (default): DDP with a gradcomp communication hook; fsdp2: the same models, data and "
                        "settings sharded by FSDP2 (fully_shard on a CPU mesh of the W gloo ranks) with gradcomp's "
                        "compressed reduce-scatter, the dense row 'dense' being FSDP2's own; its codec lists: "
                        "digits dense;" + ";".join(FSDP2_CODECS["digits"][0][1:]) + ", charlm "
                        + ";".join(FSDP2_CODECS["charlm"][0]) + " (--full: the --full lists without PowerSGD, "
                        "plus dense and fp8). PowerSGD (a DDP hook), the digits optimizer rows, --link with digits, "
                        "--charlm-start-iter > 0 and --workers 1 are --engine ddp only; outputs get an fsdp2 prefix")
    g = p.add_argument_group("sweep (every selected task; default: each task's own)")
    g.add_argument("--codecs", default=None,
                   help="codec specs separated by ';' (a spec itself may hold commas, e.g. "
                        "'topk:k=50,value_dtype=float16'; 'powersgd:rank=R' for the low-rank hook; DDP: SPEC@SCHEME "
                        "runs the hook with that scheme instead of auto, e.g. 'onebit@majority'). digits: "
                        + ";".join(DEFAULT_CODECS) + " (--full: also "
                        + ";".join(c for c in DIGITS_FULL_CODECS if c not in DEFAULT_CODECS) + "). "
                        "charlm: "
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
    d.add_argument("--optimizers", default=None,
                   help="optimizer rows separated by ';', beside the SGD codec sweep: adam (torch.optim.Adam, "
                        "plain DDP) and onebit_adam (gradcomp.optim.OnebitAdam with its DDP hook: dense "
                        "warm-up, then 1-bit compressed momentum); '' for none (default: " + DEFAULT_OPTIMIZERS
                        + "; --engine fsdp2: none)")
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
    c.add_argument("--charlm-methods", default=None,
                   help="method rows beside the codec sweep, OPTIMIZER@CODEC separated by ';': sgd@none (dense "
                        "SGD with momentum, the DGC rows' baseline), dgc@topk:ratio=D (gradcomp.optim.DGC), "
                        "compressed_adam@SPEC (gradcomp.optim.CompressedAdam with any codec); '' for none. "
                        "Default: " + ";".join(CHARLM_METHODS) + " (--engine fsdp2: none)")
    c.add_argument("--charlm-sgd-lr", type=float, default=CHARLM_LR["sgd"],
                   help="peak learning rate of the sgd and dgc rows (default 4.0, tuned once for dense SGD)")
    c.add_argument("--charlm-adam-lr", type=float, default=CHARLM_LR["adam"],
                   help="peak learning rate of the compressed_adam rows (default 2e-2, the Adam default)")
    c.add_argument("--charlm-freeze-fraction", type=float, default=0.2,
                   help="CompressedAdam's dense warm-up (freeze_step) as a fraction of --charlm-steps, "
                        "rounded, at least 1 step (default 0.2: DeepSpeed's 1-bit Adam tutorial advises "
                        "15-25%% of the steps)")
    c.add_argument("--charlm-dgc-warmup", default="",
                   help="DGC's density warm-up, STEP:DENSITY entries separated by ',' (e.g. the paper's x1/4 "
                        "per stage '0:0.25,5:0.0625,10:0.015625'); default '' (none: the measured gain did not "
                        "pay for its bytes here)")
    lk = p.add_argument_group("slow links (root; see the module docstring)")
    lk.add_argument("--link", default=None, metavar="RATE",
                    help="run the workers behind a tc-rate-limited link at RATE (e.g. 100mbit, 1gbit, 10gbit, "
                         "unlimited); the digits table adds the wall-clock time to 98%% of the dense run's accuracy, the "
                         "charlm table (--engine ddp) the time to 1.02 x the dense run's val bits/char")
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
    if not a.charlm_sgd_lr > 0 or not a.charlm_adam_lr > 0:
        p.error(f"--charlm-sgd-lr={a.charlm_sgd_lr}, --charlm-adam-lr={a.charlm_adam_lr}; accepted: > 0")
    if not 0.0 < a.charlm_freeze_fraction < 1.0:
        p.error(f"--charlm-freeze-fraction={a.charlm_freeze_fraction}; accepted: (0, 1)")
    try:
        dgc_warmup = parse_dgc_warmup(a.charlm_dgc_warmup)
        method_list = [parse_method(m, a.engine) for m in _split_list(
            a.charlm_methods if a.charlm_methods is not None else "" if a.engine == "fsdp2"
            else ";".join(CHARLM_METHODS))]
    except ValueError as e:
        p.error(str(e))
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
    fsdp2 = a.engine == "fsdp2"
    if fsdp2:
        if a.workers < 2:
            p.error(f"--engine fsdp2 needs --workers >= 2 (at world size 1 FSDP2 has no reduce-scatter); "
                    f"got {a.workers}")
        if a.charlm_start_iter and "charlm" in a.tasks:
            p.error(f"--charlm-start-iter={a.charlm_start_iter} needs --engine ddp (gradcomp.torch.fsdp has no "
                    f"dense warm-up); accepted under --engine fsdp2: 0")
        if a.link is not None and "digits" in a.tasks:
            p.error("--link with --engine fsdp2: charlm only (the digits time to target evaluates rank 0's model "
                    "mid-run, which FSDP2 holds sharded); use --task charlm or --engine ddp")
        if a.optimizers is not None and _split_list(a.optimizers) and "digits" in a.tasks:
            p.error(f"--optimizers {a.optimizers!r} needs --engine ddp (torch Adam under plain DDP, 1-bit Adam's "
                    f"DDP hook); accepted under --engine fsdp2: '' (the digits codec sweep runs with SGD)")
    optimizer_list = _split_list(a.optimizers if a.optimizers is not None else "" if fsdp2 else DEFAULT_OPTIMIZERS)
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
            if fsdp2 and family(spec) == "powersgd":
                p.error(f"--codecs: {spec!r}: PowerSGD has no FSDP2 path (it is a DDP communication hook; "
                        f"gradcomp.torch.fsdp compresses the reduce-scatter with a codec): run it with --engine ddp. "
                        f"Accepted under --engine fsdp2: {fsdp2_accepted()}")
            if family(spec) == DENSE:
                if spec != DENSE:
                    p.error(f"--codecs: {spec!r}; {DENSE!r} takes no options")
                if not fsdp2:
                    p.error(f"--codecs: {DENSE!r} is FSDP2's own reduce-scatter without gradcomp (--engine fsdp2 "
                            f"only); under --engine ddp codec none is the dense row")
                continue
            try:
                if family(spec) == "powersgd":
                    check_powersgd_spec(spec)
                else:
                    only, scheme = split_scheme(spec)
                    if scheme != "auto" and fsdp2:
                        raise ValueError(f"{spec!r}: SPEC@SCHEME is for --engine ddp (FSDP2 runs its "
                                         f"reduce-scatter)")
                    Codec(only)
            except ValueError as e:
                p.error(f"--codecs: {e}")
        if any(family(s) == "powersgd" for s in explicit) and not powersgd_available():
            p.error("--codecs: powersgd needs gradcomp.torch's PowerSGD hook (gradcomp.torch.powersgd), "
                    "which cannot be imported here")
    psgd_ok = None
    for task in TASKS:
        dflt = SWEEP_DEFAULTS[task]
        t = argparse.Namespace(task=task, workers=a.workers)
        t.engine = a.engine
        if explicit is not None:
            t.codec_list = list(explicit)
        elif fsdp2:
            t.codec_list = list(FSDP2_CODECS[task][full])
            left = [s for s in dflt["codecs"][full] if family(s) == "powersgd"]
            if left and task in a.tasks:
                a.notes.append(f"{task}: left out {', '.join(left)} of the --engine ddp sweep: PowerSGD is a DDP "
                               f"communication hook with no FSDP2 path")
        else:
            t.codec_list = list(dflt["codecs"][full])
            if any(family(s) == "powersgd" for s in t.codec_list):
                psgd_ok = powersgd_available() if psgd_ok is None else psgd_ok
                if not psgd_ok:
                    left = [s for s in t.codec_list if family(s) == "powersgd"]
                    t.codec_list = [s for s in t.codec_list if family(s) != "powersgd"]
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
    if fsdp2 and a.optimizers is None and "digits" in a.tasks:
        a.notes.append(f"digits: left out the optimizer rows ({DEFAULT_OPTIMIZERS.replace(';', ', ')}): they run "
                       f"under --engine ddp only (torch Adam under plain DDP, 1-bit Adam's DDP hook)")
    dg.optimizer_seeds = a.optimizer_seeds if a.optimizer_seeds is not None else DIGITS_OPTIMIZER_SEEDS[full]
    cl = a.charlm
    for k in ("steps", "optimizer", "momentum", "clip", "batch_size", "seq_len", "embed", "hidden", "bucket_cap_mb",
              "start_iter", "val_windows"):
        setattr(cl, k, getattr(a, "charlm_" + k))
    cl.lr = a.charlm_lr if a.charlm_lr is not None else CHARLM_LR[a.charlm_optimizer]
    cl.corpus_bytes = a.charlm_corpus_bytes if a.charlm_corpus_bytes is not None else charlm.CORPUS_MAX_BYTES
    cl.method_list = method_list
    cl.sgd_lr, cl.adam_lr, cl.dgc_warmup = a.charlm_sgd_lr, a.charlm_adam_lr, dgc_warmup
    cl.freeze_step = max(1, round(a.charlm_freeze_fraction * a.charlm_steps))
    # under --link (DDP): validate every curve_every steps for the time to 1.02 x dense bits/char
    cl.curve_every = max(1, a.charlm_steps // 15) if a.link is not None and not fsdp2 else 0
    if fsdp2 and a.charlm_methods is None and explicit is None and "charlm" in a.tasks:
        a.notes.append("charlm: left out the method rows (" + ", ".join(CHARLM_METHODS) + "): DGC and "
                       "CompressedAdam exchange through their DDP hook (--engine ddp only)")
    if "digits" in a.tasks and not dg.codec_list and not dg.optimizer_list:
        p.error("digits: --codecs and --optimizers are empty")
    if "charlm" in a.tasks and not cl.codec_list and not cl.method_list:
        p.error("charlm: --codecs and --charlm-methods are empty")
    return a
