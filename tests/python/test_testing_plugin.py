"""The contract suite's user entry point: ``pytest --pyargs gradcomp.testing --codec SPEC`` in a
subprocess (the installed package's pytest11 plugin, or -p gradcomp.testing.plugin from a source
tree). No numerics here: the suite itself is the test; this checks that a user's own spec runs and
that a bad spec fails with gradcomp's message."""

import importlib.metadata
import os
import subprocess
import sys



def _pytest(*args, cwd):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    eps = {e.name for e in importlib.metadata.entry_points(group="pytest11")}
    if "gradcomp" not in eps:  # a source tree on PYTHONPATH: load the plugin by name
        cmd += ["-p", "gradcomp.testing.plugin"]
    return subprocess.run(cmd + ["--pyargs", "gradcomp.testing", *args], capture_output=True, text=True,
                          cwd=cwd, env=dict(os.environ), timeout=600)


def test_user_spec_runs_the_whole_contract(tmp_path):
    p = _pytest("--codec", "topk:k=5,value_dtype=float16", "--codec", "bf16", cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert " passed" in p.stdout and "failed" not in p.stdout


def test_bad_user_spec_fails_with_the_reason(tmp_path):
    p = _pytest("--codec", "topk:k=-5", cwd=tmp_path)
    assert p.returncode != 0
    assert "k=-5" in p.stdout + p.stderr


def test_unknown_codec_names_the_registry(tmp_path):
    import gradcomp

    p = _pytest("--codec", "nosuch", cwd=tmp_path)
    assert p.returncode != 0
    names = ", ".join(c["name"] for c in gradcomp.codecs())
    assert f"accepted codecs: {names}" in p.stdout + p.stderr
