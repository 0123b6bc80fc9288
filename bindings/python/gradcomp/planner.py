"""The one home of gradcomp's byte formulas, its cost model and the ``auto`` scheme choice.

Three layers, each built on the one before:
  1. byte formulas per scheme (``bucket_bytes``, ``scheme_steps``, ``hierarchical_bytes``, ...);
  2. the cost model (``Link``, ``collective_time``, ``Throughput``, ``CostModel``): alpha-beta
     times of each collective on each link level plus the codec's kernel times, per bucket and
     scheme, and the fastest scheme (``CostModel.choose``; ``choose_scheme(..., cost_model=)``);
  3. a training step (``parameter_list``, ``ddp_buckets``, ``plan_step``): bytes per step per
     rank per link level, exposed time with and without overlap, the bandwidth a step time needs;
     ``published_figures`` reproduces the field's standard figures from these formulas.
``gradcomp-plan`` (:mod:`gradcomp.planner_cli`) is the command line over them.

Every function here is pure: its result depends only on inputs every rank shares -- element
counts, dtypes, the world size W, a codec's properties and packet sizes -- never on timings or on
anything a rank measured, so every rank that asks gets the same answer (which is what lets
``auto`` choose per bucket without a collective).

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

from typing import Any, Dict, Mapping, Optional, Tuple

from .codec import _dtype_name

SCHEMES = ("dense", "sum", "gather", "two_phase")
"""The flat schemes (one ring over the whole group); ``"auto"`` resolves to one of them, or to
``"hierarchical"`` when a cost model with more than one node says so."""

ALL_SCHEMES = SCHEMES + ("hierarchical",)
"""Every scheme :func:`bucket_bytes` accounts for: the flat ones and ``"hierarchical"``."""

# Bytes per element by dtype name (torch / numpy names). A dtype not listed raises.
_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (a torch dtype, numpy dtype or name such as ``"bfloat16"``).

    Raises:
        ValueError: a dtype the planner has no size for (the list is in the message).
    """
    name = _dtype_name(dtype)
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ValueError(f"planner: no element size for dtype {name}; accepted: {', '.join(_DTYPE_BYTES)}") from None


def dense_bytes(numel: int, dtype: Any) -> int:
    """Bytes of ``numel`` elements of ``dtype``: ``numel * dtype_bytes(dtype)``."""
    return int(numel) * dtype_bytes(dtype)


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring allreduce of ``nbytes`` bytes: ``2 (W-1)/W * nbytes``
    (0.0 for W = 1). Evaluated as ``2.0 * (W - 1) / W * nbytes`` in binary64."""
    W = int(world_size)
    return 2.0 * (W - 1) / W * nbytes


def all_gather_bytes(packet_bytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-gather of one ``packet_bytes`` packet per rank:
    ``(W-1) * packet_bytes``."""
    return (int(world_size) - 1) * int(packet_bytes)


def chunk(numel: int, world_size: int, index: int) -> Tuple[int, int]:
    """Chunk ``index`` of a flat bucket of ``numel`` elements cut for the ``two_phase`` scheme:
    ``(start, count)`` in elements, chunk i = [i c, min(n, (i+1) c)) with c = ceil(n / W) =
    :func:`chunk_size`; the last chunks are shorter or empty (count 0) when W does not divide n
    (e.g. n = 1, W = 4: (0, 1), (1, 0), (1, 0), (1, 0)).

    Raises:
        ValueError: ``index`` outside [0, W).
    """
    n, W, i = int(numel), int(world_size), int(index)
    if not 0 <= i < W:
        raise ValueError(f"planner: chunk index {i} outside [0, {W})")
    c = chunk_size(n, W)
    start = min(n, i * c)
    return start, min(n, start + c) - start


