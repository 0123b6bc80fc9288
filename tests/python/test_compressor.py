"""gradcomp.torch.Compressor on real gloo process groups (2 and 3 CPU processes, spawn), outside DDP.

The processes live in pools (gradcomp.experiments.pool.GlooPool, gloo_pools.py) shared by the session;
the assertions run inside the ranks. Inputs come from generators seeded with (SEED, rank, step,
name); every assertion message names the seed.

Bitwise comparisons (floats compared as integer views, so NaN and -0.0 count):
  - codec none (sum scheme) vs ``dist.all_reduce(t / W)`` done the same way: t / W in the
    tensor's dtype, SUM-allreduced as a tensor of the payload's element count
    (``codec.payload(n, dtype)``), so gloo chunks and sums it in the same order;
  - codec fp16 (sum) vs the same emulation of its arithmetic: RNE_fp16(float32(t) / W) (numpy),
    SUM-allreduced in float16;
  - top-k 0.01 with error feedback (gather) vs the independent numpy reference of
    ddp_helpers.topk_average_ref: x' = g + r, q = x' / W in float32, exact top-k by |q| (NaN
    first, ties to the lowest index), summed in rank order in float32 from +0.0, rounded once;
    residual x' - W * D at sent indices, x' elsewhere; several steps, so residuals carry over;
  - the result on every rank; residuals after a state_dict round trip and one more step;
  - a tensor below min_compress_numel (dense) vs dist.all_reduce(t / W).
Tolerances:
  - fp16 vs PyTorch's fp16_compress_hook arithmetic done by hand (cast, divide, SUM in float16):
    at most one fp16 ulp of the hook's value, W = 2 only (halving commutes with rounding away from
    float16 subnormals, so only the order of the two roundings differs; for W = 3 the two
    roundings of t / 3 differ by up to an ulp of a term, which a cancelling sum turns into many
    ulps of the result -- the bitwise emulation above pins the W = 3 arithmetic instead);
  - top-k ratio 1 (gather) vs dense float32 all_reduce(t / W): |a - b| <= 1e-6 * sum_r |t_r / W|
    (W = 2: exact; W = 3: another summation order, bounded by the magnitudes summed).
The README's custom-loop example is run as is on 2 and 3 ranks. The CUDA status-word resolution
is tested on the CPU with fake landed copies.
"""

import io
import logging
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import gradcomp  # noqa: E402
from gradcomp.torch import Compressor  # noqa: E402
from gradcomp.torch.stats import Stats  # noqa: E402

# the gloo pools and the numpy helpers of the DDP hook tests (the session's pools: gloo_pools.py)
from ddp_helpers import (  # noqa: E402, F401
    bits, check_world_size_change_drops, no_host_sync, run, topk_average_ref)

SEED = 20261201
README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


# ---------------------------------------------------------------------------------------------
# helpers used inside the ranks


def tensor_for(shape, rank, step, tag, dtype=torch.float32, scale=1.0):
    """Seeded input: SEED, rank, step and a tag (per name) pick the generator."""
    g = torch.Generator().manual_seed(SEED + 1000003 * tag + 101 * step + rank)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def payload_allreduce(vals, codec, dtype):
    """SUM-allreduce ``vals`` (numel elements of the wire dtype) as a tensor of the payload's
    element count, so gloo sums it in the order it sums the codec's payload."""
    _, cnt, wire = codec.payload(vals.numel(), dtype)
    buf = torch.zeros(cnt, dtype=getattr(torch, wire))
    buf[: vals.numel()] = vals.reshape(-1)
    dist.all_reduce(buf)
    return buf[: vals.numel()]


def same_on_every_rank(world, t, what):
    everyone = [None] * world
    dist.all_gather_object(everyone, t)
    for r, o in enumerate(everyone):
        assert torch.equal(o.view(torch.int32 if o.element_size() == 4 else torch.int16),
                           everyone[0].view(torch.int32 if o.element_size() == 4 else torch.int16)), \
            f"{what}: rank {r} differs from rank 0 (seed {SEED})"


# ---------------------------------------------------------------------------------------------
# jobs (module level: pickled by reference into the ranks)


