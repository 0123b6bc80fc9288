"""The process groups of the ``hierarchical`` scheme, built once per (group, L) and cached.

A group of W ranks in nodes of L consecutive group ranks (:func:`gradcomp.planner.
hierarchical_groups`): group rank r is on node r // L with local rank r % L. The scheme needs two
groups per rank:

- the *intra* group of its node: group ranks ``[k L, k L + 1, ..., k L + L - 1]`` (N = W / L of
  them, one per node);
- the *cross* group of its local rank: group ranks ``[j, L + j, 2 L + j, ...]`` (L of them, one
  per local rank), ordered by node, so a rank's rank in it is its node.

``torch.distributed.new_group`` is collective: every rank must make the same calls in the same
order. :func:`hierarchical_groups_for` makes all of them on every rank (the N intra groups in node
order, then the L cross groups in local-rank order) and caches the two this rank belongs to:

- on the default group (``group=None``, or the default ProcessGroup itself, as DDP holds it)
  with the default ``new_group`` (every rank of the world
  takes part in every call);
- on a subgroup, its ranks mapped to global ranks through ``dist.get_process_group_ranks``, with
  ``use_local_synchronization=True``: only the subgroup's ranks make the calls (ranks outside it
  need not, and cannot be made to, call in); each rank is a member of exactly one group of each
  kind, so torch's group counter advances alike on every member.
Degenerate shapes make no group: L = 1 (one rank per node) has no intra group and the whole
``group`` is the cross group; L = W (one node) has no cross group and ``group`` is the intra one.
"""

from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .. import planner

_CACHE: Dict[Tuple[int, int], tuple] = {}  # (id of the parent group, L) -> (parent, intra, cross)


class HierarchicalGroups:
    """This rank's groups of the ``hierarchical`` scheme over a parent group.

    Attributes:
        world_size: W, the parent group's size; local_world_size: L; nodes: N = W / L.
        rank: this rank in the parent group; node: rank // L; local_rank: rank % L.
        intra: the process group of this rank's node (L ranks; None when L = 1: nothing to do).
        cross: the process group of this rank's local rank over the N nodes, its rank there the
            node (the parent group itself when L = 1; None when N = 1: nothing to do).
    """

    __slots__ = ("world_size", "local_world_size", "nodes", "rank", "node", "local_rank", "intra", "cross")

    def __init__(self, world_size: int, local_world_size: int, rank: int, intra: Any, cross: Any):
        self.nodes, self.local_world_size = planner.hierarchical_groups(world_size, local_world_size)
        self.world_size, self.rank = int(world_size), int(rank)
        self.node, self.local_rank = divmod(self.rank, self.local_world_size)
        self.intra, self.cross = intra, cross


def _parent_key(group: Any) -> Any:
    """The ProcessGroup object ``group`` stands for (None: the default group)."""
    return dist.distributed_c10d._get_default_group() if group is None else group


def hierarchical_groups_for(group: Any, local_world_size: int) -> HierarchicalGroups:
    """The intra-node and cross-node groups of this rank for ``group`` (None: the default
    group) cut into nodes of ``local_world_size`` ranks, created on the first call for that
    (group, L) and cached (module docstring). Every rank of ``group`` must make the first call
    for a given (group, L) at the same point of its sequence of process-group creations.

    Raises:
        ValueError: ``local_world_size`` < 1 or not dividing the group's size.
    """
    W = dist.get_world_size(group)
    rank = dist.get_rank(group)
    nodes, L = planner.hierarchical_groups(W, local_world_size)
    parent = _parent_key(group)
    key = (id(parent), L)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not parent:
        intra = cross = None
        if L == 1:
            cross = group
        elif nodes == 1:
            intra = group
        else:
            if parent is dist.distributed_c10d._get_default_group():  # None, or the default group itself
                ranks = list(range(W))
                local = {}
            else:
                ranks = [int(g) for g in dist.get_process_group_ranks(group)]
                local = {"use_local_synchronization": True}
            for k in range(nodes):  # every rank makes every call, in this order
                g = dist.new_group([ranks[k * L + i] for i in range(L)], **local)
                if k == rank // L:
                    intra = g
            for j in range(L):
                g = dist.new_group([ranks[k * L + j] for k in range(nodes)], **local)
                if j == rank % L:
                    cross = g
        for g, want, what in ((intra, rank % L, "node"), (cross, rank // L, "local rank")):
            if g is not None and g is not group and dist.get_rank(g) != want:
                raise ValueError(f"hierarchical: the group of this rank's {what} puts it at rank "
                                 f"{dist.get_rank(g)}, expected {want}: the group's ranks must be in "
                                 f"ascending global order (create it with new_group's default sort)")
        hit = _CACHE[key] = (parent, intra, cross)
    return HierarchicalGroups(W, L, rank, hit[1], hit[2])


def engine_of(group: Any, device: Optional[torch.device] = None) -> str:
    """``"gloo"`` or ``"nccl"``: the engine the byte accounting of ``hierarchical`` assumes for
    tensors on ``device`` reduced over ``group`` (:func:`gradcomp.planner.hierarchical_steps`):
    ``"gloo"`` when ``dist.get_backend(group)`` is gloo, or names gloo for CPU tensors (e.g.
    ``"cpu:gloo,cuda:nccl"`` with a CPU ``device``); else ``"nccl"``."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "gloo":
        return "gloo"
    if device is not None and torch.device(device).type == "cpu" and "cpu:gloo" in backend:
        return "gloo"
    return "nccl"
