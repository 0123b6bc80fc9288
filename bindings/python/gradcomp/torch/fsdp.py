"""FSDP2 (``torch.distributed.fsdp.fully_shard``): compressed gradient reduce-scatter, a compressed
all-reduce between replicas (custom HSDP), and error feedback in distributed checkpoints.

Usage::

    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = gradcomp.torch.fsdp.register(model, "fp8")          # every FSDPModule of the model
    ... loss.backward(); optim.step() ...
    state.stats()                                                # bytes per level
    dcp.save({"model": model, "optim": optim, "gradcomp": state}, checkpoint_id=path)

    # custom HSDP: fully_shard on a 1-D mesh inside the node, compressed all-reduce across nodes
    state = gradcomp.torch.fsdp.register(model, "int8", reduce_scatter=False, replicate_group=pg)

Pieces (each usable alone):

- :class:`CompressedReduceScatter`: a ``ReduceScatter`` comm object for
  ``FSDPModule.set_custom_reduce_scatter`` (torch >= 2.9): every rank encodes the W rows of
  FSDP's shard-major input with its worker residual, one all-to-all of fixed-size packets, every
  rank decodes the W packets of its own shard in rank order into a float32 sum
  (:mod:`gradcomp.schemes.reduce_scatter`); parameters exempt from compression (by default those
  with fewer than 2 dimensions or fewer than ``min_compress_numel`` elements: norms and biases)
  travel raw in the same all-to-all. Install it with :meth:`CompressedReduceScatter.install`.
- :class:`ReplicaAllReduce` (:func:`replica_all_reduce_hook`): a hook for
  ``FSDPModule.set_all_reduce_hook`` (torch >= 2.7) that all-reduces each rank's reduce-scattered
  shard across the replicas of ``replicate_group`` through gradcomp's schemes
  (:class:`gradcomp.torch.Compressor`: ``auto`` picks ``two_phase`` for the quantizers, ``gather``
  for top-k, ``sum`` for linear codecs), with its own residuals; exempt parameters go dense.
  This is "custom HSDP" (pytorch#147114): FSDP2 on a 1-D mesh inside a node, the hook across
  nodes, where a multi-node job's slow link is. Native HSDP (a 2-D mesh) all-reduces itself and
  is refused.
- :func:`register`: both on every ``FSDPModule`` of a model; returns an :class:`FSDPCompressionState`
  with ``stats()``, ``state_dict()`` / ``load_state_dict()`` and the
  ``torch.distributed.checkpoint`` Stateful protocol.

How the layout is known: FSDP2 hands a comm object only tensors. ``install`` wraps the parameter
group's ``_prepare_reduce_scatter_inputs`` (the function FSDP2's ``foreach_reduce`` calls with the
parameters whose gradients it is about to reduce, right before the comm) to record them, so each
call knows which parameters, in which order, with which padded shard sizes
(:func:`gradcomp.planner.fsdp_shard_rows`). Private torch interfaces are used only here, behind a
version check: ``torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter`` and the parameter
group's ``fsdp_params`` fields (``_param_fqn``, ``_orig_size``, ``fsdp_placement``,
``padded_sharded_param_size``).

Semantics (the README's "FSDP2" section):

- Ops: ``SUM``, ``AVG`` (sum, then / W), ``PREMUL_SUM(f)`` (every contribution times f, then the
  sum): what FSDP2 passes for float32 / bfloat16 (AVG), with ``set_gradient_divide_factor``
  (PREMUL_SUM) and for float16 or ``set_force_sum_reduction_for_comms`` (SUM with FSDP's own pre-
  and post-divide). World size 1: FSDP2 bypasses the comm.
- Determinism: every rank decodes the same bytes in the same order (rank order, float32, rounded
  once into the reduce dtype): bitwise identical run to run. With codec ``none`` the result equals
  FSDP2's own reduce-scatter bitwise where the summation order is the same (module docstring of
  :mod:`gradcomp.schemes.reduce_scatter`: W = 2 always, float32 and bfloat16).
- Error feedback: residuals are float32, one per compressed parameter and rank, in the order of
  the parameter's W shard pieces (for Shard(0), the parameter's own flat order): r = x' - D for
  what this rank sent of each shard. Gradient accumulation with
  ``set_requires_gradient_sync(False)`` needs nothing: FSDP2 does not reduce those micro-batches,
  so nothing is compressed and no residual changes.
- Non-finite steps: every slot carries the sender's non-finite flag, so every rank knows, with no
  extra collective, whether any rank saw a NaN or inf in that call; residuals are then restored to
  their value before it (``nonfinite="restore"``) or zeroed (``"reset"``), on the device.
- Steps: a step ends when a unit (an FSDPModule) is reduced a second time; ``stats()["steps"]``
  and the encode key's step (``(seed, step, crc32(unit name), row)``) count them.

Sources: FSDP2 (Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
VLDB 2023; torch's ``_fully_shard``); compressed reduce-scatter: DeepSpeed 1-bit Adam (Tang et
al., ICML 2021, section 3.3) and ZeRO++ qgZ (Wang et al., 2023, section 3.3); error feedback:
Karimireddy et al., ICML 2019; exempting 1-D parameters: Baidu LoongForge's FP8 DDP hook (mean
relative error 10.87% -> 2.13%).
"""

import io
import logging
import re
import threading
import time
import warnings
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import planner
from ..codec import Codec
from ..codec import _dtype_name as dtype_name
from ..errors import RankMismatchError, in_context
from ..schemes.reduce_scatter import ReduceScatterContext, RowLayout, reduce_scatter
from .compressor import Compressor, check_options, try_allocate
from .policy import ExemptArg, ExemptRule  # noqa: F401 (ExemptArg: re-exported, its old home)
from .protocol import LossScale
from .residuals import NONFINITE_MODES
from .stats import CORRUPT_MODES, Stats

log = logging.getLogger("gradcomp")

MIN_TORCH = (2, 9)
"""The oldest torch with ``FSDPModule.set_custom_reduce_scatter`` (and the comm API)."""

STATE_VERSION = 1
"""Format of :meth:`FSDPCompressionState.state_dict`."""

RANK_KEY = "gradcomp_rank{}"
"""The per-rank key of :meth:`FSDPCompressionState.state_dict` (residuals differ per rank)."""


def torch_version(text: Optional[str] = None) -> Tuple[int, int]:
    """``(major, minor)`` of ``text`` (default ``torch.__version__``), e.g. ``"2.15.0+cu130"`` ->
    ``(2, 15)``; ``(0, 0)`` when it cannot be read."""
    m = re.match(r"(\d+)\.(\d+)", str(torch.__version__ if text is None else text))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_torch(text: Optional[str] = None) -> None:
    """Raise unless torch (``text``: a version string, default this torch's) has the FSDP2 comm
    API gradcomp needs.

    Raises:
        RuntimeError: torch older than 2.9, naming the version found and what is supported.
    """
    v = torch_version(text)
    if v < MIN_TORCH:
        raise RuntimeError(f"gradcomp.torch.fsdp needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} "
                           f"(FSDPModule.set_custom_reduce_scatter and set_all_reduce_hook); this is torch "
                           f"{text or torch.__version__}. Supported: torch 2.9 to 2.15; on an older torch use "
                           f"DDP (gradcomp.torch.register) or gradcomp.torch.Compressor in a loop of your own")


