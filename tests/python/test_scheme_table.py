"""The scheme table (gradcomp.schemes.table): every list of scheme names comes from it, a scheme
is its file plus one table line, and the example scheme rs_ag (a reduce-scatter, then an
all-gather) is correct on real gloo groups against a numpy average. References are written here
with numpy and plain loops."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import gradcomp  # noqa: E402
from gradcomp import planner, planner_cli  # noqa: E402
from gradcomp.planner import schemes as registry  # noqa: E402
from gradcomp.schemes import SCHEMES, TABLE, SchemeContext  # noqa: E402
from gradcomp.schemes.base import Scheme  # noqa: E402
from gradcomp.schemes.context import chain, completed  # noqa: E402
from gradcomp.torch import Compressor, compressor  # noqa: E402

from ddp_helpers import run  # noqa: E402

SEED = 20261203
NAMES = ("dense", "sum", "gather", "two_phase", "hierarchical", "rs_ag", "majority")


def test_every_list_of_names_is_the_table():
    assert tuple(s.name for s in TABLE) == NAMES
    assert registry.names() == NAMES and tuple(SCHEMES) == NAMES
    flat = tuple(s.name for s in TABLE if s.flat)
    assert flat == ("dense", "sum", "gather", "two_phase", "rs_ag", "majority")
    assert planner.ALL_SCHEMES == NAMES and planner.SCHEMES == flat
    assert compressor.SCHEME_CHOICES == ("auto",) + NAMES
    assert compressor.INNER_CHOICES == ("auto",) + flat
    with pytest.raises(ValueError, match="accepted: auto, dense, sum, gather, two_phase, hierarchical, rs_ag, majority"):
        planner.choose_scheme(gradcomp.Codec("int8"), 4096, "float32", 4, "nope")
    with pytest.raises(SystemExit):  # argparse: an unknown --scheme
        planner_cli.main(["--params", "1M", "--gpus", "2", "--scheme", "nope"])
    with pytest.raises(ValueError, match="planner: scheme='nope'; accepted: dense, sum, gather"):
        planner.bucket_bytes("nope", gradcomp.Codec("int8"), 10, "float32", 2)


def test_candidates_follow_the_table():
    assert registry.candidates(gradcomp.Codec("none")) == ("dense", "sum", "gather")
    assert registry.candidates(gradcomp.Codec("int8")) == ("dense", "gather", "two_phase")
    assert registry.candidates(gradcomp.Codec("topk:ratio=0.01")) == ("dense", "gather", "two_phase")
    cm = planner.CostModel(planner.LINK_LEVELS["nvlink"], planner.LINK_LEVELS["network"], 4)
    cands = cm.candidates(gradcomp.Codec("fp16"), 1 << 20, "float32", 8)
    assert cands == [("dense", ""), ("sum", ""), ("gather", ""), ("hierarchical", "dense"),
                     ("hierarchical", "sum"), ("hierarchical", "gather")]


def test_linear_only_scheme_refused_for_a_nonlinear_codec():
    sum_ = registry.get("sum")
    assert sum_.accepts(gradcomp.Codec("fp16")) and not sum_.accepts(gradcomp.Codec("int8"))


@pytest.mark.parametrize("W", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [0, 1, 1000, 1001])
def test_rs_ag_bytes(W, n):
    """A reduce-scatter of the padded bucket and an all-gather of one chunk, by hand."""
    for dtype, es in (("float32", 4), ("bfloat16", 2)):
        b = planner.bucket_bytes("rs_ag", gradcomp.Codec("none"), n, dtype, W)
        c = -(-n // W)
        want = 0.0 if W == 1 else (W - 1) / W * (W * c * es) + (W - 1) * c * es
        assert b["sent_bytes"] == want and b["packet_bytes"] == n * es and b["dense_bytes"] == n * es
        assert b["ring_bytes"] == 2.0 * (W - 1) / W * (n * es)


def test_scheme_description_rejects_bad_entries():
    with pytest.raises(ValueError, match="codecs='sparse'; accepted: any, linear"):
        Scheme(name="x", summary="", run=None, context=None, steps=None, packet_bytes=None, kernels=None,
               collectives=("allreduce",), codecs="sparse")
    with pytest.raises(ValueError, match=r"collectives \['broadcast'\]"):
        Scheme(name="x", summary="", run=None, context=None, steps=None, packet_bytes=None, kernels=None,
               collectives=("broadcast",))
    with pytest.raises(ValueError, match="names \\['dense'\\] more than once"):
        registry.register(TABLE + (TABLE[0],))
    assert registry.names() == NAMES  # a refused table changes nothing


# ---------------------------------------------------------------------------------------------
# rs_ag on real gloo groups

def seeded(rank, n, dtype, step=0):
    g = np.random.default_rng([SEED, rank, n, step])
    return torch.from_numpy(g.standard_normal(n).astype(np.float32)).to(dtype)


def job_rs_ag(rank, world):
    """rs_ag through Compressor against the numpy average over the ranks' inputs; bitwise equal
    to the dense scheme for W = 2 (a sum of two terms has one order)."""
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        comp = Compressor("int8", scheme="rs_ag")
        ref_comp = Compressor("int8", scheme="dense")
        ints = torch.int16 if dtype == torch.bfloat16 else torch.int32
        for step in range(2):
            for n in (1, 7, 4096, 5001):
                t = seeded(rank, n, dtype, step)
                comp.allreduce(t, f"t{n}").wait()
                xs = [seeded(r, n, dtype, step).to(torch.float64).numpy() for r in range(world)]
                mean = np.sum([x / world for x in xs], axis=0)
                tol = 1e-6 if dtype == torch.float32 else 1e-2
                np.testing.assert_allclose(t.to(torch.float64).numpy(), mean, rtol=tol, atol=tol,
                                           err_msg=f"rank {rank} n {n} {dtype} step {step}")
                d = seeded(rank, n, dtype, step)
                ref_comp.allreduce(d, f"t{n}").wait()
                if world == 2:
                    assert torch.equal(t.view(-1).view(ints), d.view(-1).view(ints)), (n, dtype, step)
                gathered = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(gathered, t)
                assert all(torch.equal(g, t) for g in gathered), "not the same bits on every rank"
                assert comp.scheme_of(f"t{n}") == ("rs_ag" if n >= 1024 else "dense")
                checked += 1
            buckets = comp.stats()["buckets"]
            assert [b["scheme"] for b in buckets] == ["dense", "dense", "rs_ag", "rs_ag"], buckets
            comp.end_step()
            ref_comp.end_step()
    return checked


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_rs_ag_matches_numpy_average(world):
    assert run(world, job_rs_ag) == [16] * world


# ---------------------------------------------------------------------------------------------
# a scheme added as one description plus one table line, touching nothing else

class RankOrderContext(SchemeContext):
    def __init__(self, codec, numel, dtype, device, group, world_size, *, rank=None, divisor=None):
        super().__init__(codec, group, world_size, divisor=divisor)
        self.gathered = torch.empty(self.world_size * numel, dtype=torch.float32, device=device)


def rank_order(tensor, ctx, slots=None, probe=None, check=None):
    """All-gather the float32 values, sum them in rank order, divide by W, round once."""
    n = tensor.numel()
    if ctx.world_size == 1 or n == 0:
        return completed(tensor)
    if check is not None:
        check.launch()
    work = dist.all_gather_into_tensor(ctx.gathered, tensor.view(-1).to(torch.float32), group=ctx.group,
                                       async_op=True)

    def done(_):
        if check is not None:
            check.verify()
        acc = torch.zeros(n, dtype=torch.float32)
        for r in range(ctx.world_size):
            acc += ctx.gathered[r * n: (r + 1) * n]
        tensor.view(-1).copy_(acc / ctx.divisor)
        return tensor

    return chain(work.get_future(), done, "scheme 'rank_order': the all-gather")


RANK_ORDER = Scheme(
    name="rank_order", summary="test only", run=rank_order, context=RankOrderContext,
    steps=lambda codec, n, dtype, W: [] if W < 2 else [("flat", "all_gather", 4 * n, W, float((W - 1) * 4 * n))],
    packet_bytes=lambda codec, n, dtype, W: 4 * n, kernels=lambda *a: (0.0, 0.0),
    collectives=("all_gather",), slots=(), candidate=lambda codec: False)


def job_plug_in(rank, world):
    registry.register(TABLE + (RANK_ORDER,))  # the one line
    try:
        assert "rank_order" in compressor.SCHEME_CHOICES and "rank_order" in planner.SCHEMES
        comp = Compressor("int8", scheme="rank_order")
        t = seeded(rank, 3000, torch.float32)
        comp.allreduce(t, "x").wait()
        acc = np.zeros(3000, dtype=np.float32)
        for r in range(world):  # float32 sum in rank order, then one division
            acc = acc + seeded(r, 3000, torch.float32).numpy()
        assert np.array_equal(t.numpy(), (acc / np.float32(world)).astype(np.float32))
        b = comp.stats()["buckets"][-1]
        assert b["scheme"] == "rank_order" and b["sent_bytes"] == (world - 1) * 4 * 3000, b
        return True
    finally:
        registry.register(TABLE)


@pytest.mark.multiproc
def test_a_new_scheme_is_one_description_and_one_table_line():
    assert run(2, job_plug_in) == [True, True]
    assert registry.names() == NAMES


def test_parser_lists_every_scheme():
    """gradcomp-plan's --scheme choices are the table's names (read when the parser is built)."""
    ap = planner_cli.build_parser()
    (action,) = [a for a in ap._actions if "--scheme" in a.option_strings]
    assert tuple(action.choices) == ("auto", "all") + NAMES
