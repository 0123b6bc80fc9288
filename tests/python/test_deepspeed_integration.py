"""gradcomp inside DeepSpeed, on 2 CPU processes (gloo, DS_ACCELERATOR=cpu), 10 steps, lr 3e-4,
freeze_step 2, no gradient clipping (tests/python/ds_onebit_job.py runs the trainings in a
subprocess: one job per DeepSpeed version, its trainings one after another on the same 2 ranks).

DeepSpeed 0.19.6 (pinned in tests/requirements.txt), its own OneBitAdam, OneBitLamb and
ZeroOneAdam:
  - with gradcomp.deepspeed.OnebitBackend put in place of CompressedBackend ("comm_backend_name":
    "compressed"): the engine turns its gradient allreduce off after the warm-up (ZeroOneAdam: on
    the same steps as with the reference backend), the error buffers are non-zero, the loss falls,
    both ranks end with bitwise equal parameters (not ZeroOneAdam, whose local steps leave the
    ranks apart), and every rank's parameters equal the same run with a pure-torch
    re-implementation of DeepSpeed's compressed allreduce (docs/contracts.md section 6.1) to 1e-4, a
    few percent of the 8 compressed updates of lr = 3e-4 each (the scales may differ by a float32
    ulp: binary64 sums against torch.norm, and Adam divides by a variance frozen after two steps,
    which amplifies it; seen: 1.5e-5);
  - gradcomp.deepspeed.install(engine) after initialize (the engine built with the reference
    backend) gives bitwise the run above.
gradcomp.optim's OnebitAdam, OnebitLamb and ZeroOneAdam (the semantics DeepSpeed 0.19.7 removed):
  - in a plain loop and under DDP with register_comm_hook: bitwise equal to DeepSpeed 0.19.6's
    optimizer with the gradcomp backend (the same float32 operations in the same order; the
    tolerance is 0);
  - as the client optimizer of DeepSpeed 0.19.8 (installed by tests/setup.sh with --no-deps into
    .venv/deepspeed-0.19.8 and put first on PYTHONPATH), bound by install(engine): the engine runs
    its dense gradient allreduce on DeepSpeed 0.19.6's dense steps only (the two warm-up steps;
    ZeroOneAdam: also its variance step 4), and the parameters are
    bitwise those of the plain loop; install(engine) refuses torch.optim.Adam there with a
    TypeError that names the removal and gradcomp.optim.
"""

import functools
import itertools
import json
import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.slow  # DeepSpeed trainings in subprocesses: the whole suite only (tests/quick.sh leaves them out)

pytest.importorskip("deepspeed")

HERE = os.path.dirname(os.path.abspath(__file__))
DS_CURRENT = os.path.join(sys.prefix, "deepspeed-0.19.8")
_ports = itertools.count(29611, 7)


OPTS = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"]
# The trainings, batched: one job (one spawn of 2 ranks, one torch and DeepSpeed import each) per
# DeepSpeed version runs its trainings in sequence; each test reads its trainings' results
# (issue 20: 17 jobs of one training each took ~3 minutes, mostly imports)
BATCHES = {
    "0.19.6": [(o, m) for o in OPTS for m in ("gradcomp", "reference", "plain", "ddp")] + [("OneBitAdam", "install")],
    "0.19.8": [(o, "client") for o in OPTS] + [("Adam", "client_torch_adam")],
}


def _job(configs, current):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    if current:
        assert os.path.isdir(os.path.join(DS_CURRENT, "deepspeed")), \
            f"{DS_CURRENT} is missing: tests/setup.sh installs DeepSpeed 0.19.8 there"
        env["PYTHONPATH"] = os.pathsep.join([DS_CURRENT] + [x for x in [env.get("PYTHONPATH")] if x])
    cmd = [sys.executable, os.path.join(HERE, "ds_onebit_job.py"), "--batch", str(next(_ports))]
    with tempfile.TemporaryDirectory() as tmp:
        # the result lines through a file of the job's main process (ds_onebit_job.py: on stdout a
        # rank's DeepSpeed warning could land inside a long line)
        env["DS_ONEBIT_RESULTS"] = results = os.path.join(tmp, "results.txt")
        try:
            p = subprocess.run(cmd + [f"{o}:{m}" for o, m in configs], capture_output=True, text=True, timeout=900,
                               env=env)
            out, err, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = e.stdout or "", e.stderr or "", "timeout"
            out, err = [x.decode() if isinstance(x, bytes) else x for x in (out, err)]
        lines = open(results).read() if os.path.exists(results) else ""
    return lines, out + err, rc


