"""Per-step metadata (docs/semantics.md §3) — reference.

Pure functions of the step's device tensors and the cache's index maps, with fixed output shapes:
``T`` (query rows, padding included) comes from ``out_cache_loc``, widths from cache capacity
(``L_max = req_to_token.shape[1]``), never from lengths. No host reads. Each function has the
signature of its ``dsv4::`` op, and returns that op's fields as declared in
``dsv4_compile.metadata_chain`` (names, order, shapes).

Shape legend: B = requests, T = query rows, L_max = max tokens per request,
NP = L_max // 256 pages per request, W = SWA window (128).

Padding rows (query rows past ``sum(extend_lens)``) belong to the reserved dummy request row 0 at
position 0: ``seq_len 1``, and every slot they read or write is the dummy slot 0.

Out-of-range values (docs/semantics.md §6) read as "no entry" through :func:`gather_or`: a request
row outside the index maps has no pages and no window and writes nothing (-1 in all three
out-slot fields), a position past ``L_max`` or a full slot outside ``full_to_swa`` has no SWA slot
(-1), and a negative out slot gives -1 in all three out-slot fields.
"""

from __future__ import annotations

import sys

import torch

from ..config import PAGE_SIZE, SWA_WINDOW
from ..metadata_chain import FIELD_NAMES, c128_columns, run_chain
from .functional import gather_or

_I32 = torch.int32
_I32_MIN, _I32_MAX = torch.iinfo(_I32).min, torch.iinfo(_I32).max


