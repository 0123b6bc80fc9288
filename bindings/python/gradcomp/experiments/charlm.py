"""Worker side of the ``charlm`` task: a character-level language model on the Python standard
library's own source text, trained with DDP and a gradcomp hook; the metric is validation bits per
character.

Corpus (:func:`build_corpus`). The ``*.py`` files directly in the running interpreter's stdlib
directory (``sysconfig.get_paths()["stdlib"]``; subpackages are left out, since distributions split
some of them into other packages (tkinter, idlelib, lib2to3, test), and so are the
``_sysconfigdata_*.py`` files, which describe the build of the machine), sorted by name, taken as
whole files in that order while their total stays within ``max_bytes`` (default
``CORPUS_MAX_BYTES`` = 4 MiB; CPython 3.11.7 gives 154 files, 4,125,616 bytes, from
``__future__.py`` to ``tty.py``: 139 training files, 3,713,356 characters, and 15 validation
files, 412,414 characters). File ``i`` of that list (0-based) is a validation file when
``i % VAL_EVERY == VAL_EVERY - 1`` (every 10th), a training file otherwise: the split is by file,
so no line of a validation file is ever trained on. Each split is its files' bytes concatenated in
order, each file followed by one newline. The same Python version (the same stdlib files) gives
the same corpus on every machine; :attr:`Corpus.sha256` fingerprints it, and the results record it.

Vocabulary (``VOCAB_SIZE`` = 97 classes): the 95 printable ASCII bytes 0x20..0x7E are classes
0..94 (byte - 32), newline (0x0A) is class 95, every other byte (tab, carriage return, the bytes
of non-ASCII UTF-8 characters) is class 96, "other". One byte is one character.

Model (:class:`CharLSTM`): an embedding (97 x embed), a 2-layer ``torch.nn.LSTM`` (hidden units
per layer) and a linear head (hidden -> 97), float32. Its weight matrices are 2-D
(``weight_ih_l*`` [4 hidden, in], ``weight_hh_l*`` [4 hidden, hidden], the embedding and the head),
the biases 1-D. Default embed 48, hidden 192: 505,681 parameters.

Training (:func:`train_run`). Every step each rank takes ``batch_size`` windows of ``seq_len + 1``
characters at offsets drawn uniformly from the training text by a generator seeded with 2000 +
the run's seed (the same draws on every rank; rank r takes draws r*B .. r*B+B-1), predicts
characters 2..T+1 from 1..T (LSTM state zero at the start of each window) and steps on the mean
cross-entropy: Adam (betas (momentum, 0.999)) or SGD with momentum (``optimizer``), with a cosine
learning-rate decay over the run (from ``lr`` to 0); gradients are clipped to l2 norm ``clip``
after the DDP allreduce (the averaged gradient is the same on every rank, so is the clipping).
The model's parameters are initialized from ``torch.manual_seed(seed)``. The DDP model
(``bucket_cap_mb``) has the gradcomp hook of the run's codec
(:func:`gradcomp.experiments.runner.register_hook`) with ``start_iter`` dense steps first. Under
``engine="fsdp2"`` the same model, data, initialization and optimizer run sharded by FSDP2
(:mod:`gradcomp.experiments.fsdp2`: units embed, lstm, head, then the root) with gradcomp's
compressed reduce-scatter, or FSDP2's own for codec ``"dense"``.

Metric: validation bits per character, the mean cross-entropy in bits
(``nats / ln 2``) over ``val_windows`` fixed windows of ``seq_len + 1`` characters at evenly spaced
offsets of the validation text (``val_windows * seq_len`` predicted characters, each window from
a zero LSTM state), computed after training; the windows are dealt round-robin to the ranks and the
sums allreduced. A model that always predicts the uniform distribution scores log2(97) = 6.600.
"""

import dataclasses
import hashlib
import math
import os
import sysconfig
import time
from typing import Any, Dict, List, Optional

VOCAB_SIZE = 97
NEWLINE_CLASS = 95
OTHER_CLASS = 96
CORPUS_MAX_BYTES = 4 * 2 ** 20
VAL_EVERY = 10

# the task's default model and training settings (gradcomp-experiment's --charlm-* defaults): embed
# and hidden widths, LSTM layers, characters predicted per window, windows per rank per step,
# steps, optimizer, peak learning rate, Adam beta1 / SGD momentum, gradient-norm clip, DDP
# bucket_cap_mb, dense steps before compression, validation windows
DEFAULTS = {"embed": 48, "hidden": 192, "layers": 2, "seq_len": 64, "batch_size": 8, "steps": 150,
            "optimizer": "adam", "lr": 2e-2, "momentum": 0.9, "clip": 1.0, "bucket_cap_mb": 4.0,
            "start_iter": 0, "val_windows": 512}

