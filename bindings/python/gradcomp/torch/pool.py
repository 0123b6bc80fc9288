"""The gloo process pool's old home: it moved to :mod:`gradcomp.experiments.pool` (the pool) and
:mod:`gradcomp.experiments.links` (the network-namespace code), infrastructure of the experiment
harness, the benchmarks and the tests rather than part of the PyTorch integration. This module
re-exports them so that ``from gradcomp.torch.pool import GlooPool`` keeps working; new code
imports :mod:`gradcomp.experiments.pool`.
"""

from ..experiments.pool import (CLONE_NEWNET, NETNS_DIR, GlooPool, close_shared, enter_netns,  # noqa: F401
                                report, shared)

__all__ = ["GlooPool", "report", "shared", "close_shared", "enter_netns", "CLONE_NEWNET", "NETNS_DIR"]
