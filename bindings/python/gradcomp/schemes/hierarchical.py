"""The ``hierarchical`` scheme: an uncompressed reduce-scatter inside each node, a compressed
scheme across nodes between the ranks of the same local rank, an all-gather inside each node.

Only the inter-node hop is compressed, where bandwidth is scarce (NVLink / PCIe inside a node is
an order of magnitude faster than the network between nodes); each rank compresses one chunk of
its node's sum, so a node sends one packet of the bucket across, not L. It is the shape of
Horovod's hierarchical allreduce (``HOROVOD_HIERARCHICAL_ALLREDUCE``: NCCL reduce-scatter inside
the node, an allreduce across nodes, NCCL all-gather; ``NCCLHierarchicalAllreduce`` in
horovod/common/ops/nccl_operations.cc) with a gradcomp scheme as the inter-node step.

Protocol for a flat tensor of n elements over W ranks in N = W / L nodes of L consecutive ranks
(rank r: node k = r // L, local rank j = r % L; byte formulas in :func:`gradcomp.planner.
hierarchical_steps`, groups in :mod:`gradcomp.schemes.groups`):

1. inside the node: the node SUM of chunk j = :func:`gradcomp.planner.chunk` (n, L, j) (c =
   ceil(n / L) elements, the last shorter or empty), in float32 whatever the bucket dtype, not
   divided by anything: on gloo an allreduce of a float32 copy of the whole bucket (``ctx.acc``),
   whose chunk j is taken (the planner accounts gloo's intra-node step as that allreduce); on
   NCCL ``reduce_scatter_tensor`` of a float32 copy padded with zeros to L c elements into
   ``ctx.node_sum`` (c elements);
2. across nodes: the chunk's node sum s (float32, count elements) goes through the inner scheme
   (``ctx.inner``: dense, sum, gather or two_phase) over the N ranks of local rank j, with an
   inner context whose divisor is W (the full world size, not N): packets carry (s + r) / W, so
   their sum over the N nodes is the global average. The worker residual r is this rank's slice
   of chunk j of the ``"residual"`` slot (float32, gradient units as everywhere: the ranks owe
   r / W) and becomes x' - W D, x' = s + r; only the rank that encodes chunk j of its node holds a
   residual for it (the slot is zero elsewhere). Inner ``dense`` (and N = 1, where nothing
   crosses a node) adds r into s and zeroes it, then divides by W and SUM-allreduces. Inner
   ``two_phase`` also keeps the server residual (``"server"``, float32, in units of the average)
   of this rank's piece of the chunk, ``ctx.server_chunk`` = (chunk start + :func:`gradcomp.
   planner.chunk` (count, N, k)[0], its count), folded into the worker residual with factor W
   (:mod:`gradcomp.torch.residuals`);
3. inside the node: ``all_gather_into_tensor`` of the averaged chunks, each rounded once from
   float32 into the bucket dtype at the start of a (c + 1)-element slot (zero after it) whose last
   element is the rank's status (0, or 1 when its inner scheme failed: then every rank of the
   node raises instead of using that chunk), L (c + 1) elements in all; every rank copies the
   chunks into ``tensor``.

Chunk j's average is computed identically on the N ranks of local rank j (the inner schemes are
bitwise identical on every rank of their group) and all-gathered unchanged, so the result is
bitwise identical on every rank; with the inner schemes gather and two_phase (and gloo's
reduction order) also run to run. Steps 1-2 run in the calling thread, waiting for each
collective there (on NCCL that orders the current stream, no host synchronization; on gloo it
blocks), so every collective of each process group is issued from the calling thread in call
order; the all-gather of step 3 is asynchronous and the Future completes after the copy. World
size 1 and n = 0 return at once; L = 1 skips steps 1 and 3 (the inner scheme over all W ranks on
a float32 copy), N = 1 skips step 2 (exact: the node sum divided by W).
"""

from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..codec import Codec
from ..errors import CollectiveError
from ..planner import schemes as table
from ..planner.bytes import (all_gather_bytes, chunk, chunk_size, dense_bytes, hierarchical_groups,
                             ring_allreduce_bytes, scheme_steps)