def chunk_size(numel: int, world_size: int) -> int:
    """Elements per ``two_phase`` chunk: ``ceil(numel / W)`` (0 for an empty bucket)."""
    return -(-int(numel) // int(world_size))


def two_phase_slots(codec, numel: int, dtype: Any, world_size: int) -> Tuple[int, int]:
    """Slot sizes of the ``two_phase`` scheme in bytes: ``(P1, P2)`` = (``packet_bytes(c,
    dtype)``, the all-to-all slot of a chunk in the bucket dtype; ``packet_bytes(c, "float32")``,
    the all-gather slot of a chunk re-encoded from the float32 sum), c = :func:`chunk_size`."""
    c = chunk_size(numel, world_size)
    return int(codec.packet_bytes(c, dtype)), int(codec.packet_bytes(c, "float32"))


def payload_bytes(codec, numel: int, dtype: Any) -> int:
    """Bytes of a linear codec's summable payload for ``numel`` elements of ``dtype``:
    ``count * dtype_bytes(wire dtype)`` from ``codec.payload(numel, dtype)`` (the header does not
    travel in the ``sum`` scheme).

    Raises:
        ValueError: the codec is not linear (it has no payload).
    """
    pl = codec.payload(numel, dtype)
    if pl is None:
        raise ValueError(f"planner: codec {codec.spec} is not linear: it has no summable payload")
    _, count, wire = pl
    return int(count) * dtype_bytes(wire)


def bucket_bytes(scheme: str, codec, numel: int, dtype: Any, world_size: int, *,
                 local_world_size: int = 0, inner: str = "", engine: str = "nccl") -> Dict[str, float]:
    """Byte accounting of one bucket of ``numel`` elements of ``dtype`` reduced under ``scheme``.

    Returns ``{"dense_bytes", "packet_bytes", "sent_bytes", "ring_bytes"}``:
      - ``dense_bytes`` (int): the bucket in its dtype, ``numel * element size``;
      - ``packet_bytes`` (int): this rank's packet, ``codec.packet_bytes(numel, dtype)``; for
        ``dense`` the bucket itself (= dense_bytes); for ``two_phase`` the W slots the bucket is
        encoded into, ``W * P1`` (:func:`two_phase_slots`);
      - ``sent_bytes`` (float): bytes one rank sends: dense ``ring_allreduce_bytes(dense_bytes)``,
        sum ``ring_allreduce_bytes(payload_bytes)``, gather ``all_gather_bytes(packet_bytes)``,
        two_phase ``(W-1) * P1 + (W-1) * P2`` (all-to-all, then ring all-gather);
      - ``ring_bytes`` (float): ``ring_allreduce_bytes(dense_bytes)``, the dense reference.
    ``hierarchical`` needs ``local_world_size`` (L) and ``inner`` (the scheme across nodes) and
    adds ``intra_bytes`` / ``inter_bytes`` (:func:`hierarchical_bytes`; ``engine="gloo"``
    accounts the intra-node reduce-scatter as the allreduce gloo runs).

    Raises:
        ValueError: an unknown scheme, or ``sum`` with a non-linear codec; hierarchical without
            a valid ``local_world_size`` / ``inner``.
    """
    if scheme == "hierarchical":
        if inner not in SCHEMES:
            raise ValueError(f"planner: hierarchical needs inner= one of {', '.join(SCHEMES)}; got {inner!r}")
        return hierarchical_bytes(codec, numel, dtype, world_size, local_world_size, inner, engine)
    dense = dense_bytes(numel, dtype)
    ring = ring_allreduce_bytes(dense, world_size)
    if scheme == "dense":
        return {"dense_bytes": dense, "packet_bytes": dense, "sent_bytes": ring, "ring_bytes": ring}
    if scheme not in SCHEMES:
        raise ValueError(f"planner: scheme={scheme!r}; accepted: {', '.join(ALL_SCHEMES)}")
    if scheme == "two_phase":
        p1, _ = two_phase_slots(codec, numel, dtype, world_size)
        packet = int(world_size) * p1
    else:
        packet = int(codec.packet_bytes(numel, dtype))
    sent = float(sum(st[4] for st in scheme_steps(scheme, codec, numel, dtype, world_size)))
    return {"dense_bytes": dense, "packet_bytes": packet, "sent_bytes": sent, "ring_bytes": ring}


def onebit_allreduce_bytes(codec, padded_numel: int, world_size: int) -> float:
    """Bytes one rank sends in one DeepSpeed-style error-compensated 1-bit allreduce as
    :class:`gradcomp.deepspeed.OnebitBackend` runs it (also the compressed momentum exchange of
    :mod:`gradcomp.optim`): a buffer of ``padded_numel`` = Np elements (a multiple of 8 W) cut
    into W chunks of C = Np / W; the all-to-all carries each chunk's sign bits and the sender's
    float32 scale, C / 8 + 4 bytes, to its owner ((W-1) (C/8 + 4)); the ring all-gather carries
    each owner's re-encoded chunk, one ``codec`` packet of C float32 elements ((W-1) *
    ``codec.packet_bytes(C, "float32")``). 0.0 for W = 1 (nothing is sent).

    Raises:
        ValueError: ``padded_numel`` not a multiple of 8 W.
    """
    Np, W = int(padded_numel), int(world_size)
    if Np % (8 * W) != 0:
        raise ValueError(f"planner: padded_numel={Np} is not a multiple of 8 * world size = {8 * W}")
    C = Np // W
    return float(all_gather_bytes(C // 8 + 4, W) + all_gather_bytes(int(codec.packet_bytes(C, "float32")), W))


def choose_scheme(codec, numel: int, dtype: Any, world_size: int, requested: str = "auto",
                  min_compress_numel: int = 1024, *, cost_model=None, local_world_size: int = 0) -> str:
    """The scheme a bucket of ``numel`` elements of ``dtype`` takes once compression is on.

    Rule, in order:
      1. ``"dense"`` when ``numel == 0`` or ``numel < min_compress_numel``;
      2. ``requested`` when it is not ``"auto"`` (``"hierarchical"`` included);
      3. with a ``cost_model`` (:class:`CostModel`): the scheme of least predicted time
         (:meth:`CostModel.choose`: dense when compression does not pay; ``hierarchical`` is a
         candidate when ``local_world_size`` L > 1 divides W and W / L > 1);
      4. ``"sum"`` for a linear codec (``codec.properties["linear"]``);
      5. for a sparse codec (``codec.properties["sparse"]``, top-k): ``"gather"`` when it sends
         fewer bytes than a dense ring allreduce, approximated as ``W * packet_bytes < 2 *
         dense_bytes`` (i.e. (W-1) P vs 2 (W-1)/W D, both scaled by W/(W-1)); else ``"dense"``;
      6. for the other codecs (the quantizers): ``"two_phase"`` when it sends fewer bytes than a
         dense ring allreduce, (W-1) (P1 + P2) < 2 (W-1)/W D, evaluated in integers as
         ``W * (P1 + P2) < 2 * dense_bytes`` (:func:`two_phase_slots`; with P1 = P2 = P:
         W P < D), which never holds for W = 1; else ``"dense"``.
    Inputs are all rank-shared (the cost model's links and throughput table are configuration),
    so every rank chooses alike.

    Raises:
        ValueError: ``requested`` is not ``"auto"`` or one of :data:`ALL_SCHEMES`.
    """
    if requested != "auto" and requested not in ALL_SCHEMES:
        raise ValueError(f"planner: scheme={requested!r}; accepted: auto, {', '.join(ALL_SCHEMES)}")
    if numel < min_compress_numel or numel == 0:
        return "dense"
    if requested != "auto":
        return requested
    if cost_model is not None:
        return cost_model.choose(codec, numel, dtype, world_size, local_world_size=local_world_size,
                                 min_compress_numel=min_compress_numel)["scheme"]
    return bytes_choice(codec, numel, dtype, world_size)


def bytes_choice(codec, numel: int, dtype: Any, world_size: int) -> str:
    """Rules 4-6 of :func:`choose_scheme`: the choice from byte counts alone (no cost model)."""
    if codec.properties["linear"]:
        return "sum"
    W, dense = int(world_size), dense_bytes(numel, dtype)
    if codec.properties.get("sparse", False):
        return "gather" if W * int(codec.packet_bytes(numel, dtype)) < 2 * dense else "dense"
    if W < 2:  # (W-1) (P1 + P2) < 0 never holds
        return "dense"
    p1, p2 = two_phase_slots(codec, numel, dtype, W)
    return "two_phase" if W * (p1 + p2) < 2 * dense else "dense"


def summarize(totals: Mapping[str, float]) -> Dict[str, float]:
    """The three ratios (packet_ratio, wire_ratio, bits per element) from summed byte counts.

    ``totals`` holds ``numel`` (elements), ``dense_bytes``, ``packet_bytes``, ``sent_bytes`` and
    ``ring_bytes`` (bytes, summed over any set of buckets and steps). Returns
    ``{"packet_ratio": packet/dense, "wire_ratio": sent/ring, "bits_per_element": 8 * packet /
    numel}``, each NaN when its denominator is 0 -- except ``wire_ratio`` when nothing was sent
    nor would a ring have sent anything (world size 1: sent = ring = 0, packets accounted): then
    it is the packet ratio, what the packets would weigh against the dense bytes.
    """
    def ratio(a, b):
        return a / b if b else float("nan")

    packet_ratio = ratio(totals["packet_bytes"], totals["dense_bytes"])
    wire = ratio(totals["sent_bytes"], totals["ring_bytes"])
    if not totals["ring_bytes"] and not totals["sent_bytes"] and totals["packet_bytes"]:
        wire = packet_ratio
    return {"packet_ratio": packet_ratio, "wire_ratio": wire,
            "bits_per_element": ratio(8.0 * totals["packet_bytes"], totals["numel"])}


def powersgd_rank(shape, rank: int, min_compression_rate: float = 2.0, min_numel: int = 0) -> int:
    """The rank PowerSGD uses for a tensor of ``shape`` viewed as a matrix [n, m] (n = shape[0],
    m = the product of the rest), or 0 when it is sent dense: tensors of fewer than 2 dimensions
    or of fewer than ``min_numel`` elements; else r = min(n, m, rank), and the tensor is compressed
    only when ``(n + m) r * min_compression_rate < n m`` (PyTorch's ``_should_compress``).

    Raises:
        ValueError: rank < 1 or min_compression_rate <= 0.
    """
    if int(rank) < 1:
        raise ValueError(f"planner: powersgd rank={rank}; accepted: an int >= 1")
    if not min_compression_rate > 0:
        raise ValueError(f"planner: min_compression_rate={min_compression_rate}; accepted: a number > 0")
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        return 0
    n = shape[0]
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0 or numel < int(min_numel):
        return 0
    m = numel // n
    r = min(n, m, int(rank))
    return r if (n + m) * r * min_compression_rate < n * m else 0


def powersgd_bytes(numel: int, dtype: Any, dense_numel: int, p_numel: int, q_numel: int,
                   world_size: int) -> Dict[str, float]:
    """Byte accounting of one bucket under PowerSGD, as ``gradcomp.torch.powersgd_hook`` sends it:
    the ``dense_numel`` elements of the tensors sent dense and the ``p_numel`` elements of the P
    factors in one float32 allreduce, then the ``q_numel`` elements of the Q factors in a second.

    Returns the :func:`bucket_bytes` fields: ``dense_bytes`` = the bucket in ``dtype``;
    ``packet_bytes`` = 4 (dense_numel + p_numel + q_numel); ``sent_bytes`` = ring allreduce of
    4 (dense_numel + p_numel) plus ring allreduce of 4 q_numel; ``ring_bytes`` = ring allreduce of
    dense_bytes.
    """
    dense = dense_bytes(numel, dtype)
    first = 4 * (int(dense_numel) + int(p_numel))
    second = 4 * int(q_numel)
    return {"dense_bytes": dense, "packet_bytes": first + second,
            "sent_bytes": ring_allreduce_bytes(first, world_size) + ring_allreduce_bytes(second, world_size),
            "ring_bytes": ring_allreduce_bytes(dense, world_size)}


# ==============================================================================================
# The hierarchical scheme's byte formulas
# ==============================================================================================

def hierarchical_groups(world_size: int, local_world_size: int) -> Tuple[int, int]:
    """``(nodes, L)`` of a world of W ranks in nodes of L = ``local_world_size`` consecutive
    ranks (rank r: node r // L, local rank r % L).

    Raises:
        ValueError: L < 1 or L does not divide W.
    """
    W, L = int(world_size), int(local_world_size)
    if L < 1 or W % L != 0:
        raise ValueError(f"planner: local_world_size={L} must be >= 1 and divide the world size {W}")
    return W // L, L


def hierarchical_inner(codec, numel: int, dtype: Any, world_size: int, local_world_size: int,
                       requested: str = "auto", min_compress_numel: int = 1024, cost_model=None) -> str:
    """The scheme the ``hierarchical`` scheme runs across nodes: :func:`choose_scheme` of one
    intra-node chunk (c = ceil(numel / L) elements of float32, the node sum) over the N = W / L
    ranks of one local rank; every local rank takes the scheme of the full chunk size c, so the
    choice is the same on every rank. ``requested`` is the inner scheme asked for (not
    ``hierarchical``). With a ``cost_model`` of L ranks per node and ``requested="auto"``: the
    inner scheme of least predicted hierarchical time (:meth:`CostModel.predict`). One node
    (W = L): ``"dense"``, whatever is requested (nothing crosses nodes)."""
    nodes, L = hierarchical_groups(world_size, local_world_size)
    if nodes == 1:  # one node: nothing crosses, the chunks are summed exactly
        return "dense"
    if requested == "hierarchical":
        requested = "auto"
    c = chunk_size(numel, L)
    if (requested == "auto" and cost_model is not None and cost_model.nodes(world_size) > 1
            and cost_model.local_world_size == L and c >= min_compress_numel):
        preds = [cost_model.predict("hierarchical", codec, numel, dtype, world_size, s)
                 for s, inner in cost_model.candidates(codec, c, "float32", nodes) if not inner]
        return min(preds, key=lambda p: p["total_s"])["inner"]
    return choose_scheme(codec, c, "float32", nodes, requested, min_compress_numel)


def hierarchical_steps(codec, numel: int, dtype: Any, world_size: int, local_world_size: int,
                       inner: str, engine: str = "nccl"):
    """The collectives of one bucket under ``hierarchical``, as ``[(level, collective, nbytes,
    ranks, sent_bytes)]`` (level ``"intra"`` or ``"inter"``; ``nbytes`` is the buffer of an
    allreduce / reduce-scatter, one rank's part of an all-gather, one slot of an all-to-all):

      1. inside the node (L ranks) a float32 copy of the bucket (the node sum accumulates in
         float32 whatever ``dtype``) is reduce-scattered: each local rank keeps the node sum of
         its chunk (c = ceil(n / L) elements; :func:`chunk`). NCCL reduce-scatters the copy
         padded to L c elements ((L-1)/L of 4 L c bytes); on gloo it is an allreduce of the
         copy (2 (L-1)/L of 4 n bytes), as gloo runs it;
      2. across nodes (N = W / L ranks of one local rank) the chunk (float32, c elements) goes
         through ``inner`` (:func:`scheme_steps` of dense, sum, gather or two_phase);
      3. inside the node the averaged chunks are all-gathered in ``dtype``, each followed by its
         rank's status element ((L-1) (c + 1) elements sent by each rank).
    """
    nodes, L = hierarchical_groups(world_size, local_world_size)
    c = chunk_size(numel, L)
    steps = []
    if L > 1:
        if engine == "gloo":
            d = dense_bytes(numel, "float32")
            steps.append(("intra", "allreduce", d, L, ring_allreduce_bytes(d, L)))
        else:
            d = dense_bytes(L * c, "float32")
            steps.append(("intra", "reduce_scatter", d, L, (L - 1) / L * d))
    if nodes > 1:
        for _, kind, nbytes, p, sent in scheme_steps(inner, codec, c, "float32", nodes):
            steps.append(("inter", kind, nbytes, p, sent))
    if L > 1:
        part = dense_bytes(c + 1, dtype)  # the chunk and its rank's status element
        steps.append(("intra", "all_gather", part, L, float(all_gather_bytes(part, L))))
    return steps


def scheme_steps(scheme: str, codec, numel: int, dtype: Any, world_size: int):
    """The collectives one flat scheme runs for a bucket, ``[(level, collective, nbytes, ranks,
    sent_bytes)]`` with level ``"flat"`` (the ring spans the whole group): dense and sum one
    ``allreduce``, gather one ``all_gather`` of the packet, two_phase one ``all_to_all`` of P1-byte
    slots and one ``all_gather`` of P2 bytes (the byte formulas of :func:`bucket_bytes`). Empty
    for W = 1."""
    W = int(world_size)
    if W < 2:
        return []
    if scheme == "dense":
        d = dense_bytes(numel, dtype)
        return [("flat", "allreduce", d, W, ring_allreduce_bytes(d, W))]
    if scheme == "sum":
        p = payload_bytes(codec, numel, dtype)
        return [("flat", "allreduce", p, W, ring_allreduce_bytes(p, W))]
    if scheme == "gather":
        p = int(codec.packet_bytes(numel, dtype))
        return [("flat", "all_gather", p, W, float(all_gather_bytes(p, W)))]
    if scheme == "two_phase":
        p1, p2 = two_phase_slots(codec, numel, dtype, W)
        return [("flat", "all_to_all", p1, W, float(all_gather_bytes(p1, W))),
                ("flat", "all_gather", p2, W, float(all_gather_bytes(p2, W)))]
    raise ValueError(f"planner: scheme={scheme!r}; accepted: {', '.join(SCHEMES)}")


def hierarchical_bytes(codec, numel: int, dtype: Any, world_size: int, local_world_size: int,
                       inner: str, engine: str = "nccl") -> Dict[str, float]:
    """Byte accounting of one bucket under ``hierarchical`` (:func:`hierarchical_steps`): the
    :func:`bucket_bytes` fields plus ``intra_bytes`` and ``inter_bytes`` (bytes one rank sends
    inside its node and across nodes; ``sent_bytes`` is their sum). ``packet_bytes`` is this
    rank's inter-node packet (``codec.packet_bytes(c, float32)``; under inner ``two_phase`` its
    N slots; under ``dense`` the chunk itself)."""
    nodes, L = hierarchical_groups(world_size, local_world_size)
    steps = hierarchical_steps(codec, numel, dtype, world_size, local_world_size, inner, engine)
    intra = sum(s[4] for s in steps if s[0] == "intra")
    inter = sum(s[4] for s in steps if s[0] == "inter")
    c = chunk_size(numel, L)
    pk = bucket_bytes(inner, codec, c, "float32", nodes)["packet_bytes"] if c else 0
    dense = dense_bytes(numel, dtype)
    return {"dense_bytes": dense, "packet_bytes": pk, "sent_bytes": intra + inter,
            "ring_bytes": ring_allreduce_bytes(dense, world_size), "intra_bytes": intra, "inter_bytes": inter}


# ==============================================================================================
# The cost model: alpha-beta link times, kernel throughput, predicted bucket and step times
# ==============================================================================================
#
# Each collective over p ranks on a link of per-rank bandwidth beta (bytes/s, one direction) and
# per-message latency alpha (s) takes, ring / pairwise algorithms as NCCL and gloo run them
# (Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH",
# IJHPCA 2005, section 2; Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters
# of workstations", JPDC 2009):
#   allreduce of B bytes       2 (p-1) alpha + 2 (p-1)/p B / beta
#   reduce-scatter of B bytes    (p-1) alpha +   (p-1)/p B / beta
#   all-gather of P per rank     (p-1) alpha +   (p-1)   P / beta
#   all-to-all of P per slot     (p-1) alpha +   (p-1)   P / beta
# A ``shared`` link is one medium every rank of the group sends through at once (a loopback
# interface, a bus): each of the p senders gets beta / p.

COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "all_to_all")

_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
               "b/s": 1.0, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12}


def parse_rate(text: Any) -> float:
    """A link rate in bytes/s from ``text``: a number of bits per second with a unit, as tc
    writes them (``"100mbit"``, ``"1gbit"``, ``"10gbit"``; also ``"400gbps"``, ``"25Gb/s"``;
    SI prefixes: 1 gbit = 1e9 bits/s = 1.25e8 bytes/s), ``"unlimited"`` / ``"inf"`` (infinite), or
    a bare number (Gb/s). Returns ``bits / 8``.

    Raises:
        ValueError: anything else (the accepted forms are in the message).
    """
    t = str(text).strip().lower().replace(" ", "")
    if t in ("unlimited", "inf", "infinite"):
        return float("inf")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz/")
    unit = t[len(num):] or "gbit"
    try:
        v = float(num)
    except ValueError:
        v = float("nan")
    if unit not in _RATE_UNITS or not v > 0:
        raise ValueError(f"planner: link rate {text!r}; accepted: a positive number with a unit "
                         f"(e.g. 100mbit, 1gbit, 400gbps, 25Gb/s; bare numbers are Gb/s) or 'unlimited'")
    return v * _RATE_UNITS[unit] / 8.0


class Link:
    """One link level: ``bytes_per_s`` (beta, one direction; may be inf), ``latency_s`` (alpha,
    per message), ``name`` (for tables), and whose bandwidth beta is:

      - default: each rank's own (a NIC per GPU, NVLink);
      - ``shared``: one medium every rank of the group sends through at once, so each of p
        senders gets beta / p (all ranks on one host's rate-limited loopback);
      - ``per_node`` (an inter-node link only): the node's one NIC, shared by the flows leaving
        the node (:meth:`CostModel.predict`: a flat ring crosses it once per direction; the L
        cross-node groups of ``hierarchical`` all cross it at once).

    Raises:
        ValueError: beta <= 0, alpha < 0, or both shared and per_node.
    """

    __slots__ = ("bytes_per_s", "latency_s", "shared", "per_node", "name")

    def __init__(self, bytes_per_s: float, latency_s: float = 0.0, shared: bool = False, name: str = "",
                 per_node: bool = False):
        if not float(bytes_per_s) > 0:
            raise ValueError(f"planner: Link bytes_per_s={bytes_per_s}; accepted: > 0 (inf allowed)")
        if not float(latency_s) >= 0:
            raise ValueError(f"planner: Link latency_s={latency_s}; accepted: >= 0")
        if shared and per_node:
            raise ValueError("planner: a Link is shared (one medium for the group) or per_node, not both")
        self.bytes_per_s, self.latency_s = float(bytes_per_s), float(latency_s)
        self.shared, self.per_node, self.name = bool(shared), bool(per_node), str(name)

    @classmethod
    def parse(cls, rate: Any, latency_s: float = 0.0, shared: bool = False, name: str = "",
              per_node: bool = False) -> "Link":
        """A Link from a rate string (:func:`parse_rate`)."""
        return cls(parse_rate(rate), latency_s, shared, name or str(rate), per_node)

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes_per_s": self.bytes_per_s, "bits_per_s": 8 * self.bytes_per_s,
                "latency_s": self.latency_s, "shared": self.shared, "per_node": self.per_node}

    def __repr__(self) -> str:
        kind = ", shared" if self.shared else ", per node" if self.per_node else ""
        return f"Link({self.name or 'link'}: {8 * self.bytes_per_s / 1e9:g} Gb/s, alpha {self.latency_s:g} s{kind})"


