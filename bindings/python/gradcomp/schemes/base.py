"""What a scheme is: the :class:`Scheme` description every entry of the scheme table
(:mod:`gradcomp.schemes.table`) has.

A scheme turns a codec into a compressed allreduce over ``torch.distributed``. Its description
says what the rest of gradcomp needs to know, so nothing outside the scheme's own file branches on
its name:

- ``run(tensor, ctx, slots=None, probe=None, check=None) -> torch.futures.Future``: average
  ``tensor`` over ``ctx.group`` in place (the contract of :mod:`gradcomp.schemes`);
- ``context(codec, numel, dtype, device, group, world_size, *, rank=None, divisor=None,
  **options)``: the buffers of one bucket layout (numel elements of dtype on device) -- the
  scheme's own small context class; ``options`` are the layout options of the scheme
  (``option_names``; hierarchical: ``local_world_size``, ``inner``, ``min_compress_numel``,
  ``engine``), the others are not passed;
- ``steps(codec, numel, dtype, world_size, **options) -> [(level, collective, nbytes, ranks,
  sent_bytes)]``: torch-free, the collectives one rank issues for a bucket, with level ``"flat"``
  (one ring over the group), ``"intra"`` or ``"inter"``, ``collective`` one of
  :data:`gradcomp.planner.COLLECTIVES`, ``nbytes`` the buffer of an allreduce / reduce-scatter,
  one rank's part of an all-gather, one slot of an all-to-all, ``ranks`` its group size and
  ``sent_bytes`` what this rank sends (bytes). The planner's byte accounting and cost model read
  these (:mod:`gradcomp.planner`); their primitives (ring formulas, chunking) live there;
- ``packet_bytes(codec, numel, dtype, world_size, **options) -> int``: the bytes this rank
  encodes into for a bucket (the ``packet_bytes`` of ``stats()``);
- ``kernels(codec, numel, dtype, world_size, throughput, error_feedback, **options) ->
  (encode_s, decode_s)``: torch-free, the seconds one rank spends in encode / decode kernels
  (``throughput`` has ``encode_s(codec, numel, dtype, error_feedback)`` and ``decode_s(codec,
  numel, dtype)``; hierarchical: its inner scheme's on one chunk);
- ``server(ctx) -> (start, count) | None``: the elements of the bucket this rank's server
  residual covers (schemes that re-encode a sum: two_phase), else None;
- ``route(codec, numel, dtype, config) -> dict``: the layout options of a new layout that runs
  this scheme (hierarchical: ``local_world_size``, ``inner``, ``engine``), from the compressor's
  ``config`` (:class:`RouteConfig`); the compressor keeps them with the layout and passes them
  to ``context``, ``steps`` and ``packet_bytes`` (default: none);
- ``describe(options, world_size) -> str``: the layout options in words, for the log line of a
  new layout (default: "");
- ``prepare(group, config)``: what the scheme must set up on every rank at the same point,
  outside any hook (hierarchical: its process groups); the compressor calls it at construction
  for the scheme it may run (default: nothing).

Units: elements for numel, start and count; bytes for everything named ``*bytes``; seconds.
"""

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional, Tuple

from ..planner.cost import COLLECTIVES

CODEC_KINDS = ("any", "linear", "sign")
"""What a scheme's ``codecs`` may be: ``"any"`` codec, only ``"linear"`` ones (a SUM on the wire:
``codec.properties["linear"]``), or only ``"sign"`` codecs (``onebit``: the majority vote counts
their signs)."""

_KIND_WORDS = {"linear": "a linear codec", "sign": "the onebit codec (signs)"}


def _always(codec) -> bool:
    return True


def _no_server(ctx) -> Optional[Tuple[int, int]]:
    return None


def _no_options(codec, numel, dtype, config) -> dict:
    return {}


def _no_words(options, world_size) -> str:
    return ""


def _nothing(group, config) -> None:
    return None


class RouteConfig(NamedTuple):
    """What a compressor tells a scheme's ``route`` and ``prepare`` (module docstring).

    Attributes:
        world_size: W, the group's size.
        local_world_size: L, ranks per node (0: not known).
        inner_scheme: the scheme asked for across nodes (``"auto"`` by default).
        min_compress_numel: layouts with fewer elements go dense.
        cost_model: a :class:`gradcomp.planner.CostModel`, or None.
        group: the process group (None: the default group).
        device: the layout's device (None in ``prepare``).
    """

    world_size: int
    local_world_size: int = 0
    inner_scheme: str = "auto"
    min_compress_numel: int = 1024
    cost_model: Any = None
    group: Any = None
    device: Any = None


