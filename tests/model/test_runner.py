"""ModelRunner: continuous batching of the tiny transformers model on the backend — score and
generate against each request run alone, against transformers eager, capacity refusals, and no
new Dynamo frame after warm-up.

Noise yardstick (the tiny model, 40 / 90 tokens, seeds 0 and 1): transformers bf16 vs fp32
per-token log-probs differ by mean 0.003-0.004 nats (max 0.027); the backend (FP8 cache) vs
transformers bf16 by mean 0.009-0.013 (max 0.051), the FP8 cache's share (docs/semantics.md §7).
Bounds: mean 0.025, max 0.1 nats.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from dsv4_compile.compile import compile_step
from dsv4_compile.model import enable
from dsv4_compile import runner as runner_module
from dsv4_compile.runner import ModelRunner
from tests.model.conftest import load_tiny_hf
from tests.support.compile_checks import fresh_compile_state

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VOCAB = 512


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def hf_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers eager ``log p(ids[t+1] | ids[:t+1])``, fp32 ``[L - 1]``."""
    logp = model(ids.unsqueeze(0)).logits[0, :-1].float().log_softmax(-1)
    return logp.gather(1, ids[1:, None])[:, 0]


def allocator_state(backend) -> tuple:
    """What a runner call must leave as it found it: rows, free pages and the index maps."""
    alloc, cache = backend.allocator, backend.cache
    return (alloc.active_rows, alloc.free_full_pages, alloc.free_swa_pages, cache.req_to_token.clone(),
            cache.req_to_page.clone(), cache.full_to_swa.clone())


def assert_same_state(before: tuple, after: tuple) -> None:
    assert before[:3] == after[:3]
    for a, b in zip(before[3:], after[3:]):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def backend(tiny_hf_dir):
    """Two request rows of 256 tokens: more requests than rows in every test below."""
    return enable(load_tiny_hf(tiny_hf_dir), max_requests=2, max_seq_len=256)


def test_score_packs_chunks_and_equals_each_sequence_alone_and_transformers(backend, tiny_hf):
    """Four sequences (one of a single token) through two rows in 16-token steps: chunked prefill,
    several sequences per step, later ones admitted as earlier ones leave. Each equals the same
    sequence scored alone in one step (measured: identical) and transformers eager within the
    FP8-cache noise (module docstring)."""
    seqs = [ids_of(n, seed) for n, seed in ((40, 1), (7, 2), (1, 3), (23, 4))]
    before = allocator_state(backend)
    packed = ModelRunner(backend, max_step_tokens=16).score(seqs)
    assert_same_state(before, allocator_state(backend))
    assert [t.shape for t in packed] == [(39,), (6,), (0,), (22,)]
    assert all(t.dtype == torch.float32 for t in packed)
    alone_runner = ModelRunner(backend, max_step_tokens=64)
    for ids, got in zip(seqs, packed):
        if ids.shape[0] == 1:
            continue
        torch.testing.assert_close(got, alone_runner.score([ids])[0], atol=1e-2, rtol=0)
        err = (got - hf_log_probs(tiny_hf, ids)).abs()
        assert err.mean() < 0.025 and err.max() < 0.1, (err.mean(), err.max())
        assert (got < 0).all()


def test_generate_greedy_batched_equals_each_prompt_alone_and_transformers_greedy(backend, tiny_hf):
    """Three prompts through two rows, 16-token steps (the 20-token prompt prefills in two chunks
    while another request decodes): each continuation equals the prompt generated alone; at each
    generated position, transformers eager's greedy choice given the same prefix (a full
    recompute) agrees with ours on most tokens (the tiny random model's logits are flat: median
    top-2 margin about 0.05, FP8 noise about 0.01)."""
    prompts = [ids_of(9, 5), ids_of(20, 6), ids_of(5, 7)]
    before = allocator_state(backend)
    runner = ModelRunner(backend, max_step_tokens=16)
    batched = runner.generate(prompts, 5)
    assert_same_state(before, allocator_state(backend))
    assert [len(out) for out in batched] == [5, 5, 5]
    agree = []
    for prompt, out in zip(prompts, batched):
        assert runner.generate([prompt], 5) == [out]
        full = torch.cat([prompt, torch.tensor(out)])
        hf_greedy = tiny_hf(full.unsqueeze(0)).logits[0, prompt.shape[0] - 1:-1].argmax(-1)
        agree += (hf_greedy == torch.tensor(out)).tolist()
    assert sum(agree) / len(agree) >= 0.7, agree


