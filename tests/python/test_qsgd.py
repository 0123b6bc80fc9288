"""``qsgd`` (QSGD, docs/contracts.md section 3) through the Python bindings.

The reference is an independent numpy simulation of GRACE's QSGD (qsgd.py: ``level_float = s /
norm * |x|``, ``previous_level = floor``, ``is_next_level = prob < level_float - previous_level``,
``new_level * sign``, decode ``norm / s * code``) per block, in float32, given the same uniforms:
the documented Philox4x32-10 words (numpy, test_stochastic_rounding.py's implementation), u = (R >>
8) * 2^-24, and the block norm from the documented binary64 lane order. Checks:
  - packets (codes, norms, key) and residuals bitwise equal to the simulation: GRACE's defaults
    (s = 127, block 128), s = 16, s = 1, a block of 7 and of 4096, every input dtype, divisors 1
    and 3, with and without a residual; decode into every dtype, assign and accumulate;
  - unbiasedness by Monte Carlo over 2^14 keys: each decoded element's mean within 5 sigma of y,
    sigma^2 = (norm / s)^2 p (1 - p) / 2^14 with p = q - floor(q) from the simulation; the mean
    squared error within QSGD's bound min(B / s^2, sqrt(B) / s) ||y||^2 per block (Alistarh et al.,
    NeurIPS 2017, Lemma 3.1);
  - the same packet on 2 and 3 gloo ranks for the same key, another one for the next step;
  - a non-finite value makes its block's norm NaN and codes zero, flags the packet; bad specs name
    the value and the accepted range;
  - CUDA (skipped without a GPU): packets and residuals equal to the CPU's.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes  # noqa: F401  (bfloat16 for numpy)
import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from ddp_helpers import run  # noqa: E402
from test_stochastic_rounding import MASK, philox4x32_10, philox_scalar  # noqa: E402

TAG = 0x51534744  # ASCII "QSGD", read big-endian
F32 = np.float32


def words(key, n):
    """R_i for i in [0, n): the element's 32-bit Philox word."""
    seed, step, bucket, chunk = key
    m = philox_scalar((step, bucket, chunk, TAG), (seed & 0xFFFFFFFF, seed >> 32))
    groups = (n + 3) // 4
    g = np.arange(groups, dtype=np.uint64)
    w = philox4x32_10((g & MASK, g >> np.uint64(32), np.full(groups, m[2], np.uint64),
                       np.full(groups, m[3], np.uint64)), np.uint64(m[0]), np.uint64(m[1]))
    return np.stack(w, axis=1).reshape(-1)[:n].astype(np.uint32)


def block_norms(y, block):
    """fl32(sqrt(S)) per block, S the binary64 sum of y^2 in the lane order: lane l adds elements
    l, l + 32, ... in order, then lanes fold v[l] += v[l + o] for o = 16, 8, 4, 2, 1."""
    n = y.size
    nb = (n + block - 1) // block
    rows = (block + 31) // 32
    sq = np.zeros((nb, rows * 32))
    yb = np.zeros(nb * block)
    yb[:n] = y.astype(np.float64)
    sq[:, :block] = (yb * yb).reshape(nb, block)
    lanes = np.zeros((nb, 32))
    for row in range(rows):
        lanes = lanes + sq[:, row * 32: (row + 1) * 32]
    for o in (16, 8, 4, 2, 1):
        lanes[:, :o] = lanes[:, :o] + lanes[:, o: 2 * o]
    norms = np.sqrt(lanes[:, 0]).astype(F32)
    bad = ~np.isfinite(np.pad(y, (0, nb * block - n))).reshape(nb, block).all(axis=1)
    norms[bad] = np.float32(np.nan)
    return norms, bad


