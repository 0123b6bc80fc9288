"""The measurements of gradcomp-bench: :func:`run` times every codec's encode and decode, the torch
baseline of each (:mod:`gradcomp.bench.baselines`) and a torch copy of the same input, and returns
the ``gradcomp-bench/1`` table (see :mod:`gradcomp.bench`).

Timing: per input (size, dtype) and codec, the codec's encode and decode (and its encode with
error feedback), the torch baselines of each and a torch copy of the same input run in ``reps``
interleaved rounds (one call of each per round, the order rotated each round, after one warm-up
call of each), each call timed by :func:`gradcomp.bench.timing.clock` (CPU ``time.perf_counter``,
CUDA two ``torch.cuda.Event`` records on the current stream). A row reports each measurement's
median and its spread ``[min, median, max]``; the copy floor is the fastest copy of every round of
that input. A row whose rounds spread more than :data:`SPREAD_LIMIT` or whose kernel beats the
floor by :data:`FLOOR_LIMIT` carries ``flags``, is marked ``!`` in the table and named under it:
not a result (a busy machine). Inputs: normal(0, 1) float32 drawn from a fixed seed, cast to the
dtype; residuals normal(0, 0.01) float32. Every output (packets, decoded tensors, the baselines'
buffers) is allocated before timing.
"""

from __future__ import annotations

import datetime
import platform
import statistics
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .. import _C
from ..codec import Codec, aligned_empty, build_info
from . import FORMAT, DTYPES, baselines, decode_bytes, default_specs, encode_bytes, validate
from .timing import clock


def header(width: int = 34) -> str:
    """The table's column line: kernel (``width`` characters), ms, spread, GB/s, of copy, baseline,
    ms, spread, speedup (and ``!`` after a flagged line)."""
    return (f"{'kernel':<{width}} {'ms':>9} {'spread':>7} {'GB/s':>8} {'of copy':>8}  {'baseline':<46} {'ms':>9} "
            f"{'spread':>7} {'speedup':>8}")


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


SPREAD_LIMIT = 2.0
"""A measurement whose slowest round took more than this times its fastest is flagged ``noisy``:
the machine was busy (another process, a scheduler time slice), and its median is not a result."""

FLOOR_LIMIT = 1.10
"""A kernel whose compulsory bytes moved faster than this times the copy floor of the same input
is flagged ``beats the copy floor``: physically it cannot (the floor was measured under contention,
or the data sat in a cache the copy did not use)."""


def _rounds(device: str, items: Dict[str, Callable[[], object]], reps: int) -> Dict[str, List[float]]:
    """Time every callable of ``items`` once per round, ``reps`` rounds, the order rotated by one
    each round (so no measurement always runs right after the same other), after one warm-up
    call of each. Returns the seconds of every round per name."""
    t = clock(device)
    names = list(items)
    for n in names:
        items[n]()
    if device == "cuda":
        torch.cuda.synchronize()
    out: Dict[str, List[float]] = {n: [] for n in names}
    for k in range(reps):
        for n in names[k % len(names):] + names[: k % len(names)]:
            out[n].append(t(items[n]))
    return out


def _spread(ts: Optional[List[float]]) -> Optional[List[float]]:
    """[min, median, max] of a measurement's rounds (None for none)."""
    return None if not ts else [min(ts), statistics.median(ts), max(ts)]


def _flags(row: dict, copy_bps: float) -> List[str]:
    """What makes a measurement not a result (:data:`SPREAD_LIMIT`, :data:`FLOOR_LIMIT`)."""
    out = []
    for what, sp in (("encode", row.get("encode_spread_s")), ("decode", row.get("decode_spread_s")),
                     ("baseline encode", row.get("baseline_encode_spread_s")),
                     ("baseline decode", row.get("baseline_decode_spread_s"))):
        if sp is not None and sp[0] > 0 and sp[2] / sp[0] > SPREAD_LIMIT:
            out.append(f"noisy {what}: slowest round {sp[2] / sp[0]:.1f}x the fastest")
    for what, nbytes, t in (("encode", row.get("encode_bytes"), row.get("encode_s")),
                            ("decode", row.get("decode_bytes"), row.get("decode_s"))):
        if nbytes and t and nbytes / t / copy_bps > FLOOR_LIMIT:
            out.append(f"{what} beats the copy floor: {nbytes / t / copy_bps:.2f} of copy")
    return out


