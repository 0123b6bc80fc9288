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

    # AMP with dynamic loss scaling: residuals follow the scale
    state.attach_grad_scaler(scaler)

    # checkpoint as PyTorch's PowerSGDState (per rank), then register on a new DDP model
    torch.save({"state_dict": ddp_model.state_dict(), "comm_hook": gradcomp.torch.compression_hook,
                "comm_hook_state": state}, f"ckpt_rank{rank}.pt")
    ck = torch.load(f"ckpt_rank{rank}.pt", weights_only=False)
    new_ddp.load_state_dict(ck["state_dict"])
    gradcomp.torch.register(new_ddp, state=ck["comm_hook_state"])

    # FSDP2 (fully_shard): a compressed reduce-scatter on every FSDPModule; custom HSDP with
    # replicate_group=; the state is a torch.distributed.checkpoint Stateful
    state = gradcomp.torch.fsdp.register(fsdp_model, "fp8")

    # PowerSGD (low rank), PyTorch's PowerSGDState options
    state = gradcomp.torch.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=10,
                                         ddp_model=ddp_model)
    ddp_model.register_comm_hook(state, gradcomp.torch.powersgd_hook)

The codec is always given: there is no default. See :class:`Compressor` and
:class:`CompressionState` for the schemes, error feedback, the non-finite rule, loss scaling,
checkpoints and the byte accounting; the README's "Compressed allreduce for any training loop" and
"DDP communication hook" sections are the user guide. Modules: ``protocol`` (the interface every
compressor protocol implements, :class:`BaseCompressor`, and the protocol table that
``Compressor(spec)`` and ``register`` read), ``compressor`` (the codec protocol's allreduce),
``hook`` (DDP), ``fsdp`` (FSDP2: :mod:`gradcomp.torch.fsdp`), ``powersgd`` (the low-rank protocol: Vogels et al., NeurIPS 2019), ``residuals`` (error-feedback state), ``stats`` (accounting, the one-step-late
reads, the log handler); ``pool`` only re-exports :mod:`gradcomp.experiments.pool` (the gloo process
pool of the tests and experiments), its old home.

Sources: PyTorch DDP communication hooks (``torch.distributed.algorithms.ddp_comm_hooks``,
``DistributedDataParallel.register_comm_hook``); top-k sparsification with error feedback: Aji &
Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017, and Lin et al., "Deep
Gradient Compression", ICLR 2018; error feedback: Karimireddy et al., "Error Feedback Fixes SignSGD
and other Gradient Compression Schemes", ICML 2019.
"""

from .protocol import BaseCompressor  # noqa: F401
from .compressor import Compressor  # noqa: F401
from .hook import CompressionState, compression_hook, register  # noqa: F401
from .powersgd import PowerSGDCompressor, PowerSGDState, powersgd_hook  # noqa: F401
from . import fsdp  # noqa: F401,E402  (gradcomp.torch.fsdp.register after `import gradcomp.torch`)

__all__ = ["BaseCompressor", "Compressor", "CompressionState", "compression_hook", "register", "PowerSGDState", "powersgd_hook",
           "PowerSGDCompressor"]
