"""Triton kernels of ``dsv4::linears`` (several bf16 / fp16 linear maps of one small input, one
launch) and ``dsv4::grouped_linear`` (a block-diagonal linear map of one small input, one launch).

At a decode step's few rows each projection of a layer is a GEMV bound by reading its weight, and
the small ones are bound by latency instead: cuBLAS runs each as a split-K GEMV plus a reduction
kernel (on the H200, 5.7 µs for a 1024 x 4096 weight whose bytes need 1.7 µs). The projections
of one input (a layer's query, key and compressor projections of the normed hidden state) run
here as one grid over every weight's column tiles: program ``p`` finds the weight whose tiles
hold ``p``, streams ``BLOCK_N`` of its rows along K once and multiplies them with all rows of x at
once on the tensor cores (x padded to 16, 32 or 64 rows). Up to :data:`MAX_WEIGHTS` weights a
launch, each its own pointer argument (no pointer table to build, so the launch is CUDA-graph
safe); a program selects its weight's pointers by value, so the kernel has one K loop whatever the
weight count.

The grouped kernel runs the same K loop (:func:`_rows_product`) with group ``g`` of the input
against rows ``[g N, (g + 1) N)`` of the weight, the groups' column tiles in one grid: in place of
cuBLAS's batched split-K GEMV and its reduction kernel.

Programmatic dependent launch (sm_90+, ``PDL``): a decode step's projections read weights that no
earlier kernel writes, so each program first asks the L2 for the leading bytes of its weight rows
(``host.PREFETCH_BYTES``), then waits for the kernel before it (whose output, x, it reads) and lets
the kernel after it launch. Launched while its predecessor still runs, the projection's first
DRAM round trips overlap that kernel instead of following it. The predecessor must trigger its
dependents early (an Inductor kernel does under ``triton.enable_pdl``); otherwise the launch
waits for its end, as without PDL.

Numerics: fp32 accumulation, one rounding to the output dtype, as cuBLAS; only the order of the
K sums differs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .host import has_pdl, num_sms, prefetch_columns
from .hyper_connection import Partials, collapse_weights, post_and_comb
from .primitives import DOT_MIN_ROWS, TileConfig, dependent_launch, prefetch_then_wait

MAX_ROWS = 64  # rows of x up to which the kernels run (padded to 16, 32 or 64: rows_pad); more are a GEMM
MAX_WEIGHTS = 8
# TileConfig (BLOCK_N: rows of a weight per program, BLOCK_K: K per step). The H200's
# best over the benchmark model's fused groups at 1 and 8 rows (a sweep of 36 tiles,
# docs/perf-log.md): with K of 4096 deep K steps keep the most bytes in flight per program; with K
# of 1024 (the query latent's products) a program has few K steps, and wider N tiles win.
DEEP_K = 2048
DEEP_K_CONFIG = (32, 512, 4, 4)
SHALLOW_K_CONFIG = (64, 128, 4, 4)
# A weight of many rows (an lm_head: 129,280 x 4096) is tens of waves of programs, where shallower
# K steps over wider N tiles stream best: 237.7 µs against 250.3 with DEEP_K_CONFIG and 244.5
# through cuBLAS at one row (bench_ops.py --only linears; docs/perf-log.md).
WIDE_ROWS = 65536
WIDE_CONFIG = (64, 128, 4, 4)
# The grouped o_a_proj (8 groups of 1024 x 4096, 256 programs of 32 rows): the loop stages its
# loads through shared memory (cp.async) in num_stages - 1 buffers, so 32 x 512 on 3 stages keeps
# 64 KiB of weights in flight a program (two programs an SM) where 32 x 256 on 4 keeps 48 KiB. On
# an H100 at one row 24.0 µs against 28.2 with 32 x 256 on 4 stages and 24.9 with 16 x 256
# (docs/perf-log.md); on the H200 32 x 256 on 4 stages took 18.6 against DEEP_K_CONFIG's 20.4 (an
# earlier tree).
GROUPED_CONFIG = (32, 512, 4, 3)
# A group of few rows at K >= DEEP_K (the sliding layer's q_a + kv: 1,536 rows, 48 programs of 32;
# a MoE layer's router alone: 8 rows, one program) leaves most SMs idle while each program streams
# whole rows. Up to SPLIT_K_ROWS rows the launch runs SPLIT_K_CONFIG's tiles with K split until
# tiles x splits fill the SMs once. In the benchmark model's step on the H200: the router 9.8 ->
# 5.0 µs, the sliding group 8.3 -> 7.5; the HCA group (2,560 rows) took 9.8 split against 8.5, and
# larger groups, the grouped o_a_proj and the routed experts measured slower split too
# (docs/perf-log.md).
SPLIT_K_ROWS = 2048
SPLIT_K_CONFIG = (64, 128, 4, 4)
# False: launched without PDL or the weight prefetch (benchmarks compare the two)
WEIGHT_PREFETCH = True


# Above 16 rows of x (a b = 17..64 decode step, a verify step's draft rows) each program reads x's
# [M_PAD, BLOCK_K] tile from the L2 beside its weight rows. On an H100 at 24 / 32 / 64 rows, alone
# (docs/perf-log.md), against cuBLAS's GEMMs: a CSA layer's 7 hidden-state products 13.9 / 13.0 /
# 11.6 µs against 46.7 / 48.0 / 47.8, o_b_proj 27.7 / 27.1 / 27.8 against 28.6 / 28.9 / 30.2 with
# 32 x 256 tiles unsplit; the query latent's products (K 1024) 33.8 / 34.1 / 36.1 against 35.1 /
# 35.5 / 37.1 with 64 x 256 on 3 stages; the grouped o_a_proj 27.1 / 27.7 / 28.0 with that tile
# against the bmm's 26.6 / 27.1 / 27.8, which in a step also needs its output transposed (a copy
# kernel, 3 µs at 64 rows); an lm_head-sized weight (129,280 rows) 353.9 / 360.2 / 382.1 at 17 /
# 32 / 64 rows with the deep-K tile against cuBLAS's 380.5 / 383.2 / 391.7.
MANY_ROWS_DEEP_K_CONFIG = (32, 256, 4, 4)
MANY_ROWS_SHALLOW_K_CONFIG = (64, 256, 4, 3)
MANY_ROWS_GROUPED_CONFIG = (64, 256, 4, 3)
# Up to 16 rows with a folded norm at K < DEEP_K (the query latent's products): one stage, no
# loads staged through shared memory. Staged on SHALLOW_K_CONFIG's 4 stages, the folded loop syncs
# the block 9 times in the kernel where the plain one does 6 (sm_90 build at the model's shapes)
# and ran far slower. On an H100 at one row: a lone q_b 25.9 µs against 44.9 with
# SHALLOW_K_CONFIG (plain 25.2), a CSA layer's q_b + indexer q_b 34.2 against 47.3 (plain 30.6;
# docs/perf-log.md).
NORMED_SHALLOW_K_CONFIG = (64, 256, 4, 1)


def rows_pad(m: int) -> int:
    """``M_PAD``: ``m`` rows of x padded to a ``tl.dot`` tile of rows (16, 32 or 64)."""
    return max(DOT_MIN_ROWS, triton.next_power_of_2(m))


def default_config(k: int, rows: int = 0, m: int = 1, norm: bool = False) -> tuple[TileConfig, bool]:
    """``(tile, split_k)``: the launch tile for ``m`` rows of x, ``K = k`` input features and
    ``rows`` weight rows in all (``norm``: x RMS-normed in the launch), and whether the launch
    splits K."""
    if m > DOT_MIN_ROWS:
        return (MANY_ROWS_DEEP_K_CONFIG if k >= DEEP_K else MANY_ROWS_SHALLOW_K_CONFIG), False
    if norm and k < DEEP_K:
        return NORMED_SHALLOW_K_CONFIG, False
    if rows >= WIDE_ROWS:
        return WIDE_CONFIG, False
    if k >= DEEP_K:
        return (SPLIT_K_CONFIG, True) if rows <= SPLIT_K_ROWS else (DEEP_K_CONFIG, False)
    return SHALLOW_K_CONFIG, False


def _split_plan(tiles: int, k: int, block_k: int, device: torch.device) -> tuple[int, int]:
    """``(split, k_per_split)``: K cut into whole ``block_k`` blocks until ``tiles`` x splits
    fill the SMs once (``(1, k)`` when the tiles do)."""
    k_blocks = triton.cdiv(k, block_k)
    split = min(k_blocks, triton.cdiv(num_sms(device), tiles))
    if split < 2:
        return 1, k
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


@triton.jit
def _split_k_finish(acc, part_ptr, counters_ptr, tile, tiles, split, M, M_PAD: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Split-K: this program's fp32 partial ``acc`` of ``tile`` stored to its slot of ``part
    [split, tiles, M_PAD, BLOCK_N]`` (rows < M), its arrival counted on ``counters[tile]`` (0 at
    launch). ``(last, total)``: the last of the tile's ``split`` programs gets True and the partials
    summed in split order (the same sum whatever order the programs ran in); the others get False
    and a total they must not use."""
    m = tl.arange(0, M_PAD)
    offs = m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    rows_ok = (m < M)[:, None]
    tl.store(part_ptr + (tl.program_id(1) * tiles + tile) * (M_PAD * BLOCK_N) + offs, acc, mask=rows_ok)
    tl.debug_barrier()  # every thread's partial stored before the (one-thread) release below
    last = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu") == split - 1
    total = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    if last:
        for s in range(split):  # written by other programs: read from the L2
            total += tl.load(part_ptr + (s * tiles + tile) * (M_PAD * BLOCK_N) + offs, mask=rows_ok, other=0.0,
                             cache_modifier=".cg")
    return last, total


