"""The per-step report (gradcomp.torch.stats.step_report, gradcomp.torch.timeline), the
``log_file`` JSON lines and ``gradcomp-report`` (gradcomp.report_cli).

- The time split, the busy time and the percentiles against plain references: a sampling of an
  integer timeline unit by unit (exact: every time is an integer number of seconds), numpy's
  percentile (relative 1e-12: numpy interpolates in another order).
- The traffic matrix (gradcomp.planner.traffic_matrix) against matrices written out by hand.
- A real 2-rank gloo DDP run with ``log_every=1, log_file=...``: each rank's rows, whole lines
  in one shared file; the split sums to the step exactly; each step's wall time lies between
  bounds the loop measured itself (no tolerance: orderings of perf_counter readings); bytes
  against the hand count of fp16 under ``sum`` at W = 2 (2 bytes per element); the link fields
  against the cost model's rate; ``stats()["report"]`` is the last row.
- ``gradcomp-report`` on that log: its numbers against a plain loop over the rows; its PNG; bad
  input (missing file, a malformed line named by number, a missing field, no rows, a rank not in
  the file) exits 2 with the reason.
"""

import io
import json
import math
import os
import random

import numpy as np
import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from gradcomp import planner  # noqa: E402
from gradcomp import report_cli  # noqa: E402
from gradcomp.torch import timeline  # noqa: E402
from gradcomp.torch.stats import check_log_file, step_report  # noqa: E402

from ddp_helpers import ddp, run  # noqa: E402


# ---- the timeline against a unit-by-unit sampling -----------------------------------------------
def sampled_split(spans, t_open, t_next, t_ret):
    """Reference: walk the integer timeline one unit at a time, classify each unit [t, t+1)."""
    t_done = max([min(e, t_next) for _, _, s, e, _ in spans if min(e, t_next) > max(s, t_open)], default=t_open)
    if t_ret is None:
        t_ret = max([e for *_, e, c in spans if c], default=t_open)
    out = {"encode_s": 0, "comm_s": 0, "decode_s": 0}
    blocked_total = 0
    for t in range(t_open, t_next):
        cover = {f for _, f, s, e, _ in spans if s <= t < e}
        caller = any(s <= t < e for _, _, s, e, c in spans if c)
        blocked = caller or (t_ret <= t < t_done)
        if not blocked:
            continue
        blocked_total += 1
        out["decode_s" if "decode_s" in cover else "encode_s" if "encode_s" in cover else "comm_s"] += 1
    return t_next - t_open - blocked_total, out


@pytest.mark.parametrize("seed", range(40))
def test_split_against_sampling(seed):
    rng = random.Random(seed)
    t_open, t_next = 0, rng.randint(20, 80)
    spans = []
    for call in range(rng.randint(0, 6)):
        for f in timeline.PHASES:
            s = rng.randint(-5, t_next + 5)
            spans.append((call, f, s, s + rng.randint(0, 15), rng.random() < 0.5))
    t_ret = rng.choice([None, rng.randint(0, t_next)])
    got = timeline.split_step(spans, t_open, t_next, t_ret)
    compute, exposed = sampled_split(spans, t_open, t_next, t_ret)
    assert got["step_s"] == t_next - t_open
    assert got["exposed"] == exposed, (spans, t_ret)
    assert got["compute_s"] == compute
    # the busy time of the collectives: the union of their spans inside the step
    busy = sum(1 for t in range(t_open, t_next) if any(s <= t < e for _, f, s, e, _ in spans if f == "comm_s"))
    assert timeline.busy(spans, "comm_s", t_open, t_next) == busy


def test_split_example_and_errors():
    # caller: encode 0-2 and 5-6; a collective 2-9 on another thread; decode 9-10 there; the
    # last call returns at 6: blocked 0-2 (encode), 5-6 (encode), 6-9 (comm), 9-10 (decode)
    spans = [(0, "encode_s", 0, 2, True), (0, "comm_s", 2, 9, False), (0, "decode_s", 9, 10, False),
             (1, "encode_s", 5, 6, True)]
    got = timeline.split_step(spans, 0, 20, 6)
    assert got == {"step_s": 20, "compute_s": 13, "exposed": {"encode_s": 3, "comm_s": 3, "decode_s": 1}}
    assert timeline.call_latencies(spans) == [10, 1]
    with pytest.raises(ValueError, match="before t_open"):
        timeline.split_step([], 5, 4)
    with pytest.raises(ValueError, match="span field 'wait_s'"):
        timeline.split_step([(0, "wait_s", 0, 1, True)], 0, 2)
    with pytest.raises(ValueError, match="ends at 1 before it starts at 2"):
        timeline.split_step([(0, "comm_s", 2, 1, True)], 0, 2)


