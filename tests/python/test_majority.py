"""The ``majority`` scheme (signSGD with majority vote over ``onebit``) on real gloo groups.

The reference is numpy, written from the scheme's definition: two_phase's chunks (c = ceil(n / W)),
each rank's onebit l2 scale of chunk j of g_w / W (RMS, binary64), its signs (+ for y >= 0, as
onebit's bit = !(y < 0)); per element votes = sum of the signs, the result's sign is + where votes
>= 0 and its magnitude the sum of the ranks' scales of that chunk (to a float32 rounding: the
server re-encodes it with onebit). Also: ties go to +, error feedback runs, auto never picks the
scheme, other codecs are refused with the reason, the planner's bytes are two_phase's.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradcomp
from gradcomp import planner
from gradcomp.planner import schemes as registry

from ddp_helpers import run  # noqa: E402


def _grads(world, n, step):
    return [torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + w)) * (w + 1) for w in range(world)]


def reference(grads):
    W, n = len(grads), grads[0].numel()
    c = math.ceil(n / W)
    out = np.zeros(n, np.float64)
    votes_all = np.zeros(n, np.int64)
    for j in range(W):
        a, b = j * c, min(n, (j + 1) * c)
        if a >= b:
            continue
        ys = [(g.numpy()[a:b] / np.float32(W)).astype(np.float32) for g in grads]
        votes = sum(np.where(y < 0, -1, 1) for y in ys)
        m = sum(np.sqrt(np.mean(y.astype(np.float64) ** 2)) for y in ys)
        out[a:b] = np.where(votes >= 0, m, -m)
        votes_all[a:b] = votes
    return out, votes_all


def job_majority(rank, world, n, ef, steps):
    from gradcomp.torch import Compressor

    comp = Compressor("onebit", scheme="majority", error_feedback=ef, min_compress_numel=1)
    res = []
    for step in range(steps):
        g = _grads(world, n, step)[rank].clone()
        res.append(comp.allreduce(g, "w").wait().clone().numpy())
    return res


@pytest.mark.parametrize("world,n", [(3, 1000), (2, 999), (4, 1 << 14)])
def test_majority_matches_the_vote(world, n):
    res = run(world, job_majority, n, False, 1)
    for r in range(1, world):
        assert np.array_equal(res[r][0], res[0][0]), f"rank {r} differs from rank 0"
    got = res[0][0]
    want, votes = reference(_grads(world, n, 0))
    assert np.array_equal(np.sign(got), np.sign(want)), "the majority sign"
    np.testing.assert_allclose(np.abs(got), np.abs(want), rtol=2e-6)
    if world % 2 == 0:
        assert (votes == 0).any() and np.all(got[votes == 0] > 0), "ties go to +"


@pytest.mark.slow  # 3 ranks
def test_majority_with_error_feedback_runs_several_steps():
    res = run(3, job_majority, 3000, True, 3)
    for step in range(3):
        assert np.isfinite(res[0][step]).all()
        assert all(np.array_equal(res[r][step], res[0][step]) for r in range(3))
    # step 0 has no residual yet: the plain vote
    want, _ = reference(_grads(3, 3000, 0))
    assert np.array_equal(np.sign(res[0][0]), np.sign(want))


def job_refused(rank, world):
    from gradcomp.torch import Compressor

    msgs = []
    for spec in ("int8", "topk:ratio=0.01"):
        try:
            Compressor(spec, scheme="majority")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_other_codecs_are_refused():
    msgs = run(2, job_refused)[0]
    assert len(msgs) == 2
    assert "scheme='majority' needs the onebit codec (signs); got int8" in msgs[0]


def test_table_entry_planner_and_auto():
    s = registry.get("majority")
    assert s.accepts(gradcomp.Codec("onebit:scale=mean_abs")) and not s.accepts(gradcomp.Codec("fp16"))
    assert "majority" not in registry.candidates(gradcomp.Codec("onebit"))
    c = gradcomp.Codec("onebit")
    for W in (2, 8):
        assert planner.bucket_bytes("majority", c, 1 << 20, "float32", W) == \
            planner.bucket_bytes("two_phase", c, 1 << 20, "float32", W)
