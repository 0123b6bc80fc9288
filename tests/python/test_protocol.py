"""The compressor protocols (gradcomp.torch.protocol): one interface, one table.

Checked: the table picks the protocol from the spec (no prefix test elsewhere), every protocol's
compressor implements the whole BaseCompressor interface, PowerSGDCompressor's bucket path
equals its per-tensor path bitwise and lists its layouts, both protocols' residuals follow a
GradScaler (a run on gradients times powers of two equals the unscaled run times the scale,
bitwise: the reference is the same compressor without a scaler), PowerSGD's first step on a
rank-1 gradient is that gradient (numpy), and bad arguments are named. Real gloo ranks.
"""

import inspect

import numpy as np
import pytest
import torch

import gradcomp
import gradcomp.torch as gt
from gradcomp.torch import protocol
from ddp_helpers import run


def test_table_picks_the_protocol_from_the_spec():
    assert protocol.names()[:2] == ("codec", "powersgd")
    assert protocol.for_spec("powersgd:rank=2").compressor is gt.PowerSGDCompressor
    assert protocol.for_spec(" powersgd ").state is gt.PowerSGDState
    assert protocol.for_spec("topk:ratio=0.01").compressor is gt.Compressor
    assert protocol.for_spec(gradcomp.Codec("int8")).compressor is gt.Compressor
    assert protocol.for_spec("no_such_codec").name == "codec"  # the Compressor names the bad spec
    assert protocol.get("codec").hook is gt.compression_hook
    assert protocol.get("powersgd").hook is gt.powersgd_hook
    with pytest.raises(ValueError, match="protocol 'nope'; accepted: codec, powersgd"):
        protocol.get("nope")


def test_every_protocol_implements_the_whole_interface():
    abstract = {n for n, v in vars(protocol.BaseCompressor).items() if getattr(v, "__isabstractmethod__", False)}
    assert {"allreduce", "allreduce_bucket", "end_step", "stats", "layouts", "state_dict", "load_state_dict",
            "attach_grad_scaler", "on_corrupt", "residual", "scheme_of"} <= abstract
    for name in protocol.names():
        cls = protocol.get(name).compressor
        assert issubclass(cls, protocol.BaseCompressor) and not inspect.isabstract(cls), name


def test_table_refuses_clashes():
    p = protocol.get("powersgd")
    with pytest.raises(ValueError, match="in the table already"):
        protocol.add(protocol.Protocol("powersgd", ("other",), p.compressor, p.state, p.hook, p.register))
    with pytest.raises(ValueError, match=r"families \['powersgd'\] belong to protocol 'powersgd'"):
        protocol.add(protocol.Protocol("lowrank2", ("powersgd",), p.compressor, p.state, p.hook, p.register))
    with pytest.raises(TypeError, match="is not a BaseCompressor subclass"):
        protocol.add(protocol.Protocol("x", ("x",), dict, p.state, p.hook, p.register))
    assert "lowrank2" not in protocol.names() and "x" not in protocol.names()


# ---------------------------------------------------------------------------------------------
# on gloo ranks

SHAPES = [(12, 10), (10,), (12, 10), (6, 2, 5)]


def _grads(rank, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) * scale for s in SHAPES]


def job_bucket_equals_per_tensor(rank, world):
    by_name = gt.Compressor("powersgd:rank=2,min_rate=1")
    by_bucket = gt.Compressor("powersgd:rank=2,min_rate=1")
    assert isinstance(by_bucket, gt.PowerSGDCompressor) and isinstance(by_bucket, protocol.BaseCompressor)
    names = [f"p{i}" for i in range(len(SHAPES))]
    offsets = np.cumsum([0] + [int(np.prod(s)) for s in SHAPES]).tolist()
    params = [(n, offsets[i], SHAPES[i]) for i, n in enumerate(names)]
    for step in range(3):
        gs = _grads(rank, step)
        flat = torch.cat([g.reshape(-1) for g in gs])
        by_bucket.allreduce_bucket(flat, 0, lambda: params).wait()
        by_bucket.end_step()
        for n, g in zip(names, gs):
            by_name.allreduce(g, n).wait()
        by_name.end_step()
        for i, g in enumerate(gs):
            got = flat[offsets[i]: offsets[i + 1]]
            assert torch.equal(got.view(torch.int32), g.reshape(-1).view(torch.int32)), (step, i)
            assert torch.equal(by_bucket.residual(names[i]), by_name.residual(names[i])), (step, i)
    (lay,) = by_bucket.layouts()
    assert lay["index"] == 0 and lay["scheme"] == "powersgd" and lay["numel"] == offsets[-1]
    assert lay["params"] == [(n, offsets[i], int(np.prod(SHAPES[i]))) for i, n in enumerate(names)]
    assert lay["dense"] == [("p1", offsets[1], 10)] and lay["groups"] == [(12, 10, 2, 2), (6, 10, 2, 1)]
    assert by_name.scheme_of("p0") == "powersgd"
    # a dense (warm-up) call of a bucket without residuals: accounted as dense
    fresh = gt.Compressor("powersgd:rank=2,min_rate=1")
    flat = torch.cat([g.reshape(-1) for g in _grads(rank, 9)])
    fresh.allreduce_bucket(flat, 0, params, dense=True).wait()
    assert fresh.stats()["buckets"][-1]["scheme"] == "dense"
    # allreduce_hook's semantics: each rank divides by W, then SUM (two ranks: one float32 add)
    ins = [np.concatenate([g.reshape(-1).numpy() for g in _grads(r, 9)]) for r in range(world)]
    want = (ins[0] / np.float32(world)) + (ins[1] / np.float32(world))
    assert np.array_equal(flat.numpy(), want)
    return True


