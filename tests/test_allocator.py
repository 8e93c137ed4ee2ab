"""Host-side page allocator: page-aligned slots, index maps, SWA eviction, truncate, free."""

import pytest
import torch

from dsv4_compile import DSV4AttnConfig, DSV4Cache, OutOfPagesError, PageAllocator
from dsv4_compile.reference.metadata import page_map

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


def test_swa_pages_are_evicted_once_out_of_the_window():
    cache, alloc = _alloc()
    a = alloc.admit()
    first = alloc.extend(a, 256)  # page 0 of the request, full
    alloc.extend(a, 127)  # length 383; this step's queries (256..382) still read page 0
    assert torch.all(cache.full_to_swa[first] > 0)
    assert alloc.evict_swa(a) == 1  # the next query (pos 383) sees positions 256.. only
    assert torch.all(cache.full_to_swa[first] == 0)
    assert alloc.free_swa_pages == cache.num_swa_pages - 1 - 1


def test_truncate_and_free_return_pages():
    cache, alloc = _alloc()
    a = alloc.admit()
    free_full = alloc.free_full_pages
    alloc.extend(a, 250)
    alloc.extend(a, 10)  # drafts cross into a second page
    assert alloc.free_full_pages == free_full - 2
    alloc.truncate(a, 252)  # all drafts but two rejected: the second page is released
    assert alloc.seq_len(a) == 252 and alloc.free_full_pages == free_full - 1
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
    cache2, alloc2 = _alloc(max_requests=2, num_full_pages=3)
    b, c = alloc2.admit(), alloc2.admit()
    alloc2.extend(b, 512)
    with pytest.raises(OutOfPagesError, match="needs 1 full"):
        alloc2.extend(c, 1)
    assert torch.equal(cache.req_to_token, before)


def test_unknown_row_is_rejected():
    _, alloc = _alloc()
    with pytest.raises(ValueError, match="not active"):
        alloc.extend(2, 1)
