"""Triton kernels of the mHC ops (``ops/hyper_connection.py``).

``dsv4::sinkhorn``: ``x [..., N, N] fp32`` is seen as ``M`` contiguous ``N x N`` matrices. Each
program (one warp for N <= 16) loads ``BLOCK_M`` of them as one ``[BLOCK_M, NP, NP]`` tile (NP = N
rounded up to a power of two), runs every normalisation in registers and stores once: one launch
instead of the string of kernels Inductor makes of the traced loop (it cannot fuse a reduction over
rows with the next one over columns).

``dsv4::hc_pre`` / ``dsv4::hc_head``: two launches for what Inductor runs as about ten kernels.

* ``_mix_partial_kernel``: the projection ``x [T, K] @ fn [M, K]ᵀ`` (K = N D) and each token's sum of
  squares, split over K (``SPLIT`` programs per block of tokens, so a decode step's few tokens still
  spread the ``M x K`` fp32 weights over the GPU) into fp32 partials ``[SPLIT, T, MP]``. The RMS norm is
  a per-token factor, so it is applied after the sum: ``(x r) fnᵀ = r (x fnᵀ)``. For
  ``dsv4::hc_post_pre`` (``POST``) a program first makes its columns of x from the previous block's
  mix, as ``_post_kernel`` does, and stores them: the previous ``hc_post`` costs no launch of its own.
* ``_pre_finish_kernel``: per token, the partials summed; program 0 of a token turns them into
  ``post``, the softmax of ``comb`` and its Sinkhorn normalisation (one warp, in registers; absent for
  ``hc_head``); the others each collapse ``BLOCK_D`` columns of the streams with ``pre``.

``dsv4::hc_post``: ``post ⊗ out + combᵀ @ streams`` in one pass over the streams, with the reference's
roundings (weights, product, matrix product and sum each rounded to the streams' dtype).

Numerics: every Sinkhorn step is the reference's ``x / (sum + eps)`` with an IEEE division
(``div_rn``); sums (the projection's split-K, the N-term reductions) add in another order than the
reference's, so results agree to fp32 rounding. Padding (rows and columns past N, matrices past M)
is loaded as 0 and stays 0, so it adds nothing to a sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .host import INTERPRET
from .primitives import prefetch_l2

MAX_N = 64  # a program holds whole matrices in registers: up to 64 x 64 (hc_mult is 4)
# hc_pre / hc_post hold a token's N x N comb and N streams of BLOCK_D columns in one program.
MAX_HC_N = 16
# Elements of a Sinkhorn program's tile: as many matrices as fit in 64 (at least one), one warp up
# to 256 elements. The 2 iters - 1 normalisations are a chain of dependent reductions, so a program
# is kept small (no cross-warp reduction for N <= 16) and M is spread over programs (on the H200:
# 3.5 µs for one 4 x 4 matrix, against 41 µs for Inductor's 39 kernels).
_TILE_ELEMS = 64
_WARP_ELEMS = 256
# Projection partials: a program's [BLOCK_T, MP, BLOCK_K] product tile holds _PRODUCT_ELEMS / MP
# (token, k) pairs; about _MIX_PROGRAMS programs in all (four per SM of an H200), at most
# _MAX_SPLIT splits of K (the finishing kernel sums them in one tile).
_PRODUCT_ELEMS = 8192
_MIX_PROGRAMS = 512
_MAX_SPLIT = 128
_MAX_BLOCK_T = 8
_BLOCK_D = 512  # streams' columns per collapse / hc_post program
# Columns a step of the norm's rewrite of a collapsed row (one program, one warp, after the row's
# collapse programs): few L2 round trips, few enough registers.
_NORM_BLOCK = 2048
# hc_post_pre makes the new streams inside the projection up to this many tokens. On the H200, one
# Flash-width op (bench_hyper_connection.py), µs in the projection against hc_post then hc_pre:
# 8.9 / 9.7 at 1 token, 9.0 / 10.7 at 2, 10.8 / 11.1 at 3, 10.7 / 11.1 at 4, 14.5 / 11.4 at 6 and
# 14.7 / 11.6 at 8 (each program then gathers the four old streams of several tokens per K block).
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
def _posted_streams(streams_ptr, post_ptr, comb_ptr, out_ptr, new_ptr, t, t_ok, k0, D,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns ``[k0, k0 + BLOCK_K)`` of the flattened next streams of tokens ``t [BLOCK_T]``, all in
    stream ``i = k0 // D`` (``BLOCK_K`` divides D): ``new[t, i, d] = post[t, i] out[t, d] +
    sum_j comb[t, j, i] streams[t, j, d]``, rounded as ``_post_kernel`` rounds, stored to ``new_ptr``
    and returned as fp32 ``[BLOCK_T, BLOCK_K]`` (0 past the last stream)."""
    dt = new_ptr.dtype.element_ty
    i = k0 // D
    d = k0 - i * D + tl.arange(0, BLOCK_K)
    j = tl.arange(0, NP)
    tok = t[:, None].to(tl.int64)
    t_ok = t_ok[:, None] & (i < N)
    post = tl.load(post_ptr + tok * N + i, mask=t_ok, other=0.0).to(dt).to(tl.float32)  # [BLOCK_T, 1]
    comb = tl.load(comb_ptr + tok * (N * N) + j[None, :] * N + i, mask=t_ok & (j < N)[None, :],
                   other=0.0).to(dt).to(tl.float32)  # [BLOCK_T, j]: comb[t, j, i]
    streams = tl.load(streams_ptr + (tok[:, :, None] * N + j[None, :, None]) * D + d[None, None, :],
                      mask=t_ok[:, :, None] & (j < N)[None, :, None], other=0.0).to(tl.float32)
    block_out = tl.load(out_ptr + tok * D + d[None, :], mask=t_ok, other=0.0).to(tl.float32)
    new = _rounded_mix(post * block_out, tl.sum(comb[:, :, None] * streams, axis=1), dt)
    tl.store(new_ptr + tok * (N * D) + k0 + tl.arange(0, BLOCK_K)[None, :], new, mask=t_ok)
    return new.to(tl.float32)


