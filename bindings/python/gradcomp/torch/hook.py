"""The gradcomp DDP communication hook and its state.

One :class:`CompressionState` per DDP model and process; :func:`compression_hook` is registered with
``ddp_model.register_comm_hook(state, compression_hook)`` (PyTorch's DDP comm-hook contract: called
once per bucket per synchronized backward, in bucket index order, must return a
``torch.futures.Future`` holding a tensor of the bucket's numel; with a hook registered DDP does not
divide by the world size, the hook averages). The README's "DDP communication hook" section is the
user guide.

This module is the DDP-specific orchestration only: parameter names from the model, bucket ->
parameter map, the dense warm-up (``start_iter``), ``join()`` detection, complex buckets, binding
a pickled state to a new model. The compressed allreduce itself -- schemes, error feedback, the
non-finite rule, loss-scale tracking, accounting -- is the state's
:class:`gradcomp.torch.Compressor` (``state.compressor``).

Sources: PyTorch ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`` (allreduce_hook,
fp16_compress_hook) and ``powerSGD_hook.py`` (error feedback state, start iteration, the pickled
state and its checkpoint recipe); Aji & Heafield 2017 and Lin et al. 2018 (top-k sparsification
with locally accumulated residuals); Karimireddy et al. 2019 (error feedback).

No annotation here uses ``from __future__ import annotations``: DDP's ``_check_comm_hook`` compares
the hook's annotations with the real classes.
"""

import logging
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..codec import _dtype_name as dtype_name
from . import protocol
from .compressor import Compressor, check_options
from .stats import check_log_file
from .policy import ExemptArg, RampArg

log = logging.getLogger("gradcomp")

PICKLE_VERSION = 1


