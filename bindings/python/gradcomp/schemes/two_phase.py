"""The ``two_phase`` scheme: a compressed reduce-scatter (all-to-all of chunk packets, each rank
sums its chunk) followed by a compressed all-gather, with error feedback on both sides.

It is the error-compensated compressed allreduce of DeepSpeed's 1-bit Adam (Tang et al., "1-bit
Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021:
``compressed_allreduce(buffer, worker_error, server_error)``) and ZeRO++'s quantized gradient
reduction qgZ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training", 2023), for any gradcomp codec: bytes per rank are about 2 (W-1)/W of one packet of the
whole bucket whatever W (the ``gather`` scheme sends (W-1) whole packets).

Protocol for a flat tensor of n elements over W ranks, this rank r (byte formulas and chunking in
:mod:`gradcomp.planner`):

1. chunks: c = ceil(n / W); chunk j = [j c, min(n, (j+1) c)), the last shorter, possibly empty;
2. encode chunk j of the tensor with the worker residual's slice (``slots["residual"]``, float32,
   n elements, gradient units) and ``divisor=W`` (``ctx.divisor``: W, or the full world size when
   two_phase runs across nodes inside ``hierarchical``) into slot j (P1 = packet_bytes(c, dtype) bytes;
   a shorter chunk's packet sits at the start of its slot, the rest is zero; an empty chunk is
   not encoded and its slot stays zero);
3. one ``all_to_all_single`` of the W * P1 bytes: slot j goes to rank j, so rank r receives the W
   packets of chunk r;
4. decode them in rank order 0..W-1 into one float32 accumulator zeroed first (``accumulate=True``:
   out = fl(out + D));
5. re-encode the accumulator with the server residual (``slots["server"]``, float32, the count of
   chunk r, in units of the average; divisor 1): it keeps what this second encode did not send;
   the packet goes to the start of a P2 = packet_bytes(c, float32) slot (zero after it);
6. ``all_gather_into_tensor`` of the W slots; every rank decodes slot j into chunk j of the tensor,
   rounding once into its dtype.

Every rank decodes the same bytes in the same order, so the result is bitwise identical on every
rank and run to run (no atomics, no reduction inside the engine). Steps 1-5 run in the calling
thread (the all-to-all is waited for there: on CUDA/NCCL that orders the current stream after it,
no host synchronization; on gloo it blocks the caller), so every collective of a process group is
issued from the calling thread in call order -- issuing the all-gather from a completion callback
could interleave differently with other buckets' collectives on different ranks. Step 6 is
asynchronous: the Future completes after the last decode.
"""

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..codec import Codec, _dtype_name, aligned_empty
from ..planner.bytes import all_gather_bytes, chunk, chunk_size, two_phase_slots
from .base import Scheme
from .check import check_headers, decode_from
from .collectives import all_gather_failsafe
from .context import NULL_PROBE, SchemeContext, collective_failed, completed, prefer_mismatch


class TwoPhaseContext(SchemeContext):
    """The ``two_phase`` scheme's buffers for tensors of ``numel`` elements of ``dtype`` on
    ``device`` over W ranks (``rank``: this rank in ``group``, default ``dist.get_rank(group)``):

    - ``chunks``: ``[(start, count)]`` of the W chunks (:func:`gradcomp.planner.chunk`);
      ``slot_bytes``: ``(P1, P2)`` (:func:`gradcomp.planner.two_phase_slots`);
    - ``packet``: uint8, the W all-to-all send slots of P1 bytes (chunk j's packet at ``[j P1,
      j P1 + packet_bytes(count_j, dtype))``, the rest of each slot zero: zeroed once here,
      encodes write only their packet); ``received``: uint8, W P1 (slot j: rank j's packet of
      chunk ``rank``);
    - ``acc``: float32, ``chunk_size`` elements: the sum of this rank's chunk (its count used);
    - ``server_packet``: uint8, P2 bytes, zeroed once (this rank's re-encoded chunk at its start);
      ``gathered``: uint8, the W all-gather slots of P2 bytes;
    - ``dec_codec``: a Codec of the same spec with its own workspace (decodes run in callbacks).
    """

    def __init__(self, codec: Codec, numel: int, dtype, device, group, world_size: int, *,
                 rank: Optional[int] = None, divisor: Optional[int] = None):
        W = int(world_size)
        like = torch.empty(0, device=device)
        p1, p2 = two_phase_slots(codec, numel, dtype, W)
        super().__init__(codec, group, W, packet=aligned_empty(like, W * p1), gathered=aligned_empty(like, W * p2),
                         acc=torch.empty(chunk_size(numel, W), dtype=torch.float32, device=device),
                         dec_codec=Codec(codec.spec), divisor=divisor)
        self.packet.zero_()
        self.rank = int(dist.get_rank(group) if rank is None else rank)
        self.chunks = [chunk(numel, W, j) for j in range(W)]
        self.slot_bytes = (p1, p2)
        self.received = aligned_empty(like, W * p1)
        self.server_packet = aligned_empty(like, p2)
        self.server_packet.zero_()


