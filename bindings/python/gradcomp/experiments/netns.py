"""Network namespaces by name, the two primitives that :mod:`gradcomp.experiments.pool` (a rank
enters its namespace) and :mod:`gradcomp.experiments.links` (which creates and removes them with
``ip netns``) share: where ``ip netns`` keeps a namespace (:data:`NETNS_DIR`), whether one exists,
and moving the calling thread into one with setns(2). Standard library only; entering needs root
(CAP_SYS_ADMIN).
"""

import os

NETNS_DIR = "/var/run/netns"
"""Where ``ip netns add NAME`` keeps the namespace ``NAME`` (a bind mount of its nsfs file)."""

CLONE_NEWNET = 0x40000000
"""setns(2)'s nstype for a network namespace (``<sched.h>``)."""


def namespace_exists(name: str) -> bool:
    """Whether ``/var/run/netns/<name>`` exists (a namespace ``ip netns add`` made)."""
    return os.path.exists(os.path.join(NETNS_DIR, name))


def enter_netns(name: str) -> None:
    """Move the calling thread into the network namespace ``name`` (``/var/run/netns/NAME``) with
    setns(2) through ctypes (Python 3.11 has no ``os.setns``). Only the calling thread moves;
    threads it starts afterwards (gloo's) inherit the namespace, so call it before
    ``init_process_group`` (:class:`gradcomp.experiments.pool.GlooPool` does, in each worker, for
    its ``netns``). Needs CAP_SYS_ADMIN (root).

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
