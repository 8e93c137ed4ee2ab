"""Host-side page allocator: page-aligned slots, index maps, SWA eviction, truncate, free, and
all-or-nothing steps (the engine's, and nested transactions)."""

import pytest
import torch

from dsv4_compile import DSV4AttentionStack, DSV4AttnConfig, DSV4Cache, ForwardMode, OutOfPagesError, PageAllocator
from dsv4_compile.engine import Engine
from dsv4_compile.reference.metadata import page_map
from tests.support.cache_checks import allocator_state, assert_unchanged, snapshot

CFG = DSV4AttnConfig.from_name("tiny").with_(compress_ratios=(0,))


def _alloc(**kw):
    cache = DSV4Cache(CFG, max_requests=kw.pop("max_requests", 3), max_seq_len=kw.pop("max_seq_len", 1024), **kw)
    return cache, PageAllocator(cache)


def test_slots_are_page_aligned_and_maps_written():
    cache, alloc = _alloc()
    a = alloc.admit()
    assert a == 1  # row 0 is the dummy
    loc = alloc.extend(a, 300)
    pos = torch.arange(300)
    assert torch.equal(loc % 256, pos % 256)
    assert torch.equal(cache.req_to_token[a, :300].long(), loc)
    swa = cache.full_to_swa[loc]
    assert torch.equal(swa.long() % 256, pos % 256) and torch.all(swa > 0)
    assert loc.min() >= 256  # never page 0
    assert torch.equal(cache.req_to_page[a, :2], page_map(cache.req_to_token)[a, :2])  # compact page map


def test_extending_several_requests_at_once_writes_what_one_by_one_writes():
    """extend_requests (one transfer of every map entry) against extend per request, on two
    allocators taken through the same history (prefills, decodes crossing a page, an eviction of
    a dead SWA page, a truncation): the same slots and the same maps."""
    (one_cache, one), (all_cache, at_once) = _alloc(), _alloc()
    rows = [one.admit() for _ in range(3)]
    assert [at_once.admit() for _ in range(3)] == rows
    for tokens in ({rows[0]: 300, rows[1]: 1, rows[2]: 255}, {r: 1 for r in rows}, {rows[2]: 0, rows[0]: 250},
                   {rows[1]: 40, rows[2]: 2}):
        want = torch.cat([one.extend(row, n) for row, n in tokens.items()])
        assert at_once.extend_requests(tokens) == want.tolist()
        for a, b in zip(one_cache.buffers(), all_cache.buffers()):
            assert torch.equal(a, b)
        if rows[1] in tokens:  # a rejected draft token
            one.truncate(rows[1], one.seq_len(rows[1]) - 1)
            at_once.truncate(rows[1], at_once.seq_len(rows[1]) - 1)
    assert one.free_swa_pages == at_once.free_swa_pages and allocator_state(one) == allocator_state(at_once)


def test_swa_pages_are_evicted_once_out_of_the_window():
    cache, alloc = _alloc()
    a = alloc.admit()
    depth = CFG.max_draft_tokens
    first = alloc.extend(a, 256)  # page 0 of the request, full
    alloc.extend(a, 127 + depth)  # this step's queries (256..382 + depth) still read page 0
    assert torch.all(cache.full_to_swa[first] > 0)
    # the next query, even after the deepest rollback (pos 383), sees positions 256.. only
    assert alloc.evict_swa(a) == 1
    assert torch.all(cache.full_to_swa[first] == 0)
    assert alloc.free_swa_pages == cache.num_swa_pages - 1 - 1


def test_truncate_and_free_return_pages():
    cache, alloc = _alloc()
    a = alloc.admit()
    free_full = alloc.free_full_pages
    alloc.extend(a, 254)
    alloc.extend(a, 4)  # drafts cross into a second page
    assert alloc.free_full_pages == free_full - 2
    alloc.truncate(a, 255)  # all drafts but one rejected: the second page is released
    assert alloc.seq_len(a) == 255 and alloc.free_full_pages == free_full - 1
    alloc.free(a)
    assert alloc.free_full_pages == free_full and alloc.free_swa_pages == cache.num_swa_pages - 1
    assert alloc.admit() == a


def test_out_of_pages_and_rows():
    cache, alloc = _alloc(max_requests=1, num_full_pages=3, num_swa_pages=3)
    a = alloc.admit()
    with pytest.raises(OutOfPagesError):
        alloc.admit()
    alloc.extend(a, 512)
    before = cache.req_to_token.clone()
    with pytest.raises(ValueError, match="max_seq_len"):
        alloc.extend(a, 600)
    assert torch.equal(cache.req_to_token, before) and alloc.seq_len(a) == 512
    cache2, alloc2 = _alloc(max_requests=2, num_full_pages=3)
    b, c = alloc2.admit(), alloc2.admit()
    alloc2.extend(b, 512)
    before2 = cache2.req_to_token.clone()
    with pytest.raises(OutOfPagesError, match="needs 1 full"):
        alloc2.extend(c, 1)
    assert torch.equal(cache2.req_to_token, before2) and alloc2.seq_len(c) == 0


