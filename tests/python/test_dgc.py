"""gradcomp.optim.DGC (Deep Gradient Compression, Lin et al. ICLR 2018) on real gloo process groups (2 and
3 CPU ranks; the session's pools) against :func:`simulate`, an independent numpy simulation of DGC's
algorithm written here: momentum correction (plain and Nesterov), exact top-k of the accumulated velocity
by |v| with ties to the lower index, momentum factor masking, the rank-order float32 sum of the sparse
vectors divided by W, weight decay added to the update, the density warm-up, the dense fallback when a
top-k packet would be as large as the parameter, and torch.optim.SGD's momentum for the 1-D parameters.

Bitwise (floats as integer views): parameters, momenta and velocities on every rank after every step.
The 1-D parameter's gradients are multiples of 2^-4 so that gloo's allreduce sums them exactly in any
order. Local gradient clipping is compared within 1e-6 relative (torch's float64 norm and numpy's may
differ in the last bit before the factor is rounded to float32).
"""

import math

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import gradcomp.optim as go  # noqa: E402
from ddp_helpers import run  # noqa: E402

SEED = 20261204
SHAPES = [(20, 30), (7,), (3, 50)]
STEPS = 6
WARMUP = [(0, 0.5), (2, 0.25)]  # 0.5 of 600: the top-k packet would be larger than the parameter: dense


class Params(nn.Module):
    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in SHAPES])

    def forward(self, gs):
        return sum((p * g).sum() for p, g in zip(self.ps, gs))


def grad_of(i, rank, step):
    g = np.random.default_rng([SEED, i, rank, step])
    if len(SHAPES[i]) < 2:
        return (g.integers(-32, 33, size=SHAPES[i]) / 16.0).astype(np.float32)
    x = g.standard_normal(SHAPES[i]).astype(np.float32)
    return (x * np.float32(2.0) ** g.integers(-2, 3)).astype(np.float32)


def job(rank, world, opts, steps=STEPS, ddp=False):
    torch.manual_seed(0)
    m = Params()
    model = m
    opt = go.DGC(m.parameters(), **opts)
    if ddp:
        model = nn.parallel.DistributedDataParallel(m)
        go.register_comm_hook(model, opt)
    out = []
    for step in range(steps):
        opt.zero_grad()
        model([torch.from_numpy(grad_of(i, rank, step)) for i in range(len(SHAPES))]).backward()
        opt.step()
        st = [{k: v.clone().numpy() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)} for p in m.ps]
        out.append(([p.detach().clone().numpy() for p in m.ps], st))
    return out, opt.comm_stats()


def f32(a):
    return np.asarray(a, dtype=np.float32)


def topk_packet_bytes(k):
    return 32 + 2 * (-(-4 * k // 16) * 16)  # header, k uint32 indices, k float32 values, each 16-aligned


def simulate(W, lr, momentum, nesterov, wd, density, warmup, warmup_steps, clip=None, steps=STEPS):
    m_, lr_, wd_ = np.float32(momentum), np.float32(lr), np.float32(wd)
    ps = [np.zeros(s, np.float32).reshape(-1) for s in SHAPES]
    u = [[None] * len(SHAPES) for _ in range(W)]
    v = [[np.zeros(int(np.prod(s)), np.float32) for s in SHAPES] for _ in range(W)]
    out = []
    for t in range(steps):
        d = density
        if t < warmup_steps:
            for s, dd in warmup:
                if s <= t:
                    d = dd
        g = [[grad_of(i, k, t).reshape(-1) for i in range(len(SHAPES))] for k in range(W)]
        if clip is not None:
            for k in range(W):
                norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g[k]))
                coef = np.float32(min(1.0, (clip / math.sqrt(W)) / (norm + 1e-6)))
                g[k] = [f32(x * coef) for x in g[k]]
        for i, shp in enumerate(SHAPES):
            n = int(np.prod(shp))
            if len(shp) < 2:  # dense: torch.optim.SGD on the average
                avg = g[0][i].copy()
                for k in range(1, W):
                    avg = f32(avg + g[k][i])
                avg = f32(avg / np.float32(W))
                dd = f32(avg + f32(ps[i] * wd_)) if wd else avg
                for k in range(W):
                    u[k][i] = dd.copy() if u[k][i] is None else f32(f32(u[k][i] * m_) + dd)
                step = f32(dd + f32(u[0][i] * m_)) if nesterov else u[0][i]
                ps[i] = f32(ps[i] - f32(step * lr_))
                continue
            kk = min(n, max(1, math.ceil(d * n)))
            sent = []
            for k in range(W):
                uu = u[k][i] if u[k][i] is not None else np.zeros(n, np.float32)
                if nesterov:
                    uu = f32(f32(uu + g[k][i]) * m_)
                    v[k][i] = f32(f32(v[k][i] + uu) + g[k][i])
                else:
                    uu = f32(f32(uu * m_) + g[k][i])
                    v[k][i] = f32(v[k][i] + uu)
                if W > 1 and topk_packet_bytes(kk) >= 4 * n:
                    sent.append(("dense", v[k][i].copy()))
                    v[k][i] = np.zeros(n, np.float32)
                    uu = np.zeros(n, np.float32)
                else:
                    idx = np.argsort(-np.abs(v[k][i]), kind="stable")[:kk]
                    sent.append(("sparse", (idx, v[k][i][idx].copy())))
                    v[k][i][idx] = 0
                    uu[idx] = 0
                u[k][i] = uu
            acc = np.zeros(n, np.float32)
            for kind, x in sent:
                if kind == "dense":
                    acc = f32(acc + x)  # W = 2 here: the allreduce's sum of two terms
                else:
                    idx, vals = x
                    acc[idx] = f32(acc[idx] + vals)
            G = f32(acc / np.float32(W))
            upd = f32(G + f32(ps[i] * wd_)) if wd else G
            ps[i] = f32(ps[i] - f32(upd * lr_))
        out.append(([p.copy() for p in ps], [[x if x is not None else None for x in u[k]] for k in range(W)],
                    [[x.copy() for x in v[k]] for k in range(W)]))
    return out


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.int32)


