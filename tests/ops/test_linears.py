"""``dsv4::linears`` on the CPU (its reference): each output is ``F.linear`` of the input by its
weight, bit for bit, and argument errors name the argument."""

import pytest
import torch
import torch.nn.functional as F

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