LINK_LEVELS = {
    # per GPU, one direction: NVLink 4 (H100/H200 SXM, 900 GB/s bidirectional), PCIe 5 x16,
    # a 400 Gb/s NIC per GPU (rail-optimized clusters); latencies as NCCL's tuning tables assume.
    "nvlink": Link(450e9, 2e-6, name="nvlink"),
    "pcie": Link(50e9, 5e-6, name="pcie"),
    "network": Link(50e9, 10e-6, name="network"),
}
"""Default link levels (bytes/s per rank, latency s); ``--link-gbps LEVEL=GBPS`` overrides."""


def collective_time(kind: str, nbytes: float, ranks: int, link: Link, load: float = 1.0) -> float:
    """Seconds of one collective (the alpha-beta formulas above) of ``nbytes`` (the buffer of an
    allreduce / reduce-scatter; one rank's part of an all-gather; one slot of an all-to-all) over
    ``ranks`` ranks on ``link``; ``load`` scales the volume term (how many ranks' volumes cross a
    ``per_node`` link at once, :meth:`CostModel.predict`). 0.0 for ranks < 2.

    Raises:
        ValueError: an unknown collective.
    """
    p = int(ranks)
    if kind not in COLLECTIVES:
        raise ValueError(f"planner: collective {kind!r}; accepted: {', '.join(COLLECTIVES)}")
    if p < 2:
        return 0.0
    beta = link.bytes_per_s / (p if link.shared else 1)
    msgs, vol = {"allreduce": (2 * (p - 1), 2.0 * (p - 1) / p * nbytes),
                 "reduce_scatter": (p - 1, (p - 1) / p * nbytes),
                 "all_gather": (p - 1, (p - 1) * nbytes),
                 "all_to_all": (p - 1, (p - 1) * nbytes)}[kind]
    return msgs * link.latency_s + (load * vol / beta if vol else 0.0)


