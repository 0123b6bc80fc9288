"""gradcomp.deepspeed.OnebitBackend against a pure-torch re-implementation of DeepSpeed's
compressed_allreduce (docs/contracts.md section 6.1) written here, not calling gradcomp:
padding to Np, buf += worker_error, scale = ||buf|| / sqrt(Np) over the padded length, the sign rule
(sign(x) + 1 cast to bool: +-0.0 and NaN are +1), worker_error = buf - scale * sign, the
all-to-all of sign chunks with the all-gather of scales, the server sum sign * (scale_j * (1/W))
over ranks, + server_error, its scale and error, the all-gather and the output. Real gloo groups,
W = 2 and 3, several calls in a row so both error buffers carry over, and DeepSpeed's golden
example (W = 2, n = 13). Every rank's result is bitwise identical. Against the reference: the
signs are equal; the scales are the RMS summed in binary64 here and in float32/float64 by
torch.norm, so the results agree to a relative 2^-20 and the error buffers to 2^-20 of the
magnitudes involved (stated tolerances)."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from ddp_helpers import run  # noqa: E402, F401

TOL = 2.0 ** -20


def ds_sign(x):
    """DeepSpeed's s(x): sign(x) + 1 cast to bool, then 2 (b - 0.5): +1 for +-0.0 and NaN."""
    return (torch.sign(x) + 1).bool().float() * 2 - 1


def reference_step(bufs, werrs, serrs):
    """One call of DeepSpeed's compressed_allreduce on all W ranks at once (lists of tensors, one
    per rank; the errors are updated in place). Returns the result of each rank (all equal)."""
    W = len(bufs)
    Np = werrs[0].numel()
    C = Np // W
    padded = []
    scales = []
    signs = []
    for i in range(W):
        b = torch.zeros(Np)
        b[: bufs[i].numel()] = bufs[i].reshape(-1)
        b += werrs[i]
        s = torch.norm(b) / math.sqrt(Np)
        sg = ds_sign(b)
        werrs[i].copy_(b - s * sg)
        padded.append(b)
        scales.append(s)
        signs.append(sg)
    server_scales, server_signs = [], []
    for r in range(W):
        comp = torch.stack([signs[j][r * C:(r + 1) * C] * (scales[j] * (1.0 / W)) for j in range(W)]).sum(0)
        comp += serrs[r]
        s = torch.norm(comp) / math.sqrt(C)
        sg = ds_sign(comp)
        serrs[r].copy_(comp - s * sg)
        server_scales.append(s)
        server_signs.append(sg)
    out = torch.cat([server_signs[j] * server_scales[j] for j in range(W)])
    return [out[: bufs[i].numel()].reshape(bufs[i].shape) for i in range(W)]


GOLDEN = [[-0.0, .375, -1, .25, -.625, .5, .25, .75, -.25, 2.125, .125, -.25, -.125],
          [-1.375, -.125, .875, -.25, .625, -0.0, -1.5, -.25, .875, -.625, .625, .25, .125]]


