"""The narrow context a scheme runs in, and the probe interface it reports through.

A scheme sees only a :class:`SchemeContext` (codec, process group, world size and the buffers of
one bucket layout) and a probe; never the hook or compressor state, so nothing here imports
upwards (dependency direction: torch -> schemes -> planner -> codec -> _C).
"""

import atexit
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .. import _C, planner
from ..codec import Codec, aligned_empty
from ..errors import CollectiveError, RankMismatchError
from .groups import engine_of, hierarchical_groups_for


class SchemeContext:
    """Codec, group and per-layout buffers for reducing tensors of one (numel, dtype, device).

    Attributes:
        codec: the :class:`gradcomp.Codec` that encodes (its workspace is the caller thread's).
        group: the ``torch.distributed`` process group (None: the default group).
        world_size: W, the group's size.
        divisor: what encodes divide by (and ``dense`` divides by) so that the group's SUM of the
            packets is the average: W by default; the inner context of ``hierarchical`` (a chunk
            over the N ranks of one local rank) divides by the full world size instead, since
            its inputs are node sums.
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

    Attributes of a ``hierarchical`` context (L ranks per node, N = W / L nodes, c = ceil(n / L);
    :mod:`gradcomp.schemes.hierarchical`, groups from :mod:`gradcomp.schemes.groups`):
        local_world_size: L; nodes: N; node: rank // L; local_rank: rank % L (the chunk it owns).
        rank: this rank in ``group``; chunks: the L intra-node chunks ``[(start, count)]``
            (:func:`gradcomp.planner.chunk` (n, L, i)); chunk_size: c.
        intra_group / cross_group: the node's group (None when L = 1) and the local rank's group
            over the nodes (None when N = 1).
        engine: ``"gloo"`` (the intra reduce-scatter is an allreduce of ``acc``) or ``"nccl"``
            (``reduce_scatter_tensor`` of ``acc`` into ``node_sum``).
        acc: float32, the bucket's float32 copy: n elements (gloo, L = 1) or L * c (nccl; zeroed
            once, the padding stays zero).
        node_sum: float32, c elements (nccl): this rank's chunk of the node sum; None on gloo
            (the chunk is a view of ``acc``).
        part / gathered: the bucket dtype, c + 1 and L * (c + 1) elements (zeroed once): this
            rank's averaged chunk at the start of ``part`` (zero after it) and its status element
            ``part[c]`` (0, or 1 when its inner scheme failed), and the all-gathered parts.
        inner: the scheme across nodes (dense, sum, gather, two_phase; ``"dense"`` when N = 1);
            inner_ctx: its context for this rank's chunk (count elements, float32) over
            ``cross_group``, divisor W (None when the chunk is empty or N = 1).
        server_chunk: inner two_phase: ``(start, count)`` in the bucket of this rank's piece of
            its chunk (the chunk's start + :func:`gradcomp.planner.chunk` (count, N, node)),
            which its server residual covers; else None.
    """

    def __init__(self, codec: Codec, group: Any, world_size: int, packet: Optional[torch.Tensor] = None,
                 gathered: Optional[torch.Tensor] = None, acc: Optional[torch.Tensor] = None,
                 dec_codec: Optional[Codec] = None, divisor: Optional[int] = None):
        self.codec = codec
        self.group = group
        self.world_size = int(world_size)
        self.divisor = self.world_size if divisor is None else int(divisor)
        self.packet = packet
        self.gathered = gathered
        self.acc = acc
        self.dec_codec = dec_codec
        self.rank: Optional[int] = None
        self.chunks: list = []
        self.slot_bytes: Tuple[int, int] = (0, 0)
        self.received: Optional[torch.Tensor] = None
        self.server_packet: Optional[torch.Tensor] = None
        # hierarchical (see the class docstring)
        self.local_world_size = 0
        self.nodes = 0
        self.node: Optional[int] = None
        self.local_rank: Optional[int] = None
        self.chunk_size = 0
        self.intra_group: Any = None
        self.cross_group: Any = None
        self.engine = ""
        self.node_sum: Optional[torch.Tensor] = None
        self.part: Optional[torch.Tensor] = None
        self.inner = ""
        self.inner_ctx: Optional["SchemeContext"] = None
        self.server_chunk: Optional[Tuple[int, int]] = None

    @classmethod
    def for_layout(cls, scheme: str, codec: Codec, numel: int, dtype: torch.dtype, device: torch.device,
                   group: Any, world_size: int, rank: Optional[int] = None, *, divisor: Optional[int] = None,
                   local_world_size: int = 0, inner: str = "auto", min_compress_numel: int = 1024,
                   engine: Optional[str] = None) -> "SchemeContext":
        """Allocate what ``scheme`` needs for tensors of ``numel`` elements of ``dtype`` on
        ``device``: nothing for dense; the packet and the decode codec for sum; also the gathered
        packets (W * packet bytes) and the float32 accumulator (numel) for gather; for two_phase
        the W * P1 send and receive slots, the P2 server packet, the W * P2 gathered slots and a
        float32 accumulator of one chunk (``rank``: this rank in ``group``, default
        ``dist.get_rank(group)``); for hierarchical the groups of ``local_world_size`` (L) ranks
        per node (:func:`gradcomp.schemes.groups.hierarchical_groups_for`: created on the first
        call for a (group, L), by every rank of the group), the float32 and bucket-dtype buffers
        and the inner context of ``inner`` (``"auto"``: :func:`gradcomp.planner.
        hierarchical_inner` with ``min_compress_numel``) for this rank's chunk (see the class
        attributes). ``divisor``: what encodes divide by (default W). ``engine``: hierarchical's
        intra-node reduction, ``"gloo"`` (allreduce) or ``"nccl"`` (``reduce_scatter_tensor``,
        which gloo also runs in recent PyTorch); default :func:`gradcomp.schemes.groups.engine_of`.

        Raises:
            ValueError: an unknown scheme, inner scheme or engine; hierarchical with L < 1 or L not
                dividing W.
        """
        if scheme == "dense":
            return cls(codec, group, world_size, divisor=divisor)
        if scheme == "two_phase":
            return cls._two_phase(codec, numel, dtype, device, group, world_size, rank, divisor)
        if scheme == "hierarchical":
            return cls._hierarchical(codec, numel, dtype, device, group, world_size, divisor, local_world_size,
                                     inner, min_compress_numel, engine)
        if scheme not in ("sum", "gather"):
            raise ValueError(f"SchemeContext: scheme={scheme!r}; accepted: {', '.join(planner.ALL_SCHEMES)}")
        pbytes = codec.packet_bytes(numel, dtype)
        packet = aligned_empty(torch.empty(0, device=device), pbytes)
        ctx = cls(codec, group, world_size, packet=packet, dec_codec=Codec(codec.spec), divisor=divisor)
        if scheme == "gather":
            ctx.gathered = aligned_empty(packet, pbytes * ctx.world_size)
            ctx.acc = torch.empty(numel, dtype=torch.float32, device=device)
        return ctx

    @classmethod
    def _two_phase(cls, codec, numel, dtype, device, group, world_size, rank, divisor=None) -> "SchemeContext":
        W = int(world_size)
        like = torch.empty(0, device=device)
        p1, p2 = planner.two_phase_slots(codec, numel, dtype, W)
        ctx = cls(codec, group, W, packet=aligned_empty(like, W * p1), gathered=aligned_empty(like, W * p2),
                  acc=torch.empty(planner.chunk_size(numel, W), dtype=torch.float32, device=device),
                  dec_codec=Codec(codec.spec), divisor=divisor)
        ctx.packet.zero_()
        ctx.rank = int(dist.get_rank(group) if rank is None else rank)
        ctx.chunks = [planner.chunk(numel, W, j) for j in range(W)]
        ctx.slot_bytes = (p1, p2)
        ctx.received = aligned_empty(like, W * p1)
        ctx.server_packet = aligned_empty(like, p2)
        ctx.server_packet.zero_()
        return ctx

    @classmethod
    def _hierarchical(cls, codec, numel, dtype, device, group, world_size, divisor, local_world_size, inner,
                      min_compress_numel, engine) -> "SchemeContext":
        W, n = int(world_size), int(numel)
        N, L = planner.hierarchical_groups(W, local_world_size)
        if inner in ("auto", "hierarchical"):
            inner = planner.hierarchical_inner(codec, n, dtype, W, L, "auto", min_compress_numel)
        if inner not in planner.SCHEMES:
            raise ValueError(f"SchemeContext: hierarchical inner={inner!r}; accepted: auto, "
                             f"{', '.join(planner.SCHEMES)}")
        if engine is not None and engine not in ("gloo", "nccl"):
            raise ValueError(f"SchemeContext: engine={engine!r}; accepted: gloo, nccl (None: from the backend)")
        hg = hierarchical_groups_for(group, L)
        if hg.world_size != W:
            raise ValueError(f"SchemeContext: world_size={W}, but the group has {hg.world_size} ranks")
        ctx = cls(codec, group, W, divisor=divisor)
        ctx.local_world_size, ctx.nodes, ctx.node, ctx.local_rank = L, N, hg.node, hg.local_rank
        ctx.rank = hg.rank
        ctx.intra_group, ctx.cross_group = hg.intra, hg.cross
        ctx.engine = engine_of(group, device) if engine is None else engine
        ctx.inner = "dense" if N == 1 else inner  # across one node nothing is sent: exact
        c = planner.chunk_size(n, L)
        ctx.chunk_size = c
        ctx.chunks = [planner.chunk(n, L, i) for i in range(L)]
        start, count = ctx.chunks[ctx.local_rank]
        nccl = ctx.engine == "nccl" and L > 1
        ctx.acc = torch.zeros(L * c if nccl else n, dtype=torch.float32, device=device)
        ctx.node_sum = torch.empty(c, dtype=torch.float32, device=device) if nccl else None
        if L > 1:
            ctx.part = torch.zeros(c + 1, dtype=dtype, device=device)  # + the status element
            ctx.gathered = torch.zeros(L * (c + 1), dtype=dtype, device=device)
        if count and N > 1:
            if ctx.inner == "dense":
                ctx.inner_ctx = cls(codec, hg.cross, N, divisor=ctx.divisor)
            else:
                ctx.inner_ctx = cls.for_layout(ctx.inner, codec, count, torch.float32, device, hg.cross, N,
                                               rank=hg.node, divisor=ctx.divisor)
        if ctx.inner == "two_phase" and count:
            a, m = planner.chunk(count, N, hg.node)
            ctx.server_chunk = (start + a, m)
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


