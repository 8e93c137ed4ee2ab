"""``greedy_tokens`` (``dsv4::greedy_tokens``, whose kernels ``tests/interpret`` checks) equals
``argmax(-1)`` on rows with ties, infinities and NaNs; its argument checks; ``sample_tokens`` at
temperature 0 is greedy, otherwise draws at the given temperature, within top-k and top-p."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_compile.sampling import greedy_tokens, sample_tokens

SPECIAL = [float("inf"), float("-inf"), float("nan")]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 300), levels=st.integers(1, 4),
       specials=st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(SPECIAL)), max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_equals_argmax(rows, vocab, levels, specials, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).to(dtype)  # few values: many ties
    for where, value in specials:
        logits.view(-1)[where % logits.numel()] = value
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("logits, error, match", [
    (torch.zeros(2, 0), ValueError, "logits has no columns"),
    (torch.zeros(5), ValueError, "logits must be 2-D"),
    (torch.zeros(2, 3, dtype=torch.int64), TypeError, "logits must have dtype"),
])
def test_bad_logits_are_named(logits, error, match):
    with pytest.raises(error, match=match):
        greedy_tokens(logits)


def test_greedy_sampling_is_the_argmax():
    logits = torch.randn(3, 2 * 1024 + 9)
    assert torch.equal(sample_tokens(logits, 0.0, 1.0, None), logits.argmax(-1))


def test_top_k_sampling_draws_among_the_k_most_likely():
    """``top_k`` keeps the k most likely tokens of each row (1: the argmax), before ``top_p``
    narrows them further; every draw of many lies among them, and each of them is drawn."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    top3 = logits.topk(3, -1).indices
    assert torch.equal(sample_tokens(logits, 1.0, 1.0, gen, top_k=1), logits.argmax(-1))
    draws = torch.stack([sample_tokens(logits, 5.0, 1.0, gen, top_k=3) for _ in range(300)], 1)
    for row in range(4):
        assert set(draws[row].tolist()) == set(top3[row].tolist())
    # top_p on the top-k tokens' renormalised mass (transformers' order): two tokens of 0.3 each
    # beside 40 of 0.01 become 0.5 and 0.5, so top_p = 0.5 keeps one of them (of 0.3 and 0.3
    # unrenormalised it would keep both)
    two = torch.tensor([[0.3, 0.3] + [0.01] * 40]).log()
    draws = {int(sample_tokens(two, 1.0, 0.5, gen, top_k=2)) for _ in range(100)}
    assert len(draws) == 1 and draws <= {0, 1}


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_logits(temperature):
    """Draws follow softmax(logits / temperature): token 1 of logits (0, ln 3) has probability
    3^(1/t) / (1 + 3^(1/t)); the frequency over n draws lies within 5 standard deviations of it."""
    n = 4000
    logits = torch.tensor([[0.0, math.log(3.0)]]).repeat(n, 1)
    freq = sample_tokens(logits, temperature, 1.0, torch.Generator().manual_seed(0)).float().mean().item()
    p = 3 ** (1 / temperature) / (1 + 3 ** (1 / temperature))
    assert abs(freq - p) <= 5 * math.sqrt(p * (1 - p) / n)
