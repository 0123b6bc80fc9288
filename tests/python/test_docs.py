"""Every document a file of the repository names ships with it (docs/contracts.md section 7).

Scans every text file git lists (tracked, plus untracked files that are not ignored, so a new file
counts before its commit) for path-like names ending in ``.md`` -- in comments, docstrings,
scripts and documents -- and checks that each names a file of the repository, resolved against
the repository root or against the folder of the file that mentions it. URLs are left out (a
README of another project inside a link is that project's), and so are the Markdown files the
code writes as its outputs (``GENERATED_OUTPUTS``, under results/). The team's internal spec
outside the repository must not be named at all. Plain Python and read-only git; well under 2 s.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MD = ".md"
# The internal spec that is not shipped (spelled in two parts so that this file does not name it).
BANNED = "DESIGN" + MD

# Markdown files the code writes (gradcomp-experiment, bench/slow_link.py), not documents: allowed
# as a bare name or under results/ (the ignored output folder).
GENERATED_OUTPUTS = frozenset({"table" + MD, "charlm_table" + MD, "fsdp2_table" + MD, "charlm_fsdp2_table" + MD,
                               "slow_link" + MD})

# scheme://... and bare host/path links (github.com/...): names inside them are other projects'
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://\S+|\b(?:[\w-]+\.)+(?:com|org|io|net|dev)/\S*")
# a path-like name ending in .md: not the tail of a longer word, and not followed by more name
_NAME = re.compile(r"(?<![\w.-])((?:\.{1,2}/|/)*[\w-][\w.-]*(?:/[\w.-]+)*\.md)(?![\w-]|\.\w)")


def md_mentions(text: str) -> list[tuple[int, str]]:
    """The ``(line number, name)`` of every path-like ``.md`` name in ``text``, URLs left out."""
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        for m in _NAME.finditer(_URL.sub(" ", line)):
            out.append((no, m.group(1)))
    return out


def is_generated_output(name: str) -> bool:
    parts = name.lstrip("/").split("/")
    return parts[-1] in GENERATED_OUTPUTS and (len(parts) == 1 or parts[0] == "results")


def resolves(name: str, mentioned_in: str, shipped: set[str]) -> bool:
    """Whether ``name`` (mentioned in the repository file ``mentioned_in``, a relative posix path)
    names a file of ``shipped``, from the repository root or from the mentioning file's folder."""
    rel = name.lstrip("/")
    while rel.startswith("./"):
        rel = rel[2:]
    for base in ("", os.path.dirname(mentioned_in)):
        cand = os.path.normpath(os.path.join(base, rel)).replace(os.sep, "/")
        if not cand.startswith("../") and cand in shipped:
            return True
    return False


def missing_documents(texts: dict[str, str], shipped: set[str]) -> list[str]:
    """``"file:line: name"`` for every ``.md`` name in ``texts`` ({path: text}) that names no file
    of ``shipped`` and is not a generated output."""
    bad = []
    for path, text in sorted(texts.items()):
        for no, name in md_mentions(text):
            if not is_generated_output(name) and not resolves(name, path, shipped):
                bad.append(f"{path}:{no}: {name}")
    return bad


def banned_mentions(texts: dict[str, str]) -> list[str]:
    return [f"{p}:{no}" for p, t in sorted(texts.items()) for no, line in enumerate(t.splitlines(), 1)
            if BANNED in line]


def read_texts(root: str, paths) -> dict[str, str]:
    """{path: text} of the files of ``paths`` (relative to ``root``) that exist and are UTF-8 text."""
    texts = {}
    for p in paths:
        full = os.path.join(root, p)
        if not os.path.isfile(full):
            continue  # deleted in the work tree, not yet in the index
        with open(full, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            continue
        try:
            texts[p] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def repository_files() -> list[str]:
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=30).stdout
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"not a git work tree ({e})")
    return sorted({p for p in out.decode("utf-8", "surrogateescape").split("\0") if p})


@pytest.fixture(scope="module")
def repo():
    paths = repository_files()
    shipped = {p for p in paths if os.path.isfile(os.path.join(ROOT, p))}
    return read_texts(ROOT, paths), shipped


