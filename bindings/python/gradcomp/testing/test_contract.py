"""The codec contract suite (see gradcomp.testing for what it checks and how to run it).

Every test takes ``spec`` (and ``dtype`` / ``device``), parametrised by the pytest plugin gradcomp_pytest.
Seeds are fixed per test and named in the assertion messages.
"""

import math
import zlib

import numpy as np
import pytest

import gradcomp

torch = pytest.importorskip("torch")

GUARD = 64
HEADER = np.dtype([("magic", "<u4"), ("version", "<u2"), ("codec_id", "<u2"), ("input_dtype", "u1"),
                   ("wire_dtype", "u1"), ("index_dtype", "u1"), ("flags", "u1"), ("spec_hash", "<u4"),
                   ("numel", "<u8"), ("main", "<u8")])
TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SIZES = [0, 1, 7, 15, 17, 1023, 1025, 65535, 65537]
BITS = {"float32": 32, "float16": 16, "bfloat16": 16, "uint32": 32, "int32": 32, "uint64": 64, "int64": 64,
        "uint8": 8, "int8": 8, "float8_e4m3fn": 8, "float8_e5m2": 8, "float8_e8m0fnu": 8, "int4": 4, "uint1": 1}


def section_bytes(count: int, dtype: str) -> int:
    """Bytes of a packet section of `count` elements of `dtype` (sub-byte dtypes packed)."""
    return (count * BITS[dtype] + 7) // 8


def fnv1a32(s: str) -> int:
    h = 2166136261
    for b in s.encode():
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def host(t) -> np.ndarray:
    return t.detach().cpu().numpy()


def header(packet) -> dict:
    h = host(packet)[:32].copy().view(HEADER)[0]
    return {k: int(h[k]) for k in HEADER.names}


def guarded(nbytes: int, device: str, fill: int):
    """(whole buffer, 16-byte aligned view of nbytes with GUARD guard bytes on both sides)."""
    whole = gradcomp.aligned_empty(torch.empty(0, device=device), nbytes + 2 * GUARD)
    whole.fill_(fill)
    return whole, whole[GUARD: GUARD + nbytes]


def guards_intact(whole, nbytes: int, fill: int) -> bool:
    h = host(whole)
    return bool((h[:GUARD] == fill).all() and (h[GUARD + nbytes:] == fill).all())


def make_input(n, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g) * scale).to(TORCH_DTYPE[dtype])
    r = torch.randn(n, generator=g) * 0.25
    return x.to(device), r.to(device)


class Run:
    """One encode into guarded packet and workspace buffers."""

    def __init__(self, codec, x, residual=None, divisor=1.0, key=None, status=0):
        n, dtype = x.numel(), str(x.dtype).replace("torch.", "")
        self.pbytes = codec.packet_bytes(n, dtype)
        self.wbytes = codec.workspace_bytes(n, dtype, x.device)
        self.pwhole, self.packet = guarded(self.pbytes, x.device, 0xCD)
        self.wwhole, self.ws = guarded(self.wbytes, x.device, 0xEE)
        self.ws[:4].copy_(torch.tensor(np.array([status], "<u4").view(np.uint8)))
        self.residual = None if residual is None else residual.clone()
        codec.encode(x, residual=self.residual, out=self.packet, divisor=divisor, workspace=self.ws, key=key)
        assert guards_intact(self.pwhole, self.pbytes, 0xCD), "encode wrote outside the packet"
        assert guards_intact(self.wwhole, self.wbytes, 0xEE), "encode wrote outside the workspace"


def decode(codec, packet, n, device, accumulate=False):
    """Decode into float32 inside guards; returns (values as numpy float32, status word)."""
    owhole, obytes = guarded(4 * n, device, 0x5A)
    out = obytes.view(torch.float32)
    if not accumulate:
        out.fill_(123.0)
    wwhole, ws = guarded(16, device, 0x00)
    codec.decode(packet, out=out, accumulate=accumulate, workspace=ws)
    assert guards_intact(owhole, 4 * n, 0x5A), "decode wrote outside out"
    assert guards_intact(wwhole, 16, 0x00), "decode wrote outside the workspace"
    return host(out).copy(), gradcomp.check(ws)


def bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# ---- the spec and the layout -----------------------------------------------------------------------
def test_spec_round_trip(spec):
    c = gradcomp.Codec(spec)
    again = gradcomp.Codec(c.spec)
    assert again.spec == c.spec
    assert gradcomp.Codec(again.spec).spec == c.spec
    examples = {e for info in gradcomp.codecs() for e in info["examples"]}
    if spec in examples:
        assert c.spec == spec, "registry example specs are canonical"


def test_packet_bytes_and_layout(spec, dtype):
    c = gradcomp.Codec(spec)
    for n in SIZES:
        pb = c.packet_bytes(n, dtype)
        assert pb % 16 == 0 and pb >= 32, (n, pb)
        assert pb == c.packet_bytes(n, dtype)
        lay = c.layout(n, dtype)
        assert lay["bytes"] == pb
        at = 32
        for name, off, count, sdtype in lay["sections"]:
            assert off % 16 == 0 and off >= at, (name, off, at)
            at = off + section_bytes(count, sdtype)
        assert 0 <= pb - at < 16, (n, pb, at)
        assert (lay["key_section"] >= 0) == c.properties["keyed"]
        assert (lay["payload_section"] >= 0) == c.properties["linear"]
        assert lay["main_param"] == c.main_param(n)


# ---- the header --------------------------------------------------------------------------------------
def _corruptions(h, main_kind, n):
    """(field, byte offset, size, value) of single-field corruptions the decoder must refuse."""
    out = [("magic", 0, 4, h["magic"] ^ 1), ("magic", 0, 4, 0), ("version", 4, 2, h["version"] + 1),
           ("codec_id", 6, 2, (h["codec_id"] + 1) & 0xFFFF), ("codec_id", 6, 2, 0xFFFF),
           ("input_dtype", 8, 1, 3), ("input_dtype", 8, 1, 0xFF),
           ("wire_dtype", 9, 1, (h["wire_dtype"] + 1) & 0xFF), ("wire_dtype", 9, 1, 0xFE),
           ("index_dtype", 10, 1, (h["index_dtype"] + 1) & 0xFF), ("index_dtype", 10, 1, 0xFE),
           ("flags", 11, 1, h["flags"] ^ 0x02), ("flags", 11, 1, 0x80),
           ("spec_hash", 12, 4, h["spec_hash"] ^ 1), ("spec_hash", 12, 4, h["spec_hash"] ^ 0x80000000),
           ("numel", 16, 8, n + 1), ("numel", 16, 8, n - 1), ("numel", 16, 8, 2**64 - 1)]
    if main_kind == "exact":
        out += [("main_param", 24, 8, h["main"] + 1), ("main_param", 24, 8, h["main"] ^ (1 << 63))]
    return out


def _expect_refused(c, packet, n, device, what):
    owhole, obytes = guarded(4 * n, device, 0x5A)
    out = obytes.view(torch.float32)
    ws = c.workspace(packet)
    gradcomp.check(ws)
    if device == "cpu":
        with pytest.raises(gradcomp.CorruptPacketError):
            c.decode(packet, out=out, workspace=ws)
        assert gradcomp.check(ws) == 0, f"{what}: the CPU reports by raising, not through the status word"
    else:
        c.decode(packet, out=out, workspace=ws)
        with pytest.raises(gradcomp.CorruptPacketError):
            gradcomp.check(ws)
    assert bool((host(owhole) == 0x5A).all()), f"{what}: decode of a refused packet wrote into out"


def test_every_header_field_is_checked(spec, dtype, device):
    c = gradcomp.Codec(spec)
    n = 100
    x, _ = make_input(n, dtype, device, seed_of(spec, dtype, "header"))
    run = Run(c, x)
    h = header(run.packet)
    assert h["magic"] == int.from_bytes(b"GCP1", "little") and h["version"] == 1
    assert h["spec_hash"] == fnv1a32(c.spec) and h["numel"] == n
    # exact: the codec's main parameter; a maximum (qsgd coding=elias: the stream's bits) at most it
    if c.layout(n, dtype)["main_kind"] == "exact":
        assert h["main"] == c.main_param(n)
    else:
        assert h["main"] <= c.main_param(n)
    assert h["input_dtype"] == {"float32": 0, "float16": 1, "bfloat16": 2}[dtype]
    decode(c, run.packet, n, device)  # the packet itself decodes
    for field, off, size, value in _corruptions(h, c.layout(n, dtype)["main_kind"], n):
        bad = gradcomp.aligned_empty(run.packet, run.pbytes)
        bad.copy_(run.packet)
        bad[off: off + size].copy_(torch.tensor(np.array([value], f"<u{size}").view(np.uint8)))
        _expect_refused(c, bad, n, device, f"{field}={value}")
    if run.pbytes > 32:  # a buffer shorter than the packet
        _expect_refused(c, run.packet[: run.pbytes - 16], n, device, "truncated")
    # another gradient input dtype: refused, or decoded to the same values
    want, _ = decode(c, run.packet, n, device)
    for other in {0, 1, 2} - {h["input_dtype"]}:
        alt = gradcomp.aligned_empty(run.packet, run.pbytes)
        alt.copy_(run.packet)
        alt[8] = other
        try:
            got, _ = decode(c, alt, n, device)
        except gradcomp.CorruptPacketError:
            continue
        assert np.array_equal(bits(got), bits(want)), f"input dtype {other}: decoded other values"


