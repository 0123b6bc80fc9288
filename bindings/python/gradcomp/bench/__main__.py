"""``gradcomp-bench`` / ``python -m gradcomp.bench``: every codec beside torch and the copy floor.

For each size (``--sizes``, log2 element counts; default 2^20..2^26 on the CPU, 2^20..2^28 on
CUDA), input dtype (``--dtypes``, default float32 and bfloat16) and codec spec (``--codecs``,
default every registered codec's default spec plus ``topk:ratio=0.01``): gradcomp's encode and
decode, the torch sequence a user would write for the same packet (:mod:`gradcomp.bench.baselines`)
and, once per (size, dtype), a torch copy of the same input: the floor. For the codecs users run
with error feedback (:data:`gradcomp.bench.baselines.EF_CODECS`) also the encode with error
feedback (a float32 residual read and updated), beside the same step written in torch.

Printed, per (size, dtype), one line per measurement with the columns
``kernel, ms, spread, GB/s, of copy, baseline, ms, spread, speedup``: ms the median time; spread
the slowest round over the fastest; GB/s the compulsory bytes over the median (encode: input read
+ packet written, + 8 bytes per element for the residual with error feedback; decode: packet read
+ output written; 1e9 bytes); ``of copy`` that rate over the copy's bytes read + written per
second (for an encode, the fraction of the floor reached); the baseline's description, median ms,
spread and speedup = baseline ms / gradcomp ms. A line ending in ``!`` is not a result: its rounds
spread more than 2x, or its kernel moved its bytes faster than 1.1x the copy floor (a busy machine,
or data in a cache the copy did not use); the reasons follow the block, and a count ends the run.

Writes into ``--out`` (default results/bench): ``bench_<device>.json`` (format gradcomp-bench/1,
see :mod:`gradcomp.bench`; read it with ``gradcomp.bench.load``), ``bench_<device>.png`` (encode
GB/s against size, one line per codec, the copy as a dashed line; matplotlib) and
``bench_<device>.txt`` (the printed table).

Timing: per input and codec, its kernels, its torch baselines and the copy run in ``--reps``
interleaved rounds (one call of each per round, the order rotated, after one warm-up call of each),
so a burst of load hits them alike; CPU time.perf_counter, CUDA torch.cuda event pairs on the
current stream (:func:`gradcomp.bench.timing.clock`, the clock of every benchmark); medians
reported with their spread. The copy floor is the fastest copy of all the rounds of that input:
the best the machine did (at sizes that fit in the last-level cache, as --quick's on a CPU, that
is a copy from cache). ``--threads`` sets both gradcomp's and torch's CPU thread counts (default
gradcomp's: GRADCOMP_NUM_THREADS or the OpenMP default). ``--quick``: sizes 2^20 and 2^22, 3 reps
(explicit ``--sizes`` / ``--reps`` win); how long it takes is in bench/RESULTS.md, section
"gradcomp-bench --quick: run time".

Exit status 0; 2 on bad arguments (argparse), including ``--device cuda`` where torch sees no
GPU or gradcomp was built without CUDA.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def parse_args(argv: Optional[List[str]] = None):
    from .. import _C
    from ..codec import Codec
    from . import DTYPES, default_specs

    p = argparse.ArgumentParser(prog="gradcomp-bench", description=__doc__.split("\n\n")[1],
                                epilog="See python -m pydoc gradcomp.bench.__main__ for the columns and files.")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--sizes", type=int, nargs="+", metavar="LOG2",
                   help="log2 element counts (default 20..26 on cpu, 20..28 on cuda; --quick: 20 22)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], metavar="DTYPE",
                   help=f"input dtypes (default float32 bfloat16; accepted: {', '.join(DTYPES)})")
    p.add_argument("--codecs", nargs="+", metavar="SPEC",
                   help=f"codec specs (default: {' '.join(default_specs())})")
    p.add_argument("--reps", type=int, help="timed repetitions per measurement, medians (default 5; --quick: 3)")
    p.add_argument("--threads", type=int, help="CPU threads for gradcomp and torch (default gradcomp's current count)")
    p.add_argument("--out", default=os.path.join("results", "bench"), help="output folder (default results/bench)")
    p.add_argument("--quick", action="store_true", help="sizes 2^20 and 2^22, 3 reps")
    a = p.parse_args(argv)
    if a.device not in ("cpu", "cuda"):
        p.error(f"--device {a.device!r}; accepted: cpu, cuda")
    if a.sizes is None:
        a.sizes = [20, 22] if a.quick else list(range(20, 29 if a.device == "cuda" else 27))
    for s in a.sizes:
        if not 0 <= s <= 40:
            p.error(f"--sizes {s}: log2 element counts in [0, 40]")
    for d in a.dtypes:
        if d not in DTYPES:
            p.error(f"--dtypes {d!r}; accepted: {', '.join(DTYPES)}")
    if a.reps is None:
        a.reps = 3 if a.quick else 5
    if a.reps < 1:
        p.error(f"--reps {a.reps}: expected an integer >= 1")
    if a.threads is not None and a.threads < 1:
        p.error(f"--threads {a.threads}: expected an integer >= 1")
    if a.codecs is not None:
        for s in a.codecs:
            try:
                Codec(s)
            except ValueError as e:
                p.error(f"--codecs {s!r}: {e}")
    from .runner import check_device

    try:
        check_device(a.device)
    except (ValueError, _C.UnsupportedError) as e:
        p.error(str(e))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("gradcomp-bench writes a PNG with matplotlib, which is not installed (pip install matplotlib)")
    return a


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``gradcomp-bench``; returns the exit status (0)."""
    a = parse_args(argv)
    from .plot import plot
    from .runner import run

    os.makedirs(a.out, exist_ok=True)
    lines: List[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    table = run(device=a.device, sizes=a.sizes, dtypes=a.dtypes, specs=a.codecs, reps=a.reps,
                threads=a.threads, emit=emit)
    emit("")
    emit(f"gradcomp {table['gradcomp']}, torch {table['torch']}, {table['device']} ({table['device_name']}), "
         f"{table['threads']} thread(s), best copy {table['copy_bytes_per_s'] / 1e9:.2f} GB/s, {table['date']}")
    import json

    base = os.path.join(a.out, f"bench_{a.device}")
    with open(base + ".json", "w") as f:
        json.dump(table, f, indent=1)
    plot(table, base + ".png")
    with open(base + ".txt", "w") as f:
        f.write("\n".join(lines).lstrip("\n") + "\n")
    sys.stdout.write(f"wrote {base}.json, {base}.png, {base}.txt\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
