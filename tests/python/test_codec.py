"""Numerics of the CPU codecs top-k, none, fp16, bf16 through the Python bindings.

Every expected value comes from tests/python/test_codec_support.py (numpy / ml_dtypes references
written from docs/contracts.md, packets parsed byte by byte). Comparisons are bitwise (on the uint bit
patterns) unless a test says otherwise: the design fixes every float32 expression, so the CPU
backend must agree with numpy's IEEE float32 arithmetic exactly.
"""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest
import torch

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from test_codec_support import (  # noqa: E402
    BF16,
    BITS,
    CODEC_ID,
    DTYPE_CODE,
    MAGIC,
    NAN_BITS,
    WIRE_SIZE,
    align16,
    as_np_bytes,
    convert_input,
    encode_reference,
    f32_bits,
    fnv1a32,
    header,
    make_input,
    store,
    to_numpy_any,
    topk_indices,
    topk_k,
)

SIZES = [0, 1, 7, 15, 16, 17, 257, 1000]
KINDS = ["randn", "zeros", "const", "outlier", "denorm", "ties", "special"]


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key] + [1234])


def _residual(n, framework, rng, kind="randn"):
    r = (rng.standard_normal(n) * 0.25).astype(np.float32)
    if kind == "special" and n > 3:
        r[0] = np.float32(np.inf)  # inf + finite stays inf; inf - inf in r_new is NaN
        r[1] = np.float32(-0.0)
    return (torch.from_numpy(r.copy()) if framework == "torch" else r.copy()), r


def _np(t):
    return t.numpy() if isinstance(t, torch.Tensor) else t


def _out_like(framework, n, dtype, fill=0.0):
    if framework == "torch":
        return torch.full((n,), fill, dtype=getattr(torch, dtype))
    if dtype == "bfloat16":
        return np.full(n, fill, dtype=np.float32).astype(BF16)
    return np.full(n, fill, dtype=dtype)


def _out_bits(out) -> np.ndarray:
    a = to_numpy_any(out)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16).copy()


def _spec_params(spec: str) -> dict:
    name, _, rest = spec.partition(":")
    kv = dict(item.split("=") for item in rest.split(",")) if rest else {}
    return kv


# =================================================================================================
# top-k
# =================================================================================================
TOPK_SPECS = [
    "topk:ratio=0.1",
    "topk:ratio=0.3",
    "topk:ratio=1",
    "topk:ratio=0.001",
    "topk:k=0",
    "topk:k=5",
    "topk:k=100000",
    "topk:ratio=0.3,value_dtype=float16",
    "topk:ratio=0.3,value_dtype=bfloat16",
    "topk:k=6,index=u64,value_dtype=float32",
]


def check_topk_packet(codec, spec, p, x_loaded, in_dtype, r_old=None, divisor=1.0):
    """Parse a top-k packet and compare it with the reference; returns the reference tuple."""
    kv = _spec_params(spec)
    n = x_loaded.size
    k = topk_k(n, ratio=float(kv["ratio"]) if "ratio" in kv else None,
               k=int(kv["k"]) if "k" in kv else None)
    vdt = kv.get("value_dtype", "auto")
    vdt = in_dtype if vdt == "auto" else vdt
    idt = "uint64" if kv.get("index") == "u64" else "uint32"
    ib, vb = (8 if idt == "uint64" else 4), WIRE_SIZE[vdt]

    b = as_np_bytes(p)
    size = 32 + align16(k * ib) + align16(k * vb)
    assert codec.packet_bytes(n, in_dtype) == size
    assert b.size == size
    h = header(p)
    y = encode_reference(x_loaded, r_old, divisor, "float32")[0]  # the values selection sees
    sel = topk_indices(y, k)
    y, xp, sel, bits, d, r_new, flag = encode_reference(x_loaded, r_old, divisor, vdt, sel=sel)
    assert h == {
        "magic": MAGIC, "version": 1, "codec_id": CODEC_ID["topk"],
        "input_dtype": DTYPE_CODE[in_dtype], "wire_dtype": DTYPE_CODE[vdt],
        "index_dtype": DTYPE_CODE[idt], "flags": int(flag), "spec_hash": fnv1a32(codec.spec),
        "numel": n, "main": k,
    }
    idx = b[32:32 + k * ib].view("<u8" if ib == 8 else "<u4")
    np.testing.assert_array_equal(idx.astype(np.int64), sel)
    voff = 32 + align16(k * ib)
    vals = b[voff:voff + k * vb].view(BITS[vdt])
    np.testing.assert_array_equal(vals, bits)
    # padding after each section is zero (byte-deterministic packets)
    assert not b[32 + k * ib:voff].any()
    assert not b[voff + k * vb:].any()
    return y, xp, sel, bits, d, r_new, flag


