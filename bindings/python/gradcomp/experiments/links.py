"""Rate-limited links on one machine: network namespaces shaped with ``tc``, for measuring a
gradient exchange on a slow link (``bench/slow_link.py``, ``gradcomp-experiment --link RATE``).

Two setups, each a context manager that creates everything it needs and removes it on exit
(also when the body raises or is interrupted; an ``atexit`` handler removes whatever a crashed
body left behind in this process):

- :func:`shaped_loopback` -- one network namespace whose loopback carries every rank's traffic,
  rate-limited by one token-bucket filter (tbf) on ``lo``'s egress: every byte any rank sends
  crosses that one queue, so W ranks share ``rate`` (the planner's
  ``CostModel.loopback``: a ``shared`` link, each of W senders gets rate / W);
- :func:`two_nodes` -- two namespaces ("nodes" A and B), joined by a veth pair with a tbf on
  each end's egress (each direction of the pair carries all traffic leaving its node at
  ``rate``); ranks ``[0, L)`` live in A, ``[L, 2L)`` in B; traffic between two ranks of one node
  stays on that node's (unshaped) loopback (the planner's ``Link(inf)`` intra level and a
  ``per_node`` inter link).

Nothing leaves the machine: the only addresses are ``127.0.0.1`` inside the namespaces and
``10.199.X.1`` / ``10.199.X.2`` on a /30 between the veth ends, which exist only inside the two
namespaces this process created. Names are unique per process and call: namespaces
``gc-<pid>-<n>`` (``-a`` / ``-b`` for the two nodes), veth ends ``gc<pid>n<n>a`` / ``...b``
(at most 15 characters).

The tbf parameters (:func:`tbf_params`): rate in bits/s as tc takes it; burst (the bucket, bytes)
= max(rate / HZ, :data:`MIN_BURST_BYTES`), where HZ is the kernel's timer frequency
(``CONFIG_HZ`` from ``/proc/config.gz`` or ``/boot/config-<release>``; 100 when unknown, the
largest burst): tc-tbf(8) asks for at least rate / HZ bytes so the rate is reached with a
timer tick per refill, and the floor of 66,000 bytes holds one 64 KiB GSO packet of loopback or
of the veth (their ``gso_max_size`` is 65,536; a tbf segments a larger packet) with its headers.
At HZ = 250 that is 66,000 B at 100 Mb/s (rate / HZ = 50 kB), 500 kB at 1 Gb/s and 5 MB at
10 Gb/s (what one TCP stream then reaches: bench/RESULTS.md, section "experiments/links.py: the
shaped links measured"). A token bucket lends
what an idle link did not use, up to the burst: a transfer that starts after an idle gap runs
the first ``burst`` bytes at the CPU's speed, i.e. up to burst / rate = max(1 / HZ, 66,000 B /
rate) seconds (4 ms at 1 and 10 Gb/s, 5.3 ms at 100 Mb/s) faster than a real link of that rate
(a ``peakrate`` would remove it, but costs a share of the rate that grows with it, the same
section, so it is not used).
The queue ``limit`` (bytes) = rate x 0.5 s, at least 64 MiB: large enough that TCP (with its
small-queue limit of ~4 MiB per socket and up to W(W-1) sockets) never overflows it, so nothing
is dropped and retransmitted (:meth:`Setup.qdisc_stats` reports ``dropped``; the bench prints it).

Ranks enter their namespace with :func:`enter_netns` (setns(2); it and :func:`namespace_exists`
come from :mod:`gradcomp.experiments.netns`), which :class:`gradcomp.experiments.pool.GlooPool`
calls in each worker given ``netns=Setup.rank_netns(W)``.

Requirements (:func:`available`): root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc``
(iproute2), tbf and veth in the kernel.
"""

import atexit
import gzip
import logging
import math
import os
import re
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

from .netns import CLONE_NEWNET, NETNS_DIR, enter_netns, namespace_exists  # noqa: F401 (links' names too)

