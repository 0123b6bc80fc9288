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

from .. import _C
from ..codec import Codec
from ..errors import CollectiveError, RankMismatchError
from ..planner import schemes as planner_schemes


class SchemeContext:
    """What every scheme's context has; each scheme's own context class adds its buffers
    (:class:`gradcomp.schemes.allreduce.SumContext`, :class:`gradcomp.schemes.allgather.
    GatherContext`, :class:`gradcomp.schemes.two_phase.TwoPhaseContext`,
    :class:`gradcomp.schemes.hierarchical.HierarchicalContext`). ``dense`` uses this class as is.

    Attributes:
        codec: the :class:`gradcomp.Codec` that encodes (its workspace is the caller thread's).
        group: the ``torch.distributed`` process group (None: the default group).
        world_size: W, the group's size.
        divisor: what encodes divide by (and ``dense`` divides by) so that the group's SUM of the
            packets is the average: W by default; the inner context of ``hierarchical`` (a chunk
            over the N ranks of one local rank) divides by the full world size instead, since
            its inputs are node sums.
        packet, gathered, acc, dec_codec: the buffers the scheme's context sets (None here).
        rank: this rank in ``group`` where the scheme needs it, else None.
        key: ``(seed, step, bucket)`` of the current call, the key of codecs that draw random
            numbers (``Codec.encode(key=...)``, the same on every rank: a seed all ranks share,
            the step, the bucket), set by the caller before ``run``; None: no key (0, 0, 0).
        chunk_base: added to the chunk index of every encode (hierarchical gives its inner
            scheme a range of its own per local rank).

    Every encode of a scheme passes :meth:`key_for` of its chunk: ``one_round`` (sum, gather)
    chunk 0; two_phase chunk j for the packet of chunk j (step 1) and W + rank for the re-encoded
    chunk sum (step 5); hierarchical's inner scheme the same, offset by ``2 N local_rank``.
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
        self.key: Optional[Tuple[int, int, int]] = None
        self.chunk_base = 0

    def key_for(self, chunk: int) -> Optional[Tuple[int, int, int, int]]:
        """``(seed, step, bucket, chunk_base + chunk)`` for the encode of ``chunk``, or None
        without a key (codecs that draw no random numbers ignore it either way)."""
        if self.key is None:
            return None
        seed, step, bucket = self.key
        return (seed, step, bucket, self.chunk_base + int(chunk))

    @classmethod
    def for_layout(cls, scheme: str, codec: Codec, numel: int, dtype: torch.dtype, device: torch.device,
                   group: Any, world_size: int, rank: Optional[int] = None, *, divisor: Optional[int] = None,
                   **options) -> "SchemeContext":
        """The context of ``scheme`` (a name of the scheme table) for tensors of ``numel``
        elements of ``dtype`` on ``device`` over ``group`` of ``world_size`` ranks: the scheme's
        ``context(codec, numel, dtype, device, group, world_size, rank=, divisor=, **options)``
        (``rank``: this rank in ``group``, default ``dist.get_rank(group)`` where needed;
        ``divisor``: what encodes divide by, default W). ``options`` are layout options; those
        the scheme does not take (:attr:`gradcomp.schemes.base.Scheme.option_names`) are
        dropped (hierarchical: ``local_world_size``, ``inner``, ``min_compress_numel``,
        ``engine``).

        Raises:
            ValueError: an unknown scheme; what the scheme's context raises.
        """
        desc = planner_schemes.get(scheme)
        return desc.context(codec, numel, dtype, device, group, world_size, rank=rank, divisor=divisor,
                            **desc.options(**options))


class NullProbe:
    """The probe interface, doing nothing (what a scheme uses when given ``probe=None``).

    A probe has three methods, called by the schemes in this order per phase:
      - ``clock(field)``: the phase ``field`` (``"encode_s"``, ``"comm_s"``, ``"decode_s"``)
        starts; returns a start token (a ``time.perf_counter()`` float, a CUDA event, ...; the
        compressor's probe also opens the phase's profiler range, :mod:`gradcomp.torch.stats`);
      - ``tock(field, start)``: the phase ``field`` ended (on whichever thread: a collective's
        in the callback of its Future); ``start`` is the token from ``clock(field)``;
      - ``decoded(workspace)``: the decodes of this call are enqueued on ``workspace`` (uint8, its
        first 4 bytes the little-endian status word), so a probe may copy the status out.
    """

    def clock(self, field: Optional[str] = None):
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
    t0 = probe.clock("encode_s")
    ctx.codec.encode(tensor, residual=residual, out=ctx.packet, divisor=ctx.divisor, key=ctx.key_for(0))
    probe.tock("encode_s", t0)
    t1 = probe.clock("comm_s")
    if check is not None:
        check.launch()
    work = communicate()

    def done(_):
        probe.tock("comm_s", t1)
        if check is not None:
            check.verify()
        if receipt is not None:
            receipt()
        t2 = probe.clock("decode_s")
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
