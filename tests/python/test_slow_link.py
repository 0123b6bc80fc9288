"""bench/slow_link.py's own logic, without the shaped links: its probe wrapper on real gloo ranks
(the compressor's probe interface changed under it once, unnoticed until a run), and the planner
model and per-step prediction it compares the measurements with."""

import math
import os
import sys

import pytest

pytest.importorskip("torch")

import gradcomp  # noqa: E402
from gradcomp import planner  # noqa: E402
from gradcomp.experiments import links  # noqa: E402

from ddp_helpers import run  # noqa: E402

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


def _slow_link():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import slow_link

    return slow_link


def job_rows(rank, world, spec, scheme, steps):
    sl = _slow_link()
    sl.job_comm_prepare(rank, world, [(1000, "float32"), (300, "float32")], spec, scheme, spec != "none", 1)
    out = sl.job_comm_measure(rank, world, steps)
    sl.job_release(rank, world)
    return out


@pytest.mark.parametrize("spec,scheme,barriers,phases", [
    ("none", "dense", 2, 2),         # one allreduce per bucket, after a barrier
    ("int8", "two_phase", 4, 4),     # per bucket: the all-to-all, the all-gather after its re-encode
])
def test_aligned_probe_on_gloo_ranks(spec, scheme, barriers, phases):
    res = run(2, job_rows, spec, scheme, 3)
    for per_rank in res:
        assert len(per_rank) == 3
        for step in per_rank:
            assert step["barriers"] == barriers and step["comm_phases"] == phases
            assert [b[2] for b in step["buckets"]] == [scheme, scheme]
            for comm, enc, dec in step["times"]:
                assert comm > 0 and enc >= 0 and dec >= 0
                assert (enc > 0) == (spec != "none")


def job_calibration(rank, world):
    sl = _slow_link()
    return sl.job_collective(rank, world, "allreduce", 8, 4), sl.job_collective(rank, world, "all_gather", 8, 4)


def test_calibration_collectives_on_gloo_ranks():
    for ar, ag in run(2, job_calibration):
        assert len(ar) == 4 and len(ag) == 4 and all(t > 0 for t in ar + ag)
    with pytest.raises(Exception, match="accepted: allreduce, all_gather"):
        run(2, job_bad_calibration)


def job_bad_calibration(rank, world):
    return _slow_link().job_collective(rank, world, "broadcast", 8, 1)


def test_prediction_per_step_by_hand():
    sl = _slow_link()
    eng = planner.EngineCost(2e-3, 1e9, 5e-4)
    W = sl.W
    fp16, int8 = gradcomp.Codec("fp16"), gradcomp.Codec("int8")
    m = sl.cost_model("lo", "100mbit", eng)
    burst = links.tbf_params("100mbit")["burst_bytes"]
    assert m.intra.shared and m.intra.burst_bytes == burst and m.intra.latency_s == 0.0 and m.engine_cost is eng
    n = 1 << 16
    got = sl.predict_buckets(m, fp16, [(n, "float32", "sum", ""), (n, "float32", "sum", "")], "lo")
    # per bucket: the fp16 payload allreduced on the shared 12.5 MB/s loopback less the burst, or the engine
    vol = 2 * (W - 1) / W * 2 * n
    link = (W * vol - burst) / 12.5e6
    per = max(link, 2e-3 + 2 * (W - 1) * 5e-4 + vol / 1e9)
    check = max(0.0, (W * (W - 1) * 256 - burst)) / 12.5e6
    check = max(check, 2e-3 + (W - 1) * 5e-4 + (W - 1) * 256 / 1e9)
    assert math.isclose(got["comm_s"], 2 * per + check, rel_tol=1e-12)
    # tc's bytes: every rank's volume and the check's
    assert math.isclose(got["wire_bytes"], 2 * W * vol + W * (W - 1) * 256, rel_tol=1e-12)
    # two nodes: the measured loopback (the engine's rate) inside, the veth with its burst across
    m2 = sl.cost_model("nodes", "1gbit", eng)
    assert m2.intra.bytes_per_s == 1e9 and m2.inter.per_node
    assert m2.inter.burst_bytes == links.tbf_params("1gbit")["burst_bytes"]
    t = sl.predict_buckets(m2, int8, [(n, "float32", "two_phase", "")], "nodes")
    assert math.isclose(t["comm_s"], m2.peer_check_s(W) + m2.predict("two_phase", int8, n, "float32", W)["comm_s"],
                        rel_tol=1e-12)
