"""Lightning indexer: score visible c4 entries and pick the top-k (docs/semantics.md §4.3) — reference.

For query row ``q`` at position ``p`` with ``n = (p + 1) // 4`` visible compressed entries::

    Q_h      = hadamard(rope(q_h[64:128], p))                  per head h, 128 dims
    Q~, sig  = fp8(Q_h / sig_h), sig_h = max(amax(Q_h), 1e-4) / 448
    w_h      = weights_h * index_weight_scale * sig_h
    l_j      = kappa_j * sum_h w_h * relu(Q~_h . K~_j)          j < n (K~ fp8 keys, kappa scales)
    selected = all j < n if n <= topk else the topk largest l_j (order unspecified)
    index    = page_table[q, j // 64] * 64 + j % 64            (c4 slot), -1 for unused columns

Out of range (docs/semantics.md §6): ``n`` is clamped to ``[0, NP * 64]``; an entry on a page
outside the index cache reads as a zero key (``l_j = 0``) and is emitted as -1 when selected.

The choice between "all visible" and "top-k" is made per row on device (never at trace time).

Shape legend: T = rows, H = indexer heads, NP = pages per request, K = topk.
"""

from __future__ import annotations

import torch

from ..layout import INDEX_PAGE_SIZE
from .functional import gather_or, hadamard, rope_tail, row_chunks
from .kv_store import gather_index_k
from .quant import quantize_q_per_head

_ROW_CHUNK_ELEMS = 1 << 22


def indexer_rotate_q(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``hadamard(rope(q))``, the indexer query before quantisation: q [T, H, 128] (bf16 or
    fp32), positions [T] int -> [T, H, 128] fp32."""
    return hadamard(rope_tail(q.float(), positions.unsqueeze(1), inv_freq))


def indexer_prepare_q(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                      inv_freq: torch.Tensor, weight_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries and head weights.

    q: [T, H, 128] (bf16 or fp32) from ``q_lora @ W_qb^I``; weights: [T, H] from ``x @ W_w``;
    positions: [T] int32. Returns ``q_fp8 [T, H, 128] float8_e4m3fn`` and ``w [T, H] fp32``
    (``weights * weight_scale * sigma``).
    """
    q_fp8, sigma = quantize_q_per_head(indexer_rotate_q(q, positions, inv_freq))
    return q_fp8, weights.float() * weight_scale * sigma


def indexer_logits(q_fp8: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                   page_table: torch.Tensor) -> torch.Tensor:
    """``[T, NP * 64]`` fp32 logits of every entry the page table can address (unmasked; 0 on
    pages outside ``index_cache``)."""
    num_rows, num_pages = page_table.shape
    j = torch.arange(num_pages * INDEX_PAGE_SIZE, device=page_table.device)
    slots = page_table.long()[:, j // INDEX_PAGE_SIZE] * INDEX_PAGE_SIZE + j % INDEX_PAGE_SIZE  # [T, N]
    chunk = max(1, _ROW_CHUNK_ELEMS // max(1, j.numel() * q_fp8.shape[-1]))
    out = []
    for lo, hi in row_chunks(num_rows, chunk):
        keys = gather_index_k(index_cache, slots[lo:hi], INDEX_PAGE_SIZE)  # [C, N, 128]
        dots = torch.einsum("chd,cnd->chn", q_fp8[lo:hi].float(), keys)  # [C, H, N]
        out.append(torch.einsum("chn,ch->cn", dots.relu(), w[lo:hi].float()))
    return torch.cat(out, 0) if out else w.new_zeros(0, j.numel())


def indexer_topk(q_fp8: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                 page_table: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k c4 slots per row: ``[T, topk] int32``, -1 padded.

    q_fp8: [T, H, 128] float8_e4m3fn; w: [T, H] fp32; index_cache: [N_pages, 8448] uint8;
    page_table: [T, NP] int32; visible: [T] int32 entries each row may see (clamped to
    ``[0, NP * 64]``). Entries on pages outside ``index_cache`` are -1.
    """
    num_rows, num_pages = page_table.shape
    capacity = num_pages * INDEX_PAGE_SIZE
    n = visible.long().clamp(0, capacity).unsqueeze(1)  # [T, 1]
    col = torch.arange(topk, device=visible.device)
    j_all = torch.where(col < n, col, -1).expand(num_rows, topk)  # rows with n <= topk
    if capacity > topk:
        logits = indexer_logits(q_fp8, w, index_cache, page_table)
        ar = torch.arange(capacity, device=visible.device)
        logits = logits.masked_fill(ar >= n, float("-inf"))
        j_top = torch.topk(logits, topk, dim=1).indices
        j = torch.where(n <= topk, j_all, j_top)
    else:
        j = j_all
    jc = j.clamp_min(0)
    rows = torch.arange(num_rows, device=page_table.device).unsqueeze(1)
    page = gather_or(page_table, (rows, jc // INDEX_PAGE_SIZE), -1).long()
    in_cache = (j >= 0) & (page >= 0) & (page < index_cache.shape[0])
    return torch.where(in_cache, page * INDEX_PAGE_SIZE + jc % INDEX_PAGE_SIZE, -1).to(torch.int32)
