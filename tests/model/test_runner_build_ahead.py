"""ModelRunner's steps built ahead, fuzzed (hypothesis, derandomized): for any prompts, queue,
step size, stop ids and sampling, ``generate`` gives the tokens of the loop that builds each step
after the last one's draw, every step finds the index maps holding its own slots, and the
allocator ends as it began.

The step function is a stand-in for the model: each logit row's token is a function of the row's
token and its position in its request, read back from the step, so a step built at a wrong
position (one not undone, or undone twice) changes the tokens."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_compile.model import enable
from dsv4_compile.runner import ModelRunner
from tests.model.conftest import load_tiny_hf
from tests.model.test_runner import allocator_state, assert_same_state

VOCAB = 512
ROWS = 3


@pytest.fixture(scope="module")
def backend(tiny_hf_dir):
    return enable(load_tiny_hf(tiny_hf_dir), max_requests=ROWS, max_seq_len=256)


def positional_step(cache):
    """A step function whose logits pick token ``(31 id + 7 position) % VOCAB`` for each logit row,
    after checking that ``req_to_token`` maps every real row's position to the row's slot."""
    def step(ids, step, logit_rows):
        rows, seq_lens, ext, loc = (t.tolist() for t in (step.req_rows, step.seq_lens, step.extend_lens,
                                                         step.out_cache_loc))
        positions = []
        for row, length, n in zip(rows, seq_lens, ext):
            positions += [(row, p) for p in range(length - n, length)]
        for (row, p), slot in zip(positions, loc):
            assert cache.req_to_token[row, p].item() == slot, (row, p, slot)
        picks = [(31 * ids[r].item() + 7 * positions[r][1]) % VOCAB if r < len(positions) else 0
                 for r in logit_rows.tolist()]
        logits = torch.zeros(len(picks), VOCAB)
        logits[torch.arange(len(picks)), torch.tensor(picks)] = 10.0
        return logits
    return step


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), min_size=1, max_size=5),
       max_new_tokens=st.integers(1, 8), max_step_tokens=st.sampled_from([3, 16, 64]),
       stop_picks=st.lists(st.integers(0, 10**6), max_size=3), temperature=st.sampled_from([0.0, 1.0]))
def test_built_ahead_equals_built_after_the_draw(backend, prompts, max_new_tokens, max_step_tokens, stop_picks,
                                                 temperature):
    """The stop ids are tokens the prompts generate without them, so that requests end early."""
    before = allocator_state(backend)

    def generate(ahead, stops=()):
        runner = ModelRunner(backend, step_fn=positional_step(backend.cache), max_step_tokens=max_step_tokens,
                             build_ahead=ahead)
        tokens = runner.generate(prompts, max_new_tokens, stop_ids=stops, temperature=temperature, seed=0)
        assert_same_state(before, allocator_state(backend))
        return tokens

    unstopped = [t for out in generate(False) for t in out]
    stops = {unstopped[i % len(unstopped)] for i in stop_picks}
    assert generate(True, stops) == generate(False, stops)