def _api():
    """``(ReduceScatter, FSDPModule)``, the private comm base class and the public module class."""
    check_torch()
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    return ReduceScatter, FSDPModule


try:  # the base class of the comm object: private, present from torch 2.9 (checked again at use)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - torch < 2.9: constructing raises with the version
    _ReduceScatterBase = object


# ---------------------------------------------------------------------------------------------
# units: one fully_shard module each, and the layout of its current call

_current = threading.local()
"""The unit FSDP2 is reducing in this thread (set by the wrapped ``_prepare_reduce_scatter_inputs``
right before the comm and the all-reduce hook run)."""


class _Unit:
    """One FSDPModule's single parameter group, as gradcomp sees it.

    Attributes:
        name: the module's name in the registered model ("" for the root), for keys and messages.
        group: FSDP's parameter group (private ``FSDPParamGroup``).
        params: the ``fsdp_params`` of the current call, in FSDP's order; ``sizes``: their padded
            sizes; ``world_size``: the reduce-scatter group's size.
    """

    def __init__(self, name: str, group):
        self.name = name
        self.group = group
        self.params: list = []
        self.sizes: list = []
        self.world_size = 1

    @property
    def label(self) -> str:
        return f"unit {self.name or '<root>'}"

    @property
    def bucket(self) -> int:
        """crc32 of the unit's name: the bucket part of its encode keys (the same on every rank)."""
        return zlib.crc32(("fsdp:" + self.name).encode("utf-8"))

    def shard_rank(self) -> int:
        """This rank in the unit's reduce-scatter (shard) group."""
        mi = getattr(self.group, "mesh_info", None)
        r = getattr(mi, "shard_mesh_rank", None)
        return int(r) if r is not None else 0


def _param_groups(module) -> list:
    return list(module._get_fsdp_state()._fsdp_param_groups)


def _unit_of(module, name: str) -> Optional[_Unit]:
    """The :class:`_Unit` of ``module`` (created and its ``_prepare_reduce_scatter_inputs``
    wrapped once), or None for a module without parameters.

    Raises:
        ValueError: a module with more than one FSDP parameter group.
    """
    groups = _param_groups(module)
    if not groups:
        return None
    if len(groups) > 1:
        raise ValueError(f"gradcomp.torch.fsdp: module {name or '<root>'} ({type(module).__name__}) has "
                         f"{len(groups)} FSDP parameter groups (per-parameter meshes); supported: one parameter "
                         f"group per FSDPModule (what fully_shard(module, mesh=...) makes), as FSDP2's own "
                         f"set_custom_reduce_scatter / set_all_reduce_hook require")
    pg = groups[0]
    unit = getattr(pg, "_gradcomp_unit", None)
    if unit is not None:
        unit.name = name
        return unit
    unit = _Unit(name, pg)
    inner = pg._prepare_reduce_scatter_inputs

    def prepare(fsdp_params, unsharded_grads, world_size):
        sizes = inner(fsdp_params, unsharded_grads, world_size)
        unit.params, unit.sizes, unit.world_size = list(fsdp_params), list(sizes), int(world_size)
        _current.unit = unit
        return sizes

    pg._prepare_reduce_scatter_inputs = prepare
    pg._gradcomp_unit = unit
    return unit


class _Exempt:
    """Which parameters travel uncompressed: the shared rule of :class:`gradcomp.torch.policy.
    ExemptRule` -- ``exempt`` None (default): fewer than 2 dimensions; a callable ``exempt(fqn,
    param) -> bool``; or names / ``fnmatch`` patterns of FQNs -- and in every case also any
    parameter with fewer than ``min_compress_numel`` elements."""

    def __init__(self, exempt: ExemptArg, min_compress_numel: int):
        self.rule = ExemptRule(exempt, what="fqn")
        self.min_numel = int(min_compress_numel)
        self._cache: Dict[str, bool] = {}

    def __call__(self, fqn: str, fp) -> bool:
        hit = self._cache.get(fqn)
        if hit is not None:
            return hit
        size = tuple(fp._orig_size)
        numel = 1
        for s in size:
            numel *= int(s)
        hit = True if numel < self.min_numel else self.rule.decide(fqn, len(size), fp.sharded_param)
        self._cache[fqn] = hit
        return hit


class _Piece:
    """One parameter's part of one row: ``fqn``, row ``j``, ``at`` (offset in the parameter's
    residual: its pieces in row order), ``n`` elements, ``off`` (offset in the row), ``staged``
    (offset of its residual in the layout's flat residual, -1 for exempt pieces)."""

    __slots__ = ("fqn", "j", "at", "n", "off", "staged")

    def __init__(self, fqn, j, at, n, off, staged):
        self.fqn, self.j, self.at, self.n, self.off, self.staged = fqn, j, at, n, off, staged


def _fqn(fp) -> str:
    name = getattr(fp, "_param_fqn", None)
    if not name:
        raise RuntimeError("gradcomp.torch.fsdp: an FSDP parameter has no FQN yet (FSDP2 names parameters at its "
                           "lazy initialization, the first forward); reduce-scatters run after it")
    return str(name)


def _pieces(unit: _Unit, exempt: _Exempt) -> Tuple[List[RowLayout], List[_Piece], Dict[str, int]]:
    """The W row layouts of the unit's current call, its pieces, and ``{fqn: residual numel}``
    of the compressed parameters.

    Raises:
        ValueError: a padded size that does not match FSDP2's Shard(0) rule (a sharding gradcomp
            does not know), or an uneven Shard(d > 0).
    """
    W = unit.world_size
    rows_c: List[list] = [[] for _ in range(W)]
    rows_e: List[list] = [[] for _ in range(W)]
    pieces: List[_Piece] = []
    numels: Dict[str, int] = {}
    staged = [0] * W
    off = 0
    for fp, padded_size in zip(unit.params, unit.sizes):
        fqn = _fqn(fp)
        size = tuple(int(s) for s in fp._orig_size)
        numel = 1
        for s in size:
            numel *= s
        padded = 1
        for s in padded_size:
            padded *= int(s)
        if padded % W:
            raise ValueError(f"gradcomp.torch.fsdp: {fqn}: padded size {tuple(padded_size)} is not a multiple of the "
                             f"world size {W}")
        per_row = padded // W
        dim = int(getattr(getattr(fp, "fsdp_placement", None), "dim", 0))
        ex = exempt(fqn, fp)
        at = 0
        for j in range(W):
            if dim == 0:
                cnt, pad = planner.fsdp_shard_rows(numel, size[0] if size else 1, W, j)
            else:
                cnt, pad = numel // W, numel // W
            if pad != per_row:
                raise ValueError(f"gradcomp.torch.fsdp: {fqn} of shape {size} (Shard({dim})) has padded shards of "
                                 f"{per_row} elements over {W} ranks; gradcomp expects {pad}: supported are "
                                 f"FSDP2's Shard(0) (torch.chunk rows) and even Shard(d) placements")
            if cnt:
                if ex:
                    rows_e[j].append((off, cnt))
                    pieces.append(_Piece(fqn, j, at, cnt, off, -1))
                else:
                    rows_c[j].append((off, cnt))
                    pieces.append(_Piece(fqn, j, at, cnt, off, staged[j]))
                    staged[j] += cnt
            at += cnt
        if not ex:
            numels[fqn] = at
        off += per_row
    # row offsets of compressed pieces -> offsets in the flat residual (rows one after another)
    starts, acc = [], 0
    for j in range(W):
        starts.append(acc)
        acc += staged[j]
    for p in pieces:
        if p.staged >= 0:
            p.staged += starts[p.j]
    rows = [RowLayout(tuple(rows_c[j]), tuple(rows_e[j])) for j in range(W)]
    return rows, pieces, numels


