"""PowerSGD low-rank compression as a DDP communication hook and as a compressor for any loop.

PowerSGD (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019, algorithm 1) sends, for each gradient matrix M (a tensor
of shape [n, ...] viewed as [n, m], with this rank's residual added, error feedback), two thin
factors: P = M Q (n x r, summed over the ranks, then orthonormalized) and Q = M^T P (m x r,
averaged); every rank then applies M_hat = P Q^T and keeps M - M_hat as its residual. Q is kept
from step to step (warm start: one step of subspace iteration per training step).

Drop-in for PyTorch's ``powerSGD_hook``::

    state = gradcomp.torch.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                         start_powerSGD_iter=10, ddp_model=ddp)
    ddp.register_comm_hook(state, gradcomp.torch.powersgd_hook)
    # or: state = gradcomp.torch.register(ddp, codec="powersgd:rank=4", start_iter=10)
    # any loop: comp = gradcomp.torch.Compressor("powersgd:rank=4"); comp.allreduce(p.grad, name).wait()

What differs from PyTorch's hook (``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``;
the README's "PowerSGD" section has the measured speed):

- two collectives per bucket, not three: the tensors that do not pay (fewer than 2 dimensions,
  fewer than ``min_compress_numel`` elements, or ``(n + m) r * min_compression_rate >= n m``)
  travel in ONE float32 allreduce together with the P factors, then the Q factors in a second;
- the steps run in gradcomp's kernels (:mod:`gradcomp.lowrank`: gradcomp's / OpenBLAS / cuBLAS GEMMs batched
  over same-shape matrices, Gram-Schmidt in float64 sums, the residual update fused into the
  output pass), with no clone of the bucket, no new error tensor and no device synchronize;
- the residuals are float32 whatever the bucket dtype, keyed by parameter name in a
  :class:`gradcomp.torch.residuals.ResidualStore`: they follow their parameters through DDP's
  bucket rebuild (so ``start_powerSGD_iter`` may be 0 or 1 with error feedback and warm start,
  which PyTorch refuses) and round-trip through checkpoints bit for bit; so does each matrix's Q;
- tensors sent dense carry no residual (PyTorch's keeps local minus average for them, which sums
  to zero over the ranks); a 0-dim parameter is sent dense (PyTorch's hook crashes on it);
- a zero column of P or Q stays zero, never NaN, whatever ``orthogonalization_epsilon`` (PyTorch's
  gives NaN at epsilon 0); at warm start a zero column of Q is drawn again, so a layer whose
  gradient was zero once is not stuck with a zero Q;
- non-finite steps (docs/contracts.md section 4): a step is non-finite iff the averaged bucket holds a
  NaN or inf (every rank decides the same); then the residuals and the Qs are put back as they
  were before the step (``nonfinite="restore"``) or the residuals zeroed (``"reset"``), on the
  device, so one NaN step never poisons the state (in PyTorch's hook it does, forever);
- the initial Q comes from Philox keyed by ``random_seed`` and the parameter's name
  (:func:`gradcomp.lowrank.random_normal`, identical on every rank without communication, and
  independent of the bucketing: a parameter's result does not depend on which bucket holds it); ``q_init="torch"`` draws it as PyTorch's hook
  does instead (numpy RandomState(random_seed) -> torch.manual_seed -> CPU randn per Q, per shape
  group when ``batch_tensors_with_same_shape``), for a step-by-step comparison with it;
- same-shape matrices are always batched (``batch_tensors_with_same_shape`` changes only the
  ``q_init="torch"`` draws); P and Q travel in float32 (PyTorch: in the bucket dtype);
- world size 1 returns the bucket unchanged (PyTorch's compresses it anyway).

Byte accounting (:func:`gradcomp.planner.powersgd_bytes`) is in ``state.stats()``, shaped as the
other hooks' (``scheme`` "powersgd"), and ``state.compression_stats()`` is PyTorch's.
"""

import logging
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from .. import lowrank, planner
from ..codec import _dtype_name as dtype_name
from ..schemes.allreduce import dense as dense_scheme
from ..schemes.allreduce import sum_allreduce
from ..schemes.check import PeerCheck
from ..schemes.context import SchemeContext, chain, completed
from . import protocol
from .hook import check_ddp_model, hook_joins
from .journal import Attempt, NotApplied, StepJournal, fail_call, not_applied, peer_check
from .protocol import BaseCompressor, LossScale, check_allreduce_args
from .residuals import NONFINITE_MODES, ResidualStore
from .stats import Stats, check_log_file

log = logging.getLogger("gradcomp")

PICKLE_VERSION = 1
Q_INITS = ("philox", "torch")
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MASK64 = (1 << 64) - 1


class _Group:
    """Compressed matrices of one shape [n, m] in a bucket: rank r, their bucket offsets and
    names, and views of the plan's P (comm buffer) and Q (memory) for them."""

    def __init__(self, n: int, m: int, r: int):
        self.n, self.m, self.r = n, m, r
        self.offsets: List[int] = []
        self.names: List[str] = []
        self.p: Optional[torch.Tensor] = None  # float32 [b, n, r]
        self.q: Optional[torch.Tensor] = None  # float32 [b, m, r]


class _Plan:
    """What one bucket layout needs, built once per layout (a DDP rebuild makes a new one)."""

    def __init__(self, key, numel: int, dtype: torch.dtype, device: torch.device,
                 entries: Sequence[Tuple[str, int, Tuple[int, ...]]], opts: dict):
        self.key = key
        self.numel, self.dtype, self.device = int(numel), dtype, device
        self.signature = _signature(numel, dtype, device, entries)
        groups: Dict[Tuple[int, int], _Group] = {}
        dense_ranges: List[Tuple[int, int]] = []
        self.compressed: List[Tuple[str, int, int]] = []  # (name, offset, numel) for the residual layout
        self.dense_names: List[Tuple[str, int, int]] = []
        self.numel_before = 0
        self.numel_after = 0
        for name, off, shape in entries:
            numel_t = 1
            for d in shape:
                numel_t *= int(d)
            r = planner.powersgd_rank(shape, opts["rank"], opts["min_compression_rate"], opts["min_compress_numel"])
            self.numel_before += numel_t
            if r == 0:
                dense_ranges.append((int(off), numel_t))
                self.dense_names.append((name, int(off), numel_t))
                self.numel_after += numel_t
                continue
            n = int(shape[0])
            m = numel_t // n
            g = groups.get((n, m))
            if g is None:
                g = groups[(n, m)] = _Group(n, m, r)
            g.offsets.append(int(off))
            g.names.append(name)
            self.compressed.append((name, int(off), numel_t))
            self.numel_after += (n + m) * r
        self.groups = list(groups.values())  # first-appearance order of shapes (PyTorch's)
        self.dense_numel = sum(c for _, c in dense_ranges)
        self.p_numel = sum(len(g.offsets) * g.n * g.r for g in self.groups)
        self.q_numel = sum(len(g.offsets) * g.m * g.r for g in self.groups)
        f32 = dict(dtype=torch.float32, device=device)
        self.comm1 = torch.zeros(self.dense_numel + self.p_numel, **f32)  # [dense | P]
        self.q = torch.zeros(self.q_numel, **f32)  # the Q memory, also the second collective's buffer
        self.qbak = torch.empty_like(self.q)
        p_at, q_at = self.dense_numel, 0
        for g in self.groups:
            b = len(g.offsets)
            g.p = self.comm1[p_at: p_at + b * g.n * g.r].view(b, g.n, g.r)
            g.q = self.q[q_at: q_at + b * g.m * g.r].view(b, g.m, g.r)
            p_at += b * g.n * g.r
            q_at += b * g.m * g.r
        self.dense_idx = None
        if self.dense_numel:
            idx = torch.cat([torch.arange(o, o + c, dtype=torch.int64) for o, c in dense_ranges])
            self.dense_idx = idx.to(device)
        self.warm = [[False] * len(g.offsets) for g in self.groups]  # host knowledge only
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        self.scratch: Optional[torch.Tensor] = None  # float32 M without error feedback (16-bit buckets)
        self.lay = None  # the ResidualStore layout (error feedback)
        self.flush_dense = True  # dense parameters may hold residuals (loaded, or from older layouts)

    def m_scratch(self) -> torch.Tensor:
        if self.scratch is None:
            self.scratch = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        return self.scratch


