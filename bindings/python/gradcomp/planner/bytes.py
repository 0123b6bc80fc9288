"""Byte formulas of :mod:`gradcomp.planner`: element sizes, the ring collectives' byte counts, the
bytes of one bucket under each scheme (dense, sum, gather, two_phase, hierarchical), the 1-bit
allreduce and PowerSGD, the ratios of summed counts, and the compulsory memory traffic of an encode
and a decode (the floor ``gradcomp-bench`` divides by copy bandwidth). The formulas and their
sources are in :mod:`gradcomp.planner`'s docstring. Pure functions of rank-shared inputs.
"""

from typing import Any, Dict, List, Mapping, Tuple

from ..codec import _dtype_name
from . import schemes as _schemes


def __getattr__(name: str):
    """``SCHEMES`` (the flat schemes: one ring over the whole group; ``"auto"`` resolves to one
    of them, or to a non-flat one such as ``"hierarchical"`` when a cost model with more than
    one node says so) and ``ALL_SCHEMES`` (every scheme :func:`bucket_bytes` accounts for), in
    the order of the scheme table (:mod:`gradcomp.planner.schemes`), read when asked for."""
    if name == "SCHEMES":
        return _schemes.names(flat=True)
    if name == "ALL_SCHEMES":
        return _schemes.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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

    Each scheme's ``steps`` and ``packet_bytes`` (the scheme table, :mod:`gradcomp.planner.
    schemes`) give these numbers; a scheme whose steps are on link levels (``"intra"`` /
    ``"inter"``, not ``"flat"``) also gets ``intra_bytes`` / ``inter_bytes``.

    Raises:
        ValueError: an unknown scheme, or ``sum`` with a non-linear codec; hierarchical without
            a valid ``local_world_size`` / ``inner``.
    """
    desc = _schemes.get(scheme)
    opts = desc.options(local_world_size=local_world_size, inner=inner, engine=engine)
    steps = desc.steps(codec, numel, dtype, world_size, **opts)
    dense = dense_bytes(numel, dtype)
    out = {"dense_bytes": dense, "packet_bytes": int(desc.packet_bytes(codec, numel, dtype, world_size, **opts))}
    if any(st[0] != "flat" for st in steps) or not desc.flat:  # by link level
        intra = sum(st[4] for st in steps if st[0] == "intra")
        inter = sum(st[4] for st in steps if st[0] == "inter")
        out.update(sent_bytes=intra + inter, ring_bytes=ring_allreduce_bytes(dense, world_size),
                   intra_bytes=intra, inter_bytes=inter)
    else:
        out.update(sent_bytes=float(sum(st[4] for st in steps)), ring_bytes=ring_allreduce_bytes(dense, world_size))
    return out


def onebit_slot_bytes(chunk_numel: int) -> int:
    """The all-to-all slot of DeepSpeed's 1-bit allreduce for a chunk of ``chunk_numel`` = C
    elements (a multiple of 8): its sign bits and the sender's float32 scale, C / 8 + 4 bytes
    (:mod:`gradcomp.schemes.onebit_allreduce` sends these; :func:`onebit_allreduce_bytes` counts them)."""
    return int(chunk_numel) // 8 + 4


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
    return float(all_gather_bytes(onebit_slot_bytes(C), W) + all_gather_bytes(int(codec.packet_bytes(C, "float32")), W))


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
# FSDP2's reduce-scatter: the shard layout and the compressed all-to-all slot
# ==============================================================================================

PEER_CHECK_BYTES = 256
"""Bytes of one rank's call descriptor (:class:`gradcomp.schemes.check.PeerCheck`: 32 int64
words), all-gathered once per step by the compressor beside its first collective (and at once
for a call whose layout is new)."""

FSDP_TRAILER_BYTES = 16
"""The trailer at the end of every slot of the compressed FSDP2 reduce-scatter
(:mod:`gradcomp.schemes.reduce_scatter`): byte 0 is the sender's non-finite flag (1: some element
the sender encoded or sent raw, in any row, was NaN or +-inf), the other 15 bytes are zero."""


def fsdp_shard_rows(numel: int, dim0: int, world_size: int, index: int) -> Tuple[int, int]:
    """Shard ``index`` of a parameter of ``numel`` elements whose dim 0 has ``dim0`` rows, cut
    by FSDP2 (``fully_shard``, Shard(0)) over W ranks as ``torch.chunk`` cuts it: c = ceil(dim0 /
    W) rows per rank, rank j holds rows [j c, min(dim0, (j+1) c)) (the last ranks fewer, possibly
    none), padded to c rows in the reduce-scatter input. A 0-dim parameter counts as one row.

    Returns ``(count, padded)`` in elements: the rows rank ``index`` holds times the elements per
    row, and ``c`` times the elements per row (every rank's padded shard, ``padded_sharded_param_size``).

    Raises:
        ValueError: ``index`` outside [0, W), dim0 < 1 for a non-empty parameter, or dim0 not
            dividing numel.
    """
    n, d0, W, j = int(numel), max(1, int(dim0)), int(world_size), int(index)
    if not 0 <= j < W:
        raise ValueError(f"planner: shard index {j} outside [0, {W})")
    if n % d0:
        raise ValueError(f"planner: a parameter of {n} elements cannot have {d0} rows in dim 0")
    per_row = n // d0
    c = -(-d0 // W)
    rows = max(0, min(c, d0 - j * c))
    return rows * per_row, c * per_row


def fsdp_slot(codec, rows, dtype: Any) -> Dict[str, int]:
    """The all-to-all slot of the compressed FSDP2 reduce-scatter for one call, in bytes.

    ``rows`` = ``[(compressed, exempt)]`` for the W rows of the reduce-scatter input (row j: the
    elements of rank j's shard, compressed or exempt, without FSDP's padding). Slot j (what this
    rank sends rank j) holds, at fixed offsets: the codec's packet of row j's compressed elements
    (``codec.packet_bytes(compressed_j, dtype)``; nothing when there are none) at 0, the exempt
    elements raw in ``dtype`` at ``exempt_offset`` and the :data:`FSDP_TRAILER_BYTES` trailer at
    ``trailer_offset``; every region is as large as its largest row needs, 16-byte aligned, and
    the rest is zero. Returns ``{"packet", "exempt_offset", "trailer_offset", "slot"}``:
    ``packet`` the packet region (max over rows), ``slot`` the whole slot.
    """
    es = dtype_bytes(dtype)
    pk = max([int(codec.packet_bytes(c, dtype)) if c else 0 for c, _ in rows] or [0])
    ex = max([int(e) * es for _, e in rows] or [0])
    ex = -(-ex // 16) * 16
    return {"packet": pk, "exempt_offset": pk, "trailer_offset": pk + ex, "slot": pk + ex + FSDP_TRAILER_BYTES}


def fsdp_reduce_scatter_bytes(codec, rows, dtype: Any, padded_numel: int) -> Dict[str, float]:
    """Byte accounting of one compressed FSDP2 reduce-scatter call over W = ``len(rows)`` ranks
    (``rows`` as :func:`fsdp_slot`; ``padded_numel`` N, FSDP's input of ``dtype``, W padded
    shards): ``{"dense_bytes": N elements, "packet_bytes": W slots (what this rank encodes into),
    "sent_bytes": (W-1) slots (one all-to-all; a rank keeps its own slot), "ring_bytes": (W-1)/W
    of the dense input (what a ring reduce-scatter sends)}``."""
    W = len(rows)
    slot = fsdp_slot(codec, rows, dtype)["slot"]
    dense = dense_bytes(padded_numel, dtype)
    return {"dense_bytes": dense, "packet_bytes": W * slot, "sent_bytes": float((W - 1) * slot),
            "ring_bytes": (W - 1) / W * dense if W else 0.0}


def fsdp_exempt(numel: int, ndim: int, min_compress_numel: int = 1024) -> bool:
    """Whether a parameter of ``numel`` elements and ``ndim`` dimensions travels raw in the
    compressed FSDP2 reduce-scatter (and dense in HSDP's compressed replica all-reduce): fewer
    than 2 dimensions (biases, norms' weights) or fewer than ``min_compress_numel`` elements."""
    return int(ndim) < 2 or int(numel) < int(min_compress_numel)


def fsdp_rows(params, world_size: int, min_compress_numel: int = 1024) -> Tuple[list, int]:
    """The rows of one FSDP unit's reduce-scatter input over W ranks.

    ``params`` = ``[(numel, shape)]`` in elements (``shape`` a tuple of ints; its first entry is
    dim 0, a 0-dim parameter counts as one row; :func:`fsdp_shard_rows`). Returns ``(rows,
    padded_numel)``: ``rows`` = ``[(compressed_j, exempt_j)]`` for j in 0..W-1, the elements of
    rank j's shard of the compressed and of the exempt (:func:`fsdp_exempt`) parameters, without
    padding (what :func:`fsdp_slot` takes); ``padded_numel`` N = W times the sum of the padded
    shards (the reduce-scatter input, elements).
    """
    W = int(world_size)
    rows = [[0, 0] for _ in range(W)]
    padded = 0
    for numel, shape in params:
        shape = tuple(int(d) for d in shape)
        dim0 = shape[0] if shape else 1
        ex = 1 if fsdp_exempt(numel, len(shape), min_compress_numel) else 0
        for j in range(W):
            count, pad = fsdp_shard_rows(numel, dim0, W, j)
            rows[j][ex] += count
        padded += pad if W else 0
    return [tuple(r) for r in rows], W * padded


def level_bytes(kind: str, sent_bytes: float, world_size: int, local_world_size: int, *,
                one_rank_per_node: bool = False) -> Dict[str, float]:
    """Where the ``sent_bytes`` one rank sends in one collective over W ranks go, for nodes of
    L = ``local_world_size`` consecutive ranks (rank r on node r // L).

    Returns ``{"intra": bytes a rank sends inside its node, "inter": bytes a rank sends into the
    network, "node_inter": bytes one node sends into the network}``:
      - one node (L = 0 or L >= W): everything intra; nothing leaves the node;
      - ``one_rank_per_node`` (a group of W ranks on W nodes, while each of a node's L ranks runs
        its own group at once: HSDP's replica all-reduce): inter = ``sent_bytes``, node_inter =
        L ``sent_bytes``;
      - ``"all_to_all"`` over nodes: of a rank's W - 1 slots, W - L go to other nodes: inter =
        (W-L)/(W-1), intra = (L-1)/(W-1) of ``sent_bytes``; node_inter = L inter (every rank of
        the node sends its slots off the node);
      - a ring (``"allreduce"``, ``"reduce_scatter"``, ``"all_gather"``) in rank order over
        nodes: each node has one rank whose successor is on the next node, and it sends its
        whole volume there: inter = ``sent_bytes`` (that rank: the busiest, the planner's
        convention for a flat ring, :meth:`gradcomp.planner.CostModel.predict`), node_inter =
        ``sent_bytes`` (one rank's volume per node).
    So an all-to-all puts L (W-L)/(W-1) times the bytes of a ring of the same volume into the
    network per node: 7.89x at L = 8, W = 512, tending to L (the review of ByteDance VeOmni PR
    #1167 measured an all-to-all reduce-scatter across nodes at about 8x the ring's inter-node
    bytes).

    Raises:
        ValueError: an unknown collective, or L not dividing W over several nodes.
    """
    W, L = int(world_size), int(local_world_size)
    kinds = ("allreduce", "reduce_scatter", "all_gather", "all_to_all")
    if kind not in kinds:
        raise ValueError(f"planner: collective {kind!r}; accepted: {', '.join(kinds)}")
    s = float(sent_bytes)
    if one_rank_per_node:
        return {"intra": 0.0, "inter": s, "node_inter": max(L, 1) * s}
    if L <= 0 or L >= W:
        return {"intra": s, "inter": 0.0, "node_inter": 0.0}
    if W % L:
        raise ValueError(f"planner: local_world_size={L} does not divide the world size {W}; accepted: a divisor")
    if kind == "all_to_all":
        inter = s * (W - L) / (W - 1)
        return {"intra": s * (L - 1) / (W - 1), "inter": inter, "node_inter": L * inter}
    return {"intra": 0.0, "inter": s, "node_inter": s}


# ==============================================================================================
# Steps of a scheme, and the hierarchical scheme's groups
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


def hierarchical_steps(codec, numel: int, dtype: Any, world_size: int, local_world_size: int,
                       inner: str, engine: str = "nccl"):
    """The collectives of one bucket under ``hierarchical`` (the steps of
    :func:`gradcomp.schemes.hierarchical.hierarchical_steps`, read from the scheme table), as
    ``[(level, collective, nbytes, ranks, sent_bytes)]`` with level ``"intra"`` or ``"inter"``."""
    return _schemes.get("hierarchical").steps(codec, numel, dtype, world_size, local_world_size=local_world_size,
                                              inner=inner, engine=engine)


def scheme_steps(scheme: str, codec, numel: int, dtype: Any, world_size: int, **options):
    """The collectives one rank issues for a bucket of ``numel`` elements of ``dtype`` under
    ``scheme``, ``[(level, collective, nbytes, ranks, sent_bytes)]`` (the scheme's ``steps``
    from the scheme table; level ``"flat"`` for a ring over the whole group; ``nbytes`` is the
    buffer of an allreduce / reduce-scatter, one rank's part of an all-gather, one slot of an
    all-to-all). Empty for W = 1. ``options``: the scheme's layout options (hierarchical:
    ``local_world_size``, ``inner``, ``engine``).

    Raises:
        ValueError: an unknown scheme (the accepted names are in the message).
    """
    return _schemes.get(scheme).steps(codec, numel, dtype, world_size, **options)


_RING_COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")


def traffic_matrix(steps, world_size: int, local_world_size: int = 0) -> List[List[float]]:
    """Bytes each rank sends to each other rank in the collectives ``steps`` (``[(level,
    collective, nbytes, ranks, sent_bytes)]``, what :func:`scheme_steps` returns for one bucket;
    every rank of a step's group sends its ``sent_bytes``), as the cost model runs them:

      - the group of a step: ``"flat"`` all W ranks; ``"intra"`` the L ranks of a node (rank r
        on node r // L); ``"inter"`` the ranks of one local rank (r % L), one per node;
      - a ring collective (allreduce, reduce_scatter, all_gather) sends all of a rank's
        ``sent_bytes`` to its successor in the group (members in rank order, the last one's
        successor the first);
      - an ``all_to_all`` splits them evenly over the group's other members.

    Returns a W x W list of floats, ``M[i][j]`` = bytes rank i sends to rank j (``M[i][i]`` = 0;
    each row sums to the ranks' total ``sent_bytes``). For W = 2 every model agrees: each rank
    sends everything to the other.

    Raises:
        ValueError: an unknown level or collective; an ``"intra"`` / ``"inter"`` step without a
            ``local_world_size`` dividing W.
    """
    W, L = int(world_size), int(local_world_size)
    M = [[0.0] * W for _ in range(W)]
    for level, kind, _, _, sent in steps:
        if level == "flat":
            groups = [list(range(W))]
        elif level in ("intra", "inter"):
            nodes, L = hierarchical_groups(W, L)
            groups = ([[n * L + i for i in range(L)] for n in range(nodes)] if level == "intra" else
                      [[n * L + i for n in range(nodes)] for i in range(L)])
        else:
            raise ValueError(f"planner: link level {level!r}; accepted: flat, intra, inter")
        if kind not in _RING_COLLECTIVES and kind != "all_to_all":
            raise ValueError(f"planner: collective {kind!r}; accepted: {', '.join(_RING_COLLECTIVES)}, all_to_all")
        for g in groups:
            p = len(g)
            if p < 2:
                continue
            for k, src in enumerate(g):
                if kind == "all_to_all":
                    for dst in g:
                        if dst != src:
                            M[src][dst] += float(sent) / (p - 1)
                else:
                    M[src][g[(k + 1) % p]] += float(sent)
    return M


def hierarchical_bytes(codec, numel: int, dtype: Any, world_size: int, local_world_size: int,
                       inner: str, engine: str = "nccl") -> Dict[str, float]:
    """Byte accounting of one bucket under ``hierarchical``: :func:`bucket_bytes` with its
    options, the four fields plus ``intra_bytes`` and ``inter_bytes`` (bytes one rank sends
    inside its node and across nodes; ``sent_bytes`` is their sum). ``packet_bytes`` is this
    rank's inter-node packet (the inner scheme's for one float32 chunk over the N nodes)."""
    return bucket_bytes("hierarchical", codec, numel, dtype, world_size, local_world_size=local_world_size,
                        inner=inner, engine=engine)


# ==============================================================================================
# Compulsory memory traffic of a codec's kernels (the cost model's and gradcomp-bench's floor)
# ==============================================================================================

def encode_traffic_bytes(numel: int, dtype: Any, packet_bytes: int, error_feedback: bool) -> int:
    """Compulsory memory traffic of an encode in bytes: the input read (``numel`` elements of
    ``dtype``) plus the packet written, plus, with error feedback, the float32 residual read and
    written (8 bytes per element). The floor ``gradcomp-bench`` divides by copy bandwidth."""
    return dense_bytes(numel, dtype) + int(packet_bytes) + (8 * int(numel) if error_feedback else 0)


def decode_traffic_bytes(numel: int, dtype: Any, packet_bytes: int) -> int:
    """Compulsory memory traffic of a decode (assign mode) in bytes: the packet read plus the
    ``numel`` output elements of ``dtype`` written."""
    return int(packet_bytes) + dense_bytes(numel, dtype)