def _aligned(w: torch.Tensor) -> torch.Tensor:
    """``w``, or a contiguous copy when it is strided or not 16-byte aligned: the kernels assume
    contiguous rows and vectorise their loads on that alignment (a fresh copy has it)."""
    return w if w.is_contiguous() and w.data_ptr() % 16 == 0 else w.clone(memory_format=torch.contiguous_format)


def _pdl_prefetch_k(k: int, block_n: int, itemsize: int, device: torch.device) -> int:
    """Leading K columns of its weight rows a program prefetches under PDL (0: no PDL launch)."""
    if not (WEIGHT_PREFETCH and has_pdl(device)):
        return 0
    return prefetch_columns(k, block_n, itemsize)


@triton.jit
def _collapsed_block(x_ptr, M, K, ks, k_ok, norm_ptr, pre, r_out, x_out_ptr, store_x, M_PAD: tl.constexpr,
                     BLOCK_K: tl.constexpr, N: tl.constexpr, NORM: tl.constexpr):
    """Columns ``ks [BLOCK_K]`` of the collapse of ``M`` tokens' ``N`` streams (``x_ptr [M, N, K]``)
    with the weights ``pre [T_PAD, NP]`` fp32, rounded to the streams' dtype (with ``NORM`` then
    scaled by ``r_out [T_PAD]`` and ``norm [K]`` and rounded again), as a ``[M_PAD, BLOCK_K]`` tile
    (rows past M 0); stored to ``x_out_ptr [M, K]`` where ``store_x``. Computed on the tokens' own
    rows and laid over the tile's rows after: the tile's padding rows never hold streams."""
    dtype = x_ptr.dtype.element_ty
    t = tl.arange(0, pre.shape[0])
    t_ok = (t < M)[:, None] & k_ok[None, :]
    rows = tl.zeros((pre.shape[0], BLOCK_K), dtype=tl.float32)
    for i in tl.static_range(N):
        pre_i = tl.sum(tl.where(tl.arange(0, pre.shape[1])[None, :] == i, pre, 0.0), axis=1)
        stream = tl.load(x_ptr + (t[:, None] * N + i) * K + ks[None, :], mask=t_ok, other=0.0)
        rows += pre_i[:, None] * stream.to(tl.float32)
    rows = rows.to(dtype)
    if NORM:
        weight = tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        rows = (rows.to(tl.float32) * r_out[:, None] * weight[None, :]).to(dtype)
    tl.store(x_out_ptr + t[:, None] * K + ks[None, :], rows, mask=store_x & t_ok)
    m = tl.arange(0, M_PAD)
    x = tl.zeros((M_PAD, BLOCK_K), dtype=dtype)
    for row in tl.static_range(pre.shape[0]):
        picked = tl.sum(tl.where(t[:, None] == row, rows.to(tl.float32), 0.0), axis=0).to(dtype)
        x = tl.where(m[:, None] == row, picked[None, :], x)
    return x