def job_casts_vs_dense(rank, world):
    W = world
    for spec, dtype in (("none", torch.float32), ("none", torch.bfloat16), ("fp16", torch.float32)):
        comp = Compressor(spec, error_feedback=False, min_compress_numel=0)
        codec = comp.codec
        for step in range(3):
            t = tensor_for((40, 77), rank, step, 1, dtype, scale=10.0)
            if spec == "none":
                exp = payload_allreduce(t / W, codec, dtype)
            else:
                q = torch.from_numpy((t.numpy() / np.float32(W)).astype(np.float32).astype(np.float16))
                exp = payload_allreduce(q, codec, dtype).float()
                hook = payload_allreduce(t.half().div_(W), codec, dtype).float()
            got = t.clone()
            with no_host_sync():
                fut = comp.allreduce(got, "w")
            assert fut.wait() is got and got.shape == (40, 77)
            what = f"{spec} {dtype} step {step} seed {SEED}"
            assert comp.scheme_of("w") == "sum", what
            assert torch.equal(got.reshape(-1).view(torch.int32 if got.element_size() == 4 else torch.int16),
                               exp.view(torch.int32 if exp.element_size() == 4 else torch.int16)), what
            if spec == "fp16" and W == 2:
                h, gv = hook.numpy(), got.reshape(-1).numpy()
                fin = np.isfinite(h)
                ulp = np.spacing(np.abs(h[fin]).astype(np.float16)).astype(np.float32)
                assert np.all(np.abs(gv[fin] - h[fin]) <= ulp), what
            same_on_every_rank(world, got, what)
        s = comp.stats()
        assert s["steps"] == 3 and s["total"]["compressed_buckets"] == 3, (spec, s["total"])
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_casts_bitwise_vs_dense_allreduce(world):
    """Bitwise: none == all_reduce(t / W) (float32, bfloat16); fp16 == its float16 emulation;
    tolerance: fp16 within one fp16 ulp of fp16_compress_hook's arithmetic (W = 2)."""
    assert run(world, job_casts_vs_dense) == [True] * world


def job_topk_ratio1(rank, world):
    comp = Compressor("topk:ratio=1.0", scheme="gather", error_feedback=False, min_compress_numel=0)
    for step in range(3):
        t = tensor_for((1000,), rank, step, 2)
        terms = [None] * world
        dist.all_gather_object(terms, t / world)
        dense = t / world
        dist.all_reduce(dense)
        got = t.clone()
        comp.allreduce(got, "v").wait()
        bound = 1e-6 * torch.stack(terms).abs().sum(0)
        assert torch.all((got - dense).abs() <= bound), f"step {step} seed {SEED}"
        if world == 2:
            assert torch.allclose(got, dense, rtol=1e-6, atol=0.0), f"step {step} seed {SEED}"
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_topk_ratio1_matches_dense(world):
    """Tolerance: |a - b| <= 1e-6 * sum_r |t_r / W| against dense float32 all_reduce(t / W)."""
    assert run(world, job_topk_ratio1) == [True] * world


NAMES = {"a": ((3000,), torch.float32), "b": ((37, 41), torch.bfloat16), "small": ((100,), torch.float32)}


def _topk_steps(comp, rank, world, steps, first=0):
    """Run ``steps`` steps over NAMES ("small" is below min_compress_numel: dense). Returns one
    record per call: step, name, input g, residual before (None: never reduced), output,
    residual after, and for "small" the dense reference all_reduce(g / W)."""
    recs = []
    for step in range(first, first + steps):
        for tag, (name, (shape, dtype)) in enumerate(NAMES.items()):
            g = tensor_for(shape, rank, step, 10 + tag, dtype)
            if name == "a" and step == 1:
                g[5] = 40.0 if rank == 0 else -40.0  # an outlier on every rank
            try:
                r0 = comp.residual(name)
            except KeyError:
                r0 = None
            dense = None
            if name == "small":
                dense = g / world
                dist.all_reduce(dense)
            out = g.clone()
            comp.allreduce(out, name).wait()
            recs.append({"step": step, "name": name, "g": g, "r0": r0, "out": out,
                         "r1": comp.residual(name), "dense": dense})
    return recs


def _check_topk(recs, rank, world, ratio):
    """Every call bitwise: ranks agree; top-k names vs the numpy reference (output and this
    rank's residual); "small" vs dense all_reduce(g / W). Returns the top-k calls checked."""
    everyone = [None] * world
    dist.all_gather_object(everyone, recs)
    checked = 0
    for i, rec in enumerate(recs):
        what = f"step {rec['step']} {rec['name']} seed {SEED}"
        out = rec["out"].float().reshape(-1)
        for r in range(world):
            assert np.array_equal(bits(everyone[r][i]["out"].float().reshape(-1)), bits(out)), f"{what}: rank {r} differs"
        if rec["dense"] is not None:
            assert torch.equal(rec["out"], rec["dense"]), what + ": dense name != all_reduce(g / W)"
            continue
        xps = []
        for r in range(world):
            g = everyone[r][i]["g"].float().reshape(-1).numpy()
            r0 = everyone[r][i]["r0"]
            xps.append((g + (np.zeros_like(g) if r0 is None else r0.numpy())).astype(np.float32))
        exp, res = topk_average_ref(xps, ratio, str(rec["g"].dtype))
        assert np.array_equal(bits(out), bits(exp)), what + ": output != reference"
        assert np.array_equal(bits(rec["r1"]), bits(res[rank])), what + ": residual != x' - W*sent"
        checked += 1
    return checked


