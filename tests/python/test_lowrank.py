"""gradcomp.lowrank (the steps of PowerSGD, Vogels et al., NeurIPS 2019, algorithm 1) against
references written here with numpy (never calling gradcomp):

* project / back_project against float64 numpy matmuls; tolerance |got - ref| <= 1e-5 * |row of
  M| * |column of Q| (project; back_project: column of M, column of P) -- a float32 GEMM's error is
  about sqrt(n) * 2^-24 of that;
* orthogonalize against numpy's float64 QR with the signs fixed so that diag(R) > 0 (Gram-Schmidt's
  convention): |got - ref| <= 2e-6 * cond(X) + 1e-6, and |Q^T Q - I| < 1e-5;
* reconstruct bitwise against a float32 numpy loop in k order (numpy's float32 ufuncs round every
  product and sum: no FMA), out float16 / bfloat16 bitwise against torch's / ml_dtypes' rounding of
  that float32 T, the residual fl(e - T), the status bit;
* one whole power-iteration step (P = M Q, QR, Q = M^T P, M_hat = P Q^T) in float64 vs the kernels
  chained: |M_hat - ref| <= 1e-5 * cond(M Q) * ||M||_2 (float32 rounding moves the span of P by
  about 2^-24 cond(M Q));
* random_normal bitwise against a pure-Python Philox4x64-10 (pinned to numpy.random.Philox's raw
  output) and Box-Muller with math.log / math.cos;
* zero matrices (no NaN, redraw), NaN input, shapes 1 x n and n x 1, rank = min(rows, cols), count
  1 and 5, offsets with gaps in any order; rank above min(rows, cols) rejected with a clear error.

The same checks run on CUDA tensors when a GPU and a CUDA build are present (skipped otherwise):
GEMMs with the same tolerances, reconstruct bitwise, random_normal within 1 float32 ulp (CUDA's
binary64 log / cos are not glibc's). Seeds are fixed (numpy default_rng from the test parameters).
"""

from __future__ import annotations

import contextlib
import math
import os

import ml_dtypes
import numpy as np
import pytest
import torch

import gradcomp
from gradcomp import lowrank

F32 = np.float32
_HAVE_GPU = gradcomp.build_info()["cuda"] and torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA build and a GPU"))]
if os.environ.get("GRADCOMP_REQUIRE_GPU") == "1" and not _HAVE_GPU:
    raise RuntimeError("GRADCOMP_REQUIRE_GPU=1 but no CUDA build of gradcomp or no GPU")


# ---- Philox4x64-10 (Salmon et al., SC 2011) and Box-Muller, in Python integers -------------------
_M64 = (1 << 64) - 1


def philox4x64_10(ctr, key):
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r:
            k0 = (k0 + 0x9E3779B97F4A7C15) & _M64
            k1 = (k1 + 0xBB67AE8584CAA73B) & _M64
        p0 = 0xD2E7470EE14C6C93 * c0
        p1 = 0xCA5A826395121157 * c2
        c0, c1, c2, c3 = (p1 >> 64) ^ c1 ^ k0, p1 & _M64, (p0 >> 64) ^ c3 ^ k1, p0 & _M64
    return c0, c1, c2, c3


def ref_normal(n, seed, stream):
    out = np.empty(n, F32)
    for e in range(n):
        x0, x1, _, _ = philox4x64_10((e, stream, 0, 0), (seed, 0x9E3779B97F4A7C15))
        u1 = ((x0 >> 11) + 1) * 2.0 ** -53
        u2 = (x1 >> 11) * 2.0 ** -53
        out[e] = F32(math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2))
    return out


