"""Shared pytest configuration for tests/python (several test files; keep additions small)."""

import sys

# markers that tag whole modules (pytest -m selects on them; none of them deselects by itself):
# multiproc - real gloo process groups (pools or spawned processes); deepspeed - DeepSpeed
# trainings or its backend; netns - network namespaces (root)
_MODULE_MARKERS = {
    "multiproc": ("test_charlm", "test_compressed_adam", "test_compressor", "test_dgc", "test_ddp_hook", "test_deepspeed_backend",
                  "test_deepspeed_integration", "test_experiment", "test_failures", "test_fsdp", "test_hierarchical",
                  "test_links", "test_optim", "test_parity", "test_pool", "test_powersgd", "test_profiler_ranges",
                  "test_protocol", "test_scheme_keys", "test_step_report", "test_stochastic_rounding",
                  "test_torch_integration", "test_two_phase"),
    "deepspeed": ("test_deepspeed_backend", "test_deepspeed_integration"),
    "netns": ("test_links",),
}


def pytest_configure(config):
    # test_codec_large.py: tensors of 2^31 + 64 elements; runs by default, deselect with -m 'not large'
    config.addinivalue_line("markers", "large: needs ~6 GB of memory and tens of seconds (deselect with -m 'not large')")
    # the whole suite runs everything; tests/quick.sh deselects these with -m 'not slow'
    config.addinivalue_line("markers", "slow: left out of the quick tier (tests/quick.sh): trainings in subprocesses, "
                                       "failure cases, end-to-end runs, the large sizes")
    config.addinivalue_line("markers", "multiproc: runs real gloo process groups (pools of spawned ranks, subprocesses)")
    config.addinivalue_line("markers", "deepspeed: DeepSpeed's engine or its communication backend")
    config.addinivalue_line("markers", "netns: network namespaces and shaped links (needs root and iproute2)")


def pytest_collection_modifyitems(config, items):
    # slow as well: the large tests, and every case on more than 2 ranks (the quick tier runs each
    # scheme on 2; the whole suite runs them all)
    import pytest

    for item in items:
        cs = getattr(item, "callspec", None)
        world = cs.params.get("world") if cs is not None else None
        if item.get_closest_marker("large") is not None or (isinstance(world, int) and world > 2):
            item.add_marker(pytest.mark.slow)
        module = getattr(item, "module", None)
        name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
        for marker, modules in _MODULE_MARKERS.items():
            if name in modules:
                item.add_marker(getattr(pytest.mark, marker))


def pytest_sessionfinish(session, exitstatus):
    # the gloo pools shared by the session (gradcomp.experiments.pool.shared: ddp_helpers.run,
    # gloo_pools.py), if any module made one
    pools = sys.modules.get("gradcomp.experiments.pool")
    if pools is not None:
        pools.close_shared()