_corpus_cache: Dict[Any, "Corpus"] = {}


def byte_table():
    """The byte -> class lookup table: a numpy uint8 array [256] (see the module docstring)."""
    import numpy as np

    t = np.full(256, OTHER_CLASS, dtype=np.uint8)
    t[32:127] = np.arange(95, dtype=np.uint8)
    t[10] = NEWLINE_CLASS
    return t


def encode_text(data: bytes):
    """Bytes -> classes: a numpy uint8 array [len(data)], values 0..96."""
    import numpy as np

    return byte_table()[np.frombuffer(data, dtype=np.uint8)]


def stdlib_dir() -> str:
    """The running interpreter's stdlib directory, ``sysconfig.get_paths()["stdlib"]``."""
    return sysconfig.get_paths()["stdlib"]


def corpus_files(stdlib: Optional[str] = None, max_bytes: int = CORPUS_MAX_BYTES) -> List[str]:
    """The corpus's file names (relative to ``stdlib``, default :func:`stdlib_dir`), in order: the
    sorted ``*.py`` regular files directly in that directory except ``_sysconfigdata*``, taken
    while their total size in bytes stays <= ``max_bytes`` (the first file that would pass it
    ends the list).

    Raises:
        ValueError: ``max_bytes`` < 1, or no file fits.
    """
    if max_bytes < 1:
        raise ValueError(f"corpus_files: max_bytes={max_bytes}; accepted: >= 1")
    d = stdlib if stdlib is not None else stdlib_dir()
    names = sorted(f for f in os.listdir(d) if f.endswith(".py") and not f.startswith("_sysconfigdata")
                   and os.path.isfile(os.path.join(d, f)))
    out, total = [], 0
    for f in names:
        size = os.path.getsize(os.path.join(d, f))
        if total + size > max_bytes:
            break
        out.append(f)
        total += size
    if not out:
        raise ValueError(f"corpus_files: no *.py file of {d!r} fits in max_bytes={max_bytes}")
    return out


@dataclasses.dataclass
class Corpus:
    """The charlm corpus: ``train`` and ``val`` are numpy uint8 arrays of classes (one per byte,
    values 0..96; files concatenated in order, each followed by a newline); ``train_files`` and
    ``val_files`` the file names of each split (disjoint, in corpus order); ``stdlib`` the directory
    read; ``sha256`` the hex SHA-256 of the raw bytes of all files in corpus order (names and
    contents: ``name NUL bytes NUL`` per file); ``bytes`` their total size."""

    stdlib: str
    train_files: List[str]
    val_files: List[str]
    train: Any
    val: Any
    sha256: str
    bytes: int

    def describe(self) -> dict:
        """A JSON-ready summary: stdlib, files per split, characters per split, bytes, sha256."""
        return {"stdlib": self.stdlib, "train_files": len(self.train_files), "val_files": len(self.val_files),
                "train_chars": int(self.train.shape[0]), "val_chars": int(self.val.shape[0]),
                "bytes": self.bytes, "sha256": self.sha256, "max_bytes": CORPUS_MAX_BYTES,
                "val_every": VAL_EVERY, "vocab_size": VOCAB_SIZE}


def build_corpus(stdlib: Optional[str] = None, max_bytes: int = CORPUS_MAX_BYTES) -> Corpus:
    """Read the corpus (module docstring) from ``stdlib`` (default :func:`stdlib_dir`); cached per
    process by (directory, max_bytes).

    Raises:
        ValueError: as :func:`corpus_files`; OSError: a file cannot be read.
    """
    import numpy as np

    d = stdlib if stdlib is not None else stdlib_dir()
    key = (os.path.abspath(d), max_bytes)
    if key in _corpus_cache:
        return _corpus_cache[key]
    files = corpus_files(d, max_bytes)
    h = hashlib.sha256()
    parts: Dict[bool, List[bytes]] = {True: [], False: []}
    names: Dict[bool, List[str]] = {True: [], False: []}
    total = 0
    for i, f in enumerate(files):
        with open(os.path.join(d, f), "rb") as fh:
            data = fh.read()
        h.update(f.encode() + b"\0" + data + b"\0")
        total += len(data)
        is_val = i % VAL_EVERY == VAL_EVERY - 1
        parts[is_val].append(data + b"\n")
        names[is_val].append(f)
    c = Corpus(stdlib=d, train_files=names[False], val_files=names[True],
               train=encode_text(b"".join(parts[False])), val=encode_text(b"".join(parts[True])),
               sha256=h.hexdigest(), bytes=total)
    if c.val.shape[0] == 0 or c.train.shape[0] == 0:
        raise ValueError(f"build_corpus: {len(files)} file(s) of {d!r}: need at least {VAL_EVERY} for a "
                         f"validation split (max_bytes={max_bytes})")
    assert c.train.dtype == np.uint8
    _corpus_cache[key] = c
    return c


