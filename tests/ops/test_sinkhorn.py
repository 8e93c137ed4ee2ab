"""``dsv4::sinkhorn`` on the CPU (its reference): the Sinkhorn-Knopp loop of transformers'
``DeepseekV4HyperConnection``, bit for bit, and argument errors that name the argument."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from tests.support.hf_model import tiny_hf_config

sinkhorn = torch.ops.dsv4.sinkhorn


def transformers_loop(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The loop as ``DeepseekV4HyperConnection.forward`` writes it."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("shape", [(5, 4, 4), (2, 3, 4, 4), (4, 4), (6, 3, 3), (0, 4, 4)])
@pytest.mark.parametrize("iters, eps", [(1, 1e-6), (2, 0.0), (20, 1e-6)])
def test_equals_the_transformers_loop(shape, iters, eps):
    x = torch.rand(shape) + 0.01
    out = sinkhorn(x, iters, eps)
    assert torch.equal(out, transformers_loop(x, iters, eps))
    assert out.shape == x.shape and out.is_contiguous()


def test_strided_input_gives_a_contiguous_result():
    x = (torch.rand(3, 4, 4) + 0.01).transpose(1, 2)
    out = sinkhorn(x, 20, 1e-6)
    assert out.is_contiguous()
    assert torch.equal(out, transformers_loop(x.contiguous(), 20, 1e-6))


@torch.no_grad()
def test_equals_the_comb_of_a_hyper_connection():
    """The comb weights a real ``DeepseekV4HyperConnection`` returns are ``sinkhorn`` of its
    softmax stage (the lines of its forward before the loop, repeated here)."""
    config = tiny_hf_config(num_hidden_layers=1)
    hc, n = DeepseekV4HyperConnection(config), config.hc_mult
    for p in (hc.fn, hc.base, hc.scale):
        p.normal_(std=0.5)
    streams = torch.randn(2, 3, n, config.hidden_size).bfloat16()
    _, comb, _ = hc(streams)

    mixes = F.linear(hc.input_norm(streams.view(2, 3, -1).float()), hc.fn.float())
    comb_w = mixes.split([n, n, n * n], dim=-1)[2].view(2, 3, n, n)
    softmax = torch.softmax(comb_w * hc.scale[2] + hc.base[2 * n:].view(n, n), dim=-1) + hc.hc_eps
    assert torch.equal(sinkhorn(softmax, config.hc_sinkhorn_iters, config.hc_eps), comb)


X = torch.rand(3, 4, 4)


@pytest.mark.parametrize("args, exc, name", [
    ((X.double(), 20, 1e-6), TypeError, "x"),
    ((X.bfloat16(), 20, 1e-6), TypeError, "x"),
    ((torch.rand(4), 20, 1e-6), ValueError, "x"),
    ((torch.rand(3, 4, 5), 20, 1e-6), ValueError, "x"),
    ((X, 0, 1e-6), ValueError, "iters"),
    ((X, 20, -1e-6), ValueError, "eps"),
    ((X, 20, float("nan")), ValueError, "eps"),
], ids=["fp64", "bf16", "1-D", "not-square", "iters-0", "eps-negative", "eps-nan"])
def test_bad_arguments_are_named(args, exc, name):
    with pytest.raises(exc, match=rf"^dsv4\.sinkhorn: {name}\b"):
        sinkhorn(*args)
    with pytest.raises(exc, match=rf"^dsv4\.sinkhorn: {name}\b"):  # the fake impl checks alike
        sinkhorn(args[0].to("meta"), *args[1:])
