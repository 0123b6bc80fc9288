"""``OnebitBackend``: DeepSpeed's error-compensated 1-bit compressed allreduce (the
``compressed_allreduce(buffer_m, worker_error, server_error, local_rank)`` of its NCCL /
Compressed backends, DeepSpeed <= 0.19.6; Tang et al., "1-bit Adam", ICML 2021, section 4) on
gradcomp's ``onebit`` codec and torch.distributed.

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

Shapes and dtypes: buffer_m any shape of float32 (float16/bfloat16/float64 buffers are computed
in float32 and the result rounded into the buffer's dtype); worker_error float32 of Np elements,
server_error float32 of Np / W, on buffer_m's device; Np a multiple of 8 W (DeepSpeed's optimizers
pad to a multiple of W lcm(W, 8)). Empty buffers: both errors zeroed, the buffer returned, no
communication (DeepSpeed PR 7769).

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

from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..codec import Codec, aligned_empty
from ..errors import in_context
from ..schemes.check import check_headers
from ..schemes.context import collective_failed

_CODEC = "onebit"
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class OnebitBackend:
    """A DeepSpeed 1-bit communication backend on gradcomp (see the module docstring).

    Args:
        mpu: DeepSpeed's model-parallel unit or None; when given, its data-parallel group is used
            (as DeepSpeed's backends do).
        group: a torch.distributed process group (default: the world); ignored when ``mpu`` is set.

    Attributes:
        size: the group's world size W (DeepSpeed reads it to pad its buffers).
        rank: this process's rank in the group.
    """

    def __init__(self, mpu=None, group=None):
        if not dist.is_initialized():
            raise RuntimeError("gradcomp.deepspeed.OnebitBackend: torch.distributed is not initialized "
                               "(call deepspeed.init_distributed() or torch.distributed.init_process_group first)")
        self.group = mpu.get_data_parallel_group() if mpu is not None else group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.codec = Codec(_CODEC)
        self._alpha = float(torch.tensor(1.0 / self.size, dtype=torch.float32))  # fl32(1 / W), DeepSpeed's factor
        self._templates: Dict[tuple, torch.Tensor] = {}
        self.calls = 0  # compressed_allreduce calls so far (named in error messages)

    # -- helpers -------------------------------------------------------------------------------
    def _template(self, numel: int, device) -> torch.Tensor:
        """A valid onebit packet of ``numel`` float32 elements (its header), cached per size."""
        key = (numel, str(device))
        t = self._templates.get(key)
        if t is None:
            t = self.codec.encode(torch.zeros(numel, device=device))
            self._templates[key] = t
        return t

    def compressed_allreduce(self, buffer_m: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                             local_rank: Optional[int] = None) -> torch.Tensor:
        """The compressed mean of ``buffer_m`` over the group (see the module docstring).

        Returns a tensor of buffer_m's shape and dtype, identical on every rank; writes it into
        ``buffer_m`` when its numel equals worker_error's; updates both error buffers in place.
        ``local_rank`` is accepted for DeepSpeed's signature and not used (the device is
        buffer_m's).

        Raises:
            ValueError: bad buffers (module docstring), before anything is sent.
            gradcomp.CollectiveError: a collective failed; gradcomp.RankMismatchError: a server
                packet of another size or codec, or a rank that failed before the all-gather.
                Both error buffers are then as they were before the call.
        """
        W = self.size
        shape, n = buffer_m.shape, buffer_m.numel()
        if buffer_m.dtype not in _FLOATS:
            raise ValueError(f"OnebitBackend.compressed_allreduce: buffer_m is {buffer_m.dtype}; accepted: "
                             f"float32, float16, bfloat16, float64 (computed in float32)")
        for name, e in (("worker_error", worker_error), ("server_error", server_error)):
            if e.dtype != torch.float32 or e.device != buffer_m.device or not e.is_contiguous():
                raise ValueError(f"OnebitBackend.compressed_allreduce: {name} must be a contiguous float32 tensor on "
                                 f"{buffer_m.device}, got {e.dtype} on {e.device} with strides {tuple(e.stride())}")
        if n == 0:
            worker_error.zero_()
            server_error.zero_()
            return buffer_m
        Np = worker_error.numel()
        if Np < n or Np % (8 * W) != 0:
            raise ValueError(f"OnebitBackend.compressed_allreduce: worker_error has {Np} elements; it must hold at "
                             f"least buffer_m's {n} and be a multiple of 8 * world size = {8 * W} (DeepSpeed's "
                             f"optimizers pad to a multiple of W * lcm(W, 8))")
        C = Np // W
        if server_error.numel() != C:
            raise ValueError(f"OnebitBackend.compressed_allreduce: server_error has {server_error.numel()} "
                             f"elements and worker_error {Np}; accepted: server_error = worker_error / world size "
                             f"({W}) elements")
        self.calls += 1
        saved = (worker_error.clone(), server_error.clone())
        try:
            return self._exchange(buffer_m, worker_error, server_error, shape, n, Np, C)
        except Exception as e:  # noqa: BLE001 - undone, raised with its context
            worker_error.copy_(saved[0])
            server_error.copy_(saved[1])
            raise in_context(e, f"gradcomp.deepspeed.OnebitBackend.compressed_allreduce (call {self.calls}, {n} "
                                f"elements padded to {Np}, world size {W}; both error buffers are as before the "
                                f"call)") from e

    def _exchange(self, buffer_m, worker_error, server_error, shape, n: int, Np: int, C: int) -> torch.Tensor:
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
        # worker: one packet over the padded buffer, e_w updated in place
        p1 = self.codec.encode(buf, residual=worker_error)
        lay = self.codec.layout(Np, "float32")["sections"]
        boff, soff = lay[0][1], lay[1][1]
        cb = C // 8
        send = torch.empty(W, cb + 4, dtype=torch.uint8, device=buf.device)
        send[:, :cb] = p1[boff: boff + Np // 8].view(W, cb)
        send[:, cb:] = p1[soff: soff + 4].view(1, 4)
        recv = torch.empty_like(send)
        try:
            dist.all_to_all_single(recv, send, group=self.group)
        except Exception as e:  # noqa: BLE001 - named, cause kept
            raise collective_failed("the all-to-all of the worker signs", e) from e
        # server: rank order, float32 from +0.0, each term fl(+-s_i * fl(1 / W))
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
        gathered = aligned_empty(buf, W * P2)
        try:
            dist.all_gather_into_tensor(gathered, p2, group=self.group)
        except Exception as e:  # noqa: BLE001 - named, cause kept
            raise collective_failed("the all-gather of the server packets", e) from e
        if failed is not None:
            raise failed
        check_headers(gathered, P2, [(j, C) for j in range(W)], tmpl, "float32", "the all-gather of the server packets")
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
