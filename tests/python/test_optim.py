"""gradcomp.optim: OnebitAdam and OnebitLamb against references written here (not calling
gradcomp's optimizers), on real gloo groups.

- World size 1 (no process group): OnebitAdam equals a numpy loop of DeepSpeed's semantics (an
  initialisation step without update, Adam without bias correction, v frozen from freeze_step on)
  to 1e-6 relative; OnebitLamb's warm-up equals a numpy LAMB loop (trust ratio clamp, the frozen
  coefficient's EMA).
- W = 3 (padding to a multiple of 72): OnebitAdam against a torch loop whose momentum goes
  through ReferenceBackend (DeepSpeed's compressed allreduce re-implemented in plain torch,
  ds_onebit_job.py) to 1e-5: the scales differ by at most a float32 ulp (binary64 sums against
  torch.norm), and Adam divides by a variance frozen after one warm-up step, which amplifies it.
- state_dict round trips: after 5 steps (3 compressed), a fresh optimizer loaded from the
  state_dict continues bitwise like the original (error buffers included) on every rank; a
  checkpoint of another world size loads with a warning and zero errors.
- exp_avg_mask zeroes the momentum where the mask is 0 and survives load_state_dict (DeepSpeed's
  rule); a non_freeze group keeps updating its variance; the DDP hook averages only during the
  warm-up; bad arguments raise errors that name the value.
The comparison with DeepSpeed 0.19.6's own optimizers (bitwise) is in test_deepspeed_integration.py."""

import copy
import math
import os
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from ddp_helpers import run  # noqa: E402, F401

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ds_onebit_job import ReferenceBackend  # noqa: E402


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).to(dtype)


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


# ------------------------------------------------------------------------------------------------
# world size 1: numpy references

def np_onebit_adam(params0, grads, lr, b1, b2, eps, wd, freeze_step):
    """DeepSpeed's OnebitAdam for one process (no compression at W = 1), in float64 numpy."""
    ps = [p.astype(np.float64) for p in params0]
    m = [np.zeros_like(p) for p in ps]
    v = [np.zeros_like(p) for p in ps]
    frozen = False
    for t, gs in enumerate(grads, start=1):
        if t == 1:
            continue  # the initialisation step
        for i, g in enumerate(gs):
            m[i] = b1 * m[i] + (1 - b1) * g
            if not frozen:
                v[i] = b2 * v[i] + (1 - b2) * g * g
            u = m[i] / (np.sqrt(v[i]) + eps) + wd * ps[i]
            ps[i] = ps[i] - lr * u
        if t >= freeze_step:
            frozen = True
    return ps


def test_onebit_adam_world_size_one_equals_numpy():
    import gradcomp.optim as go

    rng = np.random.default_rng(3)
    shapes = [(4, 3), (5,), (2, 2, 2)]
    p0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(9)]
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in p0]
    opt = go.OnebitAdam(params, lr=1e-2, freeze_step=4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)
    assert opt.size == 1
    for t, gs in enumerate(grads, start=1):
        for p, g in zip(params, gs):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
        if t == 1:  # no update on the initialisation step
            assert all(torch.equal(p.detach(), torch.from_numpy(q)) for p, q in zip(params, p0))
        assert opt.compression_stage == (t >= 4)
    want = np_onebit_adam(p0, grads, 1e-2, 0.8, 0.99, 1e-6, 0.01, 4)
    for p, w in zip(params, want):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-5, atol=1e-6)
    assert opt.state[params[0]]["step"] == 9


