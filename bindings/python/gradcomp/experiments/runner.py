"""Worker side of the accuracy-versus-ratio experiment: data, model, one DDP training run.

Data: scikit-learn's digits (``sklearn.datasets.load_digits``: 1797 8x8 images, 64 features with
values 0..16, 10 classes; ships inside scikit-learn, no download). A fixed stratified split holds
out ``TEST_SIZE`` = 400 samples (one sample = 0.25 percentage points); features are standardized
with the training mean and std. Each epoch the training set is permuted with the run's seed (the
same permutation on every rank) and dealt round-robin to the W ranks (DistributedSampler style,
the tail dropped so every rank takes the same number of steps).

Model: an MLP 64 -> hidden -> hidden -> 10 with ReLU, float32, trained with SGD + momentum on the
cross-entropy, wrapped in DDP with a small ``bucket_cap_mb`` and the gradcomp hook
(:func:`register_hook`) with ``min_compress_numel=0`` and ``start_iter=0`` (every bucket is
compressed from the first step, so DDP's bucket rebuild after step 1 remaps the residuals).
"""

import math
import time
from typing import Any, Dict, Optional

TEST_SIZE = 400
SPLIT_SEED = 0

_data_cache: Dict[str, Any] = {}


def load_data():
    """Returns float32 tensors ``(x_train [1397, 64], y_train [1397] int64, x_test [400, 64],
    y_test [400] int64)``: the fixed split, standardized with training statistics."""
    if "d" in _data_cache:
        return _data_cache["d"]
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = d.data.astype(np.float32)
    y = d.target.astype(np.int64)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=TEST_SIZE, random_state=SPLIT_SEED, stratify=y)
    mu = xtr.mean(0)
    sd = xtr.std(0) + 1.0  # the +1 keeps constant (all-zero) pixels finite and damps rare ones
    out = tuple(torch.from_numpy(a) for a in ((xtr - mu) / sd, ytr, (xte - mu) / sd, yte))
    _data_cache["d"] = out
    return out


def make_model(hidden: int):
    import torch.nn as nn

    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


STATS_LOG_EVERY = 10
"""Steps between the rows of a run's stats log (``cfg["stats_log"]``, :func:`register_hook`)."""


def split_scheme(codec: str):
    """A codec-list entry ``SPEC`` or ``SPEC@SCHEME`` (DDP: the hook's scheme instead of ``auto``,
    e.g. ``onebit@majority``, signSGD's majority vote) -> ``(SPEC, SCHEME or "auto")``.

    Raises:
        ValueError: an empty SPEC or SCHEME around the ``@``, or a SCHEME that is not in the scheme
            table, does not take the codec (``sum``: a linear codec; ``majority``: onebit) or needs
            a route option the sweep does not give (``hierarchical``: its local world size).
    """
    if "@" not in codec:
        return codec.strip(), "auto"
    spec, _, scheme = codec.partition("@")
    spec, scheme = spec.strip(), scheme.strip()
    if not spec or not scheme:
        raise ValueError(f"{codec!r}: accepted: SPEC or SPEC@SCHEME with both parts non-empty")
    from ..codec import Codec
    from ..planner import schemes as scheme_table

    names = scheme_table.names()
    if scheme not in names:
        raise ValueError(f"{codec!r}: unknown scheme {scheme!r}; accepted: {', '.join(names)}")
    desc = scheme_table.get(scheme)
    if desc.requires:
        raise ValueError(f"{codec!r}: scheme {scheme!r} needs {', '.join(desc.requires)}, which the sweep does not "
                         f"set; accepted here: {', '.join(n for n in names if not scheme_table.get(n).requires)}")
    if family_of(spec) != "powersgd" and not desc.accepts(Codec(spec)):
        raise ValueError(f"{codec!r}: scheme {scheme!r} takes {desc.needs()}, not {spec!r}")
    return spec, scheme


def family_of(codec: str) -> str:
    """The family of a codec-list entry: its name before ``:`` (and ``@``)."""
    return codec.partition("@")[0].partition(":")[0].strip()