def two_phase_steps(codec, numel: int, dtype, world_size: int) -> list:
    """two_phase: one ``all_to_all`` of P1-byte slots ((W-1) P1 sent: a rank keeps its own
    chunk's slot), then one ``all_gather`` of a P2-byte slot ((W-1) P2)."""
    W = int(world_size)
    if W < 2:
        return []
    p1, p2 = two_phase_slots(codec, numel, dtype, W)
    return [("flat", "all_to_all", p1, W, float(all_gather_bytes(p1, W))),
            ("flat", "all_gather", p2, W, float(all_gather_bytes(p2, W)))]


def _two_phase_packet(codec, numel: int, dtype, world_size: int) -> int:
    p1, _ = two_phase_slots(codec, numel, dtype, world_size)
    return int(world_size) * p1  # the W slots the bucket is encoded into


def _two_phase_kernels(codec, numel, dtype, world_size, tp, ef):
    """The chunk encodes (the bucket), one float32 chunk re-encode, W chunk decodes and the
    bucket's decodes."""
    W = int(world_size)
    c = chunk_size(numel, W)
    return (tp.encode_s(codec, numel, dtype, ef) + tp.encode_s(codec, c, "float32", ef),
            W * tp.decode_s(codec, c, "float32") + tp.decode_s(codec, numel, dtype))


def _two_phase_server(ctx) -> Optional[tuple]:
    return ctx.chunks[ctx.rank]


def two_phase(tensor: torch.Tensor, ctx: SchemeContext, slots: Optional[Mapping[str, torch.Tensor]] = None,
              probe=None, check=None) -> torch.futures.Future:
    """Average ``tensor`` with any codec through the two-phase protocol of the module docstring.

    Args:
        tensor: C-contiguous float32/float16/bfloat16, any shape taken as flat (n elements),
            reduced in place.
        ctx: a context built for ``"two_phase"`` of tensor's numel, dtype and device
            (:meth:`SchemeContext.for_layout`: packet, received, server_packet, gathered, acc,
            chunks, slot_bytes, rank, dec_codec).
        slots: error feedback, or None/{}: ``"residual"``, the worker residual (float32, n
            elements: x' = g + r is encoded divided by W, r becomes x' - W * D); ``"server"``, the
            server residual of this rank's chunk (float32, its count: x'' = acc + s is encoded,
            s becomes x'' - D2). Either may be absent (a joined rank passes the server alone).
        probe: times ``"encode_s"`` (both encodes), ``"comm_s"`` (both collectives),
            ``"decode_s"`` (both decodes); sees both decode workspaces.
        check: a :class:`gradcomp.schemes.check.PeerCheck` launched before the all-to-all and
            verified after it (before any decode), or None.

    Returns:
        A Future holding ``tensor``, bitwise identical on every rank and run to run.

    Raises:
        gradcomp.InvalidArgumentError: from encode (dtype, size, device), at once.
        gradcomp.CollectiveError: the all-to-all failed (at once; the worker residual then holds
            this step's encode: the caller undoes it), or the all-gather (in the Future).
        gradcomp.RankMismatchError: ``check`` found ranks that disagree (at once, on every rank),
            or a received packet's header differs (:func:`gradcomp.schemes.check.check_headers`).
        gradcomp.CorruptPacketError: (CPU) a received packet that fails validation: in the Future.
            A rank whose own chunk fails (a mismatched or corrupt packet) still takes part in the
            all-gather with a zeroed slot, so every rank's Future then fails (the zeroed slot is
            named as that rank's failure) instead of some ranks waiting forever.
    """
    W = ctx.world_size
    if W == 1 or tensor.numel() == 0:
        return completed(tensor)
    probe = probe or NULL_PROBE
    failed = reduce_scatter_phase(tensor, ctx, slots, probe, check)
    return all_gather_phase(tensor, ctx, slots, probe, failed)


