"""DeepSpeed's error-compensated 1-bit compressed allreduce (the ``compressed_allreduce(buffer_m,
worker_error, server_error, local_rank)`` of its NCCL / Compressed backends, DeepSpeed <= 0.19.6;
Tang et al., "1-bit Adam", ICML 2021, section 4; docs/contracts.md section 6.1) on gradcomp's
``onebit`` codec and torch.distributed: :class:`OnebitAllreduce`. :class:`gradcomp.deepspeed.
OnebitBackend` is its DeepSpeed-facing adapter; :mod:`gradcomp.optim` exchanges its compressed
momentum through it.

The protocol (DeepSpeed's, step for step; W = the group's size, Np = worker_error.numel()):
  1. buf = buffer_m flattened, zero-padded to Np (a new tensor; when numel == Np it is buffer_m's
     own storage, so the result is also written there, as DeepSpeed does);
  2. worker encode (codec ``onebit``: one l2 scale s = ||buf + e_w||_2 / sqrt(Np) over the padded
     length, bit = !(x < 0)): e_w := buf + e_w - s * sign, in place;
  3. one ``all_to_all_single``: rank j gets byte chunk j of every rank's sign bits (Np / (8 W)
     bytes) with that rank's scale (DeepSpeed sends the scales with a separate all_gather);
  4. rank r sums its chunk in rank order, acc = sum_i sign_i * fl(s_i * fl(1 / W)) (float32, from
     +0.0), then encodes acc with its server error e_s (length Np / W): e_s := acc + e_s - s_r *
     sign, in place;
  5. one ``all_gather_into_tensor`` of the server packets; every rank decodes chunk j from rank j's
     packet: the result, identical on every rank.
Numerics: bits, the sign rule (+-0.0 and NaN count as +1) and every float32 expression are
DeepSpeed's; the scales are the RMS summed in binary64 in a fixed order and rounded once, where
DeepSpeed's torch.norm sums in float32, so DeepSpeed's scale is the less exact one: on this
project's CPU torch 2.15's float32 norm is off by 1.1e-5 relative at 2^20 elements and 8e-5 at
2^22 (bench/onebit_allreduce.py), and a result differs from DeepSpeed's by as much.

Why its own functions and not :func:`gradcomp.schemes.two_phase.reduce_scatter_phase` /
:func:`~gradcomp.schemes.two_phase.all_gather_phase` (whose shape it has: an all-to-all of chunks,
a re-encode with a server residual, an all-gather):
  - chunking and scale: two_phase encodes each of its W chunks as a packet of its own (a scale per
    chunk, divisor W, the worker residual left as x' - W D); DeepSpeed encodes the whole padded
    buffer once (one scale over Np, divisor 1, e_w = x' - s sign) and cuts the sign bits into W
    byte chunks that all carry that one scale, and the server divides each term by W as fl(s_i *
    fl(1 / W)) (decode ``alpha``), not by encoding with divisor W -- other bits, other residuals;
  - the call is blocking (DeepSpeed's ``compressed_allreduce`` returns the tensor): both
    collectives are waited for in the calling thread, with no Future and no callback thread;
  - failures: the error buffers are put back as they were before the call (below), which the
    schemes leave to their caller (:mod:`gradcomp.torch.journal`).
What it shares with the schemes: :func:`gradcomp.schemes.check.check_headers` on the server
packets, :func:`gradcomp.schemes.context.collective_failed` for the error of a failed collective,
and the failure-safe all-gather :func:`gradcomp.schemes.collectives.all_gather_failsafe` (blocking).

Why no :class:`gradcomp.schemes.base.Scheme` description and no line in the scheme table: a Scheme
is a choice of ``Compressor(codec, scheme=...)`` for any codec (or any linear one) and any numel,
averaging the tensor in place with a worker residual of numel elements. This algorithm needs the
``onebit`` codec's layout (one scale for the whole buffer, sign bits cut into byte chunks), a
buffer the caller padded to a multiple of 8 W (DeepSpeed's optimizers pad to W lcm(W, 8)) with a
worker error of that padded length and a server error of Np / W, and it is blocking; it is
DeepSpeed's optimizer-side exchange, not a bucket scheme of the hook.

Shapes and dtypes: buffer_m any shape of float32 (float16/bfloat16/float64 buffers are computed
in float32 and the result rounded into the buffer's dtype); worker_error float32 of Np elements,
server_error float32 of Np / W, on buffer_m's device; Np a multiple of 8 W. Empty buffers: both
errors zeroed, the buffer returned, no communication (DeepSpeed PR 7769).

A NaN or infinity in buffer_m makes that call's scale, result and both error buffers NaN, and
the error buffers keep it (as DeepSpeed's): zero them (``worker_error.zero_()``) to start over.

A failed call loses nothing (unlike DeepSpeed's, which leaves the error buffers updated by the
encodes that ran): when a collective fails (a peer died, a timeout) or a server packet does not
match, both error buffers are put back as they were before the call (from copies taken at its
start) and :class:`gradcomp.CollectiveError` (or :class:`gradcomp.RankMismatchError`) is raised,
naming the call, the element count and the collective; ``buffer_m`` is written only after every
server packet has arrived and passed its header check. A rank whose phase-one work fails still
takes part in the all-gather with an empty packet, so the other ranks raise too (naming it)
instead of waiting for the process group's timeout.

Raises:
    ValueError: buffer_m not floating (float32, float16, bfloat16, float64), Np not a multiple of
        8 W, Np < numel, server_error not Np / W elements, error buffers not float32, not
        contiguous or on another device (DeepSpeed fails later with a cupy split error).
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from ..codec import Codec, aligned_empty
from ..errors import in_context
from ..planner.bytes import onebit_slot_bytes
from .check import check_headers
from .collectives import all_gather_failsafe
from .context import collective_failed

CODEC = "onebit"
"""The codec of the algorithm (its layout: one bits section, one float32 scale)."""
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""The buffer dtypes accepted (computed in float32)."""


