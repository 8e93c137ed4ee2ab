"""KV compressor: softmax-gated pooling of raw-token projections into one entry per window
(docs/semantics.md §4.2) — reference.

Per raw token ``t`` at position ``p_t`` the caller supplies ``a_t = x_t W_kv`` and
``s_t = x_t W_gate`` (fp32, width ``Wc = coff * d``; coff = 2 for ratio 4, 1 for ratio 128).
A query row at position ``p`` completing a window (``(p + 1) % r == 0``) emits entry
``i = (p + 1) / r - 1`` from ``S`` slots::

    r = 128: slot s <-> token p - 127 + s, all Wc = d columns
    r = 4  : slot s <-> token p - 7 + s; slots 0..3 use columns [0, d) ("overlap" half of the
             previous window), slots 4..7 use columns [d, 2d) ("own" half)
    e[c]   = sum_s softmax_s(score[s, c] + ape[p_s % r, c]) * kv[s, c]      (slots with p_s < 0:
                                                                           weight 0)
    y      = rope(rmsnorm(bf16(e)) * norm_weight, at position p - r + 1); hadamard(y) if rotate

State (``[R * ring, 2 Wc]`` fp32, rows ``[kv | score + ape]``): the request's ring of its last
``ring`` raw tokens, row ``req * ring + p % ring``. Tokens processed in this step are read from the
step's own projections (rows of a request are consecutive, so position ``t`` of row ``q``'s request
is row ``q - (p - t)``); earlier tokens from the ring. After all reads, each row whose position is
among its request's last ``ring`` positions is written to the ring. Rows that complete no window
still produce a (meaningless) entry; their out slot is -1.

Out of range (docs/semantics.md §6): ``R = state rows / ring``. A request row outside ``[0, R)``
reads no ring row (those slots weigh 0, like positions before 0) and writes none; so does a row
at a negative position. Masked slots are selected away, never multiplied by a zero weight.
"""

from __future__ import annotations

import torch

from .functional import gather_or, hadamard, may_select, put_where, rms_norm, rope_tail, row_chunks

_ROW_CHUNK_ELEMS = 1 << 22  # bound the [rows, S, Wc] gather of one chunk (fp32 elements)


def window_slots(ratio: int) -> int:
    """Raw tokens pooled into one entry: 8 for ratio 4 (overlapping), ``ratio`` otherwise."""
    return 8 if ratio == 4 else ratio


def compress_kv(state: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor,
                req_of_row: torch.Tensor, seq_lens_causal: torch.Tensor, extend_start: torch.Tensor,
                extend_end: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor,
                ratio: int, ring: int, rotate: bool, eps: float) -> torch.Tensor:
    """Pool, normalise, rotate one potential entry per row; update the state ring in place.

    state: [R * ring, 2 Wc] fp32 (mutated); kv, score: [T, Wc] fp32, bf16 or fp16 (widened to fp32:
    pooling and the ring are fp32); ape: [r, Wc] fp32;
    req_of_row, seq_lens_causal, extend_start, extend_end: [T] int32 (see metadata.expand_queries);
    norm_weight: [d]; inv_freq: [32] fp32. Returns ``[T, d]`` bf16.
    """
    kv, score = kv.float(), score.float()
    num_rows, wc = kv.shape
    d = norm_weight.shape[0]
    slots = window_slots(ratio)
    pos = seq_lens_causal.long() - 1  # [T]
    score_ape = score + ape[pos % ratio]  # [T, Wc]
    chunk = max(1, _ROW_CHUNK_ELEMS // (slots * wc))
    rows = torch.arange(num_rows, device=kv.device)
    if may_select(kv):
        # only the rows that complete a window pool (1 in 4 or 128 of a prefill's); the others'
        # output is unspecified (docs/semantics.md §4.2) and left 0, as the CUDA kernel leaves it.
        # Where a selection may not be made, every row pools.
        rows = rows[(pos + 1) % ratio == 0]
    e = kv.new_zeros(num_rows, d)  # [T, d] fp32
    for lo, hi in row_chunks(rows.shape[0], chunk):
        e[rows[lo:hi]] = _pool_rows(state, kv, score_ape, req_of_row, pos, extend_start, rows[lo:hi], ratio, ring, d)
    y = rms_norm(e.to(torch.bfloat16), norm_weight, eps)
    y = rope_tail(y, pos - ratio + 1, inv_freq)
    if rotate:
        y = hadamard(y).to(torch.bfloat16)
    _write_ring(state, kv, score_ape, req_of_row, pos, extend_end, ring)
    return y


def _pool_rows(state, kv, score_ape, req_of_row, pos, extend_start, rows: torch.Tensor,
               ratio: int, ring: int, d: int) -> torch.Tensor:
    """Pooled fp32 entry ``[C, d]`` for the in-step rows ``rows [C]`` (int64).

    A slot reads nothing (weight 0, value 0: selected, never multiplied, so NaN in an unread ring
    row cannot leak) when its position is negative, its in-step row is outside ``[0, T)``, or its
    ring row is outside ``state`` (a request row outside ``[0, R)``, docs/semantics.md §6)."""
    wc = kv.shape[1]
    slots = window_slots(ratio)
    p = pos[rows].unsqueeze(1)  # [C, 1]
    t = p - (slots - 1) + torch.arange(slots, device=kv.device)  # [C, S] token positions
    in_step = t >= extend_start[rows].long().unsqueeze(1)
    batch_row = torch.where(in_step & (t >= 0), rows.unsqueeze(1) - (p - t), -1)
    req = req_of_row[rows].long().unsqueeze(1)
    known = (req >= 0) & (req < state.shape[0] // ring)  # before the product, which a huge row would overflow
    ring_row = torch.where(~in_step & (t >= 0) & known, req * ring + t % ring, -1)
    sel = in_step.unsqueeze(-1)
    a = torch.where(sel, gather_or(kv, (batch_row,), 0.0), gather_or(state[:, :wc], (ring_row,), 0.0))  # [C, S, Wc]
    s = torch.where(sel, gather_or(score_ape, (batch_row,), float("-inf")),
                    gather_or(state[:, wc:], (ring_row,), float("-inf")))
    if ratio == 4:  # slots 0..3 take the overlap half, 4..7 the own half
        half = (torch.arange(slots, device=kv.device) >= 4).long().view(1, slots, 1)
        cols = torch.arange(d, device=kv.device).view(1, 1, d) + half * d
        a = torch.gather(a, 2, cols.expand(a.shape[0], slots, d))
        s = torch.gather(s, 2, cols.expand(s.shape[0], slots, d))
    return (torch.softmax(s, dim=1) * a).sum(dim=1)


def _write_ring(state, kv, score_ape, req_of_row, pos, extend_end, ring: int) -> None:
    """Persist the rows among each request's last ``ring`` positions; other rows, rows at negative
    positions and rows of request rows outside ``[0, R)`` are no-ops."""
    if state.shape[0] == 0:
        return
    req = req_of_row.long()
    keep = (pos >= extend_end.long() - ring) & (pos >= 0) & (req >= 0) & (req < state.shape[0] // ring)
    rows = torch.where(keep, req * ring + pos % ring, 0)
    put_where(state, (rows,), torch.cat([kv, score_ape], dim=1), keep)
