"""The measurements of gradcomp-bench: :func:`run` times every codec's encode and decode, the torch
baseline of each (:mod:`gradcomp.bench.baselines`) and a torch copy of the same input, and returns
the ``gradcomp-bench/1`` table (see :mod:`gradcomp.bench`).

Timing: on the CPU the median of ``reps`` ``time.perf_counter`` intervals after one warm-up call;
on CUDA the median of ``reps`` intervals between two ``torch.cuda.Event`` records on the current
stream, after one warm-up call and a synchronize. The copy floor keeps the fastest of
2 x max(reps, 7) runs, before and after the codecs (:data:`COPY_REPS`). Inputs: normal(0, 1)
float32 drawn from a fixed seed, cast to the dtype; residuals normal(0, 0.01) float32. Every output (packets, decoded
tensors, the baselines' buffers) is allocated before timing.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import _C
from ..codec import Codec, aligned_empty, build_info
from . import FORMAT, DTYPES, baselines, decode_bytes, default_specs, encode_bytes, validate

COPY_REPS = 7
"""The copy (the floor) is timed max(reps, COPY_REPS) times before and as many after the codecs of
the same input, and the fastest run kept: a floor is the best the machine did, and a burst of
contention on a shared machine must not lower it. (A table's lines are printed once the copy after
is measured, one (size, dtype) at a time.)"""


def header(width: int = 34) -> str:
    """The table's column line: kernel (``width`` characters), ms, GB/s, of copy, baseline, ms, speedup."""
    return f"{'kernel':<{width}} {'ms':>9} {'GB/s':>8} {'of copy':>8}  {'baseline':<46} {'ms':>9} {'speedup':>8}"


