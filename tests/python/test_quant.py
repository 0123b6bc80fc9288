"""fp8 / int8 / int4 block quantizers (codecs ``fp8``, ``int8``, ``int4``) against references written
here with numpy and ml_dtypes (never calling gradcomp): packets (codes, scales, header), residuals
and decoded values, bit for bit, over random data in several scales and the edge set of the issue
(448, 464, 465, 57344, 61440, subnormals, +-inf, NaN of both signs, -0.0, an all-zero block, a block of
denormals, a block of 1e-40, a block holding one inf), float32/float16/bfloat16 input, divisors 1
and 3, sizes around the block. The e8m0 scale against a float64 evaluation of its rule, with golden
cases where it differs from the OCP MX floor rule and from a round-to-nearest e8m0 cast (torch,
ml_dtypes)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import gradcomp

F32 = np.float32
FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
INT_MAX = {"int8": 127, "int4": 7}
TINY = np.finfo(np.float32).tiny  # 2^-126
HEADER = np.dtype([("magic", "<u4"), ("version", "<u2"), ("codec_id", "<u2"), ("input_dtype", "u1"),
                   ("wire_dtype", "u1"), ("index_dtype", "u1"), ("flags", "u1"), ("spec_hash", "<u4"),
                   ("numel", "<u8"), ("main", "<u8")])
DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def e8m0_exponent(q: float) -> int:
    """ceil(log2 q) for a float32 q, in float64 (frexp is exact), clamped to [-127, 127]; q == 0
    (an amax that underflows) gives -127."""
    if q == 0:
        return -127
    m, k = math.frexp(float(q))
    return max(-127, min(127, k - 1 if m == 0.5 else k))


def reference(x32: np.ndarray, r: np.ndarray, divisor: float, kind: str, block: int, e8m0: bool):
    """Returns (codes as uint8 per element (int: two's complement byte), scales (float32 per block),
    scale bytes (e8m0), residual, decoded, nonfinite flag)."""
    n = x32.size
    B = block if block else max(n, 1)
    with np.errstate(all="ignore"):
        xp = (x32 + r).astype(F32)
        y = xp if divisor == 1 else (xp / F32(divisor)).astype(F32)
    codes = np.zeros(n, np.uint8)
    dec = np.zeros(n, F32)
    scales, sbytes = [], []
    for b0 in range(0, n, B):
        yb = y[b0:b0 + B]
        fin = np.isfinite(yb)
        amax = F32(np.abs(yb[fin]).max()) if fin.any() else F32(0)
        mx = FP8[kind][1] if kind in FP8 else INT_MAX[kind]
        if kind in INT_MAX and not fin.all():
            d = F32(np.nan)
        elif e8m0:
            e = 0 if amax == 0 else e8m0_exponent(F32(amax / F32(mx)))
            sbytes.append(e + 127)
            d = F32(2.0 ** e)
        else:
            d = F32(1) if amax == 0 else max(F32(amax / F32(mx)), F32(TINY))
        scales.append(d)
        with np.errstate(all="ignore"):
            if kind in FP8:
                q = (yb / d).astype(F32)
                c = q.astype(FP8[kind][0])
                codes[b0:b0 + B] = c.view(np.uint8)
                vals = c.astype(F32)
            else:
                if np.isnan(d):
                    ci = np.zeros(yb.size, np.int32)
                else:
                    ci = np.clip(np.rint((yb / d).astype(F32)), -mx, mx).astype(np.int32)
                codes[b0:b0 + B] = ci.astype(np.int8).view(np.uint8)
                vals = ci.astype(F32)
            dec[b0:b0 + B] = (vals * d).astype(F32)
    with np.errstate(all="ignore"):
        res = (xp - dec).astype(F32) if divisor == 1 else (xp - (F32(divisor) * dec).astype(F32)).astype(F32)
    # the flag: some new residual x' - divisor * D is not finite (x', D or divisor * D non-finite)
    return codes, np.array(scales, F32), np.array(sbytes, np.uint8), res, dec, bool((~np.isfinite(res)).any())


def spec_parts(spec: str):
    name, _, opts = spec.partition(":")
    kv = dict(o.split("=") for o in opts.split(",") if o)
    kind = kv.get("format", "e4m3") if name == "fp8" else name
    e8m0 = kv.get("scale") == "e8m0"
    return kind, int(kv.get("block", 32 if e8m0 else 128)), e8m0


def make(kind: str, n: int, rng) -> np.ndarray:
    if kind == "normal":
        return rng.standard_normal(n).astype(F32)
    if kind == "scales":  # each block of 128 at its own scale, 1e-30 .. 1e30
        s = 10.0 ** rng.integers(-30, 31, (n + 127) // 128)
        return (rng.standard_normal(n) * np.repeat(s, 128)[:n]).astype(F32)
    if kind == "edges":
        v = rng.standard_normal(n).astype(F32)
        special = np.array([448, 464, 465, -465, 57344, 61440, -61440, 1e-45, 1e-40, -1e-40, np.inf, -np.inf,
                            np.nan, -np.nan, -0.0, 0.0, 6e-5, 1.5e-5], F32)
        v[: min(n, special.size)] = special[: min(n, special.size)]
        if n >= 1024:
            v[128:256] = 0.0             # an all-zero block
            v[256:384] = 1e-42           # a block of denormals
            v[384:512] = 1e-40           # a block of 1e-40
            v[512:640] = 1.0
            v[600] = np.inf              # a block holding one inf
        return v
    raise ValueError(kind)


SPECS = ["fp8", "fp8:format=e5m2", "fp8:scale=e8m0", "fp8:format=e5m2,scale=e8m0", "fp8:block=0", "fp8:block=17",
         "int8", "int8:block=0", "int8:block=33", "int4", "int4:block=0", "int4:block=6"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["normal", "scales", "edges"])
@pytest.mark.parametrize("n", [1, 7, 13, 128, 129, 1000, 2048, 65539])
@pytest.mark.parametrize("divisor", [1.0, 3.0])
def test_packet_residual_and_decode_match_the_reference(spec, in_dtype, kind, n, divisor):
    rng = np.random.default_rng([n, len(spec), len(kind), int(divisor), DTYPE_CODE[in_dtype]])
    xt = torch.from_numpy(make(kind, n, rng)).to(TORCH[in_dtype])
    x32 = xt.float().numpy()  # the values the codec sees
    r = (rng.standard_normal(n) * 0.01).astype(F32)
    c = gradcomp.Codec(spec)
    kindq, block, e8m0 = spec_parts(spec)
    rg = torch.from_numpy(r.copy())
    p = c.encode(xt, residual=rg, divisor=divisor).numpy()
    codes, scales, sbytes, res, dec, flag = reference(x32, r, divisor, kindq, block, e8m0)
    lay = c.layout(n, in_dtype)
    (_, coff, ccount, cdt), (_, soff, scount, sdt) = lay["sections"]
    h = p[:32].copy().view(HEADER)[0]
    assert int(h["main"]) == block if "block=0" not in spec else int(h["main"]) == 0
    assert int(h["flags"]) == int(flag) and int(h["input_dtype"]) == DTYPE_CODE[in_dtype]
    assert cdt == {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "int8": "int8", "int4": "int4"}[kindq]
    if kindq == "int4":
        b = p[coff: coff + (n + 1) // 2]
        nib = np.empty(2 * b.size, np.uint8)
        nib[0::2], nib[1::2] = b & 15, b >> 4
        if n % 2:
            assert nib[-1] == 0, "padding nibble"
        got = nib[:n].astype(np.int8)
        got = np.where(got > 7, got - 16, got).astype(np.int8).view(np.uint8)
    else:
        got = p[coff: coff + n]
    bad = np.flatnonzero(got != codes)
    assert bad.size == 0, f"codes differ at {bad[:6]}: {got[bad[:6]]} vs {codes[bad[:6]]} (x {x32[bad[:6]]})"
    if e8m0:
        assert sdt == "float8_e8m0fnu" and np.array_equal(p[soff: soff + scount], sbytes)
        assert not (sbytes == 0).any() or (x32 != 0).any()
    else:
        got_s = p[soff: soff + 4 * scount].view(np.float32)
        assert np.array_equal(got_s.view(np.uint32), scales.view(np.uint32)) or \
            np.array_equal(got_s, scales, equal_nan=True)
    assert np.array_equal(rg.numpy().view(np.uint32), res.view(np.uint32)) or \
        np.array_equal(rg.numpy(), res, equal_nan=True), "residual != fl(x' - divisor * D)"
    out = c.decode(torch.from_numpy(p), numel=n).numpy()
    assert np.array_equal(out, dec, equal_nan=True)


def test_e8m0_differs_from_the_ocp_floor_rule_and_a_nearest_cast():
    """Golden cases. gradcomp's e8m0 scale is d = 2^ceil(log2(amax / 448)): no element of the block
    exceeds the largest code. The OCP MX v1.0 rule takes X = 2^(floor(log2 amax) - 8) (emax of e4m3)
    and saturates the elements above 448; torch's and ml_dtypes' cast of q = amax / 448 to
    float8_e8m0fnu rounds to the nearest power of two, which can be below q."""
    c = gradcomp.Codec("fp8:scale=e8m0")
    # amax 500: OCP X = 2^(8 - 8) = 1 -> 500 saturates to 448; ours d = 2^ceil(log2 1.116) = 2
    x = np.zeros(32, F32)
    x[3] = 500.0
    p = c.encode(x)
    soff = c.layout(32)["sections"][1][1]
    assert p[soff] == 128  # 2^1
    ocp = 2.0 ** (math.floor(math.log2(500.0)) - 8)
    assert ocp == 1.0 and 500.0 / ocp > 448  # the OCP element would saturate
    out = c.decode(p, numel=32)
    assert out[3] == 512.0  # 500 / 2 = 250 -> e4m3 256 -> 512, not 448
    # q = 1.2 (amax 537.6): the nearest-power-of-two cast gives 2^0, and 537.6 / 1 would overflow e4m3
    amax = F32(1.2 * 448)
    q = F32(amax / F32(448))
    assert torch.tensor([float(q)]).to(torch.float8_e8m0fnu).view(torch.uint8).item() == 127
    assert np.array([q], F32).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8)[0] == 127
    x = np.zeros(32, F32)
    x[0] = amax
    p = c.encode(x)
    assert p[soff] == 128  # ours rounds up: 2^1
    assert np.array([amax / 1.0], F32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0] == 0x7F  # NaN with 2^0
    # an all-zero block: d = 1 (byte 127), never byte 0
    assert c.encode(np.zeros(32, F32))[soff] == 127


def test_spec_errors_and_canonical_forms():
    assert gradcomp.Codec("fp8:format=e4m3,block=128,scale=float32").spec == "fp8"
    assert gradcomp.Codec("fp8:scale=e8m0,block=32").spec == "fp8:scale=e8m0"
    assert gradcomp.Codec("int4:block=128").spec == "int4"
    for bad, words in (("fp8:format=e3m4", "e4m3, e5m2"), ("fp8:scale=e8m0,block=64", "needs block=32"),
                       ("int4:block=7", "even"), ("int8:block=-1", "out of range"), ("fp8:scale=ue8", "float32, e8m0"),
                       ("int8:format=e4m3", "unknown key")):
        with pytest.raises(gradcomp.InvalidArgumentError, match=words):
            gradcomp.Codec(bad)
    assert {c["name"] for c in gradcomp.codecs()} >= {"fp8", "int8", "int4"}
