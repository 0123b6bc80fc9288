"""gradcomp: gradient compression kernels with fused error feedback.

Codecs (``gradcomp.Codec(spec)``) compress a flat float32/float16/bfloat16 gradient into a
fixed-size packet (see the README: codecs and packets); ``gradcomp.torch`` turns them into PyTorch DDP
communication hooks; ``gradcomp.lowrank`` exposes the steps of PowerSGD low-rank compression
(Vogels et al., NeurIPS 2019) over torch tensors.

Errors: ``InvalidArgumentError`` (ValueError) for bad arguments, ``CorruptPacketError``
(ValueError) for packets that fail validation, ``UnsupportedError`` (RuntimeError) for requests
this build cannot serve (e.g. a CUDA tensor in a CPU-only build), ``CudaError`` (RuntimeError);
``CollectiveError`` (RuntimeError) when a collective of a compressed allreduce fails and
``RankMismatchError`` (a CollectiveError) when ranks disagree on what they reduce (a failed step
is undone on every rank: :mod:`gradcomp.errors`).
"""

from ._C import (  # noqa: F401
    CorruptPacketError,
    CudaError,
    Error,
    InvalidArgumentError,
    UnsupportedError,
    get_num_threads,
    set_num_threads,
)
from .codec import Codec, aligned_empty, build_info, check, codecs  # noqa: F401
from .errors import CollectiveError, RankMismatchError  # noqa: F401
from . import lowrank  # noqa: F401  (PowerSGD low-rank steps: gradcomp.lowrank.project, ...)
from . import schemes  # noqa: F401  (the scheme table, handed to the planner: gradcomp.schemes.table)

__version__ = build_info()["version"]

__all__ = [
    "Codec",
    "aligned_empty",
    "codecs",
    "lowrank",
    "CollectiveError",
    "CorruptPacketError",
    "CudaError",
    "Error",
    "InvalidArgumentError",
    "RankMismatchError",
    "UnsupportedError",
    "build_info",
    "check",
    "get_num_threads",
    "set_num_threads",
]
