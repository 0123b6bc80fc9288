"""``randomk`` (random-k, docs/contracts.md section 3) through the Python bindings.

The reference is this file's own: the strata from ``numpy.array_split``'s sizes, the indices from
the documented Philox4x32-10 derivation (numpy, test_stochastic_rounding.py's implementation,
checked there against Random123's known answers) with the 128-bit product in Python integers, the
values and residuals in numpy float32 (bfloat16 through ml_dtypes). Checks:
  - packets (values, key section) and residuals bitwise equal to the reference, every input dtype,
    with and without a residual, divisors 1 and 3, unbiased scaling;
  - one strictly ascending index per stratum; every key field changes the indices;
  - unbiasedness by Monte Carlo (``unbiased=true``): over 2^14 keys the mean of each decoded
    element is within 5 sigma of x, sigma^2 = x^2 (s - 1) / 2^14 for a stratum of s elements
    (D = s x with probability 1 / s, else 0); each element is picked with frequency 1 / s within
    5 binomial sigmas;
  - on 2 and 3 real gloo ranks: different x, the same key: the same indices; the ``sum`` scheme
    through a Compressor averages the ranks' values at those indices (and keeps r = x' off them);
  - non-finite input off the selection flags the packet and makes value 0 NaN; the key section's
    reserved bytes are checked; bad specs name the value and what is accepted;
  - CUDA (skipped without a GPU): packets and residuals equal to the CPU's.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from ddp_helpers import run  # noqa: E402
from test_stochastic_rounding import MASK, philox4x32_10, philox_scalar  # noqa: E402

TAG = 0x524E444B  # ASCII "RNDK", read big-endian


def strata(n, k):
    sizes = np.array([len(a) for a in np.array_split(np.arange(n), k)], np.int64)
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64), sizes


def indices(key, n, k):
    seed, step, bucket, chunk = key
    m = philox_scalar((step, bucket, chunk, TAG), (seed & 0xFFFFFFFF, seed >> 32))
    lo, size = strata(n, k)
    j = np.arange(k, dtype=np.uint64)
    g = j >> np.uint64(1)
    w = philox4x32_10((g & MASK, g >> np.uint64(32), np.full(k, m[2], np.uint64), np.full(k, m[3], np.uint64)),
                      np.uint64(m[0]), np.uint64(m[1]))
    odd = (j & np.uint64(1)).astype(bool)
    u = np.where(odd, w[2] | (w[3] << np.uint64(32)), w[0] | (w[1] << np.uint64(32)))
    off = np.array([(int(a) * int(b)) >> 64 for a, b in zip(u, size)], np.int64)
    return lo + off, size


def wire(v32, dtype):
    """float32 -> the input dtype (round to nearest even), back as float32, and the raw codes."""
    if dtype == "float32":
        return v32, v32.view("<u4")
    t = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    c = v32.astype(t)
    return c.astype(np.float32), c.view("<u2")


def reference(x32, r, divisor, key, k, dtype, unbiased=False):
    """(value codes, decoded D over n, new residual or None) of an encode of the float32 values
    x32 (already rounded to ``dtype``)."""
    n = x32.size
    xp = x32 if r is None else (x32 + r).astype(np.float32)
    y = xp if divisor == 1 else (xp / np.float32(divisor)).astype(np.float32)
    idx, size = indices(key, n, k)
    v = y[idx]
    if unbiased:
        v = (v * size.astype(np.float32)).astype(np.float32)
    dv, codes = wire(v, dtype)
    D = np.zeros(n, np.float32)
    D[idx] = dv
    r_new = None if r is None else (xp - (D if divisor == 1 else (np.float32(divisor) * D).astype(np.float32)))
    return codes, D, r_new


def _input(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * 3).to(getattr(torch, dtype))
    return x, x.float().numpy()


def values(packet, k, dtype):
    raw = packet.numpy() if isinstance(packet, torch.Tensor) else packet
    w = 4 if dtype == "float32" else 2
    return raw[32: 32 + k * w].view("<u4" if w == 4 else "<u2")


def test_strata_and_reference_indices():
    for n, k in [(10, 3), (1000, 10), (7, 7), (70001, 701), (5, 1)]:
        lo, size = strata(n, k)
        assert size.sum() == n and size.min() >= 1 and size.max() - size.min() <= 1
        idx, _ = indices((5, 6, 7, 8), n, k)
        assert np.all(idx >= lo) and np.all(idx < lo + size)
        assert np.all(np.diff(idx) > 0)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec", ["randomk:ratio=0.01", "randomk:k=3", "randomk:ratio=1", "randomk:ratio=0.1,unbiased=true"])
def test_bitwise_against_the_reference(spec, dtype):
    c = gradcomp.Codec(spec)
    unbiased = "unbiased" in spec
    for n in (1, 9, 1000, 70001):
        x, x32 = _input(n, dtype, n)
        k = c.layout(n, dtype)["main_param"]
        for key in [(0, 0, 0, 0), (2 ** 40 + 3, 17, 5, 2)]:
            for divisor in (1.0, 3.0):
                r0 = (np.random.default_rng(n).standard_normal(n) * 0.01).astype(np.float32)
                rt = torch.from_numpy(r0.copy())
                p = c.encode(x, residual=rt, divisor=divisor, key=key)
                codes, D, r_new = reference(x32, r0, divisor, key, k, dtype, unbiased)
                where = (spec, dtype, n, key, divisor)
                assert np.array_equal(values(p, k, dtype), codes), where
                assert np.array_equal(rt.numpy().view("<u4"), r_new.view("<u4")), where
                assert c.packet_key(p) == key
                out = c.decode(p, out=torch.full((n,), 7.0, dtype=getattr(torch, dtype)))
                assert np.array_equal(out.float().numpy(), D), where
                acc = c.decode(p, out=torch.ones(n, dtype=getattr(torch, dtype)), accumulate=True, alpha=0.5)
                want = wire((np.float32(1) + np.float32(0.5) * D).astype(np.float32), dtype)[0]
                assert np.array_equal(acc.float().numpy(), want), where
                # without a residual: the same values, no residual
                p2 = c.encode(x, divisor=divisor, key=key)
                codes2, _, _ = reference(x32, None, divisor, key, k, dtype, unbiased)
                assert np.array_equal(values(p2, k, dtype), codes2), where


def test_properties_and_layout():
    c = gradcomp.Codec("randomk:ratio=0.01")
    assert c.properties == {"linear": True, "unbiased": False, "deterministic": True, "exact_residual": True,
                            "keyed": True, "sparse": True}
    assert gradcomp.Codec("randomk:k=3,unbiased=true").properties["unbiased"]
    assert not gradcomp.Codec("randomk:k=3,unbiased=true").properties["exact_residual"]
    lay = c.layout(10000, "bfloat16")
    assert lay["main_param"] == 100 and lay["payload_section"] == 0
    assert lay["sections"] == [("values", 32, 100, "bfloat16"), ("key", 240, 32, "uint8")]
    assert c.packet_bytes(10000, "bfloat16") == 272
    assert c.payload(10000, "bfloat16") == (32, 100, "bfloat16")
    assert gradcomp.Codec("randomk:ratio=0.0100").spec == "randomk:ratio=0.01"
    assert gradcomp.Codec("randomk:k=5,unbiased=false").spec == "randomk:k=5"


@pytest.mark.parametrize("spec,msg", [
    ("randomk", "exactly one of ratio="), ("randomk:ratio=0.1,k=3", "exactly one of ratio="),
    ("randomk:ratio=0", "accepted: 0 < ratio <= 1"), ("randomk:ratio=1.5", "accepted: 0 < ratio <= 1"),
    ("randomk:k=-1", "accepted: an integer >= 0"), ("randomk:k=3,unbiased=yes", "unbiased='yes'"),
    ("randomk:k=3,index=u32", "index")])
def test_bad_specs_name_the_value(spec, msg):
    with pytest.raises(gradcomp.InvalidArgumentError, match=msg.replace("(", r"\(").replace("*", r"\*")):
        gradcomp.Codec(spec)


def test_every_key_field_changes_the_indices():
    n, k = 100000, 1000
    base = (10, 20, 30, 40)
    want, _ = indices(base, n, k)
    x = torch.arange(1, n + 1, dtype=torch.float32)
    c = gradcomp.Codec(f"randomk:k={k}")
    got = np.flatnonzero(c.decode(c.encode(x, key=base), numel=n).numpy())
    assert np.array_equal(got, want)
    for i in range(4):
        kk = list(base)
        kk[i] += 1
        assert (indices(tuple(kk), n, k)[0] != want).mean() > 0.9, f"field {i}"
    assert (indices((10 + (1 << 32), 20, 30, 40), n, k)[0] != want).mean() > 0.9  # the seed's high word


def test_unbiased_by_monte_carlo():
    n, k, keys = 64, 8, 1 << 14  # strata of s = 8
    c = gradcomp.Codec(f"randomk:k={k},unbiased=true")
    x = torch.linspace(-2, 3, n)
    total = torch.zeros(n, dtype=torch.float64)
    picked = np.zeros(n)
    for seed in range(keys):
        d = c.decode(c.encode(x, key=(seed, 1, 2, 0)), numel=n)
        total += d.double()
        picked += (d != 0).numpy()
    mean = (total / keys).numpy()
    s = n // k
    x64 = x.double().numpy()
    sigma = np.abs(x64) * np.sqrt(s - 1) / np.sqrt(keys)
    assert np.all(np.abs(mean - x64) <= 5 * sigma + 1e-12), np.max(np.abs(mean - x64) / (sigma + 1e-30))
    p = 1.0 / s
    nz = x64 != 0
    assert np.all(np.abs(picked[nz] - keys * p) <= 5 * np.sqrt(keys * p * (1 - p)))


def test_nonfinite_off_the_selection_is_visible():
    n = 1000
    c = gradcomp.Codec("randomk:k=10")
    key = (3, 4, 5, 6)
    idx, _ = indices(key, n, 10)
    off = next(i for i in range(n) if i not in set(idx.tolist()))
    x = torch.ones(n)
    x[off] = float("inf")
    r = torch.zeros(n)
    p = c.encode(x, residual=r, key=key)
    assert p[11] & 1
    vals = values(p, 10, "float32").view(np.float32)
    assert np.isnan(vals[0]) and np.all(vals[1:] == 1)
    assert torch.isnan(r[int(idx[0])]) and r[off] == float("inf")
    ws = c.workspace(x)
    out = c.decode(p, numel=n, workspace=ws)
    assert torch.isnan(out[int(idx[0])])
    assert gradcomp.check(ws) & 1
    # k = 0: nothing travels; decode of the flagged packet makes out[0] NaN
    c0 = gradcomp.Codec("randomk:k=0")
    assert torch.isnan(c0.decode(c0.encode(x, key=key), numel=n)[0])
    assert torch.equal(c0.decode(c0.encode(torch.ones(n), key=key), numel=n), torch.zeros(n))


def test_corrupt_key_section_raises():
    c = gradcomp.Codec("randomk:k=10")
    p = c.encode(torch.ones(1000), key=(1, 2, 3, 4))
    ks = c.layout(1000)["sections"][1][1]
    bad = p.clone()
    bad[ks + 25] = 1  # a reserved byte
    with pytest.raises(gradcomp.CorruptPacketError):
        c.decode(bad, numel=1000)


def test_global_generators_untouched():
    state = torch.random.get_rng_state()
    np_state = np.random.get_state()[1].copy()
    c = gradcomp.Codec("randomk:ratio=0.1")
    c.decode(c.encode(torch.randn(5000, generator=torch.Generator().manual_seed(1)), key=(1, 2, 3, 4)), numel=5000)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert np.array_equal(np.random.get_state()[1], np_state)


# ---- gloo ranks ----------------------------------------------------------------------------------------------
def job_same_indices(rank, world, n, k):
    """Each rank encodes its own x (seed rank) with one key; gathers the positions it would fill."""
    c = gradcomp.Codec(f"randomk:k={k}")
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank + 1)) + 10.0  # no zeros
    out = []
    for step in (0, 1):
        nz = torch.nonzero(c.decode(c.encode(x, key=(99, step, 4, 0)), numel=n)).flatten()
        got = [torch.empty_like(nz) for _ in range(world)]
        dist.all_gather(got, nz)
        out.append([t.tolist() for t in got])
    return out


def job_sum_scheme(rank, world, n, k):
    """A Compressor with the sum scheme: one SUM allreduce of the k values; two steps."""
    from gradcomp.torch import Compressor

    comp = Compressor(f"randomk:k={k}", scheme="sum", seed=77, min_compress_numel=1)
    res = []
    for step in range(2):
        g = torch.randn(n, generator=torch.Generator().manual_seed(100 * step + rank)) * (rank + 1)
        res.append(comp.allreduce(g, "w").wait().clone())
    return [t.numpy() for t in res]


@pytest.mark.parametrize("world", [2, 3])
def test_same_indices_on_every_rank(world):
    n, k = 50000, 500
    res = run(world, job_same_indices, n, k)
    for step in (0, 1):
        lists = [res[r][step] for r in range(world)]
        for r in range(world):
            assert all(lst == lists[r][0] for lst in lists[r]), f"rank {r}, step {step}: ranks picked different indices"
        assert lists[0][0] == indices((99, step, 4, 0), n, k)[0].tolist()
    assert res[0][0][0] != res[0][1][0], "the next step picked the same indices"


def test_sum_scheme_averages_the_selected_values():
    n, k, world = 4096, 64, 2
    res = run(world, job_sum_scheme, n, k)
    assert np.array_equal(res[0][0], res[1][0]) and np.array_equal(res[0][1], res[1][1])
    # step 0: no residual yet; the average over the ranks at the step's indices
    nz = np.flatnonzero(res[0][0])
    assert len(nz) == k
    g = [(torch.randn(n, generator=torch.Generator().manual_seed(r)) * (r + 1)).numpy() for r in range(world)]
    want = ((g[0] / np.float32(2)).astype(np.float32) + (g[1] / np.float32(2)).astype(np.float32))[nz]
    np.testing.assert_array_equal(res[0][0][nz], want.astype(np.float32))


# ---- CUDA ------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cuda_packets_equal_the_cpu(dtype):
    if not gradcomp.build_info()["cuda"]:
        pytest.skip("a CPU-only build")
    for spec in ("randomk:ratio=0.01", "randomk:ratio=1", "randomk:k=0", "randomk:k=3,unbiased=true"):
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
                for acc in (False, True):
                    init = torch.randn(n).to(getattr(torch, dtype))
                    oc = c.decode(pc, out=init.clone(), accumulate=acc, alpha=0.5)
                    og = c.decode(pc.cuda(), out=init.clone().cuda(), accumulate=acc, alpha=0.5)
                    assert torch.equal(og.cpu().view(torch.int16 if dtype != "float32" else torch.int32),
                                       oc.view(torch.int16 if dtype != "float32" else torch.int32)), (spec, n, acc)
