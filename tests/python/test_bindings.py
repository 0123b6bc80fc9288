"""The Python face of gradcomp: DLPack bridge, zero copy, argument errors, corrupt packets, status
word, threads, build info. Expected packets come from test_codec_support.py's references."""

from __future__ import annotations

import gc
import io
import os
import sys

import numpy as np
import pytest
import torch

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from test_codec_support import (  # noqa: E402
    BF16,
    as_np_bytes,
    fnv1a32,
    header,
    topk_indices,
)

IAE = gradcomp.InvalidArgumentError
CPE = gradcomp.CorruptPacketError


def aligned_bytes(nbytes, framework="torch", offset=0):
    """A uint8 buffer of nbytes at a 16-byte aligned address (+ offset)."""
    if framework == "torch":
        buf = torch.zeros(nbytes + 32, dtype=torch.uint8)
        o = (-buf.data_ptr()) % 16 + offset
    else:
        buf = np.zeros(nbytes + 32, dtype=np.uint8)
        o = (-buf.ctypes.data) % 16 + offset
    return buf[o:o + nbytes]


def ptr(t):
    return t.data_ptr() if isinstance(t, torch.Tensor) else t.ctypes.data


@pytest.fixture
def restore_threads():
    old = gradcomp.get_num_threads()
    yield
    gradcomp.set_num_threads(old)


# ---- module surface ----------------------------------------------------------------------------
def test_exception_hierarchy():
    assert issubclass(gradcomp.InvalidArgumentError, ValueError)
    assert issubclass(gradcomp.CorruptPacketError, ValueError)
    assert issubclass(gradcomp.UnsupportedError, RuntimeError)
    assert issubclass(gradcomp.CudaError, RuntimeError)
    for e in (IAE, CPE, gradcomp.UnsupportedError, gradcomp.CudaError):
        assert issubclass(e, gradcomp.Error)
    # `except RuntimeError` (e.g. a fallback for UnsupportedError) never swallows bad arguments
    assert not issubclass(IAE, RuntimeError) and not issubclass(CPE, RuntimeError)
    with pytest.raises(gradcomp.Error):
        gradcomp.Codec("nope")


def test_build_info():
    info = gradcomp.build_info()
    assert set(info) >= {"version", "cuda", "cuda_architectures", "cuda_version", "openmp", "dlpack_version"}
    assert isinstance(info["version"], str) and info["version"] == gradcomp.__version__
    assert isinstance(info["cuda"], bool) and isinstance(info["openmp"], bool)
    assert isinstance(info["cuda_architectures"], str) and isinstance(info["cuda_version"], str)
    assert info["dlpack_version"] == 60  # Debian's libdlpack-dev 0.6
    if not info["cuda"]:
        assert info["cuda_architectures"] == "" and info["cuda_version"] == ""


