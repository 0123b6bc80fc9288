"""The compressed allreduce for any hook or training loop: :class:`Compressor` (DESIGN.md section 6).

A Compressor owns one codec, the error-feedback residuals (:class:`ResidualStore`), the per-layout
scheme buffers and the step records (:class:`Stats`); it picks a scheme per tensor layout through
:func:`gradcomp.planner.choose_scheme` and runs it from :mod:`gradcomp.schemes`. The DDP hook
(:mod:`gradcomp.torch.hook`) is built on it, so both share one implementation of
encode / communicate / decode, error feedback, the non-finite rule and the accounting.

Sources: top-k sparsification with locally accumulated residuals: Aji & Heafield, "Sparse
Communication for Distributed Gradient Descent", EMNLP 2017; Lin et al., "Deep Gradient
Compression", ICLR 2018. Error feedback: Karimireddy et al., "Error Feedback Fixes SignSGD and
other Gradient Compression Schemes", ICML 2019. The dense and fp16 semantics follow PyTorch's
``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`` (allreduce_hook,
fp16_compress_hook).
"""

import functools
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import planner
from ..codec import Codec
from ..schemes import SCHEMES, SchemeContext
from ..schemes.context import completed
from .residuals import NONFINITE_MODES, Layout, ResidualStore
from .stats import CORRUPT_MODES, StepRecord, Stats

