"""Guards of the Python codec API: one Codec shared by several threads, tensors DLPack cannot carry
faithfully, overlapping buffers, and numbers out of range. Each bad call must raise a gradcomp
error naming the value; results are compared bitwise with a single-threaded run."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import gradcomp


def test_one_codec_shared_by_threads_gives_the_single_thread_packets():
    c = gradcomp.Codec("topk:ratio=0.01")
    xs = [torch.randn(1 << 18, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    expect = [gradcomp.Codec("topk:ratio=0.01").encode(x).clone() for x in xs]
    errors = []

    def work(i):
        try:
            for _ in range(10):
                if not torch.equal(c.encode(xs[i]), expect[i]):
                    errors.append(f"thread {i}: packet differs")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: torch.arange(1.0, 9.0)._neg_view(), "resolve_neg"),
        (lambda: torch.randn(8, requires_grad=True), "detach"),
    ],
)
def test_tensors_dlpack_cannot_carry(make, words):
    with pytest.raises(gradcomp.InvalidArgumentError, match=words):
        gradcomp.Codec("none").encode(make())


def test_overlapping_buffers_raise_and_leave_x_alone():
    c = gradcomp.Codec("topk:ratio=0.1")
    x = torch.randn(256)
    x0 = x.clone()
    with pytest.raises(gradcomp.InvalidArgumentError, match="overlap"):
        c.encode(x, residual=x)
    assert torch.equal(x, x0)
    buf = torch.zeros(4096)
    p = gradcomp.Codec("none").encode(x)
    with pytest.raises(gradcomp.InvalidArgumentError, match="overlap"):
        gradcomp.Codec("none").decode(p, out=p[32 : 32 + 4 * 256].view(torch.float32))
    with pytest.raises(gradcomp.InvalidArgumentError, match="overlap"):
        gradcomp.Codec("none").encode(buf[:100], out=buf.view(torch.uint8)[:448])


@pytest.mark.parametrize("divisor", [0, -1, 1e-50, 1e300, float("nan"), float("inf"), None, "2"])
def test_bad_divisor_is_named(divisor):
    with pytest.raises(gradcomp.InvalidArgumentError, match="divisor"):
        gradcomp.Codec("fp16").encode(torch.ones(4), divisor=divisor)


@pytest.mark.parametrize("alpha", [1e300, float("nan"), -float("inf"), None])
def test_bad_alpha_is_named(alpha):
    c = gradcomp.Codec("fp16")
    with pytest.raises(gradcomp.InvalidArgumentError, match="alpha"):
        c.decode(c.encode(torch.ones(4)), numel=4, alpha=alpha)


@pytest.mark.parametrize("numel", [-1, 2**56, 2**63, 1.5, True])
def test_bad_numel_is_named(numel):
    c = gradcomp.Codec("none")
    with pytest.raises(gradcomp.InvalidArgumentError, match="numel"):
        c.packet_bytes(numel)
    with pytest.raises(gradcomp.InvalidArgumentError, match="numel"):
        c.decode(c.encode(np.ones(4, np.float32)), numel=numel)


def test_decode_numel_must_match_the_packet_before_allocating():
    c = gradcomp.Codec("none")
    with pytest.raises(gradcomp.InvalidArgumentError, match="header says 4"):
        c.decode(c.encode(torch.ones(4)), numel=2**40)


def test_codec_spec_must_be_a_string():
    with pytest.raises(gradcomp.InvalidArgumentError, match="str"):
        gradcomp.Codec(None)