def check_device(device: str) -> None:
    """Raise when ``device`` cannot be benchmarked here.

    Raises:
        ValueError: ``device`` is not "cpu" or "cuda".
        gradcomp.UnsupportedError: "cuda" without a CUDA device visible to torch, or with a gradcomp
            build that has no CUDA backend.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}; accepted: 'cpu', 'cuda'")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise _C.UnsupportedError(
                f"--device cuda: torch.cuda.is_available() is False (torch {torch.__version__}, built with CUDA "
                f"{torch.version.cuda or 'none'}; no GPU visible or no driver); run with --device cpu")
        if not build_info()["cuda"]:
            raise _C.UnsupportedError(
                "--device cuda: this gradcomp build has no CUDA backend (gradcomp.build_info()['cuda'] is False); "
                "rebuild with GRADCOMP_CUDA=ON or run with --device cpu")


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(torch.cuda.current_device())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _timer(device: str, pick: Callable[[List[float]], float] = statistics.median
           ) -> Callable[[Callable[[], object], int], float]:
    """A function (fn, reps) -> ``pick`` (the median) of the seconds of ``reps`` calls of fn after
    one warm-up call."""
    if device == "cuda":
        def t(fn, reps):
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            return pick(ts)
    else:
        def t(fn, reps):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return pick(ts)
    return t


def _fmt(kernel: str, t: float, nbytes: int, copy_bps: float, base: str, tb: Optional[float], width: int) -> str:
    gbps = nbytes / t / 1e9
    tail = f"{tb * 1e3:9.3f} {tb / t:7.2f}x" if tb is not None else f"{'-':>9} {'-':>8}"
    return (f"{kernel:<{width}} {t * 1e3:9.3f} {gbps:8.2f} {nbytes / t / copy_bps:8.2f}  {base[:46]:<46} {tail}")


def run(device: str = "cpu", sizes: Sequence[int] = tuple(range(20, 27)),
        dtypes: Sequence[str] = ("float32", "bfloat16"), specs: Optional[Sequence[str]] = None,
        reps: int = 5, threads: Optional[int] = None,
        emit: Optional[Callable[[str], None]] = None) -> Dict:
    """Measure and return a ``gradcomp-bench/1`` table (a dict; see :mod:`gradcomp.bench`).

    Args:
        device: "cpu" or "cuda".
        sizes: log2 of the element counts (each in [0, 40]).
        dtypes: input dtypes, names of :data:`gradcomp.bench.DTYPES`.
        specs: codec specs (default :func:`gradcomp.bench.default_specs`: every registered codec);
            rows carry their canonical form.
        reps: timed repetitions per measurement (>= 1), after one warm-up.
        threads: CPU threads for gradcomp and torch (``gradcomp.set_num_threads``,
            ``torch.set_num_threads``) during the run, restored after; default gradcomp's current
            count.
        emit: called with each line of the printed table as it is measured (default: nothing).

    Raises:
        ValueError: a size, dtype, reps, threads or device outside what is accepted (named with
            the accepted values); gradcomp.InvalidArgumentError: a spec that does not parse.
        gradcomp.UnsupportedError: see :func:`check_device`.
    """
    check_device(device)
    emit = emit or (lambda line: None)
    sizes = list(sizes)
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= 40:
            raise ValueError(f"size 2^{s!r}: sizes are log2 element counts, integers in [0, 40]")
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"dtype {d!r}; accepted: {', '.join(DTYPES)}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps={reps!r}: expected an integer >= 1")
    if threads is None:
        threads = _C.get_num_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r}: expected an integer >= 1")
    specs = [Codec(s).spec for s in (default_specs() if specs is None else specs)]
    specs = list(dict.fromkeys(specs))
    if not sizes or not dtypes or not specs:
        raise ValueError(f"nothing to measure: sizes={sizes}, dtypes={list(dtypes)}, specs={specs} "
                         f"(each needs at least one entry)")
    saved = (_C.get_num_threads(), torch.get_num_threads())
    _C.set_num_threads(threads)
    torch.set_num_threads(threads)
    try:
        return _measure(device, sizes, dtypes, specs, reps, threads, emit)
    finally:  # a library call leaves the process's thread counts as it found them
        _C.set_num_threads(saved[0])
        torch.set_num_threads(saved[1])


def _measure(device, sizes, dtypes, specs, reps, threads, emit) -> Dict:
    timeit = _timer(device)
    floor_timeit = _timer(device, min)
    width = max([34] + [len(s) + len(" +ef encode") for s in specs])
    dev = torch.device(device)
    rows: List[dict] = []
    copies: List[dict] = []
    for lg in sizes:
        n = 1 << lg
        for dname in dtypes:
            dt = getattr(torch, dname)
            g = torch.Generator(device=dev).manual_seed(1234 + lg)
            x = torch.randn(n, generator=g, device=dev).to(dt)
            r0 = torch.randn(n, generator=g, device=dev).mul_(0.01)
            y = torch.empty_like(x)
            # the copy before and after the codecs of this input, the faster kept (see COPY_REPS)
            t_copy = floor_timeit(lambda: y.copy_(x), max(reps, COPY_REPS))
            group: List[dict] = []  # rows without the floor, and ("decode", ...) lines, in print order
            for spec in specs:
                c = Codec(spec)
                name = spec.split(":")[0]
                pb = c.packet_bytes(n, dname)
                pk = aligned_empty(x, pb)
                od = torch.empty_like(x)
                c.encode(x, out=pk)
                te = timeit(lambda: c.encode(x, out=pk), reps)
                td = timeit(lambda: c.decode(pk, out=od), reps)
                b = baselines.make(c, x)
                if b is not None:
                    tbe = timeit(b.encode, reps)
                    tbd = timeit(b.decode, reps)
                    desc, ddesc, summary = b.description, b.decode_description, b.summary
                else:
                    tbe = tbd = None
                    desc = ddesc = summary = f"no torch sequence for {spec} at n={n}"
                del b
                for ef in ([False, True] if name in baselines.EF_CODECS else [False]):
                    row = {"codec": spec, "dtype": dname, "numel": n, "packet_bytes": pb, "error_feedback": ef,
                           "encode_s": te, "decode_s": td, "encode_bytes": encode_bytes(n, dname, pb, ef),
                           "decode_bytes": decode_bytes(n, dname, pb), "baseline": summary,
                           "baseline_encode_s": tbe, "baseline_decode_s": tbd, "_desc": desc}
                    if ef:
                        r_g = r0.clone()
                        row["encode_s"] = timeit(lambda: c.encode(x, residual=r_g, out=pk), reps)
                        del r_g
                        r_b = r0.clone()
                        b = baselines.make(c, x, r_b)
                        row["baseline_encode_s"] = timeit(b.encode, reps) if b is not None else None
                        row["_desc"] = b.description if b is not None else f"no torch sequence for {spec} +ef at n={n}"
                        row["baseline"] = b.summary if b is not None else row["_desc"]
                        del b, r_b
                    group.append(row)
                group.append({"_decode": spec, "decode_s": td, "decode_bytes": decode_bytes(n, dname, pb),
                              "_desc": ddesc, "baseline_decode_s": tbd})
                del pk, od
            t_copy = min(t_copy, floor_timeit(lambda: y.copy_(x), max(reps, COPY_REPS)))
            del y
            cbytes = 2 * n * x.element_size()
            copy_bps = cbytes / t_copy
            copies.append({"dtype": dname, "numel": n, "copy_s": t_copy, "bytes_per_s": copy_bps})
            emit("")
            emit(f"n = 2^{lg} = {n} {dname}, {device} {threads} thread(s)")
            emit(header(width))
            emit(_fmt("copy (floor)", t_copy, cbytes, copy_bps, "", None, width))
            for row in group:
                desc = row.pop("_desc")
                if "_decode" in row:
                    emit(_fmt(f"{row['_decode']} decode", row["decode_s"], row["decode_bytes"], copy_bps, desc,
                              row["baseline_decode_s"], width))
                    continue
                row["copy_bytes_per_s"] = copy_bps
                row["floor_s"] = row["encode_bytes"] / copy_bps
                row["fraction_of_floor"] = row["floor_s"] / row["encode_s"]
                rows.append(row)
                emit(_fmt(f"{row['codec']}{' +ef' if row['error_feedback'] else ''} encode", row["encode_s"],
                          row["encode_bytes"], copy_bps, desc, row["baseline_encode_s"], width))
            del x, r0
            if device == "cuda":
                torch.cuda.empty_cache()
    table = {
        "format": FORMAT, "device": device, "device_name": _device_name(device), "threads": threads,
        "torch": torch.__version__, "gradcomp": build_info()["version"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_bytes_per_s": max(c["bytes_per_s"] for c in copies),
        "copies": copies, "rows": rows,
    }
    return validate(table, "gradcomp-bench run")