def check(res, sim, W, exact=True, what=""):
    for rank, (got, _) in enumerate(res):
        for t in range(len(sim)):
            ps, st = got[t]
            sp, su, sv = sim[t]
            for i, shp in enumerate(SHAPES):
                a, b = ps[i].reshape(-1), sp[i]
                if exact:
                    assert np.array_equal(bits(a), bits(b)), f"{what} rank {rank} step {t} param {i}: {a[:4]} vs {b[:4]}"
                else:
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=f"{what} rank {rank} step {t} param {i}")
                if len(shp) >= 2 and exact:
                    assert np.array_equal(bits(st[i]["momentum_buffer"]), bits(su[rank][i])), (what, rank, t, i)
                    assert np.array_equal(bits(st[i]["velocity"]), bits(sv[rank][i])), (what, rank, t, i)


OPTS = dict(lr=0.1, momentum=0.9, weight_decay=0.01, density=0.1, warmup=WARMUP, warmup_steps=4)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_matches_the_simulation(world, nesterov):
    opts = dict(OPTS, nesterov=nesterov)
    if world == 3:  # the dense fallback's allreduce sums three terms in gloo's order: warm up sparse
        opts["warmup"] = [(0, 0.25)]
    res = run(world, job, opts)
    sim = simulate(world, 0.1, 0.9, nesterov, 0.01, 0.1, opts["warmup"], 4)
    check(res, sim, world, what=f"W={world} nesterov={nesterov}")
    st = res[0][1]
    assert st["compressed_sent_bytes"] > 0 and st["dense_sent_bytes"] > 0
    # top-k at 10% of 600 and 150 elements after the warm-up: well below float32's 32 bits per element
    assert st["bits_per_element"] < 32


def test_dgc_local_gradient_clipping():
    opts = dict(OPTS, clip=0.5)
    res = run(2, job, opts)
    sim = simulate(2, 0.1, 0.9, False, 0.01, 0.1, WARMUP, 4, clip=0.5)
    check(res, sim, 2, exact=False, what="clip")


def test_dgc_under_ddp_equals_the_plain_loop():
    """Under DDP with register_comm_hook the hook sends nothing and step() exchanges: bitwise the plain loop."""
    plain = run(2, job, OPTS)
    under = run(2, job, OPTS, STEPS, True)
    for (a, _), (b, _) in zip(plain, under):
        for t in range(STEPS):
            for x, y in zip(a[t][0], b[t][0]):
                assert np.array_equal(bits(x), bits(y))


def job_state(rank, world):
    torch.manual_seed(0)
    m = Params()
    opt = go.DGC(m.parameters(), **OPTS)
    for step in range(3):
        opt.zero_grad()
        m([torch.from_numpy(grad_of(i, rank, step)) for i in range(len(SHAPES))]).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # as a checkpoint file: torch's state_dict shares the state's tensors
    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    m2 = Params()
    m2.load_state_dict(m.state_dict())
    opt2 = go.DGC(m2.parameters(), **OPTS)
    opt2.load_state_dict(sd)
    for model, o in ((m, opt), (m2, opt2)):
        for step in range(3, 5):
            o.zero_grad()
            model([torch.from_numpy(grad_of(i, rank, step)) for i in range(len(SHAPES))]).backward()
            o.step()
    return [np.array_equal(bits(a.detach().numpy()), bits(b.detach().numpy())) for a, b in zip(m.ps, m2.ps)], opt2.step_count


def test_dgc_state_dict_round_trip():
    for same, count in run(2, job_state):
        assert all(same) and count == 5


def test_warmup_helpers_and_errors():
    assert go.warmup_stages([0.25, 0.0625, 0.015625, 0.004], 100) == [(0, 0.25), (100, 0.0625), (200, 0.015625),
                                                                      (300, 0.004)]
    w = go.warmup_geometric(0.25, 0.001, 40, 4)
    assert [s for s, _ in w] == [0, 10, 20, 30]
    assert w[0][1] == 0.25 and math.isclose(w[2][1], 0.25 * (0.004) ** 0.5)
    opt = go.DGC([nn.Parameter(torch.zeros(4, 4))], lr=0.1, density=0.001, warmup=w)
    assert opt.warmup_steps == 40
    assert [opt.density_at(t) for t in (0, 9, 10, 39, 40)] == [0.25, 0.25, w[1][1], w[3][1], 0.001]
    with pytest.raises(ValueError, match=r"strictly increasing"):
        go.DGC([nn.Parameter(torch.zeros(2, 2))], lr=0.1, warmup=[(0, 0.5), (0, 0.25)])
    with pytest.raises(ValueError, match=r"density 2"):
        go.DGC([nn.Parameter(torch.zeros(2, 2))], lr=0.1, warmup=[(0, 2)])
    with pytest.raises(ValueError, match="warmup_steps"):
        go.DGC([nn.Parameter(torch.zeros(2, 2))], lr=0.1, warmup=lambda t: 0.5)
    with pytest.raises(ValueError, match="density=0"):
        go.DGC([nn.Parameter(torch.zeros(2, 2))], lr=0.1, density=0)