def test_generate_stop_ids_and_seeded_sampling(backend):
    """A stop id ends a continuation after it (included); a top_p smaller than the most likely
    token's probability keeps that token alone (greedy); a seed fixes the draws, and the two copies
    of one prompt in a batch draw differently."""
    runner = ModelRunner(backend, max_step_tokens=32)
    prompt = ids_of(12, 8)
    greedy = runner.generate([prompt], 4)[0]
    stop = greedy[2]
    assert runner.generate([prompt], 4, stop_ids=[stop])[0] == greedy[:greedy.index(stop) + 1]
    assert runner.generate([prompt], 4, temperature=0.7, top_p=1e-6, seed=0)[0] == greedy
    sampled = runner.generate([prompt, prompt], 4, temperature=1.5, seed=3)
    assert runner.generate([prompt, prompt], 4, temperature=1.5, seed=3) == sampled
    assert sampled[0] != sampled[1]
    assert runner.generate([prompt], 0) == [[]]


def test_generate_builds_the_next_step_before_it_draws_tokens_and_undoes_it_on_a_stop(backend, monkeypatch):
    """Each step is built before the tokens of the step before it are drawn (the host's building
    overlaps the device's step: drawing waits for the device), also when a waiting request is
    admitted in the rows of requests that end. A stop token that ends one of two requests early
    undoes the step built ahead of it. The continuations, and the allocator afterwards, equal those
    of a loop that builds no step ahead."""
    runner = ModelRunner(backend, max_step_tokens=32, build_ahead=True)  # by default on a GPU only
    prompts = [ids_of(6, 9), ids_of(11, 10)]
    greedy = runner.generate(prompts, 6)
    stop = greedy[1][1]
    assert stop not in greedy[0] and greedy[1][0] != stop  # the second draw ends the second request alone
    events = []
    drawn = runner_module.sample_tokens
    monkeypatch.setattr(runner_module, "sample_tokens", lambda *a: events.append("draw") or drawn(*a))
    built = runner.build_step
    monkeypatch.setattr(runner, "build_step", lambda *a, **k: events.append("build") or built(*a, **k))
    before = allocator_state(backend)
    assert runner.generate(prompts, 6) == greedy
    # the prefill step, then each decode step built before the previous step's draw
    assert events == ["build"] + ["build", "draw"] * 5 + ["draw"]
    events.clear()
    stopped = runner.generate(prompts, 6, stop_ids=[stop])
    assert_same_state(before, allocator_state(backend))
    # the second draw ends the second request: the step built before it is undone and planned again
    assert events == ["build"] + ["build", "draw"] * 2 + ["build"] + ["build", "draw"] * 3 + ["draw"]
    # a third prompt waits for a row: admitted in the step built while the first two draw their last tokens
    third = ids_of(4, 11)
    events.clear()
    three = runner.generate(prompts + [third], 6)
    assert events == ["build"] + ["build", "draw"] * 11 + ["draw"]
    assert_same_state(before, allocator_state(backend))
    runner.build_ahead = False
    events.clear()
    assert runner.generate(prompts, 6, stop_ids=[stop]) == stopped
    assert events == ["build", "draw"] * 6  # each step built after the last one's draw
    assert stopped == [greedy[0], greedy[1][:2]]
    assert runner.generate(prompts + [third], 6) == three == greedy + runner.generate([third], 6)
    assert_same_state(before, allocator_state(backend))


def test_logits_of_the_last_positions_only(backend, monkeypatch):
    """``logits(sequences, last)``: the last ``last[i]`` rows of each sequence's logits (measured:
    identical to slicing all of them), the steps asking for those rows only; ``last[i] == 0`` gives
    ``[0, vocab]``; a ``last`` that does not fit the sequences is refused by name before any step."""
    seqs, last = [ids_of(40, 1), ids_of(7, 2), ids_of(23, 4)], [3, 0, 23]
    runner = ModelRunner(backend, max_step_tokens=16, bucketed=False)
    every = runner.logits(seqs)
    asked = []

    def step_fn(ids, step, logit_rows):
        asked.append(logit_rows.shape[0])
        return backend(ids, step, logit_rows)

    runner.step_fn = step_fn
    before = allocator_state(backend)
    got = runner.logits(seqs, last=last)
    assert_same_state(before, allocator_state(backend))
    assert [t.shape for t in got] == [(3, VOCAB), (0, VOCAB), (23, VOCAB)]
    for all_rows, kept, n in zip(every, got, last):
        torch.testing.assert_close(kept, all_rows[all_rows.shape[0] - n:], atol=0, rtol=0)
    assert sum(asked) <= sum(last) + 2 * len(asked)  # (a step's logit rows are padded to 2)
    asked.clear()
    for bad, match in (([1, 2], r"last must be a sequence of 3 counts"), ([1, -1, 1], r"last\[1\]=-1 must be >= 0"),
                       ([1, 8, 1], r"last\[1\]=8 exceeds the sequence's 7 tokens"),
                       ([1, 1.0, 1], r"last\[1\] must be an int"), (torch.tensor([1, 1, 1]), r"last must be a")):
        with pytest.raises((TypeError, ValueError), match=match):
            runner.logits(seqs, last=bad)
    assert not asked
    assert_same_state(before, allocator_state(backend))


