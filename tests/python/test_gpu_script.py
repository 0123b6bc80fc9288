"""tests/gpu/run.sh --dry-run, here without a GPU: every stage runs with its GPU and build commands
faked, the smoke matrix on the CPU backend; the deadline, a failing stage and SIGTERM each end in a
summary.json that says so and at most 8 files in $OUT (5: run.log, summary.json, bench.json,
bench.txt, artifacts.tar.gz). Also tests/gpu/smoke.py's byte -> packet section mapping against
layouts written here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "tests", "gpu", "run.sh")
STAGES = ["preflight", "build", "smoke", "gtests", "convert", "pytest", "huge", "sanitizer", "bench"]
OUT_FILES = {"run.log", "summary.json", "bench.json", "bench.txt", "artifacts.tar.gz"}


def _env(tmp_path):
    return dict(os.environ, PYTHON=sys.executable, GRADCOMP_GPU_LOG=str(tmp_path / "out"),
                GRADCOMP_GPU_BUILD=str(tmp_path / "build"))


def _run(tmp_path, *args, timeout=120):
    r = subprocess.run(["bash", RUN, "--dry-run", *args], env=_env(tmp_path), capture_output=True, text=True,
                       timeout=timeout, cwd=str(tmp_path))
    with open(tmp_path / "out" / "summary.json") as f:
        return r, json.load(f)


def _check_out(tmp_path):
    files = set(os.listdir(tmp_path / "out"))
    assert files == OUT_FILES and len(files) <= 8
    with tarfile.open(tmp_path / "out" / "artifacts.tar.gz") as tar:
        return set(tar.getnames())


def test_dry_run_passes_every_stage_and_packages_out(tmp_path):
    r, s = _run(tmp_path, "--fake-seconds", "0.05")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert s["result"] == "passed" and s["dry_run"] is True
    assert [st["name"] for st in s["stages"]] == STAGES
    assert all(st["status"] == "passed" for st in s["stages"]), s["stages"]
    smoke = next(st for st in s["stages"] if st["name"] == "smoke")
    assert "0 failed" in smoke["detail"] and "cases" in smoke["detail"]
    gtests = next(st for st in s["stages"] if st["name"] == "gtests")
    # every suite of the CUDA test sources, one process each, the convert / huge suites apart
    assert "CudaBlockQ" in gtests["detail"] and "CudaOnebit" in gtests["detail"]
    assert "CudaConvertAll" not in gtests["detail"]
    names = _check_out(tmp_path)
    assert {"smoke.txt", "smoke.log", "build.log", "gtest_CudaBlockQ.log", "sanitizer_memcheck.log"} <= names
    assert "run.py: PASSED" in r.stdout and "=== summary ===" in r.stdout


@pytest.mark.slow
def test_dry_run_honours_the_deadline(tmp_path):
    t0 = time.monotonic()
    r, s = _run(tmp_path, "--deadline", "38", "--fake-seconds", "2")
    assert time.monotonic() - t0 < 38
    assert r.returncode == 1 and s["result"] == "failed"
    statuses = {st["name"]: st for st in s["stages"]}
    assert list(statuses) == STAGES  # every stage reported, none silently skipped
    late = [n for n, st in statuses.items() if any("before the deadline" in f for f in st["failures"])]
    assert late and late[-1] == "bench", statuses
    assert all(st["budget_s"] <= 38 - 30 for st in s["stages"])
    _check_out(tmp_path)


@pytest.mark.slow
def test_dry_run_reports_a_failing_stage_and_goes_on(tmp_path):
    r, s = _run(tmp_path, "--fake-seconds", "0.05", "--fake-fail", "huge")
    assert r.returncode == 1 and s["result"] == "failed" and s["failed"] == ["huge"]
    after = [st for st in s["stages"] if st["name"] in ("sanitizer", "bench")]
    assert [st["status"] for st in after] == ["passed", "passed"]
    assert "huge: FAILED" in r.stdout


@pytest.mark.slow
def test_sigterm_still_writes_the_summary(tmp_path):
    p = subprocess.Popen(["bash", RUN, "--dry-run", "--fake-seconds", "2"], env=_env(tmp_path),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path))
    time.sleep(6)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 1, out[-2000:]
    with open(tmp_path / "out" / "summary.json") as f:
        s = json.load(f)
    assert s["interrupted"] == "SIGTERM" and s["result"] == "failed"
    assert s["not_reached"], s
    _check_out(tmp_path)


def test_bad_arguments_are_refused(tmp_path):
    r = subprocess.run(["bash", RUN, "--fake-fail", "huge"], env=_env(tmp_path), capture_output=True, text=True)
    assert r.returncode == 2 and "--fake-fail needs --dry-run" in r.stderr
    r = subprocess.run(["bash", RUN, "--dry-run", "--deadline", "10"], env=_env(tmp_path), capture_output=True,
                       text=True)
    assert r.returncode == 2 and "--deadline 10.0" in r.stderr


def test_smoke_names_the_section_of_a_byte():
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    try:
        import smoke
    finally:
        sys.path.pop(0)
    onebit = {"sections": [("bits", 32, 4097, "uint1"), ("scales", 560, 1, "float32")]}
    assert smoke._section_of(onebit, 0) == "header"
    assert smoke._section_of(onebit, 31) == "header"
    assert smoke._section_of(onebit, 32) == "bits"
    assert smoke._section_of(onebit, 32 + 512) == "bits"        # 4097 bits: 513 bytes
    assert smoke._section_of(onebit, 32 + 513) == "padding after bits"
    assert smoke._section_of(onebit, 563) == "scales"
    assert smoke._section_of(onebit, 564) == "padding after scales"
    int4 = {"sections": [("codes", 32, 5, "int4"), ("scales", 48, 1, "float32")]}
    assert smoke._section_of(int4, 34) == "codes" and smoke._section_of(int4, 35) == "padding after codes"
    torch = pytest.importorskip("torch")
    a = torch.zeros(10, dtype=torch.uint8)
    b = a.clone()
    assert smoke._first_diff(a, b) == -1
    b[7] = 1
    assert smoke._first_diff(a, b) == 7
    assert smoke._first_diff(torch.zeros(3), torch.zeros(4)) == 12


def test_ncu_csv_sums_dram_bytes_with_units():
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    try:
        import run
    finally:
        sys.path.pop(0)
    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"'
    rows = ['"0","k1","s","dram__bytes_read.sum","Mbyte","268.44"',
            '"0","k1","s","dram__bytes_write.sum","Kbyte","1,024.50"',
            '"0","k1","s","gpu__time_duration.sum","nsecond","5000"',
            '"1","k2","s","dram__bytes_read.sum","byte","100"']
    text = "\n".join(["==PROF== Connected to process 1", head, *rows, "==PROF== Disconnected"])
    assert run.ncu_dram_bytes(text) == pytest.approx(268.44e6 + 1024.5e3 + 100, rel=1e-12)
    assert run.ncu_dram_bytes("==ERROR== ERR_NVGPUCTRPERM") is None
    assert run.ncu_dram_bytes("\n".join([head, rows[2]])) is None
