"""``bf16:rounding=stochastic``, the first keyed codec (docs/contracts.md section 3), through the
Python bindings.

The reference is this file's own: Philox4x32-10 in numpy (from the Random123 paper's spec,
Salmon et al., SC 2011, checked here against Random123's known answers and a plain-Python scalar
version), the documented derivation of the stream from the key ``(seed, step, bucket, chunk)`` and
the element index, and the rounding rule by value in float64 (the lower bfloat16 neighbour and
the gap above it; up iff 65536 (|y| - lo) / gap + R >= 65536). Checks:
  - packets and residuals bitwise equal to the reference (every input dtype, torch and numpy
    inputs, with and without a residual, divisors 1 and 3, sizes around the 8-element groups);
  - unbiasedness by Monte Carlo: over 2^14 keys the mean of each decoded element is within 5 sigma
    of x, sigma^2 = p (1 - p) gap^2 / 2^14 derived here from x (p the rounding-up probability);
    elements that are bfloat16 values come back exactly; each decode is one of the two neighbours;
  - the top of the finite range: above the largest finite bfloat16 the code is inf with
    probability (low 16 bits) / 65536;
  - on 2 and 3 real gloo ranks (ddp_helpers.run): the same key gives the same packet on every
    rank, the next step another one;
  - the key API: 4-tuples, 3-tuples as chunk 0, errors naming the value and the ranges;
  - CUDA (skipped without a GPU): packets equal to the CPU's.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from ddp_helpers import run  # noqa: E402

SPEC = "bf16:rounding=stochastic"
M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK = np.uint64(0xFFFFFFFF)
TAG = 0x42463136  # ASCII "BF16", read big-endian: counter word 3 of the stream derivation


# ---- the reference ------------------------------------------------------------------------------------
def philox4x32_10(c, k0, k1):
    """Philox4x32-10 of counters ``c`` (four uint64 arrays holding 32-bit words) under the key
    (k0, k1) (Python ints or uint64 arrays). Per round, with the 64-bit products split in halves:
    c = {hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0)}; then k += (W0, W1)."""
    c0, c1, c2, c3 = (np.asarray(w, np.uint64) for w in c)
    k0, k1 = np.uint64(k0) if np.isscalar(k0) else k0, np.uint64(k1) if np.isscalar(k1) else k1
    for _ in range(10):
        p0, p1 = M0 * c0, M1 * c2  # < 2^64: exact in uint64
        c0, c1, c2, c3 = (p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & MASK, (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & MASK
        k0, k1 = (k0 + np.uint64(W0)) & MASK, (k1 + np.uint64(W1)) & MASK
    return c0, c1, c2, c3


def philox_scalar(c, k):
    """The same in plain Python integers (a second, independent spelling)."""
    c, (k0, k1) = list(c), k
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & 0xFFFFFFFF, p1 & 0xFFFFFFFF, ((p0 >> 32) ^ c[3] ^ k1) & 0xFFFFFFFF,
             p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + W0) & 0xFFFFFFFF, (k1 + W1) & 0xFFFFFFFF
    return tuple(c)


def uniforms(key, n):
    """R_i for i in [0, n): the 16-bit uniforms of an encode keyed by (seed, step, bucket, chunk)."""
    seed, step, bucket, chunk = key
    m = philox_scalar((step, bucket, chunk, TAG), (seed & 0xFFFFFFFF, seed >> 32))
    groups = (n + 7) // 8
    j = np.arange(groups, dtype=np.uint64)
    w = philox4x32_10((j & MASK, j >> np.uint64(32), np.full(groups, m[2], np.uint64),
                       np.full(groups, m[3], np.uint64)), np.uint64(m[0]), np.uint64(m[1]))
    words = np.stack([x.astype("<u4") for x in w], axis=1)  # [groups, 4]: w0..w3
    return words.view("<u2").reshape(-1)[:n].astype(np.uint32)  # 16 bytes little-endian as eight u16


def round_sr(y, r16):
    """float32 y -> bfloat16 bits with uniforms r16, by value (float64): lo = the largest bfloat16
    <= |y|, gap the spacing above it (2^-133 below 2^-126); up iff 65536 (|y| - lo) / gap + R >=
    65536; past the largest finite bfloat16 (2^128) inf; NaN / inf as the nearest cast."""
    y = np.asarray(y, np.float32)
    sign = (y.view(np.uint32) >> np.uint32(16)) & np.uint32(0x8000)
    a = np.abs(y.astype(np.float64))
    fin = np.isfinite(a)
    af = np.where(fin, a, 1.0)
    _, e = np.frexp(af)  # af in [2^(e-1), 2^e)
    gap = np.where(af < 2.0 ** -126, 2.0 ** -133, np.ldexp(1.0, e - 8))
    lo = np.floor(af / gap) * gap
    frac = (af - lo) / gap * 65536.0
    assert np.array_equal(frac, np.floor(frac))
    q = np.where(frac + r16 >= 65536.0, lo + gap, lo)
    with np.errstate(over="ignore"):
        code = np.where(q >= 2.0 ** 128, np.uint32(0x7F80), q.astype(np.float32).view(np.uint32) >> np.uint32(16))
    code = np.where(np.isnan(y), np.uint32(0x7FC0), np.where(np.isinf(y), np.uint32(0x7F80), code))
    return (code | sign).astype(np.uint16)


def reference(x32, r, divisor, key):
    """(codes, r_new or None, non-finite flag) for float32 values x32 (x widened exactly)."""
    with np.errstate(all="ignore"):
        xp = x32 if r is None else (x32 + r).astype(np.float32)
        y = xp if divisor == 1.0 else (xp / np.float32(divisor)).astype(np.float32)
        codes = round_sr(y, uniforms(key, x32.size))
        d = (codes.astype(np.uint32) << np.uint32(16)).view(np.float32)
        rn = None if r is None else (xp - d if divisor == 1.0 else xp - (np.float32(divisor) * d).astype(np.float32))
    return codes, rn, bool(((codes & 0x7F80) == 0x7F80).any())


def payload(packet, n):
    b = packet.numpy() if isinstance(packet, torch.Tensor) else np.asarray(packet)
    return b[32: 32 + 2 * n].copy().view("<u2")


def f32bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def test_reference_philox_known_answers():
    """Random123's kat_vectors for philox4x32 with 10 rounds, both spellings of the reference."""
    kats = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
            ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
            ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
             (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for c, k, want in kats:
        assert philox_scalar(c, k) == want
        got = philox4x32_10(tuple(np.array([v], np.uint64) for v in c), k[0], k[1])
        assert tuple(int(w[0]) for w in got) == want
    # the rounding reference on hand-checked values
    cases = [(0x3F800000, 0xFFFF, 0x3F80), (0x3F808000, 0x7FFF, 0x3F80), (0x3F808000, 0x8000, 0x3F81),
             (0xBF80FFFF, 0, 0xBF80), (0xBF80FFFF, 1, 0xBF81), (0x3F7FFFFF, 1, 0x3F80), (0x00000001, 0xFFFF, 0x0001),
             (0x007FFFFF, 1, 0x0080), (0x7F7FFFFF, 0, 0x7F7F), (0x7F7FFFFF, 1, 0x7F80), (0x80000000, 0xFFFF, 0x8000)]
    for bits, r, want in cases:
        assert int(round_sr(np.array([bits], np.uint32).view(np.float32), np.array([r]))[0]) == want, hex(bits)


# ---- bitwise -----------------------------------------------------------------------------------------
def _input(n, dtype, seed):
    g = np.random.default_rng(seed)
    v = (g.standard_normal(n) * 3).astype(np.float32)
    if n > 8:  # any bit pattern here and there: NaN payloads, inf, subnormals, huge values
        at = g.choice(n, size=max(1, n // 64), replace=False)
        v[at] = g.integers(0, 2**32, size=at.size, dtype=np.uint64).astype(np.uint32).view(np.float32)
    t = torch.from_numpy(v).to(getattr(torch, dtype))
    return t, t.float().numpy()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 17, 1000, 65537, (1 << 17) + 3])
def test_bitwise_against_the_reference(n, dtype):
    c = gradcomp.Codec(SPEC)
    x, x32 = _input(n, dtype, n * 7 + len(dtype))
    r0 = (np.random.default_rng(n).standard_normal(n) * 0.01).astype(np.float32)
    for key in [(0, 0, 0, 0), (0x0123456789ABCDEF, 7, 3, 1), (2**64 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1)]:
        for divisor in (1.0, 3.0):
            for with_r in (False, True):
                what = f"n {n} {dtype} key {key} divisor {divisor} residual {with_r}"
                res = torch.from_numpy(r0.copy()) if with_r else None
                p = c.encode(x, residual=res, divisor=divisor, key=key)
                codes, rn, nonfinite = reference(x32, r0 if with_r else None, divisor, key)
                got = payload(p, n)
                bad = np.flatnonzero(got != codes)
                assert bad.size == 0, f"{what}: codes differ at {bad[:8]}: {got[bad[:4]]} vs {codes[bad[:4]]}"
                if with_r:
                    assert np.array_equal(f32bits(res.numpy()), f32bits(rn)), what
                assert int(p[11]) == int(nonfinite), what
                assert c.packet_key(p) == key
                # the decode is the codes, widened
                d = c.decode(p, numel=n).numpy()
                assert np.array_equal(f32bits(d), (codes.astype(np.uint32) << np.uint32(16))), what


def test_numpy_input_and_threads():
    """numpy arrays (float32, and ml_dtypes bfloat16) give the packets torch tensors do; the thread
    count changes nothing."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    c = gradcomp.Codec(SPEC)
    n = (1 << 17) + 5
    x, x32 = _input(n, "float32", 5)
    key = (99, 1, 2, 3)
    want = c.encode(x, key=key).numpy().copy()
    assert np.array_equal(c.encode(x32, key=key), want)
    xb = x.to(torch.bfloat16)
    assert np.array_equal(c.encode(xb.float().numpy().astype(ml_dtypes.bfloat16), key=key), c.encode(xb, key=key))
    old = gradcomp.get_num_threads()
    try:
        for t in (1, 2, 3):
            gradcomp.set_num_threads(t)
            assert np.array_equal(c.encode(x, key=key).numpy(), want), f"{t} threads"
    finally:
        gradcomp.set_num_threads(old)


# ---- unbiasedness ----------------------------------------------------------------------------------------
def test_unbiased_by_monte_carlo():
    """Over K = 2^14 keys the mean of each decoded element is within 5 sigma of x, with the
    per-element variance p (1 - p) gap^2 (the decode is lo + gap with probability p, else lo:
    p = (|x| - lo) / gap) and sigma = sqrt(p (1 - p)) gap / sqrt(K). Elements that are bfloat16
    values (p = 0) come back exactly every time."""
    c = gradcomp.Codec(SPEC)
    g = np.random.default_rng(2024)
    x = np.concatenate([
        (g.standard_normal(40) * 10.0 ** g.integers(-30, 30, 40)).astype(np.float32),
        np.array([1.0, -2.5, 0.0, -0.0, 3.0e38, 1e-40, -1e-42], np.float32),  # exact / subnormal / large
        np.array([0x3F808000, 0x3F800001, 0x3F80FFFF, 0xBF7FFFFF, 0x00000001], np.uint32).view(np.float32),
    ])
    n, K = x.size, 1 << 14
    xt = torch.from_numpy(x)
    ws = c.workspace(xt, n)
    out = gradcomp.aligned_empty(xt, c.packet_bytes(n))
    total = np.zeros(n, np.float64)
    a = np.abs(x.astype(np.float64))
    _, e = np.frexp(a)
    gap = np.where(a < 2.0 ** -126, 2.0 ** -133, np.ldexp(1.0, e - 8))
    lo = np.floor(a / gap) * gap
    p = (a - lo) / gap
    sgn = np.where(np.signbit(x), -1.0, 1.0)
    lo_s, hi_s = sgn * lo, sgn * (lo + gap)
    for k in range(K):
        c.encode(xt, out=out, workspace=ws, key=(0xC0FFEE, k, 5, 0))
        d = (payload(out, n).astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
        if k < 64:
            assert np.all((d == lo_s) | (d == hi_s)), "a decode that is not one of the two neighbours"
        total += d
    mean = total / K
    sigma = np.sqrt(p * (1 - p)) * gap / np.sqrt(K)
    err = np.abs(mean - x.astype(np.float64))
    bad = np.flatnonzero(err > 5 * sigma)
    assert bad.size == 0, (f"biased: x {x[bad[:4]]}, mean {mean[bad[:4]]}, |err| {err[bad[:4]]} > 5 sigma "
                           f"{5 * sigma[bad[:4]]}")
    assert np.array_equal(mean[p == 0], x[p == 0].astype(np.float64)), "a bfloat16 value moved"
    assert (p > 0).sum() >= 40


def test_top_of_the_finite_range():
    """Above the largest finite bfloat16 (0x7F7F = 3.3895314e38) the next code is inf: |x| with
    low 16 bits L becomes inf with probability L / 65536 (FLT_MAX: 65535 / 65536), the packet is
    flagged; 0x7F7F0000 itself never overflows."""
    c = gradcomp.Codec(SPEC)
    n = 1 << 16
    for low in (0x0001, 0x8000, 0xFFFF):
        x = np.full(n, 0x7F7F0000 | low, np.uint32).view(np.float32).copy()
        x[1::2] *= -1
        p = c.encode(x, key=(3, 1, 4, 1))
        codes, _, _ = reference(x, None, 1.0, (3, 1, 4, 1))
        got = payload(p, n)
        assert np.array_equal(got, codes)
        assert set(np.unique(got & 0x7FFF)) <= {0x7F7F, 0x7F80}
        assert np.array_equal(got >> 15, np.arange(n) % 2)
        up = int(((got & 0x7FFF) == 0x7F80).sum())
        q = low / 65536
        assert abs(up - n * q) <= 5 * np.sqrt(n * q * (1 - q)) + 1, (low, up)
        assert int(p[11]) == int(up > 0)
    x = np.full(4096, 0x7F7F0000, np.uint32).view(np.float32)
    p = c.encode(x, key=(3, 1, 4, 1))
    assert np.all(payload(p, 4096) == 0x7F7F) and int(p[11]) == 0


# ---- the key -----------------------------------------------------------------------------------------------
def test_key_api():
    c = gradcomp.Codec(SPEC)
    assert c.spec == SPEC and gradcomp.Codec("bf16:rounding=nearest").spec == "bf16"
    props = c.properties
    assert props == {"linear": True, "unbiased": True, "deterministic": True, "exact_residual": True,
                     "keyed": True, "sparse": False}
    lay = c.layout(100)
    assert [s[0] for s in lay["sections"]] == ["payload", "key"] and lay["key_section"] == 1
    assert lay["sections"][1][1:] == (240, 32, "uint8") and lay["bytes"] == 272  # 32 + 200 -> 240
    x, _ = _input(100, "float32", 1)
    p3, p4 = c.encode(x, key=(1, 2, 3)), c.encode(x, key=(1, 2, 3, 0))
    assert torch.equal(p3, p4) and c.packet_key(p3) == (1, 2, 3, 0)
    assert c.packet_key(c.encode(x, key=[1, 2, 3, 4])) == (1, 2, 3, 4)
    assert c.packet_key(c.encode(x, key=(np.uint64(2**64 - 1), np.uint32(5), 0, 9))) == (2**64 - 1, 5, 0, 9)
    assert c.packet_key(c.encode(x)) == (0, 0, 0, 0)
    for bad, words in [((1, 2), "expected a tuple"), ((1, 2, 3, 4, 5), "expected a tuple"), ("abc", "expected a tuple"),
                       ((2**64, 0, 0), "seed=18446744073709551616"), ((0, -1, 0), "step=-1"),
                       ((0, 0, 2**32), "bucket=4294967296"), ((0, 0, 0, -5), "chunk=-5"),
                       ((0, 0, 0, 1.5), "chunk=1.5"), ((True, 0, 0), "seed=True")]:
        with pytest.raises(gradcomp.InvalidArgumentError, match=words) as ei:
            c.encode(x, key=bad)
        assert "0 <= seed < 2^64, 0 <= step < 2^32, 0 <= bucket < 2^32, 0 <= chunk < 2^32" in str(ei.value)
    # codecs that are not keyed take the key and ignore it
    n = gradcomp.Codec("bf16")
    assert torch.equal(n.encode(x, key=(1, 2, 3, 4)), n.encode(x)) and n.packet_key(n.encode(x)) is None


def test_every_key_field_changes_the_payload():
    c = gradcomp.Codec(SPEC)
    x, _ = _input(4096, "float32", 2)
    base = (10, 20, 30, 40)
    want = payload(c.encode(x, key=base), 4096)
    assert np.array_equal(payload(c.encode(x, key=base), 4096), want)
    for i in range(4):
        k = list(base)
        k[i] += 1
        assert not np.array_equal(payload(c.encode(x, key=tuple(k)), 4096), want), f"field {i}"
    k = list(base)
    k[0] += 1 << 32  # the seed's high word
    assert not np.array_equal(payload(c.encode(x, key=tuple(k)), 4096), want)


# ---- gloo ranks ----------------------------------------------------------------------------------------------
def job_same_key_same_packet(rank, world, n, seed):
    """Every rank encodes the same x with the key (seed, step, bucket 3, chunk 0) for steps 0 and
    1; the packets of all ranks are gathered (an all_gather of the uint8 buffers)."""
    c = gradcomp.Codec(SPEC)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 4
    out = []
    for step in (0, 1):
        p = c.encode(x, key=(seed, step, 3, 0))
        got = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(got, p)
        out.append([t.numpy().tobytes() for t in got])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_same_packet_on_every_rank(world):
    n, seed = 70001, 123456789
    res = run(world, job_same_key_same_packet, n, seed)
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 4).numpy()
    for rank, (step0, step1) in enumerate(res):
        assert len(set(step0)) == 1, f"rank {rank}: the ranks' packets for one key differ"
        assert len(set(step1)) == 1, f"rank {rank}: the ranks' packets for one key differ (step 1)"
        assert step0[0] != step1[0], "the next step gave the same packet"
        assert step0[0] == res[0][0][0]
    for step, blob in ((0, res[0][0][0]), (1, res[0][1][0])):
        codes, _, _ = reference(x, None, 1.0, (seed, step, 3, 0))
        assert np.array_equal(np.frombuffer(blob, np.uint8)[32: 32 + 2 * n].view("<u2"), codes), f"step {step}"
        assert gradcomp.Codec(SPEC).packet_key(np.frombuffer(blob, np.uint8).copy()) == (seed, step, 3, 0)


# ---- CUDA ------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_packets_equal_the_cpu(dtype):
    if not gradcomp.build_info()["cuda"]:
        pytest.skip("a CPU-only build")
    c = gradcomp.Codec(SPEC)
    for n in (1, 9, 70001, (1 << 20) + 3):
        x, _ = _input(n, dtype, n)
        r0 = torch.randn(n) * 0.01
        for key in [(0, 0, 0, 0), (7, 8, 9, 10)]:
            rc, rg = r0.clone(), r0.clone().cuda()
            pc = c.encode(x, residual=rc, divisor=3.0, key=key)
            pg = c.encode(x.cuda(), residual=rg, divisor=3.0, key=key)
            torch.cuda.synchronize()
            assert torch.equal(pg.cpu(), pc), (n, dtype, key)
            assert torch.equal(rg.cpu().view(torch.int32), rc.view(torch.int32)), (n, dtype, key)