def test_requests_that_cannot_fit_are_refused_before_anything_is_written(tiny_hf_dir):
    """One usable full page: a 300-position request can never fit (ValueError naming it, state
    unchanged); two 130-position requests cannot run together, so the second waits for the
    first, and both equal their scores alone."""
    backend = enable(load_tiny_hf(tiny_hf_dir), max_requests=2, max_seq_len=512, num_full_pages=2)
    runner = ModelRunner(backend, max_step_tokens=256)
    before = allocator_state(backend)
    with pytest.raises(ValueError, match=r"sequences\[1\] needs a request row, 2 full and 2 SWA pages; "
                                         r"the cache has 2, 1 and 1 free"):
        runner.score([ids_of(10, 1), ids_of(301, 2)])
    with pytest.raises(ValueError, match=r"sequences\[0\] needs 513 positions in the cache, more than"):
        runner.score([ids_of(514, 3)])
    with pytest.raises(ValueError, match=r"prompts \(with max_new_tokens - 1 generated tokens\)\[0\] needs 514"):
        runner.generate([ids_of(500, 4)], 15)
    with pytest.raises(ValueError, match=r"sequences\[1\]: token ids must lie in \[0, 512\)"):
        runner.score([[1, 2], [3, 512]])
    with pytest.raises(ValueError, match=r"sequences\[0\] is empty"):
        runner.score([[]])
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a 1-D integer tensor"):
        runner.generate([torch.zeros(3)], 2)
    with pytest.raises(ValueError, match=r"seed=\d+ must be < 2\*\*63"):
        runner.generate([[1, 2]], 2, seed=2**70)
    assert_same_state(before, allocator_state(backend))
    seqs = [ids_of(131, 5), ids_of(131, 6)]
    waited = runner.score(seqs)
    assert_same_state(before, allocator_state(backend))
    for ids, got in zip(seqs, waited):
        torch.testing.assert_close(got, runner.score([ids])[0], atol=1e-2, rtol=0)


def test_warmup_of_a_one_request_cache_leaves_no_row_held(tiny_hf_dir):
    """A cache of one request row: ``warmup()`` skips the class of several requests and leaves the
    row free, and the runner then scores (before, the row admitted for that class stayed held)."""
    backend = enable(load_tiny_hf(tiny_hf_dir), max_requests=1, max_seq_len=256)
    runner = ModelRunner(backend, max_step_tokens=16)
    runner.warmup()
    assert not backend.allocator.active_rows
    assert len(runner.score([ids_of(5, 1)])[0]) == 4


def test_after_warmup_a_stream_of_requests_compiles_no_new_frame(backend):
    """``compile_step`` (Dynamo, fullgraph, default config; the eager backend to keep the test
    short): ``warmup()`` compiles every frame; then requests of varying lengths, prefill chunks,
    decodes, one- and several-request steps, scoring and generation, compile nothing new and
    compute what the eager runner computes."""
    with fresh_compile_state():
        runner = ModelRunner(backend, step_fn=compile_step(backend, backend="eager"), max_step_tokens=16)
        runner.warmup()
        frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
        assert 1 <= graphs <= 3 and not counters["graph_break"]
        out = runner.generate([ids_of(n, n) for n in (5, 20, 1, 33)], 4)
        seqs = [ids_of(n, n) for n in (40, 2, 17)]
        scores = runner.score(seqs)
        assert counters["frames"]["total"] == frames and counters["stats"]["unique_graphs"] == graphs
        assert not counters["recompiles"] and not counters["graph_break"]
    assert [len(o) for o in out] == [4] * 4
    eager = ModelRunner(backend, max_step_tokens=16).score(seqs)
    for got, want in zip(scores, eager):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_warmup_skips_the_classes_whose_pages_are_not_free(tiny_hf_dir):
    """Two request rows but one usable full page: the cache serves one request at a time, so
    ``warmup()`` runs the one-request classes and skips the two-request one (before, it raised
    ``OutOfPagesError``), leaving no row held."""
    backend = enable(load_tiny_hf(tiny_hf_dir), max_requests=2, max_seq_len=512, num_full_pages=2)
    runner = ModelRunner(backend, max_step_tokens=16)
    runner.warmup()
    assert not backend.allocator.active_rows and backend.allocator.free_full_pages == 1


@pytest.mark.parametrize("stop", [5, "eos"])
def test_a_stop_that_is_not_callable_is_refused_before_any_step(backend, stop):
    steps = []
    runner = ModelRunner(backend, step_fn=lambda *args: steps.append(args), max_step_tokens=16)
    before = allocator_state(backend)
    with pytest.raises(TypeError, match="stop must be a callable"):
        runner.generate([ids_of(4, 1)], 3, stop=stop)
    assert not steps
    assert_same_state(before, allocator_state(backend))