def _fmt(kernel: str, t: float, nbytes: int, copy_bps: float, base: str, tb: Optional[float], width: int,
         spread: Optional[List[float]] = None, bspread: Optional[List[float]] = None, flagged: bool = False) -> str:
    gbps = nbytes / t / 1e9
    sp = f"x{spread[2] / spread[0]:.2f}" if spread and spread[0] > 0 else "-"
    bsp = f"x{bspread[2] / bspread[0]:.2f}" if bspread and bspread[0] > 0 else "-"
    tail = f"{tb * 1e3:9.3f} {bsp:>7} {tb / t:7.2f}x" if tb is not None else f"{'-':>9} {'-':>7} {'-':>8}"
    return (f"{kernel:<{width}} {t * 1e3:9.3f} {sp:>7} {gbps:8.2f} {nbytes / t / copy_bps:8.2f}  {base[:46]:<46} "
            f"{tail}{'  !' if flagged else ''}")


def _elias_line(spec: str, packet, n: int, ts) -> str:
    """What an Elias-coded QSGD row adds: the stream's bits per element (the header's main parameter
    over n; 8 in the fallback, the int8 codes) and the coder's throughput in elements per second.
    BytePS's CPU Elias coder (its `dithering` compressor) publishes no throughput to compare with."""
    h = packet[:32].cpu().numpy()
    bits = int(h[24:32].view("<u8")[0])
    fallback = bool(h[11] & 2)
    per = 8.0 if fallback else bits / n
    enc, dec = statistics.median(ts["encode"]), statistics.median(ts["decode"])
    return (f"{spec}: stream {per:.2f} bits per element{' (fallback: the int8 codes)' if fallback else ''}, "
            f"capacity 8; coder {n / enc / 1e6:.0f} M elements/s encode, {n / dec / 1e6:.0f} M elements/s "
            f"decode (BytePS publishes no figure for its CPU Elias coder)")


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
    width = max([34] + [len(s) + len(" +ef encode") for s in specs])
    dev = torch.device(device)
    rows: List[dict] = []
    copies: List[dict] = []
    flagged = total = 0
    for lg in sizes:
        n = 1 << lg
        for dname in dtypes:
            dt = getattr(torch, dname)
            g = torch.Generator(device=dev).manual_seed(1234 + lg)
            x = torch.randn(n, generator=g, device=dev).to(dt)
            r0 = torch.randn(n, generator=g, device=dev).mul_(0.01)
            y = torch.empty_like(x)
            copy_ts: List[float] = []
            infos: List[str] = []
            group: List[dict] = []  # rows without the floor, and ("decode", ...) lines, in print order
            for spec in specs:
                # one codec's kernels, its torch baselines and the copy, interleaved in rounds
                c = Codec(spec)
                name = spec.split(":")[0]
                pb = c.packet_bytes(n, dname)
                pk = aligned_empty(x, pb)
                od = torch.empty_like(x)
                c.encode(x, out=pk)
                items: Dict[str, Callable[[], object]] = {"copy": lambda: y.copy_(x),
                                                          "encode": lambda: c.encode(x, out=pk),
                                                          "decode": lambda: c.decode(pk, out=od)}
                b = baselines.make(c, x)
                if b is not None:
                    items["b_encode"], items["b_decode"] = b.encode, b.decode
                    desc, ddesc, summary = b.description, b.decode_description, b.summary
                else:
                    desc = ddesc = summary = f"no torch sequence for {spec} at n={n}"
                ef = name in baselines.EF_CODECS
                r_g = r_b = b_ef = None
                if ef:
                    r_g, r_b = r0.clone(), r0.clone()
                    items["encode_ef"] = lambda: c.encode(x, residual=r_g, out=pk)
                    b_ef = baselines.make(c, x, r_b)
                    if b_ef is not None:
                        items["b_encode_ef"] = b_ef.encode
                ts = _rounds(device, items, reps)
                copy_ts += ts["copy"]
                if "coding=elias" in spec:
                    infos.append(_elias_line(spec, pk, n, ts))
                for with_ef in ([False, True] if ef else [False]):
                    enc = ts["encode_ef" if with_ef else "encode"]
                    benc = ts.get("b_encode_ef" if with_ef else "b_encode")
                    row = {"codec": spec, "dtype": dname, "numel": n, "packet_bytes": pb, "error_feedback": with_ef,
                           "encode_s": statistics.median(enc), "decode_s": statistics.median(ts["decode"]),
                           "encode_bytes": encode_bytes(n, dname, pb, with_ef), "decode_bytes": decode_bytes(n, dname, pb),
                           "baseline": summary, "baseline_encode_s": statistics.median(benc) if benc else None,
                           "baseline_decode_s": statistics.median(ts["b_decode"]) if "b_decode" in ts else None,
                           "encode_spread_s": _spread(enc), "decode_spread_s": _spread(ts["decode"]),
                           "baseline_encode_spread_s": _spread(benc), "baseline_decode_spread_s": _spread(ts.get("b_decode")),
                           "_desc": desc}
                    if with_ef:
                        row["_desc"] = b_ef.description if b_ef is not None else f"no torch sequence for {spec} +ef at n={n}"
                        row["baseline"] = b_ef.summary if b_ef is not None else row["_desc"]
                    group.append(row)
                group.append({"_decode": spec, "decode_s": statistics.median(ts["decode"]),
                              "decode_bytes": decode_bytes(n, dname, pb), "_desc": ddesc,
                              "baseline_decode_s": statistics.median(ts["b_decode"]) if "b_decode" in ts else None,
                              "decode_spread_s": _spread(ts["decode"]), "baseline_decode_spread_s": _spread(ts.get("b_decode"))})
                del b, b_ef, r_g, r_b, pk, od, items, ts
            del y
            t_copy = min(copy_ts)  # the floor: the fastest copy of every round of this input
            cbytes = 2 * n * x.element_size()
            copy_bps = cbytes / t_copy
            copies.append({"dtype": dname, "numel": n, "copy_s": t_copy, "bytes_per_s": copy_bps,
                           "copy_spread_s": _spread(copy_ts)})
            emit("")
            emit(f"n = 2^{lg} = {n} {dname}, {device} {threads} thread(s)")
            emit(header(width))
            emit(_fmt("copy (floor)", t_copy, cbytes, copy_bps, "", None, width))
            notes: List[str] = []
            for row in group:
                desc = row.pop("_desc")
                if "_decode" in row:
                    fl = _flags({"decode_bytes": row["decode_bytes"], "decode_s": row["decode_s"],
                                 "decode_spread_s": row["decode_spread_s"],
                                 "baseline_decode_spread_s": row["baseline_decode_spread_s"]}, copy_bps)
                    total += 1
                    flagged += bool(fl)
                    notes += [f"{row['_decode']} decode: {f}" for f in fl]
                    emit(_fmt(f"{row['_decode']} decode", row["decode_s"], row["decode_bytes"], copy_bps, desc,
                              row["baseline_decode_s"], width, row["decode_spread_s"],
                              row["baseline_decode_spread_s"], bool(fl)))
                    continue
                row["copy_bytes_per_s"] = copy_bps
                row["floor_s"] = row["encode_bytes"] / copy_bps
                row["fraction_of_floor"] = row["floor_s"] / row["encode_s"]
                fl = _flags({k: row[k] for k in ("encode_spread_s", "baseline_encode_spread_s", "encode_bytes",
                                                 "encode_s")}, copy_bps)
                row["flags"] = fl
                total += 1
                flagged += bool(fl)
                label = f"{row['codec']}{' +ef' if row['error_feedback'] else ''} encode"
                notes += [f"{label}: {f}" for f in fl]
                rows.append(row)
                emit(_fmt(label, row["encode_s"], row["encode_bytes"], copy_bps, desc, row["baseline_encode_s"], width,
                          row["encode_spread_s"], row["baseline_encode_spread_s"], bool(fl)))
            for line in infos:
                emit(f"  {line}")
            for note in notes:
                emit(f"  ! not a result: {note}")
            del x, r0
            if device == "cuda":
                torch.cuda.empty_cache()
    if flagged:
        emit("")
        emit(f"! {flagged} of {total} measurements are flagged (spread over {SPREAD_LIMIT:g}x between rounds, or "
             f"faster than {FLOOR_LIMIT:g}x the copy floor): the machine was busy; run again on a quiet one")
    table = {
        "format": FORMAT, "device": device, "device_name": _device_name(device), "threads": threads,
        "torch": torch.__version__, "gradcomp": build_info()["version"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "copy_bytes_per_s": max(c["bytes_per_s"] for c in copies),
        "copies": copies, "rows": rows, "flagged": flagged, "measurements": total,
    }
    return validate(table, "gradcomp-bench run")
