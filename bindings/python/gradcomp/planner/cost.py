"""The cost model of :mod:`gradcomp.planner`: link rates (:func:`parse_rate`), link levels
(:class:`Link`, :data:`LINK_LEVELS`), alpha-beta collective times (:func:`collective_time`), a CPU
host's collective engine (:class:`EngineCost`, calibrated from unshaped timings), codec
kernel times (:class:`Throughput`, from a ``gradcomp-bench`` table read by
:mod:`gradcomp.planner.table` or from a memory bandwidth) and the predicted time of one bucket under
each scheme with the fastest (:class:`CostModel`).
"""

from typing import Any, Optional, Tuple

from ..codec import _dtype_name
from . import schemes as _schemes
from .bytes import PEER_CHECK_BYTES, decode_traffic_bytes, encode_traffic_bytes, scheme_steps
from .table import throughput as _table_throughput


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
ENGINE_LEVELS = ("flat", "intra", "inter")
"""The group shapes a :class:`CostModel` may hold an :class:`EngineCost` for: the W ranks
(``flat``), a node's ranks (``intra``) and one rank per node (``inter``)."""

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

    ``burst_bytes`` (default 0): a token-bucket link (``tc``'s tbf, a cloud NIC's burst
    allowance) lends an idle link this many bytes at once: a collective that starts on it sends
    its first ``burst_bytes`` (of all the bytes through the bucket: the group's on a ``shared``
    link) without waiting for the rate (:func:`collective_time`).

    Raises:
        ValueError: beta <= 0, alpha < 0, burst < 0, or both shared and per_node.
    """

    __slots__ = ("bytes_per_s", "latency_s", "shared", "per_node", "name", "burst_bytes")

    def __init__(self, bytes_per_s: float, latency_s: float = 0.0, shared: bool = False, name: str = "",
                 per_node: bool = False, burst_bytes: float = 0.0):
        if not float(bytes_per_s) > 0:
            raise ValueError(f"planner: Link bytes_per_s={bytes_per_s}; accepted: > 0 (inf allowed)")
        if not float(latency_s) >= 0:
            raise ValueError(f"planner: Link latency_s={latency_s}; accepted: >= 0")
        if shared and per_node:
            raise ValueError("planner: a Link is shared (one medium for the group) or per_node, not both")
        if not float(burst_bytes) >= 0:
            raise ValueError(f"planner: Link burst_bytes={burst_bytes}; accepted: >= 0")
        self.burst_bytes = float(burst_bytes)
        self.bytes_per_s, self.latency_s = float(bytes_per_s), float(latency_s)
        self.shared, self.per_node, self.name = bool(shared), bool(per_node), str(name)

    @classmethod
    def parse(cls, rate: Any, latency_s: float = 0.0, shared: bool = False, name: str = "",
              per_node: bool = False, burst_bytes: float = 0.0) -> "Link":
        """A Link from a rate string (:func:`parse_rate`)."""
        return cls(parse_rate(rate), latency_s, shared, name or str(rate), per_node, burst_bytes)

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes_per_s": self.bytes_per_s, "bits_per_s": 8 * self.bytes_per_s,
                "latency_s": self.latency_s, "shared": self.shared, "per_node": self.per_node,
                "burst_bytes": self.burst_bytes}

    def __repr__(self) -> str:
        kind = ", shared" if self.shared else ", per node" if self.per_node else ""
        burst = f", burst {self.burst_bytes:g} B" if self.burst_bytes else ""
        return (f"Link({self.name or 'link'}: {8 * self.bytes_per_s / 1e9:g} Gb/s, alpha {self.latency_s:g} s"
                f"{kind}{burst})")


LINK_LEVELS = {
    # per GPU, one direction: NVLink 4 (H100/H200 SXM, 900 GB/s bidirectional), PCIe 5 x16,
    # a 400 Gb/s NIC per GPU (rail-optimized clusters); latencies as NCCL's tuning tables assume.
    "nvlink": Link(450e9, 2e-6, name="nvlink"),
    "pcie": Link(50e9, 5e-6, name="pcie"),
    "network": Link(50e9, 10e-6, name="network"),
}
"""Default link levels (bytes/s per rank, latency s); ``--link-gbps LEVEL=GBPS`` overrides."""


def _ring_messages(kind: str, p: int) -> int:
    """Sequential messages of a collective of ``kind`` over ``p`` ranks: 2 (p-1) for a ring
    allreduce, p-1 for the others (Thakur, Rabenseifner & Gropp, IJHPCA 2005, section 2)."""
    return 2 * (p - 1) if kind == "allreduce" else p - 1


def collective_time(kind: str, nbytes: float, ranks: int, link: Link, load: float = 1.0,
                    engine: Optional["EngineCost"] = None) -> float:
    """Seconds of one collective (the alpha-beta formulas above) of ``nbytes`` (the buffer of an
    allreduce / reduce-scatter; one rank's part of an all-gather; one slot of an all-to-all) over
    ``ranks`` ranks on ``link``; ``load`` scales the volume term (how many ranks' volumes cross a
    ``per_node`` link at once, :meth:`CostModel.predict`). With an ``engine``
    (:class:`EngineCost`, a CPU host's collective engine) the time is the slower of the link's
    and the engine's: ``max(msgs alpha + load vol / beta, engine.fixed_s(kind, ranks) + vol /
    engine.rate(kind))``, the fixed time ``per_collective_s + steps latency_s`` with ``steps``
    the ring's sequential messages (``msgs``), but 1 for an all-to-all (gloo posts its W-1 sends
    at once, then waits), or the kind's measured fixed time (:meth:`EngineCost.fixed_s`).
    The two overlap: gloo's threads do their per-collective and per-byte work (wake-ups, socket
    copies, the sum) while earlier segments are on the wire. 0.0 for ranks < 2.

    Raises:
        ValueError: an unknown collective.
    """
    p = int(ranks)
    if kind not in COLLECTIVES:
        raise ValueError(f"planner: collective {kind!r}; accepted: {', '.join(COLLECTIVES)}")
    if p < 2:
        return 0.0
    beta = link.bytes_per_s / (p if link.shared else 1)
    msgs = _ring_messages(kind, p)
    vol = {"allreduce": 2.0 * (p - 1) / p * nbytes, "reduce_scatter": (p - 1) / p * nbytes,
           "all_gather": (p - 1) * nbytes, "all_to_all": (p - 1) * nbytes}[kind]
    paced = vol
    if vol and link.burst_bytes and load > 0:  # the bucket's loan, of the bytes through it (p senders' if shared)
        paced = max(0.0, vol - link.burst_bytes / (load * (p if link.shared else 1)))
    t_link = msgs * link.latency_s + (load * paced / beta if paced else 0.0)
    if engine is None:
        return t_link
    return max(t_link, engine.fixed_s(kind, p) + (vol / engine.rate(kind) if vol else 0.0))


class EngineCost:
    """The time a collective engine takes on a CPU host, whatever the link:
    ``per_collective_s`` (s, once per collective: waking the ranks' threads, gloo's bookkeeping;
    on an oversubscribed host, the scheduler), ``latency_s`` (alpha, s per message of the ring)
    and ``bytes_per_s`` (the rate the engine moves and reduces a collective's volume at: copies
    through the socket and the element-wise sum; the ceiling of an unshaped loopback).
    ``kind_bytes_per_s`` (optional): the rate of a collective kind that moves its volume at
    another rate, e.g. ``{"all_gather": 0.4e9}`` (gloo's all-gather copies every rank's part
    into the output, where an allreduce sums in place); :meth:`rate` gives a kind's rate.
    ``kind_fixed_s`` (optional): the measured fixed time (s) of a collective kind whose
    wake-ups and messages the ring's count does not describe, at the group size this cost
    describes, e.g. ``{"all_to_all": 2.0e-3}`` (gloo posts an all-to-all's p-1 sends at once and
    then waits on all of them); :meth:`fixed_s` gives a kind's fixed time.
    :func:`collective_time` takes the slower of this and the link's alpha-beta time.

    The model is Hockney's latency-bandwidth one (alpha + n / beta) applied to the engine's
    own work, with the ring's sequential messages of Thakur, Rabenseifner & Gropp (IJHPCA 2005,
    section 2) as the latency count. :meth:`calibrate` derives the figures from unshaped timings
    of one group shape (``bench/slow_link.py`` measures them once per run, setup and group
    shape: the W ranks, and on two nodes also ``hierarchical``'s groups inside and across the
    nodes, each with its sibling groups running at once; bench/RESULTS.md has how well the model
    then predicts its shaped rows, and where it misses).

    Raises:
        ValueError: per_collective_s < 0, latency_s < 0, bytes_per_s <= 0, a
            ``kind_bytes_per_s`` key that is not a collective or a rate <= 0, or a
            ``kind_fixed_s`` key that is not a collective or a time < 0.
    """

    __slots__ = ("per_collective_s", "bytes_per_s", "latency_s", "kind_bytes_per_s", "kind_fixed_s")

    def __init__(self, per_collective_s: float, bytes_per_s: float, latency_s: float = 0.0,
                 kind_bytes_per_s: Optional[dict] = None, kind_fixed_s: Optional[dict] = None):
        if not float(per_collective_s) >= 0:
            raise ValueError(f"planner: EngineCost per_collective_s={per_collective_s}; accepted: >= 0")
        if not float(bytes_per_s) > 0:
            raise ValueError(f"planner: EngineCost bytes_per_s={bytes_per_s}; accepted: > 0 (inf allowed)")
        if not float(latency_s) >= 0:
            raise ValueError(f"planner: EngineCost latency_s={latency_s}; accepted: >= 0")
        kinds = {}
        for k, v in (kind_bytes_per_s or {}).items():
            if k not in COLLECTIVES:
                raise ValueError(f"planner: EngineCost kind_bytes_per_s key {k!r}; accepted: {', '.join(COLLECTIVES)}")
            if not float(v) > 0:
                raise ValueError(f"planner: EngineCost kind_bytes_per_s[{k!r}]={v}; accepted: > 0 (inf allowed)")
            kinds[k] = float(v)
        fixed = {}
        for k, v in (kind_fixed_s or {}).items():
            if k not in COLLECTIVES:
                raise ValueError(f"planner: EngineCost kind_fixed_s key {k!r}; accepted: {', '.join(COLLECTIVES)}")
            if not float(v) >= 0:
                raise ValueError(f"planner: EngineCost kind_fixed_s[{k!r}]={v}; accepted: >= 0 (seconds)")
            fixed[k] = float(v)
        self.per_collective_s, self.bytes_per_s = float(per_collective_s), float(bytes_per_s)
        self.latency_s, self.kind_bytes_per_s, self.kind_fixed_s = float(latency_s), kinds, fixed

    def rate(self, kind: str) -> float:
        """Bytes/s of volume for a collective of ``kind``: its own rate when given, else
        ``bytes_per_s``."""
        return self.kind_bytes_per_s.get(kind, self.bytes_per_s)

    def fixed_s(self, kind: str, ranks: int) -> float:
        """Seconds of a collective of ``kind`` over ``ranks`` ranks before its volume: the
        kind's measured ``kind_fixed_s`` when given (whatever ``ranks``: it was measured at the
        group size this cost describes), else ``per_collective_s + steps latency_s``, steps the
        ring's sequential messages (2 (p-1) for an allreduce, p-1 for a reduce-scatter or an
        all-gather) and 1 for an all-to-all (gloo posts its p-1 sends at once, then waits)."""
        if kind not in COLLECTIVES:
            raise ValueError(f"planner: collective {kind!r}; accepted: {', '.join(COLLECTIVES)}")
        if kind in self.kind_fixed_s:
            return self.kind_fixed_s[kind]
        steps = 1 if kind == "all_to_all" else _ring_messages(kind, int(ranks))
        return self.per_collective_s + steps * self.latency_s

    @classmethod
    def calibrate(cls, world_size: int, small_allreduce_s: float, small_all_gather_s: float,
                  large_allreduce_s: float, large_allreduce_bytes: float, *,
                  large_all_gather: Optional[Tuple[float, float]] = None,
                  small_all_to_all_s: Optional[float] = None) -> "EngineCost":
        """The engine cost of a group of W = ``world_size`` ranks from unshaped timings
        (seconds; expected times, i.e. means over many calls, not medians: the model adds up a
        step's collectives, and where a collective's time is skewed, as on an oversubscribed
        host, the sum of many tends to the sum of their means):

          - ``small_allreduce_s``: an allreduce of 2W float32 elements (every rank's ring
            segment holds data, unlike a 1-element one, which gloo sends as a shorter exchange):
            per_collective + 2 (W-1) alpha;
          - ``small_all_gather_s``: an all-gather of a few bytes per rank: per_collective +
            (W-1) alpha;
          - ``large_allreduce_s``: an allreduce of ``large_allreduce_bytes`` (B): the small one
            plus 2 (W-1)/W B / bytes_per_s;
          - optional, ``large_all_gather=(seconds, P)``: an all-gather of P bytes per rank: the
            small all-gather plus (W-1) P / the all-gather's rate;
          - optional, ``small_all_to_all_s``: an all-to-all of a few bytes per slot: the
            all-to-all's fixed time (``kind_fixed_s["all_to_all"]``; without it the fixed time
            is per_collective + alpha, inferred from the other two kinds).

        Solves alpha = (small_allreduce - small_all_gather) / (W-1) and per_collective =
        small_all_gather - (W-1) alpha (each at least 0; alpha 0 when the all-gather is not
        the faster, and per_collective then the all-gather's time), and each rate from its large
        collective's excess over the small one (inf when there is none). The alpha is
        ``latency_s``; the links the engine runs on then need no latency of their own.

        Raises:
            ValueError: W < 2, a time that is not positive, or B or P <= 0.
        """
        W = int(world_size)
        if W < 2:
            raise ValueError(f"planner: EngineCost.calibrate world_size={world_size}; accepted: >= 2")
        named = [("small_allreduce_s", small_allreduce_s), ("small_all_gather_s", small_all_gather_s),
                 ("large_allreduce_s", large_allreduce_s), ("large_allreduce_bytes", large_allreduce_bytes)]
        if large_all_gather is not None:
            named += [("large_all_gather seconds", large_all_gather[0]),
                      ("large_all_gather bytes", large_all_gather[1])]
        if small_all_to_all_s is not None:
            named += [("small_all_to_all_s", small_all_to_all_s)]
        for name, v in named:
            if not float(v) > 0:
                raise ValueError(f"planner: EngineCost.calibrate {name}={v}; accepted: > 0")

        def rate(vol, t, base):
            return vol / (float(t) - float(base)) if float(t) > float(base) else float("inf")

        alpha = max(0.0, (float(small_allreduce_s) - float(small_all_gather_s)) / (W - 1))
        per_coll = max(0.0, float(small_all_gather_s) - (W - 1) * alpha)
        kinds = {}
        if large_all_gather is not None:
            kinds["all_gather"] = rate((W - 1) * float(large_all_gather[1]), large_all_gather[0], small_all_gather_s)
        fixed = {"all_to_all": float(small_all_to_all_s)} if small_all_to_all_s is not None else None
        return cls(per_coll, rate(2.0 * (W - 1) / W * float(large_allreduce_bytes), large_allreduce_s,
                                  small_allreduce_s), alpha, kinds, fixed)

    def to_dict(self) -> dict:
        return {"per_collective_s": self.per_collective_s, "bytes_per_s": self.bytes_per_s,
                "latency_s": self.latency_s, "kind_bytes_per_s": dict(self.kind_bytes_per_s),
                "kind_fixed_s": dict(self.kind_fixed_s)}

    def __repr__(self) -> str:
        kinds = "".join(f", {k} {v / 1e9:g} GB/s" for k, v in self.kind_bytes_per_s.items())
        kinds += "".join(f", {k} {1e6 * v:g} us fixed" for k, v in self.kind_fixed_s.items())
        return (f"EngineCost({1e6 * self.per_collective_s:g} us per collective, alpha {1e6 * self.latency_s:g} us, "
                f"{self.bytes_per_s / 1e9:g} GB/s{kinds})")


# Achievable memory bandwidth (bytes/s) of named devices, for kernel times without a bench table:
# about 90 % of each GPU's specified HBM bandwidth, and a copy bandwidth of this project's 2-core
# CPU machine. Where each figure comes from (none of the GPU ones is a measurement of this
# project's): bench/RESULTS.md, section "The planner's default device bandwidths".
DEVICE_BYTES_PER_S = {"H200": 4.3e12, "H100": 3.0e12, "A100": 1.8e12, "cpu": 10e9}

# Fraction of that bandwidth a codec's encode / decode reaches on its compulsory bytes, without a
# measured table, from the codec's properties (no per-codec table to keep beside the registry): a
# sparse codec (it selects elements: top-k) 25 % (the best published radix select, CUB on H100,
# is ~4 reads); every other (casts, block quantizers, onebit) 85 % (torchao's MXFP8 cast: 90 % on
# B200, pytorch/ao PR 4931).
_SPARSE_EFFICIENCY = 0.25
_DEFAULT_EFFICIENCY = 0.85


def kernel_efficiency(codec) -> float:
    """The fraction of a device's memory bandwidth :class:`Throughput` assumes ``codec``'s encode
    reaches without a measured table: 0.25 when ``codec.properties["sparse"]`` (a selection),
    else 0.85. Decodes are assumed at 0.85 whatever the codec (a scatter or a dense pass)."""
    return _SPARSE_EFFICIENCY if codec.properties.get("sparse", False) else _DEFAULT_EFFICIENCY


class Throughput:
    """Encode / decode time of a codec on one device: from a ``gradcomp-bench`` JSON table
    (``table``: measured seconds; the largest size of the codec and dtype, scaled linearly in
    elements) or, without one (or for a codec / dtype the table lacks), from a memory bandwidth
    (the table's measured ``copy_bytes_per_s``, else ``device``'s entry of
    :data:`DEVICE_BYTES_PER_S`): compulsory bytes (:func:`gradcomp.planner.encode_traffic_bytes`,
    :func:`gradcomp.planner.decode_traffic_bytes`) over the bandwidth times the efficiency
    :func:`kernel_efficiency` derives from the codec's properties.

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
        try:
            return _table_throughput(self.table, codec.spec, _dtype_name(dtype))
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
        return b / (self._bandwidth() * kernel_efficiency(codec))

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
    """(encode_s, decode_s) a rank spends in one flat scheme's kernels: the scheme's ``kernels``
    from the scheme table (sum one encode and one decode of the bucket; gather one encode and W
    decodes; two_phase the chunk encodes (the bucket), one float32 chunk re-encode, W chunk
    decodes and the bucket's decodes; dense none); none for W < 2 or an empty bucket."""
    if W < 2 or numel == 0:
        return 0.0, 0.0
    return _schemes.get(scheme).kernels(codec, numel, dtype, W, tp, ef)


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
        engine_cost: an :class:`EngineCost` (a CPU host's collective engine, measured): every
            collective on every level takes the slower of its link time and the engine's
            (:func:`collective_time`); or a dict of one per group shape (:data:`ENGINE_LEVELS`):
            ``"flat"`` (the W ranks: flat schemes, the descriptor check, FSDP2's ring),
            ``"intra"`` (a node's L ranks, the N nodes' groups at once: hierarchical's steps
            inside the node, HSDP's shard group) and ``"inter"`` (one rank per node, the L such
            groups at once: hierarchical's cross-node step, HSDP's replica all-reduce); a shape
            left out takes the ``"flat"`` one. None: the links alone (GPU hosts, where NCCL's
            cost is in the link's alpha). :meth:`engine_for` gives a shape's.

    All inputs are configuration every rank shares, so every rank predicts and chooses alike.

    Raises:
        ValueError: engine not nccl/gloo; local_world_size < 0; an engine_cost dict without
            ``"flat"``, with another key, or with a value that is not an :class:`EngineCost`.
    """

    def __init__(self, intra: Link, inter: Optional[Link] = None, local_world_size: int = 0,
                 throughput: Optional[Throughput] = None, engine: str = "nccl", error_feedback: bool = True,
                 engine_cost: Any = None):
        if engine not in ("nccl", "gloo"):
            raise ValueError(f"planner: engine={engine!r}; accepted: nccl, gloo")
        if int(local_world_size) < 0:
            raise ValueError(f"planner: local_world_size={local_world_size}; accepted: >= 0 (0: one node)")
        self.intra, self.inter = intra, inter
        self.local_world_size = int(local_world_size)
        self.throughput = throughput or Throughput(device="H200")
        self.engine, self.error_feedback = engine, bool(error_feedback)
        if engine_cost is None or isinstance(engine_cost, EngineCost):
            costs = {} if engine_cost is None else {"flat": engine_cost}
        elif isinstance(engine_cost, dict) and "flat" in engine_cost and set(engine_cost) <= set(ENGINE_LEVELS) \
                and all(isinstance(v, EngineCost) for v in engine_cost.values()):
            costs = dict(engine_cost)
        else:
            raise ValueError(f"planner: engine_cost={engine_cost!r}; accepted: None, an EngineCost, or a dict of "
                             f"EngineCost by group shape with 'flat' and any of {', '.join(ENGINE_LEVELS[1:])}")
        self.engine_costs = costs
        self.engine_cost = costs.get("flat")  # the W ranks' (every shape's when given alone)

    def engine_for(self, level: str) -> Optional[EngineCost]:
        """The :class:`EngineCost` of a group shape of :data:`ENGINE_LEVELS` (the ``"flat"`` one
        for a shape the model was not given; None without an engine cost).

        Raises:
            ValueError: an unknown shape.
        """
        if level not in ENGINE_LEVELS:
            raise ValueError(f"planner: engine level {level!r}; accepted: {', '.join(ENGINE_LEVELS)}")
        return self.engine_costs.get(level, self.engine_cost)

    @classmethod
    def loopback(cls, rate: Any, latency_s: float = 50e-6, throughput: Optional[Throughput] = None,
                 error_feedback: bool = True, engine_cost: Optional[EngineCost] = None) -> "CostModel":
        """All ranks on one host over a (rate-limited) loopback: one shared link of ``rate``
        (:func:`parse_rate`: ``"100mbit"``, ``"unlimited"``), gloo, CPU kernel times, and the
        measured ``engine_cost`` when given."""
        return cls(Link.parse(rate, latency_s, shared=True, name=f"loopback {rate}"), None, 0,
                   throughput or Throughput(device="cpu"), "gloo", error_feedback, engine_cost)

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
        return Link(self.inter.bytes_per_s, lat, self.inter.shared, self.inter.name,
                    burst_bytes=self.inter.burst_bytes)

    def predict(self, scheme: str, codec, numel: int, dtype: Any, world_size: int, inner: str = "") -> dict:
        """Predicted times of one bucket under ``scheme`` (``inner``: hierarchical's scheme across
        nodes). Returns ``{"scheme", "inner", "comm_s", "encode_s", "decode_s", "total_s",
        "bytes": {"intra": sent bytes inside nodes, "inter": across nodes}}`` (seconds, bytes
        one rank sends). A flat ring over several nodes counts all its bytes as ``inter``: its
        time is paced by the hops that cross the network (in a rank-order ring only the node's
        boundary rank sends across, at the ring's full volume).

        A scheme of the table that is not flat (its steps are on the link levels: hierarchical)
        gets the model's L, ``inner`` and engine as its layout options and runs on both links.

        Raises:
            ValueError: a scheme on link levels on a model of one node, or an unknown scheme.
        """
        W = int(world_size)
        nodes = self.nodes(W)
        desc = _schemes.get(scheme)
        if not desc.flat:
            if nodes < 2:
                raise ValueError(f"planner: {scheme} needs a cost model with local_world_size > 0, "
                                 f"an inter link and more than one node (W={W}, L={self.local_world_size})")
            opts = desc.options(local_world_size=self.local_world_size, inner=inner, engine=self.engine)
            steps = desc.steps(codec, numel, dtype, W, **opts)
            enc, dec = desc.kernels(codec, numel, dtype, W, self.throughput, self.error_feedback, **opts)
            links = {"intra": self.intra, "inter": self.inter}
        else:
            steps = scheme_steps(scheme, codec, numel, dtype, W)
            enc, dec = _kernel_time(scheme, codec, numel, dtype, W, self.throughput, self.error_feedback)
            level = "inter" if nodes > 1 else "intra"
            steps = [(level,) + tuple(s[1:]) for s in steps]
            links = {level: self._flat_link(W)}
        comm = sum(collective_time(kind, nb, p, links[lv], self._load(scheme, lv, kind, W),
                                   self.engine_for("flat" if desc.flat else lv))
                   for lv, kind, nb, p, _ in steps)
        by = {"intra": 0.0, "inter": 0.0}
        for lv, _, _, _, sent in steps:
            by[lv] += sent
        return {"scheme": scheme, "inner": inner, "comm_s": comm, "encode_s": enc, "decode_s": dec,
                "total_s": comm + enc + dec, "bytes": by}

    def peer_check_s(self, world_size: int) -> float:
        """Seconds of the compressor's once-per-step descriptor check: an all-gather of
        :data:`~gradcomp.planner.PEER_CHECK_BYTES` per rank over the W = ``world_size`` ranks on
        the flat link (on one node, the intra link), with the flat engine cost
        (:meth:`engine_for`). On gloo it is one more collective beside a step's first, and its
        cost is the engine's per-collective one; 0.0 for W < 2."""
        W = int(world_size)
        return collective_time("all_gather", PEER_CHECK_BYTES, W, self._flat_link(W),
                               self.inter_load("all_gather", W) if self.nodes(W) > 1 else 1.0,
                               self.engine_for("flat"))

    def _load(self, scheme: str, level: str, kind: str, world_size: int) -> float:
        """How many ranks' volumes cross a ``per_node`` inter link at once: the L cross-node groups
        of a scheme on link levels (hierarchical: one per local rank) all leave the node together
        (L); a flat ring leaves each node over one hop per direction (1); a flat all-to-all sends
        the fraction (W - L) / (W - 1) of each of the node's L ranks' slots off the node."""
        if level != "inter":
            return 1.0
        return self.inter_load(kind, world_size, grouped=not _schemes.get(scheme).flat)

    def inter_load(self, kind: str, world_size: int, *, grouped: bool = False) -> float:
        """How many ranks' volumes cross the inter link at once when it is ``per_node`` (the
        node's one NIC; 1.0 for a link per rank or without an inter link), for a collective of
        ``kind`` over W = ``world_size`` ranks in nodes of L: ``grouped`` (L groups of one rank
        per node, one per local rank, all leaving the node together: hierarchical's cross-node
        step, HSDP's replica all-reduce) L; a flat all-to-all L (W-L)/(W-1) (each of the node's
        L ranks sends (W-L) of its (W-1) slots off the node); a flat ring 1 (it leaves each node
        over one hop per direction). Dimensionless (scales the volume term of
        :func:`collective_time`)."""
        if self.inter is None or not self.inter.per_node:
            return 1.0
        L, W = self.local_world_size, int(world_size)
        if grouped:
            return float(L)
        return L * (W - L) / (W - 1) if kind == "all_to_all" else 1.0

    def candidates(self, codec, numel: int, dtype: Any, world_size: int) -> list:
        """``[(scheme, inner)]`` worth predicting for a bucket: the flat candidates of the scheme
        table for this codec (:func:`gradcomp.planner.schemes.candidates`: dense; sum for linear
        codecs; gather; two_phase for the others), then, when the model has more than one node,
        hierarchical over each of them as its inner scheme."""
        flat = _schemes.candidates(codec)
        out = [(s, "") for s in flat]
        if self.nodes(world_size) > 1:
            out += [(h, s) for h in _schemes.names(flat=False) for s in flat]
        return out

    def choose(self, codec, numel: int, dtype: Any, world_size: int, *, local_world_size: int = 0,
               min_compress_numel: int = 0) -> dict:
        """The fastest scheme for a bucket: ``{"scheme", "inner", "predictions": [predict(...)
        for each candidate]}``. Dense unless a compressed scheme is predicted strictly faster
        (compression that does not pay is not taken); ``local_world_size`` (the compressor's)
        must match the model's for hierarchical to be a candidate."""
        preds = []
        for s, inner in self.candidates(codec, numel, dtype, world_size):
            if not _schemes.get(s).flat and local_world_size != self.local_world_size:
                continue
            preds.append(self.predict(s, codec, numel, dtype, world_size, inner))
        best = preds[0]
        for p in preds[1:]:
            if p["total_s"] < best["total_s"]:
                best = p
        return {"scheme": best["scheme"], "inner": best["inner"], "predictions": preds}

    def rank_rates(self, world_size: int) -> dict:
        """Bytes per second one rank sends on each link level of a group of W = ``world_size``
        ranks, the bandwidth term of :meth:`predict`: ``{"flat": the link a flat ring runs on
        (intra on one node, else the inter link's bandwidth), "intra": the intra link, "inter":
        the inter link or None without one}``. A ``shared`` link is divided by the ranks sending
        through it at once (flat: W; intra: L, or W on one node; inter: the N nodes' ranks of one
        group); a ``per_node`` inter link by the L ranks of a node (the grouped case, whose L
        groups all leave the node together). May be inf (an unlimited link)."""
        W = int(world_size)
        N = self.nodes(W)
        L = self.local_world_size if N > 1 else W

        def per_rank(link: Link, p: int) -> float:
            return link.bytes_per_s / (max(p, 1) if link.shared else 1)

        inter = None
        if self.inter is not None:
            inter = self.inter.bytes_per_s / (max(N, 1) if self.inter.shared else L if self.inter.per_node else 1)
        return {"flat": per_rank(self._flat_link(W), W), "intra": per_rank(self.intra, L), "inter": inter}

    def describe(self) -> dict:
        return {"intra": self.intra.to_dict(), "inter": None if self.inter is None else self.inter.to_dict(),
                "local_world_size": self.local_world_size, "engine": self.engine,
                "throughput": self.throughput.name, "error_feedback": self.error_feedback,
                "engine_cost": None if self.engine_cost is None else self.engine_cost.to_dict(),
                "engine_costs": {k: v.to_dict() for k, v in self.engine_costs.items()}}