# Achievable memory bandwidth (bytes/s) of named devices, for kernel times without a bench table:
# H200 4.3 TB/s measured copy (4.8 spec; reference/frontier.md), H100 SXM 3.35 TB/s spec at the
# same 90%, A100 80 GB 2.04 TB/s at 90%, and this project's 2-core CPU machine (copy ~10 GB/s).
DEVICE_BYTES_PER_S = {"H200": 4.3e12, "H100": 3.0e12, "A100": 1.8e12, "cpu": 10e9}

# Fraction of that bandwidth a codec's encode / decode reaches on its compulsory bytes, without a
# measured table: block casts and quantizers 85% (reference/frontier.md: torchao MXFP8 at 90%),
# top-k 25% (the best published radix select, CUB on H100, is ~4 reads).
_EFFICIENCY = {"topk": 0.25, "randomk": 0.5, "dgc": 0.25}
_DEFAULT_EFFICIENCY = 0.85


def encode_traffic_bytes(numel: int, dtype: Any, packet_bytes: int, error_feedback: bool) -> int:
    """Compulsory memory traffic of an encode in bytes: the input read (``numel`` elements of
    ``dtype``) plus the packet written, plus, with error feedback, the float32 residual read and
    written (8 bytes per element). The floor ``gradcomp-bench`` divides by copy bandwidth."""
    return dense_bytes(numel, dtype) + int(packet_bytes) + (8 * int(numel) if error_feedback else 0)


