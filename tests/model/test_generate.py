"""``model.generate()`` with the backend enabled: the backend's paged cache (``DSV4PagedCache``)
instead of ``transformers``' dynamic cache — left-padded batches give the runner's tokens, EOS
through ``generate``'s own ``eos_token_id``, assisted generation (rollback = truncate) gives plain
greedy's tokens, rows are released when ``generate`` returns, beam search is refused."""

import contextlib

import pytest
import torch

from dsv4_compile.hf_cache import DSV4PagedCache
from dsv4_compile.model import enable
from dsv4_compile.runner import ModelRunner
from tests.model.conftest import load_tiny_hf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VOCAB, PAD = 512, 0
# smallest lead of a greedy token over the runner-up (logits) that no platform's bf16 rounding
# overturns: 4 bf16 steps at the tiny model's logit magnitudes (~1)
TIE_MARGIN = 1 / 32


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, longest]``, pads (id 0) on the left."""
    width = max(r.shape[0] for r in rows)
    ids, mask = torch.full((len(rows), width), PAD), torch.zeros(len(rows), width, dtype=torch.int64)
    for b, row in enumerate(rows):
        ids[b, width - row.shape[0]:], mask[b, width - row.shape[0]:] = row, 1
    return ids, mask


def greedy(model, ids, mask, max_new_tokens, **kwargs) -> torch.Tensor:
    """The new columns of ``model.generate`` (greedy)."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=PAD, **kwargs)
    return out[:, ids.shape[1]:]


@contextlib.contextmanager
def recorded_rollbacks(allocator):
    """While entered, the depth of every rollback (``allocator.truncate``) is appended to the list
    it yields."""
    rollbacks, truncate = [], allocator.truncate

    def recording_truncate(row, new_len):
        rollbacks.append(allocator.seq_len(row) - new_len)
        truncate(row, new_len)

    allocator.truncate = recording_truncate
    try:
        yield rollbacks
    finally:
        del allocator.truncate


@pytest.fixture(scope="module")
def backend(tiny_hf_dir):
    return enable(load_tiny_hf(tiny_hf_dir), max_requests=3, max_seq_len=256)


def test_left_padded_batch_gives_the_runner_tokens(backend, tiny_hf):
    """Three prompts of 9, 5 and 20 tokens, left padded: ``generate`` gives exactly the runner's
    greedy tokens, also when the prompt is prefilled in chunks (``max_step_tokens=8``); the rows
    are released when it returns. Against ``transformers`` eager on each prompt alone (flat logits
    of the tiny random model: the FP8 cache's noise flips near ties and the continuation follows):
    measured 44 of 48 positions equal (92%; 99 of 128, 77%, over 8 more prompts)."""
    rows = [ids_of(9, 1), ids_of(5, 2), ids_of(20, 3)]
    ids, mask = left_padded(rows)
    want = backend.runner.generate(rows, 16)
    got = greedy(backend.model, ids, mask, 16)
    assert got.tolist() == want
    assert not backend.allocator.active_rows
    default = backend.runner
    backend.runner = ModelRunner(backend, max_step_tokens=8)
    try:
        assert greedy(backend.model, ids, mask, 16).tolist() == want
    finally:
        backend.runner = default
    assert not backend.allocator.active_rows
    eager = torch.tensor([tiny_hf.generate(r[None], max_new_tokens=16, do_sample=False)[0, r.shape[0]:].tolist()
                          for r in rows])
    assert (eager == got).float().mean() >= 0.75


def test_eos_stops_each_row_and_pads_it(backend):
    """``eos_token_id`` (several ids): each row ends after its first EOS (the runner's
    ``stop_ids``), ``generate`` pads it until every row has finished, then stops."""
    rows = [ids_of(9, 1), ids_of(5, 2), ids_of(20, 3)]
    ids, mask = left_padded(rows)
    plain = backend.runner.generate(rows, 16)
    eos = [plain[0][1], plain[1][3], plain[2][2]]  # every row stops within 4 tokens
    want = backend.runner.generate(rows, 16, stop_ids=eos)
    got = greedy(backend.model, ids, mask, 16, eos_token_id=eos)
    assert got.shape[1] == max(len(w) for w in want) <= 4
    for row, w in zip(got.tolist(), want):
        assert row == w + [PAD] * (got.shape[1] - len(w))
    assert not backend.allocator.active_rows


