"""``gradcomp-experiment`` / ``python -m gradcomp.experiments``: model quality versus compression.

Spawns W DDP worker processes on gloo (default 4, spawn start method, one thread each, reused for
every run of every task: :class:`gradcomp.experiments.pool.GlooPool`; a new model, DDP wrapper and
hook state per run) and sweeps codecs x error feedback x seeds on two tasks (``--task
digits,charlm``, the default, or ``all``; or one):

``digits`` (:mod:`gradcomp.experiments.runner`): an MLP 64-256-256-10 on scikit-learn's digits,
SGD with momentum, 30 epochs; metric test accuracy. Codecs: none, fp16, bf16, topk at ratios 0.1,
0.01, 0.001, the block quantizers fp8 (e4m3, block 128), int8 and int4 (block 128), and onebit
(1-bit signs with one l2 scale per packet; with error feedback, EF-signSGD with a scale,
Karimireddy et al. 2019); ``--full`` adds the fp8 variants e5m2 (block 128) and e8m0 scales (block
32). Each with and without error feedback, except that under ``--ef both`` codec none runs without
it only: its residual is exactly zero, so the run with error feedback repeats the one without bit
for bit. none, top-k and onebit run over ``--seeds`` seeds (default 2; 3 with ``--full``): their
accuracy moves with the seed and with error feedback; the casts and the block quantizers over
``--quant-seeds`` (1), their test accuracy matched the dense run's on every seed tried. Then the
optimizer rows (``--optimizers``, ``--optimizer-seeds`` seeds each, default 1; 2 with ``--full``):
torch's Adam under plain DDP and gradcomp.optim.OnebitAdam (1-bit Adam, Tang et al., ICML 2021)
with its DDP hook, a dense warm-up of 15 % of the steps and then the 1-bit compressed momentum, on
the same model (peak lr 1e-3, eps 1e-4, cosine decay, no weight decay; the first layer's weights
of constant pixels masked with ``exp_avg_mask``). Default: 28 SGD runs + 2 optimizer runs = 30;
``--full``: 41 + 4 = 45, the sweep that was the default before the charlm task came (the same runs
give the same results: the default's runs are a subset of the full sweep's).

``charlm`` (:mod:`gradcomp.experiments.charlm`): a character-level 2-layer LSTM language model
(embed 48, hidden 192: 505,681 parameters) on the Python standard library's own source text (the
running interpreter's, a fixed file list, 4 MiB at most; validation split by file); Adam (peak lr
2e-2, cosine decay, clip 1), ``--charlm-steps`` steps (default 150) of 8 windows x 64 characters
per rank; metric validation bits per character. Default: none (dense), then fp16, topk:ratio=0.01,
powersgd:rank=2 and powersgd:rank=4 with error feedback (``--ef auto``: error feedback on except
for codec none), 1 seed: 5 runs. ``--full``: none, fp16, bf16, topk at 0.1, 0.01 and 0.001, int8,
int4, onebit and PowerSGD at ranks 1, 2, 4 and 8, each with and without error feedback (codec none
without only), 2 seeds: 50 runs. The ``powersgd:rank=R`` specs go to gradcomp.torch's low-rank
hook (Vogels et al., NeurIPS 2019; PyTorch's PowerSGD hook protocol); when
``gradcomp.torch.powersgd`` cannot be imported, the default lists leave those rows out (the table
says so) and an explicit ``--codecs`` with one is an argparse error.

``--engine fsdp2`` (default ``ddp``): the same tasks, data, seeds, steps and hyperparameters with
the model sharded by FSDP2 instead of wrapped in DDP (:mod:`gradcomp.experiments.fsdp2`:
``fully_shard`` of each direct child holding parameters, then of the root, on a 1-D CPU mesh of
the W gloo ranks) and gradcomp's compressed reduce-scatter (:func:`gradcomp.torch.fsdp.register`,
biases exempt) on every unit; the dense row ``dense`` is FSDP2's own reduce-scatter. Default
codecs: dense, then the DDP lists without PowerSGD (a DDP hook with no FSDP2 path: the table's note
says so, and an explicit ``powersgd:rank=R`` is an argparse error naming the accepted codecs), and
for charlm fp8 and int8. The byte ratios are the reduce-scatters' (wire_ratio against a ring
reduce-scatter of the dense input, (W-1)/W x dense bytes). Not under fsdp2: the digits optimizer
rows (left out, with a note), ``--link`` with digits, ``--charlm-start-iter`` > 0, ``--workers
1``. The files get an ``fsdp2`` prefix (``charlm_fsdp2_results.csv``, ``fsdp2_results.csv``,
...), so both engines' results can share ``--out``.

The hook's scheme is ``auto`` (sum for the casts, gather for top-k, two_phase for the quantizers
and onebit, with worker and server residuals under error feedback; powersgd for the low-rank
hook); the tables and the CSVs say which scheme each run used. ``--codecs``, ``--ef``, ``--seeds``
and ``--quant-seeds`` apply to every selected task (default: each task's own); the ``--charlm-*``
flags to charlm only, the other training flags (``--epochs``, ``--lr``, ...) to digits only.

Writes into ``--out`` (default ``results/``), for digits: ``results.csv`` (one row per run),
``results.json`` (configuration, every run with its loss curve, and the summary), ``table.md``
(the printed table: mean and spread over seeds) and ``accuracy_vs_bits.png`` (test accuracy
against bits per element); for charlm the same with a ``charlm_`` prefix and
``charlm_bpc_vs_bits.png`` (validation bits per character against bits per element; both plots
from :func:`gradcomp.experiments.report.plot`). Each DDP run with the gradcomp hook writes its step
reports (``log_file``, every :data:`gradcomp.experiments.runner.STATS_LOG_EVERY` steps, all ranks
into one file) to ``stats/TASK_III.jsonl`` (:func:`gradcomp.experiments.sweep.assign_stats_logs`;
``gradcomp-report`` reads them), and the tables show each row's network share next to its metric:
exposed communication over step time, summed over the run's steps (``stats()["time_split"]``).
Progress bars (tqdm) go to stderr; the tables and the file paths go to stdout. The README's "The
main job" has the measured times (the default: within 5 minutes on 2 cores).

Byte accounting, summed over all buckets and steps of a run, as the hook's ``stats()`` reports it
from :mod:`gradcomp.planner` (the one home of these formulas; the README's "The main job"):
packet_ratio = packet bytes / dense bytes; wire_ratio = bytes one rank sends under the scheme /
bytes it sends in a ring allreduce of the dense buckets (2(W-1)/W * dense bytes); bits per element
= 8 * packet bytes / numel.

Slow links (``--link RATE``, e.g. ``100mbit``, ``1gbit``, ``10gbit``, ``unlimited``; needs root,
``ip`` and ``tc``): the W workers run inside a network namespace this command creates, whose
loopback is rate-limited by a tc token-bucket filter at RATE (every rank's traffic shares it;
:func:`gradcomp.experiments.links.shaped_loopback`), or with ``--link-nodes 2`` in two namespaces
("nodes", W/2 ranks each) joined by a veth pair rate-limited at RATE in each direction
(:func:`gradcomp.experiments.links.two_nodes`); the namespaces are removed at the end, also on
errors, and nothing leaves the machine. The digits table then also has, per codec, the wall-clock
time to a target accuracy: the target is 98 % of the mean final test accuracy of the dense run
(codec none, SGD, no error feedback) of the same sweep, and a run's time to target is the wall
time from its start (model build) to the end of the first epoch whose test accuracy reaches it,
the per-epoch evaluation excluded (:func:`gradcomp.experiments.links.timed_train_run`), with the
epoch, how many seeds reached it, and the run's wall time; charlm runs under the same link with
its usual table. Without ``--link`` nothing changes.

Exit status 0 on success; 2 on bad arguments (argparse) or when ``--link`` cannot build the
namespaces here (the reason is printed); a failed run raises RuntimeError with the worker's
traceback.

The code: :mod:`gradcomp.experiments.args` (the flags and each task's defaults),
:mod:`gradcomp.experiments.sweep` (the runs each task makes, and running them on the pool) and
:mod:`gradcomp.experiments.report` (rows, summaries, tables, files, plots); this module is the entry
point and re-exports their names (``parse_args``, ``plan_runs``, ``summarize``, ...).
"""

