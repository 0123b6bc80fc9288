"""Shared pytest configuration for tests/python (several test files; keep additions small)."""


def pytest_configure(config):
    # test_codec_large.py: tensors of 2^31 + 64 elements; runs by default, deselect with -m 'not large'
    config.addinivalue_line("markers", "large: needs ~6 GB of memory and tens of seconds (deselect with -m 'not large')")
