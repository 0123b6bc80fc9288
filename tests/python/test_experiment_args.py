"""gradcomp.experiments without processes: the command's modules (args, sweep, report, with
__main__ re-exporting their names), the codec lists of the sweep against the codec registry
(``gradcomp.codecs()``), and the one plot function of both tasks on made-up summaries. The runs
themselves: test_experiment.py (digits) and test_charlm.py."""

import pytest

import gradcomp
from gradcomp import Codec
from gradcomp.experiments import __main__ as cli
from gradcomp.experiments import args, report, sweep


def _registered():
    return {c["name"] for c in gradcomp.codecs()}


def test_seed_families_are_registered_codecs():
    """The families that run over --quant-seeds are codec names of the registry (the casts and
    the block quantizers), and seeds_for gives every other family --seeds."""
    names = _registered()
    assert set(args.QUANT_SEED_FAMILIES) <= names, set(args.QUANT_SEED_FAMILIES) - names
    t = args.parse_args(["--seeds", "3", "--quant-seeds", "2"]).digits
    for name in names:
        want = 2 if name in args.QUANT_SEED_FAMILIES else 3
        assert sweep.seeds_for(name, t) == want, name
    assert sweep.seeds_for("powersgd:rank=2", t) == 3


@pytest.mark.parametrize("lst", ["DEFAULT_CODECS", "DIGITS_FULL_CODECS", "CHARLM_CODECS", "CHARLM_FULL_CODECS"])
def test_default_codec_lists_are_registered_specs(lst):
    """Every spec of the default sweeps builds a registered codec of its family (or is the
    low-rank hook's ``powersgd:rank=R``), once per list; a ``SPEC@SCHEME`` entry names a scheme of
    the table."""
    from gradcomp.schemes import SCHEMES

    names = _registered()
    specs = getattr(args, lst)
    assert len(set(specs)) == len(specs)
    for spec in specs:
        fam = args.family(spec)
        if fam == "powersgd":
            args.check_powersgd_spec(spec)
            continue
        assert fam in names, spec
        only, scheme = args.split_scheme(spec)
        assert scheme == "auto" or scheme in SCHEMES, spec
        assert Codec(only).spec.partition(":")[0] == fam


def test_main_reexports_the_modules_names():
    for mod, names in ((args, ("parse_args", "parse_tasks", "powersgd_available", "check_powersgd_spec", "TASKS",
                               "DEFAULT_CODECS", "SWEEP_DEFAULTS", "OPTIMIZERS", "QUANT_SEED_FAMILIES")),
                       (sweep, ("plan_runs", "plan_charlm_runs", "seeds_for", "efs_for", "run_sweep")),
                       (report, ("summarize", "format_table", "format_charlm_table", "link_target", "plot",
                                 "CSV_COLUMNS", "CHARLM_CSV_COLUMNS", "OUTPUT_FILES", "TARGET_FRACTION"))):
        for n in names:
            assert getattr(cli, n) is getattr(mod, n), n


def _group(codec, ef, prefix, mean, bits):
    return {"codec": codec, "error_feedback": ef, "bits_per_element": bits, f"{prefix}_mean": mean,
            f"{prefix}_min": mean - 0.5, f"{prefix}_max": mean + 0.5}


def test_one_plot_for_both_tasks(tmp_path):
    pytest.importorskip("matplotlib")
    digits = [_group("none", False, "acc", 97.0, 32.0), _group("fp16", False, "acc", 97.0, 16.0),
              _group("bf16", False, "acc", 96.5, 16.0), _group("topk:ratio=0.01", True, "acc", 95.0, 0.64),
              _group("Adam", False, "acc", 96.0, 32.0), _group("1-bit Adam", True, "acc", 95.5, 1.5)]
    charlm = [_group("none", False, "bpc", 2.4, 32.0), _group("powersgd:rank=2", True, "bpc", 2.6, 0.3),
              dict(_group("none", False, "bpc", 2.8, 32.0), optimizer="sgd"),  # method rows
              dict(_group("topk:ratio=0.01", True, "bpc", 2.9, 0.84), optimizer="dgc")]
    for task, summary in (("digits", digits), ("charlm", charlm)):
        path = tmp_path / f"{task}.png"
        report.plot(summary, str(path), 4, task)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(report.PLOTS) == set(args.TASKS) == set(report.OUTPUT_FILES)
    with pytest.raises(KeyError):
        report.plot(charlm, str(tmp_path / "x.png"), 4, "mnist")


