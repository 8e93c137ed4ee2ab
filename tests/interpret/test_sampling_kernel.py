"""``dsv4::greedy_tokens``' kernels (``ops/kernels/sampling.py``) equal ``argmax(-1)``: rows with
many ties, infinities and NaNs, vocabularies shorter than, equal to and past a chunk, each logits
dtype, a row-strided view."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_compile.ops.kernels import sampling as kernels

CHUNK = kernels._BLOCK
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"  # hypothesis: no fixture
SPECIAL = [float("inf"), float("-inf"), float("nan")]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3), vocab=st.sampled_from([1, 7, CHUNK, CHUNK + 1, 3 * CHUNK - 5]),
       levels=st.integers(1, 4), specials=st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(SPECIAL)),
                                                   max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2 ** 16))
def test_kernel_equals_argmax(rows, vocab, levels, specials, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).to(dtype)  # few values: many ties
    for where, value in specials:
        logits.view(-1)[where % logits.numel()] = value
    logits = logits.to(DEVICE)
    got = kernels.launch_greedy_tokens(logits)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), logits.cpu().argmax(-1))


@pytest.mark.parametrize("all_value", [float("-inf"), float("nan")])
def test_rows_of_one_value_give_column_zero(device, all_value):
    logits = torch.full((2, CHUNK + 3), all_value, device=device)
    assert kernels.launch_greedy_tokens(logits).tolist() == [0, 0]


def test_row_strided_view_and_zero_rows(device):
    wide = torch.randn(3, 2 * CHUNK + 40, device=device)
    logits = wide[:, 8:8 + CHUNK + 20]  # row stride past the row length
    assert torch.equal(kernels.launch_greedy_tokens(logits).cpu(), logits.cpu().argmax(-1))
    assert kernels.launch_greedy_tokens(wide[:0]).shape == (0,)


def test_op_runs_the_kernel_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("the op's CUDA kernel registration")
    logits = torch.randn(4, 129280, device="cuda").bfloat16()
    assert torch.equal(torch.ops.dsv4.greedy_tokens(logits), logits.argmax(-1))
