"""gradcomp.experiments.links: rate-limited network namespaces, GlooPool ranks inside them, and
the byte counters of their tc qdiscs against the planner's byte formulas.

The namespace tests need root, ``ip`` and ``tc`` (``links.available()``) and are skipped cleanly
otherwise; the parsing tests run anywhere. No timing is asserted: the byte checks compare tc's
"Sent N bytes" counter (whole packets, headers included) with the planner's payload bytes, from
below (the payload must all have crossed) and from above with 15 % for TCP/IP and gloo headers.
Values of the allreduces are checked against numpy sums of the ranks' inputs computed here."""

import os
import subprocess

import pytest

pytestmark = pytest.mark.slow  # shaped links in network namespaces: the whole suite only (tests/quick.sh leaves them out)

pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from gradcomp import planner  # noqa: E402
from gradcomp.experiments import links  # noqa: E402
from gradcomp.experiments.pool import GlooPool  # noqa: E402

OK, WHY = links.available()
needs_root = pytest.mark.skipif(not OK, reason=f"links not available here: {WHY}")

N = 1 << 20  # elements of the allreduce whose bytes are counted
HEADROOM = 1.15


def _ours():
    """Network namespaces named like this process's (``gc-<pid>-``) that exist now."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith(f"gc-{os.getpid()}-"))


# ----------------------------------------------------------------------------------------------
# jobs (module level: the pool's spawned workers import them)
# ----------------------------------------------------------------------------------------------

def _rank_input(rank):
    return np.random.default_rng(100 + rank).standard_normal(N).astype(np.float32)


def job_where(rank, world):
    """This worker's network namespace (inode of /proc/self/ns/net), GLOO_SOCKET_IFNAME and the
    IPv4 addresses it sees."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    addrs = sorted(line.split()[3].split("/")[0] for line in out.splitlines())
    return os.stat("/proc/self/ns/net").st_ino, os.environ.get("GLOO_SOCKET_IFNAME"), addrs


def job_allreduce(rank, world):
    import torch
    import torch.distributed as dist

    x = torch.from_numpy(_rank_input(rank))
    dist.all_reduce(x)
    return x.numpy()


def job_train(rank, world, cfg, timed):
    from gradcomp.experiments import runner

    return links.timed_train_run(rank, world, cfg) if timed else runner.train_run(rank, world, cfg)


def _check_sum(results, world):
    ref = np.sum([_rank_input(r).astype(np.float64) for r in range(world)], axis=0)
    for r, got in enumerate(results):
        assert got.shape == (N,) and got.dtype == np.float32
        # float32 sums of 4 terms in gloo's ring order: within a few ulps of the float64 sum
        np.testing.assert_allclose(got, ref, rtol=0, atol=4e-6 * np.abs(ref).max() + 1e-6, err_msg=f"rank {r}")
    for got in results[1:]:
        assert np.array_equal(got, results[0])  # every rank holds the same bits


def _dense_sent(world):
    """Bytes one rank sends in a ring allreduce of N float32: 2 (W-1)/W * 4 N."""
    return planner.bucket_bytes("dense", None, N, "float32", world)["sent_bytes"]


# ----------------------------------------------------------------------------------------------
# parsing and parameters (no root needed)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["fast", "-1gbit", "0mbit", "1 parsec", ""])
def test_bad_rates_raise(bad):
    with pytest.raises(ValueError, match="link rate"):
        links.tbf_params(bad)
    before = links.live_namespaces()
    with pytest.raises(ValueError, match="link rate"):
        with links.shaped_loopback(bad):
            pass  # pragma: no cover
    with pytest.raises(ValueError, match="link rate"):
        with links.two_nodes(bad):
            pass  # pragma: no cover
    assert links.live_namespaces() == before  # nothing was created


def test_bad_two_node_options():
    for kw, msg in (({"ranks_per_node": 0}, "ranks_per_node"), ({"mtu": 100}, "mtu"), ({"mtu": 70000}, "mtu")):
        with pytest.raises(ValueError, match=msg):
            with links.two_nodes("1gbit", **kw):
                pass  # pragma: no cover


def test_tbf_params():
    # burst = max(rate / HZ, 66,000 B); limit = max(0.5 s of traffic, 64 MiB); rate in bit/s
    t = links.tbf_params("10gbit", hz=250)
    assert t["rate_bits_per_s"] == 10 ** 10 and t["bytes_per_s"] == 1.25e9
    assert t["burst_bytes"] == 5_000_000 and t["limit_bytes"] == 625_000_000
    t = links.tbf_params("1gbit", hz=250)
    assert t["burst_bytes"] == 500_000 and t["limit_bytes"] == 64 << 20
    t = links.tbf_params("100mbit", hz=250)
    assert t["burst_bytes"] == 66_000 and t["rate_bits_per_s"] == 10 ** 8  # rate / HZ = 50 kB < the floor
    assert links.tbf_params("1gbit", hz=1000)["burst_bytes"] == 125_000
    assert links.tbf_params("1gbit")["hz"] == (links.kernel_hz() or 100)
    assert links.tbf_params("unlimited") is None


