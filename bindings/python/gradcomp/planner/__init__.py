"""The one home of gradcomp's byte formulas, its cost model and the ``auto`` scheme choice.

Three layers, each built on the one before:
  1. byte formulas per scheme (``bucket_bytes``, ``scheme_steps``, ``hierarchical_bytes``, ...);
  2. the cost model (``Link``, ``collective_time``, ``EngineCost``, ``Throughput``, ``CostModel``): alpha-beta
     times of each collective on each link level plus the codec's kernel times, per bucket and
     scheme, and the fastest scheme (``CostModel.choose``; ``choose_scheme(..., cost_model=)``);
  3. a training step (``parameter_list``, ``ddp_buckets``, ``plan_step``): bytes per step per
     rank per link level, exposed time with and without overlap, the bandwidth a step time needs;
     for FSDP2 and HSDP (``fsdp_units``, ``plan_fsdp_step``, ``plan_fsdp_variants``): the
     parameter all-gathers, the gradient reduce-scatters (NCCL's ring or gradcomp's compressed
     all-to-all) and HSDP's replica all-reduce, per rank and per node, where compression goes;
     ``published_figures`` reproduces the field's standard figures from these formulas.
``gradcomp-plan`` (:mod:`gradcomp.planner_cli`) is the command line over them.

Submodules (the names of bytes, choice, cost, step and figures are re-exported here, so
``gradcomp.planner.X`` is the name to use; table and schemes are used as submodules):
  - :mod:`gradcomp.planner.bytes`: element sizes (``dtype_bytes``, ``dense_bytes``), the ring
    collectives' bytes, the byte formulas of each scheme (``bucket_bytes``, ``scheme_steps``,
    ``two_phase_slots``, ``hierarchical_*``), FSDP2's reduce-scatter (``fsdp_shard_rows``,
    ``fsdp_rows``, ``fsdp_exempt``, ``fsdp_slot``, ``fsdp_reduce_scatter_bytes``), where a
    collective's bytes go per link level and per node (``level_bytes``) and between which ranks
    (``traffic_matrix``), the 1-bit allreduce
    and PowerSGD, ``summarize``, the kernels' compulsory memory traffic (``encode_traffic_bytes``,
    ``decode_traffic_bytes``), and ``SCHEMES`` / ``ALL_SCHEMES``;
  - :mod:`gradcomp.planner.choice`: the ``auto`` choice (``choose_scheme``, ``bytes_choice``,
    ``hierarchical_inner``) and ``choice_report``;
  - :mod:`gradcomp.planner.cost`: link rates and levels, alpha-beta collective times, kernel
    times (``Throughput``, ``kernel_efficiency``) and ``CostModel``;
  - :mod:`gradcomp.planner.table`: the reader of ``gradcomp-bench`` JSON tables, the measured
    kernel speeds ``Throughput`` takes (:mod:`gradcomp.bench`, which writes them, re-exports it);
  - :mod:`gradcomp.planner.step`: ``parameter_list``, ``ddp_buckets``, ``plan_step``,
    ``fsdp_units``, ``plan_fsdp_step``, ``plan_fsdp_variants``;
  - :mod:`gradcomp.planner.figures`: ``published_figures``;
  - :mod:`gradcomp.planner.schemes`: the scheme table :mod:`gradcomp.schemes` registers
    (``planner.schemes.register``, ``get``, ``names``, ``candidates``).
Imports run one way (bytes <- table <- cost; bytes <- choice; step <- bytes, choice, cost;
figures <- bytes, cost, step); no submodule imports this package's ``__init__`` or
:mod:`gradcomp.bench`.

Every function of the formulas, the choice, the cost model and the step is pure: its result
depends only on inputs every rank shares -- element counts, dtypes, the world size W, a codec's
properties and packet sizes, the cost model's configuration -- never on timings or on anything a
rank measured, so every rank that asks gets the same answer (which is what lets ``auto`` choose
per bucket without a collective). (:func:`gradcomp.planner.table.load` reads a file.)

Units: ``numel`` and counts are elements; everything named ``*_bytes`` is bytes. Byte counts that
involve a ring allreduce are floats (2(W-1)/W is not an integer); the others are ints.

Formulas (bytes one rank sends; ring algorithms, as NCCL and gloo use):
  - ring allreduce of B bytes: 2 (W-1)/W * B (a reduce-scatter and an all-gather, each (W-1)/W * B);
  - ring all-gather of one P-byte packet per rank: (W-1) * P;
  - dense: the bucket itself through a ring allreduce;
  - sum: the codec's payload (``codec.payload``) through a ring allreduce;
  - gather: the codec's packet through a ring all-gather;
  - two_phase: the bucket cut into W chunks of c = ceil(n / W) elements (:func:`chunk`), each
    encoded into a slot of P1 = ``packet_bytes(c, dtype)`` bytes and sent in one all-to-all
    ((W-1) * P1: a rank keeps its own chunk's slot), then each rank's re-encoded float32 chunk
    in a slot of P2 = ``packet_bytes(c, float32)`` bytes through a ring all-gather
    ((W-1) * P2); P1 == P2 for a float32 bucket and for every codec whose packet does not depend
    on the input dtype, so the total is 2 (W-1) P, about 2 (W-1)/W of the whole bucket's packet.
Ratios (``summarize``): packet_ratio = packet bytes / dense bytes; wire_ratio = bytes sent under
the scheme / bytes a ring allreduce of the dense bucket sends; bits per element = 8 * packet
bytes / numel.

  - powersgd (low rank, :func:`powersgd_bytes`): per bucket one float32 ring allreduce of the
    tensors sent dense together with the P factors, then one of the Q factors.
Sources of two_phase: the error-compensated compressed allreduce of DeepSpeed's 1-bit Adam (Tang
et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed",
ICML 2021) and ZeRO++'s quantized gradient reduction qgZ (Wang et al., "ZeRO++: Extremely
Efficient Collective Communication for Giant Model Training", 2023).

Source of powersgd: Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", NeurIPS 2019, algorithm 1; the rule of which tensors
are compressed is PyTorch's ``powerSGD_hook._should_compress``.

Callers: ``gradcomp.torch.Compressor`` (scheme choice, the accounting in ``stats()``) and through it
the DDP hook and the experiment harness.
"""

