"""``OnebitLamb``: 1-bit LAMB (Li et al., "1-bit LAMB: Communication Efficient Large-Scale
Large-Batch Training with LAMB's Convergence Speed", HiPC 2022 / arXiv 2104.06069, Algorithm 1)
with the semantics of DeepSpeed 0.19.6's ``deepspeed.runtime.fp16.onebit.lamb.OnebitLamb``, which
DeepSpeed 0.19.7 removed (PR 8490). See :mod:`gradcomp.optim`."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ._base import OnebitOptimizer
from .adam import _check_hparams


def _drop_empty(params):
    """``params`` as torch.optim takes them (tensors, (name, tensor) pairs or groups of them)
    without the parameters of 0 elements (DeepSpeed PR 7736)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("gradcomp.optim.OnebitLamb: params must be an iterable of tensors, (name, tensor) pairs "
                        "or dicts, got a torch.Tensor")

    def keep(p):
        t = p[1] if isinstance(p, tuple) and len(p) == 2 else p
        return not isinstance(t, torch.Tensor) or t.numel() > 0

    def group_params(g):
        ps = g["params"]
        return [ps] if isinstance(ps, torch.Tensor) else list(ps)

    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, params=[p for p in group_params(g) if keep(p)]) for g in params]
    return [p for p in params if keep(p)]


