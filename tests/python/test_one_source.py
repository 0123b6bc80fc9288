"""One source per fact (issue 21): the facts about codecs that documents and the planner state are
checked against the registry (``gradcomp.codecs()``, ``Codec(spec)``), and the figures moved out
of code comments into bench/RESULTS.md are where the comments say.

- README.md's codec table ("What is here"): a row for every registered codec and for every
  example spec whose properties differ from the other rows'; each row's example parses, names the
  row's codec, and has the row's properties; the keys the row names are the codec's, and every key
  of a codec is named in one of its rows.
- The planner's per-codec facts come from the codec: the ``none`` codec of its figures is the
  registry's, the kernel efficiency follows ``properties["sparse"]``.
- Every section of bench/RESULTS.md that a source file cites (the file's path, a comma, the word
  section and the quoted start of a heading) is a heading there.
"""

from __future__ import annotations

import os
import re

import pytest

import gradcomp
from gradcomp import planner

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROPERTIES = ("linear", "unbiased", "deterministic", "exact_residual", "keyed", "sparse")
COLUMNS = ["codec spec", "example", "what", "properties", "packet"]


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def _cells(line: str) -> list:
    """The cells of a Markdown table line (``\\|`` inside a cell is a literal bar)."""
    parts = re.split(r"(?<!\\)\|", line.strip())
    return [p.strip().replace("\\|", "|") for p in parts[1:-1]]


def codec_table(text: str) -> list:
    """The rows of the README's codec table as dicts of its columns (the first table whose header
    starts with ``| codec spec |``)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| codec spec |"))
    header = _cells(lines[start])
    assert header == COLUMNS, f"README codec table columns {header}; expected {COLUMNS}"
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = _cells(ln)
        assert len(cells) == len(header), ln
        rows.append(dict(zip(header, cells)))
    return rows


def _code(cell: str) -> list:
    """The backticked spans of a cell."""
    return re.findall(r"`([^`]*)`", cell)


def _row_specs(row) -> list:
    """The spec patterns of a row's ``codec spec`` cell (``topk:ratio=r`` / ``topk:k=K``)."""
    return _code(row["codec spec"])


def _row_name(row) -> str:
    names = {s.split(":")[0] for s in _row_specs(row)}
    assert len(names) == 1, f"README codec table: row {row['codec spec']} names {sorted(names)}"
    return names.pop()


def _keys_named(text: str) -> set:
    """The ``key=`` names in spec patterns and options of a cell."""
    out = set()
    for span in _code(text):
        _, _, rest = span.rpartition(":") if ":" in span else ("", "", span)
        for kv in rest.split(","):
            if "=" in kv:
                out.add(kv.split("=")[0].strip())
    return out


def _true(props: dict) -> set:
    return {k for k in PROPERTIES if props.get(k)}


@pytest.fixture(scope="module")
def table():
    return codec_table(_read("README.md"))


def test_table_parses_and_names_registered_codecs(table):
    registered = {c["name"] for c in gradcomp.codecs()}
    assert table
    for row in table:
        assert _row_name(row) in registered, f"README codec table: {row['codec spec']} is not a registered codec"


def test_every_registered_codec_has_a_row(table):
    named = {_row_name(r) for r in table}
    missing = [c["name"] for c in gradcomp.codecs() if c["name"] not in named]
    assert not missing, f"registered codecs without a row in README.md's codec table: {missing}"


def test_each_row_example_parses_and_has_the_row_properties(table):
    for row in table:
        ex = _code(row["example"])
        assert len(ex) == 1, f"README codec table: row {row['codec spec']}: one example spec in backticks"
        codec = gradcomp.Codec(ex[0])  # raises InvalidArgumentError when the example does not parse
        assert codec.spec.split(":")[0] == _row_name(row), (row["codec spec"], ex[0])
        listed = {p.strip() for p in row["properties"].split(",") if p.strip()}
        unknown = listed - set(PROPERTIES)
        assert not unknown, f"README codec table: row {row['codec spec']}: unknown properties {sorted(unknown)}"
        assert listed == _true(codec.properties), (
            f"README codec table: row {row['codec spec']} lists {sorted(listed)}; Codec({ex[0]!r}).properties has "
            f"{sorted(_true(codec.properties))} true")
        lay = codec.layout(4096, "float32")
        assert ("key" in row["packet"]) == (lay["key_section"] >= 0), (
            f"README codec table: row {row['codec spec']}: the packet column and the layout disagree on a key section")