from .bytes import (  # noqa: F401
    _DTYPE_BYTES, FSDP_TRAILER_BYTES, PEER_CHECK_BYTES, all_gather_bytes, bucket_bytes, chunk, chunk_size,
    decode_traffic_bytes, dense_bytes, dtype_bytes, encode_traffic_bytes, fsdp_exempt, fsdp_reduce_scatter_bytes,
    fsdp_rows, fsdp_shard_rows, fsdp_slot, hierarchical_bytes, hierarchical_groups, hierarchical_steps, level_bytes,
    onebit_allreduce_bytes, payload_bytes, powersgd_bytes, powersgd_rank, ring_allreduce_bytes, scheme_steps,
    summarize, traffic_matrix, two_phase_slots,
)
from .cost import (  # noqa: F401
    _DEFAULT_EFFICIENCY, _RATE_UNITS, _SPARSE_EFFICIENCY, COLLECTIVES, DEVICE_BYTES_PER_S, ENGINE_LEVELS, LINK_LEVELS,
    CostModel, EngineCost, Link, Throughput, _kernel_time, collective_time, kernel_efficiency, parse_rate,
)
from .choice import bytes_choice, choice_report, choose_scheme, hierarchical_inner  # noqa: F401
from .step import (  # noqa: F401
    FSDP_COLLECTIVES, FSDP_ENGINES, FSDP_VARIANTS, ddp_buckets, fsdp_units, parameter_list, plan_fsdp_step,
    plan_fsdp_variants, plan_step,
)
from .figures import _NoneCodec, published_figures  # noqa: F401
from . import schemes  # noqa: F401  (the scheme table; filled by gradcomp.schemes.table)
from . import bytes as _bytes


def __getattr__(name: str):
    """``SCHEMES`` / ``ALL_SCHEMES``: the flat / all scheme names of the scheme table
    (:func:`gradcomp.planner.schemes.names`), read when asked for."""
    if name in ("SCHEMES", "ALL_SCHEMES"):
        return getattr(_bytes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    # bytes
    "SCHEMES", "ALL_SCHEMES", "dtype_bytes", "dense_bytes", "ring_allreduce_bytes", "all_gather_bytes", "chunk",
    "chunk_size", "two_phase_slots", "payload_bytes", "bucket_bytes", "scheme_steps", "hierarchical_groups",
    "hierarchical_steps", "hierarchical_bytes", "onebit_allreduce_bytes", "powersgd_rank", "powersgd_bytes",
    "summarize", "encode_traffic_bytes", "decode_traffic_bytes", "FSDP_TRAILER_BYTES", "fsdp_shard_rows", "fsdp_slot",
    "fsdp_reduce_scatter_bytes", "fsdp_exempt", "fsdp_rows", "level_bytes", "traffic_matrix", "PEER_CHECK_BYTES",
    # choice
    "choose_scheme", "bytes_choice", "hierarchical_inner", "choice_report",
    # cost
    "COLLECTIVES", "parse_rate", "Link", "LINK_LEVELS", "collective_time", "DEVICE_BYTES_PER_S", "Throughput",
    "CostModel", "EngineCost", "ENGINE_LEVELS", "kernel_efficiency",
    # step, figures
    "parameter_list", "ddp_buckets", "plan_step", "published_figures", "FSDP_ENGINES", "FSDP_VARIANTS",
    "FSDP_COLLECTIVES", "fsdp_units", "plan_fsdp_step", "plan_fsdp_variants",
]
