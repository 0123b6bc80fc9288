"""The one home of gradcomp's byte formulas and of the ``auto`` scheme choice.

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

from typing import Any, Dict, Mapping, Tuple

from .codec import _dtype_name

SCHEMES = ("dense", "sum", "gather", "two_phase")
"""The schemes the planner can account for (``"auto"`` resolves to one of them)."""

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


def bucket_bytes(scheme: str, codec, numel: int, dtype: Any, world_size: int) -> Dict[str, float]:
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

    Raises:
        ValueError: an unknown scheme, or ``sum`` with a non-linear codec.
    """
    dense = dense_bytes(numel, dtype)
    ring = ring_allreduce_bytes(dense, world_size)
    if scheme == "dense":
        return {"dense_bytes": dense, "packet_bytes": dense, "sent_bytes": ring, "ring_bytes": ring}
    if scheme not in SCHEMES:
        raise ValueError(f"planner: scheme={scheme!r}; accepted: {', '.join(SCHEMES)}")
    if scheme == "two_phase":
        p1, p2 = two_phase_slots(codec, numel, dtype, world_size)
        W = int(world_size)
        return {"dense_bytes": dense, "packet_bytes": W * p1,
                "sent_bytes": float(all_gather_bytes(p1, W) + all_gather_bytes(p2, W)), "ring_bytes": ring}
    packet = int(codec.packet_bytes(numel, dtype))
    if scheme == "sum":
        sent = ring_allreduce_bytes(payload_bytes(codec, numel, dtype), world_size)
    else:
        sent = float(all_gather_bytes(packet, world_size))
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
                  min_compress_numel: int = 1024) -> str:
    """The scheme a bucket of ``numel`` elements of ``dtype`` takes once compression is on.

    Rule, in order:
      1. ``"dense"`` when ``numel == 0`` or ``numel < min_compress_numel``;
      2. ``requested`` when it is not ``"auto"``;
      3. ``"sum"`` for a linear codec (``codec.properties["linear"]``);
      4. for a sparse codec (``codec.properties["sparse"]``, top-k): ``"gather"`` when it sends
         fewer bytes than a dense ring allreduce, approximated as ``W * packet_bytes < 2 *
         dense_bytes`` (i.e. (W-1) P vs 2 (W-1)/W D, both scaled by W/(W-1)); else ``"dense"``;
      5. for the other codecs (the quantizers): ``"two_phase"`` when it sends fewer bytes than a
         dense ring allreduce, (W-1) (P1 + P2) < 2 (W-1)/W D, evaluated in integers as
         ``W * (P1 + P2) < 2 * dense_bytes`` (:func:`two_phase_slots`; with P1 = P2 = P:
         W P < D), which never holds for W = 1; else ``"dense"``.
    Inputs are all rank-shared, so every rank chooses alike.

    Raises:
        ValueError: ``requested`` is not ``"auto"`` or one of ``SCHEMES``.
    """
    if requested != "auto" and requested not in SCHEMES:
        raise ValueError(f"planner: scheme={requested!r}; accepted: auto, {', '.join(SCHEMES)}")
    if numel < min_compress_numel or numel == 0:
        return "dense"
    if requested != "auto":
        return requested
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
    numel}``, each NaN when its denominator is 0.
    """
    def ratio(a, b):
        return a / b if b else float("nan")

    return {"packet_ratio": ratio(totals["packet_bytes"], totals["dense_bytes"]),
            "wire_ratio": ratio(totals["sent_bytes"], totals["ring_bytes"]),
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
