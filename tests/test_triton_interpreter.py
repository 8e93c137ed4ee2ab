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


def test_collapse_launch_at_the_models_tile_builds_without_local_memory(recorded_launches):
    """The products' launch that makes a hyper-connection's collapse, at the model's split-K tile
    and one token (the launch's limit), specialised as on the GPU: its sm_90 build keeps everything
    in registers. From two tokens it spilled (6 KiB of stack a thread at four) and ran ~70x slower
    on an H100 (docs/perf-log.md, 2026-12-06)."""
    import inspect
    import json

    import triton

    from dsv4_compile.ops.kernels import hyper_connection, linear
    from tests.support.kernel_launches import compile_for_sm90, local_memory_use

    launch = next(launch for launch in json.loads(recorded_launches.read_text())
                  if launch["kernel"] == "_linears_kernel" and launch["kwargs"]["COLLAPSE"]["value"] == 4
                  and launch["kwargs"]["SPLIT_K"]["value"])
    tokens, width, streams, mixes = linear.COLLAPSE_MAX_TOKENS, 4096, 4, 24  # the Flash model's mHC
    mix_row, _, _, _, d_per_split = hyper_connection._mix_plan(tokens, width, streams, mixes)
    splits = triton.cdiv(width, d_per_split)
    block_n, block_k, warps, stages = linear.SPLIT_K_CONFIG
    model = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages,
             "M_PAD": linear.rows_pad(tokens), "T_PAD": triton.next_power_of_2(tokens), "HC_NP": streams,
             "HC_MP": mix_row, "HC_SP": triton.next_power_of_2(splits), "PREFETCH_K": 256}
    launch["kwargs"].update({name: {"value": value} for name, value in model.items()})
    names = list(inspect.signature(linear._linears_kernel.fn).parameters)
    for name, value in {"M": tokens, "K": width, "hc_split": splits}.items():
        launch["args"][names.index(name)] = {"value": value}
    kernel, _ = compile_for_sm90(launch)
    assert local_memory_use(kernel.asm["ptx"]) is None