class OnebitLamb(OnebitOptimizer):
    """1-bit LAMB as a ``torch.optim.Optimizer`` (DeepSpeed's config names and semantics).

    All momenta live in one flat buffer (every parameter of every group, in order, then zeros up
    to ``padded_numel``), so the compression stage makes one exchange per step.

    Steps:
      1. the first ``step()`` is DeepSpeed's initialisation step: state created, no update;
      2. warm-up (step count below ``freeze_step``): LAMB on the averaged gradient: m, v as Adam
         (no bias correction), u = m / (sqrt(v) + eps) (+ weight_decay * p), trust ratio
         c = ||p|| / ||u|| clamped to [min_coeff, max_coeff] (1 when either norm is 0),
         p -= lr * c * u; the frozen coefficient is the EMA ``lamb_coeff_freeze = coeff_beta *
         lamb_coeff_freeze + (1 - coeff_beta) c`` (over the steps where c != 1); v is copied into
         ``exp_avg_sq_fresh`` at step == freeze_step;
      3. compression stage: at its first step every parameter gets ``scaling_coeff`` = (mean over
         parameters of rms(m)) / rms(m) (1.0 where rms(m) = 0; DeepSpeed divides by zero there);
         then each step m = (b1 m + (1-b1) g_local) * scaling_coeff, the flat buffer goes through
         the error-compensated 1-bit mean (:class:`gradcomp.deepspeed.OnebitBackend`), m is
         divided back by scaling_coeff and masked by ``exp_avg_mask``; the gradient is
         reconstructed as (m - b1 m_prev) / (1 - b1) to update ``exp_avg_sq_fresh``; v stays
         frozen; the coefficient is lamb_coeff_freeze * f, f = max(denominator / fresh
         denominator) (blended with the weight-decay share of the update), clamped to
         [factor_min, factor_max] and to within factor_threshold of the previous f. A parameter
         without a gradient in this stage takes a zero gradient (the flat exchange carries every
         momentum; DeepSpeed divides its momentum without having scaled it).
    ``lamb_coeffs`` lists the coefficients of the last step (DeepSpeed's ``get_lamb_coeffs()``).

    Args:
        params: parameters or param groups (empty parameters are dropped, as DeepSpeed PR 7736);
            all of one dtype and device (one flat buffer). Groups may carry ``exp_avg_mask``.
        lr, freeze_step, betas, eps, weight_decay, group, average_gradients: as
            :class:`OnebitAdam`.
        max_coeff, min_coeff: the trust-ratio clamp (10.0, 0.01).
        coeff_beta: EMA factor of the frozen coefficient (0.9).
        factor_max, factor_min, factor_threshold: the compression-stage factor's bounds and
            largest relative change per step (4.0, 0.5, 0.1).

    State: per parameter ``step``, ``exp_avg`` (a view of the flat buffer), ``exp_avg_sq``,
    ``exp_avg_sq_fresh``, ``lamb_coeff_freeze``, ``last_factor``, ``scaling_coeff`` (from the
    compression stage on); the flat buffer's worker and server errors (float32) ride in
    ``state_dict()["onebit_errors"]`` and are restored bit for bit (DeepSpeed dropped them).

    Raises:
        ValueError: bad hyper-parameters; parameters of several dtypes or devices.
        TypeError: ``params`` is a single tensor (as torch.optim).
        RuntimeError: sparse gradients; ``add_param_group`` after the first step.
    """

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, *, group=None, average_gradients: bool = True):
        _check_hparams(type(self).__name__, lr, betas, eps, weight_decay)
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"gradcomp.optim.OnebitLamb: min_coeff={min_coeff!r}, max_coeff={max_coeff!r}; "
                             f"accepted: 0 < min_coeff <= max_coeff")
        if not 0.0 < factor_min <= factor_max or not factor_threshold >= 0.0:
            raise ValueError(f"gradcomp.optim.OnebitLamb: factor_min={factor_min!r}, factor_max={factor_max!r}, "
                             f"factor_threshold={factor_threshold!r}; accepted: 0 < factor_min <= factor_max, "
                             f"factor_threshold >= 0")
        params = _drop_empty(params)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff), freeze_step,
                         group=group, average_gradients=average_gradients)
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        kinds = {(p.dtype, p.device) for g in self.param_groups for p in g["params"]}
        if len(kinds) > 1:
            raise ValueError(f"gradcomp.optim.OnebitLamb: the parameters have several dtypes/devices "
                             f"{sorted(str(k) for k in kinds)}; accepted: one (the momenta share one flat buffer)")
        self._flat: Optional[torch.Tensor] = None
        self.worker_error: Optional[torch.Tensor] = None
        self.server_error: Optional[torch.Tensor] = None
        self.lamb_coeffs: List[float] = []

    def add_param_group(self, param_group: dict) -> None:
        """As torch's, before the first step only: the momenta of every group share one flat
        buffer, and its error buffers are sized for it.

        Raises:
            RuntimeError: after the first step."""
        if getattr(self, "_flat", None) is not None:
            raise RuntimeError("gradcomp.optim.OnebitLamb.add_param_group: the optimizer has stepped (its momenta "
                               "share one flat buffer with error buffers sized for it); give every group to the "
                               "constructor")
        super().add_param_group(param_group)

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def _init_state(self, p) -> dict:
        state = self.state[p]
        if "exp_avg" not in state:
            state["step"] = 0
            state["lamb_coeff_freeze"] = 0.0
            state["last_factor"] = 1.0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
            state["exp_avg_sq_fresh"] = torch.zeros_like(p)
        return state

    def _build_flat(self) -> None:
        """One flat buffer of every momentum (groups, then parameters, in order) and zero padding
        to ``padded_numel``; each ``exp_avg`` becomes a view of it."""
        params = self._params()
        states = [self._init_state(p) for p in params]
        n = sum(p.numel() for p in params)
        Np = self.padded_numel(n)
        ref = params[0]
        flat = torch.zeros(Np, dtype=ref.dtype, device=ref.device)
        off = 0
        for p, st in zip(params, states):
            flat[off: off + p.numel()].copy_(st["exp_avg"].reshape(-1))
            st["exp_avg"] = flat[off: off + p.numel()].view_as(p)
            off += p.numel()
        pad = getattr(self, "_padding", None)
        if pad is not None:  # a checkpoint's tail (load_state_dict)
            flat[off:].copy_(pad)
            self._padding = None
        self._flat = flat

    _STEP_ATTRS = OnebitOptimizer._STEP_ATTRS + ("_flat", "worker_error", "server_error", "lamb_coeffs", "_padding")

    def _exchanges_in_loop(self) -> bool:
        return self.compression_stage

    def _step(self, closure) -> Optional[torch.Tensor]:
        """The step itself (:meth:`step` runs it, undone if it fails)."""
        params = self._params()
        self.lamb_coeffs = []
        comp = self.compression_stage
        loss, first = self._begin_step(closure)
        if not params:
            return loss
        if self._flat is None:
            self._build_flat()
        last: List[List[torch.Tensor]] = []
        if comp:
            last = [[self.state[p]["exp_avg"].detach().clone() for p in g["params"]] for g in self.param_groups]
            if "scaling_coeff" not in self.state[params[0]]:
                scales = [(torch.linalg.vector_norm(self.state[p]["exp_avg"]) / (p.numel() ** 0.5)).item()
                          for p in params]
                united = sum(scales) / len(scales)
                for p, s in zip(params, scales):
                    self.state[p]["scaling_coeff"] = united / s if s != 0.0 else 1.0
        last_step = None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    if not comp or first:
                        continue
                    grad = torch.zeros_like(p)
                if grad.is_sparse:
                    raise RuntimeError("gradcomp.optim.OnebitLamb: sparse gradients are not supported")
                state = self.state[p]
                state["step"] += 1
                last_step = state["step"]
                if first:
                    continue
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                if not comp:
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    if state["step"] == self.freeze_step:
                        state["exp_avg_sq_fresh"].copy_(exp_avg_sq)
                    weight_norm = p.pow(2).sum().sqrt()
                    update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
                    if group["weight_decay"] > 0.0:
                        update += group["weight_decay"] * p
                    update_norm = update.pow(2).sum().sqrt()
                    lamb_coeff = 1.0
                    if weight_norm != 0 and update_norm != 0:
                        lamb_coeff = (weight_norm / update_norm).item()
                        lamb_coeff = min(max(lamb_coeff, group["min_coeff"]), group["max_coeff"])
                    if lamb_coeff != 1.0:
                        state["lamb_coeff_freeze"] = (self.coeff_beta * state["lamb_coeff_freeze"]
                                                      + (1 - self.coeff_beta) * lamb_coeff)
                    self.lamb_coeffs.append(lamb_coeff)
                    p.add_(-group["lr"] * lamb_coeff * update)
                else:
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    exp_avg.mul_(state["scaling_coeff"])
        if comp and self.size > 1:
            Np = self._flat.numel()
            if self.worker_error is None:
                self.worker_error = torch.zeros(Np, dtype=torch.float32, device=self._flat.device)
                self.server_error = torch.zeros(Np // self.size, dtype=torch.float32, device=self._flat.device)
            out = self._compressed_allreduce(self._flat, self.worker_error, self.server_error)
            assert out is self._flat  # the flat buffer is exactly Np long: the backend wrote it in place
        if comp:
            for i, group in enumerate(self.param_groups):
                beta1, beta2 = group["betas"]
                mask = group.get("exp_avg_mask")
                for j, p in enumerate(group["params"]):
                    state = self.state[p]
                    exp_avg, exp_avg_sq, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
                    exp_avg.div_(state["scaling_coeff"])
                    if mask is not None:
                        exp_avg.mul_(mask.to(exp_avg.device))
                    grad_reconstruct = (exp_avg - last[i][j] * beta1) / (1 - beta1)
                    fresh.mul_(beta2).addcmul_(grad_reconstruct, grad_reconstruct, value=1 - beta2)
                    denom = exp_avg_sq.sqrt() + group["eps"]
                    update_prelim = exp_avg / denom
                    if group["weight_decay"] > 0.0:
                        update = update_prelim + group["weight_decay"] * p
                    else:
                        update = update_prelim
                    update_norm = update.pow(2).sum().sqrt()
                    denom_real = fresh.sqrt() + group["eps"]
                    factor = (denom / denom_real).max().item()
                    if group["weight_decay"] > 0.0:
                        update_ratio = min(1.0, (update_prelim.pow(2).sum().sqrt() / update_norm).item())
                        factor = factor * update_ratio + (1.0 - update_ratio)
                    factor = min(max(factor, self.factor_min), self.factor_max)
                    factor = min(max(factor, state["last_factor"] * (1.0 - self.factor_threshold)),
                                 state["last_factor"] * (1.0 + self.factor_threshold))
                    state["last_factor"] = factor
                    lamb_coeff = state["lamb_coeff_freeze"] * factor
                    self.lamb_coeffs.append(lamb_coeff)
                    p.add_(-group["lr"] * lamb_coeff * update)
        if first:
            self.initialized = True
            return loss
        if last_step is not None:
            self._after_step(last_step)
        return loss

    def state_dict(self) -> dict:
        """torch's state_dict plus ``"onebit_errors"``: the flat buffer's ``worker_error`` and
        ``server_error`` (float32 tensors or None), ``momentum_padding`` (the flat buffer's tail
        past the last parameter: the exchange writes it, and the next exchange reads it) and the
        ``world_size`` they belong to."""
        sd = super().state_dict()
        pad = None
        if self._flat is not None:
            n = sum(p.numel() for p in self._params())
            pad = self._flat[n:].clone()
        sd["onebit_errors"] = {"worker_error": self.worker_error, "server_error": self.server_error,
                               "momentum_padding": pad, "world_size": self.size}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a checkpoint of this class (or of DeepSpeed's OnebitLamb, without error buffers):
        the state; the error buffers when they fit this world size; ``exp_avg_mask`` stays the
        running optimizer's. As DeepSpeed: a checkpoint still in the warm-up restarts the frozen
        coefficient, the last factor and the scaling coefficients."""
        sd = self._keep_masks(state_dict)
        errors = sd.pop("onebit_errors", None) or {}
        super().load_state_dict(sd)
        self._flat = None
        self._padding = None
        params = self._params()
        step = self._loaded_step()
        if step < self.freeze_step:
            for p in params:
                st = self.state[p]
                st["lamb_coeff_freeze"] = 0.0
                st["last_factor"] = 1.0
                st.pop("scaling_coeff", None)
        self.worker_error = self.server_error = None
        if params:
            n = sum(p.numel() for p in params)
            fit = self._fitting_errors(errors.get("worker_error"), errors.get("server_error"), n, params[0].device)
            if fit is not None:
                self.worker_error, self.server_error = fit
                pad = errors.get("momentum_padding")
                if isinstance(pad, torch.Tensor) and pad.numel() == self.padded_numel(n) - n:
                    self._padding = pad
        self.initialized = step > 0
        self._stage_from_step(step)