def job_topk_reference(rank, world):
    ratio = 0.01
    comp = Compressor(f"topk:ratio={ratio}")
    recs = _topk_steps(comp, rank, world, 4)
    assert comp.scheme_of("a") == comp.scheme_of("b") == "gather" and comp.scheme_of("small") == "dense"
    checked = _check_topk(recs, rank, world, ratio)
    assert checked == 8, checked
    # residuals carry over: each step starts from the previous step's residual
    last = {}
    for rec in recs:
        if rec["name"] in last:
            assert torch.equal(rec["r0"].view(torch.int32), last[rec["name"]].view(torch.int32)), rec["name"]
        last[rec["name"]] = rec["r1"]
    assert all(last[n].abs().sum() > 0 for n in ("a", "b")) and last["small"].abs().sum() == 0
    s = comp.stats()
    assert s["steps"] == 4 and comp.iter == 3  # the last step is still open
    assert [b["name"] for b in s["buckets"]] == list(NAMES)
    assert [b["scheme"] for b in s["buckets"]] == ["gather", "gather", "dense"]
    # checkpoint round trip: bit-exact, and both continue identically
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf)
    comp2 = Compressor(f"topk:ratio={ratio}")
    comp2.load_state_dict(sd)
    a, b = comp.state_dict(), comp2.state_dict()
    assert a["iter"] == b["iter"] == 3 and a["residuals"].keys() == b["residuals"].keys() == {"a", "b"}
    for k in a["residuals"]:
        assert torch.equal(a["residuals"][k].view(torch.int32), b["residuals"][k].view(torch.int32)), k
    more1 = _topk_steps(comp, rank, world, 1, first=4)
    more2 = _topk_steps(comp2, rank, world, 1, first=4)
    for x, y in zip(more1, more2):
        assert torch.equal(x["out"].float().view(torch.int32), y["out"].float().view(torch.int32)), x["name"]
        assert torch.equal(x["r1"].view(torch.int32), y["r1"].view(torch.int32)), x["name"]
    assert _check_topk(more1, rank, world, ratio) == 2
    # another world size drops the residuals with a warning
    check_world_size_change_drops(Compressor(f"topk:ratio={ratio}"), sd, world)
    return checked


@pytest.mark.parametrize("world", [2, 3])
def test_topk_error_feedback_bitwise_reference(world):
    """Bitwise: outputs and residuals of two names (float32 3000, bfloat16 37x41) over 4 steps vs
    the numpy reference; ranks agree; state_dict round trip and one more step bit-exact."""
    assert run(world, job_topk_reference) == [8] * world


def job_nonfinite(rank, world):
    for mode in ("restore", "reset"):
        comp = Compressor("topk:ratio=0.05", nonfinite=mode)
        for step in range(3):
            g = tensor_for((2000,), rank, step, 30)
            if step == 1 and rank == 0:
                g[17] = float("nan")
            before = comp.residual("g") if step else None
            out = g.clone()
            with no_host_sync():
                fut = comp.allreduce(out, "g")
            fut.wait()
            after = comp.residual("g")
            what = f"{mode} step {step} seed {SEED}"
            assert bool(torch.isfinite(out).all()) == (step != 1), what
            if step == 1 and mode == "restore":
                assert torch.equal(after.view(torch.int32), before.view(torch.int32)), what
            elif step == 1:
                assert float(after.abs().sum()) == 0.0, what
            else:
                assert bool(torch.isfinite(after).all()) and float(after.abs().sum()) > 0, what
            same_on_every_rank(world, out, what)
        assert comp.stats()["nonfinite_steps"] == 1, mode  # step 1, read when step 2 started
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_nonfinite_restore_and_reset(world):
    """Bitwise: a NaN on rank 0 makes every rank's result non-finite (identical bits); the
    residual is restored (restore) or zeroed (reset) with no host synchronization."""
    assert run(world, job_nonfinite) == [True] * world