def perturbed_draft(tiny_hf_dir, scale: float):
    """The model with noise of ``scale`` times the weights' std added to its output head, on a
    backend of its own: a draft that agrees with the model on some tokens only."""
    draft = load_tiny_hf(tiny_hf_dir)
    w = draft.lm_head.weight
    w += (torch.randn(w.shape, generator=torch.Generator().manual_seed(5)) * w.float().std() * scale).to(w.dtype)
    return enable(draft, max_requests=1, max_seq_len=256)


def test_assisted_generation_gives_plain_greedy_tokens(backend, tiny_hf_dir):
    """``transformers`` refuses assisted generation for this model; on the backend the target
    verifies the draft tokens in one step and rolls the rejected ones back (a truncate). The model
    as its own draft (every draft accepted) and a perturbed copy (rejections rolled back: 16
    rollbacks of 1 to 4 tokens over 24 new tokens on one CPU) give plain greedy's tokens; no row
    stays held. A verify step computes several rows in one GEMM, a plain step one row, and the two
    round differently in bf16 on some CPUs (by about one bf16 step of a logit), so the prompt is
    one whose 24 greedy tokens each lead the runner-up by at least 4 such steps: a near tie would
    let either path's rounding pick the other token without anything being wrong."""
    model = backend.model
    assert load_tiny_hf(tiny_hf_dir)._is_stateful and not model._is_stateful
    draft = perturbed_draft(tiny_hf_dir, 0.5)
    for m in (model, draft.model):
        m.generation_config.assistant_confidence_threshold = 0.0  # always draft max_draft_tokens tokens
    prompt = ids_of(10, 49)[None]
    plain = greedy(model, prompt, None, 24)
    scores = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=PAD, output_scores=True,
                            return_dict_in_generate=True).scores
    assert min(float(top[0] - top[1]) for top in (s[0].float().topk(2).values for s in scores)) >= TIE_MARGIN
    with recorded_rollbacks(backend.allocator) as rollbacks:
        assert torch.equal(greedy(model, prompt, None, 24, assistant_model=model), plain)
        assert not any(rollbacks)
        assert torch.equal(greedy(model, prompt, None, 24, assistant_model=draft.model), plain)
    assert len(rollbacks) >= 2 and max(rollbacks) == backend.config.max_draft_tokens
    assert not backend.allocator.active_rows and not draft.allocator.active_rows


def test_drafts_longer_than_max_draft_tokens_are_capped(backend, tiny_hf_dir):
    """Draft generators configured for more than ``max_draft_tokens`` tokens a step (prompt lookup
    of 10 tokens; a draft model of 20 on the heuristic schedule, which grows the draft after each
    fully accepted one) draft at most ``max_draft_tokens``: their rejections roll back within it,
    and the tokens are plain greedy's (before, a deeper rollback raised mid-generation)."""
    model, max_draft = backend.model, backend.config.max_draft_tokens
    draft = perturbed_draft(tiny_hf_dir, 0.5)
    draft.model.generation_config.num_assistant_tokens = 20
    draft.model.generation_config.num_assistant_tokens_schedule = "heuristic"
    draft.model.generation_config.assistant_confidence_threshold = 0.0
    prompt = ids_of(10, 49)[None]
    repeating = torch.cat([prompt, prompt], 1)  # prompt lookup finds n-grams to draft from
    with recorded_rollbacks(backend.allocator) as rollbacks:
        assert torch.equal(greedy(model, repeating, None, 12, prompt_lookup_num_tokens=10),
                           greedy(model, repeating, None, 12))
        looked_up = len(rollbacks)
        assert torch.equal(greedy(model, prompt, None, 24, assistant_model=draft.model),
                           greedy(model, prompt, None, 24))
    assert looked_up and len(rollbacks) > looked_up and max(rollbacks) <= max_draft
    assert not backend.allocator.active_rows and not draft.allocator.active_rows