def test_philox_reference_matches_numpy():
    """numpy.random.Philox is Philox4x64-10; it increments its 256-bit counter before the first
    block, so a generator set to counter c - 1 returns the block of c."""
    for ctr, key in [((0, 0, 0, 0), (0, 0)), ((5, 7, 0, 0), (42, 0x9E3779B97F4A7C15)),
                     ((2**64 - 3, 2**63 + 1, 9, 2**64 - 1), (2**64 - 1, 12345))]:
        v = (sum(c << (64 * i) for i, c in enumerate(ctr)) - 1) % (1 << 256)  # the 256-bit counter - 1
        prev = [(v >> (64 * i)) & _M64 for i in range(4)]
        bg = np.random.Philox(counter=np.array(prev, np.uint64), key=np.array(key, np.uint64))
        assert [int(v) for v in bg.random_raw(4)] == list(philox4x64_10(ctr, key)), (ctr, key)


# ---- helpers ------------------------------------------------------------------------------------
def make_batch(rng, count, rows, cols, shuffle=True):
    """A flat float32 buffer holding `count` matrices with gaps of 0..7 elements (gap value 1234.5),
    in reversed order when shuffle; returns (buffer, offsets, list of [rows, cols] float32 views)."""
    starts, pos = [], int(rng.integers(0, 8))
    for _ in range(count):
        starts.append(pos)
        pos += rows * cols + int(rng.integers(0, 8))
    buf = np.full(pos + 3, 1234.5, F32)
    if shuffle:
        starts = starts[::-1]
    for s in starts:
        buf[s:s + rows * cols] = rng.standard_normal(rows * cols).astype(F32)
    mats = [buf[s:s + rows * cols].reshape(rows, cols) for s in starts]
    return buf, starts, mats


def dev(a, device):
    """A copy of numpy array a as a torch tensor on device (never sharing a's memory)."""
    return torch.from_numpy(np.array(a, copy=True)).to(device)


def host(t):
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    return t.cpu().numpy()


def qr_gs(x64):
    """Gram-Schmidt's Q of x (float64 [rows, rank]) through numpy's QR: signs with diag(R) > 0."""
    q, r = np.linalg.qr(x64)
    s = np.sign(np.diag(r))
    s[s == 0] = 1
    return q * s


def ref_T(p, q):
    """T = fl(...fl(fl(P[:,0] Q[:,0]) + fl(P[:,1] Q[:,1])) ...) in float32, k ascending."""
    with np.errstate(all="ignore"):
        t = (p[:, 0:1] * q[None, :, 0]).astype(F32)
        for k in range(1, p.shape[1]):
            t = (t + (p[:, k:k + 1] * q[None, :, k]).astype(F32)).astype(F32)
    return t


def round_to(t32, dtype):
    if dtype == "float32":
        return t32
    if dtype == "float16":
        return torch.from_numpy(t32).to(torch.float16).numpy()
    return t32.astype(ml_dtypes.bfloat16)


TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SHAPES = [(1, 1, 1, 1), (1, 1, 50, 1), (1, 60, 1, 1), (5, 1, 33, 1), (5, 40, 1, 1), (1, 12, 7, 7), (5, 7, 12, 7),
          (5, 33, 17, 4), (1, 200, 150, 4), (3, 500, 64, 8), (1, 300, 260, 1), (2, 90, 130, 24)]


