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

from .check import check_headers
from .context import NULL_PROBE, SchemeContext, chain, collective_failed, completed, prefer_mismatch


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
    n = tensor.numel()
    if W == 1 or n == 0:
        return completed(tensor)
    probe = probe or NULL_PROBE
    flat = tensor.view(-1)
    residual = slots.get("residual") if slots else None
    server = slots.get("server") if slots else None
    p1, p2 = ctx.slot_bytes
    codec, dec = ctx.codec, ctx.dec_codec
    dtype = tensor.dtype

    t0 = probe.clock()
    for j, (a, m) in enumerate(ctx.chunks):
        if m:
            codec.encode(flat[a: a + m], residual=None if residual is None else residual[a: a + m],
                         out=ctx.packet[j * p1: j * p1 + codec.packet_bytes(m, dtype)], divisor=ctx.divisor)
    probe.tock("encode_s", t0)
    t1 = probe.clock()
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

    failed: Optional[BaseException] = None
    _, mine = ctx.chunks[ctx.rank]
    if mine:
        try:
            t2 = probe.clock()
            q1 = codec.packet_bytes(mine, dtype)
            check_headers(ctx.received, p1, [(j, mine) for j in range(W)], ctx.packet[ctx.rank * p1:],
                          str(dtype).replace("torch.", ""), "scheme 'two_phase': the all-to-all of the chunk packets")
            acc = ctx.acc[:mine]
            acc.zero_()
            ws = dec.workspace(ctx.received, mine, "float32")
            for j in range(W):
                dec.decode(ctx.received[j * p1: j * p1 + q1], out=acc, accumulate=True, workspace=ws)
            probe.decoded(ws)
            probe.tock("decode_s", t2)
            t3 = probe.clock()
            codec.encode(acc, residual=server, out=ctx.server_packet[: codec.packet_bytes(mine, "float32")],
                         divisor=1)
            probe.tock("encode_s", t3)
        except Exception as e:  # noqa: BLE001 - re-raised through the Future after the all-gather
            failed = e
            ctx.server_packet.zero_()
    t4 = probe.clock()
    work = dist.all_gather_into_tensor(ctx.gathered, ctx.server_packet, group=ctx.group, async_op=True)
    ref = ctx.packet[ctx.rank * p1:] if mine else next(ctx.packet[j * p1:] for j, (_, m) in enumerate(ctx.chunks) if m)

    def done(_):
        probe.tock("comm_s", t4)
        if failed is not None:
            raise failed
        check_headers(ctx.gathered, p2, [(j, m) for j, (_, m) in enumerate(ctx.chunks) if m], ref, "float32",
                      "scheme 'two_phase': the all-gather of the summed chunks")
        t5 = probe.clock()
        ws = dec.workspace(ctx.gathered, len(ctx.acc), "float32")
        for j, (a, m) in enumerate(ctx.chunks):
            if m:
                dec.decode(ctx.gathered[j * p2: j * p2 + dec.packet_bytes(m, "float32")], out=flat[a: a + m],
                           workspace=ws)
        probe.decoded(ws)
        probe.tock("decode_s", t5)
        return tensor

    return chain(work.get_future(), done, "scheme 'two_phase': the all-gather of the summed chunks",
                 device=tensor.device)
