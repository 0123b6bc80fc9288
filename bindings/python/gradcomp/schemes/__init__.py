"""Collective schemes: a codec turned into a compressed allreduce over torch.distributed
(the README: "Compressed allreduce" and "DDP communication hook").

Each scheme is a function ``scheme(tensor, ctx, slots=None, probe=None, check=None) -> torch.futures.Future``
that averages ``tensor`` over ``ctx.group`` in place (the Future holds ``tensor``, bitwise identical
on every rank), described by a :class:`gradcomp.schemes.base.Scheme` in its own module and listed
once in :data:`gradcomp.schemes.table.TABLE` (what each does: its module's docstring, and
``Scheme.summary``): :mod:`~gradcomp.schemes.allreduce` (``dense``, ``sum``),
:mod:`~gradcomp.schemes.allgather` (``gather``), :mod:`~gradcomp.schemes.two_phase`,
:mod:`~gradcomp.schemes.hierarchical`, :mod:`~gradcomp.schemes.rs_ag`. A new scheme is its file
and one line of the table.

Failures: a scheme's Future raises :class:`gradcomp.CollectiveError` when one of its collectives
fails (nothing is decoded from a collective that did not complete: every callback is attached
through :func:`gradcomp.schemes.context.chain`, which reads the future first), and
:class:`gradcomp.RankMismatchError` when ranks disagree: ``check=`` (a
:class:`gradcomp.schemes.check.PeerCheck`, the caller's call descriptor) is compared before the
first decode, and ``gather`` / ``two_phase`` compare every received packet header
(:func:`gradcomp.schemes.check.check_headers`). A collective issued in the calling thread
(two_phase's all-to-all, hierarchical's intra-node step) raises at once; the caller undoes what
the encodes changed (:mod:`gradcomp.torch.journal`).

World size 1 returns ``tensor`` unchanged. ``ctx`` is the scheme's own context (a
:class:`SchemeContext`: codec, group, world size, and the buffers of one bucket layout, built by
``Scheme.context`` or :meth:`SchemeContext.for_layout`); ``slots`` maps the slot names the scheme
lists in ``Scheme.slots`` to flat float32 tensors (``"residual"``, the worker error-feedback
residual, ``tensor.numel()`` elements; ``"server"``, the server residual of ``Scheme.server(ctx)``);
``probe`` times the phases and sees each decode workspace (:class:`NullProbe` when None). Schemes
never see the state of the hook or compressor that calls them.

The primitives of the byte formulas (ring formulas, chunking) live in :mod:`gradcomp.planner`;
each scheme composes them in its own ``steps``, which the planner reads from the table.

Also here, outside the table: :mod:`~gradcomp.schemes.collectives` (the failure-safe all-gather
that two_phase and hierarchical end with), :func:`~gradcomp.schemes.allreduce.sum_allreduce` (the
one SUM allreduce of ``dense`` and of PowerSGD's two rounds) and
:mod:`~gradcomp.schemes.onebit_allreduce` (DeepSpeed's 1-bit ``compressed_allreduce``, exactly:
one scale over the padded buffer, server terms through the decode's alpha, blocking; what
:mod:`gradcomp.deepspeed` and :mod:`gradcomp.optim` call; not a ``Compressor`` scheme, its
docstring says why).
"""

from .allgather import GatherContext, gather
from .allreduce import SumContext, dense, sum  # noqa: A004 - the scheme is called sum
from .base import Scheme
from .context import NullProbe, SchemeContext
from .groups import HierarchicalGroups, engine_of, hierarchical_groups_for
from .hierarchical import HierarchicalContext, hierarchical
from .onebit_allreduce import OnebitAllreduce
from .rs_ag import rs_ag
from .table import TABLE
from .two_phase import TwoPhaseContext, all_gather_phase, reduce_scatter_phase, two_phase

SCHEMES = {s.name: s.run for s in TABLE}
"""Scheme name -> run function, in table order (from :data:`TABLE`)."""

__all__ = ["SCHEMES", "TABLE", "GatherContext", "HierarchicalContext", "HierarchicalGroups", "NullProbe", "OnebitAllreduce", "Scheme",
           "SchemeContext", "SumContext", "TwoPhaseContext", "all_gather_phase", "dense", "engine_of", "gather",
           "hierarchical", "hierarchical_groups_for", "reduce_scatter_phase", "rs_ag", "sum", "two_phase"]