def test_every_named_document_ships(repo):
    texts, shipped = repo
    assert "docs/contracts" + MD in shipped
    bad = missing_documents(texts, shipped)
    assert not bad, "documents named but not in the repository:\n" + "\n".join(bad)


def test_internal_spec_is_not_named(repo):
    texts, _ = repo
    bad = banned_mentions(texts)
    assert not bad, f"{BANNED} is not shipped; cite docs/contracts.md instead:\n" + "\n".join(bad)


def test_generated_outputs_are_written_by_the_code(repo):
    # the exemption covers only names the code itself writes (a quoted file name in its Python)
    texts, _ = repo
    py = "\n".join(t for p, t in texts.items() if p.endswith(".py") and not p.endswith("test_docs.py"))
    for name in GENERATED_OUTPUTS:
        assert f'"{name}"' in py or f"'{name}'" in py, name


# ---- the checker itself fails where it should ---------------------------------------------------
def test_mentions_found_and_urls_ignored():
    text = (f"// see DESIGN{MD} section 3 and docs/contracts{MD} section 2\n"
            f"# https://github.com/dmlc/dlpack/blob/main/README{MD}, github.com/x/y/NOTES{MD}\n"
            f"'kernels/cuda/README{MD}' (../../README{MD}), `--out`/slow_link{MD}; README{MD}'s; x{MD}x; a.mdx\n")
    assert md_mentions(text) == [(1, "DESIGN" + MD), (1, "docs/contracts" + MD), (3, "kernels/cuda/README" + MD),
                                 (3, "../../README" + MD), (3, "/slow_link" + MD), (3, "README" + MD)]


def test_missing_documents_on_crafted_texts():
    shipped = {"docs/contracts" + MD, "kernels/cuda/README" + MD, "kernels/cuda/topk.cu", "README" + MD}
    texts = {
        "kernels/cuda/topk.cu": (f"// docs/contracts{MD} section 3; README{MD} here and at the root;\n"
                                 f"// ../../README{MD}; ./README{MD}; results/table{MD}; {BANNED} section 7\n"),
        "tests/gpu/run.sh": f"# bench/RESULTS{MD}, ../elsewhere/{BANNED}, /opt/notes/ARCH{MD}, docs/table{MD}\n",
    }
    assert missing_documents(texts, shipped) == [
        f"kernels/cuda/topk.cu:2: {BANNED}",
        f"tests/gpu/run.sh:1: bench/RESULTS{MD}",
        f"tests/gpu/run.sh:1: ../elsewhere/{BANNED}",
        f"tests/gpu/run.sh:1: /opt/notes/ARCH{MD}",
        f"tests/gpu/run.sh:1: docs/table{MD}",
    ]
    assert banned_mentions(texts) == ["kernels/cuda/topk.cu:2", "tests/gpu/run.sh:1"]
    # a name relative to the mentioning file's folder only
    assert missing_documents({"kernels/cuda/a.cu": f"// README{MD}"}, {"kernels/cuda/README" + MD}) == []
    assert missing_documents({"kernels/a.cpp": f"// README{MD}"}, {"kernels/cuda/README" + MD}) == [
        f"kernels/a.cpp:1: README{MD}"]


def test_scratch_copy_with_a_bad_reference(tmp_path):
    # a scratch tree (not the repository): one good and one bad reference, and a binary file
    files = {"docs/contracts" + MD: "# contracts\n", "kernels/x.hpp": f"// docs/contracts{MD} section 1\n",
             "tests/y.py": f'"""see {BANNED} section 2"""\n'}
    for p, t in files.items():
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p).write_text(t)
    (tmp_path / "blob").write_bytes(b"\0\1" + ("NOTES" + MD).encode())
    texts = read_texts(str(tmp_path), [*files, "blob", "gone" + MD])
    assert sorted(texts) == sorted(files)
    assert missing_documents(texts, set(files) | {"blob"}) == [f"tests/y.py:1: {BANNED}"]
    assert banned_mentions(texts) == ["tests/y.py:1"]