# ---------------------------------------------------------------------------------------------
# the reduce-scatter's residuals

class _Layout:
    """One call layout of a unit: the scheme context, the flat residual (rows one after another)
    and its backup, the pieces, and which compressed parameters it holds."""

    def __init__(self, ctx: ReduceScatterContext, pieces: List[_Piece], numels: Dict[str, int], ef: bool):
        self.ctx, self.pieces, self.numels = ctx, pieces, numels
        dev = ctx.device
        self.residual = torch.zeros(ctx.residual_numel, dtype=torch.float32, device=dev) if ef else None
        self.backup = torch.empty_like(self.residual) if ef else None
        self.homed = False

    def extract(self, fqn: str) -> torch.Tensor:
        """A float32 copy of ``fqn``'s residual (its pieces in row order)."""
        parts = [self.residual[p.staged: p.staged + p.n] for p in self.pieces if p.fqn == fqn and p.staged >= 0]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=self.residual.device)

    def put(self, fqn: str, t: torch.Tensor) -> None:
        """Copy ``t`` (``fqn``'s residual, float32, in piece order) into its pieces."""
        for p in self.pieces:
            if p.fqn == fqn and p.staged >= 0:
                self.residual[p.staged: p.staged + p.n].copy_(t[p.at: p.at + p.n])

    def zero(self, fqn: str) -> None:
        for p in self.pieces:
            if p.fqn == fqn and p.staged >= 0:
                self.residual[p.staged: p.staged + p.n].zero_()


class _Residuals:
    """Where each compressed parameter's residual lives: in one layout (``home``) or pending
    (a float32 tensor of its own: loaded, or left by a layout that no longer runs)."""

    def __init__(self):
        self.home: Dict[str, _Layout] = {}
        self.pending: Dict[str, torch.Tensor] = {}
        self.numels: Dict[str, int] = {}

    def activate(self, lay: _Layout) -> None:
        if lay.homed:
            return
        for fqn, n in lay.numels.items():
            old = self.home.get(fqn)
            if old is lay:
                continue
            src = old.extract(fqn) if old is not None else self.pending.pop(fqn, None)
            if src is not None and src.numel() == n:
                lay.put(fqn, src.to(lay.residual.device))
            elif src is not None:
                warnings.warn(f"gradcomp: the residual of {fqn} has {src.numel()} elements, its parameter now "
                              f"needs {n}: dropped", stacklevel=4)
            if old is not None:
                old.zero(fqn)
                old.homed = False
            self.home[fqn] = lay
            self.numels[fqn] = n
        lay.homed = True

    def tensor(self, fqn: str) -> Optional[torch.Tensor]:
        lay = self.home.get(fqn)
        if lay is not None:
            return lay.extract(fqn)
        t = self.pending.get(fqn)
        return None if t is None else t.clone()

    def state(self) -> Dict[str, torch.Tensor]:
        out = {}
        for fqn in list(self.home) + [k for k in self.pending if k not in self.home]:
            out[fqn] = self.tensor(fqn)
        return out

    def load(self, res: Dict[str, torch.Tensor]) -> None:
        """Replace every residual by ``res`` (``{fqn: float32 1-D}``): into its home layout when
        the size matches, else pending until a layout takes it."""
        for lay in {id(v): v for v in self.home.values()}.values():
            lay.residual.zero_()
        self.pending = {}
        for fqn, t in res.items():
            t = t.detach().to(torch.float32).reshape(-1)
            lay = self.home.get(fqn)
            if lay is not None and lay.numels.get(fqn) == t.numel():
                lay.put(fqn, t.to(lay.residual.device))
            else:
                self.pending[fqn] = t.clone()
                if lay is not None:
                    del self.home[fqn]
                    lay.homed = False

    def scale_(self, factor: torch.Tensor) -> None:
        for lay in {id(v): v for v in self.home.values()}.values():
            lay.residual.mul_(factor.to(lay.residual.device))
        for t in self.pending.values():
            t.mul_(factor.to(t.device))


class _Steps:
    """The step counter of one state: a step ends when a (kind, unit) pair is seen again; the
    listeners run at each new step (the replica compressor's ``end_step``)."""

    def __init__(self):
        self.iter = 0
        self.begun = False
        self._seen: set = set()
        self.listeners: List[Callable[[], None]] = []

    def enter(self, kind: str, unit: _Unit) -> int:
        key = (kind, unit.name)
        if key in self._seen:
            self.iter += 1
            self._seen.clear()
            for fn in self.listeners:
                fn()
        self._seen.add(key)
        self.begun = True
        return self.iter

    def next_step(self) -> int:
        """The step the next reduction starts (this one's number + 1 once a call has run in it)."""
        return self.iter + 1 if self._seen else self.iter

    def restart(self, step: int) -> None:
        """The next reduction starts step ``step`` (a loaded checkpoint)."""
        self.iter = int(step)
        self._seen.clear()


def _take_unit(units: Dict[int, _Unit], what: str) -> _Unit:
    unit = getattr(_current, "unit", None)
    if unit is None or id(unit) not in units:
        raise RuntimeError(f"gradcomp.torch.fsdp: {what} was called for an FSDP module it was not installed on; "
                           f"install it with .install(module) (or gradcomp.torch.fsdp.register(model, codec)) "
                           f"instead of calling set_custom_reduce_scatter / set_all_reduce_hook directly")
    return unit


def _check_install(module, what: str) -> None:
    _, FSDPModule = _api()
    if not isinstance(module, FSDPModule):
        raise TypeError(f"gradcomp.torch.fsdp: {what}: expected a module sharded by fully_shard (an FSDPModule), "
                        f"got {type(module).__name__}")


# ---------------------------------------------------------------------------------------------
# the comm object