def job_against_reference(rank, world, n, calls, golden):
    from gradcomp.deepspeed import OnebitBackend
    backend = OnebitBackend()
    assert backend.size == world and backend.rank == rank
    div = 8 * world // math.gcd(8, world)  # DeepSpeed's optimizers: a multiple of W * lcm(W, 8)
    Np = ((n + world * div - 1) // (world * div)) * (world * div)
    werr, serr = torch.zeros(Np), torch.zeros(Np // world)
    ref_w = [torch.zeros(Np) for _ in range(world)]
    ref_s = [torch.zeros(Np // world) for _ in range(world)]
    outs = []
    for call in range(calls):
        if golden:
            xs = [torch.tensor(g) for g in GOLDEN]
        else:
            g = torch.Generator().manual_seed(1000 * call + n)
            xs = [torch.randn(n, generator=g) for _ in range(world)]
        want = reference_step([x.clone() for x in xs], ref_w, ref_s)
        x = xs[rank].clone()
        got = backend.compressed_allreduce(x, werr, serr, 0)
        assert got.shape == xs[rank].shape
        w = want[rank]
        assert torch.equal(torch.sign(got), torch.sign(w)), f"call {call}: signs differ"
        assert torch.allclose(got, w, rtol=TOL, atol=0), f"call {call}: {got[:4]} vs {w[:4]}"
        # errors are differences of near-equal values: compare on the scale of the values involved
        for e, r, what in ((werr, ref_w[rank], "worker"), (serr, ref_s[rank], "server")):
            d = float((e - r).abs().max())
            assert d <= TOL * (float(r.abs().max()) + float(w.abs().max())), f"call {call}: {what} error off by {d}"
        if n == Np:
            assert got.data_ptr() == x.data_ptr()  # written in place, as DeepSpeed does
        allr = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(allr, got)
        assert all(torch.equal(a.view(torch.int32), got.view(torch.int32)) for a in allr), "ranks differ"
        outs.append(got.tolist())
    assert float(werr.abs().sum()) > 0
    if rank * (Np // world) < n:  # a chunk of padding only is constant: its server error is exactly 0
        assert float(serr.abs().sum()) > 0
    return outs


@pytest.mark.parametrize("world,n", [(2, 13), (2, 16), (2, 1000), (3, 13), (3, 72), (3, 4099)])
def test_backend_equals_the_reference_over_calls(world, n):
    run(world, job_against_reference, n, 4, False)


def test_golden_example():
    """docs/contracts.md section 6.1: W = 2, n = 13 -> Np = 16; call 1 and call 2 outputs."""
    outs = run(2, job_against_reference, 13, 2, True)
    call1 = [0.2355493, 0.2355493, -0.2355493, 0.2355493, -0.2355493, 0.2355493, 0.2355493, 0.2355493,
             -0.4710879, 0.4710879, 0.4710879, -0.4710879, -0.4710879]
    call2 = [-0.7710573, 0.7710573, 0.7710573, -0.7710573, 0.7710573, 0.7710573, -0.7710573, 0.7710573,
             0.7898301, -0.7898301, 0.7898301, 0.7898301, 0.7898301]
    for rank_out in outs:
        assert rank_out[0] == pytest.approx(call1, abs=1e-6)
        assert rank_out[1] == pytest.approx(call2, abs=1e-6)


F32 = np.float32


def np_scale(x):
    """gradcomp's scale of a float32 vector (docs/contracts.md section 6.1): the RMS, its sum of
    squares exactly rounded in binary64 (math.fsum), divided and rooted in binary64, rounded once
    to float32."""
    return F32(math.sqrt(math.fsum((x.astype(np.float64) ** 2).tolist()) / x.size))


def np_compressed_allreduce(bufs, werrs, serrs):
    """DeepSpeed's compressed_allreduce on all W ranks at once in plain numpy (float32 arrays, one
    per rank; the error buffers are updated in place), step by step as docs/contracts.md section
    6.1 states it: pad, add the worker error, scale and worker error, the sign bits packed MSB
    first (numpy.packbits) and cut into W byte chunks, the all-to-all (a transposition of the
    lists), the server sum in rank order from +0.0 of s * fl(scale_j * fl(1 / W)), the server
    error, the all-gather. Returns the result of each rank (all equal)."""
    W = len(bufs)
    Np = werrs[0].size
    C = Np // W
    inv_w = F32(1.0) / F32(W)  # fl(1 / W)
    sent = []  # rank i: ([W byte chunks], scale)
    for i in range(W):
        b = np.zeros(Np, F32)
        b[: bufs[i].size] = bufs[i].reshape(-1)
        b = b + werrs[i]
        s = np_scale(b)
        plus = ~(b < 0)  # s(x) = +1 for x >= 0, +-0.0 and NaN
        werrs[i][:] = b - np.where(plus, s, -s)
        packed = np.packbits(plus)
        sent.append(([packed[j * C // 8: (j + 1) * C // 8] for j in range(W)], s))
    server = []  # rank r: (packed bits of its chunk, server scale)
    for r in range(W):
        comp = np.zeros(C, F32)
        for j in range(W):
            chunk_bits, s_j = sent[j][0][r], sent[j][1]
            term = F32(s_j * inv_w)
            comp = comp + np.where(np.unpackbits(chunk_bits).astype(bool), term, -term)
        comp = comp + serrs[r]
        ss = np_scale(comp)
        plus = ~(comp < 0)
        serrs[r][:] = comp - np.where(plus, ss, -ss)
        server.append((np.packbits(plus), ss))
    out = np.concatenate([np.where(np.unpackbits(bits_j).astype(bool), s_j, -s_j) for bits_j, s_j in server])
    return [out[: b.size].reshape(b.shape) for b in bufs]


def job_against_numpy(rank, world, sizes, calls):
    """gradcomp.schemes.onebit_allreduce.OnebitAllreduce (the algorithm under OnebitBackend)
    against np_compressed_allreduce: results and both error buffers bitwise, call after call."""
    from gradcomp.schemes.onebit_allreduce import OnebitAllreduce

    allreduce = OnebitAllreduce()
    div = 8 * world // math.gcd(8, world)
    for n in sizes:
        Np = ((n + world * div - 1) // (world * div)) * (world * div)
        werr, serr = torch.zeros(Np), torch.zeros(Np // world)
        ref_w = [np.zeros(Np, F32) for _ in range(world)]
        ref_s = [np.zeros(Np // world, F32) for _ in range(world)]
        for call in range(calls):
            rng = np.random.default_rng([n, call])
            xs = [rng.standard_normal(n).astype(F32) for _ in range(world)]
            for x in xs:  # signed zeros and exact zeros: +1 signs
                x[:: 7] = -0.0
                x[3:: 11] = 0.0
            want = np_compressed_allreduce([x.copy() for x in xs], ref_w, ref_s)[rank]
            x = torch.from_numpy(xs[rank].copy())
            got = allreduce(x, werr, serr).numpy()
            for a, b, what in ((got, want, "result"), (werr.numpy(), ref_w[rank], "worker error"),
                               (serr.numpy(), ref_s[rank], "server error")):
                bad = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
                assert bad.size == 0, f"n={n}, call {call}: {what} differs at {bad[:4]}: {a[bad[:4]]} vs {b[bad[:4]]}"
    return True


def test_onebit_allreduce_equals_a_numpy_simulation():
    """Bitwise (results, worker and server errors) over 3 calls on 2 gloo ranks; n = 13 and 1000
    (padded), 16 (in place) and 5003 (more than one 4096-element reduction tile)."""
    assert run(2, job_against_numpy, [13, 16, 1000, 5003], 3) == [True, True]


def job_edges(rank, world):
    from gradcomp.deepspeed import OnebitBackend
    b = OnebitBackend()
    werr, serr = torch.ones(16), torch.ones(8)
    empty = torch.empty(0)
    assert b.compressed_allreduce(empty, werr, serr, 0) is empty
    assert float(werr.abs().sum()) == 0 and float(serr.abs().sum()) == 0  # zeroed, no communication
    for we, se, what in [(torch.zeros(12), torch.zeros(6), "multiple of 8"),
                         (torch.zeros(16), torch.zeros(7), "server_error has 7"),
                         (torch.zeros(8), torch.zeros(4), "at least"),
                         (torch.zeros(16, dtype=torch.float64), torch.zeros(8), "float32")]:
        with pytest.raises(ValueError, match=what):
            b.compressed_allreduce(torch.ones(13), we, se, 0)
    # not a floating buffer; error buffers checked even for an empty buffer; messages name the fault
    with pytest.raises(ValueError, match="buffer_m is torch.int64; accepted: float32"):
        b.compressed_allreduce(torch.ones(16, dtype=torch.int64), torch.zeros(16), torch.zeros(8), 0)
    with pytest.raises(ValueError, match="float32 tensor on cpu, got torch.int32"):
        b.compressed_allreduce(torch.empty(0), torch.zeros(16, dtype=torch.int32), torch.zeros(8), 0)
    with pytest.raises(ValueError, match=r"with strides \(2,\)"):
        b.compressed_allreduce(torch.ones(13), torch.zeros(32)[::2], torch.zeros(8), 0)
    with pytest.raises(ValueError, match="server_error has 8 elements and worker_error 32"):
        b.compressed_allreduce(torch.ones(13), torch.zeros(32), torch.zeros(8), 0)
    # a float16 buffer: computed in float32, returned in float16
    got = b.compressed_allreduce(torch.ones(16, dtype=torch.float16), torch.zeros(16), torch.zeros(8), 0)
    assert got.dtype == torch.float16 and torch.all(got == 1)
    return True


def test_edges():
    assert run(2, job_edges) == [True, True]


class _Engine:
    """A stand-in for a DeepSpeed engine: the attributes install() reads."""

    def __init__(self, opt, dp_world_size=1):
        self.basic_optimizer = opt
        self.mpu = None
        self.dp_world_size = dp_world_size
        self.enable_backward_allreduce = True


def job_install(rank, world):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.onebit.adam import OnebitAdam as DsAdam
    from deepspeed.runtime.fp16.onebit.lamb import OnebitLamb as DsLamb

    import gradcomp.optim as go
    from gradcomp.deepspeed import OnebitBackend, install

    out = {}
    # another optimizer: a TypeError naming it and what is accepted
    with pytest.raises(TypeError, match=r"SGD; accepted: DeepSpeed's OnebitAdam, ZeroOneAdam, OnebitLamb"):
        install(_Engine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)))
    with pytest.raises(TypeError, match="has no optimizer"):
        install(_Engine(None))
    with pytest.raises(TypeError, match="got the optimizer OnebitAdam; accepted: the engine"):
        install(go.OnebitAdam([torch.nn.Parameter(torch.zeros(2))]))
    # DeepSpeed's optimizers (built without their constructor, which needs an engine and cupy)
    for cls in (DsAdam, DsLamb):
        opt = object.__new__(cls)
        opt.initialize, opt.size, opt.comm_backend_handle = False, world, None
        b = install(_Engine(opt, world))
        out[cls.__name__] = isinstance(b, OnebitBackend) and opt.comm_backend_handle is b and b.size == world
        opt.comm_backend_handle, opt.size = None, world + 1  # padded for another world size
        with pytest.raises(ValueError, match=f"world size {world}, {cls.__name__} padded its buffers for {world + 1}"):
            install(_Engine(opt, world))
        opt.size, opt.initialize = world, True  # already stepped
        with pytest.raises(RuntimeError, match="already stepped"):
            install(_Engine(opt, world))
    # gradcomp's optimizer: bound; a mismatching data-parallel size is refused
    mine = go.OnebitAdam([torch.nn.Parameter(torch.zeros(3))], freeze_step=2)
    eng = _Engine(mine, world)
    assert install(eng) is mine and not mine.average_gradients and eng.enable_backward_allreduce
    with pytest.raises(ValueError, match=f"data-parallel world size is {world + 1}"):
        install(_Engine(go.OnebitAdam([torch.nn.Parameter(torch.zeros(3))]), world + 1))
    # the engine's flag follows the stage: off once the step count reaches freeze_step
    p = mine.param_groups[0]["params"][0]
    p.grad = torch.ones(3)
    mine.step()
    mine.step()
    out["engine_off_after_freeze"] = mine.compression_stage and not eng.enable_backward_allreduce
    # world size 1: DeepSpeed's backend still compresses (its optimizers skip the call): +-scale
    if world == 1:
        b = OnebitBackend()
        x = torch.tensor([1.0, -2.0, 3.0, -4.0, 0.0, -0.0, 5.0, -6.0])
        got = b.compressed_allreduce(x.clone(), torch.zeros(8), torch.zeros(8), 0)
        s = float(torch.norm(x) / math.sqrt(8))
        sign = torch.tensor([1.0, -1, 1, -1, 1, 1, 1, -1])
        s2 = float(torch.norm(s * sign) / math.sqrt(8))
        out["w1"] = torch.allclose(got, s2 * sign, rtol=2 ** -20)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_install(world):
    for r in run(world, job_install):
        assert r and all(r.values()), r
