"""The narrow context a scheme runs in, and the probe interface it reports through.

A scheme sees only a :class:`SchemeContext` (codec, process group, world size and the buffers of
one bucket layout) and a probe; never the hook or compressor state, so nothing here imports
upwards (dependency direction: torch -> schemes -> planner -> codec -> _C).
"""

from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .. import planner
from ..codec import Codec, aligned_empty


class SchemeContext:
    """Codec, group and per-layout buffers for reducing tensors of one (numel, dtype, device).

    Attributes:
        codec: the :class:`gradcomp.Codec` that encodes (its workspace is the caller thread's).
        group: the ``torch.distributed`` process group (None: the default group).
        world_size: W, the group's size.
        packet: uint8, 16-byte aligned, on the layout's device: ``codec.packet_bytes(numel,
            dtype)`` bytes (sum, gather); for two_phase the W all-to-all slots of P1 bytes, chunk
            j's packet at ``[j * P1, j * P1 + packet_bytes(count_j, dtype))``, the rest of each
            slot zero (zeroed once here; encodes write only their packet); None for dense.
        gathered: uint8, W packets back to back, rank r at ``[r * P, (r + 1) * P)`` (gather);
            for two_phase the W all-gather slots of P2 bytes (rank r's re-encoded chunk r).
        acc: float32: the gather scheme's accumulator (numel elements); two_phase's sum of this
            rank's chunk (``chunk_size`` elements; the chunk's count are used).
        dec_codec: a second Codec of the same spec with its own workspace, because decodes run in
            future callbacks, possibly on another thread than the encodes (sum, gather, two_phase).
        rank: this rank in ``group`` (two_phase: the chunk it sums), else None.
        chunks: two_phase: ``[(start, count)]`` of the W chunks (:func:`gradcomp.planner.chunk`).
        slot_bytes: two_phase: ``(P1, P2)`` (:func:`gradcomp.planner.two_phase_slots`).
        received: two_phase: uint8, W * P1: slot j holds rank j's packet of chunk ``rank``.
        server_packet: two_phase: uint8, P2 bytes, zeroed once: this rank's re-encoded chunk at
            its start, zero after it (and all zero when its chunk is empty).
    """

    def __init__(self, codec: Codec, group: Any, world_size: int, packet: Optional[torch.Tensor] = None,
                 gathered: Optional[torch.Tensor] = None, acc: Optional[torch.Tensor] = None,
                 dec_codec: Optional[Codec] = None):
        self.codec = codec
        self.group = group
        self.world_size = int(world_size)
        self.packet = packet
        self.gathered = gathered
        self.acc = acc
        self.dec_codec = dec_codec
        self.rank: Optional[int] = None
        self.chunks: list = []
        self.slot_bytes: Tuple[int, int] = (0, 0)
        self.received: Optional[torch.Tensor] = None
        self.server_packet: Optional[torch.Tensor] = None

    @classmethod
    def for_layout(cls, scheme: str, codec: Codec, numel: int, dtype: torch.dtype, device: torch.device,
                   group: Any, world_size: int, rank: Optional[int] = None) -> "SchemeContext":
        """Allocate what ``scheme`` needs for tensors of ``numel`` elements of ``dtype`` on
        ``device``: nothing for dense; the packet and the decode codec for sum; also the gathered
        packets (W * packet bytes) and the float32 accumulator (numel) for gather; for two_phase
        the W * P1 send and receive slots, the P2 server packet, the W * P2 gathered slots and a
        float32 accumulator of one chunk (``rank``: this rank in ``group``, default
        ``dist.get_rank(group)``).

        Raises:
            ValueError: an unknown scheme.
        """
        if scheme == "dense":
            return cls(codec, group, world_size)
        if scheme == "two_phase":
            return cls._two_phase(codec, numel, dtype, device, group, world_size, rank)
        if scheme not in ("sum", "gather"):
            raise ValueError(f"SchemeContext: scheme={scheme!r}; accepted: dense, sum, gather, two_phase")
        pbytes = codec.packet_bytes(numel, dtype)
        packet = aligned_empty(torch.empty(0, device=device), pbytes)
        ctx = cls(codec, group, world_size, packet=packet, dec_codec=Codec(codec.spec))
        if scheme == "gather":
            ctx.gathered = aligned_empty(packet, pbytes * ctx.world_size)
            ctx.acc = torch.empty(numel, dtype=torch.float32, device=device)
        return ctx

    @classmethod
    def _two_phase(cls, codec, numel, dtype, device, group, world_size, rank) -> "SchemeContext":
        W = int(world_size)
        like = torch.empty(0, device=device)
        p1, p2 = planner.two_phase_slots(codec, numel, dtype, W)
        ctx = cls(codec, group, W, packet=aligned_empty(like, W * p1), gathered=aligned_empty(like, W * p2),
                  acc=torch.empty(planner.chunk_size(numel, W), dtype=torch.float32, device=device),
                  dec_codec=Codec(codec.spec))
        ctx.packet.zero_()
        ctx.rank = int(dist.get_rank(group) if rank is None else rank)
        ctx.chunks = [planner.chunk(numel, W, j) for j in range(W)]
        ctx.slot_bytes = (p1, p2)
        ctx.received = aligned_empty(like, W * p1)
        ctx.server_packet = aligned_empty(like, p2)
        ctx.server_packet.zero_()
        return ctx


