"""A reusable pool of W processes joined in one gloo process group (CPU), for the experiment
harness, the benchmarks and the tests: spawning a torch process costs seconds, so the pool spawns
once and runs many jobs.

Ranks may live in other network namespaces (``netns``: each worker enters its namespace with
:func:`gradcomp.experiments.netns.enter_netns` before the process group starts;
:mod:`gradcomp.experiments.links` builds rate-limited ones) and get their own environment
(``env``, e.g. ``GLOO_SOCKET_IFNAME``); the rendezvous is a FileStore in a temporary folder, which
every namespace sees.

``pool.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` in every worker (``fn`` must be a
module-level function, importable by the spawned children) and returns the W return values in
rank order. A worker may call :func:`report` to send a picklable progress message to the parent's
``on_progress`` callback. :func:`shared` keeps one pool per (world size, options) for the whole
process (a test session's modules share them); :func:`close_shared` closes them.

This module was ``gradcomp.torch.pool``; that path still imports it (a re-export).

Raises:
    RuntimeError: a worker raised (the message carries its traceback; the pool is then closed,
        since the other ranks may be stuck in a collective), or a job exceeded ``timeout`` seconds.
"""

import datetime
import os
import queue as _queue
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from .netns import CLONE_NEWNET, NETNS_DIR, enter_netns, namespace_exists  # noqa: F401 (re-exported)

__all__ = ["GlooPool", "report", "shared", "close_shared", "enter_netns", "CLONE_NEWNET", "NETNS_DIR"]

_report_q = None
_rank = None


def report(msg: Any) -> None:
    """From inside a pool job: send ``msg`` (picklable) to the parent's ``on_progress``; a no-op
    outside a pool worker."""
    if _report_q is not None:
        _report_q.put(("progress", _rank, msg))