def test_every_example_variant_is_documented(table):
    """Each registered example spec has the properties of one of its codec's rows (a spec whose
    properties differ, e.g. a keyed variant, needs its own row)."""
    by_name = {}
    for row in table:
        ex = _code(row["example"])[0]
        by_name.setdefault(_row_name(row), []).append(_true(gradcomp.Codec(ex).properties))
    for c in gradcomp.codecs():
        for ex in c["examples"]:
            props = _true(gradcomp.Codec(ex).properties)
            assert props in by_name.get(c["name"], []), (
                f"README codec table: no row of {c['name']} has the properties of {ex!r} ({sorted(props)})")


def test_row_keys_are_the_codec_keys(table):
    # integrity= is every codec's key: the paragraph after the table names it, not each row
    keys = {c["name"]: set(c["keys"]) - {"integrity"} for c in gradcomp.codecs()}
    assert all("integrity" in c["keys"] for c in gradcomp.codecs())
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    assert "Every codec accepts `integrity=crc32c`" in readme
    named = {}
    for row in table:
        name = _row_name(row)
        in_spec = _keys_named(row["codec spec"])
        assert in_spec <= keys[name], f"README codec table: {row['codec spec']}: keys {sorted(in_spec - keys[name])} " \
                                      f"are not keys of {name} ({sorted(keys[name])})"
        named.setdefault(name, set()).update(in_spec | _keys_named(row["what"]) | _keys_named(row["example"]))
    for name, ks in keys.items():
        assert ks <= named.get(name, set()), f"README codec table: keys {sorted(ks - named.get(name, set()))} of " \
                                             f"{name} are named in none of its rows"


def test_the_checker_fails_where_it_should():
    text = ("| codec spec | example | what | properties | packet |\n|---|---|---|---|---|\n"
            "| `fp8:format=e4m3\\|e5m2,block=B` | `fp8` | a | deterministic | header |\n\nafter\n")
    rows = codec_table(text)
    assert rows == [{"codec spec": "`fp8:format=e4m3|e5m2,block=B`", "example": "`fp8`", "what": "a",
                     "properties": "deterministic", "packet": "header"}]
    assert _keys_named(rows[0]["codec spec"]) == {"format", "block"}
    assert _keys_named("options `index=auto\\|u32`, `value_dtype=auto`") == {"index", "value_dtype"}
    with pytest.raises(AssertionError, match="columns"):
        codec_table("| codec spec | what | linear | packet |\n|---|---|---|---|\n")


# ---- the planner: per-codec facts from the codec ------------------------------------------------
def test_planner_none_codec_is_the_registry():
    none = planner._NoneCodec()
    ref = gradcomp.Codec("none")
    assert none == ref
    for n in (0, 1, 3, 1000, 1 << 20):
        for dt in ("float32", "bfloat16", "float16"):
            assert none.packet_bytes(n, dt) == ref.packet_bytes(n, dt)


def test_kernel_efficiency_from_properties():
    for c in gradcomp.codecs():
        for ex in c["examples"]:
            codec = gradcomp.Codec(ex)
            want = 0.25 if codec.properties["sparse"] else 0.85
            assert planner.kernel_efficiency(codec) == want, ex
            tp = planner.Throughput(device="cpu")
            n = 1 << 16
            b = planner.encode_traffic_bytes(n, "float32", codec.packet_bytes(n, "float32"), True)
            assert tp.encode_s(codec, n, "float32") == b / (planner.DEVICE_BYTES_PER_S["cpu"] * want)


# ---- figures moved to bench/RESULTS.md: the sections the comments cite exist -------------------
_CITE = re.compile(r'bench/RESULTS\.md,\s+section\s+"([^"]+)"')


def _source_files():
    out = []
    for top in ("bench", "bindings/python/gradcomp", "kernels", "include", "tests"):
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in files:
                if f.endswith((".py", ".cpp", ".hpp", ".cu", ".cuh", ".sh")):
                    out.append(os.path.join(dirpath, f))
    return out


def _flat(text: str) -> str:
    """Text with line breaks, comment leaders and indentation collapsed to single spaces (a
    citation may wrap across comment lines)."""
    return re.sub(r"\s+", " ", re.sub(r"\n\s*(#|//!?|\*)?\s*", " ", text))


def test_results_sections_cited_exist():
    headings = [ln.lstrip("#").strip() for ln in _read("bench/RESULTS.md").splitlines() if ln.startswith("#")]
    cited = []
    for path in _source_files():
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        for m in _CITE.finditer(_flat(text)):
            cited.append((os.path.relpath(path, ROOT), m.group(1)))
    assert cited  # the comments that moved their figures cite sections
    bad = [f"{p}: {sec!r}" for p, sec in cited if not any(h.startswith(sec) for h in headings)]
    assert not bad, "bench/RESULTS.md has no section starting with:\n" + "\n".join(bad)