def test_prompt_lookup_up_to_the_cache_capacity_gives_plain_greedy(backend):
    """Prompt lookup on a prompt of a repeated 4-gram, generating up to the last position the cache
    holds (prompt + max_new_tokens - 1 = max_seq_len): its drafts are cut at generate's length, so
    the verify steps stay within the cache and the tokens are plain greedy's (before, a draft ran
    past ``max_length - 1`` and the step was refused mid-generation; this prompt's tokens draft
    to the end)."""
    prompt = torch.randint(2, VOCAB, (4,), generator=torch.Generator().manual_seed(0)).repeat(60)[None]
    new_tokens = backend.cache.max_seq_len - prompt.shape[1] + 1
    with recorded_rollbacks(backend.allocator) as rollbacks:
        looked_up = greedy(backend.model, prompt, None, new_tokens, prompt_lookup_num_tokens=4)
    assert rollbacks and torch.equal(looked_up, greedy(backend.model, prompt, None, new_tokens))
    assert not backend.allocator.active_rows


def test_capped_candidates_stop_one_short_of_max_length():
    """A draft generator whose candidates run past ``max_length - 1`` (as prompt lookup's do) is cut
    there, its draft logits with it, and its draft length is capped at ``max_draft``."""
    from dsv4_compile.hf_generate import capped

    class Drafting:
        num_output_tokens = 10

        def get_candidates(self, input_ids):
            draft = torch.arange(6)[None]
            return torch.cat([input_ids, draft], 1), torch.randn(1, 6, VOCAB)

    generator = capped(Drafting(), 4, max_length=8)
    ids, logits = generator.get_candidates(torch.zeros(1, 5, dtype=torch.int64))
    assert ids.tolist() == [[0] * 5 + [0, 1]] and logits.shape == (1, 2, VOCAB)
    assert generator.num_output_tokens == 4
    ids, logits = generator.get_candidates(torch.zeros(1, 7, dtype=torch.int64))
    assert ids.shape == (1, 7) and logits.shape == (1, 0, VOCAB)


@pytest.mark.parametrize("cache", ["cache_implementation", "past_key_values"])
def test_assisted_generation_on_transformers_own_cache_is_refused(backend, cache):
    """Assisted generation on ``transformers``' own cache would run the original forward, whose
    compressor state cannot roll back: refused as ``transformers`` refuses it without the backend,
    before any token is generated."""
    from transformers import DynamicCache

    kwargs = {"cache_implementation": "dynamic"} if cache == "cache_implementation" else \
        {"past_key_values": DynamicCache(config=backend.model.config)}
    with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
        greedy(backend.model, ids_of(8, 51).repeat(2)[None], None, 4, prompt_lookup_num_tokens=4, **kwargs)
    assert not backend.allocator.active_rows


def test_rollback_deeper_than_max_draft_tokens_is_refused(backend):
    """``crop`` past ``max_draft_tokens`` raises, naming the limit, and changes nothing; ``reset``
    and dropping the cache release its rows."""
    cache = DSV4PagedCache(backend)
    backend.model(ids_of(12, 5)[None], past_key_values=cache)
    row = cache.rows[0]
    with pytest.raises(ValueError, match="at most max_draft_tokens=4 can be rolled back"):
        cache.crop(-5)
    assert cache.get_seq_length() == 12 and backend.allocator.seq_len(row) == 12
    cache.crop(-4)
    assert cache.get_seq_length() == 8 and backend.allocator.seq_len(row) == 8
    cache.reset()
    assert not backend.allocator.active_rows
    cache = DSV4PagedCache(backend)
    backend.model(ids_of(3, 6)[None], past_key_values=cache)
    assert backend.allocator.active_rows
    del cache
    assert not backend.allocator.active_rows


