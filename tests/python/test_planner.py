"""gradcomp.planner: the byte formulas (dense, sum, gather, two_phase) against hand calculations and
auto's choice table (sum for linear codecs, gather for sparse ones, two_phase for the quantizers).

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


def block_packet(n, code_bits, block=128, scale_bytes=4):
    """32-byte header + n codes of code_bits bits (padded to 16) + one scale per block (float32,
    or the 1-byte e8m0 of fp8:scale=e8m0, whose blocks are 32)."""
    return 32 + pad16((code_bits * n + 7) // 8) + pad16(scale_bytes * -(-n // block))


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


def test_two_phase_chunks():
    """Exact: chunk j = [j c, min(n, (j+1) c)), c = ceil(n / W); shorter and empty last chunks."""
    assert [planner.chunk(1, 4, j) for j in range(4)] == [(0, 1), (1, 0), (1, 0), (1, 0)]
    assert [planner.chunk(13, 3, j) for j in range(3)] == [(0, 5), (5, 5), (10, 3)]
    assert [planner.chunk(9, 4, j) for j in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 0)]  # n > W, one empty
    assert [planner.chunk(2 ** 16 + 3, 2, j) for j in range(2)] == [(0, 32770), (32770, 32769)]
    assert planner.chunk(0, 3, 2) == (0, 0) and planner.chunk_size(0, 3) == 0 and planner.chunk_size(13, 3) == 5
    with pytest.raises(ValueError, match="chunk index 4"):
        planner.chunk(10, 4, 4)


def test_bucket_bytes_two_phase():
    """Exact: (W-1) P1 in the all-to-all + (W-1) P2 in the all-gather, packet_bytes W P1; P1 is
    the chunk's packet in the bucket dtype, P2 in float32 (hand-computed packet sizes)."""
    W, n = 4, 3000  # c = 750
    int8 = gradcomp.Codec("int8")
    p = block_packet(750, 8)  # 32 + 752 + 32 = 816, either input dtype
    assert p == 816 and planner.two_phase_slots(int8, n, torch.float32, W) == (p, p)
    assert planner.two_phase_slots(int8, n, torch.bfloat16, W) == (p, p)
    assert planner.bucket_bytes("two_phase", int8, n, torch.float32, W) == {
        "dense_bytes": 12000, "packet_bytes": 4 * p, "sent_bytes": 2 * 3 * p, "ring_bytes": 18000}
    int4 = gradcomp.Codec("int4")
    assert planner.bucket_bytes("two_phase", int4, n, torch.float32, 3)["sent_bytes"] == 2 * 2 * block_packet(1000, 4)
    # none on bfloat16: the chunks travel as bfloat16, the float32 sums as float32
    p1, p2 = cast_packet(750, 2), cast_packet(750, 4)
    none = gradcomp.Codec("none")
    assert planner.two_phase_slots(none, n, torch.bfloat16, W) == (p1, p2) == (1536, 3040)
    assert planner.bucket_bytes("two_phase", none, n, torch.bfloat16, W) == {
        "dense_bytes": 6000, "packet_bytes": 4 * p1, "sent_bytes": 3 * (p1 + p2), "ring_bytes": 9000}
    s = planner.summarize(dict(planner.bucket_bytes("two_phase", int8, n, torch.float32, W), numel=n))
    assert s["wire_ratio"] == 2 * 3 * p / 18000 and s["bits_per_element"] == 8 * 4 * p / n


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
    ("fp16", 4096, "float32", 4, "two_phase", 0, "two_phase"),         # requested wins
    ("topk:ratio=0.01", 4096, "float32", 4, "two_phase", 0, "two_phase"),
    # quantizers (neither linear nor sparse): two_phase iff W (P1 + P2) < 2 * dense
    ("int8", 4096, "float32", 4, "auto", 1024, "two_phase"),           # c = 1024: 4 * 2 * 1088 < 32768
    ("fp8", 4096, "bfloat16", 4, "auto", 1024, "two_phase"),           # 8704 < 16384
    ("fp8:scale=e8m0", 4096, "float32", 8, "auto", 0, "two_phase"),    # c = 512: 8 * 2 * 560 < 32768
    ("int4", 4096, "float32", 4, "auto", 1000, "two_phase"),
    ("int4", 1000, "float32", 4, "auto", 1024, "dense"),               # below min_compress_numel
    ("int8", 100, "float32", 64, "auto", 0, "dense"),                  # c = 2: 64 * 2 * 64 >= 800
    ("int8", 4096, "float32", 1, "auto", 0, "dense"),                  # W = 1: (W-1)(P1 + P2) < 0 never
]


@pytest.mark.parametrize("spec,n,dtype,W,requested,minc,want", CHOICES)
def test_choose_scheme_table(spec, n, dtype, W, requested, minc, want):
    """Exact: the rule of docs/contracts.md section 5 / CompressionState's docstring."""
    codec = gradcomp.Codec(spec)
    if spec in ("int8", "fp8", "fp8:scale=e8m0") and n >= 1024:
        c = -(-n // W)
        e8m0 = spec.endswith("e8m0")
        assert codec.packet_bytes(c, dtype) == block_packet(c, 8, 32 if e8m0 else 128, 1 if e8m0 else 4)
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


def test_choose_scheme_two_phase_boundary():
    """Exact: two_phase iff W (P1 + P2) < 2 * dense, strictly; int4 at W = 2 has P1 = P2 = 64
    bytes for every chunk of up to 32 elements, so 256 < 8 n flips between n = 32 and 33."""
    codec = gradcomp.Codec("int4")
    assert codec.packet_bytes(16) == codec.packet_bytes(17) == 64 == block_packet(17, 4)
    assert planner.choose_scheme(codec, 32, torch.float32, 2, "auto", 0) == "dense"
    assert planner.choose_scheme(codec, 33, torch.float32, 2, "auto", 0) == "two_phase"
    assert codec.properties["linear"] is False and codec.properties["sparse"] is False
    assert gradcomp.Codec("topk:k=1").properties["sparse"] is True


def test_onebit_allreduce_bytes():
    from gradcomp import Codec, planner

    c = Codec("onebit")
    # W = 4, Np = 4096: each rank sends 3 chunks of 1024 / 8 sign bytes + a 4-byte scale, then its
    # re-encoded 1024-element chunk to 3 ranks: a packet of the 32-byte header, 128 sign bytes and
    # one float32 scale, padded to 16 bytes (176)
    assert c.packet_bytes(1024) == 176
    assert planner.onebit_allreduce_bytes(c, 4096, 4) == 3 * (128 + 4) + 3 * 176
    assert planner.onebit_allreduce_bytes(c, 16, 1) == 0.0
    with pytest.raises(ValueError, match="padded_numel=40 is not a multiple of 8 \\* world size = 32"):
        planner.onebit_allreduce_bytes(c, 40, 4)
