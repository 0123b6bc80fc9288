"""End to end: ``python -m gradcomp.experiments --task digits`` on a tiny setting (2 gloo workers,
1 seed, 2 epochs, 3 codecs with error feedback on: one per scheme auto picks), checking the files
it writes; and the default and ``--full`` digits sweeps as planned (the charlm task:
test_charlm.py). No numeric tolerance is
involved except the ratio checks below (stated inline)."""

import csv
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the main job end to end: the whole suite only (tests/quick.sh leaves them out)

pytest.importorskip("torch")
pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")


def test_experiment_end_to_end(tmp_path):
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "gradcomp.experiments", "--task", "digits", "--workers", "2", "--seeds", "1",
           "--epochs", "2", "--codecs", "none;topk:ratio=0.01;int8", "--ef", "on", "--out", str(out),
           "--no-progress", "--optimizer-seeds", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-4000:]
    for name in ("table.md", "results.csv", "results.json", "accuracy_vs_bits.png"):
        assert (out / name).is_file(), name
        assert str(out / name) in p.stdout  # the CLI says where its files are
    assert "| codec | scheme | EF |" in p.stdout

    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5
    opt_rows = {r["codec"]: r for r in rows[3:]}
    rows = rows[:3]
    for col in ("codec", "scheme", "error_feedback", "seed", "test_accuracy", "packet_ratio", "wire_ratio",
                "bits_per_element"):
        assert col in rows[0], col
    by = {r["codec"]: r for r in rows}
    assert set(by) == {"none", "topk:ratio=0.01", "int8"}
    # auto: sum for none, gather for top-k, two_phase for a quantizer, on the weights; the hook
    # exempts the biases (1-D parameters) by default: averaged dense in the same call ("dense+")
    assert [by[c]["scheme"] for c in ("none", "topk:ratio=0.01", "int8")] == ["dense+sum", "dense+gather",
                                                                              "dense+two_phase"]
    for r in rows:
        assert r["error_feedback"] == "True" and r["seed"] == "0"
        assert 0.0 <= float(r["test_accuracy"]) <= 100.0
    # codec none: packet = 32-byte header + numel float32 (padded to 16 bytes) per bucket, so just above 1
    assert 1.0 < float(by["none"]["packet_ratio"]) < 1.001
    assert abs(float(by["none"]["bits_per_element"]) - 32 * float(by["none"]["packet_ratio"])) < 1e-9
    # top-k 0.01 on the 84,480 weight elements: about 8 bytes per kept element over 4 bytes per
    # element, plus headers (0.0199 of the 85,002 elements); the 522 bias elements dense (0.0061)
    assert 0.026 <= float(by["topk:ratio=0.01"]["packet_ratio"]) <= 0.027
    # W = 2: one rank sends (W-1) packets vs 2(W-1)/W dense: wire_ratio == packet_ratio
    assert math.isclose(float(by["topk:ratio=0.01"]["wire_ratio"]),
                        float(by["topk:ratio=0.01"]["packet_ratio"]), rel_tol=1e-12)

    # the optimizer rows, counted by hand: W = 2, 698 samples per rank, batch 48: 14 steps per
    # epoch, 28 in all; 1-bit Adam's warm-up round(0.15 * 28) = 4 steps are dense (DDP's hook
    # averages), the other 24 send one onebit exchange per parameter, padded to a multiple of 16
    from gradcomp import Codec

    sizes = [256 * 64, 256, 256 * 256, 256, 10 * 256, 10]
    dense = 4 * sum(sizes)
    adam, onebit = opt_rows["Adam"], opt_rows["1-bit Adam"]
    assert adam["optimizer"] == "adam" and adam["scheme"] == "dense" and adam["error_feedback"] == "False"
    assert float(adam["packet_ratio"]) == 1.0 and float(adam["wire_ratio"]) == 1.0
    assert float(adam["bits_per_element"]) == 32.0
    assert onebit["optimizer"] == "onebit_adam" and onebit["error_feedback"] == "True"
    c = Codec("onebit")
    pad = [n + (-n) % 16 for n in sizes]
    packet = 4 * dense + 24 * sum(c.packet_bytes(n) for n in pad)
    sent = 4 * dense + 24 * sum((n // 2) // 8 + 4 + c.packet_bytes(n // 2) for n in pad)  # (W-1) = 1
    assert math.isclose(float(onebit["packet_ratio"]), packet / (28 * dense), rel_tol=1e-12)
    assert math.isclose(float(onebit["wire_ratio"]), sent / (28 * dense), rel_tol=1e-12)
    assert 0.0 <= float(onebit["test_accuracy"]) <= 100.0

    with open(out / "results.json") as f:
        js = json.load(f)
    assert {"config", "runs", "summary", "wall_s"} <= set(js)
    assert len(js["runs"]) == 5 and len(js["runs"][0]["train_loss"]) == 2
    assert {s["codec"] for s in js["summary"]} == {"none", "topk:ratio=0.01", "int8", "Adam", "1-bit Adam"}

    with open(out / "accuracy_vs_bits.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # --task digits: no charlm files
    assert not any(name.startswith("charlm_") for name in os.listdir(out))

    # the network share beside the accuracy: the three runs with the hook have one, the
    # optimizer rows (no gradcomp hook) none; each hook run's step reports under stats/, every
    # 10th of its 28 steps from both ranks
    assert "| test acc % (mean ± std) | min–max | net share |" in p.stdout
    assert all(0.0 < float(r["network_share"]) < 1.0 for r in rows)
    assert opt_rows["Adam"]["network_share"] == "" and opt_rows["1-bit Adam"]["network_share"] == ""
    assert sorted(os.listdir(out / "stats")) == ["digits_000.jsonl", "digits_001.jsonl", "digits_002.jsonl"]
    assert [r.get("stats_log") for r in js["runs"]] == [str(out / "stats" / f"digits_00{i}.jsonl")
                                                        for i in range(3)] + [None, None]
    for i in range(3):
        with open(out / "stats" / f"digits_00{i}.jsonl") as f:
            logged = [json.loads(line) for line in f]
        assert sorted((r["rank"], r["step"]) for r in logged) == [(0, 9), (0, 19), (1, 9), (1, 19)]
        for r in logged:
            assert math.isclose(r["compute_s"] + sum(r["exposed"].values()), r["step_s"], rel_tol=1e-12)
    rep = subprocess.run([sys.executable, "-m", "gradcomp.report_cli", str(out / "stats" / "digits_002.jsonl"),
                          "--png", str(tmp_path / "r.png")], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ))
    assert rep.returncode == 0, rep.stderr
    assert "| 19 |" in rep.stdout and "Rank 0 of 2, 2 logged steps (codec int8)" in rep.stdout


def test_experiment_fsdp2_end_to_end(tmp_path):
    """--task digits --engine fsdp2 on a tiny setting: the MLP sharded by FSDP2 (its three Linear
    layers one unit each), the dense row (FSDP2's own reduce-scatter) and gradcomp's codec none
    bit for bit equal at W = 2, fp8 with error feedback at the planner's bytes, no optimizer rows
    (DDP only: the table's note says so), the files under their fsdp2 names."""
    import gradcomp
    from gradcomp import planner

    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "gradcomp.experiments", "--task", "digits", "--engine", "fsdp2", "--workers", "2",
           "--seeds", "1", "--epochs", "2", "--codecs", "dense;none;fp8", "--ef", "on", "--out", str(out),
           "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-4000:]
    assert sorted(os.listdir(out)) == sorted(["fsdp2_table.md", "fsdp2_results.csv", "fsdp2_results.json",
                                              "fsdp2_accuracy_vs_bits.png"])
    assert "## digits (--engine fsdp2)" in p.stdout and "left out the optimizer rows" in p.stdout
    with open(out / "fsdp2_results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["codec"], r["optimizer"], r["error_feedback"], r["scheme"]) for r in rows] == [
        ("dense", "sgd", "False", "dense"), ("none", "sgd", "True", "reduce_scatter"),
        ("fp8", "sgd", "True", "reduce_scatter")]
    by = {r["codec"]: r for r in rows}
    assert by["dense"]["test_accuracy"] == by["none"]["test_accuracy"]
    assert by["dense"]["final_loss"] == by["none"]["final_loss"]  # repr(float): bit for bit
    # 28 steps; per step one reduce-scatter per Linear layer, biases raw (1-D)
    shapes = [[(256, 64), (256,)], [(256, 256), (256,)], [(10, 256), (10,)]]
    tot = {"numel": 0, "dense_bytes": 0.0, "packet_bytes": 0.0, "sent_bytes": 0.0, "ring_bytes": 0.0}
    for unit in shapes:
        rws, n = planner.fsdp_rows([(math.prod(s), s) for s in unit], 2, 1024)
        b = planner.fsdp_reduce_scatter_bytes(gradcomp.Codec("fp8"), rws, "float32", n)
        tot["numel"] += n
        for k in ("dense_bytes", "packet_bytes", "sent_bytes", "ring_bytes"):
            tot[k] += b[k]
    tot.update(planner.summarize(tot))
    fp8 = by["fp8"]
    assert int(fp8["steps"]) == 28 and int(fp8["numel"]) == tot["numel"]
    for k in ("packet_ratio", "wire_ratio", "bits_per_element"):
        assert math.isclose(float(fp8[k]), tot[k], rel_tol=1e-12), k
    assert float(by["dense"]["bits_per_element"]) == 32.0 and float(by["dense"]["wire_ratio"]) == 1.0
    assert all(0.0 <= float(r["test_accuracy"]) <= 100.0 for r in rows)


def test_default_sweep_plan():
    """The digits sweep as the README's "The main job" documents it (no process is started): by
    default 9 codecs, 24 SGD runs, codec none without error feedback only (under --ef both), 2
    seeds for none, top-k and onebit, 1 for the casts and the block quantizers, then Adam and 1-bit
    Adam with 1 seed each (26 runs); with --full top-k at 0.1, random-k 1%, the fp8 variants e5m2
    and e8m0, QSGD s=16 (dense and Elias-coded), TernGrad and onebit@majority (signSGD's majority
    vote) too, 3 seeds and 2 per optimizer row (75 runs). auto picks two_phase for onebit."""
    import torch

    from gradcomp import planner
    from gradcomp.codec import Codec
    from gradcomp.experiments.__main__ import parse_args, plan_runs

    codecs = ["none", "fp16", "bf16", "topk:ratio=0.01", "topk:ratio=0.001", "fp8", "int8", "int4", "onebit"]
    full = (codecs[:3] + ["topk:ratio=0.1"] + codecs[3:5] + ["randomk:ratio=0.01"] + codecs[5:6]
            + ["fp8:format=e5m2", "fp8:scale=e8m0"] + codecs[6:8]
            + ["qsgd:levels=16", "qsgd:levels=16,coding=elias", "terngrad"] + codecs[8:] + ["onebit@majority"])
    for argv, cl, n_seeds, n_opt_seeds, n_sgd in (([], codecs, 2, 1, 24), (["--full"], full, 3, 2, 71)):
        a = parse_args(argv)
        assert a.tasks == ["digits", "charlm"]
        d = a.digits
        assert d.codec_list == cl and d.ef == "both" and d.epochs == 30
        runs = plan_runs(d)
        assert len(runs) == n_sgd + 2 * n_opt_seeds
        # the optimizer rows come last: torch's Adam and gradcomp's 1-bit Adam
        assert [(r["codec"], r["optimizer"], r["error_feedback"], r["seed"]) for r in runs[n_sgd:]] == (
            [("Adam", "adam", False, s) for s in range(n_opt_seeds)]
            + [("1-bit Adam", "onebit_adam", True, s) for s in range(n_opt_seeds)])
        assert all(r["optimizer"] == "sgd" for r in runs[:n_sgd])
        onebit_adam = runs[n_sgd + n_opt_seeds]
        assert onebit_adam["freeze_fraction"] == 0.15 and onebit_adam["adam_lr"] == 1e-3
        assert onebit_adam["adam_eps"] == 1e-4
        assert len(plan_runs(parse_args(argv + ["--optimizers", ""]).digits)) == n_sgd
        seeds = {}
        for r in runs:
            seeds.setdefault((r["codec"], r["error_feedback"]), []).append(r["seed"])
        assert seeds[("none", False)] == list(range(n_seeds)) and ("none", True) not in seeds
        for c in [c for c in ("topk:ratio=0.1", "topk:ratio=0.01", "topk:ratio=0.001", "randomk:ratio=0.01",
                              "qsgd:levels=16", "qsgd:levels=16,coding=elias", "terngrad", "onebit",
                              "onebit@majority") if c in cl]:
            assert seeds[(c, False)] == seeds[(c, True)] == list(range(n_seeds))
        for c in cl:
            if c.partition(":")[0] in ("fp16", "bf16", "fp8", "int8", "int4"):
                assert seeds[(c, False)] == seeds[(c, True)] == [0]
    with pytest.raises(SystemExit):
        parse_args(["--optimizers", "lamb"])
    # an explicit --ef on still runs codec none with error feedback; --seeds overrides the default
    only_none = plan_runs(parse_args(["--codecs", "none", "--ef", "on", "--optimizers", "", "--seeds", "3"]).digits)
    assert [r["error_feedback"] for r in only_none] == [True] * 3
    # onebit takes two_phase under auto for buckets of the harness's sizes (W = 4)
    for n in (2570, 82432):
        assert planner.choose_scheme(Codec("onebit"), n, torch.float32, 4, min_compress_numel=0) == "two_phase"
