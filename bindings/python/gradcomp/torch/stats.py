"""Step records for a compressor: byte accounting, timings and the late reads.

Nothing here synchronizes with a device. Values that live on a CUDA device are copied into pinned
host memory behind an event and read once the event has completed, which in practice is one step
later:

- times: CPU phases with ``time.perf_counter``; CUDA phases with timing events, read when the
  step is closed (the next step's first call);
- the non-finite flag: a 0-dim device bool per step (OR over its buckets), copied to the host
  when the step closes, counted in ``nonfinite_steps`` (and logged) when it has landed;
- the CUDA status word: after each CUDA decode the first 4 bytes of the decode workspace (the
  little-endian status word; ``gradcomp._C.STATUS_CORRUPT`` = 2, ``STATUS_NONFINITE`` = 1) are
  copied into pinned memory behind an event, then cleared on the device. When a copy has landed
  and carries the CORRUPT bit, ``on_corrupt="raise"`` raises :class:`gradcomp.CorruptPacketError`
  naming the step and the bucket, ``"log"`` logs a warning. (On the CPU a corrupt packet already
  raises inside decode.)
- the ranks' call descriptors on CUDA (:class:`gradcomp.schemes.check.PeerCheck`): copied into
  pinned memory behind an event and compared when landed; a mismatch raises
  :class:`gradcomp.RankMismatchError` naming the step (on the CPU it raises in the step itself).

A failed step (:meth:`Stats.fail`) is dropped: counted in ``failed_steps``, left out of the totals
and of ``steps``; its retry gets a fresh record.

Byte counts come from :mod:`gradcomp.planner`; so do the ratios of :meth:`Stats.summary`.

Log lines (``log_every``) go to ``logging.getLogger("gradcomp")`` at INFO. When ``log_every > 0``
and that logger has no handler anywhere (``hasHandlers()`` False: logging is not configured),
:func:`ensure_visible` attaches :data:`STDERR_HANDLER` (stderr, INFO, the message alone) to it
once and, if its level is unset, sets it to INFO. To route the lines elsewhere, configure logging
(or add a handler to the "gradcomp" logger) before building the compressor; to silence the
handler, ``logging.getLogger("gradcomp").removeHandler(gradcomp.torch.stats.STDERR_HANDLER)``.

A :class:`Stats` pickles (with its compressor): the totals, the counters and the most recent
step's record; copies still in flight are waited for first (:meth:`Stats.settle`).
"""

import logging
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from .. import _C
from .. import planner

log = logging.getLogger("gradcomp")

FIELDS = ("numel", "dense_bytes", "packet_bytes", "sent_bytes", "ring_bytes",
          "encode_s", "decode_s", "comm_s", "compressed_buckets", "dense_buckets")
"""Per-step counters: elements, bytes (see :func:`gradcomp.planner.bucket_bytes`), seconds and
bucket counts."""

CORRUPT_MODES = ("raise", "log")

LOCAL = "local (world size 1)"
"""The scheme a call is accounted under when its group has one rank: nothing is sent; its
``packet_bytes`` are what the codec would send, counted as a dense bucket."""

_INT_FIELDS = ("dense_bytes", "packet_bytes", "sent_bytes", "compressed_buckets", "dense_buckets")

STDERR_HANDLER = logging.StreamHandler(sys.stderr)
"""The handler :func:`ensure_visible` attaches to the "gradcomp" logger (stderr, INFO)."""
STDERR_HANDLER.setLevel(logging.INFO)
STDERR_HANDLER.setFormatter(logging.Formatter("%(message)s"))


def ensure_visible() -> bool:
    """Make the "gradcomp" logger's INFO lines visible when logging is not configured: if the
    logger has no handler anywhere (``hasHandlers()`` False), attach :data:`STDERR_HANDLER`
    and, when the logger's level is unset (NOTSET), set it to INFO. Returns True when it
    attached the handler."""
    lg = logging.getLogger("gradcomp")
    if lg.hasHandlers():
        return False
    lg.addHandler(STDERR_HANDLER)
    if lg.level == logging.NOTSET:
        lg.setLevel(logging.INFO)
    return True


