"""The ``rs_ag`` scheme: the uncompressed allreduce as its two ring halves, a reduce-scatter and
then an all-gather (the decomposition of Patarasuk & Yuan, "Bandwidth optimal all-reduce
algorithms for clusters of workstations", JPDC 2009). It compresses nothing and ``auto`` never
takes it: it is the smallest scheme there is, kept as the example (and the test) of what a new
scheme is -- this file and one line in :mod:`gradcomp.schemes.table`; the compressor, the
planner, the CLI and the error messages learn of it from the table.

Protocol for a flat tensor of n elements over W ranks (c = ceil(n / W)): copy it into ``ctx.buf``
(the tensor's dtype, W c elements, the padding zero), divide by W there, ``reduce_scatter_tensor``
(SUM) into ``ctx.part`` (c elements: chunk ``rank``), ``all_gather_into_tensor`` back into
``ctx.buf``, copy the first n elements into ``tensor``. Both collectives are issued in the calling
thread, the all-gather asynchronously; the Future completes after the copy.
"""

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..codec import Codec
from ..planner.bytes import all_gather_bytes, chunk_size, dense_bytes
from .allreduce import _dense_packet, _no_kernels
from .base import Scheme
from .context import NULL_PROBE, SchemeContext, chain, collective_failed, completed, prefer_mismatch


class RsAgContext(SchemeContext):
    """``buf``: the tensor dtype, W c elements (zeroed once); ``part``: c elements."""

    def __init__(self, codec: Codec, numel: int, dtype, device, group, world_size: int, *,
                 rank: Optional[int] = None, divisor: Optional[int] = None):
        super().__init__(codec, group, world_size, divisor=divisor)
        c = chunk_size(numel, self.world_size)
        self.buf = torch.zeros(self.world_size * c, dtype=dtype, device=device)
        self.part = torch.empty(c, dtype=dtype, device=device)


def rs_ag(tensor: torch.Tensor, ctx: RsAgContext, slots: Optional[Mapping[str, torch.Tensor]] = None,
          probe=None, check=None) -> torch.futures.Future:
    """Average ``tensor`` (any dtype torch.distributed sums, strided, n elements) in place, as
    the module docstring says. ``slots`` is unused (nothing is compressed).

    Returns:
        A Future holding ``tensor``; it raises :class:`gradcomp.CollectiveError` when a
        collective fails and :class:`gradcomp.RankMismatchError` when ``check`` finds ranks that
        disagree.
    """
    n = tensor.numel()
    if ctx.world_size == 1 or n == 0:
        return completed(tensor)
    probe = probe or NULL_PROBE
    flat = tensor.view(-1)
    t0 = probe.clock("comm_s")
    ctx.buf[:n].copy_(flat)
    ctx.buf.div_(ctx.divisor)
    if check is not None:
        check.launch()
    try:
        dist.reduce_scatter_tensor(ctx.part, ctx.buf, group=ctx.group)
    except Exception as e:  # noqa: BLE001 - a failed collective: named, cause kept
        raise prefer_mismatch(check)(collective_failed("scheme 'rs_ag': the reduce-scatter", e)) from e
    if check is not None:
        check.verify()
    work = dist.all_gather_into_tensor(ctx.buf, ctx.part, group=ctx.group, async_op=True)

    def done(_):
        probe.tock("comm_s", t0)
        flat.copy_(ctx.buf[:n])
        return tensor

    return chain(work.get_future(), done, "scheme 'rs_ag': the all-gather", device=tensor.device)


def rs_ag_steps(codec, numel: int, dtype, world_size: int) -> list:
    """A ``reduce_scatter`` of the padded bucket ((W-1)/W of W c elements) and an ``all_gather``
    of one chunk per rank ((W-1) c elements), in the bucket dtype."""
    W = int(world_size)
    if W < 2:
        return []
    c = chunk_size(numel, W)
    d = dense_bytes(W * c, dtype)
    part = dense_bytes(c, dtype)
    return [("flat", "reduce_scatter", d, W, (W - 1) / W * d),
            ("flat", "all_gather", part, W, float(all_gather_bytes(part, W)))]


RS_AG = Scheme(
    name="rs_ag", summary="uncompressed: a reduce-scatter, then an all-gather (the example scheme; auto never takes it)",
    run=rs_ag, context=RsAgContext, steps=rs_ag_steps,
    packet_bytes=_dense_packet, kernels=_no_kernels,
    collectives=("reduce_scatter", "all_gather"), slots=(), candidate=lambda codec: False)
