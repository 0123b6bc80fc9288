"""Loads gradcomp's pytest plugin (the package ``gradcomp_pytest``: the ``--codec`` option and the
contract suite's parametrisation) for ``pytest -p gradcomp.testing.plugin --pyargs
gradcomp.testing`` from a source tree; an installed gradcomp registers it as the ``pytest11``
entry point ``gradcomp`` instead, and pytest loads it once either way."""

pytest_plugins = ["gradcomp_pytest"]
