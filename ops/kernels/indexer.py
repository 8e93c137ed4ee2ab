"""Triton kernels of the lightning indexer (docs/semantics.md §4.3): ``dsv4::indexer_prepare_q`` and
``dsv4::indexer_topk``.

``indexer_prepare_q`` (grid ``[T, H / BH]``): RoPE on dims 64..127 at the row's position, the
128-point Walsh-Hadamard transform (first butterfly as even/odd sum and difference, the 64-point
rest as a ``tl.dot`` with the ±1 matrix: 3xTF32 on the GPU, about fp32 accuracy), per-(row, head)
fp8 quantisation ``sigma = max(amax, 1e-4) / 448`` (IEEE division, as the reference) and
``w = weights * weight_scale * sigma``.

``indexer_topk`` = the logits scan here + the radix select of ``topk_select.py``:

* ``_logits_kernel`` (grid ``[T, S]``): program ``(q, s)`` scores tiles ``s, s + S, ...`` of the
  row's visible prefix only (``n_q = min(visible[q], capacity)``; rows with ``n_q <= k`` skip) into
  an fp32 workspace ``[T, capacity]``, and records its tiles' min / max for the select. A tile is
  one page of 64 entries: its id from the page table, then 64 x 128 contiguous fp8 key bytes and
  64 fp32 scales straight from the 8448-byte page; ``dot = K~ . Q~^T`` is an fp8 x fp8 -> fp32
  ``tl.dot`` (heads padded to >= 16; products exact, but Hopper's fp8 MMA accumulates with
  reduced precision, about 2^-14 relative to the sum of |products|), then
  ``l = kappa * sum_h w_h * relu(dot_h)``. Cost is proportional to the visible length; ``S`` only
  spreads a row over several programs (about ``_SCAN_PROGRAMS`` in all).
* Rows are scored in chunks of at most ``_WORKSPACE_ELEMS / capacity`` rows (a host loop over
  shapes only), each followed by the select.

Shape legend: T = rows, H = indexer heads, NP = pages per request, K = topk,
capacity = NP * 64 entries addressable by a row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ... import layout
from ...config import INDEX_HEAD_DIM
from .host import INTERPRET, has_pdl, unit_stride
from .primitives import hadamard_pm1, to_e4m3_bits
from .topk_select import launch_topk_select

_SCAN_PROGRAMS = 4096  # programs the logits scan aims for (~31 per H200 SM: more pages in flight)
# Pages per scan program at least, by the pages a chunk scans (the first bound at or above them):
# latency-bound scans spread wide, larger ones amortise each program's setup. H200, µs with 4 / 8
# pages: b=1 at 8k 3.7 / 5.2, b=1 at 128k 4.1 / 5.4; b=256 at 8k 22.7 / 20.9, b=32 at 128k 42.8 /
# 40.1, b=4 at 1M 44.7 / 42.1 (b=256 at 128k and b=32 at 1M: capped by _SCAN_PROGRAMS, unchanged).
# Scan and select of one row of 16 / 32 pages with 1, 2 and 4 pages: 5.1, 5.4, 6.1 / 7.0, 7.2, 7.2.
_MIN_SCAN_PAGES = ((64, 1), (4095, 4), (float("inf"), 8))
_HALF = tl.constexpr(INDEX_HEAD_DIM // 2)
_DIM = tl.constexpr(INDEX_HEAD_DIM)
_FP8_MAX = tl.constexpr(layout.FP8_MAX)
_EPS = tl.constexpr(layout.INDEX_SCALE_EPS)
_PDL_MAX_SCORED = 1 << 17  # rows x capacity (entries) up to which scan and select chain under PDL
_WORKSPACE_ELEMS = 1 << 25  # fp32 logits per workspace chunk (128 MiB); longer batches loop over rows


@triton.jit
def _prepare_q_kernel(q_ptr, wts_ptr, pos_ptr, inv_freq_ptr, qo_ptr, wo_ptr, weight_scale, H,
                      stride_qt, stride_qh, stride_wt, stride_ot, stride_oh, stride_wot,
                      BH: tl.constexpr, HSCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      SOFT_FP8: tl.constexpr):
    HALF: tl.constexpr = _HALF
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    k = tl.arange(0, HALF)
    hm = (h < H)[:, None]
    base = q_ptr + row * stride_qt + h[:, None] * stride_qh
    ev = tl.load(base + 2 * k[None, :], mask=hm, other=0.0).to(tl.float32)
    od = tl.load(base + 2 * k[None, :] + 1, mask=hm, other=0.0).to(tl.float32)
    # loaded with q: after the stores below the load could not be moved above them (they may alias)
    wts = tl.load(wts_ptr + row * stride_wt + h, mask=h < H, other=0.0).to(tl.float32)
    # RoPE: pairs k >= 32 (dims 64..127), angle float32(pos) * inv_freq[k - 32]
    f = k - (HALF - 32)
    is_rope = (f >= 0)[None, :]
    pos = tl.cast(tl.load(pos_ptr + row), tl.float32)
    ang = pos * tl.load(inv_freq_ptr + tl.maximum(f, 0), mask=f >= 0, other=0.0)[None, :]
    cos, sin = tl.cos(ang), tl.sin(ang)
    ev, od = tl.where(is_rope, ev * cos - od * sin, ev), tl.where(is_rope, ev * sin + od * cos, od)
    # WHT_128 / sqrt(128) = even/odd butterfly, then the 64-point Hadamard as a matrix product
    hmat = hadamard_pm1(HALF)
    y_ev = tl.dot(ev + od, hmat, input_precision=DOT_PRECISION) * HSCALE
    y_od = tl.dot(ev - od, hmat, input_precision=DOT_PRECISION) * HSCALE
    amax = tl.maximum(tl.max(tl.abs(y_ev), axis=1), tl.max(tl.abs(y_od), axis=1))
    sigma = tl.math.div_rn(tl.maximum(amax, _EPS), tl.full([BH], _FP8_MAX, tl.float32))
    q_ev = to_e4m3_bits(tl.clamp(tl.math.div_rn(y_ev, sigma[:, None]), -_FP8_MAX, _FP8_MAX), SOFT_FP8)
    q_od = to_e4m3_bits(tl.clamp(tl.math.div_rn(y_od, sigma[:, None]), -_FP8_MAX, _FP8_MAX), SOFT_FP8)
    out = qo_ptr + row * stride_ot + h[:, None] * stride_oh
    tl.store(out + 2 * k[None, :], q_ev, mask=hm)
    tl.store(out + 2 * k[None, :] + 1, q_od, mask=hm)
    tl.store(wo_ptr + row * stride_wot + h, wts * tl.cast(weight_scale, tl.float32) * sigma, mask=h < H)


def launch_indexer_prepare_q(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                             inv_freq: torch.Tensor, weight_scale: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_fp8 [T, H, 128] float8_e4m3fn, w [T, H] fp32)``.

    q: [T, H, 128] bf16/fp32; weights: [T, H] bf16/fp32; positions: [T] int32/int64;
    inv_freq: [32] fp32. Validated by the op (``ops/indexer.py::_check_prepare``).
    """
    num_rows, num_heads, _ = q.shape
    q, weights = unit_stride(q), unit_stride(weights)
    q_fp8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    w = torch.empty(num_rows, num_heads, dtype=torch.float32, device=q.device)
    if num_rows == 0 or num_heads == 0:
        return q_fp8, w
    bh = 16  # heads per program: tl.dot needs M >= 16; more would spill the fp32 tiles
    q_u8 = q_fp8.view(torch.uint8)
    _prepare_q_kernel[(num_rows, triton.cdiv(num_heads, bh))](
        q, weights, positions.contiguous(), inv_freq.contiguous(), q_u8, w, weight_scale, num_heads,
        q.stride(0), q.stride(1), weights.stride(0), q_u8.stride(0), q_u8.stride(1), w.stride(0),
        BH=bh, HSCALE=1.0 / math.sqrt(INDEX_HEAD_DIM), DOT_PRECISION="ieee" if INTERPRET else "tf32x3",
        SOFT_FP8=INTERPRET, num_warps=4)
    return q_fp8, w


