"""Accuracy-versus-ratio experiment harness (the README's "The main job").

Run ``gradcomp-experiment`` or ``python -m gradcomp.experiments`` (``--help`` for the flags). Real
DDP worker processes on gloo (CPU, spawn, one thread each, reused across runs) train an MLP on
scikit-learn's digits while a gradcomp hook compresses every bucket; the sweep covers codecs x
error feedback x seeds and writes a table, CSV, JSON and a PNG plot (see ``__main__``).
"""
