"""The ``auto`` scheme choice of :mod:`gradcomp.planner`: :func:`choose_scheme` (the rule every
rank applies alike), :func:`bytes_choice` (its byte-count rules), :func:`hierarchical_inner` (the
scheme ``hierarchical`` runs across nodes) and :func:`choice_report` (a cost model's choice as one
log line). A cost model (:class:`gradcomp.planner.CostModel`) is used only through its methods.
"""

from typing import Any

from . import schemes as _schemes
from .bytes import chunk_size, dense_bytes, hierarchical_groups, two_phase_slots


def choose_scheme(codec, numel: int, dtype: Any, world_size: int, requested: str = "auto",
                  min_compress_numel: int = 1024, *, cost_model=None, local_world_size: int = 0) -> str:
    """The scheme a bucket of ``numel`` elements of ``dtype`` takes once compression is on.

    Rule, in order:
      1. ``"dense"`` when ``numel == 0`` or ``numel < min_compress_numel``;
      2. ``requested`` when it is not ``"auto"`` (``"hierarchical"`` included);
      3. with a ``cost_model`` (:class:`gradcomp.planner.CostModel`): the scheme of least
         predicted time (:meth:`gradcomp.planner.CostModel.choose`: dense when compression does
         not pay; ``hierarchical`` is a candidate when ``local_world_size`` L > 1 divides W and
         W / L > 1);
      4. ``"sum"`` for a linear codec (``codec.properties["linear"]``);
      5. for a sparse codec (``codec.properties["sparse"]``, top-k): ``"gather"`` when it sends
         fewer bytes than a dense ring allreduce, approximated as ``W * packet_bytes < 2 *
         dense_bytes`` (i.e. (W-1) P vs 2 (W-1)/W D, both scaled by W/(W-1)); else ``"dense"``;
      6. for the other codecs (the quantizers): ``"two_phase"`` when it sends fewer bytes than a
         dense ring allreduce, (W-1) (P1 + P2) < 2 (W-1)/W D, evaluated in integers as
         ``W * (P1 + P2) < 2 * dense_bytes`` (:func:`gradcomp.planner.two_phase_slots`; with
         P1 = P2 = P: W P < D), which never holds for W = 1; else ``"dense"``.
    Inputs are all rank-shared (the cost model's links and throughput table are configuration),
    so every rank chooses alike.

    Raises:
        ValueError: ``requested`` is not ``"auto"`` or one of :data:`gradcomp.planner.ALL_SCHEMES`.
    """
    if requested != "auto" and requested not in _schemes.names():
        raise ValueError(f"planner: scheme={requested!r}; accepted: auto, {', '.join(_schemes.names())}")
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


def hierarchical_inner(codec, numel: int, dtype: Any, world_size: int, local_world_size: int,
                       requested: str = "auto", min_compress_numel: int = 1024, cost_model=None) -> str:
    """The scheme the ``hierarchical`` scheme runs across nodes: :func:`choose_scheme` of one
    intra-node chunk (c = ceil(numel / L) elements of float32, the node sum) over the N = W / L
    ranks of one local rank; every local rank takes the scheme of the full chunk size c, so the
    choice is the same on every rank. ``requested`` is the inner scheme asked for (not
    ``hierarchical``). With a ``cost_model`` of L ranks per node and ``requested="auto"``: the
    inner scheme of least predicted hierarchical time
    (:meth:`gradcomp.planner.CostModel.predict`). One node (W = L): ``"dense"``, whatever is
    requested (nothing crosses nodes)."""
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


def choice_report(choice: dict) -> str:
    """One log line of a :meth:`gradcomp.planner.CostModel.choose` result: the choice and each
    candidate's predicted total / communication time in ms."""
    parts = []
    for p in choice["predictions"]:
        nm = p["scheme"] + (f"({p['inner']})" if p["inner"] else "")
        parts.append(f"{nm} {1e3 * p['total_s']:.3g} ms (comm {1e3 * p['comm_s']:.3g})")
    nm = choice["scheme"] + (f"({choice['inner']})" if choice["inner"] else "")
    return f"cost model chose {nm}: " + ", ".join(parts)
