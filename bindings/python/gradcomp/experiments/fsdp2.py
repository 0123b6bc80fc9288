"""Worker side of ``gradcomp-experiment --engine fsdp2``: the tasks' models under FSDP2
(``torch.distributed.fsdp.fully_shard``) instead of DDP, with gradcomp's compressed reduce-scatter
(:func:`gradcomp.torch.fsdp.register`) or, for the dense row (:data:`DENSE`), FSDP2's own.

Sharding (:func:`shard`): a 1-D CPU device mesh over the pool's W gloo ranks (the default process
group); ``fully_shard`` on every direct child of the model that holds parameters (charlm: the
embedding, the 2-layer LSTM, the head; digits: the three Linear layers), then on the root, which
holds none of its own. Each child is one FSDP unit: one reduce-scatter of its gradients per step
(float32, ``AVG``, as DDP's average), one parameter all-gather before its forward and one before
its backward. The parameters are DTensors (Shard(0)); torch's Adam and SGD and
``clip_grad_norm_`` take them as they are.

gradcomp's defaults (:func:`register`): error feedback as the run says, and the parameters with
fewer than 2 dimensions or fewer than 1024 elements (the biases) exempt, sent raw in the same
all-to-all (``min_compress_numel=1024``); the seed of keyed codecs 0, as the DDP hook's.

Byte accounting (:func:`run_stats`, the DDP hook's ``stats()`` shape for
:func:`gradcomp.experiments.runner.hook_totals`): the reduce-scatters only (the all-gathers are the
same in every run): ``dense_bytes`` = FSDP2's padded reduce-scatter input, ``packet_bytes`` = the W
slots one rank encodes, ``sent_bytes`` = its W-1 slots of the all-to-all, ``ring_bytes`` = (W-1)/W
of the dense input, what a ring reduce-scatter sends; for :data:`DENSE` the same formulas with the
dense input as packet (packet_ratio = wire_ratio = 1). All from :mod:`gradcomp.planner`.

After training, :func:`gathered` all-gathers the full parameters into a plain copy of the model
(every rank), which the task evaluates and checksums as under DDP: the evaluation then makes no
collective, so the ranks may run different numbers of evaluation batches.
"""

from typing import Callable, List

DENSE = "dense"
"""The codec column's name of the FSDP2 runs without gradcomp: FSDP2's own reduce-scatter."""

MIN_COMPRESS_NUMEL = 1024
"""gradcomp.torch.fsdp.register's default, passed explicitly: smaller parameters travel raw."""

_meshes: dict = {}


def mesh(world: int):
    """The 1-D CPU device mesh over the default process group's ``world`` ranks (made once per
    process; a 1-D mesh of the whole world reuses the default group, no new group)."""
    m = _meshes.get(world)
    if m is None:
        from torch.distributed.device_mesh import init_device_mesh

        m = _meshes[world] = init_device_mesh("cpu", (world,))
    return m


def shard(model, world: int) -> List:
    """``fully_shard`` every direct child of ``model`` that holds parameters, then ``model``, on
    :func:`mesh`; returns the units (the children, in order). In place: ``model`` becomes the
    FSDPModule (its parameters DTensors; the names stay)."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    # torch warns once that the LSTM unit returns views (its (h, c)); the model uses its output
    # out of place (the head), which keeps FSDP's pre-backward hook
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDP\w+\) returned a view tensor")
    m = mesh(world)
    units = [c for c in model.children() if any(True for _ in c.parameters())]
    for u in units:
        fully_shard(u, mesh=m)
    fully_shard(model, mesh=m)
    return units


def register(model, codec: str, error_feedback: bool):
    """gradcomp on every FSDP unit of ``model`` (:func:`gradcomp.torch.fsdp.register` with
    ``min_compress_numel`` :data:`MIN_COMPRESS_NUMEL`); None for :data:`DENSE` (FSDP2's own
    reduce-scatter)."""
    if codec == DENSE:
        return None
    from gradcomp.torch import fsdp

    return fsdp.register(model, codec, error_feedback=error_feedback, min_compress_numel=MIN_COMPRESS_NUMEL)


def padded_numel(units: List, world: int) -> int:
    """Elements of one step's reduce-scatter inputs: per unit, W times the sum of its parameters'
    padded shards (:func:`gradcomp.planner.fsdp_shard_rows`)."""
    from .. import planner

    n = 0
    for u in units:
        for p in u.parameters():
            shape = tuple(p.shape)
            n += world * planner.fsdp_shard_rows(p.numel(), shape[0] if shape else 1, world, 0)[1]
    return n


def exempt_numel(state, numels: dict) -> int:
    """Elements that travelled raw under gradcomp: the sum of ``numels`` (``{name: numel}`` of the
    model's parameters) over the names ``state``'s reduce-scatter exempted; 0 without gradcomp.

    Raises:
        KeyError: an exempted name that is not in ``numels``."""
    if state is None or state.reduce_scatter is None:
        return 0
    return sum(numels[fqn] for fqn in state.reduce_scatter.exempted())


def run_stats(state, units: List, world: int, steps: int) -> dict:
    """The run's byte accounting in the DDP hook's ``stats()`` shape (``steps``, ``total``,
    ``buckets``, ``nonfinite_steps``): gradcomp's reduce-scatter stats
    (``state.stats()["reduce_scatter"]``), or for :data:`DENSE` (``state`` None) FSDP2's dense
    reduce-scatter over ``steps`` steps (scheme "dense", times 0: not measured)."""
    if state is not None:
        return state.stats()["reduce_scatter"]
    from .. import planner

    n = padded_numel(units, world)
    dense = planner.dense_bytes(n, "float32")
    ring = (world - 1) / world * dense
    tot = {"numel": n * steps, "dense_bytes": dense * steps, "packet_bytes": dense * steps,
           "sent_bytes": ring * steps, "ring_bytes": ring * steps, "encode_s": 0.0, "decode_s": 0.0, "comm_s": 0.0}
    tot.update(planner.summarize(tot))
    return {"steps": steps, "total": tot, "buckets": [{"scheme": "dense"} for _ in units], "nonfinite_steps": 0}


def gathered(model, build: Callable[[], object]):
    """A plain (not sharded) copy of the FSDP2 ``model``: ``build()`` (a new model of the same
    structure) with every parameter's full tensor (``DTensor.full_tensor``: an all-gather, so
    every rank calls this). Float32 bit for bit what the sharded model computes with."""
    import torch

    full = {name: p.full_tensor().detach() for name, p in model.named_parameters()}
    plain = build()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(full[name])
    return plain
