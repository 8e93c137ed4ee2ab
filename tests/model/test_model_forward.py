"""The model's own forward with the backend enabled: ``model(input_ids, attention_mask, labels)``
on a padded batch, as evaluation harnesses call it; a ``transformers`` cache passed and
``close()`` give the original forward."""

import pytest
import torch
from transformers import DynamicCache

from dsv4_compile.model import enable
from tests.model.conftest import load_tiny_hf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

VOCAB = 512


def ids_of(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def padded(rows: list[torch.Tensor], width: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[B, width]``, pad id 0."""
    ids, mask = torch.zeros(len(rows), width, dtype=torch.int64), torch.zeros(len(rows), width, dtype=torch.int64)
    for b, row in enumerate(rows):
        span = slice(width - row.shape[0], width) if left else slice(0, row.shape[0])
        ids[b, span], mask[b, span] = row, 1
    return ids, mask


@pytest.fixture(scope="module")
def backend(tiny_hf_dir):
    return enable(load_tiny_hf(tiny_hf_dir), max_requests=2, max_seq_len=256)


def test_padded_batch_scores_each_row_over_its_real_tokens(backend, tiny_hf):
    """Three rows (more than the cache's two request rows), left and right padded: each row's
    logits equal the row alone (measured: identical), are zeros on pads, and the loss is the
    model's own loss function of those logits. transformers eager gives the same numbers with right
    padding (within the FP8-cache noise: logits differ by a mean of about 0.01), not with left
    padding: there its positions and compressor windows include the pads."""
    rows = [ids_of(12, 1), ids_of(7, 2), ids_of(3, 3)]
    alone = backend.runner.logits(rows)
    out = {}
    for left in (False, True):
        ids, mask = padded(rows, 12, left)
        labels = ids.masked_fill(mask == 0, -100)
        out[left] = backend.model(ids, attention_mask=mask, labels=labels)
        logits = out[left].logits
        assert logits.shape == (3, 12, VOCAB) and logits.dtype == torch.bfloat16
        for b, row in enumerate(rows):
            real = slice(12 - row.shape[0], 12) if left else slice(0, row.shape[0])
            torch.testing.assert_close(logits[b, real], alone[b], atol=0, rtol=0)
            assert not logits[b].float().abs().sum(-1).eq(0)[real].any()
            assert logits[b].float().abs().sum(-1).ne(0).sum() == row.shape[0]
        want = backend.model.loss_function(logits, labels, VOCAB)
        torch.testing.assert_close(out[left].loss, want)
    assert not backend.allocator.active_rows

    ids, mask = padded(rows, 12, left=False)
    hf_right = tiny_hf(ids, attention_mask=mask).logits.float()
    ids, mask = padded(rows, 12, left=True)
    hf_left = tiny_hf(ids, attention_mask=mask).logits.float()
    for b, row in enumerate(rows):
        unpadded = tiny_hf(row.unsqueeze(0)).logits[0].float()
        n = row.shape[0]
        ours = alone[b].float()
        assert (ours - hf_right[b, :n]).abs().mean() < 0.02
        assert (unpadded - hf_right[b, :n]).abs().max() < 0.02  # right padding: the row alone (measured: 0)
        if n < 12:
            # left padding: not the row alone (measured: 0.18)
            assert (unpadded - hf_left[b, 12 - n:]).abs().mean() > 0.1


@pytest.mark.parametrize("keep", [1, 5, 12, 20, -4, 0])
def test_logits_to_keep_computes_the_kept_columns_only(backend, keep, monkeypatch):
    """``logits_to_keep`` as ``transformers`` slices it (an int keeps ``[-keep:]``; 0 all): the kept
    columns equal those of the whole forward (measured: identical), and the runner is asked for the
    kept real positions only."""
    rows = [ids_of(12, 1), ids_of(7, 2), ids_of(3, 3)]
    ids, mask = padded(rows, 12, left=False)
    whole = backend.model(ids, attention_mask=mask).logits
    asked = []
    logits = backend.runner.logits
    monkeypatch.setattr(backend.runner, "logits", lambda seqs, last: asked.append(sum(last)) or logits(seqs, last))
    columns = slice(-keep, None)
    torch.testing.assert_close(backend.model(ids, attention_mask=mask, logits_to_keep=keep).logits,
                               whole[:, columns], atol=0, rtol=0)
    assert asked == [int(mask[:, columns].sum())]


def test_logits_to_keep_as_a_tensor_selects_columns(backend):
    rows = [ids_of(12, 1), ids_of(7, 2)]
    ids, mask = padded(rows, 12, left=True)
    whole = backend.model(ids, attention_mask=mask).logits
    picked = torch.tensor([0, 6, 11])
    torch.testing.assert_close(backend.model(ids, attention_mask=mask, logits_to_keep=picked).logits,
                               whole[:, picked], atol=0, rtol=0)


def test_a_cache_or_close_gives_the_original_forward(tiny_hf_dir, tiny_hf):
    """A ``transformers`` cache passed to ``generate()`` (here a DynamicCache) runs the original
    forward (the same tokens as the model without the backend); after ``close()`` the forward is
    the class's again."""
    backend = enable(load_tiny_hf(tiny_hf_dir), max_requests=1, max_seq_len=256)
    model, prompt = backend.model, ids_of(10, 4).unsqueeze(0)
    want = tiny_hf.generate(prompt, max_new_tokens=3, do_sample=False)
    got = model.generate(prompt, max_new_tokens=3, do_sample=False, past_key_values=DynamicCache(config=model.config))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.equal(model(prompt).logits, tiny_hf(prompt).logits)  # the backend's numbers
    assert model(prompt, return_dict=False)[0].shape == (1, 10, VOCAB)
    backend.close()
    assert "forward" not in model.__dict__
    torch.testing.assert_close(model(prompt).logits, tiny_hf(prompt).logits, atol=0, rtol=0)


def test_position_ids_numbering_the_real_tokens_from_0_stay_on_the_backend(backend, tiny_hf):
    """``position_ids`` as ``transformers`` derives them from a left-padded mask (``[B, S]``) or an
    ``arange`` of one row shared by the batch (``[1, S]``) give the backend's logits, equal to the call
    without them; positions with an offset (as a packed or continued sequence has) run the original
    forward: equal to ``transformers`` eager to the bit."""
    rows = [ids_of(9, 6), ids_of(5, 7)]
    ids, mask = padded(rows, 9, left=True)
    want = backend.model(ids, attention_mask=mask).logits
    from_mask = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    torch.testing.assert_close(backend.model(ids, attention_mask=mask, position_ids=from_mask).logits, want,
                               atol=0, rtol=0)
    full = torch.stack(rows[:1] * 2)
    torch.testing.assert_close(backend.model(full, position_ids=torch.arange(9)[None]).logits,
                               backend.model(full).logits, atol=0, rtol=0)
    assert not torch.equal(want[0], tiny_hf(rows[0][None]).logits[0])  # the backend's numbers, not transformers'
    shifted = torch.arange(3, 12)[None]
    torch.testing.assert_close(backend.model(rows[0][None], position_ids=shifted).logits,
                               tiny_hf(rows[0][None], position_ids=shifted).logits, atol=0, rtol=0)
    assert not backend.allocator.active_rows


def test_generate_without_a_cache_rescores_on_the_backend(backend, monkeypatch):
    """``generate(use_cache=False)`` calls the forward with the whole sequence each step and
    ``position_ids`` derived from the mask: every step is scored by the backend's runner, which
    computes the last position's logits only (generate's ``logits_to_keep=1``), and the tokens
    equal those of ``generate()`` over the paged cache, left padding included."""
    ids, mask = padded([ids_of(9, 8), ids_of(6, 9)], 9, left=True)
    cached = backend.model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    scored = []
    logits = backend.runner.logits
    monkeypatch.setattr(backend.runner, "logits",
                        lambda seqs, last: scored.append((len(seqs), sum(last))) or logits(seqs, last))
    uncached = backend.model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=False)
    torch.testing.assert_close(uncached, cached, atol=0, rtol=0)
    assert scored == [(2, 2)] * 4
    assert not backend.allocator.active_rows


def test_an_attention_mask_with_holes_is_refused(backend):
    ids = ids_of(6, 5).unsqueeze(0)
    with pytest.raises(ValueError, match="attention_mask row 0: the real tokens must be one contiguous run"):
        backend.model(ids, attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1]]))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 5\), input_ids \(1, 6\)"):
        backend.model(ids, attention_mask=torch.ones(1, 5))
    assert not backend.allocator.active_rows