class NullProbe:
    """The probe interface, doing nothing (what a scheme uses when given ``probe=None``).

    A probe has three methods, called by the schemes in this order per phase:
      - ``clock()``: a start token (a ``time.perf_counter()`` float, a CUDA event, ...);
      - ``tock(field, start)``: the phase ``field`` (``"encode_s"``, ``"comm_s"``,
        ``"decode_s"``) ended; ``start`` is the token from ``clock()``;
      - ``decoded(workspace)``: the decodes of this call are enqueued on ``workspace`` (uint8, its
        first 4 bytes the little-endian status word), so a probe may copy the status out.
    """

    def clock(self):
        return None

    def tock(self, field: str, start) -> None:
        pass

    def decoded(self, workspace) -> None:
        pass


NULL_PROBE = NullProbe()


def completed(tensor: torch.Tensor) -> torch.futures.Future:
    """A Future already holding ``tensor`` (what every scheme returns for world size 1)."""
    fut = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def one_round(tensor: torch.Tensor, ctx: SchemeContext, slots, probe, communicate: Callable[[], Any],
              decode: Callable[[Codec, torch.Tensor], None]) -> torch.futures.Future:
    """The shape of a one-collective compressed scheme: encode, communicate, decode.

    Encodes ``tensor`` into ``ctx.packet`` with ``divisor=W`` -- with error feedback through the
    ``"residual"`` slot when ``slots`` holds one (the packet then carries ``(g + r) / W``
    compressed and ``r`` becomes ``g + r - W * decode(packet)``) -- then launches
    ``communicate()`` (an async ``torch.distributed`` Work over the packet) and, once it completes,
    calls ``decode(dec_codec, workspace)``, which must leave the average in ``tensor``. Phases are
    timed as ``"encode_s"``, ``"comm_s"``, ``"decode_s"``; the probe sees the decode workspace.

    Returns:
        A Future holding ``tensor`` (errors of the collective or the decode are raised by it).
    """
    probe = probe or NULL_PROBE
    residual = slots.get("residual") if slots else None
    t0 = probe.clock()
    ctx.codec.encode(tensor, residual=residual, out=ctx.packet, divisor=ctx.world_size)
    probe.tock("encode_s", t0)
    t1 = probe.clock()
    work = communicate()

    def done(f):
        probe.tock("comm_s", t1)
        t2 = probe.clock()
        ws = ctx.dec_codec.workspace(ctx.packet)
        decode(ctx.dec_codec, ws)
        probe.decoded(ws)
        probe.tock("decode_s", t2)
        return tensor

    return work.get_future().then(done)