@functools.lru_cache(maxsize=None)
def _batch(version):
    """{(optimizer, mode): the ranks' records, or the error text} for every training of BATCHES[version].
    A training that fails ends its job: it gets the error, and the trainings after it run in a new job."""
    pending, results = list(BATCHES[version]), {}
    while pending:
        lines, err, rc = _job(pending, version == "0.19.8")
        done = 0
        for ln in lines.splitlines():
            kind, _, rest = ln.partition(" ")
            if kind in ("RESULT", "ERROR"):
                o, m, js = rest.split(" ", 2)
                assert (o, m) == pending[done], (ln[:200], pending)
                results[(o, m)] = json.loads(js) if kind == "RESULT" else (
                    f"training {o} {m} failed (job status {rc}): {js[:4000]}\n{err[-4000:]}")
                done += 1
        if done < len(pending) and (done == 0 or not isinstance(results[pending[done - 1]], str)):
            # the job ended without a word on pending[done]: that one takes the blame
            results[pending[done]] = (f"training {pending[done]}: the job ended (status {rc}) without its "
                                      f"result\n{err[-6000:]}")
            done += 1
        pending = pending[done:]
    return results


def train(opt, mode):
    r = _batch("0.19.8" if mode.startswith("client") else "0.19.6")[(opt, mode)]
    assert not isinstance(r, str), r
    return r


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("opt", ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"])
def test_onebit_optimizers_train_with_the_gradcomp_backend(opt):
    got = train(opt, "gradcomp")
    ref = train(opt, "reference")
    for r in got:
        assert r["deepspeed"] == "0.19.6"
        assert r["error_sum"] > 0
        assert r["losses"][-1] < r["losses"][0], r["losses"]
    if opt != "ZeroOneAdam":  # 0/1 Adam takes local steps between synchronizations: ranks differ
        for r in got:
            assert r["allreduce"][0] and not any(r["allreduce"][2:]), r["allreduce"]  # off after the freeze
            assert r["dense_calls"] == [1, 1] + [0] * 8, r["dense_calls"]
        assert got[0]["params"] == got[1]["params"], "ranks differ"
        assert ref[0]["params"] == ref[1]["params"]
    else:  # the engine allreduces only on the variance-update steps; the same steps with both backends
        assert [r["allreduce"] for r in got] == [r["allreduce"] for r in ref]
    for g, f in zip(got, ref):
        diff = max_diff(g, f)
        assert diff <= 1e-4, f"gradcomp backend vs the pure-torch reference: max |param diff| {diff}"


def test_install_puts_the_backend_under_an_engine():
    inst, direct = train("OneBitAdam", "install"), train("OneBitAdam", "gradcomp")
    for a, b in zip(inst, direct):
        assert a["params"] == b["params"] and a["losses"] == b["losses"]


# DeepSpeed's dense gradient allreduces per step (ZeroOneAdam: steps 1, 2 and the variance step 4)
DENSE = {"OneBitAdam": [1, 1] + [0] * 8, "OneBitLamb": [1, 1] + [0] * 8, "ZeroOneAdam": [1, 1, 0, 1] + [0] * 6}
NAMES = {"OneBitAdam": "OnebitAdam", "OneBitLamb": "OnebitLamb", "ZeroOneAdam": "ZeroOneAdam"}


@pytest.mark.parametrize("opt", ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"])
@pytest.mark.parametrize("mode", ["plain", "ddp"])
def test_gradcomp_optim_equals_deepspeed(opt, mode):
    ds, mine = train(opt, "gradcomp"), train(opt, mode)
    for a, b in zip(ds, mine):
        assert a["dense_calls"] == DENSE[opt], a["dense_calls"]
        assert b["optimizer"] == NAMES[opt]
        assert max_diff(a, b) == 0.0, f"{mode} vs DeepSpeed 0.19.6: max |param diff| {max_diff(a, b)}"
        assert a["losses"] == b["losses"] and a["allreduce"] == b["allreduce"]
        assert b["error_sum"] == a["error_sum"] and b["error_sum"] > 0
        assert b["comm_stats"]["compressed_steps"] == 10 - sum(DENSE[opt])
        assert b["comm_stats"]["compressed_sent_bytes"] > 0


@pytest.mark.parametrize("opt", ["OneBitAdam", "OneBitLamb", "ZeroOneAdam"])
def test_client_optimizer_on_current_deepspeed(opt):
    got, plain = train(opt, "client"), train(opt, "plain")
    for a, b in zip(got, plain):
        assert a["deepspeed"] == "0.19.8"
        assert a["dense_calls"] == DENSE[opt], a["dense_calls"]  # no dense gradient on the compressed steps
        assert a["allreduce"] == b["allreduce"]
        assert a["params"] == b["params"], f"client optimizer vs plain loop: {max_diff(a, b)}"
        # issue 19 (7): the engine's dense averaging is counted: it ran on every DENSE step, the
        # initialisation step included, where the plain loop's step() averages all but that one
        n = sum(DENSE[opt])
        assert b["comm_stats"]["dense_sent_bytes"] > 0
        assert a["comm_stats"]["dense_sent_bytes"] == n / (n - 1) * b["comm_stats"]["dense_sent_bytes"]


def test_install_refuses_other_optimizers_on_current_deepspeed():
    for r in train("Adam", "client_torch_adam"):
        assert r["deepspeed"] == "0.19.8"
        msg = r["install_error"]
        assert msg and "Adam" in msg and "0.19.7" in msg and "gradcomp.optim.OnebitAdam" in msg, msg
