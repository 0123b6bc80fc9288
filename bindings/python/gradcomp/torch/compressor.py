"""The compressed allreduce for any hook or training loop: :class:`Compressor`.

A Compressor owns one codec, the error-feedback residuals (:class:`ResidualStore`), the per-layout
scheme buffers and the step records (:class:`Stats`); it picks a scheme per tensor layout through
:func:`gradcomp.planner.choose_scheme` and runs it from :mod:`gradcomp.schemes`. The DDP hook
(:mod:`gradcomp.torch.hook`) is built on it, so both share one implementation of
encode / communicate / decode, error feedback, the non-finite rule, loss-scale tracking and the
accounting. The README's "Compressed allreduce for any training loop" section is the user guide.

Sources: top-k sparsification with locally accumulated residuals: Aji & Heafield, "Sparse
Communication for Distributed Gradient Descent", EMNLP 2017; Lin et al., "Deep Gradient
Compression", ICLR 2018. Error feedback: Karimireddy et al., "Error Feedback Fixes SignSGD and
other Gradient Compression Schemes", ICML 2019. The dense and fp16 semantics follow PyTorch's
``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`` (allreduce_hook,
fp16_compress_hook).
"""

import functools
import logging
import os
import pickle
import warnings
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import planner
from ..codec import Codec
from ..codec import _dtype_name as dtype_name
from ..planner import schemes as scheme_table
from ..schemes import SchemeContext
from ..schemes.base import RouteConfig
from ..schemes.check import PeerCheck
from ..schemes.context import chain, completed
from . import protocol
from .journal import Attempt, NotApplied, StepJournal, fail_call, not_applied, peer_check
from .policy import DENSE, ExemptArg, Exemptions, Ramp, RampArg, entry_size, spec_of
from .protocol import BaseCompressor, LossScale, check_allreduce_args  # noqa: F401 (re-exported)
from .residuals import NONFINITE_MODES, Layout, ResidualStore
from .stats import CORRUPT_MODES, LOCAL, Stats, check_log_file

log = logging.getLogger("gradcomp")

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes that are compressed; others (float64, complex) and sparse tensors go dense."""

CAST_CODECS = {"fp16": torch.float16, "bf16": torch.bfloat16}
"""The 16-bit cast codecs and their wire dtype: on a 16-bit tensor they save nothing."""

PICKLE_VERSION = 2
"""Format of a pickled Compressor; 2 added local_world_size, inner_scheme and cost_model (a
version-1 pickle loads with their defaults), and later seed (read as 0 when absent), exempt and
ramp (read as ``()`` and None when absent: what a Compressor before them did)."""

def scheme_choices() -> Tuple[str, ...]:
    """The ``scheme`` values: ``"auto"`` and every scheme of the table (:mod:`gradcomp.schemes.table`)."""
    return ("auto",) + scheme_table.names()


def inner_choices() -> Tuple[str, ...]:
    """The ``inner_scheme`` values: what ``hierarchical`` runs across nodes, ``"auto"``
    (:func:`gradcomp.planner.hierarchical_inner`) or a flat scheme of the table."""
    return ("auto",) + scheme_table.names(flat=True)


def __getattr__(name: str):
    """``SCHEME_CHOICES`` / ``INNER_CHOICES``: :func:`scheme_choices` / :func:`inner_choices`,
    read from the scheme table when asked for."""
    if name == "SCHEME_CHOICES":
        return scheme_choices()
    if name == "INNER_CHOICES":
        return inner_choices()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

ParamMap = Sequence[Tuple[str, int, Any]]
"""``[(name, offset, length | shape | tensor)]``: offsets and lengths in elements of the flat
tensor; a shape (tuple, ``torch.Size``) or a tensor (the parameter) also tells the exemption rule
its dimensions (:mod:`gradcomp.torch.policy`)."""


def check_options(*, scheme: str, nonfinite: str, ints: Sequence[Tuple[str, Any]], error_feedback: Any,
                  group: Any, group_arg: str = "group", on_corrupt: str = "raise") -> None:
    """Validate the options shared by :class:`Compressor` and the DDP hook's state, before any
    process-group call. ``ints`` are ``(name, value)`` pairs that must be integers >= 0.

    Raises:
        ValueError: unknown scheme, nonfinite or on_corrupt mode; a negative or non-integer int.
        TypeError: error_feedback not a bool; the group not None or a ProcessGroup.
    """
    if scheme not in scheme_choices():
        raise ValueError(f"scheme={scheme!r}; accepted: {', '.join(scheme_choices())}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite={nonfinite!r}; accepted: {', '.join(NONFINITE_MODES)}")
    for name, v in ints:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name}={v!r}; accepted: an integer >= 0")
    if not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback={error_feedback!r}; accepted: True or False")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{group_arg}={group!r}; accepted: None or a torch.distributed.ProcessGroup")
    if on_corrupt not in CORRUPT_MODES:
        raise ValueError(f"on_corrupt={on_corrupt!r}; accepted: {', '.join(CORRUPT_MODES)}")


def resolve_local_world_size(local_world_size: Optional[int], world_size: int, scheme: str) -> int:
    """L, the ranks per node (of the ``hierarchical`` scheme), for a group of ``world_size`` ranks:
    ``local_world_size`` when given, else the ``LOCAL_WORLD_SIZE`` environment variable (torchrun
    sets it) when it is an integer dividing the world size; 0 when neither applies and the
    scheme does not require it (its :attr:`gradcomp.schemes.base.Scheme.requires`; ``auto``
    then never takes a scheme that does).

    Raises:
        ValueError: ``local_world_size`` not an integer >= 1 dividing ``world_size``; for
            ``scheme="hierarchical"``, neither given nor set, or ``LOCAL_WORLD_SIZE`` not such an
            integer (each message names the value and the world size).
    """
    W = int(world_size)
    required = scheme != "auto" and "local_world_size" in scheme_table.get(scheme).requires
    if local_world_size is not None:
        v = local_world_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or W % v != 0:
            raise ValueError(f"local_world_size={v!r}; accepted: an integer >= 1 dividing the world size {W} "
                             f"(ranks per node), or None (the LOCAL_WORLD_SIZE environment variable)")
        return int(v)
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is not None and env.strip():
        try:
            v = int(env.strip())
        except ValueError:
            v = 0
        if v >= 1 and W % v == 0:
            return v
        if required:
            raise ValueError(f"scheme={scheme!r}: the LOCAL_WORLD_SIZE environment variable is {env!r}; "
                             f"accepted: an integer >= 1 dividing the world size {W}; or pass local_world_size=")
        return 0
    if required:
        raise ValueError(f"scheme={scheme!r} needs the ranks per node: pass local_world_size= (an integer "
                         f"dividing the world size {W}) or set the LOCAL_WORLD_SIZE environment variable "
                         f"(torchrun sets it)")
    return 0


class _Route:
    """A layout with the codec and scheme chosen for it, the scheme's layout options (its
    description's ``route``: hierarchical's L, scheme across nodes and engine; empty for the
    others) and, once it compresses, its scheme buffers. ``layout`` is the store's layout of what
    is compressed (the whole tensor, or the compressed part of a bucket holding exempt
    parameters: ``split``); ``full`` maps the whole tensor (what a dense call flushes)."""

    __slots__ = ("layout", "scheme", "ctx", "options", "codec", "split", "full")

    def __init__(self, layout: Layout, scheme: str, options: Optional[dict] = None, codec: Optional[Codec] = None,
                 split: Optional["_Split"] = None):
        self.layout = layout
        self.scheme = scheme
        self.ctx: Optional[SchemeContext] = None
        self.options = dict(options or {})
        self.codec = codec
        self.split = split
        self.full = layout if split is None else split.full

    def check_params(self) -> list:
        """The parameter map the ranks' call descriptors carry: the tensor's, with each exempt
        parameter marked."""
        if self.split is None:
            return list(self.layout.params)
        return [(k, o, n, int(f)) for (k, o, n), f in zip(self.split.full.params, self.split.flags)]

    def shown(self) -> dict:
        """The options its scheme shows in stats, layouts and the ranks' call descriptors."""
        return {k: self.options[k] for k in scheme_table.get(self.scheme).shown if k in self.options}


def _ranges(spans: List[Tuple[int, int]]) -> List[List[int]]:
    """Sorted, non-overlapping ``(offset, length)`` spans merged into ``[start, end)`` ranges."""
    out: List[List[int]] = []
    for off, n in spans:
        if out and off == out[-1][1]:
            out[-1][1] = off + n
        else:
            out.append([off, off + n])
    return out


