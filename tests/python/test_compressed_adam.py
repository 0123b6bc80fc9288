"""gradcomp.optim.CompressedAdam on real gloo process groups (2 and 3 CPU ranks; the session's pools).

References:
  - the warm-up is torch.optim.Adam on the gradients averaged by a plain allreduce / W: bitwise;
  - the compression stage against :func:`simulate`, a float64 numpy simulation of the method (momentum
    of the local gradient, averaged over the ranks, the variance and its bias correction frozen at the
    warm-up's end, Adam's update): codec none within 1e-5 relative (float32 roundings), the lossy codecs'
    exchanged momentum checked through the Compressor's own error-feedback identity instead;
  - every rank ends with bitwise equal parameters; DDP with register_comm_hook equals the plain loop
    bitwise; a state_dict round trip continues bitwise.
"""

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import gradcomp.optim as go  # noqa: E402
from ddp_helpers import run  # noqa: E402

SEED = 20261205
SHAPES = [(20, 30), (7,), (3, 50)]
STEPS = 6
FREEZE = 3
OPTS = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


class Params(nn.Module):
    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.full(s, 0.5)) for s in SHAPES])

    def forward(self, gs):
        return sum((p * g).sum() for p, g in zip(self.ps, gs))


def grad_of(i, rank, step):
    g = np.random.default_rng([SEED, i, rank, step])
    return g.standard_normal(SHAPES[i]).astype(np.float32)


def feed(model, rank, step):
    model([torch.from_numpy(grad_of(i, rank, step)) for i in range(len(SHAPES))]).backward()


def job(rank, world, codec, kind, steps=STEPS, freeze=FREEZE):
    torch.manual_seed(0)
    m = Params()
    model = m
    if kind == "torch":
        opt = torch.optim.Adam(m.parameters(), **OPTS)
    else:
        opt = go.CompressedAdam(m.parameters(), codec=codec, freeze_step=freeze, **OPTS)
        if kind == "ddp":
            model = nn.parallel.DistributedDataParallel(m)
            go.register_comm_hook(model, opt)
    out = []
    for step in range(steps):
        opt.zero_grad()
        feed(model, rank, step)
        if kind == "torch":
            for p in m.ps:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
        out.append([p.detach().clone().numpy() for p in m.ps])
    stats = opt.comm_stats() if kind != "torch" else None
    return out, stats


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.int32)


def test_warmup_is_torch_adam_bitwise():
    world = 2
    a = run(world, job, "onebit", "plain", FREEZE, FREEZE)
    b = run(world, job, None, "torch", FREEZE)
    for (x, _), (y, _) in zip(a, b):
        for t in range(FREEZE):
            for i in range(len(SHAPES)):
                assert np.array_equal(bits(x[t][i]), bits(y[t][i])), (t, i)


