"""What a scheme checks on receipt, so that ranks that disagree fail before anything is decoded
into a gradient (:class:`gradcomp.RankMismatchError`, raised on every rank).

Two checks:

- :func:`check_headers`: the packets a rank receives (``gather``'s W packets, ``two_phase``'s
  chunk packets of both phases, the DeepSpeed backend's server packets) carry their 32-byte header
  (magic, version, codec id, FNV-1a hash of the canonical spec, numel, input dtype: the README's
  packet format); each one is compared with what this rank expects and a mismatch names the
  sending rank and both values. An all-zero header is a rank that failed before the collective
  and sent its zeroed slot instead (two_phase's protocol). CPU packets only: on CUDA the decode
  kernels check headers on the device (status word, read one step later).
- :class:`PeerCheck`: a 256-byte descriptor of the call (step, tensor or bucket, numel, dtype,
  parameter map, codec spec, scheme, world size), all-gathered over the group beside the scheme's
  own collective and compared row by row. It catches what headers cannot show (the ``sum``
  scheme sends no header; a rank one step behind sends a valid packet of the same layout): the
  compressor builds one at a new layout (checked in the calling thread before the scheme runs, so
  a mismatched numel never reaches a collective of another size) and at the first call of each
  step (launched before the scheme's first collective, checked before its first decode). On
  CUDA it is compared on the host one step later through a pinned copy (no synchronization in
  the hook) unless the caller waits.

Descriptor layout (int64 words, little-endian): 0 magic ``"GCCK"`` | version << 32; 1 step;
2 key kind (0 bucket index, 1 tensor name); 3 bucket index or crc32 of the name; 4 numel;
5 dtype code; 6 parameters in the map; 7 crc32 of the parameter map; 8 spec hash; 9 scheme code;
10 inner scheme code; 11 local world size; 12 world size; 13-15 zero; 16-23 the canonical spec
(64 bytes, zero-padded); 24-31 the tensor name (64 bytes; empty for buckets).
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple
import zlib

import numpy as np
import torch
import torch.distributed as dist

from ..codec import _dtype_name as dtype_name
from .. import _C
from ..errors import RankMismatchError
from ..planner.bytes import PEER_CHECK_BYTES

HEADER_MAGIC = 0x31504347  # "GCP1" little-endian
CHECK_MAGIC = 0x4B434347  # "GCCK"
CHECK_VERSION = 1
WORDS = 32
SCHEME_CODES = ("dense", "sum", "gather", "two_phase", "hierarchical", "powersgd", "onebit_allreduce", "")
"""Scheme names as descriptor codes (index); "" is none."""
DTYPE_CODES = ("float32", "float16", "bfloat16", "float64", "complex64", "complex128", "int64", "int32", "other")
_INPUT_DTYPES = {0: "float32", 1: "float16", 2: "bfloat16"}


def _host(t: torch.Tensor) -> Optional[np.ndarray]:
    """A CPU tensor's bytes as a flat numpy uint8 view, or None (device memory is not read)."""
    if t.is_cuda or not t.is_contiguous():
        return None
    return t.reshape(-1).view(torch.uint8).numpy()


def header_fields(h: np.ndarray) -> dict:
    """The fields of a 32-byte packet header (numpy uint8): magic, version, codec_id, input, wire,
    index, flags, spec_hash, numel, main."""
    b = h.tobytes()

    def u(a, n):
        return int.from_bytes(b[a: a + n], "little")

    return {"magic": u(0, 4), "version": u(4, 2), "codec_id": u(6, 2), "input": b[8], "wire": b[9],
            "index": b[10], "flags": b[11], "spec_hash": u(12, 4), "numel": u(16, 8), "main": u(24, 8)}


def _codec_name(codec_id: int) -> str:
    from ..codec import codecs

    for c in codecs():
        if int(c["id"]) == codec_id:
            return c["name"]
    return f"unknown codec id {codec_id}"