@pytest.mark.parametrize("spec", TOPK_SPECS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_topk_packet_float32(spec, kind, n):
    rng = _rng(spec, kind, n)
    x = make_input(kind, n, rng)
    c = gradcomp.Codec(spec)
    x_before = x.copy()
    p = c.encode(x)
    np.testing.assert_array_equal(f32_bits(x), f32_bits(x_before))  # x not modified
    *_, sel, bits, d, _, flag = check_topk_packet(c, spec, p, x, "float32")
    # decode: zeros except the selected values (NaN into out[0] when flagged)
    out = c.decode(p, numel=n)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (n,)
    ref = np.zeros(n, np.float32)
    ref[sel] = d
    ref_bits = f32_bits(ref).copy()
    if flag and n:
        ref_bits[0] = NAN_BITS["float32"]
    np.testing.assert_array_equal(out.view(np.uint32), ref_bits)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec", TOPK_SPECS)
@pytest.mark.parametrize("divisor", [1.0, 3.0])
@pytest.mark.parametrize("kind", ["randn", "ties", "special"])
def test_topk_error_feedback(framework, in_dtype, spec, divisor, kind):
    """Fused error feedback: x' = fl(x + r_old); r_new = fl(x' - D) for the sent elements (with a
    divisor: fl(x' - fl(divisor * D))), x' elsewhere."""
    n = 203
    rng = _rng(framework, in_dtype, spec, divisor, kind)
    x32 = make_input(kind, n, rng)
    x, xl = convert_input(x32, in_dtype, framework)
    r, r_old = _residual(n, framework, rng, kind)
    c = gradcomp.Codec(spec)
    p = c.encode(x, residual=r, divisor=divisor)
    assert type(p) is type(x)
    y, xp, sel, bits, d, r_new, flag = check_topk_packet(c, spec, p, xl, in_dtype, r_old, divisor)
    np.testing.assert_array_equal(f32_bits(_np(r)), f32_bits(r_new))
    if divisor == 1.0:
        dec = _np(c.decode(p, numel=n))
        assert dec.dtype == np.float32
        fin = np.isfinite(xp) & np.isfinite(dec) & np.isfinite(_np(r))
        fin[:1] = False  # out[0] may carry the non-finite marker
        # the identity x' == decode + r_new (value equality: -0.0 + 0.0 is +0.0)
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal((dec + _np(r))[fin], xp[fin])
        vdt = _spec_params(spec).get("value_dtype", "auto")
        if (vdt == "float32" or (vdt == "auto" and in_dtype == "float32")) and len(sel):
            s = sel[np.isfinite(xp[sel])]
            assert not f32_bits(_np(r)[s]).any()  # exactly +0.0 where sent


@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("alpha", [1.0, -0.5, 0.1])
@pytest.mark.parametrize("spec", ["topk:ratio=0.25", "topk:k=9,value_dtype=bfloat16"])
def test_topk_decode_modes(out_dtype, framework, accumulate, alpha, spec):
    """decode(out, accumulate, alpha): v = fl(D * alpha); out = v (assign, zeros elsewhere) or
    fl(out + v) at the sent indices; stored into out's dtype with RNE."""
    n = 300
    rng = _rng(out_dtype, framework, accumulate, alpha, spec)
    x32 = rng.standard_normal(n).astype(np.float32) * 100
    x = torch.from_numpy(x32) if framework == "torch" else x32
    c = gradcomp.Codec(spec)
    p = c.encode(x)
    *_, sel, bits, d, _, flag = check_topk_packet(c, spec, p, x32, "float32")
    assert not flag
    init32 = rng.standard_normal(n).astype(np.float32)
    out = _out_like(framework, n, out_dtype)
    to_numpy_any(out)[...] = init32.astype(to_numpy_any(out).dtype)
    init = to_numpy_any(out).astype(np.float32)
    ptr = out.data_ptr() if framework == "torch" else out.ctypes.data
    res = c.decode(p, out=out, accumulate=accumulate, alpha=alpha)
    assert res is out
    assert (out.data_ptr() if framework == "torch" else out.ctypes.data) == ptr
    v = (d * np.float32(alpha)).astype(np.float32)
    ref = init.copy() if accumulate else np.zeros(n, np.float32)
    ref[sel] = (init[sel] + v) if accumulate else v
    # unchanged elements keep their bits, changed ones are one RNE store of a float32
    ref_bits = store(ref, out_dtype)
    np.testing.assert_array_equal(_out_bits(out), ref_bits)


def test_topk_tie_rule_and_nan():
    # NaN (either sign) beats +inf, all NaNs tie (lowest index first), -0.0 ties +0.0
    nan, nnan = f32_from(0x7FC00000), f32_from(0xFFF00001)
    x = np.array([1.0, nnan, -np.inf, 2.0, nan, np.inf, -2.0, 0.0, -0.0, 0.0], np.float32)
    for k, expect in [(1, [1]), (2, [1, 4]), (3, [1, 2, 4]), (4, [1, 2, 4, 5]), (5, [1, 2, 3, 4, 5]),
                      (6, [1, 2, 3, 4, 5, 6]), (7, [0, 1, 2, 3, 4, 5, 6]), (8, [0, 1, 2, 3, 4, 5, 6, 7]),
                      (9, [0, 1, 2, 3, 4, 5, 6, 7, 8])]:
        c = gradcomp.Codec(f"topk:k={k}")
        p = as_np_bytes(c.encode(x))
        assert p[32:32 + 4 * k].view("<u4").tolist() == expect
        assert topk_indices(x, k).tolist() == expect  # the reference agrees with the hand answer
        assert header(p)["flags"] == 1
    # -0.0 vs +0.0: ties go to the lowest index whatever the sign
    z = np.array([0.0, -0.0, -0.0, 0.0], np.float32)
    p = as_np_bytes(gradcomp.Codec("topk:k=2").encode(z))
    assert p[32:40].view("<u4").tolist() == [0, 1]
    assert p[48:56].view("<u4").tolist() == [0x00000000, 0x80000000]  # values keep their sign
    z = np.array([-0.0, 0.0, 0.0, -1e-45], np.float32)
    p = as_np_bytes(gradcomp.Codec("topk:k=2").encode(z))
    assert p[32:40].view("<u4").tolist() == [0, 3]


def f32_from(u):
    return np.array([u], np.uint32).view(np.float32)[0]


@pytest.mark.parametrize("ratio", [0.1, 0.3, 1 / 3, 0.7, 0.999, 1e-9, 0.5])
@pytest.mark.parametrize("n", [1, 3, 10, 30, 99, 1001, 70001])
def test_topk_k_from_ratio(ratio, n):
    c = gradcomp.Codec(f"topk:ratio={ratio!r}")
    assert c.spec == f"topk:ratio={ratio!r}"  # Python's repr is also the shortest round trip
    assert c.main_param(n) == topk_k(n, ratio=ratio)
    assert c.packet_bytes(n) == 32 + 2 * align16(4 * topk_k(n, ratio=ratio))


def test_topk_large_random_threads():
    """A size that takes the multi-threaded radix select and the candidate buffer (random data),
    and one that overflows the buffer (many ties): same packet for 1 and 2 threads, = reference."""
    n = 300_000
    rng = np.random.default_rng(7)
    old = gradcomp.get_num_threads()
    try:
        for x, spec in [
            (rng.standard_normal(n).astype(np.float32), "topk:ratio=0.01"),
            (rng.choice(np.array([1.0, -1.0, 0.5], np.float32), n), "topk:ratio=0.5"),
            (rng.choice(np.array([1.0, -1.0, 0.5], np.float32), n), "topk:k=1"),
            (np.where(rng.random(n) < 0.2, np.float32(np.nan), rng.standard_normal(n)).astype(np.float32),
             "topk:ratio=0.1"),
            # the largest values all in the second half (one thread's share): a sampled prefilter's
            # per-thread buffer region holds them (0.01) or overflows (0.025)
            (np.sort(rng.standard_normal(n).astype(np.float32) ** 2), "topk:ratio=0.01"),
            (np.sort(rng.standard_normal(n).astype(np.float32) ** 2), "topk:ratio=0.025"),
            (-np.sort(rng.standard_normal(n).astype(np.float32) ** 2)[::-1].copy(), "topk:ratio=0.025"),
        ]:
            c = gradcomp.Codec(spec)
            r = (rng.standard_normal(n) * 0.1).astype(np.float32)
            pkts, res = [], []
            for t in (1, 2):
                gradcomp.set_num_threads(t)
                rr = r.copy()
                pkts.append(c.encode(x, residual=rr).copy())
                res.append(rr)
            np.testing.assert_array_equal(pkts[0], pkts[1])
            np.testing.assert_array_equal(f32_bits(res[0]), f32_bits(res[1]))
            *_, r_new, _ = check_topk_packet(c, spec, pkts[1], x, "float32", r_old=r)
            np.testing.assert_array_equal(f32_bits(res[1]), f32_bits(r_new))
    finally:
        gradcomp.set_num_threads(old)


# =================================================================================================
# casts none / fp16 / bf16
# =================================================================================================
CAST_WIRE = {"none": None, "fp16": "float16", "bf16": "bfloat16"}


def check_cast_packet(codec, spec, p, x_loaded, in_dtype, r_old=None, divisor=1.0):
    n = x_loaded.size
    wire = CAST_WIRE[spec] or in_dtype
    wb = WIRE_SIZE[wire]
    b = as_np_bytes(p)
    size = 32 + align16(n * wb)
    assert codec.packet_bytes(n, in_dtype) == size == b.size
    assert codec.payload(n, in_dtype) == (32, n, wire)  # exactly numel elements: no sentinel
    y, xp, _, bits, d, r_new, flag = encode_reference(x_loaded, r_old, divisor, wire)
    assert header(p) == {
        "magic": MAGIC, "version": 1, "codec_id": CODEC_ID[spec], "input_dtype": DTYPE_CODE[in_dtype],
        "wire_dtype": DTYPE_CODE[wire], "index_dtype": 255, "flags": int(flag),
        "spec_hash": fnv1a32(spec), "numel": n, "main": 0,
    }
    payload = b[32:32 + n * wb].view(BITS[wire])
    np.testing.assert_array_equal(payload, bits)
    assert not b[32 + n * wb:].any()  # zero padding
    return y, xp, bits, d, r_new, flag


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [0, 1, 7, 17, 255, 1025])
def test_cast_packet(spec, in_dtype, kind, n):
    rng = _rng(spec, in_dtype, kind, n)
    x, xl = convert_input(make_input(kind, n, rng), in_dtype, "numpy")
    c = gradcomp.Codec(spec)
    p = c.encode(x)
    assert isinstance(p, np.ndarray) and p.dtype == np.uint8
    _, _, bits, d, _, flag = check_cast_packet(c, spec, p, xl, in_dtype)
    out = c.decode(p, numel=n)
    # the casts carry every non-finite value: decode writes each element's own value, nothing else
    np.testing.assert_array_equal(out.view(np.uint32), f32_bits(d))