def expand_queries(req_rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                   out_cache_loc: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per query token (docs/semantics.md §3.2), requests concatenated in order.

    req_rows, seq_lens, extend_lens: [B] int32 — request pool rows, post-step lengths ``L_b`` and
    tokens this step ``E_b`` (decode: 1; uniform verify: D; prefill/extend: chunk length);
    out_cache_loc: [T] — only its length T (query rows, padding included) is read.
    Row ``j`` of request ``b`` is position ``L_b - E_b + j``. Returns, per row, int32 [T]:
    ``req_of_row``, ``seq_lens_causal`` (position + 1), ``extend_start = L_b - E_b`` (first position
    this step), ``extend_end = L_b`` and ``positions`` (padding rows: request 0, position 0). Every
    layer's RoPE reads ``positions``: produced here, a compiled step holds it in one buffer, where
    ``seq_lens_causal - 1`` in the graph would be recomputed into a buffer of its own for each op
    that reads it (Inductor does not keep a cheap pointwise result for extern kernels). From int64
    inputs, a request row past int32's range becomes -1 (out of range, docs/semantics.md §6) and
    lengths and positions past it saturate, rather than wrap onto another request or position.
    """
    num_tokens, device = out_cache_loc.shape[0], req_rows.device
    q = torch.arange(num_tokens, device=device)
    if req_rows.shape[0] == 0:  # idle: every row is padding
        zeros = torch.zeros(num_tokens, dtype=_I32, device=device)
        return zeros, zeros + 1, zeros.clone(), zeros + 1, zeros.clone()
    ends = torch.cumsum(extend_lens.long(), 0)  # [B] exclusive end row of each request
    b = torch.searchsorted(ends, q, right=True).clamp_max(req_rows.shape[0] - 1)  # [T]
    real = q < ends[-1]
    e_b, l_b = extend_lens.long()[b], seq_lens.long()[b]
    start = l_b - e_b
    pos = start + (q - (ends[b] - e_b))
    req = req_rows.long()[b]
    req = torch.where(real, torch.where((req >= _I32_MIN) & (req <= _I32_MAX), req, -1), 0)
    seq_causal = torch.where(real, pos + 1, 1)
    return (req.to(_I32), _saturated(seq_causal), _saturated(torch.where(real, start, 0)),
            _saturated(torch.where(real, l_b, 1)), _saturated(seq_causal - 1))


def _saturated(x: torch.Tensor) -> torch.Tensor:
    """``x`` (int64) as int32, values past int32's range clamped to its ends rather than wrapped."""
    return x.clamp(_I32_MIN, _I32_MAX).to(_I32)


def page_map(req_to_token: torch.Tensor) -> torch.Tensor:
    """``req_to_page [R, NP] int32``: the full page of each 256-token page of every request row,
    ``req_to_token[r, 256 i] // 256`` (the allocator keeps this map beside ``req_to_token``)."""
    return (req_to_token[:, ::PAGE_SIZE] // PAGE_SIZE).to(_I32)


def build_page_table(req_to_page: torch.Tensor, req_of_row: torch.Tensor,
                     seq_lens_causal: torch.Tensor) -> torch.Tensor:
    """``page_table[q, i] = req_to_page[req_q, i]`` (= ``req_to_token[req_q, 256 i] // 256``) for
    the pages holding positions ``< seq_lens_causal[q]``, 0 past them, for request rows outside
    ``[0, R)`` and for pages past int32's range: [T, NP] int32 (docs/semantics.md §3.3, §6).
    Every reader (c4 indexer, c128 indices) stays inside that prefix; a row of the compact page
    map is contiguous, so the table is a masked row copy."""
    i = torch.arange(req_to_page.shape[1], device=req_of_row.device)
    live = i * PAGE_SIZE < seq_lens_causal.long().unsqueeze(1)
    pages = gather_or(req_to_page, (req_of_row.long().unsqueeze(1), i), 0).long()
    return torch.where(live & (pages >= _I32_MIN) & (pages <= _I32_MAX), pages, 0).to(_I32)


def build_swa_metadata(req_to_token: torch.Tensor, full_to_swa: torch.Tensor, req_of_row: torch.Tensor,
                       seq_lens_causal: torch.Tensor, out_cache_loc: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sliding-window attention inputs (docs/semantics.md §3.3, §3.4, §3.7).

    Returns ``swa_indices [T, 128] int32`` (newest first: k-th entry is the SWA slot of position
    ``pos - k``, -1 where ``pos - k`` is outside ``[0, L_max)``, the request row outside ``[0, R)``
    or the full slot outside ``full_to_swa``), ``swa_lengths [T] int32 = min(pos + 1, 128)`` and
    ``swa_out_loc [T] int32`` = SWA slot this row's token is written to (-1 for an out slot
    outside ``full_to_swa`` or a request row outside ``[0, R)``: the store skips it).
    """
    req = req_of_row.long()
    pos = seq_lens_causal.long() - 1  # [T]
    p = pos.unsqueeze(1) - torch.arange(SWA_WINDOW, device=pos.device)  # [T, W]
    full = gather_or(req_to_token, (req.unsqueeze(1), p), -1)  # [T, W]
    indices = gather_or(full_to_swa, (full,), -1).to(_I32)
    lengths = seq_lens_causal.clamp_max(SWA_WINDOW).to(_I32)
    out_loc = torch.where(_known(req, req_to_token.shape[0]), gather_or(full_to_swa, (out_cache_loc,), -1), -1)
    return indices, lengths, out_loc.to(_I32)


def _known(req_of_row: torch.Tensor, num_request_rows: int) -> torch.Tensor:
    """Rows whose request row is in ``[0, num_request_rows)``: bool [T]. Only such a row writes."""
    return (req_of_row >= 0) & (req_of_row < num_request_rows)


def _compressed_out_loc(req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor, out_cache_loc: torch.Tensor,
                        ratio: int, num_request_rows: int) -> torch.Tensor:
    """``out_cache_loc // ratio`` for a row completing a window (a positive multiple of ``ratio``
    tokens) with a non-negative out slot whose quotient fits int32 and a request row in
    ``[0, num_request_rows)``, else -1: int32 [T]."""
    seq, loc = seq_lens_causal.long(), out_cache_loc.long()
    writes = ((seq > 0) & (seq % ratio == 0) & (loc >= 0) & (loc // ratio <= _I32_MAX)
              & _known(req_of_row.long(), num_request_rows))
    return torch.where(writes, loc // ratio, -1).to(_I32)


def build_c4_metadata(req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor, out_cache_loc: torch.Tensor,
                      topk: int, num_request_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ratio-4 fields (docs/semantics.md §3.5, §3.6); ``num_request_rows`` = R.

    Returns int32 [T]: ``c4_out_loc`` (``full_slot // 4`` for a row completing a window, else -1,
    and -1 for a negative out slot or a request row outside ``[0, R)``: skipped by the store),
    ``c4_visible = (pos + 1) // 4`` (compressed entries the row may see) and
    ``c4_topk_lengths = min(max(c4_visible, 1), topk)`` (attention's extra length).
    """
    visible = (seq_lens_causal.long() // 4).to(_I32)
    out_loc = _compressed_out_loc(req_of_row, seq_lens_causal, out_cache_loc, 4, num_request_rows)
    return out_loc, visible, visible.clamp(1, topk).to(_I32)


def build_c128_metadata(page_table: torch.Tensor, req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor,
                        out_cache_loc: torch.Tensor, num_request_rows: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ratio-128 fields (docs/semantics.md §3.5); ``num_request_rows`` = R.

    Returns ``c128_out_loc [T] int32`` (``full_slot // 128`` on a window boundary, else -1, and -1
    for a negative out slot or a request row outside ``[0, R)``), ``c128_indices [T, ceil64(2 NP)]
    int32`` (entry ``j`` at slot ``page_table[q, j // 2] * 2 + j % 2`` for
    ``j < (pos + 1) // 128``, else -1, and -1 for a negative page or one whose slots pass int32)
    and ``c128_lengths = max((pos + 1) // 128, 1)`` [T] int32.
    """
    seq = seq_lens_causal.long()
    out_loc = _compressed_out_loc(req_of_row, seq_lens_causal, out_cache_loc, 128, num_request_rows)
    n_entries = 2 * page_table.shape[1]
    j = torch.arange(c128_columns(page_table.shape[1]), device=seq.device)  # [K]
    page = page_table.long()[:, (j // 2).clamp_max(page_table.shape[1] - 1)]  # [T, K]
    visible = (seq // 128).unsqueeze(1)
    fits = (page >= 0) & (page <= (_I32_MAX - 1) // 2)  # a slot past int32 would wrap onto another entry
    indices = torch.where((j < visible) & (j < n_entries) & fits, page * 2 + j % 2, -1).to(_I32)
    return out_loc, indices, (seq // 128).clamp_min(1).to(_I32)


def step_metadata(req_rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                  out_cache_loc: torch.Tensor, req_to_token: torch.Tensor, req_to_page: torch.Tensor,
                  full_to_swa: torch.Tensor, topk: int) -> tuple[torch.Tensor, ...]:
    """Every field of the step (the outputs of the five functions above, chained as
    ``build_step_metadata`` chains the ops), in ``metadata_chain.FIELDS`` order."""
    fields = run_chain(sys.modules[__name__], req_rows, seq_lens, extend_lens, out_cache_loc, req_to_token,
                       req_to_page, full_to_swa, topk)
    return tuple(fields[name] for name in FIELD_NAMES)