# ---- --engine fsdp2 (the sweep's lists and refusals; the runs: test_charlm.py, test_experiment.py) ----

def _parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        args.parse_args(argv)
    assert e.value.code == 2, argv
    return capsys.readouterr().err


def test_engine_default_is_ddp_and_unchanged():
    """Without --engine nothing changes: the DDP lists, the optimizer rows, the file names."""
    a = args.parse_args([])
    assert a.engine == "ddp" and a.digits.engine == a.charlm.engine == "ddp"
    assert a.digits.codec_list == args.DEFAULT_CODECS and a.digits.optimizer_list == ["adam", "onebit_adam"]
    psgd = args.powersgd_available()
    assert a.charlm.codec_list == [c for c in args.CHARLM_CODECS if psgd or args.family(c) != "powersgd"]
    assert all(r["engine"] == "ddp" for r in sweep.plan_charlm_runs(a.charlm) + sweep.plan_runs(a.digits))
    assert report.output_files("charlm") == report.OUTPUT_FILES["charlm"]
    assert report.output_files("digits", "ddp")["table"] == "table.md"


def test_fsdp2_charlm_sweep():
    """--engine fsdp2 --task charlm: dense (FSDP2's own reduce-scatter) first, the DDP list without
    PowerSGD (said in a note), fp8 and int8; error feedback on but for dense and none; every other
    setting the DDP sweep's."""
    a = args.parse_args(["--task", "charlm", "--engine", "fsdp2"])
    assert a.engine == a.charlm.engine == "fsdp2"
    assert a.charlm.codec_list == ["dense", "none", "fp16", "topk:ratio=0.01", "fp8", "int8"]
    assert a.notes[0] == ("charlm: left out powersgd:rank=4 of the --engine ddp sweep: PowerSGD "
                          "is a DDP communication hook with no FSDP2 path")
    assert a.notes[1].startswith("charlm: left out the method rows (sgd@none, dgc@topk:ratio=0.01")
    assert len(a.notes) == 2 and a.charlm.method_list == []
    runs = sweep.plan_charlm_runs(a.charlm)
    assert [(r["codec"], r["error_feedback"], r["seed"]) for r in runs] == [
        ("dense", False, 0), ("none", False, 0), ("fp16", True, 0), ("topk:ratio=0.01", True, 0), ("fp8", True, 0),
        ("int8", True, 0)]
    ddp = sweep.plan_charlm_runs(args.parse_args(["--task", "charlm"]).charlm)[0]
    for r in runs:  # the same data, seeds, steps and hyperparameters as the DDP runs
        assert r["engine"] == "fsdp2"
        assert {k: v for k, v in r.items() if k not in ("codec", "error_feedback", "engine")} == \
            {k: v for k, v in ddp.items() if k not in ("codec", "error_feedback", "engine")}
    full = args.parse_args(["--task", "charlm", "--engine", "fsdp2", "--full"])
    assert "dense" in full.charlm.codec_list and "fp8" in full.charlm.codec_list
    assert not any(args.family(c) == "powersgd" for c in full.charlm.codec_list)
    assert "powersgd:rank=1, powersgd:rank=2, powersgd:rank=4, powersgd:rank=8" in full.notes[0]
    settings = {(r["codec"], r["error_feedback"]) for r in sweep.plan_charlm_runs(full.charlm)}
    assert ("dense", True) not in settings and ("int8", False) in settings and ("int8", True) in settings
    # an explicit list: as given, no note
    b = args.parse_args(["--task", "charlm", "--engine", "fsdp2", "--codecs", "dense;int8", "--ef", "on"])
    assert [(r["codec"], r["error_feedback"]) for r in sweep.plan_charlm_runs(b.charlm)] == [
        ("dense", False), ("int8", True)] and b.notes == []


def test_fsdp2_digits_sweep():
    """--engine fsdp2 --task digits: dense and the DDP codec list; the optimizer rows (DDP only)
    left out with a note, or none asked for with --optimizers ''."""
    a = args.parse_args(["--task", "digits", "--engine", "fsdp2"])
    assert a.digits.codec_list == ["dense"] + args.DEFAULT_CODECS and a.digits.optimizer_list == []
    assert a.notes == ["digits: left out the optimizer rows (adam, onebit_adam): they run under --engine ddp only "
                       "(torch Adam under plain DDP, 1-bit Adam's DDP hook)"]
    runs = sweep.plan_runs(a.digits)
    assert runs[0]["codec"] == "dense" and runs[0]["error_feedback"] is False
    assert all(r["engine"] == "fsdp2" and r["optimizer"] == "sgd" for r in runs)
    b = args.parse_args(["--task", "digits", "--engine", "fsdp2", "--optimizers", ""])
    assert b.digits.optimizer_list == [] and b.notes == []