# ---- the steps ------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count,rows,cols,rank", SHAPES)
def test_power_step_matches_numpy(device, count, rows, cols, rank):
    rng = np.random.default_rng([count, rows, cols, rank, 1])
    buf, offs, mats = make_batch(rng, count, rows, cols)
    q0 = rng.standard_normal((count, cols, rank)).astype(F32)
    m_t = dev(buf, device)

    # P = M Q
    p_t = torch.full((count, rows, rank), math.nan, device=device)  # outputs are never read
    assert lowrank.project(m_t, offs, rows, cols, dev(q0, device), p_t) is p_t
    p = host(p_t)
    for b, M in enumerate(mats):
        ref = M.astype(np.float64) @ q0[b].astype(np.float64)
        tol = 1e-5 * np.linalg.norm(M, axis=1)[:, None] * np.linalg.norm(q0[b], axis=0)[None, :] + 1e-30
        assert np.all(np.abs(p[b] - ref) <= tol), f"P[{b}]: max err {np.abs(p[b] - ref).max()}"

    # orthogonalize P (the kernel's P as input)
    lowrank.orthogonalize(p_t)
    po = host(p_t)
    for b in range(count):
        ref = qr_gs(p[b].astype(np.float64))
        cond = np.linalg.cond(p[b].astype(np.float64))
        assert np.abs(po[b] - ref).max() <= 2e-6 * cond + 1e-6, f"orthogonalize[{b}] cond {cond}"
        assert np.abs(po[b].T.astype(np.float64) @ po[b] - np.eye(rank)).max() < 1e-5

    # Q = M^T P
    q_t = torch.full((count, cols, rank), math.nan, device=device)
    lowrank.back_project(m_t, offs, rows, cols, p_t, q_t)
    q = host(q_t)
    for b, M in enumerate(mats):
        ref = M.T.astype(np.float64) @ po[b].astype(np.float64)
        tol = 1e-5 * np.linalg.norm(M, axis=0)[:, None] * np.linalg.norm(po[b], axis=0)[None, :] + 1e-30
        assert np.all(np.abs(q[b] - ref) <= tol), f"Q[{b}]"

    # out = P Q^T, e = M - P Q^T: bitwise
    out_t = torch.zeros(buf.size, device=device)
    res_t = dev(buf, device)
    st = torch.zeros(1, dtype=torch.int32, device=device)
    lowrank.reconstruct(out_t, offs, rows, cols, p_t, q_t, residual=res_t, status=st)
    out, res = host(out_t), host(res_t)
    covered = np.zeros(buf.size, bool)
    for b, (o, M) in enumerate(zip(offs, mats)):
        T = ref_T(po[b], q[b])
        got = out[o:o + rows * cols].reshape(rows, cols)
        assert np.array_equal(got.view(np.uint32), T.view(np.uint32)), f"out[{b}] != the fixed expression"
        e_got = res[o:o + rows * cols].reshape(rows, cols)
        assert np.array_equal(e_got.view(np.uint32), (M - T).astype(F32).view(np.uint32)), f"residual[{b}]"
        covered[o:o + rows * cols] = True
        # the whole step in float64: M_hat = P P^T M with P = QR(M Q0); float32 rounding moves
        # the span of P by ~2^-24 cond(P), so M_hat by that times ||M||_2
        P64 = qr_gs(M.astype(np.float64) @ q0[b].astype(np.float64))
        mhat = P64 @ (M.T.astype(np.float64) @ P64).T
        tol = 1e-5 * np.linalg.cond(p[b].astype(np.float64)) * np.linalg.norm(M.astype(np.float64), 2)
        assert np.abs(got - mhat).max() <= tol, f"M_hat[{b}]"
    assert np.all(out[~covered] == 0) and np.all(res[~covered] == 1234.5), "gap elements written"
    assert int(host(st)[0]) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("scale", [1.0, 300.0, 1e19])