from ..planner.choice import hierarchical_inner
from .base import Scheme
from .collectives import all_gather_failsafe
from .context import NULL_PROBE, SchemeContext, chain, collective_failed, completed, prefer_mismatch
from .groups import engine_of, hierarchical_groups_for


class HierarchicalContext(SchemeContext):
    """The ``hierarchical`` scheme's buffers for tensors of ``numel`` elements of ``dtype`` on
    ``device`` over W ranks in N = W / L nodes of L = ``local_world_size`` consecutive ranks (c =
    ceil(numel / L); the groups come from :func:`gradcomp.schemes.groups.hierarchical_groups_for`,
    created on the first call for a (group, L), by every rank of the group):

    - ``local_world_size``: L; ``nodes``: N; ``node``: rank // L; ``local_rank``: rank % L (the
      chunk it owns); ``rank``: this rank in ``group``;
    - ``chunks``: the L intra-node chunks ``[(start, count)]`` (:func:`gradcomp.planner.chunk`
      (n, L, i)); ``chunk_size``: c;
    - ``intra_group`` / ``cross_group``: the node's group (None when L = 1) and the local rank's
      group over the nodes (None when N = 1);
    - ``engine``: ``"gloo"`` (the intra reduce-scatter is an allreduce of ``acc``) or ``"nccl"``
      (``reduce_scatter_tensor`` of ``acc`` into ``node_sum``);
    - ``acc``: float32, the bucket's float32 copy: n elements (gloo, L = 1) or L c (nccl; zeroed
      once, the padding stays zero); ``node_sum``: float32, c elements (nccl), else None;
    - ``part`` / ``gathered``: the bucket dtype, c + 1 and L (c + 1) elements (zeroed once): this
      rank's averaged chunk at the start of ``part`` and its status element ``part[c]`` (0, or 1
      when its inner scheme failed), and the all-gathered parts;
    - ``inner``: the scheme across nodes (a flat scheme of the table; ``"dense"`` when N = 1);
      ``inner_ctx``: its context for this rank's chunk (count elements, float32) over
      ``cross_group``, divisor W (None when the chunk is empty or N = 1);
    - ``server_chunk``: an inner scheme with a server residual (two_phase): ``(start, count)`` in
      the bucket of this rank's piece of its chunk (the chunk's start + the inner scheme's
      ``server`` range), which its server residual covers; else None.

    Options: ``local_world_size`` (L), ``inner`` (``"auto"``: :func:`gradcomp.planner.
    hierarchical_inner` with ``min_compress_numel``), ``engine`` (``"gloo"`` / ``"nccl"``; None:
    :func:`gradcomp.schemes.groups.engine_of`).

    Raises:
        ValueError: an unknown inner scheme or engine; L < 1 or L not dividing W; a group whose
            size is not W.
    """

    def __init__(self, codec: Codec, numel: int, dtype, device, group, world_size: int, *,
                 rank: Optional[int] = None, divisor: Optional[int] = None, local_world_size: int = 0,
                 inner: str = "auto", min_compress_numel: int = 1024, engine: Optional[str] = None):
        W, n = int(world_size), int(numel)
        N, L = hierarchical_groups(W, local_world_size)
        flat = table.names(flat=True)
        if inner in ("auto", "hierarchical"):
            inner = hierarchical_inner(codec, n, dtype, W, L, "auto", min_compress_numel)
        if inner not in flat:
            raise ValueError(f"SchemeContext: hierarchical inner={inner!r}; accepted: auto, {', '.join(flat)}")
        if engine is not None and engine not in ("gloo", "nccl"):
            raise ValueError(f"SchemeContext: engine={engine!r}; accepted: gloo, nccl (None: from the backend)")
        hg = hierarchical_groups_for(group, L)
        if hg.world_size != W:
            raise ValueError(f"SchemeContext: world_size={W}, but the group has {hg.world_size} ranks")
        super().__init__(codec, group, W, divisor=divisor)
        self.local_world_size, self.nodes, self.node, self.local_rank = L, N, hg.node, hg.local_rank
        self.rank = hg.rank
        self.intra_group, self.cross_group = hg.intra, hg.cross
        self.engine = engine_of(group, device) if engine is None else engine
        self.inner = "dense" if N == 1 else inner  # across one node nothing is sent: exact
        c = chunk_size(n, L)
        self.chunk_size = c
        self.chunks = [chunk(n, L, i) for i in range(L)]
        start, count = self.chunks[self.local_rank]
        nccl = self.engine == "nccl" and L > 1
        self.acc = torch.zeros(L * c if nccl else n, dtype=torch.float32, device=device)
        self.node_sum = torch.empty(c, dtype=torch.float32, device=device) if nccl else None
        self.part = self.gathered = None
        if L > 1:
            self.part = torch.zeros(c + 1, dtype=dtype, device=device)  # + the status element
            self.gathered = torch.zeros(L * (c + 1), dtype=dtype, device=device)
        self.inner_ctx = None
        if count and N > 1:
            self.inner_ctx = table.get(self.inner).context(codec, count, torch.float32, device, hg.cross, N,
                                                           rank=hg.node, divisor=self.divisor)
        self.server_chunk = None
        if count and self.inner_ctx is not None:
            piece = table.get(self.inner).server(self.inner_ctx)
            if piece is not None:
                self.server_chunk = (start + piece[0], piece[1])


