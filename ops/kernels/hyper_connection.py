"""Triton kernel of ``dsv4::sinkhorn``: the mHC comb weights' Sinkhorn-Knopp normalisation.

``x [..., N, N] fp32`` is seen as ``M`` contiguous ``N x N`` matrices. Each program (one warp for
N <= 16) loads ``BLOCK_M`` of them as one ``[BLOCK_M, NP, NP]`` tile (NP = N rounded up to a power of two), runs
every normalisation in registers and stores once: one launch instead of the string of kernels
Inductor makes of the traced loop (it cannot fuse a reduction over rows with the next one over
columns).

Numerics: every step is the reference's ``x / (sum + eps)`` with an IEEE division (``div_rn``);
only the order of the N-term sums may differ from the reference's, so results agree to fp32
rounding. Padding (rows and columns past N, matrices past M) is loaded as 0 and stays 0, so it
adds nothing to a sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_N = 64  # a program holds whole matrices in registers: up to 64 x 64 (hc_mult is 4)
# Elements of a program's tile: as many matrices as fit in 64 (at least one), one warp up to 256
# elements. The 2 iters - 1 normalisations are a chain of dependent reductions, so a program is
# kept small (no cross-warp reduction for N <= 16) and M is spread over programs (on the H200:
# 3.5 µs for one 4 x 4 matrix, against 41 µs for Inductor's 39 kernels).
_TILE_ELEMS = 64
_WARP_ELEMS = 256


@triton.jit
def _normalise(x, s, eps, mask):
    """``x / (s + eps)``; padding is divided by 1 and stays 0 (with eps = 0 it would be 0 / 0)."""
    return tl.math.div_rn(x, tl.where(mask, s + eps, 1.0))


@triton.jit
def _sinkhorn_kernel(x_ptr, out_ptr, M, iters, eps, N: tl.constexpr, NP: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    """Matrices ``[pid * BLOCK_M, (pid + 1) * BLOCK_M)`` of ``x [M, N, N]`` -> ``out``: a column
    normalisation, then ``iters - 1`` (row, column) pairs."""
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M * N * N may pass 2**31
    r = tl.arange(0, NP)
    row, col = r[None, :, None], r[None, None, :]
    mask = (m[:, None, None] < M) & (row < N) & (col < N)
    offs = m[:, None, None] * (N * N) + row * N + col
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x = _normalise(x, tl.sum(x, axis=1, keep_dims=True), eps, mask)
    for _ in range(iters - 1):
        x = _normalise(x, tl.sum(x, axis=2, keep_dims=True), eps, mask)
        x = _normalise(x, tl.sum(x, axis=1, keep_dims=True), eps, mask)
    tl.store(out_ptr + offs, x, mask=mask)


def launch_sinkhorn(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``x [..., N, N] fp32`` (N <= :data:`MAX_N`, any strides) Sinkhorn-normalised as the
    reference does it; a new contiguous tensor of the same shape."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    n = x.shape[-1]
    np2 = triton.next_power_of_2(n)
    m = x.numel() // (n * n)
    block_m = max(1, min(_TILE_ELEMS // (np2 * np2), triton.next_power_of_2(m)))
    num_warps = min(4, max(1, block_m * np2 * np2 // _WARP_ELEMS))
    _sinkhorn_kernel[(triton.cdiv(m, block_m),)](x, out, m, iters, eps, N=n, NP=np2, BLOCK_M=block_m,
                                                 num_warps=num_warps)
    return out
