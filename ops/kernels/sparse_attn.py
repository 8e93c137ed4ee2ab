"""Fused sparse MQA with sink over FP8 MODEL1 caches (``dsv4::sparse_attn``, SPEC §4.4) — Triton.

One program owns one query row, a block of up to 64 heads and one split of the row's key list. The
row's keys are the SWA list followed by the extra (c4 / c128) list, each cut at its length; a
split takes a contiguous range of that concatenation. Per block of ``BLOCK_N`` keys the program
gathers the 584-byte entries by slot, dequantises them in registers (fp8 e4m3 x 2^(e-127) per
64-wide tile, rope bf16 as is) and runs QK and PV on tensor cores against all heads of the block
at once. K is also V (all 512 dims). The 512 dims are handled as four column groups that line up
with the byte layout: nope [0, 256), [256, 384), [384, 448) and rope [448, 512).

Softmax state is base 2 inside the kernels (``s2 = q.k * scale * log2(e)``, running max ``m2``,
partial LSE ``lse2 = m2 + log2(l)``); the returned LSE is natural log and excludes the sink.
With one split the main kernel finishes the row itself (sink gate, empty rows); with several it
writes partial ``(out / l, lse2)`` and ``_combine`` merges them.

``launch_sparse_attn`` is the entry point for three paths (``choose_path``): on sm_90 the
warp-specialised Gluon version of this kernel (``sparse_attn_ws.py``: the same work split and
combine, with producer warps dequantising keys while two consumer warpgroups run the dots); on
other GPUs this fused kernel for few rows (decode at small batch, where splitting the key list
fills the GPU) and the two-pass kernels of ``sparse_attn_two_pass.py`` for many (``use_two_pass``).

Shape legend: T = query rows, H = heads, HB = heads per program (power of two, 16..64),
S = splits, K1 / K2 = SWA / extra index widths, P1 / P2 = page sizes.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ... import layout
from ...config import HEAD_DIM, NOPE_DIM
from . import sparse_attn_two_pass as two_pass_kernels
from . import sparse_attn_ws as ws_kernels
from ._launch import INTERPRET, has_pdl, unit_stride
from ._attn_common import (DIM, LN2, LOG2E, NOPE, ROPE, dequant_nope, gather_entries, load_rope,
                           row_key_counts, scale_word, sink_gate)

_MAX_HEAD_BLOCK = 64  # an fp32 [64, 512] accumulator already fills half the register file
_MIN_HEAD_BLOCK = 16  # smallest tl.dot tile
# Column groups of a key: nope [0, 256), [256, 384), [384, 448), rope [448, 512). Each nope group
# is a whole number of 64-wide scale tiles whose scale bytes lie in one 4-byte word of the entry's
# scales (group 0: bytes 0-3, groups 1 and 2: bytes 4-7).
_G1 = tl.constexpr(256)
_G2 = tl.constexpr(384)
assert 256 == 4 * layout.FP8_TILE and 384 % layout.FP8_TILE == 0 and NOPE_DIM == 7 * layout.FP8_TILE


@triton.jit
def _load_q(q_rows, head_ok, COL: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr):
    """Columns ``[COL, COL + WIDTH)`` of q for the program's heads (0 for padding heads)."""
    return tl.load(q_rows + (tl.arange(0, WIDTH) + COL)[None, :], mask=head_ok[:, None], other=0.0).to(DTYPE)


@triton.jit
def _store_cols(dst, x, scale, mask, COL: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr):
    """``dst[:, COL:COL + WIDTH] = x * scale[:, None]`` cast to DTYPE."""
    tl.store(dst + (tl.arange(0, WIDTH) + COL)[None, :], (x * scale[:, None]).to(DTYPE), mask=mask)


