"""Runs ``tests/interpret`` under ``TRITON_INTERPRET=1`` in a fresh process (CPU machines), then
compiles every kernel variant that run launched for sm_90 with Triton's compiler
(``tests/support/kernel_launches.py``): the interpreter does not type-check kernels as the
compiler does, so a kernel can pass under it and still fail to build on the GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.kernel_launches import RECORD_ENV

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA tests/interpret runs natively")

HERE = Path(__file__).parent
MIN_VARIANTS = 100  # the suite launches ~120 distinct kernel variants: fewer means the record broke


@pytest.fixture(scope="module")
def recorded_launches(tmp_path_factory) -> Path:
    """The interpreter run; returns the file of the kernel launches it recorded."""
    launches = tmp_path_factory.mktemp("kernels") / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1", **{RECORD_ENV: str(launches)})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "interpret")],
                          env=env, capture_output=True, text=True, cwd=HERE.parent)
    if proc.returncode == 5:  # no kernel tests collected
        pytest.skip("no interpreter tests")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return launches


def test_kernels_under_triton_interpreter(recorded_launches):
    assert recorded_launches.exists()


def test_launched_kernels_compile_for_sm90(recorded_launches):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.support.kernel_launches", str(recorded_launches)],
                          env=env, capture_output=True, text=True, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    compiled = int(proc.stdout.split()[0])
    assert compiled >= MIN_VARIANTS, proc.stdout


def test_compiled_variant_is_specialised_as_a_gpu_launch():
    """A recorded launch compiles as the GPU specialises its arguments: an integer of 1 a constant,
    integers divisible by 16 and tensors marked divisible by 16, other integers as they are."""
    from tests.support.kernel_launches import compile_spec

    tensor = {"tensor": "bfloat16"}
    # _grouped_linear_kernel(x, w, out, M, G, K, N, stride_xm, stride_xg, tiles, *constexprs)
    scalars = {"M": 1, "G": 8, "K": 4096, "N": 1000, "stride_xm": 32768, "stride_xg": 4096, "tiles": 7}
    launch = {"module": "dsv4_compile.ops.kernels.linear", "kernel": "_grouped_linear_kernel",
              "args": [tensor] * 3 + [{"value": v} for v in scalars.values()],
              "kwargs": {"M_PAD": {"value": 16}, "BLOCK_N": {"value": 32}, "BLOCK_K": {"value": 512},
                         "PREFETCH_K": {"value": 256}, "num_warps": {"value": 4}, "num_stages": {"value": 3}}}
    fn, signature, constexprs, attrs, options = compile_spec(launch)
    divisible = [["tt.divisibility", 16]]
    index = {name: (i,) for i, name in enumerate(fn.arg_names)}
    assert signature["M"] == "constexpr" and constexprs[index["M"]] == 1
    assert signature["x_ptr"] == "*bf16" and attrs[index["x_ptr"]] == divisible
    for name in ("K", "stride_xm", "stride_xg"):
        assert signature[name] == "i32" and attrs[index[name]] == divisible, name
    for name in ("G", "N", "tiles"):
        assert signature[name] == "i32" and attrs[index[name]] == [], name
    assert constexprs[index["BLOCK_K"]] == 512 and options == {"num_warps": 4, "num_stages": 3}
