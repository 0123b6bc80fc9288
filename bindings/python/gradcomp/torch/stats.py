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

The per-step report (``summary()["report"]``; :func:`step_report` says what each field is):
where the step's wall time went -- compute, and the encode, communication and decode that held
the training loop up (:mod:`gradcomp.torch.timeline`) -- the network share of the step, the bytes
this rank sent per link level, the achieved bandwidth against the configured link's, the p50 /
p99 latency of the calls over the last ``window`` steps and the traffic matrix between ranks.
With ``log_file`` the report of every ``log_every``-th step is appended to that file as one JSON
line (instead of the log line); ``gradcomp-report`` reads it (:mod:`gradcomp.report_cli`).

Profiler ranges: each phase a probe times is also a ``torch.profiler.record_function`` range named
``gradcomp.encode[bucket=3]``, ``gradcomp.comm[bucket=3]``, ``gradcomp.decode[bucket=3]`` (the
call's tag: ``bucket=I`` for a bucket, ``name=N`` for a named tensor, ``unit=U`` for an FSDP2
unit; ``,part=exempt`` for the dense part of a bucket holding exempt parameters), opened only
while a PyTorch profiler records (:func:`profiling`: one flag read otherwise), and on CUDA an NVTX
range of the same name (``torch.cuda.nvtx.range_start`` / ``range_end``, which may end on another
thread). A range ends when its phase does, on whichever thread that is: a collective's range
spans its launch to the completion its callback sees. The profiler records a range only on a
thread it profiles: the calling thread always; gloo's worker thread, which runs the decodes of
asynchronous collectives on the CPU, only with ``experimental_config=torch._C._profiler.
_ExperimentalConfig(profile_all_threads=True)`` (PyTorch's profiler state is per thread).

A :class:`Stats` pickles (with its compressor): the totals, the counters and the most recent
step's record; copies still in flight are waited for first (:meth:`Stats.settle`).
"""

import collections
import json
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from .. import _C
from .. import planner
from . import timeline

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


LATENCY_WINDOW = 100
"""Steps whose calls the report's p50 / p99 latency is taken over (the most recent ones)."""

TRAFFIC_MAX_RANKS = 64
"""The report carries the W x W traffic matrix for groups of at most this many ranks (None above)."""

_PROFILER = torch.autograd.profiler
_PROFILER_ON = torch.autograd._profiler_enabled


def profiling() -> bool:
    """Whether a PyTorch profiler records now: one started in this process by ``torch.profiler.
    profile``, ``torch.autograd.profiler.profile`` or ``emit_nvtx`` (their process-wide flag), or
    one enabled on this thread. Cheap: a module attribute and a flag of the thread."""
    return _PROFILER._is_profiler_enabled or _PROFILER_ON()


def _profiler_ops():
    """``(enter, end_on_future)``: the record-function ops ``torch.profiler.record_function`` is
    built on, or None where this torch lacks them (then no profiler ranges)."""
    try:
        ops = torch.ops.profiler
        return ops._record_function_enter_new, ops._call_end_callbacks_on_jit_fut._RecordFunction
    except (AttributeError, RuntimeError):
        return None


_OPS: List[Any] = []


def open_range(name: str, cuda: bool):
    """Open the ranges of one phase: a ``record_function`` range while :func:`profiling`, an NVTX
    range when ``cuda``. Returns ``(future, nvtx id)`` (either None when not opened); call
    :func:`close_range` with them on any thread. The record-function range is ended through a
    Future completed by :func:`close_range` (``record_function._call_end_callbacks_on_future``'s
    mechanism), whose callback runs with the profiler state of the opening thread, so the range
    ends where the phase ends even on another thread. Never raises: a trace is not worth a step."""
    fut = nv = None
    if profiling():
        try:
            if not _OPS:
                _OPS.append(_profiler_ops())
            if _OPS[0] is not None:
                enter, end_on = _OPS[0]
                handle = enter(name, None)
                fut = torch.futures.Future()
                end_on(handle, fut)
        except Exception:  # noqa: BLE001 - a profiler that refuses the range: none
            fut = None
    if cuda:
        try:
            nv = torch.cuda.nvtx.range_start(name)
        except Exception:  # noqa: BLE001 - no NVTX in this build: none
            nv = None
    return fut, nv


def close_range(fut, nv) -> None:
    """End the ranges :func:`open_range` returned (either may be None)."""
    if fut is not None:
        try:
            fut.set_result(None)
        except Exception:  # noqa: BLE001 - already ended
            pass
    if nv is not None:
        torch.cuda.nvtx.range_end(nv)


def range_tag(bucket: dict) -> str:
    """The tag of a call's range names: ``bucket=I`` (a DDP bucket's index), ``name=N`` (a named
    tensor of :meth:`gradcomp.torch.Compressor.allreduce`), ``unit=U`` (an FSDP2 unit), else
    ``call``; ``,part=P`` appended for a part of a call (``exempt``, ``compressed``)."""
    if "index" in bucket:
        tag = f"bucket={bucket['index']}"
    elif "name" in bucket:
        tag = f"name={bucket['name']}"
    elif "unit" in bucket:
        tag = f"unit={bucket['unit']}"
    else:
        tag = "call"
    part = bucket.get("part")
    return f"{tag},part={part}" if part else tag


def check_log_file(log_file: Any, log_every: int) -> Optional[str]:
    """Validate ``log_file`` (None, or a path: str or os.PathLike, where ``{rank}`` is replaced by
    the rank) against ``log_every``; returns it as a str (or None).

    Raises:
        TypeError: another type.
        ValueError: a path with ``log_every`` 0 (no step would be written); an empty path.
    """
    if log_file is None:
        return None
    if not isinstance(log_file, (str, os.PathLike)):
        raise TypeError(f"log_file={log_file!r}; accepted: None or a path (str or os.PathLike)")
    path = os.fspath(log_file)
    if not path:
        raise ValueError("log_file=''; accepted: None or a non-empty path")
    if not log_every:
        raise ValueError(f"log_file={path!r} needs log_every >= 1 (the steps between the JSON lines); "
                         f"got log_every={log_every!r}")
    return path


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


LEVELS = ("flat", "intra", "inter")
"""The link levels of the report's bytes: a flat ring over the group, inside a node, across nodes
(the planner's levels, :func:`gradcomp.planner.bucket_bytes`)."""


def _finite(x: Optional[float]) -> Optional[float]:
    return float(x) if x is not None and abs(float(x)) != float("inf") and float(x) == float(x) else None


def step_report(step: int, rank: Optional[int], world_size: int, codec: str, v: dict, buckets: List[dict],
                split: dict, comm_busy_s: float, latencies: Optional[List[float]], links: Optional[dict]) -> dict:
    """One step's report (``summary()["report"]``, a row of ``log_file``), JSON-ready (no NaN or
    inf: None instead). Seconds, bytes, bytes per second:

      - ``step``, ``rank`` (None: not known), ``world_size``, ``codec`` (the step's);
      - ``step_s``: wall seconds from the step's first call to the next step's first call (one
        iteration of the loop); ``compute_s``: the part not held up by gradcomp; ``exposed``:
        ``{"encode_s", "comm_s", "decode_s"}``, the parts that held the loop up
        (:func:`gradcomp.torch.timeline.split_step`; the four sum to ``step_s``);
      - ``network_share``: ``exposed["comm_s"] / step_s`` (0 for a zero-length step);
      - ``encode_s``, ``comm_s``, ``decode_s``: the phases' times summed over the calls, as
        ``stats()["step"]`` (overlapping ones each counted);
      - ``sent_bytes``: bytes this rank sent; ``bytes``: ``{"flat", "intra", "inter"}``, the same
        per link level (``intra_bytes`` / ``inter_bytes`` of hierarchical calls, ``sent_bytes``
        of the others);
      - ``comm_busy_s``: seconds some collective of the step was in flight (the union of their
        spans); ``achieved_bytes_per_s`` = sent_bytes / comm_busy_s (None without either);
      - ``link_bytes_per_s``: what the configured links would give these bytes, sent_bytes /
        sum over levels of (level bytes / level rate) (``links``; None without a rate for a level
        that carried bytes, or an unlimited one); ``link_utilization`` = achieved / link;
      - ``latency_p50_s``, ``latency_p99_s``: percentiles (linear interpolation) of the calls'
        latencies (first phase's start to last phase's end) over the window of recent steps
        given in ``latencies`` (this one's included); ``latency_calls``: how many (None, None, 0
        for ``latencies`` None);
      - ``traffic`` (added by :class:`Stats`): the W x W bytes rank i sent to rank j in the step
        (:func:`gradcomp.planner.traffic_matrix` of each call's collectives), None above
        :data:`TRAFFIC_MAX_RANKS` ranks.
    """
    latencies = latencies or []
    by = {lv: 0.0 for lv in LEVELS}
    for b in buckets:
        if "intra_bytes" in b:
            by["intra"] += float(b["intra_bytes"])
            by["inter"] += float(b.get("inter_bytes", 0.0))
        else:
            by["flat"] += float(b.get("sent_bytes", 0.0))
    sent = float(v.get("sent_bytes", 0.0))
    achieved = sent / comm_busy_s if sent > 0 and comm_busy_s > 0 else None
    link = None
    if links is not None and sent > 0:
        t = 0.0
        for lv in LEVELS:
            if by[lv] > 0:
                r = links.get(lv)
                t = None if t is None or not r else t + by[lv] / float(r)
        link = sent / t if t else None
    step_s = split["step_s"]
    return {"step": int(step), "rank": rank, "world_size": int(world_size), "codec": codec,
            "step_s": step_s, "compute_s": split["compute_s"], "exposed": dict(split["exposed"]),
            "network_share": split["exposed"]["comm_s"] / step_s if step_s > 0 else 0.0,
            "encode_s": float(v.get("encode_s", 0.0)), "comm_s": float(v.get("comm_s", 0.0)),
            "decode_s": float(v.get("decode_s", 0.0)), "sent_bytes": sent, "bytes": by,
            "comm_busy_s": comm_busy_s, "achieved_bytes_per_s": achieved, "link_bytes_per_s": _finite(link),
            "link_utilization": achieved / link if achieved is not None and _finite(link) else None,
            "latency_p50_s": timeline.percentile(latencies, 50) if latencies else None,
            "latency_p99_s": timeline.percentile(latencies, 99) if latencies else None,
            "latency_calls": len(latencies)}


class StepRecord:
    """Accounting of one synchronized step (all its buckets).

    Attributes:
        step: the step number.
        v: ``{field: float}`` summed over the step's buckets (``FIELDS``).
        buckets: one dict per bucket call, in call order (see :meth:`Stats.account`).
        nf: 0-dim device bool, OR of the non-finite flags of the step's buckets, or None.
        on_finite: callables run once the step is known finite (e.g. dropping the copies of
            flushed residuals kept in case it was not).
        t_open: ``time.perf_counter()`` at the step's first call; thread: that call's thread
            (the caller's, :mod:`gradcomp.torch.timeline`).
        spans: the phase spans of the step (:data:`gradcomp.torch.timeline.Span`; CUDA spans
            are added when the step closes); t_ret: when its last call returned (None: unknown).
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
        self.t_open = time.perf_counter()
        self.thread = threading.get_ident()
        self.spans: list = []
        self.t_ret: Optional[float] = None

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


class _Mark:
    """A start token with ranges open (:func:`open_range`): ``start`` (a ``perf_counter`` float or
    a CUDA timing event), the record-function range's future and the NVTX range id."""

    __slots__ = ("start", "fut", "nvtx")

    def __init__(self, start, fut, nvtx):
        self.start, self.fut, self.nvtx = start, fut, nvtx


class Probe:
    """The scheme probe (see :class:`gradcomp.schemes.NullProbe`) of one bucket call: times and
    spans go into the bucket dict and its step record; each phase is a profiler range (and an
    NVTX range on CUDA; the module docstring); decode workspaces on CUDA have their status word
    copied out (:meth:`Stats.watch_status`)."""

    def __init__(self, stats: "Stats", rec: StepRecord, bucket: dict, device: torch.device, label: str):
        self.stats, self.rec, self.bucket, self.label = stats, rec, bucket, label
        self.cuda = device.type == "cuda"

    def range_name(self, field: str) -> str:
        """The range name of phase ``field``: ``gradcomp.encode[bucket=3]`` for ``"encode_s"``
        of bucket 3 (:func:`range_tag`)."""
        return f"gradcomp.{field[:-2] if field.endswith('_s') else field}[{range_tag(self.bucket)}]"

    def clock(self, field: Optional[str] = None):
        """A start token of phase ``field`` (``"encode_s"``, ``"comm_s"``, ``"decode_s"``; None:
        no range): a recorded CUDA timing event on CUDA, ``time.perf_counter()`` else; with the
        phase's ranges open on CUDA or while a profiler records."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return _Mark(e, *open_range(self.range_name(field), True)) if field is not None else e
        t = time.perf_counter()
        if field is not None and profiling():
            return _Mark(t, *open_range(self.range_name(field), False))
        return t

    def tock(self, field: str, start) -> None:
        """Phase ``field`` (seconds) ended: its ranges end; CPU times and spans are added now,
        CUDA events when the step closes (if they have completed by then)."""
        if type(start) is float:
            self.stats.add_span(self.rec, self.bucket, field, start, time.perf_counter())
            return
        if isinstance(start, _Mark):
            end = time.perf_counter()
            close_range(start.fut, start.nvtx)
            start = start.start
            if type(start) is float:
                self.stats.add_span(self.rec, self.bucket, field, start, end)
                return
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
        log_every: log a stats line every N closed steps (0: never); with ``log_file``, append
            that step's report (:func:`step_report`) to the file as one JSON line instead.
        rank: this rank, written into the report (None: not known).
        log_file: None or a path (``{rank}`` in it replaced by ``rank``; its folder must exist):
            rows are appended (one ``os.write`` each, so ranks may share one file) when a step
            closes, i.e. when the next step starts.
        links: ``{"flat", "intra", "inter"}`` -> bytes per second one rank sends on that level
            (:meth:`gradcomp.planner.CostModel.rank_rates`), or None: the report's link bandwidth.
        steps_of: ``steps_of(bucket dict) -> [(level, collective, nbytes, ranks, sent_bytes)]``
            (:func:`gradcomp.planner.scheme_steps` of the call), for the traffic matrix; None (or
            an error): each level's bytes go around a ring.
        window: steps the latency percentiles cover (:data:`LATENCY_WINDOW`).

    Raises:
        TypeError, ValueError: a bad ``log_file`` (:func:`check_log_file`), or one whose folder
            does not exist; ``window`` < 1.
    """

    def __init__(self, world_size: int, codec_spec: str, nonfinite: str = "restore",
                 on_corrupt: str = "raise", log_every: int = 0, *, rank: Optional[int] = None,
                 log_file: Any = None, links: Optional[dict] = None,
                 steps_of: Optional[Callable[[dict], list]] = None, window: int = LATENCY_WINDOW):
        self.on_corrupt = on_corrupt
        self.world_size = world_size
        self.codec_spec = codec_spec
        self.nonfinite = nonfinite
        self.log_every = log_every
        path = check_log_file(log_file, log_every)
        if path is not None:
            path = path.replace("{rank}", str(rank))
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise ValueError(f"log_file={path!r}: its folder {folder!r} does not exist")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r}; accepted: an integer >= 1 (steps)")
        self.log_file = path
        self.rank = rank
        self.links = links
        self.steps_of = steps_of
        self.window = window
        self._latencies: collections.deque = collections.deque(maxlen=window)  # per closed step: call latencies
        self._last: Optional[tuple] = None  # (report without traffic, bucket dicts) of the last closed step
        self._split_total = {"steps": 0, "step_s": 0.0, "compute_s": 0.0, "exposed": {f: 0.0 for f in timeline.PHASES}}
        self._traffic_cache: Dict[tuple, list] = {}
        self._log_failed = False
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
        if log_every and self.log_file is None:
            ensure_visible()

    def __getstate__(self) -> dict:
        """Everything but the lock, the copies in flight, ``steps_of`` (its owner sets it again)
        and caches."""
        self.settle()
        with self.lock:
            d = dict(self.__dict__)
        del d["lock"]
        d["_unresolved"], d["_status"], d["_checks"] = [], [], []
        d["steps_of"], d["_traffic_cache"] = None, {}
        return d

    def __setstate__(self, d: dict) -> None:
        d.setdefault("failed_steps", 0)
        d.setdefault("_checks", [])
        d.setdefault("_by_codec", {})
        for k, v in (("log_file", None), ("rank", None), ("links", None), ("steps_of", None),
                     ("window", LATENCY_WINDOW), ("_last", None), ("_traffic_cache", {}), ("_log_failed", False)):
            d.setdefault(k, v)
        d.setdefault("_latencies", collections.deque(maxlen=d["window"]))
        d.setdefault("_split_total", {"steps": 0, "step_s": 0.0, "compute_s": 0.0,
                                      "exposed": {f: 0.0 for f in timeline.PHASES}})
        self.__dict__.update(d)
        self.lock = threading.Lock()
        if self.log_every and self.log_file is None:
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
                self._close(old, self._cur.t_open)
        return self._cur

    def returned(self) -> None:
        """A call of the current step returned to its caller now (the last one's time is the
        step's ``t_ret``, :mod:`gradcomp.torch.timeline`)."""
        rec = self._cur
        if rec is not None:
            rec.t_ret = time.perf_counter()

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

    def add_span(self, rec: StepRecord, b: dict, field: str, start: float, end: float) -> None:
        """Phase ``field`` of the call ``b`` ran from ``start`` to ``end`` (``perf_counter``
        seconds) on this thread: its time is added (:meth:`add_time`) and the span kept for the
        step's report."""
        on_caller = threading.get_ident() == rec.thread
        with self.lock:
            rec.v[field] += end - start
            b[field] = b.get(field, 0.0) + (end - start)
            rec.spans.append((id(b), field, start, end, on_caller))

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
    def _close(self, rec: StepRecord, t_next: float) -> None:
        t_ret = rec.t_ret
        with self.lock:
            ref = None
            for s, e, field, b in rec.cuda_times:
                if e.query():
                    dt = s.elapsed_time(e) / 1000.0
                    rec.v[field] += dt
                    b[field] = b.get(field, 0.0) + dt
                    # on the GPU's clock from the step's first event, placed at the step's start:
                    # encodes and decodes run on the compute stream (they hold it up), collectives not
                    if ref is None:
                        ref = s
                    t0 = rec.t_open + ref.elapsed_time(s) / 1000.0
                    rec.spans.append((id(b), field, t0, t0 + dt, field != "comm_s"))
            if ref is not None:  # the backward pass ends with the last encode on the stream
                t_ret = max((sp[3] for sp in rec.spans if sp[1] == "encode_s"), default=None)
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
        report = self._step_report(rec, t_next, t_ret)
        if self.log_every and (rec.step + 1) % self.log_every == 0 and self.log_file is not None:
            self._write_row(self._complete(report, rec.buckets))
        elif self.log_every and (rec.step + 1) % self.log_every == 0:
            s = self._summary(rec.v)
            log.info("gradcomp step %d: %d elements, packet %d B, sent %d B, packet_ratio %.4f, "
                     "wire_ratio %.4f, %.3f bits/element, encode %.2f ms, comm %.2f ms, decode %.2f ms",
                     rec.step, s["numel"], s["packet_bytes"], s["sent_bytes"], s["packet_ratio"],
                     s["wire_ratio"], s["bits_per_element"], 1e3 * s["encode_s"], 1e3 * s["comm_s"],
                     1e3 * s["decode_s"])
            log.info("gradcomp step %d: step %.2f ms, compute %.2f ms, exposed comm %.2f ms, network share %.1f%%",
                     rec.step, 1e3 * report["step_s"], 1e3 * report["compute_s"],
                     1e3 * report["exposed"]["comm_s"], 100 * report["network_share"])
        self._resolve_checks()
        self._resolve_status()

    # -- the per-step report -------------------------------------------------------------------
    def _step_report(self, rec: StepRecord, t_next: float, t_ret: Optional[float]) -> dict:
        """The report of the closed step ``rec`` (:func:`step_report`, without the latencies and
        ``traffic``: :meth:`_complete` adds them); kept as the last one, added to the time totals
        and the latency window."""
        spans = rec.spans
        split = timeline.split_step(spans, rec.t_open, t_next, t_ret)
        report = step_report(rec.step, self.rank, self.world_size, rec.codec or self.codec_spec, rec.v, rec.buckets,
                             split, timeline.busy(spans, "comm_s", rec.t_open, t_next), None, self.links)
        lat = timeline.call_latencies(spans)
        with self.lock:
            self._latencies.append(lat)
            self._last = (report, [dict(b) for b in rec.buckets])
            tot = self._split_total
            tot["steps"] += 1
            tot["step_s"] += split["step_s"]
            tot["compute_s"] += split["compute_s"]
            for f in timeline.PHASES:
                tot["exposed"][f] += split["exposed"][f]
        return report

    def _complete(self, report: dict, buckets: List[dict]) -> dict:
        """A copy of ``report`` with the latency percentiles over the current window and the
        traffic matrix of ``buckets`` (its step's calls)."""
        with self.lock:
            window = [x for step in self._latencies for x in step]
        out = dict(report, exposed=dict(report["exposed"]), bytes=dict(report["bytes"]))
        out.update(latency_p50_s=timeline.percentile(window, 50), latency_p99_s=timeline.percentile(window, 99),
                   latency_calls=len(window), traffic=self._traffic(buckets))
        return out

    def _traffic(self, buckets: List[dict]) -> Optional[List[List[float]]]:
        """The W x W bytes rank i sent to rank j over ``buckets`` (one step's calls;
        :func:`gradcomp.planner.traffic_matrix` of each call's collectives), or None when W >
        :data:`TRAFFIC_MAX_RANKS`."""
        W = int(self.world_size)
        if W > TRAFFIC_MAX_RANKS:
            return None
        total = [[0.0] * W for _ in range(W)]
        for b in buckets:
            if b.get("scheme") == LOCAL or W < 2:
                continue
            sig = (W,) + tuple(sorted((k, v) for k, v in b.items() if not isinstance(v, (dict, list))
                                      and k not in timeline.PHASES))
            m = self._traffic_cache.get(sig)
            if m is None:
                m = self._traffic_cache[sig] = self._bucket_traffic(b, W)
            for i in range(W):
                ti, mi = total[i], m[i]
                for j in range(W):
                    ti[j] += mi[j]
        return total

    def _bucket_traffic(self, b: dict, W: int) -> List[List[float]]:
        L = int(b.get("local_world_size") or 0)
        steps = None
        if self.steps_of is not None:
            try:
                steps = self.steps_of(b)
            except Exception:  # noqa: BLE001 - a call the owner cannot describe: the ring model below
                steps = None
        if steps is None:  # each level's bytes around a ring
            if "intra_bytes" in b and L:
                steps = [("intra", "allreduce", 0, L, b["intra_bytes"]), ("inter", "allreduce", 0, W // L, b["inter_bytes"])]
            else:
                steps = [("flat", "allreduce", 0, W, b.get("sent_bytes", 0.0))]
        return planner.traffic_matrix(steps, W, L)

    def _write_row(self, row: dict) -> None:
        """Append ``row`` to ``log_file`` as one JSON line (one ``os.write`` on an O_APPEND file).
        A failed write is logged once as a warning and the next ones are skipped (the training
        goes on)."""
        if self._log_failed:
            return
        data = (json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n").encode("utf-8")
        try:
            fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as e:
            self._log_failed = True
            log.warning("gradcomp: cannot append the step report to log_file=%r (%s); no more rows are written",
                        self.log_file, e)

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
        "codecs", "buckets", "report", "time_split"}``:
        ``step`` (the most recent step, open or closed) and ``total`` (all steps) hold the
        ``FIELDS`` and ``packet_ratio``, ``wire_ratio``, ``bits_per_element``; ``step["codec"]``
        the codec that step ran (:meth:`set_codec`; the compressor's when never set);
        ``codecs`` the same totals per codec, each with its ``steps``; ``buckets`` are the
        per-bucket dicts of the most recent step; ``report`` the most recent closed step's report
        (:func:`step_report`, with ``traffic``: the W x W bytes rank i sent to rank j, None above
        :data:`TRAFFIC_MAX_RANKS` ranks; None until a step has closed, i.e. until the second
        step's first call); ``time_split`` the split summed over the closed steps: ``{"steps",
        "step_s", "compute_s", "exposed": {"encode_s", "comm_s", "decode_s"}, "network_share"}``
        (exposed comm / step time, 0 without a closed step). Resolves what has landed first
        (may raise CorruptPacketError)."""
        with self.lock:
            last = self._last
            ts = self._split_total
            time_split = {"steps": ts["steps"], "step_s": ts["step_s"], "compute_s": ts["compute_s"],
                          "exposed": dict(ts["exposed"]),
                          "network_share": ts["exposed"]["comm_s"] / ts["step_s"] if ts["step_s"] > 0 else 0.0}
        report = None if last is None else self._complete(*last)
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
                "total": self._summary(total), "codecs": codecs, "buckets": buckets, "report": report,
                "time_split": time_split}