MIN_BURST_BYTES = 66_000
"""Smallest tbf bucket (bytes): one 64 KiB GSO packet (``gso_max_size`` 65,536 on loopback and
veth) with its headers."""

MIN_LIMIT_BYTES = 64 << 20
"""Smallest tbf queue limit (bytes)."""

LIMIT_SECONDS = 0.5
"""The tbf queue limit as seconds of traffic at the link rate (at least :data:`MIN_LIMIT_BYTES`)."""

VETH_MTU = 65535
"""MTU of the veth pair of :func:`two_nodes`: the largest veth accepts (``ETH_MAX_MTU``), so
per-packet headers cost ~0.1 % of the bytes."""

_lock = threading.Lock()
_counter = 0
_live: Dict[str, None] = {}  # namespaces this process created and has not removed yet (ordered)


# ----------------------------------------------------------------------------------------------
# tc / ip helpers
# ----------------------------------------------------------------------------------------------

def _cmd(*args: str) -> str:
    """Run ``args``; return stdout. Raises RuntimeError naming the command and its stderr."""
    r = subprocess.run(list(args), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"links: `{' '.join(args)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r.stdout


def kernel_hz() -> Optional[int]:
    """The kernel's timer frequency ``CONFIG_HZ`` (ticks/s) from ``/proc/config.gz`` or
    ``/boot/config-<release>``; None when neither says."""
    pat = re.compile(rb"^CONFIG_HZ=(\d+)\s*$", re.M)
    for path, opener in (("/proc/config.gz", gzip.open), (f"/boot/config-{os.uname().release}", open)):
        try:
            with opener(path, "rb") as f:
                m = pat.search(f.read())
        except OSError:
            continue
        if m:
            return int(m.group(1))
    return None


def parse_rate(rate) -> float:
    """A link rate in bytes/s (:func:`gradcomp.planner.parse_rate`: ``"100mbit"``, ``"1gbit"``,
    ``"10gbit"``; SI prefixes, 1 gbit = 1.25e8 bytes/s) or ``inf`` for ``"unlimited"``.

    Raises:
        ValueError: a rate the planner does not parse (the accepted forms are in the message).
    """
    from ..planner import parse_rate as _parse

    return _parse(rate)


def tbf_params(rate, hz: Optional[int] = None) -> Optional[dict]:
    """The tbf of one shaped device at ``rate`` (see the module docstring), or None for
    ``"unlimited"``: ``{"rate_bits_per_s": int, "bytes_per_s": float, "burst_bytes": int,
    "limit_bytes": int, "hz": int}``. ``hz`` defaults to :func:`kernel_hz` (100 when unknown).

    Raises:
        ValueError: a bad rate (:func:`parse_rate`).
    """
    bps = parse_rate(rate)
    if math.isinf(bps):
        return None
    hz = int(hz or kernel_hz() or 100)
    burst = max(int(math.ceil(bps / hz)), MIN_BURST_BYTES)
    limit = max(int(bps * LIMIT_SECONDS), MIN_LIMIT_BYTES)
    return {"rate_bits_per_s": int(round(8 * bps)), "bytes_per_s": bps, "burst_bytes": burst,
            "limit_bytes": limit, "hz": hz}


def _add_tbf(ns: str, dev: str, tbf: dict) -> None:
    _cmd("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{tbf['rate_bits_per_s']}bit",
         "burst", str(tbf["burst_bytes"]), "limit", str(tbf["limit_bytes"]))


_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)")


def qdisc_stats(ns: str, dev: str) -> dict:
    """The root qdisc counters of ``dev`` in namespace ``ns`` (``tc -s qdisc show``):
    ``{"bytes", "packets", "dropped", "overlimits", "requeues"}`` (ints; bytes are whole packets
    as the qdisc saw them: IP and TCP headers included, each GSO segment's headers counted).

    Raises:
        RuntimeError: tc failed, or printed no counters for the root qdisc.
    """
    out = _cmd("tc", "-n", ns, "-s", "qdisc", "show", "dev", dev)
    m = _SENT.search(out)
    if not m:
        raise RuntimeError(f"links: no qdisc counters for {dev} in {ns}: {out.strip()!r}")
    b, p, d, o, r = (int(x) for x in m.groups())
    return {"bytes": b, "packets": p, "dropped": d, "overlimits": o, "requeues": r}