def _worker_main(rank, world, init_file, tasks, results, threads, gloo_timeout_s, sys_path, netns=None, env=None):
    global _report_q, _rank
    for p in sys_path:
        if p not in sys.path:
            sys.path.append(p)
    if env:
        os.environ.update(env)
    if netns:
        try:
            enter_netns(netns)
        except OSError:
            results.put(("err", rank, traceback.format_exc()))
            return
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    _report_q, _rank = results, rank
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=gloo_timeout_s))
    results.put(("ready", rank, None))
    while True:
        job = tasks.get()
        if job is None:
            break
        fn, args = job
        try:
            out = fn(rank, world, *args)
            results.put(("ok", rank, out))
        except BaseException:  # noqa: BLE001 - the parent re-raises with the traceback
            results.put(("err", rank, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # pragma: no cover
        pass


def _per_rank(value, world_size: int, what: str, entries: str, single: type) -> Optional[list]:
    """``value`` as a list of ``world_size`` entries (one per rank), or None for None.

    Raises:
        ValueError: ``value`` is a ``single`` (one entry where W are expected), not a sequence,
            or not of ``world_size`` entries (the message names ``what`` and the ``entries``).
    """
    if value is None:
        return None
    if isinstance(value, single) or not hasattr(value, "__len__") or len(value) != world_size:
        raise ValueError(f"GlooPool: {what}={value!r}; accepted: None or a sequence of {world_size} {entries} "
                         f"(one per rank)")
    return list(value)


class GlooPool:
    """W spawned CPU processes (one thread each by default) in a gloo process group.

    Args:
        world_size: number of processes (>= 1).
        threads: ``torch.set_num_threads`` in each worker.
        gloo_timeout_s: collective timeout (seconds), so a failed rank does not hang the others
            forever.
        start_timeout_s: how long to wait for the workers to start (seconds).
        netns: the network namespace of each rank (W names of ``/var/run/netns``, e.g.
            ``Setup.rank_netns(W)`` of :mod:`gradcomp.experiments.links`), or None (the parent's
            namespace). A worker enters its namespace (:func:`enter_netns`) before anything
            else touches the network.
        env: each rank's extra environment (W dicts of str to str, e.g. ``{"GLOO_SOCKET_IFNAME":
            "lo"}``), set before torch.distributed starts, or None.

    Attributes:
        world_size: W; ``netns``: the W namespace names or None; ``closed``: whether the pool
            was closed (by :meth:`close`, or after a failed job or start).

    Raises:
        ValueError: world_size < 1; ``netns`` / ``env`` not of W entries, a namespace that does
            not exist, an env entry that is not a dict of strings.
        RuntimeError: a worker failed to start (its traceback: e.g. setns refused), or the start
            timed out.
    """

    def __init__(self, world_size: int, threads: int = 1, gloo_timeout_s: float = 60.0,
                 start_timeout_s: float = 180.0, netns: Optional[Sequence[str]] = None,
                 env: Optional[Sequence[Mapping[str, str]]] = None):
        import torch.multiprocessing as mp

        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        netns = self._check_netns(netns, world_size)
        env = self._check_env(env, world_size)
        self.world_size = world_size
        self.netns = netns
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory(prefix="gradcomp-pool-")
        init_file = os.path.join(self._dir.name, "init")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = []
        for r in range(world_size):
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(r, world_size, init_file, self._tasks[r], self._results, threads,
                                  gloo_timeout_s, list(sys.path), netns[r] if netns else None,
                                  env[r] if env else None))
            p.start()
            self._procs.append(p)
        self.closed = False
        ready = 0
        deadline = time.monotonic() + start_timeout_s
        while ready < world_size:
            kind, rank, payload = self._get(deadline, "start")
            if kind == "ready":
                ready += 1
            elif kind == "err":
                self.close(force=True)
                raise RuntimeError(f"GlooPool: worker {rank} failed to start:\n{payload}")

    @staticmethod
    def _check_netns(netns, world_size: int) -> Optional[List[str]]:
        out = _per_rank(netns, world_size, "netns", "namespace names", str)
        if out is None:
            return None
        out = [str(n) for n in out]
        missing = sorted({n for n in out if not namespace_exists(n)})
        if missing:
            raise ValueError(f"GlooPool: network namespace(s) {', '.join(missing)} not found in {NETNS_DIR}")
        return out

    @staticmethod
    def _check_env(env, world_size: int) -> Optional[List[dict]]:
        out = _per_rank(env, world_size, "env", "dicts", Mapping)
        if out is None:
            return None
        for r, e in enumerate(out):
            if not isinstance(e, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in e.items()):
                raise ValueError(f"GlooPool: env[{r}]={e!r}; accepted: a dict of str to str")
        return [dict(e) for e in out]

    def _get(self, deadline, what):
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(force=True)
                raise RuntimeError(f"GlooPool: {what} timed out")
            try:
                return self._results.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [p.pid for p in self._procs if not p.is_alive()]
                if dead:
                    self.close(force=True)
                    raise RuntimeError(f"GlooPool: worker process(es) {dead} died during {what}")

    def run(self, fn: Callable, *args, timeout: float = 300.0,
            on_progress: Optional[Callable[[int, Any], None]] = None) -> List[Any]:
        """Run ``fn(rank, world_size, *args)`` on every worker; return the W results in rank
        order. ``on_progress(rank, msg)`` receives the workers' :func:`report` messages;
        ``timeout``: seconds for the whole job.

        Raises:
            RuntimeError: the pool is closed; a worker raised (every failed rank's traceback in
                the message), a worker died, or the job timed out (the pool is then closed).
        """
        if self.closed:
            raise RuntimeError("GlooPool: the pool is closed")
        for q in self._tasks:
            q.put((fn, args))
        out: List[Any] = [None] * self.world_size
        errors = []
        got = 0
        deadline = time.monotonic() + timeout
        while got < self.world_size:
            kind, rank, payload = self._get(deadline, f"job {getattr(fn, '__name__', fn)}")
            if kind == "progress":
                if on_progress is not None:
                    on_progress(rank, payload)
                continue
            got += 1
            if kind == "ok":
                out[rank] = payload
            else:
                errors.append((rank, payload))
        if errors:
            self.close(force=True)
            msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors))
            raise RuntimeError(f"GlooPool: job {getattr(fn, '__name__', fn)} failed:\n{msg}")
        return out

    def close(self, force: bool = False) -> None:
        """Stop the workers (politely, or by terminating them with ``force``)."""
        if self.closed:
            return
        self.closed = True
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        self._dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=exc[0] is not None)


_SHARED: Dict[tuple, GlooPool] = {}


def shared(world_size: int, **options) -> GlooPool:
    """This process's pool of ``world_size`` ranks with the :class:`GlooPool` keyword
    ``options`` (e.g. ``gloo_timeout_s``, ``env``): spawned on first use and kept for the next
    call with the same arguments; a pool that was closed (a failed job closes its pool, since its
    ranks may be stuck in a collective) is replaced by a fresh one. Close them all with
    :func:`close_shared`.

    Raises:
        as :class:`GlooPool`.
    """
    key = (int(world_size), repr(sorted(options.items())))
    p = _SHARED.get(key)
    if p is None or p.closed:
        p = _SHARED[key] = GlooPool(world_size, **options)
    return p


def close_shared() -> None:
    """Close every pool :func:`shared` made (politely) and forget them."""
    for p in _SHARED.values():
        p.close()
    _SHARED.clear()
