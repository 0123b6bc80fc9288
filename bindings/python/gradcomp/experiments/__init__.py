"""Accuracy-versus-ratio experiment harness (the README's "The main job") and the infrastructure it
runs on.

Run ``gradcomp-experiment`` or ``python -m gradcomp.experiments`` (``--help`` for the flags). Real
DDP worker processes on gloo (CPU, spawn, one thread each, reused across runs) train an MLP on
scikit-learn's digits and a character-level LSTM on the Python standard library's source while a
gradcomp hook compresses every bucket; the sweep covers codecs x error feedback x seeds and writes
tables, CSVs, JSON and PNG plots (see ``__main__``).

Modules: ``__main__`` (the entry point; the command's documentation), ``args`` (the flags and
each task's defaults), ``sweep`` (the runs of each task and running them), ``report`` (rows,
summaries, tables, files, the plot), ``runner`` (the digits task's worker side), ``charlm`` (the
charlm task's), ``fsdp2`` (both tasks' models under FSDP2: ``--engine fsdp2``), ``pool``
(:class:`~gradcomp.experiments.pool.GlooPool`, the gloo process pool the harness, the benchmarks
and the tests run jobs on; formerly ``gradcomp.torch.pool``, which still re-exports it), ``links`` (rate-limited links: network namespaces shaped with tc) and ``netns``
(namespaces by name and entering one, which ``pool`` and ``links`` share).
"""
