"""gradcomp.bench.timing, the clock, timed-call loop and copy floor every benchmark uses
(gradcomp-bench and bench/*.py): call order and counts with a fake clock, and that no benchmark
script keeps a timing loop or copy floor of its own. No timing is asserted."""

import ast
import os

import pytest

from gradcomp.bench import timing

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_time_calls_order_and_counts(monkeypatch):
    calls = []
    ticks = iter(range(100))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(ticks)))
    ts = timing.time_calls(lambda: calls.append("fn"), 3, warmup=2, before=lambda: calls.append("before"))
    assert calls == ["before", "fn"] * 5  # before() ahead of every call, the warm-ups included
    assert ts == [1.0, 1.0, 1.0]  # only the 3 timed calls, each one tick of the fake clock
    calls.clear()
    assert timing.time_calls(lambda: calls.append("fn"), 2, warmup=0) == [1.0, 1.0]
    assert calls == ["fn", "fn"]


def test_median_s(monkeypatch):
    durations = iter([5.0, 1.0, 3.0, 2.0])  # the warm-up (not timed), then 1, 3, 2
    t = {"now": 0.0}

    def step():
        t["now"] += next(durations)

    monkeypatch.setattr(timing.time, "perf_counter", lambda: t["now"])
    assert timing.median_s(step, 3) == 2.0


def test_clock_cpu():
    seen = []
    assert timing.clock("cpu")(lambda: seen.append(1)) >= 0.0
    assert seen == [1]


def test_copy_bandwidth_counts_read_and_written(monkeypatch):
    pytest.importorskip("torch")
    seen = {}

    def fake_median(fn, reps, warmup=1, before=None, device="cpu"):
        fn()
        seen.update(reps=reps, warmup=warmup)
        return 0.5

    monkeypatch.setattr(timing, "median_s", fake_median)
    assert timing.copy_bandwidth(numel=1000, reps=7) == 2 * 4 * 1000 / 0.5
    assert seen == {"reps": 7, "warmup": 1}


# the loops the helpers replaced: a perf_counter pair around a call inside a for loop that appends
# to a list, or a copy_ / copyto timed by hand
SCRIPTS = ["bench/onebit_allreduce.py", "bench/powersgd_step.py", "bench/busy_core.py", "bench/slow_link.py",
           "bindings/python/gradcomp/bench/runner.py"]


@pytest.mark.parametrize("path", SCRIPTS)
def test_scripts_use_the_shared_helpers(path):
    with open(os.path.join(ROOT, path)) as f:
        src = f.read()
    tree = ast.parse(src)
    assert "timing" in src, f"{path} does not use gradcomp.bench.timing"
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            body = ast.dump(ast.Module(body=node.body, type_ignores=[]))
            timed = body.count("attr='perf_counter'") >= 2 and "attr='append'" in body
            assert not timed, f"{path}:{node.lineno}: a timing loop of its own (use gradcomp.bench.timing)"
        if isinstance(node, ast.FunctionDef) and node.name in ("_copy_bandwidth", "bandwidth", "timeit", "_clock"):
            body = ast.dump(node)
            assert "attr='perf_counter'" not in body, f"{path}:{node.lineno}: {node.name} times by hand"