class StepRecord:
    """Accounting of one synchronized step (all its buckets).

    Attributes:
        step: the step number.
        v: ``{field: float}`` summed over the step's buckets (``FIELDS``).
        buckets: one dict per bucket call, in call order (see :meth:`Stats.account`).
        nf: 0-dim device bool, OR of the non-finite flags of the step's buckets, or None.
        on_finite: callables run once the step is known finite (e.g. dropping the copies of
            flushed residuals kept in case it was not).
    """

    def __init__(self, step: int):
        self.step = step
        self.v = {f: 0.0 for f in FIELDS}
        self.buckets: List[dict] = []
        self.nf: Optional[torch.Tensor] = None
        self.nf_host: Optional[torch.Tensor] = None
        self.nf_event = None
        self.cuda_times: list = []  # (start event, end event, field, bucket dict)
        self.on_finite: List[Callable[[], None]] = []
        self.failed = False
        self.codec: Optional[str] = None  # the codec the step ran ("dense": a dense step)

    def __getstate__(self) -> dict:
        """Step, counters, bucket dicts, codec and the flag (on the host); events, pending timings
        and ``on_finite`` (closures over the live store) are left out."""
        nf = None if self.nf is None else self.nf.detach().to("cpu")
        return {"step": self.step, "v": dict(self.v), "buckets": [dict(b) for b in self.buckets], "nf": nf,
                "codec": self.codec}

    def __setstate__(self, d: dict) -> None:
        self.__init__(d["step"])
        self.v, self.buckets, self.nf = d["v"], d["buckets"], d["nf"]
        self.codec = d.get("codec")


class _StatusCopy:
    """A status word on its way to the host: ``host`` (uint8, 4 bytes, pinned) is valid once
    ``event`` has completed (``event`` None: already valid)."""

    def __init__(self, step: int, label: str, host: torch.Tensor, event):
        self.step, self.label, self.host, self.event = step, label, host, event


