"""Where one step's wall time went, from the phase spans a compressor's probes recorded: the split
of the per-step report (:meth:`gradcomp.torch.stats.Stats.summary`'s ``"report"``, the rows of
``log_file``) and the tail latency of the calls. Plain Python (no torch), so that it is cheap and
testable against a hand-built timeline.

A *span* is one phase of one call: ``(call, field, start, end, on_caller)`` -- ``call`` any
hashable naming the call (a bucket of a step), ``field`` ``"encode_s"``, ``"comm_s"`` or
``"decode_s"``, ``start`` and ``end`` seconds on one clock, ``on_caller`` whether the thread that
ran it was the caller's (the thread that called the compressor: DDP's backward) -- on that
thread it holds the training loop up; on another (gloo's worker thread, which runs the callbacks
on the CPU) it may overlap the loop's own work.

The step is ``[t_open, t_next)``: from its first call to the next step's first call, one
iteration of the loop (forward, backward, optimizer). The loop is held up by gradcomp ("blocked")

  - while the caller's thread runs a phase (an encode, a collective waited for in the call,
    a decode run inline), and
  - from ``t_ret`` (the step's last call returned to the caller: DDP's backward is done and it
    waits for the Futures) to ``t_done`` (the end of the step's last span).

Each blocked instant is a decode where a decode span covers it, else an encode where an encode
span does, else communication (the network, or the engine's queue). ``compute_s`` is the rest of
the step. So ``step_s = compute_s + exposed encode_s + exposed comm_s + exposed decode_s``
exactly, and the network share is exposed ``comm_s / step_s``.
"""

import math
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

PHASES = ("encode_s", "comm_s", "decode_s")
"""The phases of a span, in the order the stacked bars of ``gradcomp-report`` draw them."""

Span = Tuple[Hashable, str, float, float, bool]


def split_step(spans: Iterable[Span], t_open: float, t_next: float, t_ret: Optional[float] = None) -> dict:
    """Split the step ``[t_open, t_next)`` (seconds) into compute and the exposed parts of the
    phases (module docstring).

    Args:
        spans: the step's spans; parts outside ``[t_open, t_next)`` are left out.
        t_open, t_next: the step's first call and the next step's first call.
        t_ret: when the step's last call returned to the caller; None: the end of the latest
            span run on the caller's thread (or ``t_open`` when none was).

    Returns:
        ``{"step_s", "compute_s", "exposed": {"encode_s", "comm_s", "decode_s"}}`` in seconds
        (``step_s = t_next - t_open``; the four parts sum to it).

    Raises:
        ValueError: ``t_next < t_open``, a span with ``end < start`` or an unknown field.
    """
    if not t_next >= t_open:
        raise ValueError(f"split_step: t_next={t_next!r} is before t_open={t_open!r}")
    events: List[Tuple[float, int, str]] = []
    t_done = t_open
    caller_end = t_open
    for _, field, s, e, on_caller in spans:
        if field not in PHASES:
            raise ValueError(f"split_step: span field {field!r}; accepted: {', '.join(PHASES)}")
        if not e >= s:
            raise ValueError(f"split_step: a {field} span ends at {e!r} before it starts at {s!r}")
        if on_caller:
            caller_end = max(caller_end, e)
        s, e = max(s, t_open), min(e, t_next)
        if e <= s:
            continue
        t_done = max(t_done, e)
        events += [(s, 1, field), (e, -1, field)]
        if on_caller:
            events += [(s, 1, "caller"), (e, -1, "caller")]
    t_ret = caller_end if t_ret is None else min(max(float(t_ret), t_open), t_next)
    if t_done > t_ret:
        events += [(t_ret, 1, "wait"), (t_done, -1, "wait")]
    events.sort(key=lambda ev: ev[0])
    count = {"encode_s": 0, "comm_s": 0, "decode_s": 0, "caller": 0, "wait": 0}
    exposed = {f: 0.0 for f in PHASES}
    prev = t_open
    for t, d, kind in events:
        if t > prev and (count["caller"] > 0 or count["wait"] > 0):
            f = "decode_s" if count["decode_s"] > 0 else "encode_s" if count["encode_s"] > 0 else "comm_s"
            exposed[f] += t - prev
        prev = max(prev, t)
        count[kind] += d
    step = t_next - t_open
    return {"step_s": step, "compute_s": max(0.0, step - sum(exposed.values())), "exposed": exposed}


def busy(spans: Iterable[Span], field: str, t_open: float, t_next: float) -> float:
    """Seconds of ``[t_open, t_next)`` during which at least one ``field`` span ran (the union of
    those spans): for ``"comm_s"``, the time some collective of the step was in flight."""
    iv = sorted((max(s, t_open), min(e, t_next)) for _, f, s, e, _ in spans if f == field)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def call_latencies(spans: Iterable[Span]) -> List[float]:
    """The latency of each call of ``spans`` (seconds): from the start of its first span to the end
    of its last -- an encode to the last decode, a dense call's collective -- in first-start
    order."""
    first: Dict[Hashable, List[float]] = {}
    for call, _, s, e, _ in spans:
        se = first.get(call)
        if se is None:
            first[call] = [s, e]
        else:
            se[0], se[1] = min(se[0], s), max(se[1], e)
    return [e - s for s, e in sorted(first.values())]


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0 <= q <= 100) of ``values`` by linear interpolation between the
    order statistics (numpy's default ``method="linear"``: rank ``q/100 * (n-1)``); None for no
    values.

    Raises:
        ValueError: q outside [0, 100].
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile: q={q!r}; accepted: 0 <= q <= 100")
    v = sorted(values)
    if not v:
        return None
    r = q / 100.0 * (len(v) - 1)
    lo = math.floor(r)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (r - lo)
