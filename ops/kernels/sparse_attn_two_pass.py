"""Sparse MQA with sink for many query rows (``dsv4::sparse_attn``, docs/semantics.md §4.4) in two
passes — Triton.

The fused kernel (``sparse_attn_fused.py``) keeps an fp32 [64, 512] accumulator per program: one
program per SM, and its QK and PV dots wait on each other and on the dequantisation. With many
rows there is enough parallel work to split the attention instead into two GEMM-shaped kernels
with [64, 128] accumulators, two programs per SM:

1. ``_block_scores``, one program per (row, head block, block of ``BLOCK_N`` keys): ``s = q.k``
   over the 7 fp8 nope tiles and the rope tile, then the block's own softmax: probabilities
   ``exp2(s2 - m_blk)`` (bf16) and the block's max ``m_blk`` and sum ``l_blk`` (fp32, base 2).
2. ``_block_values``, one program per (row, head block, pair of 64-column tiles of the 512
   output dims): the row max and sum from the block statistics, then
   ``sum_blk exp2(m_blk - m) p_blk @ v_blk`` over the pair's columns, the sink gate and the store.

Costs against the fused kernel: the probabilities round-trip through memory (2 bytes per head and
key) and entries are read twice (once whole, once 128 columns per program). Rows are done in
chunks so the probability workspace stays under ``_WORKSPACE_BYTES``.

H200, µs at 64 heads (fused kernel / two-pass with 64- / 128-key blocks, single / paired column
tiles): c4 b=128 90.9 / 127.7 (64, single), 109.6 (128, single), 85.1 (128, paired); c128 at 1M
b=64 583 / 452 (128, paired). Paired tiles halve the re-reads of the probabilities and the
per-block index work; 8 warps, ``maxnreg`` caps and a keys-major QK (k as the register operand)
were no faster.

Shape legend: T = query rows, H = heads, HB = heads per program, NB = key blocks per row
(``cdiv(K1 + K2, BLOCK_N)``), W = NB * BLOCK_N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ... import layout
from ...config import HEAD_DIM
from .host import INTERPRET
from .primitives import (DIM, LOG2E, NUM_NOPE_TILES, TILE, dequant_tile, finish_rows, gather_entries, load_rope,
                         row_key_counts, scale_word, softmax_rescale)
from .sparse_attn_args import entry_lists, key_width

if TYPE_CHECKING:
    from ...attention import KVSet

_NUM_PAIRS = HEAD_DIM // (2 * layout.FP8_TILE)  # output column pairs of 64-wide tiles (7 nope + rope)
_COL_PAIRS = tl.constexpr(_NUM_PAIRS)
_WORKSPACE_BYTES = 1 << 29  # probabilities of one chunk of rows (512 MiB)
_STATS_BLOCK = 64  # block statistics read per step by _block_values


@dataclass(frozen=True)
class TwoPassConfig:
    """Tuning knobs of the two-pass kernels (benchmarks); the defaults are the H200's best."""

    block_n: int = 128  # keys per score block
    num_warps: tuple[int, int] = (4, 4)  # of _block_scores, _block_values
    num_stages: tuple[int, int] = (3, 3)  # their software pipelines


