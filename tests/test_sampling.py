"""``greedy_tokens``: the chunked argmax equals ``argmax(-1)`` on rows with ties, infinities and
NaNs, for vocabularies shorter than, equal to and past a chunk."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_compile.sampling import GREEDY_CHUNK, greedy_tokens, sample_tokens

SPECIAL = [float("inf"), float("-inf"), float("nan")]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.sampled_from([1, 7, GREEDY_CHUNK, GREEDY_CHUNK + 1, 3 * GREEDY_CHUNK - 5]),
       levels=st.integers(1, 4), specials=st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(SPECIAL)),
                                                   max_size=3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2 ** 16))
def test_equals_argmax(rows, vocab, levels, specials, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).to(dtype)  # few values: many ties
    for where, value in specials:
        logits.view(-1)[where % logits.numel()] = value
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))


def test_greedy_sampling_is_the_chunked_argmax():
    logits = torch.randn(3, 2 * GREEDY_CHUNK + 9)
    assert torch.equal(sample_tokens(logits, 0.0, 1.0, None), logits.argmax(-1))
