"""A bucket whose buffers cannot be allocated fails the step on every rank before any collective
of it is started (issue 26: no rank is left waiting).

On 2 real gloo ranks, rank 1 lowers its address-space limit (RLIMIT_AS) to its current size plus
32 MiB, so the scheme context of a 2^24-element bucket (its packet, the all-gathered packets and the
float32 accumulator, 112 MiB) really fails to allocate there. Checked: both ranks' calls raise
within the gloo timeout, naming rank 1 and the bucket; then, the limit restored, the same call on
both ranks succeeds and equals the plain average of the int8 round trips.
"""

from __future__ import annotations

import resource
import time

import numpy as np
import pytest
import torch

import gradcomp
from gradcomp.experiments.pool import shared

N = 1 << 24


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


class _address_limit:
    """RLIMIT_AS at this process's current size plus ``extra`` bytes while inside (on ``on``)."""

    def __init__(self, extra: int, on: bool = True):
        self.extra, self.on = extra, on

    def __enter__(self):
        self.saved = resource.getrlimit(resource.RLIMIT_AS)
        if self.on:
            resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + self.extra, self.saved[1]))

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_AS, self.saved)


def job(rank, world):
    from gradcomp.torch import Compressor

    comp = Compressor("int8:block=4096", scheme="gather", min_compress_numel=1, error_feedback=False)
    t = torch.full((N,), float(rank + 1))
    t0 = time.monotonic()
    err = None
    try:
        with _address_limit(32 << 20, on=rank == 1):
            comp.allreduce(t, "w").wait()
    except Exception as e:  # noqa: BLE001 - the test reads its type and message
        err = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    out = comp.allreduce(t, "w").wait()  # memory back: the same call goes through
    return err, took, float(out[0]), float(out[-1])


def _run(fn):
    """``fn`` on a pool of 2 gloo ranks of its own (a rank still holds the failed step's
    callbacks at exit: GRADCOMP_EXIT_WAIT_S), closed after."""
    pool = shared(2, gloo_timeout_s=60.0, env=[{"GRADCOMP_EXIT_WAIT_S": "1"}] * 2)
    try:
        return pool.run(fn, timeout=240)
    finally:
        pool.close()


def test_allocation_failure_fails_every_rank_at_once():
    res = _run(job)
    for rank, (err, took, first, last) in enumerate(res):
        assert err is not None, f"rank {rank}: the call did not fail"
        assert "rank(s) 1 could not allocate the buffers of tensor 'w'" in err and "Nothing was sent" in err, err
        assert took < 30, f"rank {rank} waited {took:.1f} s"
        # both ranks' tensors are constant: int8 codes of 1.0 and 2.0 decode exactly, the mean is 1.5
        assert first == last == pytest.approx(1.5, abs=0), (rank, first, last)


def job_fsdp2(rank, world):
    """FSDP2 on a CPU mesh: rank 1's reduce-scatter context of its unit (a Linear(4096, 4096))
    is built under RLIMIT_AS at the process's current size, so its allocations really fail."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradcomp.torch import fsdp

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    m = nn.Sequential(nn.Linear(4096, 4096, bias=False))
    fully_shard(m, mesh=mesh)
    fsdp.register(m, "int8", error_feedback=True)
    real = fsdp.ReduceScatterContext
    limited = {"on": rank == 1}

    def context(*a, **k):
        with _address_limit(0, on=limited["on"]):
            return real(*a, **k)

    fsdp.ReduceScatterContext = context
    x = torch.randn(8, 4096, generator=torch.Generator().manual_seed(rank))
    t0 = time.monotonic()
    err = None
    try:
        m(x).pow(2).sum().backward()
    except Exception as e:  # noqa: BLE001 - the test reads its message
        err = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    limited["on"] = False  # memory back: the next step goes through
    m.zero_grad()
    m(x).pow(2).sum().backward()
    fsdp.ReduceScatterContext = real
    g = m[0].weight.grad
    return err, took, float((g.to_local() if hasattr(g, "to_local") else g).abs().sum())


def test_fsdp2_allocation_failure_fails_every_rank_at_once():
    res = _run(job_fsdp2)
    for rank, (err, took, gsum) in enumerate(res):
        assert err is not None, f"rank {rank}: the backward did not fail"
        assert "rank(s) 1 could not allocate the unit's buffers" in err and "Nothing was sent" in err, err
        assert took < 30, f"rank {rank} waited {took:.1f} s"
        assert gsum > 0, f"rank {rank}: the retried step left no gradient"
