"""The published figures :mod:`gradcomp.planner` reproduces from its own formulas
(:func:`published_figures`; ``gradcomp-plan --figures`` prints them), on the registry's ``none``
codec (its packet sizes are ``Codec("none").packet_bytes``, not a formula of the planner's).
"""

from ..codec import Codec
from .bytes import bucket_bytes, chunk, dense_bytes, dtype_bytes, hierarchical_bytes, ring_allreduce_bytes
from .cost import LINK_LEVELS, CostModel
from .step import parameter_list, plan_step


def published_figures() -> list:
    """The published figures the planner reproduces from first principles, as ``[(claim,
    computed, expected)]`` (exact values; docs and tests read this list):

    - a 70B-parameter model, float32 gradients, synchronized every 2 s on 512 GPUs: 280 GB per
      step, 140 GB/s = 1.12 Tb/s of gradient traffic;
    - a ring allreduce sends (N-1)/N of the data over each link in each of its two phases
      (reduce-scatter, all-gather): 2 (N-1)/N in all;
    - a hierarchical reduction cuts inter-rack traffic by the GPUs per rack: with 8 per rack the
      data entering the network is 1/8 (each rack sends its reduced gradient once); per rank
      ring bytes fall by (LN-1)/(N-1), 8.11x at 64 racks of 8, tending to 8;
    - accumulating over 8 micro-batches cuts the traffic per micro-batch by 87.5%;
    - a 175B model produces 700 GB of float32 gradients per step whatever the GPU count.
    """
    none = Codec("none")
    m70 = plan_step(parameter_list(70e9), none, 512, CostModel(LINK_LEVELS["nvlink"], LINK_LEVELS["network"], 8),
                    "dense", step_time_s=2.0)
    ring = ring_allreduce_bytes(1.0, 512)
    flat = bucket_bytes("dense", none, 10 ** 6, "float32", 512)["sent_bytes"]
    hier = hierarchical_bytes(none, 10 ** 6, "float32", 512, 8, "dense", "nccl")["inter_bytes"]
    # data a rack of 8 puts into the network: flat, each rank its whole gradient; hierarchical,
    # each local rank its chunk of the rack's reduced gradient
    rack_flat = 8 * dense_bytes(10 ** 6, "float32")
    rack_hier = sum(chunk(10 ** 6, 8, j)[1] for j in range(8)) * dtype_bytes("float32")
    acc1 = plan_step(parameter_list(10 ** 9), none, 64, CostModel(LINK_LEVELS["network"]), "dense", step_time_s=1.0)
    acc8 = plan_step(parameter_list(10 ** 9), none, 64, CostModel(LINK_LEVELS["network"]), "dense", step_time_s=1.0,
                     accumulate=8)
    cut = 1 - acc8["bytes_per_micro_batch"]["intra"] / acc1["bytes_per_micro_batch"]["intra"]
    g175 = {W: dense_bytes(175 * 10 ** 9, "float32") for W in (8, 512, 4096)}
    return [
        ("70B float32 gradients per step (bytes)", m70["gradient_bytes"], 280e9),
        ("70B every 2 s: required bytes/s", m70["required_bytes_per_s"], 140e9),
        ("70B every 2 s: required bits/s", m70["required_bits_per_s"], 1.12e12),
        ("ring allreduce, 512 ranks: bytes per link per phase / data", ring / 2, 511 / 512),
        ("hierarchical, 8 per rack: data entering the network, flat / hierarchical", rack_flat / rack_hier, 8.0),
        ("hierarchical, 64 racks of 8: per-rank inter-rack bytes, flat / hierarchical", flat / hier, 511 / 63),
        ("accumulate 8: traffic cut per micro-batch", cut, 0.875),
        ("175B float32 gradients per step at 8, 512, 4096 GPUs (bytes)", sorted(set(g175.values())), [700e9]),
    ]


def _NoneCodec() -> Codec:
    """The ``none`` codec, ``gradcomp.Codec("none")`` (kept under this name for callers of the
    planner's former stand-in, which re-derived its packet size; the registry's answer is the one
    source)."""
    return Codec("none")