# ---- error feedback, padding, guards -----------------------------------------------------------------
@pytest.mark.parametrize("divisor", [1.0, 3.0])
def test_error_feedback_identity_and_padding(spec, dtype, device, divisor):
    c = gradcomp.Codec(spec)
    for n in SIZES:
        s = seed_of(spec, dtype, n, divisor)
        x, r0 = make_input(n, dtype, device, s)
        run = Run(c, x, residual=r0, divisor=divisor)
        # padding: every byte outside the header and the sections is zero
        lay = c.layout(n, dtype)
        p = host(run.packet)
        covered = np.zeros(lay["bytes"], bool)
        covered[:32] = True
        for name, off, count, sdtype in lay["sections"]:
            covered[off: off + section_bytes(count, sdtype)] = True
        assert not p[~covered].any(), f"seed {s}: padding bytes not zero at {np.flatnonzero(p[~covered])[:8]}"
        D, _ = decode(c, run.packet, n, device)
        xp = (host(x.float()) + host(r0)).astype(np.float32)  # fl(x + r_old) in float32
        with np.errstate(all="ignore"):
            want = xp - D if divisor == 1.0 else xp - (np.float32(divisor) * D).astype(np.float32)
        got = host(run.residual)
        bad = np.flatnonzero(bits(got) != bits(want))
        assert bad.size == 0, (f"seed {s} n {n}: r_new != fl(x' - divisor * D) at {bad[:8]}: "
                               f"{got[bad[:4]]} vs {want[bad[:4]]}")
        if c.properties["exact_residual"] and divisor == 1.0:
            fin = np.isfinite(xp)
            lhs, rhs = xp[fin].astype(np.float64), D[fin].astype(np.float64) + got[fin].astype(np.float64)
            assert np.array_equal(lhs, rhs), f"seed {s} n {n}: x' != D + r_new"


def test_nonfinite_input_gives_nonfinite_result(spec, dtype, device):
    c = gradcomp.Codec(spec)
    n = 300
    for bad in (math.nan, -math.nan, math.inf, -math.inf):
        s = seed_of(spec, dtype, bad)
        x, _ = make_input(n, dtype, device, s)
        at = s % n
        x[at] = bad
        run = Run(c, x)
        assert header(run.packet)["flags"] & 1, f"seed {s}: non-finite flag not set ({bad} at {at})"
        D, status = decode(c, run.packet, n, device)
        assert not np.isfinite(D).all(), f"seed {s}: a {bad} at {at} vanished from the decoded result"
        assert status & gradcomp._C.STATUS_NONFINITE


def test_packets_identical_at_1_2_3_threads(spec, dtype):
    c = gradcomp.Codec(spec)
    n = (1 << 17) + 3
    x, r0 = make_input(n, dtype, "cpu", seed_of(spec, dtype, "threads"))
    old = gradcomp.get_num_threads()
    runs = []
    try:
        for t in (1, 2, 3):
            gradcomp.set_num_threads(t)
            runs.append(Run(c, x, residual=r0))
    finally:
        gradcomp.set_num_threads(old)
    for t, r in zip((2, 3), runs[1:]):
        assert torch.equal(r.packet, runs[0].packet), f"{t} threads: other packet bytes"
        assert torch.equal(r.residual.view(torch.int32), runs[0].residual.view(torch.int32)), f"{t} threads"