def _allocated_everywhere(label: str, group, W: int, device: torch.device, make: Callable[[], Any],
                          residual_numel: int):
    """``make()`` (a new unit's reduce-scatter context) on every rank, and ``residual_numel``
    float32 elements (its residuals and their backups) allocated and dropped, before any collective
    of the unit: one all-gather of an int32 per rank says where that ran out of memory, and every
    rank raises :class:`gradcomp.RankMismatchError` naming those ranks (so none waits in a
    reduce-scatter another rank never starts). Other errors propagate."""
    def make_all():
        ctx = make()
        if residual_numel:
            torch.empty(residual_numel, dtype=torch.float32, device=device)
        return ctx

    ctx, err = try_allocate(make_all)
    flags = torch.empty(W, dtype=torch.int32, device=device)
    dist.all_gather_into_tensor(flags, torch.tensor([int(err is not None)], dtype=torch.int32, device=device),
                                group=group)
    short = [r for r, f in enumerate(flags.tolist()) if f]
    if short:
        mine = f" (here: {err})" if err is not None else ""
        raise RankMismatchError(f"gradcomp FSDP2 reduce-scatter of {label}: rank(s) {', '.join(map(str, short))} "
                                f"could not allocate the unit's buffers (the packets, the received packets, the "
                                f"accumulators and the error-feedback residuals){mine}. Nothing was sent: no rank "
                                f"waits for it. Free memory, or use a codec with smaller packets.")
    return ctx


