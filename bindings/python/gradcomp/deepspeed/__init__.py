"""gradcomp for DeepSpeed's 1-bit optimizers (OnebitAdam, ZeroOneAdam, OnebitLamb of DeepSpeed
<= 0.19.6): :class:`OnebitBackend`, a drop-in for the ``comm_backend_handle`` those optimizers
call, built on gradcomp's ``onebit`` codec over torch.distributed (gloo or NCCL; no cupy),
and :func:`install`, which puts it (or a :mod:`gradcomp.optim` optimizer) under an engine.
See the README's DeepSpeed section."""

from .backend import OnebitBackend
from .install import install

__all__ = ["OnebitBackend", "install"]