class _Split:
    """How a flat tensor divides when some parameters of its map are exempt (:mod:`gradcomp.
    torch.policy`): their elements (the *exempt part*) are averaged dense, the rest (the
    *compressed part*, elements no parameter covers included) through the scheme. Each part is
    a view of the tensor when its elements are contiguous, else staged into a tensor of its own
    (``index_select``) and copied back (``index_copy_``) when the call completes.

    Attributes:
        sig: what the split was made from (numel, dtype, device, map with the exempt flags).
        flags: per map entry, whether it is exempt.
        full: an (unregistered) :class:`Layout` of the whole map, bucket offsets.
        ex_layout: an (unregistered) :class:`Layout` of the exempt parameters, offsets in the
            exempt part (what a call flushes their residuals by).
        comp_map: the compressed parameters, offsets in the compressed part.
        comp_numel, ex_numel: the parts' elements.

    Raises:
        ValueError: map entries that overlap or leave the tensor.
    """

    def __init__(self, key, numel: int, dtype, device, entries: list, flags: Tuple[bool, ...], sig: tuple):
        self.sig, self.flags, self.numel = sig, tuple(bool(f) for f in flags), int(numel)
        spans = sorted((off, n, f, name) for (name, off, n, _, _), f in zip(entries, flags) if n > 0)
        end = 0
        for off, n, _, name in spans:
            if off < end or off + n > numel:
                raise ValueError(f"gradcomp: {_label(key)}: parameter {name!r} at offset {off} with {n} elements "
                                 f"overlaps another or leaves the tensor of {numel} elements; a map with exempt "
                                 f"parameters needs disjoint entries")
            end = off + n
        ex = _ranges([(off, n) for off, n, f, _ in spans if f])
        comp, at = [], 0
        for a, b in ex:
            if a > at:
                comp.append([at, a])
            at = b
        if at < numel:
            comp.append([at, numel])
        self.ex_ranges, self.comp_ranges = ex, comp
        self.ex_numel = sum(b - a for a, b in ex)
        self.comp_numel = numel - self.ex_numel
        self.full = Layout(key, numel, dtype, device, [(name, off, n) for name, off, n, _, _ in entries])
        ex_map, comp_map = [], []
        for (name, off, n, _, _), f in zip(entries, self.flags):
            ranges = ex if f else comp
            staged = self._staged(ranges, off) if n > 0 else 0
            (ex_map if f else comp_map).append((name, staged, n))
        self.ex_layout = Layout(key, self.ex_numel, dtype, device, ex_map)
        self.comp_map = comp_map
        self._index: Dict[tuple, torch.Tensor] = {}

    @staticmethod
    def _staged(ranges: List[List[int]], off: int) -> int:
        at = 0
        for a, b in ranges:
            if a <= off < b:
                return at + off - a
            at += b - a
        return at

    def _part(self, part: str) -> List[List[int]]:
        return self.ex_ranges if part == "exempt" else self.comp_ranges

    def take(self, flat: torch.Tensor, part: str) -> torch.Tensor:
        """The ``"exempt"`` or ``"compressed"`` part of ``flat``: a view (one range) or a staged copy."""
        ranges = self._part(part)
        if len(ranges) == 1:
            return flat[ranges[0][0]: ranges[0][1]]
        if not ranges:
            return flat[:0]
        return flat.index_select(0, self._idx(part, flat.device))

    def put(self, flat: torch.Tensor, part: str, t: torch.Tensor) -> None:
        """Copy the part ``t`` back into ``flat`` (nothing for a view)."""
        if len(self._part(part)) > 1:
            flat.index_copy_(0, self._idx(part, flat.device), t)

    def _idx(self, part: str, device) -> torch.Tensor:
        k = (part, str(device))
        idx = self._index.get(k)
        if idx is None:
            idx = self._index[k] = torch.cat([torch.arange(a, b, dtype=torch.int64, device=device)
                                              for a, b in self._part(part)])  # on the device: no copy
        return idx


def _label(key) -> str:
    kind, v = key
    return f"bucket {v}" if kind == "index" else f"tensor {v!r}"


def _bucket_id(key) -> int:
    """The bucket part of the encode key: a bucket's index, or crc32 of a tensor's name (the
    same on every rank), as a u32."""
    kind, v = key
    return int(v) & 0xFFFFFFFF if kind == "index" else zlib.crc32(str(v).encode("utf-8"))


def try_allocate(make: Callable[[], Any]) -> Tuple[Any, Optional[BaseException]]:
    """``(make(), None)``, or ``(None, error)`` when ``make`` runs out of memory: a
    ``torch.OutOfMemoryError``, a ``MemoryError``, or the CPU allocator's ``RuntimeError`` ("can't
    allocate memory"). Other errors propagate. What the compressor's and FSDP2's pre-checks use to
    tell every rank, before any collective, that one could not allocate."""
    try:
        return make(), None
    except (torch.OutOfMemoryError, MemoryError) as e:
        return None, e
    except RuntimeError as e:
        if "allocate" not in str(e):
            raise
        return None, e