class CompressedReduceScatter(_ReduceScatterBase):
    """FSDP2's gradient reduce-scatter through a gradcomp codec, with error feedback.

    Args:
        codec: a codec spec (``"fp8"``, ``"int8"``, ``"topk:ratio=0.01"``, ``"onebit"``,
            ``"none"``, ...: ``gradcomp.codecs()``) or a :class:`gradcomp.Codec`. Required.
        error_feedback: keep a float32 residual per compressed element and rank (default True).
        min_compress_numel: parameters with fewer elements travel raw (default 1024).
        exempt: None (default: parameters with fewer than 2 dimensions), a callable
            ``exempt(fqn, param) -> bool`` (``param`` the sharded DTensor parameter), or a
            collection of FQNs / ``fnmatch`` patterns; exempt parameters travel raw in the same
            all-to-all (always also those below ``min_compress_numel``).
        nonfinite: ``"restore"`` (default) or ``"reset"``: residuals after a call in which some
            rank saw a NaN or inf.
        seed: an int in [0, 2^64), the same on every rank: the key of codecs that draw random
            numbers, with the step, crc32 of the unit's name and the row.
        on_corrupt: ``"raise"`` or ``"log"``: a corrupt packet met by a CUDA decode (read one
            step late); CPU decodes raise at once.

    Install it on FSDP modules with :meth:`install` (it records each call's parameters: see the
    module docstring); one object may serve every module of a model. FSDP2 calls it as
    ``comm(output_tensor=, input_tensor=, group=, op=)`` on its reduce-scatter stream; it returns
    None with everything ordered on the current stream.

    Raises:
        RuntimeError: torch older than 2.9.
        ValueError: a bad nonfinite / on_corrupt / min_compress_numel / seed.
        TypeError: error_feedback not a bool; exempt of another type.
        gradcomp.InvalidArgumentError: a bad codec spec.
    """

    def __init__(self, codec: Any, error_feedback: bool = True, *, min_compress_numel: int = 1024,
                 exempt: ExemptArg = None, nonfinite: str = "restore", seed: int = 0, on_corrupt: str = "raise",
                 _steps: Optional[_Steps] = None):
        check_torch()
        check_options(scheme="auto", nonfinite=nonfinite, ints=(("min_compress_numel", min_compress_numel),),
                      error_feedback=error_feedback, group=None, on_corrupt=on_corrupt)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
            raise ValueError(f"seed={seed!r}; accepted: an int in [0, 2^64), the same on every rank")
        self.codec = codec if isinstance(codec, Codec) else Codec(str(codec))
        self.error_feedback = error_feedback
        self.min_compress_numel = int(min_compress_numel)
        self.nonfinite = nonfinite
        self.seed = int(seed)
        self.exempt = _Exempt(exempt, self.min_compress_numel)
        self.steps = _steps or _Steps()
        self.store = _Residuals()
        self._units: Dict[int, _Unit] = {}
        self._layouts: Dict[tuple, _Layout] = {}
        self._scale = LossScale()
        self._stats: Optional[Stats] = None
        self._on_corrupt = on_corrupt
        self.world_size = 0

    # -- installing ----------------------------------------------------------------------------
    def install(self, module, name: Optional[str] = None) -> "CompressedReduceScatter":
        """``module.set_custom_reduce_scatter(self)`` after recording-wrapping its parameter group.

        Args:
            module: an FSDPModule (``fully_shard``-ed); a module without parameters is skipped.
            name: the module's name in the model (keys, messages); default its FSDP name.

        Raises:
            TypeError: not an FSDPModule. RuntimeError: torch < 2.9.
            ValueError: several parameter groups; a reduce-scatter comm other than FSDP2's default
                already set (``set_allocate_memory_from_process_group_for_comm(True)``,
                ``set_symm_mem_for_comm``, or another custom comm).
        """
        _check_install(module, "CompressedReduceScatter.install")
        groups = _param_groups(module)
        if not groups:
            return self
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
        cur = groups[0]._reduce_scatter_comm if len(groups) == 1 else None
        if cur is not None and cur is not self and type(cur) is not DefaultReduceScatter:
            raise ValueError(f"gradcomp.torch.fsdp: module {name or getattr(groups[0], '_module_fqn', '') or '<root>'} "
                             f"already has reduce-scatter comm {type(cur).__name__}: supported is FSDP2's default "
                             f"(do not combine set_allocate_memory_from_process_group_for_comm(True), "
                             f"set_symm_mem_for_comm or another custom reduce-scatter with gradcomp)")
        unit = _unit_of(module, name if name is not None else getattr(groups[0], "_module_fqn", "") or "")
        self._units[id(unit)] = unit
        module.set_custom_reduce_scatter(self)
        return self

    # -- the Comm interface --------------------------------------------------------------------
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized tensor of ``size`` (FSDP2 allocates its input and output with it)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        """Reduce-scatter ``input_tensor`` (N elements, W shard rows) into ``output_tensor`` (N / W
        elements) over ``group`` with ``op`` (SUM, AVG, PREMUL_SUM); see the module docstring.

        Returns None (the work is done and ordered on the current stream).

        Raises:
            ValueError: ``async_op=True`` (FSDP2 never asks for it), an unsupported op, a dtype
                other than float32 / bfloat16 / float16.
            RuntimeError: called for a module it was not installed on.
            gradcomp.CollectiveError, gradcomp.RankMismatchError, gradcomp.CorruptPacketError:
                the step failed (the residuals are as before the call); the message names the
                unit, the step and the codec.
        """
        if async_op:
            raise ValueError("CompressedReduceScatter: async_op=True; accepted: async_op=False (FSDP2 calls the "
                             "comm synchronously on its reduce-scatter stream)")
        unit = _take_unit(self._units, "CompressedReduceScatter")
        if input_tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"CompressedReduceScatter: reduce dtype {input_tensor.dtype}; accepted: float32, "
                             f"bfloat16, float16 (MixedPrecisionPolicy.reduce_dtype)")
        W = dist.get_world_size(group)
        if W != unit.world_size:
            raise RuntimeError(f"gradcomp.torch.fsdp: {unit.label}: the reduce-scatter group has {W} ranks, the "
                               f"recorded layout {unit.world_size}")
        lay = self._layout(unit, input_tensor, group)
        step = self.steps.enter("rs", unit)
        stats = self._stats_for(W)
        rec = stats.record(step)
        b = {"unit": unit.name, "numel": input_tensor.numel(), "dtype": dtype_name(input_tensor.dtype),
             "scheme": "reduce_scatter",
             **planner.fsdp_reduce_scatter_bytes(self.codec, [(r.c, r.e) for r in lay.ctx.rows],
                                                 dtype_name(input_tensor.dtype), input_tensor.numel())}
        stats.account(rec, b)
        probe = stats.probe(rec, b, input_tensor.device, f"FSDP2 reduce-scatter of {unit.label}")
        if self._scale.due(step):
            self._scale.follow(self.store, step)
        res = lay.residual
        if res is not None:
            lay.backup.copy_(res)
        lay.ctx.key = (self.seed, step & 0xFFFFFFFF, unit.bucket)
        try:
            nf = reduce_scatter(output_tensor, input_tensor, lay.ctx, res, op, probe)
        except BaseException as e:
            if res is not None:
                res.copy_(lay.backup)
            stats.fail(rec)
            raise in_context(e, f"gradcomp: FSDP2 reduce-scatter of {unit.label}, step {step} (codec "
                                f"{self.codec.spec}); its residuals are as before the call") from e
        if res is not None:
            if self.nonfinite == "restore":
                torch.where(nf, lay.backup, res, out=res)
            else:
                res.masked_fill_(nf, 0.0)
        stats.mark_nonfinite(rec, nf)
        return None

    def _stats_for(self, W: int) -> Stats:
        if self._stats is None:
            self._stats = Stats(W, self.codec.spec, self.nonfinite, self._on_corrupt)
            self.world_size = W
        return self._stats

    def _layout(self, unit: _Unit, input_tensor: torch.Tensor, group) -> _Layout:
        W = unit.world_size
        sig = (unit.name, W, input_tensor.dtype, str(input_tensor.device),
               tuple((_fqn(fp), tuple(s)) for fp, s in zip(unit.params, unit.sizes)))
        lay = self._layouts.get(sig)
        if lay is None:
            rows, pieces, numels = _pieces(unit, self.exempt)
            S = sum(int(torch.Size(s).numel()) for s in unit.sizes) // W
            if S * W != input_tensor.numel():
                raise RuntimeError(f"gradcomp.torch.fsdp: {unit.label}: the reduce-scatter input has "
                                   f"{input_tensor.numel()} elements, the recorded parameters {S * W}")
            ctx = _allocated_everywhere(
                unit.label, group, W, input_tensor.device,
                lambda: ReduceScatterContext(self.codec, rows, input_tensor.dtype, input_tensor.device, group, W,
                                             dist.get_rank(group)),
                2 * sum(numels.values()) if self.error_feedback else 0)
            lay = self._layouts[sig] = _Layout(ctx, pieces, numels, self.error_feedback)
            nc = sum(numels.values())
            log.info("gradcomp: FSDP2 reduce-scatter of %s: %d parameters (%d elements compressed with %s, %d "
                     "exempt), W=%d, slot %d bytes", unit.label, len(unit.params), nc, self.codec.spec,
                     sum(r.e for r in rows), W, ctx.slot["slot"])
        if self.error_feedback:
            self.store.activate(lay)
        return lay

    # -- state ---------------------------------------------------------------------------------
    def residual(self, fqn: str) -> torch.Tensor:
        """A float32 copy of parameter ``fqn``'s residual on this rank: its W shard pieces in row
        order (the parameter's flat order for Shard(0)), ``numel`` elements.

        Raises:
            KeyError: ``fqn`` has no residual (exempt, not reduced yet, or no error feedback).
        """
        t = self.store.tensor(fqn)
        if t is None:
            raise KeyError(f"gradcomp.torch.fsdp: no residual for {fqn!r}; parameters with one: "
                           f"{sorted(self.store.numels) or 'none yet'}")
        return t

    def exempted(self) -> List[str]:
        """The FQNs met so far that travel uncompressed."""
        return sorted(k for k, v in self.exempt._cache.items() if v)

    def stats(self) -> dict:
        """Byte accounting of the reduce-scatters (:meth:`gradcomp.torch.Compressor.stats`'s
        fields; each call is one bucket dict with its ``unit``): ``sent_bytes`` = (W-1) slots,
        ``ring_bytes`` = (W-1)/W of the dense input (a ring reduce-scatter), ``packet_bytes`` = W
        slots, ``dense_bytes`` = the input (N elements of the reduce dtype)."""
        if self._stats is None:
            return {"steps": 0, "world_size": self.world_size, "codec": self.codec.spec, "nonfinite_steps": 0,
                    "failed_steps": 0, "step": {}, "total": {}, "buckets": []}
        return self._stats.summary()

    def state_dict(self) -> dict:
        """``{"codec", "error_feedback", "next_step", "grad_scale", "residuals": {fqn: float32 1-D}}``
        (this rank's; the reduce-scatter's residuals are per rank)."""
        if self._stats is not None:
            self._stats.settle()
        return {"codec": self.codec.spec, "error_feedback": self.error_feedback, "next_step": self.steps.next_step(),
                "grad_scale": self._scale.value(), "residuals": self.store.state()}

    def load_state_dict(self, sd: dict) -> None:
        """Load :meth:`state_dict` (bit-exact) and the step the next reduction starts. Residuals of
        parameters not reduced yet wait for their first call."""
        self.store.load(sd.get("residuals", {}))
        if "next_step" in sd:
            self.steps.restart(int(sd["next_step"]))
        gs = float(sd.get("grad_scale", 1.0))
        self._scale.unit = None if gs == 1.0 else torch.tensor(gs, dtype=torch.float32)
        self._scale.step = -1

    def attach_grad_scaler(self, scaler) -> None:
        """Keep the residuals in ``scaler``'s loss-scale units (as :meth:`gradcomp.torch.Compressor.
        attach_grad_scaler`; a ``torch.amp.GradScaler`` or None)."""
        self._scale.attach(scaler)


# ---------------------------------------------------------------------------------------------
# the replica all-reduce hook (custom HSDP)

_NATIVE_HSDP = ("gradcomp.torch.fsdp: the module is sharded with native HSDP (a 2-D mesh): FSDP2 all-reduces "
                "across replicas itself and a hook would run after it. Supported: fully_shard on a 1-D mesh of "
                "the ranks of a node with replicate_group= the ranks holding the same shard (custom HSDP); or "
                "native HSDP without a replicate_group (only its reduce-scatter compressed)")


def _process_group(g, what: str):
    if g is None:
        return None
    if isinstance(g, dist.ProcessGroup):
        return g
    get = getattr(g, "get_group", None)
    if get is not None and getattr(g, "ndim", None) == 1:
        return get()
    raise TypeError(f"gradcomp.torch.fsdp: {what}={g!r}; accepted: a torch.distributed.ProcessGroup or a 1-D "
                    f"DeviceMesh (the ranks holding the same shard on other nodes)")