def _signature(numel, dtype, device, entries) -> tuple:
    """A bucket layout's identity: (numel, dtype, device, ((name, offset, shape), ...))."""
    return (int(numel), dtype, str(device), tuple((n, int(o), tuple(s)) for n, o, s in entries))


def _parse_spec(spec: str) -> Dict[str, Any]:
    """``"powersgd"`` or ``"powersgd:rank=4,min_rate=2,warm_start=1,epsilon=0,seed=0"`` -> options."""
    name, _, rest = str(spec).partition(":")
    if name.strip() != "powersgd":
        raise ValueError(f"PowerSGD: spec {spec!r} does not name powersgd")
    keys = {"rank": int, "min_rate": float, "warm_start": lambda v: bool(int(v)), "epsilon": float, "seed": int}
    out: Dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        k, eq, v = item.partition("=")
        k = k.strip()
        if not eq or k not in keys:
            raise ValueError(f"PowerSGD spec {spec!r}: key {k!r}; accepted keys: {', '.join(keys)} (e.g. powersgd:rank=4)")
        try:
            out[k] = keys[k](v.strip())
        except ValueError:
            raise ValueError(f"PowerSGD spec {spec!r}: {k}={v.strip()!r} is not a valid {keys[k].__name__ if isinstance(keys[k], type) else 'value'}") from None
    return out


def is_powersgd_spec(codec: Any) -> bool:
    """Whether ``codec`` is a PowerSGD spec string (``"powersgd"`` or ``"powersgd:..."``)."""
    return isinstance(codec, str) and codec.partition(":")[0].strip() == "powersgd"


class _Undo:
    """How to put back what one PowerSGD call changed (:mod:`gradcomp.torch.journal`): the plan's
    Qs and warm flags, the residual (the new one is written into the backup buffer and swapped in
    at the end: swapping back undoes it), flushed residuals, the compression counters and
    ``q_init="torch"``'s RandomState. ``again()`` repeats the per-call parts for a call still in
    flight when its step failed (idempotent)."""

    def __init__(self, engine: "_LowRank", plan: Optional["_Plan"]):
        self.engine, self.plan = engine, plan
        self.q = plan.q.clone() if plan is not None and plan.q_numel else None
        self.warm = [list(w) for w in plan.warm] if plan is not None else None
        self.rng = engine.rng.get_state() if engine.q_init == "torch" else None
        self.swapped = False
        self.flushed: list = []
        self.flush_dense = plan.flush_dense if plan is not None else False
        self.counted = (0, 0)

    def count(self, before: int, after: int) -> None:
        self.engine.numel_before += before
        self.engine.numel_after += after
        self.counted = (before, after)

    def again(self) -> None:
        e, plan = self.engine, self.plan
        if plan is not None:
            if self.q is not None:
                plan.q.copy_(self.q)
            plan.warm = [list(w) for w in self.warm]
            plan.flush_dense = self.flush_dense
            if self.swapped:
                e.store.swap_backup(plan.lay)
                self.swapped = False
        if self.flushed:
            e.store.unflush(self.flushed)
        b, a = self.counted
        e.numel_before -= b
        e.numel_after -= a
        self.counted = (0, 0)

    def __call__(self) -> None:
        self.again()
        if self.rng is not None:
            self.engine.rng.set_state(self.rng)


