"""Triton kernel of ``dsv4::linears``: several bf16 / fp16 linear maps of one small input, one launch.

At a decode step's few rows each projection of a layer is a GEMV bound by reading its weight, and
the small ones are bound by latency instead: cuBLAS runs each as a split-K GEMV plus a reduction
kernel (on the H200, 5.7 µs for a 1024 x 4096 weight whose bytes need 1.7 µs). The projections
of one input (a layer's query, key and compressor projections of the normed hidden state) run
here as one grid over every weight's column tiles: program ``p`` finds the weight whose tiles
hold ``p``, streams ``BLOCK_N`` of its rows along K once and multiplies them with all rows of x at
once on the tensor cores (x padded to 16 rows). Up to :data:`MAX_WEIGHTS` weights a launch, each
its own pointer argument (no pointer table to build, so the launch is CUDA-graph safe).

Numerics: fp32 accumulation, one rounding to the output dtype, as cuBLAS; only the order of the
K sums differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x up to which the kernel runs (tl.dot's smallest M); more rows are a GEMM
MAX_WEIGHTS = 8
# (BLOCK_N, BLOCK_K, num_warps, num_stages): rows of a weight per program, K per step. Untuned:
# the experts kernels' best tile for a handful of streaming programs (docs/perf-log.md).
CONFIG = (32, 256, 4, 3)


@triton.jit
def _tile(x_ptr, w_ptr, out_ptr, n_rows, first, last, pid, M, K, stride_x,
          M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[:, tile] = x @ w[tile].T`` when ``first <= pid < last`` (the tiles of this weight);
    otherwise nothing is read or written."""
    mine = (pid >= first) & (pid < last)
    k_end = tl.where(mine, K, 0)
    rows = (pid - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = mine & (rows < n_rows)
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_ptr + m[:, None] * stride_x + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + m[:, None] * n_rows + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _linears_kernel(x_ptr, M, K, stride_x,
                    w0, o0, n0, t0, w1, o1, n1, t1, w2, o2, n2, t2, w3, o3, n3, t3,
                    w4, o4, n4, t4, w5, o5, n5, t5, w6, o6, n6, t6, w7, o7, n7, t7, t8,
                    G: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight ``g`` (``n_g`` rows, output ``o_g [M, n_g]``) owns programs ``[t_g, t_{g+1})``."""
    pid = tl.program_id(0)
    _tile(x_ptr, w0, o0, n0, t0, t1, pid, M, K, stride_x, M_PAD, BLOCK_N, BLOCK_K)
    if G > 1:
        _tile(x_ptr, w1, o1, n1, t1, t2, pid, M, K, stride_x, M_PAD, BLOCK_N, BLOCK_K)
    if G > 2:
        _tile(x_ptr, w2, o2, n2, t2, t3, pid, M, K, stride_x, M_PAD, BLOCK_N, BLOCK_K)
    if G > 3:
        _tile(x_ptr, w3, o3, n3, t3, t4, pid, M, K, stride_x, M_PAD, BLOCK_N, BLOCK_K)
    if G > 4:
        _tile(x_ptr, w4, o4, n4, t4, t5, pid, M, K, stride_x, M_PAD, BLOCK_N, BLOCK_K)
    if G > 5:
        _tile(x_ptr, w5, o5, n5, t5, t6, pid, M, K, stride_x, M_PAD, BLOCK_N, BLOCK_K)
    if G > 6:
        _tile(x_ptr, w6, o6, n6, t6, t7, pid, M, K, stride_x, M_PAD, BLOCK_N, BLOCK_K)
    if G > 7:
        _tile(x_ptr, w7, o7, n7, t7, t8, pid, M, K, stride_x, M_PAD, BLOCK_N, BLOCK_K)


def launch_linears(x: torch.Tensor, weights: list[torch.Tensor],
                   config: tuple[int, int, int, int] = CONFIG) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` in one launch: ``x [M, K]`` (M <= :data:`MAX_ROWS`, unit
    stride along K), each ``w [N_g, K]`` contiguous of x's dtype, 1 to :data:`MAX_WEIGHTS` of
    them -> ``[M, N_g]`` each. ``config``: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``."""
    m, k = x.shape
    if m > MAX_ROWS or not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"launch_linears: {m} rows and {len(weights)} weights; the kernel takes at most "
                         f"{MAX_ROWS} rows and 1 to {MAX_WEIGHTS} weights")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weights = [w.contiguous() for w in weights]
    outs = [x.new_empty(m, w.shape[0]) for w in weights]
    if m == 0 or k == 0:
        return [o.zero_() for o in outs]
    block_n, block_k, warps, stages = config
    firsts = [0]
    for w in weights:
        firsts.append(firsts[-1] + triton.cdiv(w.shape[0], block_n))
    args = []
    for g in range(MAX_WEIGHTS):  # unused slots: x as a pointer nobody reads, an empty tile range
        w, o = (weights[g], outs[g]) if g < len(weights) else (x, x)
        n = w.shape[0] if g < len(weights) else 0
        args += [w, o, n, firsts[min(g, len(weights))]]
    _linears_kernel[(firsts[-1],)](x, m, k, x.stride(0), *args, firsts[-1], G=len(weights),
                                   M_PAD=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
                                   num_warps=warps, num_stages=stages)
    return outs