def test_reconstruct_rounds_into_out_dtype(device, dtype, scale):
    """out = T rounded to nearest even (torch for float16, ml_dtypes for bfloat16); scale 300 puts
    some T above 65504 (float16 inf, status bit set), 1e19 * 1e19 overflows float32."""
    rng = np.random.default_rng([len(dtype), int(math.log10(scale)), 2])
    count, rows, cols, rank = 3, 17, 40, 3
    buf, offs, mats = make_batch(rng, count, rows, cols)
    p = (rng.standard_normal((count, rows, rank)) * scale).astype(F32)
    q = (rng.standard_normal((count, cols, rank)) * scale).astype(F32)
    out_t = torch.zeros(buf.size, dtype=TORCH[dtype], device=device)
    st = torch.full((1,), 4, dtype=torch.int32, device=device)
    lowrank.reconstruct(out_t, offs, rows, cols, dev(p, device), dev(q, device), status=st)
    nonfinite = False
    for b, o in enumerate(offs):
        want = round_to(ref_T(p[b], q[b]), dtype)
        got = host(out_t[o:o + rows * cols].float()).reshape(rows, cols)
        wantf = want.astype(F32)
        nan = np.isnan(wantf)
        assert np.array_equal(np.isnan(got), nan)
        if dtype == "float32":
            assert np.array_equal(got[~nan].view(np.uint32), wantf[~nan].view(np.uint32))
        else:
            gb = host(out_t[o:o + rows * cols].view(torch.int16)).view(np.uint16).reshape(rows, cols)
            assert np.array_equal(gb[~nan], want.view(np.uint16)[~nan])
        nonfinite |= not np.isfinite(wantf).all()
    assert int(host(st)[0]) == (5 if nonfinite else 4)
    if scale == 300.0:
        assert nonfinite == (dtype == "float16")
    if scale == 1e19:
        assert nonfinite


