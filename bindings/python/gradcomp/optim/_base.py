"""What :class:`~gradcomp.optim.OnebitAdam`, :class:`~gradcomp.optim.OnebitLamb` and
:class:`~gradcomp.optim.ZeroOneAdam` share: the process group and DeepSpeed's padding rule, the
dense gradient averaging, the switch to the compression stage (and a bound DeepSpeed engine's
allreduce flag), byte accounting, and the checks of checkpointed error buffers.

Not public: use the optimizers, :func:`gradcomp.optim.register_comm_hook` and
:func:`gradcomp.deepspeed.install`.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import planner
from ..errors import CollectiveError, in_context
from ..schemes.context import collective_failed
from ..schemes.onebit_allreduce import OnebitAllreduce


class OnebitOptimizer(torch.optim.Optimizer):
    """Base of the 1-bit optimizers (see :mod:`gradcomp.optim`).

    Args:
        params, defaults: as ``torch.optim.Optimizer``.
        freeze_step: the step count (DeepSpeed's ``state['step']``, the initialisation step
            included) after which the compression stage starts; an int >= 1.
        group: the data-parallel process group (default: the world; world size 1 when
            torch.distributed is not initialized: then nothing is communicated).
        average_gradients: whether ``step()`` itself averages the gradients over the group
            during the warm-up (a plain training loop). False when something else averages them:
            DDP (with :func:`register_comm_hook`, which leaves them local after the warm-up) or a
            DeepSpeed engine (:func:`gradcomp.deepspeed.install` sets it).

    A step that fails (a collective fails: a peer died, a timeout; a server packet does not
    match) is undone on every rank that raises: the parameters, the optimizer state (error
    buffers, momenta, step counts) and the stage flags are put back as they were before the step
    from a copy taken at its start, and :class:`gradcomp.CollectiveError` is raised naming the
    optimizer and the step, so a checkpoint written then resumes exactly. The copy covers the
    parameters and their state when the step exchanges inside its update loop (the compression
    stage; ZeroOneAdam after its first step) and only the counters otherwise; set
    ``opt.undo_failed_steps = False`` to save that memory and time (a failed step then leaves the
    state partly updated). An error of the closure is re-raised unchanged, after the same undo.

    Raises:
        ValueError: freeze_step not an int >= 1.
    """

    _STEP_ATTRS = ("initialized", "compression_stage", "dense_next", "_stats")
    """The optimizer's own attributes a step may change (a failed step puts them back)."""

    undo_failed_steps = True
    """Copy what a step changes, so that a failed step is undone (class docstring)."""

    def __init__(self, params, defaults: dict, freeze_step: int, group=None, average_gradients: bool = True):
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"gradcomp.optim.{type(self).__name__}: freeze_step={freeze_step!r}; accepted: an "
                             f"int >= 1 (the number of steps, the first, initialisation step included, before "
                             f"the compression stage)")
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.group = group
        self.average_gradients = bool(average_gradients)
        if dist.is_available() and dist.is_initialized():
            self.size = dist.get_world_size(group)
        else:
            self.size = 1
        # DeepSpeed's padding: every compressed buffer is a multiple of W * lcm(W, 8) elements
        self.divider = self.size * 8 // math.gcd(self.size, 8)
        self._backend = None
        self.initialized = False  # DeepSpeed's "initialize": False until the initialisation step
        self.compression_stage = False  # DeepSpeed's adam_freeze_key / lamb_freeze_key after init
        # whether the next step averages its gradients densely (DeepSpeed's engine flag
        # enable_backward_allreduce: read by the DDP hook, the plain loop and a bound engine)
        self.dense_next = True
        self._engine = None
        self._stats = {"steps": 0, "warmup_steps": 0, "compressed_steps": 0, "dense_sent_bytes": 0.0,
                       "compressed_sent_bytes": 0.0, "packet_bytes": 0, "exchanged_dense_bytes": 0}

    # -- a step, undone when it fails -----------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None) -> Optional[torch.Tensor]:
        """One optimization step (see the class docstring). Returns the closure's loss.

        Raises:
            gradcomp.CollectiveError: an exchange failed (a peer died, a timeout; a
                RankMismatchError when server packets do not match); the step is undone first.
            RuntimeError: sparse gradients.
        """
        if self.size == 1:
            return self._step(closure)
        number = self._stats["steps"] + 1
        saved = self._save(full=self.undo_failed_steps and self._exchanges_in_loop())
        try:
            return self._step(closure)
        except Exception as e:  # noqa: BLE001 - undone, then raised (with context when it is a collective's)
            self._restore(saved)
            if isinstance(e, CollectiveError):
                raise in_context(e, f"gradcomp.optim.{type(self).__name__}: step {number} failed; the parameters, "
                                    f"the optimizer state (error buffers included) and the step counts are as "
                                    f"before it") from e
            raise

    def _exchanges_in_loop(self) -> bool:
        """Whether this step may exchange after it changed parameters or state (then a failed
        step needs a copy of them to be undone)."""
        return True

    def _step(self, closure) -> Optional[torch.Tensor]:  # pragma: no cover - each optimizer's
        raise NotImplementedError

    def _save(self, full: bool) -> dict:
        """What the step may change: the optimizer's ``_STEP_ATTRS`` always; with ``full`` also
        every parameter and its state (tensors cloned, the rest deep-copied)."""
        def keep(v):
            return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)

        out = {"attrs": {k: keep(getattr(self, k, None)) for k in self._STEP_ATTRS}, "params": []}
        if full:
            for g in self.param_groups:
                for p in g["params"]:
                    st = self.state.get(p)
                    out["params"].append((p, p.detach().clone(),
                                          None if st is None else {k: keep(v) for k, v in st.items()}))
        return out

    def _restore(self, saved: dict) -> None:
        """Put back what :meth:`_save` kept. Tensors are copied into the current ones when their
        shape and dtype match (views of them, e.g. OnebitLamb's momenta in its flat buffer, follow),
        else replaced; state keys the step added are removed; the engine's allreduce flag follows
        ``dense_next``."""
        def put(cur, old):
            if (isinstance(cur, torch.Tensor) and isinstance(old, torch.Tensor) and cur.shape == old.shape
                    and cur.dtype == old.dtype):
                cur.copy_(old)
                return cur
            return old

        for k, v in saved["attrs"].items():
            setattr(self, k, put(getattr(self, k, None), v))
        for p, data, st in saved["params"]:
            p.copy_(data)
            if st is None:
                self.state.pop(p, None)
                continue
            cur = self.state[p]
            for k in [k for k in cur if k not in st]:
                del cur[k]
            for k, v in st.items():
                cur[k] = put(cur.get(k), v)
        self._set_engine_allreduce(self.dense_next)

    # -- communication -------------------------------------------------------------------------
    @property
    def backend(self):
        """The :class:`gradcomp.schemes.onebit_allreduce.OnebitAllreduce` (DeepSpeed's
        compressed_allreduce, the algorithm of :class:`gradcomp.deepspeed.OnebitBackend`) this
        optimizer compresses through (created on first use; None for world size 1)."""
        if self._backend is None and self.size > 1:
            self._backend = OnebitAllreduce(group=self.group)
        return self._backend

    def padded_numel(self, numel: int) -> int:
        """``numel`` rounded up to DeepSpeed's multiple of ``W * lcm(W, 8)`` elements."""
        m = self.size * self.divider
        return int(numel) + (-int(numel)) % m

    def _compressed_allreduce(self, buf: torch.Tensor, worker_error: torch.Tensor,
                              server_error: torch.Tensor) -> torch.Tensor:
        out = self.backend(buf, worker_error, server_error)
        Np = worker_error.numel()
        self._stats["compressed_sent_bytes"] += planner.onebit_allreduce_bytes(self.backend.codec, Np, self.size)
        self._stats["packet_bytes"] += int(self.backend.codec.packet_bytes(Np))
        self._stats["exchanged_dense_bytes"] += buf.numel() * buf.element_size()
        return out

    def _average(self, tensors: List[torch.Tensor]) -> None:
        """Mean over the group, in place: one allreduce per (dtype, device) of the flattened
        tensors, then a multiply by fl(1 / W) (as DeepSpeed's non_freeze path does)."""
        if self.size == 1 or not tensors:
            return
        by_kind: Dict[tuple, List[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for ts in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in ts])
            try:
                dist.all_reduce(flat, group=self.group)
            except Exception as e:  # noqa: BLE001 - named, cause kept
                raise collective_failed("the dense allreduce of the gradients", e) from e
            flat.mul_(1.0 / self.size)
            self.count_dense(flat.numel() * flat.element_size())
            off = 0
            for t in ts:
                t.copy_(flat[off: off + t.numel()].view_as(t))
                off += t.numel()

    def count_dense(self, nbytes: int) -> None:
        """Adds one dense ring allreduce of ``nbytes`` bytes to :meth:`comm_stats` (called by the
        DDP hook for the buckets it averages)."""
        self._stats["dense_sent_bytes"] += planner.ring_allreduce_bytes(nbytes, self.size)
        self._stats["packet_bytes"] += int(nbytes)
        self._stats["exchanged_dense_bytes"] += int(nbytes)

    def comm_stats(self) -> dict:
        """Bytes this rank sent (the planner's formulas) and step counts: ``{"steps",
        "warmup_steps", "compressed_steps", "dense_sent_bytes", "compressed_sent_bytes",
        "sent_bytes", "sent_bytes_per_step", "packet_bytes", "exchanged_dense_bytes"}``.
        ``warmup_steps`` counts the steps that averaged densely (ZeroOneAdam: its variance steps),
        ``compressed_steps`` the others. Dense bytes are the dense averaging (by ``step()`` or by
        :func:`register_comm_hook`'s hook) and non_freeze groups; compressed bytes the 1-bit
        exchanges. ``packet_bytes`` sums what this rank put on the wire as its own data (a dense
        tensor's bytes; a onebit packet of the padded buffer), ``exchanged_dense_bytes`` the
        dense size of the same tensors (their ratio is the packet ratio). Under a DeepSpeed
        engine (:meth:`bind_engine`) the gradients the engine averages are counted as dense on the
        steps its allreduce was on (the initialisation step and the warm-up; ZeroOneAdam's
        variance steps): a ring allreduce of the step's gradient bytes each. The counts are not in
        ``state_dict()``: after ``load_state_dict`` they start from zero (the step counts of the
        state go on)."""
        s = dict(self._stats)
        s["sent_bytes"] = s["dense_sent_bytes"] + s["compressed_sent_bytes"]
        s["sent_bytes_per_step"] = s["sent_bytes"] / s["steps"] if s["steps"] else float("nan")
        return s

    # -- stage switch and DeepSpeed --------------------------------------------------------------
    def bind_engine(self, engine) -> None:
        """Lets a DeepSpeed engine average the warm-up gradients and turns its gradient
        allreduce off for the compression stage (``engine.enable_backward_allreduce``, or
        ``pipeline_enable_backward_allreduce`` for a pipeline engine), as DeepSpeed's own
        optimizers do. Use :func:`gradcomp.deepspeed.install`, which checks the world size."""
        self._engine = engine
        self.average_gradients = False
        self._set_engine_allreduce(self.dense_next)

    def _set_engine_allreduce(self, on: bool) -> None:
        self.dense_next = bool(on)
        e = self._engine
        if e is None:
            return
        if hasattr(e, "pipeline_enable_backward_allreduce"):
            e.pipeline_enable_backward_allreduce = on
        else:
            e.enable_backward_allreduce = on

    def _after_step(self, step: int) -> None:
        """DeepSpeed's switch: once the step count reaches freeze_step the next steps compress."""
        if not self.compression_stage and step >= self.freeze_step:
            self.compression_stage = True
            self._set_engine_allreduce(False)

    def _stage_from_step(self, step: int) -> None:
        self.compression_stage = self.initialized and step >= self.freeze_step
        self._set_engine_allreduce(not self.compression_stage)

    def _begin_step(self, closure):
        """The start every step() shares: the closure's loss (under enable_grad), the step
        counts, and the dense averaging of every gradient when this step averages densely and
        ``average_gradients`` is set (never on the initialisation step, which uses none).
        Returns ``(loss, first)``, first = this is the initialisation step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = not self.initialized
        self._stats["steps"] += 1
        self._stats["warmup_steps" if self.dense_next else "compressed_steps"] += 1
        if not first and self.dense_next and self.average_gradients:
            self._average([g for group in self.param_groups for g in self._grads(group)])
        elif self.dense_next and self._engine is not None and self.size > 1:
            # a bound DeepSpeed engine allreduced this step's gradients in backward (its flag was on)
            self.count_dense(sum(g.numel() * g.element_size() for group in self.param_groups
                                 for g in self._grads(group)))
        return loss, first

    @staticmethod
    def _grads(group) -> List[torch.Tensor]:
        out = []
        for p in group["params"]:
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError("gradcomp.optim: sparse gradients are not supported (1-bit compression "
                                       "needs dense tensors)")
                out.append(p.grad)
        return out

    # -- checkpoints -----------------------------------------------------------------------------
    def _keep_masks(self, state_dict: dict) -> dict:
        """DeepSpeed's rule: a param group's ``exp_avg_mask`` is always the one of the running
        optimizer, never the checkpoint's."""
        state_dict = dict(state_dict)
        groups = [dict(g) for g in state_dict["param_groups"]]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"gradcomp.optim.{type(self).__name__}.load_state_dict: the checkpoint has "
                             f"{len(groups)} parameter groups, this optimizer {len(self.param_groups)}")
        for g, mine in zip(groups, self.param_groups):
            if "exp_avg_mask" in mine:
                g["exp_avg_mask"] = mine["exp_avg_mask"]
            else:
                g.pop("exp_avg_mask", None)
        state_dict["param_groups"] = groups
        return state_dict

    def _fitting_errors(self, we, se, numel: int, device) -> Optional[tuple]:
        """Checkpointed (worker_error, server_error) of a buffer of ``numel`` elements as float32
        copies on ``device`` when both fit this world size's padding; else None, with a warning
        when they were there but do not fit (a checkpoint from another world size: the buffers
        restart at zero, as DeepSpeed's always do)."""
        if we is None and se is None:
            return None
        Np = self.padded_numel(numel)
        for name, t, want in (("worker_error", we, Np), ("server_error", se, Np // self.size)):
            if not isinstance(t, torch.Tensor) or t.numel() != want:
                got = t.numel() if isinstance(t, torch.Tensor) else type(t).__name__
                warnings.warn(f"gradcomp.optim.{type(self).__name__}.load_state_dict: {name} holds {got} elements, "
                              f"this world size ({self.size}) needs {want}: the error buffers restart at zero",
                              stacklevel=3)
                return None
        return tuple(t.to(device=device, dtype=torch.float32, copy=True) for t in (we, se))

    def _load_without_errors(self, state_dict: dict) -> Dict[int, tuple]:
        """torch's load_state_dict of everything but the per-parameter error buffers (torch would
        cast them to the parameter's dtype), the running optimizer's ``exp_avg_mask`` kept.
        Returns ``{parameter index: (worker_error, server_error)}`` from the checkpoint."""
        sd = self._keep_masks(state_dict)
        errors, state = {}, {}
        for k, st in sd["state"].items():
            st = dict(st)
            errors[int(k)] = (st.pop("worker_error", None), st.pop("server_error", None))
            state[k] = st
        sd["state"] = state
        super().load_state_dict(sd)
        return errors

    def _loaded_state(self) -> dict:
        """The state of the first parameter that has one, whose step count sets the stage after
        a load (DeepSpeed reads the first parameter, which has none when it never had a
        gradient); {} for none."""
        params = [p for g in self.param_groups for p in g["params"]]
        return next((self.state[p] for p in params if "step" in self.state.get(p, {})), {})

    def _loaded_step(self) -> int:
        return int(self._loaded_state().get("step", 0))
