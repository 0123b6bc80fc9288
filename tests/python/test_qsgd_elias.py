"""``qsgd:...,coding=elias`` (QSGD section 3.2, docs/contracts.md section 3) through the Python bindings.

The reference is written here, independently of kernels/common/elias.hpp: Elias delta as a string
of '0'/'1' characters (``format(v, 'b')``), the entries (gap, sign, level) of every non-zero code of
test_qsgd's numpy simulation of QSGD, the blocks joined and packed with ``np.packbits`` (most
significant bit first). Checks:
  - the stream, the per-block ends (stream bit), the header's bit count, the norms and the key bitwise
    equal to the reference; the residual and the decoded values bitwise those of coding=dense;
  - round trip exact over adversarial code patterns written straight into a packet (all zeros,
    all maximal with alternating signs, alternating zero / maximal, one code at the end of each
    block), decoded against norm / s * code;
  - a stream that would pass its capacity (n bytes) falls back to the dense int8 codes and says
    so in header flag bit 1 with bit count 0;
  - corrupt streams (ends that do not match the header or decrease, a level above s, a gap past the block, a
    code cut short, random bit flips) raise CorruptPacketError before anything is written;
  - CUDA (skipped without a GPU): packets equal to the CPU's.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from test_qsgd import F32, _input, simulate  # noqa: E402

FLAG_FALLBACK = 2


def delta(v: int) -> str:
    """Elias delta of v >= 1 as bits: L zeros, N + 1 in binary, the low N bits of v."""
    n = v.bit_length() - 1
    n1 = format(n + 1, "b")
    return "0" * (len(n1) - 1) + n1 + format(v, "b")[1:]


def block_bits(codes) -> str:
    out, prev = [], -1
    for t, c in enumerate(codes):
        if c:
            out.append(delta(t - prev) + ("1" if c < 0 else "0") + delta(abs(int(c))))
            prev = t
    return "".join(out)


def reference_stream(codes, block, capacity):
    """(stream bytes padded with zeros to `capacity`, the stream bit where each block ends, total bits)."""
    parts = [block_bits(codes[i: i + block]) for i in range(0, codes.size, block)]
    bits = "".join(parts)
    packed = np.packbits(np.frombuffer(bits.encode(), np.uint8) - ord("0")) if bits else np.zeros(0, np.uint8)
    stream = np.zeros(capacity, np.uint8)
    stream[: packed.size] = packed[:capacity]
    return stream, np.cumsum([len(p) for p in parts]).astype(np.uint32), len(bits)


def sections(c, packet, n):
    raw = packet.numpy()
    sec = {name: (off, cnt) for name, off, cnt, _ in c.layout(n)["sections"]}
    (so, sn), (no, nn), (lo, ln) = sec["stream"], sec["norms"], sec["ends"]
    return raw[so: so + sn], raw[no: no + 4 * nn].view(np.float32), raw[lo: lo + 4 * ln].view(np.uint32)


def main_param(packet) -> int:
    return int(packet[24:32].numpy().view(np.uint64)[0])


SPECS = [("qsgd:levels=16,coding=elias", 16, 128), ("qsgd:coding=elias", 127, 128),
         ("qsgd:levels=1,block=7,coding=elias", 1, 7), ("qsgd:levels=4,block=4096,coding=elias", 4, 4096)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec,s,block", SPECS)
def test_bitwise_against_the_reference(spec, s, block, dtype):
    c = gradcomp.Codec(spec)
    dense = gradcomp.Codec(spec.replace(",coding=elias", "").replace(":coding=elias", ""))
    for n in (1, 100, 4097, 70001):
        x, x32 = _input(n, dtype, n + s)
        for key, divisor in [((0, 0, 0, 0), 1.0), ((2 ** 33 + 5, 9, 4, 1), 3.0)]:
            r0 = (np.random.default_rng(n).standard_normal(n) * 0.01).astype(F32)
            rt, rd = torch.from_numpy(r0.copy()), torch.from_numpy(r0.copy())
            p = c.encode(x, residual=rt, divisor=divisor, key=key)
            pd = dense.encode(x, residual=rd, divisor=divisor, key=key)
            codes, norms, D, _, _ = simulate(x32, r0, divisor, key, s, block)
            stream, ends, total = reference_stream(codes, block, n)
            where = (spec, dtype, n, key)
            got_s, got_n, got_e = sections(c, p, n)
            assert np.array_equal(got_n.view(np.uint32), norms.view(np.uint32)), where
            if total <= 8 * n:
                assert not p[11] & FLAG_FALLBACK and main_param(p) == total, where
                assert np.array_equal(got_e, ends), where
                assert np.array_equal(got_s, stream), where
            else:
                assert p[11] & FLAG_FALLBACK and main_param(p) == 0 and not got_e.any(), where
                assert np.array_equal(got_s.view(np.int8), codes), where
            assert c.packet_key(p) == key
            assert torch.equal(rt.view(torch.int32), rd.view(torch.int32)), where
            out = c.decode(p, out=torch.full((n,), 5.0))
            assert torch.equal(out, torch.from_numpy(D)), where
            acc = c.decode(p, out=torch.ones(n, dtype=torch.bfloat16), accumulate=True, alpha=0.5)
            assert torch.equal(acc, dense.decode(pd, out=torch.ones(n, dtype=torch.bfloat16), accumulate=True,
                                                 alpha=0.5)), where


def test_layout_canonical_spec_and_bits():
    with pytest.raises(gradcomp.InvalidArgumentError, match=r"numel 268435456 is too large for coding=elias"):
        gradcomp.Codec("qsgd:coding=elias").packet_bytes(1 << 28)
    c = gradcomp.Codec("qsgd:levels=16,coding=elias")
    assert c.spec == "qsgd:levels=16,coding=elias"
    assert gradcomp.Codec("qsgd:coding=dense").spec == "qsgd"
    lay = c.layout(1000)
    assert lay["sections"] == [("stream", 32, 1000, "uint8"), ("norms", 1040, 8, "float32"),
                               ("ends", 1072, 8, "uint32"), ("key", 1104, 32, "uint8")]
    assert lay["wire_dtype"] == "uint8" and lay["main_param"] == 8000
    # the worked examples of the delta code (Elias 1975, table)
    assert [delta(v) for v in (1, 2, 3, 4, 17)] == ["1", "0100", "0101", "01100", "001010001"]
    with pytest.raises(gradcomp.InvalidArgumentError, match=r"coding='huffman' is not accepted; accepted: dense"):
        gradcomp.Codec("qsgd:coding=huffman")


def forge(c, n, block, codes):
    """A packet of `c` for n elements whose stream codes `codes` (int8), norms 1..nb."""
    p = c.encode(torch.zeros(n), key=(1, 2, 3, 4)).clone()
    stream, ends, total = reference_stream(codes, block, n)
    assert total <= 8 * n
    s, nm, en = sections(c, p, n)
    s[:] = stream
    en[:] = ends
    nm[:] = np.arange(1, nm.size + 1, dtype=F32)
    p.numpy()[24:32].view(np.uint64)[0] = total
    return p, nm.copy()


@pytest.mark.parametrize("pattern", ["zeros", "max_alternating_sign", "alternating_zero", "last_only", "random"])
def test_round_trip_adversarial_patterns(pattern):
    s, block, n = 127, 64, 64 * 9 + 5
    c = gradcomp.Codec(f"qsgd:levels={s},block={block},coding=elias")
    i = np.arange(n)
    rng = np.random.default_rng(7)
    codes = {"zeros": np.zeros(n),
             # 13 bits per element would pass the 8-bit capacity: two blocks in three empty
             "max_alternating_sign": np.where((i // block) % 3 != 0, 0, np.where(i % 2, -s, s)),
             "alternating_zero": np.where(i % 2, 0, np.where(i % 4, -s, s)),
             "last_only": np.where((i % block == block - 1) | (i == n - 1), -1, 0),
             "random": rng.integers(-s, s + 1, n) * (rng.random(n) < 0.3)}[pattern].astype(np.int8)
    p, norms = forge(c, n, block, codes)
    want = (np.repeat(norms / F32(s), block)[:n] * codes.astype(F32)).astype(F32)
    assert torch.equal(c.decode(p, numel=n), torch.from_numpy(want)), pattern
    # the codes parsed into a workspace of workspace_bytes (16 + n) rather than the heap
    ws = c.workspace(p, n, "float32")
    assert ws.numel() >= 16 + n
    assert torch.equal(c.decode(p, numel=n, workspace=ws), torch.from_numpy(want)), pattern


def test_fallback_past_the_capacity():
    # every element at level 127 (block 1: |y| / norm = 1): 13 bits each > 8
    c = gradcomp.Codec("qsgd:block=1,coding=elias")
    x = torch.linspace(-3, 3, 1000)
    x[500] = 0.5
    r = torch.zeros(1000)
    p = c.encode(x, residual=r, key=(5, 5, 5, 5))
    stream, norms, ends = sections(c, p, 1000)
    assert p[11] == FLAG_FALLBACK and main_param(p) == 0 and not ends.any()
    codes, want_norms, D, _, _ = simulate(x.numpy(), None, 1.0, (5, 5, 5, 5), 127, 1)
    assert np.array_equal(stream.view(np.int8), codes) and np.array_equal(norms, want_norms)
    assert torch.equal(c.decode(p, numel=1000), torch.from_numpy(D))
    # the flag lost: an empty stream with non-zero bytes past it
    lost = p.clone()
    lost[11] = 0
    with pytest.raises(gradcomp.CorruptPacketError, match="non-zero bits past its 0 bits"):
        c.decode(lost, numel=1000)
    # the flag set on a stream packet: its count must be 0
    q = gradcomp.Codec("qsgd:levels=2,coding=elias").encode(x, key=(5, 5, 5, 5))
    assert q[11] == 0 and main_param(q) > 0
    q[11] = FLAG_FALLBACK
    with pytest.raises(gradcomp.CorruptPacketError, match="must have main parameter 0"):
        gradcomp.Codec("qsgd:levels=2,coding=elias").decode(q, numel=1000)


def test_corrupt_streams_refused_before_any_write():
    s, block, n = 16, 32, 200
    c = gradcomp.Codec(f"qsgd:levels={s},block={block},coding=elias")
    codes = np.where(np.arange(n) % 3 == 0, 5, 0).astype(np.int8)
    good, _ = forge(c, n, block, codes)

    def refused(p, match):
        out = torch.full((n,), 7.0)
        with pytest.raises(gradcomp.CorruptPacketError, match=match):
            c.decode(p, out=out)
        assert torch.equal(out, torch.full((n,), 7.0))

    p = good.clone()
    p.numpy()[24:32].view(np.uint64)[0] += 1
    refused(p, "the last block ends at stream bit")
    p = good.clone()
    sections(c, p, n)[2][-1] += 1  # the header total no longer matches
    refused(p, "the last block ends at stream bit")
    p = good.clone()
    e = sections(c, p, n)[2]
    e[1] = e[2] + 1  # block 2 ends before block 1
    refused(p, "block 2 ends at stream bit")
    # one block whose bits are a level of 17 > s (gap 1, sign 0, delta(17))
    bad = delta(1) + "0" + delta(17)
    for what, bits in [("level", bad), ("gap past the block", delta(33) + "0" + delta(1)),
                       ("cut short", (delta(1) + "0" + delta(5))[:-1])]:
        p = good.clone()
        st, _, en = sections(c, p, n)
        rest = [block_bits(codes[i: i + block]) for i in range(block, n, block)]
        allbits = bits + "".join(rest)
        st[:] = 0
        packed = np.packbits(np.frombuffer(allbits.encode(), np.uint8) - ord("0"))
        st[: packed.size] = packed
        en[:] = np.cumsum([len(bits)] + [len(r) for r in rest])
        p.numpy()[24:32].view(np.uint64)[0] = len(allbits)
        refused(p, "block 0's")
    # random flips in the stream and the ends: refused or decoded, never out of bounds
    rng = np.random.default_rng(3)
    lay = {name: (off, cnt * (4 if dt == "uint32" else 1)) for name, off, cnt, dt in c.layout(n)["sections"]}
    for _ in range(300):
        p = good.clone()
        sec = ["stream", "ends"][rng.integers(2)]
        off, size = lay[sec]
        j = off + int(rng.integers(size))
        p[j] ^= 1 << int(rng.integers(8))
        try:
            c.decode(p, numel=n)
        except gradcomp.CorruptPacketError:
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_packets_equal_the_cpu():
    if not gradcomp.build_info()["cuda"]:
        pytest.skip("a CPU-only build")
    for spec, _, _ in SPECS + [("qsgd:block=1,coding=elias", 127, 1)]:
        c = gradcomp.Codec(spec)
        for n in (1, 9, 70001, (1 << 20) + 3):
            x, _ = _input(n, "float32", n)
            r0 = torch.randn(n) * 0.01
            rc, rg = r0.clone(), r0.clone().cuda()
            pc = c.encode(x, residual=rc, divisor=3.0, key=(7, 8, 9, 10))
            pg = c.encode(x.cuda(), residual=rg, divisor=3.0, key=(7, 8, 9, 10))
            torch.cuda.synchronize()
            assert torch.equal(pg.cpu(), pc), (spec, n)
            assert torch.equal(rg.cpu().view(torch.int32), rc.view(torch.int32)), (spec, n)
            assert torch.equal(c.decode(pg, numel=n, device="cuda").cpu(), c.decode(pc, numel=n)), (spec, n)
