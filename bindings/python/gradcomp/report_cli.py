"""``gradcomp-report``: a table and a PNG from the step reports a compressor wrote with ``log_file``.

Examples::

    gradcomp-report run.jsonl                     # table on stdout, run.png beside the log
    gradcomp-report run_{rank}.jsonl --rank 1 --png out/rank1.png

Input: a JSON-lines file, one step report per line (:func:`gradcomp.torch.stats.step_report`:
``gradcomp.torch.Compressor(..., log_every=N, log_file=PATH)``, the DDP hook's and the PowerSGD
hook's ``log_file``, and ``gradcomp-experiment``'s ``stats/`` folder). Several ranks may share
one file (each row names its rank); the report shows one rank: ``--rank`` (default the lowest in
the file).

The table (stdout) has one line per logged step and a last line of means: the step's wall time,
its split into compute and the encode, communication and decode that held the training loop up
(ms), the network share (exposed communication / step time), the bytes this rank sent per link
level (flat, intra-node, inter-node; KiB), the achieved bandwidth (MB/s: bytes sent / time some
collective was in flight) against the configured link's (``link`` %: utilization, ``-`` without
a cost model) and the p50 / p99 latency of the calls over the compressor's window (ms). The
traffic matrix (mean bytes per step that rank i sent to rank j, from the planner's model of the
collectives) follows for up to 8 ranks.

The PNG (matplotlib, Agg; ``--png``, default the log's path with ``.png``) has three panels: the
step time split per step (stacked bars: compute, encode, communication, decode), the network
share over the steps (with the 25 % line), and the traffic matrix as a heatmap.

Exit status 0; 2 on bad input -- a missing file, a line that is not a JSON object or lacks a
field (the message names the file, the line number and the field), no rows, a ``--rank`` not in
the file -- or bad arguments (argparse).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import List, Optional, TextIO

REQUIRED = {"step": (int,), "world_size": (int,), "step_s": (int, float), "compute_s": (int, float),
            "exposed": (dict,), "network_share": (int, float), "sent_bytes": (int, float), "bytes": (dict,)}
"""The fields a row must have, with their JSON types (the others may be null or missing)."""

PHASES = ("encode_s", "comm_s", "decode_s")
LEVELS = ("flat", "intra", "inter")
TRAFFIC_PRINT_MAX = 8
"""The table prints the traffic matrix for up to this many ranks (the PNG always draws it)."""


class ReportError(ValueError):
    """Bad input to ``gradcomp-report`` (the message names the file and the line)."""


def read_rows(path: str) -> List[dict]:
    """The rows of the JSON-lines file ``path`` (blank lines skipped), each checked for the fields
    of :data:`REQUIRED` and their types, and ``exposed`` / ``bytes`` for their keys.

    Raises:
        ReportError: the file cannot be read; a line is not a JSON object, or a field is missing
            or of another type (``path:LINE: ...``); the file holds no row.
    """
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ReportError(f"{path}: cannot read the stats log ({e.strerror or e})") from None
    rows = []
    with f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ReportError(f"{path}:{no}: not a JSON line ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ReportError(f"{path}:{no}: a JSON {type(row).__name__}, not an object (a step report)")
            for k, types in REQUIRED.items():
                v = row.get(k)
                if v is None or isinstance(v, bool) or not isinstance(v, types):
                    what = "missing" if k not in row else f"{v!r} is not a {'/'.join(t.__name__ for t in types)}"
                    raise ReportError(f"{path}:{no}: field {k!r} {what} (is this a gradcomp log_file?)")
            for k, keys in (("exposed", PHASES), ("bytes", LEVELS)):
                bad = [x for x in keys if not isinstance(row[k].get(x), (int, float))]
                if bad:
                    raise ReportError(f"{path}:{no}: field {k!r} lacks the number(s) {', '.join(bad)}")
            rows.append(row)
    if not rows:
        raise ReportError(f"{path}: no step report in the file")
    return rows


def ranks_of(rows: List[dict]) -> List[Optional[int]]:
    """The ranks the rows name, sorted (None, a row without a rank, first)."""
    return sorted({r.get("rank") for r in rows}, key=lambda x: (x is not None, x or 0))


def select(rows: List[dict], rank: Optional[int] = None) -> List[dict]:
    """The rows of ``rank`` (None: the lowest rank in the rows), in step order.

    Raises:
        ReportError: no row of that rank (the ranks present are in the message).
    """
    present = ranks_of(rows)
    want = present[0] if rank is None else rank
    out = sorted((r for r in rows if r.get("rank") == want), key=lambda r: r["step"])
    if not out:
        raise ReportError(f"--rank {rank}: no row of that rank; the file has rank(s) {present}")
    return out


def _num(x, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(scale * x, fmt)


def means(rows: List[dict]) -> dict:
    """The means over ``rows`` of the table's numbers: ``step_s``, ``compute_s``, ``exposed``
    (per phase), ``network_share`` (of the mean step: sum of exposed comm / sum of step time),
    ``sent_bytes``, ``bytes`` (per level) and ``traffic`` (the mean W x W matrix of the rows
    that carry one; None without). Seconds, bytes."""
    n = len(rows)
    step = sum(r["step_s"] for r in rows)
    out = {"steps": n, "step_s": step / n, "compute_s": sum(r["compute_s"] for r in rows) / n,
           "exposed": {f: sum(r["exposed"][f] for r in rows) / n for f in PHASES},
           "network_share": sum(r["exposed"]["comm_s"] for r in rows) / step if step > 0 else 0.0,
           "sent_bytes": sum(r["sent_bytes"] for r in rows) / n,
           "bytes": {lv: sum(r["bytes"][lv] for r in rows) / n for lv in LEVELS}}
    mats = [r["traffic"] for r in rows if r.get("traffic")]
    if mats:
        W = len(mats[0])
        out["traffic"] = [[sum(m[i][j] for m in mats) / len(mats) for j in range(W)] for i in range(W)]
    else:
        out["traffic"] = None
    return out


def format_table(rows: List[dict]) -> str:
    """The Markdown table of the module docstring for one rank's ``rows`` (step order)."""
    head = ("| step | step ms | compute ms | encode ms | comm ms | decode ms | net share | sent KiB | "
            "flat / intra / inter KiB | achieved MB/s | link % | p50 ms | p99 ms |")
    lines = [head, "|" + "---|" * 13]

    def line(label, r):
        by = r["bytes"]
        util = r.get("link_utilization")
        return (f"| {label} | {1e3 * r['step_s']:.2f} | {1e3 * r['compute_s']:.2f} | "
                f"{1e3 * r['exposed']['encode_s']:.2f} | {1e3 * r['exposed']['comm_s']:.2f} | "
                f"{1e3 * r['exposed']['decode_s']:.2f} | {100 * r['network_share']:.1f}% | "
                f"{r['sent_bytes'] / 1024:.1f} | "
                f"{by['flat'] / 1024:.1f} / {by['intra'] / 1024:.1f} / {by['inter'] / 1024:.1f} | "
                f"{_num(r.get('achieved_bytes_per_s'), '.2f', 1e-6)} | {_num(util, '.1f', 100)} | "
                f"{_num(r.get('latency_p50_s'), '.2f', 1e3)} | {_num(r.get('latency_p99_s'), '.2f', 1e3)} |")

    for r in rows:
        lines.append(line(str(r["step"]), r))
    m = means(rows)
    achieved = [r["achieved_bytes_per_s"] for r in rows if r.get("achieved_bytes_per_s") is not None]
    util = [r["link_utilization"] for r in rows if r.get("link_utilization") is not None]
    lines.append(line("mean", dict(m, achieved_bytes_per_s=statistics.fmean(achieved) if achieved else None,
                                   link_utilization=statistics.fmean(util) if util else None,
                                   latency_p50_s=rows[-1].get("latency_p50_s"),
                                   latency_p99_s=rows[-1].get("latency_p99_s"))))
    rank = rows[0].get("rank")
    lines += ["", f"Rank {'?' if rank is None else rank} of {rows[0]['world_size']}, {len(rows)} logged steps "
              f"(codec {rows[-1].get('codec', '?')}). Times per step; net share = exposed comm / step time "
              f"(the mean line: over all steps); the mean line's p50 / p99 are the last row's (its window)."]
    t = m["traffic"]
    if t is not None and len(t) <= TRAFFIC_PRINT_MAX:
        lines += ["", "Traffic (mean bytes per step, row = sender, column = receiver):", ""]
        lines.append("| from \\ to | " + " | ".join(str(j) for j in range(len(t))) + " |")
        lines.append("|" + "---|" * (len(t) + 1))
        lines += [f"| {i} | " + " | ".join(f"{x:.0f}" for x in row) + " |" for i, row in enumerate(t)]
    return "\n".join(lines)


