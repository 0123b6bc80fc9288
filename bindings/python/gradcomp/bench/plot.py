"""The PNG of gradcomp-bench: encode throughput against size, one panel per input dtype."""

from __future__ import annotations

from typing import Any, Dict


def plot(table: Dict[str, Any], path: str) -> None:
    """Write a PNG (matplotlib, Agg backend) of ``table`` (a ``gradcomp-bench/1`` dict) to ``path``:
    per input dtype one panel of encode GB/s (compulsory bytes, ``encode_bytes / encode_s``, 1e9
    bytes) against numel (log2 axis), one line per codec spec (rows without error feedback), and
    the torch copy of the same input (bytes read + written per second) as a dashed black line.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["dtype"] for r in table["rows"]))
    fig, axes = plt.subplots(1, max(1, len(dtypes)), figsize=(6.4 * max(1, len(dtypes)), 4.8), dpi=110,
                             squeeze=False)
    for ax, dname in zip(axes[0], dtypes):
        rows = [r for r in table["rows"] if r["dtype"] == dname and not r["error_feedback"]]
        for spec in dict.fromkeys(r["codec"] for r in rows):
            pts = sorted((r["numel"], r["encode_bytes"] / r["encode_s"] / 1e9) for r in rows if r["codec"] == spec)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=spec)
        cp = sorted((c["numel"], c["bytes_per_s"] / 1e9) for c in table.get("copies", []) if c["dtype"] == dname)
        if not cp:  # a file without the per-input copies: the best copy as a flat line
            ns = sorted({r["numel"] for r in rows})
            cp = [(n, table["copy_bytes_per_s"] / 1e9) for n in ns]
        ax.plot([p[0] for p in cp], [p[1] for p in cp], "k--", linewidth=1.4, label="copy (floor)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("elements (log2)")
        ax.set_ylabel("encode GB/s (input read + packet written)")
        ax.set_title(f"{dname} input")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"gradcomp-bench {table['gradcomp']}: {table['device']} ({table['device_name']}), "
                 f"{table['threads']} thread(s), torch {table['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
