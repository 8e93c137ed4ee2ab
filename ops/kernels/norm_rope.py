"""Triton kernels of ``dsv4::rms_norm_rope`` and ``dsv4::rms_norm_rope_store_kv``: the RMSNorm and
RoPE of one row (a token's key, or one head of its query) in one program; for the second, the
key's FP8 quantisation and cache write in the same program. And ``dsv4::rope_tail``'s: the RoPE
(or its inverse) of one row.

Program ``r`` loads row ``r`` once, reduces its sum of squares in fp32, scales it (by the weight,
or with the scale rounded to the row's dtype for ``round_scale``) and rounds to the row's dtype, as
the unfused code rounds the norm's output before RoPE. It stores the first ``D - 2 * HALF``
values and rotates the last ``2 * HALF`` in pairs ``(2i, 2i + 1)`` by ``pos * inv_freq[i]``
(fp32, one rounding). Compiled unfused, the same chain was a reduction kernel and a pointwise
kernel per call, the query's taking 18 µs at 8 tokens x 64 heads on the H200. The store variant
quantises the rounded values as ``store_kv``'s kernel does (``kv_cache.store_model1_nope``) and
writes the rotated pairs as the token's bf16 rope bytes.

Shape legend: R = rows (tokens x heads), D = row length, HALF = RoPE pairs.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .kv_cache import (check_page_rows, model1_rope_ptr, model1_slot_ptrs, model1_store_constants, model1_tiles,
                       store_model1_nope)


@triton.jit
def _normed(x, scale, w, HAS_WEIGHT: tl.constexpr, ROUND_SCALE: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 values ``x`` of a row normed by its ``scale``, rounded to ``DTYPE`` (the norm's output)."""
    if ROUND_SCALE:
        y = x * scale.to(DTYPE).to(tl.float32)
    else:
        y = x * scale
        if HAS_WEIGHT:
            y = y * w
    return y.to(DTYPE)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, pos_ptr, freq_ptr, out_ptr, rows_per_token, eps,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, HALF: tl.constexpr,
                      HAS_WEIGHT: tl.constexpr, ROUND_SCALE: tl.constexpr):
    """Grid ``[R]``: x / out ``[R, D]`` contiguous, pos ``[R / rows_per_token]``, freq ``[HALF]``
    fp32, w ``[D]`` (read when HAS_WEIGHT)."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + row * D, out_ptr + row * D
    cols = tl.arange(0, BLOCK_D)
    nope = D - 2 * HALF
    even = nope + 2 * tl.arange(0, HALF)
    # every load first: the norm's reduction syncs the warps, and no load is issued across that
    x = tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
    w = 0.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    pairs = _pair_values(x_row, w_ptr, even, HAS_WEIGHT)
    pos = tl.load(pos_ptr + row // rows_per_token)
    freq = tl.load(freq_ptr + tl.arange(0, HALF))
    scale = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    y0, y1 = _rotated_pairs(pairs, scale, pos, freq, HAS_WEIGHT, ROUND_SCALE, dtype)
    tl.store(out_row + cols, _normed(x, scale, w, HAS_WEIGHT, ROUND_SCALE, dtype), mask=cols < nope)
    tl.store(out_row + even, y0)
    tl.store(out_row + even + 1, y1)


@triton.jit
def _pair_values(x_row, w_ptr, even, HAS_WEIGHT: tl.constexpr):
    """The RoPE pairs ``(even, even + 1)`` of a row and of the norm's weight (zeros without
    ``HAS_WEIGHT``), fp32: ``(x0, x1, w0, w1)``. Loaded apart from the row's tile (whose layout
    does not split into pairs); the lines are the tile's, so the loads cost no extra bytes."""
    x0 = tl.load(x_row + even).to(tl.float32)
    x1 = tl.load(x_row + even + 1).to(tl.float32)
    w0, w1 = 0.0, 0.0
    if HAS_WEIGHT:
        w0 = tl.load(w_ptr + even).to(tl.float32)
        w1 = tl.load(w_ptr + even + 1).to(tl.float32)
    return x0, x1, w0, w1