def val_offsets(n_chars: int, seq_len: int, windows: int) -> List[int]:
    """Start offsets of the validation windows: ``windows`` evenly spaced offsets in
    ``[0, n_chars - seq_len - 1]`` (``floor(j * (n_chars - seq_len - 1) / (windows - 1))``), so
    each window of ``seq_len + 1`` characters lies inside the text.

    Raises:
        ValueError: the text is shorter than one window, or ``windows`` < 1.
    """
    span = n_chars - seq_len - 1
    if span < 0 or windows < 1:
        raise ValueError(f"val_offsets: {n_chars} characters, seq_len={seq_len}, windows={windows}: "
                         f"need n_chars >= seq_len + 1 and windows >= 1")
    if windows == 1:
        return [0]
    return [j * span // (windows - 1) for j in range(windows)]


def make_model(embed: int, hidden: int, layers: int = 2):
    """A :class:`CharLSTM` (float32, default torch initialization of the current RNG state)."""
    import torch.nn as nn

    class CharLSTM(nn.Module):
        """Embedding [97, embed] -> LSTM(embed, hidden, layers, batch_first) -> Linear(hidden, 97).
        ``forward(x)``: x int64 [B, T] classes -> logits float32 [B, T, 97]."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB_SIZE, embed)
            self.lstm = nn.LSTM(embed, hidden, layers, batch_first=True)
            self.head = nn.Linear(hidden, VOCAB_SIZE)

        def forward(self, x):
            return self.head(self.lstm(self.embed(x))[0])

    return CharLSTM()


def evaluate(model, val, seq_len: int, windows: int, rank: int, world: int) -> float:
    """Validation bits per character of ``model`` (a :class:`CharLSTM` or the module under DDP,
    called without DDP: no collective per batch) over the ``windows`` windows of
    :func:`val_offsets` of ``val`` (int64-able tensor [n] of classes), this rank taking every
    W-th window, the sums all-reduced (a collective: every rank calls it). Leaves the model in
    eval mode; changes no parameter or RNG."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    ar = torch.arange(seq_len + 1)
    offs = val_offsets(val.shape[0], seq_len, windows)[rank::world]
    ev = torch.zeros(2, dtype=torch.float64)  # [sum of nats, predicted characters]
    model.eval()
    with torch.no_grad():
        for i in range(0, len(offs), 64):
            w = val[torch.tensor(offs[i:i + 64])[:, None] + ar].long()
            lg = model(w[:, :-1])
            ev[0] += float(F.cross_entropy(lg.reshape(-1, VOCAB_SIZE), w[:, 1:].reshape(-1), reduction="sum"))
            ev[1] += w.shape[0] * seq_len
    dist.all_reduce(ev)
    return float(ev[0] / ev[1]) / math.log(2.0)


METHOD_OPTIMIZERS = ("dgc", "compressed_adam")
"""The ``optimizer`` values whose optimizer exchanges in ``step()`` (gradcomp.optim.DGC with SGD
momentum, gradcomp.optim.CompressedAdam): the model's DDP hook is
:func:`gradcomp.optim.register_comm_hook` instead of a codec hook, and ``codec`` is the method's."""


def method_optimizer(cfg: dict, ddp, world: int):
    """The optimizer of a :data:`METHOD_OPTIMIZERS` run, its DDP hook registered.

    - ``dgc``: :class:`gradcomp.optim.DGC` with ``momentum``, the density of the codec
      ``topk:ratio=d`` (``cfg["codec"]``), ``cfg["dgc_warmup"]`` (``[(step, density)]``), Nesterov
      when ``cfg["nesterov"]`` and local clipping at ``clip`` (the run's clip threshold, or
      ``cfg["dgc_clip"]`` when given; 0: none; applied as DGC prescribes: clip / sqrt(W) per rank);
    - ``compressed_adam``: :class:`gradcomp.optim.CompressedAdam` with the codec, betas
      (``momentum``, 0.999), ``freeze_step`` = ``cfg["freeze_step"]`` and error feedback
      ``cfg["error_feedback"]``; the loop's clipping at ``clip`` then acts on the averaged
      gradient during the dense warm-up and on each rank's local gradient after it (the hook
      leaves the local gradient in place then).

    Raises:
        ValueError: dgc with a codec other than ``topk:ratio=D``; the optimizers' own errors.
    """
    import gradcomp.optim as go

    kind = cfg["optimizer"]
    if kind == "dgc":
        spec = cfg["codec"]
        if not spec.startswith("topk:ratio="):
            raise ValueError(f"charlm: optimizer dgc with codec {spec!r}; accepted: topk:ratio=D (D: the density)")
        warm = [tuple(e) for e in cfg.get("dgc_warmup") or []]
        clip = cfg.get("dgc_clip", cfg["clip"])
        opt = go.DGC(ddp.parameters(), lr=cfg["lr"], momentum=cfg["momentum"], density=float(spec.split("=", 1)[1]),
                     warmup=warm or None, clip=clip if clip and clip > 0 else None,
                     nesterov=bool(cfg.get("nesterov", False)))
    else:
        opt = go.CompressedAdam(ddp.parameters(), lr=cfg["lr"], codec=cfg["codec"], betas=(cfg["momentum"], 0.999),
                                freeze_step=int(cfg["freeze_step"]), error_feedback=cfg["error_feedback"],
                                scheme=cfg.get("scheme", "auto"))
    go.register_comm_hook(ddp, opt)
    return opt


def train_run(rank: int, world: int, cfg: dict) -> dict:
    """One charlm training run on this rank (a :class:`gradcomp.experiments.pool.GlooPool` job).

    ``cfg`` keys: codec (spec), error_feedback (bool), seed (int), steps, optimizer ("adam",
    "sgd", or under DDP one of :data:`METHOD_OPTIMIZERS`: "dgc", "compressed_adam", whose
    optimizer exchanges through its own DDP hook, :func:`method_optimizer`), lr (peak), momentum
    (Adam's beta1 or SGD's momentum), clip (gradient l2 norm; 0: none; dgc: DGC's local clipping),
    batch_size (windows per rank per step), seq_len (characters predicted per window), embed,
    hidden, bucket_cap_mb, start_iter, val_windows, corpus_max_bytes; optional stdlib (directory
    of the corpus, default the interpreter's), progress_every (steps between progress reports,
    default 10), nesterov (sgd, dgc), dgc_warmup, freeze_step (:func:`method_optimizer`),
    curve_every (DDP only: evaluate every that many steps and at the end, the result's
    ``curve``) and engine: "ddp" (default) or "fsdp2" (the model sharded by FSDP2 instead of
    wrapped in DDP, gradcomp's compressed reduce-scatter or, for codec "dense", FSDP2's own:
    :mod:`gradcomp.experiments.fsdp2`; bucket_cap_mb unused, start_iter must be 0); stats_log (a
    path: the gradcomp hook's step reports, :func:`gradcomp.experiments.runner.register_hook`).

    Returns (every rank) a dict: val_bpc (validation bits per character), final_loss and
    train_loss (mean training cross-entropy in bits per character over all ranks, per progress
    interval; final_loss: the last interval), the hook's byte/time totals (as the digits task's
    :func:`gradcomp.experiments.runner.train_run`), train_s (the training loop: forward,
    backward with the hook, clipping, step), eval_s, wall_s, params (parameter count) and
    param_checksum (sum of the final float32 parameters' bit patterns as int32, for the parent's
    check that all ranks agree bitwise); under FSDP2 also exempt_numel (elements sent raw), and the
    byte accounting is the reduce-scatters' (:func:`gradcomp.experiments.fsdp2.run_stats`); with
    curve_every, ``curve`` = ``[{"step", "wall_s", "val_bpc"}]`` (wall_s: seconds of the training
    loop from its first step to that step's end, the curve's evaluations left out; evaluating
    changes no parameter or RNG, so the run is bitwise the one without a curve)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from .pool import report
    from .runner import register_hook

    t_start = time.perf_counter()
    engine = cfg.get("engine", "ddp")
    curve_every = int(cfg.get("curve_every", 0))
    if curve_every and engine != "ddp":
        raise ValueError(f"charlm: curve_every={curve_every} under engine {engine!r}; accepted: ddp (the curve "
                         f"evaluates the whole model mid-run)")
    corpus = build_corpus(cfg.get("stdlib"), cfg["corpus_max_bytes"])
    train = torch.from_numpy(corpus.train)
    val = torch.from_numpy(corpus.val)
    T, B = cfg["seq_len"], cfg["batch_size"]
    torch.manual_seed(cfg["seed"])
    model = make_model(cfg["embed"], cfg["hidden"])
    n_params = sum(p.numel() for p in model.parameters())
    if engine == "fsdp2":
        from . import fsdp2

        if cfg["start_iter"]:
            raise ValueError(f"charlm: start_iter={cfg['start_iter']} under FSDP2; accepted: 0 (gradcomp.torch.fsdp "
                             f"has no dense warm-up)")
        numels = {n: p.numel() for n, p in model.named_parameters()}
        units = fsdp2.shard(model, world)
        state = fsdp2.register(model, cfg["codec"], cfg["error_feedback"])
        ddp = model  # the FSDPModule: forward, parameters (DTensors)
    elif engine == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_cap_mb"])
        state = (None if cfg["optimizer"] in METHOD_OPTIMIZERS else
                 register_hook(ddp, cfg["codec"], cfg["error_feedback"], cfg["start_iter"],
                               stats_log=cfg.get("stats_log")))
    else:
        raise ValueError(f"charlm: engine={engine!r}; accepted: ddp, fsdp2")
    clip_in_loop = cfg["clip"] > 0
    if cfg["optimizer"] == "adam":
        opt = torch.optim.Adam(ddp.parameters(), lr=cfg["lr"], betas=(cfg["momentum"], 0.999))
    elif cfg["optimizer"] == "sgd":
        opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                              nesterov=bool(cfg.get("nesterov", False)))
    elif cfg["optimizer"] in METHOD_OPTIMIZERS and engine == "ddp":
        opt = method_optimizer(cfg, ddp, world)
        clip_in_loop = clip_in_loop and cfg["optimizer"] != "dgc"  # DGC clips each rank's gradient itself
    else:
        raise ValueError(f"charlm: optimizer={cfg['optimizer']!r} (engine {engine}); accepted: adam, sgd, and "
                         f"under ddp {', '.join(METHOD_OPTIMIZERS)}")
    gen = torch.Generator().manual_seed(2000 + cfg["seed"])
    span = train.shape[0] - T - 1
    ar = torch.arange(T + 1)
    every = max(1, int(cfg.get("progress_every", 10)))
    steps = cfg["steps"]
    losses: List[float] = []
    loss_sum = torch.zeros(2, dtype=torch.float64)
    compute_s = 0.0
    ln2 = math.log(2.0)
    curve: List[dict] = []
    curve_eval_s = 0.0
    t_loop = time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = cfg["lr"] * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, span + 1, (world * B,), generator=gen)[rank * B:(rank + 1) * B]
        win = train[starts[:, None] + ar].long()  # [B, T + 1]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        logits = ddp(win[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), win[:, 1:].reshape(-1))
        loss.backward()
        if clip_in_loop:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        compute_s += time.perf_counter() - t0
        loss_sum[0] += float(loss.detach())
        loss_sum[1] += 1
        if (step + 1) % every == 0 or step + 1 == steps:
            dist.all_reduce(loss_sum)
            losses.append(float(loss_sum[0] / loss_sum[1]) / ln2)
            loss_sum.zero_()
            if rank == 0:
                report({"step": step + 1, "loss": losses[-1]})
        if curve_every and ((step + 1) % curve_every == 0 or step + 1 == steps):
            t1 = time.perf_counter()  # the curve's clock: training only (its evaluations left out)
            curve.append({"step": step + 1, "wall_s": t1 - t_loop - curve_eval_s,
                          "val_bpc": evaluate(model, val, T, cfg["val_windows"], rank, world)})
            model.train()
            curve_eval_s += time.perf_counter() - t1
    t_eval = time.perf_counter()
    extra = {}
    if engine == "fsdp2":  # evaluate a plain copy with the full parameters (no collective per batch)
        st = fsdp2.run_stats(state, units, world, steps)
        extra["exempt_numel"] = fsdp2.exempt_numel(state, numels)
        model = fsdp2.gathered(model, lambda: make_model(cfg["embed"], cfg["hidden"]))
    val_bpc = evaluate(model, val, T, cfg["val_windows"], rank, world)
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        checksum = int(flat.view(torch.int32).to(torch.int64).sum())
    eval_s = time.perf_counter() - t_eval + curve_eval_s
    from .runner import hook_totals, optimizer_stats

    return {
        "val_bpc": val_bpc,
        "train_loss": losses,
        "final_loss": losses[-1] if losses else float("nan"),
        **hook_totals(st if engine == "fsdp2" else state.stats() if state is not None else
                      optimizer_stats(cfg["optimizer"], opt, model, world, steps)),
        **extra,
        "train_s": compute_s,
        "eval_s": eval_s,
        "wall_s": time.perf_counter() - t_start,
        "params": n_params,
        "param_checksum": checksum,
        **({"curve": curve} if curve_every else {}),
    }
