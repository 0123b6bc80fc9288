"""``OnebitBackend``: DeepSpeed's error-compensated 1-bit compressed allreduce (the
``compressed_allreduce(buffer_m, worker_error, server_error, local_rank)`` of its NCCL /
Compressed backends, DeepSpeed <= 0.19.6; docs/contracts.md section 6.1) as a drop-in for the
``comm_backend_handle`` of DeepSpeed's 1-bit optimizers.

The adapter: DeepSpeed's constructor (``mpu`` -> its data-parallel group), the ``size`` / ``rank``
attributes DeepSpeed reads and the ``compressed_allreduce`` signature. The algorithm, its
numerics, the buffer rules and what a failed call does are
:class:`gradcomp.schemes.onebit_allreduce.OnebitAllreduce`'s (its module docstring), which this
class is, named ``OnebitBackend.compressed_allreduce`` in its error messages.

Raises:
    ValueError: bad buffers (:mod:`gradcomp.schemes.onebit_allreduce`), before anything is sent.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..schemes.onebit_allreduce import OnebitAllreduce


class OnebitBackend(OnebitAllreduce):
    """A DeepSpeed 1-bit communication backend on gradcomp (see the module docstring).

    Args:
        mpu: DeepSpeed's model-parallel unit or None; when given, its data-parallel group is used
            (as DeepSpeed's backends do).
        group: a torch.distributed process group (default: the world); ignored when ``mpu`` is set.

    Attributes:
        size: the group's world size W (DeepSpeed reads it to pad its buffers).
        rank: this process's rank in the group.
        group, codec, calls: as :class:`gradcomp.schemes.onebit_allreduce.OnebitAllreduce`.
    """

    who = "OnebitBackend.compressed_allreduce"
    where = "gradcomp.deepspeed.OnebitBackend.compressed_allreduce"

    def __init__(self, mpu=None, group=None):
        if not dist.is_initialized():
            raise RuntimeError("gradcomp.deepspeed.OnebitBackend: torch.distributed is not initialized "
                               "(call deepspeed.init_distributed() or torch.distributed.init_process_group first)")
        super().__init__(mpu.get_data_parallel_group() if mpu is not None else group)

    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                             local_rank: Optional[int] = None) -> torch.Tensor:
        """The compressed mean of ``buffer_m`` over the group (DeepSpeed's contract).

        Returns a tensor of buffer_m's shape and dtype, identical on every rank; writes it into
        ``buffer_m`` when its numel equals worker_error's; updates both error buffers in place.
        ``local_rank`` is accepted for DeepSpeed's signature and not used (the device is
        buffer_m's).

        Raises:
            ValueError: bad buffers, before anything is sent.
            gradcomp.CollectiveError: a collective failed; gradcomp.RankMismatchError: a server
                packet of another size or codec, or a rank that failed before the all-gather.
                Both error buffers are then as they were before the call.
        """
        return self(buffer_m, worker_error, server_error)