class OnebitAllreduce:
    """DeepSpeed's compressed_allreduce over one process group (see the module docstring).

    Args:
        group: a torch.distributed process group (default: the world); torch.distributed must be
            initialized.

    Attributes:
        group: the group; size: its world size W; rank: this process's rank in it.
        codec: the ``onebit`` :class:`gradcomp.Codec`.
        calls: calls so far (named in error messages).

    Calling it: ``allreduce(buffer_m, worker_error, server_error)`` -> a tensor of buffer_m's
    shape and dtype (see :meth:`__call__`). Error messages name the object as ``who`` (the
    ValueErrors) and ``where`` (the context of a failed call), which an adapter may set.
    """

    who = "OnebitAllreduce"
    where = "gradcomp.schemes.onebit_allreduce.OnebitAllreduce"

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError(f"{self.where}: torch.distributed is not initialized (call "
                               f"torch.distributed.init_process_group first)")
        self.group = group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.codec = Codec(CODEC)
        self._alpha = float(torch.tensor(1.0 / self.size, dtype=torch.float32))  # fl32(1 / W), DeepSpeed's factor
        self._templates: Dict[tuple, torch.Tensor] = {}
        self.calls = 0

    def _template(self, numel: int, device) -> torch.Tensor:
        """A valid onebit packet of ``numel`` float32 elements (its header), cached per size."""
        key = (numel, str(device))
        t = self._templates.get(key)
        if t is None:
            t = self.codec.encode(torch.zeros(numel, device=device))
            self._templates[key] = t
        return t

    def __call__(self, buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor) -> torch.Tensor:
        """The compressed mean of ``buffer_m`` over the group (see the module docstring).

        Returns a tensor of buffer_m's shape and dtype, identical on every rank; writes it into
        ``buffer_m`` when its numel equals worker_error's; updates both error buffers in place.

        Raises:
            ValueError: bad buffers (module docstring), before anything is sent.
            gradcomp.CollectiveError: a collective failed; gradcomp.RankMismatchError: a server
                packet of another size or codec, or a rank that failed before the all-gather.
                Both error buffers are then as they were before the call.
        """
        W = self.size
        shape, n = buffer_m.shape, buffer_m.numel()
        if buffer_m.dtype not in FLOATS:
            raise ValueError(f"{self.who}: buffer_m is {buffer_m.dtype}; accepted: float32, float16, bfloat16, "
                             f"float64 (computed in float32)")
        for name, e in (("worker_error", worker_error), ("server_error", server_error)):
            if e.dtype != torch.float32 or e.device != buffer_m.device or not e.is_contiguous():
                raise ValueError(f"{self.who}: {name} must be a contiguous float32 tensor on {buffer_m.device}, got "
                                 f"{e.dtype} on {e.device} with strides {tuple(e.stride())}")
        if n == 0:
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        Np = worker_error.numel()
        if Np < n or Np % (8 * W) != 0:
            raise ValueError(f"{self.who}: worker_error has {Np} elements; it must hold at least buffer_m's {n} "
                             f"and be a multiple of 8 * world size = {8 * W} (DeepSpeed's optimizers pad to a "
                             f"multiple of W * lcm(W, 8))")
        C = Np // W
        if server_error.numel() != C:
            raise ValueError(f"{self.who}: server_error has {server_error.numel()} elements and worker_error {Np}; "
                             f"accepted: server_error = worker_error / world size ({W}) elements")
        self.calls += 1
        saved = (worker_error.clone(), server_error.clone())
        try:
            return self._exchange(buffer_m, worker_error, server_error, shape, n, Np, C)
        except Exception as e:  # noqa: BLE001 - undone, raised with its context
            worker_error.copy_(saved[0])
            server_error.copy_(saved[1])
            raise in_context(e, f"{self.where} (call {self.calls}, {n} elements padded to {Np}, world size {W}; "
                                f"both error buffers are as before the call)") from e

    def _exchange(self, buffer_m, worker_error, server_error, shape, n: int, Np: int, C: int) -> torch.Tensor:
        """Steps 1-5 of the module docstring (the buffers are checked)."""
        W = self.size
        flat = buffer_m.reshape(-1)
        # a float32 buffer of exactly Np elements is worked on in its own storage (as DeepSpeed
        # does): read by the worker encode, then overwritten by the result
        inplace = n == Np and buffer_m.dtype == torch.float32 and buffer_m.is_contiguous()
        if inplace:
            buf = flat
        else:
            buf = torch.zeros(Np, dtype=torch.float32, device=buffer_m.device)
            buf[:n] = flat
        # 2-3. worker: one packet over the padded buffer, e_w updated in place; its sign bits cut
        # into W byte chunks, each sent with the one scale
        p1 = self.codec.encode(buf, residual=worker_error)
        lay = self.codec.layout(Np, "float32")["sections"]
        boff, soff = lay[0][1], lay[1][1]
        cb = C // 8
        send = torch.empty(W, onebit_slot_bytes(C), dtype=torch.uint8, device=buf.device)  # [signs | scale]
        send[:, :cb] = p1[boff: boff + Np // 8].view(W, cb)
        send[:, cb:] = p1[soff: soff + 4].view(1, 4)
        recv = torch.empty_like(send)
        try:
            dist.all_to_all_single(recv, send, group=self.group)
        except Exception as e:  # noqa: BLE001 - named, cause kept
            raise collective_failed("the all-to-all of the worker signs", e) from e
        # 4. server: rank order, float32 from +0.0, each term fl(+-s_i * fl(1 / W))
        tmpl = self._template(C, buf.device)
        P2 = tmpl.numel()  # a multiple of 16: every rank's packet in `gathered` stays 16-byte aligned
        failed = None
        try:
            clay = self.codec.layout(C, "float32")["sections"]
            cboff, csoff = clay[0][1], clay[1][1]
            acc = torch.zeros(C, dtype=torch.float32, device=buf.device)
            pk = aligned_empty(buf, P2)
            pk.copy_(tmpl)  # the header; each rank's bits and scale go in below
            for i in range(W):
                pk[cboff: cboff + cb] = recv[i, :cb]
                pk[csoff: csoff + 4] = recv[i, cb:]
                self.codec.decode(pk, out=acc, accumulate=True, alpha=self._alpha)
            p2 = self.codec.encode(acc, residual=server_error)
        except Exception as e:  # noqa: BLE001 - raised after the all-gather, so no rank waits for this one
            failed = e
            p2 = torch.zeros(P2, dtype=torch.uint8, device=buf.device)
        # 5. the server packets to every rank; buffer_m is written only after their header check
        gathered = aligned_empty(buf, W * P2)

        def finish() -> torch.Tensor:
            check_headers(gathered, P2, [(j, C) for j in range(W)], tmpl, "float32",
                          "the all-gather of the server packets")
            out = buf if inplace else torch.empty(Np, dtype=torch.float32, device=buf.device)
            for j in range(W):
                self.codec.decode(gathered[j * P2:(j + 1) * P2], out=out[j * C:(j + 1) * C])
            if inplace:
                return buffer_m
            result = out[:n].to(buffer_m.dtype).reshape(shape)
            if n == Np:
                buffer_m.copy_(result)
                return buffer_m
            return result

        return all_gather_failsafe(gathered, p2, self.group, failed, finish, "the all-gather of the server packets",
                                   wait=True)