def hierarchical_steps(codec, numel: int, dtype, world_size: int, *, local_world_size: int, inner: str,
                       engine: str = "nccl") -> list:
    """The collectives of one bucket under ``hierarchical``, as ``[(level, collective, nbytes,
    ranks, sent_bytes)]`` (level ``"intra"`` or ``"inter"``):

      1. inside the node (L ranks) a float32 copy of the bucket (the node sum accumulates in
         float32 whatever ``dtype``) is reduce-scattered: each local rank keeps the node sum of
         its chunk (c = ceil(n / L) elements). NCCL reduce-scatters the copy padded to L c
         elements ((L-1)/L of 4 L c bytes); on gloo it is an allreduce of the copy (2 (L-1)/L of
         4 n bytes), as gloo runs it;
      2. across nodes (N = W / L ranks of one local rank) the chunk (float32, c elements) goes
         through ``inner`` (the steps of that flat scheme);
      3. inside the node the averaged chunks are all-gathered in ``dtype``, each followed by its
         rank's status element ((L-1) (c + 1) elements sent by each rank).

    Raises:
        ValueError: ``inner`` not a flat scheme; L < 1 or not dividing W.
    """
    flat = table.names(flat=True)
    if inner not in flat:
        raise ValueError(f"planner: hierarchical needs inner= one of {', '.join(flat)}; got {inner!r}")
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


def _hierarchical_packet(codec, numel: int, dtype, world_size: int, *, local_world_size: int, inner: str,
                         engine: str = "nccl") -> int:
    """This rank's inter-node packet: the inner scheme's of one float32 chunk over N ranks."""
    nodes, L = hierarchical_groups(world_size, local_world_size)
    c = chunk_size(numel, L)
    return int(table.get(inner).packet_bytes(codec, c, "float32", nodes)) if c else 0


def _hierarchical_kernels(codec, numel, dtype, world_size, tp, ef, *, local_world_size: int, inner: str,
                          engine: str = "nccl"):
    """The inner scheme's kernel times on this rank's float32 chunk of ceil(numel / L) elements
    over the N nodes (none for N < 2 or an empty chunk): only the inter-node hop is encoded."""
    nodes, L = hierarchical_groups(world_size, local_world_size)
    c = chunk_size(numel, L)
    if nodes < 2 or c == 0:
        return 0.0, 0.0
    return table.get(inner).kernels(codec, c, "float32", nodes, tp, ef)


def _server_of_chunk(ctx) -> Optional[tuple]:
    return ctx.server_chunk


