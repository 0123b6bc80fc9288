"""``ZeroOneAdam``: 0/1 Adam (Lu et al., "Maximizing Communication Efficiency for Large-scale
Training via 0/1 Adam", ICLR 2023 / arXiv 2202.06009, Algorithm 1) with the semantics of DeepSpeed
0.19.6's ``deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam``, which DeepSpeed 0.19.7 removed (PR
8490). See :mod:`gradcomp.optim`."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._base import OnebitOptimizer
from .adam import _check_hparams


class ZeroOneAdam(OnebitOptimizer):
    """0/1 Adam as a ``torch.optim.Optimizer`` (DeepSpeed's config names and semantics).

    Steps (per parameter ``state['step']``):
      1. the first ``step()`` is DeepSpeed's initialisation step (no update);
      2. before ``var_freeze_step``: the variance is updated only on the steps where ``step %
         var_interval == 0``; those steps average the gradient densely (m, v as Adam); on the
         others the local gradient goes through the error-compensated 1-bit mean
         (:class:`gradcomp.deepspeed.OnebitBackend`, masked by ``exp_avg_mask``) into m only
         (at world size 1 the gradient itself; DeepSpeed leaves m unchanged there).
         After ``var_update_scaler`` variance updates the interval doubles. update = m /
         (sqrt(v) + eps) (+ weight_decay * p), p -= lr * update (no bias correction);
      3. after ``var_freeze_step``: local steps (m from the local gradient, the updates summed in
         ``momentum_accumulator``); every ``local_step_interval`` steps the summed update is taken
         back, turned into momentum units (times sqrt(v) + eps), averaged with the 1-bit
         exchange, and applied; m becomes minus that average over the summed learning rates
         (unchanged when they sum to 0: DeepSpeed divides 0 by 0 into a NaN there). The
         interval doubles every ``local_step_scaler`` steps up to ``local_step_clipper``. The
         error buffers are zeroed once at the switch.
    ``dense_next`` says whether the coming step averages densely (the DDP hook and a bound
    DeepSpeed engine follow it; ``step()`` itself averages then when ``average_gradients``).

    Args:
        params, lr, betas, eps, weight_decay, group, average_gradients: as :class:`OnebitAdam`.
        var_freeze_step: the step after which the variance is frozen (default 100000).
        var_update_scaler: variance updates before their interval doubles (default 16).
        local_step_scaler: steps before the local-step interval doubles (default 32678).
        local_step_clipper: the largest local-step interval (default 16).

    State: per parameter ``step``, ``exp_avg``, ``exp_avg_sq``, ``momentum_accumulator`` (the
    parameter's dtype), ``worker_error`` / ``server_error`` (float32), ``var_interval``,
    ``var_counter``, ``local_step_interval``, ``local_step_counter``, ``lrs``; the optimizer's
    stage in ``state_dict()["zero_one"]``. All of it is restored bit for bit (DeepSpeed dropped
    the errors and the accumulator on load and, reading a misspelt flag, resumed a run past
    var_freeze_step in the pre-freeze branch).

    Raises:
        ValueError: bad hyper-parameters (the message names the value).
        RuntimeError: sparse gradients.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, *, group=None,
                 average_gradients: bool = True):
        _check_hparams(type(self).__name__, lr, betas, eps, weight_decay)
        for name, v in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                        ("local_step_clipper", local_step_clipper)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"gradcomp.optim.ZeroOneAdam: {name}={v!r}; accepted: an int >= 1")
        if isinstance(var_freeze_step, bool) or not isinstance(var_freeze_step, int) or var_freeze_step < 0:
            raise ValueError(f"gradcomp.optim.ZeroOneAdam: var_freeze_step={var_freeze_step!r}; accepted: an int >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay),
                         freeze_step=max(var_freeze_step, 1), group=group, average_gradients=average_gradients)
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.errors_reset = False  # DeepSpeed's reinitial_error_buffer

    def _new_state(self, p) -> dict:
        st = self.state[p]
        st["step"] = 0
        st["exp_avg"] = torch.zeros_like(p)
        st["exp_avg_sq"] = torch.zeros_like(p)
        st["var_interval"] = 1
        st["var_counter"] = 0
        st["local_step_interval"] = 1
        st["local_step_counter"] = 0
        st["lrs"] = 0
        Np = self.padded_numel(p.numel())
        st["worker_error"] = torch.zeros(Np, dtype=torch.float32, device=p.device)
        st["server_error"] = torch.zeros(Np // self.size, dtype=torch.float32, device=p.device)
        st["momentum_accumulator"] = torch.zeros_like(p)
        return st

    def _onebit(self, buf: torch.Tensor, st: dict, mask) -> torch.Tensor:
        out = buf
        if self.size > 1:
            out = self._compressed_allreduce(buf, st["worker_error"], st["server_error"])
            if mask is not None:
                out.mul_(mask.to(out.device))
        return out

    _STEP_ATTRS = OnebitOptimizer._STEP_ATTRS + ("errors_reset",)

    def _exchanges_in_loop(self) -> bool:
        return self.initialized

    def _step(self, closure) -> Optional[torch.Tensor]:
        """The step itself (:meth:`step` runs it, undone if it fails)."""
        frozen = self.compression_stage
        loss, first = self._begin_step(closure)
        engine_flag = None
        last_step = None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            mask = group.get("exp_avg_mask")
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("gradcomp.optim.ZeroOneAdam: sparse gradients are not supported")
                st = self.state[p] if len(self.state[p]) else self._new_state(p)
                exp_avg, exp_avg_sq, acc = st["exp_avg"], st["exp_avg_sq"], st["momentum_accumulator"]
                st["step"] += 1
                last_step = st["step"]
                if first:
                    continue
                if not frozen:
                    if st["step"] % st["var_interval"] == 0:
                        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    else:  # at W = 1 the 1-bit mean is the gradient itself (DeepSpeed skips m there)
                        g1 = self._onebit(grad, st, mask) if self.size > 1 else grad
                        exp_avg.mul_(beta1).add_(g1, alpha=1 - beta1)
                else:
                    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                    st["lrs"] += group["lr"]
                update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p
                p.add_(-group["lr"] * update)
                if frozen:
                    acc.add_(-group["lr"] * update)
                    if st["step"] % st["local_step_interval"] == 0:
                        p.add_(-1 * acc)
                        acc.mul_(exp_avg_sq.sqrt() + group["eps"])
                        if self.size > 1:
                            out = self._compressed_allreduce(acc, st["worker_error"], st["server_error"])
                            if out is not acc:
                                acc.copy_(out)
                            if mask is not None:
                                acc.mul_(mask.to(acc.device))
                        if st["lrs"] != 0:  # all lr 0 since the last sync: m stays (DeepSpeed: 0 / 0)
                            exp_avg.zero_().add_(acc / st["lrs"], alpha=-1)
                        p.add_(acc / (exp_avg_sq.sqrt() + group["eps"]))
                        acc.zero_()
                        st["lrs"] = 0
                    st["local_step_counter"] += 1
                    if st["local_step_counter"] == self.local_step_scaler:
                        st["local_step_counter"] = 0
                        st["local_step_interval"] = min(self.local_step_clipper, st["local_step_interval"] * 2)
                else:
                    if st["step"] % st["var_interval"] == 0:
                        st["var_counter"] += 1
                        if st["var_counter"] == self.var_update_scaler:
                            st["var_counter"] = 0
                            st["var_interval"] *= 2
                    engine_flag = (st["step"] + 1) % st["var_interval"] == 0
        if first:
            self.initialized = True
            return loss
        if engine_flag is not None:
            self._set_engine_allreduce(engine_flag)
        params = [p for g in self.param_groups for p in g["params"]]
        if last_step is not None and last_step > self.var_freeze_step:
            self.compression_stage = True
            self._set_engine_allreduce(False)
        if self.compression_stage and not self.errors_reset:
            for p in params:
                st = self.state[p]
                if "worker_error" in st:
                    st["worker_error"].zero_()
                    st["server_error"].zero_()
            self.errors_reset = True
        return loss

    def state_dict(self) -> dict:
        """torch's state_dict plus ``"zero_one"``: ``{"initialized", "compression_stage",
        "dense_next", "errors_reset", "world_size"}``."""
        sd = super().state_dict()
        sd["zero_one"] = {"initialized": self.initialized, "compression_stage": self.compression_stage,
                          "dense_next": self.dense_next, "errors_reset": self.errors_reset, "world_size": self.size}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a checkpoint of this class (everything, bit for bit, when the world size
        matches; the error buffers restart at zero with a warning otherwise) or of DeepSpeed's
        ZeroOneAdam (no error buffers or accumulator: they restart at zero, and the stage follows
        the first parameter's step as DeepSpeed intended)."""
        flags = state_dict.get("zero_one")
        errors = self._load_without_errors({k: v for k, v in state_dict.items() if k != "zero_one"})
        params = [p for g in self.param_groups for p in g["params"]]
        for k, (we, se) in errors.items():
            p = params[k]
            st = self.state[p]
            Np = self.padded_numel(p.numel())
            fit = self._fitting_errors(we, se, p.numel(), p.device)
            st["worker_error"], st["server_error"] = fit if fit is not None else (
                torch.zeros(Np, dtype=torch.float32, device=p.device),
                torch.zeros(Np // self.size, dtype=torch.float32, device=p.device))
            if "momentum_accumulator" not in st:
                st["momentum_accumulator"] = torch.zeros_like(p)
        if flags is not None and flags.get("world_size") == self.size:
            self.initialized = bool(flags["initialized"])
            self.compression_stage = bool(flags["compression_stage"])
            self.errors_reset = bool(flags["errors_reset"])
            self._set_engine_allreduce(bool(flags["dense_next"]))
            return
        st0 = self._loaded_state()
        step = int(st0.get("step", 0))
        self.initialized = step > 0
        self.compression_stage = step > self.var_freeze_step
        self.errors_reset = self.compression_stage
        if not self.initialized:
            dense = True
        elif self.compression_stage:
            dense = False
        else:
            dense = (step + 1) % int(st0.get("var_interval", 1)) == 0
        self._set_engine_allreduce(dense)