@pytest.mark.parametrize("n", [1, 2, 7, 100, 601])
def test_percentile_against_numpy(n):
    v = np.random.default_rng(n).exponential(size=n).tolist()
    for q in (0, 50, 99, 100):
        assert math.isclose(timeline.percentile(v, q), float(np.percentile(v, q)), rel_tol=1e-12), q
    assert timeline.percentile([], 50) is None
    with pytest.raises(ValueError, match="q=101"):
        timeline.percentile(v, 101)


# ---- the traffic matrix and the link rates -------------------------------------------------------
def test_traffic_matrix_by_hand():
    ring = planner.traffic_matrix([("flat", "allreduce", 0, 4, 6.0)], 4)
    assert ring == [[0, 6, 0, 0], [0, 0, 6, 0], [0, 0, 0, 6], [6, 0, 0, 0]]
    a2a = planner.traffic_matrix([("flat", "all_to_all", 3, 4, 9.0)], 4)
    assert a2a == [[0, 3, 3, 3], [3, 0, 3, 3], [3, 3, 0, 3], [3, 3, 3, 0]]
    # nodes {0, 1} and {2, 3}: inside a node to the other local rank, across to the same local rank
    hier = planner.traffic_matrix([("intra", "allreduce", 0, 2, 5.0), ("inter", "all_gather", 0, 2, 7.0)], 4, 2)
    assert hier == [[0, 5, 7, 0], [5, 0, 0, 7], [7, 0, 0, 5], [0, 7, 5, 0]]
    # two_phase at W = 4: one P1 slot to each other rank (all-to-all), then the ring all-gather
    # forwards W - 1 = 3 slots of P2 to the successor
    import gradcomp

    c = gradcomp.Codec("int8")
    p1, p2 = planner.two_phase_slots(c, 1000, "float32", 4)
    m = planner.traffic_matrix(planner.scheme_steps("two_phase", c, 1000, "float32", 4), 4)
    assert m[0] == [0, p1 + 3 * p2, p1, p1] and m[3] == [p1 + 3 * p2, p1, p1, 0]
    assert all(math.isclose(sum(row), planner.bucket_bytes("two_phase", c, 1000, "float32", 4)["sent_bytes"])
               for row in m)
    with pytest.raises(ValueError, match="link level 'rack'"):
        planner.traffic_matrix([("rack", "allreduce", 0, 4, 1.0)], 4)
    with pytest.raises(ValueError, match="collective 'broadcast'"):
        planner.traffic_matrix([("flat", "broadcast", 0, 4, 1.0)], 4)
    with pytest.raises(ValueError, match="local_world_size=3"):
        planner.traffic_matrix([("intra", "allreduce", 0, 2, 1.0)], 4, 3)


def test_rank_rates():
    lo = planner.CostModel.loopback("100mbit")  # one shared 12.5 MB/s medium
    assert lo.rank_rates(4) == {"flat": 12.5e6 / 4, "intra": 12.5e6 / 4, "inter": None}
    two = planner.CostModel(planner.Link(100.0), planner.Link(10.0, per_node=True), local_world_size=4)
    assert two.rank_rates(8) == {"flat": 10.0, "intra": 100.0, "inter": 10.0 / 4}


def test_step_report_link_fields():
    split = {"step_s": 2.0, "compute_s": 1.0, "exposed": {"encode_s": 0.25, "comm_s": 0.5, "decode_s": 0.25}}
    buckets = [{"sent_bytes": 300.0, "intra_bytes": 100.0, "inter_bytes": 200.0}, {"sent_bytes": 50.0}]
    r = step_report(3, 1, 4, "int8", {"sent_bytes": 350.0, "encode_s": 0.3, "comm_s": 0.9, "decode_s": 0.2},
                    buckets, split, 0.7, [1.0, 3.0], {"flat": 50.0, "intra": 100.0, "inter": 20.0})
    assert r["bytes"] == {"flat": 50.0, "intra": 100.0, "inter": 200.0}
    assert r["network_share"] == 0.25 and r["achieved_bytes_per_s"] == 350.0 / 0.7
    link = 350.0 / (50.0 / 50.0 + 100.0 / 100.0 + 200.0 / 20.0)
    assert r["link_bytes_per_s"] == link and r["link_utilization"] == (350.0 / 0.7) / link
    assert (r["latency_p50_s"], r["latency_p99_s"], r["latency_calls"]) == (2.0, 1.0 + 2.0 * 0.99, 2)
    no = step_report(3, 1, 4, "int8", {"sent_bytes": 350.0}, buckets, split, 0.0, None, {"flat": 50.0})
    assert no["achieved_bytes_per_s"] is None and no["link_bytes_per_s"] is None  # no intra/inter rate
    assert no["link_utilization"] is None and no["latency_p50_s"] is None and no["latency_calls"] == 0
    json.dumps(r, allow_nan=False)


