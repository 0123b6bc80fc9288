"""The timing helpers every benchmark uses (``gradcomp-bench`` and the scripts under bench/): one
clock, one timed-call loop, one copy-bandwidth floor.

- :func:`clock`: a function ``fn -> seconds of one call of fn`` (CPU ``time.perf_counter``; CUDA
  two ``torch.cuda.Event`` records on the current stream, synchronized);
- :func:`time_calls`: the seconds of each of ``reps`` calls after ``warmup`` untimed ones, with an
  optional untimed ``before()`` ahead of every call (restore an input, a ``dist.barrier()``);
  :func:`median_s` is their median;
- :func:`copy_bandwidth`: bytes per second of torch's ``dst.copy_(src)`` (bytes read + written),
  the floor the scripts divide compulsory bytes by.

torch is imported only where a function needs it.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, List, Optional


def clock(device: str = "cpu") -> Callable[[Callable[[], object]], float]:
    """A function ``fn -> the seconds of one call of fn``: ``time.perf_counter`` around the call
    on the CPU; on CUDA an event pair recorded on the current stream around it, synchronized
    on the second event."""
    if device == "cuda":
        import torch

        def t(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
    else:
        def t(fn):
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
    return t


def time_calls(fn: Callable[[], object], reps: int, warmup: int = 1,
               before: Optional[Callable[[], object]] = None, device: str = "cpu") -> List[float]:
    """The seconds of each of ``reps`` calls of ``fn`` (:func:`clock` of ``device``), after
    ``warmup`` calls that are not timed. ``before``, when given, runs before every call, the
    warm-ups included, outside the timed region (put an input back, wait in a barrier)."""
    t = clock(device)
    out: List[float] = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        if i < warmup:
            fn()
        else:
            out.append(t(fn))
    return out


def median_s(fn: Callable[[], object], reps: int, warmup: int = 1,
             before: Optional[Callable[[], object]] = None, device: str = "cpu") -> float:
    """The median of :func:`time_calls` (seconds)."""
    return statistics.median(time_calls(fn, reps, warmup, before, device))


def copy_bandwidth(numel: int = 16 << 20, reps: int = 9) -> float:
    """Bytes per second of torch's ``dst.copy_(src)`` of ``numel`` float32 elements on the CPU
    (default 16 Mi elements, 64 MiB), at torch's current thread count, counted as the bytes read
    plus written (2 x 4 x numel per copy): the median of ``reps`` copies after one warm-up."""
    import torch

    src = torch.randn(int(numel))
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / median_s(lambda: dst.copy_(src), reps)


__all__ = ["clock", "time_calls", "median_s", "copy_bandwidth"]