def _sum_packets(ctx, dec, packets, ws) -> None:
    """Step 4: decode the W packets of this rank's chunk in rank order into ``ctx.acc`` (zeroed
    first; accumulate)."""
    acc = ctx.acc[:ctx.chunks[ctx.rank][1]]
    acc.zero_()
    for j, p in enumerate(packets):
        decode_from(dec, p, j, "scheme 'two_phase': the all-to-all of the chunk packets", out=acc, accumulate=True,
                    workspace=ws)


def reduce_scatter_phase(tensor: torch.Tensor, ctx: TwoPhaseContext, slots=None, probe=None,
                         check=None, combine=_sum_packets) -> Optional[BaseException]:
    """Steps 1-4 of the module docstring, a compressed reduce-scatter: encode the W chunks of
    ``tensor`` (with the worker residual ``slots["residual"]``, divisor ``ctx.divisor``), one
    ``all_to_all_single`` in the calling thread, and ``combine(ctx, dec, packets, ws)`` the W
    packets of this rank's chunk (rank order) into ``ctx.acc[:count]``: by default their decoded
    sum (float32, the sum over the ranks of chunk ``ctx.rank`` divided by the divisor; the
    ``majority`` scheme counts signs instead); nothing for an empty chunk.

    Returns:
        None, or the error of this rank's decode (a mismatched or corrupt packet): the caller
        still takes part in its next collective, so that no rank waits forever.

    Raises:
        gradcomp.InvalidArgumentError: from encode. gradcomp.CollectiveError: the all-to-all
        failed. gradcomp.RankMismatchError: ``check`` found ranks that disagree (on every rank).
    """
    probe = probe or NULL_PROBE
    flat = tensor.view(-1)
    W = ctx.world_size
    residual = slots.get("residual") if slots else None
    p1, _ = ctx.slot_bytes
    codec, dec = ctx.codec, ctx.dec_codec
    dtype = tensor.dtype

    t0 = probe.clock("encode_s")
    for j, (a, m) in enumerate(ctx.chunks):
        if m:
            codec.encode(flat[a: a + m], residual=None if residual is None else residual[a: a + m],
                         out=ctx.packet[j * p1: j * p1 + codec.packet_bytes(m, dtype)], divisor=ctx.divisor,
                         key=ctx.key_for(j))
    probe.tock("encode_s", t0)
    t1 = probe.clock("comm_s")
    if check is not None:
        check.launch()
    try:
        dist.all_to_all_single(ctx.received, ctx.packet, group=ctx.group)
    except Exception as e:  # noqa: BLE001 - a failed collective: named, cause kept
        err = prefer_mismatch(check)(collective_failed("scheme 'two_phase': the all-to-all of the chunk packets", e))
        raise err from e
    probe.tock("comm_s", t1)
    if check is not None:
        check.verify()  # every rank sees the same descriptors: all raise here, or none

    _, mine = ctx.chunks[ctx.rank]
    if not mine:
        return None
    try:
        t2 = probe.clock("decode_s")
        q1 = codec.packet_bytes(mine, dtype)
        check_headers(ctx.received, p1, [(j, mine) for j in range(W)], ctx.packet[ctx.rank * p1:],
                      _dtype_name(dtype), "scheme 'two_phase': the all-to-all of the chunk packets")
        ws = dec.workspace(ctx.received, mine, "float32")
        combine(ctx, dec, [ctx.received[j * p1: j * p1 + q1] for j in range(W)], ws)
        probe.decoded(ws)
        probe.tock("decode_s", t2)
    except Exception as e:  # noqa: BLE001 - re-raised through the Future after the all-gather
        return e
    return None