def check_headers(buf: torch.Tensor, slot_bytes: int, expect: Sequence[Tuple[int, int]], ref: torch.Tensor,
                  input_dtype: str, what: str) -> None:
    """Check the packet headers of the slots ``buf[r * slot_bytes:]`` before any is decoded.

    Args:
        buf: uint8, the received slots (CPU; a CUDA buffer is left to the device-side check).
        slot_bytes: bytes per slot.
        expect: ``[(rank, numel)]``: slot ``rank`` must hold a packet of ``numel`` elements
            (slots of empty chunks are not listed: they are not decoded).
        ref: uint8, a packet this rank encoded with the same codec (its magic, version, codec id
            and spec hash are the expected ones).
        input_dtype: the packets' expected input dtype ("float32", "float16", "bfloat16").
        what: the scheme and collective, for the message (e.g. "scheme 'gather': the all-gather").

    Raises:
        gradcomp.RankMismatchError: a header that differs; the message names the rank, the field,
            what it sent and what this rank expected (or that the rank failed before sending).
    """
    b = _host(buf)
    r0 = _host(ref)
    if b is None or r0 is None or not expect:
        return
    mine = header_fields(r0[:32])
    want_input = {v: k for k, v in _INPUT_DTYPES.items()}[input_dtype]
    problems = []
    for rank, numel in expect:
        h = b[rank * slot_bytes: rank * slot_bytes + 32]
        if h.size < 32:
            problems.append(f"rank {rank}'s slot is shorter than a header")
            continue
        if not h.any():
            problems.append(f"rank {rank} sent an empty slot: it failed before this collective (its own error "
                            f"says why)")
            continue
        f = header_fields(h)
        if f["magic"] != HEADER_MAGIC or f["version"] != mine["version"]:
            problems.append(f"rank {rank} sent bytes that are not a gradcomp packet of this version (magic "
                            f"0x{f['magic']:08x}, version {f['version']}; expected 0x{HEADER_MAGIC:08x}, "
                            f"{mine['version']})")
        elif f["codec_id"] != mine["codec_id"]:
            problems.append(f"rank {rank} sent a packet of codec {_codec_name(f['codec_id'])!r}, this rank runs "
                            f"{_codec_name(mine['codec_id'])!r}")
        elif f["spec_hash"] != mine["spec_hash"]:
            problems.append(f"rank {rank} sent a packet of another {_codec_name(f['codec_id'])!r} spec (spec hash "
                            f"0x{f['spec_hash']:08x}, this rank's 0x{mine['spec_hash']:08x})")
        elif f["numel"] != numel or f["input"] != want_input:
            got = _INPUT_DTYPES.get(f["input"], f"dtype code {f['input']}")
            problems.append(f"rank {rank} sent a packet of {f['numel']} {got} elements, this rank expects {numel} "
                            f"{input_dtype} elements")
    if problems:
        raise RankMismatchError(f"{what}: ranks disagree: " + "; ".join(problems) + ". Nothing was decoded.")


# ---- the call descriptor ------------------------------------------------------------------------
def _pack_str(s: str, words: int) -> List[int]:
    raw = s.encode("utf-8")[: 8 * words].ljust(8 * words, b"\0")
    return [int.from_bytes(raw[8 * i: 8 * i + 8], "little", signed=True) for i in range(words)]


def _unpack_str(ws: Sequence[int]) -> str:
    raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in ws)
    return raw.rstrip(b"\0").decode("utf-8", errors="replace")


def _dtype_code(dtype: Any) -> int:
    name = dtype_name(dtype)
    return DTYPE_CODES.index(name) if name in DTYPE_CODES else DTYPE_CODES.index("other")