def decode_traffic_bytes(numel: int, dtype: Any, packet_bytes: int) -> int:
    """Compulsory memory traffic of a decode (assign mode) in bytes: the packet read plus the
    ``numel`` output elements of ``dtype`` written."""
    return int(packet_bytes) + dense_bytes(numel, dtype)


class Throughput:
    """Encode / decode time of a codec on one device: from a ``gradcomp-bench`` JSON table
    (``table``: measured seconds; the largest size of the codec and dtype, scaled linearly in
    elements) or, without one (or for a codec / dtype the table lacks), from a memory bandwidth
    (the table's measured ``copy_bytes_per_s``, else ``device``'s entry of
    :data:`DEVICE_BYTES_PER_S`): compulsory bytes (:func:`encode_traffic_bytes`,
    :func:`decode_traffic_bytes`) over the bandwidth times the codec family's efficiency.

    Raises:
        ValueError: an unknown device name.
    """

    def __init__(self, table: Optional[dict] = None, device: str = "H200"):
        if table is None and device not in DEVICE_BYTES_PER_S:
            raise ValueError(f"planner: device {device!r}; accepted: {', '.join(DEVICE_BYTES_PER_S)} "
                             f"(or a gradcomp-bench table)")
        self.table, self.device = table, device
        self.name = (table.get("device_name") or table.get("device", "table")) if table else device

    def _rates(self, codec, dtype):
        if self.table is None:
            return None
        from .bench import throughput as bench_throughput
        try:
            return bench_throughput(self.table, codec.spec, _dtype_name(dtype))
        except KeyError:
            return None

    def encode_s(self, codec, numel: int, dtype: Any, error_feedback: bool = True) -> float:
        """Seconds to encode ``numel`` elements of ``dtype`` (0 for 0 elements)."""
        n = int(numel)
        if n == 0:
            return 0.0
        r = self._rates(codec, dtype)
        if r is not None:
            return n / r[0]
        b = encode_traffic_bytes(n, dtype, codec.packet_bytes(n, dtype), error_feedback)
        return b / (self._bandwidth() * _EFFICIENCY.get(codec.spec.split(':')[0], _DEFAULT_EFFICIENCY))

    def decode_s(self, codec, numel: int, dtype: Any) -> float:
        """Seconds to decode one packet of ``numel`` elements into ``dtype``."""
        n = int(numel)
        if n == 0:
            return 0.0
        r = self._rates(codec, dtype)
        if r is not None:
            return n / r[1]
        b = decode_traffic_bytes(n, dtype, codec.packet_bytes(n, dtype))
        return b / (self._bandwidth() * _DEFAULT_EFFICIENCY)

    def _bandwidth(self) -> float:
        if self.table is not None and self.table.get("copy_bytes_per_s"):
            return float(self.table["copy_bytes_per_s"])
        return DEVICE_BYTES_PER_S[self.device]


