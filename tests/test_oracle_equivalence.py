"""The paged incremental path equals the cache-free dense oracle (docs/semantics.md §4.7) in every
forward mode: outputs of every step and the cache contents (SWA keys, compressed entries, indexer
keys). Every step is judged per layer on the inputs that layer saw; end to end only while no
indexer selects among more than top-k entries (``tests/support/oracle_asserts.py``): long runs
are judged per layer and by their cache contents.

The tiny preset keeps real per-head dims; most cases use top-k 64 so that "visible c4 entries
above top-k" starts at 256 tokens instead of 2048 (one case runs the real top-k 512).
"""

import pytest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.cache_checks import assert_idle_step_is_inert
from tests.support.oracle_asserts import assert_cache_matches, assert_outputs_match

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)
DECODE, VERIFY, EXTEND = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def test_prefill_chunked_prefill_then_decode_across_boundaries():
    """A: single-shot prefill to 380, B: chunked prefill 200 + 50 (chunk crosses nothing) + 125
    (crosses 256). Decoding 10 steps takes A across 384 (c128 entry, c4 windows) and B across
    the 128-window of page 1 and more c4 windows; top-k 64 is exceeded (95 visible)."""
    eng, rec = make_engine(TINY, max_requests=3, max_seq_len=1024)
    a, b = eng.admit(), eng.admit()
    assert_outputs_match(rec, rec.run(EXTEND, {a: 380, b: 200}))
    assert_outputs_match(rec, rec.run(EXTEND, {b: 50}))
    assert_outputs_match(rec, rec.run(EXTEND, {b: 125}))
    for _ in range(10):
        assert_outputs_match(rec, rec.run(DECODE, {a: 1, b: 1}))
    assert eng.allocator.seq_len(a) == 390 and eng.allocator.seq_len(b) == 385
    assert_cache_matches(rec, [a, b])


def test_decode_from_one_token():
    """Every position from 0: lengths crossing 4 (first c4 window, then overlap), 8, 128."""
    eng, rec = make_engine(TINY.with_(compress_ratios=(4, 128)), max_requests=1, max_seq_len=256)
    a = eng.admit()
    for step in range(132):
        out = rec.run(DECODE if step else EXTEND, {a: 1})
        if step < 10 or step % 20 == 0 or step >= 125:
            assert_outputs_match(rec, out)
    assert_cache_matches(rec, [a])


def test_uniform_and_ragged_verify_with_rejections():
    eng, rec = make_engine(TINY, max_requests=3, max_seq_len=1024)
    a, b = eng.admit(), eng.admit()
    rec.run(EXTEND, {a: 253, b: 126})
    for accepted_a, accepted_b in [(1, 3), (0, 2), (3, 3), (2, 1)]:  # uniform D = 3
        assert_outputs_match(rec, rec.run(VERIFY, {a: 3, b: 3}))
        eng.accept(a, accepted_a, 3)
        eng.accept(b, accepted_b, 3)
    for lens, accepted in [((2, 4), (2, 1)), ((4, 1), (0, 1))]:  # ragged verify lengths
        assert_outputs_match(rec, rec.run(VERIFY, {a: lens[0], b: lens[1]}))
        eng.accept(a, accepted[0], lens[0])
        eng.accept(b, accepted[1], lens[1])
    for _ in range(4):  # rejected drafts left no trace that decode can see
        assert_outputs_match(rec, rec.run(DECODE, {a: 1, b: 1}))
    assert_cache_matches(rec, [a, b])


def test_draft_extend_on_swa_only_draft_stack():
    eng, rec = make_engine(TINY.with_(compress_ratios=(0,)), max_requests=2, max_seq_len=512)
    a, b = eng.admit(), eng.admit()
    rec.run(EXTEND, {a: 140, b: 60})
    for _ in range(3):
        assert_outputs_match(rec, rec.run(ForwardMode.DRAFT_EXTEND, {a: 2, b: 2}))
    assert_outputs_match(rec, rec.run(DECODE, {a: 1, b: 1}))
    assert_cache_matches(rec, [a, b])


def test_idle_steps_between_real_steps_change_nothing():
    """Idle steps of 0, 1 and 4 rows output zeros and write only the dummy targets; the request's
    next steps still match the oracle."""
    eng, rec = make_engine(TINY, max_requests=2, max_seq_len=512)
    a = eng.admit()
    rec.run(EXTEND, {a: 130})
    for num_rows in (0, 1, 4):
        assert_idle_step_is_inert(eng, num_rows)
        assert_outputs_match(rec, rec.run(DECODE, {a: 1}))
    assert_cache_matches(rec, [a])


