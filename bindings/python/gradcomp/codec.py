"""The Python face of a codec: allocation with the caller's framework, workspace caching, streams.

Tensors are taken zero-copy through DLPack (torch, numpy, or any object with ``__dlpack__``); a
C-contiguous tensor of any shape is taken as flat, a non-contiguous one raises
``InvalidArgumentError`` naming its strides. Outputs and workspaces are allocated with the framework
of the input (torch tensors on the input's device, numpy arrays on the CPU).
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from typing import Any, Optional

import numpy as np

from . import _C

log = logging.getLogger("gradcomp")

_GRADIENT_DTYPES = ("float32", "float16", "bfloat16")


def _torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional for the codec API
        return None
    return torch


def _is_torch(t: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(t, torch.Tensor)


def _dtype_name(dtype: Any) -> str:
    """Name of a torch dtype, numpy dtype (ml_dtypes bfloat16 included) or string."""
    if isinstance(dtype, str):
        name = dtype
    elif _torch() is not None and isinstance(dtype, _torch().dtype):
        name = str(dtype).replace("torch.", "")
    else:
        name = np.dtype(dtype).name
    return name


def check_tensor(t: Any, what: str) -> None:
    """Reject what DLPack would export wrongly or not at all, with gradcomp's error type:
    torch tensors with the negative or conjugate bit set (the bit does not travel through DLPack),
    that require grad, or that live on a device other than CPU/CUDA."""
    if _is_torch(t):
        if t.device.type not in ("cpu", "cuda"):
            raise _C.InvalidArgumentError(f"{what}: tensor on device {t.device}; accepted: cpu, cuda")
        if t.requires_grad:
            raise _C.InvalidArgumentError(f"{what}: tensor requires grad; pass {what}.detach()")
        if t.is_neg() or t.is_conj():
            raise _C.InvalidArgumentError(
                f"{what}: tensor has its negative/conjugate bit set, which DLPack cannot carry; "
                f"pass {what}.resolve_neg() / .resolve_conj()"
            )
    elif not isinstance(t, np.ndarray) and not hasattr(t, "__dlpack__"):
        raise _C.InvalidArgumentError(
            f"{what}: expected a torch.Tensor, numpy.ndarray or DLPack tensor, got {type(t).__name__}"
        )


def _number(v: Any, what: str) -> float:
    """A finite float32 scale factor; raises InvalidArgumentError naming v otherwise."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        raise _C.InvalidArgumentError(f"{what}={v!r} is not a number")
    f = float(v)
    with np.errstate(over="ignore"):
        f32 = float(np.float32(f)) if math.isfinite(f) else f
    if not math.isfinite(f32) or (f != 0 and abs(f32) < float(np.finfo(np.float32).tiny)):
        raise _C.InvalidArgumentError(
            f"{what}={v!r} is not a finite normal float32 value (accepted: {np.finfo(np.float32).tiny:g} "
            f"<= |{what}| <= {np.finfo(np.float32).max:g})"
        )
    return f32


def _count(v: Any, what: str) -> int:
    """An element count: a non-negative integer below 2^56."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise _C.InvalidArgumentError(f"{what}={v!r} is not an integer")
    if not 0 <= int(v) < (1 << 56):
        raise _C.InvalidArgumentError(f"{what}={v} is out of range; accepted: 0 <= {what} < 2^56")
    return int(v)


def _numel_dtype(x: Any, what: str = "x") -> tuple[int, str]:
    if _is_torch(x):
        check_tensor(x, what)
        return x.numel(), _dtype_name(x.dtype)
    if isinstance(x, np.ndarray):
        return x.size, x.dtype.name
    if what != "x" and hasattr(x, "__dlpack__"):
        return -1, ""  # another DLPack tensor: the core checks it
    raise _C.InvalidArgumentError(
        f"expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}"
    )


def _numpy_view(x: Any) -> tuple[Any, str]:
    """numpy arrays of ml_dtypes.bfloat16 cannot go through DLPack: pass a uint16 view + override."""
    if isinstance(x, np.ndarray) and x.dtype.name == "bfloat16":
        return x.view(np.uint16), "bfloat16"
    return x, ""


def _stream_of(t: Any) -> int:
    """The caller's current CUDA stream for a CUDA torch tensor (as an int), else 0."""
    if _is_torch(t) and t.is_cuda:
        torch = _torch()
        return int(torch.cuda.current_stream(t.device).cuda_stream)
    return 0


