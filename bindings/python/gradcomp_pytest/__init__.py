"""The pytest plugin of the contract suite: the ``--codec SPEC`` option (repeatable) and the
parametrisation. Installed as the ``pytest11`` entry point ``gradcomp`` (pyproject.toml), so
``pytest --pyargs gradcomp.testing --codec SPEC`` works wherever gradcomp is installed; from a
source tree use ``pytest -p gradcomp.testing.plugin --pyargs gradcomp.testing``.

Test functions of the gradcomp.testing modules (only those) that take these arguments are
parametrised over:
  ``spec``    the ``--codec`` specs given, else every example spec of ``gradcomp.codecs()``;
  ``device``  "cpu", and "cuda" when torch sees a GPU;
  ``dtype``   "float32", "float16", "bfloat16".
"""

def pytest_addoption(parser):
    parser.addoption("--codec", action="append", default=[], metavar="SPEC",
                     help="gradcomp contract suite: a codec spec to check (repeatable); default: every "
                          "example spec of gradcomp.codecs()")


def _specs(config):
    import gradcomp

    given = config.getoption("codec") or []
    if given:
        for s in given:
            gradcomp.Codec(s)  # a bad spec fails the collection with gradcomp's message
        return list(given)
    return [e for c in gradcomp.codecs() for e in c["examples"]]


def _devices():
    import gradcomp

    out = ["cpu"]
    try:
        import torch

        if torch.cuda.is_available() and gradcomp.build_info()["cuda"]:
            out.append("cuda")
    except ImportError:  # pragma: no cover - torch is a test dependency
        pass
    return out


def pytest_generate_tests(metafunc):
    if not metafunc.module.__name__.startswith("gradcomp.testing"):
        return
    if "spec" in metafunc.fixturenames:
        metafunc.parametrize("spec", _specs(metafunc.config))
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", _devices())
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", ["float32", "float16", "bfloat16"])