def test_dense_runs_without_error_feedback():
    for ef in ("both", "on", "off", "auto"):
        t = args.parse_args(["--task", "charlm", "--engine", "fsdp2", "--ef", ef]).charlm
        assert sweep.efs_for("dense", t) == [False], ef


@pytest.mark.parametrize("argv, says", [
    (["--engine", "fsdp2", "--codecs", "none;powersgd:rank=2"], "PowerSGD has no FSDP2 path"),
    (["--engine", "fsdp2", "--task", "charlm", "--codecs", "powersgd:rank=4"], "Accepted under --engine fsdp2: dense"),
    (["--codecs", "dense"], "--engine fsdp2 only"),
    (["--engine", "fsdp2", "--codecs", "dense:x=1"], "takes no options"),
    (["--engine", "fsdp2", "--workers", "1"], "--workers >= 2"),
    (["--engine", "fsdp2", "--task", "digits", "--optimizers", "adam"], "needs --engine ddp"),
    (["--engine", "fsdp2", "--task", "charlm", "--charlm-start-iter", "5"], "no dense warm-up"),
    (["--engine", "fsdp2", "--task", "digits", "--link", "1gbit"], "charlm only"),
    (["--engine", "fsdp3"], "invalid choice"),
])
def test_fsdp2_refusals(argv, says, capsys):
    err = _parse_error(argv, capsys)
    assert says in err, err


def test_fsdp2_refusal_names_the_accepted_codecs(capsys):
    err = _parse_error(["--engine", "fsdp2", "--codecs", "powersgd:rank=2"], capsys)
    for name in sorted(_registered()):
        assert name in err, name


def test_fsdp2_output_files_and_footer():
    """Outputs under --engine fsdp2 go beside the DDP ones under other names; the table's footer
    says what the ratios are against (a ring reduce-scatter) and each row against dense."""
    for task in args.TASKS:
        new, old = report.output_files(task, "fsdp2"), report.OUTPUT_FILES[task]
        assert set(new) == set(old) and not set(new.values()) & set(old.values())
        assert all("fsdp2" in f for f in new.values())
    summary = [{"codec": "dense", "error_feedback": False, "bpc_mean": 2.5},
               {"codec": "int8", "error_feedback": True, "bpc_mean": 2.51},
               {"codec": "none", "error_feedback": False, "bpc_mean": 2.5}]
    lines = report.fsdp2_lines(summary, "bpc", "bits/char", "embed, lstm and head", 1000, 40, 4)
    assert "ring reduce-scatter of the dense input ((W-1)/W x dense bytes)" in lines[0]
    assert "40 of 1000 parameter elements" in lines[1]
    assert lines[2] == "Relative to dense (2.5000 bits/char): int8 +EF +0.40%, none +0.00%."
    # no dense row (an explicit --codecs without it): no relative line
    assert len(report.fsdp2_lines(summary[1:], "bpc", "bits/char", "x", 1000, 40, 4)) == 2


def test_spec_at_scheme_entries(capsys):
    """``SPEC@SCHEME`` (DDP): the scheme must be one of the table's; FSDP2 refuses it."""
    from gradcomp.experiments.__main__ import parse_args

    assert args.split_scheme("onebit@majority") == ("onebit", "majority")
    assert args.split_scheme("topk:ratio=0.01") == ("topk:ratio=0.01", "auto")
    assert args.family("onebit@majority") == "onebit"
    assert parse_args(["--task", "digits", "--codecs", "onebit@majority"]).digits.codec_list == ["onebit@majority"]
    for argv, msg in [(["--task", "digits", "--codecs", "onebit@nope"], "unknown scheme 'nope'"),
                      (["--task", "digits", "--engine", "fsdp2", "--codecs", "onebit@majority"], "--engine ddp"),
                      (["--task", "digits", "--codecs", "onebit@"], "both parts non-empty"),
                      (["--task", "digits", "--codecs", "topk:ratio=0.01@majority"],
                       "scheme 'majority' takes the onebit codec (signs), not 'topk:ratio=0.01'"),
                      (["--task", "digits", "--codecs", "int8:integrity=crc32c@sum"], "takes a linear codec"),
                      (["--task", "digits", "--codecs", "onebit@hierarchical"], "needs local_world_size")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert msg in capsys.readouterr().err