def test_set_num_threads(restore_threads):
    with pytest.raises(IAE, match=r"set_num_threads\(100000\).*\[1, 1024\]"):
        gradcomp.set_num_threads(100000)
    assert gradcomp._C.MAX_THREADS == 1024
    for bad in (0, -1):
        with pytest.raises(IAE, match=rf"set_num_threads\({bad}\)"):
            gradcomp.set_num_threads(bad)
    gradcomp.set_num_threads(1)
    assert gradcomp.get_num_threads() == 1
    gradcomp.set_num_threads(2)
    assert gradcomp.get_num_threads() == 2


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "topk:ratio=0.01", "topk:ratio=0.5", "topk:k=1000"])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_threads_identical(spec, in_dtype, restore_threads):
    """Packets, residuals and decodes are bitwise the same with 1 and 2 threads (sizes above the
    64 Ki elements under which loops run on one thread)."""
    n = (1 << 17) + 3
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, generator=g).to(in_dtype)
    x[::1000] = 0.0
    x[5::777] = x[5::777].abs()  # ties between equal magnitudes
    r0 = torch.randn(n, generator=g) * 0.01
    c = gradcomp.Codec(spec)
    got = []
    for t in (1, 2):
        gradcomp.set_num_threads(t)
        r = r0.clone()
        p = c.encode(x, residual=r)
        acc = torch.ones(n, dtype=torch.float32)
        c.decode(p, out=acc, accumulate=True, alpha=0.5)
        got.append((p.clone(), r, c.decode(p, numel=n), acc))
    for a, b in zip(got[0], got[1]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- codec construction and specs ---------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, canonical",
    [
        ("none", "none"), ("fp16", "fp16"), ("bf16", "bf16"),
        ("topk:ratio=0.010", "topk:ratio=0.01"), ("topk:ratio=1e-3", "topk:ratio=0.001"),
        ("topk:ratio=1.0", "topk:ratio=1"), ("topk:k=07", "topk:k=7"),
        ("topk:value_dtype=float16,ratio=0.5", "topk:ratio=0.5,value_dtype=float16"),
        ("topk:ratio=0.5,index=auto,value_dtype=auto", "topk:ratio=0.5"),
        ("topk:k=3,index=u64", "topk:k=3,index=u64"), ("topk:index=u32,k=3", "topk:k=3,index=u32"),
    ],
)
def test_spec_canonical(spec, canonical):
    c = gradcomp.Codec(spec)
    assert c.spec == canonical
    assert gradcomp.Codec(c.spec).spec == canonical
    assert c._c.spec_hash == fnv1a32(canonical)
    assert repr(c) == f"gradcomp.Codec({canonical!r})"


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("foo", ["'foo'", "none, fp16, bf16, topk"]),
        ("TopK:ratio=0.1", ["'TopK'", "none, fp16, bf16, topk"]),
        ("", ["empty codec name"]),
        ("topk", ["ratio=", "k="]),
        ("topk:", ["nothing after ':'"]),
        ("topk:ratio=0.1,k=3", ["exactly one of"]),
        ("topk:ratio=1.5", ["ratio=1.5", "0 < ratio <= 1"]),
        ("topk:ratio=0", ["ratio=0", "0 < ratio <= 1"]),
        ("topk:ratio=-0.1", ["ratio=-0.1", "0 < ratio <= 1"]),
        ("topk:ratio=nan", ["ratio='nan'", "finite number"]),
        ("topk:ratio=abc", ["ratio='abc'"]),
        ("topk:ratio=0.1x", ["ratio='0.1x'"]),
        ("topk:k=-1", ["k=-1", ">= 0"]),
        ("topk:k=2.5", ["k='2.5'", "integer"]),
        ("topk:k=3,index=u16", ["index='u16'", "auto, u32, u64"]),
        ("topk:k=3,value_dtype=int8", ["value_dtype='int8'", "auto, float32, float16, bfloat16"]),
        ("topk:k=3,foo=1", ["unknown key 'foo'", "ratio, k, index, value_dtype"]),
        ("topk:k=3,k=4", ["'k' given twice"]),
        ("topk:k", ["'k' is not key=value"]),
        ("fp16:ratio=0.1", ["unknown key 'ratio'", "accepted keys: integrity"]),
        # issue 19 (7): PowerSGD is a Compressor protocol, not a codec; the error says where it goes
        ("powersgd:rank=4", ["PowerSGD is not a codec", "gradcomp.torch.Compressor('powersgd:rank=4')"]),
    ],
)
def test_bad_specs(spec, needles):
    with pytest.raises(IAE) as ei:
        gradcomp.Codec(spec)
    msg = str(ei.value)
    for s in needles:
        assert s in msg, (s, msg)
    assert isinstance(ei.value, ValueError)


def test_packet_bytes_and_payload():
    c = gradcomp.Codec("topk:ratio=0.1")
    assert c.payload(100) is None
    assert c.properties == {"linear": False, "unbiased": False, "deterministic": True, "exact_residual": True,
                            "keyed": False, "sparse": True}
    assert gradcomp.Codec("fp16").properties == {"linear": True, "unbiased": False, "deterministic": True,
                                                 "exact_residual": True, "keyed": False, "sparse": False}
    assert gradcomp.Codec("none").properties["unbiased"] is True
    assert c.packet_bytes(100, "float32") == 32 + 2 * 48
    assert c.packet_bytes(100, torch.float16) == 32 + 48 + 32
    assert c.packet_bytes(100, BF16) == 32 + 48 + 32
    assert c.packet_bytes(0) == 32
    assert gradcomp.Codec("topk:k=3,index=u64").packet_bytes(10) == 32 + 32 + 16
    # more than 2^32 elements switch to u64 indices; index=u32 refuses them
    n = (1 << 32) + 1
    assert gradcomp.Codec("topk:k=5").packet_bytes(n, "bfloat16") == 32 + 48 + 16
    with pytest.raises(IAE, match="index=u32"):
        gradcomp.Codec("topk:k=5,index=u32").packet_bytes(n)
    assert gradcomp.Codec("fp16").packet_bytes(8, "float32") == 32 + 16
    assert gradcomp.Codec("fp16").packet_bytes(9, "float32") == 32 + 32
    assert gradcomp.Codec("none").packet_bytes(8, "float32") == 32 + 32  # exactly numel elements
    assert gradcomp.Codec("none").packet_bytes(9, "float32") == 32 + 48
    for bad in ("float64", "int8", "uint8"):
        with pytest.raises(IAE, match=bad):
            c.packet_bytes(10, bad)
    with pytest.raises(IAE, match="numel=-1 is out of range"):
        c.packet_bytes(-1)
    with pytest.raises(IAE, match="'float65'"):
        c.packet_bytes(10, "float65")


