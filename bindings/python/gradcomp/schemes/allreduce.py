"""The two schemes that are one SUM allreduce: ``dense`` (the tensor itself) and ``sum`` (a linear
codec's payload). Semantics of ``dense`` follow PyTorch's ``allreduce_hook`` and of the fp16 path
``fp16_compress_hook`` (``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``): divide
by W, then SUM; ``sum`` divides at encode instead, so fp16 does not overflow when |g| > 65504 but
|g| / W fits."""

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..codec import Codec, aligned_empty
from ..planner.bytes import dense_bytes, dtype_bytes, payload_bytes, ring_allreduce_bytes
from .base import Scheme
from .context import NULL_PROBE, SchemeContext, chain, completed, one_round, prefer_mismatch


class SumContext(SchemeContext):
    """The ``sum`` scheme's buffers for tensors of ``numel`` elements of ``dtype`` on ``device``:
    ``packet`` (uint8, 16-byte aligned, ``codec.packet_bytes(numel, dtype)`` bytes) and
    ``dec_codec`` (a Codec of the same spec with its own workspace: decodes run in future
    callbacks, possibly on another thread than the encodes). ``rank`` is not used."""

    def __init__(self, codec: Codec, numel: int, dtype, device, group, world_size: int, *,
                 rank: Optional[int] = None, divisor: Optional[int] = None):
        pbytes = codec.packet_bytes(numel, dtype)
        super().__init__(codec, group, world_size, packet=aligned_empty(torch.empty(0, device=device), pbytes),
                         dec_codec=Codec(codec.spec), divisor=divisor)


def dense_context(codec: Codec, numel: int, dtype, device, group, world_size: int, *,
                  rank: Optional[int] = None, divisor: Optional[int] = None) -> SchemeContext:
    """The ``dense`` scheme's context: only the group, the world size and the divisor."""
    return SchemeContext(codec, group, world_size, divisor=divisor)


def dense_steps(codec, numel: int, dtype, world_size: int) -> list:
    """dense: one ``allreduce`` of the bucket, ``2 (W-1)/W`` of its bytes (none for W = 1)."""
    W = int(world_size)
    if W < 2:
        return []
    d = dense_bytes(numel, dtype)
    return [("flat", "allreduce", d, W, ring_allreduce_bytes(d, W))]


def sum_steps(codec, numel: int, dtype, world_size: int) -> list:
    """sum: one ``allreduce`` of the codec's payload (:func:`gradcomp.planner.payload_bytes`)."""
    W = int(world_size)
    if W < 2:
        return []
    p = payload_bytes(codec, numel, dtype)
    return [("flat", "allreduce", p, W, ring_allreduce_bytes(p, W))]


def _dense_packet(codec, numel: int, dtype, world_size: int) -> int:
    return dense_bytes(numel, dtype)  # dense sends the bucket itself


def _packet(codec, numel: int, dtype, world_size: int) -> int:
    return int(codec.packet_bytes(numel, dtype))


def _no_kernels(codec, numel, dtype, world_size, throughput, error_feedback):
    return 0.0, 0.0


def _sum_kernels(codec, numel, dtype, world_size, tp, ef):
    return tp.encode_s(codec, numel, dtype, ef), tp.decode_s(codec, numel, dtype)


def dense(tensor: torch.Tensor, ctx: SchemeContext, slots: Optional[Mapping[str, torch.Tensor]] = None,
          probe=None, check=None) -> torch.futures.Future:
    """Average ``tensor`` uncompressed: ``tensor /= W`` (in its dtype; ``ctx.divisor``, W unless
    the context says otherwise), then one SUM allreduce.

    Args:
        tensor: any dtype torch.distributed can sum (dense or sparse), reduced in place.
        ctx: only ``world_size``, ``divisor`` and ``group`` are used.
        slots: unused (dense sends every value; residual flushing is the caller's).
        probe: times ``"comm_s"`` (launch to completion).
        check: a :class:`gradcomp.schemes.check.PeerCheck` launched before the allreduce and
            verified before the Future completes, or None.

    Returns:
        A Future holding the reduced tensor (``tensor``, written in place); it raises
        :class:`gradcomp.CollectiveError` when the allreduce fails (``tensor`` then holds no
        average) and :class:`gradcomp.RankMismatchError` when ``check`` finds ranks that disagree.
    """
    if ctx.world_size == 1:
        return completed(tensor)
    tensor.div_(ctx.divisor)
    return sum_allreduce(tensor, ctx.group, "scheme 'dense': the allreduce", probe, check)