def aligned_empty(like: Any, nbytes: int):
    """An uninitialized 1-D uint8 buffer of ``nbytes`` bytes whose first byte is 16-byte aligned
    (packets and workspaces must be), allocated with the framework of ``like`` on its device: a
    torch tensor on ``like.device`` when ``like`` is a torch tensor, else a numpy array (CPU).

    Shape ``(nbytes,)``, dtype uint8; a view into an allocation 16 bytes larger. ``like`` only
    names the framework and device (its shape and dtype do not matter); ``nbytes`` >= 0.
    """
    if _is_torch(like):
        torch = _torch()
        buf = torch.empty(nbytes + 16, dtype=torch.uint8, device=like.device)
        off = (-buf.data_ptr()) % 16
        return buf[off : off + nbytes]
    buf = np.empty(nbytes + 16, dtype=np.uint8)
    off = (-buf.ctypes.data) % 16
    return buf[off : off + nbytes]


def _device_key(t: Any) -> str:
    return str(t.device) if _is_torch(t) else "cpu"


def codecs() -> list:
    """Every registered codec, in registry order (the C++ table kernels/core/registry.cpp).

    Returns a list of dicts ``{"name": str, "id": int (header bytes 6-7), "keys": [str] (the
    spec keys it accepts), "properties": dict (of its first example; see Codec.properties),
    "examples": [str] (canonical example specs; the contract suite gradcomp.testing runs each),
    "summary": str (what it does and its source)}``.
    """
    return _C.list_codecs()


_KEY_FIELDS = (("seed", 64), ("step", 32), ("bucket", 32), ("chunk", 32))
_KEY_ACCEPTED = "0 <= seed < 2^64, 0 <= step < 2^32, 0 <= bucket < 2^32, 0 <= chunk < 2^32"


def _key(key: Any) -> tuple[int, int, int, int]:
    """An EncodeContext ``(seed, step, bucket, chunk)``: integers in [0, 2^64), [0, 2^32),
    [0, 2^32), [0, 2^32); a 3-tuple ``(seed, step, bucket)`` is chunk 0; None is (0, 0, 0, 0)."""
    if key is None:
        return 0, 0, 0, 0
    if not isinstance(key, (tuple, list)) or len(key) not in (3, 4):
        raise _C.InvalidArgumentError(
            f"key={key!r}: expected a tuple (seed, step, bucket, chunk) of four integers, or (seed, step, bucket) "
            f"for chunk 0; accepted: {_KEY_ACCEPTED}")
    out = []
    for v, (name, nbits) in zip(key, _KEY_FIELDS):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < (1 << nbits):
            raise _C.InvalidArgumentError(
                f"key={tuple(key)!r}: {name}={v!r} is not an integer in [0, 2^{nbits}); accepted: {_KEY_ACCEPTED}")
        out.append(int(v))
    if len(out) == 3:
        out.append(0)
    return out[0], out[1], out[2], out[3]