def test_powersgd_bucket_path_equals_per_tensor_path():
    assert run(2, job_bucket_equals_per_tensor) == [True, True]


class _Scaler(torch.amp.GradScaler):
    """A GradScaler whose scale the test sets (CPU, enabled)."""

    def __init__(self):
        super().__init__("cpu", enabled=True)
        self._scale = torch.tensor(1.0)


def job_residuals_follow_the_scale(rank, world, spec):
    plain = gt.Compressor(spec, min_compress_numel=0)
    scaled = gt.Compressor(spec, min_compress_numel=0)
    sc = _Scaler()
    scaled.attach_grad_scaler(sc)
    assert scaled.grad_scaler is sc
    for step, s in enumerate([1024.0, 2048.0, 512.0, 512.0]):
        sc._scale = torch.tensor(s)
        for i, g in enumerate(_grads(rank, step)):
            a, b = g.clone(), g * s
            plain.allreduce(a, f"t{i}").wait()
            scaled.allreduce(b, f"t{i}").wait()
            assert torch.equal(b, a * s), (spec, step, i)  # powers of two: exact
            assert torch.equal(scaled.residual(f"t{i}"), plain.residual(f"t{i}") * s), (spec, step, i)
        plain.end_step()
        scaled.end_step()
    assert scaled.state_dict()["grad_scale"] == 512.0 and plain.state_dict()["grad_scale"] == 1.0
    with pytest.raises(TypeError, match="expected a torch.amp.GradScaler or None, got int"):
        scaled.attach_grad_scaler(3)
    return True


@pytest.mark.parametrize("spec", ["powersgd:rank=2,min_rate=1", "topk:ratio=0.1"])
def test_residuals_follow_the_grad_scaler_in_every_protocol(spec):
    assert run(2, job_residuals_follow_the_scale, spec) == [True, True]


def job_rank1_gradient(rank, world):
    u = np.linspace(-1.0, 2.0, 16)
    v = np.cos(np.arange(9.0))
    g = torch.tensor(np.outer(u, v), dtype=torch.float32)  # the same rank-1 gradient on every rank
    comp = gt.Compressor("powersgd:rank=1,min_rate=1")
    out = g.clone()
    comp.allreduce(out, "w").wait()
    np.testing.assert_allclose(out.numpy(), np.outer(u, v), rtol=0, atol=2e-6)  # P P^T M = M for rank-1 M
    comp.on_corrupt = "log"
    assert comp.on_corrupt == "log"
    with pytest.raises(ValueError, match="on_corrupt"):
        comp.on_corrupt = "ignore"
    with pytest.raises(ValueError, match="on_corrupt"):
        gt.Compressor("powersgd:rank=1", on_corrupt="ignore")
    with pytest.raises(ValueError, match="scheme='gather'; accepted: 'auto' or 'powersgd'"):
        gt.Compressor("powersgd:rank=1", "gather")
    return True


def test_powersgd_first_step_on_a_rank1_gradient_and_its_options():
    assert run(2, job_rank1_gradient) == [True, True]


def job_register_names_the_states(rank, world):
    from ddp_helpers import Params

    m = torch.nn.parallel.DistributedDataParallel(Params([(4, 3)]))
    with pytest.raises(TypeError, match="state=dict; accepted: a CompressionState or a PowerSGDState"):
        gt.register(m, state={})
    st = gt.register(m, codec="powersgd:rank=1")
    assert isinstance(st, gt.PowerSGDState)
    return True


def test_register_reads_the_table():
    assert run(2, job_register_names_the_states) == [True, True]
