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


def test_bad_arguments_name_themselves():
    x, w = torch.randn(3, 16).bfloat16(), torch.randn(4, 16).bfloat16()
    cases = [
        ((x.float(), [w.float()]), TypeError, "x must have dtype"),
        ((x[0], [w]), ValueError, "x must be 2-D"),
        ((x, []), ValueError, "at least one"),
        ((x, [w, w.half()]), TypeError, r"weights\[1\] must have dtype"),
        ((x, [w, w[:, :8]]), ValueError, r"weights\[1\] has shape"),
        ((x, [w, w.to("meta")]), ValueError, r"weights\[1\] is on meta"),
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
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            torch.ops.dsv4.grouped_linear(*args)