def test_unknown_row_is_rejected():
    _, alloc = _alloc()
    with pytest.raises(ValueError, match="not active"):
        alloc.extend(2, 1)


def test_freed_rows_and_truncated_positions_read_as_no_page():
    cache, alloc = _alloc()
    a = alloc.admit()
    loc = alloc.extend(a, 258)
    alloc.truncate(a, 255)
    assert torch.all(cache.req_to_token[a, 255:] == 0) and torch.all(cache.req_to_page[a, 1:] == 0)
    assert torch.all(cache.full_to_swa[loc[255:]] == 0)  # dropped slots have no SWA storage
    assert torch.equal(cache.req_to_token[a, :255].long(), loc[:255])
    alloc.free(a)
    assert torch.all(cache.req_to_token[a] == 0) and torch.all(cache.req_to_page[a] == 0)


def test_rollback_is_bounded_by_max_draft_tokens():
    cache, alloc = _alloc()
    a = alloc.admit()
    depth = CFG.max_draft_tokens
    alloc.extend(a, 300)
    alloc.truncate(a, 300 - depth + 1)
    alloc.extend(a, 1)  # the longest length reached is still 300
    before = (cache.req_to_token.clone(), alloc.seq_len(a), alloc.free_full_pages)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        alloc.truncate(a, 300 - depth - 1)
    assert torch.equal(cache.req_to_token, before[0])
    assert (alloc.seq_len(a), alloc.free_full_pages) == before[1:]
    alloc.truncate(a, 300 - depth)  # exactly max_draft_tokens below is allowed


def test_swa_pages_outlive_the_window_by_the_rollback_depth():
    cache, alloc = _alloc()
    a = alloc.admit()
    depth = CFG.max_draft_tokens
    first = alloc.extend(a, 256)
    alloc.extend(a, 126 + depth)  # rolling back depth tokens brings back the query at 382
    assert alloc.evict_swa(a) == 0 and torch.all(cache.full_to_swa[first] > 0)
    alloc.truncate(a, 382)  # the query at 382 reads positions 255 .. 382: page 0 is needed
    alloc.extend(a, 1)
    assert alloc.evict_swa(a) == 0  # a rollback to 382 is still allowed
    alloc.extend(a, depth)  # longest length 383 + depth: no query below 383 can come back
    assert alloc.evict_swa(a) == 1 and torch.all(cache.full_to_swa[first] == 0)


def test_admission_clears_the_rows_compressor_state():
    cfg = DSV4AttnConfig.from_name("tiny")
    cache = DSV4Cache(cfg, max_requests=2, max_seq_len=512)
    alloc = PageAllocator(cache)
    a = alloc.admit()
    for layer in cache.layers[1:]:
        layer.kv_state.fill_(float("nan"))
    alloc.free(a)
    b = alloc.admit()
    assert b == a
    for layer in cache.layers[1:]:
        rows = layer.kv_state[b * layer.ring:(b + 1) * layer.ring]
        assert torch.all(rows == 0)
        assert torch.isnan(layer.kv_state[(b + 1) * layer.ring:]).all()  # other rows untouched


@pytest.mark.parametrize("bad", [torch.tensor(3), 2.0, True])
def test_counts_must_be_ints(bad):
    cache, alloc = _alloc()
    a = alloc.admit()
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        alloc.extend(a, bad)
    assert alloc.seq_len(a) == 0 and torch.all(cache.req_to_token == 0)


def _engine_with_evictable_page(num_full_pages=6, num_swa_pages=5):
    """An engine whose request ``a`` holds 400 tokens: its first SWA page left every future window
    but is only evicted by its next extend. Returns ``(engine, a, b)`` with ``b`` admitted, empty."""
    cache = DSV4Cache(CFG, max_requests=3, max_seq_len=1024, num_full_pages=num_full_pages,
                      num_swa_pages=num_swa_pages)
    engine = Engine(DSV4AttentionStack(CFG, cache).reset_parameters(0))
    a, b = engine.admit(), engine.admit()
    engine.allocator.extend(a, 400)
    return engine, a, b


def test_failed_step_leaves_allocator_and_maps_unchanged():
    """Request a's extend succeeds (evicting its dead SWA page, taking a page), then b's does not
    fit: a is rolled back too, byte for byte."""
    engine, a, b = _engine_with_evictable_page()
    before, state = snapshot(engine.stack.cache), allocator_state(engine.allocator)
    with pytest.raises(OutOfPagesError, match=f"request {b}"):
        engine.build_step(ForwardMode.EXTEND, {a: 200, b: 700})
    assert_unchanged(before, engine.stack.cache, "a failed build_step")
    assert allocator_state(engine.allocator) == state
    engine.build_step(ForwardMode.EXTEND, {a: 200, b: 200})  # what fits still fits