def _kernel_time(scheme: str, codec, numel: int, dtype: Any, W: int, tp: Throughput, ef: bool) -> Tuple[float, float]:
    """(encode_s, decode_s) a rank spends in one flat scheme's kernels: sum one encode and one
    decode of the bucket; gather one encode and W decodes; two_phase the chunk encodes (the
    bucket), one float32 chunk re-encode, W chunk decodes and the bucket's decodes; dense none."""
    if scheme == "dense" or W < 2 or numel == 0:
        return 0.0, 0.0
    if scheme == "sum":
        return tp.encode_s(codec, numel, dtype, ef), tp.decode_s(codec, numel, dtype)
    if scheme == "gather":
        return tp.encode_s(codec, numel, dtype, ef), W * tp.decode_s(codec, numel, dtype)
    c = chunk_size(numel, W)
    return (tp.encode_s(codec, numel, dtype, ef) + tp.encode_s(codec, c, "float32", ef),
            W * tp.decode_s(codec, c, "float32") + tp.decode_s(codec, numel, dtype))


class CostModel:
    """Predicted time of reducing one bucket under each scheme, and the fastest: the alpha-beta
    times of the scheme's collectives (:func:`collective_time`) on its link levels plus the
    encode / decode kernel times (:class:`Throughput`).

    Args:
        intra: the link inside a node (NVLink, PCIe, a loopback). A flat scheme runs on it when
            the whole group is one node.
        inter: the link between nodes (per rank: a rail-optimized NIC per GPU); flat schemes over
            more than one node run on it. None: one node, whatever the world size.
        local_world_size: L, ranks per node (0: the whole group is one node).
        throughput: kernel times (default ``Throughput(device="H200")``).
        engine: ``"nccl"`` or ``"gloo"`` (gloo has no reduce-scatter: hierarchical's intra step is
            an allreduce).
        error_feedback: whether encodes read and write a residual.

    All inputs are configuration every rank shares, so every rank predicts and chooses alike.

    Raises:
        ValueError: engine not nccl/gloo; local_world_size < 0.
    """

    def __init__(self, intra: Link, inter: Optional[Link] = None, local_world_size: int = 0,
                 throughput: Optional[Throughput] = None, engine: str = "nccl", error_feedback: bool = True):
        if engine not in ("nccl", "gloo"):
            raise ValueError(f"planner: engine={engine!r}; accepted: nccl, gloo")
        if int(local_world_size) < 0:
            raise ValueError(f"planner: local_world_size={local_world_size}; accepted: >= 0 (0: one node)")
        self.intra, self.inter = intra, inter
        self.local_world_size = int(local_world_size)
        self.throughput = throughput or Throughput(device="H200")
        self.engine, self.error_feedback = engine, bool(error_feedback)

    @classmethod
    def loopback(cls, rate: Any, latency_s: float = 50e-6, throughput: Optional[Throughput] = None,
                 error_feedback: bool = True) -> "CostModel":
        """All ranks on one host over a (rate-limited) loopback: one shared link of ``rate``
        (:func:`parse_rate`: ``"100mbit"``, ``"unlimited"``), gloo, CPU kernel times."""
        return cls(Link.parse(rate, latency_s, shared=True, name=f"loopback {rate}"), None, 0,
                   throughput or Throughput(device="cpu"), "gloo", error_feedback)

    def nodes(self, world_size: int) -> int:
        L = self.local_world_size
        return int(world_size) // L if L and self.inter is not None and int(world_size) % L == 0 else 1

    def _flat_link(self, world_size: int) -> Link:
        """The link a flat ring runs on: ``intra`` on one node; across N nodes the inter link's
        bandwidth (every rank's bytes cross the network) with the mean hop latency of the ring,
        N network hops and W - N intra-node hops: (N alpha_inter + (W - N) alpha_intra) / W."""
        W, N = int(world_size), self.nodes(world_size)
        if N < 2:
            return self.intra
        lat = (N * self.inter.latency_s + (W - N) * self.intra.latency_s) / W
        return Link(self.inter.bytes_per_s, lat, self.inter.shared, self.inter.name)

    def predict(self, scheme: str, codec, numel: int, dtype: Any, world_size: int, inner: str = "") -> dict:
        """Predicted times of one bucket under ``scheme`` (``inner``: hierarchical's scheme across
        nodes). Returns ``{"scheme", "inner", "comm_s", "encode_s", "decode_s", "total_s",
        "bytes": {"intra": sent bytes inside nodes, "inter": across nodes}}`` (seconds, bytes
        one rank sends). A flat ring over several nodes counts all its bytes as ``inter``: its
        time is paced by the hops that cross the network (in a rank-order ring only the node's
        boundary rank sends across, at the ring's full volume).

        Raises:
            ValueError: hierarchical on a model of one node, or an unknown scheme.
        """
        W = int(world_size)
        nodes = self.nodes(W)
        if scheme == "hierarchical":
            if nodes < 2:
                raise ValueError("planner: hierarchical needs a cost model with local_world_size > 0, "
                                 f"an inter link and more than one node (W={W}, L={self.local_world_size})")
            L = self.local_world_size
            steps = hierarchical_steps(codec, numel, dtype, W, L, inner, self.engine)
            enc, dec = _kernel_time(inner, codec, chunk_size(numel, L), "float32", nodes, self.throughput,
                                    self.error_feedback)
            links = {"intra": self.intra, "inter": self.inter}
        else:
            steps = scheme_steps(scheme, codec, numel, dtype, W)
            enc, dec = _kernel_time(scheme, codec, numel, dtype, W, self.throughput, self.error_feedback)
            level = "inter" if nodes > 1 else "intra"
            steps = [(level,) + tuple(s[1:]) for s in steps]
            links = {level: self._flat_link(W)}
        comm = sum(collective_time(kind, nb, p, links[lv], self._load(scheme, lv, kind, W))
                   for lv, kind, nb, p, _ in steps)
        by = {"intra": 0.0, "inter": 0.0}
        for lv, _, _, _, sent in steps:
            by[lv] += sent
        return {"scheme": scheme, "inner": inner, "comm_s": comm, "encode_s": enc, "decode_s": dec,
                "total_s": comm + enc + dec, "bytes": by}

    def _load(self, scheme: str, level: str, kind: str, world_size: int) -> float:
        """How many ranks' volumes cross a ``per_node`` inter link at once: hierarchical's L
        cross-node groups all leave the node together (L); a flat ring leaves each node over one
        hop per direction (1); a flat all-to-all sends the fraction (W - L) / (W - 1) of each of
        the node's L ranks' slots off the node."""
        if level != "inter" or not self.inter.per_node:
            return 1.0
        L, W = self.local_world_size, int(world_size)
        if scheme == "hierarchical":
            return float(L)
        return L * (W - L) / (W - 1) if kind == "all_to_all" else 1.0

    def candidates(self, codec, numel: int, dtype: Any, world_size: int) -> list:
        """``[(scheme, inner)]`` worth predicting for a bucket: dense; sum (linear codecs);
        gather; two_phase (non-linear codecs; W >= 2); hierarchical over each flat inner scheme
        when the model has more than one node."""
        flat = ["dense"] + (["sum"] if codec.properties["linear"] else []) + ["gather"]
        if not codec.properties["linear"]:
            flat.append("two_phase")
        out = [(s, "") for s in flat]
        if self.nodes(world_size) > 1:
            out += [("hierarchical", s) for s in flat]
        return out

    def choose(self, codec, numel: int, dtype: Any, world_size: int, *, local_world_size: int = 0,
               min_compress_numel: int = 0) -> dict:
        """The fastest scheme for a bucket: ``{"scheme", "inner", "predictions": [predict(...)
        for each candidate]}``. Dense unless a compressed scheme is predicted strictly faster
        (compression that does not pay is not taken); ``local_world_size`` (the compressor's)
        must match the model's for hierarchical to be a candidate."""
        preds = []
        for s, inner in self.candidates(codec, numel, dtype, world_size):
            if s == "hierarchical" and local_world_size != self.local_world_size:
                continue
            preds.append(self.predict(s, codec, numel, dtype, world_size, inner))
        best = preds[0]
        for p in preds[1:]:
            if p["total_s"] < best["total_s"]:
                best = p
        return {"scheme": best["scheme"], "inner": best["inner"], "predictions": preds}

    def describe(self) -> dict:
        return {"intra": self.intra.to_dict(), "inter": None if self.inter is None else self.inter.to_dict(),
                "local_world_size": self.local_world_size, "engine": self.engine,
                "throughput": self.throughput.name, "error_feedback": self.error_feedback}


