"""Triton kernels of ``dsv4::compress_kv`` (SPEC §4.2, §2.5): window pooling + RMSNorm + RoPE
(+ Hadamard), then the state-ring update.

Two launches, because a long prefill writes ring rows that other rows of the same step still read:

* ``_pool_kernel`` (grid ``[T]``): rows completing a window (``(p + 1) % r == 0``) gather their
  ``S`` slots (8 for r = 4, r otherwise) — in-step tokens from this step's ``kv`` / ``score`` (+ ape),
  earlier ones from the ring — and compute ``softmax_slot(score) . kv`` per channel with an online
  softmax over slot blocks, newest block first (it holds the row's own token, so the running max
  is finite from the first block on). Then ``bf16 -> RMSNorm * w -> bf16 -> RoPE -> bf16
  [-> Hadamard -> bf16]``, the same rounding points as the reference. Other rows output zeros
  (their out slot is -1: never stored). Work per row is O(S * d).
* ``_ring_write_kernel`` (grid ``[T]``): rows among their request's last ``ring`` positions
  write ``[kv | score + ape]`` to ring row ``req * ring + p % ring``; the others are skipped.

Channels are processed as even / odd halves (columns ``2k`` and ``2k + 1``), so a RoPE pair sits in
the same lane of two vectors and the first Hadamard butterfly is a sum / difference:
``WHT_d(y)[2m + b] = sum_k (y[2k] + (-1)^b y[2k+1]) H_{d/2}[k, m]``.

Shape legend: T = rows, d = entry dim, Wc = coff * d, S = window slots, R = request rows.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ...reference.compressor import window_slots

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_SLOT_BLOCK = 16  # slots per online-softmax step (c128: 8 steps of [16, d/2] tiles)


@triton.jit
def hadamard_pm1(n: tl.constexpr):
    """``[n, n]`` fp32 Sylvester Hadamard matrix: ``(-1) ** popcount(i & j)`` (n a power of two)."""
    ij = tl.arange(0, n)[:, None] & tl.arange(0, n)[None, :]
    parity = tl.zeros([n, n], dtype=tl.int32)
    for b in tl.static_range(16):
        if (1 << b) < n:
            parity = parity ^ ((ij >> b) & 1)
    return (1 - 2 * parity).to(tl.float32)


@triton.jit
def _to_bf16(x, SOFT: tl.constexpr):
    """fp32 -> bf16, round to nearest even (the interpreter's cast truncates: there the rounding
    is done on the integer bits, after which the cast is exact)."""
    if SOFT:
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _pool_cols(kv_ptr, score_ptr, ape_ptr, state_ptr, row, p, req, row_start, cols,
               stride_kv, stride_score, stride_ape, stride_state,
               D: tl.constexpr, WC: tl.constexpr, RATIO: tl.constexpr, RING: tl.constexpr,
               S: tl.constexpr, SB: tl.constexpr):
    """Pooled fp32 channels ``cols [d/2]`` of the window ending at position ``p`` (row ``row``)."""
    m = tl.full([D // 2], float("-inf"), tl.float32)
    den = tl.zeros([D // 2], dtype=tl.float32)
    acc = tl.zeros([D // 2], dtype=tl.float32)
    for i in range(S // SB):
        s = (S // SB - 1 - i) * SB + tl.arange(0, SB)  # newest block first
        t = p - (S - 1) + s  # [SB] token positions
        live = t >= 0
        in_step = live & (t >= row_start)
        from_ring = live & (t < row_start)
        tt = tl.maximum(t, 0)
        if RATIO == 4:  # slots 0..3: overlap half [0, d); slots 4..7: own half [d, 2d)
            c = cols[None, :] + (D * (s >= S // 2).to(tl.int32))[:, None]
        else:
            c = cols[None, :] + 0 * s[:, None]
        brow = (row - (p - tt)).to(tl.int64)  # in-step rows of a request are consecutive
        rrow = (req * RING + tt % RING).to(tl.int64)
        step_m, ring_m = in_step[:, None], from_ring[:, None]
        a = tl.load(kv_ptr + brow[:, None] * stride_kv + c, mask=step_m, other=0.0)
        a += tl.load(state_ptr + rrow[:, None] * stride_state + c, mask=ring_m, other=0.0)
        sc = tl.load(score_ptr + brow[:, None] * stride_score + c, mask=step_m, other=0.0)
        sc += tl.load(ape_ptr + (tt % RATIO)[:, None] * stride_ape + c, mask=step_m, other=0.0)
        sc += tl.load(state_ptr + rrow[:, None] * stride_state + WC + c, mask=ring_m, other=0.0)
        sc = tl.where(live[:, None], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(sc - m_new[None, :])
        den = den * alpha + tl.sum(e, axis=0)
        acc = acc * alpha + tl.sum(e * a, axis=0)
        m = m_new
    return tl.math.div_rn(acc, den)


@triton.jit
def _pool_kernel(kv_ptr, score_ptr, ape_ptr, state_ptr, req_ptr, seq_ptr, start_ptr, w_ptr,
                 inv_freq_ptr, out_ptr, eps, stride_kv, stride_score, stride_ape, stride_state,
                 stride_out, D: tl.constexpr, WC: tl.constexpr, RATIO: tl.constexpr,
                 RING: tl.constexpr, S: tl.constexpr, SB: tl.constexpr, ROTATE: tl.constexpr,
                 HSCALE: tl.constexpr, SOFT_BF16: tl.constexpr):
    row = tl.program_id(0)
    k = tl.arange(0, D // 2)
    out_row = out_ptr + row.to(tl.int64) * stride_out
    p = tl.load(seq_ptr + row).to(tl.int32) - 1
    if (p + 1) % RATIO == 0:
        req = tl.load(req_ptr + row).to(tl.int32)
        start = tl.load(start_ptr + row).to(tl.int32)
        ev = _pool_cols(kv_ptr, score_ptr, ape_ptr, state_ptr, row, p, req, start, 2 * k, stride_kv,
                        stride_score, stride_ape, stride_state, D, WC, RATIO, RING, S, SB)
        od = _pool_cols(kv_ptr, score_ptr, ape_ptr, state_ptr, row, p, req, start, 2 * k + 1, stride_kv,
                        stride_score, stride_ape, stride_state, D, WC, RATIO, RING, S, SB)
        # RMSNorm of the bf16-rounded entry, times the weight, rounded to bf16 (reference order)
        ev = _to_bf16(ev, SOFT_BF16).to(tl.float32)
        od = _to_bf16(od, SOFT_BF16).to(tl.float32)
        inv_rms = tl.rsqrt((tl.sum(ev * ev, 0) + tl.sum(od * od, 0)) * (1.0 / D) + tl.cast(eps, tl.float32))
        ev = _to_bf16(ev * inv_rms * tl.load(w_ptr + 2 * k).to(tl.float32), SOFT_BF16).to(tl.float32)
        od = _to_bf16(od * inv_rms * tl.load(w_ptr + 2 * k + 1).to(tl.float32), SOFT_BF16).to(tl.float32)
        # RoPE on the last 64 dims (pairs k >= d/2 - 32) at the window start p - r + 1
        f = k - (D // 2 - 32)
        is_rope = f >= 0
        ang = tl.cast(p - RATIO + 1, tl.float32) * tl.load(inv_freq_ptr + tl.maximum(f, 0), mask=is_rope,
                                                            other=0.0)
        cos, sin = tl.cos(ang), tl.sin(ang)
        ev, od = (_to_bf16(tl.where(is_rope, ev * cos - od * sin, ev), SOFT_BF16),
                  _to_bf16(tl.where(is_rope, ev * sin + od * cos, od), SOFT_BF16))
        if ROTATE:  # WHT_d / sqrt(d): first butterfly here, the d/2 Hadamard as a matrix product
            hm = hadamard_pm1(D // 2)
            s_ev = (ev.to(tl.float32) + od.to(tl.float32))[:, None]
            s_od = (ev.to(tl.float32) - od.to(tl.float32))[:, None]
            ev = _to_bf16(tl.sum(s_ev * hm, axis=0) * HSCALE, SOFT_BF16)
            od = _to_bf16(tl.sum(s_od * hm, axis=0) * HSCALE, SOFT_BF16)
        tl.store(out_row + 2 * k, ev)
        tl.store(out_row + 2 * k + 1, od)
    else:  # no window completes here: the row is never stored; keep it finite
        zero = tl.zeros([D // 2], dtype=tl.bfloat16)
        tl.store(out_row + 2 * k, zero)
        tl.store(out_row + 2 * k + 1, zero)


@triton.jit
def _ring_write_kernel(kv_ptr, score_ptr, ape_ptr, state_ptr, req_ptr, seq_ptr, end_ptr,
                       stride_kv, stride_score, stride_ape, stride_state,
                       WC: tl.constexpr, RATIO: tl.constexpr, RING: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    p = tl.load(seq_ptr + row).to(tl.int32) - 1
    if p >= tl.load(end_ptr + row).to(tl.int32) - RING:  # among the request's last `ring` positions
        req = tl.load(req_ptr + row).to(tl.int32)
        dst = state_ptr + (req * RING + p % RING).to(tl.int64) * stride_state
        r64 = row.to(tl.int64)
        for c0 in range(0, WC, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            cm = c < WC
            tl.store(dst + c, tl.load(kv_ptr + r64 * stride_kv + c, mask=cm), mask=cm)
            sc = tl.load(score_ptr + r64 * stride_score + c, mask=cm)
            sc += tl.load(ape_ptr + (p % RATIO) * stride_ape + c, mask=cm)
            tl.store(dst + WC + c, sc, mask=cm)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Unit stride on the last dim (a no-op for the usual contiguous inputs)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_compress_kv(state: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                       req_of_row: torch.Tensor, seq_lens_casual: torch.Tensor, row_start: torch.Tensor,
                       row_end: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor,
                       ratio: int, ring: int, rotate: bool, eps: float) -> torch.Tensor:
    """Entries ``[T, d] bf16`` (zeros on rows completing no window); updates ``state`` in place.

    state: [R * ring, 2 Wc] fp32 (last dim contiguous); kv, score: [T, Wc] fp32; ape: [r, Wc] fp32;
    req_of_row, seq_lens_casual, row_start, row_end: [T] int32/int64; norm_weight: [d];
    inv_freq: [32] fp32. Arguments are validated by the op (``ops/compressor.py::_check``).
    """
    num_rows, wc = kv.shape
    d = norm_weight.shape[0]
    if d & (d - 1) or d < 64:
        raise ValueError(f"compress_kv kernel: d={d} must be a power of two >= 64")
    if rotate and d > 128:
        raise ValueError(f"compress_kv kernel: rotate needs d <= 128, got {d}")
    if state.stride(-1) != 1:
        raise ValueError("compress_kv kernel: state must have a unit last-dim stride")
    kv, score, ape = _rows(kv), _rows(score), _rows(ape)
    req_of_row, seq_lens_casual = req_of_row.contiguous(), seq_lens_casual.contiguous()
    row_start, row_end = row_start.contiguous(), row_end.contiguous()
    norm_weight, inv_freq = norm_weight.contiguous(), inv_freq.contiguous()
    out = torch.empty(num_rows, d, dtype=torch.bfloat16, device=kv.device)
    if num_rows == 0:
        return out
    slots = window_slots(ratio)
    strides = (kv.stride(0), score.stride(0), ape.stride(0), state.stride(0))
    _pool_kernel[(num_rows,)](kv, score, ape, state, req_of_row, seq_lens_casual, row_start, norm_weight,
                              inv_freq, out, eps, *strides, out.stride(0), D=d, WC=wc, RATIO=ratio,
                              RING=ring, S=slots, SB=min(slots, _SLOT_BLOCK), ROTATE=rotate,
                              HSCALE=1.0 / math.sqrt(d), SOFT_BF16=_INTERPRET, num_warps=4)
    _ring_write_kernel[(num_rows,)](kv, score, ape, state, req_of_row, seq_lens_casual, row_end, *strides,
                                    WC=wc, RATIO=ratio, RING=ring,
                                    BLOCK=min(triton.next_power_of_2(wc), 1024), num_warps=4)
    return out
