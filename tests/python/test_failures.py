"""A failed collective fails the step on every rank and loses nothing (real gloo process groups).

What is checked (the rank-side code is tests/python/failure_jobs.py):

- Dead peers: 3 CPU ranks (4 for hierarchical, 2 nodes of 2: 3 ranks cannot form two nodes),
  a gloo timeout of TIMEOUT_S seconds; rank 1 is SIGKILLed before the first collective of step 3,
  or while the others wait inside the last collective of that step (0.3 s after they entered it;
  the step's earlier calls have then completed and updated their residuals), for every scheme through the Compressor (dense, sum, gather,
  two_phase, hierarchical, powersgd) and for the DDP hook, the PowerSGD hook, the DeepSpeed
  backend and gradcomp.optim's OnebitAdam. Every survivor must raise within the timeout, with a
  message naming the step and what failed, and hold exactly (bitwise) the state it saved before
  the step: residuals (worker and server), PowerSGD's Qs, step counters, parameters and
  optimizer state. One case stalls rank 1 past the timeout instead (the peers time out). Every
  process is killed at the end of its case.
- Injected failures: on 3 ranks of a shared pool every rank fails the same collective of step 2
  in place (as a closed connection does), at each collective index of the step in turn; every
  rank raises, its state is as before the step, and the run retried from there ends bitwise
  equal to a run that never failed (the "resumes exactly" promise), outputs included. The same
  for a decode that fails (a corrupt top-k packet).
- Ranks that disagree (another codec or spec, numel, bucket layout, scheme, call order, a step
  counter ahead, PowerSGD options, a DDP hook's codec, packets of another spec through a scheme
  called directly): every rank raises gradcomp.RankMismatchError with a message saying which
  rank sent what, and its tensor keeps its input (nothing was decoded into it).
- The guard itself: with the bug of issue 18 planted back (a Future callback that ignores its
  future) the dead-peer check fails; and no code in the package attaches a callback to a Future
  other than gradcomp.schemes.context.chain, which reads the future first (a static scan, itself
  tested on a planted snippet).
"""

import ast
import datetime
import os
import pathlib
import queue
import subprocess
import sys
import tempfile
import time
import traceback

import pytest

pytestmark = pytest.mark.slow  # processes killed and stalled, gloo timeouts: the whole suite only (tests/quick.sh leaves them out)

torch = pytest.importorskip("torch")

import gradcomp  # noqa: E402
from gradcomp.experiments.pool import shared  # noqa: E402

import failure_jobs  # noqa: E402

TIMEOUT_S = 5.0
"""The process groups' timeout in these tests (seconds)."""

SCHEMES = ["compressor:dense", "compressor:sum", "compressor:gather", "compressor:two_phase",
           "compressor:hierarchical", "compressor:powersgd"]
INTEGRATIONS = ["ddp:topk", "ddp:powersgd", "deepspeed", "optim:OnebitAdam"]


