"""``dsv4::linears`` and ``dsv4::grouped_linear`` on the CPU (their references): each output is
``F.linear`` of the input by its weight, and the grouped product is ``transformers``' grouped
linear module, bit for bit; argument errors name the argument."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

linears = torch.ops.dsv4.linears


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_equals_f_linear(rows):
    x = torch.randn(rows, 96).bfloat16()
    weights = [torch.randn(n, 96).bfloat16() for n in (1, 64, 130)]
    outs = linears(x, weights)
    assert len(outs) == 3
    for out, w in zip(outs, weights):
        assert out.dtype == torch.bfloat16 and torch.equal(out, F.linear(x, w))


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
def test_norm_weight_normalises_x_first(norm_dtype):
    """With a norm weight: the products of ``dsv4::rms_norm(x, norm_weight, eps)``, bit for bit."""
    x = torch.randn(5, 96).bfloat16() * 30
    weights = [torch.randn(n, 96).bfloat16() for n in (3, 64)]
    norm = (torch.rand(96) + 0.5).to(norm_dtype)
    normed = torch.ops.dsv4.rms_norm(x, norm, 1e-5)
    for out, w in zip(linears(x, weights, norm, 1e-5), weights):
        assert torch.equal(out, F.linear(normed, w))


def test_bad_arguments_name_themselves():
    x, w = torch.randn(3, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    cases = [
        ((x.float(), [w.float()]), TypeError, "x must have dtype"),
        ((x[0], [w]), ValueError, "x must be 2-D"),
        ((x, []), ValueError, "at least one"),
        ((x, [w, w.half()]), TypeError, r"weights\[1\] must have dtype"),
        ((x, [w, w[:, :8]]), ValueError, r"weights\[1\] has shape"),
        ((x, [w, w.to("meta")]), ValueError, r"weights\[1\] is on meta"),
        ((x, [w], torch.ones(16).double()), TypeError, "norm_weight must have dtype"),
        ((x, [w], torch.ones(8)), ValueError, "norm_weight has shape"),
        ((x, [w], torch.ones(1, 16)), ValueError, "norm_weight must be 1-D"),
        ((x, [w], torch.ones(16, device="meta")), ValueError, "norm_weight is on meta"),
        ((x, [w], torch.ones(16), -1e-6), ValueError, "eps must be >= 0"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            linears(*args)


@pytest.mark.parametrize("rows", [1, 5, 40])  # the module cannot reshape 0 rows; opcheck runs them
def test_grouped_linear_equals_the_grouped_module(rows):
    module = DeepseekV4GroupedLinear(32, 4 * 24, 4).bfloat16()
    x = torch.randn(rows, 4, 32).bfloat16()
    out = torch.ops.dsv4.grouped_linear(x, module.weight.detach())
    assert out.shape == (rows, 4, 24) and out.is_contiguous()
    assert torch.equal(out, module(x).detach())


def test_grouped_linear_bad_arguments_name_themselves():
    x, w = torch.randn(3, 2, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    cases = [
        ((x.double(), w.double()), TypeError, "x must have dtype"),
        ((x[0], w), ValueError, "x must be 3-D"),
        ((x, w.half()), TypeError, "w must have dtype"),
        ((x, w[:, :8]), ValueError, "w has shape"),
        ((x, w[:7]), ValueError, "not a multiple of the 2 groups"),
        ((x, w.to("meta")), ValueError, "w is on meta"),
    ]
    pos, freq = torch.arange(3), torch.rand(4)
    cases += [
        ((x, w, pos, None, 8), ValueError, "given together"),
        ((x, w, pos.float(), freq, 8), TypeError, "positions must have dtype"),
        ((x, w, pos[:2], freq, 8), ValueError, "positions has shape"),
        ((x, w, pos, freq.double(), 8), TypeError, "inv_freq must have dtype"),
        ((x, w, pos, freq, 0), ValueError, "head_dim=0 must be positive"),
        ((x, w, pos, freq, 6), ValueError, "head_dim=6 must be positive and divide"),
        ((x, w, pos, freq[:3], 8), ValueError, "inv_freq must have a power-of-two length, got 3"),
        ((x, w, pos, torch.rand(8), 8), ValueError, "inv_freq has 8 entries; .* needs between 1 and 4"),
        ((x, w, pos.to("meta"), freq, 8), ValueError, "positions is on meta"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            torch.ops.dsv4.grouped_linear(*args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_linear_rotates_heads_back_first(dtype):
    """With positions: the product of x whose heads (head_dim 16, RoPE on their last 8) were
    rotated back by ``rope_tail(..., inverse=True)``, bit for bit; not the product of x itself."""
    from dsv4_compile.reference.functional import rope_tail

    x, w = torch.randn(3, 2, 32).to(dtype), torch.randn(2 * 8, 32).to(dtype)
    positions, inv_freq = torch.tensor([0, 17, 40_000], dtype=torch.int32), 0.3 ** torch.arange(4.0)
    unroped = rope_tail(x.view(3, 4, 16), positions[:, None], inv_freq, inverse=True).view(x.shape)
    got = torch.ops.dsv4.grouped_linear(x, w, positions, inv_freq, 16)
    assert torch.equal(got, torch.ops.dsv4.grouped_linear(unroped, w))
    assert torch.equal(got[0], torch.ops.dsv4.grouped_linear(x, w)[0])  # position 0: no rotation
    assert not torch.equal(got[1:], torch.ops.dsv4.grouped_linear(x, w)[1:])
