"""``dsv4::linears`` on the GPU: the Triton kernel (up to 16 rows) against ``torch.mm`` at the
benchmark model's projection shapes (the model step with and without its pass:
``test_fx_passes_gpu.py``)."""

import pytest
import torch

from dsv4_compile.ops.kernels import linear as kernels

pytestmark = pytest.mark.gpu
# a CSA layer's projections of its normed hidden state (hidden 4096): q_a, kv, compressor kv and
# gate, the indexer's compressor kv and gate, the indexer weights
PROJECTIONS = (1024, 512, 1024, 1024, 256, 256, 64)


def _assert_bf16_close(got, want):
    """Within one bf16 rounding step at the output's scale (another order of the K sums)."""
    torch.testing.assert_close(got.float(), want.float(), atol=2 ** -7 * want.float().abs().max().item(), rtol=0)


@pytest.mark.parametrize("rows", [1, 8, kernels.MAX_ROWS, kernels.MAX_ROWS + 1])
@torch.no_grad()
def test_op_equals_mm(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    weights = [(torch.randn(n, 4096, device="cuda", generator=g) * 0.02).bfloat16() for n in PROJECTIONS]
    for out, w in zip(torch.ops.dsv4.linears(x, weights), weights):
        _assert_bf16_close(out, x @ w.T)