import logging
import sys
from typing import List, Optional

from . import args, report, sweep
from .args import (CHARLM_CODECS, CHARLM_FULL_CODECS, CHARLM_LR, CL, DEFAULT_CODECS,  # noqa: F401 (re-exported)
                   DIGITS_FULL_CODECS, DIGITS_OPTIMIZER_SEEDS, ENGINES, FSDP2_CODECS, OPTIMIZERS,
                   QUANT_SEED_FAMILIES, SWEEP_DEFAULTS, TASKS, check_powersgd_spec, family, parse_args, parse_tasks,
                   powersgd_available)
from .report import (CHARLM_CSV_COLUMNS, CSV_COLUMNS, OUTPUT_FILES, OUTPUT_FILES_FSDP2, PLOTS,  # noqa: F401
                     TARGET_FRACTION, format_charlm_table, format_table, link_target, output_files, plot, summarize)
from .sweep import efs_for, plan_charlm_runs, plan_runs, run_sweep, seeds_for  # noqa: F401


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``gradcomp-experiment``: parse ``argv`` (default ``sys.argv[1:]``), run the
    sweep, write and print the report. Returns the exit status (0; 2 when ``--link`` cannot build
    its namespaces here; argparse exits with 2 on bad arguments)."""
    a = args.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        done = sweep.run(a)
    except sweep.LinkUnavailable as e:
        sys.stderr.write(f"gradcomp-experiment: --link {a.link}: {e}\n")
        return 2
    report.write(a, done, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
