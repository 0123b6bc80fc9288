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
    low-rank hook's ``powersgd:rank=R``), once per list."""
    names = _registered()
    specs = getattr(args, lst)
    assert len(set(specs)) == len(specs)
    for spec in specs:
        fam = args.family(spec)
        if fam == "powersgd":
            args.check_powersgd_spec(spec)
            continue
        assert fam in names, spec
        assert Codec(spec).spec.partition(":")[0] == fam


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
    charlm = [_group("none", False, "bpc", 2.4, 32.0), _group("powersgd:rank=2", True, "bpc", 2.6, 0.3)]
    for task, summary in (("digits", digits), ("charlm", charlm)):
        path = tmp_path / f"{task}.png"
        report.plot(summary, str(path), 4, task)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(report.PLOTS) == set(args.TASKS) == set(report.OUTPUT_FILES)
    with pytest.raises(KeyError):
        report.plot(charlm, str(tmp_path / "x.png"), 4, "mnist")