class Compressor(BaseCompressor):
    """Compressed allreduce over a process group, with error feedback, for any loop or hook.

    Args:
        codec: codec spec (``"topk:ratio=0.01"``, ``"fp16"``, ``"bf16"``, ``"none"``; the README's
            "What is here" table, ``gradcomp.codecs()``) or a :class:`gradcomp.Codec`. Required:
            there is no default codec.
        scheme: ``"sum"`` (linear codecs: one SUM allreduce of the packet's payload; encode divides
            by W), ``"gather"`` (any codec: all-gather the fixed-size packets, decode all W in
            rank order into one float32 accumulator, round once), ``"two_phase"`` (any codec: W
            chunks, one all-to-all of their packets, each rank sums its chunk in float32 in rank
            order and re-encodes it with its server residual, all-gather, decode; DeepSpeed 1-bit
            Adam, Tang et al. 2021, and ZeRO++ qgZ, Wang et al. 2023: :mod:`gradcomp.schemes.
            two_phase`), ``"hierarchical"`` (any codec, nodes of ``local_world_size`` = L ranks:
            an uncompressed float32 reduce-scatter inside the node -- an allreduce on gloo --,
            ``inner_scheme`` across nodes between the ranks of the same local rank for this rank's
            chunk of the node sum, an all-gather inside the node: :mod:`gradcomp.schemes.
            hierarchical`), ``"dense"`` (divide by W, SUM allreduce, as PyTorch's allreduce_hook)
            or ``"auto"`` (:func:`gradcomp.planner.choose_scheme`: with ``cost_model`` the scheme
            of least predicted time, hierarchical included when L is known; else sum for linear
            codecs; gather for sparse ones (top-k) when ``W * packet_bytes < 2 * dense_bytes``;
            two_phase for the others (the quantizers) when it sends fewer bytes than a dense ring
            allreduce; else dense). The choice uses only numel, dtype, W, L, codec properties and
            the cost model's configuration.
        error_feedback: keep a float32 residual per element (Karimireddy et al. 2019): encode sees
            ``x' = g + r`` and leaves ``r = x' - W * decode(packet)``, in gradient units. Under
            two_phase each rank also keeps a float32 server residual for its chunk of each layout
            (in units of the average), folded into the worker residuals when the layout changes or
            goes dense and saved with its layout in checkpoints (:mod:`gradcomp.torch.residuals`).
            Under hierarchical the worker residual of a rank covers its chunk of the node sum
            (the rank that encodes it); with inner two_phase it also keeps the server residual of
            its piece of that chunk (folded with factor W, as two_phase's).
        group: the ``torch.distributed`` process group (None: the default group).
        min_compress_numel: tensors/buckets with fewer elements go dense (default 1024).
        nonfinite: ``"restore"`` (default; a second residual copy) or ``"reset"``: the residuals
            of a tensor whose averaged result holds a non-finite value are restored to their value
            before the call, or zeroed -- decided on the device, no host synchronization.
        on_corrupt: ``"raise"`` (default) or ``"log"``: what a corrupt packet met by a CUDA decode
            does when its status word is read one step later (CPU decodes raise at once).
        log_every: log a stats line every N steps through ``logging.getLogger("gradcomp")`` at
            INFO. When that logger has no handler anywhere (``hasHandlers()`` is False: logging
            not configured), a stderr ``StreamHandler`` at INFO is attached to it once
            (:data:`gradcomp.torch.stats.STDERR_HANDLER`); configure logging first to route the
            lines elsewhere. With ``log_file``, the step's report goes to that file instead.
        log_file: None (default), or a path (str or os.PathLike; ``{rank}`` in it is replaced by
            this rank; its folder must exist) to which the report of every ``log_every``-th step
            (``stats()["report"]``, :func:`gradcomp.torch.stats.step_report`) is appended as one
            JSON line, written when the next step starts; ranks may share one file (each row
            names its rank). ``gradcomp-report FILE`` turns it into a table and a PNG. Needs
            ``log_every`` >= 1.
        local_world_size: L, ranks per node for ``"hierarchical"`` (nodes of L consecutive
            ranks of ``group``: rank r is on node r // L, local rank r % L); None (default): the
            ``LOCAL_WORLD_SIZE`` environment variable (torchrun's) when set. Must divide W.
        inner_scheme: what hierarchical runs across nodes: ``"dense"``, ``"sum"`` (linear
            codecs), ``"gather"``, ``"two_phase"`` or ``"auto"`` (default:
            :func:`gradcomp.planner.hierarchical_inner`, the ``auto`` rule applied to one chunk
            of ceil(n / L) float32 elements over the N = W / L nodes; across one node, N = 1,
            nothing crosses and the inner scheme is dense).
        cost_model: a :class:`gradcomp.planner.CostModel` for ``"auto"`` (and an ``"auto"``
            inner scheme), or None: passed to :func:`gradcomp.planner.choose_scheme`.
        seed: an int in [0, 2^64), the same on every rank (default 0): with the step and the
            bucket (its index, or crc32 of the tensor's name) the key of codecs that draw random
            numbers; every scheme passes ``(seed, step, bucket, chunk)`` to every encode
            (:meth:`gradcomp.schemes.SchemeContext.key_for`), so all ranks draw alike and no
            global generator is touched. Codecs without randomness ignore it.
        exempt: the parameters of a bucket's map (:meth:`allreduce_bucket`) -- or the names of
            :meth:`allreduce` -- averaged dense instead of compressed (:mod:`gradcomp.torch.
            policy`): ``()`` (default here: none), None (those with fewer than 2 dimensions: biases,
            norms; an entry that carries only a length has no dimensions and is not exempt by
            this rule; :meth:`allreduce` passes the tensor), a callable ``(name,
            param_or_shape) -> bool`` (given the map entry's tensor or shape, or its length) or a
            collection of names / ``fnmatch`` patterns (``["*embed*"]``). A bucket holding exempt
            parameters is one call: their elements are divided by W and SUM-allreduced (the
            ``dense`` scheme, as allreduce_hook), the others compressed as usual (the scheme
            chosen for their count; below ``min_compress_numel`` the whole bucket goes dense),
            each part staged into a tensor of its own unless contiguous, and the Future completes
            when both did. Exempt parameters hold no residual: one that holds a residual when it
            becomes exempt (another rule, a loaded checkpoint) adds it to its dense gradient, as a
            parameter moving to the dense path does. Settable between steps (:attr:`exempt`).
        ramp: ``[(step, spec), ...]``: from step ``step`` on (``iter``) the codec is ``spec`` (a
            codec spec, a :class:`gradcomp.Codec`, or ``"dense"`` for the dense path), e.g.
            ``[(0, "topk:ratio=0.25"), (50, "topk:ratio=0.0625")]`` (DGC's density warm-up) or
            ``[(0, "fp16"), (100, "int8"), (200, "int4")]``; before its first step the codec is
            ``codec``. Steps strictly increase from any int >= 0; every rank switches at the same
            step. Residuals (float32, codec-independent) carry over; a two_phase server residual is
            folded into the worker residuals at a switch (as when a layout changes). ``stats()``
            names the codec of each step (``"dense"`` for a dense one) and totals per codec.

    Steps: a step ends at :meth:`end_step`, or when :meth:`allreduce` sees a name a second time
    (so a loop that reduces each name once per iteration needs no call). Records, the one-step-
    late reads and ``state_dict()["iter"]`` count steps.

    Non-finite results: every rank sees the same averaged tensor, so every rank decides alike;
    the result is returned as is (without a GradScaler an optimizer applies it) and the step is
    logged and counted in ``stats()["nonfinite_steps"]`` one step late.

    Loss scaling: with :meth:`attach_grad_scaler` the residuals follow the scaler's scale (see
    there); a step the scaler skips (inf/NaN gradients) is a non-finite step above.

    16-bit tensors: the ``fp16`` and ``bf16`` codecs save nothing on a float16/bfloat16 tensor
    (one warning per codec and dtype; use ``"none"``, or a smaller codec).

    Failed steps (the README's "When a step fails"): when a collective of a step fails (a peer
    died, a timeout), ranks disagree (:class:`gradcomp.RankMismatchError`, checked from a call
    descriptor at each new layout and at each step's first call) or a decode fails, every
    Future of that step raises on every surviving rank, naming the step, the tensor or bucket,
    the codec and the scheme, and the step's changes are undone (:mod:`gradcomp.torch.journal`):
    residuals as before it, ``iter`` too (the step is tried again; a name called again starts
    the retry). ``stats()["failed_steps"]`` counts them.

    Joined ranks (``joined=True``) send exact zeros and keep their worker residuals; under
    two_phase they still sum and re-encode their chunk for the others, with its server residual;
    under hierarchical they still encode their chunk of the node sum across nodes (without
    their worker residual: its compression error that step is not fed back) and serve their
    inner two_phase piece with its server residual.

    Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` (per rank, bit-exact, checked
    against the rank, codec and error_feedback), or pickle the Compressor itself
    (``torch.save(comp)``): config, residuals (bit-exact), step count and stats travel; the
    process group and an attached GradScaler do not (a warning): a Compressor comes back on the
    default group -- :meth:`set_process_group` moves it -- and its residuals are loaded, with
    the checks of ``load_state_dict(strict=True)``, by the first of :meth:`set_process_group`,
    :meth:`state_dict`, :meth:`residual` or the first reduction. Pickle between steps.

    Attributes:
        codec: the :class:`gradcomp.Codec`; world_size, rank: of ``group``.
        iter: steps completed (saved in ``state_dict()``).
        store: the :class:`gradcomp.torch.residuals.ResidualStore` holding the residuals.

    Raises:
        ValueError: unknown scheme / nonfinite / on_corrupt / inner_scheme, ``scheme="sum"`` or
            ``inner_scheme="sum"`` with a non-linear codec (the ramp's included), a negative
            min_compress_numel or log_every; a log_file with log_every 0 or in a folder that
            does not exist; a local_world_size not dividing W, or
            ``scheme="hierarchical"`` without local_world_size nor LOCAL_WORLD_SIZE
            (:func:`resolve_local_world_size`); a bad ramp entry (the message names it).
        TypeError: error_feedback not a bool; group not a ProcessGroup; exempt of another type;
            log_file not None, a str or an os.PathLike.
        gradcomp.InvalidArgumentError: a bad codec spec.
    """

    def __new__(cls, codec: Any = None, *args, **kwargs):
        # a spec of another protocol ("powersgd:rank=R": low rank, not a codec) builds that
        # protocol's compressor (gradcomp.torch.protocol's table)
        if cls is Compressor and codec is not None:
            p = protocol.for_spec(codec)
            if p.compressor is not Compressor:
                return p.compressor(codec, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, codec: Any, scheme: str = "auto", error_feedback: bool = True, group=None, *,
                 min_compress_numel: int = 1024, nonfinite: str = "restore", on_corrupt: str = "raise",
                 log_every: int = 0, local_world_size: Optional[int] = None, inner_scheme: str = "auto",
                 cost_model=None, seed: int = 0, exempt: ExemptArg = (), ramp: RampArg = None,
                 log_file: Any = None):
        check_options(scheme=scheme, nonfinite=nonfinite, error_feedback=error_feedback, group=group,
                      on_corrupt=on_corrupt,
                      ints=(("min_compress_numel", min_compress_numel), ("log_every", log_every)))
        check_log_file(log_file, log_every)
        if inner_scheme not in inner_choices():
            raise ValueError(f"inner_scheme={inner_scheme!r}; accepted: {', '.join(inner_choices())}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
            raise ValueError(f"seed={seed!r}; accepted: an int in [0, 2^64), the same on every rank")
        self.seed = int(seed)
        self._exempt = Exemptions(exempt)
        self.codec = codec if isinstance(codec, Codec) else Codec(str(codec))
        self.linear = bool(self.codec.properties["linear"])
        self._ramp = Ramp(ramp, self.codec)
        for arg, name in (("scheme", scheme), ("inner_scheme", inner_scheme)):
            if name == "auto":
                continue
            for c in self._ramp.all_codecs():
                sch = scheme_table.get(name)
                if not sch.accepts(c):
                    where = "" if c is self.codec else " (a codec of the ramp)"
                    if sch.codecs == "linear":
                        raise ValueError(f"{arg}={name!r} needs a linear codec; {c.spec}{where} is not linear "
                                         f"(use 'gather' or 'two_phase')")
                    raise ValueError(f"{arg}={name!r} needs {sch.needs()}; got {c.spec}{where}")
        world = dist.get_world_size(group)
        self.local_world_size = resolve_local_world_size(local_world_size, world, scheme)
        self._local_world_size_arg = local_world_size
        self.inner_scheme = inner_scheme
        self.cost_model = cost_model
        self.scheme = scheme
        self.error_feedback = error_feedback
        self.min_compress_numel = int(min_compress_numel)
        self.group = group
        self.world_size = world
        self.rank = dist.get_rank(group)
        self._prepare_schemes()
        self.iter = 0  # steps completed
        self.store = ResidualStore(nonfinite)
        self._routes: Dict[tuple, _Route] = {}
        self._stats = Stats(self.world_size, self.codec.spec, nonfinite, on_corrupt, int(log_every), rank=self.rank,
                            log_file=log_file, links=self._link_rates(), steps_of=self._steps_of)
        self._dense_ctx = SchemeContext(self.codec, group, self.world_size)
        self._warned: set = set()
        self._names: Dict[str, Tuple[int, torch.device]] = {}  # allreduce()/load names: numel, device
        self._fallback: set = set()  # keys that took the dense path for their dtype or layout
        self._step_names: set = set()
        self._scale = LossScale()  # an attached GradScaler and the loss scale the residuals are in
        self._restored: Optional[dict] = None  # a state_dict from a pickle, loaded on first use
        self._journal = StepJournal(self._rewind)  # undoes a failed step (gradcomp.torch.journal)
        self._verified: Dict[tuple, tuple] = {}  # key -> call signature the ranks agreed on
        self._splits: Dict[tuple, _Split] = {}  # key -> how its map divides (exempt parameters)

    def _link_rates(self) -> Optional[dict]:
        """Bytes per second a rank sends per link level, from the cost model (None without one):
        the report's link bandwidth (:meth:`gradcomp.planner.CostModel.rank_rates`)."""
        rates = getattr(self.cost_model, "rank_rates", None)
        return rates(self.world_size) if rates is not None else None

    def _steps_of(self, b: dict) -> list:
        """The collectives of the call accounted as bucket dict ``b`` (``stats()["buckets"]``),
        from the planner with its layout's options (:func:`gradcomp.planner.scheme_steps`): the
        report's traffic matrix.

        Raises:
            ValueError, KeyError: a dict this compressor did not account.
        """
        key = ("index", b["index"]) if "index" in b else ("name", b["name"])
        route = self._routes.get(key)
        options = route.options if route is not None and route.scheme == b["scheme"] else {}
        if b["scheme"] == "dense" or b["codec"] == DENSE:
            codec = self.codec  # the dense steps read no codec
        elif route is not None and route.codec is not None and route.codec.spec == b["codec"]:
            codec = route.codec
        else:
            codec = Codec(b["codec"])
        return planner.scheme_steps(b["scheme"], codec, b["numel"], b["dtype"], self.world_size, **options)

    def _config(self, device=None) -> RouteConfig:
        return RouteConfig(self.world_size, self.local_world_size, self.inner_scheme, self.min_compress_numel,
                           self.cost_model, self.group, device)

    def _prepare_schemes(self) -> None:
        """What the schemes this compressor may run set up on every rank now (every rank
        constructs the Compressor at the same point), not inside a hook: the requested scheme's
        ``prepare``; under ``auto`` with a cost model, every scheme's (the cost model may pick
        any; hierarchical: its process groups, :mod:`gradcomp.schemes.groups`)."""
        if self.scheme != "auto":
            names = (self.scheme,)
        else:
            names = scheme_table.names() if self.cost_model is not None else ()
        for name in names:
            scheme_table.get(name).prepare(self.group, self._config())

    spec = property(lambda self: self.codec.spec, doc="The codec's canonical spec (read-only).")

    @property
    def exempt(self):
        """The ``exempt`` argument (a collection as a tuple; see the class doc). Set it between
        steps to change which parameters go dense: a parameter that becomes exempt adds its
        residual to its dense gradient at its next call (and holds none after); one that stops
        being exempt starts with a zero residual.

        Raises (setting):
            TypeError: as the constructor's ``exempt``.
        """
        return self._exempt.arg

    @exempt.setter
    def exempt(self, exempt: ExemptArg) -> None:
        self._exempt = Exemptions(exempt)
        self._splits.clear()

    def exempted(self) -> List[str]:
        """The names found exempt so far (sorted)."""
        return self._exempt.exempted()

    @property
    def ramp(self) -> List[Tuple[int, str]]:
        """The ramp as ``[(step, canonical spec or "dense")]`` (empty: ``codec`` at every step)."""
        return self._ramp.entries()

    def codec_at(self, step: int) -> Optional[Codec]:
        """The :class:`gradcomp.Codec` that step ``step`` runs (the ramp's, else ``codec``), or
        None for a dense step of the ramp."""
        return self._ramp.at(step)
    nonfinite = property(lambda self: self.store.nonfinite, doc="``\"restore\"`` or ``\"reset\"`` (read-only).")
    log_every = property(lambda self: self._stats.log_every, doc="Steps between stats log lines (read-only).")
    log_file = property(lambda self: self._stats.log_file,
                        doc="The JSON-lines file of the step reports, ``{rank}`` replaced (None: the log line; read-only).")

    @property
    def on_corrupt(self) -> str:
        """``"raise"`` or ``"log"``: what a corrupt packet seen by a CUDA decode does when its
        status word is read (one step later). Settable, e.g. ``state.compressor.on_corrupt = "log"``
        for the DDP hook."""
        return self._stats.on_corrupt

    @on_corrupt.setter
    def on_corrupt(self, mode: str) -> None:
        self._stats.on_corrupt = mode  # validated there

    # -- reducing ------------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.futures.Future:
        """Average ``tensor`` over the group in place; the Future holds ``tensor``.

        Args:
            tensor: C-contiguous float32/float16/bfloat16 torch tensor of any shape (taken as
                flat; other dtypes take the dense path with one warning), not requiring grad,
                with the same numel and dtype on every rank.
            name: the key of its residual (float32, numel elements); every rank must call with
                the same names in the same order.

        Returns:
            A ``torch.futures.Future`` whose value is ``tensor``, holding the average, bitwise
            identical on every rank. ``wait()`` raises :class:`gradcomp.CollectiveError` when a
            collective of the step failed (or the step failed in another call),
            :class:`gradcomp.RankMismatchError` when ranks disagree, the decode's error
            (:class:`gradcomp.CorruptPacketError`); the step is then undone.

        Raises:
            TypeError: ``tensor`` not a torch.Tensor or ``name`` not a str.
            ValueError: a non-contiguous or sparse tensor; ``name`` used before with another numel.
            gradcomp.CollectiveError, gradcomp.RankMismatchError: at once, when a collective
                issued in the calling thread fails (two_phase, hierarchical) or the ranks'
                descriptors of a new layout differ; the step is then undone.
            gradcomp.CorruptPacketError: a corrupt packet seen by a CUDA decode of an earlier step
                (``on_corrupt="raise"``).
        """
        check_allreduce_args(tensor, name)
        n = tensor.numel()
        known = self._names.get(name)
        if known is not None and known[0] != n:
            raise ValueError(f"allreduce: tensor {name!r} has {n} elements, but {name!r} had {known[0]} "
                             f"before; one name per tensor")
        self._names[name] = (n, tensor.device)
        if name in self._step_names:
            self.end_step()
        self._step_names.add(name)
        return self._reduce(tensor, ("name", name), ((name, 0, tensor),))

    def allreduce_bucket(self, tensor: torch.Tensor, index: int, params: Union[ParamMap, Callable[[], ParamMap]],
                         *, joined: bool = False, dense: bool = False, dense_reason: str = "") -> torch.futures.Future:
        """Average a flat bucket holding several named tensors (what the DDP hook calls).

        Args:
            tensor: the flat bucket (1-D; float32/float16/bfloat16 compress, others go dense).
            index: the bucket's id (int); a bucket whose ``params`` change at the same index is a
                new layout (a DDP rebuild): residuals follow their names into it.
            params: ``[(name, offset, length)]`` in elements of ``tensor`` -- the third element
                may also be the tensor's shape or the tensor itself (e.g. the parameter), which
                the ``exempt`` rule then sees -- or a callable returning it. Parameters the rule
                exempts are averaged dense in the same call (the class doc's ``exempt``).
            joined: this rank has no data (DDP ``join()``): send exact zeros, keep the residuals.
            dense: send this call dense (e.g. a warm-up); its residuals are flushed into it.
            dense_reason: when not empty, why the bucket cannot be compressed (e.g. it holds the
                float32 view of complex parameters): it takes the dense path, as other dtypes do,
                with one warning per distinct reason.

        Returns:
            A Future holding ``tensor`` with the average. Raises as :meth:`allreduce`.
        """
        return self._reduce(tensor, ("index", int(index)), params, joined=joined, dense=dense,
                            dense_reason=dense_reason)

    def end_step(self) -> None:
        """End the current step: the next reduction starts step ``iter + 1`` -- unless the step
        failed (a call's Future raised), which is then tried again as the same step (``iter``
        stays; see "When a step fails" in the README)."""
        self._journal.end_step(self._advance)
        self._step_names.clear()

    def _advance(self) -> None:
        self.iter += 1

    def _rewind(self, step: int) -> None:
        """A failure landed after its step ended (journal): the step counter goes back to it."""
        self.iter = int(step)
        self._step_names.clear()

    def _attempt(self, key) -> Attempt:
        att = self._journal.attempt(self.iter, key)
        if att.rec is None:
            att.rec = self._stats.record(att.step)
        return att

    def _context(self, att: Attempt, key, scheme: str) -> str:
        return f"gradcomp: step {att.step}, {_label(key)} (codec {spec_of(self.codec_at(att.step))}, scheme {scheme})"

    def _failed(self, att: Attempt, key, scheme: str, e: BaseException) -> BaseException:
        """A call of ``att`` failed with ``e``: undo the step (the first failure) and return the
        error to raise, naming the step, the tensor or bucket, the codec and the scheme."""
        return fail_call(att, _label(key), self._context(att, key, scheme), e, self._stats,
                         "its residuals and step counter are")

    def _not_applied(self, att: Attempt, key, scheme: str) -> NotApplied:
        return not_applied(att, self._context(att, key, scheme))

    def _check(self, att: Attempt, key, tensor, route: Optional[_Route], scheme: str,
               codec: Optional[Codec], short: Optional[BaseException] = None, now: bool = False) -> Optional[PeerCheck]:
        """The ranks' call descriptors (:func:`gradcomp.torch.journal.peer_check`): the call's
        parameter map (exempt entries marked) and the codec of its step (``"dense"`` on a dense
        step of the ramp). ``short``: this rank could not allocate the route's buffers; ``now``:
        the route's buffers were allocated by this call (every rank's at the same call). With
        either the descriptors are compared at once, before anything is sent."""
        params = route.check_params() if route is not None else None
        shown = route.shown() if route is not None and route.scheme == scheme else {}
        spec = spec_of(codec)
        sig = (tensor.numel(), tensor.dtype, scheme, tuple(shown.items()), None if params is None else tuple(params),
               spec, short is not None)

        def make(now: bool) -> PeerCheck:
            return PeerCheck(self.group, self.world_size, tensor.device, step=att.step, key=key,
                             numel=tensor.numel(), dtype=tensor.dtype, params=params, spec=spec,
                             spec_hash=codec.spec_hash if codec is not None else 0, scheme=scheme,
                             late=None if now else self._stats.expect_check, alloc_failed=short is not None,
                             **shown)

        return peer_check(att, self._verified, key, sig, make, lambda e: self._failed(att, key, scheme, e),
                          now=now or short is not None)

    def _single(self, tensor, key) -> torch.futures.Future:
        """World size 1: nothing is sent and ``tensor`` is the average already. Said once; the
        call is accounted with the packet it would send (``sent_bytes`` 0; the ratios are the
        packet's, :func:`gradcomp.planner.summarize`)."""
        self._warn_once(("world1",), f"gradcomp: the process group has one rank: nothing is sent or compressed "
                                     f"(the tensors are returned as they are); stats() reports the packets codec "
                                     f"{self.codec.spec} would send")
        rec = self._stats.record(self.iter)
        codec = self.codec_at(self.iter)
        self._stats.set_codec(rec, spec_of(codec))
        supported = tensor.layout == torch.strided and tensor.dtype in SUPPORTED_DTYPES and codec is not None
        dense = planner.dense_bytes(tensor.numel(), tensor.dtype) if tensor.layout == torch.strided else 0
        packet = int(codec.packet_bytes(tensor.numel(), tensor.dtype)) if supported else dense
        self._stats.account(rec, {key[0]: key[1], "numel": tensor.numel(), "dtype": dtype_name(tensor.dtype),
                                  "scheme": LOCAL, "codec": spec_of(codec), "dense_bytes": dense,
                                  "packet_bytes": packet, "sent_bytes": 0.0, "ring_bytes": 0.0})
        return completed(tensor)

    def _reduce(self, tensor, key, params, joined=False, dense=False, dense_reason="") -> torch.futures.Future:
        fut = self._reduce_call(tensor, key, params, joined, dense, dense_reason)
        self._stats.returned()  # the caller has its Future: the step's report counts from here
        return fut

    def _reduce_call(self, tensor, key, params, joined, dense, dense_reason) -> torch.futures.Future:
        if self.world_size == 1:
            return self._single(tensor, key)
        self._load_restored(strict=True)
        att = self._attempt(key)
        codec = self.codec_at(att.step)  # the ramp's codec of this step (None: a dense step)
        self._stats.set_codec(att.rec, DENSE if dense or codec is None else codec.spec)
        if self._scale.due(self.iter):
            self._scale.follow(self.store, self.iter)
        kind = "bucket" if key[0] == "index" else "tensor"
        if tensor.layout != torch.strided or tensor.dtype not in SUPPORTED_DTYPES:
            self._fallback.add(key)
            self._warn_once(("dtype", tensor.dtype, tensor.layout),
                            f"gradcomp: {kind} of dtype {tensor.dtype} / layout {tensor.layout} takes the dense path")
            check = self._check(att, key, tensor, None, "dense", codec) if tensor.layout == torch.strided else None
            return self._dense(att, tensor, key, None, joined, check, codec)
        if dense_reason:
            self._fallback.add(key)
            self._routes.pop(key, None)
            self._warn_once(("reason", dense_reason), f"gradcomp: {_label(key)} takes the dense path: {dense_reason}")
            return self._dense(att, tensor, key, None, joined, self._check(att, key, tensor, None, "dense", codec),
                               codec)
        route = self._route(key, tensor, params, codec)
        if dense or route.scheme == "dense":
            return self._dense(att, tensor, key, route.full, joined,
                               self._check(att, key, tensor, route, "dense", codec), codec)
        fresh = route.ctx is None
        short = self._prepare(route)
        check = self._check(att, key, tensor, route, route.scheme, codec, short=short, now=fresh)
        if short is not None:  # every rank could not allocate (so no descriptor differed): all raise here
            raise self._failed(att, key, route.scheme, short)
        return self._compressed(att, tensor, key, route, joined, check)

    def _prepare(self, route: _Route) -> Optional[BaseException]:
        """A route's buffers, allocated before its first call sends anything: the scheme context
        (packet, received packets, accumulators), and (allocated and dropped) one decode workspace
        and the error-feedback residuals with their backups. Returns the allocation error (out of
        memory, :func:`try_allocate`) instead of raising it, so that the call's descriptor tells every rank (:class:`PeerCheck`
        ``alloc_failed``) and no rank is left waiting in a collective; other errors propagate."""
        if route.ctx is not None:
            return None
        lay = route.layout

        def make():
            ctx = SchemeContext.for_layout(route.scheme, route.codec, lay.numel, lay.dtype, lay.device,
                                           self.group, self.world_size, rank=self.rank, **route.options)
            if getattr(ctx, "dec_codec", None) is not None and getattr(ctx, "packet", None) is not None:
                ctx.dec_codec.workspace(ctx.packet)  # (hierarchical's inner contexts hold theirs)
            if self.error_feedback and "residual" in scheme_table.get(route.scheme).slots and lay.residual is None:
                # the residual slots and their backups the call's activate allocates: tried, dropped
                torch.empty(2 * len(self.store.slot_names) * lay.numel, dtype=torch.float32, device=lay.device)
            return ctx

        ctx, err = try_allocate(make)
        if err is None:
            route.ctx = ctx
        return err

    def _split(self, key, tensor, entries: list) -> Optional[_Split]:
        """How ``tensor``'s map divides between exempt and compressed parameters (cached per
        key), or None when no parameter with elements is exempt."""
        if self._exempt.exempts_nothing:
            return None
        flags = tuple(self._exempt(name, shape, obj) for name, _, _, shape, obj in entries)
        if not any(f and e[2] > 0 for f, e in zip(flags, entries)):
            return None
        sig = (tensor.numel(), tensor.dtype, str(tensor.device),
               tuple((name, off, n, f) for (name, off, n, _, _), f in zip(entries, flags)))
        sp = self._splits.get(key)
        if sp is None or sp.sig != sig:
            sp = self._splits[key] = _Split(key, tensor.numel(), tensor.dtype, tensor.device, entries, flags, sig)
        return sp

    def _route(self, key, tensor, params, codec: Optional[Codec]) -> _Route:
        if callable(params):
            params = params()
        entries = []
        for name, off, size in params:
            n, shape, obj = entry_size(size)
            entries.append((str(name), int(off), n, shape, obj))
        split = self._split(key, tensor, entries)
        if split is None:
            lay = self.store.layout(key, tensor.numel(), tensor.dtype, tensor.device,
                                    [(name, off, n) for name, off, n, _, _ in entries])
        else:
            lay = self.store.layout(key, split.comp_numel, tensor.dtype, tensor.device, split.comp_map)
        route = self._routes.get(key)
        if route is None or route.layout is not lay or route.codec is not codec or route.split is not split:
            if route is not None and route.layout is lay and route.codec is not codec:
                # a codec switch (the ramp) folds a server residual as a layout change does
                self.store.fold(lay)
            if codec is None:  # a dense step of the ramp
                scheme, options = DENSE, {}
            else:
                scheme = planner.choose_scheme(codec, lay.numel, lay.dtype, self.world_size, self.scheme,
                                               self.min_compress_numel, cost_model=self.cost_model,
                                               local_world_size=self.local_world_size)
                options = scheme_table.get(scheme).route(codec, lay.numel, lay.dtype, self._config(lay.device))
            desc = scheme_table.get(scheme)
            route = self._routes[key] = _Route(lay, scheme, options, codec, split)
            self._fallback.discard(key)
            wire = CAST_CODECS.get(codec.spec) if codec is not None else None
            if scheme != "dense" and wire is not None and lay.dtype in (torch.float16, torch.bfloat16):
                dt = dtype_name(lay.dtype)
                loss = ("" if wire == lay.dtype else
                        "; it also rounds every value to " + dtype_name(wire) +
                        (" (fewer mantissa bits)" if wire == torch.bfloat16 else " (overflows beyond 65504)"))
                self._warn_once(("cast16", codec.spec, lay.dtype),
                                f"gradcomp: codec {codec.spec} on a {dt} {_label(key).split()[0]} saves nothing "
                                f"(16 bits per element either way){loss}; use codec 'none' for the same bytes "
                                f"without a cast, or a smaller codec (e.g. 'topk:ratio=0.01')")
            words = desc.describe(route.options, self.world_size) if route.options else ""
            shown = f"{scheme} ({words})" if words else scheme
            ex = (f"; {len(split.ex_layout.params)} exempt parameters ({split.ex_numel} elements) dense"
                  if split is not None else "")
            log.info("gradcomp: %s layout: %d elements, %s, %d parameters, scheme %s (codec %s, W=%d)%s",
                     _label(key), lay.numel, dtype_name(lay.dtype), len(lay.params), shown,
                     spec_of(codec), self.world_size, ex)
            if (codec is not None and self.cost_model is not None and self.scheme == "auto"
                    and lay.numel >= max(1, self.min_compress_numel)):
                choice = self.cost_model.choose(codec, lay.numel, lay.dtype, self.world_size,
                                                local_world_size=self.local_world_size,
                                                min_compress_numel=self.min_compress_numel)
                log.info("gradcomp: %s layout: %s", _label(key), planner.choice_report(choice))
        return route

    def _bucket(self, key, tensor, scheme: str, route: Optional[_Route] = None, codec: Optional[Codec] = None,
                part: str = "") -> dict:
        """The stats dict of one call (or of one part of a call, ``part``: ``"compressed"`` /
        ``"exempt"``); bytes from the planner with the route's layout options (hierarchical:
        with ``inner``, ``local_world_size`` and the planner's ``intra_bytes`` /
        ``inter_bytes``); ``codec`` is the step's (``"dense"`` on a dense step of the ramp)."""
        b = {key[0]: key[1], "numel": tensor.numel(), "dtype": dtype_name(tensor.dtype),
             "scheme": scheme, "codec": spec_of(codec)}
        if part:
            b["part"] = part
        options = route.options if route is not None and route.scheme == scheme else {}
        if options:
            b.update(route.shown())
        b.update(planner.bucket_bytes(scheme, codec if codec is not None else self.codec, tensor.numel(),
                                      tensor.dtype, self.world_size, **options))
        return b

    def _dense(self, att: Attempt, tensor, key, lay: Optional[Layout], joined: bool, check: Optional[PeerCheck],
               codec: Optional[Codec] = None):
        rec = att.rec
        b = self._bucket(key, tensor, "dense", codec=codec)
        self._stats.account(rec, b)
        # parameters that go dense add their residual to the gradient they send (ResidualStore.flush);
        # a call of a step that already failed elsewhere changes no residual
        flushed = []
        if lay is not None and not joined and not att.failed:
            with self._journal.lock:
                flushed = self.store.flush(lay, tensor.view(-1))
                if flushed:
                    att.on_undo(functools.partial(self.store.unflush, flushed))
        undo_self = functools.partial(self.store.unflush, flushed) if flushed else None
        probe = self._stats.probe(rec, b, tensor.device, _label(key))

        def on_error(e):
            err = self._failed(att, key, "dense", e)
            if undo_self is not None:  # (again: the step may have failed elsewhere meanwhile)
                with self._journal.lock:
                    undo_self()
            return err

        try:
            fut = scheme_table.get("dense").run(tensor, self._dense_ctx, probe=probe, check=check)
        except Exception as e:  # noqa: BLE001 - the step fails: undone, raised with its context
            raise on_error(e) from e

        def done(out):
            with self._journal.lock:
                if att.failed:
                    if undo_self is not None:
                        undo_self()
                    raise self._not_applied(att, key, "dense")
                if flushed:
                    nf = torch.isfinite(out).logical_not().any()
                    self._stats.mark_nonfinite(rec, nf)
                    for k, pend in self.store.keep_flushed(flushed, nf):
                        self._stats.on_finite(rec, functools.partial(self.store.drop_pending, k, pend))
            return out

        return chain(fut, done, f"{_label(key)}: the dense allreduce", on_error=on_error, device=tensor.device)

    def _compressed(self, att: Attempt, tensor, key, route: _Route, joined: bool, check: Optional[PeerCheck]):
        """A compressed call: the route's scheme over the tensor -- or, when the route has a split
        (exempt parameters), the scheme over the compressed part and the ``dense`` scheme over the
        exempt part, both launched here (compressed first, every collective from the calling
        thread), one Future for both."""
        rec = att.rec
        lay = route.layout
        split = route.split
        codec = route.codec
        desc = scheme_table.get(route.scheme)
        # route.ctx: allocated by _prepare before the call's descriptor went out
        # the server residual (ResidualStore docstring): the scheme's server range (two_phase,
        # this rank's chunk; hierarchical with inner two_phase, this rank's piece of its node
        # chunk), folded with factor W
        piece = desc.server(route.ctx)
        server = None if piece is None else tuple(piece) + (self.world_size,)
        if self.error_feedback and "residual" in desc.slots:
            self.store.activate(lay, server=server)
        flat = tensor.view(-1)
        if joined:
            tensor.zero_()
        comp = tensor if split is None else split.take(flat, "compressed")
        b = self._bucket(key, comp, route.scheme, route, codec, "compressed" if split is not None else "")
        probe = self._stats.probe(rec, b, tensor.device, _label(key))
        # joined ranks send exact zeros and keep their worker residuals; under two_phase (and
        # hierarchical's inner two_phase) they still sum their chunk for the others, with its
        # server residual
        # a call of a step that already failed elsewhere runs its collectives (the ranks stay in
        # step) without error feedback, so it changes no residual
        if joined:
            names = ("server",) if server is not None else ()
        else:  # None: every slot of the layout; a scheme without a residual slot takes none
            names = None if "residual" in desc.slots else ()
        slots = None
        if self.error_feedback and names != () and not att.failed:
            with self._journal.lock:
                slots = self.store.slots(lay, names)
                if slots:
                    self.store.snapshot(lay, names)  # what a failed or (restore) non-finite step puts back
                    att.on_undo(functools.partial(self.store.restore, lay, names))
        undos = [functools.partial(self.store.restore, lay, names)] if slots else []
        ex = None
        flushed = []
        if split is not None:
            # exempt parameters hold no residual: one that still has one (it just became exempt)
            # adds it to the gradient it sends dense, as a parameter going dense does
            ex = split.take(flat, "exempt")
            if not joined and not att.failed:
                with self._journal.lock:
                    flushed = self.store.flush(split.ex_layout, ex)
                    if flushed:
                        att.on_undo(functools.partial(self.store.unflush, flushed))
                if flushed:
                    undos.append(functools.partial(self.store.unflush, flushed))
        scheme = route.scheme

        def undo_self():
            for fn in undos:
                fn()

        def on_error(e):
            err = self._failed(att, key, scheme, e)
            if undos:  # (again: the step may have failed elsewhere meanwhile)
                with self._journal.lock:
                    undo_self()
            return err

        route.ctx.key = (self.seed, att.step & 0xFFFFFFFF, _bucket_id(key))
        try:
            fut = desc.run(comp, route.ctx, slots, probe=probe, check=check)
        except Exception as e:  # noqa: BLE001 - the step fails: undone, raised with its context
            raise on_error(e) from e
        self._stats.account(rec, b)
        if split is not None:
            be = self._bucket(key, ex, "dense", codec=codec, part="exempt")
            try:
                fut_ex = scheme_table.get("dense").run(ex, self._dense_ctx, probe=self._stats.probe(
                    rec, be, tensor.device, _label(key) + " (exempt parameters)"))
            except Exception as e:  # noqa: BLE001 - as above (the compressed part is undone when it completes)
                raise on_error(e) from e
            self._stats.account(rec, be)
            parts = [fut, fut_ex]
            fut = torch.futures.collect_all(parts)  # completes when both have (with the first error)

        def done(_):
            if split is not None:
                for f in parts:
                    f.wait()  # (CUDA: the current stream waits for each part)
            with self._journal.lock:
                if att.failed:  # another call of the step failed: this one's residuals go back too
                    if undos:
                        undo_self()
                    raise self._not_applied(att, key, scheme)
                if split is not None:
                    split.put(flat, "compressed", comp)
                    split.put(flat, "exempt", ex)
                nf = torch.isfinite(tensor).logical_not().any()
                if slots:
                    self.store.settle(lay, nf, names)
                for k, pend in (self.store.keep_flushed(flushed, nf) if flushed else ()):
                    self._stats.on_finite(rec, functools.partial(self.store.drop_pending, k, pend))
                self._stats.mark_nonfinite(rec, nf)
            return tensor

        what = f"{_label(key)}: scheme {scheme!r}" + (" and the dense allreduce of its exempt parameters"
                                                       if split is not None else "")
        return chain(fut, done, what, on_error=on_error, device=tensor.device)

    def _warn_once(self, key, msg):
        """One warning per ``key`` (Python's warnings module: one line, filterable; not also a
        log record, which would print it twice when logging is not configured)."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=4)

    # -- introspection -------------------------------------------------------------------------
    def scheme_of(self, name: str) -> str:
        """The scheme ``allreduce(..., name)`` uses: ``"sum"``, ``"gather"``, ``"two_phase"``,
        ``"hierarchical"`` (its inner scheme: :meth:`layouts`) or ``"dense"``.

        Raises:
            KeyError: ``name`` has not been reduced yet.
        """
        key = ("name", name)
        route = self._routes.get(key)
        if route is not None:
            return route.scheme
        if key in self._fallback:
            return "dense"
        raise KeyError(f"scheme_of: no tensor named {name!r} has been reduced")

    def layouts(self) -> List[dict]:
        """The current layouts: ``[{"index" (bucket) or "name" (tensor), "numel", "dtype",
        "scheme", "codec", "params": [(name, offset, length)]}]`` (offsets and lengths in
        elements; ``scheme`` and ``codec``: of the most recent call's step, ``"dense"`` on a dense
        step of the ramp); a hierarchical layout also has ``"inner"`` (its scheme across nodes)
        and ``"local_world_size"``. A layout with exempt parameters also has ``"exempt"`` (their
        names, in map order) and ``"compressed_numel"`` (the elements of its compressed part,
        which ``scheme`` runs on and whose offsets ``server_residuals()`` and checkpoints use)."""
        out = []
        for key, r in self._routes.items():
            full = r.full
            d = {key[0]: key[1], "numel": full.numel, "dtype": dtype_name(full.dtype),
                 "scheme": r.scheme, "codec": spec_of(r.codec), "params": list(full.params)}
            if r.split is not None:
                d["exempt"] = [k for k, _, _ in r.split.ex_layout.params]
                d["compressed_numel"] = r.layout.numel
            d.update(r.shown())
            out.append(d)
        return out

    def server_residuals(self) -> List[dict]:
        """The server residuals of the two_phase layouts (this rank's chunk of each) and of the
        hierarchical layouts with inner two_phase (this rank's piece of its node chunk; world_size
        is the fold factor W there too):
        ``[{"index" (bucket) or "name" (tensor), "start", "count" (elements of the flat tensor),
        "world_size", "residual": float32 1-D copy of count elements}]``, in layout order;
        empty without two_phase or error feedback. Checkpoint loads not yet placed in a layout
        are not listed (they are in ``state_dict()["server_residuals"]``)."""
        self._load_restored(strict=True)
        out = []
        for lay, t in self.store.server_slots():
            start, count, world = lay.chunk
            out.append({lay.key[0]: lay.key[1], "start": start, "count": count, "world_size": world,
                        "residual": t.detach().clone()})
        return out

    def residual(self, name: str) -> torch.Tensor:
        """A float32 copy of ``name``'s (worker) residual: 1-D, numel elements (zeros when it has none).

        Raises:
            KeyError: ``name`` was never reduced nor loaded.
            ValueError: a pickled Compressor whose checkpoint does not match (see
                :meth:`load_state_dict`; it is loaded here when nothing loaded it before).
        """
        self._load_restored(strict=True)
        r = self.store.residual(name)
        if r is not None:
            return r
        known = self._names.get(name)
        if known is None:
            raise KeyError(f"residual: no tensor named {name!r} has been reduced or loaded")
        return torch.zeros(known[0], dtype=torch.float32, device=known[1])

    @property
    def nonfinite_steps(self) -> int:
        """Steps seen non-finite so far (read one step late)."""
        return self._stats.nonfinite_steps

    def stats(self) -> dict:
        """Byte and time accounting (the README's "The main job" and "DDP communication hook").

        Returns ``{"steps", "world_size", "codec", "nonfinite_steps", "step", "total", "buckets"}``:
        ``step`` (the most recent step) and ``total`` (all steps) hold ``numel``, ``dense_bytes``
        (bytes in the tensors' dtype), ``packet_bytes`` (this rank's packets; the tensor itself
        when dense; under two_phase its W chunk slots, W * P1), ``sent_bytes`` (bytes one rank
        sends: sum 2(W-1)/W * payload bytes, gather (W-1) * packet bytes, two_phase (W-1) * (P1 +
        P2), dense 2(W-1)/W * dense bytes), ``ring_bytes`` (2(W-1)/W * dense
        bytes), ``packet_ratio`` = packet/dense, ``wire_ratio`` = sent/ring, ``bits_per_element``
        = 8 * packet bytes / numel (:mod:`gradcomp.planner`), seconds ``encode_s``, ``decode_s``,
        ``comm_s`` (launch to completion as seen by the callback; CUDA: events read one step
        late), ``compressed_buckets`` and ``dense_buckets``; ``step["codec"]``: the codec that step
        ran (``"dense"`` for a dense step: a dense step of the ramp, the hook's ``start_iter``
        warm-up). ``buckets``: one dict per call of the most recent step (its ``index`` or
        ``name``, numel, dtype, scheme, codec, bytes, times; a hierarchical call adds ``inner``,
        ``local_world_size`` and the bytes sent inside and across nodes, ``intra_bytes`` /
        ``inter_bytes``, whose sum is its ``sent_bytes``: :func:`gradcomp.planner.
        hierarchical_bytes`); a bucket holding exempt parameters gives two dicts with ``"part"``
        ``"compressed"`` (its scheme over the compressed part) and ``"exempt"`` (scheme
        ``"dense"`` over the exempt elements: a dense ring allreduce's bytes).
        ``codecs``: ``{codec spec or "dense": {"steps", and the fields and ratios of "total"}}``,
        the totals split by the codec each step ran (a ramp's phases; dense steps counted as
        dense ring allreduces). ``failed_steps``: failed steps, left out of the totals. In a
        group of one nothing is sent: calls are accounted with the packets they would send
        (scheme ``"local (world size 1)"``, wire ratio = packet ratio).
        ``report``: the per-step report of the most recent closed step (a step closes when the
        next one starts; None before): its wall time split into compute and the encode,
        communication and decode that held the loop up, the network share, bytes per link
        level, achieved against the link's bandwidth (the cost model's), p50 / p99 call latency
        over the last 100 steps, the traffic matrix between ranks
        (:func:`gradcomp.torch.stats.step_report`; what ``log_file`` writes). ``time_split``:
        that split summed over the closed steps, with the run's ``network_share``.

        The totals cover the steps this object ran since it was built or unpickled (a pickle
        keeps them; :meth:`load_state_dict` does not: a resumed run counts from zero while
        ``iter`` continues). The README's "Reading stats()" says what each ratio means.

        Raises:
            gradcomp.CorruptPacketError: a corrupt packet seen by a CUDA decode (on_corrupt="raise").
        """
        return self._stats.summary()

    # -- loss scaling --------------------------------------------------------------------------
    def attach_grad_scaler(self, scaler) -> None:
        """Keep the residuals in the units of ``scaler``'s loss scale (dynamic loss scaling).

        With AMP the tensors reduced are the gradients of ``scaler.scale(loss)``, i.e. multiplied
        by the current scale S_t, so residuals kept from step t-1 are in units of S_{t-1}. From
        now on, the first reduction of each step multiplies every residual by ``S_t / S_prev``
        (float32 0-dim tensors read from the scaler's ``_scale`` tensor on its device: no host
        read, one extra pass over the residuals per step), S_prev being the scale the residuals
        are in (1 before any scaler). With GradScaler's power-of-two scales the rescaling is
        exact. A step the scaler skips has inf/NaN gradients, so its averaged result is
        non-finite and the residuals are restored to their value before the step (``nonfinite=
        "restore"``; ``"reset"`` zeroes them); the next step rescales them by the backed-off
        scale (e.g. 0.5). Call it when the tensors reduced are the scaled gradients (before
        ``scaler.unscale_``); ``state_dict()["grad_scale"]`` records the scale of the saved
        residuals; a pickle does not keep the scaler: attach it again after loading.

        Args:
            scaler: a ``torch.amp.GradScaler`` (``torch.cuda.amp.GradScaler`` and FSDP's
                ``ShardedGradScaler`` are subclasses), or None to detach (the residuals are
                then brought back to gradient units at the next step). A disabled scaler
                counts as scale 1.

        Raises:
            TypeError: ``scaler`` is not a GradScaler nor None.
        """
        self._scale.attach(scaler)

    @property
    def grad_scaler(self):
        """The attached GradScaler, or None."""
        return self._scale.scaler

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Per-rank state: ``{"version", "codec", "world_size", "rank", "iter", "error_feedback",
        "grad_scale", "scheme", "local_world_size", "inner_scheme", "residuals": {name: float32
        1-D tensor}, "server_residuals": [...]}``; only names that hold a residual appear;
        ``server_residuals`` lists the server residuals of two_phase (and hierarchical with inner
        two_phase) with their layouts (:meth:`gradcomp.torch.residuals.ResidualStore.server_state`:
        key, numel, dtype, parameter map, chunk, world size = fold factor, float32 tensor);
        ``scheme``, ``local_world_size`` (0: none), ``inner_scheme`` and ``ramp`` (``[[step,
        spec]]``) record the configuration (informational: residuals are owed gradient mass
        whatever the scheme or codec, so they load into any configuration and are not checked
        against these; a loaded ``iter`` picks the ramp's codec); ``grad_scale``
        (float) is the loss scale the residuals are in (1.0 without
        :meth:`attach_grad_scaler`; reading it is a host read of a device scalar, so do not
        call this inside a hook). Residuals differ per rank: save one file per rank.

        Raises:
            ValueError: a pickled Compressor whose checkpoint does not match (see
                :meth:`load_state_dict`; it is loaded here when nothing loaded it before).
        """
        self._load_restored(strict=True)
        return {"version": 1, "codec": self.codec.spec, "world_size": self.world_size, "rank": self.rank,
                "iter": self.iter, "error_feedback": self.error_feedback,
                "grad_scale": self._scale.value(),
                "scheme": self.scheme, "local_world_size": self.local_world_size, "inner_scheme": self.inner_scheme,
                "ramp": [list(e) for e in self._ramp.entries()],
                "residuals": self.store.state(), "server_residuals": self.store.server_state()}

    def mismatches(self, sd: dict) -> List[str]:
        """What in the ``state_dict()`` ``sd`` does not fit this compressor: ``["rank: saved 0,
        current 1 (...)", "codec: saved '...', current '...'", "error_feedback: ..."]`` (empty:
        it fits). Keys absent from ``sd`` are not compared; the rank is not compared when the
        world size differs (its residuals are dropped then). Codecs compare by canonical spec."""
        out = []
        same_world = int(sd.get("world_size", self.world_size)) == self.world_size
        if same_world and "rank" in sd and int(sd["rank"]) != self.rank:
            out.append(f"rank: saved {int(sd['rank'])}, current {self.rank} (residuals differ per rank: load the "
                       f"file this rank saved)")
        if "codec" in sd:
            saved = _canonical(sd["codec"])
            if saved != self.codec.spec:
                out.append(f"codec: saved {saved!r}, current {self.codec.spec!r}")
        if "error_feedback" in sd and bool(sd["error_feedback"]) != self.error_feedback:
            out.append(f"error_feedback: saved {bool(sd['error_feedback'])}, current {self.error_feedback}")
        return out

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Load a ``state_dict()`` of the same rank, bit-exact, with its step count and loss
        scale. With another world size the residuals are dropped (a warning), server residuals
        included. A residual lands where its name lives, or waits (on the device it was loaded
        to) for the first reduction of that name. Server residuals (two_phase) replace the
        current ones: restored bit-exact into a layout that matches the saved one (key, numel,
        dtype, parameter map, chunk), else folded into their parameters' residuals (W * server
        added to the worker residual of the same elements; :mod:`gradcomp.torch.residuals`).

        Args:
            sd: a ``state_dict()``.
            strict: True (default): a checkpoint saved by another rank, or with another codec
                (by canonical spec) or error_feedback setting raises ValueError naming saved and
                current values (see :meth:`mismatches`); False: a warning, and it is loaded.

        Raises:
            ValueError: (strict) a mismatch as above; a residual whose numel differs from its
                name's tensor; a server residual whose numel is not its chunk's count. Nothing is
                loaded then.
        """
        self._restored = None
        problems = self.mismatches(sd)
        if problems:
            msg = "load_state_dict: the checkpoint does not match this compressor: " + "; ".join(problems)
            if strict:
                raise ValueError(msg + ". Pass strict=False to load it anyway.")
            self._warn(f"gradcomp: {msg} (strict=False: loaded anyway)")
        res = sd.get("residuals", {})
        servers = sd.get("server_residuals", [])
        same_world = int(sd.get("world_size", self.world_size)) == self.world_size
        if not same_world:
            self._warn(f"gradcomp: checkpoint from world size {sd.get('world_size')} loaded at world size "
                       f"{self.world_size}: residuals dropped" + (" (server residuals too)" if servers else ""))
            res, servers = {}, []
        for e in servers:
            if e["residual"].numel() != int(e["count"]):
                raise ValueError(f"load_state_dict: server residual of {_label(tuple(e['key']))} has "
                                 f"{e['residual'].numel()} elements, its chunk has {int(e['count'])}")
        flat = {}
        for name, t in res.items():
            t = t.detach().to(dtype=torch.float32).reshape(-1)
            want = self._names[name][0] if name in self._names else self.store.length(name)
            if want is not None and t.numel() != want:
                raise ValueError(f"load_state_dict: residual {name!r} has {t.numel()} elements, its tensor has {want}")
            flat[name] = t
        self.iter = int(sd.get("iter", 0))
        gs = float(sd.get("grad_scale", 1.0))
        self._scale.unit = None if gs == 1.0 else torch.tensor(gs, dtype=torch.float32)
        self._scale.step = -1
        for name, t in flat.items():
            self.store.load(name, t)
            self._names.setdefault(name, (t.numel(), t.device))
        if same_world:
            self.store.load_server(servers)

    def _warn(self, msg: str) -> None:
        warnings.warn(msg, stacklevel=3)

    # -- the process group and pickling --------------------------------------------------------
    def set_process_group(self, group=None, strict: bool = True) -> None:
        """Reduce over ``group`` from now on (None: the default group), e.g. after unpickling a
        Compressor that ran on a subgroup (it comes back on the default group). Call it between
        steps. A pickled checkpoint not yet loaded is loaded now against ``group``, with the
        checks of :meth:`load_state_dict` (``strict`` as there); otherwise, with another world
        size the residuals are dropped (a warning).

        ``local_world_size`` is resolved again for the new group's size (the argument given, else
        ``LOCAL_WORLD_SIZE``) and hierarchical's process groups are created for it (every rank
        of ``group`` calls this at the same point).

        Raises:
            TypeError: ``group`` not None or a ProcessGroup.
            ValueError: (strict) the pickled checkpoint does not match, see :meth:`load_state_dict`;
                local_world_size does not divide the new world size (hierarchical: or is unknown).
        """
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"set_process_group: group={group!r}; accepted: None or a torch.distributed.ProcessGroup")
        world = dist.get_world_size(group)
        local = resolve_local_world_size(self._local_world_size_arg, world, self.scheme)
        if self._restored is None and world != self.world_size and self.store.state():
            self._warn(f"gradcomp: process group of world size {world} replaces world size {self.world_size}: "
                       f"residuals dropped")
            self.store = ResidualStore(self.nonfinite, self.store.slot_names)
        self.group, self.world_size, self.rank = group, world, dist.get_rank(group)
        self.local_world_size = local
        self._stats.world_size, self._stats.rank, self._stats.links = world, self.rank, self._link_rates()
        self._dense_ctx = SchemeContext(self.codec, group, world)
        self._routes.clear()
        self._verified.clear()  # the new group's ranks compare their call descriptors again
        self._prepare_schemes()
        self._load_restored(strict)

    def _load_restored(self, strict: bool) -> None:
        if self._restored is not None:
            sd = self._restored
            try:
                self.load_state_dict(sd, strict=strict)
            except Exception:
                self._restored = sd
                raise

    def _checkpoint(self) -> dict:
        """Everything but the process group and the scaler, for pickling (see the class doc)."""
        self._stats.settle()
        sd = self._restored if self._restored is not None else self.state_dict()
        return {"version": PICKLE_VERSION, "codec": self.codec.spec, "scheme": self.scheme,
                "error_feedback": self.error_feedback, "min_compress_numel": self.min_compress_numel,
                "nonfinite": self.nonfinite, "on_corrupt": self.on_corrupt, "log_every": self.log_every,
                "local_world_size": self._local_world_size_arg, "inner_scheme": self.inner_scheme,
                "cost_model": self.cost_model, "seed": self.seed, "explicit_group": self.group is not None,
                "exempt": self._picklable_exempt(), "ramp": self._ramp.entries(),
                "state": dict(sd, iter=self.iter), "stats": self._stats,
                "names": {k: (n, str(d)) for k, (n, d) in self._names.items()},
                "step_names": sorted(self._step_names)}

    def _picklable_exempt(self):
        """The ``exempt`` argument for a pickle: a callable that does not pickle (a lambda, a
        local function) is left out with a warning, and the loaded compressor uses the default
        rule, ``exempt=None``."""
        arg = self._exempt.arg
        if callable(arg):
            try:
                pickle.dumps(arg)
            except Exception:  # noqa: BLE001 - any pickling error: left out, said once
                log.warning("gradcomp: the exempt callable %r cannot be pickled (a lambda or a local function; use a "
                            "module-level function) and is left out: the loaded compressor uses exempt=None (fewer "
                            "than 2 dimensions); set .exempt again after loading", arg)
                return None
        return arg

    def _restore(self, d: dict) -> None:
        """Rebuild from :meth:`_checkpoint` on the default group; residuals wait in ``_restored``.
        Formats 1 and 2 load (1 has no local_world_size / inner_scheme / cost_model: their
        defaults; a local_world_size given as None is read from ``LOCAL_WORLD_SIZE`` again; a
        pickle without ``exempt`` / ``ramp``, from before they existed, compressed every parameter
        at every step with its codec: ``exempt=()``, no ramp)."""
        if not isinstance(d, dict) or d.get("version") not in (1, PICKLE_VERSION):
            raise ValueError(f"gradcomp: cannot unpickle a Compressor of format "
                             f"{d.get('version') if isinstance(d, dict) else type(d).__name__!r}; "
                             f"this version reads 1 and {PICKLE_VERSION}")
        if not dist.is_initialized():
            raise RuntimeError("gradcomp: unpickling a Compressor needs torch.distributed initialized "
                               "(dist.init_process_group) first")
        Compressor.__init__(self, d["codec"], d["scheme"], d["error_feedback"], None,
                            min_compress_numel=d["min_compress_numel"], nonfinite=d["nonfinite"],
                            on_corrupt=d["on_corrupt"], log_every=d["log_every"],
                            local_world_size=d.get("local_world_size"), inner_scheme=d.get("inner_scheme", "auto"),
                            cost_model=d.get("cost_model"), seed=d.get("seed", 0), exempt=d.get("exempt", ()),
                            ramp=d.get("ramp"))
        stats = d["stats"]
        stats.world_size, stats.rank = self.world_size, self.rank
        stats.links, stats.steps_of = self._link_rates(), self._steps_of
        self._stats = stats
        self._names = {k: (int(n), torch.device(dev)) for k, (n, dev) in d["names"].items()}
        self._step_names = set(d["step_names"])
        self.iter = int(d["state"].get("iter", 0))
        self._restored = d["state"]

    def __getstate__(self) -> dict:
        dropped = [what for what, held in (("process group", self.group is not None),
                                           ("GradScaler", self._scale.scaler is not None)) if held]
        if dropped:
            log.warning("gradcomp: the %s of a Compressor cannot be pickled and is left out; after loading "
                        "it is the default group / no scaler: call set_process_group(group) / "
                        "attach_grad_scaler(scaler) again", " and the ".join(dropped))
        return self._checkpoint()

    def __setstate__(self, d: dict) -> None:
        self._restore(d)
        if d["explicit_group"]:
            log.warning("gradcomp: Compressor restored on the default process group (world size %d); if it "
                        "ran on a subgroup, call set_process_group(group) before its first reduction (its "
                        "residuals are loaded then)", self.world_size)


def _canonical(spec: Any) -> str:
    """The canonical form of a codec spec (the string itself when it does not parse)."""
    try:
        return Codec(str(spec)).spec
    except Exception:  # noqa: BLE001 - a spec of another version: compared as written
        return str(spec)
