"""``DGC``: Deep Gradient Compression for momentum SGD (Lin, Han, Mao, Wang & Dally, "Deep Gradient
Compression: Reducing the Communication Bandwidth for Distributed Training", ICLR 2018), as a
``torch.optim.Optimizer`` that exchanges its own sparse updates.

Why an optimizer and not a DDP hook: momentum correction moves the momentum into the compression
state (each rank accumulates its momentum-corrected gradient locally and sends the top of that
accumulation), and momentum factor masking zeroes the momentum where a value was sent, so the
optimizer's momentum buffer and the compressor's state are one thing; a hook cannot reach the
momentum of a ``torch.optim.SGD``, and SGD's own momentum would apply momentum a second time. The
optimizer therefore owns both, and the DDP hook (:func:`gradcomp.optim.register_comm_hook`) sends
nothing: gradients stay local and ``step()`` does every exchange.

Per step, on every rank (algorithm 1 and section 3 of the paper; t the step, W the world size):

1. local gradient clipping (``clip``: the paper's section 3.2): the l2 norm of this rank's whole
   local gradient (every parameter, computed in float64), N; when N > clip / sqrt(W), every local
   gradient is multiplied by the float32 factor fl32((clip / sqrt(W)) / (N + 1e-6));
2. compressed parameters (2 or more dimensions, unless a parameter group says ``compress``):
   momentum correction u = fl(fl(m u) + g), v = fl(v + u) (``nesterov``: u = fl(m fl(u + g)),
   v = fl(fl(v + u) + g)); the k = min(n, max(1, ceil(d_t n))) largest |v| (exact top-k, ties to
   the lower index: gradcomp's ``topk`` codec) are sent; v and u are zeroed there (momentum
   factor masking); the packets of all compressed parameters, one after another, go through one
   all-gather; each rank decodes the W packets of each parameter in rank order into a float32 sum
   from +0.0 and divides it by W once: G; then p = fl(p - fl(fl(G + fl(wd p)) lr)) -- weight
   decay outside the compressed path (added to the update, never sparsified or accumulated);
   when a parameter's packet would hold as many bytes as the parameter (d_t of about 1/2 and up),
   its v is averaged dense instead (the same mathematics: every element is sent) and v, u are
   zeroed;
3. dense parameters (fewer than 2 dimensions: biases, norms): the gradients averaged by one SUM
   allreduce divided by W, then momentum SGD as ``torch.optim.SGD`` (d = fl(g + fl(wd p)), u =
   fl(fl(m u) + d), nesterov d = fl(d + fl(m u)) else d = u, p = fl(p - fl(d lr))).

The density d_t follows ``warmup`` then stays at ``density``. The paper warms the density up over
the first epochs, x1/4 per epoch (75%, 93.75%, 98.4375%, 99.6%, 99.9% sparsity); the reference
code's default is a geometric ramp with other coefficients; both are a list of ``(step, density)``
pairs here (:func:`warmup_stages`, :func:`warmup_geometric`), so the coefficients are always
explicit.

Byte accounting (:meth:`DGC.comm_stats`): one all-gather of this rank's packets ((W-1) times their
bytes), one ring allreduce of the dense gradients and of the dense-sent velocities.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import planner
from ..codec import Codec
from ..errors import CollectiveError, in_context
from ..schemes.check import check_headers
from ..schemes.context import collective_failed

Warmup = Union[None, Sequence[Tuple[int, float]], Callable[[int], float]]


def warmup_stages(densities: Sequence[float], steps_per_stage: int) -> List[Tuple[int, float]]:
    """``[(i * steps_per_stage, densities[i])]``: one density per stage (e.g. per epoch). The
    paper's schedule for a final density of 0.001 is ``warmup_stages([0.25, 0.0625, 0.015625,
    0.004], steps_per_epoch)`` (x1/4 per epoch; the fifth epoch on runs at ``density``).

    Raises:
        ValueError: an empty list, steps_per_stage < 1, a density outside (0, 1].
    """
    if not densities:
        raise ValueError("warmup_stages: densities is empty; accepted: one density in (0, 1] per stage")
    if isinstance(steps_per_stage, bool) or not isinstance(steps_per_stage, int) or steps_per_stage < 1:
        raise ValueError(f"warmup_stages: steps_per_stage={steps_per_stage!r}; accepted: an int >= 1")
    return _check_warmup([(i * steps_per_stage, float(d)) for i, d in enumerate(densities)])


def warmup_geometric(start: float, end: float, steps: int, stages: int) -> List[Tuple[int, float]]:
    """A geometric ramp from ``start`` to ``end`` in ``stages`` equal stages over ``steps`` steps:
    stage i (i = 0 .. stages-1) begins at step ``i * steps // stages`` with density
    ``start * (end / start) ** (i / stages)`` (the reference code's kind of schedule, its
    coefficients given here).

    Raises:
        ValueError: densities outside (0, 1], steps < stages, stages < 1.
    """
    if not (0 < start <= 1 and 0 < end <= 1):
        raise ValueError(f"warmup_geometric: start={start!r}, end={end!r}; accepted: densities in (0, 1]")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or not isinstance(steps, int) or steps < stages:
        raise ValueError(f"warmup_geometric: steps={steps!r}, stages={stages!r}; accepted: ints with steps >= stages >= 1")
    return _check_warmup([(i * steps // stages, float(start * (end / start) ** (i / stages))) for i in range(stages)])


def _check_warmup(w: Sequence[Tuple[int, float]]) -> List[Tuple[int, float]]:
    out, last = [], -1
    for e in w:
        try:
            s, d = e
        except (TypeError, ValueError):
            raise ValueError(f"DGC warmup entry {e!r}; accepted: (step, density) pairs") from None
        if isinstance(s, bool) or not isinstance(s, int) or s <= last:
            raise ValueError(f"DGC warmup entry {e!r}: steps must be ints >= 0, strictly increasing")
        if not isinstance(d, (int, float)) or not 0 < float(d) <= 1:
            raise ValueError(f"DGC warmup entry {e!r}: density {d!r}; accepted: in (0, 1]")
        out.append((int(s), float(d)))
        last = s
    return out


def _index_view(packet: torch.Tensor, layout: dict) -> torch.Tensor:
    """The int64 indices of a top-k packet (its ``indices`` section)."""
    name, off, count, dt = layout["sections"][0]
    if name != "indices":
        raise RuntimeError(f"DGC: expected a top-k packet, its first section is {name!r}")
    if dt == "uint32":
        return packet[off: off + 4 * count].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return packet[off: off + 8 * count].view(torch.int64)


class DGC(torch.optim.Optimizer):
    """Deep Gradient Compression (module docstring) for momentum SGD.

    Args:
        params: parameters or param groups; a group may set ``compress`` (True/False) to override
            the rule "compressed when the parameter has 2 or more dimensions".
        lr: learning rate (required).
        momentum: m (default 0.9); nesterov: Nesterov momentum (default False).
        weight_decay: L2 coefficient, applied outside the compressed path (default 0).
        density: the fraction of each compressed parameter sent per step after the warm-up
            (default 0.001, the paper's 99.9% sparsity).
        warmup: None, ``[(step, density)]`` (each entry's density from its step until the next
            entry's, the last one until ``warmup_steps``: :meth:`density_at`), or a callable
            ``step -> density`` used while ``step < warmup_steps``.
        warmup_steps: the step from which ``density`` applies (default: one stage after the last
            warm-up entry's step, the length of the last stage being that of the one before it, or
            the last entry's step + 1 for a single entry; 0 without warm-up).
        clip: local gradient clipping threshold (the global l2 norm over the group; each rank
            clips its own gradient to ``clip / sqrt(W)``), or None.
        group: the process group (default: the world; without torch.distributed, world size 1).
        average_gradients: unused (kept for the DDP hook's interface): DGC always exchanges in
            ``step()``.

    State per parameter (``state_dict`` keeps it, bit-exact): ``step`` (int), ``momentum_buffer``
    (u, float32), and for compressed parameters ``velocity`` (v, float32). The velocities and
    momenta are this rank's: save every rank's state_dict.

    Raises:
        ValueError: lr < 0, momentum outside [0, 1), weight_decay < 0, a density outside (0, 1],
            clip <= 0, a bad warmup (the message names the entry).
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, nesterov: bool = False, weight_decay: float = 0.0,
                 *, density: float = 0.001, warmup: Warmup = None, warmup_steps: Optional[int] = None,
                 clip: Optional[float] = None, group=None, average_gradients: bool = True):
        if not lr >= 0:
            raise ValueError(f"gradcomp.optim.DGC: lr={lr!r}; accepted: >= 0")
        if not 0 <= momentum < 1:
            raise ValueError(f"gradcomp.optim.DGC: momentum={momentum!r}; accepted: in [0, 1)")
        if not weight_decay >= 0:
            raise ValueError(f"gradcomp.optim.DGC: weight_decay={weight_decay!r}; accepted: >= 0")
        if not 0 < density <= 1:
            raise ValueError(f"gradcomp.optim.DGC: density={density!r}; accepted: in (0, 1]")
        if clip is not None and not clip > 0:
            raise ValueError(f"gradcomp.optim.DGC: clip={clip!r}; accepted: > 0 or None")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=bool(nesterov), weight_decay=weight_decay))
        self.density = float(density)
        if warmup is None or callable(warmup):
            self._warmup_fn = warmup
            self.warmup: List[Tuple[int, float]] = []
        else:
            self._warmup_fn = None
            self.warmup = _check_warmup(list(warmup))
        if warmup_steps is None and self._warmup_fn is not None:
            raise ValueError("gradcomp.optim.DGC: a callable warmup needs warmup_steps= (the step from which "
                             "density applies)")
        if warmup_steps is None:
            w = self.warmup
            warmup_steps = 0 if not w else (w[-1][0] + (w[-1][0] - w[-2][0] if len(w) > 1 else 1))
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"gradcomp.optim.DGC: warmup_steps={warmup_steps!r}; accepted: an int >= 0")
        self.warmup_steps = int(warmup_steps)
        self.clip = None if clip is None else float(clip)
        self.group = group
        self.size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.average_gradients = bool(average_gradients)
        self.dense_next = False  # the DDP hook (gradcomp.optim.register_comm_hook) sends nothing
        self._codecs: Dict[int, Codec] = {}
        self._stats = {"steps": 0, "dense_sent_bytes": 0.0, "compressed_sent_bytes": 0.0, "packet_bytes": 0,
                       "exchanged_dense_bytes": 0, "sent_elements": 0, "compressed_elements": 0}

    # -- the schedule --------------------------------------------------------------------------
    def density_at(self, step: int) -> float:
        """d_t: the warm-up's density at step ``step`` (0-based) while ``step < warmup_steps``
        (a list: the last entry whose step is <= ``step``; a callable: its value), else
        ``density``."""
        if step >= self.warmup_steps:
            return self.density
        if self._warmup_fn is not None:
            d = float(self._warmup_fn(step))
            if not 0 < d <= 1:
                raise ValueError(f"gradcomp.optim.DGC: warmup({step}) = {d!r}; accepted: a density in (0, 1]")
            return d
        d = self.density
        for s, dd in self.warmup:
            if s <= step:
                d = dd
        return d

    def _codec(self, k: int) -> Codec:
        c = self._codecs.get(k)
        if c is None:
            c = self._codecs[k] = Codec(f"topk:k={k}")
        return c

    @property
    def step_count(self) -> int:
        """Steps taken (the state's ``step`` of the first parameter that has one)."""
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state.get(p)
                if st and "step" in st:
                    return int(st["step"])
        return 0

    @staticmethod
    def _compressed(group: dict, p: torch.Tensor) -> bool:
        c = group.get("compress")
        return bool(c) if c is not None else p.dim() >= 2

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One DGC step (module docstring). Returns the closure's loss.

        Raises:
            gradcomp.CollectiveError: an exchange failed (the parameters and the state are as
                before the step); gradcomp.RankMismatchError: ranks sent packets of other sizes.
            RuntimeError: sparse gradients.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self.step_count
        comp, dense = [], []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("gradcomp.optim.DGC: sparse gradients are not supported")
                (comp if self._compressed(g, p) else dense).append((g, p))
        grads = {id(p): p.grad.detach().to(torch.float32).reshape(-1) for _, p in comp + dense}
        if self.clip is not None and grads:
            self._clip(grads)
        W = self.size
        d_t = self.density_at(t)
        # momentum correction, into new tensors: the state changes only once the exchange succeeded
        new = {}
        packets, sparse, dense_v = [], [], []
        for g, p in comp:
            st = self.state[p]
            n = p.numel()
            u = st.get("momentum_buffer")
            v = st.get("velocity")
            if u is None:
                u = torch.zeros(n, dtype=torch.float32, device=p.device)
                v = torch.zeros(n, dtype=torch.float32, device=p.device)
            gr = grads[id(p)]
            m = g["momentum"]
            if g["nesterov"]:
                u2 = (u + gr).mul_(m)
                v2 = (v + u2).add_(gr)
            else:
                u2 = (u * m).add_(gr)
                v2 = v + u2
            new[id(p)] = [u2, v2]
            codec = self._codec(min(n, max(1, math.ceil(d_t * n))))
            if W > 1 and codec.packet_bytes(n) >= 4 * n:
                dense_v.append((g, p))
                continue
            r = torch.zeros(n, dtype=torch.float32, device=p.device)
            pk = codec.encode(v2, residual=r)  # r = v2 - D: v2 where not sent, exactly 0 where sent
            idx = _index_view(pk, codec.layout(n))
            u2.index_fill_(0, idx, 0.0)
            new[id(p)][1] = r
            packets.append(pk)
            sparse.append((g, p, codec))
        try:
            G = self._exchange(packets, sparse)
            Gd = self._average([new[id(p)][1] for _, p in dense_v])
            gd = self._average([grads[id(p)] for _, p in dense])
        except Exception as e:  # noqa: BLE001 - nothing was changed: raised with the step named
            if isinstance(e, CollectiveError):
                raise in_context(e, f"gradcomp.optim.DGC: step {t + 1} failed; the parameters and the state are as "
                                    f"before it") from e
            raise
        # commit
        for (g, p), avg in zip(dense_v, Gd):
            u2, v2 = new[id(p)]
            u2.zero_()
            new[id(p)][1] = torch.zeros_like(v2)
            G[id(p)] = avg
        for g, p in comp:
            st = self.state[p]
            st["momentum_buffer"], st["velocity"] = new[id(p)]
            st["step"] = t + 1
            upd = G[id(p)]
            if g["weight_decay"]:
                upd = upd + p.detach().reshape(-1).float() * g["weight_decay"]
            p.sub_((upd * g["lr"]).view_as(p).to(p.dtype))
        for (g, p), avg in zip(dense, gd):
            st = self.state[p]
            d = avg
            if g["weight_decay"]:
                d = d + p.detach().reshape(-1).float() * g["weight_decay"]
            u = st.get("momentum_buffer")
            m = g["momentum"]
            if m:
                u = d.clone() if u is None else (u * m).add_(d)
                st["momentum_buffer"] = u
                d = d + u * m if g["nesterov"] else u
            st["step"] = t + 1
            p.sub_((d * g["lr"]).view_as(p).to(p.dtype))
        self._stats["steps"] += 1
        return loss

    def _clip(self, grads: Dict[int, torch.Tensor]) -> None:
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads.values()])
        total = torch.linalg.vector_norm(norms)
        thr = self.clip / math.sqrt(self.size)
        coef = torch.clamp(thr / (total + 1e-6), max=1.0).to(torch.float32)
        for k in grads:
            grads[k] = grads[k] * coef

    def _exchange(self, packets: List[torch.Tensor], sparse: list) -> Dict[int, torch.Tensor]:
        """One all-gather of this rank's packets (one after another); each parameter's W
        packets decoded in rank order into a float32 sum, divided by W."""
        out: Dict[int, torch.Tensor] = {}
        if not packets:
            return out
        W = self.size
        sizes = [int(pk.numel()) for pk in packets]
        total = sum(sizes)
        if W == 1:
            gathered = torch.cat(packets)
        else:
            mine = torch.cat(packets)
            gathered = torch.empty(W * total, dtype=torch.uint8, device=mine.device)
            try:
                dist.all_gather_into_tensor(gathered, mine, group=self.group)
            except Exception as e:  # noqa: BLE001 - named, cause kept
                raise collective_failed("gradcomp.optim.DGC: the all-gather of the sparse packets", e) from e
            self._stats["compressed_sent_bytes"] += float((W - 1) * total)
        self._stats["packet_bytes"] += total
        off = 0
        for (g, p, codec), size, pk in zip(sparse, sizes, packets):
            n = p.numel()
            check_headers(gathered[off:], total, [(j, n) for j in range(W)], pk, "float32",
                          "gradcomp.optim.DGC: the all-gather of the sparse packets")
            acc = torch.zeros(n, dtype=torch.float32, device=p.device)
            for j in range(W):
                codec.decode(gathered[j * total + off: j * total + off + size], out=acc, accumulate=True)
            out[id(p)] = acc.div_(W)
            self._stats["exchanged_dense_bytes"] += 4 * n
            self._stats["sent_elements"] += codec.main_param(n)
            self._stats["compressed_elements"] += n
            off += size
        return out

    def _average(self, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """Mean over the group of float32 flat tensors: one SUM allreduce of their concatenation,
        divided by W (new tensors)."""
        if not tensors:
            return []
        flat = torch.cat(tensors)
        if self.size > 1:
            try:
                dist.all_reduce(flat, group=self.group)
            except Exception as e:  # noqa: BLE001 - named, cause kept
                raise collective_failed("gradcomp.optim.DGC: the dense allreduce", e) from e
            flat.div_(self.size)
            self._stats["dense_sent_bytes"] += planner.ring_allreduce_bytes(4 * flat.numel(), self.size)
        self._stats["packet_bytes"] += 4 * flat.numel()
        self._stats["exchanged_dense_bytes"] += 4 * flat.numel()
        out, off = [], 0
        for t in tensors:
            out.append(flat[off: off + t.numel()])
            off += t.numel()
        return out

    def count_dense(self, nbytes: int) -> None:
        """The DDP hook's interface (:func:`gradcomp.optim.register_comm_hook`); DGC's hook sends
        nothing, so this is never called with bytes."""
        self._stats["dense_sent_bytes"] += planner.ring_allreduce_bytes(nbytes, self.size)

    def comm_stats(self) -> dict:
        """``{"steps", "dense_sent_bytes", "compressed_sent_bytes", "sent_bytes",
        "sent_bytes_per_step", "packet_bytes", "exchanged_dense_bytes", "bits_per_element",
        "sent_elements", "compressed_elements"}``: bytes this rank sent (the all-gather: (W-1)
        times its packets; the dense allreduces: ring formula), its packets' bytes, the float32
        bytes of what it exchanged (packet_bytes / exchanged_dense_bytes is the packet ratio,
        ``bits_per_element`` = 32 times that), and the top-k counts."""
        s = dict(self._stats)
        s["sent_bytes"] = s["dense_sent_bytes"] + s["compressed_sent_bytes"]
        s["sent_bytes_per_step"] = s["sent_bytes"] / s["steps"] if s["steps"] else float("nan")
        s["bits_per_element"] = 8.0 * s["packet_bytes"] / (s["exchanged_dense_bytes"] / 4) if s["exchanged_dense_bytes"] else float("nan")
        return s
