"""Runs ``tests/interpret`` under ``TRITON_INTERPRET=1`` in a fresh process (CPU machines)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA tests/interpret runs natively")
def test_kernels_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here / "interpret")],
                          env=env, capture_output=True, text=True, cwd=here.parent)
    if proc.returncode == 5:  # no kernel tests collected
        pytest.skip("no interpreter tests")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
