"""Collective schemes: a codec turned into a compressed allreduce over torch.distributed
(the README: "Compressed allreduce" and "DDP communication hook").

Each scheme is a function ``scheme(tensor, ctx, slots=None, probe=None, check=None) -> torch.futures.Future``
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
- :func:`hierarchical`: any codec, nodes of L ranks: an uncompressed float32 reduce-scatter
  inside the node (an allreduce on gloo), one of the four above across nodes over the N = W / L
  ranks of the same local rank for this rank's chunk of the node sum (encode divisor W:
  ``ctx.divisor``), an all-gather of the averaged chunks inside the node
  (:mod:`gradcomp.schemes.hierarchical`; its groups: :mod:`gradcomp.schemes.groups`).

Failures: a scheme's Future raises :class:`gradcomp.CollectiveError` when one of its collectives
fails (nothing is decoded from a collective that did not complete: every callback is attached
through :func:`gradcomp.schemes.context.chain`, which reads the future first), and
:class:`gradcomp.RankMismatchError` when ranks disagree: ``check=`` (a
:class:`gradcomp.schemes.check.PeerCheck`, the caller's call descriptor) is compared before the
first decode, and ``gather`` / ``two_phase`` compare every received packet header
(:func:`gradcomp.schemes.check.check_headers`). A collective issued in the calling thread
(two_phase's all-to-all, hierarchical's intra-node step) raises at once; the caller undoes what
the encodes changed (:mod:`gradcomp.torch.journal`).

World size 1 returns ``tensor`` unchanged. ``ctx`` is a :class:`SchemeContext` (codec, group,
world size, per-layout buffers); ``slots`` maps slot names to flat float32 tensors of
``tensor.numel()`` elements (``"residual"``, the worker error-feedback residual) and, for
two_phase, ``"server"`` (float32, the count of this rank's chunk; under hierarchical with inner
two_phase, of this rank's piece of its node chunk, ``ctx.server_chunk``); ``probe``
times the phases and sees each decode workspace (:class:`NullProbe` when None). Schemes never see
the state of the hook or compressor that calls them.

Byte formulas for each scheme live in :mod:`gradcomp.planner`.
"""

from .allgather import gather
from .allreduce import dense, sum  # noqa: A004 - the scheme is called sum
from .context import NullProbe, SchemeContext
from .groups import HierarchicalGroups, engine_of, hierarchical_groups_for
from .hierarchical import hierarchical
from .two_phase import two_phase

SCHEMES = {"dense": dense, "sum": sum, "gather": gather, "two_phase": two_phase, "hierarchical": hierarchical}
"""Scheme name -> function; the names of :data:`gradcomp.planner.ALL_SCHEMES`."""

__all__ = ["SCHEMES", "HierarchicalGroups", "NullProbe", "SchemeContext", "dense", "engine_of", "gather",
           "hierarchical", "hierarchical_groups_for", "sum", "two_phase"]
