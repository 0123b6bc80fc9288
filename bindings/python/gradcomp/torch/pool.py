"""A reusable pool of W processes joined in one gloo process group (CPU), for tests and the
experiment harness: spawning a torch process costs seconds, so the pool spawns once and runs many
jobs.

Ranks may live in other network namespaces (``netns``: each worker enters its namespace with
setns(2) before the process group starts; :mod:`gradcomp.experiments.links` builds rate-limited
ones) and get their own environment (``env``, e.g. ``GLOO_SOCKET_IFNAME``); the rendezvous is a
FileStore in a temporary folder, which every namespace sees.

``pool.run(fn, *args)`` calls ``fn(rank, world_size, *args)`` in every worker (``fn`` must be a
module-level function, importable by the spawned children) and returns the W return values in
rank order. A worker may call :func:`report` to send a picklable progress message to the parent's
``on_progress`` callback.

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
from typing import Any, Callable, List, Mapping, Optional, Sequence

CLONE_NEWNET = 0x40000000
"""setns(2)'s nstype for a network namespace (``<sched.h>``)."""

NETNS_DIR = "/var/run/netns"
"""Where ``ip netns add NAME`` keeps the namespace ``NAME`` (a bind mount of its nsfs file)."""

_report_q = None
_rank = None


def report(msg: Any) -> None:
    """From inside a pool job: send ``msg`` (picklable) to the parent's ``on_progress``."""
    if _report_q is not None:
        _report_q.put(("progress", _rank, msg))


def enter_netns(name: str) -> None:
    """Move the calling thread into the network namespace ``name`` (``/var/run/netns/NAME``) with
    setns(2) through ctypes (Python 3.11 has no ``os.setns``). Only the calling thread moves;
    threads it starts afterwards (gloo's) inherit the namespace, so call it before
    ``init_process_group``. Needs CAP_SYS_ADMIN (root).

    Raises:
        OSError: the namespace file cannot be opened, or setns failed (errno and name in the
            message).
    """
    import ctypes

    path = os.path.join(NETNS_DIR, name)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}, CLONE_NEWNET) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


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


class GlooPool:
    """W spawned CPU processes (one thread each by default) in a gloo process group.

    Args:
        world_size: number of processes (>= 1).
        threads: ``torch.set_num_threads`` in each worker.
        gloo_timeout_s: collective timeout, so a failed rank does not hang the others forever.
        start_timeout_s: how long to wait for the workers to start.
        netns: the network namespace of each rank (W names of ``/var/run/netns``, e.g.
            ``Setup.rank_netns(W)`` of :mod:`gradcomp.experiments.links`), or None (the parent's
            namespace). A worker enters its namespace (:func:`enter_netns`) before anything
            else touches the network.
        env: each rank's extra environment (W dicts of str to str, e.g. ``{"GLOO_SOCKET_IFNAME":
            "lo"}``), set before torch.distributed starts, or None.

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
        if netns is None:
            return None
        if isinstance(netns, str) or len(netns) != world_size:
            raise ValueError(f"GlooPool: netns={netns!r}; accepted: None or a sequence of {world_size} "
                             f"namespace names (one per rank)")
        out = [str(n) for n in netns]
        missing = sorted({n for n in out if not os.path.exists(os.path.join(NETNS_DIR, n))})
        if missing:
            raise ValueError(f"GlooPool: network namespace(s) {', '.join(missing)} not found in {NETNS_DIR}")
        return out

    @staticmethod
    def _check_env(env, world_size: int) -> Optional[List[dict]]:
        if env is None:
            return None
        if isinstance(env, Mapping) or len(env) != world_size:
            raise ValueError(f"GlooPool: env={env!r}; accepted: None or a sequence of {world_size} dicts "
                             f"(one per rank)")
        out = []
        for r, e in enumerate(env):
            if not isinstance(e, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in e.items()):
                raise ValueError(f"GlooPool: env[{r}]={e!r}; accepted: a dict of str to str")
            out.append(dict(e))
        return out

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
        """Run ``fn(rank, world_size, *args)`` on every worker; return the results in rank order."""
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
