"""The gradcomp DDP communication hook and its state (DESIGN.md sections 4 and 5).

One :class:`CompressionState` per DDP model and process; :func:`compression_hook` is registered with
``ddp_model.register_comm_hook(state, compression_hook)`` (PyTorch's DDP comm-hook contract: called
once per bucket per synchronized backward, in bucket index order, must return a
``torch.futures.Future`` holding a tensor of the bucket's numel; with a hook registered DDP does not
divide by the world size, the hook averages).

This module is the DDP-specific orchestration only: parameter names from the model, bucket ->
parameter map, the dense warm-up (``start_iter``), ``join()`` detection. The compressed allreduce
itself -- schemes, error feedback, the non-finite rule, accounting -- is the state's
:class:`gradcomp.torch.Compressor` (``state.compressor``).

Sources: PyTorch ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`` (allreduce_hook,
fp16_compress_hook) and ``powerSGD_hook.py`` (error feedback state, start iteration); Aji & Heafield
2017 and Lin et al. 2018 (top-k sparsification with locally accumulated residuals); Karimireddy et
al. 2019 (error feedback).

No annotation here uses ``from __future__ import annotations``: DDP's ``_check_comm_hook`` compares
the hook's annotations with the real classes.
"""

from typing import Any, Dict, List

import torch
import torch.distributed as dist

from .compressor import Compressor, check_options