def test_returned_cache_keeps_its_rows_until_dropped(backend):
    out = backend.model.generate(ids_of(6, 7)[None], max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, DSV4PagedCache) and out.past_key_values.get_seq_length() == 8
    assert len(backend.allocator.active_rows) == 1
    del out
    assert not backend.allocator.active_rows


def test_beam_search_and_oversized_requests_are_refused(backend):
    prompt = ids_of(10, 8)[None]
    with pytest.raises(ValueError, match="beam search is not supported on the dsv4_compile backend"):
        backend.model.generate(prompt, max_new_tokens=3, num_beams=2)
    with pytest.raises(ValueError, match="generate needs 309 positions per row.*max_seq_len=256"):
        backend.model.generate(prompt, max_new_tokens=300)
    ids, mask = left_padded([ids_of(4, s) for s in range(4)])
    with pytest.raises(ValueError, match="generate needs 4 request rows"):
        backend.model.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert not backend.allocator.active_rows


def test_close_gives_transformers_generate_back(tiny_hf_dir, tiny_hf):
    """After ``close()`` the model's ``generate`` is the class's again (``transformers``' cache,
    the same tokens as the model never enabled) and assisted generation is refused again."""
    backend = enable(load_tiny_hf(tiny_hf_dir), max_requests=1, max_seq_len=256)
    model, prompt = backend.model, ids_of(10, 4)[None]
    backend.close()
    assert not {"generate", "_prepare_cache_for_generation", "_get_candidate_generator",
                "_is_stateful"} & model.__dict__.keys()
    want = tiny_hf.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=3, do_sample=False), want)
    with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
        model.generate(prompt, max_new_tokens=3, do_sample=False, assistant_model=model)


@pytest.mark.parametrize("bad", [torch.tensor([[VOCAB]]), torch.tensor([[-1]]), torch.tensor([[3.0]])])
def test_a_refused_step_over_the_cache_extends_no_row(backend, bad):
    """A step over a ``DSV4PagedCache`` with bad ``input_ids`` (an id outside the vocabulary, a
    float tensor) is refused naming ``input_ids`` and changes nothing: the rows keep their lengths
    (before, the refused step's positions stayed allocated, unwritten, and every later logit was
    computed over them), and the next good token gives the logits of the sequence scored whole."""
    model, prompt, good = backend.model, ids_of(6, 21), ids_of(1, 22)
    cache = model(prompt[None], use_cache=True).past_key_values
    try:
        row, free = cache.rows[0], backend.allocator.free_full_pages
        with pytest.raises((TypeError, ValueError), match="input_ids"):
            model(bad, past_key_values=cache, use_cache=True)
        assert backend.allocator.seq_len(row) == cache.get_seq_length() == 6
        assert backend.allocator.free_full_pages == free
        got = model(good[None], past_key_values=cache, use_cache=True).logits[0, -1]
        want = ModelRunner(backend, max_step_tokens=16).logits([torch.cat([prompt, good])])[0][-1]
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=0)
    finally:
        cache.reset()


def test_a_prompt_past_max_seq_len_over_a_new_cache_is_refused_before_any_step(backend):
    """``model(ids, use_cache=True)`` with more tokens than ``max_seq_len``: refused naming
    ``input_ids`` before a step runs (before, every chunk that fitted ran first, then the allocator
    refused ``num_tokens``), no row held."""
    steps, runner = [], backend.runner
    backend.runner = ModelRunner(backend, step_fn=lambda *args: steps.append(args), max_step_tokens=128)
    try:
        with pytest.raises(ValueError, match="input_ids row 0 brings 260 tokens to the 0 in the cache"):
            backend.model(ids_of(260, 1)[None], use_cache=True)
    finally:
        backend.runner = runner
    assert not steps and not backend.allocator.active_rows
