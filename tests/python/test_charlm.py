"""The charlm task of ``gradcomp-experiment``: its corpus (deterministic, split by file), the
vocabulary, the planned sweeps, and end to end on a tiny configuration (2 gloo workers, a tiny
LSTM, 20 steps): the table, the CSV/JSON/PNG files, validation bits per character, and the ranks'
final parameters bitwise equal. The PowerSGD row skips while ``gradcomp.torch.powersgd`` cannot
be imported."""

import csv
import json
import math
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the charlm task end to end: the whole suite only (tests/quick.sh leaves them out)

np = pytest.importorskip("numpy")
pytest.importorskip("torch")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from gradcomp.experiments import charlm  # noqa: E402

LOG2_VOCAB = math.log2(97)

# a tiny configuration of charlm.train_run: 20 steps of 4 windows x 32 characters per rank
TINY = dict(steps=20, optimizer="adam", lr=2e-2, momentum=0.9, clip=1.0, batch_size=4, seq_len=32, embed=16,
            hidden=32, bucket_cap_mb=4.0, start_iter=0, val_windows=32, corpus_max_bytes=charlm.CORPUS_MAX_BYTES,
            progress_every=10)
TINY_ARGS = ["--task", "charlm", "--workers", "2", "--charlm-steps", "20", "--charlm-batch-size", "4",
             "--charlm-seq-len", "32", "--charlm-embed", "16", "--charlm-hidden", "32", "--charlm-val-windows", "32"]


def _powersgd():
    try:
        import gradcomp.torch.powersgd  # noqa: F401
    except ImportError:
        return False
    return True


def test_vocabulary():
    # printable ASCII -> byte - 32, newline -> 95, everything else (tab, CR, NUL, UTF-8 bytes) -> 96
    got = charlm.encode_text(b" ~aZ\n\t\r\x00\xc3\xa9")
    assert got.dtype == np.uint8
    assert got.tolist() == [0, 94, ord("a") - 32, ord("Z") - 32, 95, 96, 96, 96, 96, 96]
    t = charlm.byte_table()
    assert t.shape == (256,) and sorted(set(t.tolist())) == list(range(97))


