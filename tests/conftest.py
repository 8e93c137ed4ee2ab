"""Shared pytest setup: the ``gpu`` marker skips without CUDA; the slowest modules run first; each
test starts from fixed seeds.

Test-only plumbing lives in the ``tests/support`` package, imported as ``tests.support.<module>``
(pytest's importlib mode resolves ``tests`` from the root directory; no ``sys.path`` edits)."""

import pytest
import torch

import dsv4_compile  # noqa: F401  (registers the dsv4:: ops)


# Modules whose first test waits minutes on a module fixture (an AOTInductor package build, the
# kernel tests under the Triton interpreter), run first: with README's `-n 2 --dist loadfile` each
# worker then starts on one of them while the other modules share out around them.
SLOW_MODULES = ("tests/model/test_deploy.py", "tests/test_triton_interpreter.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in SLOW_MODULES)  # stable: else as collected
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