def test_use_cache_returns_a_paged_cache_a_decode_loop_continues(backend):
    """``model(ids, use_cache=True)`` returns the batch's rows in a ``DSV4PagedCache``: a
    hand-written greedy loop that feeds it back one token at a time gives ``generate()``'s tokens,
    and the rows go back when the cache is dropped."""
    from dsv4_compile.hf_cache import DSV4PagedCache

    model, prompt = backend.model, ids_of(10, 10).unsqueeze(0)
    want = model.generate(prompt, max_new_tokens=4, do_sample=False)[0, 10:].tolist()
    out = model(prompt, use_cache=True, labels=prompt)
    assert isinstance(out.past_key_values, DSV4PagedCache) and len(backend.allocator.active_rows) == 1
    torch.testing.assert_close(out.loss, model(prompt, labels=prompt).loss, atol=0, rtol=0)
    got = []
    for _ in range(4):
        got.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[got[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    assert got == want
    del out
    assert not backend.allocator.active_rows


def test_use_cache_keeps_each_steps_logits_when_the_step_reuses_its_output(backend):
    """A prompt longer than a step (``max_step_tokens`` 16) fed with ``use_cache=True``, through a
    step that returns one buffer per shape and overwrites it on the next call (a CUDA-graph step's
    contract): every position's logits are those of the step that computed them."""
    from dsv4_compile.runner import ModelRunner

    buffers = {}

    def graph_like_step(ids, step, rows):
        out = backend(ids, step, rows)
        return buffers.setdefault(tuple(out.shape), torch.empty_like(out)).copy_(out)

    model, prompt, default = backend.model, ids_of(40, 11).unsqueeze(0), backend.runner
    try:
        backend.runner = ModelRunner(backend, max_step_tokens=16)
        want = model(prompt, use_cache=True).logits
        backend.runner = ModelRunner(backend, step_fn=graph_like_step, max_step_tokens=16)
        got = model(prompt, use_cache=True).logits
    finally:
        backend.runner = default
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("flag", ["output_router_logits", "output_hidden_states"])
def test_outputs_asked_for_by_the_config_run_the_original_forward(backend, flag):
    """An output the backend does not make, asked for by the model's config rather than by keyword,
    runs the original forward (its router logits or hidden states, its loss with the router's
    auxiliary term), as the keyword does."""
    model, ids = backend.model, ids_of(8, 11).unsqueeze(0)
    original = type(model).forward.__get__(model)
    setattr(model.config, flag, True)
    try:
        got = model(ids, labels=ids)
        want = original(ids, labels=ids)
    finally:
        setattr(model.config, flag, False)
    key = "router_logits" if flag == "output_router_logits" else "hidden_states"
    assert got[key] is not None
    torch.testing.assert_close(got.loss, want.loss, atol=0, rtol=0)
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)


def test_training_mode_runs_the_original_differentiable_forward(backend):
    """In training mode the forward is the original one: its loss has a graph to backpropagate
    through (the backend's is inference-only), equal to the class forward's."""
    model, ids = backend.model, ids_of(8, 12).unsqueeze(0)
    model.train().requires_grad_(True)
    try:
        with torch.enable_grad():  # tests/model/conftest.py runs every test under no_grad
            loss = model(ids, labels=ids).loss
            want = type(model).forward(model, ids, labels=ids).loss
            model.eval()
            assert not model(ids, labels=ids).loss.requires_grad
    finally:
        model.eval().requires_grad_(False)
    assert loss.requires_grad
    torch.testing.assert_close(loss, want, atol=0, rtol=0)
