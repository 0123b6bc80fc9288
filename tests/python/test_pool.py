"""gradcomp.experiments.pool: the gloo process pool of the experiment harness, the benchmarks and
the tests (its network-namespace options: test_links.py). Jobs run on the session's shared 2-rank
pool (``pool.shared(2)``, the one gloo_pools.py and ddp_helpers.py hand out); the failure case
spawns a 1-rank pool of its own, since a failed job closes its pool."""

import os

import pytest

pytest.importorskip("torch")

from gradcomp.experiments import pool as gp  # noqa: E402


def job_rank(rank, world, tag):
    """(rank, world, tag, pid): where the job ran."""
    return rank, world, tag, os.getpid()


def job_report(rank, world, n):
    for i in range(n):
        gp.report({"rank": rank, "i": i})
    return n


def job_fail(rank, world):
    raise KeyError(f"rank {rank} fails on purpose")


def test_old_path_reexports_the_pool():
    from gradcomp.torch import pool as old

    for name in ("GlooPool", "report", "shared", "close_shared", "enter_netns", "CLONE_NEWNET", "NETNS_DIR"):
        assert getattr(old, name) is getattr(gp, name), name
    from gradcomp.experiments import links, netns

    assert gp.enter_netns is links.enter_netns is netns.enter_netns
    assert gp.NETNS_DIR == links.NETNS_DIR == netns.NETNS_DIR == "/var/run/netns"


def test_shared_pool_runs_jobs_in_rank_order():
    p = gp.shared(2)
    assert gp.shared(2) is p and p.world_size == 2 and not p.closed
    out = p.run(job_rank, "x")
    assert [o[:3] for o in out] == [(0, 2, "x"), (1, 2, "x")]
    assert len({o[3] for o in out} | {os.getpid()}) == 3  # two worker processes, not this one
    again = p.run(job_rank, "y")
    assert [o[3] for o in again] == [o[3] for o in out]  # the same workers


def test_report_reaches_on_progress():
    got = []
    assert gp.shared(2).run(job_report, 3, on_progress=lambda r, m: got.append((r, m))) == [3, 3]
    for r in (0, 1):
        assert [m["i"] for rr, m in got if rr == r] == [0, 1, 2]
        assert all(m["rank"] == rr for rr, m in got)
    gp.report("outside a worker: a no-op")


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size=0"):
        gp.GlooPool(0)
    for bad in (5, ["a", "b", "c"]):
        with pytest.raises(ValueError, match="sequence of 2 namespace names"):
            gp.GlooPool(2, netns=bad)
    with pytest.raises(ValueError, match="sequence of 2 dicts"):
        gp.GlooPool(2, env={"GLOO_SOCKET_IFNAME": "lo"})
    with pytest.raises(ValueError, match=r"env\[0\]"):
        gp.GlooPool(2, env=["lo", {}])


def test_failed_job_closes_the_pool_and_shared_replaces_it():
    p = gp.shared(1, gloo_timeout_s=20.0)
    assert gp.shared(1, gloo_timeout_s=20.0) is p
    with pytest.raises(RuntimeError, match=r"(?s)job job_fail failed:.*--- rank 0 ---.*KeyError: 'rank 0 fails"):
        p.run(job_fail)
    assert p.closed
    with pytest.raises(RuntimeError, match="the pool is closed"):
        p.run(job_rank, "z")
    q = gp.shared(1, gloo_timeout_s=20.0)
    assert q is not p and q.run(job_rank, "z")[0][:3] == (0, 1, "z")
    q.close()
