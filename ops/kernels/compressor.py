"""Triton kernels of ``dsv4::compress_kv`` (docs/semantics.md §4.2, §2.5): window pooling + RMSNorm + RoPE
(+ Hadamard), then the state-ring update.

Two launches, because a long prefill writes ring rows that other rows of the same step still read
(every pool read must be done before the first ring write):

* ``_pool_kernel`` (grid ``[T / G, d / CB]``): a program walks ``G`` rows for ``CB`` channels
  (``_pool_config``: by compressor and decode / prefill size). Rows completing a
  window (``(p + 1) % r == 0``) gather their ``S`` slots (8 for r = 4, r otherwise) — in-step
  tokens from this step's ``kv`` / ``score`` (+ ape), earlier ones from the ring — and compute
  ``softmax_slot(score) . kv`` per channel with an online softmax over slot blocks, newest block
  first (it holds the row's own token, so the running max is finite from the first block on),
  into the fp32 buffer ``pooled [T, d]``; other rows are skipped. (``_pool_window``: one window.)
* ``_entry_kernel`` (grid ``[T]``): window rows read their pooled row and apply ``bf16 ->
  RMSNorm * w -> bf16 -> RoPE -> bf16 [-> Hadamard -> bf16]``, the same rounding points as the
  reference; other rows' entries are zeros (their out slot is -1: never stored). Rows among their
  request's last ``ring`` positions also write ``[kv | score + ape]`` to ring row
  ``req * ring + p % ring`` (loaded first, so those loads overlap the entry's).

Out of range (docs/semantics.md §6): with ``R = state rows / ring``, a row of a request row outside
``[0, R)`` reads no ring row (such slots weigh 0, as positions before 0 do) and writes none, nor
does a row at a negative position; an in-step slot whose row falls outside ``[0, T)`` weighs 0.

``launch_compress_kv_store`` runs the same two kernels with the cache write in the entry kernel:
its entry goes from registers to the row's slot, quantised by ``store_kv``'s (d = 512) or
``store_index_k``'s (d = 128) helpers, instead of to ``out``.

Decode-sized launches use programmatic dependent launch (``launch_compress_kv``'s ``pdl``), so
the entry kernel's programs start and load their inputs while the pool drains.

The entry kernel takes channels as even / odd halves (columns ``2k`` and ``2k + 1``), so a RoPE
pair sits in the same lane of two vectors and the first Hadamard butterfly is a sum / difference:
``WHT_d(y)[2m + b] = sum_k (y[2k] + (-1)^b y[2k+1]) H_{d/2}[k, m]``.

Shape legend: T = rows, d = entry dim, Wc = coff * d, S = window slots, R = request rows,
G / CB = rows / channels per pool program.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...config import HEAD_DIM, INDEX_HEAD_DIM
from ...reference.compressor import window_slots
from .host import INTERPRET, has_pdl, unit_stride
from .kv_cache import check_page_rows, key_store_constants, model1_slot_ptrs, store_index_key, store_model1_key
from .primitives import dependent_launch, hadamard_pm1, softmax_rescale, to_bf16

_DECODE_MAX_ROWS = 1024  # decode / verify batches (PDL, pool shapes); prefills above


@triton.jit
def _step_or_ring(step_ptrs, ring_ptrs, in_step, live, other):
    """fp32 values of a block of slots: this step's projection where ``in_step``, else the ring's;
    ``other`` where not ``live``. One load per element when the step's projections are fp32 like
    the ring; two masked loads (each element read once) when they are bf16 / fp16."""
    if step_ptrs.dtype.element_ty == ring_ptrs.dtype.element_ty:
        return tl.load(tl.where(in_step, step_ptrs, ring_ptrs), mask=live, other=other)
    else:
        step = tl.load(step_ptrs, mask=live & in_step, other=other).to(tl.float32)
        return tl.where(in_step, step, tl.load(ring_ptrs, mask=live & ~in_step, other=other))


@triton.jit
def _pool_window(kv_ptr, score_ptr, ape_ptr, state_ptr, row, p, req, extend_start, cols, num_rows, num_reqs,
                 stride_kv, stride_score, stride_ape, stride_state, D: tl.constexpr, WC: tl.constexpr,
                 RATIO: tl.constexpr, RING: tl.constexpr, S: tl.constexpr, SB: tl.constexpr):
    """fp32 ``softmax_slot(score) . kv`` of the window ending on ``row`` (position ``p`` of
    request ``req``, whose step starts at position ``extend_start``), channels ``cols [n] int32``.
    A slot reads nothing (weight 0) at a negative position, from a step row outside
    ``[0, num_rows)`` or from the ring of a request row outside ``[0, num_reqs)``."""
    m = tl.full(cols.shape, float("-inf"), tl.float32)
    den = tl.zeros(cols.shape, dtype=tl.float32)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for i in tl.static_range(S // SB):  # unrolled; later blocks' loads only partly overlap earlier reductions
        s = (S // SB - 1 - i) * SB + tl.arange(0, SB)  # newest block first
        t = p - (S - 1) + s  # [SB] token positions
        in_step = t >= extend_start
        tt = tl.maximum(t, 0)
        if RATIO == 4:  # slots 0..3: overlap half [0, d); slots 4..7: own half [d, 2d)
            c = cols[None, :] + (D * (s >= S // 2).to(tl.int32))[:, None]
        else:
            c = cols[None, :]
        brow = (row - (p - tt)).to(tl.int64)  # in-step rows of a request are consecutive
        rrow = req.to(tl.int64) * RING + tt % RING
        live = (t >= 0) & tl.where(in_step, (brow >= 0) & (brow < num_rows), (req >= 0) & (req < num_reqs))
        step_m = in_step[:, None]
        ring_row = state_ptr + rrow[:, None] * stride_state + c
        a = _step_or_ring(kv_ptr + brow[:, None] * stride_kv + c, ring_row, step_m, live[:, None], 0.0)
        sc = _step_or_ring(score_ptr + brow[:, None] * stride_score + c, ring_row + WC, step_m, live[:, None],
                           float("-inf"))  # slots before position 0: weight 0
        sc += tl.load(ape_ptr + (tt % RATIO)[:, None] * stride_ape + c, mask=step_m, other=0.0)
        m, alpha, e = softmax_rescale(m, sc, 0, True)
        den = den * alpha + tl.sum(e, axis=0)
        acc = acc * alpha + tl.sum(e * a, axis=0)
    return tl.math.div_rn(acc, den)


@triton.jit
def _pool_kernel(kv_ptr, score_ptr, ape_ptr, state_ptr, req_ptr, seq_ptr, start_ptr, pooled_ptr, num_rows,
                 num_reqs, stride_kv, stride_score, stride_ape, stride_state,
                 D: tl.constexpr, WC: tl.constexpr, RATIO: tl.constexpr, RING: tl.constexpr,
                 S: tl.constexpr, SB: tl.constexpr, CB: tl.constexpr, G: tl.constexpr, PDL: tl.constexpr):
    """Pooled fp32 channels ``[CB]`` (block ``program_id(1)``) of the windows ending on rows
    ``program_id(0) * G + [0, G)``, into ``pooled [T, d]``."""
    dependent_launch(PDL)  # inputs are final past the wait; the entry kernel may launch after it
    cols = tl.program_id(1) * CB + tl.arange(0, CB)
    rows = tl.program_id(0) * G + tl.arange(0, G)
    live = rows < num_rows
    # the G rows' scalars in one memory round trip, then a loop over the (few) window rows only:
    # each of its scalars is a masked register reduction, no memory access
    ps = tl.load(seq_ptr + rows, mask=live, other=0).to(tl.int32) - 1
    reqs = tl.load(req_ptr + rows, mask=live, other=0).to(tl.int64)  # a huge int64 row must not wrap into range
    starts = tl.load(start_ptr + rows, mask=live, other=0).to(tl.int32)
    windows = (live & ((ps + 1) % RATIO == 0)).to(tl.int32)
    rank = tl.cumsum(windows, 0) * windows  # k + 1 on the k-th window row, 0 elsewhere
    for k in range(tl.sum(windows, 0)):
        this = rank == k + 1
        row = tl.sum(tl.where(this, rows, 0), 0)
        pooled = _pool_window(kv_ptr, score_ptr, ape_ptr, state_ptr, row, tl.sum(tl.where(this, ps, 0), 0),
                              tl.sum(tl.where(this, reqs, 0), 0), tl.sum(tl.where(this, starts, 0), 0), cols,
                              num_rows, num_reqs, stride_kv, stride_score, stride_ape, stride_state, D, WC, RATIO,
                              RING, S, SB)
        tl.store(pooled_ptr + row.to(tl.int64) * D + cols, pooled)


@triton.jit
def _entry_kernel(kv_ptr, score_ptr, ape_ptr, state_ptr, req_ptr, seq_ptr, end_ptr, w_ptr,
                  inv_freq_ptr, pooled_ptr, out_ptr, cache_ptr, slots_ptr, capacity, stride_page, eps, num_reqs,
                  stride_kv, stride_score, stride_ape, stride_state, stride_out, D: tl.constexpr, WC: tl.constexpr,
                  RATIO: tl.constexpr, RING: tl.constexpr, ROTATE: tl.constexpr, HSCALE: tl.constexpr,
                  SOFT_BF16: tl.constexpr, PDL: tl.constexpr, STORE: tl.constexpr, PAGE: tl.constexpr,
                  DATA_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
                  TILE: tl.constexpr, NUM_TILES: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
                  BIAS: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Entry ``[d] bf16`` of ``row`` from ``pooled[row]`` — into ``out[row]``, or with ``STORE``
    quantised into the cache at ``slots[row]`` as ``store_kv`` (d = 512) / ``store_index_k`` (d =
    128) write it — then the row's ring write (none at a negative position or for a request row
    outside ``[0, num_reqs)``)."""
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    p = tl.load(seq_ptr + row).to(tl.int32) - 1  # the three scalar loads issue together
    req = tl.load(req_ptr + row).to(tl.int64)
    keep = p >= tl.load(end_ptr + row).to(tl.int32) - RING  # among the request's last `ring` positions
    keep = keep & (p >= 0) & (req >= 0) & (req < num_reqs)
    # the ring row's loads go first (masked, not branched): they are in flight during the entry
    c = tl.arange(0, WC)
    kv = tl.load(kv_ptr + r64 * stride_kv + c, mask=keep).to(tl.float32)
    sc = tl.load(score_ptr + r64 * stride_score + c, mask=keep).to(tl.float32)
    sc += tl.load(ape_ptr + (p % RATIO) * stride_ape + c, mask=keep)
    if PDL:  # the pool has read the ring and written pooled past the wait (its inputs, loaded above, were final)
        tl.extra.cuda.gdc_wait()
    k = tl.arange(0, D // 2)
    if (p + 1) % RATIO == 0:
        # every load first (the compiler keeps source order around the norm's reductions)
        ev = tl.load(pooled_ptr + r64 * D + 2 * k)
        od = tl.load(pooled_ptr + r64 * D + 2 * k + 1)
        w_ev = tl.load(w_ptr + 2 * k).to(tl.float32)
        w_od = tl.load(w_ptr + 2 * k + 1).to(tl.float32)
        f = k - (D // 2 - 32)  # RoPE on the last 64 dims: pairs k >= d/2 - 32
        is_rope = f >= 0
        freq = tl.load(inv_freq_ptr + tl.maximum(f, 0), mask=is_rope, other=0.0)
        # RMSNorm of the bf16-rounded entry, times the weight, rounded to bf16 (reference order)
        ev = to_bf16(ev, SOFT_BF16).to(tl.float32)
        od = to_bf16(od, SOFT_BF16).to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(ev * ev, 0) + tl.sum(od * od, 0)) * (1.0 / D) + tl.cast(eps, tl.float32))
        ev = to_bf16(ev * inv_rms * w_ev, SOFT_BF16).to(tl.float32)
        od = to_bf16(od * inv_rms * w_od, SOFT_BF16).to(tl.float32)
        # RoPE at the window start p - r + 1
        ang = tl.cast(p - RATIO + 1, tl.float32) * freq
        cos, sin = tl.cos(ang), tl.sin(ang)
        ev, od = (to_bf16(tl.where(is_rope, ev * cos - od * sin, ev), SOFT_BF16),
                  to_bf16(tl.where(is_rope, ev * sin + od * cos, od), SOFT_BF16))
        if ROTATE:  # WHT_d / sqrt(d): first butterfly here, the d/2 Hadamard as a matrix product
            hm = hadamard_pm1(D // 2)
            s_ev = (ev.to(tl.float32) + od.to(tl.float32))[:, None]
            s_od = (ev.to(tl.float32) - od.to(tl.float32))[:, None]
            ev = to_bf16(tl.sum(s_ev * hm, axis=0) * HSCALE, SOFT_BF16)
            od = to_bf16(tl.sum(s_od * hm, axis=0) * HSCALE, SOFT_BF16)
    else:  # no window completes here: the entry is unspecified (its out slot is -1); keep it finite
        ev = tl.zeros([D // 2], dtype=tl.bfloat16)
        od = tl.zeros([D // 2], dtype=tl.bfloat16)
    if STORE:  # channel 2k + b of the entry is (ev, od)[b][k]
        if D == NOPE + ROPE:
            x = tl.reshape(tl.join(ev, od), [8, TILE]).to(tl.float32)
            valid, data_ptr, scale_ptr = model1_slot_ptrs(cache_ptr, slots_ptr, r64, capacity, stride_page, PAGE,
                                                          DATA_BYTES, SCALE_BYTES)
            store_model1_key(data_ptr, scale_ptr, x, valid, NOPE, TILE, NUM_TILES, FP8_MAX, EPS, BIAS, SOFT_FP8)
        else:
            store_index_key(cache_ptr, slots_ptr, r64, capacity, stride_page,
                            tl.reshape(tl.join(ev, od), [D]).to(tl.float32), PAGE, D, FP8_MAX, EPS, SOFT_FP8)
    else:
        out_row = out_ptr + r64 * stride_out
        tl.store(out_row + 2 * k, ev)
        tl.store(out_row + 2 * k + 1, od)
    dst = state_ptr + (req * RING + p % RING) * stride_state
    tl.store(dst + c, kv, mask=keep)
    tl.store(dst + WC + c, sc, mask=keep)


class PoolShape(NamedTuple):
    """Tuning of a pool program."""

    rows: int  # G, rows walked
    channels: int  # CB
    slot_block: int  # SB, slots per online-softmax block
    warps: int


def _pool_config(ratio: int, d: int, num_rows: int) -> PoolShape:
    """The :class:`PoolShape` of a pool program, by compressor and launch size (decode / verify batches up to ``_DECODE_MAX_ROWS`` rows, else
    prefill). H200, b = 256 decode / T = 4096 prefill, µs for the whole op (bench_ops.py):

    * c4 (8 slots, one block): decode one row per program, each of two programs half of the
      channels (d = 128: 4.2 against 4.8 for one program per row); prefill two rows per program
      (c4 attention 14.5 against 15.4).
    * c128: a program walks G rows and pools the windows among them over 16 channels (32 programs
      per window at d = 512). Decode: 16 rows, the whole window as one [128, 16] tile over four
      warps, so all its loads issue at once (3.9, against 7.6 for eight dependent [16, 16]
      blocks). Prefill: windows are 1 row in 128, so fewer, larger programs win: 128 rows,
      one warp, [16, 16] blocks (11.8 against 17.2 for the decode shape).

    Under the interpreter (about 1 ms per tl.sum / tl.max call) two channel blocks per window, and
    c128 keeps the 16-slot online softmax of the prefill shape (one slot block is its special case)."""
    slots = window_slots(ratio)
    decode = num_rows <= _DECODE_MAX_ROWS
    if INTERPRET:
        return PoolShape(1 if ratio == 4 else 8, d // 2, min(slots, 16), 1)
    if ratio == 4:
        rows, cb = (1, d // 2) if decode else (2, d)
        return PoolShape(rows, cb, slots, max(1, cb // 128))
    return PoolShape(16, 16, slots, 4) if decode else PoolShape(128, 16, 16, 1)


def launch_compress_kv(state: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                       req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor, extend_start: torch.Tensor,
                       extend_end: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor,
                       ratio: int, ring: int, rotate: bool, eps: float, *, pdl: bool | None = None) -> torch.Tensor:
    """Entries ``[T, d] bf16`` (zeros on rows completing no window); updates ``state`` in place.

    state: [R * ring, 2 Wc] fp32 (last dim contiguous); kv, score: [T, Wc] fp32, bf16 or fp16
    (widened on load: a projection's own output needs no conversion kernel); ape: [r, Wc] fp32;
    req_of_row, seq_lens_causal, extend_start, extend_end: [T] int32/int64; norm_weight: [d];
    inv_freq: [32] fp32. Arguments are validated by the op (``ops/compressor.py::_check``).

    ``pdl``: launch both kernels with programmatic dependent launch (sm_90+): the pool waits for
    the previous kernel, then lets the entry kernel launch, whose programs load their ring row and wait
    for the pool. Default (None): on sm_90+ for up to ``_DECODE_MAX_ROWS`` rows (H200, b = 256
    decode: c4 6.2 -> 5.0 µs, c4 indexer 5.9 -> 4.8, c128 8.4 -> 7.5; a 4096-row prefill is
    faster without it).
    """
    out = torch.empty(kv.shape[0], norm_weight.shape[0], dtype=torch.bfloat16, device=kv.device)
    _launch(state, kv, score, ape, req_of_row, seq_lens_causal, extend_start, extend_end, norm_weight, inv_freq,
            ratio, ring, rotate, eps, pdl, out=out)
    return out


def launch_compress_kv_store(state: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor,
                             score: torch.Tensor, ape: torch.Tensor, req_of_row: torch.Tensor,
                             seq_lens_causal: torch.Tensor, extend_start: torch.Tensor, extend_end: torch.Tensor,
                             norm_weight: torch.Tensor, inv_freq: torch.Tensor, ratio: int, ring: int, rotate: bool,
                             eps: float, page_size: int, *, pdl: bool | None = None) -> None:
    """:func:`launch_compress_kv`, each row's entry quantised and written at ``slots[row]`` (int32 /
    int64 ``[T]``; outside ``[0, N_pages * P)``: skipped) of ``cache [N_pages, Nb] uint8`` by the
    entry kernel itself, as ``launch_store_kv`` (d = 512, MODEL1 tokens) or
    ``launch_store_index_k`` (d = 128, indexer keys) writes it: the entries never go to memory."""
    check_page_rows("compress_kv_store", cache)
    _launch(state, kv, score, ape, req_of_row, seq_lens_causal, extend_start, extend_end, norm_weight, inv_freq,
            ratio, ring, rotate, eps, pdl, store=(cache, slots.contiguous(), page_size))


def _launch(state, kv, score, ape, req_of_row, seq_lens_causal, extend_start, extend_end, norm_weight, inv_freq,
            ratio: int, ring: int, rotate: bool, eps: float, pdl: bool | None, *, out: torch.Tensor | None = None,
            store: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """The pool and entry kernels, the entries into ``out`` or, given ``store = (cache, slots,
    page_size)``, into the cache."""
    num_rows, wc = kv.shape
    d = norm_weight.shape[0]
    if d & (d - 1) or d < 64:
        raise ValueError(f"compress_kv kernel: d={d} must be a power of two >= 64")
    if rotate and d > 128:
        raise ValueError(f"compress_kv kernel: rotate needs d <= 128, got {d}")
    if store is not None and d not in (HEAD_DIM, INDEX_HEAD_DIM):
        raise ValueError(f"compress_kv kernel: a stored entry is a MODEL1 key ({HEAD_DIM}) or an indexer key "
                         f"({INDEX_HEAD_DIM}), got d={d}")
    if state.stride(-1) != 1:
        raise ValueError("compress_kv kernel: state must have a unit last-dim stride")
    if num_rows == 0:
        return
    kv, score, ape = unit_stride(kv), unit_stride(score), unit_stride(ape)
    req_of_row, seq_lens_causal = req_of_row.contiguous(), seq_lens_causal.contiguous()
    extend_start, extend_end = extend_start.contiguous(), extend_end.contiguous()
    norm_weight, inv_freq = norm_weight.contiguous(), inv_freq.contiguous()
    if pdl is None:
        pdl = num_rows <= _DECODE_MAX_ROWS and has_pdl(kv.device)
    slots = window_slots(ratio)
    strides = (kv.stride(0), score.stride(0), ape.stride(0), state.stride(0))
    pooled = torch.empty(num_rows, d, dtype=torch.float32, device=kv.device)  # read on window rows only
    pool = _pool_config(ratio, d, num_rows)
    num_reqs = state.shape[0] // ring  # request rows of the ring: others read and write none
    _pool_kernel[(triton.cdiv(num_rows, pool.rows), d // pool.channels)](
        kv, score, ape, state, req_of_row, seq_lens_causal, extend_start, pooled, num_rows, num_reqs, *strides, D=d,
        WC=wc, RATIO=ratio, RING=ring, S=slots, SB=pool.slot_block, CB=pool.channels, G=pool.rows, PDL=pdl,
        num_warps=pool.warps, launch_pdl=pdl)
    cache, cache_slots, page_size = store if store is not None else (None, None, 1)
    capacity, stride_page = (cache.shape[0] * page_size, cache.stride(0)) if store is not None else (0, 0)
    _entry_kernel[(num_rows,)](kv, score, ape, state, req_of_row, seq_lens_causal, extend_end,
                               norm_weight, inv_freq, pooled, out, cache, cache_slots, capacity, stride_page, eps,
                               num_reqs, *strides, out.stride(0) if out is not None else 0, D=d, WC=wc,
                               RATIO=ratio, RING=ring, ROTATE=rotate, HSCALE=1.0 / math.sqrt(d),
                               SOFT_BF16=INTERPRET, PDL=pdl, STORE=store is not None, PAGE=page_size,
                               **key_store_constants(d),
                               num_warps=max(2, d // 128),  # fewest instructions
                               launch_pdl=pdl)
