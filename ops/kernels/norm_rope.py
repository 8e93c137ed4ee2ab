"""Triton kernel of ``dsv4::rms_norm_rope``: the RMSNorm and RoPE of one row (a token's key, or
one head of its query) in one program.

Program ``r`` loads row ``r`` once, reduces its sum of squares in fp32, scales it (by the weight,
or with the scale rounded to the row's dtype for ``round_scale``) and rounds to the row's dtype, as
the unfused code rounds the norm's output before RoPE. It stores the first ``D - 2 * HALF``
values and rotates the last ``2 * HALF`` in pairs ``(2i, 2i + 1)`` by ``pos * inv_freq[i]``
(fp32, one rounding). Compiled unfused, the same chain was a reduction kernel and a pointwise
kernel per call, the query's taking 18 µs at 8 tokens x 64 heads on the H200.

Shape legend: R = rows (tokens x heads), D = row length, HALF = RoPE pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    x = tl.load(x_row + cols, mask=cols < D, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = 0.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    nope = D - 2 * HALF
    tl.store(out_row + cols, _normed(x, scale, w, HAS_WEIGHT, ROUND_SCALE, dtype), mask=cols < nope)

    even = nope + 2 * tl.arange(0, HALF)  # the RoPE pairs, re-read from L1
    x0 = tl.load(x_row + even).to(tl.float32)
    x1 = tl.load(x_row + even + 1).to(tl.float32)
    w0, w1 = 0.0, 0.0
    if HAS_WEIGHT:
        w0 = tl.load(w_ptr + even).to(tl.float32)
        w1 = tl.load(w_ptr + even + 1).to(tl.float32)
    y0 = _normed(x0, scale, w0, HAS_WEIGHT, ROUND_SCALE, dtype).to(tl.float32)
    y1 = _normed(x1, scale, w1, HAS_WEIGHT, ROUND_SCALE, dtype).to(tl.float32)
    angle = tl.load(pos_ptr + row // rows_per_token).to(tl.float32) * tl.load(freq_ptr + tl.arange(0, HALF))
    cos, sin = tl.cos(angle), tl.sin(angle)
    tl.store(out_row + even, (y0 * cos - y1 * sin).to(dtype))
    tl.store(out_row + even + 1, (y0 * sin + y1 * cos).to(dtype))


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
