"""Triton kernels for the per-step metadata ops (docs/semantics.md §3).

One program per query row (the wide outputs also split their columns over a second grid axis).
Output widths are fixed by capacity; loads are masked to what the row can see, so the work beyond
the stores grows with true lengths. Values equal the reference's exactly (int32 outputs; integer
division by the page size or ratio is floor division, as in PyTorch).

Out-of-range values read as "no entry" (docs/semantics.md §6): every load through a request row,
position or full slot is masked to the tensor it reads (``R`` request rows, ``L_max`` positions,
``full_to_swa``'s length), with the reference's fill values, so no kernel reads outside its inputs;
a row whose request row is outside ``[0, R)`` gets -1 in every out-slot field, so it writes nothing.

Each launcher has its op's signature. Output buffers come from the field table
(``metadata_chain.empty_outputs``) and reach a kernel by keyword: the kernel parameter of field
``f`` is ``f_ptr``, so a kernel names the fields it writes instead of relying on their order.
Kernel parameters are inputs, then outputs, then scalars (passed by keyword after the outputs).

Shape legend: B = requests, T = query rows, R = request rows, L_max = tokens per request,
NP = L_max // 256, W = 128 (SWA window), K = ceil64(2 NP) (c128 index width).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...config import PAGE_SIZE, SWA_WINDOW
from ...metadata_chain import empty_outputs

_MAX_BLOCK = 1024  # columns per program for the wide outputs
_I32_MIN, _I32_MAX = tl.constexpr(-2**31), tl.constexpr(2**31 - 1)


@triton.jit
def _floor_div(a, B: tl.constexpr):
    """``a // B`` rounded towards -inf (PyTorch semantics) for a positive constant ``B``."""
    q = a // B
    return q - ((a % B) < 0).to(q.dtype)


@triton.jit
def _expand_row(q, req_rows_ptr, seq_lens_ptr, extend_lens_ptr, B, BLOCK_B: tl.constexpr):
    """Row q -> (request row, position + 1, first position and end of its request this step).

    The request of row q is ``b = #{i : ends[i] <= q}`` with ``ends`` the inclusive cumsum of
    ``extend_lens`` (= ``searchsorted(ends, q, right=True)``), and its first row is the largest end
    ``<= q``. Both are counted over ``extend_lens`` chunk by chunk, so no scratch buffer or second
    launch is needed; rows past the last end are padding (request 0, seq 1, range [0, 1)).
    """
    count = q * 0
    first_row = q * 0
    total = q * 0
    for c in range(0, B, BLOCK_B):
        i = c + tl.arange(0, BLOCK_B)
        e = tl.load(extend_lens_ptr + i, mask=i < B, other=0).to(tl.int32)
        ends = tl.cumsum(e, axis=0) + total
        before = (i < B) & (ends <= q)
        count += tl.sum(before.to(tl.int32), axis=0)
        first_row = tl.maximum(first_row, tl.max(tl.where(before, ends, 0), axis=0))
        total += tl.sum(e, axis=0)
    real = q < total
    b = tl.minimum(count, B - 1)
    e_b = tl.load(extend_lens_ptr + b, mask=real, other=0).to(tl.int64)
    end = tl.load(seq_lens_ptr + b, mask=real, other=1).to(tl.int64)
    req = tl.load(req_rows_ptr + b, mask=real, other=0).to(tl.int64)
    # int64 inputs: a request row past int32 is out of range, lengths and positions saturate (the reference's rule)
    req = tl.where((req >= _I32_MIN) & (req <= _I32_MAX), req, -1).to(tl.int32)
    start = tl.where(real, end - e_b, 0)
    seq = tl.where(real, start + (q - first_row) + 1, 1)
    return req, _saturated(seq), _saturated(start), _saturated(end)


@triton.jit
def _saturated(x):
    """int64 ``x`` as int32, clamped to int32's range rather than wrapped."""
    return tl.minimum(tl.maximum(x, _I32_MIN), _I32_MAX).to(tl.int32)


@triton.jit
def _known(req, R):
    """Whether request row ``req`` is one of the index maps' ``R`` rows: only then does its row
    read a page or a window entry, or write anything."""
    return (req >= 0) & (req < R)


