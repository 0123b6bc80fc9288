"""The gloo process pools (gradcomp.torch.pool.GlooPool) shared by the whole pytest session: one
per (world size, options), spawned on first use and closed at the session's end (conftest.py's
pytest_sessionfinish), so that the modules that run jobs on 2, 3 or 4 ranks (test_ddp_hook's
``run`` and its importers, test_parity, test_charlm) spawn and import torch once per world size
rather than once per module (issue 20). A pool whose job failed is closed by GlooPool (its ranks
may be stuck in a collective) and the next ``pool()`` call spawns a fresh one."""

from gradcomp.torch.pool import GlooPool

_POOLS = {}


def pool(world: int, **options) -> GlooPool:
    """The session's pool of ``world`` ranks with GlooPool ``options`` (a new one if it was closed)."""
    key = (world, tuple(sorted(options.items())))
    p = _POOLS.get(key)
    if p is None or p.closed:
        p = _POOLS[key] = GlooPool(world, **options)
    return p


def close_all() -> None:
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()
