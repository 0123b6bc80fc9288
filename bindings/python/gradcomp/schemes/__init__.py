"""Collective schemes: a codec turned into a compressed allreduce over torch.distributed
(the README: "Compressed allreduce" and "DDP communication hook").

Each scheme is a function ``scheme(tensor, ctx, slots=None, probe=None) -> torch.futures.Future``
that averages ``tensor`` over ``ctx.group`` in place (the Future holds ``tensor``, bitwise identical
on every rank):

- :func:`dense`: ``tensor /= W`` then one SUM allreduce (PyTorch's ``allreduce_hook``).
- :func:`sum`: linear codecs; encode with ``divisor=W`` (and the ``"residual"`` slot), one SUM
  allreduce of the packet's payload view ``codec.payload(numel, dtype)``, decode into ``tensor``.
- :func:`gather`: any codec; encode with ``divisor=W``, all-gather the fixed-size packets, decode
  all W in rank order into one float32 accumulator zeroed first, round once into ``tensor``.
- :func:`two_phase`: any codec; cut ``tensor`` into W chunks, encode each (``divisor=W``), one
  all-to-all so rank r gets every rank's packet of chunk r, decode them in rank order into a
  float32 sum, re-encode it with the ``"server"`` residual, all-gather, decode (DeepSpeed 1-bit
  Adam's compressed allreduce, Tang et al. 2021; ZeRO++ qgZ, Wang et al. 2023).

World size 1 returns ``tensor`` unchanged. ``ctx`` is a :class:`SchemeContext` (codec, group,
world size, per-layout buffers); ``slots`` maps slot names to flat float32 tensors of
``tensor.numel()`` elements (``"residual"``, the worker error-feedback residual) and, for
two_phase, ``"server"`` (float32, the count of this rank's chunk); ``probe``
times the phases and sees each decode workspace (:class:`NullProbe` when None). Schemes never see
the state of the hook or compressor that calls them.

Byte formulas for each scheme live in :mod:`gradcomp.planner`.
"""

from .allgather import gather
from .allreduce import dense, sum  # noqa: A004 - the scheme is called sum
from .context import NullProbe, SchemeContext
from .two_phase import two_phase

SCHEMES = {"dense": dense, "sum": sum, "gather": gather, "two_phase": two_phase}
"""Scheme name -> function; the names of :data:`gradcomp.planner.SCHEMES`."""

__all__ = ["SCHEMES", "NullProbe", "SchemeContext", "dense", "gather", "sum", "two_phase"]