class ReplicaAllReduce:
    """The all-reduce of each rank's reduce-scattered shard across replicas, for
    ``FSDPModule.set_all_reduce_hook`` (custom HSDP; :func:`replica_all_reduce_hook` builds one).

    FSDP2 calls ``hook(output)`` after its reduce-scatter with this rank's shard of a unit
    (already averaged over the shard group); the hook averages it over ``replicate_group`` in
    place: the compressed parameters' elements through a :class:`gradcomp.torch.Compressor`
    (scheme ``auto``: two_phase for the quantizers, gather for top-k, sum for linear codecs; its
    own worker (and server) residuals, keyed by parameter FQN: this rank's shard of it), the
    exempt ones dense (the ``dense`` scheme, divide by R and sum), and waits for both.

    Args: as :func:`replica_all_reduce_hook`.
    """

    def __init__(self, codec: Any, replicate_group, *, error_feedback: bool = True, scheme: str = "auto",
                 min_compress_numel: int = 1024, exempt: ExemptArg = None, nonfinite: str = "restore",
                 seed: int = 0, cost_model=None, on_corrupt: str = "raise", _steps: Optional[_Steps] = None):
        check_torch()
        pg = _process_group(replicate_group, "replicate_group")
        if pg is None:
            raise TypeError("gradcomp.torch.fsdp: replicate_group is required (a ProcessGroup or 1-D DeviceMesh of "
                            "the ranks that hold the same shard: one per node in custom HSDP)")
        # min_compress_numel is applied per parameter (the exempt rule), not to a unit's whole shard
        self.compressor = Compressor(codec, scheme, error_feedback, pg, min_compress_numel=0, nonfinite=nonfinite,
                                     seed=seed, cost_model=cost_model, on_corrupt=on_corrupt)
        self.codec = self.compressor.codec
        self.exempt = _Exempt(exempt, int(min_compress_numel))
        self.steps = _steps or _Steps()
        self.steps.listeners.append(self.compressor.end_step)
        self._units: Dict[int, _Unit] = {}
        self._index: Dict[int, int] = {}
        self._rows: Dict[tuple, Tuple[RowLayout, list, list]] = {}

    @property
    def world_size(self) -> int:
        """R, the replicas."""
        return self.compressor.world_size

    def install(self, module, name: Optional[str] = None) -> "ReplicaAllReduce":
        """``module.set_all_reduce_hook(self)`` after recording-wrapping its parameter group.

        Raises:
            TypeError: not an FSDPModule.
            ValueError: several parameter groups; native HSDP (a 2-D mesh: FSDP2 all-reduces across
                replicas itself and the hook would run after it).
        """
        _check_install(module, "ReplicaAllReduce.install")
        groups = _param_groups(module)
        if not groups:
            return self
        if len(groups) == 1 and getattr(groups[0], "_is_hsdp", False):
            raise ValueError(_NATIVE_HSDP)
        unit = _unit_of(module, name if name is not None else getattr(groups[0], "_module_fqn", "") or "")
        self._units[id(unit)] = unit
        self._index.setdefault(id(unit), len(self._index))
        module.set_all_reduce_hook(self)
        return self

    def __call__(self, output: torch.Tensor) -> None:
        """Average ``output`` (this rank's shard of the current unit, the reduce dtype) over the
        replicas in place. Raises what :meth:`gradcomp.torch.Compressor.allreduce_bucket`'s
        Futures raise (the step is then undone there)."""
        unit = _take_unit(self._units, "ReplicaAllReduce")
        self.steps.enter("ar", unit)
        mine, comp, ex = self._layout(unit, output)
        flat = output.view(-1)
        idx = 2 * self._index[id(unit)]
        futs = []
        staged = []
        for segs, params, index, dense in ((mine.compressed, comp, idx, False), (mine.exempt, ex, idx + 1, True)):
            if not segs:
                continue
            if len(segs) == 1:
                t = flat[segs[0][0]: segs[0][0] + segs[0][1]]
            else:
                t = torch.cat([flat[a: a + n] for a, n in segs])
                staged.append((t, segs))
            futs.append(self.compressor.allreduce_bucket(t, index, params, dense=dense))
        for f in futs:
            f.wait()
        for t, segs in staged:
            at = 0
            for a, n in segs:
                flat[a: a + n].copy_(t[at: at + n])
                at += n

    def _layout(self, unit: _Unit, output: torch.Tensor):
        W = unit.world_size
        r = unit.shard_rank()
        sig = (unit.name, W, r, tuple((_fqn(fp), tuple(s)) for fp, s in zip(unit.params, unit.sizes)))
        got = self._rows.get(sig)
        if got is None:
            rows, pieces, _ = _pieces(unit, self.exempt)
            mine = rows[r]
            comp, ex = [], []
            at_c = at_e = 0
            for p in pieces:
                if p.j != r:
                    continue
                if p.staged >= 0:
                    comp.append((p.fqn, at_c, p.n))
                    at_c += p.n
                else:
                    ex.append((p.fqn, at_e, p.n))
                    at_e += p.n
            got = self._rows[sig] = (mine, comp, ex)
        if sum(n for _, n in got[0].compressed) + sum(n for _, n in got[0].exempt) > output.numel():
            raise RuntimeError(f"gradcomp.torch.fsdp: {unit.label}: shard of {output.numel()} elements is smaller "
                               f"than its recorded layout")
        return got

    def stats(self) -> dict:
        """The replica compressor's :meth:`gradcomp.torch.Compressor.stats` (bucket 2u: unit u's
        compressed elements, 2u + 1: its exempt elements, dense)."""
        return self.compressor.stats()

    def state_dict(self) -> dict:
        return self.compressor.state_dict()

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        self.compressor.load_state_dict(sd, strict=strict)


def replica_all_reduce_hook(codec: Any, replicate_group, *, error_feedback: bool = True, scheme: str = "auto",
                            min_compress_numel: int = 1024, exempt: ExemptArg = None, nonfinite: str = "restore",
                            seed: int = 0, cost_model=None, on_corrupt: str = "raise") -> ReplicaAllReduce:
    """A compressed all-reduce across replicas for ``FSDPModule.set_all_reduce_hook`` (custom
    HSDP); install it with ``hook.install(module)`` on every FSDPModule (one hook serves them all).

    Args:
        codec: the codec spec or :class:`gradcomp.Codec`.
        replicate_group: the ProcessGroup (or 1-D DeviceMesh) of the R ranks that hold the same
            shard, one per replica (node).
        error_feedback, min_compress_numel, nonfinite, seed, on_corrupt: as
            :class:`gradcomp.torch.Compressor`; ``scheme``: its scheme (``"auto"``), ``cost_model``
            its cost model for ``auto``.
        exempt: as :class:`CompressedReduceScatter` (exempt parameters go dense).

    Raises:
        TypeError: replicate_group missing or of another type. RuntimeError: torch < 2.9.
        ValueError: as :class:`gradcomp.torch.Compressor`.
    """
    return ReplicaAllReduce(codec, replicate_group, error_feedback=error_feedback, scheme=scheme,
                            min_compress_numel=min_compress_numel, exempt=exempt, nonfinite=nonfinite, seed=seed,
                            cost_model=cost_model, on_corrupt=on_corrupt)