def all_gather_phase(tensor: torch.Tensor, ctx: TwoPhaseContext, slots=None, probe=None,
                     failed: Optional[BaseException] = None) -> torch.futures.Future:
    """Steps 5-6 of the module docstring, a compressed all-gather: re-encode this rank's chunk
    sum ``ctx.acc[:count]`` with the server residual ``slots["server"]`` (divisor 1) into
    ``ctx.server_packet`` (zeroed instead when ``failed`` or the encode fails), all-gather the W
    slots asynchronously, and decode slot j into chunk j of ``tensor``.

    Returns:
        A Future holding ``tensor``; it raises ``failed`` (or the re-encode's error) after the
        all-gather, a :class:`gradcomp.CollectiveError` when the all-gather fails, and
        :class:`gradcomp.RankMismatchError` when a gathered header differs.
    """
    probe = probe or NULL_PROBE
    flat = tensor.view(-1)
    server = slots.get("server") if slots else None
    p1, p2 = ctx.slot_bytes
    codec, dec = ctx.codec, ctx.dec_codec
    _, mine = ctx.chunks[ctx.rank]
    if mine and failed is None:
        try:
            t3 = probe.clock("encode_s")
            codec.encode(ctx.acc[:mine], residual=server,
                         out=ctx.server_packet[: codec.packet_bytes(mine, "float32")], divisor=1,
                         key=ctx.key_for(ctx.world_size + ctx.rank))
            probe.tock("encode_s", t3)
        except Exception as e:  # noqa: BLE001 - re-raised through the Future after the all-gather
            failed = e
    # all_gather_failsafe zeroes the slot of a rank that failed (an empty chunk's slot is zero already)
    ref = ctx.packet[ctx.rank * p1:] if mine else next(ctx.packet[j * p1:] for j, (_, m) in enumerate(ctx.chunks) if m)

    def finish():
        check_headers(ctx.gathered, p2, [(j, m) for j, (_, m) in enumerate(ctx.chunks) if m], ref, "float32",
                      "scheme 'two_phase': the all-gather of the summed chunks")
        t5 = probe.clock("decode_s")
        ws = dec.workspace(ctx.gathered, len(ctx.acc), "float32")
        for j, (a, m) in enumerate(ctx.chunks):
            if m:
                decode_from(dec, ctx.gathered[j * p2: j * p2 + dec.packet_bytes(m, "float32")], j,
                            "scheme 'two_phase': the all-gather of the summed chunks", out=flat[a: a + m], workspace=ws)
        probe.decoded(ws)
        probe.tock("decode_s", t5)
        return tensor

    return all_gather_failsafe(ctx.gathered, ctx.server_packet, ctx.group, failed, finish,
                               "scheme 'two_phase': the all-gather of the summed chunks", probe=probe,
                               device=tensor.device)


TWO_PHASE = Scheme(
    name="two_phase",
    summary="any codec: a compressed reduce-scatter (all-to-all of chunk packets), then an all-gather of the "
            "re-encoded chunk sums, error feedback on both sides (DeepSpeed 1-bit Adam, ZeRO++ qgZ)",
    run=two_phase, context=TwoPhaseContext, steps=two_phase_steps, packet_bytes=_two_phase_packet,
    kernels=_two_phase_kernels, collectives=("all_to_all", "all_gather"), slots=("residual", "server"),
    server=_two_phase_server, candidate=lambda codec: not codec.properties["linear"])