def _crc(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


def describe_key(key) -> str:
    kind, v = key
    return f"bucket {v}" if kind == "index" else f"tensor {v!r}"


class PeerCheck:
    """The descriptor of one call, all-gathered over ``group`` and compared (module docstring).

    Args:
        group: the process group (None: the default group); world_size: its size W.
        device: where the descriptor lives (the tensor's device: gloo for CPU, NCCL for CUDA).
        step: the caller's step; key: ``("index", i)`` or ``("name", str)``.
        numel, dtype: of the tensor or bucket; params: its parameter map ``[(name, offset,
            length)]`` (or None).
        spec, spec_hash: the codec's canonical spec and its FNV-1a hash (0 for none).
        scheme, inner: the scheme (``SCHEME_CODES``) and hierarchical's inner scheme ("" else).
        local_world_size: hierarchical's L (0 else).
        late: on CUDA, a callable ``late(check, host_rows, event)`` that compares the rows one
            step later (the compressor's stats); None: :meth:`verify` waits for them.
        alloc_failed: this rank could not allocate the call's buffers (word 13 = 1): every rank's
            compare then fails naming it, before any collective of the call is started.
    """

    def __init__(self, group: Any, world_size: int, device: torch.device, *, step: int, key, numel: int,
                 dtype: Any, params: Optional[Sequence] = None, spec: str = "", spec_hash: int = 0,
                 scheme: str = "", inner: str = "", local_world_size: int = 0,
                 late: Optional[Callable[["PeerCheck", torch.Tensor, Any], None]] = None,
                 alloc_failed: bool = False):
        self.group, self.world_size, self.device = group, int(world_size), torch.device(device)
        self.step, self.key, self.scheme, self.spec = int(step), key, scheme, spec
        self.label = describe_key(key)
        kind, v = key
        pmap = [tuple(p) for p in params] if params is not None else []
        words = [CHECK_MAGIC | (CHECK_VERSION << 32), int(step), 0 if kind == "index" else 1,
                 int(v) if kind == "index" else _crc(str(v)), int(numel), _dtype_code(dtype), len(pmap),
                 _crc(repr(pmap)), int(spec_hash), SCHEME_CODES.index(scheme if scheme in SCHEME_CODES else ""),
                 SCHEME_CODES.index(inner if inner in SCHEME_CODES else ""), int(local_world_size), self.world_size,
                 int(bool(alloc_failed)), 0, 0] + _pack_str(spec, 8) + _pack_str(str(v) if kind == "name" else "", 8)
        self.mine_host = np.array(words, dtype=np.int64)
        assert self.mine_host.nbytes == PEER_CHECK_BYTES, "the planner's descriptor size"
        self.mine = torch.from_numpy(self.mine_host.copy()).to(self.device)
        self.rows: Optional[torch.Tensor] = None
        self.work = None
        self.late = late

    def launch(self) -> None:
        """Issue the all-gather of the descriptors (async); call it where every rank issues its
        collectives in the same order (before the scheme's first collective)."""
        if self.work is not None:
            return
        self.rows = torch.empty(self.world_size * WORDS, dtype=torch.int64, device=self.device)
        self.work = dist.all_gather_into_tensor(self.rows, self.mine, group=self.group, async_op=True)

    def verify(self) -> None:
        """Wait for the descriptors and compare them (CPU: now; CUDA with ``late``: one step
        later, see the module docstring).

        Raises:
            gradcomp.RankMismatchError: a rank's descriptor differs (:meth:`message`).
            RuntimeError: the all-gather itself failed (torch.distributed's error).
        """
        if self.work is None:
            self.launch()
        self.work.wait()
        if self.device.type == "cuda" and self.late is not None:
            host = torch.empty_like(self.rows, device="cpu").pin_memory()
            host.copy_(self.rows, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
            self.late(self, host, ev)
            return
        self.compare(self.rows if self.device.type == "cpu" else self.rows.cpu())

    def compare(self, rows: torch.Tensor) -> None:
        """Compare the all-gathered descriptors ``rows`` (int64, W * 32, on the host).

        Raises:
            gradcomp.RankMismatchError: as :meth:`verify`.
        """
        m = rows.view(self.world_size, WORDS).numpy()  # host memory (a CPU tensor, or the landed copy)
        mine = self.mine_host
        bad = np.nonzero((m != mine[None, :]).any(axis=1))[0]
        if bad.size:
            err = RankMismatchError(self.message(m, [int(r) for r in bad]))
            err.step_context = True  # the message names the step, the tensor or bucket, codec and scheme
            raise err

    def message(self, rows: np.ndarray, bad: Sequence[int]) -> str:
        """What differs between this rank's descriptor and those of the ranks ``bad``."""
        me = self.mine_host
        short = [r for r in range(len(rows)) if int(rows[r][13]) == 1]
        if short:  # a rank could not allocate: that is the error, whatever else differs
            return (f"gradcomp: step {self.step}, {self.label} (codec {self.spec}, scheme {self.scheme}): rank(s) "
                    f"{', '.join(map(str, short))} could not allocate the buffers of {self._what(me)} "
                    f"({int(me[4])} elements; the packet, the received packets, the workspace and the "
                    f"error-feedback residuals of scheme {self.scheme}): out of memory there. Nothing was sent: "
                    f"no rank waits for it. Free memory, or use smaller buckets or a codec with smaller packets.")
        parts = [self._diff(int(r), rows[r], me) for r in bad[:8]]
        more = f"; {len(bad) - 8} more ranks differ" if len(bad) > 8 else ""
        return (f"gradcomp: step {self.step}, {self.label} (codec {self.spec}, scheme {self.scheme}): ranks disagree: "
                + "; ".join(parts) + more + ". Every rank must reduce the same tensors, with the same codec, "
                "layout and order, at the same step. Nothing was decoded.")

    @staticmethod
    def _what(w: np.ndarray) -> str:
        if int(w[2]) == 0:
            return f"bucket {int(w[3])}"
        name = _unpack_str(w[24:32])
        return f"tensor {name!r}"

    def _diff(self, r: int, w: np.ndarray, me: np.ndarray) -> str:
        if (int(w[0]) & 0xFFFFFFFF) != CHECK_MAGIC:
            return f"rank {r} sent no call descriptor (another gradcomp version, or another collective here)"
        if w[1] != me[1]:
            return (f"rank {r} is at step {int(w[1])}, this rank at step {int(me[1])} (a rank skipped or "
                    f"repeated a step)")
        if w[2] != me[2] or w[3] != me[3]:
            return f"rank {r} reduces {self._what(w)} where this rank reduces {self._what(me)} (calls in another order)"
        if w[8] != me[8] or not np.array_equal(w[16:24], me[16:24]):
            return f"rank {r} runs codec {_unpack_str(w[16:24])!r}, this rank {_unpack_str(me[16:24])!r}"
        if w[9] != me[9] or w[10] != me[10] or w[11] != me[11]:
            def sch(x):
                s = SCHEME_CODES[int(x[9])] if 0 <= int(x[9]) < len(SCHEME_CODES) else f"code {int(x[9])}"
                if 0 <= int(x[10]) < len(SCHEME_CODES) and SCHEME_CODES[int(x[10])]:
                    s += f" (inner {SCHEME_CODES[int(x[10])]}, local world size {int(x[11])})"
                return s
            return f"rank {r} runs scheme {sch(w)}, this rank {sch(me)}"
        if w[12] != me[12]:
            return f"rank {r} has world size {int(w[12])}, this rank {int(me[12])}"
        if w[4] != me[4] or w[5] != me[5]:
            def dt(x):
                c = int(x[5])
                return DTYPE_CODES[c] if 0 <= c < len(DTYPE_CODES) else f"dtype code {c}"
            return (f"rank {r}'s {self._what(w)} has {int(w[4])} elements of {dt(w)}, this rank's {int(me[4])} "
                    f"of {dt(me)}")
        if w[6] != me[6] or w[7] != me[7]:
            return (f"rank {r}'s {self._what(w)} holds {int(w[6])} parameters in another layout (parameter map "
                    f"crc32 0x{int(w[7]) & 0xFFFFFFFF:08x}), this rank {int(me[6])} (0x{int(me[7]) & 0xFFFFFFFF:08x})")
        return f"rank {r} sent another call descriptor"


def decode_from(codec, packet: torch.Tensor, rank: int, what: str, **kwargs):
    """``codec.decode(packet, **kwargs)`` of the packet rank ``rank`` sent; a
    :class:`gradcomp.CorruptPacketError` (a header, index or ``integrity=crc32c`` checksum that does
    not hold: bytes changed in transit) is raised again naming that rank and ``what`` (the
    collective), so that every rank's error says where the bad bytes came from."""
    try:
        return codec.decode(packet, **kwargs)
    except _C.CorruptPacketError as e:
        raise _C.CorruptPacketError(f"{what}: the packet from rank {rank} is corrupt: {e}") from e
