"""Split-KV combine of sparse attention — Triton.

The fused and the warp-specialised kernels can split a row's key list over ``S`` programs; each
split then writes a partial result that ``_combine_kernel`` merges. The partial buffers are the
contract between them, stated here once (:class:`Partials`, :func:`allocate_partials`,
:func:`partial_index`, :func:`finish_partial_rows`):

* ``part_out [T, S, H, 512] fp32``: split ``s``'s output of (row, head), normalised by the
  split's own softmax sum (0 for a split without valid keys);
* ``part_lse [T, S, H] fp32``: the split's base-2 LSE (``-inf`` for a split without valid keys).

Shape legend: T = query rows, H = heads, S = splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...config import HEAD_DIM
from .primitives import DIM, finish_rows, row_lse2

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
def _combine_kernel(part_out, part_lse, sink, out, lse, num_heads, num_splits, SPLITS_POW2: tl.constexpr,
                    COLS: tl.constexpr, PDL: tl.constexpr):
    """Grid ``(T * H, 512 / COLS)``: merge the S partial ``(out / l, lse2)`` of one (row, head) over
    ``COLS`` output columns, apply the sink and write out [T, H, 512] bf16 (and lse [T, H] fp32,
    natural log, from the first column block). All splits are loaded at once: one memory round
    trip, not one per split. PDL: launched early; waits here for the main grid's partials."""
    if PDL:
        tl.extra.cuda.gdc_wait()
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
    tl.store(out + row_head * DIM + d, (tl.sum(w[:, None] * parts, 0) * scale).to(tl.bfloat16))
    if tl.program_id(1) == 0:
        tl.store(lse + row_head, row_lse)


def launch_combine(partials: Partials, attn_sink: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   pdl: bool) -> None:
    """Merge ``partials`` into ``out [T, H, 512] bf16`` and ``lse [T, H] fp32``. ``pdl``: launched
    with programmatic dependent launch (the main grid let it start early)."""
    T, H, _ = out.shape
    splits = split_count(partials)
    splits_pow2 = triton.next_power_of_2(splits)
    cols = min(HEAD_DIM, max(_MIN_COLS, _COMBINE_TILE_ELEMS // splits_pow2))
    _combine_kernel[(T * H, HEAD_DIM // cols)](partials.out, partials.lse, attn_sink, out, lse, H, splits,
                                               SPLITS_POW2=splits_pow2, COLS=cols, PDL=pdl, num_warps=4,
                                               launch_pdl=pdl)
