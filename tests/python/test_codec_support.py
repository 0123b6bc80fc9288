"""Independent references for the codec tests (no test cases here).

Everything in this module is written from docs/contracts.md sections 2-3 with numpy / ml_dtypes / torch and
never calls into gradcomp: the packet is parsed byte by byte, top-k is a lexsort, the casts are
numpy's and ml_dtypes' round-to-nearest-even conversions with NaN canonicalized here.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

BF16 = np.dtype(ml_dtypes.bfloat16)

HEADER = np.dtype(
    [
        ("magic", "<u4"),
        ("version", "<u2"),
        ("codec_id", "<u2"),
        ("input_dtype", "u1"),
        ("wire_dtype", "u1"),
        ("index_dtype", "u1"),
        ("flags", "u1"),
        ("spec_hash", "<u4"),
        ("numel", "<u8"),
        ("main", "<u8"),
    ]
)
assert HEADER.itemsize == 32

MAGIC = int.from_bytes(b"GCP1", "little")
DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2, "uint32": 9, "uint64": 10, None: 255}
CODEC_ID = {"none": 1, "fp16": 2, "bf16": 3, "topk": 4}
WIRE_SIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}
NAN_BITS = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}  # canonical quiet NaN


def fnv1a32(s: str) -> int:
    h = 2166136261
    for b in s.encode():
        h ^= b
        h = (h * 16777619) & 0xFFFFFFFF
    return h


def align16(n: int) -> int:
    return (n + 15) // 16 * 16


def as_np_bytes(p) -> np.ndarray:
    """A packet (torch or numpy uint8 buffer) as a numpy uint8 array (shared memory, no copy)."""
    if isinstance(p, torch.Tensor):
        return p.numpy()
    return p


def header(p) -> dict:
    b = as_np_bytes(p)
    h = b[:32].view(HEADER)[0]
    return {name: int(h[name]) for name in HEADER.names}


# ---- element conversions ------------------------------------------------------------------------
def f32_bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def cast_bits(y: np.ndarray, wire: str) -> np.ndarray:
    """Bits of float32 y converted to `wire` by round-to-nearest-even, NaN -> canonical quiet NaN
    with the sign kept (float16 0x7E00, bfloat16 0x7FC0), overflow -> inf. float32 is the identity."""
    y = np.ascontiguousarray(y, dtype=np.float32)
    if wire == "float32":
        return y.view(np.uint32).copy()
    with np.errstate(all="ignore"):
        if wire == "float16":
            bits = y.astype(np.float16).view(np.uint16).copy()
        else:
            bits = y.astype(BF16).view(np.uint16).copy()
    nan = np.isnan(y)
    sign = ((y.view(np.uint32) >> 16) & 0x8000).astype(np.uint16)
    bits[nan] = sign[nan] | NAN_BITS[wire]
    return bits


def load_bits(bits: np.ndarray, wire: str) -> np.ndarray:
    """float32 values of wire-format bits (exact widening)."""
    bits = np.ascontiguousarray(bits)
    if wire == "float32":
        return bits.view(np.float32).copy()
    if wire == "float16":
        return bits.view(np.float16).astype(np.float32)
    return bits.view(BF16).astype(np.float32)


def round_to(y: np.ndarray, wire: str) -> np.ndarray:
    """float32 y rounded to `wire` and widened back (the decoded value D of a cast)."""
    return load_bits(cast_bits(y, wire), wire)


# ---- inputs ------------------------------------------------------------------------------------
def f32_from_bits(*u: int) -> np.ndarray:
    return np.array(u, dtype=np.uint32).view(np.float32)


def make_input(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """float32 test inputs: random plus the docs/contracts.md section 7 edge set."""
    if kind == "randn":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "zeros":
        return np.zeros(n, np.float32)
    if kind == "const":
        return np.full(n, -1.5, np.float32)
    if kind == "outlier":
        x = rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
        if n:
            x[n // 2] = np.float32(3e38)
        return x
    if kind == "denorm":
        return (rng.integers(-50, 50, n) * np.float32(1e-45)).astype(np.float32)
    if kind == "ties":  # few distinct magnitudes, both signs, -0.0 among them
        pool = np.array([2.0, -2.0, 1.0, -1.0, 0.0, -0.0, 0.5], np.float32)
        return pool[rng.integers(0, len(pool), n)]
    if kind == "special":
        pool = np.concatenate(
            [
                np.array(
                    [np.inf, -np.inf, -0.0, 0.0, 65504.0, -65504.0, 65519.0, 65520.0, -65520.0, 1e5,
                     -3.4e38, 1e-8, -1e-8, 6.1e-5, 5.96e-8, -2.9e-8, 3.0e-8, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,
                     -(1.0 + 2.0**-8), 1.0 + 3 * 2.0**-8, 2.0**-126, -(2.0**-133)],
                    np.float32,
                ),
                # NaNs of both signs, with and without payload
                f32_from_bits(0x7FC00000, 0xFFC00000, 0x7FF00000, 0xFFE12345),
            ]
        )
        x = rng.standard_normal(n).astype(np.float32)
        m = min(n, len(pool))
        pos = rng.permutation(n)[:m]
        x[pos] = pool[rng.permutation(len(pool))[:m]]
        return x
    raise ValueError(kind)


def convert_input(x32: np.ndarray, dtype: str, framework: str):
    """(tensor passed to gradcomp, its float32 values as the kernel loads them)."""
    with np.errstate(all="ignore"):
        if dtype == "float32":
            xs = x32.copy()
        elif dtype == "float16":
            xs = x32.astype(np.float16)
        else:
            xs = x32.astype(BF16)
    loaded = xs.astype(np.float32)
    if framework == "numpy":
        return xs, loaded
    if dtype == "bfloat16":
        return torch.from_numpy(xs.view(np.int16)).view(torch.bfloat16), loaded
    return torch.from_numpy(xs), loaded


def to_numpy_any(t) -> np.ndarray:
    """numpy view of a torch / numpy tensor; torch bfloat16 becomes ml_dtypes.bfloat16."""
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(BF16)
        return t.numpy()
    return t


# ---- top-k ---------------------------------------------------------------------------------------
def topk_k(n: int, ratio: float | None = None, k: int | None = None) -> int:
    if k is not None:
        return min(k, n)
    return min(n, max(1, math.ceil(ratio * n)))


def topk_indices(y: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the k largest |y|: NaN above +inf, all NaNs tied, -0.0 == +0.0,
    ties to the lowest index."""
    y = np.asarray(y, dtype=np.float32)
    nan = np.isnan(y)
    mag = np.where(nan, np.float32(np.inf), np.abs(y)).astype(np.float64)
    idx = np.arange(y.size)
    order = np.lexsort((idx, -mag, -nan.astype(np.int8)))  # last key is the primary key
    return np.sort(order[:k]).astype(np.int64)


def encode_reference(x: np.ndarray, r: np.ndarray | None, divisor: float, wire: str, sel=None):
    """Reference of a fused encode on the float32 input values x.

    Returns (y, xprime, sel, wire_bits, decoded, r_new, nonfinite_flag); sel=None means a cast
    (every element is sent)."""
    f = np.float32
    with np.errstate(all="ignore"):
        xp = x if r is None else (x + r).astype(f)
        div = f(divisor)
        y = xp if divisor == 1 else (xp / div).astype(f)
        ys = y if sel is None else y[sel]
        bits = cast_bits(ys, wire)
        d = load_bits(bits, wire)
        r_new = xp.copy()
        sent = slice(None) if sel is None else sel
        r_new[sent] = (xp[sent] - d) if divisor == 1 else (xp[sent] - (div * d).astype(f))
    flag = bool((~np.isfinite(y)).any() or (~np.isfinite(d)).any())
    return y, xp, sel, bits, d, r_new, flag


def store(v: np.ndarray, out_dtype: str) -> np.ndarray:
    """Bits of float32 v stored into an output of out_dtype (RNE, canonical NaN)."""
    return cast_bits(v, out_dtype)
