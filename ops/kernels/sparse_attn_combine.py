"""Split-KV combine of sparse attention — Triton.

The fused and the warp-specialised kernels can split a row's key list over ``S`` programs; each
split then writes a partial result that ``_combine_kernel`` merges. The partial buffers are the
contract between them, stated here once (:class:`Partials`, :func:`allocate_partials`,
:func:`partial_index`, :func:`finish_partial_rows`):

* ``part_out [T, S, H, 512] fp32``: split ``s``'s output of (row, head), normalised by the
  split's own softmax sum (0 for a split without valid keys);
* ``part_lse [T, S, H] fp32``: the split's base-2 LSE (``-inf`` for a split without valid keys).

Given a RoPE table, the combine also applies the inverse RoPE of each head's output (its last 64
dims rotated in pairs by minus the row's position, as ``rope_tail(..., inverse=True)``'s kernel
does it, from the bf16 output): the attention's output as the layer's output projection takes it.

Shape legend: T = query rows, H = heads, S = splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...config import HEAD_DIM, NOPE_DIM
from .norm_rope import rotated
from .primitives import DIM, dependent_launch, finish_rows, row_lse2

_COMBINE_TILE_ELEMS = 4096  # [S, cols] fp32 tile of one program: <= 32 registers per thread
_MIN_COLS = 16


@dataclass(frozen=True)
class Partials:
    """Partial results of a split launch (see module doc)."""

    out: torch.Tensor  # [T, S, H, 512] fp32
    lse: torch.Tensor  # [T, S, H] fp32

    @property
    def splits(self) -> int:
        return self.out.shape[1]


def split_count(partials: Partials | None) -> int:
    """Splits of a launch that writes ``partials`` (None: one split, no partials)."""
    return 1 if partials is None else partials.splits


def allocate_partials(num_rows: int, splits: int, num_heads: int, device: torch.device) -> Partials | None:
    """Uninitialised partial buffers for ``splits`` splits; None for one split (no combine)."""
    if splits <= 1:
        return None
    return Partials(torch.empty(num_rows, splits, num_heads, HEAD_DIM, dtype=torch.float32, device=device),
                    torch.empty(num_rows, splits, num_heads, dtype=torch.float32, device=device))


@triton.jit
def partial_index(row, split, num_splits, num_heads, heads):
    """Flat (row, split, head) index into ``part_lse`` (times 512: into ``part_out``)."""
    return (row * num_splits + split) * num_heads + heads


@triton.jit
def finish_partial_rows(m2, l):
    """Epilogue of a split's rows (base-2 running max ``m2``, sum ``l``) -> ``(scale, part_lse)``:
    ``1 / l`` (0 without valid keys) for the accumulator and the split's LSE (-inf without)."""
    lse2, empty = row_lse2(m2, l)
    return tl.where(empty, 0.0, 1.0 / l), tl.where(empty, float("-inf"), lse2)


@triton.jit
def _combine_kernel(part_out, part_lse, sink, out, lse, pos_ptr, freq_ptr, num_heads, num_splits,
                    SPLITS_POW2: tl.constexpr, COLS: tl.constexpr, PDL: tl.constexpr, ROPE: tl.constexpr,
                    NOPE: tl.constexpr):
    """Grid ``(T * H, 512 / COLS)``: merge the S partial ``(out / l, lse2)`` of one (row, head) over
    ``COLS`` output columns, apply the sink and write out [T, H, 512] bf16 (and lse [T, H] fp32,
    natural log, from the first column block). All splits are loaded at once: one memory round
    trip, not one per split. PDL: launched early; waits here for the main grid's partials, then
    lets the kernel after it launch (the attention output's product, which prefetches its weights
    meanwhile). ROPE: the columns from ``NOPE`` on are rotated back in pairs by ``pos[row] *
    freq`` (``freq [(512 - NOPE) / 2]``) before the store; a pair never straddles two column
    blocks."""
    dependent_launch(PDL)
    row_head = tl.program_id(0).to(tl.int64)
    head = row_head % num_heads
    first = partial_index(row_head // num_heads, 0, num_splits, num_heads, head)  # split 0 of (row, head)
    sp = tl.arange(0, SPLITS_POW2)
    has = sp < num_splits
    part = tl.load(part_lse + first + sp * num_heads, mask=has, other=float("-inf"))
    d = tl.program_id(1) * COLS + tl.arange(0, COLS)
    parts = tl.load(part_out + (first + sp * num_heads)[:, None] * DIM + d[None, :], mask=has[:, None], other=0.0)
    m2 = tl.max(part, 0)
    m_safe = tl.where(m2 == float("-inf"), 0.0, m2)
    w = tl.exp2(part - m_safe)  # 0 for splits without keys (their part_out is 0)
    scale, row_lse = finish_rows(m_safe, tl.sum(w, 0), sink, head, True)
    o = (tl.sum(w[:, None] * parts, 0) * scale).to(tl.bfloat16)
    if ROPE:
        o = _inverse_rope(o, tl.program_id(1) * COLS, tl.load(pos_ptr + row_head // num_heads), freq_ptr, COLS, NOPE)
    tl.store(out + row_head * DIM + d, o)
    if tl.program_id(1) == 0:
        tl.store(lse + row_head, row_lse)


@triton.jit
def _inverse_rope(o, first_col, pos, freq_ptr, COLS: tl.constexpr, NOPE: tl.constexpr):
    """``o [COLS] bf16``, the output columns ``first_col + [0, COLS)`` of one head, with its
    columns from ``NOPE`` on rotated back in pairs ``(2k, 2k + 1)`` (bf16)."""
    y0, y1 = tl.split(tl.reshape(o, [COLS // 2, 2]))
    col = first_col + 2 * tl.arange(0, COLS // 2)  # each pair's first column
    is_rope = col >= NOPE
    freq = tl.load(freq_ptr + tl.maximum(col - NOPE, 0) // 2, mask=is_rope, other=0.0)
    r0, r1 = rotated(y0.to(tl.float32), y1.to(tl.float32), pos, freq, True, tl.bfloat16)
    return tl.reshape(tl.join(tl.where(is_rope, r0, y0), tl.where(is_rope, r1, y1)), [COLS])


def launch_combine(partials: Partials, attn_sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   pdl: bool, inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Merge ``partials`` into ``out [T, H, 512] bf16`` and ``lse [T, H] fp32``. ``pdl``: launched
    with programmatic dependent launch (the main grid let it start early). ``inverse_rope``:
    ``(positions [T] int, inv_freq [32] fp32)``, each head's output rotated back at its row's
    position."""
    T, H, _ = out.shape
    splits = split_count(partials)
    splits_pow2 = triton.next_power_of_2(splits)
    cols = min(HEAD_DIM, max(_MIN_COLS, _COMBINE_TILE_ELEMS // splits_pow2))
    positions, inv_freq = (t.contiguous() for t in inverse_rope) if inverse_rope is not None else (None, None)
    _combine_kernel[(T * H, HEAD_DIM // cols)](partials.out, partials.lse, attn_sink, out, lse, positions, inv_freq,
                                               H, splits, SPLITS_POW2=splits_pow2, COLS=cols, PDL=pdl,
                                               ROPE=inverse_rope is not None, NOPE=NOPE_DIM, num_warps=4,
                                               launch_pdl=pdl)
