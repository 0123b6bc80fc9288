"""``OnebitAdam``: 1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed", ICML 2021, Algorithm 1) with the semantics of DeepSpeed
0.19.6's ``deepspeed.runtime.fp16.onebit.adam.OnebitAdam``, which DeepSpeed 0.19.7 removed (PR
8490). See :mod:`gradcomp.optim` for the stages and how it communicates."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._base import OnebitOptimizer


class OnebitAdam(OnebitOptimizer):
    """1-bit Adam as a ``torch.optim.Optimizer`` (DeepSpeed's config names and semantics).

    Steps (``state['step']`` counts them, per parameter):
      1. the first ``step()`` is DeepSpeed's initialisation step: it creates the state and
         applies no update (that step's gradient is not used);
      2. warm-up, while the step count is below ``freeze_step``: Adam on the averaged gradient,
         m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2, update = m / (sqrt(v) + eps) (+
         weight_decay * p), p -= lr * update; no bias correction (DeepSpeed's; its
         ``bias_correction`` flag was unused);
      3. compression stage: g stays local; m = b1 m + (1-b1) g is replaced by its error-
         compensated 1-bit mean over the group (:class:`gradcomp.deepspeed.OnebitBackend`, one
         worker error of ``padded_numel(p.numel())`` and one server error of that / W float32
         elements per parameter, created at the first compressed step), then multiplied by the
         group's ``exp_avg_mask`` if it has one; v is frozen; the update as in 2. A param group
         with ``non_freeze=True`` keeps averaging its gradients densely and updating v.

    Args:
        params: parameters or param groups (a group may carry ``exp_avg_mask``, a tensor of the
            parameter's shape multiplied into m after each exchange -- for momenta with constant
            exact zeros, which 1-bit signs cannot represent -- and ``non_freeze``).
        lr: learning rate (default 1e-3).
        freeze_step: steps, the initialisation step included, before compression (default
            100000, DeepSpeed's; its tutorial advises 15-25 % of the run).
        betas: (b1, b2), default (0.9, 0.999).
        eps: added to sqrt(v) (default 1e-8).
        weight_decay: L2 term added to the update (default 0).
        group: the data-parallel process group (default: the world).
        average_gradients: True (default): ``step()`` averages the gradients over the group
            during the warm-up (a plain loop with torch.distributed; the gradients are averaged in
            place). False when DDP with :func:`gradcomp.optim.register_comm_hook` or a DeepSpeed
            engine (:func:`gradcomp.deepspeed.install`) does it.

    State (``state_dict`` keeps all of it, error buffers included, and ``load_state_dict``
    restores it bit for bit; DeepSpeed dropped the error buffers on load): per parameter
    ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (the parameter's dtype and shape),
    ``worker_error`` / ``server_error`` (float32, from the first compressed step). The error
    buffers are this rank's: save every rank's state_dict. A checkpoint from another world size
    loads with the error buffers reset (a warning says so).

    Raises:
        ValueError: lr < 0, betas outside [0, 1), eps < 0, weight_decay < 0, freeze_step < 1.
        RuntimeError: sparse gradients.
    """

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, group=None, average_gradients: bool = True):
        _check_hparams(type(self).__name__, lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), freeze_step,
                         group=group, average_gradients=average_gradients)

    def _exchanges_in_loop(self) -> bool:
        return self.initialized and self.compression_stage

    def _step(self, closure) -> Optional[torch.Tensor]:
        """The step itself (:meth:`step` runs it, undone if it fails)."""
        comp = self.compression_stage
        loss, first = self._begin_step(closure)
        last_step = None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            non_freeze = bool(group.get("non_freeze", False))
            if not first and comp and non_freeze:
                self._average(self._grads(group))
            mask = group.get("exp_avg_mask")
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("gradcomp.optim.OnebitAdam: sparse gradients are not supported")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                last_step = state["step"]
                if first:
                    continue
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                if not comp or non_freeze:
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                else:
                    if self.size > 1:
                        if "worker_error" not in state:
                            Np = self.padded_numel(p.numel())
                            state["worker_error"] = torch.zeros(Np, dtype=torch.float32, device=p.device)
                            state["server_error"] = torch.zeros(Np // self.size, dtype=torch.float32,
                                                                device=p.device)
                        out = self._compressed_allreduce(exp_avg, state["worker_error"], state["server_error"])
                        if out is not exp_avg:
                            exp_avg.copy_(out)
                    if mask is not None:
                        exp_avg.mul_(mask.to(exp_avg.device))
                update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p
                p.add_(-group["lr"] * update)
        if first:
            self.initialized = True
            return loss
        if last_step is not None:
            self._after_step(last_step)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a checkpoint of this class (or of DeepSpeed's OnebitAdam): the state, error
        buffers included when they fit this world size; ``exp_avg_mask`` stays the running
        optimizer's (DeepSpeed's rule); the stage follows the step count of the first parameter
        that has state."""
        errors = self._load_without_errors(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for k, (we, se) in errors.items():
            p = params[k]
            fit = self._fitting_errors(we, se, p.numel(), p.device)
            if fit is not None:
                self.state[p]["worker_error"], self.state[p]["server_error"] = fit
        step = self._loaded_step()
        self.initialized = step > 0
        self._stage_from_step(step)

def _check_hparams(name: str, lr, betas, eps, weight_decay) -> None:
    if not lr >= 0.0:
        raise ValueError(f"gradcomp.optim.{name}: lr={lr!r}; accepted: >= 0")
    if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"gradcomp.optim.{name}: betas={betas!r}; accepted: two values in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"gradcomp.optim.{name}: eps={eps!r}; accepted: >= 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"gradcomp.optim.{name}: weight_decay={weight_decay!r}; accepted: >= 0")
