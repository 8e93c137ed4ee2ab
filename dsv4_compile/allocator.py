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

:meth:`PageAllocator.transaction` groups changes all-or-nothing: a step whose later request does
not fit leaves the allocator and the index maps exactly as they were.

A step's allocations (:meth:`PageAllocator.extend_requests`) compute their index-map entries on
the host and send all of them to the device in one asynchronous copy, each vector in the dtype it
is used in: on a GPU each small tensor built from a Python list is a transfer the host waits for,
and one per map and request made the host the bottleneck of a decode loop (benchmarks/README.md,
"The runner's host time").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from .cache import DSV4Cache
from .config import PAGE_SIZE, SWA_WINDOW
from .counts import check_count
from .transfer import to_device


class OutOfPagesError(RuntimeError):
    """The cache has no free page (full or SWA pool) or request row left."""


@dataclass
class _Request:
    seq_len: int = 0
    high_water: int = 0  # longest length reached: ring rows below it minus max_draft are intact
    full_pages: list[int] = field(default_factory=list)  # logical page i -> full page
    swa_pages: dict[int, int] = field(default_factory=dict)  # logical page i -> SWA page

    def copy(self) -> "_Request":
        return _Request(self.seq_len, self.high_water, self.full_pages[:], dict(self.swa_pages))