def _new_id() -> int:
    global _counter
    with _lock:
        _counter += 1
        return _counter


def _add_ns(name: str) -> None:
    with _lock:
        _live[name] = None
    _cmd("ip", "netns", "add", name)
    _cmd("ip", "-n", name, "link", "set", "lo", "up")


def _del_ns(name: str) -> Optional[str]:
    """Remove namespace ``name`` (its devices and qdiscs go with it); the error text, or None."""
    with _lock:
        _live.pop(name, None)
    r = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
    if r.returncode != 0 and namespace_exists(name):
        return r.stderr.strip() or f"exit {r.returncode}"
    return None


@atexit.register
def _cleanup_all() -> None:
    """Remove the namespaces this process created and did not remove (a crashed context body)."""
    for name in list(_live):
        _del_ns(name)


def live_namespaces() -> List[str]:
    """Namespaces this process created and has not removed yet (empty outside the contexts)."""
    with _lock:
        return list(_live)


# ----------------------------------------------------------------------------------------------
# availability
# ----------------------------------------------------------------------------------------------

_available: Optional[Tuple[bool, str]] = None


def available() -> Tuple[bool, str]:
    """``(True, "")`` when this process can build the setups here, else ``(False, reason)``:
    root, ``ip`` and ``tc`` on PATH, and a probe namespace with a tbf on its loopback that can
    be created and removed (the result is cached)."""
    global _available
    if _available is not None:
        return _available
    if os.geteuid() != 0:
        _available = (False, "links need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); euid is %d" % os.geteuid())
        return _available
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        _available = (False, f"links need iproute2: {' and '.join(missing)} not found on PATH")
        return _available
    name = f"gc-{os.getpid()}-probe{_new_id()}"
    try:
        _add_ns(name)
        _add_tbf(name, "lo", tbf_params("1gbit"))
        qdisc_stats(name, "lo")
        _available = (True, "")
    except (RuntimeError, OSError) as e:
        _available = (False, f"cannot build a shaped namespace here: {e}")
    finally:
        err = _del_ns(name)
        if err and _available[0]:
            _available = (False, f"cannot remove the probe namespace {name}: {err}")
    return _available


def _require() -> None:
    ok, why = available()
    if not ok:
        raise RuntimeError(f"links: {why}")


# ----------------------------------------------------------------------------------------------
# the setups
# ----------------------------------------------------------------------------------------------