def register_hook(ddp, codec: str, error_feedback: bool, start_iter: int, stats_log: Optional[str] = None):
    """Register the gradcomp hook of a run on the DDP model and return its state (whose
    ``stats()`` the run reports): ``gradcomp.torch.register`` with the codec spec, error feedback
    and ``start_iter``, scheme ``auto`` (or SCHEME of a ``SPEC@SCHEME`` entry, e.g.
    ``onebit@majority``) and ``min_compress_numel=0`` (every bucket compressed),
    whatever the protocol (a ``powersgd:rank=R`` spec gets the low-rank hook's state from the
    protocol table, :mod:`gradcomp.torch.protocol`). Both tasks register this way. With
    ``stats_log`` (a path) the hook appends the report of every :data:`STATS_LOG_EVERY`-th step
    to it (``log_file``; every rank to the same file, each row naming its rank)."""
    import gradcomp.torch as gt

    log = {} if stats_log is None else {"log_every": STATS_LOG_EVERY, "log_file": stats_log}
    spec, scheme = split_scheme(codec)
    return gt.register(ddp, codec=spec, error_feedback=error_feedback, scheme=scheme, start_iter=start_iter,
                       min_compress_numel=0, **log)


def train_run(rank: int, world: int, cfg: dict) -> dict:
    """One training run on this rank (a pool job). ``cfg`` keys: codec, error_feedback, seed,
    epochs, lr, momentum, batch_size (per rank), hidden, bucket_cap_mb, weight_decay; optional
    optimizer (sgd, adam, onebit_adam; default sgd) and engine ("ddp", default, or "fsdp2": the
    MLP sharded by FSDP2, its Linear layers one unit each, with gradcomp's compressed
    reduce-scatter or FSDP2's own for codec "dense", :mod:`gradcomp.experiments.fsdp2`; SGD only);
    stats_log (a path: the hook's step reports, :func:`register_hook`; DDP with the gradcomp
    hook only).

    Returns (every rank) a dict: test_accuracy (percent, full test set), train_loss (per-epoch
    mean over all ranks' batches), the hook's byte/time totals, compute and wall seconds, and a
    checksum of the final parameters (for the parent's check that all ranks agree bitwise)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from .pool import report

    t_start = time.perf_counter()
    xtr, ytr, xte, yte = load_data()
    torch.manual_seed(cfg["seed"])
    model = make_model(cfg["hidden"])
    engine = cfg.get("engine", "ddp")
    kind = cfg.get("optimizer", "sgd")
    if engine == "fsdp2":
        from . import fsdp2

        if kind != "sgd":
            raise ValueError(f"experiment: optimizer={kind!r} under FSDP2; accepted: sgd (the optimizer rows run "
                             f"under DDP only)")
        numels = {n: p.numel() for n, p in model.named_parameters()}
        units = fsdp2.shard(model, world)
        ddp = model  # the FSDPModule: forward, parameters (DTensors)
    elif engine == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_cap_mb"])
    else:
        raise ValueError(f"experiment: engine={engine!r}; accepted: ddp, fsdp2")
    bs = cfg["batch_size"]
    n = xtr.shape[0]
    per_rank = n // world
    steps = per_rank // bs
    total_steps = steps * cfg["epochs"]
    state = None
    peak_lr = cfg["lr"]
    if kind == "sgd":
        state = (fsdp2.register(model, cfg["codec"], cfg["error_feedback"]) if engine == "fsdp2" else
                 register_hook(ddp, cfg["codec"], cfg["error_feedback"], start_iter=0,
                               stats_log=cfg.get("stats_log")))
        opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                              weight_decay=cfg.get("weight_decay", 0.0))
    elif kind == "adam":  # torch's Adam under plain DDP: every step allreduces the float32 gradients
        peak_lr = cfg["adam_lr"]
        opt = torch.optim.Adam(ddp.parameters(), lr=peak_lr, eps=cfg["adam_eps"])
    elif kind == "onebit_adam":
        import gradcomp.optim as go

        peak_lr = cfg["adam_lr"]
        # the first layer's weights of pixels that are constant over the training set get exact
        # zero gradients, which 1-bit signs cannot carry: DeepSpeed's exp_avg_mask
        first = model[0].weight
        mask = (xtr.std(0) > 0).to(first.dtype).expand_as(first).clone()
        rest = [p for p in model.parameters() if p is not first]
        opt = go.OnebitAdam([{"params": [first], "exp_avg_mask": mask}, {"params": rest}], lr=peak_lr,
                            eps=cfg["adam_eps"], freeze_step=max(2, round(cfg["freeze_fraction"] * total_steps)))
        go.register_comm_hook(ddp, opt)
    else:
        raise ValueError(f"experiment: optimizer={kind!r}; accepted: sgd, adam, onebit_adam")
    gen = torch.Generator().manual_seed(1000 + cfg["seed"])
    losses = []
    compute_s = 0.0
    step = 0
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(n, generator=gen)
        mine = perm[rank: per_rank * world: world]
        loss_sum = torch.zeros(2)
        for s in range(steps):
            # cosine learning-rate decay over the run
            for g in opt.param_groups:
                g["lr"] = peak_lr * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
            idx = mine[s * bs: (s + 1) * bs]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            compute_s += time.perf_counter() - t0
            loss_sum[0] += loss.detach()
            loss_sum[1] += 1
            step += 1
        dist.all_reduce(loss_sum)
        losses.append(float(loss_sum[0] / loss_sum[1]))
        if rank == 0:
            report({"epoch": epoch + 1, "loss": losses[-1]})
    if engine == "fsdp2":  # a plain copy with the full parameters (every rank), evaluated as under DDP
        st = fsdp2.run_stats(state, units, world, total_steps)
        extra = {"exempt_numel": fsdp2.exempt_numel(state, numels), "params": sum(numels.values())}
        model = fsdp2.gathered(model, lambda: make_model(cfg["hidden"]))
    with torch.no_grad():
        model.eval()
        pred = model(xte).argmax(1)
        acc = 100.0 * float((pred == yte).float().mean())
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        checksum = int(flat.view(torch.int32).to(torch.int64).sum())
    if engine == "fsdp2":
        pass  # st: above
    elif state is not None:
        st = state.stats()
    else:
        st = optimizer_stats(kind, opt, model, world, total_steps)
    return {
        "test_accuracy": acc,
        "train_loss": losses,
        "final_loss": losses[-1] if losses else float("nan"),
        **hook_totals(st),
        # the training loop: forward + backward (hook and waits included) + optimizer step
        "train_s": compute_s,
        "wall_s": time.perf_counter() - t_start,
        "param_checksum": checksum,
        **(extra if engine == "fsdp2" else {}),
    }


def hook_totals(st: dict) -> dict:
    """The fields every run reports from a hook's ``stats()`` (both tasks): steps, the schemes of
    the last step's buckets ("two_phase", "gather", ...), the three ratios, bytes per step,
    elements per step, buckets, non-finite steps, the hook's seconds and the network share of the
    run's steps (``stats()["time_split"]``: exposed communication / step time over the closed
    steps; None where the stats have no split: the optimizer rows, FSDP2)."""
    tot = st["total"]
    n = max(st["steps"], 1)
    split = st.get("time_split")
    return {"steps": st["steps"], "scheme": "+".join(sorted({b["scheme"] for b in st["buckets"]})),
            "packet_ratio": tot["packet_ratio"], "wire_ratio": tot["wire_ratio"],
            "bits_per_element": tot["bits_per_element"], "packet_bytes_per_step": tot["packet_bytes"] / n,
            "dense_bytes_per_step": tot["dense_bytes"] / n, "sent_bytes_per_step": tot["sent_bytes"] / n,
            "numel": int(tot["numel"] / n), "buckets": len(st["buckets"]),
            "nonfinite_steps": st["nonfinite_steps"], "encode_s": tot["encode_s"],
            "decode_s": tot["decode_s"], "comm_s": tot["comm_s"],
            "network_share": split["network_share"] if split and split["steps"] else None}


def optimizer_stats(kind: str, opt, model, world: int, steps: int) -> dict:
    """The hook's ``stats()`` shape for the optimizer rows, over the whole run (warm-up included),
    from the planner's formulas: ``kind`` "adam" allreduces every float32 gradient every step (one
    "dense" packet of all gradients); the others' bytes are the optimizer's ``comm_stats()``:
    "onebit_adam" (digits' 1-bit Adam: dense warm-up averaging, then onebit packets of the padded
    momenta; scheme "dense+onebit"), "dgc" and "compressed_adam" (charlm's method rows; scheme
    the kind)."""
    from .. import planner

    numel = sum(p.numel() for p in model.parameters())
    dense = planner.dense_bytes(numel, "float32")
    ring = planner.ring_allreduce_bytes(dense, world)
    if kind == "adam":
        packet, sent, scheme = dense * steps, ring * steps, "dense"
    else:
        cs = opt.comm_stats()
        packet, sent = cs["packet_bytes"], cs["sent_bytes"]
        scheme = "dense+onebit" if kind == "onebit_adam" else kind
    tot = {"numel": numel * steps, "dense_bytes": dense * steps, "packet_bytes": packet, "sent_bytes": sent,
           "ring_bytes": ring * steps, "encode_s": 0.0, "decode_s": 0.0, "comm_s": 0.0}
    tot.update(planner.summarize(tot))
    return {"steps": steps, "total": tot, "buckets": [{"scheme": scheme}], "nonfinite_steps": 0}
