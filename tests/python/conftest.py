"""Shared pytest configuration for tests/python (several test files; keep additions small)."""


def pytest_configure(config):
    # test_codec_large.py: tensors of 2^31 + 64 elements; runs by default, deselect with -m 'not large'
    config.addinivalue_line("markers", "large: needs ~6 GB of memory and tens of seconds (deselect with -m 'not large')")
    # the whole suite runs everything; tests/quick.sh deselects these with -m 'not slow'
    config.addinivalue_line("markers", "slow: left out of the quick tier (tests/quick.sh): trainings in subprocesses, "
                                       "failure cases, end-to-end runs, the large sizes")


def pytest_collection_modifyitems(config, items):
    # slow as well: the large tests, and every case on more than 2 ranks (the quick tier runs each
    # scheme on 2; the whole suite runs them all)
    import pytest

    for item in items:
        cs = getattr(item, "callspec", None)
        world = cs.params.get("world") if cs is not None else None
        if item.get_closest_marker("large") is not None or (isinstance(world, int) and world > 2):
            item.add_marker(pytest.mark.slow)