class Codec:
    """A gradient codec built from a spec string ``name[:key=value,...]``.

    The codecs are the registry's (``gradcomp.codecs()``; the list at the end of this docstring
    is generated from it at import); the README describes each codec and the packet format.

    Raises:
        InvalidArgumentError: unknown codec name or key, or an out-of-range value; ``powersgd``
            (not a codec: the message names what takes that spec).
    """

    def __init__(self, spec: str):
        if not isinstance(spec, str):
            raise _C.InvalidArgumentError(f"codec spec must be a str such as 'topk:ratio=0.01', got {spec!r}")
        if spec.partition(":")[0].strip() == "powersgd":
            raise _C.InvalidArgumentError(
                f"codec spec {spec!r}: PowerSGD is not a codec (it is a two-round protocol over matrices, with no "
                f"single packet to encode and decode): use gradcomp.torch.Compressor({spec!r}), "
                f"gradcomp.torch.register(ddp_model, codec={spec!r}), or the steps in gradcomp.lowrank")
        self._c = _C.Codec(spec)
        # Workspaces are per thread and device: encode/decode release the GIL, and two threads
        # must never share scratch space. Keyed by thread id, not a threading.local: a decode in a
        # collective's callback runs on the engine's worker thread under a Python thread state that
        # pybind11 makes and clears for each callback, and a threading.local would free (and the
        # next callback reallocate) the workspace each time -- at interpreter exit that free needs
        # the GIL from a thread that may no longer take it, and the process aborts. A dead
        # thread's id may be reused: its workspace then serves the new thread, never two at once.
        self._ws: dict = {}
        self._ws_lock = threading.Lock()

    # -- description ---------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        """Canonical spec string; ``Codec(c.spec)`` is the same codec."""
        return self._c.spec

    @property
    def spec_hash(self) -> int:
        """The 32-bit FNV-1a hash of :attr:`spec` that every packet's header carries (bytes 12-15)."""
        return int(self._c.spec_hash)

    @property
    def properties(self) -> dict:
        """``{"linear": bool, "unbiased": bool, "deterministic": bool, "exact_residual": bool,
        "keyed": bool, "sparse": bool}``: linear (payloads may be summed by an allreduce), unbiased
        (E[decode(encode(x))] == x), deterministic (same input and key, same bytes),
        exact_residual (x + r_old == decode + r_new exactly at divisor 1), keyed (draws random
        numbers; packets carry the encode key), sparse (the packet holds a subset of the elements,
        as top-k's indices and values)."""
        return self._c.properties

    def layout(self, numel: int, dtype: Any = "float32") -> dict:
        """The packet layout for ``numel`` elements of ``dtype``: ``{"bytes": int, "sections":
        [(name, byte offset, count, dtype)], "key_section": int (-1: none), "payload_section":
        int (-1: none), "main_param": int, "main_kind": "exact" | "maximum", "wire_dtype": str,
        "index_dtype": str}``. Sections start 16-byte aligned after the 32-byte header; every
        other byte of a packet is zero."""
        return self._c.layout(_count(numel, "numel"), _dtype_name(dtype))

    def packet_key(self, packet: Any) -> Optional[tuple[int, int, int, int]]:
        """The ``(seed, step, bucket, chunk)`` key a CPU packet of a keyed codec carries (its
        32-byte key section: u64 seed, u32 step, u32 bucket, u32 chunk little-endian, 12 reserved
        zero bytes); None for codecs that draw no random numbers. Reads the header's numel and
        input dtype to find the section.

        Raises:
            InvalidArgumentError: not a CPU packet of at least 32 bytes.
            CorruptPacketError: a bad input dtype code, a packet shorter than its key section, or
                a non-zero reserved byte.
        """
        b = _host_bytes(packet)
        if not self.properties["keyed"]:
            return None
        if b is None or b.size < 32:
            raise _C.InvalidArgumentError("packet_key: expected a CPU packet of at least 32 bytes")
        numel = int.from_bytes(b[16:24].tobytes(), "little")
        names = {0: "float32", 1: "float16", 2: "bfloat16"}
        if int(b[8]) not in names:
            raise _C.CorruptPacketError(f"packet_key: packet input dtype code {int(b[8])} is not float32/float16/bfloat16")
        lay = self.layout(numel, names[int(b[8])])
        _, off, _, _ = lay["sections"][lay["key_section"]]
        nkey = int(_C.KEY_BYTES)
        raw = b[off: off + nkey].tobytes()
        if len(raw) != nkey:
            raise _C.CorruptPacketError(
                f"packet_key: packet of {b.size} bytes is shorter than its key section (bytes {off}-{off + nkey - 1})")
        if any(raw[20:]):
            at = 20 + next(i for i, v in enumerate(raw[20:]) if v)
            raise _C.CorruptPacketError(
                f"packet_key: reserved byte {at} of the key section (packet byte {off + at}) is 0x{raw[at]:02x}; "
                f"accepted: bytes 20-{nkey - 1} of the key section are zero")
        return (int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:12], "little"),
                int.from_bytes(raw[12:16], "little"), int.from_bytes(raw[16:20], "little"))

    def packet_bytes(self, numel: int, dtype: Any = "float32") -> int:
        """Exact packet size in bytes (a multiple of 16) for ``numel`` elements of ``dtype``."""
        return self._c.packet_bytes(_count(numel, "numel"), _dtype_name(dtype))

    def payload(self, numel: int, dtype: Any = "float32") -> Optional[tuple[int, int, str]]:
        """For linear codecs, ``(byte_offset, count, wire_dtype)`` of the summable part of the
        packet (count = numel + 1: the last element is the non-finite sentinel); else None."""
        return self._c.payload(_count(numel, "numel"), _dtype_name(dtype))

    def workspace_bytes(self, numel: int, dtype: Any = "float32", device: Any = "cpu") -> int:
        """Scratch bytes an encode/decode of ``numel`` elements of ``dtype`` needs on ``device``
        ("cpu", "cuda" or a torch.device); at least 16 (the status word). On the CPU it depends on
        the thread count (``gradcomp.set_num_threads``) at the time of the call.

        Raises:
            UnsupportedError: no backend for the device in this build.
        """
        cuda = str(device).startswith("cuda")
        return self._c.workspace_bytes(_count(numel, "numel"), _dtype_name(dtype), cuda)

    def main_param(self, numel: int) -> int:
        """The codec's main parameter for ``numel`` elements (k for top-k, 0 for casts)."""
        return self._c.main_param(_count(numel, "numel"))

    def __repr__(self) -> str:
        return f"gradcomp.Codec({self.spec!r})"

    # Codecs are values: equal when their canonical specs are (``Codec("topk:ratio=0.010") ==
    # Codec("topk:ratio=0.01")``), hashable, and pickled by their spec (a workspace is rebuilt on
    # first use), so a hook state holding one can be saved with torch.save.
    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, Codec):
            return NotImplemented
        return self.spec == other.spec

    def __hash__(self) -> int:
        return hash(("gradcomp.Codec", self.spec))

    def __reduce__(self):
        return (Codec, (self.spec,))

    # -- workspaces ----------------------------------------------------------------------------
    def workspace(self, like: Any, numel: int = 0, dtype: Any = "float32"):
        """The workspace this thread uses on like's device, grown to fit (numel, dtype). Its first
        16 bytes hold the status word that ``gradcomp.check`` reads; pass it to
        ``gradcomp.check(codec.workspace(t))`` after a decode."""
        cuda = _is_torch(like) and like.is_cuda
        need = self._c.workspace_bytes(_count(numel, "numel"), _dtype_name(dtype), cuda)
        key = (threading.get_ident(), _device_key(like))
        ws = self._ws.get(key)
        size = (ws.numel() if _is_torch(ws) else ws.size) if ws is not None else -1
        if size < need:
            ws = aligned_empty(like, max(need, 16))
            ws[:16] = 0
            with self._ws_lock:
                self._ws[key] = ws
        return ws

    # -- encode / decode -----------------------------------------------------------------------
    def encode(self, x: Any, residual: Any = None, out: Any = None, divisor: float = 1.0,
               workspace: Any = None, key: Any = None):
        """Compress ``x`` into a packet.

        Args:
            x: C-contiguous float32/float16/bfloat16 tensor (torch or numpy), taken as flat.
            residual: float32 tensor of x.numel() elements on x's device, or None. With a
                residual the same pass computes x' = x + residual and leaves
                residual = x' - divisor * decode(packet) (error feedback).
            out: uint8 buffer of at least ``packet_bytes`` bytes (16-byte aligned), written in
                place; allocated with x's framework when None.
            divisor: x' is divided by it before compression (e.g. the world size).
            workspace: scratch buffer; the codec's cached one when None.
            key: ``(seed, step, bucket, chunk)``, the EncodeContext of codecs that draw random
                numbers (Philox keyed by values every rank shares: the same key gives the same
                packet on every rank and backend; it travels in the packet, so decode needs no
                key). Integers with 0 <= seed < 2^64 and step, bucket, chunk in [0, 2^32); chunk
                tells apart pieces of one bucket encoded separately. A 3-tuple ``(seed, step,
                bucket)`` is accepted as chunk 0. Ignored by codecs that are not keyed; default
                (0, 0, 0, 0).

        Returns:
            The packet (``out``).

        Raises:
            InvalidArgumentError: wrong dtype, size, device or alignment; a non-contiguous or
                read-only tensor; a key that is not 3 or 4 integers in the ranges above (the
                message names the value and the ranges).
            UnsupportedError: a CUDA tensor in a CPU-only build.
        """
        numel, dtype = _numel_dtype(x)
        if dtype not in _GRADIENT_DTYPES:
            raise _C.InvalidArgumentError(
                f"encode: x has dtype {dtype}; accepted: float32, float16, bfloat16"
            )
        divisor = _number(divisor, "divisor")
        if divisor <= 0:
            raise _C.InvalidArgumentError(f"encode: divisor={divisor!r} must be > 0")
        for t, what in ((residual, "residual"), (out, "out"), (workspace, "workspace")):
            if t is not None:
                check_tensor(t, what)
        if residual is not None:
            _, rname = _numel_dtype(residual, "residual")
            if rname and rname != "float32":
                raise _C.InvalidArgumentError(
                    f"encode: residual has dtype {rname}; accepted: float32 (residuals are float32)")
        if out is None:
            out = aligned_empty(x, self.packet_bytes(numel, dtype))
        if workspace is None:
            workspace = self.workspace(x, numel, dtype)
        seed, step, bucket, chunk = _key(key)
        xv, xo = _numpy_view(x)
        self._c.encode(xv, residual, out, workspace, divisor, _stream_of(x), xo, seed, step, bucket, chunk)
        return out

    def decode(self, packet: Any, out: Any = None, numel: Optional[int] = None,
               dtype: Any = None, accumulate: bool = False, alpha: float = 1.0,
               workspace: Any = None):
        """Decode a packet: ``out = alpha * D(packet)`` or, with accumulate, ``out += ...``.

        Args:
            packet: uint8 buffer produced by ``encode`` of this codec.
            out: float32/float16/bfloat16 tensor whose numel is the packet's; allocated with the
                packet's framework on its device (zeros) when None, then ``numel`` is required.
            numel, dtype: size (elements) and dtype (default float32) of the allocated ``out``;
                with ``out`` given they are optional checks: a numel or dtype that differs from
                ``out``'s raises InvalidArgumentError.
            accumulate: add into ``out`` instead of overwriting it.
            alpha: scale applied to every decoded value.
            workspace: receives the status word; the codec's cached one when None.

        Returns:
            ``out``.

        Raises:
            CorruptPacketError: (CPU) the packet does not match this codec, out's numel or dtype,
                or carries an index out of range, out of order or repeated; nothing is written.
            InvalidArgumentError: bad arguments: out=None without numel, a numel= that differs
                from the packet's header or from out, a dtype= that differs from out's, a dtype
                that is not a gradient dtype.
        """
        alpha = _number(alpha, "alpha") if alpha != 0 else 0.0
        check_tensor(packet, "packet")
        for t, what in ((out, "out"), (workspace, "workspace")):
            if t is not None:
                check_tensor(t, what)
        name = None
        if dtype is not None:
            name = _dtype_name(dtype)
            if name not in _GRADIENT_DTYPES:
                raise _C.InvalidArgumentError(f"decode: dtype={name}; accepted: float32, float16, bfloat16")
        if numel is not None:
            numel = _count(numel, "numel")
            hdr = _header_numel(packet)
            if hdr is not None and hdr != numel:
                raise _C.InvalidArgumentError(
                    f"decode: numel={numel} but the packet's header says {hdr} elements; pass the numel the "
                    f"packet was encoded with")
        if out is not None:
            onumel, oname = _numel_dtype(out, "out")
            if onumel >= 0:  # torch / numpy (other DLPack tensors are checked by the core)
                if numel is not None and numel != onumel:
                    raise _C.InvalidArgumentError(f"decode: numel={numel} but out has {onumel} elements")
                if name is not None and name != oname:
                    raise _C.InvalidArgumentError(f"decode: dtype={name} but out has dtype {oname}")
                if oname not in _GRADIENT_DTYPES:
                    raise _C.InvalidArgumentError(
                        f"decode: out has dtype {oname}; accepted: float32, float16, bfloat16")
        else:
            if numel is None:
                raise _C.InvalidArgumentError("decode: out=None needs numel= (the packet's element count)")
            name = name or "float32"
            if _is_torch(packet):
                torch = _torch()
                out = torch.zeros(int(numel), dtype=getattr(torch, name), device=packet.device)
            else:
                if name == "bfloat16":
                    import ml_dtypes

                    out = np.zeros(int(numel), dtype=ml_dtypes.bfloat16)
                else:
                    out = np.zeros(int(numel), dtype=name)
        if workspace is None:
            workspace = self.workspace(packet)
        ov, oo = _numpy_view(out)
        self._c.decode(packet, ov, workspace, bool(accumulate), alpha, _stream_of(packet), oo)
        return out