def test_corpus_from_a_directory(tmp_path):
    """The rules on a directory of known files: sorted *.py files directly in it (no subfolders, no
    _sysconfigdata*, no other suffixes), whole files up to the cap, every 10th a validation file,
    each file followed by a newline."""
    for i in range(12):
        (tmp_path / f"m{i:02d}.py").write_bytes(f"x = {i:02d}\n".encode())  # 7 bytes each
    (tmp_path / "_sysconfigdata__linux.py").write_text("build = 'this machine'\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("in a package\n")
    assert charlm.corpus_files(str(tmp_path)) == [f"m{i:02d}.py" for i in range(12)]
    # the cap keeps whole files: 11 files of 7 bytes fit in 80, the 12th would pass it
    assert charlm.corpus_files(str(tmp_path), max_bytes=80) == [f"m{i:02d}.py" for i in range(11)]
    c = charlm.build_corpus(str(tmp_path), max_bytes=80)
    assert c.val_files == ["m09.py"] and c.train_files == [f"m{i:02d}.py" for i in range(11) if i != 9]
    assert c.val.tolist() == charlm.encode_text(b"x = 09\n\n").tolist()
    assert c.train.tolist() == charlm.encode_text(b"".join(f"x = {i:02d}\n\n".encode() for i in range(11)
                                                            if i != 9)).tolist()
    assert c.bytes == 77
    with pytest.raises(ValueError):
        charlm.build_corpus(str(tmp_path), max_bytes=60)  # 8 files: no validation file
    with pytest.raises(ValueError):
        charlm.corpus_files(str(tmp_path), max_bytes=6)  # no file fits


def test_stdlib_corpus_deterministic_and_split_by_file():
    d = charlm.stdlib_dir()
    files = charlm.corpus_files()
    assert files == sorted(files) and all(f.endswith(".py") and not f.startswith("_sysconfigdata") for f in files)
    total = sum(os.path.getsize(os.path.join(d, f)) for f in files)
    assert total <= charlm.CORPUS_MAX_BYTES
    c1 = charlm.build_corpus()
    charlm._corpus_cache.clear()
    c2 = charlm.build_corpus()
    assert c1 is not c2
    assert c1.train_files == c2.train_files and c1.val_files == c2.val_files and c1.sha256 == c2.sha256
    assert np.array_equal(c1.train, c2.train) and np.array_equal(c1.val, c2.val)
    # split by file: disjoint, every 10th file held out, together the whole list in order
    assert not set(c1.train_files) & set(c1.val_files)
    assert c1.val_files == files[charlm.VAL_EVERY - 1::charlm.VAL_EVERY]
    assert sorted(c1.train_files + c1.val_files) == files and c1.bytes == total
    assert c1.train.shape[0] + c1.val.shape[0] == total + len(files)  # one newline per file
    # the first validation file's bytes open the validation text, and its first line is not
    # a line of any training file (no shared file)
    with open(os.path.join(d, c1.val_files[0]), "rb") as f:
        first = f.read()
    assert c1.val[:len(first)].tolist() == charlm.encode_text(first).tolist()
    assert len(c1.val_files) >= 10 and c1.val.shape[0] >= 100_000 and c1.train.shape[0] >= 1_000_000


def test_default_model():
    """The default model: 505,681 parameters, every one in a 2-D weight matrix (what PowerSGD
    compresses) but for the 3,169 bias elements."""
    d = charlm.DEFAULTS
    m = charlm.make_model(d["embed"], d["hidden"], d["layers"])
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert sum(p.numel() for p in m.parameters()) == 505_681
    assert sum(p.numel() for p in m.parameters() if p.dim() == 1) == 3_169
    assert shapes["embed.weight"] == (97, 48) and shapes["head.weight"] == (97, 192)
    assert shapes["lstm.weight_ih_l0"] == (768, 48) and shapes["lstm.weight_hh_l1"] == (768, 192)
    x = charlm.encode_text(b"def f(x):\n    return x\n")
    import torch

    out = m(torch.from_numpy(x).long()[None])
    assert out.shape == (1, len(x), 97) and out.dtype == torch.float32


def test_val_offsets():
    assert charlm.val_offsets(1000, 64, 5) == [0, 233, 467, 701, 935]
    assert charlm.val_offsets(65, 64, 3) == [0, 0, 0]
    with pytest.raises(ValueError):
        charlm.val_offsets(64, 64, 3)


def test_charlm_plan(monkeypatch):
    from gradcomp.experiments import args as cli_args
    from gradcomp.experiments.__main__ import parse_args, plan_charlm_runs

    a = parse_args([])
    c = a.charlm
    assert (c.steps, c.optimizer, c.lr, c.batch_size, c.seq_len, c.embed, c.hidden, c.ef, c.seeds) == (
        150, "adam", 2e-2, 8, 64, 48, 192, "auto", 1)
    runs = [(r["codec"], r["error_feedback"], r["seed"]) for r in plan_charlm_runs(c) if r["optimizer"] == "adam"]
    want = [("none", False, 0), ("fp16", True, 0), ("topk:ratio=0.01", True, 0)]
    psgd = [("powersgd:rank=4", True, 0)]
    if _powersgd():
        assert runs == want + psgd and a.notes == []
    else:
        assert runs == want and "powersgd" in a.notes[0]
    full = [r for r in plan_charlm_runs(parse_args(["--full", "--task", "charlm"]).charlm) if r["optimizer"] == "adam"]
    settings = {(r["codec"], r["error_feedback"]) for r in full}
    assert all(sorted(r["seed"] for r in full if (r["codec"], r["error_feedback"]) == s) == [0, 1]
               for s in settings)
    assert ("none", True) not in settings and ("topk:ratio=0.001", False) in settings
    assert len(full) == (50 if _powersgd() else 34)
    # --task, --ef and bad input
    assert parse_args(["--task", "charlm,digits"]).tasks == ["charlm", "digits"]
    assert parse_args(["--task", "all,charlm"]).tasks == ["digits", "charlm"]
    on = plan_charlm_runs(parse_args(["--task", "charlm", "--codecs", "none;int8", "--ef", "both",
                                      "--charlm-methods", ""]).charlm)
    assert [(r["codec"], r["error_feedback"]) for r in on] == [("none", False), ("int8", False), ("int8", True)]
    for bad in (["--task", "charlm,mnist"], ["--task", ","], ["--charlm-steps", "0"], ["--charlm-lr", "0"],
                ["--codecs", "powersgd"], ["--codecs", "powersgd:rank=0"], ["--codecs", "powersgd:rank=two"],
                ["--codecs", "topk:ratio=2"], ["--charlm-momentum", "1"], ["--seeds", "0"]):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2, bad
    # without the PowerSGD hook: the default lists leave its rows out and say so, an explicit
    # powersgd spec is an argparse error
    monkeypatch.setattr(cli_args, "powersgd_available", lambda: False)  # what parse_args calls
    a = parse_args(["--task", "charlm"])
    assert [r["codec"] for r in plan_charlm_runs(a.charlm) if r["optimizer"] == "adam"] == [
        "none", "fp16", "topk:ratio=0.01"]
    assert a.notes == ["charlm: left out powersgd:rank=4: gradcomp.torch.powersgd cannot be "
                       "imported (the PowerSGD hook is not installed)"]
    assert parse_args(["--task", "digits"]).notes == []  # digits' default list has no powersgd row
    with pytest.raises(SystemExit) as e:
        parse_args(["--codecs", "none;powersgd:rank=2"])
    assert e.value.code == 2


def test_charlm_end_to_end(tmp_path):
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "gradcomp.experiments", *TINY_ARGS, "--codecs", "none;topk:ratio=0.01",
           "--charlm-methods", "", "--out", str(out), "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-4000:]
    names = ("charlm_table.md", "charlm_results.csv", "charlm_results.json", "charlm_bpc_vs_bits.png")
    assert sorted(os.listdir(out)) == sorted(names + ("stats",))  # --task charlm: no digits files
    for name in names:
        assert str(out / name) in p.stdout  # the CLI says where its files are
    # each run's step reports, every 10th of its 20 steps (the 20th is never closed), both ranks
    assert sorted(os.listdir(out / "stats")) == ["charlm_000.jsonl", "charlm_001.jsonl"]
    with open(out / "stats" / "charlm_000.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert sorted((r["rank"], r["step"]) for r in logged) == [(0, 9), (1, 9)]
    assert "| codec | optimizer | scheme | EF | runs | val bits/char (mean ± std) | min–max | vs dense |" in p.stdout
    with open(out / "charlm_results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    # --ef auto (the charlm default): codec none without error feedback, top-k with it; the hook
    # exempts the biases (1-D parameters) by default: averaged dense in the same call ("dense+")
    assert [(r["codec"], r["error_feedback"], r["seed"], r["scheme"]) for r in rows] == [
        ("none", "False", "0", "dense+sum"), ("topk:ratio=0.01", "True", "0", "dense+gather")]
    # tiny model: 97*16 + LSTM(16, 32) + LSTM(32, 32) + 32*97 + 97 parameters
    n = 97 * 16 + (4 * 32 * (16 + 32) + 8 * 32) + (4 * 32 * 64 + 8 * 32) + 32 * 97 + 97
    for r in rows:
        bpc = float(r["val_bpc"])
        # 20 steps take it below the uniform model's log2(97) = 6.6 bits (measured on seeds 0-2:
        # none 4.21-4.38, below the training text's unigram entropy 4.52; top-k 1% with error
        # feedback 5.09-5.46)
        assert math.isfinite(bpc) and 2.0 < bpc < LOG2_VOCAB - 0.5, bpc
        assert int(r["steps"]) == 20 and int(r["params"]) == n and int(r["numel"]) == n
        assert int(r["nonfinite_steps"]) == 0
    by = {r["codec"]: r for r in rows}
    # compression costs something here: top-k 1% trails dense (by 0.7-1.2 bits on seeds 0-2)
    assert float(by["none"]["val_bpc"]) + 0.3 < float(by["topk:ratio=0.01"]["val_bpc"])
    # codec none: packet = 32-byte header + the float32 values per bucket, just above 32 bits
    assert 32.0 < float(by["none"]["bits_per_element"]) < 32.1
    # top-k 1% on the 19,248 weight elements: about 8 bytes (index + value) per kept element, plus
    # headers (0.64 bits per element of the 19,857); the 609 bias elements dense, 32 bits (0.98)
    assert 1.6 <= float(by["topk:ratio=0.01"]["bits_per_element"]) <= 1.7
    with open(out / "charlm_results.json") as f:
        js = json.load(f)
    assert {"config", "corpus", "runs", "summary", "wall_s"} <= set(js)
    assert js["corpus"]["sha256"] == charlm.build_corpus().sha256  # the same corpus in another process
    assert len(js["runs"]) == 2 and len(js["runs"][0]["train_loss"]) == 2  # progress every 10 steps
    assert js["config"]["steps"] == 20 and js["config"]["hidden"] == 32
    assert {s["codec"] for s in js["summary"]} == {"none", "topk:ratio=0.01"}
    with open(out / "charlm_bpc_vs_bits.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pool():
    from gradcomp.experiments.pool import shared

    return shared(2)  # the session's 2-rank pool (one thread per rank, the default; closed by conftest.py)


def _run(pool, **kw):
    res = pool.run(charlm.train_run, dict(TINY, **kw), timeout=300)
    assert len(res) == 2
    return res


def test_ranks_agree_bitwise(pool):
    """Both ranks end with the same parameters (checksum of the float32 bit patterns), the same
    metric and the same accounting; another seed ends elsewhere (the checksum sees the parameters)."""
    a = _run(pool, codec="topk:ratio=0.01", error_feedback=True, seed=0)
    assert a[0]["param_checksum"] == a[1]["param_checksum"]
    assert a[0]["val_bpc"] == a[1]["val_bpc"] and a[0]["train_loss"] == a[1]["train_loss"]
    assert a[0]["packet_ratio"] == a[1]["packet_ratio"]
    b = _run(pool, codec="topk:ratio=0.01", error_feedback=True, seed=1)
    assert b[0]["param_checksum"] == b[1]["param_checksum"] != a[0]["param_checksum"]
    # the same run again: the same bits (data order and initialization come from the seed)
    again = _run(pool, codec="topk:ratio=0.01", error_feedback=True, seed=0)
    assert again[0]["param_checksum"] == a[0]["param_checksum"] and again[0]["val_bpc"] == a[0]["val_bpc"]


@pytest.mark.skipif(not _powersgd(), reason="gradcomp.torch.powersgd (the PowerSGD hook) cannot be imported")
def test_powersgd_row(pool):
    """A powersgd:rank=2 run through the harness's registration: the low-rank scheme, fewer bits
    than dense, finite bits per character below the uniform model's, ranks bitwise equal."""
    r = _run(pool, codec="powersgd:rank=2", error_feedback=True, seed=0)
    assert r[0]["param_checksum"] == r[1]["param_checksum"]
    assert r[0]["scheme"] == "powersgd" and r[0]["steps"] == 20 and r[0]["nonfinite_steps"] == 0
    assert 0.0 < r[0]["bits_per_element"] < 32.0 and 0.0 < r[0]["packet_ratio"] < 1.0
    assert math.isfinite(r[0]["val_bpc"]) and r[0]["val_bpc"] < LOG2_VOCAB - 0.5


def _planner_fsdp2_bytes(codec: str, world: int, embed: int = 16, hidden: int = 32) -> dict:
    """One step's reduce-scatter bytes of the charlm model under --engine fsdp2 from the planner's
    formulas: units embed, lstm, head (the root holds no parameter), each unit's rows
    (gradcomp.planner.fsdp_rows, exempt below 2 dims or 1024 elements) and its call's bytes
    (fsdp_reduce_scatter_bytes, float32)."""
    import gradcomp
    from gradcomp import planner

    m = charlm.make_model(embed, hidden)
    tot = {"numel": 0, "dense_bytes": 0.0, "packet_bytes": 0.0, "sent_bytes": 0.0, "ring_bytes": 0.0}
    for unit in (m.embed, m.lstm, m.head):
        rows, n = planner.fsdp_rows([(p.numel(), tuple(p.shape)) for p in unit.parameters()], world, 1024)
        b = planner.fsdp_reduce_scatter_bytes(gradcomp.Codec(codec), rows, "float32", n)
        tot["numel"] += n
        for k in ("dense_bytes", "packet_bytes", "sent_bytes", "ring_bytes"):
            tot[k] += b[k]
    tot.update(planner.summarize(tot))
    return tot


def test_charlm_fsdp2_end_to_end(tmp_path):
    """--engine fsdp2 on the tiny configuration, 2 ranks: FSDP2 without gradcomp (dense) and
    gradcomp's codec none reach the same bits per character bit for bit (at W = 2 gradcomp's
    all-to-all sums as gloo's reduce-scatter does); int8 with error feedback sends the planner's
    bytes; the files get their fsdp2 names and the table says what wire_ratio is against."""
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "gradcomp.experiments", *TINY_ARGS, "--engine", "fsdp2",
           "--codecs", "dense;none;int8", "--out", str(out), "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-4000:]
    names = ("charlm_fsdp2_table.md", "charlm_fsdp2_results.csv", "charlm_fsdp2_results.json",
             "charlm_fsdp2_bpc_vs_bits.png")
    assert sorted(os.listdir(out)) == sorted(names)
    for name in names:
        assert str(out / name) in p.stdout
    assert "## charlm (--engine fsdp2)" in p.stdout
    assert "| codec | optimizer | scheme | EF | runs | val bits/char (mean ± std) | min–max | vs dense |" in p.stdout
    assert "what it sends in a ring reduce-scatter of the dense input" in p.stdout
    assert "Relative to dense (" in p.stdout and "none +0.00%" in p.stdout
    with open(out / "charlm_fsdp2_results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["codec"], r["error_feedback"], r["seed"], r["scheme"]) for r in rows] == [
        ("dense", "False", "0", "dense"), ("none", "False", "0", "reduce_scatter"),
        ("int8", "True", "0", "reduce_scatter")]
    by = {r["codec"]: r for r in rows}
    n = 97 * 16 + (4 * 32 * (16 + 32) + 8 * 32) + (4 * 32 * 64 + 8 * 32) + 32 * 97 + 97
    for r in rows:
        bpc = float(r["val_bpc"])
        assert math.isfinite(bpc) and 2.0 < bpc < LOG2_VOCAB - 0.5, bpc
        assert int(r["steps"]) == 20 and int(r["params"]) == n and int(r["nonfinite_steps"]) == 0
    # bit for bit (the CSV holds repr(float)): the same training under FSDP2's and gradcomp's
    # reduce-scatter
    assert by["dense"]["val_bpc"] == by["none"]["val_bpc"]
    assert by["dense"]["final_loss"] == by["none"]["final_loss"]
    # int8 measured a little above dense here (4.24 against 4.24-4.25 on seed 0); the ratios are
    # the planner's, per step and so in total
    assert abs(float(by["int8"]["val_bpc"]) - float(by["dense"]["val_bpc"])) < 0.1
    want = _planner_fsdp2_bytes("int8", 2)
    for k in ("packet_ratio", "wire_ratio", "bits_per_element"):
        assert math.isclose(float(by["int8"][k]), want[k], rel_tol=1e-12), (k, by["int8"][k], want[k])
    assert float(by["int8"]["packet_bytes_per_step"]) == want["packet_bytes"]
    assert float(by["int8"]["dense_bytes_per_step"]) == want["dense_bytes"]
    assert int(by["int8"]["numel"]) == want["numel"]
    # W = 2: one slot sent of two, against half the dense input: wire_ratio == packet_ratio
    assert by["int8"]["wire_ratio"] == by["int8"]["packet_ratio"]
    # dense: FSDP2's padded input, 32 bits per element; none: the same plus headers and trailers
    assert float(by["dense"]["packet_ratio"]) == float(by["dense"]["wire_ratio"]) == 1.0
    assert float(by["dense"]["bits_per_element"]) == 32.0 and int(by["dense"]["numel"]) == want["numel"]
    assert 32.0 < float(by["none"]["bits_per_element"]) < 32.5
    with open(out / "charlm_fsdp2_results.json") as f:
        js = json.load(f)
    assert js["config"]["engine"] == "fsdp2" and js["config"]["steps"] == 20
    # the biases travel raw: 4 LSTM biases of 4 x 32 and the head's 97
    assert [r.get("exempt_numel") for r in js["runs"]] == [0, 4 * 128 + 97, 4 * 128 + 97]


def test_fsdp2_ranks_agree_bitwise(pool):
    """A train_run under FSDP2 on the shared pool: both ranks end with the same full parameters
    (all-gathered), metric and accounting; fp8 with error feedback differs from dense."""
    a = _run(pool, codec="fp8", error_feedback=True, seed=0, engine="fsdp2")
    assert a[0]["param_checksum"] == a[1]["param_checksum"]
    assert a[0]["val_bpc"] == a[1]["val_bpc"] and a[0]["packet_ratio"] == a[1]["packet_ratio"]
    assert a[0]["scheme"] == "reduce_scatter" and a[0]["buckets"] == 3  # embed, lstm, head
    want = _planner_fsdp2_bytes("fp8", 2)
    assert math.isclose(a[0]["packet_ratio"], want["packet_ratio"], rel_tol=1e-12)
    d = _run(pool, codec="dense", error_feedback=False, seed=0, engine="fsdp2")
    assert d[0]["param_checksum"] == d[1]["param_checksum"] != a[0]["param_checksum"]
    assert d[0]["scheme"] == "dense" and d[0]["encode_s"] == 0.0


def test_charlm_methods_plan():
    """--charlm-methods: the default method rows, their configurations (lr, freeze_step, DGC's
    warm-up, error feedback), the flags' parsing and every bad input an argparse error."""
    from gradcomp.experiments.__main__ import parse_args, plan_charlm_runs

    c = parse_args(["--task", "charlm"]).charlm
    assert c.method_list == [("sgd", "none"), ("dgc", "topk:ratio=0.01"), ("dgc", "topk:ratio=0.001"),
                             ("compressed_adam", "topk:ratio=0.01"), ("compressed_adam", "topk:ratio=0.001")]
    assert (c.sgd_lr, c.adam_lr, c.freeze_step, c.dgc_warmup, c.curve_every) == (4.0, 2e-2, 30, [], 0)
    runs = plan_charlm_runs(c)
    methods = [r for r in runs if r["optimizer"] != "adam"]
    assert [(r["optimizer"], r["codec"], r["error_feedback"], r["lr"], r["seed"]) for r in methods] == [
        ("sgd", "none", False, 4.0, 0), ("dgc", "topk:ratio=0.01", True, 4.0, 0),
        ("dgc", "topk:ratio=0.001", True, 4.0, 0), ("compressed_adam", "topk:ratio=0.01", True, 2e-2, 0),
        ("compressed_adam", "topk:ratio=0.001", True, 2e-2, 0)]
    assert all(r["freeze_step"] == 30 for r in methods if r["optimizer"] == "compressed_adam")
    assert all(r["dgc_warmup"] == [] for r in methods if r["optimizer"] == "dgc")
    # the codec sweep is unchanged: the task's optimizer (Adam) first
    assert [r["optimizer"] for r in runs[:len(runs) - 5]] == ["adam"] * (len(runs) - 5)
    c = parse_args(["--task", "charlm", "--charlm-steps", "600", "--seeds", "2", "--codecs", "",
                    "--charlm-methods", "dgc@topk:ratio=0.01;compressed_adam@onebit", "--charlm-dgc-warmup",
                    "0:0.25, 5:0.0625", "--charlm-freeze-fraction", "0.05", "--charlm-sgd-lr", "2"]).charlm
    runs = plan_charlm_runs(c)
    assert [(r["optimizer"], r["codec"], r["seed"]) for r in runs] == [
        ("dgc", "topk:ratio=0.01", 0), ("dgc", "topk:ratio=0.01", 1), ("compressed_adam", "onebit", 0),
        ("compressed_adam", "onebit", 1)]
    assert runs[0]["dgc_warmup"] == [(0, 0.25), (5, 0.0625)] and runs[0]["lr"] == 2.0
    assert runs[2]["freeze_step"] == 30 and runs[2]["steps"] == 600
    assert parse_args(["--task", "charlm", "--charlm-methods", ""]).charlm.method_list == []
    # --engine fsdp2: no method rows by default, with a note; an explicit one is refused
    a = parse_args(["--task", "charlm", "--engine", "fsdp2"])
    assert a.charlm.method_list == [] and any("method rows" in n for n in a.notes)
    for bad in (["--charlm-methods", "dgc"], ["--charlm-methods", "adam@none"], ["--charlm-methods", "sgd@int8"],
                ["--charlm-methods", "dgc@int8"], ["--charlm-methods", "dgc@topk:ratio=2"],
                ["--charlm-methods", "dgc@topk:k=5"], ["--charlm-methods", "compressed_adam@bogus"],
                ["--charlm-methods", "compressed_adam@"], ["--engine", "fsdp2", "--charlm-methods", "sgd@none"],
                ["--charlm-dgc-warmup", "0.25"], ["--charlm-dgc-warmup", "a:b"], ["--charlm-freeze-fraction", "0"],
                ["--charlm-freeze-fraction", "1"], ["--charlm-sgd-lr", "0"], ["--charlm-adam-lr", "-1"],
                ["--codecs", "", "--charlm-methods", ""]):
        with pytest.raises(SystemExit) as e:
            parse_args(["--task", "charlm", *bad])
        assert e.value.code == 2, bad


def test_method_rows_train(pool):
    """DGC and CompressedAdam rows through charlm.train_run: ranks bitwise equal; the bits per
    element over the whole run (warm-up included) against the bytes counted from the formulas:
    DGC's top-k packets and its dense 1-D parameters, CompressedAdam's dense warm-up steps."""
    from gradcomp.experiments.charlm import make_model

    m = make_model(16, 32)
    n = sum(p.numel() for p in m.parameters())
    n1 = sum(p.numel() for p in m.parameters() if p.dim() < 2)  # biases: DGC sends them dense
    d = _run(pool, optimizer="dgc", codec="topk:ratio=0.01", lr=4.0, error_feedback=True, seed=0, dgc_warmup=[])
    assert d[0]["param_checksum"] == d[1]["param_checksum"] and d[0]["scheme"] == "dgc"
    assert math.isfinite(d[0]["val_bpc"]) and d[0]["val_bpc"] < LOG2_VOCAB
    assert d[0]["numel"] == n and d[0]["dense_bytes_per_step"] == 4 * n and d[0]["steps"] == 20
    # per step: the dense biases (32 bits each) plus, per 2-D parameter, at least k = ceil(0.01 numel)
    # (index, value) pairs of 8 bytes; headers add a little
    k = sum(math.ceil(0.01 * p.numel()) for p in m.parameters() if p.dim() >= 2)
    floor_bits = (32.0 * n1 + 64.0 * k) / n
    assert floor_bits <= d[0]["bits_per_element"] <= floor_bits + 0.2, (d[0]["bits_per_element"], floor_bits)
    c = _run(pool, optimizer="compressed_adam", codec="topk:ratio=0.01", error_feedback=True, seed=0,
             freeze_step=5)
    assert c[0]["param_checksum"] == c[1]["param_checksum"] and c[0]["scheme"] == "compressed_adam"
    assert math.isfinite(c[0]["val_bpc"]) and c[0]["val_bpc"] < LOG2_VOCAB
    warm = 32.0 * 5 / 20  # 5 of 20 steps average float32 gradients: 8 bits per element of the whole run
    assert warm + 0.3 <= c[0]["bits_per_element"] <= warm + 0.75 * (floor_bits + 0.2), c[0]["bits_per_element"]
    with pytest.raises(ValueError, match="topk:ratio=D"):  # refused before the optimizer touches the model
        charlm.method_optimizer(dict(TINY, optimizer="dgc", codec="int8"), None, 2)


def test_curve_is_the_same_run(pool):
    """curve_every: the validation curve's last point is the run's val_bpc exactly, its clock
    increases, and the run is bitwise the one without a curve (evaluating changes nothing)."""
    a = _run(pool, codec="topk:ratio=0.01", error_feedback=True, seed=0)
    b = _run(pool, codec="topk:ratio=0.01", error_feedback=True, seed=0, curve_every=10)
    assert b[0]["param_checksum"] == a[0]["param_checksum"] and b[0]["val_bpc"] == a[0]["val_bpc"]
    assert [p["step"] for p in b[0]["curve"]] == [10, 20] and b[0]["curve"][-1]["val_bpc"] == a[0]["val_bpc"]
    assert 0 < b[0]["curve"][0]["wall_s"] < b[0]["curve"][1]["wall_s"] <= b[0]["train_s"] * 1.5 + 1.0
    assert "curve" not in a[0]
    with pytest.raises(ValueError, match="curve_every"):  # refused first, before any collective
        charlm.train_run(0, 2, dict(TINY, codec="none", error_feedback=False, seed=0, curve_every=5, engine="fsdp2"))


def test_charlm_table_vs_dense_and_link_target():
    """The charlm table's "vs dense" column and --link's time to 1.02 x dense, on hand-made runs:
    each row against the dense run of its own optimizer (Adam for CompressedAdam, SGD for DGC)."""
    import argparse

    from gradcomp.experiments import report

    def row(codec, opt, ef, bpc, curve):
        return dict(codec=codec, optimizer=opt, error_feedback=ef, seed=0, val_bpc=bpc, final_loss=bpc,
                    packet_ratio=1.0, wire_ratio=1.0, bits_per_element=32.0, encode_s=0.0, decode_s=0.0,
                    comm_s=0.0, train_s=1.0, wall_s=2.0, scheme="x", curve=curve)

    rows = [row("none", "adam", False, 2.5, [{"step": 10, "wall_s": 1.0, "val_bpc": 3.0},
                                              {"step": 20, "wall_s": 2.0, "val_bpc": 2.5}]),
            row("topk:ratio=0.01", "compressed_adam", True, 2.55,
                [{"step": 10, "wall_s": 0.5, "val_bpc": 2.6}, {"step": 20, "wall_s": 1.0, "val_bpc": 2.55}]),
            row("none", "sgd", False, 3.0, [{"step": 10, "wall_s": 1.5, "val_bpc": 3.05},
                                             {"step": 20, "wall_s": 3.0, "val_bpc": 3.0}]),
            row("topk:ratio=0.01", "dgc", True, 3.3, [{"step": 10, "wall_s": 0.7, "val_bpc": 3.4},
                                                       {"step": 20, "wall_s": 1.4, "val_bpc": 3.3}])]
    summary = report.summarize(rows, metric="val_bpc", prefix="bpc")
    link = report.charlm_link_target(rows, summary, "a link")
    assert link["dense"] == {"adam": 2.5, "sgd": 3.0}
    assert link["targets"] == pytest.approx({"adam": 2.55, "sgd": 3.06})
    got = {(s["codec"], s["optimizer"]): (s["time_to_target_s"], s["steps_to_target"], s["reached"]) for s in summary}
    assert got == {("none", "adam"): (2.0, 20, 1), ("topk:ratio=0.01", "compressed_adam"): (1.0, 20, 1),
                   ("none", "sgd"): (1.5, 10, 1), ("topk:ratio=0.01", "dgc"): (None, None, 0)}
    a = argparse.Namespace(optimizer="adam", workers=4, embed=16, hidden=32, steps=20, batch_size=4, seq_len=32,
                           lr=0.02, clip=1.0, val_windows=32, engine="ddp", momentum=0.9, sgd_lr=4.0, adam_lr=0.02,
                           freeze_step=2, dgc_warmup=[], curve_every=10,
                           method_list=[("sgd", "none"), ("dgc", "topk:ratio=0.01"),
                                        ("compressed_adam", "topk:ratio=0.01")])
    corpus = dict(train_files=1, val_files=1, stdlib="x", bytes=10, sha256="0" * 64, train_chars=5, val_chars=5,
                  vocab_size=97)
    table = report.format_charlm_table(summary, a, corpus, 100, [], link=link).splitlines()
    body = {ln.split(" | ")[0][2:] + "/" + ln.split(" | ")[1]: ln.split(" | ") for ln in table if ln.startswith("| ")}
    assert body["none/Adam"][7] == "+0.00%" and body["topk:ratio=0.01/CompressedAdam"][7] == "+2.00%"
    assert body["none/SGD"][7] == "+0.00%" and body["topk:ratio=0.01/DGC (SGD)"][7] == "+10.00%"
    assert body["none/Adam"][8] == "-"  # net share: the hand-made runs have none
    assert body["topk:ratio=0.01/DGC (SGD)"][17:21] == ["3.0600", "-", "-", "0/1"]
    assert body["topk:ratio=0.01/CompressedAdam"][17:21] == ["2.5500", "1.00", "20", "1/1"]
    assert any(ln.startswith("Method rows (--charlm-methods): SGD = ") for ln in table)
    assert any("Target = 1.02 x" in ln for ln in table)


def test_charlm_methods_end_to_end(tmp_path):
    """The CLI with method rows: the CSV's optimizer column, the table's optimizer labels."""
    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "gradcomp.experiments", *TINY_ARGS, "--codecs", "none", "--charlm-methods",
           "sgd@none;dgc@topk:ratio=0.01;compressed_adam@int8", "--charlm-freeze-fraction", "0.25",
           "--out", str(out), "--no-progress"]  # 5 dense steps of 20 (with 2, the frozen variance is too young)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-4000:]
    with open(out / "charlm_results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["optimizer"], r["codec"], r["error_feedback"]) for r in rows] == [
        ("adam", "none", "False"), ("sgd", "none", "False"), ("dgc", "topk:ratio=0.01", "True"),
        ("compressed_adam", "int8", "True")]
    assert "| none | SGD |" in p.stdout and "| topk:ratio=0.01 | DGC (SGD) |" in p.stdout
    assert "| int8 | CompressedAdam |" in p.stdout
    for r in rows:
        assert math.isfinite(float(r["val_bpc"])) and float(r["val_bpc"]) < LOG2_VOCAB