@triton.jit
def _block_scores(
    q, stride_qt, stride_qh, swa, ex, probs, block_max, block_sum, num_heads, num_blocks, softmax_scale,
    SWA_P: tl.constexpr, EX_P: tl.constexpr, HAS_EXTRA: tl.constexpr, HEAD_BLOCK: tl.constexpr,
    NUM_HEAD_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Grid ``(T * NUM_HEAD_BLOCKS * NB,)``, the key block fastest (a row's blocks share its q in L2);
    swa / ex: the lists' ``sparse_attn_args.EntryList`` tuples.

    Writes probs [T, H, W] DTYPE ``exp2(s2 - m_blk)`` (0 for invalid keys) and block_max /
    block_sum [T, H, NB] fp32 (base 2; -inf / 0 for a block without valid keys). Blocks past the
    row's keys are skipped (never read)."""
    pid = tl.program_id(0)
    block = pid % num_blocks
    row_hb = pid // num_blocks
    row = (row_hb // NUM_HEAD_BLOCKS).to(tl.int64)
    heads = (row_hb % NUM_HEAD_BLOCKS) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    head_ok = heads < num_heads
    n_swa, n_all = row_key_counts(swa, ex, row, HAS_EXTRA)
    pos = block * BLOCK_N + tl.arange(0, BLOCK_N)
    if block * BLOCK_N < n_all:
        data, scales, valid = gather_entries(pos, n_all, n_swa, row, swa, ex, SWA_P, EX_P, HAS_EXTRA)
        q_rows = q + row * stride_qt + heads[:, None] * stride_qh + tl.arange(0, TILE)[None, :]
        s_lo = scale_word(scales, valid, 0)
        s_hi = scale_word(scales, valid, 1)
        acc = tl.zeros((HEAD_BLOCK, BLOCK_N), tl.float32)
        for tile in tl.range(0, NUM_NOPE_TILES, num_stages=NUM_STAGES):
            q_tile = tl.load(q_rows + tile * TILE, mask=head_ok[:, None], other=0.0).to(DTYPE)
            k_tile = dequant_tile(data, tl.where(tile < 4, s_lo, s_hi), valid, tile, DTYPE)
            acc = tl.dot(q_tile, tl.trans(k_tile), acc)
        q_rope = tl.load(q_rows + NUM_NOPE_TILES * TILE, mask=head_ok[:, None], other=0.0).to(DTYPE)
        acc = tl.dot(q_rope, tl.trans(load_rope(data, valid, DTYPE)), acc)

        s2 = tl.where(valid[None, :], acc * (tl.cast(softmax_scale, tl.float32) * LOG2E), float("-inf"))
        m2 = tl.max(s2, 1)
        p = tl.exp2(s2 - tl.where(m2 == float("-inf"), 0.0, m2)[:, None])
        row_heads = row * num_heads + heads
        tl.store(probs + row_heads[:, None] * (num_blocks * BLOCK_N) + pos[None, :], p.to(DTYPE),
                 mask=head_ok[:, None])
        tl.store(block_max + row_heads * num_blocks + block, m2, mask=head_ok)
        tl.store(block_sum + row_heads * num_blocks + block, tl.sum(p, 1), mask=head_ok)


@triton.jit
def _weighted_values(acc_a, acc_b, probs_rows, block_max_rows, m2, n_blocks, head_ok, tile, n_swa, n_all, row,
                     swa, ex, SWA_P: tl.constexpr, EX_P: tl.constexpr, HAS_EXTRA: tl.constexpr, ROPE: tl.constexpr,
                     BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, NUM_STAGES: tl.constexpr):
    """``acc_a += sum_blk exp2(m_blk - m2) p_blk @ v_blk[:, tile]`` over the row's key blocks, and
    ``acc_b`` likewise for tile ``tile + 1`` (nope, fp8) or, if ``ROPE``, the rope tile (bf16)."""
    for block in tl.range(0, n_blocks, num_stages=NUM_STAGES):
        pos = block * BLOCK_N + tl.arange(0, BLOCK_N)
        data, scales, valid = gather_entries(pos, n_all, n_swa, row, swa, ex, SWA_P, EX_P, HAS_EXTRA)
        weight = tl.exp2(tl.load(block_max_rows + block, mask=head_ok, other=float("-inf")) - m2)
        p = tl.load(probs_rows + pos[None, :], mask=head_ok[:, None], other=0.0).to(tl.float32)
        p = (p * weight[:, None]).to(DTYPE)
        word = scale_word(scales, valid, tile // 4)  # an even tile and the next share a scale word
        acc_a = tl.dot(p, dequant_tile(data, word, valid, tile, DTYPE), acc_a)
        if ROPE:
            v_b = load_rope(data, valid, DTYPE)
        else:
            v_b = dequant_tile(data, word, valid, tile + 1, DTYPE)
        acc_b = tl.dot(p, v_b, acc_b)
    return acc_a, acc_b


@triton.jit
def _block_values(
    probs, block_max, block_sum, swa, ex, sink, out, lse, num_heads, num_blocks,
    SWA_P: tl.constexpr, EX_P: tl.constexpr, HAS_EXTRA: tl.constexpr, HEAD_BLOCK: tl.constexpr,
    NUM_HEAD_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, STATS_BLOCK: tl.constexpr,
    DTYPE: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Grid ``(T * NUM_HEAD_BLOCKS * 4,)``, the column pair fastest (a row's 4 pairs share its
    probabilities in L2). Pair ``g`` writes out [T, H, 512] bf16 columns ``[128 g, 128 g + 128)``
    (tiles 2g and 2g + 1; pair 3 is nope tile 6 and the rope tile) and, from pair 0, lse [T, H]
    fp32 (natural log, no sink; +inf and out 0 for a row without valid keys). swa / ex: the lists'
    ``sparse_attn_args.EntryList`` tuples."""
    pid = tl.program_id(0)
    tile = 2 * (pid % _COL_PAIRS)
    row_hb = pid // _COL_PAIRS
    row = (row_hb // NUM_HEAD_BLOCKS).to(tl.int64)
    heads = (row_hb % NUM_HEAD_BLOCKS) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    head_ok = heads < num_heads
    row_heads = row * num_heads + heads
    n_swa, n_all = row_key_counts(swa, ex, row, HAS_EXTRA)
    n_blocks = tl.cdiv(n_all, BLOCK_N)

    # Row max and sum over the blocks' statistics (online, STATS_BLOCK blocks per step).
    stats = row_heads[:, None] * num_blocks + tl.arange(0, STATS_BLOCK)[None, :]
    m2 = tl.full((HEAD_BLOCK,), float("-inf"), tl.float32)
    l = tl.zeros((HEAD_BLOCK,), tl.float32)
    for first in range(0, n_blocks, STATS_BLOCK):
        mask = head_ok[:, None] & (tl.arange(0, STATS_BLOCK)[None, :] < n_blocks - first)
        b_max = tl.load(block_max + stats + first, mask=mask, other=float("-inf"))
        b_sum = tl.load(block_sum + stats + first, mask=mask, other=0.0)
        m2, alpha, weight = softmax_rescale(m2, b_max, 1, False)
        l = l * alpha + tl.sum(b_sum * weight, 1)
    m_safe = tl.where(m2 == float("-inf"), 0.0, m2)

    probs_rows = probs + row_heads[:, None] * (num_blocks * BLOCK_N)
    block_max_rows = block_max + row_heads * num_blocks
    acc_a = tl.zeros((HEAD_BLOCK, TILE), tl.float32)
    acc_b = tl.zeros((HEAD_BLOCK, TILE), tl.float32)
    if tile + 1 < NUM_NOPE_TILES:
        acc_a, acc_b = _weighted_values(acc_a, acc_b, probs_rows, block_max_rows, m_safe, n_blocks, head_ok, tile,
                                        n_swa, n_all, row, swa, ex, SWA_P, EX_P, HAS_EXTRA, False, BLOCK_N, DTYPE,
                                        NUM_STAGES)
    else:
        acc_a, acc_b = _weighted_values(acc_a, acc_b, probs_rows, block_max_rows, m_safe, n_blocks, head_ok, tile,
                                        n_swa, n_all, row, swa, ex, SWA_P, EX_P, HAS_EXTRA, True, BLOCK_N, DTYPE,
                                        NUM_STAGES)

    scale, row_lse = finish_rows(m_safe, l, sink, heads, head_ok)
    dst = out + row_heads[:, None] * DIM + (tile * TILE + tl.arange(0, TILE))[None, :]
    tl.store(dst, (acc_a * scale[:, None]).to(tl.bfloat16), mask=head_ok[:, None])
    tl.store(dst + TILE, (acc_b * scale[:, None]).to(tl.bfloat16), mask=head_ok[:, None])
    if tile == 0:
        tl.store(lse + row_heads, row_lse, mask=head_ok)


def launch_two_pass(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                    softmax_scale: float, out: torch.Tensor, lse: torch.Tensor, *, head_block: int,
                    config: TwoPassConfig) -> None:
    """Fill ``out [T, H, 512] bf16`` and ``lse [T, H] fp32``. Inputs as normalised by
    ``sparse_attn_args.normalize``; ``head_block`` heads per program (``choose_tiling``'s)."""
    T, H, _ = q.shape
    block_n = config.block_n
    num_blocks = triton.cdiv(key_width(swa, extra), block_n)
    head_blocks = triton.cdiv(H, head_block)
    dtype = torch.float32 if INTERPRET else torch.bfloat16  # interpreter: bf16 dots are garbage
    rows = max(1, min(T, _WORKSPACE_BYTES // (H * num_blocks * block_n * dtype.itemsize)))
    probs = torch.empty(rows, H, num_blocks * block_n, dtype=dtype, device=q.device)
    block_max = torch.empty(rows, H, num_blocks, dtype=torch.float32, device=q.device)
    block_sum = torch.empty_like(block_max)
    tl_dtype = tl.float32 if INTERPRET else tl.bfloat16
    for lo in range(0, T, rows):  # row chunks: views, so each launch sees rows [lo, hi) from 0
        hi = min(T, lo + rows)
        swa_list, ex_list, consts = entry_lists(swa, extra, slice(lo, hi))
        consts.update(HEAD_BLOCK=head_block, NUM_HEAD_BLOCKS=head_blocks, BLOCK_N=block_n, DTYPE=tl_dtype)
        _block_scores[((hi - lo) * head_blocks * num_blocks,)](
            q[lo:hi], q.stride(0), q.stride(1), swa_list, ex_list, probs, block_max, block_sum, H, num_blocks,
            softmax_scale, **consts, NUM_STAGES=config.num_stages[0], num_warps=config.num_warps[0])
        _block_values[((hi - lo) * head_blocks * _NUM_PAIRS,)](
            probs, block_max, block_sum, swa_list, ex_list, attn_sink, out[lo:hi], lse[lo:hi], H, num_blocks,
            **consts, STATS_BLOCK=_STATS_BLOCK, NUM_STAGES=config.num_stages[1], num_warps=config.num_warps[1])
