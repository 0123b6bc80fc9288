"""``int8`` / ``int4`` with ``rounding=stochastic`` (keyed stochastic rounding of the block codes,
docs/contracts.md section 3) through the Python bindings.

The scales come from test_quant.py's independent numpy reference of the block quantizers (the
same as round-to-nearest's); the codes are computed here: q = fl(y / d), code = floor(q) + (u <
q - floor(q)) clamped to [-max, max], u = (R >> 8) * 2^-24 from the element's documented Philox
word (counter word 3 0x494E5452, "INTR"; numpy Philox of test_stochastic_rounding.py). Checks:
packets (codes, scales, key) and residuals bitwise, one-pass and two-pass block sizes, every input
dtype, divisors 1 and 3; unbiasedness by Monte Carlo over 2^14 keys within 5 sigma (sigma^2 = d^2
p (1 - p) / 2^14); spec errors and properties; CUDA (skipped without a GPU) equal to the CPU.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from test_quant import reference  # noqa: E402
from test_stochastic_rounding import MASK, philox4x32_10, philox_scalar  # noqa: E402

TAG = 0x494E5452  # ASCII "INTR", read big-endian
F32 = np.float32
MAX = {"int8": 127, "int4": 7}


def uniforms(key, n):
    seed, step, bucket, chunk = key
    m = philox_scalar((step, bucket, chunk, TAG), (seed & 0xFFFFFFFF, seed >> 32))
    groups = (n + 3) // 4
    g = np.arange(groups, dtype=np.uint64)
    w = philox4x32_10((g & MASK, g >> np.uint64(32), np.full(groups, m[2], np.uint64),
                       np.full(groups, m[3], np.uint64)), np.uint64(m[0]), np.uint64(m[1]))
    words = np.stack(w, axis=1).reshape(-1)[:n].astype(np.uint32)
    return (words >> 8).astype(F32) * F32(2.0 ** -24)


def simulate(x32, r, divisor, key, kind, block):
    n = x32.size
    _, scales, _, _, _, _ = reference(x32, r if r is not None else np.zeros(n, F32), divisor, kind, block, False)
    xp = x32 if r is None else (x32 + r).astype(F32)
    y = xp if divisor == 1 else (xp / F32(divisor)).astype(F32)
    B = block if block else max(n, 1)
    d = np.repeat(scales, B)[:n]
    with np.errstate(all="ignore"):
        q = (y / d).astype(F32)
        low = np.floor(q)
        frac = (q - low).astype(F32)
        codes = np.clip(low + (uniforms(key, n) < frac), -MAX[kind], MAX[kind])
        codes = np.where(np.isnan(q), 0, codes).astype(np.int32)
        D = (codes.astype(F32) * d).astype(F32)
        res = None if r is None else (xp - (D if divisor == 1 else (F32(divisor) * D).astype(F32))).astype(F32)
    return codes, scales, D, res, np.where(np.isnan(q), 0, frac), d


def got_codes(c, p, n, kind):
    raw = p.numpy()
    (_, co, _, _), (_, so, sc, _), _ = c.layout(n)["sections"]
    if kind == "int4":
        b = raw[co: co + (n + 1) // 2]
        nib = np.empty(2 * b.size, np.uint8)
        nib[0::2], nib[1::2] = b & 15, b >> 4
        v = nib[:n].astype(np.int32)
        codes = np.where(v > 7, v - 16, v)
    else:
        codes = raw[co: co + n].view(np.int8).astype(np.int32)
    return codes, raw[so: so + 4 * sc].view(np.float32)


SPECS = [("int8:rounding=stochastic", "int8", 128), ("int4:rounding=stochastic", "int4", 128),
         ("int8:block=2048,rounding=stochastic", "int8", 2048), ("int4:block=1026,rounding=stochastic", "int4", 1026),
         ("int8:block=7,rounding=stochastic", "int8", 7)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("spec,kind,block", SPECS)
def test_bitwise_against_the_reference(spec, kind, block, dtype):
    c = gradcomp.Codec(spec)
    for n in (1, 13, 4097, 70001):
        g = torch.Generator().manual_seed(n)
        xt = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-5, 5, (n,), generator=g).float())).to(
            getattr(torch, dtype))
        x32 = xt.float().numpy()
        for key in [(0, 0, 0, 0), (2 ** 36 + 7, 11, 3, 2)]:
            for divisor in (1.0, 3.0):
                r0 = (np.random.default_rng(n).standard_normal(n) * 0.01).astype(F32)
                rt = torch.from_numpy(r0.copy())
                p = c.encode(xt, residual=rt, divisor=divisor, key=key)
                codes, scales, D, res, _, _ = simulate(x32, r0, divisor, key, kind, block)
                gc, gs = got_codes(c, p, n, kind)
                where = (spec, dtype, n, key, divisor)
                assert np.array_equal(gs.view(np.uint32), scales.view(np.uint32)), where
                assert np.array_equal(gc, codes), (where, np.flatnonzero(gc != codes)[:5])
                assert np.array_equal(rt.numpy().view(np.uint32), res.view(np.uint32)), where
                assert np.array_equal(c.decode(p, numel=n).numpy(), D), where
                assert c.packet_key(p) == key
                p2 = c.encode(xt, divisor=divisor, key=key)
                assert np.array_equal(got_codes(c, p2, n, kind)[0], simulate(x32, None, divisor, key, kind, block)[0])


@pytest.mark.parametrize("spec,kind", [("int8:rounding=stochastic", "int8"), ("int4:block=32,rounding=stochastic", "int4")])
def test_unbiased_by_monte_carlo(spec, kind):
    n, keys = 128, 1 << 14
    x = torch.linspace(-1, 1, n) ** 3
    x32 = x.numpy()
    c = gradcomp.Codec(spec)
    total = np.zeros(n)
    for seed in range(keys):
        total += c.decode(c.encode(x, key=(seed, 2, 0, 0)), numel=n).numpy()
    mean = total / keys
    block = 32 if "block=32" in spec else 128
    _, _, _, _, frac, d = simulate(x32, None, 1.0, (0, 2, 0, 0), kind, block)
    sigma = d.astype(np.float64) * np.sqrt(frac * (1 - frac)) / np.sqrt(keys)
    tol = 5 * sigma + 2 * np.spacing(np.abs(x32)).astype(np.float64)
    assert np.all(np.abs(mean - x32) <= tol), float(np.max(np.abs(mean - x32) / tol))
    # round to nearest is biased on these values; the stochastic mean is not
    near = gradcomp.Codec(spec.replace(",rounding=stochastic", "").replace(":rounding=stochastic", ""))
    err_near = np.abs(near.decode(near.encode(x), numel=n).numpy() - x32).max()
    assert np.abs(mean - x32).max() < err_near


def test_spec_properties_and_errors():
    c = gradcomp.Codec("int8:rounding=stochastic")
    assert c.spec == "int8:rounding=stochastic"
    assert gradcomp.Codec("int8:rounding=nearest").spec == "int8"
    p = c.properties
    assert p["keyed"] and p["unbiased"] and not p["exact_residual"]
    assert [s[0] for s in c.layout(10)["sections"]] == ["codes", "scales", "key"]
    with pytest.raises(gradcomp.InvalidArgumentError, match="rounding='up' is not accepted; accepted: nearest"):
        gradcomp.Codec("int4:rounding=up")
    with pytest.raises(gradcomp.InvalidArgumentError, match="rounding"):
        gradcomp.Codec("fp8:rounding=stochastic")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_packets_equal_the_cpu(dtype):
    if not gradcomp.build_info()["cuda"]:
        pytest.skip("a CPU-only build")
    for spec, _, _ in SPECS:
        c = gradcomp.Codec(spec)
        for n in (1, 13, 70001, (1 << 20) + 3):
            x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(getattr(torch, dtype))
            r0 = torch.randn(n) * 0.01
            for key in [(0, 0, 0, 0), (7, 8, 9, 10)]:
                rc, rg = r0.clone(), r0.clone().cuda()
                pc = c.encode(x, residual=rc, divisor=3.0, key=key)
                pg = c.encode(x.cuda(), residual=rg, divisor=3.0, key=key)
                torch.cuda.synchronize()
                assert torch.equal(pg.cpu(), pc), (spec, n, dtype, key)
                assert torch.equal(rg.cpu().view(torch.int32), rc.view(torch.int32)), (spec, n, dtype, key)
