"""The reader of ``gradcomp-bench`` JSON tables, the measured codec speeds the cost model
(:class:`gradcomp.planner.Throughput`) takes its kernel times from. ``gradcomp-bench``
(:mod:`gradcomp.bench`, which re-exports every name here) writes the format; this module defines
and reads it:

- :func:`load` reads and validates a ``gradcomp-bench/1`` JSON file (:func:`validate` checks a dict);
- :func:`throughput` gives a codec's encode / decode speed (elements per second) on one dtype;
- :func:`encode_bytes` / :func:`decode_bytes` are the compulsory bytes of a row's encode / decode.

File format ``gradcomp-bench/1`` (one file per run; byte counts are exact, times are seconds,
medians over the repetitions)::

    {"format": "gradcomp-bench/1", "device": "cpu" | "cuda", "device_name": str, "threads": int,
     "torch": str, "gradcomp": str, "date": str (ISO 8601, UTC),
     "copy_bytes_per_s": float,  # the best copy bandwidth measured: bytes read + written per s
     "copies": [{"dtype", "numel", "copy_s", "bytes_per_s"}],  # the torch copy of each input (fastest run)
     "rows": [{"codec": str (canonical spec), "dtype": "float32" | "bfloat16" | "float16",
               "numel": int, "packet_bytes": int, "error_feedback": bool,
               "encode_s": float, "decode_s": float,
               "encode_bytes": int,      # encode_bytes(numel, dtype, packet_bytes, error_feedback)
               "decode_bytes": int,      # decode_bytes(numel, dtype, packet_bytes)
               "copy_bytes_per_s": float,  # the copy of this row's input (same numel and dtype)
               "floor_s": float,         # encode_bytes / copy_bytes_per_s (of the row)
               "fraction_of_floor": float,  # floor_s / encode_s
               "baseline": str, "baseline_encode_s": float | None, "baseline_decode_s": float | None}]}

``rows`` hold one row per (numel, dtype, codec) without error feedback and, for the codecs users
run with it (``gradcomp.bench.baselines.EF_CODECS``), one with it (encode with a float32 residual). A row with
error feedback has the decode times of the row without (the decode is the same operation).
``baseline_*_s`` is None where no torch sequence is written for a codec. The keys ``copies``,
``decode_bytes`` and the rows' ``copy_bytes_per_s`` are extras: :func:`load` does not require them;
so are the spreads ``encode_spread_s``, ``decode_spread_s``, ``baseline_encode_spread_s``,
``baseline_decode_spread_s`` (``[min, median, max]`` seconds of the interleaved rounds, None
without a baseline) and ``copies[i]["copy_spread_s"]``, the rows' ``flags`` (why a row is not a
result: ``noisy ...`` when its rounds spread more than 2x, ``... beats the copy floor`` when its
bytes moved faster than 1.1x the copy) and the file's ``flagged`` / ``measurements`` counts.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Tuple, Union

from .bytes import decode_traffic_bytes, encode_traffic_bytes


FORMAT = "gradcomp-bench/1"

DTYPES = ("float32", "bfloat16", "float16")
"""Input dtypes a row may have (the CLI's default: float32 and bfloat16)."""

_NUM = "number"
_NUM_OR_NONE = "number or null"
TOP_KEYS = {"format": str, "device": str, "device_name": str, "threads": int, "torch": str,
            "gradcomp": str, "date": str, "copy_bytes_per_s": _NUM, "rows": list}
"""The keys every file has, with their JSON types."""
ROW_KEYS = {"codec": str, "dtype": str, "numel": int, "packet_bytes": int, "error_feedback": bool,
            "encode_s": _NUM, "decode_s": _NUM, "encode_bytes": int, "floor_s": _NUM,
            "fraction_of_floor": _NUM, "baseline": str, "baseline_encode_s": _NUM_OR_NONE,
            "baseline_decode_s": _NUM_OR_NONE}
"""The keys every row has, with their JSON types."""


def encode_bytes(numel: int, dtype: str, packet_bytes: int, error_feedback: bool) -> int:
    """Compulsory bytes of an encode (:func:`gradcomp.planner.encode_traffic_bytes`: input read,
    packet written, + the float32 residual read and written with error feedback)."""
    return encode_traffic_bytes(numel, dtype, packet_bytes, error_feedback)


def decode_bytes(numel: int, dtype: str, packet_bytes: int) -> int:
    """Compulsory bytes of a decode (:func:`gradcomp.planner.decode_traffic_bytes`: packet read,
    output written)."""
    return decode_traffic_bytes(numel, dtype, packet_bytes)


def _type_ok(v: Any, t: Any) -> bool:
    if t is _NUM:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if t is _NUM_OR_NONE:
        return v is None or _type_ok(v, _NUM)
    if t is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, t)


