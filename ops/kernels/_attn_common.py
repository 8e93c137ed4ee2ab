"""Triton helpers shared by the sparse-attention kernels: reading a query row's keys out of FP8
MODEL1 caches (layout.py) and the attention-sink gate.

A row's keys are its SWA list followed by its extra (c4 / c128) list, each cut at its length;
"positions" index that concatenation. An entry is 576 data bytes (448 fp8 e4m3 nope values, 64
bf16 rope values) in its page's data area plus 8 scale bytes (7 ue8m0 scales, one per 64-wide nope
tile) in the page's scale area.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ... import layout
from ...config import HEAD_DIM, NOPE_DIM, ROPE_DIM

TILE = tl.constexpr(layout.FP8_TILE)
NUM_NOPE_TILES = tl.constexpr(layout.NUM_TILES)
DATA_BYTES = tl.constexpr(layout.TOKEN_DATA_BYTES)
SCALE_BYTES = tl.constexpr(layout.TOKEN_SCALE_BYTES)
NOPE = tl.constexpr(NOPE_DIM)
ROPE = tl.constexpr(ROPE_DIM)
DIM = tl.constexpr(HEAD_DIM)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
assert layout.TOKEN_DATA_BYTES == NOPE_DIM + 2 * ROPE_DIM and ROPE_DIM == layout.FP8_TILE
assert HEAD_DIM == NOPE_DIM + ROPE_DIM


@triton.jit
def row_key_counts(swa_len, swa_width, ex_len, ex_width, row, HAS_EXTRA: tl.constexpr):
    """(SWA keys, all keys) of ``row``: each list's length clamped to [0, its width]."""
    n_swa = tl.minimum(tl.maximum(tl.load(swa_len + row), 0), swa_width).to(tl.int32)
    n_all = n_swa
    if HAS_EXTRA:
        n_all += tl.minimum(tl.maximum(tl.load(ex_len + row), 0), ex_width).to(tl.int32)
    return n_swa, n_all


@triton.jit
def _slots(idx_row, m, in_set, capacity, P: tl.constexpr):
    """Slots at list positions ``m [BLOCK_N]`` -> (page int64, offset in page, valid). Invalid:
    outside the list, negative (-1 holes) or >= capacity."""
    slot = tl.load(idx_row + m, mask=in_set, other=-1)
    ok = in_set & (slot >= 0) & (slot < capacity)
    slot = tl.where(ok, slot, 0).to(tl.int32)  # < capacity < 2^31
    return (slot // P).to(tl.int64), slot % P, ok


@triton.jit
def gather_entries(pos, hi, n_swa, row,
                   swa_cache, swa_page_stride, swa_capacity, swa_idx, stride_swa_idx,
                   ex_cache, ex_page_stride, ex_capacity, ex_idx, stride_ex_idx,
                   SWA_P: tl.constexpr, EX_P: tl.constexpr, HAS_EXTRA: tl.constexpr):
    """Entries at positions ``pos [BLOCK_N]`` of ``row`` -> (data, scales, valid): [BLOCK_N]
    uint8 pointers to each entry's data and scale bytes, and whether the position is below ``hi``
    and holds an in-range slot (invalid ones point at slot 0 of the SWA cache; mask their loads)."""
    in_swa = pos < n_swa
    page, off, valid = _slots(swa_idx + row * stride_swa_idx, pos, in_swa & (pos < hi), swa_capacity, SWA_P)
    base = swa_cache + page * swa_page_stride
    data = base + off * DATA_BYTES
    scales = base + SWA_P * DATA_BYTES + off * SCALE_BYTES
    if HAS_EXTRA:
        ex_page, ex_off, ex_valid = _slots(ex_idx + row * stride_ex_idx, pos - n_swa,
                                           (pos >= n_swa) & (pos < hi), ex_capacity, EX_P)
        ex_base = ex_cache + ex_page * ex_page_stride
        data = tl.where(in_swa, data, ex_base + ex_off * DATA_BYTES)
        scales = tl.where(in_swa, scales, ex_base + EX_P * DATA_BYTES + ex_off * SCALE_BYTES)
        valid = valid | ex_valid
    return data, scales, valid


@triton.jit
def dequant_nope(data, scale_word, valid, COL: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr):
    """Nope columns ``[COL, COL + WIDTH)`` of ``BLOCK_N`` entries -> ``[BLOCK_N, WIDTH]`` DTYPE
    (0 for invalid entries), for a run of whole tiles whose scales lie in one 4-byte word.
    scale_word: [BLOCK_N] int32, the entry's scale bytes 4w..4w+3 (little endian). The scale is
    broadcast per column (a [BN, tiles, 64] reshape costs 14 % more on the H200)."""
    cols = tl.arange(0, WIDTH) + COL
    raw = tl.load(data[:, None] + cols[None, :], mask=valid[:, None], other=0)
    e = (scale_word[:, None] >> (8 * ((cols // TILE) % 4))[None, :]) & 0xFF
    scale = (e << 23).to(tl.float32, bitcast=True)  # ue8m0 byte as fp32 exponent: 2^(e-127)
    return (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale).to(DTYPE)


@triton.jit
def scale_word(scales, valid, word):
    """Scale bytes ``4 word .. 4 word + 3`` of ``BLOCK_N`` entries as [BLOCK_N] int32 (0 for invalid
    ones): word 0 holds tiles 0-3, word 1 tiles 4-6. One 4-byte load per entry, which can be issued
    asynchronously ahead of its use (a 1-byte load cannot)."""
    return tl.load(scales.to(tl.pointer_type(tl.int32)) + word, mask=valid, other=0)


@triton.jit
def dequant_tile(data, word, valid, tile, DTYPE: tl.constexpr):
    """Nope tile ``tile`` (columns ``[64 tile, 64 tile + 64)``, runtime) of ``BLOCK_N`` entries ->
    ``[BLOCK_N, 64]`` DTYPE, 0 for invalid entries. word: the entries' scale word holding the tile
    (``scale_word(.., tile // 4)``)."""
    raw = tl.load(data[:, None] + (tl.arange(0, TILE) + tile * TILE)[None, :], mask=valid[:, None], other=0)
    scale = (((word >> (8 * (tile % 4))) & 0xFF) << 23).to(tl.float32, bitcast=True)  # 2^(e-127)
    return (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]).to(DTYPE)


@triton.jit
def load_rope(data, valid, DTYPE: tl.constexpr):
    """The 64 bf16 rope values of ``BLOCK_N`` entries -> ``[BLOCK_N, 64]`` DTYPE, 0 for invalid."""
    rope = (data + NOPE).to(tl.pointer_type(tl.bfloat16))
    return tl.load(rope[:, None] + tl.arange(0, ROPE)[None, :], mask=valid[:, None], other=0.0).to(DTYPE)


@triton.jit
def sink_gate(sink, heads, head_ok, lse2):
    """``1 / (1 + exp(sink - lse))`` for a base-2 ``lse2``; sink +inf -> 0, -inf -> 1."""
    s2 = tl.load(sink + heads, mask=head_ok, other=0.0) * LOG2E
    return 1.0 / (1.0 + tl.exp2(s2 - lse2))
