"""Seeded inputs for ``dsv4::sparse_attn`` tests and benchmarks (STYLE habits 13, 14, 25).

Caches are written through the reference store (``reference.kv_store.store_model1``), so a kernel
under test reads exactly the bytes the spec defines. Index lists are drawn from the whole pool
(fragmented pages); optional adversarial content: ``-1`` holes, sentinel indices (INT32_MIN,
``capacity``, INT32_MAX) inside the row's length, ragged and over-long lengths, empty rows and
rows whose every index is invalid, and sinks of ``+inf`` / ``-inf``.

Shape legend: T = query rows, H = heads, K1 / K2 = SWA / extra index widths, P = page size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import layout
from ..config import HEAD_DIM
from ..reference.kv_store import store_model1

EXTRA_PAGE_SIZE = {"c4": layout.C4_PAGE_SIZE, "c128": layout.C128_PAGE_SIZE}
_MAX_DISTINCT_SLOTS = 1 << 21  # beyond this many entries, rows share one pool (memory bound)
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass
class AttnInputs:
    """Arguments of ``dsv4::sparse_attn`` in op order (see :meth:`args`)."""

    q: torch.Tensor  # [T, H, 512] bf16
    swa_cache: torch.Tensor  # [N_pages, page_bytes] uint8, MODEL1 pages of 256
    swa_page_size: int
    swa_indices: torch.Tensor  # [T, K1] int32 slots
    swa_lengths: torch.Tensor  # [T] int32
    extra_cache: torch.Tensor | None  # [N_pages, page_bytes] uint8, MODEL1 pages of 64 or 2
    extra_page_size: int
    extra_indices: torch.Tensor | None  # [T, K2] int32 slots
    extra_lengths: torch.Tensor | None  # [T] int32
    attn_sink: torch.Tensor  # [H] fp32
    softmax_scale: float

    def args(self) -> tuple:
        return (self.q, self.swa_cache, self.swa_page_size, self.swa_indices, self.swa_lengths,
                self.extra_cache, self.extra_page_size, self.extra_indices, self.extra_lengths,
                self.attn_sink, self.softmax_scale)

    def entries_per_row(self) -> int:
        """Index width per row (SWA + extra): the entries a full-length row gathers."""
        extra = 0 if self.extra_indices is None else self.extra_indices.shape[1]
        return self.swa_indices.shape[1] + extra


def random_keys(n: int, gen: torch.Generator, device) -> torch.Tensor:
    """``[n, 512] bf16`` keys whose 64-wide tiles have magnitudes 2^-2 .. 2^2 (varied fp8 scales)."""
    k = torch.randn(n, HEAD_DIM // layout.FP8_TILE, layout.FP8_TILE, generator=gen, device=device)
    mag = torch.exp2(torch.randint(-2, 3, (n, k.shape[1], 1), generator=gen, device=device).float())
    return (k * mag).reshape(n, HEAD_DIM).to(torch.bfloat16)


def make_model1_cache(num_slots: int, page_size: int, gen: torch.Generator, device) -> torch.Tensor:
    """A MODEL1 cache with at least ``num_slots`` slots, every slot holding a random key.

    Returns ``[N_pages, page_bytes] uint8`` with ``N_pages = ceil(num_slots / P) + 1`` (the pool's
    spare page, SPEC §2); padding bytes are zero.
    """
    num_pages = -(-num_slots // page_size) + 1
    cache = torch.zeros(num_pages, layout.model1_page_bytes(page_size), dtype=torch.uint8, device=device)
    slots = torch.arange(num_pages * page_size, device=device)
    for lo in range(0, slots.numel(), 1 << 18):  # bounded temporaries for 1M-context pools
        chunk = slots[lo:lo + (1 << 18)]
        store_model1(cache, chunk, random_keys(chunk.numel(), gen, device), page_size)
    return cache


def _index_set(rows: int, width: int, page_size: int, capacity_hint: int | None, gen, device, *,
               holes: float, ragged: bool, sentinels: bool, empty_rows: int):
    """Cache, ``indices [rows, width] int32`` and ``lengths [rows] int32`` for one index set."""
    distinct = rows * width
    capacity = capacity_hint or min(distinct, _MAX_DISTINCT_SLOTS)
    cache = make_model1_cache(capacity, page_size, gen, device)
    slots_total = cache.shape[0] * page_size
    if distinct <= slots_total:  # every row its own entries, scattered over the pool
        idx = torch.randperm(slots_total, generator=gen, device=device)[:distinct].view(rows, width)
    else:
        idx = torch.randint(0, slots_total, (rows, width), generator=gen, device=device)
    idx = idx.to(torch.int64)
    if holes:
        idx = torch.where(torch.rand(idx.shape, generator=gen, device=device) < holes, -1, idx)
    if sentinels:
        pick = torch.randint(0, width, (rows, 3), generator=gen, device=device)
        bad = torch.tensor([_INT32_MIN, slots_total, _INT32_MAX], device=device).expand(rows, 3)
        idx = idx.scatter(1, pick, bad)
    lengths = torch.full((rows,), width, dtype=torch.int64, device=device)
    if ragged:
        lengths = torch.randint(0, width + 1, (rows,), generator=gen, device=device)
        lengths[0] = width + 7  # longer than the list: clamps to the width
    if empty_rows:
        lengths[-empty_rows:] = 0
    return cache, idx.to(torch.int32), lengths.to(torch.int32)


def make_attn_inputs(num_rows: int, num_heads: int, *, extra: str | None = "c4", swa_width: int = 128,
                     extra_width: int = 512, swa_capacity: int | None = None,
                     extra_capacity: int | None = None, holes: float = 0.0, ragged: bool = False,
                     sentinels: bool = False, empty_rows: int = 0, invalid_rows: int = 0,
                     special_sink: bool = False, seed: int = 0, device="cpu") -> AttnInputs:
    """Seeded inputs for one sparse-attention call.

    extra: ``"c4"``, ``"c128"`` or ``None`` (SWA-only layer). Capacities (entries) default to one
    distinct entry per (row, index) up to ``2^21``. ``empty_rows``: the last rows get length 0;
    ``invalid_rows``: the first rows keep their lengths but every index is -1 (both give out 0,
    lse +inf). ``special_sink``: head 0 sink ``+inf``, head 1 ``-inf``.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    kw = dict(holes=holes, ragged=ragged, sentinels=sentinels, empty_rows=empty_rows)
    swa_cache, swa_idx, swa_len = _index_set(num_rows, swa_width, layout.SWA_PAGE_SIZE, swa_capacity,
                                             gen, device, **kw)
    extra_cache = extra_idx = extra_len = None
    extra_page_size = 0
    if extra is not None:
        extra_page_size = EXTRA_PAGE_SIZE[extra]
        extra_cache, extra_idx, extra_len = _index_set(num_rows, extra_width, extra_page_size,
                                                       extra_capacity, gen, device, **kw)
    if invalid_rows:
        swa_idx[:invalid_rows] = -1
        if extra_idx is not None:
            extra_idx[:invalid_rows] = -1
    q = torch.randn(num_rows, num_heads, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
    sink = torch.randn(num_heads, generator=gen, device=device)
    if special_sink:
        sink[0], sink[1 % num_heads] = float("inf"), float("-inf")
    return AttnInputs(q, swa_cache, layout.SWA_PAGE_SIZE, swa_idx, swa_len, extra_cache, extra_page_size,
                      extra_idx, extra_len, sink, HEAD_DIM ** -0.5)