@pytest.mark.parametrize("bad", ["count", "row", "mode"])
def test_step_with_a_bad_later_request_extends_nothing(bad):
    engine, a, b = _engine_with_evictable_page()
    tokens = {a: 3, b: 2.0} if bad == "count" else {a: 3, 7: 2} if bad == "row" else {a: 3, b: 2}
    mode = "extend" if bad == "mode" else ForwardMode.EXTEND
    before, state = snapshot(engine.stack.cache), allocator_state(engine.allocator)
    with pytest.raises((TypeError, ValueError)):
        engine.build_step(mode, tokens)
    assert_unchanged(before, engine.stack.cache, "a failed build_step")
    assert allocator_state(engine.allocator) == state


def test_run_whose_forward_fails_extends_nothing():
    engine, a, b = _engine_with_evictable_page()
    before, state = snapshot(engine.stack.cache), allocator_state(engine.allocator)

    def failing_forward(x, step):
        raise RuntimeError("forward failed")
    engine.forward = failing_forward
    x = torch.zeros(2, CFG.hidden_size, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.run(ForwardMode.EXTEND, {a: x[:1], b: x})
    assert_unchanged(before, engine.stack.cache, "a failed run")
    assert allocator_state(engine.allocator) == state


def test_extend_that_does_not_fit_evicts_nothing():
    """The dead SWA page counts as free for the capacity check, but a refused extend keeps it."""
    engine, a, b = _engine_with_evictable_page(num_full_pages=5, num_swa_pages=4)
    alloc, cache = engine.allocator, engine.stack.cache
    alloc.extend(b, 256)  # one full page left, no SWA page but a's dead one
    before, state = snapshot(cache), allocator_state(alloc)
    with pytest.raises(OutOfPagesError):
        alloc.extend(a, 400)  # two more full pages
    assert_unchanged(before, cache, "a refused extend")
    assert allocator_state(alloc) == state
    alloc.extend(a, 200)  # one full and one SWA page: the dead one, evicted first
    assert alloc.free_swa_pages == 0 and alloc.free_full_pages == 0 and alloc.seq_len(a) == 600


def test_transactions_nest():
    cache, alloc = _alloc()
    a = alloc.admit()
    alloc.extend(a, 10)
    outer_before = snapshot(cache)
    with pytest.raises(RuntimeError, match="outer"):
        with alloc.transaction():
            alloc.extend(a, 5)
            inner_before, inner_state = snapshot(cache), allocator_state(alloc)
            with pytest.raises(RuntimeError, match="inner"):
                with alloc.transaction():
                    alloc.extend(a, 300)
                    raise RuntimeError("inner")
            assert_unchanged(inner_before, cache, "a rolled-back inner transaction")
            assert allocator_state(alloc) == inner_state and alloc.seq_len(a) == 15
            with alloc.transaction():
                alloc.extend(a, 1)  # kept by the inner block, undone by the outer one
            raise RuntimeError("outer")
    assert_unchanged(outer_before, cache, "a rolled-back outer transaction")
    assert alloc.seq_len(a) == 10


def _every_change(alloc: PageAllocator, a: int, b: int) -> None:
    """Each kind of change a transaction can undo: a row admitted and one freed, pages taken and
    given back, SWA pages evicted, positions truncated."""
    c = alloc.admit()
    alloc.extend(c, 300)
    alloc.extend(a, 200)  # evicts a's dead SWA page first
    alloc.truncate(a, alloc.seq_len(a) - 2)
    alloc.free(b)
    alloc.extend(c, 5)
    alloc.evict_swa(c)


@pytest.mark.parametrize("nested", [False, True])
def test_every_change_is_undone(nested):
    """Whatever a failed transaction did (directly, or in an inner transaction that succeeded),
    requests, free rows and pages in their hand-out order and the index maps are as they were."""
    engine, a, b = _engine_with_evictable_page(num_full_pages=12, num_swa_pages=10)
    alloc, cache = engine.allocator, engine.stack.cache
    alloc.extend(b, 30)
    before, state = snapshot(cache), allocator_state(alloc)
    with pytest.raises(RuntimeError, match="undo"):
        with alloc.transaction():
            if nested:
                with alloc.transaction():
                    _every_change(alloc, a, b)
            else:
                _every_change(alloc, a, b)
            assert allocator_state(alloc) != state
            raise RuntimeError("undo")
    assert_unchanged(before, cache, "a rolled-back transaction")
    assert allocator_state(alloc) == state
    _every_change(alloc, a, b)  # the same changes still apply
