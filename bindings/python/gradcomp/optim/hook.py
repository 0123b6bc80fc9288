"""The DDP communication hook of gradcomp's optimizers (the 1-bit ones, CompressedAdam, DGC): during
the warm-up it averages each bucket
(a dense allreduce, as DDP's default hook); in the compression stage it sends nothing and leaves
the local gradient in place, because the optimizer then exchanges its compressed momentum itself
(so nothing is sent twice)."""


import torch
import torch.distributed as dist

from ..schemes.context import chain
from ._base import OnebitOptimizer
from .compressed_adam import CompressedAdam
from .dgc import DGC

HOOK_OPTIMIZERS = (OnebitOptimizer, CompressedAdam, DGC)
"""The optimizers the hook serves: each has ``dense_next``, ``size``, ``group`` and ``count_dense``."""


def onebit_comm_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook with a gradcomp optimizer as its state (a 1-bit optimizer, CompressedAdam or DGC:
    :data:`HOOK_OPTIMIZERS`; ``ddp.register_comm_hook(opt,
    onebit_comm_hook)``; construct the optimizer with ``average_gradients=False``, or use
    :func:`register_comm_hook`, which does both).

    Returns a Future of the bucket's flat buffer (its dtype and length): the mean over the
    optimizer's group when the coming step averages densely (``state.dense_next``: the warm-up of
    OnebitAdam / OnebitLamb / CompressedAdam, the variance-update steps of ZeroOneAdam; never for
    DGC, which exchanges everything in its step), else the untouched local gradient."""
    buf = bucket.buffer()
    if not state.dense_next or state.size == 1:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut
    state.count_dense(buf.numel() * buf.element_size())
    W = state.size
    work = dist.all_reduce(buf, group=state.group, async_op=True)
    return chain(work.get_future(), lambda v: v[0].div_(W),
                 f"gradcomp.optim: bucket {bucket.index()}: the dense allreduce of the warm-up", device=buf.device)


def register_comm_hook(ddp_model, optimizer) -> None:
    """Registers :func:`onebit_comm_hook` on ``ddp_model`` with ``optimizer`` as its state and
    sets ``optimizer.average_gradients = False`` (DDP then averages the warm-up gradients).

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel, or ``optimizer`` not a
            gradcomp.optim optimizer.
        ValueError: the DDP process group's world size differs from the optimizer's, or the
            optimizer does not hold every trainable parameter of the model.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"gradcomp.optim.register_comm_hook: ddp_model is a {type(ddp_model).__name__}; accepted: "
                        f"torch.nn.parallel.DistributedDataParallel")
    if not isinstance(optimizer, HOOK_OPTIMIZERS):
        raise TypeError(f"gradcomp.optim.register_comm_hook: optimizer is a {type(optimizer).__name__}; accepted: "
                        f"gradcomp.optim.OnebitAdam, OnebitLamb, ZeroOneAdam, CompressedAdam or DGC")
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in ddp_model.module.named_parameters() if p.requires_grad and id(p) not in mine]
    if missing:
        raise ValueError(f"gradcomp.optim.register_comm_hook: the optimizer does not hold {len(missing)} of the "
                         f"model's trainable parameters (first: {missing[0]}); the hook follows the optimizer's "
                         f"stage, so it must be the optimizer that trains this model")
    w = ddp_model.process_group.size()
    if w != optimizer.size:
        raise ValueError(f"gradcomp.optim.register_comm_hook: DDP's process group has world size {w}, the "
                         f"optimizer's {optimizer.size}; pass the same group to both")
    optimizer.average_gradients = False
    ddp_model.register_comm_hook(optimizer, onebit_comm_hook)