def job_bad_arguments(rank, world):
    comp = Compressor("topk:ratio=0.1", min_compress_numel=0)
    comp.allreduce(torch.ones(50), "x").wait()
    with pytest.raises(ValueError, match=r"'x' has 51 elements.*had 50"):
        comp.allreduce(torch.ones(51), "x")
    with pytest.raises(TypeError, match="name"):
        comp.allreduce(torch.ones(50), 3)
    with pytest.raises(ValueError, match="contiguous"):
        comp.allreduce(torch.ones(10, 10).t(), "y")
    with pytest.raises(KeyError):
        comp.residual("never")
    with pytest.raises(KeyError):
        comp.scheme_of("never")
    with pytest.raises(ValueError, match="'x' has 7 elements"):
        comp.load_state_dict(dict(comp.state_dict(), residuals={"x": torch.zeros(7)}))
    # the rejected calls left no trace: the next call is a new step on every rank alike
    t = torch.full((50,), float(rank))
    comp.allreduce(t, "x").wait()
    assert comp.iter == 1 and comp.stats()["steps"] == 2
    return True


def test_bad_name_numel_and_options():
    """No numerics: argument validation."""
    assert run(2, job_bad_arguments) == [True, True]
    with pytest.raises(ValueError, match="scheme"):
        Compressor("none", scheme="ring")
    with pytest.raises(ValueError, match="linear"):
        Compressor("topk:ratio=0.1", scheme="sum")
    with pytest.raises(ValueError, match="on_corrupt"):
        Compressor("none", on_corrupt="ignore")
    with pytest.raises(ValueError, match="nonfinite"):
        Compressor("none", nonfinite="keep")
    with pytest.raises(TypeError, match="error_feedback"):
        Compressor("none", error_feedback=1)


def readme_example():
    """The first python block of README.md's "Compressed allreduce for any training loop"."""
    with open(README) as f:
        text = f.read()
    sec = text[text.index("## Compressed allreduce for any training loop"):]
    return re.search(r"```python\n(.*?)```", sec, re.S).group(1)


def job_readme_loop(rank, world, code):
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    model, losses, comp = ns["model"], ns["losses"], ns["comp"]
    for name, p in model.named_parameters():
        same_on_every_rank(world, p.detach().clone(), f"parameter {name}")
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, (first, last)
    assert comp.scheme_of("0.weight") == "gather" and comp.scheme_of("0.bias") == "dense"
    return first, last


@pytest.mark.parametrize("world", [2, 3])
def test_readme_custom_loop(world):
    """The README example, unchanged: identical parameters on every rank (bitwise), loss halves."""
    assert len(run(world, job_readme_loop, readme_example())) == world


# ---------------------------------------------------------------------------------------------
# the CUDA status word, read one step late: the resolution logic on the CPU with fake copies


class FakeEvent:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


def landed(*word):
    """A CPU uint8 tensor standing in for the pinned copy of a workspace's first bytes."""
    return torch.tensor(list(word) + [0] * (16 - len(word)), dtype=torch.uint8)


def test_status_word_resolution_raise():
    """A CORRUPT bit raises once its copy has landed, naming step and bucket; not before, only once."""
    st = Stats(2, "topk:ratio=0.01")
    assert gradcomp._C.STATUS_CORRUPT == 2 and gradcomp._C.STATUS_NONFINITE == 1
    ev = FakeEvent(done=False)
    st.expect_status(3, "bucket 1", landed(gradcomp._C.STATUS_CORRUPT), ev)
    st.expect_status(3, "bucket 0", landed(gradcomp._C.STATUS_NONFINITE), None)  # non-finite only: fine
    st.expect_status(3, "bucket 2", landed(0, 0, 0, 2), None)  # 0x02000000: not the CORRUPT bit
    st.record(3)
    st.record(4)  # the next step starts: the copy of bucket 1 has not landed yet
    st.summary()
    ev.done = True
    with pytest.raises(gradcomp.CorruptPacketError, match=r"step 3 bucket 1.*0x2"):
        st.record(5)  # the next step starts and reads the landed copy
    st.summary()  # consumed: no second raise
    st.expect_status(5, "tensor 'w'", landed(3), None)  # CORRUPT | NONFINITE
    with pytest.raises(gradcomp.CorruptPacketError, match="step 5 tensor 'w'"):
        st.summary()
    # the records are intact after a raise: steps 3, 4 closed, 5 open
    assert st.summary()["steps"] == 3


def test_status_word_resolution_log(caplog):
    """on_corrupt='log': a warning naming step and bucket instead of an exception."""
    st = Stats(2, "topk:ratio=0.01", on_corrupt="log")
    st.record(7)
    st.expect_status(7, "bucket 4", landed(2), FakeEvent(True))
    with caplog.at_level(logging.WARNING, logger="gradcomp"):
        st.record(8)
    msgs = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(msgs) == 1 and "step 7 bucket 4" in msgs[0], msgs
    with pytest.raises(ValueError, match="on_corrupt"):
        Stats(2, "none", on_corrupt="ignore")
