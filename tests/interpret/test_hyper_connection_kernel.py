"""The Sinkhorn kernel vs the reference (``ops/kernels/hyper_connection.py``), small shapes.

Matrix counts that fill whole programs (BLOCK_M = 4 matrices of 4 x 4), leave one partly filled, and none,
N = 4 (hc_mult), N = 3, 5 or 33 (padded to 4, 8 or 64) and N = MAX_N, strided input. The sums may be added in
another order than the reference's, so results agree to fp32 rounding (atol 1e-6 on values in
[0, 1]); through ``torch.ops.dsv4`` an N past the kernel's MAX_N runs the reference."""

import pytest
import torch

from dsv4_compile.ops.kernels import hyper_connection as kernels
from dsv4_compile.reference import hyper_connection as ref

ATOL = 1e-6


def _comb(shape, device, seed=0):
    """Positive weights like the softmax output the model normalises."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device) + 0.01


@pytest.mark.parametrize("shape", [(0, 4, 4), (1, 4, 4), (64, 4, 4), (65, 4, 4), (2, 3, 4, 4), (4, 4),
                                   (7, 3, 3), (3, 5, 5), (2, 1, 1), (2, 33, 33), (2, kernels.MAX_N, kernels.MAX_N)])
@pytest.mark.parametrize("iters, eps", [(1, 1e-6), (2, 0.0), (20, 1e-6)])
def test_kernel_matches_reference(device, shape, iters, eps):
    x = _comb(shape, device)
    got = kernels.launch_sinkhorn(x, iters, eps)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref.sinkhorn(x, iters, eps), atol=ATOL, rtol=0)


def test_strided_input(device):
    x = _comb((70, 4, 8), device)[:, :, ::2]
    torch.testing.assert_close(kernels.launch_sinkhorn(x, 20, 1e-6), ref.sinkhorn(x, 20, 1e-6), atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", [4, kernels.MAX_N + 1])
def test_op_on_device(device, n):
    x = _comb((3, n, n), device)
    torch.testing.assert_close(torch.ops.dsv4.sinkhorn(x, 20, 1e-6), ref.sinkhorn(x, 20, 1e-6), atol=ATOL, rtol=0)
