"""1-bit Adam and 1-bit LAMB as torch.optim optimizers, with DeepSpeed 0.19.6's semantics
(DeepSpeed 0.19.7 removed them, PR 8490; tracking issue 8489), for plain torch.distributed
loops, DDP and current DeepSpeed.

- :class:`OnebitAdam`: Tang et al., "1-bit Adam", ICML 2021, Algorithm 1.
- :class:`OnebitLamb`: Li et al., "1-bit LAMB", arXiv 2104.06069, Algorithm 1.
- :class:`ZeroOneAdam`: Lu et al., "0/1 Adam", ICLR 2023 (arXiv 2202.06009), Algorithm 1: the
  variance updated (and the gradient averaged densely) only on exponentially spaced steps, 1-bit
  averaged gradients on the others, then local steps synchronised by the 1-bit exchange.

OnebitAdam and OnebitLamb start with DeepSpeed's initialisation step (no update), then a dense warm-up until the step
count reaches ``freeze_step``, then the compression stage: gradients stay local and the momentum
is averaged with DeepSpeed's error-compensated 1-bit compressed allreduce (worker and server
errors, :class:`gradcomp.schemes.onebit_allreduce.OnebitAllreduce`, the algorithm of
:class:`gradcomp.deepspeed.OnebitBackend`, gradcomp's ``onebit`` codec), 1 bit per
element plus one float32 scale per rank and chunk on the wire.

Three ways to run them:
  - a plain loop: ``opt = OnebitAdam(model.parameters(), ...)``; ``step()`` averages the
    warm-up gradients itself (``average_gradients=True``);
  - DDP: :func:`register_comm_hook` ``(ddp_model, opt)``: the hook averages on the dense steps
    (``opt.dense_next``: the warm-up; ZeroOneAdam's variance steps) and leaves the gradients
    local on the others;
  - DeepSpeed (any version) as a client optimizer: ``engine, *_ = deepspeed.initialize(model=m,
    optimizer=opt, config=...)`` then :func:`gradcomp.deepspeed.install` ``(engine)``: the
    engine averages during the warm-up and its gradient allreduce is off afterwards.
``opt.comm_stats()`` reports the bytes this rank sent.

Two more methods for any codec, which exchange in ``step()`` too (the same three ways to run):
  - :class:`CompressedAdam`: 1-bit Adam's recipe for every codec and scheme (a dense warm-up, then
    the variance frozen and the momentum averaged through a :class:`gradcomp.torch.Compressor` with
    worker and server error feedback);
  - :class:`DGC`: Deep Gradient Compression for momentum SGD (Lin et al., ICLR 2018): momentum
    correction, momentum factor masking, local gradient clipping, a density warm-up
    (:func:`warmup_stages`, :func:`warmup_geometric`), 1-D parameters dense.
"""

from .adam import OnebitAdam
from .compressed_adam import CompressedAdam
from .dgc import DGC, warmup_geometric, warmup_stages
from .hook import onebit_comm_hook, register_comm_hook
from .lamb import OnebitLamb
from .zoadam import ZeroOneAdam

__all__ = ["CompressedAdam", "DGC", "OnebitAdam", "OnebitLamb", "ZeroOneAdam", "onebit_comm_hook",
           "register_comm_hook", "warmup_geometric", "warmup_stages"]