# ---- inputs: dtypes, frameworks, shapes, zero copy ----------------------------------------------
@pytest.mark.parametrize("framework", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("spec", ["topk:ratio=0.2", "fp16", "bf16", "none"])
def test_half_inputs_zero_copy(framework, dtype, spec):
    """float16/bfloat16 inputs (torch, numpy incl. ml_dtypes.bfloat16), packet written in place into
    a caller-provided out, residual updated in place, x untouched."""
    n = 321
    g = np.random.default_rng(5)
    x32 = (g.standard_normal(n) * 3).astype(np.float32)
    xn = x32.astype(np.float16 if dtype == "float16" else BF16)
    if framework == "torch":
        x = torch.from_numpy(xn.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(xn)
        r = torch.zeros(n)
    else:
        x, r = xn, np.zeros(n, np.float32)
    c = gradcomp.Codec(spec)
    nb = c.packet_bytes(n, dtype)
    out = aligned_bytes(nb + 16, framework)  # bigger than needed is fine
    out[:] = 0xAB
    p0, r0 = ptr(out), ptr(r)
    res = c.encode(x, residual=r, out=out)
    assert res is out and ptr(out) == p0 and ptr(r) == r0
    assert header(out)["input_dtype"] == (1 if dtype == "float16" else 2)
    assert header(out)["numel"] == n
    b = as_np_bytes(out)
    assert (b[nb:] == 0xAB).all()  # nothing written past packet_bytes
    # same bytes as an encode into a fresh buffer, from the numpy twin of the input
    fresh = c.encode(xn, residual=np.zeros(n, np.float32))
    np.testing.assert_array_equal(b[:nb], fresh)
    np.testing.assert_array_equal(xn.astype(np.float32), (x.float().numpy() if framework == "torch" else x).astype(np.float32))
    # decode in place into a caller-provided out of the input dtype
    if framework == "torch":
        o = torch.full((n,), 7.0, dtype=getattr(torch, dtype))
    else:
        o = np.full(n, 7.0, np.float32).astype(np.float16 if dtype == "float16" else BF16)
    po = ptr(o)
    assert c.decode(out, out=o) is o and ptr(o) == po
    o_np = o.view(torch.int16).numpy() if framework == "torch" else o.view(np.int16)
    if spec in ("none",) or (spec == "fp16" and dtype == "float16") or (spec == "bf16" and dtype == "bfloat16"):
        np.testing.assert_array_equal(o_np, xn.view(np.int16))  # lossless round trip
    # error feedback identity: x' == D + r_new
    dec = c.decode(out, numel=n)
    dec_np = dec.numpy() if framework == "torch" else dec
    r_np = r.numpy() if framework == "torch" else r
    np.testing.assert_array_equal(dec_np + r_np, xn.astype(np.float32))


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_2d_contiguous_taken_flat(framework):
    g = np.random.default_rng(1)
    a = g.standard_normal((37, 29)).astype(np.float32)
    x = torch.from_numpy(a) if framework == "torch" else a
    for spec in ("topk:ratio=0.05", "fp16"):
        c = gradcomp.Codec(spec)
        p = as_np_bytes(c.encode(x))
        assert header(p)["numel"] == a.size
        np.testing.assert_array_equal(p, as_np_bytes(c.encode(a.reshape(-1).copy())))
        # 2-D out for decode too
        o = np.empty((29, 37), np.float32) if framework == "numpy" else torch.empty(29, 37)
        c.decode(c.encode(a.ravel().copy()), out=o)
        np.testing.assert_array_equal(np.asarray(o).ravel(), c.decode(p, numel=a.size))
    # size-1 dimensions and any strides on them are fine; a 0-d tensor is one element
    c = gradcomp.Codec("topk:k=1")
    assert header(c.encode(torch.randn(5, 1, 3)[:, :, :]))["numel"] == 15
    assert header(c.encode(torch.tensor(2.5)))["numel"] == 1
    assert header(c.encode(np.ones((4, 1), np.float32)[:, ::1]))["numel"] == 4


@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_non_contiguous_rejected(framework):
    a = np.arange(48, dtype=np.float32).reshape(6, 8)
    cases = [(a.T, "(1, 8)"), (a[:, ::2], "(8, 2)"), (a[::2], "(16, 1)"), (a.ravel()[::3], "(3,)")]
    c = gradcomp.Codec("topk:k=4")
    for arr, strides in cases:
        x = torch.from_numpy(a).as_strided(arr.shape, [s // 4 for s in arr.strides]) if framework == "torch" else arr
        with pytest.raises(IAE) as ei:
            c.encode(x)
        msg = str(ei.value)
        assert "strides " + strides in msg and "not C-contiguous" in msg and "encode: x" in msg, msg
    # residual and decode out too
    with pytest.raises(IAE, match=r"encode: residual.*strides \(2,\)"):
        c.encode(np.ones(10, np.float32), residual=np.zeros(20, np.float32)[::2])
    p = c.encode(np.ones(10, np.float32))
    with pytest.raises(IAE, match=r"decode: out.*strides \(2,\)"):
        c.decode(p, out=np.zeros(20, np.float32)[::2])


def test_read_only_numpy_rejected():
    c = gradcomp.Codec("fp16")
    x = np.ones(10, np.float32)
    x.flags.writeable = False
    with pytest.raises(IAE) as ei:
        c.encode(x)
    msg = str(ei.value)
    assert "encode: x" in msg and "read-only" in msg and "copy()" in msg
    p = c.encode(x.copy())
    o = np.zeros(10, np.float32)
    o.flags.writeable = False
    with pytest.raises(IAE, match=r"decode: out.*read-only"):
        c.decode(p, out=o)
    p.flags.writeable = False
    with pytest.raises(IAE, match=r"decode: packet.*read-only"):
        c.decode(p, numel=10)
    # other DLPack export failures do not claim the array is read-only
    with pytest.raises(IAE) as ei:
        c.encode(np.ones(10, np.float32), residual=np.zeros(10, BF16))
    assert "encode: residual" in str(ei.value) and "read-only" not in str(ei.value)


def test_bad_arguments():
    n = 16
    x = np.ones(n, np.float32)
    c = gradcomp.Codec("topk:k=4")
    nb = c.packet_bytes(n)
    with pytest.raises(IAE, match=r"dtype float64; accepted: float32, float16, bfloat16"):
        c.encode(np.ones(n))
    with pytest.raises(IAE, match=r"dtype int32; accepted: float32, float16, bfloat16"):
        c.encode(torch.ones(n, dtype=torch.int32))
    with pytest.raises(IAE, match="expected a torch.Tensor or numpy.ndarray, got list"):
        c.encode([1.0, 2.0])
    # wrong-size out
    with pytest.raises(IAE) as ei:
        c.encode(x, out=aligned_bytes(nb - 16))
    assert f"packet holds {nb - 16} bytes" in str(ei.value) and f"= {nb}" in str(ei.value)
    # misaligned out
    with pytest.raises(IAE, match="not 16-byte aligned"):
        c.encode(x, out=aligned_bytes(nb, offset=1))
    # residual of the wrong dtype / size
    with pytest.raises(IAE, match="residual has dtype float16; accepted: float32"):
        c.encode(x, residual=torch.zeros(n, dtype=torch.float16).numpy())
    with pytest.raises(IAE, match="residual has dtype bfloat16; accepted: float32"):
        c.encode(torch.from_numpy(x), residual=torch.zeros(n, dtype=torch.bfloat16))
    with pytest.raises(IAE, match="encode: residual has dtype float64; accepted: float32"):
        c.encode(x, residual=np.zeros(n))
    with pytest.raises(IAE, match="residual has 15 elements but x has 16"):
        c.encode(x, residual=np.zeros(n - 1, np.float32))
    # divisor
    for d in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(IAE, match="divisor"):
            c.encode(x, divisor=d)
    # decode
    p = c.encode(x)
    with pytest.raises(IAE, match="numel="):
        c.decode(p)
    with pytest.raises(IAE, match="decode: dtype=float64; accepted: float32, float16, bfloat16"):
        c.decode(p, numel=n, dtype="float64")
    with pytest.raises(IAE, match="out has dtype int32; accepted"):
        c.decode(p, out=np.zeros(n, np.int32))
    with pytest.raises(IAE, match="alpha"):
        c.decode(p, numel=n, alpha=float("inf"))
    with pytest.raises(IAE, match="numel=15 but the packet's header says 16"):
        c.decode(p, numel=n - 1)
    with pytest.raises(CPE, match="less than the 32-byte header"):
        c.decode(p[:16], numel=n)
    with pytest.raises(CPE, match="header describes"):
        c.decode(p[:-16], numel=n)


@pytest.mark.parametrize("out_dtype", ["float32", "float16", "bfloat16", torch.bfloat16, BF16])
def test_decode_allocates(out_dtype):
    c = gradcomp.Codec("bf16")
    x = torch.linspace(-3, 3, 40)
    p = c.encode(x)
    o = c.decode(p, numel=40, dtype=out_dtype)
    assert isinstance(o, torch.Tensor) and o.shape == (40,)
    assert str(o.dtype) == "torch." + ("bfloat16" if out_dtype in (torch.bfloat16, BF16) else out_dtype)
    assert torch.equal(o.float(), x.bfloat16().float())
    pn = p.numpy().copy()
    on = c.decode(pn, numel=40, dtype=out_dtype)
    assert isinstance(on, np.ndarray)
    np.testing.assert_array_equal(on.astype(np.float32), x.bfloat16().float().numpy())


def test_empty_tensors():
    for spec in ("topk:ratio=0.5", "topk:k=3", "fp16", "none"):
        c = gradcomp.Codec(spec)
        for x in (np.zeros(0, np.float32), torch.zeros(0, dtype=torch.bfloat16), torch.zeros(0, 5)):
            p = c.encode(x, residual=np.zeros(0, np.float32) if isinstance(x, np.ndarray) else torch.zeros(0))
            h = header(p)
            assert h["numel"] == 0 and h["main"] == 0 and h["flags"] == 0
            assert c.decode(p, numel=0).shape == (0,)


def test_dlpack_capsules_released():
    """The bridge calls each capsule's deleter: no reference to the arrays is leaked."""
    c = gradcomp.Codec("topk:k=3")
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    r = np.zeros(100, np.float32)
    out = aligned_bytes(c.packet_bytes(100), "numpy")
    o = np.zeros(100, np.float32)
    c.encode(x, residual=r, out=out)
    c.decode(out, out=o)
    gc.collect()
    before = [sys.getrefcount(a) for a in (x, r, out, o)]
    for _ in range(20):
        c.encode(x, residual=r, out=out)
        c.decode(out, out=o, accumulate=True)
    with pytest.raises(IAE):
        c.encode(x, residual=np.zeros(3, np.float32), out=out)  # error after the capsules were taken
    gc.collect()
    assert [sys.getrefcount(a) for a in (x, r, out, o)] == before
    # torch: the tensors stay usable and unshared
    t = torch.ones(100)
    c.encode(t)
    t += 1
    assert t.sum().item() == 200.0


def test_other_dlpack_producers():
    """Any object with __dlpack__ / __dlpack_device__ is accepted for packets and outs; objects
    without them get a clear error."""

    class Wrapped:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    c = gradcomp.Codec("fp16")
    x = np.arange(10, dtype=np.float32)
    p = c.encode(x)
    o = np.zeros(10, np.float32)
    c.decode(Wrapped(p), out=Wrapped(o))
    np.testing.assert_array_equal(o, x)
    with pytest.raises(IAE, match=r"packet: expected a torch.Tensor, numpy.ndarray or DLPack tensor, got bytes"):
        c.decode(bytes(p), numel=10)


# ---- corrupt packets -----------------------------------------------------------------------------
def _tamper(p, offset, dtype, value):
    b = as_np_bytes(p)
    b[offset:offset + np.dtype(dtype).itemsize].view(dtype)[0] = value


@pytest.mark.parametrize("spec", ["topk:k=4", "topk:k=4,index=u64", "fp16", "none"])
@pytest.mark.parametrize(
    "what",
    ["magic", "version", "codec_id", "spec_hash", "numel", "main", "input_dtype", "wire_dtype", "index_dtype",
     "index_range", "index_order", "index_repeat", "truncated"],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_corrupt_packet_leaves_out_untouched(spec, what, accumulate):
    n = 10
    c = gradcomp.Codec(spec)
    x = np.array([0, 5, 0, -7, 0, 0, 3, 0, 9, 0], np.float32)
    p = c.encode(x)
    wide = "index=u64" in spec
    it = "<u8" if wide else "<u4"
    topk = spec.startswith("topk")
    if what == "magic":
        _tamper(p, 0, "<u4", int.from_bytes(b"GCP2", "little")); msg = "bad magic"
    elif what == "version":
        _tamper(p, 4, "<u2", 2); msg = "version 2"
    elif what == "codec_id":
        _tamper(p, 6, "<u2", 3 if spec != "bf16" else 2); msg = "codec id"
    elif what == "spec_hash":
        _tamper(p, 12, "<u4", header(p)["spec_hash"] ^ 1); msg = "spec hash"
    elif what == "numel":
        _tamper(p, 16, "<u8", n + 1); msg = "numel"
    elif what == "main":
        _tamper(p, 24, "<u8", 5 if topk else 1); msg = "main parameter"
    elif what == "input_dtype":
        _tamper(p, 8, "u1", 3); msg = "input dtype"
    elif what == "wire_dtype":
        _tamper(p, 9, "u1", 2 if spec != "bf16" else 1); msg = "dtype code"
    elif what == "index_dtype":
        if not topk:
            pytest.skip("casts carry no index section")
        _tamper(p, 10, "u1", 9 if wide else 10); msg = "index dtype"
    elif what == "truncated":
        p = p[:-16]; msg = "header describes"
    else:
        if not topk:
            pytest.skip("casts carry no index section")
        idx = as_np_bytes(p)[32:32 + 4 * (8 if wide else 4)].view(it)
        assert idx.tolist() == [1, 3, 6, 8]
        if what == "index_range":
            idx[3] = n; msg = "index 10 >= numel 10"
        elif what == "index_order":
            idx[1], idx[2] = 6, 3; msg = "out of order"
        else:
            idx[2] = 3; msg = "repeated"
    out = np.full(n, 42.0, np.float32)
    ws = c.workspace(out)
    gradcomp.check(ws)
    with pytest.raises(CPE, match=msg):
        c.decode(p, out=out, accumulate=accumulate, workspace=ws)
    np.testing.assert_array_equal(out, np.full(n, 42.0, np.float32))
    # the CPU reports by raising, and only so: the status word (CUDA's channel) stays clean, so a
    # later check does not report the same packet again
    assert gradcomp.check(ws) == 0


def test_packet_of_other_codec_parameters_rejected():
    """Same layout, other spec: the spec hash refuses the packet (docs/contracts.md section 3)."""
    x = np.arange(20, dtype=np.float32)
    a, b = gradcomp.Codec("topk:k=5"), gradcomp.Codec("topk:k=5,value_dtype=float32")
    assert a.packet_bytes(20) == b.packet_bytes(20)
    with pytest.raises(CPE, match=r"spec hash .*'topk:k=5,value_dtype=float32'"):
        b.decode(a.encode(x), numel=20)
    # ratio vs k giving the same k
    with pytest.raises(CPE, match="spec hash"):
        gradcomp.Codec("topk:ratio=0.25").decode(a.encode(x), numel=20)
    with pytest.raises(CPE, match="codec id 2"):
        gradcomp.Codec("bf16").decode(gradcomp.Codec("fp16").encode(x), numel=20)


# ---- status word ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk:k=2", "topk:k=0", "fp16", "bf16", "none"])
@pytest.mark.parametrize("framework", ["torch", "numpy"])
def test_check_after_nonfinite_decode(spec, framework):
    n = 9
    x = np.array([1, 2, 3, np.nan, 5, 6, -np.inf, 8, 9], np.float32)
    c = gradcomp.Codec(spec)
    p = c.encode(torch.from_numpy(x) if framework == "torch" else x)
    assert header(p)["flags"] == 1
    ws = c.workspace(p)
    assert gradcomp.check(ws) == 0
    out = c.decode(p, numel=n, workspace=ws)
    if spec.startswith("topk"):
        assert np.isnan(np.asarray(out)[0])  # a codec that may drop a value marks out[0]
    else:  # the casts carry every value: the NaN and the inf where they were, nothing overwritten
        o = np.asarray(out, np.float32)
        assert np.isnan(o[3]) and np.isneginf(o[6]) and o[0] == 1.0
    assert gradcomp.check(ws, clear=False) == 1
    assert gradcomp.check(ws) == 1  # clear=True (default) resets it
    assert gradcomp.check(ws) == 0
    # a finite packet leaves the word alone; flags are OR-ed over decodes
    pf = c.encode(np.arange(n, dtype=np.float32) if framework == "numpy" else torch.arange(n, dtype=torch.float32))
    assert header(pf)["flags"] == 0
    c.decode(pf, numel=n, workspace=ws)
    assert gradcomp.check(ws) == 0
    c.decode(p, numel=n, workspace=ws)
    c.decode(pf, numel=n, workspace=ws)
    assert gradcomp.check(ws) == 1
    # the cached workspace is the default one
    c.decode(p, numel=n)
    assert gradcomp.check(c.workspace(p)) == 1
    with pytest.raises(IAE, match="status word"):
        gradcomp.check(np.zeros(8, np.uint8))


def test_fp16_overflow_is_flagged():
    """Finite input beyond fp16 range becomes inf on the wire; the packet says so."""
    x = np.array([1.0, 70000.0, -1e6, 2.0], np.float32)
    c = gradcomp.Codec("fp16")
    r = np.zeros(4, np.float32)
    p = c.encode(x, residual=r)
    h = header(p)
    assert h["flags"] == 1
    assert p[32:40].view("<u2").tolist() == [0x3C00, 0x7C00, 0xFC00, 0x4000]
    assert not p[40:].any()  # exactly numel wire elements, then zero padding
    np.testing.assert_array_equal(r, [0.0, -np.inf, np.inf, 0.0])
    # top-k with float16 values likewise
    p = gradcomp.Codec("topk:k=1,value_dtype=float16").encode(x)
    assert header(p)["flags"] == 1 and p[48:50].view("<u2")[0] == 0xFC00


def test_workspace_cache_grows():
    c = gradcomp.Codec("topk:ratio=0.5")
    small = np.ones(10, np.float32)
    ws1 = c.workspace(small, 10)
    big = np.random.default_rng(3).standard_normal(200_000).astype(np.float32)
    p = c.encode(big)
    ws2 = c.workspace(big, big.size)
    assert ws2.size >= c._c.workspace_bytes(big.size, "float32") and ws2.size >= ws1.size
    np.testing.assert_array_equal(as_np_bytes(p)[32:32 + 400].view("<u4")[:100],
                                  topk_indices(big, 100_000)[:100])
    with pytest.raises(IAE, match="workspace holds 16 bytes"):
        c.encode(big, workspace=np.zeros(16, np.uint8))


# ---- the registry and the layout -----------------------------------------------------------------
def test_codecs_lists_the_registry():
    cs = gradcomp.codecs()
    by = {c["name"]: c for c in cs}
    assert list(by)[:4] == ["none", "fp16", "bf16", "topk"]
    assert {n: by[n]["id"] for n in ("none", "fp16", "bf16", "topk")} == {"none": 1, "fp16": 2, "bf16": 3, "topk": 4}
    # integrity= (the CRC-32C section) is every codec's key, listed last
    assert by["topk"]["keys"] == ["ratio", "k", "index", "value_dtype", "integrity"]
    assert by["fp16"]["keys"] == ["integrity"]
    for c in cs:
        assert c["examples"] and c["summary"]
        for e in c["examples"]:
            assert gradcomp.Codec(e).spec == e
        assert c["properties"] == gradcomp.Codec(c["examples"][0]).properties


def test_layout_of_topk_and_cast():
    lay = gradcomp.Codec("topk:k=3,index=u64,value_dtype=bfloat16").layout(10, "float32")
    assert lay["sections"] == [("indices", 32, 3, "uint64"), ("values", 64, 3, "bfloat16")]
    assert lay["bytes"] == 80 and lay["key_section"] == -1 and lay["payload_section"] == -1
    assert lay["main_param"] == 3 and lay["main_kind"] == "exact"
    assert (lay["wire_dtype"], lay["index_dtype"]) == ("bfloat16", "uint64")
    lay = gradcomp.Codec("none").layout(9, "float16")
    assert lay["sections"] == [("payload", 32, 9, "float16")] and lay["payload_section"] == 0
    assert lay["bytes"] == 64 and lay["wire_dtype"] == "float16" and lay["index_dtype"] == "none"
    with pytest.raises(IAE, match="numel=-1"):
        gradcomp.Codec("none").layout(-1)


# ---- issue 8: arguments named, values, threads ---------------------------------------------------
def test_codec_is_a_value_pickled_by_spec():
    import pickle

    a, b = gradcomp.Codec("topk:ratio=0.010"), gradcomp.Codec("topk:ratio=0.01")
    assert a == b and hash(a) == hash(b) and a != gradcomp.Codec("topk:ratio=0.02") and a != "topk:ratio=0.01"
    assert len({a, b, gradcomp.Codec("fp16")}) == 2
    for c in (a, gradcomp.Codec("fp16"), gradcomp.Codec("topk:k=3,index=u64,value_dtype=bfloat16")):
        x = np.arange(40, dtype=np.float32)
        c.encode(x)  # a cached workspace must not prevent pickling
        c2 = pickle.loads(pickle.dumps(c))
        assert c2 == c and c2.spec == c.spec
        np.testing.assert_array_equal(c2.encode(x), c.encode(x))
        buf = io.BytesIO()
        torch.save({"codec": c}, buf)
        buf.seek(0)
        assert torch.load(buf, weights_only=False)["codec"] == c


def test_decode_checks_numel_and_dtype_against_out():
    c = gradcomp.Codec("fp16")
    p = c.encode(np.arange(8, dtype=np.float32))
    out = np.zeros(8, np.float32)
    c.decode(p, out=out, numel=8, dtype="float32")
    np.testing.assert_array_equal(out, np.arange(8))
    with pytest.raises(IAE, match="numel=7 but the packet's header says 8"):
        c.decode(p, out=out, numel=7)
    with pytest.raises(IAE, match="dtype=float16 but out has dtype float32"):
        c.decode(p, out=out, dtype="float16")
    t = torch.zeros(8, dtype=torch.bfloat16)
    c.decode(p, out=t)  # no dtype given: out's dtype is used
    with pytest.raises(IAE, match="dtype=float32 but out has dtype bfloat16"):
        c.decode(p, out=t, dtype=torch.float32)
    # float64 outputs and residuals: the same wording as every other dtype
    with pytest.raises(IAE, match="decode: out has dtype float64; accepted: float32, float16, bfloat16"):
        c.decode(p, out=np.zeros(8))
    with pytest.raises(IAE, match="decode: out has dtype int32; accepted: float32, float16, bfloat16"):
        c.decode(p, out=torch.zeros(8, dtype=torch.int32))
    with pytest.raises(IAE, match="encode: residual has dtype float64; accepted: float32"):
        c.encode(torch.ones(8), residual=torch.zeros(8, dtype=torch.float64))
    with pytest.raises(IAE, match="encode: x has dtype float64; accepted: float32, float16, bfloat16"):
        c.encode(torch.ones(8, dtype=torch.float64))


@pytest.mark.parametrize("value", ["abc", "0", "-3", "100000", "2.5", ""])
def test_invalid_thread_environment_is_an_error(value):
    import subprocess
    import sys

    code = ("import numpy as np, gradcomp\n"
            "try:\n    gradcomp.Codec('fp16').encode(np.ones(70000, np.float32))\n"
            "except gradcomp.InvalidArgumentError as e:\n    print('ERR', e)\n")
    env = dict(os.environ, GRADCOMP_NUM_THREADS=value)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    if value == "":
        assert "ERR" in p.stdout and "GRADCOMP_NUM_THREADS=''" in p.stdout
    else:
        assert f"ERR GRADCOMP_NUM_THREADS='{value}' is not an integer in [1, 1024]" in p.stdout, p.stdout


def test_valid_thread_environment_is_taken():
    import subprocess
    import sys

    env = dict(os.environ, GRADCOMP_NUM_THREADS="3")
    p = subprocess.run([sys.executable, "-c", "import gradcomp; print(gradcomp.get_num_threads())"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "3"


def test_portable_build_reports_and_switches_its_cpu_variant():
    """The default build is portable: the CPU kernels exist in several instruction-set variants and
    the best one this processor supports runs (build_info says which); GRADCOMP_CPU_ISA asks for a
    lower one; every variant gives the same packet bytes."""
    import subprocess
    import sys

    info = gradcomp.build_info()
    supported = gradcomp._C.cpu_isas_supported()
    assert info["cpu_isa"] == supported[0]
    if info["cpu_variants"] != "native":
        assert info["cpu_variants"].split(",")[-1] == "generic" and "generic" in supported
    code = ("import numpy as np, gradcomp, hashlib\n"
            "x = np.random.default_rng(5).standard_normal((1 << 18) + 3).astype(np.float32)\n"
            "h = hashlib.sha256()\n"
            "for s in ('fp16', 'bf16', 'topk:ratio=0.01', 'topk:ratio=0.3,value_dtype=float16'):\n"
            "    h.update(np.asarray(gradcomp.Codec(s).encode(x, residual=np.full(x.size, 0.1, np.float32))).tobytes())\n"
            "print(gradcomp.build_info()['cpu_isa'], h.hexdigest())\n")
    seen = {}
    for isa in supported:
        env = dict(os.environ, GRADCOMP_CPU_ISA=isa)
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        got_isa, digest = p.stdout.split()
        assert got_isa == isa
        seen[isa] = digest
    assert len(set(seen.values())) == 1, seen
    with pytest.raises(IAE, match="accepted: " + ", ".join(supported)):
        gradcomp._C.set_cpu_isa("sse9")