def simulate(x32, r, divisor, key, s, block):
    """GRACE's QSGD per block given our uniforms: (codes int8, norms, D, new residual or None, p)."""
    n = x32.size
    xp = x32 if r is None else (x32 + r).astype(F32)
    y = xp if divisor == 1 else (xp / F32(divisor)).astype(F32)
    norms, bad = block_norms(y, block)
    nb = norms.size
    norm_e = np.repeat(norms, block)[:n]
    bad_e = np.repeat(bad, block)[:n]
    usable = np.isfinite(norm_e) & (norm_e != 0)
    with np.errstate(all="ignore"):
        ratio = np.where(usable, (F32(s) / norm_e).astype(F32), F32(0))
        level_float = (ratio * np.abs(y)).astype(F32)  # s / norm * |x|
        previous_level = np.floor(level_float)
        frac = (level_float - previous_level).astype(F32)
        prob = (words(key, n) >> 8).astype(F32) * F32(2.0 ** -24)
        is_next_level = (prob < frac).astype(F32)
        new_level = np.minimum(previous_level + is_next_level, F32(s))  # the clamp: q may pass s by a rounding
        codes = np.where(np.signbit(y), -new_level, new_level)
        codes = np.where(bad_e, 0, codes).astype(np.int8)
        D = ((norm_e / F32(s)).astype(F32) * codes.astype(F32)).astype(F32)  # norm / s * code
        r_new = None if r is None else (xp - (D if divisor == 1 else (F32(divisor) * D).astype(F32))).astype(F32)
    assert nb == (n + block - 1) // block
    return codes, norms, D, r_new, np.where(bad_e, 0, frac)


def _input(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-6, 6, (n,), generator=g).float())).to(
        getattr(torch, dtype))
    return x, x.float().numpy()


def sections(c, packet, n):
    raw = packet.numpy() if isinstance(packet, torch.Tensor) else packet
    (_, co, cn, _), (_, no, nn, _), _ = c.layout(n)["sections"]
    return raw[co: co + cn].view(np.int8), raw[no: no + 4 * nn].view(np.float32)


