"""Top-k on a bfloat16 tensor of 2^31 + 64 elements (docs/contracts.md section 7: built from zeros with
planted values, checked against the known answer). Runs by default; deselect with -m 'not large'.

Memory: the tensor is 4 GiB; the CPU workspace (candidate buffer) about 1.6 GB; nothing else of
that size is made (no float32 copy, no residual, decode accumulates into the input itself).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest
import torch

import gradcomp

sys.path.insert(0, os.path.dirname(__file__))
from test_codec_support import DTYPE_CODE, MAGIC, cast_bits, fnv1a32, header, topk_indices  # noqa: E402

N = (1 << 31) + 64
B = 1 << 31

# index -> value (all exact in bfloat16). The largest |x| sit past 2^31; the 8th place is a tie
# between -2.0 at B+5 and 2.0 at B+20 (lowest index wins); 2.0 before B would win it, so the
# ties before B are smaller (1.5).
PLANTED = {
    B + 11: -8.0,
    B + 10: 7.0,
    B + 40: 6.5,
    B + 63: -6.5,   # last element
    B - 1: -4.0,    # last index below 2^31
    5: 3.0,
    1000: 2.5,
    B + 5: -2.0,
    B + 20: 2.0,
    B + 21: -2.0,
    1 << 30: 1.5,
    0: -1.5,
    B - 5: 1.0,
    B + 1: -0.0,
}
K = 8


@pytest.mark.large
def test_topk_bfloat16_past_2_31():
    t0 = time.monotonic()
    try:
        x = torch.zeros(N, dtype=torch.bfloat16)
    except RuntimeError as e:  # pragma: no cover - machine without 4 GiB to spare
        pytest.skip(f"cannot allocate a {N}-element bfloat16 tensor: {e}")
    try:
        idx = torch.tensor(list(PLANTED), dtype=torch.int64)
        vals = torch.tensor(list(PLANTED.values()), dtype=torch.float32).to(torch.bfloat16)
        x[idx] = vals

        # reference on the planted values only (every other element is 0.0 and cannot enter the
        # top 8: there are more than 8 non-zero values)
        order = np.argsort(idx.numpy(), kind="stable")
        pidx = idx.numpy()[order]
        pval = vals.float().numpy()[order]
        sel = pidx[topk_indices(pval, K)]
        exp_bits = cast_bits(np.array([PLANTED[int(i)] for i in sel], np.float32), "bfloat16")
        assert sel.tolist() == [5, 1000, B - 1, B + 5, B + 10, B + 11, B + 40, B + 63]  # by hand

        c = gradcomp.Codec(f"topk:k={K}")
        nb = c.packet_bytes(N, torch.bfloat16)
        assert nb == 32 + 32 + 16  # 8 u32 indices, 8 bfloat16 values
        out = torch.zeros(nb + 16, dtype=torch.uint8)
        off = (-out.data_ptr()) % 16
        out = out[off:off + nb]
        p = c.encode(x, out=out)
        assert p is out
        b = out.numpy()
        assert header(b) == {
            "magic": MAGIC, "version": 1, "codec_id": 4, "input_dtype": DTYPE_CODE["bfloat16"],
            "wire_dtype": DTYPE_CODE["bfloat16"], "index_dtype": DTYPE_CODE["uint32"], "flags": 0,
            "spec_hash": fnv1a32("topk:k=8"), "numel": N, "main": K,
        }
        np.testing.assert_array_equal(b[32:64].view("<u4").astype(np.int64), sel)
        np.testing.assert_array_equal(b[64:80].view("<u2"), exp_bits)

        # decode with accumulate, alpha=-1, into x itself: the sent values cancel exactly
        # (the small tests check whole decode outputs; here the planted entries and their
        # neighbours, to spare a full pass over 4 GiB)
        assert c.decode(p, out=x, accumulate=True, alpha=-1.0) is x
        near = torch.tensor(sorted({j for i in PLANTED for j in range(i - 2, i + 3) if 0 <= j < N}))
        got = dict(zip(near.tolist(), x[near].float().tolist()))
        sent = set(sel.tolist())
        for j, v in got.items():
            assert v == (0.0 if j in sent else PLANTED.get(j, 0.0)), (j, v)
    finally:
        del x
    # docs/contracts.md section 7: no timing assertions in unit tests; this one takes ~10-25 s on 2 cores
    log_time = time.monotonic() - t0
    print(f"2^31 + 64 element top-k test: {log_time:.1f} s")
