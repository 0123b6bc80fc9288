"""gradcomp.planner: the byte formulas against hand calculations and auto's choice table.

Exact comparisons throughout: integers, or binary64 values compared with exact fractions where
2(W-1)/W is dyadic (W = 2, 4, 8); for W = 3 the float is within one ulp of the exact fraction
(stated inline). Packet sizes of the codecs are computed by hand from the packet layout (32-byte
header, sections padded to 16 bytes) and not from the codec.
"""

import math
from fractions import Fraction

import pytest

torch = pytest.importorskip("torch")

import gradcomp  # noqa: E402
from gradcomp import planner  # noqa: E402


def pad16(n):
    return (n + 15) // 16 * 16


def topk_packet(n, ratio, value_bytes):
    """32-byte header + k uint32 indices (padded to 16) + k values (padded to 16)."""
    k = min(n, max(1, math.ceil(ratio * n)))
    return 32 + pad16(4 * k) + pad16(value_bytes * k)


def cast_packet(n, value_bytes):
    """32-byte header + exactly n wire elements, padded."""
    return 32 + pad16(value_bytes * n)


def test_dtype_bytes_and_dense_bytes():
    """Exact integers; an unknown dtype raises with the accepted list."""
    assert [planner.dtype_bytes(d) for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)] == [4, 2, 2, 8]
    assert planner.dtype_bytes("bfloat16") == 2 and planner.dtype_bytes(torch.complex64) == 8
    assert planner.dense_bytes(1000, torch.float16) == 2000
    assert planner.dense_bytes(0, torch.float32) == 0
    assert planner.dense_bytes(2**31 + 64, "float32") == 4 * (2**31 + 64)
    with pytest.raises(ValueError, match="float32"):
        planner.dtype_bytes(torch.quint8)


@pytest.mark.parametrize("W", [1, 2, 4, 8])
def test_ring_and_gather_formulas_exact(W):
    """Exact: 2(W-1)/W is dyadic for these W, so the binary64 value equals the fraction."""
    for nbytes in (0, 16, 4000, 12345, 2**33):
        got = planner.ring_allreduce_bytes(nbytes, W)
        assert Fraction(got) == Fraction(2 * (W - 1), W) * nbytes, (W, nbytes)
        assert planner.all_gather_bytes(nbytes, W) == (W - 1) * nbytes


def test_ring_formula_w3_within_one_ulp():
    """Tolerance: for W = 3, 4/3 is not a binary64 number; within one ulp of the exact value."""
    for nbytes in (3, 4000, 12345, 2**33 + 1):
        got = planner.ring_allreduce_bytes(nbytes, 3)
        exact = Fraction(4, 3) * nbytes
        assert abs(Fraction(got) - exact) <= Fraction(math.ulp(float(exact))), nbytes


def test_bucket_bytes_by_scheme():
    """Exact: the four fields of each scheme against hand calculations (W = 4, 2(W-1)/W = 3/2)."""
    W, n = 4, 3000
    top = gradcomp.Codec("topk:ratio=0.01")
    p = topk_packet(n, 0.01, 4)  # k = 30: 32 + 128 + 128 = 288
    assert p == 288 and top.packet_bytes(n) == p
    assert planner.bucket_bytes("gather", top, n, torch.float32, W) == {
        "dense_bytes": 12000, "packet_bytes": 288, "sent_bytes": 3 * 288, "ring_bytes": 18000}
    assert planner.bucket_bytes("dense", top, n, torch.float32, W) == {
        "dense_bytes": 12000, "packet_bytes": 12000, "sent_bytes": 18000, "ring_bytes": 18000}
    fp16 = gradcomp.Codec("fp16")
    # sum: the payload is exactly numel float16, the header does not travel
    assert planner.payload_bytes(fp16, n, torch.float32) == 2 * n
    assert planner.bucket_bytes("sum", fp16, n, torch.float32, W) == {
        "dense_bytes": 12000, "packet_bytes": cast_packet(n, 2), "sent_bytes": 1.5 * 2 * n,
        "ring_bytes": 18000}
    none_bf16 = planner.bucket_bytes("sum", gradcomp.Codec("none"), n, torch.bfloat16, 2)
    assert none_bf16 == {"dense_bytes": 6000, "packet_bytes": cast_packet(n, 2), "sent_bytes": 2 * n,
                         "ring_bytes": 6000}
    with pytest.raises(ValueError, match="not linear"):
        planner.bucket_bytes("sum", top, n, torch.float32, W)
    with pytest.raises(ValueError, match="scheme"):
        planner.bucket_bytes("ring", top, n, torch.float32, W)