@triton.jit
def _mix_partial_kernel(x_ptr, fn_ptr, dots_ptr, sq_ptr, post_ptr, comb_ptr, out_ptr, new_ptr, counters_ptr, T, D, M,
                        k_per_split, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_K: tl.constexpr, MP: tl.constexpr, POST: tl.constexpr, NORM: tl.constexpr):
    """Split ``s = pid(1)`` (columns ``[s k_per_split, (s + 1) k_per_split)`` of K = N D) of tokens
    ``[pid(0) BLOCK_T, +BLOCK_T)``: ``dots[s, t, m] = sum_k x[t, k] fn[m, k]`` and
    ``sq[s, t] = sum_k x[t, k]²``, fp32. ``POST``: ``x_ptr`` holds the streams before the previous
    block's mix (``post_ptr``, ``comb_ptr``, ``out_ptr``); x is made from them and stored to ``new_ptr``.
    ``NORM``: split 0 zeroes the tokens' arrival counters of ``_pre_finish_kernel``'s norm."""
    s = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = tl.arange(0, MP)
    t_ok, m_ok = t < T, m < M
    if NORM:
        tl.store(counters_ptr + t, tl.zeros([BLOCK_T], tl.int32), mask=t_ok & (s == 0))
    K = N * D
    # products accumulate elementwise and are reduced over k once, after the loop
    acc = tl.zeros([BLOCK_T, MP, BLOCK_K], tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    k_start = s * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        if POST:
            xv = _posted_streams(x_ptr, post_ptr, comb_ptr, out_ptr, new_ptr, t, t_ok, k0, D, N, NP, BLOCK_K)
        else:
            xv = tl.load(x_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                         other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += xv[:, None, :] * w[None, :, :]
        sq += xv * xv
    row = (s * T + t).to(tl.int64)
    tl.store(dots_ptr + row[:, None] * MP + m[None, :], tl.sum(acc, axis=2), mask=t_ok[:, None])
    tl.store(sq_ptr + row, tl.sum(sq, axis=1), mask=t_ok)


@triton.jit
def _summed_mixes(dots_ptr, rows, first, n, s_ok, n_ok):
    """Mixes ``first + n`` (``[NP]``) of one token, its splits' partials (at ``rows [SP]``) summed."""
    return tl.sum(tl.load(dots_ptr + rows[:, None] + first + n[None, :], mask=s_ok[:, None] & n_ok[None, :],
                          other=0.0), axis=0)


@triton.jit
def _normalise_collapsed(out_ptr, collapsed, t, d_part, D, weight_ptr, eps, sq_ptr, counters_ptr,
                         PARTS: tl.constexpr, PARTS_P2: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """The block's RMSNorm of row ``t`` of ``out [T, D]``, whose ``PARTS`` collapse programs each
    hold their columns (``collapsed``, already rounded and stored): each stores its sum of squares
    to ``sq [T, PARTS]`` and counts its arrival on ``counters[t]``; the last to arrive sums them in
    part order and rewrites the row as the reference norm does: ``((x r) w)`` rounded, with
    ``r = 1 / sqrt(mean(x²) + eps)``."""
    v = collapsed.to(tl.float32)
    tl.store(sq_ptr + t * PARTS + d_part, tl.sum(v * v, axis=0))
    tl.debug_barrier()  # the row's columns and the sum stored before the (one-thread) release below
    if tl.atomic_add(counters_ptr + t, 1, sem="acq_rel", scope="gpu") == PARTS - 1:
        parts = tl.arange(0, PARTS_P2)
        total = tl.sum(tl.load(sq_ptr + t * PARTS + parts, mask=parts < PARTS, other=0.0, cache_modifier=".cg"), axis=0)
        r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(total, D.to(tl.float32)) + eps))
        for d0 in range(0, D, NORM_BLOCK):  # written by the other programs: read from the L2
            d = d0 + tl.arange(0, NORM_BLOCK)
            x = tl.load(out_ptr + t * D + d, mask=d < D, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(weight_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            tl.store(out_ptr + t * D + d, (x * r * w).to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _pre_finish_kernel(x_ptr, dots_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
                       norm_weight_ptr, norm_sq_ptr, counters_ptr,
                       T, D, SPLIT, inv_k, iters, hc_eps, norm_eps, out_norm_eps,
                       N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr,
                       BLOCK_D: tl.constexpr, HEAD: tl.constexpr, NORM_PARTS: tl.constexpr,
                       NORM_PARTS_P2: tl.constexpr, NORM_BLOCK: tl.constexpr, INTERPRET_MODE: tl.constexpr):
    """Token ``t = pid(0)``: the partials of its ``SPLIT`` splits summed and scaled by the RMS
    factor; part ``pid(1)`` 0 (not for ``HEAD``) writes ``post [T, N]`` and ``comb [T, N, N]``, every
    other part ``BLOCK_D`` columns of ``out [T, D]``. ``NORM_PARTS > 0`` (the collapse programs a
    token has): ``out`` is RMS-normalised with ``norm_weight [D]`` (:func:`_normalise_collapsed`)."""
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    s = tl.arange(0, SP)
    s_ok = s < SPLIT
    n = tl.arange(0, NP)
    n_ok = n < N
    rows = (s * T + t) * MP  # [SP]: each split's partials of this token
    sq = tl.sum(tl.load(sq_ptr + s * T + t, mask=s_ok, other=0.0), axis=0)
    r = 1.0 / tl.sqrt_rn(sq * inv_k + norm_eps)
    if not HEAD:
        if part == 0:
            post_mix = _summed_mixes(dots_ptr, rows, N, n, s_ok, n_ok) * r
            post = 2 * tl.sigmoid(post_mix * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + n, mask=n_ok, other=0.0))
            tl.store(post_ptr + t * N + n, post, mask=n_ok)
            i, j = n[:, None], n[None, :]
            ij_ok = (i < N) & (j < N)
            ij = 2 * N + i * N + j
            comb_mix = tl.sum(tl.load(dots_ptr + rows[:, None, None] + ij[None, :, :],
                                      mask=s_ok[:, None, None] & ij_ok[None, :, :], other=0.0), axis=0) * r
            # padding: a finite floor, so padding rows (all floor) stay finite; exp sends it to 0 elsewhere
            logits = tl.where(ij_ok, comb_mix * tl.load(scale_ptr + 2) + tl.load(base_ptr + ij, mask=ij_ok, other=0.0),
                              -3.0e38)
            e = tl.exp(logits - tl.max(logits, axis=1, keep_dims=True))
            tl.store(comb_ptr + t * (N * N) + i * N + j, e / tl.sum(e, axis=1, keep_dims=True) + hc_eps, mask=ij_ok)
            # The Sinkhorn steps run on the softmax reloaded through offsets of their own, the tile
            # of _sinkhorn_kernel (3.5 µs a matrix on the H200): run in the layout of the
            # partials' sum (one of its slices), this kernel took 19 µs a call.
            tl.debug_barrier()
            row, col = n[None, :, None], n[None, None, :]
            tile_ok = (row < N) & (col < N)
            tile = comb_ptr + t * (N * N) + row * N + col
            comb = _sinkhorn_tile(tl.load(tile, mask=tile_ok, other=0.0), iters, hc_eps, tile_ok)
            tl.store(tile, comb, mask=tile_ok)
    d_part = part if HEAD else part - 1
    if d_part >= 0:
        pre_mix = _summed_mixes(dots_ptr, rows, 0, n, s_ok, n_ok) * r
        pre = tl.sigmoid(pre_mix * tl.load(scale_ptr) + tl.load(base_ptr + n, mask=n_ok, other=0.0)) + hc_eps
        d = d_part * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        if NORM_PARTS > 0 and not INTERPRET_MODE:
            # the norm weight of these columns, for the row's last program (one request per 128-byte line)
            lines = d_part * BLOCK_D + tl.arange(0, BLOCK_D // 32) * 32
            prefetch_l2(norm_weight_ptr + lines, lines < D, norm_weight_ptr)
        xs = tl.load(x_ptr + (t * N + n[:, None]) * D + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        collapsed = tl.sum(pre[:, None] * xs.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty)  # padding: 0
        tl.store(out_ptr + t * D + d, collapsed, mask=d_ok)
        if NORM_PARTS > 0:
            _normalise_collapsed(out_ptr, collapsed, t, d_part, D, norm_weight_ptr, out_norm_eps, norm_sq_ptr,
                                 counters_ptr, NORM_PARTS, NORM_PARTS_P2, NORM_BLOCK)


def _mix_plan(tokens: int, k: int, m: int) -> tuple[int, int, int, int, int]:
    """``(MP, BLOCK_T, BLOCK_K, token blocks, k_per_split)`` of the projection of ``tokens`` rows of
    K = ``k`` by ``m`` mix weights."""
    mp = triton.next_power_of_2(m)
    block_t = min(_MAX_BLOCK_T, triton.next_power_of_2(max(tokens, 1)))
    block_k = max(16, _PRODUCT_ELEMS // (mp * block_t))
    t_blocks = triton.cdiv(tokens, block_t)
    split = max(1, min(_MAX_SPLIT, triton.cdiv(k, block_k), _MIX_PROGRAMS // max(t_blocks, 1)))
    return mp, block_t, block_k, t_blocks, triton.cdiv(triton.cdiv(k, split), block_k) * block_k


def launch_hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                  hc_eps: float, norm_eps: float, head: bool = False,
                  posted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  out_norm: tuple[torch.Tensor | None, float] = (None, 0.0)):
    """``x [..., N, D]`` (N <= :data:`MAX_HC_N`), ``fn [M, N D]``, ``base [M]``, ``scale`` as
    ``dsv4::hc_pre`` (``head=False``: returns ``post, comb, collapsed``) or ``dsv4::hc_head``
    (``head=True``: returns ``collapsed``). ``posted = (post, comb, out)``: ``dsv4::hc_post_pre``, x the
    streams before that mix; returns ``new_streams, post, comb, collapsed``. The projection makes the
    new streams up to :data:`POSTED_MAX_TOKENS` tokens when its K blocks divide D (D = 4096 of the
    released models); otherwise ``_post_kernel`` makes them first. ``out_norm = (weight [D] or
    None, eps)``: the block's RMSNorm, applied to ``collapsed`` by its collapse programs."""
    n, d = x.shape[-2:]
    lead = x.shape[:-2]
    xs = x.contiguous().view(-1, n * d)
    fn, base, scale = fn.contiguous(), base.contiguous(), scale.contiguous()
    tokens, k, m = xs.shape[0], n * d, fn.shape[0]
    mp, block_t, block_k, t_blocks, k_per_split = _mix_plan(tokens, k, m)
    if posted is not None and (d % block_k or tokens > POSTED_MAX_TOKENS):
        new = launch_hc_post(*posted, x)
        return (new, *launch_hc_pre(new, fn, base, scale, iters, hc_eps, norm_eps, out_norm=out_norm))
    post = x.new_empty((*lead, n), dtype=torch.float32)
    comb = x.new_empty((*lead, n, n), dtype=torch.float32)
    out = x.new_empty((*lead, d))
    # the streams the collapse reads: x, or the ones the projection's programs make and store
    streams = xs if posted is None else torch.empty_like(xs)
    if tokens:
        split = triton.cdiv(k, k_per_split)
        dots = torch.empty((split, tokens, mp), dtype=torch.float32, device=x.device)
        sq = torch.empty((split, tokens), dtype=torch.float32, device=x.device)
        mixed = [t.contiguous() for t in posted] if posted is not None else (xs, xs, xs)  # unread without POST
        collapse_parts = triton.cdiv(d, _BLOCK_D)
        norm_weight, out_norm_eps = out_norm
        norm_parts = 0 if norm_weight is None else collapse_parts
        # the norm's sums of squares and arrival counters (zeroed by the projection); unread without it
        norm_sq = torch.empty((tokens, norm_parts), dtype=torch.float32, device=x.device) if norm_parts else sq
        counters = torch.empty(tokens, dtype=torch.int32, device=x.device) if norm_parts else sq
        np2 = triton.next_power_of_2(n)
        _mix_partial_kernel[(t_blocks, split)](xs, fn, dots, sq, *mixed, streams, counters, tokens, d, m, k_per_split,
                                               N=n, NP=np2, BLOCK_T=block_t, BLOCK_K=block_k, MP=mp,
                                               POST=posted is not None, NORM=norm_parts > 0)
        parts = collapse_parts + (0 if head else 1)
        _pre_finish_kernel[(tokens, parts)](streams, dots, sq, base, scale, post, comb, out,
                                            sq if norm_weight is None else norm_weight.contiguous(), norm_sq, counters,
                                            tokens, d, split, 1.0 / k, iters, hc_eps, norm_eps, out_norm_eps, N=n,
                                            NP=np2, MP=mp, SP=triton.next_power_of_2(split), BLOCK_D=_BLOCK_D,
                                            HEAD=head, NORM_PARTS=norm_parts,
                                            NORM_PARTS_P2=triton.next_power_of_2(max(norm_parts, 1)),
                                            NORM_BLOCK=min(_NORM_BLOCK, triton.next_power_of_2(d)),
                                            INTERPRET_MODE=INTERPRET, num_warps=1)
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
