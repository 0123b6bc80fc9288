"""The gloo process pools shared by the whole pytest session: the library's own,
``gradcomp.experiments.pool.shared`` (one pool per (world size, options), spawned on first use; a
pool whose job failed is closed by GlooPool, its ranks may be stuck in a collective, and the next
call spawns a fresh one), closed at the session's end by conftest.py's pytest_sessionfinish. So the
modules that run jobs on 2, 3 or 4 ranks (ddp_helpers.run and its importers, test_parity,
test_charlm, test_pool) spawn and import torch once per world size rather than once per module
(issue 20). This module keeps the names those modules import."""

from gradcomp.experiments.pool import GlooPool, close_shared, shared


def pool(world: int, **options) -> GlooPool:
    """The session's pool of ``world`` ranks with GlooPool ``options`` (a new one if it was closed)."""
    return shared(world, **options)


def close_all() -> None:
    """Close every shared pool (conftest.py does at the session's end)."""
    close_shared()