@triton.jit
def _page_block(req_to_page_ptr, req, seq, i, stride_pr, stride_pp, R, NP, PAGE: tl.constexpr):
    """Full-pool pages ``req_to_page[req, i]`` of page indices ``i`` holding positions below
    ``seq`` (0 past them, past NP, for a request row outside ``[0, R)`` and for a page past
    int32's range), int32: a contiguous read of the row's live pages only."""
    known = _known(req, R)
    page = tl.load(req_to_page_ptr + req.to(tl.int64) * stride_pr + i.to(tl.int64) * stride_pp,
                   mask=(i < NP) & (i * PAGE < seq) & known, other=0).to(tl.int64)
    return tl.where((page >= _I32_MIN) & (page <= _I32_MAX), page, 0).to(tl.int32)


@triton.jit
def _swa_window(req, seq, loc, req_to_token_ptr, full_to_swa_ptr, stride_rr, stride_rl, stride_f, R, L, n_swa,
                active, W: tl.constexpr):
    """Of a row (``active``; nothing is read otherwise): ``(swa [W], loc_swa)``, its window's slots,
    newest first, and its write slot; -1 for positions outside ``[0, L)``, a request row outside
    ``[0, R)`` and full slots outside ``[0, n_swa)``. Only loads: a kernel reads the window before
    it stores anything, so the window's two round trips overlap its other loads."""
    p = (seq - 1).to(tl.int64) - tl.arange(0, W)
    known = _known(req, R) & active
    full = tl.load(req_to_token_ptr + req.to(tl.int64) * stride_rr + p * stride_rl,
                   mask=known & (p >= 0) & (p < L), other=-1).to(tl.int64)
    swa = tl.load(full_to_swa_ptr + full * stride_f, mask=(full >= 0) & (full < n_swa), other=-1)
    loc = loc.to(tl.int64)
    loc_swa = tl.load(full_to_swa_ptr + loc * stride_f, mask=known & (loc >= 0) & (loc < n_swa), other=-1)
    return swa.to(tl.int32), loc_swa.to(tl.int32)


@triton.jit
def _store_swa_row(q, seq, swa, loc_swa, indices_ptr, lengths_ptr, out_loc_ptr, W: tl.constexpr):
    """Row q's window (:func:`_swa_window`), its length and its write slot stored."""
    tl.store(indices_ptr + q * W + tl.arange(0, W), swa)
    tl.store(lengths_ptr + q, tl.minimum(seq, W).to(tl.int32))
    tl.store(out_loc_ptr + q, loc_swa)


