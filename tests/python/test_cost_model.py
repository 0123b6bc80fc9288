"""gradcomp.planner's cost model and gradcomp-plan: link rates, alpha-beta collective times,
predicted bucket times per scheme, the hierarchical byte formulas, auto's choice from the cost
model, a training step's plan, and the published figures, all against hand calculations written
here (never against the planner's own helpers).

Exact comparisons where the arithmetic is exact in binary64 (dyadic fractions, integers);
otherwise within 1e-12 relative (stated inline).
"""

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gradcomp  # noqa: E402
from gradcomp import planner  # noqa: E402
from gradcomp import planner_cli  # noqa: E402


def pad16(n):
    return (n + 15) // 16 * 16


def close(a, b, rel=1e-12):
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


# -- link rates --------------------------------------------------------------------------------
@pytest.mark.parametrize("text,bytes_per_s", [
    ("100mbit", 12.5e6), ("1gbit", 125e6), ("10gbit", 1.25e9), ("400gbps", 50e9), ("25Gb/s", 3.125e9),
    ("800", 100e9), ("2.5gbit", 312.5e6), ("64kbit", 8e3), ("unlimited", math.inf), ("inf", math.inf)])
def test_parse_rate(text, bytes_per_s):
    assert planner.parse_rate(text) == bytes_per_s


@pytest.mark.parametrize("bad", ["", "fast", "-1gbit", "0mbit", "1furlong", "gbit", "nan"])
def test_parse_rate_errors_name_the_value(bad):
    with pytest.raises(ValueError, match="accepted"):
        planner.parse_rate(bad)


def test_link_errors():
    with pytest.raises(ValueError, match="bytes_per_s"):
        planner.Link(0)
    with pytest.raises(ValueError, match="latency_s"):
        planner.Link(1e9, -1)
    with pytest.raises(ValueError, match="not both"):
        planner.Link(1e9, shared=True, per_node=True)


# -- alpha-beta times --------------------------------------------------------------------------
def test_collective_times_by_hand():
    link = planner.Link(1e9, 1e-5)
    B, p = 1_000_000, 4
    # allreduce: 2 (p-1) alpha + 2 (p-1)/p B / beta = 6e-5 + 1.5e-3
    assert close(planner.collective_time("allreduce", B, p, link), 6e-5 + 1.5e-3)
    # reduce-scatter: (p-1) alpha + (p-1)/p B / beta
    assert close(planner.collective_time("reduce_scatter", B, p, link), 3e-5 + 0.75e-3)
    # all-gather / all-to-all of B per rank / slot: (p-1) alpha + (p-1) B / beta
    assert close(planner.collective_time("all_gather", B, p, link), 3e-5 + 3e-3)
    assert close(planner.collective_time("all_to_all", B, p, link), 3e-5 + 3e-3)
    # one shared medium: each of the 4 senders gets beta / 4
    shared = planner.Link(1e9, 1e-5, shared=True)
    assert close(planner.collective_time("allreduce", B, p, shared), 6e-5 + 6e-3)
    # a load of 2 ranks crossing at once doubles the volume term only
    assert close(planner.collective_time("allreduce", B, p, link, load=2.0), 6e-5 + 3e-3)
    assert planner.collective_time("allreduce", B, 1, link) == 0.0
    assert planner.collective_time("allreduce", B, 4, planner.Link(math.inf, 0.0)) == 0.0
    with pytest.raises(ValueError, match="accepted"):
        planner.collective_time("broadcast", B, p, link)


# -- a CPU host's engine cost and a token bucket's burst -----------------------------------------
def test_engine_cost_calibrate_by_hand():
    # W = 4: small allreduce = c + 6 a, small all-gather = c + 3 a, large allreduce = small + 1.5 B / r
    W, c, a, r, B = 4, 2e-3, 4e-4, 1e9, 16 << 20
    e = planner.EngineCost.calibrate(W, c + 6 * a, c + 3 * a, c + 6 * a + 1.5 * B / r, B)
    assert close(e.latency_s, a) and close(e.per_collective_s, c) and close(e.bytes_per_s, r)
    # an all-gather slower than the allreduce: alpha 0, the per-collective cost the all-gather's
    e = planner.EngineCost.calibrate(W, 3e-3, 4e-3, 5e-3, B)
    assert e.latency_s == 0.0 and close(e.per_collective_s, 4e-3)
    # no excess in the large allreduce: no per-byte cost
    assert planner.EngineCost.calibrate(W, 3e-3, 2e-3, 3e-3, B).bytes_per_s == math.inf
    for bad in ((1, 1e-3, 1e-3, 1e-3, B), (W, 0.0, 1e-3, 1e-3, B), (W, 1e-3, -1, 1e-3, B), (W, 1e-3, 1e-3, 1e-3, 0)):
        with pytest.raises(ValueError, match="accepted"):
            planner.EngineCost.calibrate(*bad)
    with pytest.raises(ValueError, match="per_collective_s"):
        planner.EngineCost(-1, 1e9)
    with pytest.raises(ValueError, match="bytes_per_s"):
        planner.EngineCost(0, 0)


def test_collective_time_with_an_engine_is_the_slower_of_link_and_engine():
    eng = planner.EngineCost(2e-3, 1e9, 5e-4)
    B, p = 1_000_000, 4
    fast = planner.Link(1e12, 0.0)  # the engine is the floor: c + steps alpha + vol / r
    assert close(planner.collective_time("allreduce", B, p, fast, engine=eng), 2e-3 + 6 * 5e-4 + 1.5e-3)
    assert close(planner.collective_time("all_gather", B, p, fast, engine=eng), 2e-3 + 3 * 5e-4 + 3e-3)
    # gloo posts an all-to-all's sends at once: one alpha
    assert close(planner.collective_time("all_to_all", B, p, fast, engine=eng), 2e-3 + 5e-4 + 3e-3)
    slow = planner.Link(1e7, 0.0)  # the link is: 1.5 MB at 10 MB/s
    assert close(planner.collective_time("allreduce", B, p, slow, engine=eng), 0.15)
    assert planner.collective_time("allreduce", B, 1, slow, engine=eng) == 0.0
    # without an engine nothing changes
    assert close(planner.collective_time("allreduce", B, p, slow), 0.15)


