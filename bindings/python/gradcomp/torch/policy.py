"""Policies every hook and compressor accepts: which parameters are exempt from compression, and
which codec runs at which step (a ramp).

- :class:`ExemptRule` (``exempt=``): the parameters that travel uncompressed. ``None`` (the
  default of the DDP hook and of FSDP2): those with fewer than 2 dimensions (biases, the weights of
  norms); a callable ``exempt(name, param_or_shape) -> bool``; or a collection of names and
  ``fnmatch`` patterns (``["*embed*", "head.weight"]``); an empty collection (``exempt=()``) exempts
  nothing. FSDP2 (:mod:`gradcomp.torch.fsdp`) adds its per-parameter ``min_compress_numel``; the
  DDP hook and :class:`gradcomp.torch.Compressor` apply ``min_compress_numel`` to the compressed
  part of a bucket instead. Why 1-D parameters by default: a large block's scale quantizes them
  badly (Baidu LoongForge's FP8 DDP hook cut its mean relative error from 10.87% to 2.13% by
  exempting them).
- :class:`Ramp` (``ramp=``): ``[(step, spec), ...]``: from step ``step`` on the codec is ``spec``
  (``"dense"``: the dense path), e.g. DGC's density warm-up ``[(0, "topk:ratio=0.25"), (50,
  "topk:ratio=0.0625"), (100, "topk:ratio=0.015625")]`` (Lin et al., ICLR 2018) or a bit-width ramp
  ``[(0, "fp16"), (100, "int8"), (200, "int4")]``; before the first entry the base codec runs.

Both are plain values (pickled with the compressor that holds them: a callable pickles by
reference, so it must be a module-level function).
"""

import bisect
import collections.abc
import fnmatch
import operator
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from ..codec import Codec

ExemptArg = Union[None, Callable[[str, Any], bool], Iterable[str]]
"""``exempt=``: None (fewer than 2 dimensions), a callable ``(name, param_or_shape) -> bool``, or
names / fnmatch patterns (``()``: none)."""

RampArg = Optional[Sequence[Tuple[int, Any]]]
"""``ramp=``: ``[(step, codec spec | gradcomp.Codec | "dense"), ...]`` or None."""

DENSE = "dense"
"""The ramp spec of the dense path (divide by W, SUM allreduce), and how stats name its steps."""


def _accepted(what: str) -> str:
    return (f"accepted: None (parameters with fewer than 2 dimensions), a callable ({what}, param_or_shape) -> bool, "
            f"or a collection of names / fnmatch patterns (() exempts nothing)")


class ExemptRule:
    """Which parameters are exempt from compression (module docstring), without any size rule.

    Args:
        exempt: None, a callable ``(name, param_or_shape) -> bool`` or a collection of names /
            fnmatch patterns (a single string is refused: ``exempt=["name"]``).
        what: how messages call a parameter's name (``"name"``; FSDP2: ``"fqn"``).

    Attributes:
        fn: the callable, or None.
        patterns: the names / patterns (a tuple), or None for the default rule or a callable.

    Raises:
        TypeError: another type (a string, a number, ...).
    """

    def __init__(self, exempt: ExemptArg = None, what: str = "name"):
        self.arg = exempt
        if exempt is None or callable(exempt):
            self.fn, self.patterns = exempt, None
        elif isinstance(exempt, (str, bytes)):
            raise TypeError(f"exempt={exempt!r}; {_accepted(what)}; a single name: exempt=[{exempt!r}]")
        else:
            try:
                self.patterns = tuple(str(p) for p in exempt)
            except TypeError:
                raise TypeError(f"exempt={exempt!r}; {_accepted(what)}") from None
            self.fn = None
            self.arg = self.patterns

    @property
    def exempts_nothing(self) -> bool:
        """``exempt=()``: every parameter is compressed."""
        return self.patterns is not None and not self.patterns

    def decide(self, name: str, ndim: Optional[int], obj: Any) -> bool:
        """Whether parameter ``name`` is exempt: ``fn(name, obj)`` for a callable, a match of any
        pattern (``fnmatch.fnmatchcase``) for a collection, else ``ndim < 2`` (a parameter whose
        dimensions are unknown, ``ndim`` None, is not exempt by the default rule)."""
        if self.fn is not None:
            return bool(self.fn(name, obj))
        if self.patterns is not None:
            return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)
        return ndim is not None and int(ndim) < 2

    def describe(self) -> str:
        """One line for logs: ``"fewer than 2 dimensions"``, ``"patterns ['*embed*']"``,
        ``"callable my_rule"`` or ``"none"``."""
        if self.fn is not None:
            return f"callable {getattr(self.fn, '__qualname__', type(self.fn).__name__)}"
        if self.patterns is not None:
            return f"patterns {list(self.patterns)}" if self.patterns else "none"
        return "fewer than 2 dimensions"