log = logging.getLogger("gradcomp")

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Dtypes that are compressed; others (float64, complex) and sparse tensors go dense."""

SCHEME_CHOICES = ("auto", "sum", "gather", "dense")

ParamMap = Sequence[Tuple[str, int, int]]


def check_options(*, scheme: str, nonfinite: str, ints: Sequence[Tuple[str, Any]], error_feedback: Any,
                  group: Any, group_arg: str = "group", on_corrupt: str = "raise") -> None:
    """Validate the options shared by :class:`Compressor` and the DDP hook's state, before any
    process-group call. ``ints`` are ``(name, value)`` pairs that must be integers >= 0.

    Raises:
        ValueError: unknown scheme, nonfinite or on_corrupt mode; a negative or non-integer int.
        TypeError: error_feedback not a bool; the group not None or a ProcessGroup.
    """
    if scheme not in SCHEME_CHOICES:
        raise ValueError(f"scheme={scheme!r}; accepted: {', '.join(SCHEME_CHOICES)}")
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


class _Route:
    """A layout with the scheme chosen for it and, once it compresses, its scheme buffers."""

    __slots__ = ("layout", "scheme", "ctx")

    def __init__(self, layout: Layout, scheme: str):
        self.layout = layout
        self.scheme = scheme
        self.ctx: Optional[SchemeContext] = None


def _label(key) -> str:
    kind, v = key
    return f"bucket {v}" if kind == "index" else f"tensor {v!r}"


class Compressor:
    """Compressed allreduce over a process group, with error feedback, for any loop or hook.

    Args:
        codec: codec spec (``"topk:ratio=0.01"``, ``"fp16"``, ``"bf16"``, ``"none"``; DESIGN.md
            section 3) or a :class:`gradcomp.Codec`.
        scheme: ``"sum"`` (linear codecs: one SUM allreduce of the packet's payload; encode divides
            by W), ``"gather"`` (any codec: all-gather the fixed-size packets, decode all W in
            rank order into one float32 accumulator, round once), ``"dense"`` (divide by W, SUM
            allreduce, as PyTorch's allreduce_hook) or ``"auto"`` (:func:`gradcomp.planner.
            choose_scheme`: sum for linear codecs; else gather when ``W * packet_bytes < 2 *
            dense_bytes``, else dense). The choice uses only numel, dtype, W and codec properties.
        error_feedback: keep a float32 residual per element (Karimireddy et al. 2019): encode sees
            ``x' = g + r`` and leaves ``r = x' - W * decode(packet)``, in gradient units.
        group: the ``torch.distributed`` process group (None: the default group).
        min_compress_numel: tensors/buckets with fewer elements go dense (default 1024).
        nonfinite: ``"restore"`` (default; a second residual copy) or ``"reset"``: the residuals
            of a tensor whose averaged result holds a non-finite value are restored to their value
            before the call, or zeroed -- decided on the device, no host synchronization.
        on_corrupt: ``"raise"`` (default) or ``"log"``: what a corrupt packet met by a CUDA decode
            does when its status word is read one step later (CPU decodes raise at once).
        log_every: log a stats line every N steps through ``logging.getLogger("gradcomp")``.

    Steps: a step ends at :meth:`end_step`, or when :meth:`allreduce` sees a name a second time
    (so a loop that reduces each name once per iteration needs no call). Records, the one-step-
    late reads and ``state_dict()["iter"]`` count steps.

    Non-finite results: every rank sees the same averaged tensor, so every rank decides alike;
    the result is returned as is (without a GradScaler an optimizer applies it) and the step is
    logged and counted in ``stats()["nonfinite_steps"]`` one step late.

    Attributes:
        codec: the :class:`gradcomp.Codec`; world_size, rank: of ``group``.
        iter: steps completed (saved in ``state_dict()``).
        store: the :class:`gradcomp.torch.residuals.ResidualStore` holding the residuals.

    Raises:
        ValueError: unknown scheme / nonfinite / on_corrupt, ``scheme="sum"`` with a non-linear
            codec, a negative min_compress_numel or log_every.
        TypeError: error_feedback not a bool; group not a ProcessGroup.
        gradcomp.InvalidArgumentError: a bad codec spec.
    """

    def __init__(self, codec: Any, scheme: str = "auto", error_feedback: bool = True, group=None, *,
                 min_compress_numel: int = 1024, nonfinite: str = "restore", on_corrupt: str = "raise",
                 log_every: int = 0):
        check_options(scheme=scheme, nonfinite=nonfinite, error_feedback=error_feedback, group=group,
                      on_corrupt=on_corrupt,
                      ints=(("min_compress_numel", min_compress_numel), ("log_every", log_every)))
        self.codec = codec if isinstance(codec, Codec) else Codec(str(codec))
        self.linear = bool(self.codec.properties["linear"])
        if scheme == "sum" and not self.linear:
            raise ValueError(f"scheme='sum' needs a linear codec; {self.codec.spec} is not linear (use 'gather')")
        self.scheme = scheme
        self.error_feedback = error_feedback
        self.min_compress_numel = int(min_compress_numel)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.iter = 0  # steps completed
        self.store = ResidualStore(nonfinite)
        self._stats = Stats(self.world_size, self.codec.spec, nonfinite, on_corrupt, int(log_every))
        self._routes: Dict[tuple, _Route] = {}
        self._dense_ctx = SchemeContext(self.codec, group, self.world_size)
        self._warned: set = set()
        self._names: Dict[str, Tuple[int, torch.device]] = {}  # allreduce()/load names: numel, device
        self._fallback: set = set()  # keys that took the dense path for their dtype or layout
        self._step_names: set = set()

    nonfinite = property(lambda self: self.store.nonfinite, doc="``\"restore\"`` or ``\"reset\"`` (read-only).")
    log_every = property(lambda self: self._stats.log_every, doc="Steps between stats log lines (read-only).")

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
            identical on every rank. Errors of the collective or of decode are raised by
            ``wait()``.

        Raises:
            TypeError: ``tensor`` not a torch.Tensor or ``name`` not a str.
            ValueError: a non-contiguous or sparse tensor; ``name`` used before with another numel.
            gradcomp.CorruptPacketError: a corrupt packet seen by a CUDA decode of an earlier step
                (``on_corrupt="raise"``).
        """
        if not isinstance(name, str):
            raise TypeError(f"allreduce: name={name!r}; accepted: a str")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"allreduce: expected a torch.Tensor for {name!r}, got {type(tensor).__name__}")
        if tensor.layout != torch.strided or not tensor.is_contiguous():
            raise ValueError(f"allreduce: tensor {name!r} (layout {tensor.layout}, shape {tuple(tensor.shape)}) "
                             f"is not a contiguous strided tensor; pass tensor.contiguous() and copy back")
        n = tensor.numel()
        known = self._names.get(name)
        if known is not None and known[0] != n:
            raise ValueError(f"allreduce: tensor {name!r} has {n} elements, but {name!r} had {known[0]} "
                             f"before; one name per tensor")
        self._names[name] = (n, tensor.device)
        if name in self._step_names:
            self.end_step()
        self._step_names.add(name)
        return self._reduce(tensor, ("name", name), ((name, 0, n),))

    def allreduce_bucket(self, tensor: torch.Tensor, index: int, params: Union[ParamMap, Callable[[], ParamMap]],
                         *, joined: bool = False, dense: bool = False) -> torch.futures.Future:
        """Average a flat bucket holding several named tensors (what the DDP hook calls).

        Args:
            tensor: the flat bucket (1-D; float32/float16/bfloat16 compress, others go dense).
            index: the bucket's id (int); a bucket whose ``params`` change at the same index is a
                new layout (a DDP rebuild): residuals follow their names into it.
            params: ``[(name, offset, length)]`` in elements of ``tensor``, or a callable returning
                it (called only when the bucket gets a layout).
            joined: this rank has no data (DDP ``join()``): send exact zeros, keep the residuals.
            dense: send this call dense (e.g. a warm-up); its residuals are flushed into it.

        Returns:
            A Future holding ``tensor`` with the average. Raises as :meth:`allreduce`.
        """
        return self._reduce(tensor, ("index", int(index)), params, joined=joined, dense=dense)

    def end_step(self) -> None:
        """End the current step (the next reduction starts step ``iter + 1``)."""
        self.iter += 1
        self._step_names.clear()

    def _reduce(self, tensor, key, params, joined=False, dense=False) -> torch.futures.Future:
        if self.world_size == 1:
            return completed(tensor)
        rec = self._stats.record(self.iter)
        if tensor.layout != torch.strided or tensor.dtype not in SUPPORTED_DTYPES:
            self._fallback.add(key)
            kind = "bucket" if key[0] == "index" else "tensor"
            self._warn_once(("dtype", tensor.dtype, tensor.layout),
                            f"gradcomp: {kind} of dtype {tensor.dtype} / layout {tensor.layout} takes the dense path")
            return self._dense(rec, tensor, key, None, joined)
        route = self._route(key, tensor, params)
        if dense or route.scheme == "dense":
            return self._dense(rec, tensor, key, route.layout, joined)
        return self._compressed(rec, tensor, key, route, joined)

    def _route(self, key, tensor, params) -> _Route:
        if callable(params):
            params = params()
        lay = self.store.layout(key, tensor.numel(), tensor.dtype, tensor.device, params)
        route = self._routes.get(key)
        if route is None or route.layout is not lay:
            scheme = planner.choose_scheme(self.codec, lay.numel, lay.dtype, self.world_size, self.scheme,
                                           self.min_compress_numel)
            route = self._routes[key] = _Route(lay, scheme)
            log.info("gradcomp: %s layout: %d elements, %s, %d parameters, scheme %s (codec %s, W=%d)",
                     _label(key), lay.numel, str(lay.dtype).replace("torch.", ""), len(lay.params), scheme,
                     self.codec.spec, self.world_size)
        return route

    def _bucket(self, key, tensor, scheme: str) -> dict:
        """The stats dict of one call; bytes from the planner."""
        b = {key[0]: key[1], "numel": tensor.numel(), "dtype": str(tensor.dtype).replace("torch.", ""),
             "scheme": scheme}
        b.update(planner.bucket_bytes(scheme, self.codec, tensor.numel(), tensor.dtype, self.world_size))
        return b

    def _dense(self, rec: StepRecord, tensor, key, lay: Optional[Layout], joined: bool):
        b = self._bucket(key, tensor, "dense")
        self._stats.account(rec, b)
        # parameters that go dense add their residual to the gradient they send (DESIGN 4)
        flushed = self.store.flush(lay, tensor.view(-1)) if lay is not None and not joined else []
        probe = self._stats.probe(rec, b, tensor.device, _label(key))
        fut = SCHEMES["dense"](tensor, self._dense_ctx, probe=probe)
        if not flushed:
            return fut

        def done(f):
            out = f.value()
            nf = torch.isfinite(out).logical_not().any()
            self._stats.mark_nonfinite(rec, nf)
            for k, pend in self.store.keep_flushed(flushed, nf):
                self._stats.on_finite(rec, functools.partial(self.store.drop_pending, k, pend))
            return out

        return fut.then(done)

    def _compressed(self, rec: StepRecord, tensor, key, route: _Route, joined: bool):
        lay = route.layout
        if route.ctx is None:
            route.ctx = SchemeContext.for_layout(route.scheme, self.codec, lay.numel, lay.dtype, lay.device,
                                                 self.group, self.world_size)
        if self.error_feedback:
            self.store.activate(lay)
        b = self._bucket(key, tensor, route.scheme)
        probe = self._stats.probe(rec, b, tensor.device, _label(key))
        use_ef = self.error_feedback and not joined
        if use_ef:
            self.store.snapshot(lay)
        if joined:  # joined ranks send exact zeros and keep their residuals
            tensor.zero_()
        fut = SCHEMES[route.scheme](tensor, route.ctx, self.store.slots(lay) if use_ef else None, probe=probe)
        self._stats.account(rec, b)

        def done(f):
            f.value()  # re-raises an error of the collective or the decode
            nf = torch.isfinite(tensor).logical_not().any()
            if use_ef:
                self.store.settle(lay, nf)
            self._stats.mark_nonfinite(rec, nf)
            return tensor

        return fut.then(done)

    def _warn_once(self, key, msg):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=4)
            log.warning(msg)

    # -- introspection -------------------------------------------------------------------------
    def scheme_of(self, name: str) -> str:
        """The scheme ``allreduce(..., name)`` uses: ``"sum"``, ``"gather"`` or ``"dense"``.

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
        "scheme", "params": [(name, offset, length)]}]`` (offsets and lengths in elements)."""
        return [{key[0]: key[1], "numel": r.layout.numel, "dtype": str(r.layout.dtype).replace("torch.", ""),
                 "scheme": r.scheme, "params": list(r.layout.params)} for key, r in self._routes.items()]

    def residual(self, name: str) -> torch.Tensor:
        """A float32 copy of ``name``'s residual: 1-D, numel elements (zeros when it has none).

        Raises:
            KeyError: ``name`` was never reduced nor loaded.
        """
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
        """Byte and time accounting (DESIGN.md section 5).

        Returns ``{"steps", "world_size", "codec", "nonfinite_steps", "step", "total", "buckets"}``:
        ``step`` (the most recent step) and ``total`` (all steps) hold ``numel``, ``dense_bytes``
        (bytes in the tensors' dtype), ``packet_bytes`` (this rank's packets; the tensor itself
        when dense), ``sent_bytes`` (bytes one rank sends: sum 2(W-1)/W * payload bytes, gather
        (W-1) * packet bytes, dense 2(W-1)/W * dense bytes), ``ring_bytes`` (2(W-1)/W * dense
        bytes), ``packet_ratio`` = packet/dense, ``wire_ratio`` = sent/ring, ``bits_per_element``
        = 8 * packet bytes / numel (:mod:`gradcomp.planner`), seconds ``encode_s``, ``decode_s``,
        ``comm_s`` (launch to completion as seen by the callback; CUDA: events read one step
        late), ``compressed_buckets`` and ``dense_buckets``. ``buckets``: one dict per call of
        the most recent step (its ``index`` or ``name``, numel, dtype, scheme, bytes, times).

        Raises:
            gradcomp.CorruptPacketError: a corrupt packet seen by a CUDA decode (on_corrupt="raise").
        """
        return self._stats.summary()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Per-rank state: ``{"version", "codec", "world_size", "rank", "iter", "error_feedback",
        "residuals": {name: float32 1-D tensor}}``; only names that hold a residual appear.
        Residuals differ per rank: save one file per rank."""
        return {"version": 1, "codec": self.codec.spec, "world_size": self.world_size, "rank": self.rank,
                "iter": self.iter, "error_feedback": self.error_feedback, "residuals": self.store.state()}

    def load_state_dict(self, sd: dict) -> None:
        """Load a ``state_dict()`` of the same rank, bit-exact, and its step count. With another
        world size the residuals are dropped (a warning). A residual lands where its name lives,
        or waits (on the device it was loaded to) for the first reduction of that name.

        Raises:
            ValueError: a residual whose numel differs from its name's tensor (nothing is loaded).
        """
        res = sd.get("residuals", {})
        if int(sd.get("world_size", self.world_size)) != self.world_size:
            msg = (f"gradcomp: checkpoint from world size {sd.get('world_size')} loaded at world size "
                   f"{self.world_size}: residuals dropped")
            warnings.warn(msg)
            log.warning(msg)
            res = {}
        flat = {}
        for name, t in res.items():
            t = t.detach().to(dtype=torch.float32).reshape(-1)
            want = self._names[name][0] if name in self._names else self.store.length(name)
            if want is not None and t.numel() != want:
                raise ValueError(f"load_state_dict: residual {name!r} has {t.numel()} elements, its tensor has {want}")
            flat[name] = t
        self.iter = int(sd.get("iter", 0))
        for name, t in flat.items():
            self.store.load(name, t)
            self._names.setdefault(name, (t.numel(), t.device))
