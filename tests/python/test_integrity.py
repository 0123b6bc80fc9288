"""``integrity=crc32c`` (docs/contracts.md section 3): every codec accepts it; packets carry a
16-byte checksum section, checked on decode.

The reference CRC-32C is the google-crc32c package (Google's C library), independent of
kernels/common/crc32c.hpp. Checks:
  - for every registry example spec with the key: the checksum section holds google_crc32c of every
    byte before it, then 12 zeros; the rest of the packet is the same codec's packet without the key
    except the header's spec hash; decode gives the same values;
  - a flipped bit anywhere (every bit of a small packet: header, sections, padding, the checksum)
    raises CorruptPacketError before anything is written;
  - packets above 2 MiB (the threaded path, partial registers combined) against the package;
  - the canonical spec, a bad value, the codec is not linear (no summable payload);
  - on 2 gloo ranks with the gather and two_phase schemes, a bit flipped in rank 1's packet on its
    way makes every rank's step fail with CorruptPacketError naming rank 1;
  - CUDA (skipped without a GPU): the same packets as the CPU, a flipped bit sets kStatusCorrupt and
    nothing is written.
"""

from __future__ import annotations

import os
import sys

import google_crc32c
import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from gradcomp.experiments.pool import shared  # noqa: E402

# the registry's example specs without the key (two examples carry it already)
EXAMPLES = sorted({s.replace(",integrity=crc32c", "") for c in gradcomp.codecs() for s in c["examples"]})


def with_key(spec: str) -> str:
    return spec + ("," if ":" in spec else ":") + "integrity=crc32c"


def checksum_offset(c, n, dtype="float32"):
    (name, off, cnt, _), = [s for s in c.layout(n, dtype)["sections"] if s[0] == "checksum"]
    assert cnt == 16
    return off


@pytest.mark.parametrize("spec", EXAMPLES)
def test_every_codec_section_and_decode(spec):
    plain, c = gradcomp.Codec(spec), gradcomp.Codec(with_key(spec))
    assert c.spec == with_key(plain.spec)
    for n, dtype in [(1, "float32"), (1000, "bfloat16"), (4099, "float32")]:
        x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3).to(getattr(torch, dtype))
        p, q = c.encode(x, key=(1, 2, 3, 4)), plain.encode(x, key=(1, 2, 3, 4))
        off = checksum_offset(c, n, dtype)
        assert p.numel() == off + 16 and off == q.numel(), spec
        raw = p.numpy().tobytes()
        assert int.from_bytes(raw[off: off + 4], "little") == google_crc32c.value(raw[:off]), (spec, n)
        assert raw[off + 4:] == bytes(12)
        # the same bytes as the plain codec's packet but the spec hash (header bytes 12-15)
        assert raw[:12] == q.numpy().tobytes()[:12] and raw[16:off] == q.numpy().tobytes()[16:], (spec, n)
        assert torch.equal(c.decode(p, numel=n), plain.decode(q, numel=n)), (spec, n)


@pytest.mark.parametrize("spec", ["int8:block=16", "topk:ratio=0.25", "qsgd:levels=4,block=8,coding=elias",
                                  "onebit:chunk=8", "fp16", "randomk:ratio=0.5"])
def test_every_flipped_bit_is_refused(spec):
    c = gradcomp.Codec(with_key(spec))
    n = 37
    p = c.encode(torch.randn(n, generator=torch.Generator().manual_seed(5)), key=(9, 9, 9, 9))
    for byte in range(p.numel()):
        for bit in range(8):
            bad = p.clone()
            bad[byte] ^= 1 << bit
            out = torch.full((n,), 7.0)
            with pytest.raises(gradcomp.CorruptPacketError):
                c.decode(bad, out=out)
            assert torch.equal(out, torch.full((n,), 7.0)), (spec, byte, bit)


