"""The onebit codec (1-bit signs with a float32 scale per chunk, error feedback fused) against a
reference written here with numpy (never calling gradcomp): bits against ``numpy.packbits`` of
``!(y < 0)``, the scales against ``math.fsum`` (an exactly rounded float64 sum) evaluated in float64
and rounded once to float32, residuals ``fl(x' - fl(divisor * D))`` and decoded values (float32,
alpha and accumulate into the input dtype), the header's non-finite flag; n = 1, 7, 8, 13, 33,
1000, 2^16 + 3, chunks 0 (whole tensor), 8, 16, 4104 and 8192 (more than one reduce tile), scale l2
and mean_abs, float32/float16/bfloat16 input, divisors 1 and 3, normal data and the edge set (-0.0,
NaN of both signs, +-inf, denormals, 1e-40, 1e30, a chunk of zeros). Seeds are fixed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradcomp

F32 = np.float32
HEADER = np.dtype([("magic", "<u4"), ("version", "<u2"), ("codec_id", "<u2"), ("input_dtype", "u1"),
                   ("wire_dtype", "u1"), ("index_dtype", "u1"), ("flags", "u1"), ("spec_hash", "<u4"),
                   ("numel", "<u8"), ("main", "<u8")])
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def spec_parts(spec: str):
    _, _, opts = spec.partition(":")
    kv = dict(o.split("=") for o in opts.split(",") if o)
    return kv.get("scale", "l2") == "l2", int(kv.get("chunk", 0))


def reference(x32: np.ndarray, r, divisor: float, l2: bool, chunk: int):
    """Returns (packed bits, scales, new residual (or None), decoded float32, flag)."""
    n = x32.size
    C = chunk if chunk else max(n, 1)
    with np.errstate(all="ignore"):
        xp = x32 if r is None else (x32 + r).astype(F32)
        y = xp if divisor == 1 else (xp / F32(divisor)).astype(F32)
    bit = ~(y < 0)  # NaN and +-0.0 give 1
    scales = []
    for c0 in range(0, n, C):
        yc = y[c0:c0 + C].astype(np.float64)
        if np.isnan(yc).any():
            scales.append(F32(np.nan))
            continue
        terms = yc * yc if l2 else np.abs(yc)  # exact in float64
        S = math.fsum(terms.tolist())
        m = S / len(yc)
        scales.append(F32(math.sqrt(m) if l2 else m))
    scales = np.array(scales, F32)
    s_el = np.repeat(scales, C)[:n]
    with np.errstate(all="ignore"):
        dec = np.where(bit, s_el, -s_el).astype(F32)
        ds = s_el if divisor == 1 else (F32(divisor) * s_el).astype(F32)
        res = None if r is None else (xp - np.where(bit, ds, -ds)).astype(F32)
        flag = bool((~np.isfinite(ds)).any()) or (not np.isfinite(xp).all())
    return np.packbits(bit), scales, res, dec, flag


def make(kind: str, n: int, rng) -> np.ndarray:
    v = rng.standard_normal(n).astype(F32)
    if kind == "edges":
        special = np.array([-0.0, 0.0, np.nan, -np.nan, 1e-45, -1e-45, 1e-40, -1e-40, 1e30, -1e30, 3.0, -2.5],
                           F32)
        v[: min(n, special.size)] = special[: min(n, special.size)]
        if n >= 64:
            v[16:32] = 0.0       # a chunk of 16 zeros
            v[32:40] = -0.0
        if n >= 1000:
            v[700] = np.inf
            v[701] = -np.inf
    return v


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a.view(np.uint32), b.view(np.uint32)) or np.array_equal(a, b, equal_nan=True)


SPECS = ["onebit", "onebit:scale=mean_abs", "onebit:chunk=8", "onebit:chunk=16,scale=mean_abs", "onebit:chunk=4104",
         "onebit:chunk=8192,scale=mean_abs"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["normal", "edges"])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 33, 1000, 65539])
@pytest.mark.parametrize("divisor", [1.0, 3.0])
@pytest.mark.parametrize("with_residual", [False, True])
def test_packet_residual_and_decode_match_the_reference(spec, in_dtype, kind, n, divisor, with_residual):
    rng = np.random.default_rng([n, len(spec), len(kind), int(divisor), len(in_dtype), with_residual])
    xt = torch.from_numpy(make(kind, n, rng)).to(TORCH[in_dtype])
    x32 = xt.float().numpy()
    r = (rng.standard_normal(n) * 0.01).astype(F32) if with_residual else None
    l2, chunk = spec_parts(spec)
    c = gradcomp.Codec(spec)
    rg = None if r is None else torch.from_numpy(r.copy())
    p = c.encode(xt, residual=rg, divisor=divisor).numpy()
    bits, scales, res, dec, flag = reference(x32, r, divisor, l2, chunk)
    (_, boff, bcount, bdt), (_, soff, scount, sdt) = c.layout(n, in_dtype)["sections"]
    assert (bdt, bcount, sdt, scount) == ("uint1", n, "float32", scales.size)
    h = p[:32].copy().view(HEADER)[0]
    assert int(h["main"]) == chunk and int(h["numel"]) == n
    got_bits = p[boff: boff + (n + 7) // 8]
    bad = np.flatnonzero(got_bits != bits)
    assert bad.size == 0, f"bit bytes differ at {bad[:6]}: {got_bits[bad[:6]]} vs {bits[bad[:6]]}"
    got_s = p[soff: soff + 4 * scount].view(np.float32)
    assert same(got_s, scales), f"scales {got_s[:4]} vs {scales[:4]}"
    assert int(h["flags"]) == int(flag)
    if res is not None:
        assert same(rg.numpy(), res), "residual != fl(x' - fl(divisor * D))"
    out = c.decode(torch.from_numpy(p), numel=n).numpy()
    assert same(out, dec) or (flag and np.array_equal(out[1:], dec[1:], equal_nan=True))
    # accumulate into the input dtype with alpha 0.5: out = fl(out + fl(D * 0.5)), rounded into it
    acc = xt.clone()
    c.decode(torch.from_numpy(p), out=acc, accumulate=True, alpha=0.5)
    with np.errstate(all="ignore"):
        want = torch.from_numpy((x32 + (dec * F32(0.5)).astype(F32)).astype(F32)).to(TORCH[in_dtype])
    assert torch.equal(acc.isnan(), want.isnan()) and torch.equal(acc[~acc.isnan()], want[~want.isnan()])


def test_golden_signs_and_scale():
    """The 13 values of DeepSpeed's golden example (docs/contracts.md section 6.1), rank 0, one chunk:
    bits 11010111 01100 (the -0.0 first element is +1), scale sqrt(7.140625 / 13)."""
    x = torch.tensor([-0.0, .375, -1, .25, -.625, .5, .25, .75, -.25, 2.125, .125, -.25, -.125])
    c = gradcomp.Codec("onebit")
    p = c.encode(x).numpy()
    (_, boff, _, _), (_, soff, _, _) = c.layout(13, "float32")["sections"]
    assert p[boff] == 0b11010111 and p[boff + 1] == 0b01100000
    assert p[soff: soff + 4].view(np.float32)[0] == F32(math.sqrt(7.140625 / 13))


def test_spec_errors_and_canonical_forms():
    assert gradcomp.Codec("onebit:scale=l2,chunk=0").spec == "onebit"
    assert gradcomp.Codec("onebit:scale=mean_abs,chunk=16").spec == "onebit:chunk=16,scale=mean_abs"
    for bad, what in [("onebit:chunk=12", "multiple of 8"), ("onebit:chunk=-8", "chunk"),
                      ("onebit:scale=max", "accepted: l2, mean_abs"), ("onebit:block=8", "block")]:
        with pytest.raises(ValueError, match=what):
            gradcomp.Codec(bad)


def test_error_feedback_carries_what_was_not_sent():
    """x + r_old == D + r_new up to one rounding per element, and over many steps the decoded sum
    tracks the input sum (the error stays bounded: it is the current residual)."""
    rng = np.random.default_rng(7)
    c = gradcomp.Codec("onebit:chunk=64")
    n = 4096
    r = torch.zeros(n)
    sent = np.zeros(n, np.float64)
    total = np.zeros(n, np.float64)
    for _ in range(50):
        x = torch.from_numpy(rng.standard_normal(n).astype(F32))
        p = c.encode(x, residual=r)
        sent += c.decode(p, numel=n).numpy()
        total += x.numpy()
    assert np.allclose(total - sent, r.numpy(), atol=1e-3)
