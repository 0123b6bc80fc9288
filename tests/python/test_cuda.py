"""CUDA tensors through the Python bindings (docs/contracts.md sections 3 and 6). Skipped without a GPU or
in a build without CUDA; tests/gpu/run.sh runs them on the GPU machine (`pytest -k cuda`).

Every check is bitwise: packets against the numpy / ml_dtypes references of test_codec_support
(never a call into gradcomp) and against the CPU backend's packet for the same input; decode and
the residual against the same references.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from test_codec_support import (  # noqa: E402
    align16,
    as_np_bytes,
    convert_input,
    encode_reference,
    f32_bits,
    header,
    load_bits,
    make_input,
    topk_indices,
    topk_k,
)

_HAVE_GPU = gradcomp.build_info()["cuda"] and torch.cuda.is_available()
if os.environ.get("GRADCOMP_REQUIRE_GPU") == "1" and not _HAVE_GPU:
    # tests/gpu/run.sh sets it on the GPU machine: a run there must not pass by skipping everything
    raise RuntimeError(f"GRADCOMP_REQUIRE_GPU=1 but gradcomp build cuda={gradcomp.build_info()['cuda']}, "
                       f"torch.cuda.is_available()={torch.cuda.is_available()}")
pytestmark = pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA build of gradcomp and a GPU")

KINDS = ["randn", "zeros", "const", "outlier", "denorm", "ties", "special"]
SIZES = [0, 1, 7, 1023, 1025, 65537, (1 << 20) + 3]


def _to_cuda(t):
    return t.cuda() if isinstance(t, torch.Tensor) else torch.from_numpy(t).cuda()


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("in_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_cuda_cast_packet_matches_reference_and_cpu(spec, in_dtype, kind, n):
    rng = np.random.default_rng(n * 7 + len(kind))
    x32 = make_input(kind, n, rng)
    xt, loaded = convert_input(x32, in_dtype, "torch")
    r = rng.standard_normal(n).astype(np.float32)
    c = gradcomp.Codec(spec)
    r_gpu = torch.from_numpy(r.copy()).cuda()
    p_gpu = c.encode(xt.cuda(), residual=r_gpu, divisor=2)
    torch.cuda.synchronize()
    r_cpu = torch.from_numpy(r.copy())
    p_cpu = c.encode(xt, residual=r_cpu, divisor=2)
    assert np.array_equal(as_np_bytes(p_gpu.cpu()), as_np_bytes(p_cpu)), "CUDA packet != CPU packet"
    wire = {"none": in_dtype, "fp16": "float16", "bf16": "bfloat16"}[spec]
    _, _, _, bits, d, r_new, flag = encode_reference(loaded, r, 2.0, wire)
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[wire]
    got = as_np_bytes(p_gpu.cpu())[32 : 32 + n * size].view(bits.dtype)
    assert np.array_equal(got, bits)
    assert np.array_equal(f32_bits(r_gpu.cpu().numpy()), f32_bits(r_new))
    assert bool(header(p_gpu.cpu())["flags"] & 1) == flag
    assert not as_np_bytes(p_gpu.cpu())[32 + n * size:].any()  # exactly numel elements, zero padding
    out = c.decode(p_gpu, numel=n)
    # the casts carry every non-finite value: each element decodes to its own value
    np.testing.assert_array_equal(f32_bits(out.cpu().numpy()), f32_bits(d))


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.5", "topk:k=1", "topk:k=0",
                                  "topk:ratio=1", "topk:ratio=0.1,value_dtype=float16",
                                  "topk:ratio=0.1,index=u64"])
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", SIZES)
def test_cuda_topk_packet_matches_reference_and_cpu(spec, in_dtype, kind, n):
    rng = np.random.default_rng(n * 13 + len(kind))
    x32 = make_input(kind, n, rng)
    xt, loaded = convert_input(x32, in_dtype, "torch")
    r = (rng.standard_normal(n) * 0.1).astype(np.float32)
    c = gradcomp.Codec(spec)
    r_gpu = torch.from_numpy(r.copy()).cuda()
    p_gpu = c.encode(xt.cuda(), residual=r_gpu)
    r_cpu = torch.from_numpy(r.copy())
    p_cpu = c.encode(xt, residual=r_cpu)
    gpu_bytes = as_np_bytes(p_gpu.cpu())
    assert np.array_equal(gpu_bytes, as_np_bytes(p_cpu)), "CUDA packet != CPU packet"
    xp = (loaded + r).astype(np.float32)
    k = c.main_param(n)
    assert k == (topk_k(n, k=int(spec.split("k=")[1].split(",")[0])) if ":k=" in spec
                 else topk_k(n, ratio=float(spec.split("ratio=")[1].split(",")[0])))
    sel = topk_indices(xp, k)
    ib = 8 if "u64" in spec else 4
    idx = gpu_bytes[32 : 32 + k * ib].view(np.uint64 if ib == 8 else np.uint32)
    assert np.array_equal(idx.astype(np.int64), sel)
    wire = "float16" if "float16" in spec else in_dtype
    _, _, _, bits, d, r_new, _ = encode_reference(xp, None, 1.0, wire, sel=sel)
    voff = 32 + align16(k * ib)
    vals = gpu_bytes[voff : voff + k * bits.itemsize].view(bits.dtype)
    assert np.array_equal(vals, bits)
    assert np.array_equal(f32_bits(r_gpu.cpu().numpy()), f32_bits(r_new))


def test_cuda_topk_large_bfloat16_planted():
    """2^31 + 64 bfloat16 elements from zeros with planted values past 2^31 (needs ~4.3 GB)."""
    n = (1 << 31) + 64
    free, _ = torch.cuda.mem_get_info()
    if free < 6 * (1 << 30):
        pytest.skip("not enough GPU memory")
    x = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    planted = {(1 << 31) + 10: 8.0, (1 << 31) + 63: -9.0, 5: 3.0, (1 << 30): -4.0, (1 << 31) - 1: 2.0}
    for i, v in planted.items():
        x[i] = v
    c = gradcomp.Codec("topk:k=4")
    p = c.encode(x).cpu()
    b = as_np_bytes(p)
    idx = b[32:48].view(np.uint32).astype(np.int64)
    assert list(idx) == [5, 1 << 30, (1 << 31) + 10, (1 << 31) + 63]
    vals = load_bits(b[48:56].view(np.uint16), "bfloat16")
    assert list(vals) == [3.0, -4.0, 8.0, -9.0]


def test_cuda_corrupt_packet_sets_status_and_stays_in_bounds():
    n = 4096
    c = gradcomp.Codec("topk:ratio=0.01")
    x = torch.randn(n, device="cuda")
    p = c.encode(x)
    k = c.main_param(n)
    bad = p.clone()
    bad_idx = bad[32 : 32 + 4 * k].view(torch.int32)
    bad_idx[1] = n + 100  # out of range
    guard = torch.full((n + 256,), 7.0, device="cuda")
    out = guard[:n]
    ws = c.workspace(out)
    gradcomp.check(ws)  # clear
    c.decode(bad, out=out, workspace=ws)
    with pytest.raises(gradcomp.CorruptPacketError):
        gradcomp.check(ws)
    assert torch.all(guard[n:] == 7.0)


def test_cuda_runs_on_the_current_stream():
    n = 1 << 20
    c = gradcomp.Codec("fp16")
    s = torch.cuda.Stream()
    x = torch.randn(n, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        p = c.encode(x)
        y = c.decode(p, numel=n)
    s.synchronize()
    np.testing.assert_array_equal(y.cpu().numpy(), x.cpu().numpy().astype(np.float16).astype(np.float32))


@pytest.mark.parametrize("spec", ["fp8", "fp8:format=e5m2", "fp8:scale=e8m0", "fp8:block=0", "int8", "int4",
                                  "int4:block=6", "int8:block=2000"])
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 129, 4097, (1 << 20) + 3])
def test_cuda_blockq_packet_equals_cpu(spec, in_dtype, n):
    """fp8 / int8 / int4: the CUDA packet, residual and decode are bitwise those of the CPU backend
    (which test_quant.py checks against ml_dtypes / numpy)."""
    rng = np.random.default_rng(n + len(spec))
    x32 = make_input("special", n, rng)
    xt, _ = convert_input(x32, in_dtype, "torch")
    r = (rng.standard_normal(n) * 0.01).astype(np.float32)
    c = gradcomp.Codec(spec)
    r_gpu, r_cpu = torch.from_numpy(r.copy()).cuda(), torch.from_numpy(r.copy())
    p_gpu = c.encode(xt.cuda(), residual=r_gpu, divisor=3)
    p_cpu = c.encode(xt, residual=r_cpu, divisor=3)
    assert np.array_equal(as_np_bytes(p_gpu.cpu()), as_np_bytes(p_cpu))
    assert np.array_equal(f32_bits(r_gpu.cpu().numpy()), f32_bits(r_cpu.numpy()))
    out_gpu, out_cpu = c.decode(p_gpu, numel=n), c.decode(p_cpu, numel=n)
    assert np.array_equal(f32_bits(out_gpu.cpu().numpy()), f32_bits(out_cpu.numpy()))


@pytest.mark.parametrize("spec", ["onebit", "onebit:scale=mean_abs", "onebit:chunk=8", "onebit:chunk=4104",
                                  "onebit:chunk=65536,scale=mean_abs"])
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [1, 129, 4097, (1 << 20) + 3])
def test_cuda_onebit_packet_equals_cpu(spec, in_dtype, n):
    """onebit: the CUDA packet, residual and decode are bitwise those of the CPU backend (which
    test_onebit.py checks against numpy.packbits and an fsum scale)."""
    rng = np.random.default_rng(n + 3 * len(spec))
    x32 = make_input("special", n, rng)
    xt, _ = convert_input(x32, in_dtype, "torch")
    r = (rng.standard_normal(n) * 0.01).astype(np.float32)
    c = gradcomp.Codec(spec)
    r_gpu, r_cpu = torch.from_numpy(r.copy()).cuda(), torch.from_numpy(r.copy())
    p_gpu = c.encode(xt.cuda(), residual=r_gpu, divisor=3)
    p_cpu = c.encode(xt, residual=r_cpu, divisor=3)
    assert np.array_equal(as_np_bytes(p_gpu.cpu()), as_np_bytes(p_cpu))
    assert np.array_equal(f32_bits(r_gpu.cpu().numpy()), f32_bits(r_cpu.numpy()))
    out_gpu, out_cpu = c.decode(p_gpu, numel=n), c.decode(p_cpu, numel=n)
    assert np.array_equal(f32_bits(out_gpu.cpu().numpy()), f32_bits(out_cpu.numpy()))