def test_log_file_arguments(tmp_path):
    from gradcomp.torch import Compressor

    assert check_log_file(None, 0) is None
    assert check_log_file(tmp_path / "a.jsonl", 3) == str(tmp_path / "a.jsonl")
    with pytest.raises(ValueError, match="needs log_every >= 1"):
        Compressor("none", log_file=str(tmp_path / "a.jsonl"))  # raised before any process-group call
    with pytest.raises(TypeError, match="log_file=3; accepted: None or a path"):
        Compressor("none", log_every=1, log_file=3)
    with pytest.raises(ValueError, match="log_file=''"):
        check_log_file("", 1)


def test_cuda_bookkeeping_with_fake_events(monkeypatch):
    """The CUDA path of the probe and of a step's close, on the CPU: CUDA events and NVTX
    replaced by fakes (each event recorded one second after the previous one; the host clock
    set by hand), so the spans, the split and the NVTX ranges are known exactly."""
    import gradcomp.torch.stats as gs

    class FakeEvent:
        now = [0.0]

        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            FakeEvent.now[0] += 1.0
            self.t = FakeEvent.now[0]

        def query(self):
            return True

        def elapsed_time(self, other):
            return 1000.0 * (other.t - self.t)  # milliseconds, as CUDA's

    nvtx = []
    host = [100.0]
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda.nvtx, "range_start", lambda name: nvtx.append(("start", name)) or len(nvtx))
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", lambda i: nvtx.append(("end", i)))
    monkeypatch.setattr(gs.time, "perf_counter", lambda: host[0])
    st = gs.Stats(2, "int8")
    rec = st.record(0)  # the step opens at host time 100
    b = {"index": 4, "numel": 10, "dense_bytes": 40, "packet_bytes": 48, "sent_bytes": 48.0, "ring_bytes": 40.0,
         "scheme": "sum"}
    st.account(rec, b)
    probe = st.probe(rec, b, torch.device("cuda"), "bucket 4")
    for field in ("encode_s", "comm_s"):  # GPU: encode 1 -> 2, collective 3 -> 4, decode 5 -> 6
        probe.tock(field, probe.clock(field))
    token = probe.clock("decode_s")
    probe.tock("decode_s", token)
    host[0] = 110.0
    st.record(1)  # closes step 0: a 10 s step
    r = st.summary()["report"]
    assert [f for f in ("encode_s", "comm_s", "decode_s") if r[f] != 1.0] == []
    # spans placed at the step's start: encode 100-101 (the stream: held up), collective 102-103,
    # decode 104-105; the wait runs from the last encode's end (101) to 105
    assert r["exposed"] == {"encode_s": 1.0, "comm_s": 3.0, "decode_s": 1.0} and r["compute_s"] == 5.0
    assert r["step_s"] == 10.0 and r["network_share"] == 0.3 and r["comm_busy_s"] == 1.0
    assert r["latency_p50_s"] == 5.0  # the call: encode start 100 to decode end 105
    names = [x[1] for x in nvtx if x[0] == "start"]
    assert names == ["gradcomp.encode[bucket=4]", "gradcomp.comm[bucket=4]", "gradcomp.decode[bucket=4]"]
    assert [x[1] for x in nvtx if x[0] == "end"] == [1, 3, 5]  # each range ended, in order


# ---- a real run ----------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


STEPS = 6


