"""gradcomp-bench: every registered codec's encode and decode beside the torch sequence a user would
write for the same packet, and beside the copy floor measured in the same run.

The CLI is ``gradcomp-bench`` / ``python -m gradcomp.bench`` (:mod:`gradcomp.bench.__main__`, which
documents the options and the printed table). The bench writes ``gradcomp-bench/1`` JSON files; the
planner's cost model reads them, so the format and its reader live in :mod:`gradcomp.planner.table`
(whose docstring documents every key) and are re-exported here:

- :func:`load` reads and validates a ``gradcomp-bench/1`` JSON file (:func:`validate` checks a dict);
- :func:`throughput` gives a codec's encode / decode speed (elements per second) on one dtype;
- :func:`encode_bytes` / :func:`decode_bytes` are the compulsory bytes of a row's encode / decode;
- :data:`FORMAT`, :data:`DTYPES` (the input dtypes a row may have), :data:`TOP_KEYS` and
  :data:`ROW_KEYS` (the keys every file / row has, with their JSON types).

This module itself holds :func:`default_specs`, the specs the bench runs by default.
"""

from __future__ import annotations

from typing import List

from ..planner.table import (  # noqa: F401  (the format's reader, re-exported: the bench writes the format)
    _NUM, _NUM_OR_NONE, DTYPES, FORMAT, ROW_KEYS, TOP_KEYS, _canonical, _tname, _type_ok, decode_bytes, encode_bytes,
    load, throughput, validate,
)


def default_specs() -> List[str]:
    """The specs gradcomp-bench runs by default: every registered codec's default (``Codec(name)``,
    or its first example spec when the name alone does not parse, as ``topk``), plus
    ``topk:ratio=0.01``, ``qsgd:levels=16,coding=elias`` (with ``qsgd:levels=16`` beside it) and
    ``int8:integrity=crc32c`` (the checksum's cost beside ``int8``);
    registry order, no duplicates."""
    from ..codec import Codec, codecs

    out: List[str] = []
    for c in codecs():
        try:
            spec = Codec(c["name"]).spec
        except ValueError:
            spec = Codec(c["examples"][0]).spec
        extra = {"topk": ["topk:ratio=0.01"], "qsgd": ["qsgd:levels=16", "qsgd:levels=16,coding=elias"],
                 "int8": ["int8:integrity=crc32c"]}
        for s in [spec] + extra.get(c["name"], []):
            s = Codec(s).spec
            if s not in out:
                out.append(s)
    return out


__all__ = ["FORMAT", "DTYPES", "TOP_KEYS", "ROW_KEYS", "load", "validate", "throughput", "encode_bytes",
           "decode_bytes", "default_specs"]