def collective_failed(what: str, e: BaseException) -> BaseException:
    """The error a scheme raises for a failed collective ``what`` (e.g. "scheme 'sum': the
    allreduce of the payload"): a :class:`gradcomp.CollectiveError` naming it, with
    torch.distributed's error as its ``__cause__``; gradcomp's own errors (a mismatch, a corrupt
    packet) pass unchanged."""
    if isinstance(e, (CollectiveError, _C.Error)):
        return e
    err = CollectiveError(f"{what} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


class _Pending:
    """The callbacks :func:`chain` attached that still exist, so that the process exits cleanly.

    A callback runs on the engine's worker thread (gloo's ``pt_gloo_runloop``), which takes the
    GIL to run it, again to free it, and again to free the Work's tensors' Python objects -- all
    after the Future the callback completed woke the waiter. When that waiter was the main
    thread's last ``wait()`` and the interpreter is finalizing by then, the worker thread cannot
    take the GIL: CPython ends it with ``pthread_exit`` inside C++ frames and the process aborts
    ("terminate called without an active exception"; in about half the runs of a two-rank
    Compressor loop that exits without ``destroy_process_group``). A callback counts from when
    it is attached until its function object is freed (a weak reference's callback, on the worker
    thread while it holds the GIL). :meth:`drain` runs at exit (``atexit``, before finalization):
    it waits, with the GIL released, until none is left -- at most ``GRADCOMP_EXIT_WAIT_S``
    seconds (default 10; a collective that never finishes), then warns -- and then releases the
    GIL for 50 ms more, for the Works' release, which no Python object marks.
    """

    def __init__(self):
        self.cond = threading.Condition()
        self.refs: set = set()
        self.used = False  # any callback attached in this process

    def add(self, callback: Callable) -> None:
        def gone(ref):
            with self.cond:
                self.refs.discard(ref)
                if not self.refs:
                    self.cond.notify_all()

        r = weakref.ref(callback, gone)
        with self.cond:
            self.refs.add(r)
            self.used = True

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until no callback is left (True) or ``timeout`` seconds passed (False)."""
        if timeout is None:
            try:
                timeout = float(os.environ.get("GRADCOMP_EXIT_WAIT_S", "10"))
            except ValueError:
                timeout = 10.0
        end = time.monotonic() + timeout
        with self.cond:
            while self.refs:
                left = end - time.monotonic()
                if left <= 0:
                    warnings.warn(f"gradcomp: {len(self.refs)} collective(s) still in flight at exit (not done "
                                  f"within GRADCOMP_EXIT_WAIT_S={timeout:g} s); the process may abort while "
                                  f"exiting: wait for every Future, then call torch.distributed."
                                  f"destroy_process_group()")
                    return False
                self.cond.wait(left)
        if self.used:
            # the engine's worker thread frees each Work after its callbacks, taking the GIL to
            # drop its tensors' Python objects: let it have the GIL now, before finalization
            time.sleep(0.05)
        return True


PENDING = _Pending()
atexit.register(PENDING.drain)


def chain(fut: torch.futures.Future, fn: Callable[[Any], Any], what: str = "the collective",
          on_error: Optional[Callable[[BaseException], BaseException]] = None,
          device: Optional[torch.device] = None) -> torch.futures.Future:
    """``fut.then(fn)`` as every gradcomp callback must be: the ONE place where gradcomp attaches
    a callback to a Future (tests/python/test_failures.py checks that no other code calls
    ``.then`` or ``add_done_callback``).

    Once ``fut`` completes, its value is read first -- so a failed collective raises here, as a
    :func:`collective_failed` error naming ``what``, before any buffer is used -- then
    ``fn(value)`` runs and its result completes the returned Future. An error of either (or of
    ``on_error``, which may undo state and returns the exception to raise, e.g. with more
    context) fails the returned Future with that exception, its type kept for ``wait()`` (a
    ``.then`` would turn it into a RuntimeError).

    Args:
        fut: a Future (a ``torch.distributed`` Work's, or another scheme's).
        fn: called with ``fut.value()``; returns the value of the new Future.
        what: the collective, for the error message.
        on_error: called with the exception; returns the one to raise.
        device: a CUDA device makes the returned Future CUDA-aware on it (as ``.then``'s is), so
            its consumers wait on the streams that produced the value.
    """
    devices = [device] if device is not None and torch.device(device).type == "cuda" else None
    out = torch.futures.Future(devices=devices) if devices else torch.futures.Future()

    def callback(f):
        try:
            try:
                value = f.value()  # re-raises the collective's error
            except BaseException as e:  # noqa: BLE001 - re-raised through the returned Future
                raise collective_failed(what, e) from e
            result = fn(value)
        except BaseException as e:  # noqa: BLE001 - re-raised through the returned Future
            if on_error is not None:
                try:
                    e = on_error(e)
                except BaseException as e2:  # noqa: BLE001
                    e = e2
            out.set_exception(e)
            return
        out.set_result(result)

    PENDING.add(callback)  # the exit waits until the worker thread has freed it (_Pending)
    fut.add_done_callback(callback)
    return out


def one_round(tensor: torch.Tensor, ctx: SchemeContext, slots, probe, communicate: Callable[[], Any],
              decode: Callable[[Codec, torch.Tensor], None], what: str = "the collective",
              check=None, receipt: Optional[Callable[[], None]] = None) -> torch.futures.Future:
    """The shape of a one-collective compressed scheme: encode, communicate, decode.

    Encodes ``tensor`` into ``ctx.packet`` with ``divisor=ctx.divisor`` (W, the group size, unless
    the context says otherwise) -- with error feedback through the ``"residual"`` slot when
    ``slots`` holds one (the packet then carries ``(g + r) / W`` compressed and ``r`` becomes
    ``g + r - W * decode(packet)``) -- then launches ``check`` (a :class:`gradcomp.schemes.check.
    PeerCheck`, or None) and ``communicate()`` (an async ``torch.distributed`` Work over the
    packet) and, once it completes: reads its result (a failed collective raises, nothing is
    decoded), verifies ``check``, runs ``receipt()`` (the scheme's header checks), then calls
    ``decode(dec_codec, workspace)``, which must leave the average in ``tensor``. Phases are
    timed as ``"encode_s"``, ``"comm_s"``, ``"decode_s"``; the probe sees the decode workspace.

    Returns:
        A Future holding ``tensor``; it raises :class:`gradcomp.CollectiveError` (the collective
        ``what`` failed), :class:`gradcomp.RankMismatchError` (``check`` or ``receipt`` found
        ranks that disagree) or the decode's error.
    """
    probe = probe or NULL_PROBE
    residual = slots.get("residual") if slots else None
    t0 = probe.clock()
    ctx.codec.encode(tensor, residual=residual, out=ctx.packet, divisor=ctx.divisor)
    probe.tock("encode_s", t0)
    t1 = probe.clock()
    if check is not None:
        check.launch()
    work = communicate()

    def done(_):
        probe.tock("comm_s", t1)
        if check is not None:
            check.verify()
        if receipt is not None:
            receipt()
        t2 = probe.clock()
        ws = ctx.dec_codec.workspace(ctx.packet)
        decode(ctx.dec_codec, ws)
        probe.decoded(ws)
        probe.tock("decode_s", t2)
        return tensor

    return chain(work.get_future(), done, what, on_error=prefer_mismatch(check), device=tensor.device)


def prefer_mismatch(check) -> Callable[[BaseException], BaseException]:
    """An ``on_error`` for :func:`chain`: when a collective failed and ``check`` (launched before
    it; None: nothing to prefer) shows ranks that disagree, that mismatch is the error to raise (a
    collective of another size can fail because of it)."""
    if check is None:
        return lambda e: e

    def on_error(e: BaseException) -> BaseException:
        if isinstance(e, CollectiveError) and not isinstance(e, RankMismatchError):
            try:
                check.verify()
            except RankMismatchError as m:
                return m
            except Exception:  # noqa: BLE001 - the check's own collective failed too: keep e
                pass
        return e

    return on_error
