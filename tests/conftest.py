"""Shared pytest setup: the ``gpu`` marker skips without CUDA; each test starts from fixed seeds."""

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