def test_cast_rounding_cases():
    """Hand-checked RNE, overflow and NaN cases (independent of numpy and ml_dtypes)."""
    x = np.array([65504.0, 65519.0, 65520.0, -65520.0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2.0**-25,
                  2.0**-25 * 1.5, -2.0**-24, 1e-8], np.float32)
    x = np.concatenate([x, f32_from_bits_arr([0x7FF00000, 0xFFC00001])])
    p = as_np_bytes(gradcomp.Codec("fp16").encode(x))
    got = p[32:32 + 2 * x.size].view("<u2").tolist()
    assert got == [0x7BFF, 0x7BFF, 0x7C00, 0xFC00, 0x3C00, 0x3C02, 0x0000, 0x0001, 0x8001, 0x0000,
                   0x7E00, 0xFE00]
    xb = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3.3895314e38, -3.4e38], np.float32)
    xb = np.concatenate([xb, f32_from_bits_arr([0x7F812345, 0xFFC00001, 0x00000001])])
    p = as_np_bytes(gradcomp.Codec("bf16").encode(xb))
    got = p[32:32 + 2 * xb.size].view("<u2").tolist()
    assert got == [0x3F80, 0x3F82, 0xBF80, 0x7F7F, 0xFF80, 0x7FC0, 0xFFC0, 0x0000]