class _LowRank:
    """The PowerSGD engine of one rank: plans per bucket layout, residuals, Qs, accounting.
    Shared by :class:`PowerSGDState` (DDP buckets) and :class:`PowerSGDCompressor` (named tensors)."""

    def __init__(self, group, rank: int, min_compression_rate: float, use_error_feedback: bool, warm_start: bool,
                 orthogonalization_epsilon: float, random_seed: int, nonfinite: str, q_init: str,
                 batch_tensors_with_same_shape: bool, min_compress_numel: int, log_every: int,
                 on_corrupt: str = "raise", log_file: Any = None):
        _check(rank=rank, min_compression_rate=min_compression_rate, use_error_feedback=use_error_feedback,
               warm_start=warm_start, orthogonalization_epsilon=orthogonalization_epsilon, random_seed=random_seed,
               nonfinite=nonfinite, q_init=q_init, min_compress_numel=min_compress_numel, log_every=log_every)
        check_log_file(log_file, log_every)
        self.opts = {"rank": int(rank), "min_compression_rate": float(min_compression_rate),
                     "min_compress_numel": int(min_compress_numel)}
        self.error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        self.q_init = q_init
        self.batch_same_shape = bool(batch_tensors_with_same_shape)
        self.rng = np.random.RandomState(self.random_seed)  # q_init="torch": PyTorch's draws
        self.store = ResidualStore(nonfinite)
        self.iter = 0
        self._plans: Dict[Any, _Plan] = {}
        self._q_pending: Dict[str, torch.Tensor] = {}  # name -> float32 [m * r] (loaded or from a dropped plan)
        self._warned: set = set()
        self.numel_before = 0
        self.numel_after = 0
        self.set_group(group)
        self._stats = Stats(self.world_size, self.spec(), nonfinite, on_corrupt, int(log_every), rank=self.rank,
                            log_file=log_file)
        self.scale = LossScale()  # an attached GradScaler and the loss scale the residuals are in
        self._journal = StepJournal(self._rewind)  # undoes a failed step (gradcomp.torch.journal)
        self._verified: Dict[Any, tuple] = {}  # key -> call signature the ranks agreed on

    def set_group(self, group) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if hasattr(self, "_stats"):
            self._stats.world_size, self._stats.rank = self.world_size, self.rank
        if hasattr(self, "_verified"):
            self._verified.clear()  # the new group's ranks compare their call descriptors again

    def spec(self) -> str:
        return f"powersgd:rank={self.opts['rank']}"

    # -- plans ---------------------------------------------------------------------------------
    def _plan(self, key, flat: torch.Tensor, entries) -> _Plan:
        """The plan of ``key`` for these entries; a new one when the layout changed (a DDP
        rebuild): residuals move by name (ResidualStore.activate), so do the Qs."""
        ent = entries() if callable(entries) else entries
        old = self._plans.get(key)
        if old is not None and old.signature == _signature(flat.numel(), flat.dtype, flat.device, ent):
            return old
        plan = _Plan(key, flat.numel(), flat.dtype, flat.device, ent, self.opts)
        if old is not None:
            self._release_q(old)
        self._adopt_q(plan)
        if self.error_feedback:
            plan.lay = self.store.layout(key, plan.numel, plan.dtype, plan.device, plan.compressed)
        self._plans[key] = plan
        log.info("gradcomp: PowerSGD %s: %d elements, %d matrices in %d shape groups (P %d, Q %d elements), "
                 "%d elements sent dense", _label(key), plan.numel, len(plan.compressed), len(plan.groups),
                 plan.p_numel, plan.q_numel, plan.dense_numel)
        return plan

    def _release_q(self, plan: _Plan) -> None:
        """A plan is replaced: its warm Qs become pending, by parameter name."""
        for gi, g in enumerate(plan.groups):
            for bi, name in enumerate(g.names):
                if plan.warm[gi][bi]:
                    self._q_pending[name] = g.q[bi].detach().reshape(-1).clone()

    def _adopt_q(self, plan: _Plan) -> None:
        """A new plan takes the pending Qs of its matrices (same m x r), warm from the start."""
        for gi, g in enumerate(plan.groups):
            for bi, name in enumerate(g.names):
                t = self._q_pending.pop(name, None)
                if t is not None and t.numel() == g.m * g.r:
                    g.q[bi].view(-1).copy_(t.to(plan.device))
                    plan.warm[gi][bi] = True

    # -- Q -------------------------------------------------------------------------------------
    def _stream_id(self, name: str) -> int:
        """The Philox stream of matrix ``name``'s Q drawn at this step: crc32(name) * 2^32 + iter
        (the same on every rank, and independent of how DDP buckets the parameters)."""
        return ((zlib.crc32(name.encode()) << 32) | (self.iter & 0xFFFFFFFF)) & _MASK64

    def _prepare_q(self, plan: _Plan) -> None:
        """Cold matrices (no Q yet, or no warm start) get a random Q (Philox per matrix, or
        PyTorch's draws); then every Q is orthonormalized (a zero column of a warm Q is drawn
        again). The Qs before orthogonalization are kept in ``plan.qbak`` for a non-finite step."""
        if not self.warm_start or not all(all(w) for w in plan.warm):
            if self.q_init == "torch":
                self._torch_draws(plan)
            else:
                for gi, g in enumerate(plan.groups):
                    for bi, name in enumerate(g.names):
                        if not (self.warm_start and plan.warm[gi][bi]):
                            lowrank.random_normal(g.q[bi], self.random_seed, self._stream_id(name))
        if self.warm_start:
            plan.qbak.copy_(plan.q)
        for gi, g in enumerate(plan.groups):
            redraw = None
            if self.warm_start and any(plan.warm[gi]):
                redraw = (self.random_seed, self._stream_id(g.names[0]) ^ (1 << 31))
            lowrank.orthogonalize(g.q, self.epsilon, redraw=redraw)

    def _torch_draws(self, plan: _Plan) -> None:
        """PyTorch's hook's draws: one seed per bucket from RandomState(random_seed), then CPU randn
        in the bucket dtype per Q (per shape group with batch_tensors_with_same_shape), in the
        order of its ``shape_to_tensors``; copied into the cold matrices."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.rng.randint(1_000_000_000))
            for gi, g in enumerate(plan.groups):
                b = len(g.names)
                shapes = [(b, g.m, g.r)] if self.batch_same_shape and b > 1 else [(1, g.m, g.r)] * b
                draws = torch.cat([torch.randn(*s, device="cpu", dtype=plan.dtype) for s in shapes])
                for bi in range(b):
                    if not (self.warm_start and plan.warm[gi][bi]):
                        g.q[bi].copy_(draws[bi].to(torch.float32))

    # -- a step -------------------------------------------------------------------------------
    def _attempt(self, key) -> Attempt:
        att = self._journal.attempt(self.iter, key)
        if att.rec is None:
            att.rec = self._stats.record(att.step)
        return att

    def _rewind(self, step: int) -> None:
        self.iter = int(step)

    def _context(self, att: Attempt, key, scheme: str) -> str:
        return f"gradcomp: step {att.step}, {_label(key)} ({self.spec()}, scheme {scheme})"

    def _failed(self, att: Attempt, key, scheme: str, e: BaseException,
                undo: Optional[_Undo] = None) -> BaseException:
        """A call of ``att`` failed: undo the step (the first failure; ``undo.again()`` for this
        call's own changes) and return the error to raise, naming step, bucket and scheme."""
        err = fail_call(att, _label(key), self._context(att, key, scheme), e, self._stats,
                        "its residuals, Qs and step counter are")
        if undo is not None:
            with self._journal.lock:
                undo.again()
        return err

    def _not_applied(self, att: Attempt, key, scheme: str) -> NotApplied:
        return not_applied(att, self._context(att, key, scheme))

    def _check(self, att: Attempt, key, flat: torch.Tensor, plan: Optional["_Plan"], scheme: str):
        """The ranks' call descriptors (:func:`gradcomp.torch.journal.peer_check`): the layout's
        entries, numel and dtype, the options and the scheme."""
        params = list(plan.signature[3]) if plan is not None else None
        sig = (flat.numel(), flat.dtype, scheme, None if params is None else tuple(params))
        spec = self.spec() if scheme == "powersgd" else "dense"

        def make(now: bool) -> PeerCheck:
            return PeerCheck(self.group, self.world_size, flat.device, step=att.step, key=key, numel=flat.numel(),
                             dtype=flat.dtype, params=params, spec=spec, spec_hash=zlib.crc32(repr(self.opts).encode()),
                             scheme=scheme, late=None if now else self._stats.expect_check)

        return peer_check(att, self._verified, key, sig, make, lambda e: self._failed(att, key, scheme, e))

    # -- a bucket ------------------------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, key, entries, joined: bool = False, dense: bool = False) -> torch.futures.Future:
        """Average the flat ``tensor`` (a bucket or one tensor) over the group in place; ``entries``
        = ``[(name, offset, shape)]`` of the tensors it holds, or a callable returning them.

        A failed collective, a mismatch between ranks or a failed step elsewhere makes the Future
        (or this call, for the first collective, issued here) raise; the step's residuals, Qs,
        counters and step counter are then put back (:mod:`gradcomp.torch.journal`)."""
        fut = self._reduce(tensor, key, entries, joined, dense)
        self._stats.returned()  # the caller has its Future: the step's report counts from here
        return fut

    def _reduce(self, tensor: torch.Tensor, key, entries, joined: bool, dense: bool) -> torch.futures.Future:
        W = self.world_size
        if W == 1:
            self._warn_once("world1", "gradcomp: PowerSGD: the process group has one rank: nothing is sent or "
                                      "compressed (the tensors are returned as they are)")
            return completed(tensor)
        flat = tensor.view(-1)
        att = self._attempt(key)
        if self.scale.due(self.iter):
            self.scale.follow(self.store, self.iter)
        if tensor.layout != torch.strided or tensor.dtype not in SUPPORTED_DTYPES:
            self._warn_once(("dtype", tensor.dtype), f"gradcomp: PowerSGD: {_label(key)} of dtype {tensor.dtype} / "
                            f"layout {tensor.layout} takes the dense path (allreduce_hook)")
            return self._dense(att, tensor, key, None)
        if dense:
            return self._dense(att, tensor, key, entries)
        plan = self._plan(key, flat, entries)
        rec = att.rec
        b = {key[0]: key[1], "numel": plan.numel, "dtype": dtype_name(plan.dtype), "scheme": "powersgd"}
        b.update(planner.powersgd_bytes(plan.numel, plan.dtype, plan.dense_numel, plan.p_numel, plan.q_numel, W))
        self._stats.account(rec, b)
        probe = self._stats.probe(rec, b, plan.device, _label(key))
        check = self._check(att, key, flat, plan, "powersgd")
        # a call of a step that already failed elsewhere runs its collectives (the ranks stay in
        # step) without error feedback; its own changes are put back when it completes
        doomed = att.failed
        undo = _Undo(self, plan)
        if not doomed:
            att.on_undo(undo)
        undo.count(plan.numel_before, plan.numel_after)
        ef = self.error_feedback and not joined and not doomed
        t0 = probe.clock("encode_s")
        if joined:
            flat.zero_()
        if self.error_feedback:
            self.store.activate(plan.lay)
        if ef and plan.flush_dense:
            if plan.dense_names and not self.store.empty():
                dl = self.store.layout((key, "dense"), plan.numel, plan.dtype, plan.device, plan.dense_names)
                undo.flushed = self.store.flush(dl, flat)  # residuals of parameters sent dense join their gradient
            plan.flush_dense = False
        # M = g + e goes into the residual's backup buffer: the residual slot keeps e until the
        # step has completed (then the two swap: no copy; a non-finite or failed step swaps back)
        if ef:
            res = plan.lay.residual
            M = torch.add(res, flat, out=plan.lay.backups["residual"])
        elif plan.dtype == torch.float32:
            M = flat
        else:
            M = plan.m_scratch()
            M.copy_(flat)
        self._prepare_q(plan)
        for g in plan.groups:
            lowrank.project(M, g.offsets, g.n, g.m, g.q, g.p)
        d = plan.dense_numel
        if d:
            plan.comm1[:d].copy_(flat.index_select(0, plan.dense_idx))
        probe.tock("encode_s", t0)
        try:  # round 1, waited for here: [dense | P], summed
            if plan.comm1.numel():
                sum_allreduce(plan.comm1, self.group, "PowerSGD: the allreduce of P (and of the tensors sent dense)",
                              probe, check).wait()
            elif check is not None:
                check.launch()
                check.verify()
        except Exception as e:  # noqa: BLE001 - the step fails: undone, raised with its context
            raise self._failed(att, key, "powersgd", e, undo) from e
        t2 = probe.clock("encode_s")
        if d:
            flat.index_copy_(0, plan.dense_idx, (plan.comm1[:d] / W).to(plan.dtype))
        for g in plan.groups:
            lowrank.orthogonalize(g.p, self.epsilon)
            lowrank.back_project(M, g.offsets, g.n, g.m, g.p, g.q)
        probe.tock("encode_s", t2)
        for gi in range(len(plan.warm)):
            plan.warm[gi] = [True] * len(plan.warm[gi])

        def finish():
            t4 = probe.clock("decode_s")
            plan.status.zero_()
            if plan.q_numel:
                plan.q.div_(W)
            for g in plan.groups:
                lowrank.reconstruct(flat, g.offsets, g.n, g.m, g.p, g.q, residual=M if ef else None,
                                    status=plan.status)
            nf = plan.status[0] != 0
            if d:
                nf = nf | torch.isfinite(plan.comm1[:d]).logical_not().any()
            with self._journal.lock:
                if att.failed:  # another call of the step failed: this one is put back too
                    undo.again()
                    raise self._not_applied(att, key, "powersgd")
                if ef:
                    if plan.dense_idx is not None:
                        M.index_fill_(0, plan.dense_idx, 0.0)  # M's dense ranges held g: no residual there
                    self.store.swap_backup(plan.lay)  # M (the new residual) becomes the residual
                    undo.swapped = True
                    if M.is_cuda:  # no host read: restore puts e back, reset zeroes, where non-finite
                        self.store.settle(plan.lay, nf)
                    elif bool(nf):  # CPU: reading the flag costs nothing
                        if self.store.nonfinite == "restore":
                            self.store.swap_backup(plan.lay)
                            undo.swapped = False
                        else:
                            plan.lay.residual.zero_()
                if self.warm_start and plan.q_numel:
                    torch.where(nf, plan.qbak, plan.q, out=plan.q)
                self._stats.mark_nonfinite(rec, nf)
            probe.tock("decode_s", t4)
            return tensor

        def on_error(e):
            return self._failed(att, key, "powersgd", e, undo)

        if not plan.q_numel:  # nothing compressed: one collective was all (no empty collective)
            return chain(completed(None), lambda _: finish(), on_error=on_error)
        # round 2: Q, summed
        q_sum = sum_allreduce(plan.q, self.group, "PowerSGD: the allreduce of Q", probe)
        return chain(q_sum, lambda _: finish(), "PowerSGD: the allreduce of Q", on_error=on_error, device=flat.device)

    def _dense(self, att: Attempt, tensor, key, entries) -> torch.futures.Future:
        """PyTorch's allreduce_hook: divide by W, SUM allreduce (warm-up steps, other dtypes);
        residuals of the bucket's parameters are added to the gradient first (and dropped; given
        back if the step fails)."""
        flat = tensor.view(-1)
        rec = att.rec
        b = {key[0]: key[1], "numel": flat.numel(), "dtype": dtype_name(tensor.dtype), "scheme": "dense"}
        b.update(planner.bucket_bytes("dense", None, flat.numel(), tensor.dtype, self.world_size))
        self._stats.account(rec, b)
        check = self._check(att, key, flat, None, "dense") if tensor.layout == torch.strided else None
        undo = _Undo(self, None)
        if entries is not None and self.error_feedback and not self.store.empty() and not att.failed:
            ent = entries() if callable(entries) else entries
            lay = self.store.layout((key, "warmup"), flat.numel(), tensor.dtype, tensor.device,
                                    [(n, o, int(np.prod(s)) if len(s) else 1) for n, o, s in ent])
            att.on_undo(undo)
            undo.flushed = self.store.flush(lay, flat)
        probe = self._stats.probe(rec, b, tensor.device, _label(key))
        reduced = dense_scheme(flat, SchemeContext(None, self.group, self.world_size), probe=probe, check=check)

        def done(_):
            with self._journal.lock:
                if att.failed:
                    undo.again()
                    raise self._not_applied(att, key, "dense")
            return tensor

        return chain(reduced, done, f"PowerSGD: {_label(key)}: the dense allreduce",
                     on_error=lambda e: self._failed(att, key, "dense", e, undo), device=flat.device)

    def end_step(self) -> None:
        """End the step (the counter advances unless the step failed: it is then tried again)."""
        self._journal.end_step(self._advance)

    def _advance(self) -> None:
        self.iter += 1

    def _warn_once(self, key, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg)

    # -- state ---------------------------------------------------------------------------------
    def q_state(self) -> Dict[str, torch.Tensor]:
        """``{name: float32 [m * r] copy}`` of every matrix with a warm Q (then the pending ones)."""
        out = {}
        for plan in self._plans.values():
            for gi, g in enumerate(plan.groups):
                for bi, name in enumerate(g.names):
                    if plan.warm[gi][bi]:
                        out[name] = g.q[bi].detach().reshape(-1).clone()
        for name, t in self._q_pending.items():
            out.setdefault(name, t.clone())
        return out

    def load_q(self, qs: Dict[str, torch.Tensor]) -> None:
        """Put saved Qs back: into the current plans' matrices of the same size (warm), the rest
        pending by name until a plan takes them."""
        self._q_pending = {}
        placed = set()
        for plan in self._plans.values():
            for gi, g in enumerate(plan.groups):
                for bi, name in enumerate(g.names):
                    t = qs.get(name)
                    plan.warm[gi][bi] = False
                    if t is not None and t.numel() == g.m * g.r:
                        g.q[bi].view(-1).copy_(t.detach().to(device=plan.device, dtype=torch.float32).reshape(-1))
                        plan.warm[gi][bi] = True
                        placed.add(name)
        for name, t in qs.items():
            if name not in placed:
                self._q_pending[name] = t.detach().to(torch.float32).reshape(-1).clone()
        for plan in self._plans.values():
            plan.flush_dense = True

    def stats(self) -> dict:
        return self._stats.summary()

    def layouts(self) -> List[dict]:
        """Per layout key: ``{"index" (bucket) or "name" (tensor), "numel", "dtype", "scheme":
        "powersgd", "params": [(name, offset, length)] (offset order), "compressed" / "dense":
        [(name, offset, length)], "groups": [(n, m, r, count)]}`` (elements)."""
        out = []
        for key, plan in self._plans.items():
            out.append({key[0]: key[1], "numel": plan.numel, "dtype": dtype_name(plan.dtype),
                        "scheme": "powersgd", "params": sorted(plan.compressed + plan.dense_names, key=lambda e: e[1]),
                        "compressed": list(plan.compressed), "dense": list(plan.dense_names),
                        "groups": [(g.n, g.m, g.r, len(g.names)) for g in plan.groups]})
        return out

    def options(self) -> dict:
        """The options a checkpoint records (PowerSGDState's names)."""
        return {"matrix_approximation_rank": self.opts["rank"], "min_compression_rate": self.opts["min_compression_rate"],
                "use_error_feedback": self.error_feedback, "warm_start": self.warm_start,
                "orthogonalization_epsilon": self.epsilon, "random_seed": self.random_seed, "q_init": self.q_init,
                "min_compress_numel": self.opts["min_compress_numel"]}

    def state_dict(self) -> dict:
        """This rank's state (see :meth:`PowerSGDState.state_dict`, without next_stats_report)."""
        self._stats.settle()
        return {"version": PICKLE_VERSION, "kind": "powersgd", "world_size": self.world_size, "rank": self.rank,
                "iter": self.iter, "options": self.options(), "grad_scale": self.scale.value(), "residuals": self.store.state(), "q": self.q_state(),
                "rng": self.rng.get_state(), "numel_before": self.numel_before, "numel_after": self.numel_after}

    def load_state_dict(self, sd: dict, strict: bool, who: str) -> None:
        """Load a :meth:`state_dict` (see :meth:`PowerSGDState.load_state_dict`; ``who`` names the
        caller in messages)."""
        if not isinstance(sd, dict) or sd.get("kind") != "powersgd":
            raise ValueError(f"{who}.load_state_dict: not a PowerSGD state_dict (no kind='powersgd')")
        mine = self.options()
        diffs = [f"{k}: saved {v!r}, current {mine.get(k)!r}" for k, v in sd.get("options", {}).items()
                 if mine.get(k) != v]
        if int(sd.get("rank", self.rank)) != self.rank and int(sd.get("world_size", self.world_size)) == self.world_size:
            diffs.insert(0, f"rank: saved {sd.get('rank')}, current {self.rank} (checkpoints are per rank)")
        if diffs:
            msg = f"{who}.load_state_dict: " + "; ".join(diffs)
            if strict:
                raise ValueError(msg + " (strict=False loads it anyway)")
            log.warning("gradcomp: %s; loading anyway (strict=False)", msg)
        self.iter = int(sd["iter"])
        gs = float(sd.get("grad_scale", 1.0))
        self.scale.unit = None if gs == 1.0 else torch.tensor(gs, dtype=torch.float32)
        self.scale.step = -1
        self.numel_before = int(sd.get("numel_before", 0))
        self.numel_after = int(sd.get("numel_after", 0))
        if "rng" in sd:
            self.rng.set_state(sd["rng"])
        if int(sd.get("world_size", self.world_size)) != self.world_size:
            log.warning("gradcomp: PowerSGD checkpoint of world size %s loaded at world size %d: residuals and Qs "
                        "dropped", sd.get("world_size"), self.world_size)
            return
        for name in list(self.store.state()):
            self.store.load(name, torch.zeros(self.store.length(name), dtype=torch.float32))
        for name, t in sd.get("residuals", {}).items():
            self.store.load(name, t.detach().to(torch.float32).reshape(-1))
        self.load_q(sd.get("q", {}))


def _label(key) -> str:
    return f"bucket {key[1]}" if key[0] == "index" else f"tensor {key[1]!r}"


def _check(*, rank, min_compression_rate, use_error_feedback, warm_start, orthogonalization_epsilon, random_seed,
           nonfinite, q_init, min_compress_numel, log_every) -> None:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"PowerSGD: matrix_approximation_rank={rank!r}; accepted: an int >= 1")
    if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
            or not min_compression_rate > 0:
        raise ValueError(f"PowerSGD: min_compression_rate={min_compression_rate!r}; accepted: a number > 0")
    for name, v in (("use_error_feedback", use_error_feedback), ("warm_start", warm_start)):
        if not isinstance(v, bool):
            raise TypeError(f"PowerSGD: {name}={v!r}; accepted: True or False")
    if isinstance(orthogonalization_epsilon, bool) or not isinstance(orthogonalization_epsilon, (int, float)) \
            or not orthogonalization_epsilon >= 0:
        raise ValueError(f"PowerSGD: orthogonalization_epsilon={orthogonalization_epsilon!r}; accepted: a number >= 0")
    if isinstance(random_seed, bool) or not isinstance(random_seed, (int, np.integer)) or not 0 <= random_seed < 2 ** 32:
        raise ValueError(f"PowerSGD: random_seed={random_seed!r}; accepted: an int in [0, 2**32)")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"PowerSGD: nonfinite={nonfinite!r}; accepted: {', '.join(NONFINITE_MODES)}")
    if q_init not in Q_INITS:
        raise ValueError(f"PowerSGD: q_init={q_init!r}; accepted: {', '.join(Q_INITS)}")
    for name, v in (("min_compress_numel", min_compress_numel), ("log_every", log_every)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"PowerSGD: {name}={v!r}; accepted: an int >= 0")


