"""Bad input raises a clear error naming the argument, before anything is written."""

import pytest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode, StepInputs, layout
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.cache_checks import assert_unchanged, snapshot

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)
ops = torch.ops.dsv4


@pytest.fixture
def engine():
    eng, rec = make_engine(TINY, max_requests=2, max_seq_len=512, capture_layers=False)
    row = eng.admit()
    with torch.no_grad():
        rec.run(ForwardMode.EXTEND, {row: 40})
    return eng


def _good_decode(engine):
    row = engine.allocator.active_rows[0]
    loc = engine.allocator.extend(row, 1)
    seq = engine.allocator.seq_len(row)
    x = torch.randn(1, TINY.hidden_size, dtype=torch.bfloat16)
    return x, StepInputs.make(ForwardMode.DECODE, [row], [seq], [1], loc)


def _assert_rejected(engine, x, step, exc, match):
    """``engine.stack(x, step)`` raises ``exc`` matching ``match`` and writes nothing."""
    before = snapshot(engine.stack.cache)
    with pytest.raises(exc, match=match):
        engine.stack(x, step)
    assert_unchanged(before, engine.stack.cache, "a rejected step")


@pytest.mark.parametrize("corrupt, exc, match", [
    (lambda x, s: (x.float(), s), TypeError, "x must be a bfloat16"),
    (lambda x, s: (x[:, :-1], s), ValueError, "x has shape"),
    (lambda x, s: (x, StepInputs(s.mode, s.req_rows.float(), s.seq_lens, s.extend_lens, s.out_cache_loc)),
     TypeError, "step.req_rows"),
    (lambda x, s: (x, StepInputs(s.mode, s.req_rows + 5, s.seq_lens, s.extend_lens, s.out_cache_loc)),
     ValueError, "step.req_rows"),
    (lambda x, s: (x, StepInputs(s.mode, s.req_rows, s.seq_lens + 1000, s.extend_lens, s.out_cache_loc)),
     ValueError, "exceeds the cache's max_seq_len"),
    (lambda x, s: (x, StepInputs(s.mode, s.req_rows, s.seq_lens, s.extend_lens + 1, s.out_cache_loc)),
     ValueError, "extend_lens sum to 2"),
    (lambda x, s: (x, StepInputs(s.mode, s.req_rows, s.seq_lens, s.extend_lens - 2, s.out_cache_loc)),
     ValueError, "step.extend_lens"),
    (lambda x, s: (x, StepInputs(s.mode, s.req_rows, s.seq_lens, s.extend_lens, s.out_cache_loc + 10**9)),
     ValueError, "step.out_cache_loc"),
    (lambda x, s: (x, StepInputs(s.mode, s.req_rows, s.seq_lens, s.extend_lens, s.out_cache_loc + 1)),
     ValueError, "req_to_token maps"),
    (lambda x, s: (x, StepInputs(ForwardMode.IDLE, s.req_rows, s.seq_lens, s.extend_lens, s.out_cache_loc)),
     ValueError, "IDLE"),
    (lambda x, s: (x, StepInputs(ForwardMode.DRAFT_EXTEND, s.req_rows, s.seq_lens, s.extend_lens,
                                 s.out_cache_loc)), ValueError, "DRAFT_EXTEND"),
])
def test_bad_step_is_rejected_and_cache_untouched(engine, corrupt, exc, match):
    _assert_rejected(engine, *corrupt(*_good_decode(engine)), exc, match)


def _x(num_tokens, device="cpu"):
    return torch.randn(num_tokens, TINY.hidden_size, dtype=torch.bfloat16, device=device)


@pytest.mark.parametrize("slots", ["zero", "stale"])
def test_step_on_a_freed_row_is_rejected(engine, slots):
    """The freed row's pages go to the next request; a late step on the freed row, with its old
    slots or with the dummy slot 0, must not reach them."""
    a = engine.allocator.active_rows[0]
    loc = engine.allocator.extend(a, 1)
    b = engine.admit()
    engine.release(a)
    engine.allocator.extend(b, 41)
    assert engine.stack.cache.req_to_token[b, 40] == loc  # b now owns the slot a's step would write
    step = StepInputs.make(ForwardMode.DECODE, [a], [41], [1], loc if slots == "stale" else [0])
    _assert_rejected(engine, _x(1), step, ValueError, r"step\.out_cache_loc")


def test_step_on_a_never_admitted_row_is_rejected(engine):
    step = StepInputs.make(ForwardMode.EXTEND, [2], [3], [3], [0, 0, 0])
    _assert_rejected(engine, _x(3), step, ValueError, "position 0 of request row 2 is not allocated")


