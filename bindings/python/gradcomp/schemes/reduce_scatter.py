"""FSDP2's gradient reduce-scatter, compressed: one all-to-all of fixed-size packets.

What :class:`gradcomp.torch.fsdp.CompressedReduceScatter` runs for every ``fully_shard`` unit.
It is the first phase of ``two_phase`` (:func:`gradcomp.schemes.two_phase.reduce_scatter_phase`:
encode each destination's chunk with the worker residual, all-to-all, decode in rank order into a
float32 sum) on FSDP2's own layout instead of equal chunks, and it writes its result into FSDP's
output instead of re-encoding it. Not a line of the scheme table: a table scheme averages a
tensor in place, this one reduces an input of W shards into one shard.

Sources: the compressed reduce-scatter of DeepSpeed 1-bit Adam (Tang et al., "1-bit Adam:
Communication Efficient Large-Scale Training with Adam's Convergence Speed", ICML 2021,
section 3.3) and ZeRO++'s quantized gradient reduce-scatter qgZ (Wang et al., "ZeRO++: Extremely
Efficient Collective Communication for Giant Model Training", 2023, section 3.3); error feedback:
Karimireddy et al., ICML 2019.

The input (FSDP2's ``foreach_reduce``): a flat tensor of N elements (float32, bfloat16 or
float16), viewed as W rows of S = N / W elements; row j is rank j's shard of every parameter of
the unit, one padded shard after another (:func:`gradcomp.planner.fsdp_shard_rows`). The layout
(:class:`RowLayout`) names, in each row, the segments that are compressed and the segments that
travel raw (exempt parameters), each without FSDP's padding.

Protocol on rank r of W (byte formulas: :func:`gradcomp.planner.fsdp_slot`):

1. for each row j: gather its compressed segments (in order) into one run of c_j elements and
   encode it with the worker residual's slice for row j (float32, c_j elements, gradient units),
   divisor 1, key ``ctx.key_for(j)``, into slot j at byte 0; copy its exempt segments raw (the
   input dtype, e_j elements) to ``exempt_offset``;
2. the trailer of every slot gets byte 0 = 1 when this rank saw a non-finite value anywhere (the
   non-finite bit of any of its W packet headers, or a non-finite exempt element), else 0;
3. one ``all_to_all_single`` of the W slots: slot j goes to rank j;
4. decode the W packets of row r in rank order 0..W-1 into one float32 accumulator zeroed first
   (``accumulate=True``, ``alpha``: out = fl(out + fl(D alpha))); the exempt elements the same
   way (fl(out + fl(float32(x) alpha))); then, for ``AVG``, divide the sum by W (IEEE, once);
5. write the sums into row r's segments of the output (the shard, S elements of the output's
   dtype, rounded once; FSDP's padding is written as zeros);
6. the step is non-finite iff any received trailer says so: the same answer on every rank,
   with no extra collective and no host read (returned as a 0-dim bool tensor).

Ops (``torch.distributed.ReduceOp``): ``SUM`` (alpha 1), ``AVG`` (alpha 1, then / W),
``PREMUL_SUM(f)`` (alpha f: every contribution is multiplied before it is added, as NCCL does).
Summation order: rank order from +0.0, the same on every rank and run to run. gloo's own
reduce-scatter adds in ring order ending with the receiving rank's own contribution and divides
AVG by W afterwards, so with codec ``none`` the result equals gloo's bitwise whenever the two
orders give the same sums (W = 2 always; the last rank of W = 3); NCCL's AVG multiplies by 1/W
before its ring sum, which is the same bits when W is a power of two.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..codec import Codec, _dtype_name, aligned_empty
from ..planner.bytes import fsdp_slot
from .check import check_headers, decode_from
from .context import NULL_PROBE, collective_failed

Segment = Tuple[int, int]
"""``(offset, count)`` in elements of one row of the reduce-scatter input."""


class RowLayout(NamedTuple):
    """The segments of one row (one rank's shard) of the reduce-scatter input.

    Attributes:
        compressed: ``[(offset, count)]`` of the compressed parameters' elements in the row, in
            order (offsets in elements from the row's start; padding excluded).
        exempt: the same for the parameters that travel raw.
    """

    compressed: Tuple[Segment, ...]
    exempt: Tuple[Segment, ...]

    @property
    def c(self) -> int:
        """Compressed elements in the row."""
        return sum(n for _, n in self.compressed)

    @property
    def e(self) -> int:
        """Exempt elements in the row."""
        return sum(n for _, n in self.exempt)


def op_parts(op, world_size: int) -> Tuple[float, Optional[int], str]:
    """``(alpha, divisor, name)`` of a ``torch.distributed.ReduceOp``: SUM (1, None), AVG (1, W),
    PREMUL_SUM(f) (f, None).

    Raises:
        ValueError: any other op (MIN, MAX, PRODUCT, bitwise ops), or a PREMUL_SUM factor that
            is not a finite number (a tensor factor must be a 0-dim CPU tensor).
    """
    R = dist.ReduceOp
    kind = getattr(op, "op", op)
    if kind == R.SUM:
        return 1.0, None, "SUM"
    if kind == R.AVG:
        return 1.0, int(world_size), "AVG"
    if kind == R.PREMUL_SUM:
        f = getattr(op, "factor", None)
        if isinstance(f, torch.Tensor):
            if f.numel() != 1 or f.is_cuda:
                raise ValueError(f"reduce-scatter: PREMUL_SUM with a factor tensor of shape {tuple(f.shape)} on "
                                 f"{f.device}; accepted: a Python number or a 0-dim CPU tensor")
            f = float(f)
        try:
            f = float(f)
        except (TypeError, ValueError):
            f = float("nan")
        if f != f or f in (float("inf"), float("-inf")):
            raise ValueError(f"reduce-scatter: PREMUL_SUM factor {getattr(op, 'factor', None)!r}; accepted: a finite number")
        return f, None, "PREMUL_SUM"
    raise ValueError(f"reduce-scatter: op {kind!r}; accepted: ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM(factor) "
                     f"(what FSDP2 passes)")


class ReduceScatterContext:
    """The buffers of one layout of the compressed reduce-scatter: the W rows' segments
    (``rows``, :class:`RowLayout` each), the input dtype and device, and:

    - ``slot``: :func:`gradcomp.planner.fsdp_slot` of the rows (``packet``, ``exempt_offset``,
      ``trailer_offset``, ``slot``: bytes); ``pc``: the packet bytes of each row (0: none);
    - ``packet``: uint8, W slots (zeroed once here: encodes and copies write only their bytes);
      ``received``: uint8, W slots;
    - ``stage``: the input dtype, the compressed runs of the rows that have more than one
      segment, one after another (``stage_at[j]``: where row j's run starts), so each row is
      encoded from one contiguous tensor; ``rstart[j]``: where row j's worker residual starts
      in the layout's flat residual (rows one after another, c_j elements each);
    - ``acc`` (float32, c_r) and ``acc_e`` (float32, e_r): this rank's sums;
    - ``packet_rows``: int64 indices of the rows that hold a packet (None: none do);
    - ``dec_codec``: a Codec of the same spec for the decodes; ``key``: ``(seed, step,
      bucket)`` or None, set by the caller per call (:meth:`key_for`).

    Raises:
        ValueError: ``len(rows) != world_size``, a rank outside [0, W).
    """

    def __init__(self, codec: Codec, rows: Sequence[RowLayout], dtype: torch.dtype, device, group, world_size: int,
                 rank: int):
        W, r = int(world_size), int(rank)
        if len(rows) != W:
            raise ValueError(f"reduce-scatter: {len(rows)} row layouts for a world size of {W}")
        if not 0 <= r < W:
            raise ValueError(f"reduce-scatter: rank {r} outside [0, {W})")
        self.codec, self.dec_codec = codec, Codec(codec.spec)
        self.rows = [RowLayout(tuple(map(tuple, row.compressed)), tuple(map(tuple, row.exempt))) for row in rows]
        self.dtype, self.device, self.group = dtype, torch.device(device), group
        self.world_size, self.rank = W, r
        counts = [(row.c, row.e) for row in self.rows]
        self.slot = fsdp_slot(codec, counts, _dtype_name(dtype))
        self.pc = [int(codec.packet_bytes(c, _dtype_name(dtype))) if c else 0 for c, _ in counts]
        like = torch.empty(0, device=self.device)
        P = self.slot["slot"]
        self.packet = aligned_empty(like, W * P)
        self.packet.zero_()
        self.received = aligned_empty(like, W * P)
        self.rstart, at = [], 0
        for c, _ in counts:
            self.rstart.append(at)
            at += c
        self.residual_numel = at
        self.stage_at, st = [], 0
        for row in self.rows:
            self.stage_at.append(st if len(row.compressed) > 1 else -1)
            st += row.c if len(row.compressed) > 1 else 0
        self.stage = torch.empty(st, dtype=dtype, device=self.device)
        e_max = max((e for _, e in counts), default=0)
        self.ex_stage = torch.empty(e_max, dtype=dtype, device=self.device)
        self.acc = torch.empty(counts[r][0], dtype=torch.float32, device=self.device)
        self.acc_e = torch.empty(counts[r][1], dtype=torch.float32, device=self.device)
        rows_with = [j for j, p in enumerate(self.pc) if p]
        self.packet_rows = (torch.tensor(rows_with, dtype=torch.int64, device=self.device) if rows_with else None)
        self.key: Optional[Tuple[int, int, int]] = None

    def key_for(self, j: int) -> Optional[Tuple[int, int, int, int]]:
        """``(seed, step, bucket, j)``: the key of row j's encode, or None without a key."""
        if self.key is None:
            return None
        seed, step, bucket = self.key
        return (seed, step, bucket, int(j))

    def slot_view(self, buf: torch.Tensor, j: int, start: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[start, start + nbytes)`` of slot j of ``buf`` (uint8)."""
        P = self.slot["slot"]
        return buf[j * P + start: j * P + start + nbytes]


def _gather(row: torch.Tensor, segs: Sequence[Segment], out: Optional[torch.Tensor]) -> torch.Tensor:
    """Row ``row``'s segments as one contiguous run: a view when there is one segment, else
    copied into ``out`` (the same count)."""
    if len(segs) == 1:
        a, n = segs[0]
        return row[a: a + n]
    if not segs:
        return row[:0]
    torch.cat([row[a: a + n] for a, n in segs], out=out)
    return out


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, ctx: ReduceScatterContext,
                   residual: Optional[torch.Tensor] = None, op=dist.ReduceOp.SUM, probe=None) -> torch.Tensor:
    """Reduce-scatter ``input`` into ``output`` over ``ctx.group`` by the protocol of the module
    docstring.

    Args:
        output: this rank's shard, S = N / W elements, C-contiguous, float32 / bfloat16 / float16
            (FSDP2's reduce dtype); overwritten.
        input: N elements of ``ctx.dtype``, C-contiguous (W rows of S); not modified.
        ctx: the layout's :class:`ReduceScatterContext` (its ``key`` set for keyed codecs).
        residual: the worker residual, float32, ``ctx.residual_numel`` elements (row j's c_j
            compressed elements at ``ctx.rstart[j]``), or None (no error feedback); updated in
            place: r = x' - D for every encoded element.
        op: ``ReduceOp.SUM``, ``AVG`` or ``PREMUL_SUM(f)`` (:func:`op_parts`).
        probe: times ``"encode_s"``, ``"comm_s"``, ``"decode_s"``; sees the decode workspace.

    Returns:
        A 0-dim bool tensor on the input's device: the step is non-finite (some rank saw a NaN or
        inf, the same on every rank). Not read on the host here.

    Raises:
        ValueError: a bad op, sizes or dtypes that do not match the layout (each message names
            the value and what is accepted).
        gradcomp.InvalidArgumentError: from encode.
        gradcomp.CollectiveError: the all-to-all failed (the residual then holds this call's
            encodes: the caller restores it).
        gradcomp.RankMismatchError: (CPU) a received packet header differs from what this rank
            expects (another codec, spec or layout on another rank).
        gradcomp.CorruptPacketError: (CPU) a received packet that fails validation.
    """
    W, r = ctx.world_size, ctx.rank
    probe = probe or NULL_PROBE
    alpha, divisor, _ = op_parts(op, W)
    S = output.numel()
    if input.dtype != ctx.dtype or input.numel() != W * S:
        raise ValueError(f"reduce-scatter: input of {input.numel()} {input.dtype} elements and output of {S}; "
                         f"accepted: {ctx.dtype} input of world size {W} x output numel")
    if not (input.is_contiguous() and output.is_contiguous()):
        raise ValueError("reduce-scatter: input and output must be contiguous")
    if residual is not None and (residual.dtype != torch.float32 or residual.numel() != ctx.residual_numel):
        raise ValueError(f"reduce-scatter: residual of {residual.numel()} {residual.dtype} elements; accepted: "
                         f"{ctx.residual_numel} float32 elements")
    rows = input.view(W, S)
    sl = ctx.slot
    P, eoff, toff = sl["slot"], sl["exempt_offset"], sl["trailer_offset"]
    codec, dtype = ctx.codec, ctx.dtype
    dname = _dtype_name(dtype)
    es = torch.empty(0, dtype=dtype).element_size()

    t0 = probe.clock("encode_s")
    bad = torch.zeros((), dtype=torch.bool, device=input.device)
    for j, lay in enumerate(ctx.rows):
        c, e = lay.c, lay.e
        if c:
            st = ctx.stage_at[j]
            x = _gather(rows[j], lay.compressed, None if st < 0 else ctx.stage[st: st + c])
            codec.encode(x, residual=None if residual is None else residual[ctx.rstart[j]: ctx.rstart[j] + c],
                         out=ctx.slot_view(ctx.packet, j, 0, ctx.pc[j]), divisor=1, key=ctx.key_for(j))
        if e:
            dst = ctx.slot_view(ctx.packet, j, eoff, e * es).view(dtype)
            if len(lay.exempt) == 1:
                a, n = lay.exempt[0]
                dst.copy_(rows[j][a: a + n])
            else:
                torch.cat([rows[j][a: a + n] for a, n in lay.exempt], out=dst)
            bad |= ~torch.isfinite(dst).all()
    pv = ctx.packet.view(W, P)
    if ctx.packet_rows is not None:  # byte 11 of a header: flags, bit 0 = non-finite seen
        bad |= (pv.index_select(0, ctx.packet_rows)[:, 11] & 1).bool().any()
    pv[:, toff] = bad.to(torch.uint8)
    probe.tock("encode_s", t0)

    t1 = probe.clock("comm_s")
    try:
        dist.all_to_all_single(ctx.received, ctx.packet, group=ctx.group)
    except Exception as e:  # noqa: BLE001 - a failed collective: named, cause kept
        raise collective_failed("FSDP2 compressed reduce-scatter: the all-to-all of the row packets", e) from e
    probe.tock("comm_s", t1)

    t2 = probe.clock("decode_s")
    rv = ctx.received.view(W, P)
    nonfinite = rv[:, toff].bool().any()
    mine = ctx.rows[r]
    c, e = mine.c, mine.e
    if c:
        check_headers(ctx.received, P, [(j, c) for j in range(W)], ctx.slot_view(ctx.packet, r, 0, ctx.pc[r]), dname,
                      "FSDP2 compressed reduce-scatter: the all-to-all of the row packets")
        acc = ctx.acc
        acc.zero_()
        ws = ctx.dec_codec.workspace(ctx.received, c, "float32")
        for j in range(W):
            decode_from(ctx.dec_codec, ctx.slot_view(ctx.received, j, 0, ctx.pc[r]), j,
                        "FSDP2 compressed reduce-scatter: the all-to-all of the row packets", out=acc, accumulate=True,
                        alpha=alpha, workspace=ws)
        probe.decoded(ws)
    if e:
        acc_e = ctx.acc_e
        acc_e.zero_()
        for j in range(W):
            v = ctx.slot_view(ctx.received, j, eoff, e * es).view(dtype).to(torch.float32)
            if alpha != 1.0:
                v = v * torch.tensor(alpha, dtype=torch.float32)  # fl(x alpha) in float32
            acc_e.add_(v)
    if divisor is not None:
        if c:
            ctx.acc.div_(divisor)
        if e:
            ctx.acc_e.div_(divisor)
    output.zero_()
    out_row = output.view(-1)
    for segs, src in ((mine.compressed, ctx.acc), (mine.exempt, ctx.acc_e)):
        at = 0
        for a, n in segs:
            out_row[a: a + n].copy_(src[at: at + n])
            at += n
    probe.tock("decode_s", t2)
    return nonfinite
