"""``CompressedAdam``: Adam whose momentum, not its gradient, is exchanged through any gradcomp codec
after a dense warm-up -- 1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed", ICML 2021, Algorithm 1) generalised from the 1-bit sign to
every codec and scheme of gradcomp.

Why the momentum: Adam divides each coordinate by sqrt(v), its own running scale; a sparse or
1-bit gradient hands that division bursts (a coordinate that was not sent for many steps, then all
of its accumulated residual at once), which the variance then chases. 1-bit Adam's observation is
that after a warm-up v changes slowly: freeze it, and Adam is a momentum method whose momentum m
can be averaged with error feedback like a gradient (its section 3).

Steps (t counts them from 1; ``freeze_step`` = T0):

- warm-up, t <= T0: Adam on the gradient averaged densely over the group (by ``step()`` itself with
  ``average_gradients=True``, or by DDP with :func:`gradcomp.optim.register_comm_hook`), exactly
  torch.optim.Adam's single-tensor update: m = lerp(m, g, 1-b1), v = fl(b2 v) + (1-b2) g g,
  p = p - (lr / (1-b1^t)) m / (sqrt(v) / sqrt(1-b2^t) + eps) (L2 ``weight_decay`` added to g);
- compression, t > T0: the gradient stays local; m = lerp(m, g_local, 1-b1); m is replaced by its
  compressed average over the group -- one :class:`gradcomp.torch.Compressor` call per step over
  the compressed parameters' momenta concatenated (one bucket), with its worker residual and, under
  ``two_phase``, its server residual (scheme ``auto``: two_phase for the quantizers and onebit,
  gather for top-k, sum for the casts); v is frozen, and so is its bias correction (1-b2^T0); the
  update as above with the averaged m;
- exempt parameters (fewer than 2 dimensions, unless a parameter group sets ``compress``): Adam on
  the densely averaged gradient at every step (1-bit Adam's ``non_freeze`` groups).

Every rank holds the same averaged momentum bit for bit (the schemes' guarantee), so the
parameters stay equal. :class:`gradcomp.optim.OnebitAdam` is unchanged (DeepSpeed's exact
semantics: an initialisation step and no bias correction); with codec ``onebit`` this class is the
same method with torch's Adam conventions.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import planner
from ..errors import CollectiveError, in_context
from ..schemes.context import collective_failed


class CompressedAdam(torch.optim.Optimizer):
    """Compressed-momentum Adam for any codec (module docstring).

    Args:
        params: parameters or param groups (a group may set ``compress`` True/False to override
            "compressed when 2 or more dimensions").
        lr: learning rate (default 1e-3).
        codec: the codec spec or :class:`gradcomp.Codec` the momentum travels through (default
            ``"onebit"``; e.g. ``"topk:ratio=0.01"``, ``"int8"``, ``"fp8"``).
        freeze_step: T0, the dense warm-up's steps (an int >= 0; 0: compressed from the first
            step, which then starts from a zero variance: not advised).
        betas, eps, weight_decay: Adam's (defaults (0.9, 0.999), 1e-8, 0: L2 added to the gradient).
        scheme: the Compressor's scheme (default ``"auto"``).
        error_feedback: worker (and server) residuals for the momentum (default True).
        group: the process group (default: the world; world size 1 without torch.distributed).
        average_gradients: True (default): ``step()`` averages the warm-up gradients itself (a
            plain loop). False under DDP with :func:`gradcomp.optim.register_comm_hook` (the hook
            averages them during the warm-up and leaves them local afterwards).
        seed: the key of codecs that draw random numbers (the same on every rank).

    State (``state_dict`` keeps it, bit-exact, with the Compressor's residuals under
    ``"compressor"``; per rank: save every rank's): per parameter ``step``, ``exp_avg``,
    ``exp_avg_sq``.

    Raises:
        ValueError: lr < 0, betas outside [0, 1), eps < 0, weight_decay < 0, freeze_step not an
            int >= 0; what :class:`gradcomp.torch.Compressor` raises for the codec and scheme.
    """

    def __init__(self, params, lr: float = 1e-3, codec: Any = "onebit", freeze_step: int = 100,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, *,
                 scheme: str = "auto", error_feedback: bool = True, group=None, average_gradients: bool = True,
                 seed: int = 0):
        if not lr >= 0:
            raise ValueError(f"gradcomp.optim.CompressedAdam: lr={lr!r}; accepted: >= 0")
        if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"gradcomp.optim.CompressedAdam: betas={betas!r}; accepted: two values in [0, 1)")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"gradcomp.optim.CompressedAdam: eps={eps!r}, weight_decay={weight_decay!r}; accepted: >= 0")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 0:
            raise ValueError(f"gradcomp.optim.CompressedAdam: freeze_step={freeze_step!r}; accepted: an int >= 0 (the "
                             f"dense warm-up's steps)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.freeze_step = freeze_step
        self.group = group
        self.size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.average_gradients = bool(average_gradients)
        self.compressor = None
        if self.size > 1:
            from ..torch.compressor import Compressor

            self.compressor = Compressor(codec, scheme, error_feedback, group, min_compress_numel=0, seed=seed)
            self.codec = self.compressor.codec
        else:
            from ..codec import Codec

            self.codec = codec if isinstance(codec, Codec) else Codec(str(codec))
        self.scheme = scheme
        self._t = 0
        self._stats = {"steps": 0, "warmup_steps": 0, "compressed_steps": 0, "dense_sent_bytes": 0.0,
                       "packet_bytes": 0, "exchanged_dense_bytes": 0}

    @property
    def dense_next(self) -> bool:
        """Whether the next step averages its gradients densely (the warm-up): the DDP hook reads it."""
        return self._t < self.freeze_step

    @property
    def compression_stage(self) -> bool:
        return self._t >= self.freeze_step

    @staticmethod
    def _compressed(group: dict, p: torch.Tensor) -> bool:
        c = group.get("compress")
        return bool(c) if c is not None else p.dim() >= 2

    @torch.no_grad()
    def step(self, closure=None):
        """One step (module docstring). Returns the closure's loss.

        Raises:
            gradcomp.CollectiveError: an exchange failed; the parameters and the state are as
                before the step (the Compressor undoes its residuals). RuntimeError: sparse
                gradients.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self._t + 1
        warm = t <= self.freeze_step
        items = []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("gradcomp.optim.CompressedAdam: sparse gradients are not supported")
                items.append((g, p))
        comp = [(g, p) for g, p in items if not warm and self._compressed(g, p)]
        dense = [(g, p) for g, p in items if warm or not self._compressed(g, p)]
        grads = {id(p): p.grad for _, p in items}
        try:
            if dense and (self.average_gradients or not warm):
                grads.update(self._average([p for _, p in dense]))
            moms = {}
            for g, p in comp:
                st = self._state(p)
                gr = grads[id(p)]
                if g["weight_decay"]:
                    gr = gr.add(p, alpha=g["weight_decay"])
                moms[id(p)] = torch.lerp(st["exp_avg"], gr, 1 - g["betas"][0])
            if comp and self.compressor is not None:
                self._exchange(comp, moms)
        except Exception as e:  # noqa: BLE001 - nothing changed yet: raised with the step named
            if isinstance(e, CollectiveError):
                raise in_context(e, f"gradcomp.optim.CompressedAdam: step {t} failed; the parameters and the state "
                                    f"are as before it") from e
            raise
        for g, p in dense:
            st = self._state(p)
            gr = grads[id(p)]
            if g["weight_decay"]:
                gr = gr.add(p, alpha=g["weight_decay"])
            b1, b2 = g["betas"]
            st["step"] = t
            st["exp_avg"].lerp_(gr, 1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(gr, gr.conj(), value=1 - b2)
            self._update(p, st, g, t, 1 - b2 ** t)
        for g, p in comp:
            st = self._state(p)
            st["step"] = t
            st["exp_avg"].copy_(moms[id(p)])
            self._update(p, st, g, t, 1 - g["betas"][1] ** max(1, self.freeze_step))
        if self.compressor is not None and not warm:
            self.compressor.end_step()
        self._t = t
        self._stats["steps"] += 1
        self._stats["warmup_steps" if warm else "compressed_steps"] += 1
        return loss

    def _state(self, p) -> dict:
        st = self.state[p]
        if "exp_avg" not in st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    @staticmethod
    def _update(p, st, g, t: int, bias2: float) -> None:
        """torch.optim.Adam's single-tensor update with bias corrections (1 - b1^t) and ``bias2``."""
        b1 = g["betas"][0]
        step_size = g["lr"] / (1 - b1 ** t)
        denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(g["eps"])
        p.addcdiv_(st["exp_avg"], denom, value=-step_size)

    def _exchange(self, comp, moms: Dict[int, torch.Tensor]) -> None:
        """The compressed average of the momenta (one bucket), in place in ``moms``."""
        flat = torch.cat([moms[id(p)].reshape(-1).to(torch.float32) for _, p in comp])
        params, off = [], 0
        index = {id(p): i for i, (_, p) in enumerate((g, p) for g in self.param_groups for p in g["params"])}
        for _, p in comp:
            params.append((f"param{index[id(p)]}", off, p.numel()))
            off += p.numel()
        self.compressor.allreduce_bucket(flat, 0, params).wait()
        off = 0
        for _, p in comp:
            m = moms[id(p)]
            m.copy_(flat[off: off + p.numel()].view_as(m))
            off += p.numel()

    def _average(self, params: List[torch.Tensor]) -> Dict[int, torch.Tensor]:
        """The gradients of ``params`` averaged over the group (one SUM allreduce of their
        concatenation, divided by W), as new tensors."""
        if self.size == 1 or not params:
            return {id(p): p.grad for p in params}
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        try:
            dist.all_reduce(flat, group=self.group)
        except Exception as e:  # noqa: BLE001 - named, cause kept
            raise collective_failed("gradcomp.optim.CompressedAdam: the dense allreduce of the gradients", e) from e
        flat.div_(self.size)
        self.count_dense(flat.numel() * flat.element_size())
        out, off = {}, 0
        for p in params:
            out[id(p)] = flat[off: off + p.numel()].view_as(p.grad)
            off += p.numel()
        return out

    def count_dense(self, nbytes: int) -> None:
        """Adds one dense ring allreduce of ``nbytes`` bytes (the DDP hook calls it for the
        warm-up buckets it averages)."""
        self._stats["dense_sent_bytes"] += planner.ring_allreduce_bytes(nbytes, self.size)
        self._stats["packet_bytes"] += int(nbytes)
        self._stats["exchanged_dense_bytes"] += int(nbytes)

    def comm_stats(self) -> dict:
        """``{"steps", "warmup_steps", "compressed_steps", "dense_sent_bytes",
        "compressed_sent_bytes", "sent_bytes", "sent_bytes_per_step", "packet_bytes",
        "exchanged_dense_bytes", "bits_per_element"}``: the dense averaging (warm-up, exempt
        parameters) as ring allreduces, the momentum exchanges as the Compressor's stats say
        (its ``sent_bytes`` / ``packet_bytes`` / ``dense_bytes``); ``bits_per_element`` = 8
        packet_bytes / (exchanged_dense_bytes / 4) over the whole run, warm-up included."""
        s = dict(self._stats)
        c = self.compressor.stats()["total"] if self.compressor is not None else {}
        s["compressed_sent_bytes"] = float(c.get("sent_bytes", 0.0))
        s["packet_bytes"] += int(c.get("packet_bytes", 0))
        s["exchanged_dense_bytes"] += int(c.get("dense_bytes", 0))
        s["sent_bytes"] = s["dense_sent_bytes"] + s["compressed_sent_bytes"]
        s["sent_bytes_per_step"] = s["sent_bytes"] / s["steps"] if s["steps"] else float("nan")
        s["bits_per_element"] = (8.0 * s["packet_bytes"] / (s["exchanged_dense_bytes"] / 4)
                                 if s["exchanged_dense_bytes"] else float("nan"))
        return s

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """torch's state_dict plus ``"gradcomp"``: ``{"t", "compressor": the Compressor's
        state_dict (residuals) or None}``."""
        sd = super().state_dict()
        sd["gradcomp"] = {"t": self._t, "compressor": None if self.compressor is None else self.compressor.state_dict()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads :meth:`state_dict` (bit-exact; the Compressor's checks: same rank and codec;
        another world size drops its residuals with a warning)."""
        sd = dict(state_dict)
        extra = sd.pop("gradcomp", None) or {}
        super().load_state_dict(sd)
        self._t = int(extra.get("t", 0))
        if self.compressor is not None and extra.get("compressor") is not None:
            self.compressor.load_state_dict(extra["compressor"])