class PowerSGDState:
    """State of :func:`powersgd_hook` for one DDP model on one rank; PyTorch's ``PowerSGDState``
    options, same names and defaults.

    Args:
        process_group: the group to reduce over (None: the default group; PyTorch's first
            positional argument).
        matrix_approximation_rank: r; each matrix uses min(n, m, r) (default 1).
        start_powerSGD_iter: synchronized steps sent dense first, as ``allreduce_hook`` (default
            1000). May be 0 or 1 (PyTorch requires > 1 with error feedback or warm start: its
            state is keyed by bucket index, which DDP's rebuild after the first step changes).
        min_compression_rate: a matrix [n, m] is compressed only when (n + m) r * rate < n m
            (default 2); tensors of fewer than 2 dimensions are never compressed.
        use_error_feedback: keep the float32 residual M - M_hat per compressed element (default True).
        warm_start: keep Q across steps (default True); False draws a new Q every step.
        orthogonalization_epsilon: added to column norms before dividing (default 0); a zero
            column stays zero at any epsilon.
        random_seed: the seed of the initial Qs (default 0), the same on every rank.
        compression_stats_logging_frequency: log PyTorch's compression stats line every so many
            steps (default 10000).
        batch_tensors_with_same_shape: accepted for compatibility; same-shape matrices are always
            batched (it changes only the ``q_init="torch"`` draws, as PyTorch's hook draws).
        ddp_model: the DDP model (keyword): its parameter names key the residuals and Qs in
            ``state_dict()`` and it enables ``join()``; without it the keys are ``param0, param1,
            ...`` in the order parameters first reach the hook (the same in every run of the same
            model), and joins are not detected.
        nonfinite: ``"restore"`` (default: a second residual copy) or ``"reset"``.
        q_init: ``"philox"`` (default) or ``"torch"`` (PyTorch's draws; module docstring).
        min_compress_numel: tensors with fewer elements are sent dense (default 0).
        log_every: a gradcomp stats log line every N steps (0: never).
        log_file: None, or a path to which the step report of every ``log_every``-th step is
            appended as a JSON line instead (:class:`gradcomp.torch.Compressor`'s ``log_file``).

    Attributes:
        iter: synchronized steps seen (incremented after the last bucket, as PyTorch's).

    Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` (per rank: residuals and Qs by
    parameter name, ``iter``, the options; bit-exact), or pickle the state as PyTorch's (the
    process group and the model are not pickled: :meth:`bind` a loaded state to a new DDP model).

    Raises:
        ValueError: an option out of range (the message names it and what is accepted).
        TypeError: a bool option that is not a bool; ``ddp_model`` not a DistributedDataParallel.
    """

    def __init__(self, process_group=None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 1_000,
                 min_compression_rate: float = 2, use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000, batch_tensors_with_same_shape: bool = False,
                 *, ddp_model=None, nonfinite: str = "restore", q_init: str = "philox", min_compress_numel: int = 0,
                 log_every: int = 0, log_file: Any = None):
        for name, v in (("start_powerSGD_iter", start_powerSGD_iter),
                        ("compression_stats_logging_frequency", compression_stats_logging_frequency)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"PowerSGDState: {name}={v!r}; accepted: an int >= 0")
        if not isinstance(batch_tensors_with_same_shape, bool):
            raise TypeError(f"PowerSGDState: batch_tensors_with_same_shape={batch_tensors_with_same_shape!r}; "
                            f"accepted: True or False")
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.next_stats_report = 0
        self._engine = _LowRank(process_group, matrix_approximation_rank, min_compression_rate, use_error_feedback,
                                warm_start, orthogonalization_epsilon, random_seed, nonfinite, q_init,
                                batch_tensors_with_same_shape, min_compress_numel, log_every,
                                log_file=log_file)
        self.process_group = process_group
        self._names: Dict[int, str] = {}
        self._joined = False
        if ddp_model is not None:
            self.bind(ddp_model, process_group)

    # PyTorch's attribute names, read from the engine
    matrix_approximation_rank = property(lambda self: self._engine.opts["rank"])
    min_compression_rate = property(lambda self: self._engine.opts["min_compression_rate"])
    use_error_feedback = property(lambda self: self._engine.error_feedback)
    warm_start = property(lambda self: self._engine.warm_start)
    orthogonalization_epsilon = property(lambda self: self._engine.epsilon)
    random_seed = property(lambda self: self._engine.random_seed)
    batch_tensors_with_same_shape = property(lambda self: self._engine.batch_same_shape)
    nonfinite = property(lambda self: self._engine.store.nonfinite)
    q_init = property(lambda self: self._engine.q_init)
    world_size = property(lambda self: self._engine.world_size)
    rank = property(lambda self: self._engine.rank)
    total_numel_before_compression = property(lambda self: self._engine.numel_before)
    total_numel_after_compression = property(lambda self: self._engine.numel_after)
    nonfinite_steps = property(lambda self: self._engine._stats.nonfinite_steps,
                               doc="Non-finite steps seen so far (read one step late).")

    @property
    def iter(self) -> int:
        return self._engine.iter

    @iter.setter
    def iter(self, v: int) -> None:
        self._engine.iter = int(v)

    def bind(self, ddp_model, process_group=None) -> "PowerSGDState":
        """Take parameter names (and ``join()`` detection) from ``ddp_model``; reduce over
        ``process_group`` (None: the model's). Then register with
        ``ddp_model.register_comm_hook(state, powersgd_hook)``.

        Raises:
            TypeError: ``ddp_model`` is not a DistributedDataParallel.
        """
        check_ddp_model(ddp_model, "PowerSGDState")
        self._names = {id(p): name for name, p in ddp_model.module.named_parameters()}
        group = process_group if process_group is not None else ddp_model.process_group
        self.process_group = process_group
        self._engine.set_group(group)
        self._engine._stats.world_size = self._engine.world_size
        hook_joins(self, ddp_model)
        return self

    def _name(self, p) -> str:
        name = self._names.get(id(p))
        if name is None:
            name = self._names[id(p)] = f"param{len(self._names)}"
        return name

    def maybe_increase_iter(self, bucket) -> None:
        """PyTorch's: count a step after its last bucket; log the compression stats at the
        logging frequency."""
        if bucket.is_last():
            self._engine.end_step()
            if self.iter == self.start_powerSGD_iter:
                log.info("gradcomp: PowerSGD starts compression at iteration %d", self.iter)
            if self.iter >= self.next_stats_report and self.iter > self.start_powerSGD_iter:
                rate, before, after = self.compression_stats()
                log.info("Compression stats: iter %d, total before compression %d, total after compression %d, "
                         "rate %.2f", self.iter, before, after, rate)
                self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    def compression_stats(self) -> Tuple[float, int, int]:
        """PyTorch's: ``(compress_rate, numel_before_compression, numel_after_compression)``
        summed over all buckets of the compressed steps (elements, dense warm-up steps not
        counted, as PyTorch's; the rate is before / after, 0.0 before the first)."""
        before, after = self._engine.numel_before, self._engine.numel_after
        return (before / after if after else 0.0), before, after

    def stats(self) -> dict:
        """Byte and time accounting shaped as :meth:`gradcomp.torch.CompressionState.stats`
        (``scheme`` "powersgd" or "dense"; bytes from :func:`gradcomp.planner.powersgd_bytes`)."""
        return self._engine.stats()

    def residual(self, param) -> torch.Tensor:
        """Float32 copy of ``param``'s residual (a Parameter or its key), 1-D, numel elements;
        zeros for a Parameter without one, an empty tensor for a key without one."""
        name = param if isinstance(param, str) else self._name(param)
        r = self._engine.store.residual(name)
        if r is None:
            numel = param.numel() if isinstance(param, torch.Tensor) else 0
            return torch.zeros(numel, dtype=torch.float32)
        return r

    def bucket_layouts(self) -> List[dict]:
        """Per bucket index: ``{"index", "numel", "dtype", "compressed": [(name, offset, numel)],
        "dense": [(name, offset, numel)], "groups": [(n, m, r, count)]}`` (and ``scheme``,
        ``params``: :meth:`PowerSGDCompressor.layouts`)."""
        return sorted((d for d in self._engine.layouts() if "index" in d), key=lambda d: d["index"])

    def attach_grad_scaler(self, scaler) -> None:
        """Keep the residuals in the units of ``scaler``'s loss scale, as
        :meth:`gradcomp.torch.Compressor.attach_grad_scaler` (None detaches).

        Raises:
            TypeError: not a ``torch.amp.GradScaler`` nor None.
        """
        self._engine.scale.attach(scaler)

    # -- checkpoints ---------------------------------------------------------------------------
    def _options(self) -> dict:
        return self._engine.options()

    def state_dict(self) -> dict:
        """Per-rank state: ``{"version", "kind": "powersgd", "world_size", "rank", "iter",
        "options", "residuals": {name: float32 1-D}, "q": {name: float32 1-D (m * r)}, "rng",
        "numel_before", "numel_after", "next_stats_report"}``. Residuals differ per rank: save one
        file per rank."""
        return dict(self._engine.state_dict(), next_stats_report=self.next_stats_report)

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Load a :meth:`state_dict` of the same rank, bit-exact (residuals, Qs, ``iter``, the
        RandomState of ``q_init="torch"``).

        Args:
            strict: True: another rank, or other options (rank, error feedback, ...), raise
                ValueError naming saved and current values; False: a warning, and it is loaded.
                Another world size drops the residuals and Qs (a warning) either way.

        Raises:
            ValueError: not a PowerSGD state_dict, or (strict) a mismatch as above. Nothing is
                loaded when it raises.
        """
        self._engine.load_state_dict(sd, strict, "PowerSGDState")
        self.next_stats_report = int(sd.get("next_stats_report", 0))

    def __getstate__(self) -> dict:
        log.warning("gradcomp: PowerSGDState pickled without its process group and DDP model; after loading, "
                    "bind it to a new DDP model: state.bind(new_ddp) and register_comm_hook(state, powersgd_hook)")
        return {"version": PICKLE_VERSION, "start_powerSGD_iter": self.start_powerSGD_iter,
                "compression_stats_logging_frequency": self.compression_stats_logging_frequency,
                "batch": self._engine.batch_same_shape, "nonfinite": self.nonfinite,
                "log_every": self._engine._stats.log_every, "log_file": self._engine._stats.log_file,
                "sd": self.state_dict()}

    def __setstate__(self, d: dict) -> None:
        if not isinstance(d, dict) or d.get("version") != PICKLE_VERSION:
            raise ValueError(f"gradcomp: cannot unpickle a PowerSGDState of format "
                             f"{d.get('version') if isinstance(d, dict) else type(d).__name__!r}")
        o = d["sd"]["options"]
        self.__init__(None, o["matrix_approximation_rank"], d["start_powerSGD_iter"], o["min_compression_rate"],
                      o["use_error_feedback"], o["warm_start"], o["orthogonalization_epsilon"], o["random_seed"],
                      d["compression_stats_logging_frequency"], d["batch"], nonfinite=d["nonfinite"],
                      q_init=o["q_init"], min_compress_numel=o["min_compress_numel"], log_every=d["log_every"])
        self._engine._stats.log_file = d.get("log_file")  # as written (its folder is not checked again)
        self.load_state_dict(d["sd"], strict=False)

    # -- the hook ------------------------------------------------------------------------------
    def _entries(self, bucket):
        base = bucket.buffer().storage_offset()
        return [(self._name(p), g.storage_offset() - base, tuple(g.shape))
                for p, g in zip(bucket.parameters(), bucket.gradients())]

    def _hook(self, bucket) -> torch.futures.Future:
        buf = bucket.buffer()
        dense = self.iter < self.start_powerSGD_iter
        if not dense and any(p.is_complex() for p in bucket.parameters()):
            self._engine._warn_once("complex", "gradcomp: PowerSGD: a bucket holding complex parameters is "
                                    "averaged as allreduce_hook does (DDP hands their float32 view)")
            dense = True
        fut = self._engine.reduce(buf, ("index", bucket.index()), lambda: self._entries(bucket),
                                  joined=self._joined, dense=dense)
        self.maybe_increase_iter(bucket)
        return fut


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: PowerSGD with ``state`` (module docstring). Register with
    ``ddp_model.register_comm_hook(state, powersgd_hook)``. Returns a Future holding
    ``bucket.buffer()`` with the average over the group, bitwise identical on every rank."""
    return state._hook(bucket)