def sum_allreduce(tensor: torch.Tensor, group, what: str, probe=None, check=None) -> torch.futures.Future:
    """One asynchronous SUM allreduce of ``tensor`` in place over ``group``: the collective of
    ``dense`` and of PowerSGD's two rounds (:mod:`gradcomp.torch.powersgd`).

    Args:
        tensor: any dtype torch.distributed can sum (dense or sparse).
        group: the process group (None: the default group).
        what: the collective, for the error message (e.g. "scheme 'dense': the allreduce").
        probe: times ``"comm_s"`` (launch to completion).
        check: a :class:`gradcomp.schemes.check.PeerCheck` launched before the allreduce and
            verified before the Future completes, or None.

    Returns:
        A Future holding the summed tensor; it raises :class:`gradcomp.CollectiveError` naming
        ``what`` when the allreduce fails and :class:`gradcomp.RankMismatchError` when ``check``
        finds ranks that disagree (preferred over the collective's error).
    """
    probe = probe or NULL_PROBE
    t0 = probe.clock("comm_s")
    if check is not None:
        check.launch()
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def done(value):
        probe.tock("comm_s", t0)
        if check is not None:
            check.verify()
        return value[0]

    return chain(fut, done, what, on_error=prefer_mismatch(check), device=tensor.device)


def sum(tensor: torch.Tensor, ctx: SchemeContext, slots: Optional[Mapping[str, torch.Tensor]] = None,  # noqa: A001
        probe=None, check=None) -> torch.futures.Future:
    """Average ``tensor`` with a linear codec: encode ``(g + r) / W`` (W = ``ctx.divisor``, the
    group size unless the context says otherwise) into ``ctx.packet``, one SUM allreduce of the
    payload view ``codec.payload(numel, dtype)`` (the header stays local), decode the summed
    packet into ``tensor``.

    For none/fp16/bf16 the payload holds the numel values in order (summed as a dense allreduce
    of them would be) and, where the codec defines one, a wire element (0 or NaN) that keeps a
    non-finite value visible after the sum.

    Args:
        tensor: C-contiguous float32/float16/bfloat16, any shape taken as flat, reduced in place.
        ctx: a context built for ``"sum"`` (packet, dec_codec) of tensor's numel, dtype, device.
        slots: ``{"residual": float32 flat tensor of numel}`` for error feedback, or None/{}.
        probe: times ``"encode_s"``, ``"comm_s"``, ``"decode_s"``; sees the decode workspace.
        check: a :class:`gradcomp.schemes.check.PeerCheck` (the payload carries no header, so
            this is what sees ranks that disagree), or None.

    Returns:
        A Future holding ``tensor``. It raises :class:`gradcomp.CollectiveError` when the
        allreduce fails (nothing is decoded: the packet holds only this rank's share),
        :class:`gradcomp.RankMismatchError` when ``check`` finds ranks that disagree.

    Raises:
        gradcomp.InvalidArgumentError: from encode (dtype, size, device).
        gradcomp.CorruptPacketError: (CPU, in the Future) a summed packet that fails validation.
    """
    if ctx.world_size == 1:
        return completed(tensor)

    def communicate():
        off, cnt, wire = ctx.codec.payload(tensor.numel(), tensor.dtype)
        view = ctx.packet[off: off + cnt * dtype_bytes(wire)].view(getattr(torch, wire))
        return dist.all_reduce(view, group=ctx.group, async_op=True)

    def decode(dec, ws):
        dec.decode(ctx.packet, out=tensor, workspace=ws)

    return one_round(tensor, ctx, slots, probe, communicate, decode, "scheme 'sum': the allreduce of the payload",
                     check=check)


DENSE = Scheme(
    name="dense", summary="the bucket itself, divided by W, through one SUM allreduce (PyTorch's allreduce_hook)",
    run=dense, context=dense_context, steps=dense_steps, packet_bytes=_dense_packet, kernels=_no_kernels,
    collectives=("allreduce",), slots=())

SUM = Scheme(
    name="sum", summary="linear codecs: one SUM allreduce of the packet's payload (encode divides by W)",
    run=sum, context=SumContext, steps=sum_steps, packet_bytes=_packet, kernels=_sum_kernels,
    collectives=("allreduce",), codecs="linear")