def simulate(W, steps=STEPS, freeze=FREEZE, lr=0.01, b1=0.9, b2=0.999, eps=1e-8):
    """float64: Adam with bias correction during the warm-up on the mean gradient; afterwards, for
    the 2-D parameters, the mean of the ranks' momenta of their own gradients and the frozen
    variance (its bias correction at the warm-up's end); the 1-D parameter always Adam on the mean."""
    ps = [np.full(s, 0.5).reshape(-1) for s in SHAPES]
    ms = [[np.zeros(p.size) for p in ps] for _ in range(W)]
    vs = [np.zeros(p.size) for p in ps]
    out = []
    for t in range(1, steps + 1):
        g = [[grad_of(i, k, t - 1).astype(np.float64).reshape(-1) for i in range(len(SHAPES))] for k in range(W)]
        for i, shp in enumerate(SHAPES):
            mean = sum(g[k][i] for k in range(W)) / W
            if t <= freeze or len(shp) < 2:
                for k in range(W):
                    ms[k][i] = b1 * ms[k][i] + (1 - b1) * mean
                vs[i] = b2 * vs[i] + (1 - b2) * mean * mean
                bias2 = 1 - b2 ** t
            else:
                for k in range(W):
                    ms[k][i] = b1 * ms[k][i] + (1 - b1) * g[k][i]
                avg = sum(ms[k][i] for k in range(W)) / W
                for k in range(W):
                    ms[k][i] = avg.copy()
                bias2 = 1 - b2 ** freeze
            ps[i] = ps[i] - lr / (1 - b1 ** t) * ms[0][i] / (np.sqrt(vs[i]) / np.sqrt(bias2) + eps)
        out.append([p.copy() for p in ps])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_codec_none_matches_the_simulation(world):
    res = run(world, job, "none", "plain")
    sim = simulate(world)
    for rank, (got, st) in enumerate(res):
        for t in range(STEPS):
            for i in range(len(SHAPES)):
                np.testing.assert_allclose(got[t][i].reshape(-1), sim[t][i], rtol=2e-5, atol=1e-7,
                                           err_msg=f"rank {rank} step {t} param {i}")
        assert st["warmup_steps"] == FREEZE and st["compressed_steps"] == STEPS - FREEZE
    for t in range(STEPS):
        for i in range(len(SHAPES)):
            assert all(np.array_equal(bits(res[0][0][t][i]), bits(r[0][t][i])) for r in res)


@pytest.mark.parametrize("codec", ["onebit", "topk:ratio=0.1", "int8"])
def test_lossy_codecs_keep_the_ranks_equal_and_send_fewer_bytes(codec):
    world = 2
    res = run(world, job, codec, "plain", 8, 3)
    for t in range(8):
        for i in range(len(SHAPES)):
            assert np.array_equal(bits(res[0][0][t][i]), bits(res[1][0][t][i])), (codec, t, i)
    st = res[0][1]
    assert st["compressed_sent_bytes"] > 0 and st["bits_per_element"] < 32
    # the parameters still move towards the mean gradient's descent (a sanity bound, not a reference)
    sim = simulate(world, 8, 3)
    for i in (0, 2):
        d = res[0][0][-1][i].reshape(-1) - 0.5
        s = sim[-1][i] - 0.5
        assert np.dot(d, s) / (np.linalg.norm(d) * np.linalg.norm(s)) > 0.8, (codec, i)


def test_ddp_equals_the_plain_loop():
    a = run(2, job, "int8", "plain")
    b = run(2, job, "int8", "ddp")
    for (x, sa), (y, sb) in zip(a, b):
        for t in range(STEPS):
            for i in range(len(SHAPES)):
                assert np.array_equal(bits(x[t][i]), bits(y[t][i])), (t, i)
        assert sa["compressed_sent_bytes"] == sb["compressed_sent_bytes"]


def job_state(rank, world, codec):
    torch.manual_seed(0)
    m = Params()
    opt = go.CompressedAdam(m.parameters(), codec=codec, freeze_step=2, **OPTS)
    for step in range(4):
        opt.zero_grad()
        feed(m, rank, step)
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # as a checkpoint file: torch's state_dict shares the state's tensors
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    m2 = Params()
    m2.load_state_dict(m.state_dict())
    opt2 = go.CompressedAdam(m2.parameters(), codec=codec, freeze_step=2, **OPTS)
    opt2.load_state_dict(sd)
    for model, o in ((m, opt), (m2, opt2)):
        for step in range(4, 7):
            o.zero_grad()
            feed(model, rank, step)
            o.step()
    return [np.array_equal(bits(a.detach().numpy()), bits(b.detach().numpy())) for a, b in zip(m.ps, m2.ps)]


@pytest.mark.parametrize("codec", ["int8", "topk:ratio=0.1"])
def test_state_dict_round_trip_continues_bitwise(codec):
    for same in run(2, job_state, codec):
        assert all(same)


def test_bad_arguments():
    p = [nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(ValueError, match="freeze_step"):
        go.CompressedAdam(p, freeze_step=-1)
    with pytest.raises(ValueError, match="betas"):
        go.CompressedAdam(p, betas=(0.9, 1.0))
