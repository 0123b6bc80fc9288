"""Keyed codecs end to end: every scheme passes ``(seed, step, bucket, chunk)`` to every encode.

With the keyed codec ``bf16:rounding=stochastic`` (its draws depend on the key only), the
Compressor's result through gather, two_phase and hierarchical equals a reference that replays
the scheme with plain ``Codec.encode`` / ``decode`` calls and the keys the contract names
(gradcomp.schemes.SchemeContext.key_for): gather chunk 0; two_phase chunk j for step 1 and W + j
for the re-encoded chunk sum; bucket = crc32(name) for ``allreduce(t, name)``; step = the
compressor's step. Another seed or step changes the result; the ranks agree bitwise. Real gloo
ranks (2 and 3).
"""

import zlib

import pytest
import torch

import gradcomp
import gradcomp.torch as gt
from gradcomp.planner.bytes import chunk
from ddp_helpers import run

SPEC = "bf16:rounding=stochastic"
N = 301  # not a multiple of W: uneven chunks


def _x(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(N, generator=g) * 3


def _dec(codec, p, n):
    return codec.decode(p, numel=n)


def _gather_ref(world, step, seed, bucket):
    c = gradcomp.Codec(SPEC)
    acc = None
    for r in range(world):
        d = _dec(c, c.encode(_x(r, step), divisor=world, key=(seed, step, bucket, 0)), N)
        acc = d if acc is None else acc + d  # rank order, float32
    return acc


def _two_phase_ref(world, step, seed, bucket):
    c = gradcomp.Codec(SPEC)
    out = torch.empty(N)
    for j in range(world):
        a, m = chunk(N, world, j)
        if not m:
            continue
        acc = torch.zeros(m)
        for r in range(world):
            acc += _dec(c, c.encode(_x(r, step)[a: a + m], divisor=world, key=(seed, step, bucket, j)), m)
        out[a: a + m] = _dec(c, c.encode(acc, key=(seed, step, bucket, world + j)), m)
    return out


def job_keys(rank, world, scheme, seed):
    kw = {"local_world_size": 1, "inner_scheme": "gather"} if scheme == "hierarchical" else {}
    comp = gt.Compressor(SPEC, scheme, error_feedback=False, min_compress_numel=0, seed=seed, **kw)
    bucket = zlib.crc32(b"w")
    ref = _two_phase_ref if scheme == "two_phase" else _gather_ref
    outs = []
    for step in range(2):
        t = _x(rank, step)
        comp.allreduce(t, "w").wait()
        comp.end_step()
        want = ref(world, step, seed, bucket)
        assert torch.equal(t.view(torch.int32), want.view(torch.int32)), (scheme, world, step)
        outs.append(t)
    # the key matters: the same input at another step or under another seed rounds otherwise
    assert not torch.equal(ref(world, 0, seed, bucket), ref(world, 0, seed + 1, bucket))
    assert not torch.equal(_gather_ref(world, 0, seed, bucket), _gather_ref(world, 0, seed, bucket + 1))
    return [o.view(torch.int32).sum().item() for o in outs]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("scheme", ["gather", "two_phase", "hierarchical"])
def test_every_scheme_passes_the_key(world, scheme):
    res = run(world, job_keys, scheme, 7)
    assert all(r == res[0] for r in res)  # bitwise the same on every rank


def _bad_seed(rank, world):
    with pytest.raises(ValueError, match=r"seed=-1; accepted: an int in \[0, 2\^64\)"):
        gt.Compressor(SPEC, seed=-1)
    with pytest.raises(ValueError, match=r"seed=True"):
        gt.Compressor(SPEC, seed=True)
    return True


def test_seed_is_checked():
    assert run(2, _bad_seed) == [True, True]