class CompressionState:
    """State of the gradcomp DDP communication hook for one DDP model on one rank.

    Args:
        ddp_model: the ``torch.nn.parallel.DistributedDataParallel`` model; its parameter names
            key ``state_dict()``.
        codec: codec spec, e.g. ``"topk:ratio=0.01"``, ``"fp16"``, ``"bf16"``, ``"none"``
            (DESIGN.md section 3), or a :class:`gradcomp.Codec`.
        error_feedback: keep a float32 residual per gradient element (Karimireddy et al. 2019):
            encode sees ``x' = g + r`` and leaves ``r = x' - W * decode(packet)``, i.e. exactly what
            this rank did not send, in gradient units (before the division by W).
        scheme: ``"sum"`` (linear codecs: one SUM allreduce of the packet's payload; encode divides
            by W), ``"gather"`` (any codec: all-gather the fixed-size packets; every rank decodes all
            W packets in rank order into one float32 accumulator, then rounds once into the bucket),
            ``"dense"`` (plain allreduce of the bucket divided by W, like PyTorch's allreduce_hook)
            or ``"auto"``: ``sum`` for linear codecs; for others ``gather`` when it sends fewer
            bytes than a dense ring allreduce (``W * packet_bytes < 2 * dense_bytes``), else dense.
            The choice uses only numel, dtype, W and codec properties, so every rank agrees
            (:func:`gradcomp.planner.choose_scheme`).
        start_iter: synchronized steps (hook calls on the last bucket) sent dense before
            compression starts (default 0). Buckets are rebuilt by DDP after the first step; the
            residuals follow the parameters into the new layout, so 0 is safe.
        min_compress_numel: buckets with fewer elements are sent dense (default 1024).
        nonfinite: ``"restore"`` (default; keeps a second residual copy) or ``"reset"``: what
            happens to the residuals of a step whose averaged result holds a non-finite value.
        process_group: the group to reduce over; default: the DDP model's group.
        log_every: log a stats line through ``logging.getLogger("gradcomp")`` every N steps
            (0: never).

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

    Joined ranks (``ddp_model.join()``) send exact zeros and keep their residuals. ``no_sync``
    needs nothing: the hook runs on synchronized steps only, on the accumulated gradient.

    Buckets of dtypes other than float32, float16, bfloat16 and sparse buckets take the dense
    path (one warning). World size 1 returns the bucket unchanged.

    Attributes:
        compressor: the :class:`gradcomp.torch.Compressor` doing the work (e.g.
            ``state.compressor.on_corrupt = "log"``).
        start_iter: as above; ``iter``: synchronized steps seen.

    Raises:
        ValueError: unknown scheme or nonfinite mode, a ``sum`` scheme with a non-linear codec,
            negative start_iter / min_compress_numel.
        gradcomp.InvalidArgumentError: a bad codec spec.
    """

    def __init__(self, ddp_model, codec: Any = "topk:ratio=0.01", error_feedback: bool = True,
                 scheme: str = "auto", start_iter: int = 0, min_compress_numel: int = 1024,
                 nonfinite: str = "restore", process_group=None, log_every: int = 0):
        check_options(scheme=scheme, nonfinite=nonfinite, error_feedback=error_feedback,
                      group=process_group, group_arg="process_group",
                      ints=(("start_iter", start_iter), ("min_compress_numel", min_compress_numel),
                            ("log_every", log_every)))
        self.start_iter = int(start_iter)
        if process_group is None:
            process_group = getattr(ddp_model, "process_group", None)
        self.compressor = Compressor(codec, scheme, error_feedback, process_group,
                                     min_compress_numel=min_compress_numel, nonfinite=nonfinite,
                                     log_every=log_every)
        module = getattr(ddp_model, "module", ddp_model)
        self._names: Dict[int, str] = {}
        self._params_by_name: Dict[str, torch.nn.Parameter] = {}
        for name, p in module.named_parameters():
            self._names[id(p)] = name
            self._params_by_name[name] = p
        self._joined = False
        self._hook_joins(ddp_model)

    # -- configuration, read from the compressor -----------------------------------------------
    codec = property(lambda self: self.compressor.codec, doc="The :class:`gradcomp.Codec`.")
    linear = property(lambda self: self.compressor.linear, doc="Whether the codec is linear.")
    error_feedback = property(lambda self: self.compressor.error_feedback)
    scheme = property(lambda self: self.compressor.scheme, doc="The requested scheme (``auto`` included).")
    min_compress_numel = property(lambda self: self.compressor.min_compress_numel)
    nonfinite = property(lambda self: self.compressor.nonfinite)
    log_every = property(lambda self: self.compressor.log_every)
    process_group = property(lambda self: self.compressor.group)
    world_size = property(lambda self: self.compressor.world_size)
    rank = property(lambda self: self.compressor.rank)
    nonfinite_steps = property(lambda self: self.compressor.nonfinite_steps,
                               doc="Non-finite steps seen so far (read one step late).")

    @property
    def iter(self) -> int:
        """Synchronized steps seen (incremented after the hook call on the last bucket)."""
        return self.compressor.iter

    @iter.setter
    def iter(self, v: int) -> None:
        self.compressor.iter = int(v)

    # -- join() support ------------------------------------------------------------------------
    def _hook_joins(self, ddp_model):
        """Mark hook calls made for a joined rank: DDP's join hook replays the comm hook on zero
        buckets through ``ddp._match_all_reduce_for_bwd_pass``; wrap that method on this instance."""
        inner = getattr(ddp_model, "_match_all_reduce_for_bwd_pass", None)
        if inner is None or getattr(inner, "_gradcomp_wrapped", False):
            return
        state = self

        def wrapped(*args, **kwargs):
            state._joined = True
            try:
                return inner(*args, **kwargs)
            finally:
                state._joined = False

        wrapped._gradcomp_wrapped = True
        object.__setattr__(ddp_model, "_match_all_reduce_for_bwd_pass", wrapped)

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
        "params": [(name, offset, length)]}]`` (offsets and lengths in elements of the bucket;
        ``scheme`` is the one used once compression is on, i.e. after ``start_iter``)."""
        return sorted((d for d in self.compressor.layouts() if "index" in d), key=lambda d: d["index"])

    def residual(self, param) -> torch.Tensor:
        """A float32 copy of the residual of ``param`` (a Parameter or its name): 1-D, numel
        elements, in the gradient's memory order; zeros when it has none.

        Raises:
            KeyError: a name that is not a parameter of the model.
        """
        if isinstance(param, str):
            param = self._params_by_name[param]
        name = self._names.get(id(param))
        r = self.compressor.store.residual(name) if name is not None else None
        if r is None:
            return torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        return r

    def stats(self) -> dict:
        """Byte and time accounting (DESIGN.md section 5): see :meth:`Compressor.stats`;
        ``buckets`` holds one dict per bucket of the most recent step, with its ``index``."""
        return self.compressor.stats()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Per-rank state: ``{"version", "codec", "world_size", "rank", "iter", "error_feedback",
        "residuals": {param name: float32 1-D tensor (numel, gradient memory order)}}``; only
        parameters that hold a residual appear. Residuals differ per rank: save one file per rank."""
        sd = self.compressor.state_dict()
        sd["residuals"] = {k: v for k, v in sd["residuals"].items() if k in self._params_by_name}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Load a ``state_dict()`` of the same rank. Bit-exact. With another world size the
        residuals are dropped (warning); unknown parameter names raise KeyError; a residual of
        the wrong numel raises ValueError."""
        res = sd.get("residuals", {})
        if int(sd.get("world_size", self.world_size)) == self.world_size:
            moved = {}
            for name, t in res.items():
                p = self._params_by_name.get(name)
                if p is None:
                    raise KeyError(f"load_state_dict: no parameter named {name!r} in this model")
                if t.numel() != p.numel():
                    raise ValueError(f"load_state_dict: residual {name!r} has {t.numel()} elements, parameter has {p.numel()}")
                moved[name] = t.detach().to(device=p.device, dtype=torch.float32).reshape(-1)
            sd = dict(sd, residuals=moved)
        self.compressor.load_state_dict(sd)

    # -- the hook ------------------------------------------------------------------------------
    def __call__(self, bucket) -> torch.futures.Future:
        return self._hook(bucket)

    def _params(self, bucket) -> list:
        """The bucket's parameter map: ``[(name, offset, length)]`` in elements of its buffer."""
        base = bucket.buffer().storage_offset()
        return [(self._names.get(id(p), f"<unnamed {id(p)}>"), g.storage_offset() - base, g.numel())
                for p, g in zip(bucket.parameters(), bucket.gradients())]

    def _hook(self, bucket):
        fut = self.compressor.allreduce_bucket(bucket.buffer(), bucket.index(), lambda: self._params(bucket),
                                               joined=self._joined, dense=self.iter < self.start_iter)
        if bucket.is_last():
            self.compressor.end_step()
        return fut


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compress ``bucket`` with ``state``'s codec and scheme.

    Register with ``ddp_model.register_comm_hook(state, compression_hook)``. Returns a Future
    holding ``bucket.buffer()`` (same numel and dtype), filled with the average over the process
    group, bitwise identical on every rank. See :class:`CompressionState`.
    """
    return state._hook(bucket)


def register(ddp_model, **kwargs) -> CompressionState:
    """Build a :class:`CompressionState` for ``ddp_model`` (keyword arguments as its constructor)
    and register :func:`compression_hook` with it. Returns the state. DDP allows one hook per
    model: a second registration raises DDP's RuntimeError."""
    state = CompressionState(ddp_model, **kwargs)
    ddp_model.register_comm_hook(state, compression_hook)
    return state