def _host_bytes(packet: Any) -> Optional[np.ndarray]:
    """A C-contiguous CPU packet as a flat numpy uint8 view, or None (CUDA packets are not read on
    the host)."""
    if _is_torch(packet):
        if packet.is_cuda or not packet.is_contiguous():
            return None
        return packet.reshape(-1).view(_torch().uint8).numpy()
    if isinstance(packet, np.ndarray) and packet.flags.c_contiguous:
        return packet.reshape(-1).view(np.uint8)
    return None


def _header_numel(packet: Any) -> Optional[int]:
    """numel from a CPU packet's header (bytes 16-23), or None (CUDA packets are not read on the
    host; short packets are left to the core's validation)."""
    if _is_torch(packet):
        if packet.is_cuda or packet.numel() * packet.element_size() < 32:
            return None
        raw = packet.reshape(-1).view(_torch().uint8)[16:24].numpy().tobytes() if packet.is_contiguous() else None
    elif isinstance(packet, np.ndarray) and packet.nbytes >= 32 and packet.flags.c_contiguous:
        raw = packet.reshape(-1).view(np.uint8)[16:24].tobytes()
    else:
        return None
    return int.from_bytes(raw, "little") if raw is not None else None


def check(workspace: Any, stream: Any = None, clear: bool = True) -> int:
    """Read (and clear) the status word of a workspace; synchronizes with ``stream`` on CUDA.

    Returns the status bits: 0 when clean, ``1`` when a decoded packet carried the non-finite
    flag. Raises ``CorruptPacketError`` when a CUDA decode skipped invalid packet entries.
    """
    s = 0
    if stream is not None:
        s = int(getattr(stream, "cuda_stream", stream))
    elif _is_torch(workspace) and workspace.is_cuda:
        s = _stream_of(workspace)
    bits = _C.read_status(workspace, s, clear)
    if bits & _C.STATUS_CORRUPT:
        raise _C.CorruptPacketError(
            f"check: a decode on this workspace met a corrupt packet (status 0x{bits:x}); invalid entries were skipped"
        )
    return bits


def build_info() -> dict:
    """Version, CUDA on/off, CUDA architectures and toolkit, OpenMP, DLPack version."""
    return _C.build_info()


def _registry_doc() -> str:
    """The docstring part that lists the registry (name, keys, an example, the summary)."""
    lines = ["", "    Registered codecs (from ``gradcomp.codecs()``):", ""]
    for c in codecs():
        keys = ", ".join(c["keys"]) or "no keys"
        lines.append(f"    - ``{c['name']}`` ({keys}; e.g. ``{c['examples'][0]}``): {c['summary']}")
    return "\n".join(lines) + "\n"


Codec.__doc__ = (Codec.__doc__ or "") + _registry_doc()
