"""Triton kernels of the mHC ops (``ops/hyper_connection.py``).

``dsv4::sinkhorn``: ``x [..., N, N] fp32`` is seen as ``M`` contiguous ``N x N`` matrices. Each
program (one warp for N <= 16) loads ``BLOCK_M`` of them as one ``[BLOCK_M, NP, NP]`` tile (NP = N
rounded up to a power of two), runs every normalisation in registers and stores once: one launch
instead of the string of kernels Inductor makes of the traced loop (it cannot fuse a reduction over
rows with the next one over columns).

``dsv4::hc_pre`` / ``dsv4::hc_head``: two launches for what Inductor runs as about ten kernels.

* ``_mix_partial_kernel``: the projection ``x [T, K] @ fn [M, K]ᵀ`` (K = N D) and each token's sum of
  squares, split over the D columns (``SPLIT`` programs per block of tokens, each taking its columns
  of every stream, so a decode step's few tokens still spread the ``M x K`` fp32 weights over the
  GPU) into fp32 partials ``[SPLIT, T, MP]``. The RMS norm is
  a per-token factor, so it is applied after the sum: ``(x r) fnᵀ = r (x fnᵀ)``. For
  ``dsv4::hc_post_pre`` (``POST``) a program first makes its columns of x from the previous block's
  mix, as ``_post_kernel`` does, and stores them: the previous ``hc_post`` costs no launch of its own.
* ``_pre_finish_kernel``: per token, the partials summed; program 0 of a token turns them into
  ``post``, the softmax of ``comb`` and its Sinkhorn normalisation (one warp, in registers; absent for
  ``hc_head``); the others each collapse ``BLOCK_D`` columns of the streams with ``pre``.

The block's RMSNorm after the collapse (``out_norm``) needs the whole collapsed row's sum of squares
in every collapse program. ``sum_d (sum_i pre_i x_i[d])² = preᵀ G pre`` with ``G`` the streams'
``N x N`` Gram matrix, which the projection's programs accumulate beside the mixes (they read every
stream column anyway); so each collapse program normalises its own columns with no program waiting
for another. The reference squares the collapse after its rounding to the streams' dtype, this the
unrounded one: the normalised values agree to one rounding. Where streams cancel, the form is a
difference of larger terms and its fp32 sum loses ~2^-24 times their ratio to it (a collapse ten
times smaller than its streams still agrees to a rounding).

``dsv4::hc_post``: ``post ⊗ out + combᵀ @ streams`` in one pass over the streams, with the reference's
roundings (weights, product, matrix product and sum each rounded to the streams' dtype).

``dsv4::hc_*_linears`` (a collapse made by its products' launch, ``ops/kernels/linear.py``) run the
projection alone (:func:`mix_partials`) and, in the products' kernel, the finishing kernel's two
halves: :func:`collapse_weights` (the collapse weights and the block norm's factor, from the
partials) in every product program, :func:`post_and_comb` in a program per token beside them.

Numerics: every Sinkhorn step is the reference's ``x / (sum + eps)`` with an IEEE division
(``div_rn``); sums (the projection's split-K, the N-term reductions) add in another order than the
reference's, so results agree to fp32 rounding. Padding (rows and columns past N, matrices past M)
is loaded as 0 and stays 0, so it adds nothing to a sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .host import has_pdl

MAX_N = 64  # a program holds whole matrices in registers: up to 64 x 64 (hc_mult is 4)
# hc_pre / hc_post hold a token's N x N comb and N streams of BLOCK_D columns in one program.
MAX_HC_N = 16
# Elements of a Sinkhorn program's tile: as many matrices as fit in 64 (at least one), one warp up
# to 256 elements. The 2 iters - 1 normalisations are a chain of dependent reductions, so a program
# is kept small (no cross-warp reduction for N <= 16) and M is spread over programs (on the H200:
# 3.5 µs for one 4 x 4 matrix, against 41 µs for Inductor's 39 kernels).
_TILE_ELEMS = 64
_WARP_ELEMS = 256
# Projection partials: a program's [BLOCK_T, MP, NP BLOCK_C] product tile holds _PRODUCT_ELEMS / MP
# (token, k) pairs, and at least one column of each stream (so more at N = 16, M = 288, and 2+ tokens);
# about _MIX_PROGRAMS programs in all (four per SM of an H200), at most _MAX_SPLIT splits of the
# columns (the finishing kernel sums them in one tile).
_PRODUCT_ELEMS = 8192
_MIX_PROGRAMS = 512
_MAX_SPLIT = 128
_MAX_BLOCK_T = 8
_BLOCK_D = 512  # streams' columns per collapse / hc_post program
# hc_post_pre makes the new streams inside the projection up to this many tokens. On the H200, one
# Flash-width op (bench_hyper_connection.py), µs in the projection against hc_post then hc_pre:
# 8.9 / 9.7 at 1 token, 9.0 / 10.7 at 2, 10.8 / 11.1 at 3, 10.7 / 11.1 at 4, 14.5 / 11.4 at 6 and
# 14.7 / 11.6 at 8 (each program then gathers the four old streams of several tokens per K block).
# Measured with the projection split over K = N D; not re-measured since it splits the D columns.
POSTED_MAX_TOKENS = 4


@triton.jit
def _normalise(x, s, eps, mask):
    """``x / (s + eps)``; padding is divided by 1 and stays 0 (with eps = 0 it would be 0 / 0)."""
    return tl.math.div_rn(x, tl.where(mask, s + eps, 1.0))


@triton.jit
def _sinkhorn_tile(x, iters, eps, mask):
    """A ``[B, NP, NP]`` tile of matrices (padding 0, ``mask`` true inside): a column
    normalisation, then ``iters - 1`` (row, column) pairs."""
    x = _normalise(x, tl.sum(x, axis=1, keep_dims=True), eps, mask)
    for _ in range(iters - 1):
        x = _normalise(x, tl.sum(x, axis=2, keep_dims=True), eps, mask)
        x = _normalise(x, tl.sum(x, axis=1, keep_dims=True), eps, mask)
    return x


@triton.jit
def _sinkhorn_kernel(x_ptr, out_ptr, M, iters, eps, N: tl.constexpr, NP: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    """Matrices ``[pid * BLOCK_M, (pid + 1) * BLOCK_M)`` of ``x [M, N, N]`` -> ``out``."""
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M * N * N may pass 2**31
    r = tl.arange(0, NP)
    row, col = r[None, :, None], r[None, None, :]
    mask = (m[:, None, None] < M) & (row < N) & (col < N)
    offs = m[:, None, None] * (N * N) + row * N + col
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _sinkhorn_tile(x, iters, eps, mask), mask=mask)


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


@triton.jit
def _rounded_mix(expanded, mixed, dt: tl.constexpr):
    """The next streams in ``dt`` from the fp32 ``post ⊗ out`` and ``combᵀ @ streams``, each rounded
    to ``dt`` before their sum is, as the reference (the decoder layer) rounds them."""
    return (expanded.to(dt).to(tl.float32) + mixed.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _posted_streams(streams_ptr, post_ptr, comb_ptr, out_ptr, new_ptr, t, t_ok, d, d_ok, D,
                    N: tl.constexpr, NP: tl.constexpr):
    """Columns ``d [BLOCK_C]`` of every next stream of tokens ``t [BLOCK_T]``: ``new[t, j, d] =
    post[t, j] out[t, d] + sum_l comb[t, l, j] streams[t, l, d]``, rounded as ``_post_kernel``
    rounds, stored to ``new_ptr`` and returned as fp32 ``[BLOCK_T, NP, BLOCK_C]`` (0 past the last
    stream and column)."""
    dt = new_ptr.dtype.element_ty
    j = tl.arange(0, NP)
    j_ok = j < N
    tok = t[:, None, None].to(tl.int64)
    ok = t_ok[:, None, None] & (j_ok[:, None] & d_ok[None, :])[None, :, :]  # [BLOCK_T, j, d]
    # the streams last: the compiler converts their layout (a warp barrier) as soon as they are
    # loaded, and a load after that barrier waits for them
    offs = (tok * N + j[None, :, None]) * D + d[None, None, :]
    block_out = tl.load(out_ptr + tok * D + d[None, None, :], mask=t_ok[:, None, None] & d_ok[None, None, :],
                        other=0.0).to(tl.float32)  # [BLOCK_T, 1, d]
    post = tl.load(post_ptr + tok * N + j[None, :, None], mask=t_ok[:, None, None] & j_ok[None, :, None],
                   other=0.0).to(dt).to(tl.float32)  # [BLOCK_T, j, 1]
    comb = tl.load(comb_ptr + tok * (N * N) + j[None, :, None] * N + j[None, None, :],
                   mask=t_ok[:, None, None] & j_ok[None, :, None] & j_ok[None, None, :],
                   other=0.0).to(dt).to(tl.float32)  # [BLOCK_T, l, j]: comb[t, l, j]
    streams = tl.load(streams_ptr + offs, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_T, l, d]
    mixed = tl.sum(comb[:, :, :, None] * streams[:, :, None, :], axis=1)  # [BLOCK_T, j, d]
    new = _rounded_mix(post * block_out, mixed, dt)
    tl.store(new_ptr + offs, new, mask=ok)
    return new.to(tl.float32)


@triton.jit
def _mix_partial_kernel(x_ptr, fn_ptr, dots_ptr, sq_ptr, post_ptr, comb_ptr, out_ptr, new_ptr, gram_ptr, T, D, M,
                        d_per_split, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr, MP: tl.constexpr, POST: tl.constexpr, GRAM: tl.constexpr,
                        PDL: tl.constexpr):
    """Split ``s = pid(1)`` (columns ``[s d_per_split, (s + 1) d_per_split)`` of every stream, so the
    split's part of K = N D) of tokens ``[pid(0) BLOCK_T, +BLOCK_T)``: ``dots[s, t, m] =
    sum_k x[t, k] fn[m, k]`` and ``sq[s, t] = sum_k x[t, k]²`` over those k, fp32. ``POST``:
    ``x_ptr`` holds the streams before the previous block's mix (``post_ptr``, ``comb_ptr``,
    ``out_ptr``); x is made from them and stored to ``new_ptr``. ``GRAM``: also ``gram[s, t, i, j] =
    sum_d x[t, i, d] x[t, j, d]`` (``[NP, NP]`` per token, padding 0): summed over the splits, the
    streams' Gram matrix, whose quadratic form in the collapse weights is the collapse's sum of
    squares. ``PDL``: a kernel launched after it with PDL may start at once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    s = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = tl.arange(0, MP)
    i = tl.arange(0, NP)
    t_ok, m_ok, i_ok = t < T, m < M, i < N
    K = N * D
    rows = t[:, None, None].to(tl.int64) * K
    # the product's columns flattened, stream-major (c = i BLOCK_C + column), so that it reduces
    # over one axis; products accumulate elementwise and are reduced once, after the loop
    c = tl.arange(0, NP * BLOCK_C)
    acc = tl.zeros([BLOCK_T, MP, NP * BLOCK_C], tl.float32)
    sq = tl.zeros([BLOCK_T, NP * BLOCK_C], tl.float32)
    gram = tl.zeros([BLOCK_T, NP, NP, BLOCK_C], tl.float32)
    d_start = s * d_per_split
    for d0 in range(d_start, d_start + d_per_split, BLOCK_C):
        d = d0 + tl.arange(0, BLOCK_C)
        d_ok = d < D
        # the weights first: loaded after the new streams' store they would wait for the mix
        k_flat = (c // BLOCK_C) * D + d0 + c % BLOCK_C
        k_ok = (c // BLOCK_C < N) & (d0 + c % BLOCK_C < D)
        w = tl.load(fn_ptr + m[:, None] * K + k_flat[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)  # [MP, NP BLOCK_C]
        if POST:
            xv = _posted_streams(x_ptr, post_ptr, comb_ptr, out_ptr, new_ptr, t, t_ok, d, d_ok, D, N, NP)
        else:
            k = i[:, None] * D + d[None, :]  # [NP, BLOCK_C]: the columns of x
            xv = tl.load(x_ptr + rows + k[None, :, :], mask=t_ok[:, None, None] & (i_ok[:, None] & d_ok[None, :])[None],
                         other=0.0).to(tl.float32)  # [BLOCK_T, NP, BLOCK_C]
        x_flat = tl.reshape(xv, [BLOCK_T, NP * BLOCK_C])
        acc += x_flat[:, None, :] * w[None, :, :]
        sq += x_flat * x_flat
        if GRAM:
            gram += xv[:, :, None, :] * xv[:, None, :, :]
    row = (s * T + t).to(tl.int64)
    tl.store(dots_ptr + row[:, None] * MP + m[None, :], tl.sum(acc, axis=2), mask=t_ok[:, None])
    tl.store(sq_ptr + row, tl.sum(sq, axis=1), mask=t_ok)
    if GRAM:
        tl.store(gram_ptr + row[:, None, None] * (NP * NP) + (i[:, None] * NP + i[None, :])[None, :, :],
                 tl.sum(gram, axis=3), mask=t_ok[:, None, None])


@triton.jit
def _summed_mixes(dots_ptr, rows, first, n, s_ok, n_ok):
    """Mixes ``first + n`` (``[NP]``) of one token, its splits' partials (at ``rows [SP]``) summed."""
    return tl.sum(tl.load(dots_ptr + rows[:, None] + first + n[None, :], mask=s_ok[:, None] & n_ok[None, :],
                          other=0.0), axis=0)


@triton.jit
def collapse_weights(dots_ptr, sq_ptr, gram_ptr, base_ptr, scale_ptr, t0, T, D, SPLIT, inv_k, hc_eps, norm_eps,
                     out_norm_eps, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr,
                     T_PAD: tl.constexpr, NORM: tl.constexpr):
    """Of tokens ``t0 + [0, T_PAD)``, from the projection's ``SPLIT`` partials (``dots [SPLIT, T,
    MP]``, ``sq [SPLIT, T]``, with ``NORM`` ``gram [SPLIT, T, NP NP]``): ``(pre [T_PAD, NP], r_out
    [T_PAD])``, the collapse weights (0 past N; their mixes scaled by the streams' RMS factor) and
    the block norm's factor of the collapse (1 without ``NORM``). Tokens past ``T`` get finite
    values no one stores."""
    s = tl.arange(0, SP)
    t = t0 + tl.arange(0, T_PAD)
    n = tl.arange(0, NP)
    n_ok = n < N
    st = s[:, None] * T + t[None, :]  # [SP, T_PAD]: each split's partials of each token
    st_ok = (s < SPLIT)[:, None] & (t < T)[None, :]
    # every load before the first sqrt_rn / div_rn, whose slow-path branch ends the block of
    # instructions the compiler would issue the loads from: one wait on memory, not three
    sq = tl.load(sq_ptr + st, mask=st_ok, other=0.0)
    mixes = tl.load(dots_ptr + st[:, :, None] * MP + n[None, None, :], mask=st_ok[:, :, None] & n_ok[None, None, :],
                    other=0.0)
    scale = tl.load(scale_ptr)
    base = tl.load(base_ptr + n, mask=n_ok, other=0.0)
    if NORM:
        ij = n[:, None] * NP + n[None, :]
        gram = tl.sum(tl.load(gram_ptr + st[:, :, None, None] * (NP * NP) + ij[None, None, :, :],
                              mask=st_ok[:, :, None, None], other=0.0), axis=0)  # [T_PAD, NP, NP], padding 0
    r = _rms_factor(tl.sum(sq, axis=0), inv_k, norm_eps)
    mix = tl.sum(mixes, axis=0) * r[:, None]  # [T_PAD, NP]
    pre = tl.sigmoid(mix * scale + base[None, :]) + hc_eps
    pre = tl.where(n_ok[None, :], pre, 0.0)
    r_out = tl.full((T_PAD,), 1.0, tl.float32)
    if NORM:
        total = tl.maximum(tl.sum(tl.sum(gram * pre[:, :, None] * pre[:, None, :], axis=2), axis=1), 0.0)
        r_out = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(total, D.to(tl.float32)) + out_norm_eps))
    return pre, r_out


@triton.jit
def post_and_comb(dots_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, t, T, SPLIT, inv_k, norm_eps, iters,
                  hc_eps, N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr):
    """Token ``t``'s ``post [N]`` and ``comb [N, N]`` (softmax, then ``iters`` Sinkhorn steps) from
    its splits' summed mixes scaled by the streams' RMS factor, stored to ``post_ptr`` /
    ``comb_ptr``. Every partial and parameter is loaded up front, so the chain before the Sinkhorn
    steps waits for memory once."""
    s = tl.arange(0, SP)
    s_ok = s < SPLIT
    n = tl.arange(0, NP)
    n_ok = n < N
    rows = (s * T + t) * MP  # [SP]: each split's partials of this token
    sq = tl.load(sq_ptr + s * T + t, mask=s_ok, other=0.0)
    post_mix = _summed_mixes(dots_ptr, rows, N, n, s_ok, n_ok)
    # comb's mixes summed in the Sinkhorn tile's own layout (a [1, NP, NP] load per split): the
    # steps reduce over its rows and columns with shuffles alone. Summed as one [SP, NP, NP] load
    # instead, the tile comes out in a layout of that sum and the kernel took 19 µs a call.
    row, col = n[None, :, None], n[None, None, :]
    tile_ok = (row < N) & (col < N)
    ij = 2 * N + row * N + col
    comb_mix = tl.zeros([1, NP, NP], tl.float32)
    for i in tl.static_range(SP):
        comb_mix += tl.load(dots_ptr + (i * T + t) * MP + ij, mask=tile_ok & (i < SPLIT), other=0.0)
    # the parameters too, before sqrt_rn's slow-path branch (loads after it would wait for it)
    post_scale, comb_scale = tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    post_base = tl.load(base_ptr + N + n, mask=n_ok, other=0.0)
    comb_base = tl.load(base_ptr + ij, mask=tile_ok, other=0.0)
    r = _rms_factor(tl.sum(sq, axis=0), inv_k, norm_eps)
    post = 2 * tl.sigmoid(post_mix * r * post_scale + post_base)
    tl.store(post_ptr + t * N + n, post, mask=n_ok)
    # padding: a finite floor, so padding rows (all floor) stay finite; exp sends it to 0 elsewhere
    logits = tl.where(tile_ok, comb_mix * r * comb_scale + comb_base, -3.0e38)
    e = tl.exp(logits - tl.max(logits, axis=2, keep_dims=True))
    softmax = tl.where(tile_ok, e / tl.sum(e, axis=2, keep_dims=True) + hc_eps, 0.0)  # padding 0, as the steps need
    comb = _sinkhorn_tile(softmax, iters, hc_eps, tile_ok)
    tl.store(comb_ptr + t * (N * N) + row * N + col, comb, mask=tile_ok)


@triton.jit
def _rms_factor(sum_sq, inv_k, norm_eps):
    """The streams' RMS norm factor ``1 / sqrt(mean + eps)`` from their summed squares."""
    return 1.0 / tl.sqrt_rn(sum_sq * inv_k + norm_eps)


@triton.jit
def _pre_finish_kernel(x_ptr, dots_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
                       norm_weight_ptr, gram_ptr, T, D, SPLIT, inv_k, iters, hc_eps, norm_eps, out_norm_eps,
                       N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr,
                       BLOCK_D: tl.constexpr, HEAD: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """Token ``t = pid(0)``: the partials of its ``SPLIT`` splits summed and scaled by the RMS
    factor; part ``pid(1)`` 0 (not for ``HEAD``) writes ``post [T, N]`` and ``comb [T, N, N]``, every
    other part ``BLOCK_D`` columns of ``out [T, D]``. ``NORM``: ``out`` RMS-normalised with
    ``norm_weight [D]``, its sum of squares the quadratic form of the streams' Gram matrix (the
    ``gram`` partials) in the collapse weights: each program knows it without waiting for the
    others. ``PDL``: the kernel after it (launched with PDL, waiting for this grid before it reads)
    may launch at once, its set-up and weight prefetch overlapping this kernel."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    d_part = part if HEAD else part - 1
    if d_part < 0:
        post_and_comb(dots_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, t, T, SPLIT, inv_k, norm_eps, iters,
                      hc_eps, N, NP, MP, SP)
    else:
        n = tl.arange(0, NP)
        d = d_part * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        # the streams and the norm's weight with the partials, before collapse_weights' divisions
        xs = tl.load(x_ptr + (t * N + n[:, None]) * D + d[None, :], mask=(n < N)[:, None] & d_ok[None, :], other=0.0)
        if NORM:
            w = tl.load(norm_weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        pre, r_out = collapse_weights(dots_ptr, sq_ptr, gram_ptr, base_ptr, scale_ptr, t, T, D, SPLIT, inv_k,
                                      hc_eps, norm_eps, out_norm_eps, N, NP, MP, SP, 1, NORM)
        collapsed = tl.sum(tl.sum(pre, axis=0)[:, None] * xs.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty)
        if NORM:
            collapsed = (collapsed.to(tl.float32) * tl.sum(r_out, axis=0) * w).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * D + d, collapsed, mask=d_ok)


def _mix_plan(tokens: int, d: int, n: int, m: int) -> tuple[int, int, int, int, int]:
    """``(MP, BLOCK_T, BLOCK_C, token blocks, d_per_split)`` of the projection of ``tokens`` rows of
    ``n`` streams of ``d`` columns by ``m`` mix weights."""
    mp = triton.next_power_of_2(m)
    block_t = min(_MAX_BLOCK_T, triton.next_power_of_2(max(tokens, 1)))
    block_c = max(1, _PRODUCT_ELEMS // (mp * block_t * triton.next_power_of_2(n)))
    t_blocks = triton.cdiv(tokens, block_t)
    split = max(1, min(_MAX_SPLIT, triton.cdiv(d, block_c), _MIX_PROGRAMS // max(t_blocks, 1)))
    return mp, block_t, block_c, t_blocks, triton.cdiv(triton.cdiv(d, split), block_c) * block_c


class Partials(NamedTuple):
    """What ``_mix_partial_kernel`` leaves for a collapse: ``streams [T, N D]`` it reads (``x``, or
    the new streams it made), fp32 ``dots [split, T, MP]``, ``sq [split, T]`` and, for the block's
    norm, ``gram [split, T, NP NP]`` (None without it)."""
    streams: torch.Tensor
    dots: torch.Tensor
    sq: torch.Tensor
    gram: torch.Tensor | None
    n: int
    d: int

    @property
    def split(self) -> int:
        return self.dots.shape[0]

    @property
    def gram_arg(self) -> torch.Tensor:
        """The Gram partials, or without the norm ``sq`` in their place (unread)."""
        return self.gram if self.gram is not None else self.sq

    def meta(self) -> dict[str, int | float]:
        """What a finishing program needs of the partials' layout: ``inv_k`` (1 / (N D)), ``NP``
        (N padded to a power of two), ``MP`` (the mixes' row), ``SP`` (the splits padded)."""
        return dict(inv_k=1.0 / (self.n * self.d), NP=triton.next_power_of_2(self.n), MP=self.dots.shape[2],
                    SP=triton.next_power_of_2(self.split))


def mix_partials(xs: torch.Tensor, fn: torch.Tensor, n: int, d: int,
                 posted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, normed: bool,
                 trigger_dependents: bool = False) -> Partials:
    """The projection's launch over ``xs [T, N D]`` (``T >= 1``; contiguous) and ``fn [M, N D]``:
    ``posted = (post, comb, out)`` makes the new streams from ``xs`` first (at most
    :data:`POSTED_MAX_TOKENS` tokens). ``trigger_dependents``: a kernel launched after it with PDL
    may start at once (it waits for this grid before it reads)."""
    tokens, m = xs.shape[0], fn.shape[0]
    mp, block_t, block_c, t_blocks, d_per_split = _mix_plan(tokens, d, n, m)
    split = triton.cdiv(d, d_per_split)
    np2 = triton.next_power_of_2(n)
    streams = xs if posted is None else torch.empty_like(xs)
    dots = torch.empty((split, tokens, mp), dtype=torch.float32, device=xs.device)
    sq = torch.empty((split, tokens), dtype=torch.float32, device=xs.device)
    gram = torch.empty((split, tokens, np2 * np2), dtype=torch.float32, device=xs.device) if normed else None
    mixed = [t.contiguous() for t in posted] if posted is not None else (xs, xs, xs)  # unread without POST
    _mix_partial_kernel[(t_blocks, split)](xs, fn, dots, sq, *mixed, streams, gram if normed else sq, tokens, d, m,
                                           d_per_split, N=n, NP=np2, BLOCK_T=block_t, BLOCK_C=block_c, MP=mp,
                                           POST=posted is not None, GRAM=normed,
                                           PDL=trigger_dependents and has_pdl(xs.device))
    return Partials(streams, dots, sq, gram, n, d)


def launch_hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                  hc_eps: float, norm_eps: float, head: bool = False,
                  posted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  out_norm: tuple[torch.Tensor | None, float] = (None, 0.0)):
    """``x [..., N, D]`` (N <= :data:`MAX_HC_N`), ``fn [M, N D]``, ``base [M]``, ``scale`` as
    ``dsv4::hc_pre`` (``head=False``: returns ``post, comb, collapsed``) or ``dsv4::hc_head``
    (``head=True``: returns ``collapsed``). ``posted = (post, comb, out)``: ``dsv4::hc_post_pre``, x the
    streams before that mix; returns ``new_streams, post, comb, collapsed``. The projection makes the
    new streams up to :data:`POSTED_MAX_TOKENS` tokens; above, ``_post_kernel`` makes them first.
    ``out_norm = (weight [D] or None, eps)``: the block's RMSNorm, applied to ``collapsed`` by its
    collapse programs."""
    n, d = x.shape[-2:]
    lead = x.shape[:-2]
    xs = x.contiguous().view(-1, n * d)
    fn, base, scale = fn.contiguous(), base.contiguous(), scale.contiguous()
    tokens = xs.shape[0]
    if posted is not None and tokens > POSTED_MAX_TOKENS:
        new = launch_hc_post(*posted, x)
        return (new, *launch_hc_pre(new, fn, base, scale, iters, hc_eps, norm_eps, out_norm=out_norm))
    post = x.new_empty((*lead, n), dtype=torch.float32)
    comb = x.new_empty((*lead, n, n), dtype=torch.float32)
    out = x.new_empty((*lead, d))
    if tokens:
        norm_weight, out_norm_eps = out_norm
        normed = norm_weight is not None
        partials = mix_partials(xs, fn, n, d, posted, normed)
        streams = partials.streams  # x, or the new ones the projection's programs made
        parts = triton.cdiv(d, _BLOCK_D) + (0 if head else 1)
        meta = partials.meta()
        _pre_finish_kernel[(tokens, parts)](streams, partials.dots, partials.sq, base, scale, post, comb, out,
                                            norm_weight.contiguous() if normed else partials.sq, partials.gram_arg,
                                            tokens, d, partials.split, meta["inv_k"], iters, hc_eps, norm_eps,
                                            out_norm_eps, N=n, NP=meta["NP"], MP=meta["MP"], SP=meta["SP"],
                                            BLOCK_D=_BLOCK_D, HEAD=head, NORM=normed, PDL=has_pdl(x.device),
                                            num_warps=1)
    else:
        streams = xs if posted is None else torch.empty_like(xs)  # a new tensor, as empty as x
    if head:
        return out
    return (post, comb, out) if posted is None else (streams.view(x.shape), post, comb, out)


@triton.jit
def _post_kernel(post_ptr, comb_ptr, out_ptr, streams_ptr, new_ptr, D, N: tl.constexpr, NP: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Token ``pid(0)``, columns ``[pid(1) BLOCK_D, +BLOCK_D)``:
    ``new[k, :] = post[k] out + sum_j comb[j, k] streams[j, :]``, rounded as the reference rounds."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    n = tl.arange(0, NP)
    n_ok = n < N
    dt = new_ptr.dtype.element_ty
    post = tl.load(post_ptr + t * N + n, mask=n_ok, other=0.0).to(dt).to(tl.float32)
    comb = tl.load(comb_ptr + t * (N * N) + n[:, None] * N + n[None, :], mask=n_ok[:, None] & n_ok[None, :],
                   other=0.0).to(dt).to(tl.float32)  # [j, k]
    offs = (t * N + n[:, None]) * D + d[None, :]
    mask = n_ok[:, None] & d_ok[None, :]
    streams = tl.load(streams_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [j, BLOCK_D]
    block_out = tl.load(out_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * streams[:, None, :], axis=0)  # [k, BLOCK_D]
    tl.store(new_ptr + offs, _rounded_mix(post[:, None] * block_out[None, :], mixed, dt), mask=mask)


def launch_hc_post(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``dsv4::hc_post``: ``post [..., N]``, ``comb [..., N, N]``, ``out [..., D]``, ``streams [..., N, D]``
    (N <= :data:`MAX_HC_N`) -> a new contiguous ``[..., N, D]`` in ``streams``' dtype."""
    n, d = streams.shape[-2:]
    streams = streams.contiguous()
    new = torch.empty_like(streams)
    tokens = streams.numel() // (n * d) if n * d else 0
    if tokens:
        _post_kernel[(tokens, triton.cdiv(d, _BLOCK_D))](post.contiguous(), comb.contiguous(), out.contiguous(),
                                                         streams, new, d, N=n, NP=triton.next_power_of_2(n),
                                                         BLOCK_D=_BLOCK_D)
    return new
