"""PyTorch integrations built on gradcomp codecs: a compressed allreduce and DDP hooks.

Usage::

    # any training loop or hook: average a tensor in place, residuals keyed by name
    comp = gradcomp.torch.Compressor("topk:ratio=0.01")
    comp.allreduce(p.grad, name).wait()

    # DistributedDataParallel
    state = gradcomp.torch.CompressionState(ddp_model, codec="topk:ratio=0.01")
    ddp_model.register_comm_hook(state, gradcomp.torch.compression_hook)
    # or, both at once:
    state = gradcomp.torch.register(ddp_model, codec="topk:ratio=0.01")

See :class:`Compressor` and :class:`CompressionState` for the schemes, error feedback, the
non-finite rule and the byte accounting (DESIGN.md sections 4 and 5). Modules: ``compressor``
(the allreduce), ``hook`` (DDP), ``residuals`` (error-feedback state), ``stats`` (accounting and
the one-step-late reads), ``pool`` (a gloo process pool for tests and experiments).

Sources: PyTorch DDP communication hooks (``torch.distributed.algorithms.ddp_comm_hooks``,
``DistributedDataParallel.register_comm_hook``); top-k sparsification with error feedback: Aji &
Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017, and Lin et al., "Deep
Gradient Compression", ICLR 2018; error feedback: Karimireddy et al., "Error Feedback Fixes SignSGD
and other Gradient Compression Schemes", ICML 2019.
"""

from .compressor import Compressor  # noqa: F401
from .hook import CompressionState, compression_hook, register  # noqa: F401

__all__ = ["Compressor", "CompressionState", "compression_hook", "register"]