class PowerSGDCompressor(BaseCompressor):
    """PowerSGD for a training loop of your own, a peer of :class:`gradcomp.torch.Compressor`
    (:class:`gradcomp.torch.protocol.BaseCompressor`): ``comp.allreduce(tensor, name)`` averages
    one tensor (viewed as [shape[0], rest]) in place with its own residual and Q, keyed by
    ``name``; ``allreduce_bucket`` a flat bucket of several; ``gradcomp.torch.Compressor(
    "powersgd:rank=4")`` returns one.

    Args:
        spec: ``"powersgd:rank=R"`` with optional keys ``min_rate`` (min_compression_rate,
            default 2), ``warm_start`` (0/1, default 1), ``epsilon`` (default 0), ``seed``
            (default 0).
        scheme: ``"auto"`` or ``"powersgd"`` (it has its own protocol: one float32 SUM allreduce
            of [dense tensors | P], one of Q, :func:`gradcomp.planner.powersgd_bytes`).
        error_feedback, group, nonfinite, log_every, log_file: as :class:`gradcomp.torch.Compressor`.
        on_corrupt: ``"raise"`` or ``"log"``, as :class:`gradcomp.torch.Compressor` (PowerSGD
            sends float32 sums, not packets: no decode can find one corrupt, so it only
            matters for the stats it shares).
        min_compress_numel: tensors with fewer elements are averaged dense (default 0).

    Raises:
        ValueError: a bad spec key or value (the message lists the accepted keys), another
            scheme, an unknown nonfinite or on_corrupt mode.
    """

    def __init__(self, spec: str = "powersgd", scheme: str = "auto", error_feedback: bool = True, group=None, *,
                 min_compress_numel: int = 0, nonfinite: str = "restore", on_corrupt: str = "raise",
                 log_every: int = 0, log_file: Any = None):
        if scheme not in ("auto", "powersgd"):
            raise ValueError(f"PowerSGD: scheme={scheme!r}; accepted: 'auto' or 'powersgd' (it has its own protocol)")
        o = _parse_spec(spec)
        self._engine = _LowRank(group, o.get("rank", 1), o.get("min_rate", 2.0), error_feedback,
                                o.get("warm_start", True), o.get("epsilon", 0.0), o.get("seed", 0), nonfinite,
                                "philox", False, min_compress_numel, log_every, on_corrupt, log_file)
        self.spec = self._engine.spec()
        self.error_feedback = self._engine.error_feedback
        self.scheme = scheme
        self._step_names: set = set()
        self._schemes: Dict[Any, str] = {}  # layout key -> the scheme its last call used

    world_size = property(lambda self: self._engine.world_size)
    rank = property(lambda self: self._engine.rank)
    group = property(lambda self: self._engine.group)
    iter = property(lambda self: self._engine.iter)
    nonfinite = property(lambda self: self._engine.store.nonfinite)

    @property
    def on_corrupt(self) -> str:
        """``"raise"`` or ``"log"`` (settable; validated)."""
        return self._engine._stats.on_corrupt

    @on_corrupt.setter
    def on_corrupt(self, mode: str) -> None:
        self._engine._stats.on_corrupt = mode  # validated there

    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.futures.Future:
        """Average ``tensor`` (C-contiguous float32/float16/bfloat16; 2-D or more is compressed
        when it pays) over the group in place; the Future holds it, bitwise identical on every
        rank. A name seen again starts a new step.

        Raises:
            TypeError: not a tensor, or ``name`` not a str. ValueError: a non-contiguous tensor.
        """
        check_allreduce_args(tensor, name)
        if name in self._step_names:
            self.end_step()
        self._step_names.add(name)
        key = ("name", name)
        self._schemes[key] = "powersgd"
        return self._engine.reduce(tensor, key, [(name, 0, tuple(tensor.shape))])

    def allreduce_bucket(self, tensor: torch.Tensor, index: int, params, *, joined: bool = False,
                         dense: bool = False, dense_reason: str = "") -> torch.futures.Future:
        """Average a flat bucket holding several named tensors (what a DDP hook calls).

        Args:
            tensor: the flat bucket (1-D; float32/float16/bfloat16 compress, others go dense).
            index: the bucket's id (int); other ``params`` at the same index are a new layout
                (residuals and Qs follow their names).
            params: ``[(name, offset, shape)]`` (offset in elements of ``tensor``; shape a tuple:
                matrices of 2 or more dimensions are compressed) or a callable returning it; an
                int in place of the shape is a 1-D length (sent dense, as every 1-D tensor).
            joined: this rank has no data (DDP ``join()``): send exact zeros, keep the residuals.
            dense: send this call dense (e.g. a warm-up); its residuals are flushed into it.
            dense_reason: when not empty, why the bucket cannot be compressed: it goes dense,
                with one warning per distinct reason.

        Returns:
            A Future holding ``tensor`` with the average. Raises as :meth:`allreduce`.
        """
        key = ("index", int(index))
        if dense_reason:
            self._engine._warn_once(("reason", dense_reason),
                                    f"gradcomp: PowerSGD: bucket {int(index)} takes the dense path: {dense_reason}")
            dense = True
        self._schemes[key] = "dense" if dense else "powersgd"

        def entries():
            ent = params() if callable(params) else params
            return [(n, int(o), (int(s),) if isinstance(s, (int, np.integer)) else tuple(s)) for n, o, s in ent]

        return self._engine.reduce(tensor, key, entries, joined=joined, dense=dense)

    def end_step(self) -> None:
        """End the current step (a new Philox stream for the Qs drawn next)."""
        self._engine.end_step()
        self._step_names.clear()

    def scheme_of(self, name: str) -> str:
        """``"powersgd"`` or ``"dense"``: what ``allreduce(..., name)`` used last.

        Raises:
            KeyError: ``name`` has not been reduced yet.
        """
        try:
            return self._schemes[("name", name)]
        except KeyError:
            raise KeyError(f"scheme_of: no tensor named {name!r} has been reduced") from None

    def layouts(self) -> List[dict]:
        """The current layouts (:meth:`_LowRank.layouts`: ``index`` or ``name``, ``numel``,
        ``dtype``, ``scheme`` "powersgd", ``params``, ``compressed``, ``dense``, ``groups``)."""
        return self._engine.layouts()

    def attach_grad_scaler(self, scaler) -> None:
        """Keep the residuals in the units of ``scaler``'s loss scale, as
        :meth:`gradcomp.torch.Compressor.attach_grad_scaler` (None detaches).

        Raises:
            TypeError: not a ``torch.amp.GradScaler`` nor None.
        """
        self._engine.scale.attach(scaler)

    @property
    def grad_scaler(self):
        """The attached GradScaler, or None."""
        return self._engine.scale.scaler

    def state_dict(self) -> dict:
        """Per-rank state, as :meth:`PowerSGDState.state_dict`: residuals and Qs by name, ``iter``,
        ``grad_scale``, the options (residuals differ per rank: save one file per rank)."""
        return self._engine.state_dict()

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Load a :meth:`state_dict` of the same rank, bit-exact (as
        :meth:`PowerSGDState.load_state_dict`, whose checkpoints it also reads).

        Raises:
            ValueError: not a PowerSGD state_dict, or (strict) another rank or other options.
        """
        self._engine.load_state_dict(sd, strict, "PowerSGDCompressor")
        self._step_names.clear()

    def residual(self, name: str) -> torch.Tensor:
        """Float32 copy of ``name``'s residual (empty when it has none)."""
        r = self._engine.store.residual(name)
        return r if r is not None else torch.zeros(0)

    def stats(self) -> dict:
        """As :meth:`PowerSGDState.stats`."""
        return self._engine.stats()