class Setup:
    """What a setup context yields.

    Attributes:
        kind: ``"loopback"`` or ``"two_nodes"``.
        rate: the rate as given (``"1gbit"``, ``"unlimited"``); ``bytes_per_s``: parsed (inf
            when unlimited).
        namespaces: the namespace names (one for loopback; node A's, node B's for two_nodes).
        addresses: the address of each namespace (``127.0.0.1``; ``10.199.X.1``, ``10.199.X.2``).
        address: the first of them (where rank 0 listens).
        devices: ``[(namespace, device)]`` carrying a tbf (empty when unlimited).
        interfaces: the device gloo binds to in each namespace (``lo``; the veth end).
        ranks_per_node: two_nodes' L (0 for loopback: every rank in the one namespace).
        tbf: :func:`tbf_params` of each shaped device (None when unlimited).
        mtu: the MTU of the shaped devices (loopback's own; the veth's).
    """

    def __init__(self, kind, rate, namespaces, addresses, devices, interfaces, ranks_per_node, tbf, mtu):
        self.kind, self.rate, self.bytes_per_s = kind, str(rate), parse_rate(rate)
        self.namespaces, self.addresses = list(namespaces), list(addresses)
        self.address = self.addresses[0]
        self.devices, self.interfaces = list(devices), list(interfaces)
        self.ranks_per_node, self.tbf, self.mtu = int(ranks_per_node), tbf, mtu

    def node_of(self, rank: int) -> int:
        """Index into :attr:`namespaces` of ``rank``'s namespace."""
        return 0 if self.kind == "loopback" else int(rank) // self.ranks_per_node

    def _check_world(self, world_size: int) -> int:
        W = int(world_size)
        if W < 1:
            raise ValueError(f"links: world_size={world_size}; accepted: >= 1")
        if self.kind == "two_nodes" and W != 2 * self.ranks_per_node:
            raise ValueError(f"links: two_nodes with {self.ranks_per_node} ranks per node holds "
                             f"{2 * self.ranks_per_node} ranks; world_size={W}")
        return W

    def rank_netns(self, world_size: int) -> List[str]:
        """The namespace of each of ``world_size`` ranks (for ``GlooPool(netns=...)``):
        ``[ns] * W`` for loopback; ``[A] * L + [B] * L`` for two_nodes.

        Raises:
            ValueError: world_size < 1, or two_nodes with world_size != 2 L.
        """
        W = self._check_world(world_size)
        return [self.namespaces[self.node_of(r)] for r in range(W)]

    def rank_env(self, world_size: int) -> List[dict]:
        """Each rank's environment (for ``GlooPool(env=...)``): ``GLOO_SOCKET_IFNAME``, the
        device of its namespace gloo binds to (``lo``; its node's veth end). Raises as
        :meth:`rank_netns`."""
        W = self._check_world(world_size)
        return [{"GLOO_SOCKET_IFNAME": self.interfaces[self.node_of(r)]} for r in range(W)]

    def qdisc_stats(self) -> List[dict]:
        """Counters of each shaped device (:func:`qdisc_stats` plus ``namespace`` and
        ``device``), in :attr:`devices` order; empty when unlimited."""
        return [dict(qdisc_stats(ns, dev), namespace=ns, device=dev) for ns, dev in self.devices]

    def qdisc_bytes(self) -> Optional[int]:
        """Bytes sent through the shaped devices so far, summed (tc's "Sent N bytes", headers
        included; for two_nodes both directions of the veth), or None when unlimited (nothing
        counts them). Take differences around the traffic of interest."""
        if not self.devices:
            return None
        return sum(s["bytes"] for s in self.qdisc_stats())

    def describe(self) -> dict:
        """A JSON-ready description (kind, rate, namespaces, addresses, tbf, mtu)."""
        return {"kind": self.kind, "rate": self.rate, "bytes_per_s": self.bytes_per_s,
                "namespaces": self.namespaces, "addresses": self.addresses, "interfaces": self.interfaces,
                "devices": [list(d) for d in self.devices], "ranks_per_node": self.ranks_per_node,
                "tbf": self.tbf, "mtu": self.mtu}

    def __repr__(self) -> str:
        return f"Setup({self.kind}, {self.rate}, namespaces={self.namespaces})"


@contextmanager
def shaped_loopback(rate="1gbit", *, hz: Optional[int] = None) -> Iterator[Setup]:
    """One namespace ``gc-<pid>-<n>`` with ``lo`` up and, unless ``rate`` is ``"unlimited"``, a
    tbf at ``rate`` on ``lo`` (:func:`tbf_params`; ``hz`` overrides the kernel HZ used for the
    burst). Yields a :class:`Setup`: every rank in that namespace, address ``127.0.0.1``,
    ``GLOO_SOCKET_IFNAME=lo``. The namespace is removed on exit.

    Raises:
        ValueError: a bad rate (before anything is created).
        RuntimeError: not :func:`available`, or an ``ip`` / ``tc`` command failed (what was
            created is removed first).
    """
    tbf = tbf_params(rate, hz)
    _require()
    ns = f"gc-{os.getpid()}-{_new_id()}"
    ok = False
    try:
        _add_ns(ns)
        devices = []
        if tbf is not None:
            _add_tbf(ns, "lo", tbf)
            devices.append((ns, "lo"))
        mtu = int(_cmd("ip", "-n", ns, "-o", "link", "show", "lo").split(" mtu ")[1].split()[0])
        setup = Setup("loopback", rate, [ns], ["127.0.0.1"], devices, ["lo"], 0, tbf, mtu)
        yield setup
        ok = True
    finally:
        _remove([ns], raise_errors=ok)


