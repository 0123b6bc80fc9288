"""The steps of PowerSGD low-rank compression over torch tensors, batched over matrices of one shape.

Source: Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019, algorithm 1 (one step of subspace iteration with a
warm-started Q). The C++ contract is ``include/gradcomp/lowrank.hpp``; these functions are thin
wrappers that check shapes, pass the caller's current CUDA stream and return the tensor they
write. Low rank is not a :class:`gradcomp.Codec`: it is a two-round protocol, so the caller (e.g.
``gradcomp.torch``'s PowerSGD hook) runs the collectives between the steps::

    M = g + e                                   # the caller: e the float32 residual, in M's buffer
    project(M, offsets, n, m, Q, P)             # P = M Q
    allreduce(P)                                # the caller (sum)
    orthogonalize(P, epsilon)                   # P = orthonormal columns of P
    back_project(M, offsets, n, m, P, Q)        # Q = M^T P
    allreduce(Q); Q /= world_size               # the caller
    reconstruct(out, offsets, n, m, P, Q, residual=M)   # out = P Q^T and e = M - P Q^T, one pass

Matrices. ``m`` (and ``out``, ``residual``) is one flat buffer (any C-contiguous torch tensor, taken
as flat): matrix ``b`` is the row-major ``[rows, cols]`` block starting at element ``offsets[b]``
(a sequence of ints, any order, gaps allowed, no overlaps; ``offsets[b] + rows * cols`` at most
the buffer's numel). ``P`` is a contiguous float32 tensor ``[count, rows, rank]`` and ``Q`` one
``[count, cols, rank]`` (``count = len(offsets)``; rank fastest, PyTorch's ``[b, n, r]`` views),
``1 <= rank <= min(rows, cols)``. All sizes are elements. Every tensor of a call is on one device:
the CPU (gradcomp's loops on :func:`gradcomp.set_num_threads` threads; OpenBLAS, on its own
threads, at ranks 1 and > 16 where ``build_info()["blas"]`` is ``"openblas"``) or one CUDA device
(cuBLAS and gradcomp kernels on ``torch.cuda.current_stream(device)``, never synchronizing).

Floating point. ``project`` / ``back_project`` are float32 GEMMs (their order of sums is the
BLAS's: compare them with a tolerance). ``reconstruct`` is a fixed expression, bitwise the same on
every rank, CPU and CUDA: ``T[i][j] = fl(...fl(fl(P[i][0] Q[j][0]) + fl(P[i][1] Q[j][1])) + ...)``
in binary32 without FMA, ``out = T`` rounded to out's dtype (round to nearest even),
``e = fl(e - T)``. ``orthogonalize`` is Gram-Schmidt with float64 sums (same bits on every rank
of one backend). ``random_normal`` is Philox4x64-10 + Box-Muller (formula in its docstring).

Errors. :class:`gradcomp.InvalidArgumentError` (a ValueError) for a wrong dtype (float32 required
except ``out``: float32 / float16 / bfloat16), shape, rank outside ``[1, min(rows, cols)]``, a
matrix reaching past its buffer, overlapping buffers, tensors on different devices, non-contiguous
tensors; ``TypeError`` for an argument of the wrong type (e.g. a float offset);
:class:`gradcomp.UnsupportedError` for CUDA tensors in a CPU-only build;
:class:`gradcomp.CudaError` for a failed CUDA / cuBLAS call.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any, Optional, Sequence

from . import _C
from .codec import _dtype_name as dtype_name
from .codec import _stream_of, check_tensor

__all__ = ["project", "back_project", "orthogonalize", "reconstruct", "random_normal"]

_U64 = 1 << 64


def _is_tensor(t: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - gradcomp.lowrank needs torch tensors
        return False
    return isinstance(t, torch.Tensor)


_F32 = ("float32",)
_OUT = ("float32", "float16", "bfloat16")


def _tensor(t: Any, what: str, fn: str, ndim: Optional[int] = None, dtypes: Optional[tuple] = _F32) -> Any:
    """A C-contiguous torch tensor (of `ndim` dimensions, of one of `dtypes`, when given), else an
    error naming it."""
    if not _is_tensor(t):
        raise TypeError(f"gradcomp.lowrank.{fn}: {what} must be a torch.Tensor, got {type(t).__name__}")
    check_tensor(t, f"{fn}: {what}")
    name = dtype_name(t.dtype)
    if dtypes is not None and name not in dtypes:
        raise _C.InvalidArgumentError(
            f"gradcomp.lowrank.{fn}: {what} has dtype {name}; accepted: {', '.join(dtypes)}"
        )
    if ndim is not None and t.dim() != ndim:
        raise _C.InvalidArgumentError(
            f"gradcomp.lowrank.{fn}: {what} has shape {tuple(t.shape)} ({t.dim()} dimensions); accepted: "
            f"{ndim} dimensions" + (" [count, n, rank]" if ndim == 3 else "")
        )
    if not t.is_contiguous():
        raise _C.InvalidArgumentError(
            f"gradcomp.lowrank.{fn}: {what} of shape {tuple(t.shape)} has strides {t.stride()} and is not "
            f"contiguous; pass {what}.contiguous()"
        )
    return t


def _int(v: Any, what: str, fn: str) -> int:
    """An integer (int, numpy integer, ...: anything with __index__ but bool), else TypeError."""
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise TypeError(f"gradcomp.lowrank.{fn}: {what}={v!r} is not an integer") from None


def _u64(v: Any, what: str, fn: str) -> int:
    i = _int(v, what, fn)
    if not 0 <= i < _U64:
        raise _C.InvalidArgumentError(
            f"gradcomp.lowrank.{fn}: {what}={i} is out of range; accepted: 0 <= {what} < 2^64"
        )
    return i


def _offsets(offsets: Any, fn: str) -> list:
    if _is_tensor(offsets) or hasattr(offsets, "tolist"):
        if getattr(offsets, "ndim", 1) != 1:
            raise _C.InvalidArgumentError(
                f"gradcomp.lowrank.{fn}: offsets has shape {tuple(offsets.shape)}; accepted: a 1-D sequence of ints"
            )
        offsets = offsets.tolist()
    if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Sequence):
        raise TypeError(
            f"gradcomp.lowrank.{fn}: offsets must be a sequence of ints (one element offset per matrix), "
            f"got {type(offsets).__name__}"
        )
    return [_int(o, f"offsets[{i}]", fn) for i, o in enumerate(offsets)]


def _factors(fn: str, count: int, rows: int, cols: int, p: Any, q: Any) -> int:
    """Check p [count, rows, rank] and q [count, cols, rank]; returns rank."""
    rank = q.shape[-1]
    if tuple(q.shape) != (count, cols, rank) or tuple(p.shape) != (count, rows, rank):
        raise _C.InvalidArgumentError(
            f"gradcomp.lowrank.{fn}: p has shape {tuple(p.shape)} and q {tuple(q.shape)}; accepted: p "
            f"[count, rows, rank] = [{count}, {rows}, r] and q [count, cols, rank] = [{count}, {cols}, r] with the "
            f"same r (count = len(offsets) = {count})"
        )
    return int(rank)


def _batch(fn: str, buf: Any, what: str, offsets: Any, rows: Any, cols: Any, p: Any, q: Any):
    buf = _tensor(buf, what, fn, dtypes=_OUT if what == "out" else _F32)
    p = _tensor(p, "p", fn, 3)
    q = _tensor(q, "q", fn, 3)
    offs = _offsets(offsets, fn)
    rows = _int(rows, "rows", fn)
    cols = _int(cols, "cols", fn)
    rank = _factors(fn, len(offs), rows, cols, p, q)
    return buf, offs, rows, cols, p, q, rank


def project(m: Any, offsets: Sequence[int], rows: int, cols: int, q: Any, p: Any) -> Any:
    """P[b] = M_b Q[b] for every matrix b (algorithm 1: P <- M Q).

    Args:
        m: float32 tensor, any C-contiguous shape taken as flat; matrix b is the row-major
            ``[rows, cols]`` block at element ``offsets[b]``. Read only.
        offsets: ``count`` element offsets (ints; any order, gaps allowed, no overlaps), each with
            ``offset + rows * cols <= m.numel()``.
        rows, cols: the matrices' shape (elements).
        q: float32 ``[count, cols, rank]``, contiguous (``rank = q.shape[-1]``, in
            ``[1, min(rows, cols)]``). Read only.
        p: float32 ``[count, rows, rank]``, contiguous, on m's device; overwritten.

    Returns:
        ``p``.

    A float32 GEMM (gradcomp's loops or OpenBLAS on the CPU, cuBLAS on CUDA on the current
    stream): the order of its sums is the library's, so compare it with a tolerance (about 1e-6 of
    ``|M_b row| * |Q column|``).

    Raises:
        gradcomp.InvalidArgumentError: dtypes, shapes, rank, offsets, devices or overlaps not as
            above. TypeError: a non-tensor or a non-integer size/offset.
        gradcomp.UnsupportedError: CUDA tensors in a CPU-only build, or (CPU) rows or cols above
            2^31 - 1.
    """
    m, offs, rows, cols, p, q, rank = _batch("project", m, "m", offsets, rows, cols, p, q)
    _C.lowrank_project(m, offs, rows, cols, q, p, rank, _stream_of(m))
    return p


def back_project(m: Any, offsets: Sequence[int], rows: int, cols: int, p: Any, q: Any) -> Any:
    """Q[b] = M_b^T P[b] for every matrix b (algorithm 1: Q <- M^T P, after P is orthogonalized).

    Args:
        m, offsets, rows, cols: the matrices, as in :func:`project`. Read only.
        p: float32 ``[count, rows, rank]``, contiguous. Read only.
        q: float32 ``[count, cols, rank]``, contiguous, on m's device; overwritten.

    Returns:
        ``q``.

    A float32 GEMM, like :func:`project`. Raises as :func:`project`.
    """
    m, offs, rows, cols, p, q, rank = _batch("back_project", m, "m", offsets, rows, cols, p, q)
    _C.lowrank_back_project(m, offs, rows, cols, p, q, rank, _stream_of(m))
    return q


def orthogonalize(x: Any, epsilon: float = 0.0, redraw: Optional[tuple] = None) -> Any:
    """Orthonormalize the columns of each ``[rows, rank]`` matrix ``x[b]`` in place (algorithm 1:
    P <- ORTHOGONALIZE(P)).

    Gram-Schmidt: column k minus its projections on columns 0..k-1, subtracted twice ("twice is
    enough"; sums and the working column in float64), then divided by ``norm + epsilon`` (PyTorch's
    ``_orthogonalize_gram_schmidt`` rule) and rounded once to float32. A column whose norm after
    projection is exactly zero stays zero whatever epsilon (PyTorch gives NaN at epsilon 0) unless
    ``redraw`` is given. A NaN or inf in a matrix makes that column and the following ones NaN
    (never hidden as zero); the other matrices are unaffected. The same input gives the same bits
    on every rank of one backend (CPU or CUDA), whatever the thread count.

    Args:
        x: float32 ``[count, rows, rank]``, contiguous, ``1 <= rank <= rows``; overwritten.
        epsilon: finite float >= 0 (rounded to float32).
        redraw: ``None``, or ``(seed, stream)`` (ints in [0, 2^64)): a column that is exactly zero
            after projection is refilled with :func:`random_normal` values of (seed, stream) at its
            flat indices of ``x`` (``b * rows * rank + i * rank + k``), then projected and
            normalized like any other column (so a layer whose gradient was once zero does not
            keep a zero Q).

    Returns:
        ``x``.

    Raises:
        gradcomp.InvalidArgumentError: x not float32 / 3-D / contiguous, rank > rows, epsilon
            negative or not finite. TypeError: redraw not None or a pair of ints.
    """
    fn = "orthogonalize"
    x = _tensor(x, "x", fn, 3)
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise TypeError(f"gradcomp.lowrank.{fn}: epsilon={epsilon!r} is not a number")
    seed = None
    stream_id = 0
    if redraw is not None:
        if not isinstance(redraw, (tuple, list)) or len(redraw) != 2:
            raise TypeError(
                f"gradcomp.lowrank.{fn}: redraw={redraw!r}; accepted: None or a pair (seed, stream) of ints"
            )
        seed = _u64(redraw[0], "redraw seed", fn)
        stream_id = _u64(redraw[1], "redraw stream", fn)
    count, rows, rank = (int(s) for s in x.shape)
    _C.lowrank_orthogonalize(x, count, rows, rank, float(epsilon), seed, stream_id, _stream_of(x))
    return x


def reconstruct(out: Any, offsets: Sequence[int], rows: int, cols: int, p: Any, q: Any,
                residual: Any = None, status: Any = None) -> Any:
    """out_b = P[b] Q[b]^T at ``offsets[b]`` of ``out``, and with a residual e = M - P Q^T in the
    same pass (algorithm 1: the decompressed gradient and the error-feedback memory).

    Exactly, per element (binary32, round to nearest, no FMA; the same bits on CPU and CUDA)::

        T[i][j] = fl(...fl(fl(P[i][0] * Q[j][0]) + fl(P[i][1] * Q[j][1])) + ... + fl(P[i][r-1] * Q[j][r-1]))
        out[i][j] = T[i][j] rounded to out's dtype (round to nearest even; NaN stays NaN)
        residual[i][j] = fl(residual[i][j] - T[i][j])        # when residual is given

    Args:
        out: float32, float16 or bfloat16 tensor, C-contiguous, taken as flat; the elements of the
            matrices are overwritten, the others are not touched.
        offsets, rows, cols: the matrices (as in :func:`project`), inside ``out``.
        p: float32 ``[count, rows, rank]``; q: float32 ``[count, cols, rank]``. Read only.
        residual: ``None`` or a float32 flat tensor holding M = g + e at the same offsets (each
            ``offset + rows * cols <= residual.numel()``); updated in place. Must not overlap out.
        status: ``None`` or a 1-element int32 tensor on out's device: bit 0 (value 1) is ORed in
            when a value written to ``out`` is non-finite (after rounding to its dtype), so the
            caller learns of a non-finite step without reading ``out``. Never cleared here.

    Returns:
        ``out``.

    Raises:
        gradcomp.InvalidArgumentError: dtypes, shapes, rank, offsets (against out and residual),
            devices, overlaps. TypeError: wrong argument types.
    """
    fn = "reconstruct"
    out, offs, rows, cols, p, q, rank = _batch(fn, out, "out", offsets, rows, cols, p, q)
    if residual is not None:
        residual = _tensor(residual, "residual", fn)
    if status is not None:
        status = _tensor(status, "status", fn, dtypes=("int32",))
    _C.lowrank_reconstruct(out, offs, rows, cols, p, q, rank, residual, status, _stream_of(out))
    return out


def random_normal(x: Any, seed: int, stream: int) -> Any:
    """Fill ``x`` (float32, any C-contiguous shape, taken as flat) with standard normal values,
    identical on every rank with the same (seed, stream), without communicating (a warm-start Q).

    Element e (the flat index)::

        (x0, x1, x2, x3) = Philox4x64-10(counter = (e, stream, 0, 0), key = (seed, 0x9E3779B97F4A7C15))
        u1 = ((x0 >> 11) + 1) * 2^-53;  u2 = (x1 >> 11) * 2^-53
        x[e] = float32(sqrt(-2 log u1) * cos(2 pi u2))      # binary64, rounded once

    (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011; Box & Muller 1958;
    ``numpy.random.Philox`` is the same generator.) It never touches torch's global RNG.

    Args:
        x: float32 tensor; overwritten.
        seed, stream: ints in [0, 2^64).

    Returns:
        ``x``.

    Raises:
        gradcomp.InvalidArgumentError: x not float32 / contiguous, seed or stream out of range.
        TypeError: seed or stream not an int.
    """
    fn = "random_normal"
    x = _tensor(x, "x", fn)
    s = _u64(seed, "seed", fn)
    sid = _u64(stream, "stream", fn)
    _C.lowrank_random_normal(x, s, sid, _stream_of(x))
    return x