def test_pool_rejects_bad_netns_and_env():
    with pytest.raises(ValueError, match="sequence of 2 namespace names"):
        GlooPool(2, netns=["a"])
    with pytest.raises(ValueError, match="sequence of 2 namespace names"):
        GlooPool(2, netns="ab")
    with pytest.raises(ValueError, match="gc-no-such-namespace"):
        GlooPool(2, netns=["gc-no-such-namespace"] * 2)
    with pytest.raises(ValueError, match="sequence of 2 dicts"):
        GlooPool(2, env=[{}])
    with pytest.raises(ValueError, match=r"env\[1\]"):
        GlooPool(2, env=[{}, {"GLOO_SOCKET_IFNAME": 1}])


# ----------------------------------------------------------------------------------------------
# namespaces
# ----------------------------------------------------------------------------------------------

@needs_root
def test_shaped_loopback_created_and_removed():
    with links.shaped_loopback("1gbit") as net:
        (ns,) = net.namespaces
        assert ns.startswith(f"gc-{os.getpid()}-") and _ours() == [ns]
        assert net.rank_netns(3) == [ns] * 3 and net.rank_env(2) == [{"GLOO_SOCKET_IFNAME": "lo"}] * 2
        q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        assert "tbf" in q and "rate 1Gbit" in q, q
        assert net.qdisc_bytes() == 0  # nothing sent yet
    assert _ours() == [] and links.live_namespaces() == []
    with links.shaped_loopback("unlimited") as net:
        assert net.tbf is None and net.devices == [] and net.qdisc_bytes() is None
    assert _ours() == []


@needs_root
def test_removed_after_an_exception():
    for ctx in (lambda: links.shaped_loopback("100mbit"), lambda: links.two_nodes("100mbit")):
        with pytest.raises(KeyError, match="inside"):
            with ctx() as net:
                assert _ours() == sorted(net.namespaces)
                raise KeyError("inside")
        assert _ours() == [] and links.live_namespaces() == []


@needs_root
def test_two_nodes_created_and_removed():
    with links.two_nodes("1gbit", subnet=77) as net:
        a, b = net.namespaces
        assert _ours() == sorted([a, b])
        assert net.addresses == ["10.199.77.1", "10.199.77.2"]
        assert net.rank_netns(4) == [a, a, b, b]
        va, vb = net.interfaces
        assert net.rank_env(4) == [{"GLOO_SOCKET_IFNAME": va}] * 2 + [{"GLOO_SOCKET_IFNAME": vb}] * 2
        for ns, dev, ip in ((a, va, "10.199.77.1"), (b, vb, "10.199.77.2")):
            link = subprocess.run(["ip", "-n", ns, "-o", "addr", "show", "dev", dev], capture_output=True,
                                  text=True).stdout
            assert f"{ip}/30" in link, link
            shown = subprocess.run(["ip", "-n", ns, "-o", "link", "show", dev], capture_output=True, text=True).stdout
            assert "mtu 65535" in shown and "UP" in shown, shown
            q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
            assert "tbf" in q and "rate 1Gbit" in q, q
        with pytest.raises(ValueError, match="holds 4 ranks"):
            net.rank_netns(3)
    assert _ours() == [] and links.live_namespaces() == []


# ----------------------------------------------------------------------------------------------
# gloo ranks inside them
# ----------------------------------------------------------------------------------------------

def _allreduce_in(net, world, counters):
    """On a pool of ``world`` ranks inside ``net``'s namespaces (``rank_netns`` / ``rank_env``):
    :func:`job_where`, then :func:`job_allreduce` between two reads of ``counters()`` (the
    setup's qdisc counters), its sums checked. Returns ``(where, inodes, before, after)``:
    each rank's job_where, the inode of each of ``net.namespaces`` (read while they exist), and
    the two counter reads."""
    with GlooPool(world, threads=1, netns=net.rank_netns(world), env=net.rank_env(world)) as pool:
        where = pool.run(job_where)
        inodes = [os.stat(os.path.join(links.NETNS_DIR, ns)).st_ino for ns in net.namespaces]
        before = counters()
        out = pool.run(job_allreduce)
        after = counters()
    _check_sum(out, world)
    return where, inodes, before, after


