"""The torch sequence a user would write for the same packet as each codec (gradcomp-bench's baselines).

:func:`make` returns, for a codec and an input ``x`` (a flat C-contiguous float32 / float16 /
bfloat16 torch tensor of ``n`` elements, CPU or CUDA), a :class:`Baseline`: an ``encode()`` that
computes the information the codec's packet carries with plain torch ops into preallocated
buffers (a user who cares about speed preallocates too, so neither side pays for fresh pages), a
``decode()`` that turns it back into ``out`` (``n`` elements of x's dtype), and a description. With
``residual`` (float32, ``n`` elements, updated in place) the encode is the error-feedback step:
x' = x + r, compress x', r = x' - D(x'). Math is in float32, as the codecs'. These are the
sequences ``bench/side_by_side.py`` timed, one per registered codec:

- ``none``, ``fp16``, ``bf16``: ``w.copy_(x)`` (a cast into the wire dtype), ``out.copy_(w)``.
- ``topk``: ``torch.topk(x.abs(), k, sorted=False)`` and ``x[idx]`` (the values the packet
  carries); decode ``out.zero_().index_copy_(0, idx, v)``; with a residual ``r = x'``, ``r[idx] -= v``.
- ``randomk``: ``torch.randint(0, n, (k,), generator=g)`` (its own generator, never the global
  one) and ``x[idx]`` (times n / k with ``unbiased=true``); decode ``out.zero_().index_copy_(0,
  idx, v)``. The indices differ from the codec's (Philox strata), so only the shape of the result
  is compared.
- ``qsgd``: GRACE's QSGD per block of B elements: ``norm = vector_norm(x_b)``, ``level = s / norm *
  |x|``, ``floor`` plus ``rand() < frac`` (its own generator), ``* sign`` to int8; decode ``norm / s
  * code`` (other uniforms than the codec's Philox words: only the shape of the result is
  compared).
- ``terngrad``: TernGrad's sequence: ``std``, ``clamp(-2.5 std, 2.5 std)``, ``s = max |x_c|``,
  ``rand() < |x_c| / s`` (its own generator) times ``sign``, two bits per code packed four to a byte;
  decode unpacks the codes times s (other uniforms than the codec's: the shape is compared).
- ``fp8``, ``int8``, ``int4``: per block of B elements amax, ``d = amax / max`` (448 e4m3fn,
  57344 e5m2, 127, 7; e8m0 scales ``2^ceil(log2 d)``), ``(x / d).to(float8)`` or
  ``round(x / d).clamp(-max, max).to(int8)`` (int4: two codes per byte, low nibble first);
  decode ``code.float() * d``; with a residual ``r = x' - code * d``.
- ``onebit``: the scale per chunk (``vector_norm / sqrt(C)`` or mean |x|), the signs ``x >= 0``
  packed MSB first: ``numpy.packbits`` on the CPU without a residual (what a CPU user calls), else
  DeepSpeed's worker step as torch ops (bool -> uint8 times bit weights, summed per byte, ``r = x' -
  sign * s``); decode ``numpy.unpackbits`` + ``torch.where`` on the CPU, bit masks on CUDA.

The sequences compute the same packet content as the codec for the deterministic codecs (checked in
tests/python/test_bench_cli.py: bitwise for the casts, block quantizers and float32 top-k; the
onebit scale within a few float32 ulps, since torch's norm sums in another order). A codec (or a
spec of one) for which no sequence is written gets ``None``: so does a keyed spec of a cast
(``bf16:rounding=stochastic``: no torch sequence is written for stochastic rounding).
:data:`CODECS` names the codecs with a sequence: every registered one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np
import torch

from ..codec import Codec

F32 = torch.float32

EF_CODECS = ("fp8", "int8", "onebit", "topk")
"""Codec names whose users run them with error feedback: gradcomp-bench adds encode-with-residual
rows for these (a choice written by hand: tests/python/test_bench_cli.py checks that each is a
registered codec that is not linear, for which a residual means something)."""

_QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0, "int4": 7.0}


@dataclass
class Baseline:
    """A torch sequence for one codec and one input: ``encode()`` then ``decode()`` leaves in
    ``out`` (n elements of x's dtype) what the codec's decode would write. ``description`` and
    ``decode_description`` are the short forms printed in the table's encode and decode rows;
    :attr:`summary` is what the JSON's ``baseline`` field holds."""

    description: str
    encode: Callable[[], object]
    decode: Callable[[], object]
    out: torch.Tensor
    decode_description: str = ""

    @property
    def summary(self) -> str:
        """``"<encode>; decode: <decode>"``."""
        return f"{self.description}; decode: {self.decode_description}"


def spec_keys(spec: str) -> Dict[str, str]:
    """The ``key=value`` pairs of a spec string ``name[:key=value,...]`` as a dict of strings
    (``spec_keys("fp8:format=e5m2,block=17") == {"format": "e5m2", "block": "17"}``)."""
    _, _, rest = spec.partition(":")
    out = {}
    for kv in rest.split(","):
        if kv:
            k, _, v = kv.partition("=")
            out[k] = v
    return out


def _section(lay: dict, name: str):
    for s in lay["sections"]:
        if s[0] == name:
            return s
    return None


def _wire(name: str) -> Optional[torch.dtype]:
    return getattr(torch, name, None) if isinstance(getattr(torch, name, None), torch.dtype) else None


def _source(x: torch.Tensor, residual: Optional[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A callable returning the float32 tensor to compress: x + r (into a preallocated buffer),
    x itself when float32 without a residual, else x cast to float32."""
    if residual is not None:
        xp = torch.empty(x.numel(), dtype=F32, device=x.device)

        def src():
            return torch.add(x, residual, out=xp)
    elif x.dtype == F32:
        def src():
            return x
    else:
        xp = torch.empty(x.numel(), dtype=F32, device=x.device)

        def src():
            return xp.copy_(x)
    return src


def _cast(codec: Codec, x: torch.Tensor, residual) -> Optional[Baseline]:
    n = x.numel()
    sec = codec.layout(n, x.dtype)["sections"]
    wire = _wire(sec[0][3]) if sec else None
    if wire is None or residual is not None or codec.properties["keyed"]:
        return None
    buf = torch.empty(n, dtype=wire, device=x.device)
    out = torch.empty_like(x)
    w = str(wire).replace("torch.", "")
    return Baseline(f"{w} buf.copy_(x)", lambda: buf.copy_(x), lambda: out.copy_(buf), out, "out.copy_(buf)")


def _topk(codec: Codec, x: torch.Tensor, residual) -> Optional[Baseline]:
    n, dev = x.numel(), x.device
    lay = codec.layout(n, x.dtype)
    k = lay["main_param"]
    vsec = _section(lay, "values")
    vdt = _wire(vsec[3]) if vsec else None
    if vdt is None:
        return None
    sdt = F32 if residual is not None else x.dtype  # the dtype top-k runs in
    xa = torch.empty(n, dtype=sdt, device=dev)
    tv = torch.empty(k, dtype=sdt, device=dev)
    ti = torch.empty(k, dtype=torch.long, device=dev)
    vals = torch.empty(k, dtype=sdt, device=dev)
    out = torch.empty_like(x)
    state = {"v": vals}
    src = _source(x, residual) if residual is not None else (lambda: x)

    def enc():
        s = src()
        torch.topk(torch.abs(s, out=xa), k, sorted=False, out=(tv, ti))
        torch.index_select(s, 0, ti, out=vals)
        v = vals if vdt == sdt else vals.to(vdt)
        if residual is not None:
            residual.copy_(s)
            residual.index_add_(0, ti, v.to(F32), alpha=-1)
        state["v"] = v

    def dec():
        v = state["v"]
        out.zero_()
        out.index_copy_(0, ti, v if v.dtype == out.dtype else v.to(out.dtype))

    desc = "topk(|x|, k, sorted=False), x[idx]"
    return Baseline(desc + (", r=x'-D" if residual is not None else ""), enc, dec, out,
                    "zero_(), index_copy_(idx, v)")


def _randomk(codec: Codec, x: torch.Tensor, residual) -> Optional[Baseline]:
    if residual is not None:
        return None
    n, dev = x.numel(), x.device
    k = codec.layout(n, x.dtype)["main_param"]
    scale = n / k if k and spec_keys(codec.spec).get("unbiased") == "true" else None
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = torch.empty(k, dtype=torch.long, device=dev)
    vals = torch.empty(k, dtype=x.dtype, device=dev)
    out = torch.empty_like(x)

    def enc():
        torch.randint(0, max(n, 1), (k,), generator=gen, device=dev, out=idx)
        torch.index_select(x, 0, idx, out=vals)
        if scale is not None:
            vals.mul_(scale)

    def dec():
        out.zero_()
        out.index_copy_(0, idx, vals)

    return Baseline("randint(n, (k,)), x[idx]" + (" * n/k" if scale else ""), enc, dec, out,
                    "zero_(), index_copy_(idx, v)")


def _qsgd(codec: Codec, x: torch.Tensor, residual) -> Optional[Baseline]:
    n, dev = x.numel(), x.device
    keys = spec_keys(codec.spec)
    B = int(keys.get("block", "128"))
    if residual is not None or n == 0 or n % B:
        return None
    s = float(int(keys.get("levels", "127")))
    gen = torch.Generator(device=dev).manual_seed(0)
    xf = torch.empty(n, dtype=F32, device=dev)
    prob = torch.empty(n, dtype=F32, device=dev)
    codes = torch.empty(n, dtype=torch.int8, device=dev)
    state = {}
    out = torch.empty_like(x)

    def enc():
        xb = xf.copy_(x).view(-1, B)
        norm = torch.linalg.vector_norm(xb, dim=1, keepdim=True)
        level = (s / norm) * xb.abs()
        prev = level.floor()
        prob.uniform_(generator=gen)
        new = prev + (prob.view(-1, B) < (level - prev))
        codes.copy_((new * xb.sign()).view(-1))
        state["norm"] = norm

    def dec():
        out.copy_((state["norm"] / s * codes.view(-1, B).float()).view(-1))

    return Baseline("GRACE qsgd: norm, s/norm*|x|, floor + rand < frac, *sign", enc, dec, out, "norm / s * code")


def _terngrad(codec: Codec, x: torch.Tensor, residual) -> Optional[Baseline]:
    n, dev = x.numel(), x.device
    if residual is not None or n == 0 or n % 4:
        return None
    c = float(spec_keys(codec.spec).get("clip", "2.5"))
    gen = torch.Generator(device=dev).manual_seed(0)
    xf = torch.empty(n, dtype=F32, device=dev)
    u = torch.empty(n, dtype=F32, device=dev)
    packed = torch.empty(n // 4, dtype=torch.uint8, device=dev)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=dev)
    state = {}
    out = torch.empty_like(x)

    def enc():
        xc = xf.copy_(x)
        if c:
            lim = c * float(torch.std(xc, correction=0))
            xc = xc.clamp(-lim, lim)
        s = xc.abs().max()
        u.uniform_(generator=gen)
        b = (u < xc.abs() / s).to(torch.uint8) * torch.where(xc < 0, 3, 1).to(torch.uint8)
        packed.copy_((b.view(-1, 4) << shifts).sum(dim=1, dtype=torch.uint8))
        state["s"] = s

    def dec():
        codes = (packed.view(-1, 1) >> shifts) & 3
        val = (codes == 1).to(F32) - (codes == 3).to(F32)
        out.copy_((val * state["s"]).view(-1))

    return Baseline("std, clamp, max|x|, rand < |x|/s, 2-bit pack", enc, dec, out, "unpack * s")


def _blockq(codec: Codec, x: torch.Tensor, residual) -> Optional[Baseline]:
    n, dev = x.numel(), x.device
    lay = codec.layout(n, x.dtype)
    B = lay["main_param"] or n
    codes, scales = _section(lay, "codes"), _section(lay, "scales")
    if n == 0 or n % B or codes is None or scales is None or codes[3] not in _QMAX:
        return None
    cname = codes[3]
    int4 = cname == "int4"
    if int4 and n % 2:
        return None
    mx = _QMAX[cname]
    fp8 = cname.startswith("float8")
    e8m0 = scales[3] == "float8_e8m0fnu"
    stochastic = spec_keys(codec.spec).get("rounding") == "stochastic"
    src = _source(x, residual)
    m = n // B
    yq = torch.empty(n, dtype=F32, device=dev)
    dd = torch.empty(n, dtype=F32, device=dev)
    amax = torch.empty(m, dtype=F32, device=dev)
    sc = torch.empty(m, dtype=F32, device=dev)
    scd = torch.empty(m, dtype=F32, device=dev)
    q = torch.empty(n, dtype=getattr(torch, cname) if fp8 else torch.int8, device=dev)
    qd = torch.empty(n, dtype=torch.int8, device=dev) if int4 else q
    packed = torch.empty(n // 2, dtype=torch.int8, device=dev) if int4 else None
    tmp = torch.empty(n // 2, dtype=torch.int8, device=dev) if int4 else None
    sc8 = torch.empty(m, dtype=torch.float8_e8m0fnu, device=dev) if e8m0 and hasattr(torch, "float8_e8m0fnu") else None
    u = torch.empty(n, dtype=F32, device=dev) if stochastic else None
    gen = torch.Generator(device=dev).manual_seed(0) if stochastic else None
    out = torch.empty_like(x)
    tiny = 2.0 ** -127 if e8m0 else torch.finfo(F32).tiny

    def enc():
        s = src()
        torch.amax(torch.abs(s, out=yq).view(-1, B), dim=1, out=amax)
        torch.div(amax, mx, out=sc).clamp_(min=tiny)
        if e8m0:
            torch.log2(sc, out=sc).ceil_().exp2_().clamp_(max=2.0 ** 127)
            if sc8 is not None:
                sc8.copy_(sc)
        torch.div(s.view(-1, B), sc[:, None], out=yq.view(-1, B))
        if fp8:
            q.copy_(yq)
        else:
            if stochastic:
                yq.add_(u.uniform_(generator=gen)).floor_()
            else:
                yq.round_()
            q.copy_(yq.clamp_(-mx, mx))
            if int4:
                qv = q.view(-1, 2)
                torch.bitwise_and(qv[:, 0], 15, out=packed)
                torch.bitwise_left_shift(qv[:, 1], 4, out=tmp)
                packed.bitwise_or_(tmp)
        if residual is not None:
            dd.copy_(q)
            torch.sub(s.view(-1, B), dd.view(-1, B).mul_(sc[:, None]), out=residual.view(-1, B))

    def dec():
        if int4:
            qv = qd.view(-1, 2)
            torch.bitwise_left_shift(packed, 4, out=tmp)
            torch.bitwise_right_shift(tmp, 4, out=qv[:, 0])
            torch.bitwise_right_shift(packed, 4, out=qv[:, 1])
        dd.copy_(qd)
        d = scd.copy_(sc8) if sc8 is not None else sc
        torch.mul(dd.view(-1, B), d[:, None], out=out.view(-1, B))

    if fp8:
        what = f"x/d, .to({cname.replace('float8_', '')})"
    else:
        what = f"round(x/d), .to(int8){', pack' if int4 else ''}"
    desc = f"amax, {what}" + (", r=x'-D" if residual is not None else "")
    return Baseline(desc, enc, dec, out, ("unpack, " if int4 else "") + "code.float() * d")


def _onebit(codec: Codec, x: torch.Tensor, residual) -> Optional[Baseline]:
    n, dev = x.numel(), x.device
    lay = codec.layout(n, x.dtype)
    C = lay["main_param"] or n
    mode = spec_keys(codec.spec).get("scale", "l2")
    if n == 0 or n % C or n % 8 or mode not in ("l2", "mean_abs"):
        return None
    m = n // C
    sc = torch.empty(m, dtype=F32, device=dev)
    out = torch.empty_like(x)
    wts = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=dev)
    packed = torch.empty(n // 8, dtype=torch.uint8, device=dev)
    cpu = dev.type == "cpu"

    def scales(s):
        if mode == "l2":
            torch.linalg.vector_norm(s.view(-1, C), dim=1, dtype=F32, out=sc).div_(math.sqrt(C))
        else:
            torch.linalg.vector_norm(s.view(-1, C), ord=1, dim=1, dtype=F32, out=sc).div_(C)

    def pack(s):
        pos = s >= 0  # DeepSpeed: sign(x) + 1 cast to bool (NaN aside)
        torch.sum(pos.view(-1, 8).to(torch.uint8) * wts, dim=1, dtype=torch.uint8, out=packed)
        return pos

    def torch_dec():
        bits = ((packed[:, None] & wts) != 0).view(-1, C)
        sp = sc.to(out.dtype)[:, None]
        torch.where(bits, sp, -sp, out=out.view(-1, C))

    norm = "norm/sqrt(C)" if mode == "l2" else "mean|x|"
    tdec = "bit masks, torch.where(b, s, -s)"
    if residual is None and cpu:
        state = {}

        def enc():
            scales(x)
            state["bits"] = np.packbits((x >= 0).numpy())  # MSB first, as the codec

        def dec():
            bits = torch.from_numpy(np.unpackbits(state["bits"])[:n]).bool().view(-1, C)
            sp = sc.to(out.dtype)[:, None]
            torch.where(bits, sp, -sp, out=out.view(-1, C))

        return Baseline(f"{norm}, numpy.packbits(x >= 0)", enc, dec, out, "numpy.unpackbits, torch.where")
    if residual is None:
        def enc():
            scales(x)
            pack(x)

        return Baseline(f"{norm}, x >= 0, packbits as torch ops", enc, torch_dec, out, tdec)
    xp = torch.empty(n, dtype=F32, device=dev)
    sgn = torch.empty(n, dtype=F32, device=dev)

    def enc_ef():
        torch.add(x, residual, out=xp)
        scales(xp)
        pos = pack(xp)
        torch.where(pos.view(-1, C), sc[:, None], -sc[:, None], out=sgn.view(-1, C))
        torch.sub(xp, sgn, out=residual)

    return Baseline(f"{norm}, x >= 0, packbits, r=x'-D", enc_ef, torch_dec, out, tdec)


_BUILDERS = {
    "none": _cast, "fp16": _cast, "bf16": _cast, "topk": _topk, "randomk": _randomk,
    "fp8": _blockq, "int8": _blockq, "int4": _blockq, "qsgd": _qsgd, "terngrad": _terngrad,
    "onebit": _onebit,
}
"""The sequence builder of each codec name: written by hand, one per registered codec
(tests/python/test_bench_cli.py fails when ``gradcomp.codecs()`` has a name this table lacks, or
this table names one the registry does not have)."""

CODECS = tuple(_BUILDERS)
"""The codec names with a torch sequence here (the registry's, in registry order)."""


def make(codec: Codec, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> Optional[Baseline]:
    """The torch sequence for ``codec`` on ``x`` (flat, C-contiguous float32/float16/bfloat16 torch
    tensor, CPU or CUDA); with ``residual`` (float32, x.numel() elements, same device, updated in
    place by each encode) the error-feedback step. Returns None when no sequence is written for
    the codec's name or for this spec and size (e.g. a block that does not divide x.numel(), a
    residual for a codec listed without error feedback)."""
    f = _BUILDERS.get(codec.spec.split(":")[0])
    return None if f is None else f(codec, x, residual)
