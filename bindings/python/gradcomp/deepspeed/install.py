"""``install(engine)``: put gradcomp under a DeepSpeed engine's 1-bit optimizer, after
``deepspeed.initialize`` and before the first step."""

from __future__ import annotations

import torch.distributed as dist

from .backend import OnebitBackend

_DS_CLASSES = ("OnebitAdam", "ZeroOneAdam", "OnebitLamb")


def _deepspeed_onebit_classes():
    """DeepSpeed's 1-bit optimizer classes, or None for a DeepSpeed without them (>= 0.19.7)."""
    try:
        from deepspeed.runtime.fp16.onebit.adam import OnebitAdam
        from deepspeed.runtime.fp16.onebit.lamb import OnebitLamb
        from deepspeed.runtime.fp16.onebit.zoadam import ZeroOneAdam
    except ImportError:
        return None
    return (OnebitAdam, ZeroOneAdam, OnebitLamb)


def _dp_world_size(engine) -> int:
    w = getattr(engine, "dp_world_size", None)
    if w is not None:
        return int(w)
    mpu = getattr(engine, "mpu", None)
    return dist.get_world_size(mpu.get_data_parallel_group() if mpu is not None else None)


def install(engine):
    """Makes a DeepSpeed engine's 1-bit optimizer communicate through gradcomp.

    - DeepSpeed <= 0.19.6 with its own ``OnebitAdam``, ``ZeroOneAdam`` or ``OnebitLamb``
      (``engine.basic_optimizer``): replaces the optimizer's ``comm_backend_handle`` with a
      :class:`OnebitBackend` over the engine's data-parallel group (``engine.mpu``). The stock
      backend must have been built by ``deepspeed.initialize`` (``nccl`` needs cupy; on a CPU,
      or without cupy, use the ``"compressed"`` route of the README instead, which replaces the
      class before ``initialize``).
    - Any DeepSpeed with a :mod:`gradcomp.optim` optimizer passed as ``optimizer=`` to
      ``deepspeed.initialize``: binds the engine (:meth:`OnebitOptimizer.bind_engine`): the
      engine averages the warm-up gradients and its gradient allreduce goes off for the
      compression stage.

    Returns:
        The installed :class:`OnebitBackend` (first case), or the gradcomp.optim optimizer
        itself, now bound to the engine (second case; ``engine.optimizer`` is the same object).

    Raises:
        TypeError: the engine's optimizer is none of those (the message names its class and what
            to use; on DeepSpeed >= 0.19.7, which has no 1-bit optimizers, it points to
            gradcomp.optim).
        ValueError: the world sizes differ (the optimizer padded its buffers for its own size,
            or a gradcomp optimizer's group is not the engine's data-parallel group).
        RuntimeError: the optimizer has already stepped (its error buffers exist).
    """
    from ..optim._base import OnebitOptimizer

    import torch

    if isinstance(engine, torch.optim.Optimizer):
        raise TypeError(f"gradcomp.deepspeed.install: got the optimizer {type(engine).__name__}; accepted: the engine "
                        f"deepspeed.initialize returned (engine, optimizer, _, _ = deepspeed.initialize(...))")
    opt = getattr(engine, "basic_optimizer", None) or getattr(engine, "optimizer", None)
    if opt is None:
        raise TypeError(f"gradcomp.deepspeed.install: {type(engine).__name__} has no optimizer (basic_optimizer "
                        f"/ optimizer); accepted: a DeepSpeed engine returned by deepspeed.initialize")
    if isinstance(opt, OnebitOptimizer):
        w = _dp_world_size(engine)
        if w != opt.size:
            raise ValueError(f"gradcomp.deepspeed.install: the engine's data-parallel world size is {w}, the "
                             f"{type(opt).__name__}'s group has {opt.size}; build the optimizer with group= the "
                             f"engine's data-parallel group")
        opt.bind_engine(engine)
        return opt
    classes = _deepspeed_onebit_classes()
    if classes is None:
        import deepspeed

        raise TypeError(f"gradcomp.deepspeed.install: the engine's optimizer is {type(opt).__name__}, and DeepSpeed "
                        f"{deepspeed.__version__} has no 1-bit optimizers (DeepSpeed 0.19.7 removed them, PR 8490); "
                        f"use gradcomp.optim.OnebitAdam, OnebitLamb or ZeroOneAdam: deepspeed.initialize(..., optimizer="
                        f"gradcomp.optim.OnebitAdam(model.parameters(), ...)), then install(engine)")
    if not isinstance(opt, classes):
        raise TypeError(f"gradcomp.deepspeed.install: the engine's optimizer is {type(opt).__name__}; accepted: "
                        f"DeepSpeed's {', '.join(_DS_CLASSES)} (\"type\" in the config's \"optimizer\") or a "
                        f"gradcomp.optim optimizer passed as optimizer=")
    if getattr(opt, "initialize", False):
        raise RuntimeError(f"gradcomp.deepspeed.install: {type(opt).__name__} has already stepped (its error buffers "
                           f"were sized and filled by its backend); call install(engine) after deepspeed.initialize "
                           f"and before the first engine.step()")
    backend = OnebitBackend(mpu=getattr(engine, "mpu", None))
    if backend.size != opt.size:
        raise ValueError(f"gradcomp.deepspeed.install: the engine's data-parallel group has world size "
                         f"{backend.size}, {type(opt).__name__} padded its buffers for {opt.size}")
    opt.comm_backend_handle = backend
    return backend