@triton.jit
def _rotated_pairs(pairs, scale, pos, freq, HAS_WEIGHT: tl.constexpr, ROUND_SCALE: tl.constexpr,
                   DTYPE: tl.constexpr):
    """The pairs of :func:`_pair_values` normed by ``scale``, rounded to ``DTYPE`` as the norm's
    output, rotated by ``pos * freq`` in fp32 and rounded again: ``(first, second)``, ``DTYPE``."""
    x0, x1, w0, w1 = pairs
    y0 = _normed(x0, scale, w0, HAS_WEIGHT, ROUND_SCALE, DTYPE).to(tl.float32)
    y1 = _normed(x1, scale, w1, HAS_WEIGHT, ROUND_SCALE, DTYPE).to(tl.float32)
    return rotated(y0, y1, pos, freq, False, DTYPE)


@triton.jit
def rotated(y0, y1, pos, freq, INVERSE: tl.constexpr, DTYPE: tl.constexpr):
    """fp32 pairs ``(y0, y1)`` rotated by the angles ``pos * freq`` (by their negatives when
    INVERSE) in fp32, rounded once to ``DTYPE``."""
    angle = pos.to(tl.float32) * freq
    cos, sin = tl.cos(angle), tl.sin(angle)
    if INVERSE:
        sin = -sin
    return (y0 * cos - y1 * sin).to(DTYPE), (y0 * sin + y1 * cos).to(DTYPE)


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, rows_per_token, D: tl.constexpr, BLOCK_NOPE: tl.constexpr,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, INVERSE: tl.constexpr):
    """Grid ``[R]``: x / out ``[R, D]`` contiguous, pos ``[R / rows_per_token]``, freq ``[HALF]``
    fp32. Row ``r`` is copied, its last ``2 * HALF`` values rotated in pairs at
    ``pos[r // rows_per_token]``."""
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + row * D, out_ptr + row * D
    nope = D - 2 * HALF
    cols = tl.arange(0, BLOCK_NOPE)
    kept = tl.load(x_row + cols, mask=cols < nope)
    pair = tl.arange(0, BLOCK_HALF)
    in_half = pair < HALF
    even = nope + 2 * pair
    y0 = tl.load(x_row + even, mask=in_half, other=0.0).to(tl.float32)
    y1 = tl.load(x_row + even + 1, mask=in_half, other=0.0).to(tl.float32)
    freq = tl.load(freq_ptr + pair, mask=in_half, other=0.0)
    r0, r1 = rotated(y0, y1, tl.load(pos_ptr + row // rows_per_token), freq, INVERSE, out_ptr.dtype.element_ty)
    tl.store(out_row + cols, kept, mask=cols < nope)  # stores last: no load is issued after one
    tl.store(out_row + even, r0, mask=in_half)
    tl.store(out_row + even + 1, r1, mask=in_half)


@triton.jit
def _norm_rope_store_kernel(x_ptr, w_ptr, pos_ptr, freq_ptr, cache_ptr, slots_ptr, capacity, stride_page, eps,
                            HAS_WEIGHT: tl.constexpr, ROUND_SCALE: tl.constexpr, PAGE: tl.constexpr,
                            DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, NOPE: tl.constexpr,
                            ROPE: tl.constexpr, TILE: tl.constexpr, NUM_TILES: tl.constexpr,
                            FP8_MAX: tl.constexpr, EPS: tl.constexpr, BIAS: tl.constexpr,
                            SOFT_FP8: tl.constexpr):
    """Grid ``[T]``: key ``t`` of ``x [T, 512] bf16`` (contiguous) normed and rotated as
    :func:`_norm_rope_kernel` does (its sum of squares reduced over the ``[8, 64]`` tiles, so it
    may round differently), then quantised and written as ``store_kv`` writes a key, at
    ``slots[t]`` if that slot is in ``[0, capacity)``: the normed key never goes to memory."""
    tl.static_assert(NOPE + ROPE == 8 * TILE)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * (NOPE + ROPE)
    valid, data_ptr, scale_ptr = model1_slot_ptrs(cache_ptr, slots_ptr, row, capacity, stride_page, PAGE,
                                                  DATA_BYTES, SCALE_BYTES)
    col = model1_tiles(TILE)
    pair = tl.arange(0, ROPE // 2)
    # every load first: the norm's reduction and the quantisation sync the warps, and the
    # quantisation's division has a slow-path branch; no load is issued across either
    x = tl.load(x_row + col).to(tl.float32)
    w = 0.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + col).to(tl.float32)
    pairs = _pair_values(x_row, w_ptr, NOPE + 2 * pair, HAS_WEIGHT)
    pos = tl.load(pos_ptr + row)
    freq = tl.load(freq_ptr + pair)
    scale = tl.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / (NOPE + ROPE) + eps)
    normed = _normed(x, scale, w, HAS_WEIGHT, ROUND_SCALE, tl.bfloat16).to(tl.float32)
    store_model1_nope(data_ptr, scale_ptr, normed, valid, TILE, NUM_TILES, FP8_MAX, EPS, BIAS, SOFT_FP8)
    y0, y1 = _rotated_pairs(pairs, scale, pos, freq, HAS_WEIGHT, ROUND_SCALE, tl.bfloat16)
    rope = model1_rope_ptr(data_ptr, NOPE)
    tl.store(rope + 2 * pair, y0, mask=valid)
    tl.store(rope + 2 * pair + 1, y1, mask=valid)


def launch_rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, round_scale: bool,
                         positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``dsv4::rms_norm_rope`` on CUDA (arguments as the op's, already checked): one program a row."""
    x = x.contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    rows = x.numel() // d
    if rows == 0:
        return out
    block_d = triton.next_power_of_2(d)
    _norm_rope_kernel[(rows,)](x, weight if weight is not None else x, positions, inv_freq.contiguous(), out,
                               rows // x.shape[0], eps, D=d, BLOCK_D=block_d, HALF=inv_freq.shape[0],
                               HAS_WEIGHT=weight is not None, ROUND_SCALE=round_scale,
                               num_warps=max(1, min(4, block_d // 128)))
    return out


def launch_rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     inverse: bool = False) -> torch.Tensor:
    """``dsv4::rope_tail`` on CUDA (arguments as the op's, already checked): one program a row of
    x's last dim. Positions of one value per leading index (``[T, 1]`` for a query ``[T, H, D]``,
    ``[T]`` for a key ``[T, D]``) are read in place; any other broadcast is expanded first."""
    x = x.contiguous()
    out = torch.empty_like(x)
    d, half = x.shape[-1], inv_freq.shape[0]
    rows = x.numel() // d if d else 0
    if rows == 0:
        return out
    if 1 <= positions.dim() == x.dim() - 1 and positions.shape[0] == x.shape[0] and math.prod(positions.shape[1:]) == 1:
        positions = positions.reshape(-1)
    else:
        positions = positions.expand(x.shape[:-1]).reshape(-1)
    nope = d - 2 * half
    _rope_kernel[(rows,)](x, positions, inv_freq.contiguous(), out, rows // positions.numel(), D=d,
                          BLOCK_NOPE=triton.next_power_of_2(max(nope, 1)), HALF=half,
                          BLOCK_HALF=triton.next_power_of_2(half), INVERSE=inverse,
                          num_warps=max(1, min(4, triton.next_power_of_2(d) // 128)))
    return out


def launch_rms_norm_rope_store_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                                  weight: torch.Tensor | None, eps: float, round_scale: bool,
                                  positions: torch.Tensor, inv_freq: torch.Tensor, page_size: int) -> None:
    """``dsv4::rms_norm_rope_store_kv`` on CUDA (arguments as the op's, already checked): one
    program a key."""
    check_page_rows("rms_norm_rope_store_kv", cache)
    if x.shape[0] == 0:
        return
    x = x.contiguous()
    _norm_rope_store_kernel[(x.shape[0],)](
        x, weight if weight is not None else x, positions, inv_freq.contiguous(), cache, slots.contiguous(),
        cache.shape[0] * page_size, cache.stride(0), eps, HAS_WEIGHT=weight is not None, ROUND_SCALE=round_scale,
        PAGE=page_size, **model1_store_constants(), num_warps=4)
