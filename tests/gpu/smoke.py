"""Codec smoke matrix, CUDA against CPU: the first correctness stage of tests/gpu/run.sh.

Every example spec of the codec registry (``gradcomp.codecs()``) x input dtype {float32, bfloat16}
x {with a float32 residual, without} x n in {1, 4097, 2^20 + 3} elements x {aligned, offset by one
element}: the packet, the residual after encode and the decode of the CPU packet (float32,
accumulate, alpha 0.5) from the CUDA backend must equal the CPU backend's byte for byte (the CPU
backend's values are checked against independent numpy / ml_dtypes references by the CPU suite).
Keyed codecs get the key (1234, 5, 6, 7) on both. One line per case; a failing one names the
first differing byte and the packet section it falls in (from ``Codec.layout``).

Usage: python tests/gpu/smoke.py [--device cuda|cpu] [--quick] [--out FILE]
  --device cpu  compares the CPU backend with itself through the same code path (how
                ``run.sh --dry-run`` exercises this script on a machine without a GPU)
  --quick       n in {1, 4097} only
Exit status: 0 when every case matched, 1 otherwise, 2 when the device is missing.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

import gradcomp

KEY = (1234, 5, 6, 7)
_BITS = {"uint1": 1, "int4": 4, "uint4": 4}


def _section_of(layout: dict, byte: int) -> str:
    """The name of the packet section holding ``byte`` ("header", a section, or "padding after X")."""
    if byte < 32:
        return "header"
    name, end = "header", 32
    for sname, off, count, dt in layout["sections"]:
        if off <= byte:
            bits = _BITS.get(dt, np.dtype(dt).itemsize * 8 if dt in np.sctypeDict else 32)
            name, end = sname, off + (count * bits + 7) // 8
    return name if byte < end else f"padding after {name}"


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Index of the first differing byte of two uint8 / float tensors (bitwise), -1 when equal."""
    ab = a.detach().cpu().contiguous().view(torch.uint8).numpy()
    bb = b.detach().cpu().contiguous().view(torch.uint8).numpy()
    if ab.shape != bb.shape:
        return min(ab.size, bb.size)
    d = np.flatnonzero(ab != bb)
    return int(d[0]) if d.size else -1


def _input(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-8, 8, (n,), generator=g).float())
    if n > 10:  # a few edge values: zeros, a huge and a tiny one
        x[3], x[5], x[7] = 0.0, 3.0e4, 1.0e-30
    return x.to(dtype)


def _on(device: str, t: torch.Tensor, offset: bool) -> torch.Tensor:
    """``t`` on ``device``; with ``offset``, a view starting one element into a larger buffer."""
    if not offset:
        return t.clone().to(device)
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=device)
    buf[1:].copy_(t)
    return buf[1:]


def run_case(spec: str, dtype: torch.dtype, with_r: bool, n: int, offset: bool, device: str) -> list[str]:
    """The mismatches of one case (empty: all equal)."""
    c = gradcomp.Codec(spec)
    key = KEY if c.properties["keyed"] else None
    x = _input(n, dtype, seed=n * 31 + len(spec))
    r0 = (torch.randn(n, generator=torch.Generator().manual_seed(n + 1)) * 0.01) if with_r else None
    r_cpu = r0.clone() if with_r else None
    p_cpu = c.encode(x, residual=r_cpu, divisor=2.0, key=key)
    r_dev = _on(device, r0, offset) if with_r else None
    p_dev = c.encode(_on(device, x, offset), residual=r_dev, divisor=2.0, key=key)
    if device == "cuda":
        torch.cuda.synchronize()
    bad = []
    layout = c.layout(n, str(dtype).replace("torch.", ""))
    d = _first_diff(p_dev, p_cpu)
    if d >= 0:
        bad.append(f"packet byte {d} ({_section_of(layout, d)}) cpu {int(p_cpu[d])} {device} {int(p_dev.cpu()[d])}")
    if with_r:
        d = _first_diff(r_dev, r_cpu)
        if d >= 0:
            bad.append(f"residual element {d // 4}")
    init = torch.randn(n, generator=torch.Generator().manual_seed(n + 2))
    out_cpu = c.decode(p_cpu, out=init.clone(), accumulate=True, alpha=0.5)
    out_dev = c.decode(p_cpu.to(device), out=_on(device, init, offset), accumulate=True, alpha=0.5)
    d = _first_diff(out_dev, out_cpu)
    if d >= 0:
        bad.append(f"decode element {d // 4}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="also write the lines to this file")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not (gradcomp.build_info()["cuda"] and torch.cuda.is_available()):
        print(f"smoke: no CUDA (gradcomp cuda={gradcomp.build_info()['cuda']}, "
              f"torch.cuda.is_available()={torch.cuda.is_available()})")
        return 2
    specs = [s for info in gradcomp.codecs() for s in info["examples"]]
    sizes = [1, 4097] if a.quick else [1, 4097, (1 << 20) + 3]
    lines, failed, t0 = [], 0, time.monotonic()
    for spec in specs:
        for dtype in (torch.float32, torch.bfloat16):
            for with_r in (True, False):
                for n in sizes:
                    for offset in (False, True):
                        case = (f"{spec} {str(dtype)[6:]} {'residual' if with_r else 'no-residual'} n={n} "
                                f"{'offset+1' if offset else 'aligned'}")
                        try:
                            bad = run_case(spec, dtype, with_r, n, offset, a.device)
                        except Exception as e:  # a raise is a failure of this case, not of the matrix
                            bad = [f"raised {type(e).__name__}: {e}"]
                        failed += bool(bad)
                        line = f"{'FAIL' if bad else 'ok  '} {case}" + (": " + "; ".join(bad) if bad else "")
                        lines.append(line)
                        print(line, flush=True)
    summary = (f"smoke ({a.device} vs cpu): {len(lines)} cases, {failed} failed, "
               f"{len(specs)} specs, {time.monotonic() - t0:.1f} s")
    print(summary)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines + [summary]) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
