"""gradcomp.planner for FSDP2 and HSDP (issue 22): the units of a model, the bytes one rank sends
per step in the parameter all-gather, the gradient reduce-scatter (NCCL's ring, or gradcomp's
compressed all-to-all) and HSDP's replica all-reduce, per link level and per node, the predicted
times, and ``gradcomp-plan --engine fsdp2|hsdp`` (the former ``--engine nccl|gloo`` kept).

Every expected value is computed here by hand from the layout FSDP2 uses (``torch.chunk`` along
dim 0: c = ceil(dim0 / W) rows per rank, padded to c rows) and from the packet layout of the
codecs (32-byte header, sections padded to 16 bytes), never from the planner's helpers. Byte
counts are exact integers (or exact binary64 where a ratio is dyadic); times within 1e-12
relative (sums of a few float terms).
"""

import json
import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import gradcomp  # noqa: E402
from gradcomp import planner  # noqa: E402
from gradcomp import planner_cli  # noqa: E402


def pad16(n):
    return (n + 15) // 16 * 16


def int8_packet(n):
    """int8: 32-byte header + n codes + one float32 scale per 128-element block, each padded."""
    return 32 + pad16(n) + pad16(4 * -(-n // 128))


def none_packet(n, value_bytes):
    """none (a cast): 32-byte header + n elements of the input dtype, padded."""
    return 32 + pad16(value_bytes * n)


def close(a, b, rel=1e-12):
    return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)


# One FSDP unit (not the root) of four parameters; W = 4 ranks in 2 nodes of L = 2.
#   blk.w1    (5, 256)  c = 2 rows: ranks hold 2, 2, 1, 0 rows  -> 512, 512, 256, 0 elements, padded 512
#   blk.w2    (7, 200)  c = 2 rows: 2, 2, 2, 1                  -> 400, 400, 400, 200, padded 400
#   blk.bias  (6,)      1-D, exempt; c = 2: 2, 2, 2, 0          -> padded 2
#   blk.small (10, 10)  100 < 1024 elements, exempt; c = 3: 3, 3, 3, 1 rows of 10 -> 30, 30, 30, 10, padded 30
PARAMS = [("blk.w1", 1280, "float32", (5, 256)), ("blk.w2", 1400, "float32", (7, 200)),
          ("blk.bias", 6, "float32", (6,)), ("blk.small", 100, "float32", (10, 10))]
UNITS = [{"name": "blk", "root": False, "params": PARAMS}]
ROWS_W4 = [(912, 32), (912, 32), (656, 32), (200, 10)]  # (compressed, exempt) elements of rank j's shard
SHARD_W4 = 512 + 400 + 2 + 30  # every rank's padded shard, elements (944)
# the same unit over G = 2 (HSDP's shard group of one node of 2):
#   w1 c = 3: 3, 2 rows -> 768, 512; w2 c = 4: 4, 3 -> 800, 600; bias c = 3: 3, 3; small c = 5: 50, 50
ROWS_G2 = [(1568, 53), (1112, 53)]
SHARD_G2 = 768 + 800 + 3 + 50  # 1621

INTRA = planner.Link(1e9, 1e-6, name="intra")
INTER = planner.Link(1e8, 1e-5, name="inter")
CPU = planner.Throughput(device="cpu")
BW = 10e9 * 0.85  # the CPU default bandwidth times the efficiency of a non-sparse codec's kernels


def model(per_node=False):
    inter = planner.Link(INTER.bytes_per_s, INTER.latency_s, name="inter", per_node=per_node)
    return planner.CostModel(INTRA, inter, 2, CPU)


def test_shard_rows_and_the_unit_layout():
    """The planner's rows of the unit agree with FSDP2's chunking written out above."""
    rows, N = planner.fsdp_rows([(n, s) for _, n, _, s in PARAMS], 4)
    assert rows == ROWS_W4 and N == 4 * SHARD_W4
    rows, N = planner.fsdp_rows([(n, s) for _, n, _, s in PARAMS], 2)
    assert rows == ROWS_G2 and N == 2 * SHARD_G2
    assert planner.fsdp_exempt(6, 1) and planner.fsdp_exempt(100, 2) and not planner.fsdp_exempt(1024, 2)
    # with min_compress_numel 0 the 10 x 10 matrix is compressed, the bias still is not (1-D)
    rows, _ = planner.fsdp_rows([(n, s) for _, n, _, s in PARAMS], 4, min_compress_numel=0)
    assert rows == [(942, 2), (942, 2), (686, 2), (210, 0)]


def test_fsdp2_dense_by_hand():
    """Dense: ring all-gather of the bfloat16 shards twice (forward + backward re-gather), ring
    reduce-scatter of the float32 gradients; over 2 nodes every ring byte counts as inter (the
    boundary rank) and each node puts one rank's volume into the network."""
    p = planner.plan_fsdp_step(UNITS, gradcomp.Codec("int8"), 4, model(), engine="fsdp2", variant="dense")
    ag = 2 * 3 * SHARD_W4 * 2  # twice, (W-1) shards of 944 bfloat16 elements
    rs = 3 * SHARD_W4 * 4      # (W-1)/W of N = 4 * 944 float32 elements
    c = p["collectives"]
    assert c["all_gather"]["bytes"] == {"intra": 0.0, "inter": ag} and c["all_gather"]["node_inter_bytes"] == ag
    assert c["reduce_scatter"]["bytes"] == {"intra": 0.0, "inter": rs} and c["reduce_scatter"]["node_inter_bytes"] == rs
    assert c["replica_all_reduce"]["calls"] == 0
    assert p["bytes"] == {"intra": 0.0, "inter": ag + rs} and p["node_inter_bytes"] == ag + rs
    assert p["params"] == 1280 + 1400 + 6 + 100 and p["exempt_params"] == 32 * 3 + 10
    assert p["param_bytes"] == 2 * 2786 and p["gradient_bytes"] == 4 * 2786
    # times: the flat ring's link over 2 nodes: inter bandwidth, mean hop latency (2 a_inter + 2 a_intra) / 4
    a = (2 * 1e-5 + 2 * 1e-6) / 4
    t_ag = 3 * a + 3 * SHARD_W4 * 2 / 1e8
    t_rs = 3 * a + 3 / 4 * (4 * SHARD_W4 * 4) / 1e8
    assert close(p["comm_s"], 2 * t_ag + t_rs) and p["encode_s"] == 0 and p["decode_s"] == 0
    # reshard_after_forward=False: one all-gather
    q = planner.plan_fsdp_step(UNITS, gradcomp.Codec("int8"), 4, model(), engine="fsdp2", variant="dense",
                               reshard_after_forward=False)
    assert q["collectives"]["all_gather"]["bytes"]["inter"] == ag // 2


def test_fsdp2_compressed_reduce_scatter_by_hand():
    """Compressed: one all-to-all of W slots; slot = the int8 packet of the largest row (912
    elements), the largest row's exempt elements raw (32 float32 = 128 bytes) and the 16-byte
    trailer; of its 3 slots a rank sends 2 off its node, 1 inside."""
    slot = int8_packet(912) + 128 + 16
    assert slot == 976 + 128 + 16 == 1120
    for per_node in (False, True):
        p = planner.plan_fsdp_step(UNITS, gradcomp.Codec("int8"), 4, model(per_node), engine="fsdp2",
                                   variant="reduce_scatter")
        rs = p["collectives"]["reduce_scatter"]
        assert rs["schemes"] == {"all_to_all": 1}
        assert rs["bytes"] == {"intra": 1 * slot, "inter": 2 * slot}
        assert rs["node_inter_bytes"] == 2 * 2 * slot  # both ranks of the node, 2 slots each
        a = (2 * 1e-5 + 2 * 1e-6) / 4
        load = 2 * (4 - 2) / (4 - 1) if per_node else 1.0  # the node's NIC carries L (W-L)/(W-1) ranks' volumes
        assert close(rs["comm_s"], 3 * a + load * 3 * slot / 1e8)
        # kernels: one encode of the 2680 compressed elements (float32 in, packet out, residual read + written),
        # W decodes of this rank's row (912 elements) into float32
        enc = (4 * 2680 + int8_packet(2680) + 8 * 2680) / BW
        dec = 4 * (int8_packet(912) + 4 * 912) / BW
        assert close(rs["encode_s"], enc) and close(rs["decode_s"], dec)
        assert close(p["total_s"], p["comm_s"] + enc + dec)


def test_hsdp_by_hand():
    """HSDP, W = 4 in 2 nodes of 2: all-gather and reduce-scatter over the 2 ranks of a node,
    then rank 0's shard (1621 padded elements: 1568 compressed, 53 exempt) all-reduced across the
    2 replicas on the inter link."""
    int8 = gradcomp.Codec("int8")
    d = planner.plan_fsdp_step(UNITS, int8, 4, model(), engine="hsdp", variant="dense")
    assert (d["shard_size"], d["replicas"]) == (2, 2)
    c = d["collectives"]
    assert c["all_gather"]["bytes"] == {"intra": 2 * SHARD_G2 * 2, "inter": 0.0}
    assert c["reduce_scatter"]["bytes"] == {"intra": SHARD_G2 * 4, "inter": 0.0}
    ar = 2 * (2 - 1) / 2 * SHARD_G2 * 4  # ring all-reduce of the padded shard
    assert c["replica_all_reduce"]["bytes"] == {"intra": 0.0, "inter": ar}
    assert c["replica_all_reduce"]["node_inter_bytes"] == 2 * ar  # both local ranks' replica groups
    assert d["node_inter_bytes"] == 2 * ar and d["bytes"]["inter"] == ar
    t = (2 * (1e-6 + SHARD_G2 * 2 / 1e9)          # two all-gathers over 2 ranks on the intra link
         + 1e-6 + SHARD_G2 * 4 / 1e9              # reduce-scatter: (p-1) a + (p-1)/p N / beta
         + 2 * 1e-5 + ar / 1e8)                   # ring all-reduce over 2 replicas on the inter link
    assert close(d["comm_s"], t)

    # engine costs per group shape: the shard group's collectives take the node's ("intra"), the
    # replica all-reduce the cross-node one ("inter"); on links this fast the engines are the time
    fast = planner.CostModel(planner.Link(1e15, 0.0), planner.Link(1e15, 0.0), 2, CPU, engine_cost={
        "flat": planner.EngineCost(1.0, 1e15), "intra": planner.EngineCost(1e-3, 1e9, 1e-4),
        "inter": planner.EngineCost(5e-3, 1e8, 1e-4)})
    e = planner.plan_fsdp_step(UNITS, int8, 4, fast, engine="hsdp", variant="dense")
    t = (2 * (1e-3 + 1e-4 + SHARD_G2 * 2 / 1e9)   # two all-gathers inside the node
         + 1e-3 + 1e-4 + SHARD_G2 * 4 / 1e9       # the reduce-scatter
         + 5e-3 + 2 * 1e-4 + ar / 1e8)            # the replica all-reduce, at the inter engine's rate
    assert close(e["comm_s"], t)

    # compressed everywhere, the replica all-reduce's scheme forced to two_phase: chunks of 784
    both = planner.plan_fsdp_step(UNITS, int8, 4, model(), engine="hsdp", variant="both", scheme="two_phase")
    slot = int8_packet(1568) + pad16(53 * 4) + 16
    assert slot == 1664 + 224 + 16
    assert both["collectives"]["reduce_scatter"]["bytes"] == {"intra": slot, "inter": 0.0}
    two_phase = 1 * (int8_packet(784) + int8_packet(784))  # P1 + (R-1) P2
    exempt = 2 * (2 - 1) / 2 * 53 * 4                    # a dense ring all-reduce of the exempt elements
    car = both["collectives"]["replica_all_reduce"]
    assert car["schemes"] == {"two_phase": 1, "dense": 1}
    assert car["bytes"] == {"intra": 0.0, "inter": two_phase + exempt}
    assert car["node_inter_bytes"] == 2 * (two_phase + exempt)
    # fp16 through sum: the payload (1568 float16) through a ring all-reduce
    fp16 = planner.plan_fsdp_step(UNITS, gradcomp.Codec("fp16"), 4, model(), engine="hsdp",
                                  variant="replica_all_reduce", scheme="sum")
    assert fp16["collectives"]["replica_all_reduce"]["bytes"]["inter"] == 1568 * 2 + exempt
    assert fp16["collectives"]["reduce_scatter"]["schemes"] == {"ring": 1}


def test_all_to_all_puts_8x_the_ring_bytes_per_node_into_the_network():
    """L = 8, W = 512, codec none (the raw all-to-all): per rank the all-to-all sends about what
    the ring sends into the network, per node about 8x (ByteDance VeOmni PR #1167's review)."""
    W, L, rows = 512, 8, 4096
    n = W * rows  # one (n, 1) tensor: 4096 rows per rank, no padding
    cm = planner.CostModel(planner.LINK_LEVELS["nvlink"], planner.LINK_LEVELS["network"], L)
    none = gradcomp.Codec("none")
    ring = planner.plan_fsdp_step(n, none, W, cm, engine="fsdp2", variant="dense")["collectives"]["reduce_scatter"]
    a2a = planner.plan_fsdp_step(n, none, W, cm, engine="fsdp2", variant="reduce_scatter")
    a2a = a2a["collectives"]["reduce_scatter"]
    slot = none_packet(rows, 4) + 16  # the float32 row raw behind the header, then the trailer
    assert ring["node_inter_bytes"] == (W - 1) * rows * 4
    assert a2a["node_inter_bytes"] == L * (W - L) * slot
    ratio = a2a["node_inter_bytes"] / ring["node_inter_bytes"]
    assert ratio == (L * (W - L) * slot) / ((W - 1) * rows * 4)
    assert 7.8 < ratio < 8.0
    assert 0.98 < a2a["bytes"]["inter"] / ring["bytes"]["inter"] < 1.0  # per rank: about the same
    assert planner.level_bytes("all_to_all", (W - 1) * 100, W, L)["node_inter"] == L * (W - L) * 100


def test_fsdp_units_of_a_module_and_the_root_gathered_once():
    """A module with a ModuleList: each block is a unit, the rest (embedding, final norm) the root,
    which FSDP2 keeps unsharded after forward (one all-gather)."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 8)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
            self.norm = torch.nn.LayerNorm(8)

    net = Net()
    units = planner.fsdp_units(net)
    assert [u["name"] for u in units] == ["root", "layers.0", "layers.1"]
    assert [u["root"] for u in units] == [True, False, False]
    assert units[0]["params"] == [("emb.weight", 80, "float32", (10, 8)), ("norm.weight", 8, "float32", (8,)),
                                  ("norm.bias", 8, "float32", (8,))]
    assert units[1]["params"] == [("layers.0.weight", 64, "float32", (8, 8)), ("layers.0.bias", 8, "float32", (8,))]
    # W = 2 on one node: shards of the root 40 + 4 + 4, of a block 32 + 4 (bfloat16)
    cm = planner.CostModel(INTRA, throughput=CPU)
    p = planner.plan_fsdp_step(net, gradcomp.Codec("int8"), 2, cm, engine="fsdp2", variant="dense")
    ag = p["collectives"]["all_gather"]
    assert ag["calls"] == 1 + 2 * 2 and ag["bytes"] == {"intra": 1 * 48 * 2 + 2 * 2 * 36 * 2, "inter": 0.0}
    assert p["node_inter_bytes"] == 0
    # parameter_list keeps its triples; shapes=True adds the shape
    assert planner.parameter_list(net)[0] == ("emb.weight", 80, "float32")
    assert planner.parameter_list(net, shapes=True)[0] == ("emb.weight", 80, "float32", (10, 8))
    assert planner.parameter_list(70, shapes=True) == [("params", 70, "float32", (70, 1))]
    assert planner.parameter_list([("a", 6, "float32")], shapes=True) == [("a", 6, "float32", (6, 1))]
    # a count in equal units
    assert [u["params"][0][1] for u in planner.fsdp_units(10, 3)] == [4, 3, 3]
    with pytest.raises(ValueError, match="units=0; accepted: an int >= 1"):
        planner.fsdp_units(10, 0)
    with pytest.raises(ValueError, match="with a torch module"):
        planner.fsdp_units(net, 2)


def test_library_errors_name_the_value():
    cm = model()
    c = gradcomp.Codec("int8")
    with pytest.raises(ValueError, match="world size W=6 is not a multiple of the ranks per node L=4"):
        planner.plan_fsdp_step(UNITS, c, 6, planner.CostModel(INTRA, INTER, 4), engine="hsdp")
    with pytest.raises(ValueError, match="variant='both' for engine fsdp2; accepted: dense, reduce_scatter"):
        planner.plan_fsdp_step(UNITS, c, 4, cm, engine="fsdp2", variant="both")
    with pytest.raises(ValueError, match="engine='zero3'; accepted: fsdp2, hsdp"):
        planner.plan_fsdp_step(UNITS, c, 4, cm, engine="zero3")
    with pytest.raises(ValueError, match="scheme='gather' for engine fsdp2; accepted: auto"):
        planner.plan_fsdp_step(UNITS, c, 4, cm, engine="fsdp2", scheme="gather")
    mixed = [{"name": "u", "root": False, "params": [("a", 4, "float32", (2, 2)), ("b", 4, "bfloat16", (2, 2))]}]
    with pytest.raises(ValueError, match="unit 'u' has gradients of dtypes"):
        planner.plan_fsdp_step(mixed, c, 4, cm, engine="fsdp2")
    assert planner.plan_fsdp_step(mixed, c, 4, cm, engine="fsdp2", reduce_dtype="float32")["gradient_bytes"] == 32


# -- gradcomp-plan ---------------------------------------------------------------------------------
def test_cli_fsdp2_70b(capsys):
    argv = ["--engine", "fsdp2", "--gpus", "512", "--gpus-per-node", "8", "--params", "70B", "--codec", "none",
            "--codec", "int8"]
    assert planner_cli.main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    i = res["inputs"]
    assert (i["engine"], i["nodes"], i["shard_size"], i["replicas"]) == ("fsdp2", 64, 512, 1)
    assert (i["param_dtype"], i["reduce_dtype"], i["reshard_after_forward"]) == ("bfloat16", "float32", True)
    assert [(r["codec"], r["variant"]) for r in res["rows"]] == [
        ("none", "dense"), ("none", "reduce_scatter"), ("int8", "reduce_scatter")]
    shard = 70 * 10 ** 9 // 512  # 136,718,750 rows of the (70e9, 1) tensor per rank, no padding
    dense = res["rows"][0]
    assert dense["collectives"]["all_gather"]["bytes"]["inter"] == 2 * 511 * shard * 2
    assert dense["collectives"]["reduce_scatter"]["bytes"]["inter"] == 511 * shard * 4
    assert res["param_bytes"] == 140e9 and res["gradient_bytes"] == 280e9
    rs = res["reduce_scatter_per_node"]
    slot = none_packet(shard, 4) + 16
    assert rs["ring_bytes"] == 511 * shard * 4 and rs["all_to_all_bytes"] == 8 * 504 * slot
    assert close(rs["formula"], 8 * 504 / 511) and 7.8 < rs["ratio"] < 8.0
    int8 = res["rows"][2]
    assert int8["collectives"]["reduce_scatter"]["bytes"]["inter"] == 504 * (int8_packet(shard) + 16)
    assert close(int8["speedup_vs_dense"], dense["total_s"] / int8["total_s"])
    assert planner_cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "AG inter" in text and "inter/node" in text and "7.89x" in text and "reduce-scatter" in text


def test_cli_hsdp_70b_compress_across_nodes(capsys):
    argv = ["--engine", "hsdp", "--gpus", "512", "--gpus-per-node", "8", "--params", "70B", "--codec", "int8"]
    assert planner_cli.main(argv + ["--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["inputs"]["shard_size"], res["inputs"]["replicas"]) == (8, 64)
    rows = {r["variant"]: r for r in res["rows"]}
    assert list(rows) == ["dense", "reduce_scatter", "replica_all_reduce", "both"]
    shard = 70 * 10 ** 9 // 8  # elements of a rank's shard over the node
    d = rows["dense"]["collectives"]
    assert d["all_gather"]["bytes"] == {"intra": 2 * 7 * shard * 2, "inter": 0.0}  # twice, (S-1) bfloat16 shards
    assert d["reduce_scatter"]["bytes"] == {"intra": 7 * shard * 4, "inter": 0.0}   # (S-1) float32 shards
    assert d["replica_all_reduce"]["bytes"]["inter"] == 2 * 63 / 64 * shard * 4
    assert rows["dense"]["node_inter_bytes"] == 8 * 2 * 63 / 64 * shard * 4
    # compressing the replica all-reduce (the traffic that crosses nodes) gains more than compressing
    # the intra-node reduce-scatter
    assert rows["replica_all_reduce"]["speedup_vs_dense"] > rows["reduce_scatter"]["speedup_vs_dense"]
    assert rows["replica_all_reduce"]["node_inter_bytes_vs_dense"] < 0.3
    assert rows["reduce_scatter"]["node_inter_bytes"] == rows["dense"]["node_inter_bytes"]
    assert planner_cli.main(argv) == 0
    assert "AR inter" in capsys.readouterr().out


def test_cli_old_engine_names_are_ddp_on_that_backend(capsys):
    base = ["--params", "1e6", "--gpus", "16", "--gpus-per-node", "8", "--codec", "int8", "--json"]
    outs = {}
    for extra in ([], ["--engine", "nccl"], ["--engine", "ddp"], ["--engine", "gloo"],
                  ["--engine", "ddp", "--backend", "gloo"], ["--engine", "gloo", "--backend", "gloo"]):
        assert planner_cli.main(base + extra) == 0
        outs[" ".join(extra)] = capsys.readouterr().out
    assert outs[""] == outs["--engine nccl"] == outs["--engine ddp"]
    assert outs["--engine gloo"] == outs["--engine ddp --backend gloo"] == outs["--engine gloo --backend gloo"]
    res = json.loads(outs["--engine gloo"])
    assert res["inputs"]["cost_model"]["engine"] == "gloo" and "rows" in res and res["rows"][0]["scheme"] == "dense"
    assert json.loads(outs[""])["inputs"]["cost_model"]["engine"] == "nccl"


@pytest.mark.parametrize("argv,msg", [
    (["--engine", "hsdp", "--params", "1e6", "--gpus", "12", "--gpus-per-node", "8"],
     "--engine hsdp: --gpus 12 is not a multiple of --gpus-per-node 8; accepted: --gpus = a multiple"),
    (["--engine", "gloo", "--backend", "nccl", "--params", "1e6"], "--engine gloo (DDP on gloo) and --backend nccl"),
    (["--engine", "fsdp2", "--params", "1e6", "--scheme", "gather"], "--scheme gather; accepted: auto"),
    (["--engine", "hsdp", "--params", "1e6", "--scheme", "hierarchical"], "accepted: auto, dense"),
    (["--engine", "fsdp2", "--params", "1e6", "--dtype", "bfloat16"], "--dtype: options of --engine ddp"),
    (["--engine", "fsdp2", "--params", "1e6", "--accumulate", "2"], "--accumulate: options of --engine ddp"),
    (["--params", "1e6", "--reduce-dtype", "float32"], "--reduce-dtype: options of --engine fsdp2|hsdp"),
    (["--engine", "fsdp2", "--params", "1e6", "--units", "0"], "--units 0: accepted: an int >= 1"),
    (["--engine", "fsdp2", "--params", "1e6", "--param-dtype", "bf16"], "--param-dtype bf16; accepted: float64"),
    (["--engine", "zero3", "--params", "1e6"], "invalid choice: 'zero3'"),
])
def test_cli_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        planner_cli.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_as_a_command():
    """``python -m gradcomp.planner_cli``, as the ``gradcomp-plan`` script runs it."""
    import os

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-m", "gradcomp.planner_cli", "--engine", "hsdp", "--gpus", "16",
                        "--gpus-per-node", "8", "--params", "1B", "--codec", "int8"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "gradcomp-plan --engine hsdp: 1,000,000,000 parameters" in r.stdout and "replica AR" in r.stdout