def test_onebit_lamb_warmup_equals_numpy():
    import gradcomp.optim as go

    rng = np.random.default_rng(4)
    shapes = [(6, 3), (3,)]
    p0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) * 0.1 for s in shapes] for _ in range(5)]
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in p0]
    opt = go.OnebitLamb(params, lr=1e-2, freeze_step=100, weight_decay=0.1, max_coeff=2.0, min_coeff=0.5,
                        coeff_beta=0.7)
    ps = [p.astype(np.float64) for p in p0]
    m = [np.zeros_like(p) for p in ps]
    v = [np.zeros_like(p) for p in ps]
    freeze = [0.0, 0.0]
    for t, gs in enumerate(grads, start=1):
        for p, g in zip(params, gs):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
        if t == 1:
            continue
        cs = []
        for i, g in enumerate(gs):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            u = m[i] / (np.sqrt(v[i]) + 1e-8) + 0.1 * ps[i]
            c = min(max(np.linalg.norm(ps[i]) / np.linalg.norm(u), 0.5), 2.0)
            freeze[i] = 0.7 * freeze[i] + 0.3 * c
            ps[i] = ps[i] - 1e-2 * c * u
            cs.append(c)
        assert opt.lamb_coeffs == pytest.approx(cs, rel=1e-5)
    for p, w in zip(params, ps):
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-5, atol=1e-6)
    for p, f in zip(params, freeze):
        assert opt.state[p]["lamb_coeff_freeze"] == pytest.approx(f, rel=1e-5)


