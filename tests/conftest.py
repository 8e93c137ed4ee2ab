"""Shared pytest setup: the ``gpu`` marker skips without CUDA; each test starts from fixed seeds.

Test-only plumbing lives in the ``tests/support`` package, imported as ``tests.support.<module>``
(pytest's importlib mode resolves ``tests`` from the root directory; no ``sys.path`` edits)."""

import pytest
import torch

import dsv4_compile  # noqa: F401  (registers the dsv4:: ops)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
