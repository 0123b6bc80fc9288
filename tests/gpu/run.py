#!/usr/bin/env python3
"""The GPU run of gradcomp in one command (tests/gpu/run.sh calls this; Python standard library only).

A GPU machine is lent for about 15 minutes in all and 10 minutes per command, with no network, and
only 8 files come back from it. This script turns one command into answers, the ones that matter
first: a global deadline (start + 480 s by default); each stage gets min(its cap, what is left -
30 s) and is killed (its whole process group) when that runs out; a stage that cannot run is
reported as failed (or, for compute-sanitizer refused by the device, "unavailable", which is not a
pass), never silently skipped; the summary prints and summary.json is written after every stage
and on SIGTERM / SIGINT, so a run cut short still says how far it got.

Stages, in order (cap in seconds):
  1 preflight  (30)  the carried dependencies (gpu-carry/: googletest, benchmark, openblas), nvcc,
                     the driver, torch, pytest, the GPU's clocks and L2 size, recorded in summary.json
  2 build     (240)  sm_90, one CPU ISA variant (GRADCOMP_NATIVE=ON), only the targets the GPU needs:
                     gradcomp_cuda_tests, _C, bench_cuda
  3 smoke      (60)  tests/gpu/smoke.py: every registry example spec x {float32, bfloat16} x
                     {residual, none} x n in {1, 4097, 2^20+3} x {aligned, offset by one}, CUDA
                     against CPU on packet, residual and decode, one line per case
  4 gtests    (120)  the CUDA gtests, one process per suite (not CudaConvertAll, not the 2^31 ones)
  5 convert    (60)  CudaConvertAll: all 2^32 float32 patterns through the device fp8 / fp16 / bf16
                     conversions against the host references
  6 pytest    (120)  test_cuda.py, the CUDA cases of test_lowrank / test_stochastic_rounding /
                     test_fsdp / the keyed codecs' tests (randomk, qsgd, terngrad, int8 / int4
                     stochastic rounding), and the codec contract suite on CUDA
  7 huge       (90)  n >= 2^31 elements: CudaHuge.* (int4, fp8, onebit on bfloat16 with a residual,
                     n = 2^31 + 4099) and the 2^31 / 2^32 top-k tests
  8 sanitizer  (75)  compute-sanitizer memcheck and racecheck on the blockq, onebit and lowrank
                     suites at small n (GRADCOMP_TEST_SMALL=1)
  9 bench     (150)  bench_cuda (2^20 .. 2^28, the copy floor beside each row) and gradcomp-bench
                     --device cuda at 2^26 and 2^28
$OUT (GRADCOMP_GPU_LOG, default gpu-log/) receives at most 5 files: run.log, summary.json,
bench.json, bench.txt and artifacts.tar.gz (the per-stage logs, the gtest / pytest XML, the smoke
lines, gradcomp-bench's PNG); the work folder is <build>/gpu-work.

--dry-run runs here, without a GPU: every stage runs with its GPU and build commands faked
(printed, then --fake-seconds of sleep), the smoke matrix for real on the CPU backend against itself
(--quick sizes), the suite list read from the sources; it honours the deadline and packages $OUT, so
the first GPU run is not the script's first run. --fake-fail STAGE makes that stage's commands fail.

Exit status: 0 when every stage passed (an "unavailable" sanitizer is listed, not failed), 1 when
any failed or ran out of time, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGES = [("preflight", 30), ("build", 240), ("smoke", 60), ("gtests", 120), ("convert", 60),
          ("pytest", 120), ("huge", 90), ("sanitizer", 75), ("bench", 150)]
MARGIN = 30       # seconds kept back from every stage's budget for the summary and packaging
MIN_BUDGET = 5    # a stage with less than this is not started (reported as failed: no time left)
OUT_FILES = ("run.log", "summary.json", "bench.json", "bench.txt", "artifacts.tar.gz")
# the suites whose tests run in their own stages (convert, huge), not in gtests
HUGE_FILTER = "CudaHuge.*:CudaTopK.Huge*:CudaTopK.Index64*"
SANITIZED = "CudaBlockQ.*:CudaOnebit.*:CudaLowrank.*"
# bench_cuda rows measured under Nsight Compute (DRAM bytes actually moved against the compulsory
# bytes): the block quantizers' one-pass and two-pass encodes, onebit whole-tensor and tiled,
# two decodes, top-k at ratio 0.1 and a cast, all at 2^26 elements
NCU_ROWS = {"fp8 f32+res encode": "BM_QuantEncode/67108864/0/0/1/",
            "int8 bf16+res encode": "BM_QuantEncode/67108864/3/1/1/",
            "int4 bf16+res encode": "BM_QuantEncode/67108864/4/1/1/",
            "onebit (chunk 0) f32+res encode": "BM_QuantEncode/67108864/5/0/1/",
            "onebit:chunk=4096 f32+res encode": "BM_QuantEncode/67108864/8/0/1/",
            "fp8:block=0 f32+res encode": "BM_QuantEncode/67108864/6/0/1/",
            "fp8 -> f32 decode": "BM_QuantDecode/67108864/0/0/",
            "onebit -> f32 decode": "BM_QuantDecode/67108864/5/0/",
            "topk:ratio=0.1 f32+res encode": "BM_TopKEncode/67108864/0/1/",
            "bf16 f32+res encode": "BM_CastEncode/67108864/2/"}
_UNIT = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1024, "MB": 1024 ** 2,
         "GB": 1024 ** 3}


def ncu_dram_bytes(csv_text: str) -> float | None:
    """DRAM bytes read + written over every kernel of an ``ncu --csv`` report (the rows whose
    Metric Name is dram__bytes_read.sum / dram__bytes_write.sum); None when there is no such row."""
    import csv
    rows = list(csv.reader(line for line in csv_text.splitlines() if line.startswith('"')))
    head = next((i for i, r in enumerate(rows) if "Metric Name" in r and "Metric Value" in r), None)
    if head is None:
        return None
    h = rows[head]
    name, unit, value = h.index("Metric Name"), h.index("Metric Unit"), h.index("Metric Value")
    total, seen = 0.0, False
    for r in rows[head + 1:]:
        if len(r) > value and r[name] in ("dram__bytes_read.sum", "dram__bytes_write.sum"):
            total += float(r[value].replace(",", "")) * _UNIT.get(r[unit], 1)
            seen = True
    return total if seen else None


class Deadline(BaseException):
    """SIGTERM / SIGINT: not an Exception, so that no stage's error handling swallows it."""