# ---------------------------------------------------------------------------------------------
# the state register() returns

class FSDPCompressionState:
    """What :func:`register` installed on a model: the reduce-scatter (or None) and the replica
    all-reduce (or None), one step counter, the accounting and the checkpoint state.

    Implements ``torch.distributed.checkpoint``'s Stateful protocol (``state_dict`` /
    ``load_state_dict``): ``dcp.save({"model": model, "optim": optim, "gradcomp": state}, ...)``
    saves this rank's residuals with the model.

    Attributes:
        reduce_scatter: the :class:`CompressedReduceScatter`, or None.
        replica: the :class:`ReplicaAllReduce`, or None.
        world_size: W, ranks of the reduce-scatter (shard) group; rank: this process's global rank.
        units: the names of the FSDPModules it is installed on.
    """

    def __init__(self, reduce_scatter: Optional[CompressedReduceScatter], replica: Optional[ReplicaAllReduce],
                 steps: _Steps, units: List[str], world_size: int, codec: Codec):
        self.reduce_scatter, self.replica, self._steps = reduce_scatter, replica, steps
        self.units, self.world_size, self.codec = list(units), int(world_size), codec
        self.rank = dist.get_rank()
        self.global_world_size = dist.get_world_size()

    @property
    def iter(self) -> int:
        """The current step's number (0 for the first; a step ends when a unit is reduced again)."""
        return self._steps.iter

    def residual(self, fqn: str, level: str = "reduce_scatter") -> torch.Tensor:
        """A float32 copy of ``fqn``'s residual on this rank at ``level``: ``"reduce_scatter"``
        (the parameter's W shard pieces in row order) or ``"replica"`` (this rank's shard of it).

        Raises:
            KeyError: none at that level (exempt, not reduced yet, no error feedback).
            ValueError: an unknown level, or a level not installed.
        """
        if level == "reduce_scatter" and self.reduce_scatter is not None:
            return self.reduce_scatter.residual(fqn)
        if level == "replica" and self.replica is not None:
            return self.replica.compressor.residual(fqn)
        raise ValueError(f"residual: level={level!r}; accepted: "
                         f"{', '.join(k for k, v in (('reduce_scatter', self.reduce_scatter), ('replica', self.replica)) if v is not None)}")

    def attach_grad_scaler(self, scaler) -> None:
        """Both levels' residuals follow ``scaler``'s loss scale (a ``torch.amp.GradScaler``, or
        FSDP's ``ShardedGradScaler``; None detaches)."""
        if self.reduce_scatter is not None:
            self.reduce_scatter.attach_grad_scaler(scaler)
        if self.replica is not None:
            self.replica.compressor.attach_grad_scaler(scaler)

    def stats(self) -> dict:
        """Bytes per level, as the DDP state's ``stats()``: ``{"steps", "world_size" (W),
        "replicas" (R, 1 without a replica hook), "codec", "reduce_scatter": the reduce-scatter's
        stats or None, "replica": the replica all-reduce's or None, "total": {"dense_bytes",
        "packet_bytes", "sent_bytes", "ring_bytes", "packet_ratio", "wire_ratio"} over both}``.
        ``ring_bytes`` is what the dense collectives send: a ring reduce-scatter, a ring
        all-reduce of the shard."""
        rs = self.reduce_scatter.stats() if self.reduce_scatter is not None else None
        ar = self.replica.stats() if self.replica is not None else None
        tot = {"numel": 0, "dense_bytes": 0.0, "packet_bytes": 0.0, "sent_bytes": 0.0, "ring_bytes": 0.0}
        for s in (rs, ar):
            for k in tot:
                tot[k] += (s or {}).get("total", {}).get(k, 0)
        tot.update(planner.summarize(tot))
        return {"steps": self.iter + 1 if self._steps.begun else 0,
                "world_size": self.world_size,
                "replicas": self.replica.world_size if self.replica is not None else 1, "codec": self.codec.spec,
                "reduce_scatter": rs, "replica": ar, "total": tot}

    # -- checkpoints (per rank; the Stateful protocol) -----------------------------------------
    def state_dict(self) -> dict:
        """``{"version", "codec", "world_size", "replicas", "gradcomp_rank<r>": bytes}``: this
        rank's residuals (both levels), step counter and loss scale, serialized with
        ``torch.save`` under a key of its own (so ``torch.distributed.checkpoint`` writes every
        rank's, and each rank reads back its own; the other fields are the same on every rank).
        Loading needs the same world size; :func:`load_planner` lets ``dcp.load`` go on where a
        rank's key is missing (a larger world size)."""
        payload = {"next_step": self._steps.next_step(), "rank": self.rank, "global_world_size": self.global_world_size,
                   "reduce_scatter": None if self.reduce_scatter is None else self.reduce_scatter.state_dict(),
                   "replica": None if self.replica is None else self.replica.state_dict()}
        buf = io.BytesIO()
        torch.save(payload, buf)
        return {"version": STATE_VERSION, "codec": self.codec.spec, "world_size": self.global_world_size,
                "replicas": self.replica.world_size if self.replica is not None else 1,
                RANK_KEY.format(self.rank): buf.getvalue()}

    def load_state_dict(self, sd: dict) -> None:
        """Load a :meth:`state_dict` of the same world size, bit-exact: each rank its own.

        With another world size (or codec) the residuals are dropped with a warning and training
        goes on from zero residuals (a rank's residual is what that rank did not send; there is
        no exact re-sharding of it onto another number of ranks).

        Raises:
            ValueError: a dict that is not such a state (the message names what is missing), or a
                format version this gradcomp does not read.
        """
        if not isinstance(sd, dict) or "version" not in sd or "world_size" not in sd:
            raise ValueError(f"FSDPCompressionState.load_state_dict: expected a dict from state_dict() with version, "
                             f"world_size and {RANK_KEY.format(self.rank)}, got "
                             f"{sorted(sd) if isinstance(sd, dict) else type(sd).__name__}")
        if int(sd["version"]) != STATE_VERSION:
            raise ValueError(f"FSDPCompressionState.load_state_dict: format {sd['version']}; accepted: {STATE_VERSION}")
        why = []
        if int(sd["world_size"]) != self.global_world_size:
            why.append(f"saved at world size {sd['world_size']}, loaded at {self.global_world_size}")
        if sd.get("codec") != self.codec.spec:
            why.append(f"saved with codec {sd.get('codec')}, this state runs {self.codec.spec}")
        want_r = self.replica.world_size if self.replica is not None else 1
        if int(sd.get("replicas", 1)) != want_r:
            why.append(f"saved with {sd.get('replicas')} replicas, this state has {want_r}")
        blob = sd.get(RANK_KEY.format(self.rank))
        if not why and blob is None:
            why.append(f"the checkpoint has no {RANK_KEY.format(self.rank)}")
        if why:
            warnings.warn(f"gradcomp: FSDP2 compression state not restored ({'; '.join(why)}): residuals dropped, "
                          f"training goes on from zero residuals", stacklevel=2)
            self._drop()
            return
        payload = torch.load(io.BytesIO(blob), weights_only=False, map_location=self._device())
        if int(payload.get("rank", self.rank)) != self.rank:
            raise ValueError(f"FSDPCompressionState.load_state_dict: rank {self.rank} was given rank "
                             f"{payload.get('rank')}'s state")
        if self.reduce_scatter is not None and payload.get("reduce_scatter") is not None:
            self.reduce_scatter.load_state_dict(payload["reduce_scatter"])
        if self.replica is not None and payload.get("replica") is not None:
            self.replica.load_state_dict(payload["replica"], strict=True)
        self._steps.restart(int(payload.get("next_step", 0)))

    def _device(self):
        for lay in (self.reduce_scatter._layouts.values() if self.reduce_scatter is not None else ()):
            return lay.ctx.device
        return None

    def _drop(self) -> None:
        if self.reduce_scatter is not None:
            self.reduce_scatter.store.load({})
        if self.replica is not None:
            c = self.replica.compressor
            c.load_state_dict({"world_size": c.world_size, "rank": c.rank, "codec": c.codec.spec,
                               "error_feedback": c.error_feedback, "iter": c.iter, "residuals": {},
                               "server_residuals": []}, strict=False)