def hierarchical(tensor: torch.Tensor, ctx: SchemeContext, slots: Optional[Mapping[str, torch.Tensor]] = None,
                 probe=None, check=None) -> torch.futures.Future:
    """Average ``tensor`` with any codec through the hierarchical protocol of the module docstring.

    Args:
        tensor: C-contiguous float32/float16/bfloat16, any shape taken as flat (n elements),
            reduced in place.
        ctx: a context built for ``"hierarchical"`` of tensor's numel, dtype and device
            (:meth:`SchemeContext.for_layout` with ``local_world_size``: groups, acc, node_sum,
            part, gathered, chunks, inner, inner_ctx, server_chunk).
        slots: error feedback, or None/{}: ``"residual"``, the worker residual (float32, n
            elements; only this rank's chunk ``ctx.chunks[ctx.local_rank]`` is read and written:
            x' = s + r is encoded divided by W, r becomes x' - W * D); ``"server"`` (inner
            two_phase), the server residual of ``ctx.server_chunk`` (float32, its count, units
            of the average). Either may be absent (a joined rank passes the server alone).
        probe: times ``"comm_s"`` (the intra-node collectives, and those of the inner scheme),
            ``"encode_s"`` / ``"decode_s"`` (the inner scheme's); sees its decode workspaces.
        check: a :class:`gradcomp.schemes.check.PeerCheck` over the whole group, launched before
            the intra-node step and verified after it (before the inner scheme decodes), or None.

    Returns:
        A Future holding ``tensor``, bitwise identical on every rank.

    Raises:
        gradcomp.InvalidArgumentError: from an inner encode (dtype, size, device), at once.
        gradcomp.CollectiveError: a failed intra-node collective issued from the calling thread,
            at once (the caller undoes the residuals); the all-gather's, or another rank's failure
            across nodes, through the Future.
        gradcomp.RankMismatchError: ``check`` found ranks that disagree (at once, on every rank).
        gradcomp.CorruptPacketError: (CPU) an inner packet that fails validation: in the Future.
            A rank whose inner scheme fails still takes part in the all-gather, with its slot's
            status element set (the element after its c values: 0 ok, 1 failed), so every rank of
            its node raises too (naming it) instead of waiting forever or using a zeroed chunk
            (on CUDA, where reading the statuses would need a host synchronization in the hook,
            that chunk becomes NaN instead: a non-finite step for the node's other ranks).
    """
    W = ctx.world_size
    n = tensor.numel()
    if W == 1 or n == 0:
        return completed(tensor)
    probe = probe or NULL_PROBE
    flat = tensor.view(-1)
    L, N = ctx.local_world_size, ctx.nodes
    start, count = ctx.chunks[ctx.local_rank]
    residual = slots.get("residual") if slots else None
    server = slots.get("server") if slots else None

    # 1. the node sum of this rank's chunk, float32
    acc = ctx.acc
    acc[:n].copy_(flat)
    t0 = probe.clock("comm_s")
    if check is not None:
        check.launch()
    if L == 1:
        s = acc
    else:
        try:
            if ctx.engine == "gloo":
                dist.all_reduce(acc, group=ctx.intra_group)
                s = acc[start: start + count]
            else:
                dist.reduce_scatter_tensor(ctx.node_sum, acc, group=ctx.intra_group)
                s = ctx.node_sum[:count]
        except Exception as e:  # noqa: BLE001 - a failed collective: named, cause kept
            what = "scheme 'hierarchical': the reduce-scatter inside the node"
            raise prefer_mismatch(check)(collective_failed(what, e)) from e
    probe.tock("comm_s", t0)
    if check is not None:
        check.verify()  # every rank sees the same descriptors: all raise here, or none

    # 2. across nodes: the inner scheme over the N ranks of this local rank, divisor W
    def across() -> Optional[torch.futures.Future]:
        if not count:
            return None
        if ctx.inner_ctx is not None:  # the inner scheme's chunks: a range of 2N per local rank
            ctx.inner_ctx.key = ctx.key
            ctx.inner_ctx.chunk_base = ctx.chunk_base + 2 * N * ctx.local_rank
        r = None if residual is None else residual[start: start + count]
        inner = table.get(ctx.inner)
        if "residual" not in inner.slots:
            if r is not None:  # dense sends every value: the residual goes with it
                s.add_(r)
                r.zero_()
            if N == 1:
                s.div_(W)
                return None
            return inner.run(s, ctx.inner_ctx, probe=probe)
        inner_slots = {}
        if r is not None:
            inner_slots["residual"] = r
        if server is not None and "server" in inner.slots:
            inner_slots["server"] = server
        return inner.run(s, ctx.inner_ctx, inner_slots or None, probe=probe)

    if L == 1:  # no node to gather in: the inner scheme's result is the average
        fut = across()

        def copy_out(_):
            flat.copy_(s)
            return tensor

        return chain(fut if fut is not None else completed(s), copy_out,
                     f"scheme 'hierarchical': the inner {ctx.inner} across nodes", device=tensor.device)

    # 3. inside the node: all-gather the averaged chunks, rounded once into the bucket dtype,
    # each followed by its rank's status element (0 ok, 1 failed across nodes)
    failed: Optional[BaseException] = None
    c = ctx.chunk_size
    try:
        fut = across()
        if fut is not None:
            fut.wait()
        if count:
            ctx.part[:count].copy_(s)
        ctx.part[c] = 0
    except Exception as e:  # noqa: BLE001 - re-raised through the Future after the all-gather
        failed = e

    def mark_failed(part):
        part.zero_()
        part[c] = 1

    def finish():
        g = ctx.gathered.view(L, c + 1)
        if not g.is_cuda:  # host memory: read the statuses now
            status = g[:, c].to(torch.float32).numpy()
            if status.any():
                bad = [ctx.node * L + i for i, v in enumerate(status) if v]
                raise CollectiveError(f"scheme 'hierarchical': rank(s) {bad} of this node failed across nodes "
                                      f"(their own error says why): their chunks hold no average")
        for i, (a, m) in enumerate(ctx.chunks):
            if m:
                if g.is_cuda:  # no host read in the hook: a failed rank's chunk becomes NaN (a non-finite step)
                    flat[a: a + m].copy_(torch.where(g[i, c] != 0, torch.full_like(g[i, :m], float("nan")), g[i, :m]))
                else:
                    flat[a: a + m].copy_(g[i, :m])
        return tensor

    return all_gather_failsafe(ctx.gathered, ctx.part, ctx.intra_group, failed, finish,
                               "scheme 'hierarchical': the all-gather inside the node", probe=probe,
                               mark_failed=mark_failed, device=tensor.device)