class PageAllocator:
    """Request rows and pages of one :class:`DSV4Cache`."""

    def __init__(self, cache: DSV4Cache):
        self.cache = cache
        self._free_rows = list(range(cache.max_requests, 0, -1))  # pop() gives the lowest row
        self._free_full = list(range(cache.num_full_pages - 1, 0, -1))
        self._free_swa = list(range(cache.num_swa_pages - 1, 0, -1))
        self._requests: dict[int, _Request] = {}
        self._max_rollback = cache.config.max_draft_tokens
        self._undo: _Undo | None = None  # the innermost open transaction's (see transaction)

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
        row = self._take(self._free_rows)
        self.cache.clear_request_state(row)
        self._changing(row)
        self._requests[row] = _Request()
        return row

    def extend(self, row: int, num_tokens: int) -> torch.Tensor:
        """Allocate the next ``num_tokens`` positions of request ``row``; returns their full slots
        (``out_cache_loc``, int64 [num_tokens], on the cache's device). Evicts SWA pages that left
        the window first. Raises before changing anything if capacity would be exceeded."""
        slots = self.extend_requests({row: num_tokens})
        return torch.tensor(slots, dtype=torch.int64, device=self.cache.device)

    def extend_requests(self, tokens: Mapping[int, int]) -> list[int]:
        """:meth:`extend` of each request ``row`` by ``tokens[row]`` positions, in order, all or
        nothing; returns the full slots of all of them, concatenated, as ints. The index-map
        entries of every request go to the device in one transfer (a step's worth of small writes
        would otherwise each be a transfer that waits for the device)."""
        if not isinstance(tokens, Mapping):
            raise TypeError(f"tokens must be a mapping of request row to token count, got {type(tokens).__name__}")
        writes = _MapWrites(self.cache)
        with self.transaction():
            slots = [slot for row, n in tokens.items() for slot in self._extend(row, n, writes)]
            self._write(writes)
        return slots

    def _write(self, writes: "_MapWrites") -> None:
        """The entries of ``writes``: every map's flat positions (int64) and values (int32, the
        maps' dtype) sent to the device in one asynchronous copy (:func:`~dsv4_compile.transfer.to_device`)."""
        maps = [(buffer, index, values) for buffer, index, values in zip(writes.buffers, writes.index, writes.values)
                if index]
        if not maps:
            return
        views = to_device(self.cache.device, int64=[index for _, index, _ in maps],
                          int32=[values for _, _, values in maps])
        for (buffer, _, _), index, values in zip(maps, views, views[len(maps):]):
            self._set(buffer, index, values)

    def _extend(self, row: int, num_tokens: int, writes: "_MapWrites") -> list[int]:
        """:meth:`extend`, its index-map entries added to ``writes``; returns the full slots."""
        req = self._get(row)
        num_tokens = check_count("num_tokens", num_tokens)
        new_len = req.seq_len + num_tokens
        if new_len > self.cache.max_seq_len:
            raise ValueError(f"request {row}: num_tokens={num_tokens} brings its length to {new_len}, which "
                             f"exceeds the cache's max_seq_len {self.cache.max_seq_len}")
        first, last = req.seq_len // PAGE_SIZE, -(-new_len // PAGE_SIZE)
        need_full = max(0, last - len(req.full_pages))
        need_swa = sum(1 for i in range(first, last) if i not in req.swa_pages)
        dead = self._dead_swa(req)  # they lie before `first`
        free_swa = len(self._free_swa) + len(dead)
        if need_full > len(self._free_full) or need_swa > free_swa:
            raise OutOfPagesError(f"request {row}: num_tokens={num_tokens} needs {need_full} full and "
                                  f"{need_swa} SWA pages, {len(self._free_full)} and {free_swa} free")
        self._changing(row)
        for i in dead:  # evict_swa's work, its pages found above
            self._release_swa(req, i)
        for i in range(first, last):
            if i >= len(req.full_pages):
                req.full_pages.append(self._take(self._free_full))
            if i not in req.swa_pages:
                req.swa_pages[i] = self._take(self._free_swa)
        full = self._map_entries(row, req, new_len, writes)
        req.seq_len = new_len
        req.high_water = max(req.high_water, new_len)
        return full

    def _map_entries(self, row: int, req: _Request, new_len: int, writes: "_MapWrites") -> list[int]:
        """Index map entries of positions ``req.seq_len .. new_len - 1`` (pages already assigned),
        added to ``writes``; returns their full slots."""
        positions = range(req.seq_len, new_len)
        full = [req.full_pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions]
        swa = [req.swa_pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions]
        token_row, page_row = row * writes.tokens_per_row, row * writes.pages_per_row
        pages = range(req.seq_len // PAGE_SIZE, -(-new_len // PAGE_SIZE))
        (token_index, page_index, swa_index), (token_values, page_values, swa_values) = writes.index, writes.values
        token_index += [token_row + p for p in positions]
        token_values += full
        page_index += [page_row + i for i in pages]
        page_values += [req.full_pages[i] for i in pages]
        swa_index += full
        swa_values += swa
        return full

    def truncate(self, row: int, new_len: int) -> None:
        """Roll request ``row`` back to ``new_len`` tokens (rejected draft tokens), zero the index
        map entries of the dropped positions and free the pages that now lie entirely past the end.

        ``new_len`` may go at most ``config.max_draft_tokens`` below the longest length the request
        has reached; a deeper rollback raises ``ValueError`` before anything changes, because the
        compressor rings no longer hold the state it would need.
        """
        req = self._get(row)
        new_len = check_count("new_len", new_len)
        if new_len > req.seq_len:
            raise ValueError(f"request {row}: new_len={new_len} is past its length {req.seq_len}")
        if new_len < req.high_water - self._max_rollback:
            raise ValueError(f"request {row}: new_len={new_len} goes {req.high_water - new_len} "
                             f"tokens below its longest length {req.high_water}; at most "
                             f"max_draft_tokens={self._max_rollback} can be rolled back")
        keep = -(-new_len // PAGE_SIZE)
        self._changing(row)
        dropped = self.cache.req_to_token[row, new_len:req.seq_len].long()
        self._set(self.cache.full_to_swa, dropped, 0)
        self._set(self.cache.req_to_token, (row, slice(new_len, req.seq_len)), 0)
        self._set(self.cache.req_to_page, (row, slice(keep, len(req.full_pages))), 0)
        for i in range(keep, len(req.full_pages)):
            self._release_swa(req, i)
        self._give(self._free_full, req.full_pages[keep:][::-1])
        del req.full_pages[keep:]
        req.seq_len = new_len

    def evict_swa(self, row: int) -> int:
        """Free the SWA pages of ``row`` that no future query can attend to; returns how many."""
        req = self._get(row)
        dead = self._dead_swa(req)
        self._changing(row)
        for i in dead:
            self._release_swa(req, i)
        return len(dead)

    def _dead_swa(self, req: _Request) -> list[int]:
        """Logical pages of ``req`` holding SWA storage no future query reads."""
        oldest_query = req.high_water - self._max_rollback  # the deepest rollback's next query
        return [i for i in req.swa_pages if (i + 1) * PAGE_SIZE <= oldest_query - (SWA_WINDOW - 1)]

    def free(self, row: int) -> None:
        """Release every page and the row of a finished request; its index map rows read as
        "no page" (zeros) afterwards."""
        req = self._get(row)
        self._changing(row)
        for i in list(req.swa_pages):
            self._release_swa(req, i)
        self._give(self._free_full, req.full_pages[::-1])
        self._set(self.cache.req_to_token, row, 0)
        self._set(self.cache.req_to_page, row, 0)
        del self._requests[row]
        self._give(self._free_rows, [row])

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """All or nothing: if the block raises, every change made inside it is undone — request
        rows, pages, lengths and each index map entry (``req_to_token``, ``req_to_page``,
        ``full_to_swa``) return to their state at entry, byte for byte — and the error propagates.
        Blocks nest. (The compressor rings a rolled-back :meth:`admit` cleared stay cleared: they
        belong to a free row.)

        Entering costs nothing per request or page: each change inside records how to undo itself
        (a request's state before its first change, a page or row taken from or given back to a
        free list, a map entry's old value)."""
        outer, self._undo = self._undo, _Undo()
        try:
            yield
        except BaseException:
            self._undo.revert(self)
            raise
        else:
            if outer is not None:
                outer.absorb(self._undo)
        finally:
            self._undo = outer

    # -- internals -----------------------------------------------------------------------------
    def _set(self, buffer: torch.Tensor, index, value) -> None:
        """``buffer[index] = value`` on an index map, remembering the old values inside a
        transaction. A tensor ``index`` holds flat positions (``buffer`` is contiguous)."""
        gathered = isinstance(index, torch.Tensor)
        if gathered:
            buffer = buffer.view(-1)
        if self._undo is not None:
            old = buffer[index]  # a tensor index gathers a copy already; other indices give a view
            self._undo.maps.append((buffer, index, old if gathered else old.clone()))
        buffer[index] = value

    def _changing(self, row: int) -> None:
        """Inside a transaction, remember request ``row`` as it is (or that it is absent) before its
        first change there."""
        if self._undo is not None and row not in self._undo.requests:
            req = self._requests.get(row)
            self._undo.requests[row] = req.copy() if req is not None else None

    def _take(self, free: list[int]) -> int:
        """The last entry of free list ``free``, removed (put back if the transaction fails)."""
        value = free.pop()
        if self._undo is not None:
            self._undo.free_lists.append((free, value, 0))
        return value

    def _give(self, free: list[int], values: list[int]) -> None:
        """``values`` appended to free list ``free`` (taken off again if the transaction fails)."""
        free += values
        if self._undo is not None and values:
            self._undo.free_lists.append((free, None, len(values)))

    def _get(self, row: int) -> _Request:
        try:
            return self._requests[check_count("row", row)]
        except KeyError:
            raise ValueError(f"request row {row} is not active") from None

    def _release_swa(self, req: _Request, i: int) -> None:
        page = req.swa_pages.pop(i, None)
        if page is None:
            return
        full_page = req.full_pages[i]
        self._set(self.cache.full_to_swa, slice(full_page * PAGE_SIZE, (full_page + 1) * PAGE_SIZE), 0)
        self._give(self._free_swa, [page])


class _MapWrites:
    """Index-map entries to write, gathered on the host: for ``req_to_token``, ``req_to_page`` and
    ``full_to_swa`` (``buffers``, read from the cache once a step), flat positions and their values."""

    def __init__(self, cache: DSV4Cache) -> None:
        self.buffers = (cache.req_to_token, cache.req_to_page, cache.full_to_swa)
        self.tokens_per_row, self.pages_per_row = self.buffers[0].shape[1], self.buffers[1].shape[1]
        self.index: tuple[list[int], ...] = ([], [], [])
        self.values: tuple[list[int], ...] = ([], [], [])


@dataclass
class _Undo:
    """What one open transaction changed, to undo it: each map write's old values, each free-list
    change in order (``(list, value, 0)``: ``value`` taken off; ``(list, None, n)``: n values
    appended), and each changed request as it was before (None: it did not exist)."""

    maps: list[tuple[torch.Tensor, object, torch.Tensor]] = field(default_factory=list)
    free_lists: list[tuple[list[int], int | None, int]] = field(default_factory=list)
    requests: dict[int, _Request | None] = field(default_factory=dict)

    def revert(self, allocator: PageAllocator) -> None:
        for buffer, index, old in reversed(self.maps):
            buffer[index] = old
        for free, taken, appended in reversed(self.free_lists):
            if taken is None:
                del free[len(free) - appended:]
            else:
                free.append(taken)
        for row, req in self.requests.items():
            if req is None:
                allocator._requests.pop(row, None)
            else:
                allocator._requests[row] = req

    def absorb(self, inner: "_Undo") -> None:
        """An inner transaction's changes, now this one's (the older state of a request wins)."""
        self.maps += inner.maps
        self.free_lists += inner.free_lists
        for row, req in inner.requests.items():
            self.requests.setdefault(row, req)