def test_large_packets_threaded():
    # 3 Mi elements of fp16: 6 MiB before the checksum, the threaded path with partial registers
    c = gradcomp.Codec("fp16:integrity=crc32c")
    n = 3 * (1 << 20) + 5
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    before = gradcomp.get_num_threads()
    for threads in (1, 2):
        gradcomp.set_num_threads(threads)
        try:
            p = c.encode(x)
        finally:
            gradcomp.set_num_threads(before)
        off = checksum_offset(c, n)
        raw = p.numpy().tobytes()
        assert int.from_bytes(raw[off: off + 4], "little") == google_crc32c.value(raw[:off])
    p[off // 2] ^= 0x10
    with pytest.raises(gradcomp.CorruptPacketError, match="checksum mismatch"):
        c.decode(p, numel=n)


def test_spec_properties_and_errors():
    c = gradcomp.Codec("fp16:integrity=crc32c")
    assert not c.properties["linear"] and gradcomp.Codec("fp16").properties["linear"]
    assert c.payload(100) is None
    assert gradcomp.Codec("topk:integrity=none,ratio=0.5").spec == "topk:ratio=0.5"
    assert gradcomp.Codec("topk:integrity=crc32c,ratio=0.5").spec == "topk:ratio=0.5,integrity=crc32c"
    with pytest.raises(gradcomp.InvalidArgumentError, match=r"integrity='md5' is not accepted; accepted: none"):
        gradcomp.Codec("int8:integrity=md5")
    with pytest.raises(gradcomp.InvalidArgumentError, match=r"accepted keys: block, rounding, integrity"):
        gradcomp.Codec("int8:nope=1")
    assert all("integrity" in c["keys"] for c in gradcomp.codecs())


# ---- gloo ranks --------------------------------------------------------------------------------------
def job_corrupt_in_transit(rank, world, scheme):
    from gradcomp.torch import Compressor

    comp = Compressor("int8:block=32,integrity=crc32c", scheme=scheme, min_compress_numel=1)
    t = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    real = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "all_to_all_single")}

    def flipping(name):
        def call(out, inp, *a, **k):
            if rank == 1 and inp.dtype == torch.uint8:  # rank 1's packets change on their way out
                inp = inp.clone()
                slots = world if name == "all_to_all_single" else 1  # one packet per destination
                for j in range(slots):
                    inp[j * (inp.numel() // slots) + 40] ^= 0x04
            return real[name](out, inp, *a, **k)
        return call

    for name in real:
        setattr(dist, name, flipping(name))
    msg = None
    try:
        comp.allreduce(t, "w").wait()
    except gradcomp.CorruptPacketError as e:
        msg = str(e)
    finally:
        for name, f in real.items():
            setattr(dist, name, f)
    return msg


_POOLS = []


def teardown_module(module):
    for p in _POOLS:  # this module's pool options: free their processes now
        p.close()


@pytest.mark.parametrize("scheme", ["gather", "two_phase"])
def test_corrupt_in_transit_names_the_sender(scheme):
    # as test_failures' pools: a rank still holds a failed step's callbacks at exit (GRADCOMP_EXIT_WAIT_S)
    pool = shared(2, gloo_timeout_s=30.0, env=[{"GRADCOMP_EXIT_WAIT_S": "1"}] * 2)
    _POOLS.append(pool)
    got = pool.run(job_corrupt_in_transit, scheme, timeout=240)
    for rank, msg in enumerate(got):
        assert msg is not None, f"rank {rank}: the step did not fail"
        assert "the packet from rank 1 is corrupt" in msg and "checksum mismatch" in msg, msg


# ---- CUDA -------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_checksum_equals_the_cpu_and_vetoes():
    if not gradcomp.build_info()["cuda"]:
        pytest.skip("a CPU-only build")
    for spec in ["int8", "topk:ratio=0.01", "qsgd:levels=16,coding=elias", "bf16", "onebit"]:
        c = gradcomp.Codec(with_key(spec))
        for n in (1, 4099, (1 << 22) + 3):
            x = torch.randn(n, generator=torch.Generator().manual_seed(n))
            pc, pg = c.encode(x, key=(1, 1, 1, 1)), c.encode(x.cuda(), key=(1, 1, 1, 1))
            assert torch.equal(pg.cpu(), pc), (spec, n)
            bad = pg.clone()
            bad[33] ^= 1
            out = torch.full((n,), 7.0, device="cuda")
            ws = c.workspace(bad, n, "float32")
            c.decode(bad, out=out, workspace=ws)
            with pytest.raises(gradcomp.CorruptPacketError):
                gradcomp.check(ws)
            assert torch.equal(out.cpu(), torch.full((n,), 7.0)), (spec, n)