def f32_from_bits_arr(u):
    return np.array(u, np.uint32).view(np.float32)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("divisor", [1.0, 4.0, 3.0])
@pytest.mark.parametrize("kind", ["randn", "special"])
def test_cast_error_feedback(framework, spec, in_dtype, divisor, kind):
    n = 131
    rng = _rng(framework, spec, in_dtype, divisor, kind)
    x, xl = convert_input(make_input(kind, n, rng) * np.float32(1000 if kind == "randn" else 1), in_dtype,
                          framework)
    r, r_old = _residual(n, framework, rng, kind)
    c = gradcomp.Codec(spec)
    p = c.encode(x, residual=r, divisor=divisor)
    assert type(p) is type(x)
    y, xp, bits, d, r_new, flag = check_cast_packet(c, spec, p, xl, in_dtype, r_old, divisor)
    np.testing.assert_array_equal(f32_bits(_np(r)), f32_bits(r_new))
    if divisor == 1.0:
        dec = _np(c.decode(p, numel=n))
        fin = np.isfinite(xp) & np.isfinite(d)
        fin[:1] = False
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal((dec + _np(r))[fin], xp[fin])


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("alpha", [1.0, 0.25, -3.0, 0.1])
def test_cast_decode_modes(spec, in_dtype, out_dtype, accumulate, alpha):
    n = 97
    rng = _rng(spec, in_dtype, out_dtype, accumulate, alpha)
    x, xl = convert_input(rng.standard_normal(n).astype(np.float32) * 50, in_dtype, "numpy")
    c = gradcomp.Codec(spec)
    p = c.encode(x)
    *_, d, _, flag = check_cast_packet(c, spec, p, xl, in_dtype)
    assert not flag
    out = _out_like("numpy", n, out_dtype)
    out[...] = (rng.standard_normal(n).astype(np.float32) * 10).astype(out.dtype)
    init = out.astype(np.float32)
    res = c.decode(p, out=out, accumulate=accumulate, alpha=alpha)
    assert res is out
    v = (d * np.float32(alpha)).astype(np.float32)
    ref = (init + v).astype(np.float32) if accumulate else v
    np.testing.assert_array_equal(_out_bits(out), store(ref, out_dtype))