def _route(codec, numel: int, dtype, config) -> dict:
    """A new layout's options: L, the scheme across nodes (``dense`` when one node holds every
    rank: nothing crosses, the chunks are summed exactly; else
    :func:`gradcomp.planner.hierarchical_inner`) and the engine its bytes are accounted for."""
    W, L = config.world_size, config.local_world_size
    inner = "dense" if W == L else hierarchical_inner(codec, numel, dtype, W, L, config.inner_scheme,
                                                      config.min_compress_numel, cost_model=config.cost_model)
    return {"local_world_size": L, "inner": inner, "engine": engine_of(config.group, config.device)}


def _describe(options: dict, world_size: int) -> str:
    L = options["local_world_size"]
    return f"inner {options['inner']} over {world_size // L} nodes of {L}, {options['engine']}"


def _prepare(group, config) -> None:
    """The intra/cross-node process groups, created when the Compressor is (every rank at the
    same point), not inside a hook (:mod:`gradcomp.schemes.groups`; cached per group and L)."""
    if config.local_world_size and config.world_size > 1:
        hierarchical_groups_for(group, config.local_world_size)


HIERARCHICAL = Scheme(
    name="hierarchical",
    summary="nodes of L ranks: a float32 reduce-scatter inside the node, a flat scheme across nodes for this "
            "rank's chunk, an all-gather inside the node (only the inter-node hop is compressed)",
    run=hierarchical, context=HierarchicalContext, steps=hierarchical_steps, packet_bytes=_hierarchical_packet,
    kernels=_hierarchical_kernels, collectives=("reduce_scatter", "allreduce", "all_gather", "all_to_all"),
    slots=("residual", "server"), server=_server_of_chunk, flat=False,
    option_names=("local_world_size", "inner", "min_compress_numel", "engine"),
    route=_route, describe=_describe, prepare=_prepare, shown=("inner", "local_world_size"),
    requires=("local_world_size",))
