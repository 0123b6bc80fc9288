"""The gradcomp DDP communication hook and its state (DESIGN.md sections 4 and 5).

One :class:`CompressionState` per DDP model and process; :func:`compression_hook` is registered with
``ddp_model.register_comm_hook(state, compression_hook)`` (PyTorch's DDP comm-hook contract: called
once per bucket per synchronized backward, in bucket index order, must return a
``torch.futures.Future`` holding a tensor of the bucket's numel; with a hook registered DDP does not
divide by the world size, the hook averages).

Sources: PyTorch ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py`` (allreduce_hook,
fp16_compress_hook) and ``powerSGD_hook.py`` (error feedback state, start iteration); Aji & Heafield
2017 and Lin et al. 2018 (top-k sparsification with locally accumulated residuals); Karimireddy et
al. 2019 (error feedback).

No annotation here uses ``from __future__ import annotations``: DDP's ``_check_comm_hook`` compares
the hook's annotations with the real classes.
"""

import logging
import threading
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..codec import Codec, aligned_empty

log = logging.getLogger("gradcomp")

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SCHEMES = ("auto", "sum", "gather", "dense")
_NONFINITE = ("restore", "reset")
_STAT_FIELDS = ("numel", "dense_bytes", "packet_bytes", "sent_bytes", "ring_bytes",
                "encode_s", "decode_s", "comm_s", "compressed_buckets", "dense_buckets")


def _wire_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class _Layout:
    """One bucket layout: flat float32 residual + parameter map, packet and gather buffers.

    ``params`` is a list of ``(param, name, offset, length)`` in bucket order; ``offset`` and
    ``length`` are in elements of the bucket buffer. The residual of a parameter is
    ``residual[offset:offset+length]``, in the order of the bucket (the gradient's memory order,
    which for a channels_last weight is the channels_last order).
    """

    def __init__(self, key, index, numel, dtype, device, params, scheme):
        self.key = key
        self.index = index
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.params = params
        self.scheme = scheme  # "dense", "sum" or "gather" for this layout once compression is on
        self.residual: Optional[torch.Tensor] = None
        self.backup: Optional[torch.Tensor] = None
        self.packet: Optional[torch.Tensor] = None
        self.gathered: Optional[torch.Tensor] = None
        self.acc: Optional[torch.Tensor] = None
        self.dec_codec: Optional[Codec] = None