class Run:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.t0 = time.monotonic()
        self.end = self.t0 + a.deadline
        self.out = os.path.abspath(a.out)
        self.build = os.path.abspath(os.path.join(ROOT, a.build))
        self.work = os.path.join(self.build, "gpu-work")
        self.py = a.python
        self.stages: list[dict] = []
        self.env_info: dict = {}
        self.current: dict | None = None
        self.stage_end = self.end
        self.python_module = True
        self.skipped = [n for n, _ in STAGES if a.stages and n not in a.stages]
        os.makedirs(self.out, exist_ok=True)
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(os.path.join(self.work, "xml"), exist_ok=True)
        self.log = open(os.path.join(self.out, "run.log"), "w")

    # --- logging and commands -------------------------------------------------------------------
    def say(self, msg: str = "") -> None:
        line = f"[{time.monotonic() - self.t0:6.1f} s] {msg}" if msg else ""
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def left(self) -> float:
        return self.end - time.monotonic()

    def sh(self, cmd: list[str], log: str, timeout: float | None = None, env: dict | None = None,
           fake: bool = True, cwd: str | None = None) -> int:
        """Run ``cmd`` with its output in <work>/<log>.log, bounded by ``timeout`` and the stage's
        end; returns its exit status (124: killed at the time limit). In --dry-run a ``fake``
        command is only printed and sleeps --fake-seconds."""
        limit = self.stage_end - time.monotonic() if timeout is None else min(timeout, self.stage_end - time.monotonic())
        path = os.path.join(self.work, log + ".log")
        text = " ".join(shlex.quote(c) for c in cmd)
        if limit < 1:
            self.say(f"  not started (no time left in the stage): {text}")
            return 124
        self.say(f"  $ {text}   (limit {limit:.0f} s; output: {os.path.relpath(path, self.work)})")
        with open(path, "a") as f:
            f.write(f"$ {text}\n")
            f.flush()
            if self.a.dry_run and fake:
                f.write("[dry-run] not run\n")
                if self.a.fake_seconds > limit:
                    time.sleep(limit)
                    return 124
                time.sleep(self.a.fake_seconds)
                return 1 if self.current and self.current["name"] in self.a.fake_fail else 0
            full_env = dict(os.environ, **(env or {}))
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=cwd or ROOT,
                                 start_new_session=True)
            try:
                return p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                self._kill(p)
                f.write(f"\n[run.py] killed after {limit:.0f} s\n")
                return 124
            except BaseException:  # SIGTERM / SIGINT: the command goes with the run
                self._kill(p)
                raise

    @staticmethod
    def _kill(p: subprocess.Popen) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                continue

    def excerpt(self, log: str, lines: int = 25, pattern: str = r"FAIL|Failure|FAILED|error|Error|mismatch") -> None:
        """Into run.log: the lines of <work>/<log>.log that match ``pattern`` (at most 40) and its tail."""
        path = os.path.join(self.work, log + ".log")
        if not os.path.exists(path):
            return
        with open(path, errors="replace") as f:
            text = f.read().splitlines()
        hits = [t for t in text if re.search(pattern, t)][:40]
        for t in hits:
            self.say(f"  | {t[:300]}")
        if hits:
            self.say("  | ...")
        for t in text[-lines:]:
            self.say(f"  > {t[:300]}")

    # --- stages ---------------------------------------------------------------------------------
    def stage(self, name: str, cap: float, fn) -> None:
        rec = {"name": name, "cap_s": cap, "status": "failed", "seconds": 0.0, "failures": [], "detail": ""}
        self.stages.append(rec)
        budget = min(cap, self.left() - MARGIN)
        rec["budget_s"] = round(max(budget, 0.0), 1)
        self.say()
        self.say(f"=== {name} (budget {max(budget, 0):.0f} s of cap {cap} s; {self.left():.0f} s to the deadline) ===")
        if budget < MIN_BUDGET:
            rec["failures"].append(f"not run: {self.left():.0f} s left before the deadline")
            self.finish_stage(rec, time.monotonic())
            return
        self.current, self.stage_end = rec, time.monotonic() + budget
        start = time.monotonic()
        try:
            status = fn(rec)
            rec["status"] = status if status else ("passed" if not rec["failures"] else "failed")
        except Exception as e:  # a bug in a stage fails that stage, the run goes on
            rec["failures"].append(f"run.py raised {type(e).__name__}: {e}")
            rec["status"] = "failed"
        if time.monotonic() > self.stage_end + 1 and rec["status"] == "passed":
            rec["status"] = "failed"
            rec["failures"].append("ran past its budget")
        self.finish_stage(rec, start)

    def finish_stage(self, rec: dict, start: float) -> None:
        rec["seconds"] = round(time.monotonic() - start, 1)
        if rec["status"] == "passed" and rec["failures"]:
            rec["status"] = "failed"
        self.say(f"{rec['name']}: {rec['status'].upper()} in {rec['seconds']} s"
                 + ("" if not rec["failures"] else ": " + "; ".join(rec["failures"][:6])))
        self.current = None
        self.write_summary(final=False)
        self.package()

    def fail(self, rec: dict, what: str) -> None:
        rec["failures"].append(what)

    def check_rc(self, rec: dict, rc: int, what: str, log: str) -> bool:
        if rc == 0:
            return True
        self.fail(rec, f"{what}: " + ("killed at its time limit" if rc == 124 else f"exit {rc}"))
        self.excerpt(log)
        return False

    # --- the individual stages ------------------------------------------------------------------
    def s_preflight(self, rec: dict) -> None:
        info = self.env_info
        carry = os.path.join(ROOT, "gpu-carry")
        info["carry"] = {}
        for dep, probe in (("googletest", "googletest/CMakeLists.txt"), ("benchmark", "benchmark/include/benchmark"),
                           ("openblas", "openblas/lib/libopenblas.so.0")):
            ok = os.path.exists(os.path.join(carry, probe))
            info["carry"][dep] = ok
            if not ok and self.a.dry_run:  # this machine has them installed; the GPU machine does not
                self.say(f"  gpu-carry/{probe} missing (dry run: the system's copy serves; the GPU run fails)")
            elif not ok:
                self.fail(rec, f"gpu-carry/{probe} missing (fill it with tests/gpu/prepare_carry.sh)")

        def probe(cmd: list[str]) -> str:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
                return (r.stdout + r.stderr).strip() if r.returncode == 0 else ""
            except (OSError, subprocess.TimeoutExpired):
                return ""
        nvcc = probe(["nvcc", "--version"])
        m = re.search(r"release [0-9.]+, V[0-9.]+", nvcc)
        info["nvcc"] = m.group(0) if m else None
        info["cmake"] = (probe(["cmake", "--version"]).splitlines() or [None])[0]
        info["ninja"] = probe(["ninja", "--version"]) or None
        info["python"] = probe([self.py, "--version"]) or None
        q = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,persistence_mode"
        smi = probe(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"])
        info["gpu"] = dict(zip(q.split(","), [s.strip() for s in smi.splitlines()[0].split(",")])) if smi else None
        torch_probe = ("import json, torch\nd = {'torch': torch.__version__, 'cuda': torch.version.cuda, "
                       "'available': torch.cuda.is_available()}\n"
                       "if d['available']:\n p = torch.cuda.get_device_properties(0)\n"
                       " d.update(name=p.name, sms=p.multi_processor_count, l2_bytes=getattr(p, 'L2_cache_size', None), "
                       "memory_bytes=p.total_memory, capability=f'{p.major}.{p.minor}')\n"
                       "for m in ('pybind11', 'pytest', 'numpy', 'ml_dtypes', 'scikit_build_core'):\n"
                       " try:\n  d[m] = __import__(m).__version__\n except Exception:\n  d[m] = None\n"
                       "print(json.dumps(d))")
        tp = probe([self.py, "-c", torch_probe])
        try:
            info["python_packages"] = json.loads(tp.splitlines()[-1]) if tp else None
        except ValueError:
            info["python_packages"] = None
        for k, v in info.items():
            self.say(f"  {k}: {v}")
        if not info["nvcc"]:
            self.fail(rec, "nvcc not found")
        pk = info["python_packages"] or {}
        if not pk.get("torch") or not pk.get("pytest") or not pk.get("pybind11"):
            self.fail(rec, f"{self.py}: torch, pytest and pybind11 are needed (found {pk})")
        if not self.a.dry_run and not (info["gpu"] and pk.get("available")):
            self.fail(rec, "no GPU visible (nvidia-smi / torch.cuda.is_available())")
        elif self.a.dry_run and not info["gpu"]:
            self.say("  (dry run: no GPU here, as expected)")

    def cmake_args(self, python: bool) -> list[str]:
        carry = os.path.join(ROOT, "gpu-carry")
        args = ["cmake", "-S", ROOT, "-B", self.build, "-DCMAKE_BUILD_TYPE=Release", "-DGRADCOMP_CUDA=ON",
                f"-DCMAKE_CUDA_ARCHITECTURES={self.a.archs}", "-DGRADCOMP_NATIVE=ON", "-DGRADCOMP_TESTS=ON",
                "-DGRADCOMP_BENCH=ON", f"-DGRADCOMP_PYTHON={'ON' if python else 'OFF'}",
                f"-DPython_EXECUTABLE={shutil.which(self.py) or self.py}"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        prefix = []
        if os.path.isdir(os.path.join(carry, "googletest")):
            args.append(f"-DGRADCOMP_GTEST_SOURCE_DIR={carry}/googletest")
        cfg = glob.glob(os.path.join(carry, "benchmark", "**", "benchmarkConfig.cmake"), recursive=True)
        if cfg:
            bdir = os.path.dirname(cfg[0])
            args.append(f"-Dbenchmark_DIR={bdir}")
            prefix.append(os.path.join(carry, "benchmark"))
            self.lib_path(os.path.dirname(os.path.dirname(bdir)))
        if os.path.isfile(os.path.join(carry, "openblas", "lib", "libopenblas.so.0")):
            args += [f"-DGRADCOMP_OPENBLAS_INCLUDE_DIR={carry}/openblas/include",
                     f"-DGRADCOMP_OPENBLAS_LIBRARY={carry}/openblas/lib/libopenblas.so.0"]
            self.lib_path(os.path.join(carry, "openblas", "lib"))
        if os.path.isdir(carry):
            prefix.append(carry)
        if prefix:
            args.append("-DCMAKE_PREFIX_PATH=" + ";".join(prefix))
        return args

    @staticmethod
    def lib_path(d: str) -> None:
        cur = os.environ.get("LD_LIBRARY_PATH", "")
        if d not in cur.split(":"):
            os.environ["LD_LIBRARY_PATH"] = d + (":" + cur if cur else "")

    def s_build(self, rec: dict) -> None:
        rc = self.sh(self.cmake_args(True), "configure")
        if rc != 0:
            self.python_module = False
            self.fail(rec, "configure with the Python module failed (exit %d); building without it" % rc)
            self.excerpt("configure")
            try:
                os.remove(os.path.join(self.build, "CMakeCache.txt"))
            except OSError:
                pass
            if not self.check_rc(rec, self.sh(self.cmake_args(False), "configure"), "configure", "configure"):
                return
        targets = ["gradcomp_cuda_tests"] + (["_C"] if self.python_module else [])
        have_bench = self.a.dry_run or os.path.exists(os.path.join(self.build, "bench", "CMakeFiles", "bench_cuda.dir"))
        if have_bench:
            targets.append("bench_cuda")
        else:
            self.fail(rec, "bench_cuda not configured (Google Benchmark missing from gpu-carry/)")
        rc = self.sh(["cmake", "--build", self.build, "-j", str(self.a.jobs), "--target", *targets], "build")
        self.check_rc(rec, rc, "build " + " ".join(targets), "build")
        if self.python_module and not self.a.dry_run:
            self.stage_python()

    def stage_python(self) -> None:
        """<work>/pystage/gradcomp: the package sources with the _C just built (the tree may hold another)."""
        so = glob.glob(os.path.join(self.build, "_C*.so"))
        if not so:
            self.python_module = False
            return
        stage = os.path.join(self.work, "pystage")
        shutil.copytree(os.path.join(ROOT, "bindings", "python", "gradcomp"), os.path.join(stage, "gradcomp"),
                        ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
        shutil.copy(so[0], os.path.join(stage, "gradcomp"))
        os.environ["PYTHONPATH"] = stage + (":" + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")

    def need_python(self, rec: dict) -> bool:
        if self.python_module:
            return True
        self.fail(rec, "no Python module was built (see the build stage)")
        return False

    def s_smoke(self, rec: dict) -> None:
        if not self.need_python(rec):
            return
        out = os.path.join(self.work, "smoke.txt")
        cmd = [self.py, os.path.join(ROOT, "tests", "gpu", "smoke.py"), "--out", out]
        cmd += ["--device", "cpu", "--quick"] if self.a.dry_run else ["--device", "cuda"]
        rc = self.sh(cmd, "smoke", fake=False)
        if os.path.exists(out):
            with open(out) as f:
                lines = f.read().splitlines()
            for t in [t for t in lines if t.startswith("FAIL")][:20] + lines[-1:]:
                self.say(f"  | {t}")
            rec["detail"] = lines[-1] if lines else ""
        if rc != 0:
            self.fail(rec, f"smoke.py exit {rc}" + (" (killed at its time limit)" if rc == 124 else ""))
            if not os.path.exists(out):
                self.excerpt("smoke")
        if self.a.dry_run and self.current and self.current["name"] in self.a.fake_fail:
            self.fail(rec, "--fake-fail smoke")

    def binary(self) -> str:
        return os.path.join(self.build, "tests", "cpp", "gradcomp_cuda_tests")

    def suites(self, rec: dict) -> list[str]:
        """The gtest suites of gradcomp_cuda_tests (from --gtest_list_tests; in --dry-run from the sources)."""
        if self.a.dry_run:
            names = []
            for path in sorted(glob.glob(os.path.join(ROOT, "tests", "cpp", "test_cuda_*.cu"))):
                with open(path) as f:
                    names += re.findall(r"^TEST(?:_F|_P)?\((\w+),", f.read(), re.M)
            return list(dict.fromkeys(names))
        try:
            r = subprocess.run([self.binary(), "--gtest_list_tests"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.fail(rec, f"gradcomp_cuda_tests --gtest_list_tests: {e}")
            return []
        return [ln.rstrip(".") for ln in r.stdout.splitlines() if ln and not ln.startswith(" ") and ln.endswith(".")]

    def gtest(self, rec: dict, filt: str, log: str, timeout: float | None = None, env: dict | None = None) -> int:
        xml = os.path.join(self.work, "xml", log + ".xml")
        rc = self.sh([self.binary(), f"--gtest_filter={filt}", f"--gtest_output=xml:{xml}"], log, timeout,
                     env=dict({"GRADCOMP_REQUIRE_GPU": "1"}, **(env or {})))
        self.check_rc(rec, rc, f"gtest {filt}", log)
        return rc

    def s_gtests(self, rec: dict) -> None:
        suites = [s for s in self.suites(rec) if s not in ("CudaConvertAll", "CudaHuge")]
        if not suites:
            self.fail(rec, "no CUDA gtest suite found")
            return
        rec["detail"] = f"{len(suites)} suites: " + " ".join(suites)
        exclude = "-" + HUGE_FILTER
        for s in suites:
            self.gtest(rec, f"{s}.*:{exclude}", "gtest_" + s, timeout=90)

    def s_convert(self, rec: dict) -> None:
        self.gtest(rec, "CudaConvertAll.*", "gtest_CudaConvertAll")
        self.excerpt("gtest_CudaConvertAll", lines=12, pattern=r"^(e4m3|e5m2|fp16|bf16|half|decode)")

    def s_pytest(self, rec: dict) -> None:
        if not self.need_python(rec):
            return
        env = {"GRADCOMP_REQUIRE_GPU": "1"}
        runs = [("test_cuda", ["tests/python/test_cuda.py"]),
                ("test_lowrank_cuda", ["tests/python/test_lowrank.py", "-k", "cuda"]),
                ("test_stochastic_rounding_cuda", ["tests/python/test_stochastic_rounding.py", "-k", "cuda"]),
                ("test_fsdp_cuda", ["tests/python/test_fsdp.py", "-k", "cuda"]),
                # the keyed codecs: CUDA packets and residuals against the CPU's
                ("test_keyed_cuda", ["tests/python/test_randomk.py", "tests/python/test_qsgd.py",
                                     "tests/python/test_terngrad.py", "tests/python/test_int_sr.py", "-k", "cuda"])]
        for log, args in runs:
            xml = os.path.join(self.work, "xml", log + ".xml")
            rc = self.sh([self.py, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"],
                         log, env=env)
            self.check_rc(rec, rc, "pytest " + " ".join(args) + (" (collected no test)" if rc == 5 else ""), log)
        xml = os.path.join(self.work, "xml", "contract_cuda.xml")
        rc = self.sh([self.py, "-m", "pytest", "-p", "gradcomp.testing.plugin", "--pyargs", "gradcomp.testing",
                      "-k", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"], "contract_cuda",
                     env=env, cwd=self.work)
        self.check_rc(rec, rc, "the contract suite -k cuda" + (" (collected no test)" if rc == 5 else ""),
                      "contract_cuda")

    def s_huge(self, rec: dict) -> None:
        self.gtest(rec, HUGE_FILTER, "gtest_huge")

    def s_sanitizer(self, rec: dict) -> str | None:
        tool = shutil.which("compute-sanitizer") or next(
            (p for p in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer")
             if os.path.exists(p)), None)
        if not tool and not self.a.dry_run:
            rec["detail"] = "compute-sanitizer not found"
            self.say("  compute-sanitizer not found: UNAVAILABLE (not a pass)")
            return "unavailable"
        tool = tool or "compute-sanitizer"
        refused = 0
        for kind in ("memcheck", "racecheck"):
            log = "sanitizer_" + kind
            per = max((self.stage_end - time.monotonic()) / (2 if kind == "memcheck" else 1), 1)
            rc = self.sh([tool, "--tool", kind, "--error-exitcode", "99", self.binary(),
                          f"--gtest_filter={SANITIZED}:-{HUGE_FILTER}"], log, timeout=per,
                         env={"GRADCOMP_TEST_SMALL": "1", "GRADCOMP_REQUIRE_GPU": "1"})
            text = ""
            path = os.path.join(self.work, log + ".log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text = f.read()
            if rc != 0 and re.search(r"not supported|Unable to (?:find|connect)|Device not supported|"
                                     r"target application terminated before", text, re.I):
                refused += 1
                self.say(f"  {kind}: refused by the device: UNAVAILABLE (not a pass)")
                continue
            m = re.findall(r"ERROR SUMMARY: (\d+) error", text)
            if m:
                self.say(f"  {kind}: ERROR SUMMARY {m[-1]} errors")
            self.check_rc(rec, rc, f"compute-sanitizer {kind}" + (" found errors" if rc == 99 else ""), log)
        if refused and not rec["failures"]:
            rec["detail"] = "compute-sanitizer refused by the device"
            return "unavailable"
        return None

    def s_bench(self, rec: dict) -> None:
        results: dict = {}
        txt: list[str] = []
        bench = os.path.join(self.build, "bench", "bench_cuda")
        bjson = os.path.join(self.work, "bench_cuda.json")
        share = (self.stage_end - time.monotonic()) * 0.4
        if self.a.dry_run or os.path.exists(bench):
            rc = self.sh([bench, f"--benchmark_out={bjson}", "--benchmark_out_format=json"], "bench_cuda", timeout=share)
            self.check_rc(rec, rc, "bench_cuda", "bench_cuda")
            if os.path.exists(bjson):
                with open(bjson) as f:
                    results["bench_cuda"] = json.load(f)
            with open(os.path.join(self.work, "bench_cuda.log"), errors="replace") as f:
                txt += ["# bench_cuda", *f.read().splitlines()]
            txt += self.ncu_rows(rec, bench, results)
        else:
            self.fail(rec, "bench_cuda was not built")
        if self.need_python(rec):
            bout = os.path.join(self.work, "bench")
            rc = self.sh([self.py, "-m", "gradcomp.bench", "--device", "cuda", "--sizes", "26", "28", "--reps", "5",
                          "--out", bout], "gradcomp_bench")
            self.check_rc(rec, rc, "gradcomp-bench --device cuda", "gradcomp_bench")
            for p in sorted(glob.glob(os.path.join(bout, "*.json"))):
                with open(p) as f:
                    results["gradcomp_bench"] = json.load(f)
            for p in sorted(glob.glob(os.path.join(bout, "*.txt"))):
                with open(p) as f:
                    txt += ["", "# gradcomp-bench --device cuda", *f.read().splitlines()]
        with open(os.path.join(self.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(self.out, "bench.txt"), "w") as f:
            f.write("\n".join(txt) + "\n")

    def ncu_rows(self, rec: dict, bench: str, results: dict) -> list[str]:
        """NCU_ROWS under Nsight Compute, one process each (1 timed call, only it profiled): the DRAM
        bytes it moved beside its compulsory bytes. ncu missing or refused (no counter permission):
        reported as unavailable in the detail, not failed."""
        ncu = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)
        if not ncu and not self.a.dry_run:
            rec["detail"] = "Nsight Compute (ncu) not found: the bytes actually moved are unavailable"
            return ["", "# bytes moved: ncu not found (unavailable)"]
        ncu = ncu or "ncu"
        until = time.monotonic() + (self.stage_end - time.monotonic()) * 0.4
        out, measured = ["", "# DRAM bytes per call (Nsight Compute) beside the compulsory bytes, 2^26 elements"], {}
        for label, row in NCU_ROWS.items():
            left = until - time.monotonic()
            if left < 5:
                out.append(f"{label:<34} not measured (time)")
                continue
            tag = re.sub(r"\W+", "_", label)
            csv_path = os.path.join(self.work, f"ncu_{tag}.csv")
            bj = os.path.join(self.work, f"ncu_{tag}.json")
            rc = self.sh([ncu, "--profile-from-start", "off", "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
                          "--csv", "--log-file", csv_path, bench, f"--benchmark_filter=^{row}",
                          f"--benchmark_out={bj}", "--benchmark_out_format=json"], "ncu", timeout=min(left, 40),
                         env={"GRADCOMP_BENCH_PROFILE": "1", "GRADCOMP_BENCH_ITERATIONS": "1"})
            moved = compulsory = None
            if os.path.exists(csv_path):
                with open(csv_path, errors="replace") as f:
                    text = f.read()
                moved = ncu_dram_bytes(text)
                if moved is None and re.search(r"ERR_NVGPUCTRPERM|permission", text):
                    rec["detail"] = "ncu refused (no GPU performance-counter permission): bytes moved unavailable"
                    out.append(rec["detail"])
                    break
            if os.path.exists(bj):
                with open(bj) as f:
                    b = json.load(f).get("benchmarks", [])
                compulsory = b[0].get("bytes") if b else None
            if rc != 0 or moved is None or not compulsory:
                out.append(f"{label:<34} not measured (ncu exit {rc})")
                continue
            measured[label] = {"dram_bytes": moved, "compulsory_bytes": compulsory, "ratio": moved / compulsory}
            out.append(f"{label:<34} {moved / 1e6:10.1f} MB moved  {compulsory / 1e6:10.1f} MB compulsory  "
                       f"{moved / compulsory:5.2f}x")
        results["ncu_dram_bytes"] = measured
        for line in out:
            self.say("  " + line)
        return out

    # --- summary and packaging ------------------------------------------------------------------
    def write_summary(self, final: bool, interrupted: str | None = None) -> dict:
        failed = [s["name"] for s in self.stages if s["status"] == "failed"]
        unavailable = [s["name"] for s in self.stages if s["status"] == "unavailable"]
        done = {s["name"] for s in self.stages}
        pending = [n for n, _ in STAGES if n not in done and n not in self.skipped]
        result = "passed" if final and not failed and not pending and not interrupted else "failed"
        if not final:
            result = "running"
        summary = {"result": result, "dry_run": self.a.dry_run, "deadline_s": self.a.deadline,
                   "elapsed_s": round(time.monotonic() - self.t0, 1), "failed": failed, "unavailable": unavailable,
                   "not_reached": pending, "skipped_by_option": self.skipped, "interrupted": interrupted,
                   "stages": self.stages, "environment": self.env_info,
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        return summary

    def package(self) -> None:
        """<out>/artifacts.tar.gz: every file of the work folder but the staged package."""
        tmp = os.path.join(self.out, "artifacts.tar.gz.tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for dirpath, dirnames, files in os.walk(self.work):
                dirnames[:] = [d for d in dirnames if d != "pystage"]
                for name in sorted(files):
                    p = os.path.join(dirpath, name)
                    tar.add(p, arcname=os.path.relpath(p, self.work))
        os.replace(tmp, os.path.join(self.out, "artifacts.tar.gz"))

    def print_summary(self, s: dict) -> None:
        self.say()
        self.say("=== summary ===")
        for st in self.stages:
            self.say(f"  {st['name']:<10} {st['status']:<11} {st['seconds']:>6.1f} s  (budget {st['budget_s']} s)"
                     + ("" if not st["failures"] else "  " + "; ".join(st["failures"][:3])))
        for n in s["not_reached"]:
            self.say(f"  {n:<10} not reached")
        if s["unavailable"]:
            self.say(f"  unavailable (not a pass): {', '.join(s['unavailable'])}")
        extra = [f for f in os.listdir(self.out) if f not in OUT_FILES]
        self.say(f"run.py: {s['result'].upper()} in {s['elapsed_s']} s (deadline {self.a.deadline} s); "
                 f"$OUT = {self.out}: {', '.join(f for f in OUT_FILES if os.path.exists(os.path.join(self.out, f)))}"
                 + (f" (and {len(extra)} other files already there)" if extra else ""))

    def main(self) -> int:
        def on_signal(signum, frame):
            raise Deadline(signal.Signals(signum).name)
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.say(f"run.py: {'DRY RUN, ' if self.a.dry_run else ''}deadline {self.a.deadline} s, out {self.out}, "
                 f"build {self.build}, python {self.py}")
        interrupted = None
        try:
            for name, cap in STAGES:
                if name in self.skipped:
                    continue
                self.stage(name, cap, getattr(self, "s_" + name))
        except Deadline as e:
            interrupted = str(e)
            if self.current is not None:
                self.current["failures"].append(f"interrupted by {e}")
                self.current["status"] = "failed"
                self.current = None
        if not os.path.exists(os.path.join(self.out, "bench.json")):
            with open(os.path.join(self.out, "bench.json"), "w") as f:
                json.dump({}, f)
            with open(os.path.join(self.out, "bench.txt"), "w") as f:
                f.write("no benchmark ran (see summary.json)\n")
        s = self.write_summary(final=True, interrupted=interrupted)
        self.package()
        self.print_summary(s)
        self.log.close()
        return 0 if s["result"] == "passed" else 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tests/gpu/run.sh", description="The GPU run of gradcomp (see the module docstring).")
    ap.add_argument("--dry-run", action="store_true", help="fake the GPU and build commands (runs without a GPU)")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds from the start for everything (default 480)")
    ap.add_argument("--stages", nargs="+", choices=[n for n, _ in STAGES], help="run only these stages")
    ap.add_argument("--build-only", action="store_true", help="= --stages preflight build")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--fake-seconds", type=float, default=0.2, help="--dry-run: seconds each faked command takes")
    ap.add_argument("--fake-fail", nargs="*", default=[], choices=[n for n, _ in STAGES],
                    help="--dry-run: these stages' faked commands fail")
    ap.add_argument("--out", default=os.environ.get("GRADCOMP_GPU_LOG", "gpu-log"), help="$GRADCOMP_GPU_LOG (gpu-log)")
    ap.add_argument("--build", default=os.environ.get("GRADCOMP_GPU_BUILD", "build-gpu"))
    ap.add_argument("--archs", default=os.environ.get("GRADCOMP_CUDA_ARCHS", "90"))
    ap.add_argument("--python", default=os.environ.get("PYTHON") or (
        os.path.join(ROOT, ".venv", "bin", "python") if os.path.exists(os.path.join(ROOT, ".venv", "bin", "python"))
        else "python3"))
    a = ap.parse_args(argv)
    if a.build_only:
        a.stages = ["preflight", "build"]
    if a.deadline <= MARGIN:
        ap.error(f"--deadline {a.deadline}: must exceed the {MARGIN} s kept for the summary")
    if a.fake_fail and not a.dry_run:
        ap.error("--fake-fail needs --dry-run")
    return a


if __name__ == "__main__":
    sys.exit(Run(parse(sys.argv[1:])).main())