SPECS = [("qsgd", 127, 128), ("qsgd:levels=16", 16, 128), ("qsgd:levels=1,block=7", 1, 7),
         ("qsgd:block=4096", 127, 4096)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec,s,block", SPECS)
def test_bitwise_against_grace_simulation(spec, s, block, dtype):
    c = gradcomp.Codec(spec)
    for n in (1, 100, 4097, 70001):
        x, x32 = _input(n, dtype, n + s)
        for key in [(0, 0, 0, 0), (2 ** 33 + 5, 9, 4, 1)]:
            for divisor in (1.0, 3.0):
                r0 = (np.random.default_rng(n).standard_normal(n) * 0.01).astype(F32)
                rt = torch.from_numpy(r0.copy())
                p = c.encode(x, residual=rt, divisor=divisor, key=key)
                codes, norms, D, r_new, _ = simulate(x32, r0, divisor, key, s, block)
                got_c, got_n = sections(c, p, n)
                where = (spec, dtype, n, key, divisor)
                assert np.array_equal(got_n.view(np.uint32), norms.view(np.uint32)), where
                assert np.array_equal(got_c, codes), where
                assert np.array_equal(rt.numpy().view(np.uint32), r_new.view(np.uint32)), where
                assert c.packet_key(p) == key and not p[11] & 1
                for out_dt in ("float32", "bfloat16"):
                    t = getattr(torch, out_dt)
                    out = c.decode(p, out=torch.full((n,), 5.0, dtype=t))
                    assert torch.equal(out, torch.from_numpy(D).to(t)), where
                    acc = c.decode(p, out=torch.ones(n, dtype=t), accumulate=True, alpha=0.5)
                    want = (F32(1) + (D * F32(0.5)).astype(F32)).astype(F32)
                    assert torch.equal(acc, torch.from_numpy(want).to(t)), where
                p2 = c.encode(x, divisor=divisor, key=key)
                codes2, _, _, _, _ = simulate(x32, None, divisor, key, s, block)
                assert np.array_equal(sections(c, p2, n)[0], codes2), where


def test_unbiased_and_within_the_variance_bound():
    n, s, keys = 256, 4, 1 << 14
    c = gradcomp.Codec(f"qsgd:levels={s},block=128")
    x = torch.linspace(-1, 2, n) ** 3
    x32 = x.numpy()
    total = np.zeros(n)
    sq_err = 0.0
    for seed in range(keys):
        d = c.decode(c.encode(x, key=(seed, 3, 1, 0)), numel=n).numpy().astype(np.float64)
        total += d
        sq_err += float(((d - x32) ** 2).sum())
    mean = total / keys
    _, norms, _, _, p = simulate(x32, None, 1.0, (0, 3, 1, 0), s, 128)
    scale = np.repeat(norms.astype(np.float64) / s, 128)[:n]
    sigma = scale * np.sqrt(p * (1 - p)) / np.sqrt(keys)
    # float32 roundings of q and D bias each element by at most a few ulps of y
    tol = 5 * sigma + 4 * np.spacing(np.abs(x32)).astype(np.float64)
    assert np.all(np.abs(mean - x32) <= tol), float(np.max(np.abs(mean - x32) / tol))
    norm2 = float((x32.astype(np.float64) ** 2).sum())
    bound = min(128 / s ** 2, np.sqrt(128) / s) * norm2
    assert sq_err / keys <= bound, (sq_err / keys, bound)


def test_nonfinite_block():
    c = gradcomp.Codec("qsgd:block=8")
    x = torch.arange(1, 25, dtype=torch.float32)
    x[10] = float("nan")
    r = torch.zeros(24)
    p = c.encode(x, residual=r, key=(1, 1, 1, 1))
    codes, norms = sections(c, p, 24)
    assert p[11] & 1
    assert np.isnan(norms[1]) and np.isfinite(norms[[0, 2]]).all()
    assert not codes[8:16].any() and codes[:8].all()
    out = c.decode(p, numel=24)
    assert torch.isnan(out[8:16]).all() and torch.isfinite(out[:8]).all() and torch.isfinite(out[16:]).all()
    assert torch.isnan(r[8:16]).all()


@pytest.mark.parametrize("spec,msg", [
    ("qsgd:levels=0", r"levels=0 is out of range; accepted: an integer in \[1, 127\]"),
    ("qsgd:levels=128", r"levels=128 is out of range"), ("qsgd:block=0", r"block=0 is out of range"),
    ("qsgd:block=4097", r"accepted: an integer in \[1, 4096\]"), ("qsgd:levels=x", "levels"),
    ("qsgd:ratio=0.1", "ratio")])
def test_bad_specs(spec, msg):
    with pytest.raises(gradcomp.InvalidArgumentError, match=msg):
        gradcomp.Codec(spec)


def test_canonical_spec_and_layout():
    assert gradcomp.Codec("qsgd:levels=127,block=128").spec == "qsgd"
    c = gradcomp.Codec("qsgd:levels=16")
    assert c.spec == "qsgd:levels=16"
    lay = c.layout(1000, "bfloat16")
    assert lay["sections"] == [("codes", 32, 1000, "int8"), ("norms", 1040, 8, "float32"), ("key", 1072, 32, "uint8")]
    assert lay["main_param"] == 128 and lay["wire_dtype"] == "int8"
    assert c.properties == {"linear": False, "unbiased": True, "deterministic": True, "exact_residual": False,
                            "keyed": True, "sparse": False}


# ---- gloo ranks ----------------------------------------------------------------------------------------------
def job_same_packet(rank, world, n):
    c = gradcomp.Codec("qsgd:levels=16")
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    out = []
    for step in (0, 1):
        p = c.encode(x, key=(42, step, 7, 0))
        got = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(got, p)
        out.append([t.numpy().tobytes() for t in got])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_same_packet_on_every_rank(world):
    n = 20001
    res = run(world, job_same_packet, n)
    x32 = torch.randn(n, generator=torch.Generator().manual_seed(5)).numpy()
    for step in (0, 1):
        blobs = {b for r in range(world) for b in res[r][step]}
        assert len(blobs) == 1, f"step {step}: the ranks' packets differ"
        codes, _, _, _, _ = simulate(x32, None, 1.0, (42, step, 7, 0), 16, 128)
        assert np.array_equal(np.frombuffer(blobs.pop(), np.uint8)[32: 32 + n].view(np.int8), codes)
    assert res[0][0][0] != res[0][1][0]


# ---- CUDA ------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_packets_equal_the_cpu(dtype):
    if not gradcomp.build_info()["cuda"]:
        pytest.skip("a CPU-only build")
    for spec, _, _ in SPECS:
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
                oc = c.decode(pc, numel=n)
                og = c.decode(pc.cuda(), numel=n)
                assert torch.equal(og.cpu().view(torch.int32), oc.view(torch.int32)), (spec, n, dtype)
