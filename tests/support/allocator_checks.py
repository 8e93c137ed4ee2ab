"""The index maps a :class:`PageAllocator` writes, recomputed from its bookkeeping: every request's
positions map to its pages, everything else reads as "no page" (0), no page is owned twice, and
the SWA storage a rollback may need is still there."""

from __future__ import annotations

import torch

from dsv4_compile import PageAllocator
from dsv4_compile.config import PAGE_SIZE, SWA_WINDOW


def expected_index_maps(allocator: PageAllocator) -> dict[str, torch.Tensor]:
    """``req_to_token``, ``req_to_page`` and ``full_to_swa`` as the allocator's requests imply."""
    cache = allocator.cache
    maps = {name: torch.zeros_like(getattr(cache, name), device="cpu")
            for name in ("req_to_token", "req_to_page", "full_to_swa")}
    for row, req in allocator._requests.items():
        pos = torch.arange(req.seq_len)
        full = torch.tensor(req.full_pages, dtype=torch.long)[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        maps["req_to_token"][row, :req.seq_len] = full.int()
        maps["req_to_page"][row, :len(req.full_pages)] = torch.tensor(req.full_pages, dtype=torch.int32)
        for i, swa_page in req.swa_pages.items():
            on_page = pos[(pos // PAGE_SIZE) == i]
            maps["full_to_swa"][full[on_page]] = (swa_page * PAGE_SIZE + on_page % PAGE_SIZE).int()
    return maps


def assert_allocator_consistent(allocator: PageAllocator, lengths: dict[int, int]) -> None:
    """The allocator holds exactly the requests ``lengths`` (row -> length); its pages are disjoint
    and account for the whole pool; the index maps equal :func:`expected_index_maps`; each
    request keeps SWA storage for every position the deepest rollback's window reads."""
    cache, requests = allocator.cache, allocator._requests
    assert {row: r.seq_len for row, r in requests.items()} == lengths
    full = [p for r in requests.values() for p in r.full_pages]
    swa = [p for r in requests.values() for p in r.swa_pages.values()]
    for name, owned, free, total in (("full", full, allocator._free_full, cache.num_full_pages),
                                     ("SWA", swa, allocator._free_swa, cache.num_swa_pages)):
        assert 0 not in owned and sorted(owned + free) == list(range(1, total)), f"{name} pages leak or are shared"
    for name, want in expected_index_maps(allocator).items():
        got = getattr(cache, name).cpu()
        assert torch.equal(got, want), f"{name} differs from the allocator's pages at " \
                                       f"{(got != want).nonzero()[:4].tolist()}"
    for row, r in requests.items():
        oldest_read = r.high_water - cache.config.max_draft_tokens - (SWA_WINDOW - 1)
        needed = range(max(0, oldest_read) // PAGE_SIZE, -(-r.seq_len // PAGE_SIZE))
        assert all(i in r.swa_pages for i in needed), f"request {row} lost SWA pages a rollback needs"