def test_step_at_an_unallocated_position_is_rejected(engine):
    """Position 40 of the request was never allocated (its length is 40): slot 0 there is refused."""
    row = engine.allocator.active_rows[0]
    step = StepInputs.make(ForwardMode.DECODE, [row], [41], [1], [0])
    _assert_rejected(engine, _x(1), step, ValueError, "position 40 of request row 1 is not allocated")


def test_verify_step_longer_than_max_draft_tokens_is_rejected(engine):
    row = engine.allocator.active_rows[0]
    n = TINY.max_draft_tokens + 1
    loc = engine.allocator.extend(row, n)
    step = StepInputs.make(ForwardMode.TARGET_VERIFY, [row], [40 + n], [n], loc)
    _assert_rejected(engine, _x(n), step, ValueError, r"step\.extend_lens.*max_draft_tokens=4")


def test_x_on_another_device_is_named(engine):
    x, step = _good_decode(engine)
    _assert_rejected(engine, x.to("meta"), step, ValueError, "x is on meta, the cache is on cpu")


def test_mode_must_be_a_forward_mode(engine):
    x, step = _good_decode(engine)
    bad = StepInputs("decode", *step.tensors())
    _assert_rejected(engine, x, bad, TypeError, r"step\.mode must be a ForwardMode")


def test_allocator_rejects_beyond_capacity_without_changes(engine):
    row = engine.allocator.active_rows[0]
    before = snapshot(engine.stack.cache)
    with pytest.raises(ValueError, match="exceeds the cache's max_seq_len"):
        engine.allocator.extend(row, 1000)
    assert engine.allocator.seq_len(row) == 40
    after = snapshot(engine.stack.cache)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _attn_args(t=2, h=4, k1=128, k2=64):
    swa = torch.zeros(3, layout.model1_page_bytes(256), dtype=torch.uint8)
    c4 = torch.zeros(3, layout.model1_page_bytes(64), dtype=torch.uint8)
    return dict(q=torch.randn(t, h, 512).bfloat16(), swa_cache=swa, swa_page_size=256,
                swa_indices=torch.zeros(t, k1, dtype=torch.int32), swa_lengths=torch.ones(t, dtype=torch.int32),
                extra_cache=c4, extra_page_size=64, extra_indices=torch.full((t, k2), -1, dtype=torch.int32),
                extra_lengths=torch.ones(t, dtype=torch.int32), attn_sink=torch.zeros(h),
                softmax_scale=512 ** -0.5)


@pytest.mark.parametrize("change, exc, match", [
    (dict(q=torch.randn(2, 4, 512)), TypeError, "q must have dtype"),
    (dict(q=torch.randn(2, 4, 256).bfloat16()), ValueError, "q has shape"),
    (dict(swa_indices=torch.zeros(2, 100, dtype=torch.int32)), ValueError, "multiple of 64"),
    (dict(swa_page_size=64), ValueError, "page_size=64 does not match swa_cache"),
    (dict(extra_lengths=torch.ones(3, dtype=torch.int32)), ValueError, "extra_lengths"),
    (dict(attn_sink=torch.zeros(5)), ValueError, "attn_sink"),
    (dict(extra_indices=None), ValueError, "must be given together"),
])
def test_sparse_attn_rejects_bad_arguments(change, exc, match):
    with pytest.raises(exc, match=match):
        ops.sparse_attn(**{**_attn_args(), **change})


def test_sparse_attn_flashmla_rejects_too_many_heads_at_trace_time():
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in _attn_args(h=192).items()}
    with pytest.raises(ValueError, match="192 heads; FlashMLA supports at most 128"):
        torch.ops.dsv4.sparse_attn_flashmla(**meta)


def test_store_kv_rejects_and_writes_nothing():
    cache = torch.zeros(2, layout.model1_page_bytes(256), dtype=torch.uint8)
    k = torch.randn(3, 512).bfloat16()
    with pytest.raises(ValueError, match="page_size=64 does not match cache"):
        ops.store_kv(cache, torch.tensor([1, 2, 3]), k, 64)
    with pytest.raises(ValueError, match="row counts differ"):
        ops.store_kv(cache, torch.tensor([1, 2]), k, 256)
    with pytest.raises(TypeError, match="k must have dtype"):
        ops.store_kv(cache, torch.tensor([1, 2, 3]), k.float(), 256)
    with pytest.raises(ValueError, match="k has shape"):
        ops.store_kv(cache, torch.tensor([1, 2, 3]), k[:, :448], 256)
    assert cache.count_nonzero() == 0
