"""Kernel-vs-reference tests at small shapes. On a machine without CUDA they run only under
``TRITON_INTERPRET=1`` (``tests/test_triton_interpreter.py`` starts that run in a subprocess,
because the variable is read when kernels are decorated); with CUDA they run on the GPU."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_ignore_collect(collection_path, config):
    return not (INTERPRET or torch.cuda.is_available())


def pytest_configure(config):
    """Under the interpreter, record the kernels' launches when asked (``tests/support/kernel_launches.py``
    compiles them for sm_90 afterwards)."""
    from tests.support.kernel_launches import RECORD_ENV, start_recording

    if INTERPRET and os.environ.get(RECORD_ENV):
        start_recording(os.environ[RECORD_ENV])


@pytest.fixture
def device():
    """Where kernel inputs live: CPU tensors under the interpreter, else the GPU."""
    return "cpu" if INTERPRET else "cuda"


@pytest.fixture(params=["rank", "row", "split"])
def select_path(request, monkeypatch):
    """Every path of the top-k select: decode-sized steps rank each entry against its row, short
    rows run in one program, longer rows in three split passes (each forced by the launcher's limits)."""
    from dsv4_compile.ops.kernels import topk_select

    for name, limit in topk_select.PATH_LIMITS[request.param].items():
        monkeypatch.setattr(topk_select, name, limit)
    return request.param