def register_powersgd(ddp_model, spec: str, *, error_feedback: bool = True, start_iter: int = 0,
                      scheme: str = "auto", min_compress_numel: int = 0, nonfinite: str = "restore",
                      process_group=None, log_every: int = 0, log_file: Any = None) -> PowerSGDState:
    """What ``gradcomp.torch.register(ddp, codec="powersgd:rank=R", ...)`` does: a
    :class:`PowerSGDState` from the spec (:class:`PowerSGDCompressor` lists its keys) and
    CompressionState's argument names (error_feedback, start_iter, ...), registered with
    :func:`powersgd_hook`. Returns the state.

    Raises:
        ValueError: a bad spec, or a scheme other than "auto"/"powersgd".
    """
    if scheme not in ("auto", "powersgd"):
        raise ValueError(f"PowerSGD: scheme={scheme!r}; accepted: 'auto' or 'powersgd' (it has its own protocol)")
    o = _parse_spec(spec)
    state = PowerSGDState(process_group, o.get("rank", 1), start_iter, o.get("min_rate", 2.0), error_feedback,
                          o.get("warm_start", True), o.get("epsilon", 0.0), o.get("seed", 0), ddp_model=ddp_model,
                          nonfinite=nonfinite, min_compress_numel=min_compress_numel, log_every=log_every,
                          log_file=log_file)
    ddp_model.register_comm_hook(state, powersgd_hook)
    return state


protocol.add(protocol.Protocol("powersgd", ("powersgd",), PowerSGDCompressor, PowerSGDState, powersgd_hook,
                               register_powersgd, "low rank: two float32 allreduces of P and Q per bucket "
                               "(Vogels et al., NeurIPS 2019)"))