@triton.jit
def _compressed_out_loc(req, seq, loc, R, RATIO: tl.constexpr):
    """``loc // RATIO`` for a row completing a window (``seq`` a positive multiple of RATIO) with
    a non-negative out slot and a request row in ``[0, R)``, else -1 (int32)."""
    loc = loc.to(tl.int64)
    writes = (seq > 0) & (seq % RATIO == 0) & (loc >= 0) & (loc // RATIO <= _I32_MAX) & _known(req, R)
    return tl.where(writes, loc // RATIO, -1).to(tl.int32)


@triton.jit
def _c4_fields(req, seq, loc, R, topk):
    """Ratio-4 write slot, visible entries and attention length (clamped to [1, topk]), int32."""
    visible = _floor_div(seq.to(tl.int64), 4)
    return (_compressed_out_loc(req, seq, loc, R, 4), visible.to(tl.int32),
            tl.minimum(tl.maximum(visible, 1), topk).to(tl.int32))


@triton.jit
def _c128_block(q, j, visible, page, indices_ptr, NP, K):
    """c128 entries j of row q: ``page * 2 + j % 2`` (``page`` = page_table[q, j // 2]) while
    ``j < (pos + 1) // 128``, -1 after (up to the width K)."""
    page = page.to(tl.int64)
    valid = (j < visible) & (j < 2 * NP) & (page >= 0) & (page <= (_I32_MAX - 1) // 2)
    tl.store(indices_ptr + q * K + j, tl.where(valid, page * 2 + j % 2, -1).to(tl.int32), mask=j < K)


@triton.jit
def _store_expanded(q, req, seq, start, end, req_of_row_ptr, seq_lens_causal_ptr, extend_start_ptr, extend_end_ptr,
                    positions_ptr):
    """Row q's ``expand_queries`` fields (``positions = seq - 1``)."""
    tl.store(req_of_row_ptr + q, req)
    tl.store(seq_lens_causal_ptr + q, seq)
    tl.store(extend_start_ptr + q, start)
    tl.store(extend_end_ptr + q, end)
    tl.store(positions_ptr + q, seq - 1)


@triton.jit
def _expand_queries_kernel(req_rows_ptr, seq_lens_ptr, extend_lens_ptr, req_of_row_ptr, seq_lens_causal_ptr,
                           extend_start_ptr, extend_end_ptr, positions_ptr, B, BLOCK_B: tl.constexpr):
    q = tl.program_id(0)
    req, seq, start, end = _expand_row(q, req_rows_ptr, seq_lens_ptr, extend_lens_ptr, B, BLOCK_B)
    _store_expanded(q, req, seq, start, end, req_of_row_ptr, seq_lens_causal_ptr, extend_start_ptr, extend_end_ptr,
                    positions_ptr)


@triton.jit
def _page_table_kernel(req_to_page_ptr, req_of_row_ptr, seq_ptr, page_table_ptr, stride_pr, stride_pp, R, NP,
                       PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """``page_table[q, i] = req_to_page[req_q, i]`` for a block of pages i (0 past the row)."""
    q = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    req = tl.load(req_of_row_ptr + q)
    page = _page_block(req_to_page_ptr, req, tl.load(seq_ptr + q), i, stride_pr, stride_pp, R, NP, PAGE)
    tl.store(page_table_ptr + q * NP + i, page, mask=i < NP)


@triton.jit
def _swa_kernel(req_to_token_ptr, full_to_swa_ptr, req_of_row_ptr, seq_ptr, out_cache_loc_ptr, swa_indices_ptr,
                swa_lengths_ptr, swa_out_loc_ptr, stride_rr, stride_rl, stride_f, R, L, n_swa, W: tl.constexpr):
    q = tl.program_id(0).to(tl.int64)
    seq = tl.load(seq_ptr + q)
    swa, loc_swa = _swa_window(tl.load(req_of_row_ptr + q), seq, tl.load(out_cache_loc_ptr + q), req_to_token_ptr,
                               full_to_swa_ptr, stride_rr, stride_rl, stride_f, R, L, n_swa, True, W)
    _store_swa_row(q, seq, swa, loc_swa, swa_indices_ptr, swa_lengths_ptr, swa_out_loc_ptr, W)


@triton.jit
def _c4_kernel(req_of_row_ptr, seq_ptr, out_cache_loc_ptr, c4_out_loc_ptr, c4_visible_ptr, c4_topk_lengths_ptr, T,
               R, topk, BLOCK: tl.constexpr):
    q = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = q < T
    out_loc, visible, lengths = _c4_fields(tl.load(req_of_row_ptr + q, mask=m, other=0),
                                           tl.load(seq_ptr + q, mask=m, other=1),
                                           tl.load(out_cache_loc_ptr + q, mask=m, other=0), R, topk)
    tl.store(c4_out_loc_ptr + q, out_loc, mask=m)
    tl.store(c4_visible_ptr + q, visible, mask=m)
    tl.store(c4_topk_lengths_ptr + q, lengths, mask=m)


@triton.jit
def _c128_kernel(page_table_ptr, req_of_row_ptr, seq_ptr, out_cache_loc_ptr, c128_out_loc_ptr, c128_indices_ptr,
                 c128_lengths_ptr, stride_pt, stride_pp, NP, K, R, BLOCK: tl.constexpr):
    """Column block ``blk`` of row q's c128 indices; block 0 also writes the row's scalars."""
    q = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    seq = tl.load(seq_ptr + q)
    visible = _floor_div(seq.to(tl.int64), 128)
    j = blk * BLOCK + tl.arange(0, BLOCK)
    # only the visible prefix is read
    page = tl.load(page_table_ptr + q * stride_pt + (j // 2) * stride_pp, mask=(j < visible) & (j < 2 * NP),
                   other=0)
    _c128_block(q, j, visible, page, c128_indices_ptr, NP, K)
    if blk == 0:
        out_loc = _compressed_out_loc(tl.load(req_of_row_ptr + q), seq, tl.load(out_cache_loc_ptr + q), R, 128)
        tl.store(c128_out_loc_ptr + q, out_loc)
        tl.store(c128_lengths_ptr + q, tl.maximum(visible, 1).to(tl.int32))


@triton.jit
def _step_metadata_kernel(
        req_rows_ptr, seq_lens_ptr, extend_lens_ptr, out_cache_loc_ptr, req_to_token_ptr, req_to_page_ptr,
        full_to_swa_ptr, req_of_row_ptr, seq_lens_causal_ptr, extend_start_ptr, extend_end_ptr, positions_ptr,
        page_table_ptr,
        swa_indices_ptr, swa_lengths_ptr, swa_out_loc_ptr, c4_out_loc_ptr, c4_visible_ptr,
        c4_topk_lengths_ptr, c128_out_loc_ptr, c128_indices_ptr, c128_lengths_ptr,
        B, stride_rr, stride_rl, stride_pr, stride_pp, stride_f, R, L, n_swa, NP, K, topk,
        PAGE: tl.constexpr, W: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    """Every per-row field of a step in one launch: program (q, blk) expands row q, writes pages
    ``[blk BLOCK, (blk + 1) BLOCK)`` of its page table and the c128 entries of those pages (from
    the page values in registers); block 0 also writes the row's scalars and SWA window."""
    q = tl.program_id(0)
    blk = tl.program_id(1)
    req, seq, start, end = _expand_row(q, req_rows_ptr, seq_lens_ptr, extend_lens_ptr, B, BLOCK_B)
    q = q.to(tl.int64)
    # every load before the first store (no load is moved above a store): block 0's window too
    loc = tl.load(out_cache_loc_ptr + q)
    swa, loc_swa = _swa_window(req, seq, loc, req_to_token_ptr, full_to_swa_ptr, stride_rr, stride_rl, stride_f, R,
                               L, n_swa, blk == 0, W)
    i = blk * BLOCK + tl.arange(0, BLOCK)
    page = _page_block(req_to_page_ptr, req, seq, i, stride_pr, stride_pp, R, NP, PAGE)
    tl.store(page_table_ptr + q * NP + i, page, mask=i < NP)
    visible = _floor_div(seq, 128)
    j = 2 * i[:, None] + tl.arange(0, 2)[None, :]  # [BLOCK, 2]: entries of page i
    _c128_block(q, j, visible, page[:, None], c128_indices_ptr, NP, K)
    if blk == 0:
        _store_expanded(q, req, seq, start, end, req_of_row_ptr, seq_lens_causal_ptr, extend_start_ptr,
                        extend_end_ptr, positions_ptr)
        _store_swa_row(q, seq, swa, loc_swa, swa_indices_ptr, swa_lengths_ptr, swa_out_loc_ptr, W)
        c4_out_loc, c4_visible, c4_topk_lengths = _c4_fields(req, seq, loc, R, topk)
        tl.store(c4_out_loc_ptr + q, c4_out_loc)
        tl.store(c4_visible_ptr + q, c4_visible)
        tl.store(c4_topk_lengths_ptr + q, c4_topk_lengths)
        tl.store(c128_out_loc_ptr + q, _compressed_out_loc(req, seq, loc, R, 128))
        tl.store(c128_lengths_ptr + q, tl.maximum(visible, 1).to(tl.int32))


def _block(n: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), _MAX_BLOCK)


def _rows(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """1-D per-request / per-row inputs as the kernels read them: unit stride."""
    return tuple(t.contiguous() for t in tensors)


def _pointers(outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Output buffers as keyword arguments: field ``f`` goes to the kernel parameter ``f_ptr``."""
    return {f"{name}_ptr": t for name, t in outputs.items()}


def launch_expand_queries(req_rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                          out_cache_loc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(req_of_row, seq_lens_causal, extend_start, extend_end)`` int32 [T] from the per-request
    ``req_rows, seq_lens, extend_lens`` [B] (int32/int64); of ``out_cache_loc`` only its length T
    is read."""
    t = out_cache_loc.shape[0]
    outs = empty_outputs("expand_queries", t, None, req_rows.device)
    if t:
        b = req_rows.shape[0]
        _expand_queries_kernel[(t,)](*_rows(req_rows, seq_lens, extend_lens), **_pointers(outs), B=b,
                                     BLOCK_B=_block(b), num_warps=4)
    return tuple(outs.values())


def launch_build_page_table(req_to_page: torch.Tensor, req_of_row: torch.Tensor,
                            seq_lens_causal: torch.Tensor) -> torch.Tensor:
    """``[T, NP] int32``: full-pool page of each live 256-token page of the row's request, 0 after."""
    t, n_pages = req_of_row.shape[0], req_to_page.shape[1]
    outs = empty_outputs("build_page_table", t, n_pages, req_of_row.device)
    if t and n_pages:
        block = _block(n_pages)
        _page_table_kernel[(t, triton.cdiv(n_pages, block))](
            req_to_page, *_rows(req_of_row, seq_lens_causal), **_pointers(outs), stride_pr=req_to_page.stride(0),
            stride_pp=req_to_page.stride(1), R=req_to_page.shape[0], NP=n_pages, PAGE=PAGE_SIZE, BLOCK=block,
            num_warps=4)
    return outs["page_table"]


def launch_build_swa_metadata(req_to_token: torch.Tensor, full_to_swa: torch.Tensor,
                              req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor,
                              out_cache_loc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(swa_indices [T, 128], swa_lengths [T], swa_out_loc [T])`` int32 (docs/semantics.md §3.3,
    3.4, 3.7)."""
    t = req_of_row.shape[0]
    outs = empty_outputs("build_swa_metadata", t, None, req_of_row.device)
    if t:
        _swa_kernel[(t,)](req_to_token, full_to_swa, *_rows(req_of_row, seq_lens_causal, out_cache_loc),
                          **_pointers(outs), stride_rr=req_to_token.stride(0), stride_rl=req_to_token.stride(1),
                          stride_f=full_to_swa.stride(0), R=req_to_token.shape[0], L=req_to_token.shape[1],
                          n_swa=full_to_swa.shape[0], W=SWA_WINDOW, num_warps=1)
    return tuple(outs.values())


def launch_build_c4_metadata(req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor, out_cache_loc: torch.Tensor,
                             topk: int, num_request_rows: int) -> tuple[torch.Tensor, ...]:
    """``(c4_out_loc, c4_visible, c4_topk_lengths)`` int32 [T] (docs/semantics.md §3.5, 3.6)."""
    t = seq_lens_causal.shape[0]
    outs = empty_outputs("build_c4_metadata", t, None, seq_lens_causal.device)
    if t:
        block = _block(t)
        _c4_kernel[(triton.cdiv(t, block),)](*_rows(req_of_row, seq_lens_causal, out_cache_loc), **_pointers(outs),
                                             T=t, R=num_request_rows, topk=topk, BLOCK=block, num_warps=4)
    return tuple(outs.values())


def launch_build_c128_metadata(page_table: torch.Tensor, req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor,
                               out_cache_loc: torch.Tensor, num_request_rows: int) -> tuple[torch.Tensor, ...]:
    """``(c128_out_loc [T], c128_indices [T, K], c128_lengths [T])`` int32 (docs/semantics.md §3.5)."""
    t, n_pages = page_table.shape
    outs = empty_outputs("build_c128_metadata", t, n_pages, page_table.device)
    width = outs["c128_indices"].shape[1]
    if t:
        block = _block(width)
        _c128_kernel[(t, max(triton.cdiv(width, block), 1))](  # block 0 writes the scalars
            page_table, *_rows(req_of_row, seq_lens_causal, out_cache_loc), **_pointers(outs),
            stride_pt=page_table.stride(0), stride_pp=page_table.stride(1), NP=n_pages, K=width, R=num_request_rows,
            BLOCK=block, num_warps=4)
    return tuple(outs.values())


def launch_step_metadata(req_rows: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                         out_cache_loc: torch.Tensor, req_to_token: torch.Tensor, req_to_page: torch.Tensor,
                         full_to_swa: torch.Tensor, topk: int) -> tuple[torch.Tensor, ...]:
    """Every field of the step (``metadata_chain.FIELDS``, in that order: the outputs of the five
    separate ops) from one launch."""
    t, n_pages = out_cache_loc.shape[0], req_to_page.shape[1]
    outs = empty_outputs(None, t, n_pages, out_cache_loc.device)
    width = outs["c128_indices"].shape[1]
    if t:
        block = _block(width // 2)  # pages per program; their c128 entries are twice as many
        b = req_rows.shape[0]
        _step_metadata_kernel[(t, max(triton.cdiv(width // 2, block), 1))](  # block 0: row scalars
            *_rows(req_rows, seq_lens, extend_lens, out_cache_loc), req_to_token, req_to_page, full_to_swa,
            **_pointers(outs), B=b, stride_rr=req_to_token.stride(0), stride_rl=req_to_token.stride(1),
            stride_pr=req_to_page.stride(0), stride_pp=req_to_page.stride(1), stride_f=full_to_swa.stride(0),
            R=req_to_token.shape[0], L=req_to_token.shape[1], n_swa=full_to_swa.shape[0], NP=n_pages, K=width,
            topk=topk, PAGE=PAGE_SIZE, W=SWA_WINDOW,
            BLOCK_B=_block(b), BLOCK=block, num_warps=4)
    return tuple(outs.values())
