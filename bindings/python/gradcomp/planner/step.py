"""A training step in :mod:`gradcomp.planner`: a model's parameters (:func:`parameter_list`), the
buckets DDP builds from them (:func:`ddp_buckets`) and one step's gradient synchronization
(:func:`plan_step`): bytes per link level, exposed time with and without overlap, the bandwidth a
step time needs. For sharded data parallelism: the FSDP2 units of a model (:func:`fsdp_units`)
and one step's parameter all-gathers, gradient reduce-scatters and (HSDP) replica all-reduces
(:func:`plan_fsdp_step`, :func:`plan_fsdp_variants`).
"""

from typing import Any, Dict, Optional, Tuple

from ..codec import _dtype_name
from . import schemes as _schemes
from .bytes import (
    all_gather_bytes, dense_bytes, dtype_bytes, fsdp_reduce_scatter_bytes, fsdp_rows, fsdp_shard_rows, fsdp_slot,
    level_bytes,
)
from .choice import choose_scheme, hierarchical_inner
from .cost import CostModel, Link, collective_time


def parameter_list(model: Any, *, shapes: bool = False) -> list:
    """``[(name, numel, dtype name)]`` of ``model``: a torch module (its parameters that require
    grad), a list of such triples (or of ``(name, numel, dtype, shape)``), or a parameter count
    (int or float, one float32 tensor ``"params"``).

    ``shapes=True``: ``[(name, numel, dtype name, shape)]`` instead, ``shape`` a tuple of ints
    (elements per dimension): a module's parameters' own shapes; a count, or a triple without a
    shape, is a 2-D matrix of shape ``(numel, 1)`` (compressible: not exempt from compression,
    :func:`gradcomp.planner.fsdp_exempt`; FSDP2 pads it by at most W - 1 elements).

    Raises:
        ValueError: a negative or non-integral count, or a shape whose product is not numel;
        TypeError: anything else.
    """
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        n = int(model)
        if n != model or n < 0:
            raise ValueError(f"planner: params={model!r}; accepted: a non-negative whole number")
        out = [("params", n, "float32", (n, 1))]
    elif hasattr(model, "named_parameters"):
        out = [(nm, int(p.numel()), _dtype_name(p.dtype), tuple(int(d) for d in p.shape))
               for nm, p in model.named_parameters() if p.requires_grad]
    elif isinstance(model, (list, tuple)):
        out = []
        for item in model:
            if len(item) not in (3, 4):
                raise TypeError(f"planner: parameter {item!r}; accepted: (name, numel, dtype) or "
                                f"(name, numel, dtype, shape)")
            nm, n, dt = item[:3]
            shape = tuple(int(d) for d in item[3]) if len(item) == 4 else (int(n), 1)
            prod = 1
            for d in shape:
                prod *= d
            if prod != int(n):
                raise ValueError(f"planner: parameter {nm!r}: shape {shape} has {prod} elements, numel is {n}; "
                                 f"accepted: a shape whose product is numel")
            out.append((str(nm), int(n), _dtype_name(dt), shape))
    else:
        raise TypeError(f"planner: model of type {type(model).__name__}; accepted: a parameter count, "
                        f"a torch module, or a list of (name, numel, dtype)")
    return out if shapes else [t[:3] for t in out]


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
        scheme: ``"auto"`` (the cost model's choice per bucket) or one of
            :data:`gradcomp.planner.ALL_SCHEMES`.
        dtype: the gradient dtype (default each parameter's). accumulate: K micro-batches per
            synchronization (gradient accumulation; K steps of compute per exchange).
        step_time_s: the compute time of one micro-batch (forward + backward), for the required
            bandwidth and the step time. backward_s: backward time the last micro-batch's
            communication overlaps with (None: no overlap).

    Returns a dict: ``gradient_bytes`` (the dense gradient, whatever W), ``buckets`` (per distinct
    bucket: numel, dtype, ``count`` (how many buckets have them) and the chosen
    :meth:`gradcomp.planner.CostModel.predict`), ``bytes`` (bytes one rank sends per
    synchronization per link level, ``{"intra", "inter"}``), ``bytes_per_micro_batch`` (the same
    / K), ``comm_s`` / ``encode_s`` / ``decode_s`` / ``sync_s`` (sums over buckets),
    ``exposed_s`` (no overlap: sync_s) and ``exposed_overlap_s`` (max(sync_s - backward_s, the
    last bucket's time): the first bucket waits for backward's end), ``required_bytes_per_s`` /
    ``required_bits_per_s`` (gradient_bytes / (K step_time_s): the rate at which gradients are
    produced), ``step_s`` (K step_time_s + exposed_overlap_s, None without step_time_s).

    Raises:
        ValueError: accumulate < 1; as :meth:`gradcomp.planner.CostModel.predict`.
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


# ==============================================================================================
# Sharded data parallelism: FSDP2 (fully_shard) and HSDP
# ==============================================================================================

FSDP_ENGINES = ("fsdp2", "hsdp")
"""The sharded engines :func:`plan_fsdp_step` plans: ``fsdp2`` (``fully_shard`` on one 1-D mesh of
all W ranks) and ``hsdp`` (gradcomp's "custom HSDP": ``fully_shard`` on a mesh of the L ranks of
a node, plus an all-reduce hook that all-reduces each rank's gradient shard across the W / L
replicas, one rank per node)."""

FSDP_VARIANTS = {"fsdp2": ("dense", "reduce_scatter"),
                 "hsdp": ("dense", "reduce_scatter", "replica_all_reduce", "both")}
"""Where compression goes, per engine: ``dense`` (nothing compressed: NCCL's ring reduce-scatter
and, for hsdp, a dense ring all-reduce across replicas), ``reduce_scatter`` (gradcomp's compressed
reduce-scatter, one all-to-all of fixed-size slots, :func:`gradcomp.planner.fsdp_reduce_scatter_bytes`),
``replica_all_reduce`` (hsdp: the replica all-reduce through gradcomp's schemes, the scheme the
cost model chooses), ``both``."""

FSDP_COLLECTIVES = ("all_gather", "reduce_scatter", "replica_all_reduce")


def _is_units(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and len(obj) > 0 and all(isinstance(u, dict) for u in obj)


def fsdp_units(model: Any, units: Optional[int] = None) -> list:
    """The FSDP units (one ``fully_shard`` module each) of ``model``, as ``[{"name", "root",
    "params"}]``: ``params`` = ``[(name, numel, dtype name, shape)]`` (:func:`parameter_list`
    with ``shapes=True``), ``root`` whether the unit is the root module's (FSDP2 keeps the root's
    parameters unsharded after forward: :func:`plan_fsdp_step`).

    - a torch module: each direct child of a ``torch.nn.ModuleList`` that holds parameters (the
      transformer blocks of ``model.layers``) is a unit, in module order (a list nested inside a
      block stays in that block), and the parameters left over (embeddings, final norm, output
      layer) form the root unit, listed first; ``units`` must be None;
    - a parameter count (``70e9``) or a list of parameters (:func:`parameter_list`'s forms):
      ``units`` (default 1) units of about equal size -- a count in equal parts (the first
      ``count % units`` one element larger), each one 2-D tensor of shape ``(numel, 1)``; a list
      in runs of consecutive parameters -- none of them the root (the embeddings and norms of a
      real model are in these equal units). The approximation: bytes per step do not depend on
      how the parameters are cut into units except through FSDP's padding (at most W - 1 rows
      per tensor); the latency terms grow with the number of units (one all-gather or two and
      one reduce-scatter per unit).
    - a list of unit dicts (this function's output): returned as it is.

    Raises:
        ValueError: ``units`` < 1, or ``units`` given with a torch module; as
            :func:`parameter_list`.
    """
    if _is_units(model):
        return [dict(u) for u in model]
    if hasattr(model, "named_modules"):
        if units is not None:
            raise ValueError(f"planner: units={units!r} with a torch module; accepted: None (a module's units are "
                             f"the children of its ModuleLists and the root)")
        from torch.nn import ModuleList  # a torch module was given, so torch is there

        claimed: set = set()
        blocks = []
        for mname, mod in model.named_modules():
            if not isinstance(mod, ModuleList):
                continue
            for cname, child in mod.named_children():
                ps = [(f"{mname}.{cname}.{pn}", p) for pn, p in child.named_parameters()
                      if p.requires_grad and id(p) not in claimed]
                if ps:
                    claimed.update(id(p) for _, p in ps)
                    blocks.append({"name": f"{mname}.{cname}", "root": False, "params": [
                        (nm, int(p.numel()), _dtype_name(p.dtype), tuple(int(d) for d in p.shape)) for nm, p in ps]})
        rest = [(nm, int(p.numel()), _dtype_name(p.dtype), tuple(int(d) for d in p.shape))
                for nm, p in model.named_parameters() if p.requires_grad and id(p) not in claimed]
        return ([{"name": "root", "root": True, "params": rest}] if rest else []) + blocks
    U = 1 if units is None else units
    if isinstance(U, bool) or not isinstance(U, int) or U < 1:
        raise ValueError(f"planner: units={units!r}; accepted: an int >= 1")
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        n = parameter_list(model, shapes=True)[0][1]
        out = []
        for i in range(U):
            k = n // U + (1 if i < n % U else 0)
            if k:
                out.append({"name": f"unit{i}", "root": False, "params": [(f"unit{i}.params", k, "float32", (k, 1))]})
        return out
    params = parameter_list(model, shapes=True)
    out, at = [], 0
    for i in range(U):
        k = len(params) // U + (1 if i < len(params) % U else 0)
        if k:
            out.append({"name": f"unit{i}", "root": False, "params": params[at: at + k]})
        at += k
    return out


def _new_collective() -> dict:
    return {"calls": 0, "schemes": {}, "bytes": {"intra": 0.0, "inter": 0.0}, "node_inter_bytes": 0.0,
            "comm_s": 0.0, "encode_s": 0.0, "decode_s": 0.0}


def _add(c: dict, scheme: str, lv: dict, comm_s: float, enc: float = 0.0, dec: float = 0.0, times: int = 1) -> None:
    c["calls"] += times
    c["schemes"][scheme] = c["schemes"].get(scheme, 0) + times
    c["bytes"]["intra"] += times * lv["intra"]
    c["bytes"]["inter"] += times * lv["inter"]
    c["node_inter_bytes"] += times * lv["node_inter"]
    c["comm_s"] += times * comm_s
    c["encode_s"] += times * enc
    c["decode_s"] += times * dec


def plan_fsdp_step(units: Any, codec, world_size: int, cost_model: CostModel, *, engine: str = "fsdp2",
                   variant: str = "reduce_scatter", param_dtype: Any = "bfloat16", reduce_dtype: Any = None,
                   reshard_after_forward: bool = True, scheme: str = "auto", min_compress_numel: int = 1024,
                   step_time_s: Optional[float] = None) -> dict:
    """Predict one optimizer step's communication under FSDP2 or HSDP (no gradient accumulation).

    Args:
        units: :func:`fsdp_units`' output, or anything it takes (a torch module, a count, a list
            of parameters: then ``fsdp_units(units)``).
        codec: a :class:`gradcomp.Codec` (used where ``variant`` compresses).
        world_size: W. cost_model: links, L = ranks per node, kernel times
            (:class:`gradcomp.planner.CostModel`; L = ``cost_model.local_world_size``, one node
            when it has no inter link).
        engine: ``"fsdp2"`` or ``"hsdp"`` (:data:`FSDP_ENGINES`).
        variant: where compression goes (:data:`FSDP_VARIANTS`).
        param_dtype: the all-gather dtype (``MixedPrecisionPolicy.param_dtype``; None: each
            parameter's own). reduce_dtype: the reduce-scatter (and replica all-reduce) dtype;
            None: each parameter's own, its gradient's dtype, which is what FSDP2 2.15 does with
            ``reduce_dtype=None`` (earlier releases used ``param_dtype``).
        reshard_after_forward: True (FSDP2's default, ``None``: True for every unit but the root,
            False for the root): a non-root unit's parameters are all-gathered in forward and again
            in backward, the root's once; False: every unit's once.
        scheme: hsdp's replica all-reduce scheme when it is compressed: ``"auto"`` (the cost
            model's choice per unit, :func:`gradcomp.planner.choose_scheme`: dense when
            compression does not pay) or a flat scheme. fsdp2: ``"auto"`` only.
        min_compress_numel: parameters with fewer elements, or fewer than 2 dimensions, are
            exempt (:func:`gradcomp.planner.fsdp_exempt`): raw in the compressed reduce-scatter,
            a dense all-reduce beside the compressed replica all-reduce; a replica shard with
            fewer compressed elements goes dense.
        step_time_s: compute seconds per step (adds ``step_s``; None: no step time).

    The collectives, per unit (G = the shard group: W for fsdp2, L for hsdp; bytes one rank
    sends; N = the unit's padded reduce-scatter input, G padded shards,
    :func:`gradcomp.planner.fsdp_rows`):
      - all-gather of the parameters, uncompressed, in ``param_dtype``: a ring, (G-1) padded
        shards = (G-1)/G of the padded parameters; once or twice (``reshard_after_forward``);
      - reduce-scatter of the gradients in the reduce dtype: dense, NCCL's ring, (G-1)/G N;
        compressed, gradcomp's all-to-all of (G-1) slots (:func:`gradcomp.planner.fsdp_slot`);
        kernels: one encode of the unit's compressed elements, G decodes of this rank's row;
      - hsdp, R = W / L > 1: the replica all-reduce of this rank's shard over the R replicas
        (one rank per node): dense, a ring all-reduce of the padded shard, 2(R-1)/R of it;
        compressed, the shard's compressed elements through the chosen scheme and its exempt
        elements through a dense ring all-reduce (padding does not travel).
    Shard sizes are local rank 0's, the largest (FSDP pads the last ranks' shorter shards).
    Link levels and nodes (:func:`gradcomp.planner.level_bytes`): fsdp2 over several nodes runs
    every collective across nodes (the flat ring's link, :meth:`CostModel.predict`); its ring
    collectives leave each node over one hop per direction, its all-to-all sends (W-L)/(W-1) of
    each rank's slots off the node from every one of the node's L ranks, L (W-L)/(W-1) times a
    ring's bytes per node (about 8x at L = 8: the review of ByteDance VeOmni PR #1167), and a
    per-node NIC (``Link(per_node=True)``) carries that load
    (:meth:`gradcomp.planner.CostModel.inter_load`). hsdp's all-gather and reduce-scatter stay in
    the node (intra link); its replica all-reduce runs on the inter link, all L local ranks' at
    once (a per-node NIC is shared by L).
    Times: alpha-beta (:func:`gradcomp.planner.collective_time`) plus the codec's kernels
    (:class:`gradcomp.planner.Throughput`), summed without overlap.

    Returns a dict: ``engine``, ``variant``, ``codec`` (spec), ``world_size``,
    ``local_world_size`` (L; W on one node), ``shard_size`` (G), ``replicas`` (R), ``units``,
    ``tensors``, ``params`` (elements), ``exempt_params`` (elements), ``param_bytes`` (the
    parameters in the all-gather dtype, unpadded) and ``gradient_bytes`` (the gradients in the
    reduce dtype, unpadded), ``param_dtype`` / ``reduce_dtype`` (names; for None the dtypes the
    parameters have, comma-separated), ``reshard_after_forward``; ``collectives``: per name of :data:`FSDP_COLLECTIVES`
    ``{"calls", "schemes": {algorithm or scheme: calls}, "bytes": {"intra", "inter"},
    "node_inter_bytes", "comm_s", "encode_s", "decode_s"}``; the totals ``bytes`` (bytes one
    rank sends per step per link level), ``node_inter_bytes`` (bytes one node sends into the
    network per step), ``comm_s``, ``encode_s``, ``decode_s``, ``total_s`` (their sum, seconds)
    and ``step_s`` (``step_time_s + total_s``, None without ``step_time_s``).

    Sources: FSDP2's layout and defaults from PyTorch 2.15's ``fully_shard`` (dim-0 shards cut as
    ``torch.chunk`` cuts them and padded, ``reshard_after_forward=None``, ``reduce_dtype=None``,
    ``foreach_reduce``'s one reduce-scatter per unit); custom HSDP: pytorch/pytorch issue 147114
    (a 1-D FSDP mesh per node and an all-reduce hook across replicas); the all-to-all's bytes
    across nodes: the review of ByteDance VeOmni PR #1167; ring collectives: Thakur, Rabenseifner
    & Gropp, IJHPCA 2005.

    Raises:
        ValueError: an unknown engine, variant or scheme; W < 1; L not dividing W over several
            nodes (hsdp: W must be R L); a unit whose gradients have more than one dtype with
            ``reduce_dtype=None`` (FSDP2 reduces a unit in one dtype); as :func:`fsdp_units`.
    """
    if engine not in FSDP_ENGINES:
        raise ValueError(f"planner: engine={engine!r}; accepted: {', '.join(FSDP_ENGINES)}")
    if variant not in FSDP_VARIANTS[engine]:
        raise ValueError(f"planner: variant={variant!r} for engine {engine}; accepted: "
                         f"{', '.join(FSDP_VARIANTS[engine])}")
    W = int(world_size)
    if W < 1:
        raise ValueError(f"planner: world_size={world_size!r}; accepted: an int >= 1")
    flat = _schemes.names(flat=True)
    if scheme != "auto" and (engine == "fsdp2" or scheme not in flat):
        acc = "auto" if engine == "fsdp2" else "auto, " + ", ".join(flat)
        raise ValueError(f"planner: scheme={scheme!r} for engine {engine}; accepted: {acc} (fsdp2's reduce-scatter "
                         f"is the all-to-all; hsdp's scheme is its replica all-reduce's)")
    L = cost_model.local_world_size
    if cost_model.inter is not None and 0 < L < W and W % L:
        raise ValueError(f"planner: {engine}: world size W={W} is not a multiple of the ranks per node L={L}; "
                         f"accepted: W = R * L (whole nodes)")
    multi = cost_model.nodes(W) > 1
    us = fsdp_units(units)
    rs_c = variant in ("reduce_scatter", "both")
    ar_c = variant in ("replica_all_reduce", "both")
    tp, ef = cost_model.throughput, cost_model.error_feedback
    rm = None
    if engine == "fsdp2":
        G, R, Ln = W, 1, (L if multi else 0)
        link = cost_model._flat_link(W)
        load_a2a = cost_model.inter_load("all_to_all", W) if multi else 1.0
        eng = cost_model.engine_for("flat")
    else:
        G = L if multi else W
        R, Ln, link, load_a2a = W // G, 0, cost_model.intra, 1.0
        eng = cost_model.engine_for("intra" if multi else "flat")  # the shard group: a node's ranks
        if R > 1:  # the replica group: one rank per node on the inter link, L such groups per node at once
            inter = cost_model.inter
            beta = inter.bytes_per_s / cost_model.inter_load("allreduce", W, grouped=True)
            rm = CostModel(Link(beta, inter.latency_s, inter.shared, inter.name), None, 0, tp, cost_model.engine, ef,
                           cost_model.engine_for("inter"))
    colls = {k: _new_collective() for k in FSDP_COLLECTIVES}
    n_params = n_exempt = n_tensors = pbytes = gbytes = 0
    used = {"param": set(), "reduce": set()}
    for unit in us:
        plist = list(unit["params"])
        if not plist:
            continue
        rdts = {_dtype_name(reduce_dtype) if reduce_dtype is not None else _dtype_name(p[2]) for p in plist}
        if len(rdts) > 1:
            raise ValueError(f"planner: FSDP unit {unit['name']!r} has gradients of dtypes {sorted(rdts)}; FSDP2 "
                             f"reduces a unit in one dtype: accepted: one dtype per unit, or pass reduce_dtype")
        rdt = rdts.pop()
        used["reduce"].add(rdt)
        es = dtype_bytes(rdt)
        shard_p = 0  # bytes of every rank's padded shard of the parameters, in the all-gather dtype
        for _, n, dt, shape in plist:
            pdt = _dtype_name(dt if param_dtype is None else param_dtype)
            used["param"].add(pdt)
            shard_p += fsdp_shard_rows(n, shape[0] if shape else 1, G, 0)[1] * dtype_bytes(pdt)
            pbytes += dense_bytes(n, pdt)
            gbytes += dense_bytes(n, rdt)
            n_params += n
            n_tensors += 1
        rows, N = fsdp_rows([(n, shape) for _, n, _, shape in plist], G, min_compress_numel)
        n_exempt += sum(e for _, e in rows)
        if G < 2:
            continue
        # the parameters' all-gather: a ring, every rank's padded shard to every other
        gathers = 1 if (not reshard_after_forward or unit.get("root")) else 2
        _add(colls["all_gather"], "ring", level_bytes("all_gather", all_gather_bytes(shard_p, G), G, Ln),
             collective_time("all_gather", shard_p, G, link, engine=eng), times=gathers)
        # the gradients' reduce-scatter
        if rs_c:
            acc = fsdp_reduce_scatter_bytes(codec, rows, rdt, N)
            slot = fsdp_slot(codec, rows, rdt)["slot"]
            enc = tp.encode_s(codec, sum(c for c, _ in rows), rdt, ef)
            dec = G * tp.decode_s(codec, rows[0][0], "float32")
            _add(colls["reduce_scatter"], "all_to_all", level_bytes("all_to_all", acc["sent_bytes"], G, Ln),
                 collective_time("all_to_all", slot, G, link, load_a2a, eng), enc, dec)
        else:
            ring = all_gather_bytes(N // G * es, G)  # (G-1) shards: (G-1)/G of the input
            _add(colls["reduce_scatter"], "ring", level_bytes("reduce_scatter", ring, G, Ln),
                 collective_time("reduce_scatter", N * es, G, link, engine=eng))
        # hsdp: this rank's shard all-reduced across the R replicas
        if rm is not None:
            c0, e0 = rows[0]
            if ar_c:
                parts = []
                if c0:
                    parts.append(rm.predict(choose_scheme(codec, c0, rdt, R, scheme, min_compress_numel, cost_model=rm),
                                            codec, c0, rdt, R))
                if e0:
                    parts.append(rm.predict("dense", codec, e0, rdt, R))
            else:
                parts = [rm.predict("dense", codec, N // G, rdt, R)]
            for p in parts:
                sent = p["bytes"]["intra"] + p["bytes"]["inter"]
                _add(colls["replica_all_reduce"], p["scheme"],
                     level_bytes("allreduce", sent, R, G, one_rank_per_node=True), p["comm_s"], p["encode_s"],
                     p["decode_s"])
    out = {"engine": engine, "variant": variant, "codec": codec.spec, "world_size": W,
           "local_world_size": L if multi else W, "shard_size": G, "replicas": R, "units": len(us),
           "tensors": n_tensors, "params": n_params, "exempt_params": n_exempt, "param_bytes": pbytes,
           "gradient_bytes": gbytes,
           "param_dtype": _dtype_name(param_dtype) if param_dtype is not None else ", ".join(sorted(used["param"])),
           "reduce_dtype": _dtype_name(reduce_dtype) if reduce_dtype is not None else ", ".join(sorted(used["reduce"])),
           "reshard_after_forward": bool(reshard_after_forward), "collectives": colls,
           "bytes": {lv: sum(c["bytes"][lv] for c in colls.values()) for lv in ("intra", "inter")},
           "node_inter_bytes": sum(c["node_inter_bytes"] for c in colls.values())}
    for f in ("comm_s", "encode_s", "decode_s"):
        out[f] = sum(c[f] for c in colls.values())
    out["total_s"] = out["comm_s"] + out["encode_s"] + out["decode_s"]
    out["step_s"] = None if step_time_s is None else float(step_time_s) + out["total_s"]
    return out


def plan_fsdp_variants(units: Any, codec, world_size: int, cost_model: CostModel, *, engine: str = "fsdp2",
                       **options) -> list:
    """:func:`plan_fsdp_step` of every variant of ``engine`` (:data:`FSDP_VARIANTS`: dense
    first), the same ``options``, each with the ratios to the dense variant:
    ``inter_bytes_vs_dense`` and ``node_inter_bytes_vs_dense`` (the row's bytes / dense's: below
    1 is fewer bytes), ``speedup_vs_dense`` (dense's time / the row's: ``step_s`` with
    ``step_time_s``, else ``total_s``), and ``fastest`` (True on the variant of least time, the
    first of equal ones). Ratios with a zero denominator are None.

    Raises:
        ValueError: as :func:`plan_fsdp_step`.
    """
    us = fsdp_units(units)
    rows = [plan_fsdp_step(us, codec, world_size, cost_model, engine=engine, variant=v, **options)
            for v in FSDP_VARIANTS.get(engine, (None,))]
    key = "step_s" if rows[0]["step_s"] is not None else "total_s"

    def ratio(a, b):
        return a / b if b else None

    d = rows[0]
    best = min(range(len(rows)), key=lambda i: rows[i][key])
    for i, r in enumerate(rows):
        r["inter_bytes_vs_dense"] = ratio(r["bytes"]["inter"], d["bytes"]["inter"])
        r["node_inter_bytes_vs_dense"] = ratio(r["node_inter_bytes"], d["node_inter_bytes"])
        r["speedup_vs_dense"] = ratio(d[key], r[key])
        r["fastest"] = i == best
    return rows