@pytest.mark.parametrize("device", DEVICES)
def test_zero_matrices_give_zeros_and_redraw_fills(device):
    count, rows, cols, rank = 2, 10, 6, 3
    m = torch.zeros(count * rows * cols, device=device)
    offs = [rows * cols, 0]
    q = dev(ref_normal(count * cols * rank, 1, 2).reshape(count, cols, rank), device)
    p = torch.full((count, rows, rank), 5.0, device=device)
    lowrank.project(m, offs, rows, cols, q, p)
    assert np.array_equal(host(p), np.zeros((count, rows, rank), F32))
    for eps in (0.0, 1e-8):
        pz = p.clone()
        lowrank.orthogonalize(pz, epsilon=eps)
        assert np.array_equal(host(pz).view(np.uint32), np.zeros((count, rows, rank), np.uint32)), "zero stays +0.0"
    lowrank.back_project(m, offs, rows, cols, p, q)
    assert not host(q).any()
    out = torch.full((count * rows * cols,), 9.0, device=device)
    res = torch.zeros_like(out)
    st = torch.zeros(1, dtype=torch.int32, device=device)
    lowrank.reconstruct(out, offs, rows, cols, p, q, residual=res, status=st)
    assert not host(out).any() and not host(res).any() and int(host(st)[0]) == 0
    # redraw: the zero columns become the random_normal values at their flat indices, orthonormalized
    lowrank.orthogonalize(p, redraw=(77, 5))
    got = host(p)
    draws = ref_normal(count * rows * rank, 77, 5).reshape(count, rows, rank).astype(np.float64)
    for b in range(count):
        ref = qr_gs(draws[b])
        assert np.abs(got[b] - ref).max() <= 2e-6 * np.linalg.cond(draws[b]) + 1e-6
        assert np.abs(got[b].T.astype(np.float64) @ got[b] - np.eye(rank)).max() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_nan_input_makes_that_matrix_non_finite(device):
    rng = np.random.default_rng(3)
    count, rows, cols, rank = 3, 8, 9, 2
    buf, offs, mats = make_batch(rng, count, rows, cols)
    buf[offs[1] + 4 * cols + 2] = np.nan
    m = dev(buf, device)
    q = dev(rng.standard_normal((count, cols, rank)).astype(F32), device)
    p = torch.empty(count, rows, rank, device=device)
    lowrank.project(m, offs, rows, cols, q, p)
    hp = host(p)
    assert np.isnan(hp[1, 4]).all() and np.isfinite(np.delete(hp[1], 4, axis=0)).all()
    assert np.isfinite(hp[0]).all() and np.isfinite(hp[2]).all()
    lowrank.orthogonalize(p)
    hp = host(p)
    assert np.isnan(hp[1]).all(), "a NaN reaching column 0 makes every column NaN"
    assert np.isfinite(hp[0]).all() and np.isfinite(hp[2]).all()
    lowrank.back_project(m, offs, rows, cols, p, q)
    out = torch.zeros(buf.size, device=device)
    st = torch.zeros(1, dtype=torch.int32, device=device)
    lowrank.reconstruct(out, offs, rows, cols, p, q, status=st)
    ho = host(out)
    assert int(host(st)[0]) == 1
    assert np.isnan(ho[offs[1]:offs[1] + rows * cols]).all()
    assert np.isfinite(ho[offs[0]:offs[0] + rows * cols]).all() and np.isfinite(ho[offs[2]:offs[2] + rows * cols]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,stream", [(0, 0), (42, 7), (2**64 - 1, 2**40)])
def test_random_normal_is_philox_box_muller(device, seed, stream):
    n = 4099
    x = torch.full((n,), -99.0, device=device)
    assert lowrank.random_normal(x, seed, stream) is x
    got, want = host(x), ref_normal(n, seed, stream)
    if device == "cpu":
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    else:  # CUDA's log / cos: the binary64 value may differ in its last bit; after rounding, 1 ulp at most
        ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
        assert ulps.max() <= 1 and np.count_nonzero(ulps) <= 2
    assert abs(float(want.mean())) < 5 / math.sqrt(n) and abs(float(want.var()) - 1) < 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_random_normal_shapes_and_streams(device):
    a = torch.empty(3, 5, device=device)
    b = torch.empty(15, device=device)
    lowrank.random_normal(a, 9, 1)
    lowrank.random_normal(b, 9, 2)
    assert not torch.equal(a.flatten(), b), "another stream draws other values"
    lowrank.random_normal(b, 9, 1)
    assert torch.equal(a.flatten(), b), "taken as flat"


@pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA build and a GPU")
def test_cuda_runs_on_the_current_stream_and_matches_cpu():
    rng = np.random.default_rng(11)
    count, rows, cols, rank = 4, 300, 200, 4
    buf, offs, mats = make_batch(rng, count, rows, cols)
    q0 = rng.standard_normal((count, cols, rank)).astype(F32)
    res = {}
    for device in ("cpu", "cuda"):
        s = torch.cuda.Stream() if device == "cuda" else None
        ctx = torch.cuda.stream(s) if s is not None else contextlib.nullcontext()
        with ctx:
            m, q = dev(buf, device), dev(q0, device)
            p = torch.empty(count, rows, rank, device=device)
            lowrank.project(m, offs, rows, cols, q, p)
            lowrank.orthogonalize(p)
            lowrank.back_project(m, offs, rows, cols, p, q)
            out = torch.zeros(buf.size, dtype=torch.bfloat16, device=device)
            lowrank.reconstruct(out, offs, rows, cols, p, q, residual=m)
        if s is not None:
            s.synchronize()
        res[device] = (p.cpu().numpy(), q.cpu().numpy())
        # reconstruct is bitwise the fixed expression of the P and Q each backend holds
        for b, o in enumerate(offs):
            T = ref_T(res[device][0][b], res[device][1][b])
            want = T.astype(ml_dtypes.bfloat16).view(np.uint16)
            got = out[o:o + rows * cols].view(torch.int16).cpu().numpy().view(np.uint16).reshape(rows, cols)
            assert np.array_equal(got, want), device
    assert np.abs(res["cpu"][0] - res["cuda"][0]).max() < 1e-4
    assert np.abs(res["cpu"][1] - res["cuda"][1]).max() < 1e-4 * np.abs(res["cpu"][1]).max()


# ---- the CPU BLAS (GRADCOMP_BLAS: OpenBLAS at ranks 1 and > 16, or gradcomp's loops at every rank) --
def _module_openblas():
    """The OpenBLAS gradcomp._C links (dlsym through _C's handle searches _C and its dependencies,
    not numpy's own suffixed copy), or None in a GRADCOMP_BLAS=OFF build."""
    import ctypes

    lib = ctypes.CDLL(gradcomp._C.__file__)
    return lib if hasattr(lib, "openblas_get_num_threads") else None


def test_build_info_blas_matches_the_build():
    info = gradcomp.build_info()
    assert info["blas"] in ("openblas", "none")
    assert (info["blas"] == "openblas") == (_module_openblas() is not None)
    configured = os.environ.get("GRADCOMP_BLAS", "AUTO").upper()  # pip install . reads it too
    if configured in ("ON", "OFF"):
        assert info["blas"] == ("openblas" if configured == "ON" else "none")


@pytest.mark.skipif(gradcomp.build_info()["blas"] != "openblas", reason="a build without OpenBLAS")
def test_openblas_thread_count_is_left_alone():
    """issue 20: the process's OpenBLAS may be shared; ranks 1 (sgemv) and 32 (sgemm) leave its
    thread count as it was (on 1 and 2 gradcomp threads: a team at 300 x 517)."""
    lib = _module_openblas()
    old_blas, old_threads = lib.openblas_get_num_threads(), gradcomp.get_num_threads()
    rng = np.random.default_rng(20)
    rows, cols = 300, 517
    m = torch.from_numpy(rng.standard_normal(rows * cols).astype(F32))
    try:
        lib.openblas_set_num_threads(2)
        before = lib.openblas_get_num_threads()
        for threads in (1, 2):
            gradcomp.set_num_threads(threads)
            for rank in (1, 32):
                q = torch.from_numpy(rng.standard_normal((1, cols, rank)).astype(F32))
                p = torch.empty(1, rows, rank)
                lowrank.project(m, [0], rows, cols, q, p)
                lowrank.back_project(m, [0], rows, cols, p, q)
                assert lib.openblas_get_num_threads() == before, (rank, threads)
    finally:
        lib.openblas_set_num_threads(old_blas)
        gradcomp.set_num_threads(old_threads)


# ---- arguments ------------------------------------------------------------------------------------
def test_rank_above_min_rows_cols_is_rejected():
    m = torch.zeros(4 * 6)
    with pytest.raises(gradcomp.InvalidArgumentError, match=r"rank 5 is outside \[1, min\(rows, cols\)\] = \[1, 4\]"):
        lowrank.project(m, [0], 4, 6, torch.zeros(1, 6, 5), torch.zeros(1, 4, 5))
    with pytest.raises(gradcomp.InvalidArgumentError, match=r"rank 5 is outside"):
        lowrank.back_project(m, [0], 4, 6, torch.zeros(1, 4, 5), torch.zeros(1, 6, 5))
    with pytest.raises(gradcomp.InvalidArgumentError, match=r"rank 5 is outside"):
        lowrank.reconstruct(m, [0], 4, 6, torch.zeros(1, 4, 5), torch.zeros(1, 6, 5))
    with pytest.raises(gradcomp.InvalidArgumentError, match=r"rank 0 is outside"):
        lowrank.project(m, [0], 4, 6, torch.zeros(1, 6, 0), torch.zeros(1, 4, 0))
    with pytest.raises(gradcomp.InvalidArgumentError, match=r"rank 3 is outside \[1, rows\] = \[1, 2\]"):
        lowrank.orthogonalize(torch.zeros(1, 2, 3))
    lowrank.project(m, [0], 4, 6, torch.zeros(1, 6, 4), torch.zeros(1, 4, 4))  # rank = min(rows, cols) is fine


def test_bad_arguments_name_the_value():
    m = torch.zeros(100)
    q, p = torch.zeros(2, 6, 2), torch.zeros(2, 4, 2)
    E = gradcomp.InvalidArgumentError
    with pytest.raises(E, match=r"p has shape \(2, 4, 2\) and q \(2, 6, 2\).*count = len\(offsets\) = 1"):
        lowrank.project(m, [0], 4, 6, q, p)
    with pytest.raises(E, match="reaches past the end of m.base"):
        lowrank.project(m, [0, 80], 4, 6, q, p)
    with pytest.raises(E, match="overlap"):
        lowrank.project(m, [0, 10], 4, 6, q, p)
    with pytest.raises(E, match="offset -3"):
        lowrank.project(m, [-3, 50], 4, 6, q, p)
    with pytest.raises(E, match="m has dtype float64; accepted: float32"):
        lowrank.project(m.double(), [0, 50], 4, 6, q, p)
    with pytest.raises(E, match="q has dtype float16"):
        lowrank.project(m, [0, 50], 4, 6, q.half(), p)
    with pytest.raises(E, match=r"q has shape \(12, 2\) \(2 dimensions\)"):
        lowrank.project(m, [0, 50], 4, 6, q.reshape(12, 2), p)
    with pytest.raises(E, match=r"not contiguous; pass p.contiguous\(\)"):
        lowrank.project(m, [0, 50], 4, 6, q, torch.zeros(2, 2, 4).transpose(1, 2))
    with pytest.raises(TypeError, match=r"offsets\[1\]=50.0 is not an integer"):
        lowrank.project(m, [0, 50.0], 4, 6, q, p)
    with pytest.raises(TypeError, match="offsets must be a sequence"):
        lowrank.project(m, 0, 4, 6, q, p)
    with pytest.raises(TypeError, match="m must be a torch.Tensor"):
        lowrank.project(m.numpy(), [0, 50], 4, 6, q, p)
    # offsets as numpy / torch integer arrays are fine
    lowrank.project(m, np.array([50, 0]), 4, 6, q, p)
    lowrank.project(m, torch.tensor([50, 0]), 4, 6, q, p)
    # reconstruct
    with pytest.raises(E, match="out has dtype int32"):
        lowrank.reconstruct(torch.zeros(100, dtype=torch.int32), [0, 50], 4, 6, p, q)
    with pytest.raises(E, match="reaches past the end of residual"):
        lowrank.reconstruct(torch.zeros(100), [0, 50], 4, 6, p, q, residual=torch.zeros(60))
    with pytest.raises(E, match="residual has dtype float16"):
        lowrank.reconstruct(torch.zeros(100), [0, 50], 4, 6, p, q, residual=torch.zeros(100, dtype=torch.float16))
    with pytest.raises(E, match="status has dtype int64; accepted: int32"):
        lowrank.reconstruct(torch.zeros(100), [0, 50], 4, 6, p, q, status=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(E, match="residual .* and out .* overlap"):
        o = torch.zeros(100)
        lowrank.reconstruct(o, [0, 50], 4, 6, p, q, residual=o)
    # orthogonalize / random_normal
    with pytest.raises(E, match="epsilon -1 is not accepted"):
        lowrank.orthogonalize(torch.zeros(2, 4, 2), epsilon=-1.0)
    with pytest.raises(TypeError, match="redraw=5"):
        lowrank.orthogonalize(torch.zeros(2, 4, 2), redraw=5)
    with pytest.raises(E, match="redraw seed=-1 is out of range"):
        lowrank.orthogonalize(torch.zeros(2, 4, 2), redraw=(-1, 0))
    with pytest.raises(E, match=r"seed=18446744073709551616 is out of range; accepted: 0 <= seed < 2\^64"):
        lowrank.random_normal(torch.zeros(3), 2**64, 0)
    with pytest.raises(E, match="x has dtype float64"):
        lowrank.random_normal(torch.zeros(3, dtype=torch.float64), 1, 0)
    with pytest.raises(E, match="requires grad"):
        lowrank.random_normal(torch.zeros(3, requires_grad=True), 1, 0)


@pytest.mark.skipif(gradcomp.build_info()["cuda"] or not torch.cuda.is_available(),
                    reason="needs torch CUDA tensors with a CPU-only gradcomp build")
def test_cuda_tensors_in_a_cpu_build_are_unsupported():
    with pytest.raises(gradcomp.UnsupportedError, match="no CUDA support"):
        lowrank.random_normal(torch.zeros(3, device="cuda"), 1, 0)