def entry_size(item: Any) -> Tuple[int, Optional[tuple], Any]:
    """The third element of a parameter map entry -- a length (an int), a shape (tuple, list,
    ``torch.Size``) or a tensor (a parameter, a gradient) -- as ``(length, shape or None, what
    a callable rule is given)``: the length itself, a ``torch.Size`` of the shape, or the tensor.

    Raises:
        TypeError: anything else (a bool included).
    """
    if isinstance(item, bool):
        raise TypeError(f"parameter map: {item!r} is not a length, a shape or a tensor")
    if hasattr(item, "numel") and hasattr(item, "shape") and not isinstance(item, tuple):
        return int(item.numel()), tuple(int(d) for d in item.shape), item  # a parameter or a gradient
    if isinstance(item, (tuple, list)):
        shape = tuple(int(d) for d in item)
        n = 1
        for d in shape:
            n *= d
        import torch

        return n, shape, torch.Size(shape)
    try:
        n = operator.index(item)
    except TypeError:
        raise TypeError(f"parameter map: {item!r} is not a length, a shape or a tensor") from None
    return int(n), None, int(n)


class Exemptions:
    """An :class:`ExemptRule` applied to parameter maps, with each decision cached per (name,
    shape) so that a callable runs once per parameter (what a compressor holds).

    Args:
        exempt: as :class:`ExemptRule`.
    """

    def __init__(self, exempt: ExemptArg = None):
        self.rule = ExemptRule(exempt)
        self._cache: Dict[tuple, bool] = {}

    @property
    def arg(self):
        """The argument as given (a collection as a tuple)."""
        return self.rule.arg

    @property
    def exempts_nothing(self) -> bool:
        return self.rule.exempts_nothing

    def __call__(self, name: str, shape: Optional[tuple], obj: Any) -> bool:
        """Whether ``name`` (of ``shape``; None: a bare length) is exempt."""
        if self.rule.exempts_nothing:
            return False
        key = (name, shape if shape is not None else ("len", obj))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self.rule.decide(name, None if shape is None else len(shape), obj)
        return hit

    def exempted(self) -> List[str]:
        """The names decided exempt so far, sorted."""
        return sorted({k[0] for k, v in self._cache.items() if v})


class Ramp:
    """The codec of each step (module docstring).

    Args:
        ramp: ``[(step, spec), ...]`` with steps strictly increasing ints >= 0 and each spec a
            codec spec, a :class:`gradcomp.Codec` or ``"dense"``; None or empty: ``base`` at every
            step.
        base: the :class:`gradcomp.Codec` of the steps before the first entry.

    Raises:
        ValueError: ``ramp`` not a list of pairs, a step that is not an int >= 0 or not above the
            one before, a spec that does not parse; the message names the entry (its index and
            value).
    """

    def __init__(self, ramp: RampArg, base: Codec):
        self.base = base
        self.steps: List[int] = []
        self.codecs: List[Optional[Codec]] = []  # None: dense
        if ramp is None:
            return
        if isinstance(ramp, (str, bytes, dict)) or not isinstance(ramp, collections.abc.Iterable):
            raise ValueError(f"ramp={ramp!r}; accepted: a list of (step, codec spec) pairs, e.g. "
                             f"[(0, 'topk:ratio=0.25'), (100, 'topk:ratio=0.01')], or None")
        for i, entry in enumerate(list(ramp)):
            where = f"ramp entry {i} {entry!r}"
            if isinstance(entry, (str, bytes)) or not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise ValueError(f"{where}: accepted: a (step, codec spec) pair")
            step, spec = entry
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"{where}: the step {step!r} is not an int >= 0")
            if self.steps and step <= self.steps[-1]:
                raise ValueError(f"{where}: the step {step} does not follow the step {self.steps[-1]} of the entry "
                                 f"before (steps strictly increase)")
            if isinstance(spec, str) and spec.strip() == DENSE:
                codec = None
            elif isinstance(spec, Codec):
                codec = spec
            elif isinstance(spec, str):
                try:
                    codec = Codec(spec)
                except Exception as e:  # noqa: BLE001 - named with its entry
                    raise ValueError(f"{where}: the codec spec {spec!r} does not parse: {e}") from None
            else:
                raise ValueError(f"{where}: the codec {spec!r} is not a codec spec, a gradcomp.Codec or 'dense'")
            self.steps.append(int(step))
            self.codecs.append(codec)

    def __bool__(self) -> bool:
        return bool(self.steps)

    def at(self, step: int) -> Optional[Codec]:
        """The codec of step ``step`` (None: dense)."""
        i = bisect.bisect_right(self.steps, int(step)) - 1
        return self.base if i < 0 else self.codecs[i]

    def entries(self) -> List[Tuple[int, str]]:
        """``[(step, canonical spec or "dense")]`` (what is pickled and saved)."""
        return [(s, DENSE if c is None else c.spec) for s, c in zip(self.steps, self.codecs)]

    def all_codecs(self) -> List[Codec]:
        """Every codec that may run: the base codec (when a step runs it) and the ramp's."""
        out = [] if self.steps and self.steps[0] == 0 else [self.base]
        return out + [c for c in self.codecs if c is not None]


def spec_of(codec: Optional[Codec]) -> str:
    """A codec's canonical spec, ``"dense"`` for None."""
    return DENSE if codec is None else codec.spec