def choice_report(choice: dict) -> str:
    """One log line of a :meth:`CostModel.choose` result: the choice and each candidate's
    predicted total / communication time in ms."""
    parts = []
    for p in choice["predictions"]:
        nm = p["scheme"] + (f"({p['inner']})" if p["inner"] else "")
        parts.append(f"{nm} {1e3 * p['total_s']:.3g} ms (comm {1e3 * p['comm_s']:.3g})")
    nm = choice["scheme"] + (f"({choice['inner']})" if choice["inner"] else "")
    return f"cost model chose {nm}: " + ", ".join(parts)


# ==============================================================================================
# A training step: buckets, bytes per link level, exposed time, required bandwidth
# ==============================================================================================

def parameter_list(model: Any) -> list:
    """``[(name, numel, dtype name)]`` of ``model``: a torch module (its parameters that require
    grad), a list of such triples, or a parameter count (int or float, one float32 tensor
    ``"params"``).

    Raises:
        ValueError: a negative or non-integral count; TypeError: anything else.
    """
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        n = int(model)
        if n != model or n < 0:
            raise ValueError(f"planner: params={model!r}; accepted: a non-negative whole number")
        return [("params", n, "float32")]
    if hasattr(model, "named_parameters"):
        return [(nm, int(p.numel()), _dtype_name(p.dtype)) for nm, p in model.named_parameters() if p.requires_grad]
    if isinstance(model, (list, tuple)):
        return [(str(nm), int(n), _dtype_name(dt)) for nm, n, dt in model]
    raise TypeError(f"planner: model of type {type(model).__name__}; accepted: a parameter count, "
                    f"a torch module, or a list of (name, numel, dtype)")


