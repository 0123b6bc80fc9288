"""``terngrad`` (TernGrad, docs/contracts.md section 3) through the Python bindings.

The reference is an independent numpy simulation of TernGrad (Wen et al., NeurIPS 2017: clip at c
standard deviations, s = max |y_c|, b = sign(y) Bernoulli(|y_c| / s), D = s b) given the same
uniforms: the documented Philox4x32-10 words (numpy, test_stochastic_rounding.py's implementation),
u = (R >> 8) * 2^-24, and sigma from binary64 sums in the documented lane order. Checks:
  - packets (2-bit codes, scale, key) and residuals bitwise equal to the simulation, every input
    dtype, clip 2.5 and none, divisors 1 and 3, with and without a residual, sizes across tiles;
  - unbiasedness by Monte Carlo (``clip=0``) over 2^14 keys within 5 sigma, sigma^2 = s^2 p (1 - p)
    / 2^14; with clipping the mean is the clipped value;
  - a non-finite value makes the scale NaN, every code 0 and the decode NaN, and flags the packet;
    a code byte holding the pattern 10 is refused (CorruptPacketError) before anything is written;
  - the same packet on 2 gloo ranks for the same key; CUDA (skipped without a GPU) equal to the CPU.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes  # noqa: F401
import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from ddp_helpers import run  # noqa: E402
from test_stochastic_rounding import MASK, philox4x32_10, philox_scalar  # noqa: E402

TAG = 0x5445524E  # ASCII "TERN", read big-endian
F32 = np.float32
TILE = 4096


def words(key, n):
    seed, step, bucket, chunk = key
    m = philox_scalar((step, bucket, chunk, TAG), (seed & 0xFFFFFFFF, seed >> 32))
    groups = (n + 3) // 4
    g = np.arange(groups, dtype=np.uint64)
    w = philox4x32_10((g & MASK, g >> np.uint64(32), np.full(groups, m[2], np.uint64),
                       np.full(groups, m[3], np.uint64)), np.uint64(m[0]), np.uint64(m[1]))
    return np.stack(w, axis=1).reshape(-1)[:n].astype(np.uint32)


def lane_sum(rows):
    """[k, R, 32] -> [k]: lanes add their column top to bottom, then fold 16, 8, 4, 2, 1."""
    lanes = np.zeros(rows.shape[::2])
    for i in range(rows.shape[1]):
        lanes = lanes + rows[:, i, :]
    for o in (16, 8, 4, 2, 1):
        lanes[:, :o] = lanes[:, :o] + lanes[:, o: 2 * o]
    return lanes[:, 0]


def sums(y):
    n = y.size
    nt = (n + TILE - 1) // TILE
    yy = np.zeros(nt * TILE)
    yy[:n] = y.astype(np.float64)
    t1 = lane_sum(yy.reshape(nt, TILE // 32, 32))
    t2 = lane_sum((yy * yy).reshape(nt, TILE // 32, 32))
    rows = (nt + 31) // 32
    f1 = np.zeros(rows * 32)
    f2 = np.zeros(rows * 32)
    f1[:nt], f2[:nt] = t1, t2
    return lane_sum(f1.reshape(1, rows, 32))[0], lane_sum(f2.reshape(1, rows, 32))[0]


def simulate(x32, r, divisor, key, c):
    n = x32.size
    xp = x32 if r is None else (x32 + r).astype(F32)
    y = xp if divisor == 1 else (xp / F32(divisor)).astype(F32)
    if not np.isfinite(y).all():
        s = F32(np.nan)
        b = np.zeros(n, np.int64)
    else:
        if c == 0:
            clip = F32(np.inf)
        else:
            S1, S2 = sums(y)
            mean = S1 / n
            clip = F32(c * np.sqrt(max(S2 / n - mean * mean, 0.0)))
        yc = np.clip(y, -clip, clip).astype(F32)
        s = F32(np.abs(yc).max()) if n else F32(0)
        if s > 0:
            p = (np.abs(yc) / s).astype(F32)
            u = (words(key, n) >> 8).astype(F32) * F32(2.0 ** -24)
            b = np.where(u < p, np.where(np.signbit(yc), -1, 1), 0)
        else:
            b = np.zeros(n, np.int64)
    with np.errstate(invalid="ignore"):
        D = (s * b.astype(F32)).astype(F32)
        r_new = None if r is None else (xp - (D if divisor == 1 else (F32(divisor) * D).astype(F32))).astype(F32)
    bits = np.where(b == 1, 1, np.where(b == -1, 3, 0)).astype(np.uint8)
    padded = np.zeros(((n + 3) // 4) * 4, np.uint8)
    padded[:n] = bits
    q = padded.reshape(-1, 4)
    codes = (q[:, 0] | (q[:, 1] << 2) | (q[:, 2] << 4) | (q[:, 3] << 6)).astype(np.uint8)
    return codes, s, D, r_new


def _input(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 2
    if n > 100:
        x[17] = 40.0  # an outlier the clipping cuts
    x = x.to(getattr(torch, dtype))
    return x, x.float().numpy()


def parts(c, p, n):
    raw = p.numpy()
    (_, co, cn, _), (_, so, _, _), _ = c.layout(n)["sections"]
    return raw[co: co + cn], raw[so: so + 4].view(np.float32)[0]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec,clip", [("terngrad", 2.5), ("terngrad:clip=0", 0.0)])
def test_bitwise_against_the_simulation(spec, clip, dtype):
    c = gradcomp.Codec(spec)
    for n in (1, 7, 5000, 70001):
        x, x32 = _input(n, dtype, n)
        for key in [(0, 0, 0, 0), (2 ** 35 + 1, 3, 2, 1)]:
            for divisor in (1.0, 3.0):
                r0 = (np.random.default_rng(n).standard_normal(n) * 0.01).astype(F32)
                rt = torch.from_numpy(r0.copy())
                p = c.encode(x, residual=rt, divisor=divisor, key=key)
                codes, s, D, r_new = simulate(x32, r0, divisor, key, clip)
                got_codes, got_s = parts(c, p, n)
                where = (spec, dtype, n, key, divisor)
                assert np.float32(got_s).view(np.uint32) == np.float32(s).view(np.uint32), where
                assert np.array_equal(got_codes, codes), where
                assert np.array_equal(rt.numpy().view(np.uint32), r_new.view(np.uint32)), where
                out = c.decode(p, numel=n)
                assert np.array_equal(out.numpy(), D), where
                acc = c.decode(p, out=torch.ones(n, dtype=torch.bfloat16), accumulate=True, alpha=0.5)
                assert torch.equal(acc, torch.from_numpy((F32(1) + (D * F32(0.5)).astype(F32)).astype(F32)).to(
                    torch.bfloat16)), where
                p2 = c.encode(x, divisor=divisor, key=key)
                assert np.array_equal(parts(c, p2, n)[0], simulate(x32, None, divisor, key, clip)[0]), where


def test_unbiased_without_clipping_and_clipped_mean_with():
    n, keys = 64, 1 << 14
    x = torch.linspace(-1, 1, n) ** 3
    x[5] = 3.0  # cut by the clipping
    x32 = x.numpy()
    for spec, clip in (("terngrad:clip=0", 0.0), ("terngrad", 2.5)):
        c = gradcomp.Codec(spec)
        total = np.zeros(n)
        for seed in range(keys):
            total += c.decode(c.encode(x, key=(seed, 1, 0, 0)), numel=n).numpy()
        mean = total / keys
        _, s, _, _ = simulate(x32, None, 1.0, (0, 1, 0, 0), clip)
        if clip:
            S1, S2 = sums(x32)
            cl = F32(clip * np.sqrt(S2 / n - (S1 / n) ** 2))
            target = np.clip(x32, -cl, cl).astype(np.float64)
            assert target[5] < 3.0
        else:
            target = x32.astype(np.float64)
        p = np.abs(target) / float(s)
        sigma = float(s) * np.sqrt(p * (1 - p)) / np.sqrt(keys)
        assert np.all(np.abs(mean - target) <= 5 * sigma + 1e-6 * abs(float(s))), (spec, np.max(np.abs(mean - target)))


def test_nonfinite_and_corrupt_codes():
    c = gradcomp.Codec("terngrad")
    x = torch.randn(100)
    x[50] = float("inf")
    r = torch.zeros(100)
    p = c.encode(x, residual=r, key=(1, 2, 3, 4))
    codes, s = parts(c, p, 100)
    assert p[11] & 1 and np.isnan(s) and not codes.any()
    assert torch.isnan(c.decode(p, numel=100)).all() and torch.isnan(r).all()
    good = c.encode(torch.randn(100), key=(1, 2, 3, 4))
    bad = good.clone()
    bad[32 + 3] = 0b10_00_01_11
    out = torch.full((100,), 9.0)
    with pytest.raises(gradcomp.CorruptPacketError, match="pattern 10"):
        c.decode(bad, out=out)
    assert torch.equal(out, torch.full((100,), 9.0))


@pytest.mark.parametrize("spec,msg", [("terngrad:clip=-1", r"clip=-1 is out of range"),
                                      ("terngrad:clip=nan", "clip"), ("terngrad:levels=3", "levels")])
def test_bad_specs(spec, msg):
    with pytest.raises(gradcomp.InvalidArgumentError, match=msg):
        gradcomp.Codec(spec)


def test_layout_and_properties():
    c = gradcomp.Codec("terngrad:clip=2.5")
    assert c.spec == "terngrad"
    assert c.layout(10)["sections"] == [("codes", 32, 3, "uint8"), ("scale", 48, 1, "float32"), ("key", 64, 32, "uint8")]
    assert c.packet_bytes(10 ** 6) == 32 + 250000 + 16 + 32
    assert not c.properties["unbiased"] and gradcomp.Codec("terngrad:clip=0").properties["unbiased"]
    assert c.properties["keyed"] and not c.properties["linear"]


def job_same_packet(rank, world, n):
    c = gradcomp.Codec("terngrad")
    x = torch.randn(n, generator=torch.Generator().manual_seed(8))
    p = c.encode(x, key=(5, 6, 7, 0))
    got = [torch.empty_like(p) for _ in range(world)]
    dist.all_gather(got, p)
    return [t.numpy().tobytes() for t in got]


def test_same_packet_on_every_rank():
    n = 10001
    res = run(2, job_same_packet, n)
    blobs = {b for r in res for b in r}
    assert len(blobs) == 1
    x32 = torch.randn(n, generator=torch.Generator().manual_seed(8)).numpy()
    codes, _, _, _ = simulate(x32, None, 1.0, (5, 6, 7, 0), 2.5)
    assert np.array_equal(np.frombuffer(blobs.pop(), np.uint8)[32: 32 + codes.size], codes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_packets_equal_the_cpu(dtype):
    if not gradcomp.build_info()["cuda"]:
        pytest.skip("a CPU-only build")
    for spec in ("terngrad", "terngrad:clip=0"):
        c = gradcomp.Codec(spec)
        for n in (1, 9, 70001, (1 << 20) + 3):
            x, _ = _input(n, dtype, n)
            r0 = torch.randn(n) * 0.01
            for key in [(0, 0, 0, 0), (7, 8, 9, 10)]:
                rc, rg = r0.clone(), r0.clone().cuda()
                pc = c.encode(x, residual=rc, divisor=3.0, key=key)
                pg = c.encode(x.cuda(), residual=rg, divisor=3.0, key=key)
                torch.cuda.synchronize()
                assert torch.equal(pg.cpu(), pc), (spec, n, dtype, key)
                assert torch.equal(rg.cpu().view(torch.int32), rc.view(torch.int32)), (spec, n, dtype, key)
                assert torch.equal(c.decode(pc.cuda(), numel=n).cpu(), c.decode(pc, numel=n))