class Probe:
    """The scheme probe (see :class:`gradcomp.schemes.NullProbe`) of one bucket call: times go
    into the bucket dict and its step record; decode workspaces on CUDA have their status word
    copied out (:meth:`Stats.watch_status`)."""

    def __init__(self, stats: "Stats", rec: StepRecord, bucket: dict, device: torch.device, label: str):
        self.stats, self.rec, self.bucket, self.label = stats, rec, bucket, label
        self.cuda = device.type == "cuda"

    def clock(self):
        """A start token: a recorded CUDA timing event on CUDA, ``time.perf_counter()`` else."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def tock(self, field: str, start) -> None:
        """Phase ``field`` (seconds) ended: CPU times are added now, CUDA events when the step
        closes (if they have completed by then)."""
        if isinstance(start, float):
            self.stats.add_time(self.rec, self.bucket, field, time.perf_counter() - start)
        else:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            with self.stats.lock:
                self.rec.cuda_times.append((start, e, field, self.bucket))

    def decoded(self, workspace) -> None:
        """A CUDA decode workspace has its status word copied out (:meth:`Stats.watch_status`);
        a CPU decode has already raised on a corrupt packet."""
        if workspace.is_cuda:
            self.stats.watch_status(self.rec.step, self.label, workspace)


class Stats:
    """Step records, totals and the one-step-late reads of one compressor.

    Args:
        world_size, codec_spec: reported by :meth:`summary`.
        nonfinite: ``"restore"`` or ``"reset"``, only for the log line of a non-finite step.
        on_corrupt: ``"raise"`` or ``"log"`` (see the module docstring).
        log_every: log a stats line every N closed steps (0: never).
    """

    def __init__(self, world_size: int, codec_spec: str, nonfinite: str = "restore",
                 on_corrupt: str = "raise", log_every: int = 0):
        self.on_corrupt = on_corrupt
        self.world_size = world_size
        self.codec_spec = codec_spec
        self.nonfinite = nonfinite
        self.log_every = log_every
        self.lock = threading.Lock()
        self.nonfinite_steps = 0
        self.failed_steps = 0
        self._checks: list = []  # (PeerCheck, pinned host rows, event) on their way (CUDA)
        self._cur: Optional[StepRecord] = None
        self._closed_total = {f: 0.0 for f in FIELDS}
        self._closed_steps = 0
        self._by_codec: Dict[str, dict] = {}  # codec spec -> closed totals of its steps (and "steps")
        self._unresolved: List[StepRecord] = []
        self._status: List[_StatusCopy] = []
        if log_every:
            ensure_visible()

    def __getstate__(self) -> dict:
        self.settle()
        with self.lock:
            d = dict(self.__dict__)
        del d["lock"]
        d["_unresolved"], d["_status"], d["_checks"] = [], [], []
        return d

    def __setstate__(self, d: dict) -> None:
        d.setdefault("failed_steps", 0)
        d.setdefault("_checks", [])
        d.setdefault("_by_codec", {})
        self.__dict__.update(d)
        self.lock = threading.Lock()
        if self.log_every:
            ensure_visible()

    def settle(self) -> None:
        """Wait for the copies in flight (non-finite flags, CUDA status words), then
        :meth:`resolve`. May synchronize with a device: for checkpoints, never in a hook.

        Raises:
            gradcomp.CorruptPacketError: as :meth:`resolve`.
        """
        with self.lock:
            events = ([r.nf_event for r in self._unresolved] + [s.event for s in self._status]
                      + [c[2] for c in self._checks])
        for e in events:
            if e is not None:
                e.synchronize()
        self.resolve()

    @property
    def on_corrupt(self) -> str:
        """``"raise"`` or ``"log"``; settable.

        Raises:
            ValueError: another value.
        """
        return self._on_corrupt

    @on_corrupt.setter
    def on_corrupt(self, mode: str) -> None:
        if mode not in CORRUPT_MODES:
            raise ValueError(f"on_corrupt={mode!r}; accepted: {', '.join(CORRUPT_MODES)}")
        self._on_corrupt = mode

    # -- recording -----------------------------------------------------------------------------
    def record(self, step: int) -> StepRecord:
        """The record of ``step``; starting a new step closes the previous one and reads what has
        landed of earlier steps (may raise CorruptPacketError, see the module docstring)."""
        if self._cur is None or self._cur.step != step:
            old, self._cur = self._cur, StepRecord(step)
            if old is not None:
                self._close(old)
        return self._cur

    def set_codec(self, rec: StepRecord, spec: str) -> None:
        """Name the codec ``rec``'s step ran (its first call's; ``"dense"`` for a dense step)."""
        if rec.codec is None:
            rec.codec = spec

    def fail(self, rec: StepRecord) -> None:
        """Drop the record of a failed step (counted in ``failed_steps``, not in the totals); the
        next :meth:`record` of that step starts a fresh one."""
        with self.lock:
            if rec.failed:
                return
            rec.failed = True
            self.failed_steps += 1
            if self._cur is rec:
                self._cur = None

    def account(self, rec: StepRecord, b: dict) -> None:
        """Add the bucket dict ``b`` (``numel``, the ``planner.bucket_bytes`` fields, ``scheme``)
        to ``rec``; times are added to ``b`` later by the probe."""
        with self.lock:
            for f in ("numel", "dense_bytes", "packet_bytes", "sent_bytes", "ring_bytes"):
                rec.v[f] += b[f]
            rec.v["dense_buckets" if b["scheme"] in ("dense", LOCAL) else "compressed_buckets"] += 1
            rec.buckets.append(b)

    def add_time(self, rec: StepRecord, b: dict, field: str, seconds: float) -> None:
        """Add ``seconds`` to ``field`` of the bucket dict ``b`` and of its step ``rec``."""
        with self.lock:
            rec.v[field] += seconds
            b[field] = b.get(field, 0.0) + seconds

    def mark_nonfinite(self, rec: StepRecord, nf: torch.Tensor) -> None:
        """OR the 0-dim device bool ``nf`` into the step's flag (no host read)."""
        with self.lock:
            rec.nf = nf if rec.nf is None else (rec.nf | nf)

    def on_finite(self, rec: StepRecord, fn: Callable[[], None]) -> None:
        """Run ``fn`` once ``rec``'s step is known finite (never, if it is not)."""
        with self.lock:
            rec.on_finite.append(fn)

    def probe(self, rec: StepRecord, b: dict, device: torch.device, label: str) -> Probe:
        """The scheme probe of one call on ``device`` (``label`` names it in messages)."""
        return Probe(self, rec, b, device, label)

    # -- the CUDA status word ------------------------------------------------------------------
    def watch_status(self, step: int, label: str, workspace: torch.Tensor) -> None:
        """After a CUDA decode on ``workspace`` (current stream): copy its 4-byte status word into
        pinned host memory (non_blocking) behind an event, then clear it on the device."""
        word = workspace[:4]
        host = torch.empty(4, dtype=torch.uint8, pin_memory=True)
        host.copy_(word, non_blocking=True)  # on the workspace device's current stream
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(workspace.device))
        word.zero_()  # ordered after the copy on the same stream
        self.expect_status(step, label, host, event)

    def expect_status(self, step: int, label: str, host: torch.Tensor, event=None) -> None:
        """Queue a status word copy: ``host`` is a CPU uint8 tensor whose first 4 bytes are the
        little-endian word once ``event`` (anything with ``query() -> bool``; None: already
        landed) has completed. :meth:`watch_status` feeds it; tests feed it directly."""
        with self.lock:
            self._status.append(_StatusCopy(step, label, host, event))

    def expect_check(self, check, host: torch.Tensor, event) -> None:
        """Queue the all-gathered call descriptors of a CUDA :class:`gradcomp.schemes.check.
        PeerCheck`: ``host`` (pinned int64 rows) is valid once ``event`` has completed; they are
        compared then (:meth:`resolve`)."""
        with self.lock:
            self._checks.append((check, host, event))

    def _resolve_checks(self) -> None:
        with self.lock:
            landed = [c for c in self._checks if c[2] is None or c[2].query()]
            self._checks = [c for c in self._checks if not (c[2] is None or c[2].query())]
        for check, host, _ in landed:
            check.compare(host)  # raises RankMismatchError (read one step late on CUDA)

    def _resolve_status(self) -> None:
        with self.lock:
            keep, corrupt = [], []
            for s in self._status:
                if s.event is not None and not s.event.query():
                    keep.append(s)
                    continue
                bits = int.from_bytes(s.host.numpy().tobytes()[:4], "little")
                if bits & _C.STATUS_CORRUPT:
                    corrupt.append((s, bits))
            self._status = keep
        if not corrupt:
            return
        msgs = [f"gradcomp: step {s.step} {s.label}: a CUDA decode met a corrupt packet (status 0x{bits:x}); "
                f"its invalid entries were skipped" for s, bits in corrupt]
        if self.on_corrupt == "raise":
            raise _C.CorruptPacketError("; ".join(msgs))
        for m in msgs:
            log.warning(m)

    # -- closing and reading -------------------------------------------------------------------
    def _close(self, rec: StepRecord) -> None:
        with self.lock:
            for s, e, field, b in rec.cuda_times:
                if e.query():
                    dt = s.elapsed_time(e) / 1000.0
                    rec.v[field] += dt
                    b[field] = b.get(field, 0.0) + dt
            rec.cuda_times = []
            if rec.nf is not None:
                rec.nf_host = torch.empty((), dtype=torch.bool, pin_memory=rec.nf.is_cuda)
                rec.nf_host.copy_(rec.nf, non_blocking=True)
                if rec.nf.is_cuda:
                    rec.nf_event = torch.cuda.Event()
                    rec.nf_event.record()
                self._unresolved.append(rec)
            for f in FIELDS:
                self._closed_total[f] += rec.v[f]
            self._closed_steps += 1
            by = self._by_codec.setdefault(rec.codec or self.codec_spec, dict({f: 0.0 for f in FIELDS}, steps=0))
            for f in FIELDS:
                by[f] += rec.v[f]
            by["steps"] += 1
        self._resolve_flags()
        if self.log_every and (rec.step + 1) % self.log_every == 0:
            s = self._summary(rec.v)
            log.info("gradcomp step %d: %d elements, packet %d B, sent %d B, packet_ratio %.4f, "
                     "wire_ratio %.4f, %.3f bits/element, encode %.2f ms, comm %.2f ms, decode %.2f ms",
                     rec.step, s["numel"], s["packet_bytes"], s["sent_bytes"], s["packet_ratio"],
                     s["wire_ratio"], s["bits_per_element"], 1e3 * s["encode_s"], 1e3 * s["comm_s"],
                     1e3 * s["decode_s"])
        self._resolve_checks()
        self._resolve_status()

    def resolve(self) -> None:
        """Read what has landed, without synchronizing: the non-finite flags of closed steps
        (a finite step runs its ``on_finite`` callables), then the CUDA status words (may raise
        CorruptPacketError under ``on_corrupt="raise"``)."""
        self._resolve_flags()
        self._resolve_checks()
        self._resolve_status()

    def _resolve_flags(self) -> None:
        keep = []
        for rec in self._unresolved:
            if rec.nf_event is not None and not rec.nf_event.query():
                keep.append(rec)
                continue
            if bool(rec.nf_host.numpy()):  # host memory already written: not a device sync
                self.nonfinite_steps += 1
                log.warning("gradcomp: step %d: averaged gradient is non-finite; residuals %s",
                            rec.step, "restored" if self.nonfinite == "restore" else "reset")
            else:
                for fn in rec.on_finite:
                    fn()
        self._unresolved = keep

    @staticmethod
    def _summary(v: dict) -> dict:
        out = dict(v)
        out["numel"] = int(v["numel"])
        for f in _INT_FIELDS:
            out[f] = int(v[f])
        out.update(planner.summarize(v))
        return out

    def summary(self) -> dict:
        """``{"steps", "world_size", "codec", "nonfinite_steps", "failed_steps", "step", "total",
        "codecs", "buckets"}``:
        ``step`` (the most recent step, open or closed) and ``total`` (all steps) hold the
        ``FIELDS`` and ``packet_ratio``, ``wire_ratio``, ``bits_per_element``; ``step["codec"]``
        the codec that step ran (:meth:`set_codec`; the compressor's when never set);
        ``codecs`` the same totals per codec, each with its ``steps``; ``buckets`` are the
        per-bucket dicts of the most recent step. Resolves what has landed first (may raise
        CorruptPacketError)."""
        with self.lock:
            total = dict(self._closed_total)
            steps = self._closed_steps
            by = {k: dict(v) for k, v in self._by_codec.items()}
            if self._cur is not None:  # the open record: the most recent step
                for f in FIELDS:
                    total[f] += self._cur.v[f]
                steps += 1
                cur = by.setdefault(self._cur.codec or self.codec_spec, dict({f: 0.0 for f in FIELDS}, steps=0))
                for f in FIELDS:
                    cur[f] += self._cur.v[f]
                cur["steps"] += 1
            last = self._cur
            step = self._summary(last.v if last is not None else {f: 0.0 for f in FIELDS})
            if last is not None:
                step["codec"] = last.codec or self.codec_spec
            buckets = [dict(b) for b in last.buckets] if last is not None else []
        self.resolve()
        codecs = {k: dict(self._summary(v), steps=int(v["steps"])) for k, v in by.items()}
        return {"steps": steps, "world_size": self.world_size, "codec": self.codec_spec,
                "nonfinite_steps": self.nonfinite_steps, "failed_steps": self.failed_steps, "step": step,
                "total": self._summary(total), "codecs": codecs, "buckets": buckets}
