"""Triton kernels of ``dsv4::greedy_tokens``: the argmax of each logits row, in two launches.

One program per row would stream a whole vocabulary (258 KB of bf16 logits at 129,280 entries)
through one SM; ``aten``'s argmax does that and takes 36 µs on the H200. Here:

* ``_chunk_argmax_kernel``, grid ``(m, chunks)``: program ``(r, c)`` reads logits
  ``[c * BLOCK, (c + 1) * BLOCK)`` of row ``r`` and stores the chunk's maximum and the first column
  holding it (a NaN counts as the maximum: the first NaN, value NaN).
* ``_pick_kernel``, grid ``(m,)``: of the row's chunk maxima, the first chunk holding a NaN, else the
  first chunk holding the largest value; its column is the row's argmax, the first of equal maxima
  because chunks are in column order and each holds its first.

Values compare in fp32, exactly as in the logits' dtype (bf16 / fp16 widen exactly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# logits per chunk program: 32 programs a row for a 129,280-entry vocabulary
_BLOCK = 4096


# a column past every real one (vocabularies are below 2**31)
_NO_COL = tl.constexpr(2147483647)


@triton.jit
def _first_max(values, cols):
    """``(maximum, first col holding it)`` of ``values`` (fp32, with their ``cols``); a NaN is the
    maximum (the first NaN's col, value NaN). Padding lanes hold -inf at cols past the real ones."""
    is_nan = values != values
    has_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    best = tl.max(tl.where(is_nan, float("-inf"), values), axis=0)
    hit = tl.where(has_nan, is_nan, values == best)
    col = tl.min(tl.where(hit, cols, _NO_COL), axis=0)
    return tl.where(has_nan, float("nan"), best), col


@triton.jit
def _chunk_argmax_kernel(logits_ptr, max_ptr, col_ptr, V, stride, CHUNKS, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(logits_ptr + r * stride + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    best, col = _first_max(values, cols)
    tl.store(max_ptr + r * CHUNKS + c, best)
    tl.store(col_ptr + r * CHUNKS + c, col)


@triton.jit
def _pick_kernel(max_ptr, col_ptr, out_ptr, CHUNKS, CP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CP)
    ok = c < CHUNKS
    best = tl.load(max_ptr + r * CHUNKS + c, mask=ok, other=float("-inf"))
    cols = tl.load(col_ptr + r * CHUNKS + c, mask=ok, other=_NO_COL)
    _, col = _first_max(best, cols)
    tl.store(out_ptr + r, col.to(tl.int64))


def launch_greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits [m, V]`` (fp32 / bf16 / fp16, last stride 1, 0 < V < 2**31) -> ``[m] int64``: the
    first column of each row's maximum, a NaN counting as the maximum (``logits.argmax(-1)``)."""
    m, vocab = logits.shape
    out = torch.empty(m, dtype=torch.int64, device=logits.device)
    if m == 0:
        return out
    chunks = triton.cdiv(vocab, _BLOCK)
    maxima = torch.empty(m, chunks, dtype=torch.float32, device=logits.device)
    cols = torch.empty(m, chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(m, chunks)](logits, maxima, cols, vocab, logits.stride(0), chunks, BLOCK=_BLOCK,
                                      num_warps=8)
    _pick_kernel[(m,)](maxima, cols, out, chunks, CP=max(16, triton.next_power_of_2(chunks)), num_warps=1)
    return out
