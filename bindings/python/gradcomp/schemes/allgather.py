"""The ``gather`` scheme: all-gather fixed-size packets, decode all W in rank order.

Top-k with locally kept residuals is Aji & Heafield, "Sparse Communication for Distributed
Gradient Descent" (EMNLP 2017) and Lin et al., "Deep Gradient Compression" (ICLR 2018); a sparse
packet cannot be summed on the wire, so every rank receives every packet (deterministic, no
atomics; bytes per rank grow with W)."""

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..codec import Codec, _dtype_name, aligned_empty
from ..planner.bytes import all_gather_bytes
from .allreduce import SumContext, _packet
from .base import Scheme
from .check import check_headers, decode_from
from .context import SchemeContext, completed, one_round


class GatherContext(SumContext):
    """The ``gather`` scheme's buffers: those of :class:`gradcomp.schemes.allreduce.SumContext`
    (``packet``, ``dec_codec``), ``gathered`` (uint8, W packets back to back, rank r at ``[r P,
    (r + 1) P)``) and ``acc`` (float32, ``numel`` elements: the decode accumulator)."""

    def __init__(self, codec: Codec, numel: int, dtype, device, group, world_size: int, *,
                 rank: Optional[int] = None, divisor: Optional[int] = None):
        super().__init__(codec, numel, dtype, device, group, world_size, divisor=divisor)
        self.gathered = aligned_empty(self.packet, self.packet.numel() * self.world_size)
        self.acc = torch.empty(numel, dtype=torch.float32, device=device)


def gather_steps(codec, numel: int, dtype, world_size: int) -> list:
    """gather: one ``all_gather`` of this rank's packet, (W-1) P bytes."""
    W = int(world_size)
    if W < 2:
        return []
    p = int(codec.packet_bytes(numel, dtype))
    return [("flat", "all_gather", p, W, float(all_gather_bytes(p, W)))]


def _gather_kernels(codec, numel, dtype, world_size, tp, ef):
    return tp.encode_s(codec, numel, dtype, ef), int(world_size) * tp.decode_s(codec, numel, dtype)


def gather(tensor: torch.Tensor, ctx: SchemeContext, slots: Optional[Mapping[str, torch.Tensor]] = None,
           probe=None, check=None) -> torch.futures.Future:
    """Average ``tensor`` with any codec: encode ``(g + r) / W`` (W = ``ctx.divisor``, the group
    size unless the context says otherwise) into ``ctx.packet``,
    ``all_gather_into_tensor`` the W packets (P bytes each) into ``ctx.gathered``, zero the float32
    accumulator ``ctx.acc``, decode the packets of ranks 0..W-1 in that order into it with
    ``accumulate=True`` (out = fl(out + D), float32), and round once into ``tensor``.

    Args:
        tensor: C-contiguous float32/float16/bfloat16, any shape taken as flat, reduced in place.
        ctx: a context built for ``"gather"`` (packet, gathered, acc, dec_codec).
        slots: ``{"residual": float32 flat tensor of numel}`` for error feedback, or None/{}.
        probe: times ``"encode_s"``, ``"comm_s"``, ``"decode_s"``; sees the decode workspace.
        check: a :class:`gradcomp.schemes.check.PeerCheck`, or None.

    Before decoding, every gathered packet's header (CPU) is compared with this rank's own: a
    packet of another codec, spec or numel, or the empty slot of a rank that failed, raises
    :class:`gradcomp.RankMismatchError` naming the rank (:func:`gradcomp.schemes.check.
    check_headers`).

    Returns:
        A Future holding ``tensor``, bitwise identical on every rank and run to run; it raises
        :class:`gradcomp.CollectiveError` when the all-gather fails (nothing is decoded) and
        :class:`gradcomp.RankMismatchError` as above.

    Raises:
        gradcomp.InvalidArgumentError: from encode (dtype, size, device).
        gradcomp.CorruptPacketError: (CPU, in the Future) a gathered packet that fails validation.
    """
    W = ctx.world_size
    if W == 1:
        return completed(tensor)

    def communicate():
        return dist.all_gather_into_tensor(ctx.gathered, ctx.packet, group=ctx.group, async_op=True)

    n, dtype = tensor.numel(), _dtype_name(tensor.dtype)

    def receipt():
        check_headers(ctx.gathered, ctx.packet.numel(), [(r, n) for r in range(W)], ctx.packet, dtype,
                      "scheme 'gather': the all-gather of the packets")

    def decode(dec, ws):
        pbytes = ctx.packet.numel()
        ctx.acc.zero_()
        for r in range(W):
            decode_from(dec, ctx.gathered[r * pbytes: (r + 1) * pbytes], r, "scheme 'gather': the all-gather of the packets",
                        out=ctx.acc, accumulate=True, workspace=ws)
        tensor.view(-1).copy_(ctx.acc)

    return one_round(tensor, ctx, slots, probe, communicate, decode, "scheme 'gather': the all-gather of the packets",
                     check=check, receipt=receipt)


GATHER = Scheme(
    name="gather", summary="any codec: all-gather the fixed-size packets, every rank decodes all W in rank order",
    run=gather, context=GatherContext, steps=gather_steps, packet_bytes=_packet, kernels=_gather_kernels,
    collectives=("all_gather",))