def load_planner(**kwargs):
    """A ``torch.distributed.checkpoint.DefaultLoadPlanner`` for ``dcp.load`` that lets a
    checkpoint saved at a smaller world size load: gradcomp's per-rank keys (``gradcomp_rank<r>``)
    the checkpoint lacks are skipped (every other missing key still raises), and
    :meth:`FSDPCompressionState.load_state_dict` then drops the residuals with a warning.
    ``kwargs`` go to ``DefaultLoadPlanner``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    pat = re.compile(r"(^|\.)" + RANK_KEY.format(r"\d+") + "$")

    class _Planner(DefaultLoadPlanner):
        def create_local_plan(self):
            md = self.metadata.state_dict_metadata
            for k in [k for k in self.state_dict if k not in md and pat.search(k)]:
                del self.state_dict[k]
            return super().create_local_plan()

    return _Planner(**kwargs)


def register(model, codec: Any, *, reduce_scatter: bool = True, replicate_group=None, error_feedback: bool = True,
             min_compress_numel: int = 1024, exempt: ExemptArg = None, nonfinite: str = "restore", seed: int = 0,
             replica_scheme: str = "auto", cost_model=None, on_corrupt: str = "raise") -> FSDPCompressionState:
    """Install gradcomp on every FSDPModule of ``model`` (the root and its ``fully_shard``-ed
    children): a :class:`CompressedReduceScatter` (``reduce_scatter=True``) and, with
    ``replicate_group``, a :class:`ReplicaAllReduce` (custom HSDP).

    Args:
        model: the root module, sharded by ``fully_shard`` (an FSDPModule).
        codec: the codec spec or :class:`gradcomp.Codec` (required; ``"none"`` is exact).
        reduce_scatter: compress the reduce-scatter inside ``fully_shard`` (default True).
        replicate_group: None, or the ProcessGroup / 1-D DeviceMesh of the ranks holding the same
            shard on other nodes: their shards are all-reduced through gradcomp's schemes after
            each reduce-scatter (``replica_scheme``, ``cost_model``).
        error_feedback, min_compress_numel, exempt, nonfinite, seed, on_corrupt: both levels (see
            :class:`CompressedReduceScatter` and :class:`gradcomp.torch.Compressor`).

    Returns:
        The :class:`FSDPCompressionState`.

    Raises:
        TypeError: ``model`` not an FSDPModule (a DDP model: use :func:`gradcomp.torch.register`);
            a bad replicate_group.
        ValueError: nothing to install (reduce_scatter=False without replicate_group); a module
            with several parameter groups; a reduce-scatter comm other than FSDP2's default
            (``set_allocate_memory_from_process_group_for_comm``); native HSDP with a
            replicate_group; bad options.
        RuntimeError: torch older than 2.9.
    """
    check_torch()
    _, FSDPModule = _api()
    if not isinstance(model, FSDPModule):
        from torch.nn.parallel import DistributedDataParallel
        hint = (" (a DistributedDataParallel model: use gradcomp.torch.register)"
                if isinstance(model, DistributedDataParallel) else "")
        raise TypeError(f"gradcomp.torch.fsdp.register: expected a model sharded by fully_shard (its root an "
                        f"FSDPModule), got {type(model).__name__}{hint}")
    if not reduce_scatter and replicate_group is None:
        raise ValueError("gradcomp.torch.fsdp.register: nothing to install: reduce_scatter=False and no "
                         "replicate_group; accepted: reduce_scatter=True, a replicate_group, or both")
    if nonfinite not in NONFINITE_MODES or on_corrupt not in CORRUPT_MODES:
        check_options(scheme="auto", nonfinite=nonfinite, ints=(), error_feedback=error_feedback, group=None,
                      on_corrupt=on_corrupt)
    steps = _Steps()
    rs = (CompressedReduceScatter(codec, error_feedback, min_compress_numel=min_compress_numel, exempt=exempt,
                                  nonfinite=nonfinite, seed=seed, on_corrupt=on_corrupt, _steps=steps)
          if reduce_scatter else None)
    rep = (ReplicaAllReduce(codec, replicate_group, error_feedback=error_feedback, scheme=replica_scheme,
                            min_compress_numel=min_compress_numel, exempt=exempt, nonfinite=nonfinite, seed=seed,
                            cost_model=cost_model, on_corrupt=on_corrupt, _steps=steps)
           if replicate_group is not None else None)
    mods = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    for name, m in mods:  # check every module before installing on any
        groups = _param_groups(m)
        if len(groups) > 1:
            _unit_of(m, name)  # raises the message
        if rep is not None and len(groups) == 1 and getattr(groups[0], "_is_hsdp", False):
            raise ValueError(_NATIVE_HSDP)
    units = []
    W = 1
    for name, m in mods:
        groups = _param_groups(m)
        if not groups:
            continue
        if rs is not None:
            rs.install(m, name)
        if rep is not None:
            rep.install(m, name)
        units.append(name)
        mi = getattr(groups[0], "mesh_info", None)
        W = int(getattr(mi, "shard_mesh_size", W) or W)
    codec_obj = rs.codec if rs is not None else rep.codec
    log.info("gradcomp: FSDP2 compression on %d units (codec %s, reduce-scatter %s, replica all-reduce %s)",
             len(units), codec_obj.spec, "compressed" if rs is not None else "FSDP2's own",
             f"over {rep.world_size} replicas" if rep is not None else "none")
    return FSDPCompressionState(rs, rep, steps, units, W, codec_obj)


__all__ = ["CompressedReduceScatter", "FSDPCompressionState", "ReplicaAllReduce", "check_torch", "load_planner",
           "register", "replica_all_reduce_hook"]
