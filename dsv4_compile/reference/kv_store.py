"""Paged cache writes and reads by slot (docs/semantics.md §2.2, §2.3, §4.1) — reference.

Caches are 2-D ``uint8 [N_pages, page_bytes]`` tensors addressed as ``slot -> (slot // P, slot % P)``
through the page views of :mod:`.quant`. A slot is valid when ``0 <= slot < N_pages * P`` (the
pages of the tensor given, docs/semantics.md §6): writes skip rows with any other slot, reads
return zeros for them. Neither synchronises with the host nor has data-dependent shapes: writes go
through :func:`~.functional.put_where`, reads of a skipped slot are redirected to the last slot of
page 0 and zeroed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .functional import may_select, put_where
from .quant import (dequantize_index_k, dequantize_model1, index_page_views, model1_page_views,
                    quantize_index_k, quantize_model1)


def _page_offset(slots: torch.Tensor, page_size: int, num_pages: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(valid, page, offset)`` of ``slots`` in a cache of ``num_pages`` pages; slots outside
    ``[0, num_pages * P)`` are invalid and map to page 0, offset P - 1."""
    s = slots.long()  # a capacity past int32 must not wrap in the comparison
    valid = (s >= 0) & (s < num_pages * page_size)
    s = torch.where(valid, s, page_size - 1)
    return valid, s // page_size, s % page_size


def _store(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int, views: Callable,
           quantize: Callable) -> None:
    """Write ``quantize(k)``'s fields through the page ``views`` of ``cache``, row n at ``slots[n]``."""
    if cache.shape[0] == 0:  # no valid slot
        return
    valid, page, off = _page_offset(slots, page_size, cache.shape[0])
    for view, values in zip(views(cache, page_size), quantize(k)):
        put_where(view, (page, off), values, valid)


def _gather(cache: torch.Tensor, slots: torch.Tensor, page_size: int, views: Callable,
            dequantize: Callable) -> torch.Tensor:
    """``dequantize`` of the fields at ``slots [...]`` -> ``[..., D] fp32`` (0 for invalid slots)."""
    rows, where = _gather_rows(cache, slots, page_size, views, dequantize)
    return rows_at(rows, where) if where is not None else rows.reshape(*slots.shape, -1)


def rows_at(rows: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``rows[where]``: ``rows [U, D]``, ``where [...]`` int64 -> ``[..., D]``, as one
    ``index_select`` (on the CPU a fifth faster than advanced indexing for these row copies)."""
    return torch.index_select(rows, 0, where.reshape(-1)).view(*where.shape, rows.shape[-1])


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor, page_size: int, views: Callable,
                 dequantize: Callable) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gather of :func:`_gather` as ``(rows [U, D] fp32, where)``: ``rows[where]`` is the
    ``[..., D]`` result.

    Where :func:`~.functional.may_select` allows it, each distinct slot is dequantised once (the
    rows of one request's chunk read mostly the same entries: the CPU step's attention and indexer
    spent most of their time dequantising them again) and ``where [...]`` int64 names each slot's
    row; the result is the same to the bit. Elsewhere every slot is dequantised where it stands,
    ``rows`` is ``[N, D]`` in the slots' order and ``where`` None."""
    flat = slots.reshape(-1)
    if may_select(flat):
        distinct, where = torch.unique(flat, return_inverse=True)
        return _dequantize_at(cache, distinct, page_size, views, dequantize), where.reshape(slots.shape)
    return _dequantize_at(cache, flat, page_size, views, dequantize), None


def _dequantize_at(cache: torch.Tensor, flat: torch.Tensor, page_size: int, views: Callable,
                   dequantize: Callable) -> torch.Tensor:
    """``dequantize`` of the fields at ``flat [N]`` -> ``[N, D] fp32`` (0 for invalid slots)."""
    if cache.shape[0] == 0:  # no valid slot: read the zeros of an empty page
        cache = cache.new_zeros(1, cache.shape[1])
        flat = flat.new_full(flat.shape, -1)
    valid, page, off = _page_offset(flat, page_size, cache.shape[0])
    k = dequantize(*(view[page, off] for view in views(cache, page_size)))
    return torch.where(valid.unsqueeze(1), k, 0.0)


def store_model1(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Quantise ``k [N, 512] bf16`` to MODEL1 and write row n at ``slots[n]`` (int32/int64 [N];
    outside ``[0, N_pages * P)``: skipped).

    cache: [N_pages, page_bytes] uint8, mutated in place.
    """
    _store(cache, slots, k, page_size, model1_page_views, quantize_model1)


def gather_model1(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantised keys at ``slots [...]`` of a MODEL1 cache: ``[..., 512] fp32`` (0 for slots
    outside ``[0, N_pages * P)``)."""
    return _gather(cache, slots, page_size, model1_page_views, dequantize_model1)


def gather_model1_rows(cache: torch.Tensor, slots: torch.Tensor, page_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`gather_model1` before its rows are copied out: ``(rows [U, 512] fp32, where)`` with
    ``rows[where]`` its result, or ``where`` None and ``rows`` ``[N, 512]`` in the slots' order
    (:func:`_gather_rows`). A caller joining several gathers indexes once, after joining the rows."""
    return _gather_rows(cache, slots, page_size, model1_page_views, dequantize_model1)


def store_index_k(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Quantise indexer keys ``k [N, 128]`` (fp8 + fp32 scale) and write row n at ``slots[n]``
    (outside ``[0, N_pages * P)``: skipped) of ``cache [N_pages, P * 132] uint8``."""
    _store(cache, slots, k, page_size, index_page_views, quantize_index_k)


def gather_index_k(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantised indexer keys at ``slots [...]``: ``[..., 128] fp32`` (0 for slots outside
    ``[0, N_pages * P)``)."""
    return _gather(cache, slots, page_size, index_page_views, dequantize_index_k)