# ---- fresh processes for the dead-peer cases ---------------------------------------------------
def _entry(rank, world, init_file, results, job, args, sys_path):
    for p in sys_path:
        if p not in sys.path:
            sys.path.append(p)
    try:
        import torch as _torch
        import torch.distributed as dist

        _torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        import failure_jobs as jobs

        results.put((rank, "ok", getattr(jobs, job)(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "err", traceback.format_exc()))


def run_fresh(world, job, *args, expect=None, deadline_s=120.0):
    """Run ``failure_jobs.<job>(rank, world, *args)`` in ``world`` fresh processes; return
    ``{rank: result}`` of the ranks that reported (``expect``: which must, default all) and kill
    every process at the end, whatever happened."""
    import torch.multiprocessing as mp

    expect = list(range(world)) if expect is None else list(expect)
    # a fork server with torch and gradcomp imported starts a rank in a fraction of a second
    # (spawn would import torch again in every process of every case)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn", "gradcomp", "gradcomp.torch",
                                "gradcomp.optim", "gradcomp.deepspeed", "failure_jobs"])
    results = ctx.Queue()
    out, errors = {}, {}
    with tempfile.TemporaryDirectory(prefix="gradcomp-failures-") as d:
        procs = [ctx.Process(target=_entry, daemon=True,
                             args=(r, world, os.path.join(d, "init"), results, job, args, list(sys.path)))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            end = time.monotonic() + deadline_s
            while not all(r in out or r in errors for r in expect):
                left = end - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, kind, payload = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    continue
                (out if kind == "ok" else errors)[rank] = payload
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
    if errors:
        raise AssertionError("ranks failed outside the scenario:\n" + "\n".join(
            f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    missing = [r for r in expect if r not in out]
    assert not missing, f"ranks {missing} did not report within {deadline_s} s (a survivor hung?)"
    assert all(not p.is_alive() for p in procs), "a process was left behind"
    return out


def check_failed_step(results, integration, mode, limit_s):
    """What every survivor must report after its peer died: it raised within ``limit_s``, naming
    the step, and its state is bitwise what it was before the step."""
    for rank, r in sorted(results.items()):
        where = f"{integration}, {mode}, rank {rank}"
        assert r["raised"], f"{where}: the step did not raise (a silently wrong average)"
        assert r["seconds"] < limit_s, f"{where}: raised after {r['seconds']:.1f} s (limit {limit_s} s)"
        msg = r["msg"]
        if integration.startswith(("compressor", "ddp")):
            assert "step 3" in msg, f"{where}: the message does not name step 3: {msg}"
            assert ("tensor" in msg or "bucket" in msg) and "scheme" in msg, f"{where}: {msg}"
        elif integration == "deepspeed":  # the backend's unit is the call (DeepSpeed passes no step)
            assert "compressed_allreduce (call" in msg, f"{where}: {msg}"
        else:
            assert "step 4 failed" in msg, f"{where}: the message does not name the optimizer's step 4: {msg}"
        assert not r["diff"], f"{where}: the state changed: {r['diff'][:6]}"


def _world(integration):
    return 4 if integration == "compressor:hierarchical" else 3


@pytest.mark.parametrize("mode", ["kill_before", "kill_during"])
@pytest.mark.parametrize("integration", SCHEMES + INTEGRATIONS)
def test_dead_peer(integration, mode):
    world = _world(integration)
    survivors = [r for r in range(world) if r != 1]
    # hierarchical: rank 1 (node 0, local rank 1) dies in its last collective ACROSS nodes, so that
    # node 1 hears of it (through rank 3, whose inner scheme fails, and its status element)
    back = 2 if integration == "compressor:hierarchical" else 0
    res = run_fresh(world, "dead_peer_job", integration, mode, 1, 3, False, back, expect=survivors)
    check_failed_step(res, integration, mode, limit_s=TIMEOUT_S + 3.0)


def test_hierarchical_death_inside_a_node():
    """Rank 1 dies in the step's last collective, the all-gather inside node 0: rank 0 raises
    with its state as before the step; node 1 (ranks 2, 3) had every rank's contribution by then
    and completes the step with the true average (its next collective would fail). What a rank
    returns is always the average of all contributions or an error."""
    res = run_fresh(4, "dead_peer_job", "compressor:hierarchical", "kill_during", expect=[0, 2, 3])
    check_failed_step({0: res[0]}, "compressor:hierarchical", "kill_during", limit_s=TIMEOUT_S + 3.0)
    for r in (2, 3):
        assert not res[r]["raised"], res[r]


def test_stalled_peer_times_out():
    """Rank 1 stops answering (alive, its sockets open): the survivors raise after the process
    group's timeout, with the state as before the step."""
    res = run_fresh(3, "dead_peer_job", "compressor:sum", "stall", expect=[0, 2])
    check_failed_step(res, "compressor:sum", "stall", limit_s=TIMEOUT_S + 5.0)
    assert all(r["seconds"] >= TIMEOUT_S * 0.8 for r in res.values()), res


def test_planted_bug_is_caught():
    """Guards the dead-peer check itself: with the bug of issue 18 planted back (the callback
    ignores its future), the survivors return a value, and check_failed_step must fail."""
    res = run_fresh(3, "dead_peer_job", "compressor:sum", "kill_before", 1, 3, True, expect=[0, 2])
    assert not any(r["raised"] for r in res.values()), res
    with pytest.raises(AssertionError, match="did not raise"):
        check_failed_step(res, "compressor:sum", "kill_before", limit_s=TIMEOUT_S + 3.0)


# ---- injected failures, in a shared pool ---------------------------------------------------------
_USED = set()


def _pool(world):
    # GRADCOMP_EXIT_WAIT_S: after the mismatch cases 'order', 'skip', 'powersgd' and 'headers'
    # (and the injected failures) a rank still holds 1-2 of chain's callbacks at exit, and its
    # exit would wait the default 10 s for them, then warn (~24 s of the module's teardown)
    p = shared(world, gloo_timeout_s=30.0, env=[{"GRADCOMP_EXIT_WAIT_S": "1"}] * world)
    _USED.add(p)
    return p


def teardown_module(module):
    for p in _USED:  # these pools' options are this module's: free their processes now
        p.close()


def _collectives(integration, world):
    """Collectives one rank issues in a regular step (the cases index them)."""
    return _pool(world).run(_count_job, integration)[0]


def _count_job(rank, world, integration):
    run = failure_jobs.build(rank, world, integration)
    for k in range(2):
        run.step(k)
    return failure_jobs.collectives_per_step(run, 2)


INJECT = SCHEMES + INTEGRATIONS + ["ddp:int8", "optim:OnebitLamb", "optim:ZeroOneAdam"]


@pytest.mark.parametrize("integration", INJECT)
def test_injected_failure_undone_and_resumed(integration):
    world = _world(integration)
    n = _collectives(integration, world)
    assert n >= 1
    for at in range(n):
        res = _pool(world).run(failure_jobs.injected_job, integration, at, timeout=240)
        for rank, r in enumerate(res):
            where = f"{integration}, collective {at} of {n}, rank {rank}"
            assert r["fired"], f"{where}: the fault was not reached"
            assert r["raised"], f"{where}: the step did not raise"
            assert "injected" in r["msg"], f"{where}: the collective's error is not in the message: {r['msg']}"
            assert not r["diff"], f"{where}: state changed by the failed step: {r['diff'][:6]}"
            assert not r["retry_diff"], f"{where}: the retried run differs from a clean one: {r['retry_diff'][:6]}"
            assert not r["outs_diff"], f"{where}: the retried outputs differ: {r['outs_diff'][:6]}"


def test_corrupt_packet_fails_the_step():
    """A decode that fails (the gathered top-k packets carry an index out of range, on every rank)
    fails the step as a collective does: CorruptPacketError (its type kept through the Future),
    naming step and tensor, the state as before the step, and the retried run equal to a clean
    one."""
    res = _pool(3).run(failure_jobs.injected_job, "compressor:gather", 1, 4, 2, "corrupt", timeout=240)
    for rank, r in enumerate(res):
        assert r["fired"] and r["raised"], (rank, r)
        assert r["type"] == "CorruptPacketError", (rank, r["type"], r["msg"])
        assert "step 2, tensor 'w' (codec topk:ratio=0.05, scheme gather)" in r["msg"], (rank, r["msg"])
        assert not r["diff"] and not r["retry_diff"] and not r["outs_diff"], (rank, r)


# ---- ranks that disagree -------------------------------------------------------------------------
MISMATCHES = {
    "codec": r"rank 1 runs codec 'bf16', this rank 'fp16'|rank \d runs codec 'fp16', this rank 'bf16'",
    "spec": r"runs codec '(int8|int8:block=256)', this rank '(int8|int8:block=256)'",
    "numel": r"tensor 'g' has (4000|4096) elements of float32, this rank's (4000|4096) of float32",
    "layout": r"bucket 0 holds 2 parameters in another layout",
    "scheme": r"runs scheme (gather|two_phase), this rank (gather|two_phase)",
    "order": r"reduces tensor '(u|g)' where this rank reduces tensor '(u|g)' \(calls in another order\)",
    "skip": r"is at step (1|2), this rank at step (1|2) \(a rank skipped or repeated a step\)",
    "powersgd": r"runs codec 'powersgd:rank=(2|4)', this rank 'powersgd:rank=(2|4)'",
    "ddp": r"runs codec '(fp16|bf16)', this rank '(fp16|bf16)'",
    "headers": r"sent a packet of another 'fp8' spec \(spec hash 0x[0-9a-f]{8}, this rank's 0x[0-9a-f]{8}\)",
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_ranks_that_disagree(case):
    import re

    res = _pool(3).run(failure_jobs.mismatch_job, case, timeout=120)
    for rank, r in enumerate(res):
        assert r["raised"], f"{case}, rank {rank}: no error"
        assert r["type"] in ("RankMismatchError", "RuntimeError"), f"{case}, rank {rank}: {r['type']}: {r['msg']}"
        assert re.search(MISMATCHES[case], r["msg"]), f"{case}, rank {rank}: {r['msg']}"
        if case not in ("ddp",):
            assert r["tensor_kept"], f"{case}, rank {rank}: something was decoded into the tensor"
        if case == "skip":
            assert r["residual_kept"], f"{case}, rank {rank}: the residual changed"
    assert _pool(3).run(failure_jobs.scan_job) == [6.0, 6.0, 6.0]  # the group still works


# ---- no callback may ignore its future -----------------------------------------------------------
PACKAGE = pathlib.Path(gradcomp.__file__).parent


def callbacks_outside_chain(source: str, name: str):
    """``.then(...)`` / ``.add_done_callback(...)`` calls outside ``def chain`` in ``source``:
    [(file, line)]. gradcomp.schemes.context.chain is the one place a callback is attached (it
    reads the future first)."""
    tree = ast.parse(source)
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "chain" and name.endswith("schemes/context.py"):
            inside |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("then", "add_done_callback") and id(node) not in inside):
            out.append((name, node.lineno))
    return out


def test_no_callback_outside_chain():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += callbacks_outside_chain(path.read_text(), path.relative_to(PACKAGE).as_posix())
    assert not found, f"Future callbacks attached outside gradcomp.schemes.context.chain: {found}"


def test_the_scan_sees_a_planted_callback():
    planted = "def f(work, t):\n    return work.get_future().then(lambda f: t)\n"
    assert callbacks_outside_chain(planted, "torch/planted.py") == [("torch/planted.py", 2)]
    assert callbacks_outside_chain("fut.add_done_callback(cb)\n", "x.py") == [("x.py", 1)]


# ---- the exit path (issue 19, item 5) ------------------------------------------------------------
EXIT_JOB = r"""
import sys, torch, torch.distributed as dist
import gradcomp.torch as gt
rank, init, scheme = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
c = gt.Compressor("topk:ratio=0.01" if scheme == "gather" else "fp16", scheme=scheme)
x = torch.randn(100_000, generator=torch.Generator().manual_seed(rank))
for step in range(20):
    futs = [c.allreduce(x.clone(), name=f"t{i}") for i in range(4)]
    for f in futs:
        f.wait()
    c.end_step()
print("done", rank, flush=True)
# no destroy_process_group: the interpreter exits with gradcomp's objects alive
"""
EXIT_ROUNDS = 5


def test_exit_without_destroy_process_group_is_clean():
    """A two-rank Compressor loop exits cleanly, EXIT_ROUNDS times in a row for each of the sum
    and gather schemes, without destroy_process_group (before the fix: "terminate called without
    an active exception" and SIGABRT in about half the runs; gradcomp.schemes.context._Pending)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for scheme in ("sum", "gather"):
        for i in range(EXIT_ROUNDS):
            with tempfile.TemporaryDirectory() as d:
                init = pathlib.Path(d, "store").as_uri()
                procs = [subprocess.Popen([sys.executable, "-c", EXIT_JOB, str(r), init, scheme], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                         for r in range(2)]
                outs = [p.communicate(timeout=120) for p in procs]
            for r, (p, (out, err)) in enumerate(zip(procs, outs)):
                assert p.returncode == 0 and f"done {r}" in out and "terminate called" not in err, (
                    f"scheme {scheme}, run {i}, rank {r}: exit status {p.returncode}\n{err[-2000:]}")


def test_exit_wait_is_bounded_and_warns():
    """The exit's wait for callbacks ends when they are freed, or after its timeout with a
    warning naming how many are left and what to do."""
    from gradcomp.schemes.context import PENDING, chain

    fut = torch.futures.Future()
    out = chain(fut, lambda v: v + 1)
    with pytest.warns(UserWarning, match=r"1 collective\(s\) still in flight at exit.*destroy_process_group"):
        assert PENDING.drain(timeout=0.05) is False
    fut.set_result(1)
    assert out.wait() == 2
    del fut, out
    t0 = time.monotonic()
    assert PENDING.drain(timeout=5.0) is True
    assert time.monotonic() - t0 < 1.0
