"""The package's import graph: no circle, and the documented direction (docs/contracts.md,
section 1).

The graph is read from the sources with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` statement, at module level and inside functions, relative ones resolved; an
import of ``a.b.c`` also depends on its parents ``a.b`` and ``a`` (their ``__init__`` runs first),
and ``from pkg import name`` on ``pkg.name`` when that is a module. The reference is a plain
depth-first search written here.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "bindings" / "python"
PKG = "gradcomp"


def _modules() -> dict:
    out = {}
    for path in sorted((ROOT / PKG).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _resolve(mod: str, is_pkg: bool, level: int, name: str) -> str:
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _edges(mod: str) -> set:
    path, is_pkg = MODULES[mod]
    tree = ast.parse(path.read_text(), str(path))
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                targets.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(mod, is_pkg, node.level, node.module or "") if node.level else (node.module or "")
            targets.add(src)
            for a in node.names:
                targets.add(f"{src}.{a.name}")
    out = set()
    for t in targets:
        if not (t == PKG or t.startswith(PKG + ".")):
            continue
        parts = t.split(".")
        for i in range(1, len(parts) + 1):  # parents run their __init__ first
            m = ".".join(parts[:i])
            if m in MODULES and m != mod:
                out.add(m)
    return out


GRAPH = {m: _edges(m) for m in MODULES}


def _cycle(graph: dict):
    """One circle of ``graph`` as a list of modules, or None (iterative three-colour DFS)."""
    colour = dict.fromkeys(graph, 0)
    for start in graph:
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
                continue
            if colour.get(nxt, 2) == 1:
                return path[path.index(nxt):] + [nxt]
            if colour.get(nxt) == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def _without_parents(graph: dict) -> dict:
    """The edges minus a package's own submodules importing the package (``from . import x``
    inside ``pkg/`` names ``pkg``): a package's ``__init__`` importing its submodules is the usual
    shape, not a circle between rooms."""
    out = {}
    for m, deps in graph.items():
        out[m] = {d for d in deps if not (m.startswith(d + ".") and MODULES[d][1])}
    return out


def test_the_graph_is_read():
    assert "gradcomp.torch.compressor" in GRAPH["gradcomp.torch.hook"]
    assert "gradcomp.schemes.context" in GRAPH["gradcomp.schemes.allreduce"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    cyc = _cycle(_without_parents(GRAPH))
    assert cyc is None, " -> ".join(cyc)


OLD_PATHS = {"gradcomp.torch.pool"}
"""Modules that only re-export a moved name from its new home (nothing in the package imports them)."""


def test_old_paths_are_only_re_exports():
    for m in OLD_PATHS:
        assert not any(m in deps for deps in GRAPH.values()), m
        tree = ast.parse(MODULES[m][0].read_text())
        assert all(isinstance(n, (ast.ImportFrom, ast.Assign, ast.Expr)) for n in tree.body), m


@pytest.mark.parametrize("low, high", [
    ("gradcomp.schemes", "gradcomp.torch"),
    ("gradcomp.schemes", "gradcomp.optim"),
    ("gradcomp.schemes", "gradcomp.deepspeed"),
    ("gradcomp.planner", "gradcomp.schemes."),
    ("gradcomp.optim", "gradcomp.deepspeed"),
    ("gradcomp.torch", "gradcomp.experiments"),
    ("gradcomp.torch", "gradcomp.deepspeed"),
    ("gradcomp.torch", "gradcomp.optim"),
    ("gradcomp.torch.protocol", "gradcomp.torch."),
    ("gradcomp.torch.compressor", "gradcomp.torch.powersgd"),
    ("gradcomp.torch.hook", "gradcomp.torch.powersgd"),
])
def test_dependencies_point_one_way(low, high):
    """Nothing in ``low`` imports ``high`` (a prefix; a trailing dot: its submodules only), but
    the re-exports that keep a moved name's old import path working (:data:`OLD_PATHS`)."""
    bad = sorted((m, d) for m, deps in GRAPH.items() if (m == low or m.startswith(low + ".")) and m not in OLD_PATHS
                 for d in deps if (d.startswith(high) if high.endswith(".") else
                                   (d == high or d.startswith(high + "."))))
    assert not bad, bad