def test_link_burst_is_lent_once_per_collective():
    B, p = 1_000_000, 4
    # per rank: 1.5 MB of volume, the first 0.5 MB lent
    link = planner.Link(1e7, 0.0, burst_bytes=500_000)
    assert close(planner.collective_time("allreduce", B, p, link), 1.0e6 / 1e7)
    # shared: 4 senders' 6 MB through one bucket of 0.5 MB, at 10 MB/s
    shared = planner.Link(1e7, 0.0, shared=True, burst_bytes=500_000)
    assert close(planner.collective_time("allreduce", B, p, shared), 5.5e6 / 1e7)
    # per node with a load of 2: 3 MB through the bucket
    node = planner.Link(1e7, 0.0, per_node=True, burst_bytes=500_000)
    assert close(planner.collective_time("allreduce", B, p, node, load=2.0), 2.5e6 / 1e7)
    # a collective smaller than the burst only pays its messages
    assert close(planner.collective_time("all_gather", 1000, p, planner.Link(1e7, 1e-5, burst_bytes=1e6)), 3e-5)
    with pytest.raises(ValueError, match="burst_bytes"):
        planner.Link(1e9, burst_bytes=-1)
    # the flat link over nodes keeps the inter link's burst
    m = planner.CostModel(planner.Link(math.inf), node, 2, planner.Throughput(device="cpu"), "gloo")
    assert m._flat_link(4).burst_bytes == 500_000


def test_cost_model_engine_cost_reaches_every_collective():
    eng = planner.EngineCost(2e-3, 1e9, 5e-4)
    none = gradcomp.Codec("none")
    m = planner.CostModel(planner.Link(math.inf, 0.0, name="lo"), planner.Link(125e6, 0.0, per_node=True), 2,
                          planner.Throughput(device="cpu"), "gloo", engine_cost=eng)
    n = 1 << 10
    # hierarchical over 2 x 2: intra allreduce (2 steps), inner dense allreduce (2), intra all-gather (1),
    # every one the engine's (tiny buffers): 3 c + 5 alpha + the volume at 1 GB/s
    h = m.predict("hierarchical", none, n, "float32", 4, "dense")
    c = n // 2
    vol = 4 * n + 4 * c + 4 * (c + 1)
    assert close(h["comm_s"], 3 * 2e-3 + 5 * 5e-4 + vol / 1e9)
    # the descriptor check: an all-gather of PEER_CHECK_BYTES over the flat link
    assert planner.PEER_CHECK_BYTES == 256
    assert close(m.peer_check_s(4), 2e-3 + 3 * 5e-4 + 3 * 256 / 1e9)
    assert m.describe()["engine_cost"] == {"per_collective_s": 2e-3, "bytes_per_s": 1e9, "latency_s": 5e-4,
                                           "kind_bytes_per_s": {}, "kind_fixed_s": {}}
    assert planner.CostModel(planner.Link(1e9)).peer_check_s(1) == 0.0


def test_engine_cost_all_gather_rate_from_its_own_calibration():
    # W = 4: small all-gather c + 3 a, large all-gather of P per rank = that + 3 P / g
    W, c, a, r, g, B, P = 4, 2e-3, 4e-4, 1e9, 4e8, 16 << 20, 16 << 20
    e = planner.EngineCost.calibrate(W, c + 6 * a, c + 3 * a, c + 6 * a + 1.5 * B / r, B,
                                     large_all_gather=(c + 3 * a + 3 * P / g, P))
    assert close(e.bytes_per_s, r) and close(e.rate("all_gather"), g)
    assert e.rate("allreduce") == e.rate("all_to_all") == e.rate("reduce_scatter") == e.bytes_per_s
    assert close(e.fixed_s("allreduce", W), c + 6 * a) and close(e.fixed_s("all_gather", W), c + 3 * a)
    assert close(e.fixed_s("all_to_all", 8), c + a) and close(e.fixed_s("reduce_scatter", 2), c + a)
    # the all-gather's volume now moves at g, an allreduce's still at r
    fast, n = planner.Link(1e12, 0.0), 1_000_000
    assert close(planner.collective_time("all_gather", n, W, fast, engine=e), c + 3 * a + 3 * n / g)
    assert close(planner.collective_time("allreduce", n, W, fast, engine=e), c + 6 * a + 1.5 * n / r)
    assert e.to_dict()["kind_bytes_per_s"] == {"all_gather": e.rate("all_gather")}
    assert "all_gather 0.4 GB/s" in repr(e)
    # a 2-rank group: alpha from its allreduce's two messages against the all-gather's one
    e2 = planner.EngineCost.calibrate(2, 1e-3 + 2 * a, 1e-3 + a, 1e-3 + 2 * a + B / r, B,
                                      large_all_gather=(1e-3 + a + P / g, P))
    assert close(e2.latency_s, a) and close(e2.per_collective_s, 1e-3) and close(e2.rate("all_gather"), g)
    with pytest.raises(ValueError, match="large_all_gather bytes=0"):
        planner.EngineCost.calibrate(W, 3e-3, 2e-3, 5e-3, B, large_all_gather=(4e-3, 0))
    with pytest.raises(ValueError, match="large_all_gather seconds=-1"):
        planner.EngineCost.calibrate(W, 3e-3, 2e-3, 5e-3, B, large_all_gather=(-1, P))
    with pytest.raises(ValueError, match="'broadcast'; accepted: allreduce"):
        planner.EngineCost(0, 1e9, kind_bytes_per_s={"broadcast": 1e9})
    with pytest.raises(ValueError, match=r"kind_bytes_per_s\['all_gather'\]=0"):
        planner.EngineCost(0, 1e9, kind_bytes_per_s={"all_gather": 0})


