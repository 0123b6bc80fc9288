"""Side-by-side CPU benchmark: gradcomp codecs against the torch call a user would otherwise make.

Rows (float32 input of --numel elements, default 2^24, normal(0, 1), fixed seed):
  topk     gradcomp ``topk:ratio=R`` encode   vs  ``torch.topk(x.abs(), k, sorted=False)``
  fp16     gradcomp ``fp16`` encode           vs  a cast into a preallocated float16 tensor
  bf16     gradcomp ``bf16`` encode           vs  a cast into a preallocated bfloat16 tensor
  fp8+ef   gradcomp ``fp8`` (e4m3, block 128) encode with error feedback  vs  the same step as
           torch ops: x' = x + r, per-block amax, d = amax / 448, ``(x' / d).to(float8_e4m3fn)``,
           r = x' - code * d (preallocated buffers, in-place ops where torch has them)
  int8+ef  gradcomp ``int8`` (block 128) with error feedback  vs  torch: x' = x + r, per-block
           amax, d = amax / 127, ``round(x' / d).clamp(-127, 127).to(int8)``, r = x' - code * d
  fp8      gradcomp ``fp8`` without error feedback vs  the torch sequence without the residual
  onebit+ef gradcomp ``onebit`` (one l2 scale) with error feedback  vs  DeepSpeed's compressed
           allreduce worker step as torch ops: x' = x + r, s = ||x'|| / sqrt(n), r = x' - s * sign,
           the signs packed MSB first (a bool -> uint8 view times bit weights, summed per byte)
and the floor: ``torch`` copy of the same buffer (bytes read + written over time), measured in
the same run. GB/s counts the compulsory traffic (x read + packet written, + the residual read
and written with error feedback). Median of --reps runs
after one warm-up. Usage: python bench/side_by_side.py [--threads 1 2] [--numel N] [--ratio R]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch

import gradcomp


def timeit(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    n = args.numel
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, generator=g)
    y = torch.empty_like(x)
    k = min(n, max(1, math.ceil(args.ratio * n)))
    print(f"gradcomp {gradcomp.build_info()['version']}, torch {torch.__version__}, n = {n}, k = {k}")
    B = 128
    assert n % B == 0, "--numel must be a multiple of 128 (the quantizer rows' block)"
    r0 = torch.randn(n, generator=g) * 0.01
    print(f"{'threads':>7} {'kernel':<18} {'ms':>9} {'GB/s':>7} {'of copy':>8} {'baseline':<34} {'ms':>9} {'speedup':>8}")
    for th in args.threads:
        torch.set_num_threads(th)
        gradcomp.set_num_threads(th)
        t_copy = timeit(lambda: y.copy_(x), args.reps)
        copy_gbps = 2 * 4 * n / t_copy / 1e9
        print(f"{th:>7} {'copy (floor)':<18} {t_copy * 1e3:9.2f} {copy_gbps:7.2f} {1.0:8.2f}")
        # Baselines write into preallocated outputs too, so no side pays for fresh pages.
        xa = torch.empty_like(x)
        tv, ti = torch.empty(k), torch.empty(k, dtype=torch.long)
        h16, b16 = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
        rows = [
            ("topk", f"topk:ratio={args.ratio}",
             lambda: torch.topk(torch.abs(x, out=xa), k, sorted=False, out=(tv, ti)),
             "torch.topk(x.abs(), k, sorted=False)"),
            ("fp16", "fp16", lambda: h16.copy_(x), "h16.copy_(x) (a cast)"),
            ("bf16", "bf16", lambda: b16.copy_(x), "b16.copy_(x) (a cast)"),
        ]
        # The block quantizers as a user would write them in torch (the residual r updated in place).
        xp, yq, dd = torch.empty(n), torch.empty(n), torch.empty(n)
        amax, sc = torch.empty(n // B), torch.empty(n // B)
        q8, qi = torch.empty(n, dtype=torch.float8_e4m3fn), torch.empty(n, dtype=torch.int8)
        r_t = r0.clone()

        def torch_quant(mx: float, fp8: bool, residual: bool):
            if residual:
                torch.add(x, r_t, out=xp)
                src = xp
            else:
                src = x
            torch.amax(torch.abs(src, out=yq).view(-1, B), dim=1, out=amax)
            torch.div(amax, mx, out=sc).clamp_(min=torch.finfo(torch.float32).tiny)
            torch.div(src.view(-1, B), sc[:, None], out=yq.view(-1, B))
            if fp8:
                q8.copy_(yq)
                dd.copy_(q8)
            else:
                qi.copy_(yq.round_().clamp_(-127, 127))
                dd.copy_(qi)
            if residual:
                torch.sub(src.view(-1, B), dd.view(-1, B).mul_(sc[:, None]), out=r_t.view(-1, B))

        wts = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
        packed = torch.empty(n // 8, dtype=torch.uint8)
        sgn = torch.empty(n)

        def torch_onebit():
            torch.add(x, r_t, out=xp)
            s = torch.linalg.vector_norm(xp) / math.sqrt(n)
            pos = xp >= 0  # DeepSpeed: sign(x) + 1 cast to bool (+1 for -0.0; NaN aside)
            torch.sum(pos.view(-1, 8).to(torch.uint8) * wts, dim=1, dtype=torch.uint8, out=packed)
            torch.where(pos, s, -s, out=sgn)
            torch.sub(xp, sgn, out=r_t)

        def numpy_onebit():  # what a CPU user without gradcomp calls: torch's norm, numpy.packbits
            s = torch.linalg.vector_norm(x) / math.sqrt(n)
            np.packbits((x >= 0).numpy())  # MSB first, as the codec
            return s

        rows += [
            ("onebit", "onebit", numpy_onebit, "torch norm + numpy.packbits"),
            ("onebit+ef", "onebit", torch_onebit, "torch: norm, sign, packbits, r = x'-D"),
            ("fp8+ef", "fp8", lambda: torch_quant(448.0, True, True), "torch: amax, div, to(e4m3fn), r = x'-D"),
            ("int8+ef", "int8", lambda: torch_quant(127.0, False, True), "torch: amax, div, round, to(int8), r"),
            ("fp8", "fp8", lambda: torch_quant(448.0, True, False), "torch: amax, div, to(e4m3fn)"),
        ]
        for name, spec, base, base_name in rows:
            c = gradcomp.Codec(spec)
            out = torch.empty(c.packet_bytes(n, "float32") + 16, dtype=torch.uint8)
            off = (-out.data_ptr()) % 16
            out = out[off : off + c.packet_bytes(n, "float32")]  # packets are 16-byte aligned
            if name.endswith("+ef"):
                r_g = r0.clone()
                t = timeit(lambda: c.encode(x, residual=r_g, out=out), args.reps)
            else:
                t = timeit(lambda: c.encode(x, out=out), args.reps)
            t_base = timeit(base, max(1, args.reps // 2) if name == "topk" else args.reps)
            gbps = (4 * n + out.numel() + (8 * n if name.endswith("+ef") else 0)) / t / 1e9  # + r read, written
            print(f"{th:>7} {name:<18} {t * 1e3:9.2f} {gbps:7.2f} {gbps / copy_gbps:8.2f} "
                  f"{base_name:<34} {t_base * 1e3:9.2f} {t_base / t:8.1f}x")
        # onebit decode into float32 against numpy.unpackbits + torch.where (the same +-s values)
        c = gradcomp.Codec("onebit")
        pk = c.encode(x)
        od, ob = torch.empty(n), torch.empty(n)
        bits_np = np.packbits((x >= 0).numpy())
        s1 = torch.linalg.vector_norm(x) / math.sqrt(n)
        sp, sn = s1.reshape(()), (-s1).reshape(())

        def numpy_decode():
            torch.where(torch.from_numpy(np.unpackbits(bits_np)[:n]).bool(), sp, sn, out=ob)

        t = timeit(lambda: c.decode(pk, out=od), args.reps)
        t_base = timeit(numpy_decode, args.reps)
        gbps = (4 * n + pk.numel()) / t / 1e9
        print(f"{th:>7} {'onebit decode':<18} {t * 1e3:9.2f} {gbps:7.2f} {gbps / copy_gbps:8.2f} "
              f"{'numpy.unpackbits + torch.where':<34} {t_base * 1e3:9.2f} {t_base / t:8.1f}x")


if __name__ == "__main__":
    main()