@triton.jit
def _rows_product(x_ptr, stride_x, M, K, k_start, k_span, w_rows, row_ok, norm_ptr, eps, pre, r_out, x_out_ptr,
                  store_x, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                  COLLAPSE: tl.constexpr, COLLAPSE_NORM: tl.constexpr):
    """``x[:, ks] @ w_rows[:, ks].T`` for ``ks = [k_start, min(k_start + k_span, K))`` as an fp32
    ``[M_PAD, BLOCK_N]`` tile: ``w_rows [BLOCK_N, 1]`` are the pointers to the program's weight rows
    (``row_ok`` masks those past the weight), streamed along K once; x (unit stride along K,
    ``stride_x`` between rows) is padded to ``M_PAD`` rows. The loads are masked by ``K`` itself
    (not the range's end): Triton knows K's divisibility and keeps them vectorised.
    ``NORM`` (the range is all of K): the product of x's rows RMS-normed with weight ``norm [K]``
    (fp32 math, x's dtype), as ``rms_norm(x, norm, eps) @ w.T`` up to where the rounding falls: each
    K block of x enters the product as ``x * norm`` rounded to x's dtype while the block's squares
    add up, and the fp32 tile is scaled by each row's ``rsqrt(mean(x^2) + eps)`` at the end (no
    second pass over x before the first product).
    ``COLLAPSE = N > 0``: x is a hyper-connection's collapse, made block by block from ``N`` streams
    (``x_ptr`` ``[M, N, K]`` contiguous) with the weights ``pre [T_PAD, NP]`` fp32, as
    ``dsv4::hc_pre`` collapses (:func:`_collapsed_block`; ``COLLAPSE_NORM``: normed with ``r_out
    [T_PAD]`` and ``norm``). Where ``store_x``, the blocks are stored to ``x_out_ptr [M, K]``."""
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    squares = tl.zeros((M_PAD,), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_span, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        if COLLAPSE > 0:
            x = _collapsed_block(x_ptr, M, K, ks, k_ok, norm_ptr, pre, r_out, x_out_ptr, store_x, M_PAD, BLOCK_K,
                                 COLLAPSE, COLLAPSE_NORM)
        else:
            x = tl.load(x_ptr + m[:, None] * stride_x + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            x = (xf * tl.load(norm_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
        wt = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(wt), acc)
    if NORM:
        acc *= tl.rsqrt(squares / K + eps)[:, None]
    return acc


@triton.jit
def _owner(pid, w, o, n, first, cur_w, cur_o, cur_n, cur_first):
    """The weight ``(w, o, n, first)`` in place of the current one when its tiles start at or
    before ``pid`` (tiles are laid out weight after weight, so the last such weight owns ``pid``).
    Pointers are carried as int64: a program picks its weight by value, with one K loop."""
    mine = pid >= first
    return (tl.where(mine, w.to(tl.int64), cur_w), tl.where(mine, o.to(tl.int64), cur_o),
            tl.where(mine, n, cur_n), tl.where(mine, first, cur_first))


@triton.jit
def _linears_kernel(x_ptr, M, K, stride_x, norm_ptr, eps, part_ptr, counters_ptr, tiles, split, k_per_split,
                    hc_dots, hc_sq, hc_gram, hc_base, hc_scale, hc_post, hc_comb, hc_out, hc_split, hc_inv_k,
                    hc_iters, hc_eps, hc_norm_eps,
                    w0, o0, n0, t0, w1, o1, n1, t1, w2, o2, n2, t2, w3, o3, n3, t3,
                    w4, o4, n4, t4, w5, o5, n5, t5, w6, o6, n6, t6, w7, o7, n7, t7,
                    G: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PREFETCH_K: tl.constexpr, SPLIT_K: tl.constexpr, NORM: tl.constexpr, COLLAPSE: tl.constexpr,
                    HC_NP: tl.constexpr, HC_MP: tl.constexpr, HC_SP: tl.constexpr, T_PAD: tl.constexpr,
                    COLLAPSE_NORM: tl.constexpr):
    """Weight ``g`` (``n_g`` rows, output ``o_g [M, n_g]``) owns tiles ``[t_g, t_{g+1})``:
    ``o_g[:, tile] = x @ w_g[tile].T``. Program ``(tile, s)`` takes K columns ``[s k_per_split,
    +k_per_split)``; with ``SPLIT_K`` the tile's last program sums the ``split`` partials. ``NORM``
    (never split): x RMS-normed with ``norm [K]`` and ``eps`` first (:func:`_rows_product`).

    ``COLLAPSE = N > 0``: x is the collapse of a hyper-connection whose projection's partials
    (``hc_dots``, ``hc_sq``, ``hc_gram``: ``hyper_connection.Partials``, ``hc_split`` splits) are
    ready, of ``N`` streams ``x_ptr [M, N, K]``; each program sums the partials into the collapse
    weights (and with ``COLLAPSE_NORM`` the block norm's factor, ``norm [K]`` and ``eps`` its
    weight and eps) and collapses its K blocks itself; the first tile's programs store the
    collapse to ``hc_out [M, K]``. Given ``hc_post``, programs ``(tiles + t, 0)`` (no tile) write
    token ``t``'s ``post`` and Sinkhorn-normalised ``comb`` beside the products."""
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    if pid < tiles:
        w, o, n, first = w0.to(tl.int64), o0.to(tl.int64), n0, t0
        if G > 1:
            w, o, n, first = _owner(pid, w1, o1, n1, t1, w, o, n, first)
        if G > 2:
            w, o, n, first = _owner(pid, w2, o2, n2, t2, w, o, n, first)
        if G > 3:
            w, o, n, first = _owner(pid, w3, o3, n3, t3, w, o, n, first)
        if G > 4:
            w, o, n, first = _owner(pid, w4, o4, n4, t4, w, o, n, first)
        if G > 5:
            w, o, n, first = _owner(pid, w5, o5, n5, t5, w, o, n, first)
        if G > 6:
            w, o, n, first = _owner(pid, w6, o6, n6, t6, w, o, n, first)
        if G > 7:
            w, o, n, first = _owner(pid, w7, o7, n7, t7, w, o, n, first)
        # the launcher passes 16-byte aligned weights and outputs: a pointer made from an integer has
        # lost what Triton knows of an argument's alignment, and the loads stay vectorised with it
        w_ptr = tl.multiple_of(w.to(tl.pointer_type(dtype)), 16)
        out_ptr = tl.multiple_of(o.to(tl.pointer_type(dtype)), 16)
        rows = (pid - first) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < n
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
        k_start = tl.program_id(1) * k_per_split
        prefetch_then_wait(w_rows, row_ok, w_ptr, k_start, K, PREFETCH_K)
        pre = 0.0
        r_out = 0.0
        if COLLAPSE > 0:  # the collapse weights of the M tokens
            pre, r_out = collapse_weights(hc_dots, hc_sq, hc_gram, hc_base, hc_scale, 0, M, K, hc_split, hc_inv_k,
                                          hc_eps, hc_norm_eps, eps, COLLAPSE, HC_NP, HC_MP, HC_SP, T_PAD,
                                          COLLAPSE_NORM)
        acc = _rows_product(x_ptr, stride_x, M, K, k_start, k_per_split, w_rows, row_ok, norm_ptr, eps, pre, r_out,
                            hc_out, pid == 0, M_PAD, BLOCK_N, BLOCK_K, NORM, COLLAPSE, COLLAPSE_NORM)
        m = tl.arange(0, M_PAD)
        out = out_ptr + m[:, None] * n + rows[None, :]
        out_ok = (m < M)[:, None] & row_ok[None, :]
        if SPLIT_K:
            last, total = _split_k_finish(acc, part_ptr, counters_ptr, pid, tiles, split, M, M_PAD, BLOCK_N)
            if last:
                tl.store(out, total.to(dtype), mask=out_ok)
        else:
            tl.store(out, acc.to(dtype), mask=out_ok)
    else:  # a token's post and comb (COLLAPSE with hc_post only: the grid has no such programs otherwise)
        dependent_launch(PREFETCH_K > 0)
        if COLLAPSE > 0 and tl.program_id(1) == 0:
            t = pid - tiles
            post_and_comb(hc_dots, hc_sq, hc_base, hc_scale, hc_post, hc_comb, t, M, hc_split, hc_inv_k, hc_norm_eps,
                          hc_iters, hc_eps, COLLAPSE, HC_NP, HC_MP, HC_SP)


class Collapse(NamedTuple):
    """A hyper-connection whose collapse :func:`launch_linears` makes for its products: the
    projection's ``partials`` and ``dsv4::hc_pre``'s ``base``, ``scale``, ``iters``, ``hc_eps``,
    ``norm_eps`` and block norm ``out_norm = (weight [D] or None, eps)``; ``head``: ``dsv4::hc_head``'s
    (no post or comb)."""
    partials: Partials
    base: torch.Tensor
    scale: torch.Tensor
    iters: int
    hc_eps: float
    norm_eps: float
    out_norm: tuple[torch.Tensor | None, float]
    head: bool = False


# Tokens up to which launch_linears makes a collapse itself: each program sums every token's
# partials (a [SPLIT, T_PAD, N, N] tile of the Gram partials) before its K loop. One token: on an
# H100 at the Flash width, hc_post_pre and a sliding layer's q_a + kv took 14.7 µs fused against
# 18.0 apart at 1 token, but 82 µs against 19.4 at 2 and ~1,410 µs against ~20 at 3 and 4: there
# the projection splits D 128 ways and the partials' tile ([128, T_PAD, ...], ~84 fp32 values a
# thread at 4 tokens) makes ptxas spill (6 KiB of stack a thread, 72 registers) inside the K loop.
COLLAPSE_MAX_TOKENS = 1


def launch_linears(x: torch.Tensor | None, weights: list[torch.Tensor], config: TileConfig | None = None,
                   split_k: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                   collapse: Collapse | None = None) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]`` in one launch: ``x [M, K]`` (M <= :data:`MAX_ROWS`, unit
    stride along K), each ``w [N_g, K]`` contiguous of x's dtype, 1 to :data:`MAX_WEIGHTS` of
    them -> ``[M, N_g]`` each. ``config``: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``, and
    ``split_k``: whether K may be split over programs; without a config both are
    :func:`default_config`'s of K and the weights' rows. With ``norm_weight [K]`` (fp32 or x's
    dtype) the products are of ``rms_norm(x, norm_weight, eps)`` (K is then never split: each
    program needs whole rows of x for their norms).

    ``collapse`` (x None; M <= :data:`COLLAPSE_MAX_TOKENS` tokens of bf16 / fp16 streams): the
    products are of that hyper-connection's collapse, which the launch makes as ``dsv4::hc_pre``
    does -> ``[post, comb, collapsed, *products]`` (``[collapsed, *products]`` for a head)."""
    if collapse is not None:
        partials = collapse.partials
        x = partials.streams.view(-1, partials.n, partials.d)[:, 0]  # the streams' rows: M, K and dtype
    m, k = x.shape
    if m > MAX_ROWS or not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"launch_linears: {m} rows and {len(weights)} weights; the kernel takes at most "
                         f"{MAX_ROWS} rows and 1 to {MAX_WEIGHTS} weights")
    if collapse is not None and not 1 <= m <= COLLAPSE_MAX_TOKENS:
        raise ValueError(f"launch_linears: a collapse of {m} tokens; the kernel makes one of 1 to "
                         f"{COLLAPSE_MAX_TOKENS}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    weights = [_aligned(w) for w in weights]  # outputs are fresh allocations, aligned too
    outs = [x.new_empty(m, w.shape[0]) for w in weights]
    if config is None:
        config, split_k = default_config(k, sum(w.shape[0] for w in weights), m, norm=norm_weight is not None)
    block_n, block_k, warps, stages = config
    m_pad = rows_pad(m)
    firsts = [0]
    for w in weights:
        firsts.append(firsts[-1] + triton.cdiv(w.shape[0], block_n))
    tiles = firsts[-1]
    if collapse is None and (m == 0 or k == 0 or tiles == 0):  # nothing to read (an empty K sums to 0)
        return [o.zero_() for o in outs]
    args = []
    for g in range(MAX_WEIGHTS):  # unused slots (G <= g): never read
        args += [weights[g], outs[g], weights[g].shape[0], firsts[g]] if g < len(weights) else [x, x, 0, tiles]
    split, k_per_split = _split_plan(tiles, k, block_k, x.device) if split_k and norm_weight is None else (1, k)
    # the partials' workspace and the tiles' arrival counters (zeroed per launch: a buffer kept
    # between launches would be owned by the first CUDA graph whose warm-up made it); unread (x in
    # their place) without a split
    part = x.new_empty((split, tiles, m_pad, block_n), dtype=torch.float32) if split > 1 else x
    counters = torch.zeros(tiles, dtype=torch.int32, device=x.device) if split > 1 else x
    prefetch_k = _pdl_prefetch_k(k_per_split, block_n, x.element_size(), x.device)
    hc_args, hc_meta, riders, hc_outs = _collapse_args(collapse, x)
    if collapse is not None:
        norm_weight, eps = collapse.out_norm
        x = collapse.partials.streams
    norm = norm_weight.contiguous() if norm_weight is not None else x  # unread without a norm
    _linears_kernel[(tiles + riders, split)](x, m, k, x.stride(0), norm, float(eps), part, counters, tiles, split,
                                             k_per_split, *hc_args, *args, G=len(weights), M_PAD=m_pad,
                                             BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH_K=prefetch_k,
                                             SPLIT_K=split > 1, NORM=norm_weight is not None and collapse is None,
                                             **hc_meta, num_warps=warps, num_stages=stages,
                                             launch_pdl=prefetch_k > 0)
    return hc_outs + outs


def _collapse_args(collapse: Collapse | None, x: torch.Tensor) -> tuple[list, dict, int, list[torch.Tensor]]:
    """``(hc arguments, their constexprs, rider programs, [post, comb,] collapsed)`` of
    :func:`_linears_kernel` for ``collapse`` (x of the streams' rows); without one, unread
    arguments (x in the tensors' place) and no outputs."""
    if collapse is None:
        return [x] * 8 + [1, 0.0, 0, 0.0, 0.0], dict(COLLAPSE=0, HC_NP=1, HC_MP=1, HC_SP=1, T_PAD=1,
                                                      COLLAPSE_NORM=False), 0, []
    p = collapse.partials
    tokens = x.shape[0]
    collapsed = x.new_empty(tokens, p.d)
    # a head has no post or comb (and no programs to write them: fp32 partials in their place, unwritten)
    mixes = [] if collapse.head else [x.new_empty(tokens, p.n, dtype=torch.float32),
                                      x.new_empty(tokens, p.n, p.n, dtype=torch.float32)]
    layout = p.meta()
    args = [p.dots, p.sq, p.gram_arg, collapse.base.contiguous(), collapse.scale.contiguous(),
            *(mixes or [p.sq, p.sq]), collapsed, p.split, layout["inv_k"], collapse.iters, collapse.hc_eps,
            collapse.norm_eps]
    meta = dict(COLLAPSE=p.n, HC_NP=layout["NP"], HC_MP=layout["MP"], HC_SP=layout["SP"],
                T_PAD=triton.next_power_of_2(tokens), COLLAPSE_NORM=collapse.out_norm[0] is not None)
    return args, meta, 0 if collapse.head else tokens, [*mixes, collapsed]


@triton.jit
def _grouped_linear_kernel(x_ptr, w_ptr, out_ptr, M, G, K, N, stride_xm, stride_xg, tiles,
                           M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PREFETCH_K: tl.constexpr):
    """Group ``g = pid // tiles``, its column tile ``pid % tiles``: ``out[:, g, tile] =
    x[:, g, :] @ w[g N + tile].T`` (``out [M, G, N]`` contiguous, ``w [G N, K]``)."""
    pid = tl.program_id(0)
    g = pid // tiles
    rows = (pid - g * tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + (g * N + rows).to(tl.int64)[:, None] * K
    prefetch_then_wait(w_rows, row_ok, w_ptr, 0, K, PREFETCH_K)
    acc = _rows_product(x_ptr + g * stride_xg, stride_xm, M, K, 0, K, w_rows, row_ok, x_ptr, 0.0, 0.0, 0.0, x_ptr,
                        False, M_PAD, BLOCK_N, BLOCK_K, False, 0, False)
    m = tl.arange(0, M_PAD)
    out = out_ptr + (m.to(tl.int64)[:, None] * G + g) * N + rows[None, :]
    tl.store(out, acc.to(x_ptr.dtype.element_ty), mask=(m < M)[:, None] & row_ok[None, :])


def launch_grouped_linear(x: torch.Tensor, w: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
    """``out[:, g] = x[:, g] @ w.view(G, N, K)[g].T`` in one launch: ``x [M, G, K]`` (M <=
    :data:`MAX_ROWS`, unit stride along K), ``w [G N, K]`` of x's dtype -> ``[M, G, N]``
    contiguous. ``config`` as :func:`launch_linears`, by default :data:`GROUPED_CONFIG`."""
    m, groups, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"launch_grouped_linear: {m} rows; the kernel takes at most {MAX_ROWS}")
    n = w.shape[0] // groups
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = _aligned(w)
    out = x.new_empty(m, groups, n)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    block_n, block_k, warps, stages = config or (GROUPED_CONFIG if m <= DOT_MIN_ROWS else MANY_ROWS_GROUPED_CONFIG)
    tiles = triton.cdiv(n, block_n)
    prefetch_k = _pdl_prefetch_k(k, block_n, x.element_size(), x.device)
    _grouped_linear_kernel[(groups * tiles,)](x, w, out, m, groups, k, n, x.stride(0), x.stride(1), tiles,
                                              M_PAD=rows_pad(m), BLOCK_N=block_n, BLOCK_K=block_k,
                                              PREFETCH_K=prefetch_k, num_warps=warps, num_stages=stages,
                                              launch_pdl=prefetch_k > 0)
    return out
