"""``dsv4::linears`` on the GPU: the Triton kernel (up to 64 rows) against ``torch.mm`` at the
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


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 40, kernels.MAX_ROWS, kernels.MAX_ROWS + 1])
@torch.no_grad()
def test_op_equals_mm(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    weights = [(torch.randn(n, 4096, device="cuda", generator=g) * 0.02).bfloat16() for n in PROJECTIONS]
    for out, w in zip(torch.ops.dsv4.linears(x, weights), weights):
        _assert_bf16_close(out, x @ w.T)


@pytest.mark.parametrize("rows", [1, 8, 17, kernels.MAX_ROWS, kernels.MAX_ROWS + 1])
@torch.no_grad()
def test_lone_products_of_deep_k_equal_mm(rows):
    """The products FuseSharedInputLinearsPass hands the op alone: o_b_proj (K 8192) and an
    lm_head-sized weight (the wide tile)."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    for n, k in ((4096, 8192), (kernels.WIDE_ROWS + 1000, 4096)):
        x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        _assert_bf16_close(torch.ops.dsv4.linears(x, [w])[0], x @ w.T)


@pytest.mark.parametrize("rows", [1, 8, 17, kernels.MAX_ROWS, kernels.MAX_ROWS + 1])
@torch.no_grad()
def test_query_latent_norm_folded_equals_norm_then_mm(rows):
    """The query latent's products with its RMSNorm folded in (K 1024): a CSA layer's q_b and the
    indexer's q_b in one launch, another layer's lone q_b; fp32 and bf16 norm weights."""
    from dsv4_compile.reference.functional import rms_norm

    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, 1024, device="cuda", generator=g) * 3).bfloat16()
    weights = [(torch.randn(n, 1024, device="cuda", generator=g) * 0.02).bfloat16() for n in (64 * 512, 64 * 128)]
    for norm in (torch.rand(1024, device="cuda", generator=g) + 0.5, torch.rand(1024, device="cuda").bfloat16() + 0.5):
        normed = rms_norm(x, norm, 1e-6)
        for group in (weights, weights[:1]):
            for out, w in zip(torch.ops.dsv4.linears(x, group, norm, 1e-6), group):
                _assert_bf16_close(out, normed @ w.T)


@pytest.mark.parametrize("rows", [1, 8, kernels.MAX_ROWS, kernels.MAX_ROWS + 1])
@torch.no_grad()
def test_grouped_linear_equals_bmm(rows):
    """The Flash model's o_a_proj: 8 groups of 1024 x 4096."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 8, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(8 * 1024, 4096, device="cuda", generator=g) * 0.02).bfloat16()
    want = torch.bmm(x.transpose(0, 1), w.view(8, 1024, 4096).transpose(1, 2)).transpose(0, 1)
    _assert_bf16_close(torch.ops.dsv4.grouped_linear(x, w), want)


@torch.no_grad()
def test_split_k_under_cudagraph_trees():
    """A split launch (a small group: the default config splits it) under ``mode="reduce-overhead"``:
    CUDA-graph trees' warm-up, recording and replays with new inputs, all correct."""
    from tests.support.compile_checks import fresh_compile_state

    w = torch.randn(1536, 4096, device="cuda").bfloat16() * 0.02
    assert kernels.default_config(4096, 1536)[1]
    with fresh_compile_state():
        step = torch.compile(lambda x: torch.ops.dsv4.linears(x, [w])[0], mode="reduce-overhead", fullgraph=True)
        for seed in range(4):
            x = torch.randn(1, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).bfloat16()
            _assert_bf16_close(step(x), x @ w.T)