def _model_kind(model) -> str:
    """What ``model`` is, for the TypeError of :func:`check_ddp_model`."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        FullyShardedDataParallel = ()
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch before fully_shard
        FSDPModule = ()
    name = type(model).__name__
    if FullyShardedDataParallel and isinstance(model, FullyShardedDataParallel):
        return ("a FullyShardedDataParallel (FSDP1) model, which gradcomp does not support; shard it with "
                "FSDP2's fully_shard and use gradcomp.torch.fsdp.register(model, codec)")
    if FSDPModule and isinstance(model, FSDPModule):
        return (f"a module sharded by fully_shard (FSDP2, {name}): use gradcomp.torch.fsdp.register(model, codec), "
                f"which compresses FSDP2's reduce-scatter (and, with replicate_group=, the all-reduce between replicas)")
    if isinstance(model, torch.nn.Module):
        return (f"a plain torch.nn.Module ({name}): wrap it first, "
                f"torch.nn.parallel.DistributedDataParallel(model)")
    return f"{name}"


def check_ddp_model(model, what: str) -> None:
    """Raise TypeError unless ``model`` is a ``torch.nn.parallel.DistributedDataParallel`` (or a
    subclass), saying what it is and what to use instead.

    Raises:
        TypeError: a FullyShardedDataParallel (FSDP1) model, a ``fully_shard`` (FSDP2) module, a
            plain ``torch.nn.Module``, or anything else.
    """
    if isinstance(model, DistributedDataParallel):
        return
    raise TypeError(f"{what}: expected a torch.nn.parallel.DistributedDataParallel model, got "
                    f"{_model_kind(model)}. For a training loop of your own (or DeepSpeed, a hook "
                    f"of another framework), use gradcomp.torch.Compressor: comp.allreduce(p.grad, name) "
                    f"averages any tensor with the same codecs and error feedback.")


def hook_joins(state, ddp_model) -> None:
    """Mark hook calls made for a joined rank: DDP's join hook replays the comm hook on zero
    buckets through ``ddp._match_all_reduce_for_bwd_pass``; wrap that method on this instance so
    that ``state._joined`` is True during those calls (any hook state with a ``_joined``
    attribute; binding another state to the same model moves the mark to it)."""
    inner = getattr(ddp_model, "_match_all_reduce_for_bwd_pass", None)
    if inner is None:
        return
    if getattr(inner, "_gradcomp_wrapped", False):  # bound before: the wrapper marks this state now
        inner._gradcomp_state[0] = state
        return
    states = [state]

    def wrapped(*args, **kwargs):
        st = states[0]
        st._joined = True
        try:
            return inner(*args, **kwargs)
        finally:
            st._joined = False

    wrapped._gradcomp_wrapped = True
    wrapped._gradcomp_state = states
    object.__setattr__(ddp_model, "_match_all_reduce_for_bwd_pass", wrapped)


class CompressionState:
    """State of the gradcomp DDP communication hook for one DDP model on one rank.

    Args:
        ddp_model: the ``torch.nn.parallel.DistributedDataParallel`` model; its parameter names
            key ``state_dict()``.
        codec: codec spec, e.g. ``"topk:ratio=0.01"``, ``"fp16"``, ``"bf16"``, ``"none"`` (the
            README's "What is here" table, ``gradcomp.codecs()``), or a :class:`gradcomp.Codec`.
            Required: there is no default codec (as PyTorch's hooks have no lossy default).
        error_feedback: keep a float32 residual per gradient element (Karimireddy et al. 2019):
            encode sees ``x' = g + r`` and leaves ``r = x' - W * decode(packet)``, i.e. exactly what
            this rank did not send, in gradient units (before the division by W).
        scheme: ``"sum"`` (linear codecs: one SUM allreduce of the packet's payload; encode divides
            by W), ``"gather"`` (any codec: all-gather the fixed-size packets; every rank decodes all
            W packets in rank order into one float32 accumulator, then rounds once into the bucket),
            ``"two_phase"`` (any codec: the bucket cut into W chunks, one all-to-all of their
            packets, each rank sums its chunk in float32 in rank order and re-encodes it with its
            server residual, one all-gather, decode: DeepSpeed 1-bit Adam's compressed allreduce,
            Tang et al. 2021, and ZeRO++ qgZ, Wang et al. 2023), ``"hierarchical"`` (nodes of
            ``local_world_size`` ranks: uncompressed float32 reduce-scatter inside the node, an
            allreduce on gloo; ``inner_scheme`` across nodes for this rank's chunk of the node
            sum; all-gather inside the node: :mod:`gradcomp.schemes.hierarchical`), ``"dense"``
            (plain allreduce of the bucket divided by W, like PyTorch's allreduce_hook) or
            ``"auto"``: with ``cost_model`` the scheme of least predicted time; else ``sum`` for
            linear codecs; ``gather`` for sparse ones (top-k) when it sends fewer bytes than a
            dense ring allreduce (``W * packet_bytes < 2 * dense_bytes``); ``two_phase`` for the
            others (the quantizers) when it does; else dense. The choice uses only numel, dtype,
            W, L, codec properties and the cost model's configuration, so every rank agrees
            (:func:`gradcomp.planner.choose_scheme`).
        start_iter: synchronized steps (hook calls on the last bucket) sent dense before
            compression starts (default 0). Buckets are rebuilt by DDP after the first step; the
            residuals follow the parameters into the new layout, so 0 is safe.
        min_compress_numel: buckets with fewer elements are sent dense (default 1024).
        nonfinite: ``"restore"`` (default; keeps a second residual copy) or ``"reset"``: what
            happens to the residuals of a step whose averaged result holds a non-finite value.
        process_group: the group to reduce over; default: the DDP model's group.
        log_every: log a stats line through ``logging.getLogger("gradcomp")`` at INFO every N
            steps (0: never); when logging is not configured a stderr handler is attached to that
            logger once (see :class:`gradcomp.torch.Compressor`).
        log_file: None, or a path (``{rank}`` replaced by the rank) to which the step report of
            every ``log_every``-th step is appended as a JSON line instead of the log line
            (:class:`gradcomp.torch.Compressor`'s ``log_file``; ``gradcomp-report`` reads it).
        local_world_size: ranks per node L for ``"hierarchical"`` (nodes of L consecutive ranks
            of the process group); None (default): the ``LOCAL_WORLD_SIZE`` environment variable
            (torchrun sets it). Must divide the world size.
        inner_scheme: hierarchical's scheme across nodes: ``"auto"`` (default;
            :func:`gradcomp.planner.hierarchical_inner`), ``"dense"``, ``"sum"`` (linear codecs),
            ``"gather"`` or ``"two_phase"``.
        cost_model: a :class:`gradcomp.planner.CostModel` for ``"auto"``, or None.
        seed: the key seed of codecs that draw random numbers (:class:`Compressor`; default 0).
        exempt: the parameters averaged dense instead of compressed (:mod:`gradcomp.torch.policy`;
            the semantics of FSDP2's ``exempt``): None (default) -- those with fewer than 2
            dimensions (biases, the weights of norms: a large block's scale quantizes them badly),
            a callable ``exempt(name, param) -> bool`` (called once per parameter), a collection
            of parameter names / ``fnmatch`` patterns (``["*embed*"]``), or ``()``: compress
            every parameter. A bucket holding exempt parameters is one hook call: their elements
            are divided by W and SUM-allreduced (``allreduce_hook``'s arithmetic), the others
            compressed (the scheme chosen for their count; below ``min_compress_numel`` the whole
            bucket goes dense), and the returned Future completes when both have. Exempt
            parameters hold no residual (one that had a residual adds it to its dense gradient).
        ramp: ``[(step, spec), ...]``: from synchronized step ``step`` on the codec is ``spec``
            (a codec spec or ``"dense"``), e.g. DGC's density warm-up ``[(0, "topk:ratio=0.25"),
            (50, "topk:ratio=0.0625"), (100, "topk:ratio=0.015625")]`` or a bit-width ramp
            ``[(0, "fp16"), (100, "int8"), (200, "int4")]``; ``codec`` runs before the first
            entry; ``[(0, "dense"), (k, codec)]`` is ``start_iter=k``. Every rank switches at the
            same step (``iter``); residuals carry over (:class:`gradcomp.torch.Compressor`).

    Server residuals (two_phase): each rank keeps a float32 residual for its chunk of each
    bucket layout (``state.compressor.server_residuals()``). Chunk boundaries are bucket offsets,
    so when DDP rebuilds a bucket, or a bucket goes dense, W * server residual is added to this
    rank's worker residual of the same elements (their parameters') and the new layout's server
    residual starts at zero: nothing is lost, the next encode sends it. Checkpoints save it with
    its layout: restored bit-exact into the same layout, folded the same way into another (a new
    DDP model's first step runs in DDP's initial buckets, so a checkpoint taken after a rebuild
    that changed them is folded there); dropped with the other residuals at another world size
    (:mod:`gradcomp.torch.residuals`).

    Averaging: the ``gather`` scheme encodes with ``divisor=W`` (so the packets carry
    ``fl(x'/W)``) and decodes with ``alpha=1``: the bucket receives ``round(sum_r fl(x'_r / W))``,
    summed in float32 in rank order 0..W-1. The ``sum`` scheme also divides by W at encode (fp16
    does not overflow when |g| > 65504 but |g|/W fits). The dense path divides the bucket by W,
    then SUM-allreduces (as ``allreduce_hook``).

    Non-finite steps: a step is non-finite iff the averaged bucket holds a non-finite value
    (decode also writes NaN into element 0 when any packet carries the non-finite flag), so all
    ranks decide alike; the residuals are then restored to their value before the step or zeroed,
    on device, without a host synchronization. Without a GradScaler the optimizer applies such a
    step (as without the hook). Non-finite steps are logged one step late. On CUDA a corrupt
    packet met by a decode raises ``gradcomp.CorruptPacketError`` one step late (the
    compressor's ``on_corrupt``).

    AMP: with a GradScaler, call :meth:`attach_grad_scaler` so the residuals follow the loss
    scale (steps the scaler skips leave them as they were).

    Joined ranks (``ddp_model.join()``) send exact zeros and keep their residuals. ``no_sync``
    needs nothing: the hook runs on synchronized steps only, on the accumulated gradient.

    Dense path: buckets of dtypes other than float32, float16, bfloat16, sparse buckets and
    buckets holding a complex parameter (DDP hands the hook their float32 ``view_as_real``,
    which a lossy codec would compress as unrelated reals) are averaged as ``allreduce_hook``
    does, with one warning. The ``fp16``/``bf16`` codecs on a float16/bfloat16 model save nothing
    (one warning). World size 1 returns the bucket unchanged.

    Checkpoints: :meth:`state_dict` / :meth:`load_state_dict` (residuals by parameter name, per
    rank, checked against rank, codec and error_feedback), or pickle the state itself as
    PyTorch's PowerSGDState (``torch.save({"state_dict": ddp.state_dict(), "comm_hook":
    compression_hook, "comm_hook_state": state}, f)``): config, residuals (bit-exact), ``iter``
    and stats travel; the DDP model, the process group and a GradScaler do not (a warning).
    After ``torch.load(f, weights_only=False)`` register the loaded state on a new DDP model with
    ``gradcomp.torch.register(new_ddp, state=loaded)`` or ``loaded.bind(new_ddp)`` followed by
    ``new_ddp.register_comm_hook(loaded, compression_hook)``.

    Attributes:
        compressor: the :class:`gradcomp.torch.Compressor` doing the work (e.g.
            ``state.compressor.on_corrupt = "log"``).
        start_iter: as above; ``iter``: synchronized steps seen.

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel (FSDP1, FSDP2 and plain modules
            are named, with what to use instead); a missing codec; error_feedback not a bool.
        ValueError: unknown scheme, inner_scheme or nonfinite mode, a ``sum`` scheme (or inner
            scheme) with a non-linear codec, negative start_iter / min_compress_numel; a
            local_world_size not dividing the world size, or ``scheme="hierarchical"`` with neither
            local_world_size nor LOCAL_WORLD_SIZE; a bad ramp entry (named).
        TypeError: exempt of another type (e.g. a single string: pass ``["name"]``).
        gradcomp.InvalidArgumentError: a bad codec spec.
    """

    def __init__(self, ddp_model, codec: Any, error_feedback: bool = True, scheme: str = "auto",
                 start_iter: int = 0, min_compress_numel: int = 1024, nonfinite: str = "restore",
                 process_group=None, log_every: int = 0, *, local_world_size: Optional[int] = None,
                 inner_scheme: str = "auto", cost_model=None, seed: int = 0, exempt: ExemptArg = None,
                 ramp: RampArg = None, log_file: Any = None):
        check_options(scheme=scheme, nonfinite=nonfinite, error_feedback=error_feedback,
                      group=process_group, group_arg="process_group",
                      ints=(("start_iter", start_iter), ("min_compress_numel", min_compress_numel),
                            ("log_every", log_every)))
        check_log_file(log_file, log_every)
        check_ddp_model(ddp_model, "CompressionState")
        self.start_iter = int(start_iter)
        self._group_given = process_group is not None
        group = process_group if process_group is not None else ddp_model.process_group
        # the hierarchical options travel only when given (their defaults live in the Compressor)
        extra = {k: v for k, v, given in (("local_world_size", local_world_size, local_world_size is not None),
                                          ("inner_scheme", inner_scheme, inner_scheme != "auto"),
                                          ("cost_model", cost_model, cost_model is not None),
                                          ("seed", seed, seed != 0), ("ramp", ramp, ramp is not None),
                                          ("log_file", log_file, log_file is not None)) if given}
        self.compressor = Compressor(codec, scheme, error_feedback, group,
                                     min_compress_numel=min_compress_numel, nonfinite=nonfinite,
                                     log_every=log_every, exempt=exempt, **extra)
        self._unbound()
        self._bind_model(ddp_model)

    def _unbound(self) -> None:
        self._names: Dict[int, str] = {}
        self._params_by_name: Dict[str, torch.nn.Parameter] = {}
        self._complex: Dict[int, str] = {}  # id -> "name: dtype" of complex parameters
        self._joined = False
        self._bound = False

    def _bind_model(self, ddp_model) -> None:
        module = ddp_model.module
        self._unbound()
        for name, p in module.named_parameters():
            self._names[id(p)] = name
            self._params_by_name[name] = p
            if p.is_complex():
                self._complex[id(p)] = f"{name}: {dtype_name(p.dtype)}"
        self._hook_joins(ddp_model)
        self._bound = True

    # -- configuration, read from the compressor -----------------------------------------------
    codec = property(lambda self: self.compressor.codec, doc="The :class:`gradcomp.Codec`.")
    linear = property(lambda self: self.compressor.linear, doc="Whether the codec is linear.")
    error_feedback = property(lambda self: self.compressor.error_feedback)
    scheme = property(lambda self: self.compressor.scheme, doc="The requested scheme (``auto`` included).")
    local_world_size = property(lambda self: getattr(self.compressor, "local_world_size", 0),
                                doc="Ranks per node for hierarchical (0: not known).")
    inner_scheme = property(lambda self: getattr(self.compressor, "inner_scheme", "auto"),
                            doc="Hierarchical's requested scheme across nodes.")
    min_compress_numel = property(lambda self: self.compressor.min_compress_numel)
    ramp = property(lambda self: self.compressor.ramp,
                    doc="The ramp, ``[(step, spec or \"dense\")]`` (empty: ``codec`` at every step).")

    @property
    def exempt(self):
        """The ``exempt`` argument (None: fewer than 2 dimensions). Settable between steps: a
        parameter that becomes exempt adds its residual to its dense gradient at its next step."""
        return self.compressor.exempt

    @exempt.setter
    def exempt(self, exempt) -> None:
        self.compressor.exempt = exempt

    def exempted(self) -> List[str]:
        """The parameters found exempt so far (names, sorted)."""
        return self.compressor.exempted()

    def codec_at(self, step: int):
        """The :class:`gradcomp.Codec` of synchronized step ``step`` (None: a dense step of the
        ramp; the ``start_iter`` warm-up is not a ramp step)."""
        return self.compressor.codec_at(step)
    nonfinite = property(lambda self: self.compressor.nonfinite)
    log_every = property(lambda self: self.compressor.log_every)
    log_file = property(lambda self: self.compressor.log_file)
    process_group = property(lambda self: self.compressor.group)
    world_size = property(lambda self: self.compressor.world_size)
    rank = property(lambda self: self.compressor.rank)
    nonfinite_steps = property(lambda self: self.compressor.nonfinite_steps,
                               doc="Non-finite steps seen so far (read one step late).")
    bound = property(lambda self: self._bound,
                     doc="Whether the state knows its DDP model (False after unpickling until :meth:`bind`).")

    @property
    def iter(self) -> int:
        """Synchronized steps seen (incremented after the hook call on the last bucket)."""
        return self.compressor.iter

    @iter.setter
    def iter(self, v: int) -> None:
        self.compressor.iter = int(v)

    def attach_grad_scaler(self, scaler) -> None:
        """Make the residuals follow ``scaler``'s loss scale (``torch.amp.GradScaler``; None
        detaches): with dynamic loss scaling the buckets hold gradients times the current scale,
        so the first bucket of each step multiplies every residual by new scale / old scale on
        the device (no host read), and a step the scaler skips (inf/NaN) leaves the residuals as
        they were before it. See :meth:`gradcomp.torch.Compressor.attach_grad_scaler`.

        Raises:
            TypeError: not a GradScaler nor None.
        """
        self.compressor.attach_grad_scaler(scaler)

    # -- binding to a DDP model (after unpickling) ---------------------------------------------
    def bind(self, ddp_model, process_group=None, strict: bool = True) -> "CompressionState":
        """Attach this state to ``ddp_model`` (a state loaded from a pickle knows no model), then
        register it with ``ddp_model.register_comm_hook(state, compression_hook)`` -- or use
        ``gradcomp.torch.register(ddp_model, state=state)``, which does both. DDP allows one hook
        per model, so bind a loaded state to a new DDP model (PowerSGDState's recipe).

        The state then reduces over ``process_group``, default: the DDP model's group (or, for a
        state built with an explicit ``process_group``, pass it again: groups cannot be
        pickled). Residuals of a pickled state are loaded now, with the checks of
        :meth:`load_state_dict` (``strict`` as there). Returns the state.

        Raises:
            TypeError: ``ddp_model`` is not a DistributedDataParallel.
            KeyError: a saved residual names no parameter of ``ddp_model``.
            ValueError: a residual's numel differs from its parameter's; (strict) the pickled
                state was saved by another rank, or with another codec or error_feedback.
        """
        check_ddp_model(ddp_model, "bind")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"bind: process_group={process_group!r}; accepted: None or a "
                            f"torch.distributed.ProcessGroup")
        group = process_group if process_group is not None else ddp_model.process_group
        pending = self.compressor._restored
        if pending is not None and int(pending.get("world_size", -1)) == dist.get_world_size(group):
            # residuals checked against the model, onto their parameters' devices
            params = dict(ddp_model.module.named_parameters())
            self.compressor._restored = dict(pending, residuals=self._check_residuals(pending.get("residuals", {}),
                                                                                       params),
                                             server_residuals=self._check_server(
                                                 pending.get("server_residuals", []), params))
        if process_group is None and self._group_given:
            log.warning("gradcomp: the state was built on an explicit process group, which is not saved; "
                        "bind(ddp_model, process_group=...) sets it, now the DDP model's group")
        self._group_given = process_group is not None
        self.compressor.set_process_group(group, strict=strict)
        self._bind_model(ddp_model)
        return self

    @staticmethod
    def _check_server(entries: list, params: dict) -> list:
        """Saved server residuals against the model's parameters: each entry's parameter names must
        be the model's (KeyError otherwise, as :meth:`_check_residuals`), its tensor moves to the
        device of its first parameter."""
        out = []
        for e in entries:
            names = [k for k, _, _ in e["params"]]
            for k in names:
                if k not in params:
                    raise KeyError(f"load_state_dict: server residual names no parameter {k!r} of this model")
            dev = params[names[0]].device if names else e["residual"].device
            out.append(dict(e, residual=e["residual"].detach().to(device=dev, dtype=torch.float32).reshape(-1)))
        return out

    @staticmethod
    def _check_residuals(res: dict, params: dict) -> dict:
        """``res`` ({name: tensor}) against the model's parameters: float32 1-D copies on each
        parameter's device. Raises KeyError / ValueError (see :meth:`load_state_dict`)."""
        moved = {}
        for name, t in res.items():
            p = params.get(name)
            if p is None:
                raise KeyError(f"load_state_dict: no parameter named {name!r} in this model")
            if t.numel() != p.numel():
                raise ValueError(f"load_state_dict: residual {name!r} has {t.numel()} elements, parameter has {p.numel()}")
            moved[name] = t.detach().to(device=p.device, dtype=torch.float32).reshape(-1)
        return moved

    def __getstate__(self) -> dict:
        log.warning("gradcomp: CompressionState pickled without its DDP model, process group%s (they "
                    "cannot be pickled); after loading, register it on a new DDP model with "
                    "gradcomp.torch.register(new_ddp, state=state) or state.bind(new_ddp)",
                    " and GradScaler" if self.compressor.grad_scaler is not None else "")
        return {"version": PICKLE_VERSION, "start_iter": self.start_iter, "group_given": self._group_given,
                "compressor": self.compressor._checkpoint()}

    def __setstate__(self, d: dict) -> None:
        if not isinstance(d, dict) or d.get("version") != PICKLE_VERSION:
            raise ValueError(f"gradcomp: cannot unpickle a CompressionState of format "
                             f"{d.get('version') if isinstance(d, dict) else type(d).__name__!r}; "
                             f"this version reads {PICKLE_VERSION}")
        self.start_iter = int(d["start_iter"])
        self._group_given = bool(d["group_given"])
        self.compressor = Compressor.__new__(Compressor)
        self.compressor._restore(d["compressor"])
        self._unbound()
        log.warning("gradcomp: CompressionState loaded on the default process group and without a DDP "
                    "model; register it on a new DDP model with gradcomp.torch.register(new_ddp, state=state) "
                    "or state.bind(new_ddp)%s", " (and pass process_group=: it was built on an explicit one)"
                    if self._group_given else "")

    # -- join() support ------------------------------------------------------------------------
    def _hook_joins(self, ddp_model):
        hook_joins(self, ddp_model)

    @property
    def joined(self) -> bool:
        """True while DDP replays the hook for this rank after it joined (``ddp_model.join()``):
        those calls send exact zeros and keep the residuals."""
        return self._joined

    # -- introspection -------------------------------------------------------------------------
    def param_name(self, param: torch.nn.Parameter) -> str:
        """The model's name of ``param`` (as ``named_parameters()`` and ``state_dict()`` give it).

        Raises:
            KeyError: ``param`` is not a parameter of the model.
        """
        try:
            return self._names[id(param)]
        except KeyError:
            raise KeyError(f"param_name: parameter of shape {tuple(param.shape)} is not in this model") from None

    def bucket_layouts(self) -> List[dict]:
        """The current bucket layouts, by bucket index: ``[{"index", "numel", "dtype", "scheme",
        "codec", "params": [(name, offset, length)]}]`` (offsets and lengths in elements of the
        bucket; ``scheme`` is the one used once compression is on, i.e. after ``start_iter``,
        for the codec of the most recent step); a bucket with exempt parameters also has
        ``"exempt"`` (their names) and ``"compressed_numel"`` (see :meth:`gradcomp.torch.
        Compressor.layouts`)."""
        return sorted((d for d in self.compressor.layouts() if "index" in d), key=lambda d: d["index"])

    def residual(self, param) -> torch.Tensor:
        """A float32 copy of the residual of ``param`` (a Parameter or its name): 1-D, numel
        elements, in the gradient's memory order; zeros when it has none.

        Raises:
            KeyError: a name that is not a parameter of the model.
            RuntimeError: the state is not bound to a model (unpickled: see :meth:`bind`).
        """
        self._need_model("residual")
        if isinstance(param, str):
            param = self._params_by_name[param]
        name = self._names.get(id(param))
        self.compressor._load_restored(strict=True)
        r = self.compressor.store.residual(name) if name is not None else None
        if r is None:
            return torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        return r

    def stats(self) -> dict:
        """Byte and time accounting (the README's "DDP communication hook"): see
        :meth:`Compressor.stats`; ``buckets`` holds one dict per bucket of the most recent step,
        with its ``index``."""
        return self.compressor.stats()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Per-rank state: ``{"version", "codec", "world_size", "rank", "iter", "error_feedback",
        "grad_scale", "residuals": {param name: float32 1-D tensor (numel, gradient memory
        order)}, "server_residuals": [two_phase server residuals with their bucket layouts, see
        :meth:`gradcomp.torch.Compressor.state_dict`]}``; only parameters that hold a residual
        appear. Residuals differ per rank: save
        one file per rank (``rank`` is checked on load). An unbound state (unpickled, see
        :meth:`bind`) returns the checkpoint it holds."""
        if not self._bound and self.compressor._restored is not None:
            return dict(self.compressor._restored, iter=self.iter)
        sd = self.compressor.state_dict()
        if self._bound:
            sd["residuals"] = {k: v for k, v in sd["residuals"].items() if k in self._params_by_name}
        return sd

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Load a ``state_dict()`` of the same rank, bit-exact, with ``iter`` and the loss scale.

        Args:
            sd: a ``state_dict()``.
            strict: True (default): a checkpoint saved by another rank (e.g. rank 0's file loaded
                on every rank), or with another codec (by canonical spec) or error_feedback
                setting raises ValueError naming saved and current values; False: a warning,
                and it is loaded. With another world size the residuals are dropped (a warning)
                either way.

        Raises:
            ValueError: (strict) a mismatch as above; a residual of the wrong numel.
            KeyError: a residual (or a server residual's parameter map) naming no parameter of
                the model.
            RuntimeError: the state is not bound to a model (see :meth:`bind`).
            Nothing is loaded when it raises.
        """
        self._need_model("load_state_dict")
        if int(sd.get("world_size", self.world_size)) == self.world_size:
            sd = dict(sd, residuals=self._check_residuals(sd.get("residuals", {}), self._params_by_name),
                      server_residuals=self._check_server(sd.get("server_residuals", []), self._params_by_name))
        self.compressor.load_state_dict(sd, strict=strict)

    def _need_model(self, what: str) -> None:
        if not self._bound:
            raise RuntimeError(f"gradcomp: {what}: this CompressionState has no DDP model (it was unpickled); "
                               f"register it on a new DDP model first: gradcomp.torch.register(new_ddp, state=state) "
                               f"or state.bind(new_ddp)")

    # -- the hook ------------------------------------------------------------------------------
    def __call__(self, bucket) -> torch.futures.Future:
        return self._hook(bucket)

    def _params(self, bucket) -> list:
        """The bucket's parameter map: ``[(name, offset, parameter)]`` (offsets in elements of its
        buffer; the parameter gives the length and, to the ``exempt`` rule, its dimensions; a
        parameter whose bucket view has another numel -- a complex one's ``view_as_real`` --
        gives that length instead)."""
        base = bucket.buffer().storage_offset()
        return [(self._names.get(id(p), f"<unnamed {id(p)}>"), g.storage_offset() - base,
                 p if p.numel() == g.numel() else g.numel())
                for p, g in zip(bucket.parameters(), bucket.gradients())]

    def _dense_reason(self, bucket) -> str:
        """Why ``bucket`` cannot be compressed ("" when it can): complex parameters. The text is
        the same for every bucket of the model, so the compressor warns once."""
        if not self._complex or not any(id(p) in self._complex for p in bucket.parameters()):
            return ""
        names = list(self._complex.values())
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
        return (f"it holds complex parameters (of this model: {shown}), which DDP hands the hook as their "
                f"float32 view (view_as_real); a lossy codec would compress real and imaginary parts as "
                f"unrelated values, so buckets holding one are averaged as allreduce_hook does")

    def _hook(self, bucket):
        self._need_model("the hook")
        fut = self.compressor.allreduce_bucket(bucket.buffer(), bucket.index(), lambda: self._params(bucket),
                                               joined=self._joined, dense=self.iter < self.start_iter,
                                               dense_reason=self._dense_reason(bucket))
        if bucket.is_last():
            self.compressor.end_step()
        return fut


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress ``bucket`` with ``state``'s codec and scheme.

    Register with ``ddp_model.register_comm_hook(state, compression_hook)``. Returns a Future
    holding ``bucket.buffer()`` (same numel and dtype), filled with the average over the process
    group, bitwise identical on every rank. See :class:`CompressionState`.

    Raises:
        RuntimeError: ``state`` is unpickled and not bound to a model (see
            :meth:`CompressionState.bind`).
    """
    return state._hook(bucket)


def register(ddp_model, codec: Any = None, *, state: Optional[CompressionState] = None,
             **kwargs) -> CompressionState:
    """Build a :class:`CompressionState` for ``ddp_model`` and register :func:`compression_hook`
    with it; or, with ``state=`` (e.g. loaded from a checkpoint), bind that state to
    ``ddp_model`` (:meth:`CompressionState.bind`) and register it. Returns the state.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        codec: the codec spec or :class:`gradcomp.Codec` (required unless ``state`` is given:
            there is no default codec), e.g. ``"none"``, ``"fp16"``, ``"bf16"``,
            ``"topk:ratio=0.01"``; or the spec of another protocol (:mod:`gradcomp.torch.protocol`'s
            table), e.g. ``"powersgd:rank=R"``, which registers :func:`gradcomp.torch.powersgd_hook`
            with a :class:`gradcomp.torch.PowerSGDState` (:func:`gradcomp.torch.powersgd.
            register_powersgd`) and returns that state.
        state: a CompressionState (or another protocol's state: a PowerSGDState) to register instead of a new one: e.g. a
            state loaded from a checkpoint, or the state of a DDP model whose step failed (DDP's
            reducer cannot go on after a failed backward: wrap the module in a new DDP model and
            register the same state on it; the failed step was undone).
        kwargs: the other arguments of :class:`CompressionState` (with ``state``: only
            ``process_group`` and ``strict``, as :meth:`CompressionState.bind` takes them).

    Raises:
        TypeError: ``ddp_model`` not a DistributedDataParallel (see :func:`check_ddp_model`);
            neither or both of ``codec`` and ``state``; ``state`` not a CompressionState or a
            PowerSGDState.
        RuntimeError: DDP's, when the model already has a hook (DDP allows one per model).
        ValueError, KeyError: as :class:`CompressionState` / :meth:`CompressionState.bind`.
    """
    check_ddp_model(ddp_model, "gradcomp.torch.register")
    if state is not None:
        if codec is not None:
            raise TypeError("gradcomp.torch.register: give codec= (a new state) or state= (an existing one), not both")
        try:
            p = protocol.for_state(state)  # CompressionState, PowerSGDState, ...: the protocol table
        except TypeError as e:
            raise TypeError(f"gradcomp.torch.register: {e}") from None
        state.bind(ddp_model, **kwargs)
        ddp_model.register_comm_hook(state, p.hook)
        return state
    if codec is None:
        raise TypeError("gradcomp.torch.register: codec is required (there is no default codec, as PyTorch's "
                        "hooks have no lossy default): e.g. codec='none' (exact), 'fp16' or 'bf16' (half the "
                        "bytes of float32), 'topk:ratio=0.01' (1% of the values, with error feedback); "
                        "gradcomp.codecs() lists them")
    return protocol.for_spec(codec).register(ddp_model, codec, **kwargs)


def _register_codec(ddp_model, codec: Any, **kwargs) -> CompressionState:
    """The ``codec`` protocol's ``register``: a :class:`CompressionState` registered with
    :func:`compression_hook`."""
    state = CompressionState(ddp_model, codec, **kwargs)
    ddp_model.register_comm_hook(state, compression_hook)
    return state


protocol.add(protocol.Protocol(protocol.CODEC, (), Compressor, CompressionState, compression_hook, _register_codec,
                               "any gradcomp.Codec through a scheme of gradcomp.schemes, with error feedback"))