def plot(rows: List[dict], path: str) -> None:
    """Write the PNG of the module docstring for one rank's ``rows`` to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [2.2, 2.2, 1.4]})
    ax = axes[0]
    bottom = [0.0] * len(rows)
    parts = [("compute", lambda r: r["compute_s"], "#8fa8c8")] + [
        (f.split("_")[0] if f != "comm_s" else "communication", lambda r, f=f: r["exposed"][f], c)
        for f, c in zip(PHASES, ("#e0a040", "#c04040", "#60a060"))]
    for label, get, color in parts:
        h = [1e3 * get(r) for r in rows]
        ax.bar(steps, h, bottom=bottom, color=color, label=label, width=0.8)
        bottom = [b + x for b, x in zip(bottom, h)]
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("step time split")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.plot(steps, [100 * r["network_share"] for r in rows], marker="o", ms=3)
    ax.axhline(25, color="gray", ls="--", lw=1)
    ax.set_ylim(0, max(30.0, 5 + max(100 * r["network_share"] for r in rows)))
    ax.set_xlabel("step")
    ax.set_ylabel("exposed communication, % of the step")
    ax.set_title("network share")
    ax = axes[2]
    t = means(rows)["traffic"]
    if t is None:
        ax.text(0.5, 0.5, "no traffic matrix in the log\n(more ranks than the report carries)",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        im = ax.imshow(t, cmap="viridis")
        fig.colorbar(im, ax=ax, label="bytes per step")
        ax.set_xlabel("to rank")
        ax.set_ylabel("from rank")
        ax.set_title("traffic matrix")
        if len(t) <= 16:
            ax.set_xticks(range(len(t)))
            ax.set_yticks(range(len(t)))
    rank = rows[0].get("rank")
    fig.suptitle(f"gradcomp: rank {'?' if rank is None else rank} of {rows[0]['world_size']}, "
                 f"codec {rows[-1].get('codec', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gradcomp-report", description="A table and a PNG from a gradcomp stats log "
                                "(the JSON lines of log_file=).")
    p.add_argument("log", help="the JSON-lines stats log (RUN.jsonl)")
    p.add_argument("--png", default=None, help="where to write the PNG (default: the log's path with .png)")
    p.add_argument("--rank", type=int, default=None, help="the rank to show (default: the lowest in the file)")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None, out: TextIO = None) -> int:
    """Entry point of ``gradcomp-report``; returns the exit status (0, or 2 on bad input, with the
    reason on stderr)."""
    a = parse_args(argv)
    out = out or sys.stdout
    try:
        rows = select(read_rows(a.log), a.rank)
    except ReportError as e:
        sys.stderr.write(f"gradcomp-report: {e}\n")
        return 2
    png = a.png or (os.path.splitext(a.log)[0] + ".png")
    out.write(format_table(rows) + "\n")
    plot(rows, png)
    out.write(f"\npng: {os.path.abspath(png)}\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