def job_logged(rank, world, path):
    """DDP with fp16 under ``sum`` (2 bytes per element on the wire), a loopback cost model of
    100 Mbit/s, a report per step into ``path`` (shared by the ranks); the loop's own readings
    before and after each backward. Returns them, the hook's stats() and the model's numel."""
    import time

    import gradcomp.torch as gt

    m = ddp(_model(), bucket_cap_mb=0.01)
    st = gt.register(m, codec="fp16", scheme="sum", min_compress_numel=0, exempt=(), log_every=1, log_file=path,
                     cost_model=planner.CostModel.loopback("100mbit"))
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
    marks = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(m(x), y)
        t0 = time.perf_counter()
        loss.backward()
        marks.append((t0, time.perf_counter()))
        opt.step()
    return {"marks": marks, "stats": st.stats(), "numel": sum(p.numel() for p in m.parameters()),
            "buckets": len(st.compressor.layouts())}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("log") / "run.jsonl")
    res = run(2, job_logged, path)
    with open(path) as f:
        rows = [json.loads(line) for line in f]  # every line whole (two ranks appended to one file)
    return path, res, rows


def test_rows_of_a_real_run(logged):
    _, res, rows = logged
    for rank, r in enumerate(res):
        mine = sorted((row for row in rows if row["rank"] == rank), key=lambda row: row["step"])
        # a step's row is written when the next one starts: the last step has none
        assert [row["step"] for row in mine] == list(range(STEPS - 1))
        sent = 2.0 * r["numel"]  # fp16 payload of every element; W = 2: 2 (W-1)/W = 1
        marks = r["marks"]
        for row in mine:
            k = row["step"]
            assert row["world_size"] == 2 and row["codec"] == "fp16"
            parts = row["compute_s"] + sum(row["exposed"].values())
            assert math.isclose(parts, row["step_s"], rel_tol=1e-12)
            assert row["network_share"] == row["exposed"]["comm_s"] / row["step_s"]
            # the step runs from the first hook call of backward k to that of backward k + 1
            assert marks[k + 1][0] - marks[k][1] <= row["step_s"] <= marks[k + 1][1] - marks[k][0]
            # DDP's backward returns once every Future completed: all that held the loop up is in it
            assert sum(row["exposed"].values()) <= marks[k][1] - marks[k][0]
            assert row["sent_bytes"] == sent and row["bytes"] == {"flat": sent, "intra": 0.0, "inter": 0.0}
            assert row["traffic"] == [[0.0, sent], [sent, 0.0]]
            assert 0 < row["comm_busy_s"] <= row["step_s"]
            assert row["achieved_bytes_per_s"] == sent / row["comm_busy_s"]
            assert row["link_bytes_per_s"] == 12.5e6 / 2  # the shared loopback, two senders
            assert row["link_utilization"] == row["achieved_bytes_per_s"] / (12.5e6 / 2)
            assert 0 < row["latency_p50_s"] <= row["latency_p99_s"]
        # the window holds every call of the steps so far (DDP's buckets are final from step 1 on)
        calls = [row["latency_calls"] for row in mine]
        assert calls[0] >= 1 and all(b - a == r["buckets"] for a, b in zip(calls[1:], calls[2:]))
        st = r["stats"]
        assert st["report"] == mine[-1]  # the last closed step, as written
        ts = st["time_split"]
        assert ts["steps"] == STEPS - 1
        assert math.isclose(ts["step_s"], sum(row["step_s"] for row in mine), rel_tol=1e-12)
        assert math.isclose(ts["exposed"]["comm_s"], sum(row["exposed"]["comm_s"] for row in mine), rel_tol=1e-12)
        assert ts["network_share"] == ts["exposed"]["comm_s"] / ts["step_s"]