@needs_root
def test_pool_in_shaped_loopback_allreduce_and_bytes():
    W = 4
    with links.shaped_loopback("1gbit") as net:
        where, (ino,), before, after = _allreduce_in(net, W, net.qdisc_bytes)
    assert [w[0] for w in where] == [ino] * W  # every rank in the namespace
    assert os.stat("/proc/self/ns/net").st_ino != ino  # and this process is not
    assert all(w[1] == "lo" and w[2] == ["127.0.0.1"] for w in where)
    sent = after - before
    # every rank's bytes cross the one loopback qdisc: W * 2 (W-1)/W * 4 N = 6 * 4 MiB
    predicted = W * _dense_sent(W)
    assert predicted == 6 * 4 * N
    assert predicted <= sent <= HEADROOM * predicted, (sent, predicted)


@needs_root
def test_pool_in_two_nodes_allreduce_and_veth_bytes():
    W = 4
    with links.two_nodes("1gbit") as net:
        where, inos, before, after = _allreduce_in(net, W, net.qdisc_stats)
    assert [w[0] for w in where] == [inos[0]] * 2 + [inos[1]] * 2
    assert [w[2] for w in where] == ([sorted([net.addresses[0], "127.0.0.1"])] * 2
                                     + [sorted([net.addresses[1], "127.0.0.1"])] * 2)
    # gloo's ring runs rank r -> r + 1: 0 -> 1 and 2 -> 3 stay inside a node, 1 -> 2 and 3 -> 0
    # cross, so each veth direction carries one rank's bytes, 2 (W-1)/W * 4 N
    predicted = _dense_sent(W)
    for b, a in zip(before, after):
        sent = a["bytes"] - b["bytes"]
        assert predicted <= sent <= HEADROOM * predicted, (a["device"], sent, predicted)
        assert a["dropped"] == b["dropped"]


@needs_root
def test_timed_train_run_matches_train_run():
    """The --link job: the same parameters bit for bit as runner.train_run, plus a curve whose
    last accuracy is the run's test accuracy."""
    pytest.importorskip("sklearn")
    cfg = dict(epochs=3, lr=0.07, momentum=0.9, batch_size=48, hidden=32, bucket_cap_mb=0.1, weight_decay=5e-4,
               codec="topk:ratio=0.1", optimizer="sgd", error_feedback=True, seed=0)
    with links.shaped_loopback("1gbit") as net:
        with GlooPool(2, threads=1, netns=net.rank_netns(2), env=net.rank_env(2)) as pool:
            plain = pool.run(job_train, cfg, False)
            timed = pool.run(job_train, cfg, True)
    assert timed[0]["param_checksum"] == plain[0]["param_checksum"] == plain[1]["param_checksum"]
    assert timed[0]["test_accuracy"] == plain[0]["test_accuracy"]
    curve = timed[0]["curve"]
    assert [c["epoch"] for c in curve] == [1, 2, 3] and timed[1]["curve"] == []
    assert curve[-1]["test_accuracy"] == timed[0]["test_accuracy"]
    walls = [c["wall_s"] for c in curve]
    assert walls == sorted(walls) and 0 < walls[-1] <= timed[0]["wall_s"] + 1e-6
    assert links.time_to_target(curve, 0.0) == (walls[0], 1)
    assert links.time_to_target(curve, 101.0) == (None, None)


@needs_root
def test_experiment_link_end_to_end(tmp_path):
    """``gradcomp-experiment --link 1gbit``: the digits table has the time-to-target columns, the
    target is 98 % of the dense run's accuracy, and no namespace is left."""
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    import json

    from gradcomp.experiments.__main__ import main

    out = tmp_path / "res"
    rc = main(["--task", "digits", "--link", "1gbit", "--workers", "2", "--seeds", "1", "--epochs", "2", "--codecs",
               "none;int8", "--ef", "auto", "--optimizers", "", "--hidden", "32", "--no-progress", "--out", str(out)])
    assert rc == 0
    table = (out / "table.md").read_text()
    assert "| time to " in table and "| reached | run wall s |" in table and "98% of the mean final" in table
    js = json.loads((out / "results.json").read_text())
    dense = [r for r in js["runs"] if r["codec"] == "none"][0]
    assert js["link"]["target"] == pytest.approx(0.98 * dense["test_accuracy"], rel=1e-12)
    assert js["link"]["setup"]["kind"] == "loopback" and js["link"]["rate"] == "1gbit"
    for r in js["runs"]:
        assert len(r["curve"]) == 2 and r["curve"][-1]["test_accuracy"] == r["test_accuracy"]
        expect = links.time_to_target(r["curve"], js["link"]["target"])
        assert (r["time_to_target_s"], r["epochs_to_target"]) == expect
    assert dense["epochs_to_target"] is not None  # the dense run reaches 98 % of itself
    assert _ours() == []


def test_experiment_link_argument_errors(capsys):
    from gradcomp.experiments.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--link", "fast"])
    assert "--link" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--link", "1gbit", "--link-nodes", "2", "--workers", "3"])
    with pytest.raises(SystemExit):
        parse_args(["--link-nodes", "2"])
    a = parse_args([])
    assert a.link is None and a.link_nodes == 1
