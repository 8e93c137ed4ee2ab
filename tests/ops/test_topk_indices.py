"""``dsv4::topk_indices`` on the CPU (its reference): each row's k largest columns in descending
order, equal scores in column order; the same set of columns as ``torch.topk`` where the scores are
distinct; argument errors name the argument."""

import pytest
import torch

topk_indices = torch.ops.dsv4.topk_indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # integers below 2048: distinct in both
@pytest.mark.parametrize("rows, columns, k", [(1, 8, 2), (5, 256, 6), (3, 300, 32), (0, 16, 4)])
def test_the_k_largest_in_descending_order(dtype, rows, columns, k):
    gen = torch.Generator().manual_seed(columns + k)
    scores = torch.randperm(rows * columns, generator=gen).view(rows, columns).to(dtype)  # distinct
    got = topk_indices(scores, k)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    want = torch.topk(scores, k, dim=-1, sorted=True).indices
    assert torch.equal(got, want)
    values = scores.gather(1, got)
    assert (values[:, :-1] >= values[:, 1:]).all()


def test_ties_zeros_and_nan():
    """Equal scores in column order, -0.0 equal to +0.0, NaN above +inf."""
    scores = torch.tensor([[1.0, 3.0, -0.0, 3.0, 0.0, float("nan"), float("inf"), -1.0]])
    assert topk_indices(scores, 8).tolist() == [[5, 6, 1, 3, 0, 2, 4, 7]]


def test_bad_arguments_name_themselves():
    scores = torch.randn(2, 8)
    cases = [((scores.long(), 2), TypeError, "scores must have dtype"),
             ((scores[0], 2), ValueError, "scores must be 2-D"),
             ((scores, 0), ValueError, "k=0 must be between 1 and the 8 columns"),
             ((scores, 9), ValueError, "k=9 must be between 1 and the 8 columns")]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            topk_indices(*args)
