"""Host-side page allocator: the bookkeeping a serving engine runs *between* steps.

It hands out request rows, full-pool pages and SWA-pool pages, and writes the index maps of
:class:`~dsv4_compile.cache.DSV4Cache` (``req_to_token``, ``req_to_page``, ``full_to_swa``). Nothing
here runs inside a compiled step. Allocation is page-aligned (docs/semantics.md §2.1): the token
at position ``pos`` gets full slot ``full_page * 256 + pos % 256`` and SWA slot
``swa_page * 256 + pos % 256``.

Rollback (speculative decoding) is a :meth:`PageAllocator.truncate` to at most
``config.max_draft_tokens`` positions below the longest length the request has reached: the
compressor state rings and the SWA pages are sized and kept for exactly that depth, so a deeper
rollback is refused rather than served from overwritten state.

SWA pages are evicted once every token on them has left the window of any future query, counting
the queries a rollback may bring back (``last position of the page < longest length - 127 -
max_draft_tokens``).

Positions a request does not own read as "no page" in the index maps: freed rows and truncated
positions are zeroed (slot 0 is the dummy target), so a stale step cannot reach another request's
pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import DSV4Cache
from .config import PAGE_SIZE, SWA_WINDOW


class OutOfPagesError(RuntimeError):
    """The cache has no free page (full or SWA pool) or request row left."""


@dataclass
class _Request:
    seq_len: int = 0
    high_water: int = 0  # longest length reached: ring rows below it minus max_draft are intact
    full_pages: list[int] = field(default_factory=list)  # logical page i -> full page
    swa_pages: dict[int, int] = field(default_factory=dict)  # logical page i -> SWA page


class PageAllocator:
    """Request rows and pages of one :class:`DSV4Cache`."""

    def __init__(self, cache: DSV4Cache):
        self.cache = cache
        self._free_rows = list(range(cache.max_requests, 0, -1))  # pop() gives the lowest row
        self._free_full = list(range(cache.num_full_pages - 1, 0, -1))
        self._free_swa = list(range(cache.num_swa_pages - 1, 0, -1))
        self._requests: dict[int, _Request] = {}
        self._max_rollback = cache.config.max_draft_tokens

    # -- queries -------------------------------------------------------------------------------
    def seq_len(self, row: int) -> int:
        return self._get(row).seq_len

    @property
    def active_rows(self) -> list[int]:
        return sorted(self._requests)

    @property
    def free_full_pages(self) -> int:
        return len(self._free_full)

    @property
    def free_swa_pages(self) -> int:
        return len(self._free_swa)

    # -- lifecycle -----------------------------------------------------------------------------
    def admit(self) -> int:
        """Reserve a request row (>= 1) for a new, empty request; its compressor state starts
        clean (nothing of the row's previous request, e.g. non-finite activations, carries over)."""
        if not self._free_rows:
            raise OutOfPagesError(f"all {self.cache.max_requests} request rows are in use")
        row = self._free_rows.pop()
        self.cache.clear_request_state(row)
        self._requests[row] = _Request()
        return row

    def extend(self, row: int, num_tokens: int) -> torch.Tensor:
        """Allocate the next ``num_tokens`` positions of request ``row``; returns their full slots
        (``out_cache_loc``, int64 [num_tokens], on the cache's device). Evicts SWA pages that left
        the window first. Raises before changing anything if capacity would be exceeded."""
        req = self._get(row)
        num_tokens = _count("num_tokens", num_tokens)
        new_len = req.seq_len + num_tokens
        if new_len > self.cache.max_seq_len:
            raise ValueError(f"request {row}: length {new_len} exceeds the cache's max_seq_len "
                             f"{self.cache.max_seq_len}")
        self.evict_swa(row)
        first, last = req.seq_len // PAGE_SIZE, -(-new_len // PAGE_SIZE)
        need_full = max(0, last - len(req.full_pages))
        need_swa = sum(1 for i in range(first, last) if i not in req.swa_pages)
        if need_full > len(self._free_full) or need_swa > len(self._free_swa):
            raise OutOfPagesError(f"request {row}: needs {need_full} full and {need_swa} SWA pages, "
                                  f"{len(self._free_full)} and {len(self._free_swa)} free")
        for i in range(first, last):
            if i >= len(req.full_pages):
                req.full_pages.append(self._free_full.pop())
            if i not in req.swa_pages:
                req.swa_pages[i] = self._free_swa.pop()
        pos = torch.arange(req.seq_len, new_len)
        page = pos // PAGE_SIZE
        full = torch.tensor(req.full_pages, dtype=torch.int64)[page] * PAGE_SIZE + pos % PAGE_SIZE
        swa_map = torch.zeros(last, dtype=torch.int64)
        for i, p in req.swa_pages.items():
            swa_map[i] = p
        swa = swa_map[page] * PAGE_SIZE + pos % PAGE_SIZE
        device = self.cache.device
        self.cache.req_to_token[row, req.seq_len:new_len] = full.to(device, torch.int32)
        self.cache.req_to_page[row, first:last] = torch.tensor(req.full_pages[first:last], dtype=torch.int32,
                                                               device=device)
        self.cache.full_to_swa[full.to(device)] = swa.to(device, torch.int32)
        req.seq_len = new_len
        req.high_water = max(req.high_water, new_len)
        return full.to(device)

    def truncate(self, row: int, new_len: int) -> None:
        """Roll request ``row`` back to ``new_len`` tokens (rejected draft tokens), zero the index
        map entries of the dropped positions and free the pages that now lie entirely past the end.

        ``new_len`` may go at most ``config.max_draft_tokens`` below the longest length the request
        has reached; a deeper rollback raises ``ValueError`` before anything changes, because the
        compressor rings no longer hold the state it would need.
        """
        req = self._get(row)
        new_len = _count("new_len", new_len)
        if new_len > req.seq_len:
            raise ValueError(f"request {row}: new_len={new_len} is past its length {req.seq_len}")
        if new_len < req.high_water - self._max_rollback:
            raise ValueError(f"request {row}: rolling back to {new_len} goes {req.high_water - new_len} "
                             f"tokens below its longest length {req.high_water}; at most "
                             f"max_draft_tokens={self._max_rollback} can be rolled back")
        keep = -(-new_len // PAGE_SIZE)
        dropped = self.cache.req_to_token[row, new_len:req.seq_len].long()
        self.cache.full_to_swa[dropped] = 0
        self.cache.req_to_token[row, new_len:req.seq_len] = 0
        self.cache.req_to_page[row, keep:len(req.full_pages)] = 0
        for i in range(keep, len(req.full_pages)):
            self._release_swa(req, i)
        self._free_full.extend(reversed(req.full_pages[keep:]))
        del req.full_pages[keep:]
        req.seq_len = new_len

    def evict_swa(self, row: int) -> int:
        """Free the SWA pages of ``row`` that no future query can attend to; returns how many."""
        req = self._get(row)
        oldest_query = req.high_water - self._max_rollback  # the deepest rollback's next query
        dead = [i for i in req.swa_pages if (i + 1) * PAGE_SIZE <= oldest_query - (SWA_WINDOW - 1)]
        for i in dead:
            self._release_swa(req, i)
        return len(dead)

    def free(self, row: int) -> None:
        """Release every page and the row of a finished request; its index map rows read as
        "no page" (zeros) afterwards."""
        req = self._get(row)
        for i in list(req.swa_pages):
            self._release_swa(req, i)
        self._free_full.extend(reversed(req.full_pages))
        self.cache.req_to_token[row] = 0
        self.cache.req_to_page[row] = 0
        del self._requests[row]
        self._free_rows.append(row)

    # -- internals -----------------------------------------------------------------------------
    def _get(self, row: int) -> _Request:
        try:
            return self._requests[_count("row", row)]
        except KeyError:
            raise ValueError(f"request row {row} is not active") from None

    def _release_swa(self, req: _Request, i: int) -> None:
        page = req.swa_pages.pop(i, None)
        if page is None:
            return
        full_page = req.full_pages[i]
        self.cache.full_to_swa[full_page * PAGE_SIZE:(full_page + 1) * PAGE_SIZE] = 0
        self._free_swa.append(page)


def _count(name: str, value) -> int:
    """``value`` as a non-negative Python int (a bool, float or tensor is refused by name)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value
