"""bench/slow_link.py's own logic, without the shaped links: its probe wrapper on real gloo ranks
(the compressor's probe interface changed under it once, unnoticed until a run), and the planner
model and per-step prediction it compares the measurements with."""

import json
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
    return tuple(sl.job_collective(rank, world, kind, 8, 4) for kind in ("allreduce", "all_gather", "all_to_all"))


def test_calibration_collectives_on_gloo_ranks():
    for ar, ag, a2a in run(2, job_calibration):
        assert len(ar) == 4 and len(ag) == 4 and len(a2a) == 4 and all(t > 0 for t in ar + ag + a2a)
    with pytest.raises(Exception, match="accepted: allreduce, all_gather, all_to_all"):
        run(2, job_bad_calibration)


def test_calibration_takes_the_mean_over_calls():
    """Per call the mean over ranks, then the mean over calls (a step's collectives add up),
    not the median: 2 ranks, 4 calls, one slow."""
    per_rank = [[1e-3, 1e-3, 1e-3, 10e-3], [1e-3, 3e-3, 1e-3, 10e-3]]
    # per call: 1, 2, 1, 10 ms; their mean 3.5 ms (their median would be 1.5 ms)
    assert _slow_link().expected_s(per_rank) == pytest.approx(3.5e-3)


def job_bad_calibration(rank, world):
    return _slow_link().job_collective(rank, world, "broadcast", 8, 1)


def job_levels(rank, world):
    import torch.distributed as dist

    sl = _slow_link()
    out = {lv: sl.job_collective(rank, world, kind, 8, 3, lv)
           for lv, kind in (("intra", "all_gather"), ("inter", "allreduce"), ("flat", "all_gather"))}
    from gradcomp.schemes.groups import hierarchical_groups_for

    hg = hierarchical_groups_for(None, sl.L)
    ranks = {lv: dist.get_process_group_ranks(g) for lv, g in (("intra", hg.intra), ("inter", hg.cross))}
    return out, ranks