def _tname(t: Any) -> str:
    return t if isinstance(t, str) else {str: "string", int: "integer", bool: "boolean", list: "list"}[t]


def _check_keys(obj: Dict[str, Any], keys: Dict[str, Any], where: str) -> None:
    """Raise ValueError naming ``where`` and the first key of ``keys`` that ``obj`` lacks or holds
    with another JSON type."""
    for k, t in keys.items():
        if k not in obj:
            raise ValueError(f"{where}: missing key {k!r}")
        if not _type_ok(obj[k], t):
            raise ValueError(f"{where}: key {k!r} = {obj[k]!r} is not a {_tname(t)}")


def validate(table: Any, where: str = "table") -> Dict[str, Any]:
    """Check that ``table`` is a ``gradcomp-bench/1`` dict (the keys and types of the module
    docstring; rows with positive times and numel, a dtype of :data:`DTYPES`); returns it.

    Raises:
        ValueError: naming ``where``, the first missing key (``rows[3]: missing key 'encode_s'``),
            a value of the wrong type, or a format other than ``gradcomp-bench/1``.
    """
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a JSON object with format {FORMAT!r}, got {type(table).__name__}")
    if "format" not in table:
        raise ValueError(f"{where}: missing key 'format' (expected {FORMAT!r}; not a gradcomp-bench file?)")
    if table["format"] != FORMAT:
        raise ValueError(f"{where}: format {table['format']!r} is not supported; accepted: {FORMAT!r}")
    _check_keys(table, TOP_KEYS, where)
    if table["device"] not in ("cpu", "cuda"):
        raise ValueError(f"{where}: device {table['device']!r}; accepted: 'cpu', 'cuda'")
    for i, r in enumerate(table["rows"]):
        if not isinstance(r, dict):
            raise ValueError(f"{where}: rows[{i}] is a {type(r).__name__}, expected an object")
        _check_keys(r, ROW_KEYS, f"{where}: rows[{i}]")
        if r["dtype"] not in DTYPES:
            raise ValueError(f"{where}: rows[{i}]: dtype {r['dtype']!r}; accepted: {', '.join(DTYPES)}")
        for k in ("numel", "encode_s", "decode_s"):
            if r[k] <= 0:
                raise ValueError(f"{where}: rows[{i}]: {k} = {r[k]!r} must be > 0")
    return table


def load(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """Read a gradcomp-bench JSON file (``bench_cpu.json`` / ``bench_cuda.json`` as the CLI writes
    them) and validate it (:func:`validate`); returns the dict.

    Raises:
        ValueError: the file is not JSON, or a key is missing or of the wrong type, or the format is
            not ``gradcomp-bench/1`` (the message names the path and the key).
        OSError: the file cannot be read.
    """
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{os.fspath(path)}: not a JSON file ({e})") from None
    return validate(table, os.fspath(path))


def _canonical(spec: str) -> str:
    try:
        from ..codec import Codec

        return Codec(spec).spec
    except Exception:  # an unknown or unparsable spec is looked up as written
        return spec


def throughput(table: Dict[str, Any], codec_spec: str, dtype: Any) -> Tuple[float, float]:
    """``(encode, decode)`` in elements per second for ``codec_spec`` on input ``dtype``, from the
    row with the largest numel among the rows without error feedback (among those with, when the
    table has none without): ``(numel / encode_s, numel / decode_s)``.

    Args:
        table: a dict as :func:`load` returns.
        codec_spec: a spec; compared in canonical form (``"topk:ratio=0.010"`` finds
            ``"topk:ratio=0.01"``).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype.

    Raises:
        KeyError: no row for that codec and dtype; the message lists the (codec, dtype) pairs the
            table has.
    """
    spec = _canonical(codec_spec)
    dname = str(dtype).replace("torch.", "")
    rows = [r for r in table["rows"] if r["codec"] == spec and r["dtype"] == dname]
    if not rows:
        have = sorted({(r["codec"], r["dtype"]) for r in table["rows"]})
        raise KeyError(f"gradcomp.bench.throughput: no row for codec {spec!r} with dtype {dname!r}; the table has "
                       f"{', '.join(f'{c} {d}' for c, d in have) or 'no rows'}")
    plain = [r for r in rows if not r["error_feedback"]]
    r = max(plain or rows, key=lambda r: r["numel"])
    return r["numel"] / r["encode_s"], r["numel"] / r["decode_s"]


__all__ = ["FORMAT", "DTYPES", "TOP_KEYS", "ROW_KEYS", "load", "validate", "throughput", "encode_bytes",
           "decode_bytes"]