@dataclass(frozen=True)
class Scheme:
    """One entry of the scheme table (see the module docstring for the callables' contracts).

    Attributes:
        name: the scheme's name (``Compressor(scheme=name)``, ``stats()``, ``gradcomp-plan``).
        summary: one line for help texts and tables.
        run, context, steps, packet_bytes, kernels: the callables of the module docstring.
        collectives: the kinds of collective it issues (:data:`gradcomp.planner.COLLECTIVES`).
        codecs: ``"any"`` or ``"linear"`` (:data:`CODEC_KINDS`).
        slots: the error-feedback slots ``run`` reads and writes: ``"residual"`` (the worker
            residual, float32, numel elements) and ``"server"`` (float32, ``server(ctx)``'s count).
        server: see the module docstring (default: no server residual).
        flat: one ring over the whole group (not nodes): a candidate of ``auto`` and of
            hierarchical's inner scheme.
        candidate: ``candidate(codec) -> bool``: whether ``auto``'s cost model predicts it for
            this codec (flat schemes; default every codec it accepts). False for a scheme that
            runs only when asked for.
        option_names: the layout options ``context`` / ``steps`` / ``packet_bytes`` take.
        route, describe, prepare: see the module docstring.
        shown: the layout options that ``stats()`` buckets, ``layouts()`` and the ranks' call
            descriptors (:class:`gradcomp.schemes.check.PeerCheck`) carry (hierarchical:
            ``inner``, ``local_world_size``).
        requires: the :class:`RouteConfig` fields the scheme cannot run without (hierarchical:
            ``local_world_size``): asking for it without them is a ValueError.

    Raises (``__post_init__``):
        ValueError: an empty name, an unknown ``codecs`` kind or collective, an unknown slot.
    """

    name: str
    summary: str
    run: Callable[..., Any]
    context: Callable[..., Any]
    steps: Callable[..., list]
    packet_bytes: Callable[..., int]
    kernels: Callable[..., Tuple[float, float]]
    collectives: Tuple[str, ...]
    codecs: str = "any"
    slots: Tuple[str, ...] = ("residual",)
    server: Callable[[Any], Optional[Tuple[int, int]]] = _no_server
    flat: bool = True
    candidate: Callable[[Any], bool] = field(default=_always)
    option_names: Tuple[str, ...] = ()
    route: Callable[..., dict] = _no_options
    describe: Callable[[dict, int], str] = _no_words
    prepare: Callable[[Any, RouteConfig], None] = _nothing
    shown: Tuple[str, ...] = ()
    requires: Tuple[str, ...] = ()

    def __post_init__(self):
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"Scheme: name={self.name!r}; accepted: a Python identifier")
        if self.codecs not in CODEC_KINDS:
            raise ValueError(f"Scheme {self.name}: codecs={self.codecs!r}; accepted: {', '.join(CODEC_KINDS)}")
        bad = [c for c in self.collectives if c not in COLLECTIVES]
        if bad:
            raise ValueError(f"Scheme {self.name}: collectives {bad}; accepted: {', '.join(COLLECTIVES)}")
        bad = [s for s in self.slots if s not in ("residual", "server")]
        if bad:
            raise ValueError(f"Scheme {self.name}: slots {bad}; accepted: residual, server")
        bad = [s for s in self.requires if s not in RouteConfig._fields]
        if bad:
            raise ValueError(f"Scheme {self.name}: requires {bad}; accepted: {', '.join(RouteConfig._fields)}")
        bad = [s for s in self.shown if s not in self.option_names]
        if bad:
            raise ValueError(f"Scheme {self.name}: shown {bad} are not among its option_names")

    def accepts(self, codec) -> bool:
        """Whether the scheme can run ``codec`` (a linear-only scheme needs a linear codec, a
        sign scheme the onebit codec)."""
        if self.codecs == "sign":
            return codec.spec.partition(":")[0] == "onebit"
        return self.codecs == "any" or bool(codec.properties["linear"])

    def needs(self) -> str:
        """What the scheme's ``codecs`` kind asks for, in words (for the refusal of a codec)."""
        return _KIND_WORDS.get(self.codecs, "any codec")

    def options(self, **given) -> dict:
        """The entries of ``given`` that are this scheme's layout options."""
        return {k: v for k, v in given.items() if k in self.option_names}