@triton.jit
def _sparse_attn_fwd(
    q, stride_qt, stride_qh,
    swa_cache, swa_page_stride, swa_capacity, swa_idx, stride_swa_idx, swa_len, swa_width,
    ex_cache, ex_page_stride, ex_capacity, ex_idx, stride_ex_idx, ex_len, ex_width,
    sink, out, lse, part_out, part_lse, num_heads, num_splits, softmax_scale,
    SWA_P: tl.constexpr, EX_P: tl.constexpr, HAS_EXTRA: tl.constexpr, SPLIT: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, NUM_HEAD_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(T * NUM_HEAD_BLOCKS, num_splits)``.

    Not SPLIT (num_splits == 1): writes out [T, H, 512] bf16 and lse [T, H] fp32 (natural log,
    no sink). Else: part_out [T, S, H, 512] fp32 (normalised by the split's own sum) and part_lse [T, S, H]
    fp32 (base 2; -inf for a split without valid keys). PDL: let the combine launch now (its
    programs wait for this grid to finish before reading the partials)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    DTYPE: tl.constexpr = tl.float32 if DOT_F32 else tl.bfloat16  # interpreter: bf16 dots are garbage
    row = (tl.program_id(0) // NUM_HEAD_BLOCKS).to(tl.int64)
    heads = (tl.program_id(0) % NUM_HEAD_BLOCKS) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    head_ok = heads < num_heads
    split = tl.program_id(1)
    qk_scale = tl.cast(softmax_scale, tl.float32) * LOG2E  # logits in base 2

    q_rows = q + row * stride_qt + heads[:, None] * stride_qh
    q0 = _load_q(q_rows, head_ok, 0, _G1, DTYPE)
    q1 = _load_q(q_rows, head_ok, _G1, _G2 - _G1, DTYPE)
    q2 = _load_q(q_rows, head_ok, _G2, NOPE - _G2, DTYPE)
    q3 = _load_q(q_rows, head_ok, NOPE, ROPE, DTYPE)

    n_swa, n_all = row_key_counts(swa_len, swa_width, ex_len, ex_width, row, HAS_EXTRA)
    chunk = tl.cdiv(tl.cdiv(n_all, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_all)

    m2 = tl.full((HEAD_BLOCK,), float("-inf"), tl.float32)
    l = tl.zeros((HEAD_BLOCK,), tl.float32)
    acc0 = tl.zeros((HEAD_BLOCK, _G1), tl.float32)
    acc1 = tl.zeros((HEAD_BLOCK, _G2 - _G1), tl.float32)
    acc2 = tl.zeros((HEAD_BLOCK, NOPE - _G2), tl.float32)
    acc3 = tl.zeros((HEAD_BLOCK, ROPE), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        data, scales, valid = gather_entries(
            start + tl.arange(0, BLOCK_N), hi, n_swa, row,
            swa_cache, swa_page_stride, swa_capacity, swa_idx, stride_swa_idx,
            ex_cache, ex_page_stride, ex_capacity, ex_idx, stride_ex_idx, SWA_P, EX_P, HAS_EXTRA)
        s_lo = scale_word(scales, valid, 0)
        s_hi = scale_word(scales, valid, 1)
        k0 = dequant_nope(data, s_lo, valid, 0, _G1, DTYPE)
        k1 = dequant_nope(data, s_hi, valid, _G1, _G2 - _G1, DTYPE)
        k2 = dequant_nope(data, s_hi, valid, _G2, NOPE - _G2, DTYPE)
        k3 = load_rope(data, valid, DTYPE)

        s = tl.dot(q0, tl.trans(k0))
        s = tl.dot(q1, tl.trans(k1), s)
        s = tl.dot(q2, tl.trans(k2), s)
        s = tl.dot(q3, tl.trans(k3), s)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m2, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: p = 0, no NaN
        alpha = tl.exp2(m2 - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        m2 = m_new
        pd = p.to(DTYPE)
        acc0 = tl.dot(pd, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pd, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(pd, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(pd, k3, acc3 * alpha[:, None])

    empty = l == 0.0
    lse2 = tl.where(empty, 0.0, m2 + tl.log2(l))
    if not SPLIT:
        scale = tl.where(empty, 0.0, sink_gate(sink, heads, head_ok, lse2) / l)
        tl.store(lse + row * num_heads + heads, tl.where(empty, float("inf"), lse2 * LN2), mask=head_ok)
        dst = out + (row * num_heads + heads[:, None]) * DIM
        ODTYPE: tl.constexpr = tl.bfloat16
    else:
        scale = tl.where(empty, 0.0, 1.0 / l)
        slot = (row * num_splits + split) * num_heads + heads
        tl.store(part_lse + slot, tl.where(empty, float("-inf"), lse2), mask=head_ok)
        dst = part_out + slot[:, None] * DIM
        ODTYPE: tl.constexpr = tl.float32
    mask = head_ok[:, None]
    _store_cols(dst, acc0, scale, mask, 0, _G1, ODTYPE)
    _store_cols(dst, acc1, scale, mask, _G1, _G2 - _G1, ODTYPE)
    _store_cols(dst, acc2, scale, mask, _G2, NOPE - _G2, ODTYPE)
    _store_cols(dst, acc3, scale, mask, NOPE, ROPE, ODTYPE)


@triton.jit
def _combine(part_out, part_lse, sink, out, lse, num_heads, num_splits, SPLITS_POW2: tl.constexpr,
             COLS: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(T * H, 512 / COLS)``: merge the S partial ``(out / l, lse2)`` of one (row, head) over
    ``COLS`` output columns, apply the sink and write out [T, H, 512] bf16 (and lse [T, H] fp32,
    natural log, from the first column block). All splits are loaded at once: one memory round
    trip, not one per split. PDL: launched early; waits here for the main grid's partials."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    row_head = tl.program_id(0).to(tl.int64)
    head = row_head % num_heads
    first = (row_head // num_heads) * num_splits * num_heads + head  # split 0 of this (row, head)
    sp = tl.arange(0, SPLITS_POW2)
    has = sp < num_splits
    part = tl.load(part_lse + first + sp * num_heads, mask=has, other=float("-inf"))
    d = tl.program_id(1) * COLS + tl.arange(0, COLS)
    parts = tl.load(part_out + (first + sp * num_heads)[:, None] * DIM + d[None, :], mask=has[:, None], other=0.0)
    m2 = tl.max(part, 0)
    m_safe = tl.where(m2 == float("-inf"), 0.0, m2)
    w = tl.exp2(part - m_safe)  # 0 for splits without keys (their part_out is 0)
    total = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * parts, 0)
    empty = total == 0.0
    lse2 = tl.where(empty, 0.0, m_safe + tl.log2(total))
    gate = sink_gate(sink, head, True, lse2)
    tl.store(out + row_head * DIM + d, tl.where(empty, 0.0, acc * (gate / total)).to(tl.bfloat16))
    if tl.program_id(1) == 0:
        tl.store(lse + row_head, tl.where(empty, float("inf"), lse2 * LN2))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter: pretend to be an H200 so the split path is exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(num_rows: int, num_head_blocks: int, width: int, block_n: int, num_sms: int) -> int:
    """Key-range splits per (row, head block), from shapes only: fill one wave of SMs when rows
    are few, never more splits than key blocks; 1 (no combine) once rows alone fill the GPU."""
    programs = max(1, num_rows * num_head_blocks)
    return max(1, min(num_sms // programs, triton.cdiv(width, block_n)))


def choose_tiling(num_rows: int, num_heads: int, width: int, num_sms: int) -> tuple[int, int]:
    """(heads per program, keys per block), from shapes only.

    Heads: all of a row's heads up to 64 per program, except for one or two rows of at most 64
    heads over a short key list (one 32- or 64-key block per split covers it), where the GPU is
    nearly idle: then 16 heads per program, so four times the programs share the list (the gather
    repeats per head block; the dots, the accumulator and the partial stores shrink 4x). Keys: 64
    per block once rows fill the SMs with at most 2 splits (6-14 % faster), else 32.

    H200, µs with 16 / 64 heads per program (FlashMLA): c4 Flash (640 keys) b = 1 11.6 / 14.3
    (12.3), b = 2 13.6 / 15.8 (12.6); c128 at 128k b = 1 14.4 / 14.9 (14.1); not at 1M (9216
    keys: 33 / 27, b = 2 64 / 34), b = 4 or 128 heads.
    """
    if num_rows <= 2 and num_heads <= _MAX_HEAD_BLOCK:
        head_blocks = triton.cdiv(num_heads, _MIN_HEAD_BLOCK)
        for block_n in (32, 64):
            if choose_splits(num_rows, head_blocks, width, block_n, num_sms) * block_n >= width:
                return _MIN_HEAD_BLOCK, block_n
    head_block = min(_MAX_HEAD_BLOCK, max(_MIN_HEAD_BLOCK, triton.next_power_of_2(num_heads)))
    splits_32 = choose_splits(num_rows, triton.cdiv(num_heads, head_block), width, 32, num_sms)
    return head_block, 64 if splits_32 <= 2 else 32


def use_two_pass(num_rows: int, num_head_blocks: int, width: int) -> bool:
    """The two-pass kernels from 64 (row, head block) pairs on, or from 16 over key lists of at
    most 2048; the fused kernel, split over the key list, otherwise: with few rows the two-pass
    value kernel has 4 programs per pair, each walking the whole list.

    H200, µs fused / two-pass (FlashMLA): 64 heads, 640 keys, T = 8: 23.0 / 24.8 (14.1), T = 16:
    26.1 / 24.9 (16.0); 128 heads, 1152 keys, T = 8: 35.2 / 36.3, T = 16: 53.9 / 44.2; 8320 keys
    (c128 at 1M), T = 16: 176 / 234, T = 64: 577 / 451 (249).
    """
    programs = num_rows * num_head_blocks
    return programs >= 64 or (programs >= 16 and width <= 2048)


PATHS = ("fused", "warp_specialized", "two_pass")


def choose_path(num_rows: int, num_heads: int, head_block: int, width: int, device: torch.device) -> str:
    """``launch_sparse_attn``'s strategy, from the shapes, the fused kernel's heads per program
    (``choose_tiling``) and the device: the warp-specialised kernel on sm_90
    (``sparse_attn_ws.available``) wherever the fused kernel would use 64-head programs; elsewhere
    the two-pass kernels for many rows (``use_two_pass``) and the fused kernel for few. The 16-head
    fused programs of one or two rows stay (c4 Flash b=1: 11.5 µs against 12.1 warp-specialised)."""
    if head_block == ws_kernels.HEAD_BLOCK and ws_kernels.available(device):
        return "warp_specialized"
    if use_two_pass(num_rows, triton.cdiv(num_heads, head_block), width):
        return "two_pass"
    return "fused"


def launch_sparse_attn(q: torch.Tensor, swa_cache: torch.Tensor, swa_page_size: int,
                       swa_indices: torch.Tensor, swa_lengths: torch.Tensor,
                       extra_cache: torch.Tensor | None, extra_page_size: int,
                       extra_indices: torch.Tensor | None, extra_lengths: torch.Tensor | None,
                       attn_sink: torch.Tensor, softmax_scale: float, *, path: str | None = None,
                       num_splits: int | None = None, block_n: int | None = None, num_stages: int = 3,
                       pdl: bool | None = None, two_pass_config: dict | None = None,
                       ws_config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA with sink. Arguments as ``dsv4::sparse_attn`` (already checked).

    q: [T, H, 512] bf16; caches: [N_pages, page_bytes] uint8 (MODEL1, layout.py); indices: [T, K]
    int32/int64 slots; lengths: [T] int32/int64; attn_sink: [H] fp32. Returns ``out [T, H, 512]
    bf16`` and ``lse [T, H] fp32`` (natural log, sink excluded; +inf and out 0 for a row without
    valid keys). Never reads tensor values on the host (CUDA-graph safe).

    ``path``: one of ``PATHS`` (default ``choose_path``). ``num_splits`` overrides the shape-based
    split count of the fused and warp-specialised kernels (tests); ``block_n`` (keys per block,
    default from the shapes) and ``num_stages`` tune the fused kernel; ``two_pass_config`` and
    ``ws_config`` hold ``launch_two_pass``'s and ``launch_ws``'s knobs (benchmarks). ``pdl``: launch
    the fused kernel's split combine with programmatic dependent launch, so its launch overlaps the
    main grid (default: on sm_90+).
    """
    T, H, _ = q.shape
    q, swa_cache, swa_indices, swa_lengths, attn_sink = map(
        unit_stride, (q, swa_cache, swa_indices, swa_lengths, attn_sink))
    if extra_cache is not None:
        extra_cache, extra_indices, extra_lengths = map(unit_stride,
                                                        (extra_cache, extra_indices, extra_lengths))
    out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    has_extra = extra_cache is not None
    width = swa_indices.shape[1] + (extra_indices.shape[1] if has_extra else 0)
    num_sms = _num_sms(q.device)
    head_block, default_block_n = choose_tiling(T, H, width, num_sms)
    path = path or choose_path(T, H, head_block, width, q.device)
    if path not in PATHS:
        raise ValueError(f"launch_sparse_attn: path={path!r}; expected one of {PATHS}")
    if path == "warp_specialized" and not ws_kernels.available(q.device):
        raise ValueError("launch_sparse_attn: the warp-specialised kernel needs Gluon from Triton 3.6 "
                         "and an sm_90 GPU")
    if T == 0:
        return out, lse
    if not has_extra:  # unused pointers / widths of the absent list
        extra_cache, extra_indices, extra_lengths, extra_page_size = swa_cache, swa_indices, swa_lengths, 1
    if path == "two_pass":
        two_pass_kernels.launch_two_pass(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache,
                                         extra_page_size, extra_indices, extra_lengths, attn_sink,
                                         softmax_scale, out, lse, has_extra=has_extra, head_block=head_block,
                                         **(two_pass_config or {}))
        return out, lse
    ws_config = ws_config or {}
    if path == "warp_specialized":
        head_block, block_n = ws_kernels.HEAD_BLOCK, ws_config.get("block_n", ws_kernels.BLOCK_N)
    else:
        block_n = block_n or default_block_n
    head_blocks = triton.cdiv(H, head_block)
    splits = num_splits or choose_splits(T, head_blocks, width, block_n, num_sms)
    if splits > 1:
        part_out = torch.empty(T, splits, H, HEAD_DIM, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, splits, H, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = lse  # unused
    # PDL pays off when the main grid lets the combine launch early (the fused kernel does)
    pdl = splits > 1 and path == "fused" and (has_pdl(q.device) if pdl is None else pdl)
    if path == "warp_specialized":
        ws_kernels.launch_ws(q, (swa_cache, swa_page_size, swa_indices, swa_lengths),
                             (extra_cache, extra_page_size, extra_indices, extra_lengths), attn_sink,
                             softmax_scale, out, lse, part_out, part_lse, splits=splits, has_extra=has_extra,
                             **ws_config)
    else:
        _sparse_attn_fwd[(T * head_blocks, splits)](
            q, q.stride(0), q.stride(1),
            swa_cache, swa_cache.stride(0), swa_cache.shape[0] * swa_page_size, swa_indices,
            swa_indices.stride(0), swa_lengths, swa_indices.shape[1],
            extra_cache, extra_cache.stride(0), extra_cache.shape[0] * extra_page_size, extra_indices,
            extra_indices.stride(0), extra_lengths, extra_indices.shape[1] if has_extra else 0,
            attn_sink, out, lse, part_out, part_lse, H, splits, softmax_scale,
            SWA_P=swa_page_size, EX_P=extra_page_size, HAS_EXTRA=has_extra, SPLIT=splits > 1,
            HEAD_BLOCK=head_block, NUM_HEAD_BLOCKS=head_blocks, BLOCK_N=block_n, DOT_F32=INTERPRET,
            PDL=pdl, num_warps=8, num_stages=num_stages,  # 3 stages: indices, then entry bytes, then math
        )
    if splits > 1:
        splits_pow2 = triton.next_power_of_2(splits)
        cols = min(HEAD_DIM, max(16, 4096 // splits_pow2))  # [S, cols] fp32 tile: <= 32 registers per thread
        _combine[(T * H, HEAD_DIM // cols)](part_out, part_lse, attn_sink, out, lse, H, splits,
                                            SPLITS_POW2=splits_pow2, COLS=cols, PDL=pdl, num_warps=4,
                                            launch_pdl=pdl)
    return out, lse
