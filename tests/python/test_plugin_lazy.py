"""The pytest plugin (gradcomp_pytest, the pytest11 entry point) must cost another project's pytest
run nothing: with gradcomp installed, a pytest run of an unrelated test folder loads neither the
gradcomp package nor its native module, OpenMP or CUDA, while the plugin itself is active (its
``--codec`` option exists)."""

import importlib.metadata
import os
import subprocess
import sys

OTHER_PROJECT_TEST = '''
import sys


def test_nothing_of_gradcomp_is_loaded():
    mods = sorted(m for m in sys.modules if m == "gradcomp" or m.startswith("gradcomp."))
    assert not mods, mods
    with open("/proc/self/maps") as f:
        maps = f.read()
    for lib in ("libgomp", "libomp", "libcuda", "libcudart", "gradcomp/_C"):
        assert lib not in maps, lib
'''


def _pytest(tmp_path, *args):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if "gradcomp" not in {e.name for e in importlib.metadata.entry_points(group="pytest11")}:
        cmd += ["-p", "gradcomp_pytest"]  # a source tree on PYTHONPATH: load the plugin by name
    return subprocess.run(cmd + list(args), capture_output=True, text=True, cwd=tmp_path,
                          env=dict(os.environ), timeout=300)


def test_another_projects_pytest_run_loads_nothing_of_gradcomp(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_other.py").write_text(OTHER_PROJECT_TEST)
    p = _pytest(tmp_path, "test_other.py")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "1 passed" in p.stdout
    # and the plugin was loaded all the same
    h = _pytest(tmp_path, "--help")
    assert h.returncode == 0 and "--codec=SPEC" in h.stdout, h.stdout[-2000:]
