"""A training step in :mod:`gradcomp.planner`: a model's parameters (:func:`parameter_list`), the
buckets DDP builds from them (:func:`ddp_buckets`) and one step's gradient synchronization
(:func:`plan_step`): bytes per link level, exposed time with and without overlap, the bandwidth a
step time needs.
"""

from typing import Any, Dict, Optional, Tuple

from ..codec import _dtype_name
from .bytes import dense_bytes, dtype_bytes
from .choice import choose_scheme, hierarchical_inner
from .cost import CostModel


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
