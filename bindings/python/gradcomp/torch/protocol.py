"""The compressor protocols: one interface every protocol implements, and one table.

A *protocol* is a way to average gradients over a process group: ``codec`` (any
:class:`gradcomp.Codec` through a scheme of :mod:`gradcomp.schemes`:
:class:`gradcomp.torch.Compressor`) and ``powersgd`` (low rank, two rounds over matrices:
:class:`gradcomp.torch.PowerSGDCompressor`; Vogels et al., NeurIPS 2019). Each implements
:class:`BaseCompressor` and adds one line to the table (:func:`add`) in its own module, naming
the spec families it takes, its compressor, its DDP state and hook and its ``register``; whatever
picks a protocol (``Compressor(spec)``, :func:`gradcomp.torch.register`) asks :func:`for_spec` /
:func:`for_state` instead of testing a spec prefix. ``gradcomp.torch`` imports every protocol's
module, so the table is complete once ``gradcomp.torch`` is imported.

Dependency direction: this module imports no protocol (each protocol's module imports it), so
there is no import circle between the compressor, the DDP hook and PowerSGD.
"""

import abc
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

import torch

CODEC = "codec"
"""The protocol of codec specs (every spec whose family no other protocol claims)."""


class BaseCompressor(abc.ABC):
    """What every compressor protocol implements (the README's "Compressed allreduce for any
    training loop"): the reductions, the step boundary, the accounting, the layouts, per-rank
    checkpoints, loss-scale tracking and what a corrupt packet does.

    Attributes every implementation has: ``world_size``, ``rank`` (ints), ``iter`` (steps
    completed), ``error_feedback`` (bool), ``spec`` (str: its canonical spec).
    """

    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, name: str) -> torch.futures.Future:
        """Average ``tensor`` (C-contiguous float32/float16/bfloat16, any shape) over the group
        in place, with the residual keyed by ``name``; the Future holds ``tensor``, bitwise
        identical on every rank. A name seen again in the same step starts a new step."""

    @abc.abstractmethod
    def allreduce_bucket(self, tensor: torch.Tensor, index: int, params, *, joined: bool = False,
                         dense: bool = False, dense_reason: str = "") -> torch.futures.Future:
        """Average a flat bucket holding several named tensors (what a DDP hook calls);
        ``params``: ``[(name, offset, length-or-shape)]`` in elements, or a callable returning it."""

    @abc.abstractmethod
    def end_step(self) -> None:
        """End the current step (a failed step is tried again as the same step)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Byte and time accounting: ``{"steps", "world_size", "codec", "step", "total",
        "buckets", ...}`` (:meth:`gradcomp.torch.Compressor.stats`)."""

    @abc.abstractmethod
    def layouts(self) -> List[dict]:
        """The current layouts: ``[{"index" or "name", "numel", "dtype", "scheme", "params"}]``."""

    @abc.abstractmethod
    def scheme_of(self, name: str) -> str:
        """The scheme ``allreduce(..., name)`` used (KeyError before its first call)."""

    @abc.abstractmethod
    def residual(self, name: str) -> torch.Tensor:
        """A float32 1-D copy of ``name``'s residual."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """This rank's state (residuals, counters, options); save one file per rank."""

    @abc.abstractmethod
    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Load a :meth:`state_dict` of the same rank, bit-exact (ValueError on a mismatch when strict)."""

    @abc.abstractmethod
    def attach_grad_scaler(self, scaler) -> None:
        """Keep the residuals in the units of ``scaler``'s loss scale (a ``torch.amp.GradScaler``;
        None detaches)."""

    @property
    @abc.abstractmethod
    def on_corrupt(self) -> str:
        """``"raise"`` or ``"log"``: what a corrupt packet seen by a CUDA decode does (settable)."""


@dataclass(frozen=True)
class Protocol:
    """One line of the protocol table.

    Attributes:
        name: ``"codec"`` or the protocol's spec family (``"powersgd"``).
        families: the spec names (the part before ``:``) it takes; empty for ``codec``, which
            takes every spec no other protocol claims, and :class:`gradcomp.Codec` objects.
        compressor: its :class:`BaseCompressor` class, built as ``compressor(spec, scheme,
            error_feedback, group, **options)``.
        state: its DDP hook state class (``CompressionState``, ``PowerSGDState``).
        hook: its DDP communication hook (``hook(state, bucket)``).
        register: ``register(ddp_model, spec, **kwargs) -> state``: a new state for the spec,
            registered on the model (what :func:`gradcomp.torch.register` calls).
        summary: one line: what it does, and its source.
    """

    name: str
    families: Tuple[str, ...]
    compressor: type
    state: type
    hook: Callable
    register: Callable
    summary: str = ""


_TABLE: Dict[str, Protocol] = {}


def add(p: Protocol) -> Protocol:
    """Add ``p`` to the table (its module calls this once, at import).

    Raises:
        ValueError: another protocol of that name, or a family another protocol claims.
        TypeError: ``p.compressor`` does not implement :class:`BaseCompressor`.
    """
    if not (isinstance(p.compressor, type) and issubclass(p.compressor, BaseCompressor)):
        raise TypeError(f"protocol {p.name!r}: compressor {p.compressor!r} is not a BaseCompressor subclass")
    old = _TABLE.get(p.name)
    if old is not None and old != p:
        raise ValueError(f"protocol {p.name!r} is in the table already")
    for q in _TABLE.values():
        clash = set(q.families) & set(p.families)
        if q.name != p.name and clash:
            raise ValueError(f"protocol {p.name!r}: families {sorted(clash)} belong to protocol {q.name!r}")
    _TABLE[p.name] = p
    return p


def names() -> Tuple[str, ...]:
    """The protocols, in the order they were added (``codec`` first)."""
    return tuple(_TABLE)


def get(name: str) -> Protocol:
    """The protocol ``name``.

    Raises:
        ValueError: an unknown name (the message lists the table).
    """
    try:
        return _TABLE[name]
    except KeyError:
        raise ValueError(f"protocol {name!r}; accepted: {', '.join(_TABLE)}") from None


def family(spec: Any) -> str:
    """The family of a spec string (``"powersgd"`` for ``"powersgd:rank=4"``); "" for anything else."""
    return spec.partition(":")[0].strip() if isinstance(spec, str) else ""


def for_spec(spec: Any) -> Protocol:
    """The protocol that takes ``spec`` (a spec string or a :class:`gradcomp.Codec`): the one
    whose families hold its family, else ``codec`` (whose compressor then checks the spec)."""
    f = family(spec)
    for p in _TABLE.values():
        if f and f in p.families:
            return p
    return get(CODEC)


def for_state(state: Any) -> Protocol:
    """The protocol whose DDP state class ``state`` is an instance of.

    Raises:
        TypeError: no protocol's state (the message names the accepted classes).
    """
    for p in _TABLE.values():
        if isinstance(state, p.state):
            return p
    raise TypeError(f"state={type(state).__name__}; accepted: "
                    f"{' or '.join('a ' + p.state.__name__ for p in _TABLE.values())}")


def check_allreduce_args(tensor, name) -> None:
    """The argument checks of every ``allreduce(tensor, name)`` (every protocol's).

    Raises:
        TypeError: ``name`` not a str, ``tensor`` not a torch.Tensor.
        ValueError: a non-contiguous or non-strided (sparse) tensor.
    """
    if not isinstance(name, str):
        raise TypeError(f"allreduce: name={name!r}; accepted: a str")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce: expected a torch.Tensor for {name!r}, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or not tensor.is_contiguous():
        raise ValueError(f"allreduce: tensor {name!r} (layout {tensor.layout}, shape {tuple(tensor.shape)}) "
                         f"is not a contiguous strided tensor; pass tensor.contiguous() and copy back")


class LossScale:
    """Residuals that follow a GradScaler's loss scale (shared by every protocol's
    ``attach_grad_scaler``). With AMP the tensors reduced are gradients of ``scaler.scale(loss)``,
    times the current scale S_t, so residuals kept from step t-1 are in units of S_{t-1}:
    :meth:`follow` (once per step, before anything reads a residual) multiplies every residual of
    ``store`` (:class:`gradcomp.torch.residuals.ResidualStore`) by ``S_t / S_prev`` on the device
    (float32 0-dim tensors read from the scaler's ``_scale``: no host read); a non-finite factor
    zeroes them. ``unit`` is the scale the residuals are in (None: 1)."""

    __slots__ = ("scaler", "unit", "step")

    def __init__(self):
        self.scaler = None
        self.unit = None  # float32 0-dim tensor, or None (scale 1)
        self.step = -1  # the step whose residuals were last brought to the scaler's scale

    def attach(self, scaler) -> None:
        """Raises TypeError: ``scaler`` is not a ``torch.amp.GradScaler`` nor None."""
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"attach_grad_scaler: expected a torch.amp.GradScaler or None, got "
                            f"{type(scaler).__name__}")
        self.scaler = scaler
        self.step = -1

    def due(self, step: int) -> bool:
        """Whether step ``step`` has not followed the scale yet (and there is anything to follow)."""
        return step != self.step and (self.scaler is not None or self.unit is not None)

    def follow(self, store, step: int) -> None:
        """Bring every residual of ``store`` from ``unit`` to the scaler's current scale."""
        self.step = step
        sc = self.scaler
        cur = None
        if sc is not None and sc.is_enabled():
            cur = getattr(sc, "_scale", None)
            if cur is None:  # the scaler has not scaled a loss yet: nothing to follow this step
                return
        if cur is None and self.unit is None:
            return
        new = cur.detach().to(torch.float32).reshape(()) if cur is not None else None
        old = self.unit
        if old is None:
            factor = new.clone()
        elif new is None:
            factor = torch.reciprocal(old)
        else:
            factor = new / old.to(new.device, non_blocking=True)
        factor = torch.where(torch.isfinite(factor), factor, torch.zeros_like(factor))
        store.scale_(factor)
        self.unit = None if new is None else new.clone()

    def value(self) -> float:
        """The scale the residuals are in, as a float (a host read of a device scalar)."""
        return 1.0 if self.unit is None else float(self.unit)