def test_summarize():
    """Exact ratios from totals; NaN for a zero denominator."""
    s = planner.summarize({"numel": 1000, "dense_bytes": 4000, "packet_bytes": 1000, "sent_bytes": 1500,
                           "ring_bytes": 6000})
    assert s == {"packet_ratio": 0.25, "wire_ratio": 0.25, "bits_per_element": 8.0}
    z = planner.summarize({"numel": 0, "dense_bytes": 0, "packet_bytes": 0, "sent_bytes": 0, "ring_bytes": 0})
    assert all(math.isnan(v) for v in z.values())


# auto's choice: (codec, numel, dtype, W, requested, min_compress_numel) -> scheme, with the reason
CHOICES = [
    ("topk:ratio=0.01", 0, "float32", 4, "auto", 0, "dense"),          # numel 0
    ("topk:ratio=0.01", 1000, "float32", 4, "auto", 1024, "dense"),    # below min_compress_numel
    ("topk:ratio=0.01", 1000, "float32", 4, "gather", 1024, "dense"),  # ... whatever was requested
    ("topk:ratio=0.01", 1024, "float32", 4, "auto", 1024, "gather"),   # k = 11: 4 * 128 < 2 * 4096
    ("fp16", 4096, "float32", 4, "auto", 1024, "sum"),                 # linear
    ("none", 4096, "bfloat16", 64, "auto", 0, "sum"),                  # linear, whatever W
    ("fp16", 4096, "float32", 4, "gather", 0, "gather"),               # requested wins
    ("topk:ratio=0.01", 4096, "float32", 4, "dense", 0, "dense"),
    # topk ratio 0.3, n = 1000 float32: k = 300, packet 32 + 1200 + 1200 = 2432; dense 4000:
    ("topk:ratio=0.3", 1000, "float32", 3, "auto", 0, "gather"),       # 3 * 2432 = 7296 < 8000
    ("topk:ratio=0.3", 1000, "float32", 4, "auto", 0, "dense"),        # 4 * 2432 = 9728 >= 8000
    # the same top-k in float16: packet 32 + 1200 + 608 = 1840, dense 2000
    ("topk:ratio=0.3", 1000, "float16", 2, "auto", 0, "gather"),       # 3680 < 4000
    ("topk:ratio=0.3", 1000, "float16", 3, "auto", 0, "dense"),        # 5520 >= 4000
]


@pytest.mark.parametrize("spec,n,dtype,W,requested,minc,want", CHOICES)
def test_choose_scheme_table(spec, n, dtype, W, requested, minc, want):
    """Exact: the rule of DESIGN.md section 5 / CompressionState's docstring."""
    codec = gradcomp.Codec(spec)
    if spec.startswith("topk") and n:
        vb = 2 if dtype == "float16" else 4
        assert codec.packet_bytes(n, dtype) == topk_packet(n, float(spec.split("=")[1]), vb)
    got = planner.choose_scheme(codec, n, getattr(torch, dtype), W, requested, minc)
    assert got == want, (spec, n, dtype, W, requested, minc)


def test_choose_scheme_boundary():
    """Exact: gather iff W * packet < 2 * dense, strictly; find n where equality holds."""
    codec = gradcomp.Codec("topk:k=1")  # packet 32 + 16 + 16 = 64 bytes for any n >= 1
    assert codec.packet_bytes(100) == 64
    # W = 4: 4 * 64 = 256 < 2 * 4n  <=>  n > 32
    assert planner.choose_scheme(codec, 32, torch.float32, 4, "auto", 0) == "dense"
    assert planner.choose_scheme(codec, 33, torch.float32, 4, "auto", 0) == "gather"
    with pytest.raises(ValueError, match="scheme"):
        planner.choose_scheme(codec, 33, torch.float32, 4, "ring", 0)