def test_engine_cost_all_to_all_fixed_time_from_its_own_calibration():
    """A measured all-to-all of a few bytes per slot is the all-to-all's fixed time; without
    one, the fixed time is inferred (per collective + one alpha); the other kinds keep theirs."""
    W, c, a, r, B, s = 4, 2e-3, 4e-4, 1e9, 16 << 20, 3.1e-3
    base = (W, c + 6 * a, c + 3 * a, c + 6 * a + 1.5 * B / r, B)
    inferred = planner.EngineCost.calibrate(*base)
    assert close(inferred.fixed_s("all_to_all", W), c + a) and inferred.kind_fixed_s == {}
    e = planner.EngineCost.calibrate(*base, small_all_to_all_s=s)
    assert e.kind_fixed_s == {"all_to_all": s} and e.fixed_s("all_to_all", W) == s
    assert close(e.fixed_s("allreduce", W), c + 6 * a) and close(e.fixed_s("all_gather", W), c + 3 * a)
    assert close(e.latency_s, a) and close(e.per_collective_s, c) and close(e.bytes_per_s, r)
    # the all-to-all's volume still moves at the engine's rate; the link's time when slower
    fast, slow, n = planner.Link(1e12, 0.0), planner.Link(1e6, 0.0), 1_000_000
    assert close(planner.collective_time("all_to_all", n, W, fast, engine=e), s + 3 * n / r)
    assert close(planner.collective_time("all_to_all", n, W, slow, engine=e), 3 * n / 1e6)
    assert e.to_dict()["kind_fixed_s"] == {"all_to_all": s} and "all_to_all 3100 us fixed" in repr(e)
    with pytest.raises(ValueError, match="small_all_to_all_s=0"):
        planner.EngineCost.calibrate(*base, small_all_to_all_s=0.0)
    with pytest.raises(ValueError, match="kind_fixed_s key 'gather'; accepted: allreduce"):
        planner.EngineCost(0, 1e9, kind_fixed_s={"gather": 1e-3})
    with pytest.raises(ValueError, match=r"kind_fixed_s\['all_to_all'\]=-1"):
        planner.EngineCost(0, 1e9, kind_fixed_s={"all_to_all": -1})


def test_cost_model_engine_cost_per_group_shape():
    """hierarchical's steps inside a node take the "intra" engine, its cross-node step the
    "inter" one; flat schemes and the descriptor check the "flat" one."""
    flat, intra, inter = (planner.EngineCost(2e-3, 1e9, 5e-4), planner.EngineCost(0.0, 5e8, 1e-3),
                          planner.EngineCost(1e-4, 2e8, 2e-3))
    none = gradcomp.Codec("none")
    links = (planner.Link(math.inf, 0.0, name="lo"), planner.Link(math.inf, 0.0, per_node=True))
    m = planner.CostModel(*links, 2, planner.Throughput(device="cpu"), "gloo",
                          engine_cost={"flat": flat, "intra": intra, "inter": inter})
    assert m.engine_for("flat") is flat and m.engine_for("intra") is intra and m.engine_for("inter") is inter
    n = 1 << 10
    c = n // 2
    h = m.predict("hierarchical", none, n, "float32", 4, "dense")
    # intra allreduce of the bucket (2 messages), inter dense allreduce of half (2), intra all-gather of half (1)
    want = (2 * 1e-3 + 4 * n / 5e8) + (1e-4 + 2 * 2e-3 + 4 * c / 2e8) + (1e-3 + 4 * (c + 1) / 5e8)
    assert close(h["comm_s"], want)
    d = m.predict("dense", none, n, "float32", 4)
    assert close(d["comm_s"], 2e-3 + 6 * 5e-4 + 1.5 * 4 * n / 1e9)
    assert close(m.peer_check_s(4), 2e-3 + 3 * 5e-4 + 3 * 256 / 1e9)
    assert set(m.describe()["engine_costs"]) == {"flat", "intra", "inter"}
    # a shape left out takes the flat one; one EngineCost is every shape's
    part = planner.CostModel(*links, 2, engine="gloo", engine_cost={"flat": flat, "inter": inter})
    assert part.engine_for("intra") is flat and part.engine_for("inter") is inter
    one = planner.CostModel(*links, 2, engine="gloo", engine_cost=flat)
    assert all(one.engine_for(k) is flat for k in planner.ENGINE_LEVELS) and one.engine_cost is flat
    assert planner.CostModel(*links, 2).engine_for("inter") is None
    for bad in ({"intra": intra}, {"flat": flat, "node": intra}, {"flat": 1.0}, 3.0):
        with pytest.raises(ValueError, match="accepted: None, an EngineCost"):
            planner.CostModel(*links, 2, engine_cost=bad)
    with pytest.raises(ValueError, match="engine level 'node'; accepted: flat, intra, inter"):
        m.engine_for("node")


