"""Fused sparse MQA with sink over FP8 MODEL1 caches (``dsv4::sparse_attn``, docs/semantics.md
§4.4) — Triton.

One program owns one query row, a block of up to 64 heads and one split of the row's key list. The
row's keys are the SWA list followed by the extra (c4 / c128) list, each cut at its length; a
split takes a contiguous range of that concatenation. Per block of ``BLOCK_N`` keys the program
gathers the entries by slot, dequantises them in registers (fp8 e4m3 x 2^(e-127) per 64-wide
tile, rope bf16 as is) and runs QK and PV on tensor cores against all heads of the block at once.
K is also V (all 512 dims). The 512 dims are handled as four column groups that line up with the
byte layout: nope [0, 256), [256, 384), [384, 448) and rope [448, 512).

Softmax state is base 2 inside the kernels (``s2 = q.k * scale * log2(e)``, running max ``m2``,
partial LSE ``lse2 = m2 + log2(l)``); the returned LSE is natural log and excludes the sink.
With one split the kernel finishes the row itself (sink gate, empty rows); with several it writes
the partials of ``sparse_attn_combine.py``, which merges them.

Shape legend: T = query rows, H = heads, HB = heads per program (power of two, 16..64),
S = splits, K1 / K2 = SWA / extra index widths, P1 / P2 = page sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ... import layout
from .host import INTERPRET
from .primitives import (DIM, DOT_MIN_ROWS, LOG2E, NOPE, ROPE, dequant_nope, finish_rows, gather_entries,
                         load_rope, row_key_counts, scale_word, softmax_rescale)
from .sparse_attn_args import row_kernel_args
from .sparse_attn_combine import Partials, finish_partial_rows, partial_index, split_count

if TYPE_CHECKING:
    from ...attention import KVSet

MAX_HEAD_BLOCK = 64  # an fp32 [64, 512] accumulator already fills half the register file
MIN_HEAD_BLOCK = DOT_MIN_ROWS  # heads of a program: at least one tl.dot tile of rows
# Column groups of a key: nope [0, 4 tiles), [4, 6), [6, 7) tiles, then rope. Each nope group is
# a whole number of 64-wide scale tiles whose scale bytes lie in one 4-byte word of the entry's
# scales (group 0: bytes 0-3, groups 1 and 2: bytes 4-7).
_G1 = tl.constexpr(4 * layout.FP8_TILE)
_G2 = tl.constexpr(6 * layout.FP8_TILE)
assert layout.NUM_TILES == 7


@dataclass(frozen=True)
class FusedConfig:
    """Tuning knobs of the fused kernel (benchmarks)."""

    block_n: int | None = None  # keys per block; None: ``choose_tiling``'s
    num_stages: int = 3  # software pipeline: indices, then entry bytes, then math


@triton.jit
def _load_q(q_rows, head_ok, COL: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr):
    """Columns ``[COL, COL + WIDTH)`` of q for the program's heads (0 for padding heads)."""
    return tl.load(q_rows + (tl.arange(0, WIDTH) + COL)[None, :], mask=head_ok[:, None], other=0.0).to(DTYPE)


@triton.jit
def _store_cols(dst, x, scale, mask, COL: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr):
    """``dst[:, COL:COL + WIDTH] = x * scale[:, None]`` cast to DTYPE."""
    tl.store(dst + (tl.arange(0, WIDTH) + COL)[None, :], (x * scale[:, None]).to(DTYPE), mask=mask)


@triton.jit
def _sparse_attn_fused(
    q, stride_qt, stride_qh, swa, ex, sink, out, lse, part_out, part_lse, num_heads, num_splits, softmax_scale,
    SWA_P: tl.constexpr, EX_P: tl.constexpr, HAS_EXTRA: tl.constexpr, SPLIT: tl.constexpr,
    HEAD_BLOCK: tl.constexpr, NUM_HEAD_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    """Grid ``(T * NUM_HEAD_BLOCKS, num_splits)``; arguments as ``sparse_attn_args.row_kernel_args``
    (swa / ex: the lists' ``EntryList`` tuples).

    Not SPLIT (num_splits == 1): writes out [T, H, 512] bf16 and lse [T, H] fp32 (natural log,
    no sink). Else: the partials of ``sparse_attn_combine.py``. PDL: let the combine launch now
    (its programs wait for this grid to finish before reading the partials)."""
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

    n_swa, n_all = row_key_counts(swa, ex, row, HAS_EXTRA)
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
        data, scales, valid = gather_entries(start + tl.arange(0, BLOCK_N), hi, n_swa, row, swa, ex,
                                             SWA_P, EX_P, HAS_EXTRA)
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
        m2, alpha, p = softmax_rescale(m2, s, 1, False)
        l = l * alpha + tl.sum(p, 1)
        pd = p.to(DTYPE)
        acc0 = tl.dot(pd, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pd, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(pd, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(pd, k3, acc3 * alpha[:, None])

    if not SPLIT:
        scale, row_lse = finish_rows(m2, l, sink, heads, head_ok)
        tl.store(lse + row * num_heads + heads, row_lse, mask=head_ok)
        dst = out + (row * num_heads + heads[:, None]) * DIM
        ODTYPE: tl.constexpr = tl.bfloat16
    else:
        scale, row_lse = finish_partial_rows(m2, l)
        part = partial_index(row, split, num_splits, num_heads, heads)
        tl.store(part_lse + part, row_lse, mask=head_ok)
        dst = part_out + part[:, None] * DIM
        ODTYPE: tl.constexpr = tl.float32
    mask = head_ok[:, None]
    _store_cols(dst, acc0, scale, mask, 0, _G1, ODTYPE)
    _store_cols(dst, acc1, scale, mask, _G1, _G2 - _G1, ODTYPE)
    _store_cols(dst, acc2, scale, mask, _G2, NOPE - _G2, ODTYPE)
    _store_cols(dst, acc3, scale, mask, NOPE, ROPE, ODTYPE)


def launch_fused(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                 softmax_scale: float, out: torch.Tensor, lse: torch.Tensor, partials: Partials | None, *,
                 head_block: int, block_n: int, num_stages: int, pdl: bool) -> None:
    """Fill ``out [T, H, 512] bf16`` and ``lse [T, H] fp32``, or with ``partials`` (several
    splits) the partial buffers. Inputs as normalised by ``sparse_attn_args.normalize``."""
    args, consts = row_kernel_args(q, swa, extra, attn_sink, softmax_scale, out, lse, partials)
    head_blocks = triton.cdiv(q.shape[1], head_block)
    _sparse_attn_fused[(q.shape[0] * head_blocks, split_count(partials))](
        *args, **consts, HEAD_BLOCK=head_block, NUM_HEAD_BLOCKS=head_blocks, BLOCK_N=block_n,
        DOT_F32=INTERPRET, PDL=pdl, num_warps=8, num_stages=num_stages)