def test_two_encodes_on_one_workspace(spec, dtype, device):
    c = gradcomp.Codec(spec)
    for n in (5000, (1 << 18) + 9):
        x, r0 = make_input(n, dtype, device, seed_of(spec, dtype, n, "twice"))
        ws = gradcomp.aligned_empty(x, c.workspace_bytes(n, dtype, device))
        ws.fill_(0xEE)
        ws[:4] = 0
        packets = []
        for _ in range(2):
            p = gradcomp.aligned_empty(x, c.packet_bytes(n, dtype))
            c.encode(x, residual=r0.clone(), out=p, workspace=ws)
            packets.append(host(p).copy())
        assert np.array_equal(packets[0], packets[1]), f"n {n}: the second encode on one workspace differs"


def test_encode_leaves_the_status_word(spec, dtype, device):
    c = gradcomp.Codec(spec)
    x, _ = make_input(777, dtype, device, seed_of(spec, dtype, "status"))
    for status in (0, 1, 2, 3, 0xA5A5A5A5):
        run = Run(c, x, status=status)
        assert int(host(run.ws[:4]).view("<u4")[0]) == status


def test_encode_key_round_trip(spec, dtype):
    c = gradcomp.Codec(spec)
    n = 4097
    x, r0 = make_input(n, dtype, "cpu", seed_of(spec, dtype, "key"))
    a, b = (0x0123456789ABCDEF, 7, 3, 5), (42, 2**32 - 1, 0, 2**32 - 1)
    pa, pb = Run(c, x, key=a).packet, Run(c, x, key=b).packet
    if c.properties["keyed"]:
        # the key read back from the packet
        assert c.packet_key(pa) == a and c.packet_key(pb) == b
        lay = c.layout(n, dtype)
        _, off, count, _ = lay["sections"][lay["key_section"]]
        assert count == gradcomp._C.KEY_BYTES == 32
        raw = host(pa)[off: off + 32].tobytes()
        assert raw == (a[0].to_bytes(8, "little") + a[1].to_bytes(4, "little") + a[2].to_bytes(4, "little")
                       + a[3].to_bytes(4, "little") + bytes(12)), "key section: u64 seed, u32 step, bucket, chunk, 12 zeros"
        # the same key: the same packet (and residual) on every call
        assert torch.equal(Run(c, x, key=a).packet, pa), "the same key gave another packet"
        ra, rb = Run(c, x, residual=r0, divisor=3.0, key=a), Run(c, x, residual=r0, divisor=3.0, key=a)
        assert torch.equal(ra.packet, rb.packet) and torch.equal(ra.residual.view(torch.int32),
                                                                 rb.residual.view(torch.int32))
        # the next step: another packet
        nxt = (a[0], a[1] + 1, a[2], a[3])
        pn = Run(c, x, key=nxt).packet
        assert not torch.equal(pn, pa), "the next step gave the same packet"
        assert c.packet_key(pn) == nxt
        # a 3-tuple is chunk 0
        assert torch.equal(Run(c, x, key=a[:3]).packet, Run(c, x, key=a[:3] + (0,)).packet)
        assert c.packet_key(Run(c, x, key=a[:3]).packet) == a[:3] + (0,)
        # a non-zero reserved key byte: refused (CPU: CorruptPacketError with nothing written)
        for at in (20, 31):
            bad = gradcomp.aligned_empty(pa, pa.numel())
            bad.copy_(pa)
            bad[off + at] = 1
            _expect_refused(c, bad, n, "cpu", f"reserved key byte {at}")
            with pytest.raises(gradcomp.CorruptPacketError, match="reserved"):
                c.packet_key(bad)
    else:
        assert c.packet_key(pa) is None
        assert torch.equal(pa, pb), "the key changed the packet of a codec that draws no random numbers"
    with pytest.raises(gradcomp.InvalidArgumentError, match="seed=-1.*accepted"):
        c.encode(x, key=(-1, 0, 0))
    with pytest.raises(gradcomp.InvalidArgumentError, match="step=4294967296.*accepted"):
        c.encode(x, key=(0, 2**32, 0))
    with pytest.raises(gradcomp.InvalidArgumentError, match="chunk=4294967296.*accepted"):
        c.encode(x, key=(0, 0, 0, 2**32))
    with pytest.raises(gradcomp.InvalidArgumentError, match="seed, step, bucket, chunk"):
        c.encode(x, key=(0, 0))