def test_bad_arguments():
    import gradcomp.optim as go

    ps = [torch.nn.Parameter(torch.zeros(3))]
    for kw, word in [({"freeze_step": 0}, "freeze_step=0"), ({"freeze_step": 2.5}, "freeze_step=2.5"),
                     ({"lr": -1.0}, "lr=-1.0"), ({"betas": (0.9, 1.0)}, "betas=(0.9, 1.0)"),
                     ({"eps": -1e-8}, "eps=-1e-08"), ({"weight_decay": -0.1}, "weight_decay=-0.1")]:
        for cls in (go.OnebitAdam, go.OnebitLamb):
            with pytest.raises(ValueError, match=word.replace("(", r"\(").replace(")", r"\)")):
                cls(ps, **kw)
    for kw, word in [({"var_update_scaler": 0}, "var_update_scaler=0"), ({"local_step_clipper": 1.5},
                      "local_step_clipper=1.5"), ({"var_freeze_step": -1}, "var_freeze_step=-1"), ({"lr": -1.0}, "lr=-1.0")]:
        with pytest.raises(ValueError, match=word):
            go.ZeroOneAdam(ps, **kw)
    with pytest.raises(ValueError, match="min_coeff"):
        go.OnebitLamb(ps, min_coeff=2.0, max_coeff=1.0)
    with pytest.raises(ValueError, match="several dtypes"):
        go.OnebitLamb([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        go.register_comm_hook(torch.nn.Linear(2, 2), go.OnebitAdam(ps))
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.zeros(3).to_sparse()
    opt = go.OnebitAdam([p])
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_lamb_drops_empty_parameters():
    import gradcomp.optim as go

    a, e = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.zeros(0))
    opt = go.OnebitLamb([a, e])
    assert [p.numel() for g in opt.param_groups for p in g["params"]] == [4]


# ------------------------------------------------------------------------------------------------
# real gloo groups

def job_adam_vs_reference(rank, world, steps, freeze_step):
    """gradcomp OnebitAdam against a torch loop with ReferenceBackend (DeepSpeed's protocol)."""
    import gradcomp.optim as go

    model = _model()
    ref_model = copy.deepcopy(model)
    opt = go.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=freeze_step)
    ref = ReferenceBackend()
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    rstate = {}
    div = world * 8 // math.gcd(world, 8)
    for t in range(1, steps + 1):
        x, y = _batch(rank, t)
        for net in (model, ref_model):
            net.zero_grad()
            (net(x) - y).square().mean().backward()
        opt.step()
        with torch.no_grad():
            for p in ref_model.parameters():
                st = rstate.setdefault(p, {"m": torch.zeros_like(p), "v": torch.zeros_like(p)})
                if t == 1:
                    continue
                g = p.grad.clone()
                if t - 1 < freeze_step:  # warm-up: averaged gradients
                    dist.all_reduce(g)
                    g /= world
                    st["m"] = b1 * st["m"] + (1 - b1) * g
                    st["v"] = b2 * st["v"] + (1 - b2) * g * g
                else:
                    st["m"] = b1 * st["m"] + (1 - b1) * g
                    if "we" not in st:
                        Np = -(-p.numel() // (world * div)) * (world * div)
                        st["we"], st["se"] = torch.zeros(Np), torch.zeros(Np // world)
                    st["m"] = ref.compressed_allreduce(st["m"].clone(), st["we"], st["se"], 0).reshape(p.shape)
                p -= lr * (st["m"] / (st["v"].sqrt() + eps))
    diffs = [float((p - q).abs().max()) for p, q in zip(model.parameters(), ref_model.parameters())]
    errs = sum(float(opt.state[p]["worker_error"].abs().sum()) for p in model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    allf = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(allf, flat)
    same = all(torch.equal(a, flat) for a in allf)
    Nps = [opt.state[p]["worker_error"].numel() for p in model.parameters()]
    return max(diffs), errs, same, Nps, opt.comm_stats()


def test_onebit_adam_w3_equals_the_reference():
    res = run(3, job_adam_vs_reference, 7, 3)
    for diff, errs, same, Nps, stats in res:
        assert diff <= 1e-5, diff
        assert errs > 0 and same
        assert all(n % 72 == 0 for n in Nps) and Nps == [72, 72, 72, 72]  # 35, 7, 21, 3 elements -> 72
        assert stats["compressed_steps"] == 4 and stats["warmup_steps"] == 3
        assert stats["compressed_sent_bytes"] > 0 and stats["dense_sent_bytes"] > 0


def _train(model, opt, rank, steps, start=1):
    for t in range(start, start + steps):
        x, y = _batch(rank, t)
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()


def job_state_dict_round_trip(rank, world, kind):
    import gradcomp.optim as go

    cls = {"adam": go.OnebitAdam, "lamb": go.OnebitLamb}[kind]
    model = _model()
    opt = cls(model.parameters(), lr=1e-3, freeze_step=2)
    _train(model, opt, rank, 5)
    assert opt.compression_stage
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = cls(model2.parameters(), lr=1e-3, freeze_step=2)
    opt2.load_state_dict(sd)
    assert opt2.compression_stage and opt2.initialized
    _train(model, opt, rank, 3, start=6)
    _train(model2, opt2, rank, 3, start=6)
    same_params = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    if kind == "adam":
        errs = [(opt.state[p]["worker_error"], opt2.state[q]["worker_error"], opt.state[p]["server_error"],
                 opt2.state[q]["server_error"]) for p, q in zip(model.parameters(), model2.parameters())]
    else:
        errs = [(opt.worker_error, opt2.worker_error, opt.server_error, opt2.server_error)]
    same_errs = all(torch.equal(a, b) and torch.equal(c, d) for a, b, c, d in errs)
    nonzero = all(float(a.abs().sum()) > 0 for a, _, _, _ in errs)
    # the saved errors are the ones in the checkpoint, bit for bit
    if kind == "adam":
        saved = [sd["state"][i]["worker_error"] for i in range(len(list(model.parameters())))]
    else:
        saved = [sd["onebit_errors"]["worker_error"]]
    return same_params, same_errs, nonzero, all(s.dtype == torch.float32 for s in saved)


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_state_dict_round_trip_is_bit_exact(kind):
    for same_params, same_errs, nonzero, f32 in run(2, job_state_dict_round_trip, kind):
        assert same_params and same_errs and nonzero and f32


def job_mask_and_non_freeze(rank, world):
    import gradcomp.optim as go

    model = _model()
    w, b = model[0].weight, model[0].bias
    mask = torch.ones_like(w)
    mask[:, 0] = 0
    rest = [p for p in model.parameters() if p is not w and p is not b]
    opt = go.OnebitAdam([{"params": [w], "exp_avg_mask": mask}, {"params": [b], "non_freeze": True},
                         {"params": rest}], lr=1e-3, freeze_step=2)
    _train(model, opt, rank, 4)
    masked_zero = bool((opt.state[w]["exp_avg"][:, 0] == 0).all()) and bool((opt.state[w]["exp_avg"][:, 1:] != 0).all())
    no_errors_for_non_freeze = "worker_error" not in opt.state[b]
    v_before = opt.state[b]["exp_avg_sq"].clone()
    vr_before = opt.state[rest[0]]["exp_avg_sq"].clone()
    _train(model, opt, rank, 1, start=5)
    v_moves = not torch.equal(v_before, opt.state[b]["exp_avg_sq"])
    v_frozen = torch.equal(vr_before, opt.state[rest[0]]["exp_avg_sq"])
    # the running optimizer's mask wins over a checkpoint's
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["exp_avg_mask"] = torch.zeros_like(w)
    opt.load_state_dict(sd)
    kept = torch.equal(opt.param_groups[0]["exp_avg_mask"], mask)
    return masked_zero, no_errors_for_non_freeze, v_moves, v_frozen, kept


def test_exp_avg_mask_and_non_freeze():
    for r in run(2, job_mask_and_non_freeze):
        assert all(r), r


def job_ddp_hook(rank, world):
    import gradcomp.optim as go

    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    other = go.OnebitAdam(_model().parameters(), lr=1e-3, freeze_step=3)
    with pytest.raises(ValueError, match="does not hold 4 of the model's trainable parameters"):
        go.register_comm_hook(ddp, other)
    opt = go.OnebitAdam(ddp.parameters(), lr=1e-3, freeze_step=3)
    go.register_comm_hook(ddp, opt)
    assert not opt.average_gradients
    local_grads = []
    for t in range(1, 6):
        x, y = _batch(rank, t)
        opt.zero_grad()
        (ddp(x) - y).square().mean().backward()
        g = model[0].weight.grad.clone()
        allg = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(allg, g)
        local_grads.append(all(torch.equal(a, g) for a in allg))  # equal on all ranks = averaged
        opt.step()
    return local_grads, opt.comm_stats()


def test_ddp_hook_averages_only_in_the_warm_up():
    for averaged, stats in run(2, job_ddp_hook):
        assert averaged == [True, True, True, False, False], averaged
        assert stats["dense_sent_bytes"] > 0 and stats["compressed_steps"] == 2


def test_checkpoint_of_another_world_size_resets_the_errors():
    import gradcomp.optim as go

    p = torch.nn.Parameter(torch.ones(5))
    opt = go.OnebitAdam([p], freeze_step=1)
    p.grad = torch.ones(5)
    opt.step()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["worker_error"] = torch.ones(48)  # as saved at W = 3
    sd["state"][0]["server_error"] = torch.ones(16)
    opt2 = go.OnebitAdam([torch.nn.Parameter(torch.ones(5))], freeze_step=1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt2.load_state_dict(sd)
    assert any("world size (1) needs 8" in str(x.message) for x in w), [str(x.message) for x in w]
    assert "worker_error" not in opt2.state[opt2.param_groups[0]["params"][0]]
    assert opt2.compression_stage and opt2.initialized


def test_example_onebit_adam_runs():
    """examples/onebit_adam.py under torchrun (2 processes, 80 steps): both runs learn (test
    accuracy > 85 %, one sample = 0.25 points), losses finite, and 1-bit Adam sends less."""
    import re
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(root, "examples", "onebit_adam.py"), "--steps", "80", "--freeze-step", "12",
                        "--every", "20"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    rows = [ln.split() for ln in out.splitlines() if re.match(r"^\s+\d+\s", ln)]
    assert [int(r[0]) for r in rows] == [20, 40, 60, 80]
    assert all(math.isfinite(float(x)) for r in rows for x in r[1:])
    acc = re.search(r"test accuracy %\s+([\d.]+)\s+([\d.]+)", out)
    assert acc and float(acc.group(1)) > 85 and float(acc.group(2)) > 85, out
    b = re.search(r"Adam (\d+), 1-bit Adam (\d+)", out)
    # Adam: 2 (W-1)/W * 4 bytes * 85002 parameters; 1-bit Adam: 12 dense steps of 80, the rest 1-bit
    assert int(b.group(1)) == 4 * 85002 and int(b.group(2)) < int(b.group(1)) / 4, out


def job_zoadam_round_trip(rank, world):
    import gradcomp.optim as go

    kw = dict(lr=1e-3, var_freeze_step=4, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2)
    model = _model()
    opt = go.ZeroOneAdam(model.parameters(), **kw)
    dense = []
    for t in range(1, 8):
        dense.append(opt.dense_next)
        _train(model, opt, rank, 1, start=t)
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = go.ZeroOneAdam(model2.parameters(), **kw)
    opt2.load_state_dict(sd)
    _train(model, opt, rank, 4, start=8)
    _train(model2, opt2, rank, 4, start=8)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    errs = all(torch.equal(opt.state[p]["worker_error"], opt2.state[q]["worker_error"])
               for p, q in zip(model.parameters(), model2.parameters()))
    return dense, opt.compression_stage, same, errs


def test_zero_one_adam_schedule_and_round_trip():
    for dense, frozen, same, errs in run(2, job_zoadam_round_trip):
        # var_interval doubles after every variance update: variance steps 1 (init), 2, 4; frozen after 4
        assert dense == [True, True, False, True, False, False, False], dense
        assert frozen and same and errs


def test_user_patterns_found_in_review():
    """What a review as a user found (each failed before its fix)."""
    import gradcomp.optim as go

    # ZeroOneAdam: a learning rate of 0 over a whole local-step interval left m = 0 / 0 = NaN
    p = torch.nn.Parameter(torch.ones(4))
    opt = go.ZeroOneAdam([p], lr=1e-2, var_freeze_step=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s == 4 else 1.0)
    for _ in range(6):
        opt.zero_grad()
        (p ** 2).sum().backward()
        opt.step()
        sched.step()
    assert torch.isfinite(p).all() and torch.isfinite(opt.state[p]["exp_avg"]).all()
    # ZeroOneAdam at world size 1: m follows the gradient on the steps without a variance update too
    p = torch.nn.Parameter(torch.ones(1))
    opt = go.ZeroOneAdam([p], var_freeze_step=1000, var_update_scaler=1)
    ms = []
    for i in range(6):
        p.grad = torch.full((1,), i + 1.0)
        opt.step()
        ms.append(opt.state[p]["exp_avg"].item())
    want, m = [0.0], 0.0
    for i in range(1, 6):
        m = 0.9 * m + 0.1 * (i + 1.0)
        want.append(m)
    assert ms == pytest.approx(want, rel=1e-6)
    # a first parameter that never has a gradient: the stage follows the others, on load too
    for cls, kw in ((go.OnebitAdam, {"freeze_step": 3}), (go.ZeroOneAdam, {"var_freeze_step": 3})):
        frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
        w = torch.nn.Parameter(torch.ones(3))
        opt = cls([frozen, w], lr=1e-2, **kw)
        for _ in range(5):
            opt.zero_grad()
            (w ** 2).sum().backward()
            opt.step()
        assert opt.compression_stage, cls.__name__
        w2 = torch.nn.Parameter(w.detach().clone())
        opt2 = cls([frozen, w2], lr=1e-2, **kw)
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
        assert (opt2.initialized, opt2.compression_stage, opt2.dense_next) == (True, True, False), cls.__name__
        for o, q in ((opt, w), (opt2, w2)):
            o.zero_grad()
            (q ** 2).sum().backward()
            o.step()
        assert torch.equal(w, w2), cls.__name__
    # OnebitLamb takes what torch.optim takes, and refuses add_param_group once it has stepped
    model = _model()
    opt = go.OnebitLamb(model.named_parameters())
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == 66
    opt = go.OnebitLamb([{"params": model[0].weight}, {"params": model[2].weight, "lr": 1e-2}])
    assert [len(g["params"]) for g in opt.param_groups] == [1, 1]
    with pytest.raises(TypeError, match="got a torch.Tensor"):
        go.OnebitLamb(model[0].weight)
    opt = go.OnebitLamb([model[0].weight])
    opt.add_param_group({"params": [model[0].bias]})  # before the first step: fine
    model[0].weight.grad = torch.ones_like(model[0].weight)
    opt.step()
    with pytest.raises(RuntimeError, match="has stepped"):
        opt.add_param_group({"params": [model[2].bias]})