def test_calibration_group_shapes_on_four_gloo_ranks():
    """The calibration's groups are hierarchical's: nodes of L = 2 consecutive ranks, and one rank
    per node across them."""
    for rank, (times, ranks) in enumerate(run(4, job_levels)):
        assert all(len(t) == 3 and all(x > 0 for x in t) for t in times.values())
        assert ranks["intra"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert ranks["inter"] == [rank % 2, rank % 2 + 2]


def _timings(c, a, r, g, p):
    """A group shape's calibration timings of an engine with per-collective c, alpha a, allreduce
    rate r and all-gather rate g, p ranks: the formulas of EngineCost.calibrate's docstring."""
    B = 16 << 20
    return {"small_allreduce_s": c + 2 * (p - 1) * a, "small_all_gather_s": c + (p - 1) * a,
            "large_allreduce_s": c + 2 * (p - 1) * a + 2 * (p - 1) / p * B / r,
            "large_all_gather_s": c + (p - 1) * a + (p - 1) * B / g}


def test_engine_from_timings_takes_the_measured_all_to_all():
    """The all-to-all's measured time is its fixed time; a run saved without one (before it was
    timed) infers it, per collective + one alpha."""
    sl = _slow_link()
    c, a, r, g = 2e-3, 5e-4, 1e9, 4e8
    t = _timings(c, a, r, g, sl.W)
    old = sl.engine_from_timings(t, "flat")
    assert old.kind_fixed_s == {} and math.isclose(old.fixed_s("all_to_all", sl.W), c + a, rel_tol=1e-9)
    new = sl.engine_from_timings(dict(t, small_all_to_all_s=3.3e-3), "flat")
    assert new.fixed_s("all_to_all", sl.W) == 3.3e-3
    assert math.isclose(new.fixed_s("allreduce", sl.W), old.fixed_s("allreduce", sl.W), rel_tol=1e-12)
    assert "all-to-all of 8 B per slot 3300 us" in sl.describe_timings(dict(t, small_all_to_all_s=3.3e-3), sl.W)


def test_repredict_judges_a_saved_run_by_hand(tmp_path, capsys):
    """--repredict: a saved row judged again from the saved calibration timings, every figure
    written out here from the formulas (shaped loopback of 1 Gb/s: the link lends 500 kB, more
    than the row sends, so the engine is the time)."""
    sl = _slow_link()
    W = sl.W
    c, a, r, g = 2e-3, 5e-4, 1e9, 4e8
    n = 1000
    row = {"setup": "lo:1gbit", "kind": "lo", "rate": "1gbit", "model": "digits", "codec": "none",
           "scheme_requested": "dense", "scheme": "dense", "buckets": [[n, "float32", "dense", ""]], "warmup": 1,
           "steps": 3, "meas_comm_ms": 9.0, "meas_comm_min_ms": 8.0, "meas_comm_max_ms": 10.0,
           "comm_per_step_ms": [9.0, 9.0, 9.0], "barriers_per_step": 2, "comm_phases_per_step": 2,
           "tbf_credit_ms": 8.0, "meas_kernel_ms": 0.5, "meas_wall_ms": 12.0, "qdisc_bytes": 30000.0,
           "qdisc_packets": 20.0, "qdisc_dropped": 0, "floor_ms": 9.5, "ddp_meas_ms": 15.0, "ddp_compute_ms": 2.0,
           "pred_comm_ms": 123.0, "ratio": 0.1, "within": False}
    saved = {"config": {"world_size": W, "ranks_per_node": sl.L, "tolerance": 0.15, "cores": 2,
                        "calibration": {"layouts": {}, "compute_s": {"digits": 2e-3}, "params": {},
                                        "engine": {}, "engine_timings": {"lo": {"flat": _timings(c, a, r, g, W)}}},
                        "tbf": {"1gbit": links.tbf_params("1gbit")}, "args": {"alpha_reps": 300},
                        "hierarchical": True},
             "rows": [row], "skipped": [], "wall_s": 1.0}
    src = tmp_path / "saved.json"
    src.write_text(json.dumps(saved))
    out = tmp_path / "again"
    assert sl.main(["--repredict", str(src), "--out", str(out)]) == 0
    got = json.loads((out / "slow_link.json").read_text())["rows"][0]
    allreduce = c + 2 * (W - 1) * a + 2 * (W - 1) / W * 4 * n / r  # the bucket's dense allreduce
    check = c + (W - 1) * a + (W - 1) * 256 / g                    # the descriptor all-gather, at g
    pred_ms = 1e3 * (allreduce + check)
    assert math.isclose(got["pred_comm_ms"], pred_ms, rel_tol=1e-9)
    assert math.isclose(got["ratio"], 9.0 / pred_ms, rel_tol=1e-9) and got["within"] is True
    wire = W * (2 * (W - 1) / W * 4 * n) + W * (W - 1) * 256
    assert math.isclose(got["pred_bytes"], wire, rel_tol=1e-9)
    assert math.isclose(got["bytes_ratio"], 30000.0 / wire, rel_tol=1e-9)
    assert math.isclose(got["payload_ratio"], (30000.0 - 66 * 20) / wire, rel_tol=1e-9)
    assert math.isclose(got["ratio_pred_plus_floor"], 9.0 / (pred_ms + 9.5), rel_tol=1e-9)
    assert math.isclose(got["ddp_pred_ms"], 2.0 + pred_ms + 0.5, rel_tol=1e-9)
    md = (out / "slow_link.md").read_text()
    assert "judged again (--repredict" in md and "1 of 1 shaped rows within 15 %" in md
    # a saved run of an earlier version (one timing set per kind, no all-gather rate): refused
    saved["config"]["calibration"]["engine_timings"] = {"lo": {"small_allreduce_s": 1e-3}}
    src.write_text(json.dumps(saved))
    with pytest.raises(SystemExit):
        sl.main(["--repredict", str(src), "--out", str(out)])
    assert "accepted: the slow_link.json of this version" in capsys.readouterr().err


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
    # per group shape: the node's loopback at the intra groups' measured rate
    shapes = {"flat": eng, "intra": planner.EngineCost(0.0, 5e8, 1e-3), "inter": planner.EngineCost(0.0, 2e8, 1e-3)}
    m3 = sl.cost_model("nodes", "1gbit", shapes)
    assert m3.intra.bytes_per_s == 5e8 and m3.engine_for("inter") is shapes["inter"] and m3.engine_cost is eng
    assert m2.inter.burst_bytes == links.tbf_params("1gbit")["burst_bytes"]
    t = sl.predict_buckets(m2, int8, [(n, "float32", "two_phase", "")], "nodes")
    assert math.isclose(t["comm_s"], m2.peer_check_s(W) + m2.predict("two_phase", int8, n, "float32", W)["comm_s"],
                        rel_tol=1e-12)