def test_predict_flat_schemes_by_hand():
    # one node of 4 on a 1 GB/s link, alpha 10 us; kernels from the CPU default bandwidth
    n, W, a, beta = 1 << 16, 4, 1e-5, 1e9
    model = planner.CostModel(planner.Link(beta, a), throughput=planner.Throughput(device="cpu"))
    fp16, int8 = gradcomp.Codec("fp16"), gradcomp.Codec("int8")
    D = 4 * n
    dense = model.predict("dense", fp16, n, "float32", W)
    assert close(dense["comm_s"], 2 * 3 * a + 2 * 3 / 4 * D / beta)
    assert dense["encode_s"] == 0 and dense["decode_s"] == 0
    assert dense["bytes"] == {"intra": 2 * 3 / 4 * D, "inter": 0.0}
    s = model.predict("sum", fp16, n, "float32", W)  # the fp16 payload, 2 n bytes
    assert close(s["comm_s"], 2 * 3 * a + 2 * 3 / 4 * (2 * n) / beta)
    P = 32 + pad16(n) + pad16(4 * (n // 128))  # int8: header, n codes, a float32 per block of 128
    g = model.predict("gather", int8, n, "float32", W)
    assert close(g["comm_s"], 3 * a + 3 * P / beta)
    c = n // W
    P1 = 32 + pad16(c) + pad16(4 * (c // 128))
    t = model.predict("two_phase", int8, n, "float32", W)
    assert close(t["comm_s"], 2 * (3 * a + 3 * P1 / beta))
    assert t["bytes"]["intra"] == 2 * 3 * P1
    # kernel times: CPU default bandwidth, 85% efficiency, compulsory bytes (x, packet, residual)
    bw = planner.DEVICE_BYTES_PER_S["cpu"] * 0.85
    assert close(g["encode_s"], (4 * n + P + 8 * n) / bw)
    assert close(g["decode_s"], W * (4 * n + P) / bw)
    assert close(g["total_s"], g["comm_s"] + g["encode_s"] + g["decode_s"])


def test_predict_hierarchical_by_hand():
    # 2 nodes x 2 on gloo: intra loopback (inf bandwidth, alpha a), inter a per-node 1 Gb/s NIC
    n, a = 1 << 20, 5e-5
    R = 125e6
    model = planner.CostModel(planner.Link(math.inf, a, name="lo"), planner.Link(R, a, per_node=True), 2,
                              planner.Throughput(device="cpu"), "gloo")
    none = gradcomp.Codec("none")
    D, c = 4 * n, n // 2
    h = model.predict("hierarchical", none, n, "float32", 4, "dense")
    # intra: gloo allreduce over 2 (2 messages, inf bandwidth), all-gather over 2 (1 message);
    # inter: dense allreduce of the 4c-byte chunk over 2 nodes, both local ranks' groups on the NIC
    assert close(h["comm_s"], 2 * a + a + 2 * a + 2 * (2 * 1 / 2 * 4 * c) / R)
    # (the all-gather sends the chunk and its rank's status element: c + 1 elements)
    assert h["bytes"] == {"intra": 2 * 1 / 2 * D + 4 * (c + 1), "inter": 2 * 1 / 2 * 4 * c}
    # flat dense over 2 nodes: one ring hop per direction crosses the NIC: load 1
    f = model.predict("dense", none, n, "float32", 4)
    assert close(f["comm_s"], 6 * a + 2 * 3 / 4 * D / R)
    # NCCL accounting: a real reduce-scatter ((L-1)/L of the bucket)
    hb = planner.hierarchical_bytes(none, n, "float32", 4, 2, "dense", "nccl")
    assert hb["intra_bytes"] == 1 / 2 * D + 4 * (c + 1)
    gb = planner.bucket_bytes("hierarchical", none, n, "float32", 4, local_world_size=2, inner="dense", engine="gloo")
    assert gb["intra_bytes"] == D + 4 * (c + 1) and gb["inter_bytes"] == 4 * c
    assert gb["sent_bytes"] == gb["intra_bytes"] + gb["inter_bytes"]
    assert gb["ring_bytes"] == 2 * 3 / 4 * D
    with pytest.raises(ValueError, match="inner"):
        planner.bucket_bytes("hierarchical", none, n, "float32", 4, local_world_size=2)
    with pytest.raises(ValueError, match="divide"):
        planner.hierarchical_groups(6, 4)
    with pytest.raises(ValueError, match="more than one node"):
        planner.CostModel(planner.Link(1e9)).predict("hierarchical", none, n, "float32", 4, "dense")


def test_hierarchical_bytes_uneven_chunks():
    # n = 10 over L = 4: c = 3, chunks 3, 3, 3, 1; every local rank accounts the full chunk c
    none = gradcomp.Codec("none")
    hb = planner.hierarchical_bytes(none, 10, "bfloat16", 8, 4, "sum", "gloo")
    payload_c = 4 * 3  # the chunk travels as float32 across nodes
    # the node sum accumulates in a float32 copy (gloo: an allreduce of 40 bytes); the all-gather
    # of the averaged chunks is in the bucket dtype (3 bfloat16 elements and the status element
    # from each of 3 others)
    assert hb["intra_bytes"] == 2 * 3 / 4 * 40 + 3 * (2 * 4)
    assert hb["inter_bytes"] == 2 * 1 / 2 * payload_c
    # NCCL: the float32 copy padded to L c = 12 elements is reduce-scattered, (L-1)/L of 48 bytes
    hn = planner.hierarchical_bytes(none, 10, "bfloat16", 8, 4, "sum", "nccl")
    assert hn["intra_bytes"] == 3 / 4 * 48 + 3 * (2 * 4)
    assert planner.hierarchical_inner(none, 10 ** 6, "float32", 4, 4, "gather") == "dense"  # one node


# -- auto from the cost model --------------------------------------------------------------------
def mlp_buckets():
    """The main job's digits MLP (64 -> 256 -> 256 -> 10) in one DDP bucket (25 MiB cap) and a
    25M-parameter model's 25 MiB buckets. (Much smaller buckets can go to gather even on an
    unlimited link: an all-gather sends W-1 messages where a ring allreduce sends 2 (W-1), and
    at a few thousand elements that latency outweighs the kernels; the model says so.)"""
    mlp = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    return [(mlp, "float32")] + planner.ddp_buckets(planner.parameter_list(25_000_000))


@pytest.mark.parametrize("spec", ["fp16", "topk:ratio=0.01", "int8", "onebit"])
def test_auto_dense_on_unlimited_compressed_at_100mbit(spec):
    codec = gradcomp.Codec(spec)
    fast = planner.CostModel.loopback("unlimited")
    slow = planner.CostModel.loopback("100mbit")
    for n, dt in mlp_buckets():
        assert planner.choose_scheme(codec, n, dt, 4, cost_model=fast) == "dense"
        assert planner.choose_scheme(codec, n, dt, 4, cost_model=slow) != "dense"
    # without a cost model the byte rule decides, as before
    assert planner.choose_scheme(codec, 1 << 16, "float32", 4) == planner.bytes_choice(codec, 1 << 16, "float32", 4)


def test_choose_picks_the_least_predicted_time():
    codec = gradcomp.Codec("int8")
    m = planner.CostModel.loopback("1gbit")
    ch = m.choose(codec, 1 << 20, "float32", 4)
    best = min(ch["predictions"], key=lambda p: p["total_s"])
    assert ch["scheme"] == best["scheme"]
    names = [p["scheme"] for p in ch["predictions"]]
    assert names == ["dense", "gather", "two_phase"]
    assert "cost model chose" in planner.choice_report(ch)
    # with two nodes of 2 the hierarchical candidates appear (one per inner scheme) ...
    m2 = planner.CostModel(planner.Link(math.inf, 5e-5), planner.Link.parse("100mbit", 5e-5, per_node=True), 2,
                           planner.Throughput(device="cpu"), "gloo")
    ch2 = m2.choose(codec, 1 << 20, "float32", 4, local_world_size=2)
    assert [(p["scheme"], p["inner"]) for p in ch2["predictions"]][3:] == [
        ("hierarchical", "dense"), ("hierarchical", "gather"), ("hierarchical", "two_phase")]
    # ... only when the compressor's local world size matches
    ch3 = m2.choose(codec, 1 << 20, "float32", 4, local_world_size=0)
    assert all(p["scheme"] != "hierarchical" for p in ch3["predictions"])
    inner = planner.hierarchical_inner(codec, 1 << 20, "float32", 4, 2, cost_model=m2)
    hp = [p for p in ch2["predictions"] if p["scheme"] == "hierarchical"]
    assert inner == min(hp, key=lambda p: p["total_s"])["inner"]


def test_choose_scheme_requested_and_small():
    codec = gradcomp.Codec("int8")
    m = planner.CostModel.loopback("100mbit")
    assert planner.choose_scheme(codec, 100, "float32", 4, cost_model=m) == "dense"  # < min_compress_numel
    assert planner.choose_scheme(codec, 1 << 20, "float32", 4, "gather", cost_model=m) == "gather"
    assert planner.choose_scheme(codec, 1 << 20, "float32", 4, "hierarchical") == "hierarchical"
    with pytest.raises(ValueError, match="accepted"):
        planner.choose_scheme(codec, 1 << 20, "float32", 4, "tree")


# -- the training step ---------------------------------------------------------------------------
def test_ddp_buckets_by_hand():
    cap = 1000  # bytes: 250 float32 elements per bucket
    params = [("a", 100, "float32"), ("b", 300, "float32"), ("c", 60, "bfloat16"), ("d", 50, "float32")]
    # reverse order: d (50), c (bf16 60, own dtype), b 300 -> 200 fills the first bucket to 250, 100 left,
    # a 100 -> 200; flush: float32 200, bfloat16 60
    assert planner.ddp_buckets(params, cap) == [(250, "float32"), (200, "float32"), (60, "bfloat16")]
    assert planner.ddp_buckets(params, cap, dtype="bfloat16") == [(500, "bfloat16"), (10, "bfloat16")]
    with pytest.raises(ValueError, match="bucket_cap_bytes"):
        planner.ddp_buckets(params, 0)


def test_plan_step_accumulate_overlap_required_bandwidth():
    none = gradcomp.Codec("none")
    m = planner.CostModel(planner.Link(10e9, 0.0))
    params = planner.parameter_list(10_000_000)
    p1 = planner.plan_step(params, none, 8, m, "dense", step_time_s=0.5, bucket_cap_bytes=4_000_000)
    p8 = planner.plan_step(params, none, 8, m, "dense", step_time_s=0.5, accumulate=8, backward_s=0.001,
                           bucket_cap_bytes=4_000_000)
    D = 40_000_000
    assert p1["gradient_bytes"] == D
    assert p1["bytes"]["intra"] == 2 * 7 / 8 * D  # 10 buckets of 4 MB, each 2 (W-1)/W
    assert p1["required_bytes_per_s"] == D / 0.5 and p1["required_bits_per_s"] == 8 * D / 0.5
    assert p8["required_bytes_per_s"] == D / (8 * 0.5)
    assert p8["bytes_per_micro_batch"]["intra"] == p1["bytes"]["intra"] / 8
    assert 1 - p8["bytes_per_micro_batch"]["intra"] / p1["bytes_per_micro_batch"]["intra"] == 0.875
    per_bucket = 2 * 7 / 8 * 4_000_000 / 10e9
    assert close(p1["comm_s"], 10 * per_bucket)
    assert p1["exposed_overlap_s"] == p1["sync_s"]  # no backward given: nothing overlaps
    assert close(p8["exposed_overlap_s"], 10 * per_bucket - 0.001)
    assert close(p1["step_s"], 0.5 + 10 * per_bucket)
    # overlap never hides the last bucket
    p9 = planner.plan_step(params, none, 8, m, "dense", backward_s=100.0, bucket_cap_bytes=4_000_000)
    assert close(p9["exposed_overlap_s"], per_bucket)
    with pytest.raises(ValueError, match="accumulate"):
        planner.plan_step(params, none, 8, m, accumulate=0)


def test_parameter_list():
    mod = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False))
    assert planner.parameter_list(mod) == [("0.weight", 12, "float32"), ("0.bias", 4, "float32"),
                                           ("1.weight", 8, "float32")]
    assert planner.parameter_list(70e9) == [("params", 70_000_000_000, "float32")]
    with pytest.raises(ValueError, match="whole number"):
        planner.parameter_list(1.5)
    with pytest.raises(TypeError, match="accepted"):
        planner.parameter_list("big")


# -- the published figures -------------------------------------------------------------------------
def test_published_figures_exact():
    figs = {claim: (got, want) for claim, got, want in planner.published_figures()}
    got = {k: v[0] for k, v in figs.items()}
    assert got["70B float32 gradients per step (bytes)"] == 70 * 10 ** 9 * 4 == 280 * 10 ** 9
    assert got["70B every 2 s: required bytes/s"] == 140e9
    assert got["70B every 2 s: required bits/s"] == 1.12e12
    assert got["ring allreduce, 512 ranks: bytes per link per phase / data"] == 511 / 512
    assert got["hierarchical, 8 per rack: data entering the network, flat / hierarchical"] == 8.0
    assert close(got["hierarchical, 64 racks of 8: per-rank inter-rack bytes, flat / hierarchical"], 511 / 63)
    assert got["accumulate 8: traffic cut per micro-batch"] == 0.875
    assert got["175B float32 gradients per step at 8, 512, 4096 GPUs (bytes)"] == [700 * 10 ** 9]
    for claim, (g, w) in figs.items():  # and each agrees with the figure the list quotes
        assert g == w or close(g, w), claim


# -- gradcomp-plan --------------------------------------------------------------------------------
def test_cli_json_70b(capsys):
    assert planner_cli.main(["--params", "70e9", "--gpus", "512", "--step-time", "2", "--codec", "none",
                             "--codec", "bf16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["gradient_bytes"] == 280e9
    assert res["required_bytes_per_s"] == 140e9 and res["required_bits_per_s"] == 1.12e12
    assert res["inputs"]["nodes"] == 64 and res["inputs"]["gpus_per_node"] == 8
    dense = res["rows"][0]
    assert dense["codec"] == "none" and dense["schemes_used"] == {"dense": math.ceil(280e9 / (25 << 20))}
    # the flat ring over 64 nodes: every rank's 2 (W-1)/W of the gradient crosses the network
    assert close(dense["bytes"]["inter"], 2 * 511 / 512 * 280e9, rel=1e-9)
    assert {s["gbps"] for s in res["sweep"]} == set(planner_cli.SWEEP_GBPS)


def test_cli_engine_cost(capsys):
    # 1M float32 parameters (one 4 MB bucket) on 4 gloo ranks of one host, a 100 Gb/s loopback:
    # the engine (1 ms + 6 x 0.5 ms + 6 MB at 1 GB/s) is the floor of the dense allreduce
    argv = ["--params", "1e6", "--gpus", "4", "--backend", "gloo", "--link-gbps", "nvlink=100", "--latency-us",
            "nvlink=0", "--codec", "none", "--json"]
    assert planner_cli.main(argv + ["--engine-cost", "1000,500,1"]) == 0
    res = json.loads(capsys.readouterr().out)
    want = {"per_collective_s": 1e-3, "latency_s": 5e-4, "bytes_per_s": 1e9, "kind_bytes_per_s": {},
            "kind_fixed_s": {}}
    assert res["inputs"]["cost_model"]["engine_cost"] == want
    dense = res["rows"][0]
    assert close(dense["comm_s"], 1e-3 + 6 * 5e-4 + 1.5 * 4e6 / 1e9, rel=1e-9)
    assert planner_cli.main(argv) == 0  # without it: the link alone
    assert close(json.loads(capsys.readouterr().out)["rows"][0]["comm_s"], 1.5 * 4e6 / 12.5e9, rel=1e-9)
    # a fourth number: the all-gather's own rate
    e = planner_cli.parse_engine_cost("1000,500,1,0.25")
    assert e.kind_bytes_per_s == {"all_gather": 0.25e9} and e.bytes_per_s == 1e9
    # a fifth: the all-to-all's measured fixed time, microseconds
    e = planner_cli.parse_engine_cost("1000,500,1,0.25,2000")
    assert e.kind_fixed_s == {"all_to_all": 2e-3} and close(e.fixed_s("all_to_all", 4), 2e-3)
    assert close(e.fixed_s("allreduce", 4), 1e-3 + 6 * 5e-4)
    for bad in ("1000,500", "1000,500,1,2,3,4", "a,b,c", "1000,500,1,0", "1000,500,1,0.25,-1"):
        with pytest.raises(ValueError, match="accepted"):
            planner_cli.parse_engine_cost(bad)


def test_cli_table_png_and_scheme_all(tmp_path, capsys):
    out = tmp_path / "plan"
    assert planner_cli.main(["--params", "125M", "--gpus", "16", "--gpus-per-node", "8", "--link-gbps",
                             "network=100", "--codec", "none", "--codec", "int8", "--scheme", "all",
                             "--step-time", "0.3", "--backward", "0.2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "required bandwidth" in text and "hierarchical" in text and "int8" in text
    png = (out / "plan_step_vs_bandwidth.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    res = json.loads((out / "plan.json").read_text())
    # the flat dense reference, then codec none and int8 on the cost model's candidates, in the
    # scheme table's order (rs_ag, which auto never takes, is not one)
    assert [(r["codec"], r["scheme"]) for r in res["rows"]] == [
        ("none", "dense"), ("none", "auto"), ("none", "sum"), ("none", "gather"), ("none", "hierarchical"),
        ("int8", "auto"), ("int8", "dense"), ("int8", "gather"), ("int8", "two_phase"), ("int8", "hierarchical")]
    assert res["inputs"]["cost_model"]["inter"]["bits_per_s"] == 100e9
    assert "x scheme" in text and "x codec" in text and "dense(flat)" in text


def test_cli_speedup_is_the_step_time_ratio_split_into_scheme_and_codec(capsys):
    """Issue 19 (1, 2): the speed-up divides step times (it divided exposed times, one of them near
    zero under --backward: 20,000x for a step going from 5.2 s to 1 s), and codec none gets the
    same scheme candidates (the hierarchical reduction included), so x total = x scheme * x codec
    with x scheme what the topology alone gives."""
    assert planner_cli.main(["--params", "7B", "--gpus", "64", "--gpus-per-node", "8", "--link-gbps", "network=100",
                             "--step-time", "1.0", "--backward", "0.6", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = res["rows"]
    dense = rows[0]
    assert dense.get("reference") and dense["scheme"] == "dense" and dense["compared"] == "step_s"
    for r in rows:
        assert r["compared"] == "step_s"
        assert close(r["speedup_vs_dense"], dense["step_s"] / r["step_s"])
        assert close(r["speedup_vs_dense"], r["scheme_gain"] * r["codec_gain"])
        assert r["speedup_vs_dense"] <= dense["step_s"] / 1.0 + 1e-9  # no step is faster than its compute
    none_auto = next(r for r in rows if r["codec"] == "none" and r["scheme"] == "auto")
    assert any(k.startswith("hierarchical") for k in none_auto["schemes_used"]), none_auto["schemes_used"]
    assert close(none_auto["codec_gain"], 1.0) and none_auto["scheme_gain"] > 1
    for r in rows[1:]:
        assert close(r["scheme_gain"], none_auto["scheme_gain"])  # the same candidates for every codec
    # without --step-time the exposed times without overlap are compared (never what is left
    # after --backward, near zero for the compressed rows), and the table says so
    argv = ["--params", "7B", "--gpus", "64", "--gpus-per-node", "8", "--link-gbps", "network=100",
            "--backward", "0.3"]
    assert planner_cli.main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {r["compared"] for r in res["rows"]} == {"exposed_s"}
    dense = res["rows"][0]
    for r in res["rows"]:
        assert close(r["speedup_vs_dense"], dense["exposed_s"] / r["exposed_s"])
        assert r["speedup_vs_dense"] < 100, (r["codec"], r["scheme"], r["speedup_vs_dense"])  # 38,900x before
    assert planner_cli.main(argv) == 0
    assert "exposed times without overlap (comm: no --step-time given)" in capsys.readouterr().out


def test_cli_nic_per_node(capsys):
    """--nic-per-node: the node's L ranks share one NIC (the planner's per_node link)."""
    argv = ["--params", "1B", "--gpus", "16", "--gpus-per-node", "8", "--codec", "int8", "--scheme", "hierarchical",
            "--json"]
    assert planner_cli.main(argv) == 0
    per_gpu = json.loads(capsys.readouterr().out)
    assert planner_cli.main(argv + ["--nic-per-node"]) == 0
    per_node = json.loads(capsys.readouterr().out)
    assert per_node["inputs"]["cost_model"]["inter"]["per_node"] is True
    assert per_gpu["inputs"]["cost_model"]["inter"]["per_node"] is False
    a, b = per_gpu["rows"][1], per_node["rows"][1]
    assert a["bytes"] == b["bytes"] and b["comm_s"] > a["comm_s"]


def test_crossover_and_curve_groups():
    """Issue 19 (3): where a codec stops paying (its gain falls through 1.01, interpolated in log
    bandwidth), and codecs with identical curves drawn once."""
    g = planner_cli.crossover_gbps([(1, 3.0), (10, 2.0), (100, 0.5)])
    t = (2.0 - 1.01) / (2.0 - 0.5)
    assert close(g, 10 ** (1 + t))
    assert planner_cli.crossover_gbps([(1, 3.0), (10, 2.0)]) == float("inf")
    assert planner_cli.crossover_gbps([(1, 1.0), (10, 0.9)]) is None
    assert planner_cli.crossover_gbps([(1, 1.005), (10, 1.0)]) is None  # a tie is not paying
    sweep = [{"gbps": gb, "codec": c, "step_s": v} for gb in (1, 10) for c, v in
             (("dense (flat)", 5.0), ("none", 4.0), ("fp8", 2.0 / gb), ("int8", 2.0 / gb), ("int4", 1.0))]
    groups = planner_cli.curve_groups(sweep, "step_s")
    assert [labels for labels, _ in groups] == [["dense (flat)"], ["none"], ["fp8", "int8"], ["int4"]]


def test_cli_model_module(tmp_path, monkeypatch, capsys):
    (tmp_path / "gc_plan_model.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10).to(torch.bfloat16))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert planner_cli.main(["--model", "gc_plan_model:build", "--gpus", "2", "--json", "--codec", "none"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["inputs"]["params"] == 1000 * 1000 + 1000 + 1000 * 10 + 10
    assert res["gradient_bytes"] == 4 * (1000 * 1000 + 1000) + 2 * (1000 * 10 + 10)
    with pytest.raises(SystemExit):
        planner_cli.main(["--model", "torch.nn:Linear", "--gpus", "2"])  # needs arguments
    assert "torch.nn:Linear" in capsys.readouterr().err


@pytest.mark.parametrize("argv,msg", [
    (["--gpus", "4"], "--params or --model"),
    (["--params", "1e6", "--gpus", "6", "--gpus-per-node", "4"], "must divide"),
    (["--params", "1.5x"], "whole number"),
    (["--params", "1e6", "--link-gbps", "wifi=1"], "accepted"),
    (["--params", "1e6", "--accumulate", "0"], "accumulate"),
    (["--model", "nomodule"], "module:attr"),
    (["--params", "1e6", "--engine-cost", "1,2"], "three to five numbers"),
    (["--params", "1e6", "--engine-cost", "1,2,0"], "bytes_per_s"),
])
def test_cli_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        planner_cli.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_figures(capsys):
    assert planner_cli.main(["--figures"]) == 0
    out = capsys.readouterr().out
    assert "280000000000" in out and "1120000000000.0" in out and "0.875" in out


# -- auto from the cost model on real gloo ranks ----------------------------------------------------
def job_auto(rank, world, spec, model_kind):
    """The main job's digits MLP under DDP (one 25 MiB bucket), `auto` from a cost model every rank
    builds from the same configuration; returns the layouts and the parameters after one step."""
    import logging

    import gradcomp.torch as gt
    from ddp_helpers import ddp

    if model_kind == "two_nodes_100mbit":
        cm = planner.CostModel(planner.Link(math.inf, 5e-5), planner.Link.parse("100mbit", 5e-5, per_node=True), 2,
                               planner.Throughput(device="cpu"), "gloo")
        kw = {"local_world_size": 2}
    else:
        cm = planner.CostModel.loopback(model_kind)
        kw = {}
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    lg = logging.getLogger("gradcomp")
    h = Keep(level=logging.INFO)
    lg.addHandler(h)
    old = lg.level
    lg.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        m = ddp(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 10)), bucket_cap_mb=25)
        st = gt.register(m, codec=spec, cost_model=cm, exempt=(), **kw)  # the choice for the whole bucket
        g = torch.Generator().manual_seed(100 + rank)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in m.parameters()]).numpy().copy()
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    lay = [(d["scheme"], d.get("inner"), d["numel"]) for d in st.bucket_layouts()]
    return lay, grads, [r for r in records if "cost model chose" in r]


@pytest.mark.parametrize("spec", ["fp16", "topk:ratio=0.01", "int8"])
def test_auto_cost_model_on_gloo_ranks(spec):
    """The same model and codec: dense on an unlimited loopback, compressed at 100 Mb/s, and
    hierarchical on two nodes joined at 100 Mb/s; the same choice (and bitwise the same average)
    on every rank, the choice logged once with every candidate's predicted time, and equal to
    the planner's own choice for the bucket."""
    from ddp_helpers import run

    codec = gradcomp.Codec(spec)
    for kind in ("unlimited", "100mbit", "two_nodes_100mbit"):
        res = run(4, job_auto, spec, kind)
        lays = [r[0] for r in res]
        assert all(lay == lays[0] for lay in lays), (kind, lays)
        assert len(lays[0]) == 1, lays  # one bucket
        scheme, inner, numel = lays[0][0]
        assert numel == 64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
        g0 = res[0][1]
        for r in res[1:]:
            assert np.array_equal(r[1].view(np.int32), g0.view(np.int32)), kind
        logs = res[0][2]
        assert len(logs) == 1 and "dense" in logs[0], logs
        if kind == "unlimited":
            assert scheme == "dense", (kind, scheme)
        elif kind == "100mbit":
            assert scheme != "dense", (kind, scheme)
            assert scheme == planner.CostModel.loopback("100mbit").choose(codec, numel, "float32", 4)["scheme"]
        else:
            assert scheme == "hierarchical" and inner in ("sum", "gather", "two_phase"), (kind, scheme, inner)
            assert "hierarchical(" in logs[0]


# -- kernel times from a gradcomp-bench table -------------------------------------------------------
def test_throughput_from_bench_table(tmp_path, capsys):
    from gradcomp import bench
    from gradcomp.bench.__main__ import main as bench_main

    assert bench_main(["--sizes", "12", "14", "--codecs", "int8", "--dtypes", "float32", "--reps", "1",
                       "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    table = bench.load(tmp_path / "bench_cpu.json")
    row = [r for r in table["rows"] if r["codec"] == "int8" and r["numel"] == 1 << 14 and not r["error_feedback"]][0]
    tp = planner.Throughput(table=table)
    int8 = gradcomp.Codec("int8")
    # the largest size's measured seconds per element, scaled linearly
    assert close(tp.encode_s(int8, 1 << 20, "float32"), (1 << 20) * row["encode_s"] / (1 << 14))
    assert close(tp.decode_s(int8, 1 << 20, "float32"), (1 << 20) * row["decode_s"] / (1 << 14))
    # a codec the table lacks: its compulsory bytes at 85% of the copy bandwidth the table measured
    fp16 = gradcomp.Codec("fp16")
    bw = table["copy_bytes_per_s"] * 0.85
    assert close(tp.encode_s(fp16, 1000, "float32", False), (4000 + fp16.packet_bytes(1000, "float32")) / bw)
    # gradcomp-plan reads the same file
    assert planner_cli.main(["--params", "1e6", "--gpus", "4", "--engine", "gloo", "--codec", "int8",
                             "--scheme", "gather", "--throughput", str(tmp_path / "bench_cpu.json"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["inputs"]["cost_model"]["throughput"] == table["device_name"]
    with pytest.raises(ValueError, match="device"):
        planner.Throughput(device="TPU")