def test_bucket_padding_rows_and_requests():
    """Decode padded to 4 requests, verify padded to 16 rows: padding never disturbs real rows."""
    eng, rec = make_engine(TINY, max_requests=3, max_seq_len=512)
    a, b = eng.admit(), eng.admit()
    rec.run(EXTEND, {a: 127, b: 255}, pad_tokens=400)
    for _ in range(3):
        assert_outputs_match(rec, rec.run(DECODE, {a: 1, b: 1}, pad_requests=4, pad_tokens=4))
    assert_outputs_match(rec, rec.run(VERIFY, {a: 2, b: 3}, pad_requests=4, pad_tokens=16))
    eng.accept(a, 2, 2)
    eng.accept(b, 1, 3)
    assert_outputs_match(rec, rec.run(DECODE, {a: 1, b: 1}, pad_requests=4, pad_tokens=4))
    assert_cache_matches(rec, [a, b])


def test_many_requests_with_fragmented_and_reused_pages():
    """Interleaved chunks fragment the page pools; a finished request's pages (and row) are
    reused by a new one whose compressor rings and pages hold stale data."""
    eng, rec = make_engine(TINY, max_requests=4, max_seq_len=768)
    rows = [eng.admit() for _ in range(3)]
    for chunk in (70, 190, 20):
        rec.run(EXTEND, {r: chunk + 13 * i for i, r in enumerate(rows)})
    eng.release(rows[1])
    new = eng.admit()
    assert new == rows[1]  # the freed row comes back with its stale state ring
    assert_outputs_match(rec, rec.run(EXTEND, {new: 300, rows[0]: 1, rows[2]: 1}))
    for _ in range(3):
        assert_outputs_match(rec, rec.run(DECODE, {r: 1 for r in (rows[0], new, rows[2])}))
    pages = [set(eng.allocator._requests[r].full_pages) for r in (rows[0], new, rows[2])]
    assert all(max(p) - min(p) >= len(p) for p in pages)  # pages really are non-contiguous
    assert_cache_matches(rec, [rows[0], new, rows[2]])


def test_real_topk_512_below_and_above():
    """Index top-k 512: rows of a 2100-token prefill see from 0 to 525 c4 entries."""
    eng, rec = make_engine(TINY.with_(index_topk=512, compress_ratios=(4,)), max_requests=1, max_seq_len=2304)
    a = eng.admit()
    assert_outputs_match(rec, rec.run(EXTEND, {a: 2100}))
    assert_outputs_match(rec, rec.run(DECODE, {a: 1}))
    assert_cache_matches(rec, [a])


def _long_and_short_request():
    """One c4 layer, top-k 64: request ``a`` holds 262 tokens (65 visible c4 entries: the indexer
    selects), ``b`` 100 (all 25 visible entries attended)."""
    eng, rec = make_engine(TINY.with_(compress_ratios=(4,)), max_requests=2, max_seq_len=512)
    a, b = eng.admit(), eng.admit()
    rec.run(EXTEND, {a: 261, b: 99})
    return eng, rec, a, b


def test_end_to_end_is_judged_only_where_the_indexer_does_not_select():
    """A long request (the indexer selects top-k of its entries) is judged per layer and by its
    cache, not end to end: one ulp of upstream drift may flip a selection there."""
    eng, rec, a, b = _long_and_short_request()
    out = rec.run(DECODE, {a: 1, b: 1})
    assert rec.indexer_selects(a) and not rec.indexer_selects(b)
    judged = []
    rec.output_error = lambda outputs: judged.append(set(outputs)) or 1.0  # every end-to-end view fails
    assert_outputs_match(rec, {a: out[a]})  # per layer only
    assert judged == []
    with pytest.raises(AssertionError, match="stack outputs differ"):
        assert_outputs_match(rec, out)
    assert judged == [{b}]
    assert_cache_matches(rec, [a, b])


def test_one_wrong_cached_entry_is_caught_on_its_own():
    """One c4 entry 74 % off among 65: its own error says so, the total RMS is diluted."""
    eng, rec, a, _ = _long_and_short_request()
    extra_kv = eng.stack.cache.layers[0].extra_kv
    slot = eng.stack.cache.req_to_token[a, 4 * 40:4 * 40 + 1].long() // 4  # entry 40
    torch.ops.dsv4.store_kv(extra_kv, slot, 0.26 * torch.ops.dsv4.dequant_kv(extra_kv, slot, 64), 64)
    errors = rec.cache_errors(a)
    assert errors["c4_entry"] > 0.7 and errors["c4_rms"] < errors["c4_entry"] / 5
    with pytest.raises(AssertionError, match="cached c4"):
        assert_cache_matches(rec, [a])