def test_report_cli_on_a_real_log(logged, tmp_path, capsys):
    path, _, rows = logged
    png = tmp_path / "r.png"
    assert report_cli.main([path, "--rank", "1", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    mine = sorted((r for r in rows if r["rank"] == 1), key=lambda r: r["step"])
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in out.splitlines() if ln.startswith("| ")]
    lines = {c[0]: c for c in cells if len(c) == 13 and c[0] != "step"}  # the step table, not the traffic
    for r in mine:
        cells = lines[str(r["step"])]
        assert cells[1] == f"{1e3 * r['step_s']:.2f}" and cells[4] == f"{1e3 * r['exposed']['comm_s']:.2f}"
        assert cells[6] == f"{100 * r['network_share']:.1f}%"
    # the mean line: plain loops over the rows
    total = 0.0
    comm = 0.0
    for r in mine:
        total += r["step_s"]
        comm += r["exposed"]["comm_s"]
    mean = lines["mean"]
    assert mean[1] == f"{1e3 * total / len(mine):.2f}" and mean[6] == f"{100 * comm / total:.1f}%"
    assert "Rank 1 of 2" in out and "| from \\ to | 0 | 1 |" in out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def job_hierarchical(rank, world, path):
    """A Compressor loop under hierarchical with nodes of one rank (L = 1: nothing inside a node,
    top-k through gather across the two nodes), a row every second step into ``{rank}`` files;
    then a pickle round trip."""
    import pickle

    from gradcomp.torch import Compressor

    comp = Compressor("topk:ratio=0.01", scheme="hierarchical", local_world_size=1, inner_scheme="gather",
                      log_every=2, log_file=path)
    t = torch.zeros(5000)
    for step in range(5):
        t.copy_(torch.arange(5000, dtype=torch.float32) * (rank + step + 1))
        comp.allreduce(t, "w").wait()
    back = pickle.loads(pickle.dumps(comp))
    return {"stats": comp.stats(), "log_file": comp.log_file, "back": back.log_file}


def test_hierarchical_levels_and_rank_files(tmp_path):
    import gradcomp

    res = run(2, job_hierarchical, str(tmp_path / "h_{rank}.jsonl"))
    inter = planner.bucket_bytes("gather", gradcomp.Codec("topk:ratio=0.01"), 5000, "float32", 2)["sent_bytes"]
    for rank, r in enumerate(res):
        path = str(tmp_path / f"h_{rank}.jsonl")
        assert r["log_file"] == r["back"] == path
        rows = report_cli.read_rows(path)
        assert [row["step"] for row in rows] == [1, 3]  # every second step; step 4 is still open
        for row in rows:
            assert row["rank"] == rank
            assert row["bytes"] == {"flat": 0.0, "intra": 0.0, "inter": inter}
            assert row["traffic"] == [[0.0, inter], [inter, 0.0]]
        b = r["stats"]["buckets"][0]
        assert b["scheme"] == "hierarchical" and b["inter_bytes"] == inter and b["intra_bytes"] == 0


# ---- gradcomp-report: bad input ------------------------------------------------------------------
ROW = {"step": 0, "rank": 0, "world_size": 2, "codec": "none", "step_s": 0.01, "compute_s": 0.006,
       "exposed": {"encode_s": 0.001, "comm_s": 0.002, "decode_s": 0.001}, "network_share": 0.2,
       "sent_bytes": 100.0, "bytes": {"flat": 100.0, "intra": 0.0, "inter": 0.0}}


def _cli(tmp_path, capsys, *argv):
    rc = report_cli.main([*argv, "--png", str(tmp_path / "x.png")], out=io.StringIO())
    return rc, capsys.readouterr().err


def test_report_cli_bad_input(tmp_path, capsys):
    rc, err = _cli(tmp_path, capsys, str(tmp_path / "nope.jsonl"))
    assert rc == 2 and "nope.jsonl: cannot read the stats log" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROW) + "\n\n{\"step\": 1,\n")
    rc, err = _cli(tmp_path, capsys, str(bad))
    assert rc == 2 and f"{bad}:3: not a JSON line" in err
    bad.write_text(json.dumps(ROW) + "\n[1, 2]\n")
    rc, err = _cli(tmp_path, capsys, str(bad))
    assert rc == 2 and f"{bad}:2: a JSON list, not an object" in err
    bad.write_text(json.dumps({k: v for k, v in ROW.items() if k != "step_s"}) + "\n")
    rc, err = _cli(tmp_path, capsys, str(bad))
    assert rc == 2 and f"{bad}:1: field 'step_s' missing" in err
    bad.write_text(json.dumps(dict(ROW, exposed={"comm_s": 1.0})) + "\n")
    rc, err = _cli(tmp_path, capsys, str(bad))
    assert rc == 2 and "field 'exposed' lacks the number(s) encode_s, decode_s" in err
    bad.write_text("\n")
    rc, err = _cli(tmp_path, capsys, str(bad))
    assert rc == 2 and "no step report in the file" in err
    bad.write_text(json.dumps(ROW) + "\n")
    rc, err = _cli(tmp_path, capsys, str(bad), "--rank", "3")
    assert rc == 2 and "--rank 3: no row of that rank; the file has rank(s) [0]" in err
    assert not os.path.exists(tmp_path / "x.png")  # nothing written on bad input