def ddp_buckets(params: list, bucket_cap_bytes: int = 25 << 20, dtype: Any = None) -> list:
    """``[(numel, dtype name)]`` of the buckets DDP would build: parameters in reverse order (the
    order gradients become ready), one bucket per dtype filled until ``bucket_cap_bytes``
    (torch's default 25 MiB) is reached; a single tensor larger than the cap is its own bucket
    cut into cap-sized buckets here (the planner's approximation of one large bucket, which DDP
    keeps whole; the bytes are the same). ``dtype`` overrides every parameter's dtype (the
    gradient dtype, e.g. bfloat16)."""
    cap = int(bucket_cap_bytes)
    if cap <= 0:
        raise ValueError(f"planner: bucket_cap_bytes={bucket_cap_bytes}; accepted: > 0")
    open_: Dict[str, int] = {}
    out = []
    for _, n, dt in reversed(params):
        dt = _dtype_name(dtype) if dtype is not None else dt
        es = dtype_bytes(dt)
        per = max(1, cap // es)
        while n > 0:
            cur = open_.get(dt, 0)
            take = min(n, per - cur)
            cur += take
            n -= take
            if cur >= per:
                out.append((cur, dt))
                cur = 0
            open_[dt] = cur
    out += [(cur, dt) for dt, cur in open_.items() if cur]
    return out


def plan_step(params: list, codec, world_size: int, cost_model: CostModel, scheme: str = "auto", *,
              dtype: Any = None, accumulate: int = 1, step_time_s: Optional[float] = None,
              backward_s: Optional[float] = None, bucket_cap_bytes: int = 25 << 20,
              min_compress_numel: int = 1024) -> dict:
    """Predict one optimizer step's gradient synchronization.

    Args:
        params: :func:`parameter_list` triples. codec: a :class:`gradcomp.Codec` (``none`` for
            the uncompressed baseline). world_size: W. cost_model: links, nodes, kernel times.
        scheme: ``"auto"`` (the cost model's choice per bucket) or one of :data:`ALL_SCHEMES`.
        dtype: the gradient dtype (default each parameter's). accumulate: K micro-batches per
            synchronization (gradient accumulation; K steps of compute per exchange).
        step_time_s: the compute time of one micro-batch (forward + backward), for the required
            bandwidth and the step time. backward_s: backward time the last micro-batch's
            communication overlaps with (None: no overlap).

    Returns a dict: ``gradient_bytes`` (the dense gradient, whatever W), ``buckets`` (per distinct
    bucket: numel, dtype, ``count`` (how many buckets have them) and the chosen
    :meth:`CostModel.predict`), ``bytes`` (bytes one rank sends per
    synchronization per link level, ``{"intra", "inter"}``), ``bytes_per_micro_batch`` (the same
    / K), ``comm_s`` / ``encode_s`` / ``decode_s`` / ``sync_s`` (sums over buckets),
    ``exposed_s`` (no overlap: sync_s) and ``exposed_overlap_s`` (max(sync_s - backward_s, the
    last bucket's time): the first bucket waits for backward's end), ``required_bytes_per_s`` /
    ``required_bits_per_s`` (gradient_bytes / (K step_time_s): the rate at which gradients are
    produced), ``step_s`` (K step_time_s + exposed_overlap_s, None without step_time_s).

    Raises:
        ValueError: accumulate < 1; as :meth:`CostModel.predict`.
    """
    K = int(accumulate)
    if K < 1:
        raise ValueError(f"planner: accumulate={accumulate}; accepted: an int >= 1")
    W = int(world_size)
    L = cost_model.local_world_size
    rows = []
    tot = {"comm_s": 0.0, "encode_s": 0.0, "decode_s": 0.0}
    by = {"intra": 0.0, "inter": 0.0}
    grad = 0
    buckets = ddp_buckets(params, bucket_cap_bytes, dtype)
    counts: Dict[Tuple[int, str], int] = {}
    for b in buckets:  # equal buckets predict alike: predict each distinct one once
        counts[b] = counts.get(b, 0) + 1
    last = 0.0
    for (n, dt), times in counts.items():
        grad += times * dense_bytes(n, dt)
        s = choose_scheme(codec, n, dt, W, scheme, min_compress_numel, cost_model=cost_model, local_world_size=L)
        inner = ""
        if s == "hierarchical":
            inner = hierarchical_inner(codec, n, dt, W, L, "auto", min_compress_numel, cost_model=cost_model)
        p = cost_model.predict(s, codec, n, dt, W, inner)
        rows.append({"numel": n, "dtype": dt, "count": times, **p})
        for f in tot:
            tot[f] += times * p[f]
        for lv in by:
            by[lv] += times * p["bytes"][lv]
        if (n, dt) == buckets[-1]:
            last = p["total_s"]
    sync = tot["comm_s"] + tot["encode_s"] + tot["decode_s"]
    overlap = sync if backward_s is None else max(sync - float(backward_s), last)
    out = {"gradient_bytes": grad, "world_size": W, "codec": codec.spec, "scheme": scheme,
           "accumulate": K, "buckets": rows, "bytes": by,
           "bytes_per_micro_batch": {lv: v / K for lv, v in by.items()}, **tot, "sync_s": sync,
           "exposed_s": sync, "exposed_overlap_s": overlap,
           "required_bytes_per_s": None, "required_bits_per_s": None, "step_s": None}
    if step_time_s is not None:
        rate = grad / (K * float(step_time_s))
        out.update(required_bytes_per_s=rate, required_bits_per_s=8 * rate,
                   step_s=K * float(step_time_s) + overlap)
    return out


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
    none = _NoneCodec()
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


class _NoneCodec:
    """The ``none`` codec's byte facts without the native module (the planner's own figures need
    no build): spec ``none``, linear, packet = 32-byte header + the elements padded to 16."""

    spec = "none"
    properties = {"linear": True, "sparse": False}

    def packet_bytes(self, numel, dtype):
        return 32 + -(-dense_bytes(numel, dtype) // 16) * 16

    def payload(self, numel, dtype):
        return (0, int(numel), _dtype_name(dtype))