class _StepRecord:
    """Byte and time accounting for one synchronized step (all its buckets)."""

    def __init__(self, step: int):
        self.step = step
        self.v = {f: 0.0 for f in _STAT_FIELDS}
        self.buckets: List[dict] = []
        self.nf: Optional[torch.Tensor] = None  # device bool, OR over compressed buckets
        self.nf_host = None
        self.nf_event = None
        self.cuda_times: list = []  # (start_event, end_event, field, bucket_dict)
        self.drop_if_finite: list = []  # (param, pending tensor) to forget once the step is known finite


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
            The choice uses only numel, dtype, W and codec properties, so every rank agrees.
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
    step (as without the hook). Non-finite steps are logged one step late.

    Joined ranks (``ddp_model.join()``) send exact zeros and keep their residuals. ``no_sync``
    needs nothing: the hook runs on synchronized steps only, on the accumulated gradient.

    Buckets of dtypes other than float32, float16, bfloat16 and sparse buckets take the dense
    path (one warning). World size 1 returns the bucket unchanged.

    Raises:
        ValueError: unknown scheme or nonfinite mode, a ``sum`` scheme with a non-linear codec,
            negative start_iter / min_compress_numel.
        gradcomp.InvalidArgumentError: a bad codec spec.
    """

    def __init__(self, ddp_model, codec: Any = "topk:ratio=0.01", error_feedback: bool = True,
                 scheme: str = "auto", start_iter: int = 0, min_compress_numel: int = 1024,
                 nonfinite: str = "restore", process_group=None, log_every: int = 0):
        if scheme not in _SCHEMES:
            raise ValueError(f"scheme={scheme!r}; accepted: {', '.join(_SCHEMES)}")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite={nonfinite!r}; accepted: {', '.join(_NONFINITE)}")
        for name, v in (("start_iter", start_iter), ("min_compress_numel", min_compress_numel),
                        ("log_every", log_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r}; accepted: an integer >= 0")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback={error_feedback!r}; accepted: True or False")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group={process_group!r}; accepted: None or a torch.distributed.ProcessGroup")
        self.codec = codec if isinstance(codec, Codec) else Codec(str(codec))
        self.linear = bool(self.codec.properties["linear"])
        if scheme == "sum" and not self.linear:
            raise ValueError(f"scheme='sum' needs a linear codec; {self.codec.spec} is not linear (use 'gather')")
        self.error_feedback = bool(error_feedback)
        self.scheme = scheme
        self.start_iter = int(start_iter)
        self.min_compress_numel = int(min_compress_numel)
        self.nonfinite = nonfinite
        self.log_every = int(log_every)
        if process_group is None:
            process_group = getattr(ddp_model, "process_group", None)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        module = getattr(ddp_model, "module", ddp_model)
        self._names: Dict[int, str] = {}
        self._params_by_name: Dict[str, torch.nn.Parameter] = {}
        for name, p in module.named_parameters():
            self._names[id(p)] = name
            self._params_by_name[name] = p
        self.iter = 0  # synchronized steps seen (incremented after the last bucket)
        self._layouts: Dict[int, _Layout] = {}
        # param id -> (layout, offset, length) or ("pending", float32 tensor)
        self._home: Dict[int, tuple] = {}
        self._warned: set = set()
        self._joined = False
        self._lock = threading.Lock()
        self._cur: Optional[_StepRecord] = None
        self._closed_total = {f: 0.0 for f in _STAT_FIELDS}
        self._closed_steps = 0
        self._last_closed: Optional[_StepRecord] = None
        self._unresolved: List[_StepRecord] = []
        self.nonfinite_steps = 0
        self._hook_joins(ddp_model)

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

    # -- scheme choice -------------------------------------------------------------------------
    def _choose_scheme(self, numel: int, dtype: torch.dtype) -> str:
        """Scheme for a bucket once compression is on; from rank-shared inputs only."""
        if numel < self.min_compress_numel or numel == 0:
            return "dense"
        if self.scheme != "auto":
            return self.scheme
        if self.linear:
            return "sum"
        dense_bytes = numel * torch.empty((), dtype=dtype).element_size()
        pbytes = self.codec.packet_bytes(numel, dtype)
        return "gather" if self.world_size * pbytes < 2 * dense_bytes else "dense"

    def _warn_once(self, key, msg):
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)
            log.warning(msg)

    # -- layouts and residuals -----------------------------------------------------------------
    def _layout(self, bucket) -> _Layout:
        buf = bucket.buffer()
        params = bucket.parameters()
        idx = bucket.index()
        grads = bucket.gradients()
        base = buf.storage_offset()
        entries = []
        for p, g in zip(params, grads):
            entries.append((p, self._names.get(id(p), f"<unnamed {id(p)}>"),
                            g.storage_offset() - base, g.numel()))
        key = (buf.numel(), buf.dtype, str(buf.device),
               tuple((id(p), off, n) for p, _, off, n in entries))
        lay = self._layouts.get(idx)
        if lay is not None and lay.key == key:
            return lay
        scheme = self._choose_scheme(buf.numel(), buf.dtype)
        lay = _Layout(key, idx, buf.numel(), buf.dtype, buf.device, entries, scheme)
        self._layouts[idx] = lay
        log.info("gradcomp: bucket %d layout: %d elements, %s, %d parameters, scheme %s (codec %s, W=%d)",
                 idx, lay.numel, str(buf.dtype).replace("torch.", ""), len(entries), scheme,
                 self.codec.spec, self.world_size)
        return lay

    def _ensure_buffers(self, lay: _Layout):
        if lay.packet is None:
            pbytes = self.codec.packet_bytes(lay.numel, lay.dtype)
            lay.packet = aligned_empty(torch.empty(0, device=lay.device), pbytes)  # 16-byte aligned
            lay.dec_codec = Codec(self.codec.spec)  # own workspace: decodes run in callbacks
            if lay.scheme == "gather":
                lay.gathered = aligned_empty(lay.packet, pbytes * self.world_size)
                lay.acc = torch.empty(lay.numel, dtype=torch.float32, device=lay.device)
        if self.error_feedback and lay.residual is None:
            lay.residual = torch.zeros(lay.numel, dtype=torch.float32, device=lay.device)
            for p, _, off, n in lay.params:
                home = self._home.get(id(p))
                if home is not None:
                    lay.residual[off: off + n].copy_(self._home_tensor(home))
                    self._release(home)
                self._home[id(p)] = (lay, off, n)
            if self.nonfinite == "restore":
                lay.backup = torch.empty_like(lay.residual)

    @staticmethod
    def _home_tensor(home) -> torch.Tensor:
        if home[0] == "pending":
            return home[1]
        lay, off, n = home
        return lay.residual[off: off + n]

    @staticmethod
    def _release(home):
        """Zero a residual slice whose parameter moved (so a stale layout holds no mass)."""
        if home[0] != "pending":
            lay, off, n = home
            lay.residual[off: off + n].zero_()

    def residual(self, param) -> torch.Tensor:
        """A float32 copy of the residual of ``param`` (a Parameter or its name): 1-D, numel
        elements, in the gradient's memory order; zeros when it has none."""
        if isinstance(param, str):
            param = self._params_by_name[param]
        home = self._home.get(id(param))
        if home is None:
            return torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        return self._home_tensor(home).detach().clone()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Per-rank state: ``{"version", "codec", "world_size", "rank", "iter", "error_feedback",
        "residuals": {param name: float32 1-D tensor (numel, gradient memory order)}}``; only
        parameters that hold a residual appear. Residuals differ per rank: save one file per rank."""
        res = {}
        for pid, home in self._home.items():
            name = self._names.get(pid)
            if name is not None:
                res[name] = self._home_tensor(home).detach().clone()
        return {"version": 1, "codec": self.codec.spec, "world_size": self.world_size,
                "rank": self.rank, "iter": self.iter, "error_feedback": self.error_feedback,
                "residuals": res}

    def load_state_dict(self, sd: dict) -> None:
        """Load a ``state_dict()`` of the same rank. Bit-exact. With another world size the
        residuals are dropped (warning); unknown parameter names raise KeyError; a residual of
        the wrong numel raises ValueError."""
        self.iter = int(sd.get("iter", 0))
        res = sd.get("residuals", {})
        if int(sd.get("world_size", self.world_size)) != self.world_size:
            msg = (f"gradcomp: checkpoint from world size {sd.get('world_size')} loaded at world size "
                   f"{self.world_size}: residuals dropped")
            warnings.warn(msg)
            log.warning(msg)
            res = {}
        for name, t in res.items():
            p = self._params_by_name.get(name)
            if p is None:
                raise KeyError(f"load_state_dict: no parameter named {name!r} in this model")
            if t.numel() != p.numel():
                raise ValueError(f"load_state_dict: residual {name!r} has {t.numel()} elements, parameter has {p.numel()}")
            t = t.detach().to(device=p.device, dtype=torch.float32).reshape(-1)
            home = self._home.get(id(p))
            if home is not None and home[0] != "pending":
                self._home_tensor(home).copy_(t)
            else:
                self._home[id(p)] = ("pending", t.clone())

    # -- stats ---------------------------------------------------------------------------------
    def _record(self) -> _StepRecord:
        if self._cur is None or self._cur.step != self.iter:
            if self._cur is not None:
                self._close(self._cur)
            self._cur = _StepRecord(self.iter)
        return self._cur

    def _close(self, rec: _StepRecord):
        with self._lock:
            for s, e, field, b in rec.cuda_times:
                if e.query():
                    dt = s.elapsed_time(e) / 1000.0
                    rec.v[field] += dt
                    b[field] = b.get(field, 0.0) + dt
            rec.cuda_times = []
            if rec.nf is not None:
                rec.nf_host = torch.empty((), dtype=torch.bool, pin_memory=rec.nf.is_cuda)
                rec.nf_host.copy_(rec.nf, non_blocking=True)
                if rec.nf.is_cuda:
                    rec.nf_event = torch.cuda.Event()
                    rec.nf_event.record()
                self._unresolved.append(rec)
            for f in _STAT_FIELDS:
                self._closed_total[f] += rec.v[f]
            self._closed_steps += 1
            self._last_closed = rec
        self._resolve()
        if self.log_every and (rec.step + 1) % self.log_every == 0:
            s = self._summary(rec.v)
            log.info("gradcomp step %d: %d elements, packet %d B, sent %d B, packet_ratio %.4f, "
                     "wire_ratio %.4f, %.3f bits/element, encode %.2f ms, comm %.2f ms, decode %.2f ms",
                     rec.step, s["numel"], s["packet_bytes"], s["sent_bytes"], s["packet_ratio"],
                     s["wire_ratio"], s["bits_per_element"], 1e3 * s["encode_s"], 1e3 * s["comm_s"],
                     1e3 * s["decode_s"])

    def _resolve(self):
        """Read non-finite flags of past steps whose copies have landed (no synchronization)."""
        keep = []
        for rec in self._unresolved:
            if rec.nf_event is not None and not rec.nf_event.query():
                keep.append(rec)
                continue
            if bool(rec.nf_host.numpy()):  # host memory already written: not a device sync
                self.nonfinite_steps += 1
                log.warning("gradcomp: step %d: averaged gradient is non-finite; residuals %s",
                            rec.step, "restored" if self.nonfinite == "restore" else "reset")
            else:
                for p, t in rec.drop_if_finite:
                    home = self._home.get(id(p))
                    if home is not None and home[0] == "pending" and home[1] is t:
                        del self._home[id(p)]
        self._unresolved = keep

    @staticmethod
    def _summary(v: dict) -> dict:
        out = dict(v)
        out["numel"] = int(v["numel"])
        for f in ("dense_bytes", "packet_bytes", "sent_bytes", "compressed_buckets", "dense_buckets"):
            out[f] = int(v[f])
        out["packet_ratio"] = v["packet_bytes"] / v["dense_bytes"] if v["dense_bytes"] else float("nan")
        out["wire_ratio"] = v["sent_bytes"] / v["ring_bytes"] if v["ring_bytes"] else float("nan")
        out["bits_per_element"] = 8.0 * v["packet_bytes"] / v["numel"] if v["numel"] else float("nan")
        return out

    def stats(self) -> dict:
        """Byte and time accounting (DESIGN.md section 5).

        Returns ``{"steps", "world_size", "codec", "nonfinite_steps", "step", "total", "buckets"}``:
        ``step`` (the most recent step) and ``total`` (all steps) hold ``numel``, ``dense_bytes``
        (bucket bytes in the bucket dtype), ``packet_bytes`` (this rank's packets; the bucket
        itself for dense buckets), ``sent_bytes`` (bytes one rank sends under the scheme: sum:
        2(W-1)/W * payload bytes; gather: (W-1) * packet bytes (ring all-gather); dense:
        2(W-1)/W * dense bytes), ``ring_bytes`` (2(W-1)/W * dense bytes), ``packet_ratio`` =
        packet/dense, ``wire_ratio`` = sent/ring, ``bits_per_element`` = 8 * packet bytes /
        numel, and seconds ``encode_s``, ``decode_s``, ``comm_s`` (launch to completion as seen by
        the callback, queueing behind earlier buckets included; CUDA: events read one step late).
        ``buckets``: per-bucket records of the most recent step.
        """
        with self._lock:
            total = dict(self._closed_total)
            steps = self._closed_steps
            if self._cur is not None:  # the open record: the most recent step
                for f in _STAT_FIELDS:
                    total[f] += self._cur.v[f]
                steps += 1
            last = self._cur
            zero = {f: 0.0 for f in _STAT_FIELDS}
            step = self._summary(last.v if last is not None else zero)
            buckets = [dict(b) for b in last.buckets] if last is not None else []
        self._resolve()
        return {"steps": steps, "world_size": self.world_size, "codec": self.codec.spec,
                "nonfinite_steps": self.nonfinite_steps, "step": step,
                "total": self._summary(total), "buckets": buckets}

    def _clock(self, device):
        if device.type == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _tock(self, rec: _StepRecord, b: dict, field: str, start):
        if isinstance(start, float):
            dt = time.perf_counter() - start
            with self._lock:
                rec.v[field] += dt
                b[field] = b.get(field, 0.0) + dt
        else:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            with self._lock:
                rec.cuda_times.append((start, e, field, b))

    def _account(self, rec, b):
        with self._lock:
            for f in ("numel", "dense_bytes", "packet_bytes", "sent_bytes", "ring_bytes"):
                rec.v[f] += b[f]
            rec.v["compressed_buckets" if b["scheme"] != "dense" else "dense_buckets"] += 1
            rec.buckets.append(b)

    # -- the hook ------------------------------------------------------------------------------
    def __call__(self, bucket) -> torch.futures.Future:
        return self._hook(bucket)

    def _hook(self, bucket):
        W = self.world_size
        buf = bucket.buffer()
        if W == 1:
            fut = torch.futures.Future()
            fut.set_result(buf)
            self._end_bucket(bucket)
            return fut
        rec = self._record()
        joined = self._joined
        if buf.layout != torch.strided or buf.dtype not in _SUPPORTED_DTYPES:
            self._warn_once(("dtype", buf.dtype, buf.layout),
                            f"gradcomp: bucket of dtype {buf.dtype} / layout {buf.layout} takes the dense path")
            fut = self._dense(rec, bucket, buf, None, joined)
        else:
            lay = self._layout(bucket)
            if self.iter < self.start_iter or lay.scheme == "dense":
                fut = self._dense(rec, bucket, buf, lay, joined)
            else:
                fut = self._compressed(rec, bucket, buf, lay, joined)
        self._end_bucket(bucket)
        return fut

    def _end_bucket(self, bucket):
        if bucket.is_last():
            self.iter += 1

    def _dense(self, rec, bucket, buf, lay, joined):
        W = self.world_size
        esize = buf.element_size()
        n = buf.numel()
        b = {"index": bucket.index(), "numel": n, "dtype": str(buf.dtype).replace("torch.", ""),
             "scheme": "dense", "dense_bytes": n * esize, "packet_bytes": n * esize,
             "sent_bytes": 2.0 * (W - 1) / W * n * esize, "ring_bytes": 2.0 * (W - 1) / W * n * esize}
        self._account(rec, b)
        flushed = []
        if lay is not None and not joined:
            # parameters that go dense add their residual to the gradient they send (DESIGN 4)
            for p, _, off, cnt in lay.params:
                home = self._home.get(id(p))
                if home is None:
                    continue
                src = self._home_tensor(home)
                saved = src.clone() if self.nonfinite == "restore" else None
                buf[off: off + cnt].add_(src.to(buf.dtype))
                if home[0] != "pending":
                    self._release(home)
                flushed.append((p, saved))
                del self._home[id(p)]
        t0 = self._clock(buf.device)
        buf.div_(W)
        fut = dist.all_reduce(buf, group=self.process_group, async_op=True).get_future()

        def done(f):
            self._tock(rec, b, "comm_s", t0)
            out = f.value()[0]
            if flushed:
                nf = torch.isfinite(out).logical_not().any()
                with self._lock:
                    rec.nf = nf if rec.nf is None else (rec.nf | nf)
                    for p, saved in flushed:
                        if saved is None:
                            continue
                        pend = torch.where(nf, saved, torch.zeros_like(saved))
                        if id(p) not in self._home:
                            self._home[id(p)] = ("pending", pend)
                            rec.drop_if_finite.append((p, pend))
            return out

        return fut.then(done)

    def _compressed(self, rec, bucket, buf, lay: _Layout, joined: bool):
        W = self.world_size
        n = lay.numel
        esize = buf.element_size()
        self._ensure_buffers(lay)
        pbytes = lay.packet.numel()
        b = {"index": bucket.index(), "numel": n, "dtype": str(buf.dtype).replace("torch.", ""),
             "scheme": lay.scheme, "dense_bytes": n * esize, "packet_bytes": pbytes,
             "ring_bytes": 2.0 * (W - 1) / W * n * esize}
        use_ef = self.error_feedback and not joined
        t0 = self._clock(buf.device)
        if use_ef and lay.backup is not None:
            lay.backup.copy_(lay.residual)
        if joined:  # joined ranks send exact zeros and keep their residuals
            buf.zero_()
        self.codec.encode(buf, residual=lay.residual if use_ef else None, out=lay.packet, divisor=W)
        self._tock(rec, b, "encode_s", t0)
        t1 = self._clock(buf.device)
        if lay.scheme == "sum":
            off, cnt, wname = self.codec.payload(n, buf.dtype)
            wdt = _wire_dtype(wname)
            wsize = torch.empty((), dtype=wdt).element_size()
            view = lay.packet[off: off + cnt * wsize].view(wdt)
            b["sent_bytes"] = 2.0 * (W - 1) / W * cnt * wsize
            work = dist.all_reduce(view, group=self.process_group, async_op=True)
        else:  # gather
            b["sent_bytes"] = float((W - 1) * pbytes)
            work = dist.all_gather_into_tensor(lay.gathered, lay.packet, group=self.process_group,
                                               async_op=True)
        self._account(rec, b)
        fut = work.get_future()
        state = self

        def done(f):
            state._tock(rec, b, "comm_s", t1)
            t2 = state._clock(buf.device)
            dec = lay.dec_codec
            ws = dec.workspace(lay.packet)
            if lay.scheme == "sum":
                dec.decode(lay.packet, out=buf, workspace=ws)
            else:
                lay.acc.zero_()
                for r in range(W):
                    dec.decode(lay.gathered[r * pbytes: (r + 1) * pbytes], out=lay.acc,
                               accumulate=True, workspace=ws)
                buf.copy_(lay.acc)
            nf = torch.isfinite(buf).logical_not().any()
            if use_ef:
                if state.nonfinite == "restore":
                    torch.where(nf, lay.backup, lay.residual, out=lay.residual)
                else:
                    lay.residual.masked_fill_(nf, 0.0)
            with state._lock:
                rec.nf = nf if rec.nf is None else (rec.nf | nf)
            state._tock(rec, b, "decode_s", t2)
            return buf

        return fut.then(done)


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