@triton.jit
def _logits_kernel(q_ptr, w_ptr, cache_ptr, scale_ptr, pt_ptr, vis_ptr, workspace_ptr, mm_ptr,
                   row0, H, capacity, num_pages, topk, num_splits, stride_qt, stride_qh, stride_wt, stride_pt,
                   stride_page, stride_scale_page, stride_workspace,
                   BH: tl.constexpr, PAGE: tl.constexpr, SCALE_OFF: tl.constexpr,
                   DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the select's first kernel may launch now (it waits for this grid before reading)
        tl.extra.cuda.gdc_launch_dependents()
    D: tl.constexpr = _DIM
    r = tl.program_id(0)
    split = tl.program_id(1)
    row = (row0 + r).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(vis_ptr + row).to(tl.int32), 0), capacity)
    lo = tl.full([PAGE], float("inf"), tl.float32)  # elementwise over the row's tiles
    hi = tl.full([PAGE], float("-inf"), tl.float32)
    if n > topk:  # rows with n <= topk take every visible entry unscored (topk_select)
        h = tl.arange(0, BH)
        d = tl.arange(0, D)
        q = tl.load(q_ptr + row * stride_qt + h[:, None] * stride_qh + d[None, :], mask=(h < H)[:, None],
                    other=0).to(tl.float8e4nv, bitcast=True)  # [BH, 128]
        w = tl.load(w_ptr + row * stride_wt + h, mask=h < H, other=0.0)  # [BH]
        if DOT_F32:  # the interpreter's fp8 dot path is exact but slow; fp32 is exact as well
            q = q.to(tl.float32)
        workspace_row = workspace_ptr + r.to(tl.int64) * stride_workspace
        e = tl.arange(0, PAGE)
        for t in range(split, tl.cdiv(n, PAGE), num_splits):  # one page (64 contiguous entries) per tile
            page = tl.load(pt_ptr + row * stride_pt + t).to(tl.int64)
            in_cache = (page >= 0) & (page < num_pages)  # else zero keys and scales: logits 0
            keys = tl.load(cache_ptr + page * stride_page + (e * D)[:, None] + d[None, :], mask=in_cache, other=0)
            keys = keys.to(tl.float8e4nv, bitcast=True)  # [64, 128]
            kappa = tl.load(scale_ptr + page * stride_scale_page + SCALE_OFF + e, mask=in_cache, other=0.0)  # [64]
            if DOT_F32:
                keys = keys.to(tl.float32)
            dots = tl.dot(keys, tl.trans(q))  # [64, BH] fp32
            logit = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1) * kappa
            j = t * PAGE + e
            valid = j < n
            tl.store(workspace_row + j, logit, mask=valid)
            lo = tl.minimum(lo, tl.where(valid, logit, float("inf")))
            hi = tl.maximum(hi, tl.where(valid, logit, float("-inf")))
    mm = mm_ptr + (r * num_splits + split).to(tl.int64) * 2
    tl.store(mm, tl.min(lo, axis=0))
    tl.store(mm + 1, tl.max(hi, axis=0))