@pytest.mark.parametrize("spec", ["fp16", "bf16", "none"])
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
def test_cast_payload_view_sums(spec, in_dtype):
    """payload() describes the summable part: summing two packets' payloads in the wire dtype and
    decoding the sum gives the elementwise sum (a linear codec); a non-finite value survives the sum
    by itself (the payload is exactly numel elements, no sentinel)."""
    n = 50
    rng = _rng(spec, in_dtype)
    c = gradcomp.Codec(spec)
    assert c.properties == {"linear": True, "unbiased": spec == "none", "deterministic": True,
                            "exact_residual": True, "keyed": False, "sparse": False}
    off, count, wire = c.payload(n, in_dtype)
    xs = [convert_input(rng.integers(-8, 8, n).astype(np.float32), in_dtype, "numpy") for _ in range(2)]
    ps = [c.encode(x) for x, _ in xs]
    np_wire = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}[wire]
    views = [p[off:off + count * np.dtype(np_wire).itemsize].view(np_wire) for p in ps]
    assert views[0].size == n
    views[0][...] = (views[0].astype(np.float32) + views[1].astype(np.float32)).astype(np_wire)
    out = c.decode(ps[0], numel=n)
    np.testing.assert_array_equal(out, xs[0][1] + xs[1][1])
    # an inf survives the sum by itself: the decoded result is inf where it was, finite elsewhere
    xn, _ = convert_input(np.array([1.0] * (n - 1) + [np.inf], np.float32), in_dtype, "numpy")
    pn = c.encode(xn)
    vn = pn[off:off + count * np.dtype(np_wire).itemsize].view(np_wire)
    assert np.isinf(vn[n - 1])
    views[1][...] = (views[1].astype(np.float32) + vn.astype(np.float32)).astype(np_wire)
    ws = c.workspace(ps[1])
    gradcomp.check(ws)
    out = c.decode(ps[1], numel=n, workspace=ws)
    assert np.isinf(out[n - 1]) and np.isfinite(out[: n - 1]).all()
    # the status word reports this packet's own header flag (clear: its rank sent finite values)
    assert gradcomp.check(ws) == 0
