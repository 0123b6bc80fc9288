"""The ``majority`` scheme: signSGD with majority vote over the ``onebit`` codec.

Bernstein, Wang, Azizzadenesheli & Anandkumar, "signSGD: Compressed optimisation for non-convex
problems", ICML 2018, section 3 (majority vote: the server sums the workers' signs and sends the
sign of the sum back), and Bernstein, Zhao, Azizzadenesheli & Anandkumar, "signSGD with majority
vote is communication efficient and fault tolerant", ICLR 2019, algorithm 1. Here the server of
each chunk is a rank, as in the ``two_phase`` scheme whose protocol and byte accounting it shares
(about 2 (W-1)/W of one 1-bit packet of the bucket per rank, whatever W):

1. each rank encodes the W chunks of ``(g + r) / W`` with ``onebit`` (signs and a scale per onebit
   chunk; the worker residual keeps what its own scaled sign did not send: error feedback as in
   EF-signSGD, Karimireddy et al., ICML 2019; off with ``error_feedback=False``);
2. one all-to-all: rank r receives the W packets of chunk r;
3. the vote: each packet is decoded (D_w = +-s_w) in rank order; per element votes = sum_w sign(D_w)
   and m = sum_w |D_w| (float32, in rank order: the mean of the ranks' scales in gradient units,
   since each encoded g / W); the chunk's result is +m where votes >= 0 (ties go to +, as onebit's
   bit rule sends +0.0 as +) and -m elsewhere; a NaN scale makes m NaN (the step is non-finite);
4. the result is re-encoded with ``onebit`` (its signs are the majority exactly; its scale the
   per-chunk m, which onebit reproduces up to a float32 rounding: the server residual keeps that
   difference) and all-gathered; every rank decodes the same bytes.

The result is ``sign(majority) * mean scale`` on every rank, bitwise identical (no atomics). It
is not an average: ``auto`` never picks it (ask for ``scheme="majority"``), and only the onebit
codec is accepted.
"""

from typing import Mapping, Optional

import torch

from ..codec import Codec
from ..planner.bytes import chunk_size
from .base import Scheme
from .check import decode_from
from .context import NULL_PROBE, SchemeContext, completed
from .two_phase import (TwoPhaseContext, _two_phase_kernels, _two_phase_packet, _two_phase_server,
                        all_gather_phase, reduce_scatter_phase, two_phase_steps)


class MajorityContext(TwoPhaseContext):
    """The buffers of :class:`gradcomp.schemes.two_phase.TwoPhaseContext` plus ``votes`` (float32,
    the chunk size: the sum of the signs) and ``one`` (float32, the chunk size: one rank's decoded
    packet)."""

    def __init__(self, codec: Codec, numel: int, dtype, device, group, world_size: int, *,
                 rank: Optional[int] = None, divisor: Optional[int] = None):
        super().__init__(codec, numel, dtype, device, group, world_size, rank=rank, divisor=divisor)
        c = chunk_size(numel, int(world_size))
        self.votes = torch.empty(c, dtype=torch.float32, device=device)
        self.one = torch.empty(c, dtype=torch.float32, device=device)


def _vote(ctx: MajorityContext, dec, packets, ws) -> None:
    """Step 3 of the module docstring into ``ctx.acc``."""
    mine = ctx.chunks[ctx.rank][1]
    acc, votes, one = ctx.acc[:mine], ctx.votes[:mine], ctx.one[:mine]
    acc.zero_()
    votes.zero_()
    for j, p in enumerate(packets):
        decode_from(dec, p, j, "scheme 'majority': the all-to-all of the sign packets", out=one, workspace=ws)
        votes.add_(torch.sign(one))
        acc.add_(one.abs())
    torch.where(votes >= 0, acc, -acc, out=acc)


def majority(tensor: torch.Tensor, ctx: SchemeContext, slots: Optional[Mapping[str, torch.Tensor]] = None,
             probe=None, check=None) -> torch.futures.Future:
    """Reduce ``tensor`` to ``sign(majority vote) * mean scale`` over the group through the
    protocol of the module docstring (``ctx``: a :class:`MajorityContext`; ``slots``, ``probe``
    and ``check`` as :func:`gradcomp.schemes.two_phase.two_phase`).

    Returns:
        A Future holding ``tensor``, bitwise identical on every rank and run to run. A group of
        one returns ``tensor`` as is (no vote to take).

    Raises:
        As :func:`gradcomp.schemes.two_phase.two_phase`, whose collectives this scheme issues (their
        errors name them as scheme 'two_phase''s).
    """
    if ctx.world_size == 1 or tensor.numel() == 0:
        return completed(tensor)
    probe = probe or NULL_PROBE
    failed = reduce_scatter_phase(tensor, ctx, slots, probe, check, combine=_vote)
    return all_gather_phase(tensor, ctx, slots, probe, failed)


MAJORITY = Scheme(
    name="majority",
    summary="onebit only: signSGD with majority vote (Bernstein et al. 2018, 2019): each rank's chunk of the "
            "signs is voted on by its owner, the majority sign times the mean scale all-gathered (two_phase's "
            "bytes); never chosen by auto",
    run=majority, context=MajorityContext, steps=two_phase_steps, packet_bytes=_two_phase_packet,
    kernels=_two_phase_kernels, collectives=("all_to_all", "all_gather"), codecs="sign",
    slots=("residual", "server"), server=_two_phase_server, candidate=lambda codec: False)