def indexer_workspace(num_rows: int, capacity: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers of one chunk of rows: logits ``[C, capacity] fp32`` and the scan's per-split
    min / max ``[C, S, 2] fp32`` (``C`` rows bounded by ``_WORKSPACE_ELEMS``; ``S`` splits)."""
    chunk = max(1, min(num_rows, _WORKSPACE_ELEMS // capacity))
    pages = capacity // layout.INDEX_PAGE_SIZE
    min_pages = next(least for bound, least in _MIN_SCAN_PAGES if chunk * pages <= bound)
    splits = max(1, min(pages // min_pages, triton.cdiv(_SCAN_PROGRAMS, chunk)))
    return (torch.empty(chunk, capacity, dtype=torch.float32, device=device),
            torch.empty(chunk, splits, 2, dtype=torch.float32, device=device))


def launch_indexer_logits(q_fp8: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                          page_table: torch.Tensor, visible: torch.Tensor, topk: int, workspace: torch.Tensor,
                          minmax: torch.Tensor, row0: int = 0, pdl: bool = False) -> None:
    """Score rows ``row0 .. row0 + C`` (clipped to T) into ``workspace[:, :visible]`` and ``minmax``
    (buffers from :func:`indexer_workspace`); rows with ``visible <= topk`` are skipped.
    Arguments as in :func:`launch_indexer_topk` (page_table contiguous). ``pdl``: let the next
    kernel (the select's, launched with PDL) start early."""
    num_rows, num_heads, _ = q_fp8.shape
    rows = min(workspace.shape[0], num_rows - row0)
    if rows <= 0:
        return
    if index_cache.stride(-1) != 1:
        raise ValueError("indexer_topk kernel: index_cache pages must be contiguous bytes")
    q_u8 = q_fp8.view(torch.uint8)
    q_u8, w = unit_stride(q_u8), unit_stride(w)
    scales = index_cache.view(torch.float32)  # [N_pages, 2112]: the fp32 scales live at 2048 + i
    splits = minmax.shape[1]
    _logits_kernel[(rows, splits)](
        q_u8, w, index_cache, scales, page_table, visible, workspace, minmax, row0, num_heads, workspace.shape[1],
        index_cache.shape[0], topk, splits, q_u8.stride(0), q_u8.stride(1), w.stride(0), page_table.stride(0),
        index_cache.stride(0), scales.stride(0), workspace.stride(0), BH=max(16, triton.next_power_of_2(num_heads)),
        PAGE=layout.INDEX_PAGE_SIZE, SCALE_OFF=layout.INDEX_PAGE_SIZE * INDEX_HEAD_DIM // 4,
        DOT_F32=INTERPRET, PDL=pdl, num_warps=4, num_stages=6)  # H200: 80% of HBM at 128k-1M (60-66% with 3-4 stages)


def launch_indexer_topk(q_fp8: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                        page_table: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """``[T, topk] int32`` c4 slots (``page_table[q, j // 64] * 64 + j % 64``), -1 padded.

    q_fp8: [T, H, 128] float8_e4m3fn; w: [T, H] fp32; index_cache: [N_pages, 8448] uint8
    (contiguous pages); page_table: [T, NP] int32/int64; visible: [T] int32/int64.
    Rows with ``visible <= topk`` select every visible entry in order; the others the ``topk``
    largest logits (order unspecified). ``visible`` is clamped to ``[0, capacity]``; entries on
    pages outside ``index_cache`` score 0 and come out as -1. Rows are processed in workspace chunks (a shape-derived
    host loop). Validated by the op (``ops/indexer.py::_check_topk``).
    """
    num_rows = q_fp8.shape[0]
    capacity = page_table.shape[1] * layout.INDEX_PAGE_SIZE
    page_table, visible = page_table.contiguous(), visible.contiguous()
    out = torch.empty(num_rows, topk, dtype=torch.int32, device=q_fp8.device)
    if num_rows == 0:
        return out
    if capacity <= topk:  # no row can have more visible entries than topk: nothing to score
        launch_topk_select(None, None, page_table, visible, out, 0, topk, capacity, index_cache.shape[0], num_rows)
        return out
    workspace, minmax = indexer_workspace(num_rows, capacity, q_fp8.device)
    # small scans: the select's launches overlap the scan's and each other's tails (H200, b = 1
    # at 8k: 20.3 -> 18.6 µs); large ones run slower with PDL (b = 32 at 128k: 75 -> 90 µs)
    pdl = num_rows * capacity <= _PDL_MAX_SCORED and has_pdl(q_fp8.device)
    for row0 in range(0, num_rows, workspace.shape[0]):  # each chunk's scan waits for the last select
        launch_indexer_logits(q_fp8, w, index_cache, page_table, visible, topk, workspace, minmax, row0, pdl=pdl)
        launch_topk_select(workspace, minmax, page_table, visible, out, row0, topk, capacity, index_cache.shape[0],
                           min(workspace.shape[0], num_rows - row0), pdl=pdl)
    return out