@contextmanager
def two_nodes(rate="1gbit", *, ranks_per_node: int = 2, mtu: int = VETH_MTU, hz: Optional[int] = None,
              subnet: Optional[int] = None) -> Iterator[Setup]:
    """Two namespaces ``gc-<pid>-<n>-a`` / ``-b`` ("nodes"), ``lo`` up in each, joined by a veth
    pair ``gc<pid>n<n>a`` (in A, ``10.199.X.1/30``) -- ``gc<pid>n<n>b`` (in B,
    ``10.199.X.2/30``) at ``mtu`` (default the largest, 65535) with a tbf at ``rate`` on each
    end (unless ``"unlimited"``). X = ``subnet`` (0..255; default n mod 256). Yields a
    :class:`Setup` whose ranks ``[0, L)`` are in A and ``[L, 2L)`` in B (L =
    ``ranks_per_node``), each binding gloo to its node's veth end; ranks of one node reach each
    other over that node's loopback (not shaped). Both namespaces are removed on exit.

    Raises:
        ValueError: a bad rate, ranks_per_node < 1, mtu outside [1280, 65535], subnet outside
            [0, 255] (before anything is created).
        RuntimeError: not :func:`available`, or an ``ip`` / ``tc`` command failed.
    """
    tbf = tbf_params(rate, hz)
    if int(ranks_per_node) < 1:
        raise ValueError(f"links: ranks_per_node={ranks_per_node}; accepted: >= 1")
    if not 1280 <= int(mtu) <= 65535:
        raise ValueError(f"links: mtu={mtu}; accepted: 1280..65535 bytes")
    _require()
    n = _new_id()
    x = n % 256 if subnet is None else int(subnet)
    if not 0 <= x <= 255:
        raise ValueError(f"links: subnet={subnet}; accepted: 0..255")
    pid = os.getpid()
    a, b = f"gc-{pid}-{n}-a", f"gc-{pid}-{n}-b"
    va, vb = f"gc{pid}n{n}a"[-15:], f"gc{pid}n{n}b"[-15:]
    ips = [f"10.199.{x}.1", f"10.199.{x}.2"]
    made: List[str] = []
    ok = False
    try:
        for ns in (a, b):
            made.append(ns)
            _add_ns(ns)
        _cmd("ip", "link", "add", va, "netns", a, "mtu", str(mtu), "type", "veth", "peer", "name", vb, "netns", b,
             "mtu", str(mtu))
        devices = []
        for ns, dev, ip in ((a, va, ips[0]), (b, vb, ips[1])):
            _cmd("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            _cmd("ip", "-n", ns, "link", "set", dev, "up")
            if tbf is not None:
                _add_tbf(ns, dev, tbf)
                devices.append((ns, dev))
        setup = Setup("two_nodes", rate, [a, b], ips, devices, [va, vb], int(ranks_per_node), tbf, int(mtu))
        yield setup
        ok = True
    finally:
        _remove(made, raise_errors=ok)


def _remove(names: List[str], raise_errors: bool) -> None:
    """Remove the namespaces ``names``; when ``raise_errors`` (the body ended normally) a failure
    raises RuntimeError naming them, else (an exception is on its way) it is only logged, so the
    body's exception is the one that propagates."""
    errs = [f"{ns}: {e}" for ns in names for e in [_del_ns(ns)] if e]
    if errs:
        msg = f"links: could not remove network namespace(s): {'; '.join(errs)}"
        if raise_errors:
            raise RuntimeError(msg)
        logging.getLogger("gradcomp").error(msg)


# ----------------------------------------------------------------------------------------------
# the experiment harness's job under --link (gradcomp-experiment --link RATE)
# ----------------------------------------------------------------------------------------------

def timed_train_run(rank: int, world: int, cfg: dict) -> dict:
    """A digits run (:func:`gradcomp.experiments.runner.train_run`, a pool job) that also records,
    at the end of every epoch, the wall-clock seconds since the run started and the test accuracy
    of the model at that point: the result gains ``curve`` = ``[{"epoch", "wall_s",
    "test_accuracy"}]`` (rank 0's; empty on the other ranks).

    How: for the duration of the call, ``runner.make_model`` is wrapped to keep the model it
    builds and ``gradcomp.experiments.pool.report`` (which rank 0 calls once per epoch, after the
    epoch's last step and its loss allreduce) to evaluate that model on the test set under
    ``torch.no_grad()`` first. The evaluation changes no parameter, RNG or module mode, so the
    run's parameters are bitwise those of ``train_run`` with the same configuration; its time is
    left out of ``wall_s`` (``eval_s`` in the result). Both wrappers are removed on return. The
    first call in a worker warms it up before the clock starts (:func:`_warm_up`), so the first
    run of a sweep does not count the process's one-time costs.
    """
    import torch

    from . import pool as pool_mod
    from . import runner

    if cfg.get("engine", "ddp") != "ddp":  # rank 0 alone evaluates the model mid-run: not a sharded one
        raise ValueError(f"timed_train_run: engine={cfg['engine']!r}; accepted: ddp")
    made: list = []
    curve: list = []
    spent = [0.0]
    orig_make, orig_report = runner.make_model, pool_mod.report
    _warm_up()
    t0 = time.perf_counter()

    def make_model(hidden):
        m = orig_make(hidden)
        made.append(m)
        return m

    def report(msg):
        if isinstance(msg, dict) and "epoch" in msg and made:
            t = time.perf_counter()
            _, _, xte, yte = runner.load_data()
            with torch.no_grad():
                acc = 100.0 * float((made[-1](xte).argmax(1) == yte).float().mean())
            curve.append({"epoch": int(msg["epoch"]), "wall_s": t - t0 - spent[0], "test_accuracy": acc})
            spent[0] += time.perf_counter() - t
        orig_report(msg)

    runner.make_model, pool_mod.report = make_model, report
    try:
        out = runner.train_run(rank, world, cfg)
    finally:
        runner.make_model, pool_mod.report = orig_make, orig_report
    out["curve"] = curve
    out["eval_s"] = spent[0]
    return out


_warm = False


def _warm_up() -> None:
    """Once per worker process, collectively (every rank's first :func:`timed_train_run` calls
    it): load the digits data (``runner.load_data`` caches them) and take one DDP step of a
    1-parameter model with the gradcomp hook, so the imports and lazy initialisations that the
    first DDP run of a process pays (seconds here) are not counted in any run's time. The
    global torch RNG is restored afterwards (each run seeds it anyway)."""
    global _warm
    if _warm:
        return
    import torch

    from . import runner

    runner.load_data()
    rng = torch.get_rng_state()
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1, bias=False))
    runner.register_hook(ddp, "none", False, 0)
    ddp(torch.ones(1, 1)).sum().backward()
    torch.set_rng_state(rng)
    _warm = True


def time_to_target(curve: List[dict], target: float) -> Tuple[Optional[float], Optional[int]]:
    """``(wall_s, epoch)`` of the first entry of ``curve`` (:func:`timed_train_run`) whose
    ``test_accuracy`` (percent) is >= ``target`` (percent), or ``(None, None)`` if none is."""
    for c in curve:
        if c["test_accuracy"] >= target:
            return c["wall_s"], c["epoch"]
    return None, None
