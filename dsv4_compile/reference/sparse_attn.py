"""Sparse MQA attention over SWA + extra (compressed) entries with a per-head sink (docs/semantics.md §4.4)
— reference.

Per query row ``q`` and head ``h``::

    K     = { dequant(SWA[i])   : m < swa_len[q],   i = swa_idx[q, m],   0 <= i < capacity }
          + { dequant(EXTRA[i]) : m < extra_len[q], i = extra_idx[q, m], 0 <= i < capacity }
    l_k   = (q_h . k) * softmax_scale                       (fp32; V is K: all 512 dims)
    lse   = ln sum_k exp(l_k)                               (natural log, sink excluded)
    o_h   = sum_k exp(l_k - lse) k * 1 / (1 + exp(sink_h - lse))
    empty K: o_h = 0, lse = +inf

Shape legend: T = query rows, H = heads, K1 / K2 = index widths (multiples of 64).
"""

from __future__ import annotations

import torch

from ..attention import KVSet
from .functional import may_select, row_chunks
from .kv_store import gather_model1

_ROW_CHUNK_KEYS = 1 << 15  # rows x keys gathered at once (each key 512 fp32)


def sparse_attn(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, 512] bf16; ``swa`` / ``extra`` (None on a ratio-0 layer): MODEL1 caches with
    ``[T, K]`` slot lists and ``[T]`` lengths; attn_sink: [H] fp32. Returns ``out [T, H, 512]
    bf16`` and ``lse [T, H] fp32``."""
    sets = [swa] if extra is None else [swa, extra]
    num_rows = q.shape[0]
    width = sum(s.indices.shape[1] for s in sets)
    chunk = max(1, _ROW_CHUNK_KEYS // max(1, width))
    outs, lses = [], []
    for lo, hi in row_chunks(num_rows, chunk):
        if may_select(q):
            o, lse = attend_sets(q[lo:hi].float(), sets, lo, hi, attn_sink.float(), softmax_scale)
        else:
            keys, valid = gather_rows(sets, lo, hi, torch.float32)
            o, lse = attend(q[lo:hi].float(), keys, valid, attn_sink.float(), softmax_scale)
        outs.append(o.to(torch.bfloat16))
        lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:2], dtype=torch.float32)
    return torch.cat(outs, 0), torch.cat(lses, 0)


def gather_rows(sets: list[KVSet], lo: int, hi: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of rows ``[lo, hi)``: the entries of every set, concatenated in order, ``[C, K, 512]``
    ``dtype`` (0 where invalid), and ``valid [C, K]`` bool (inside the row's length and pointing at
    a slot of the cache)."""
    keys, valid = [], []
    for kv in sets:
        slots, ok = _row_slots(kv, lo, hi)
        keys.append(gather_model1(kv.cache, slots, kv.page_size).to(dtype))
        valid.append(ok)
    return torch.cat(keys, 1), torch.cat(valid, 1)


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, attn_sink: torch.Tensor,
           softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked attention with sink for a chunk, in the dtype of its inputs: q [C, H, D],
    keys [C, K, D], valid [C, K], attn_sink [H] -> (out [C, H, D], lse [C, H])."""
    p, gate, lse = _weights(torch.einsum("chd,ckd->chk", q, keys) * softmax_scale, valid, attn_sink)
    return _output(torch.einsum("chk,ckd->chd", p, keys), gate, lse)


def attend_sets(q: torch.Tensor, sets: list[KVSet], lo: int, hi: int, attn_sink: torch.Tensor,
                softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` over the keys :func:`gather_rows` reads for rows ``[lo, hi)`` (fp32), set by
    set, each distinct slot of a set dequantised once. Where a set's rows share their entries (at
    most ``K + C`` distinct among ``C`` rows of ``K`` keys: a chunk of one request's rows, whose
    windows overlap) the logits of every distinct entry are computed and each row's picked out,
    and a row's weights are summed per entry before one product with the entries; elsewhere the
    keys are gathered per row. The same math as :func:`attend`, fp32 sums in another order, and no
    ``[C, K, 512]`` copy of shared keys. Eager CPU only (``functional.may_select``): the number of
    distinct entries depends on the slots' values."""
    logits, valid, weighted = [], [], []
    for kv in sets:
        entries, where, ok = distinct_entries(kv, lo, hi)
        if entries.shape[0] <= sum(where.shape):
            picks = where.unsqueeze(1).expand(-1, q.shape[1], -1)  # [C, H, K]
            logits.append(torch.einsum("chd,ud->chu", q, entries).gather(2, picks))
            weighted.append(lambda p, picks=picks, entries=entries: torch.einsum(
                "chu,ud->chd", p.new_zeros(*p.shape[:2], entries.shape[0]).scatter_add_(2, picks, p), entries))
        else:
            keys = entries[where]
            logits.append(torch.einsum("chd,ckd->chk", q, keys))
            weighted.append(lambda p, keys=keys: torch.einsum("chk,ckd->chd", p, keys))
        valid.append(ok)
    p, gate, lse = _weights(torch.cat(logits, -1) * softmax_scale, torch.cat(valid, 1), attn_sink)
    widths = [v.shape[1] for v in valid]
    return _output(sum(w(part) for w, part in zip(weighted, p.split(widths, -1))), gate, lse)


def distinct_entries(kv: KVSet, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The entries of ``kv`` that rows ``[lo, hi)`` read: ``(entries [U, 512] fp32, where [C, K],
    valid [C, K] bool)``, each distinct slot once, in the order of first reading (row by row),
    ``entries[where]`` equal to :func:`gather_rows`'s keys of this set (0 where invalid)."""
    slots, ok = _row_slots(kv, lo, hi)
    distinct, where = torch.unique(slots, return_inverse=True)
    # entries in the order rows first read them, not by slot number: the sums over entries then
    # do not depend on which pages a request was given
    first = torch.full_like(distinct, where.numel()).scatter_reduce_(
        0, where.flatten(), torch.arange(where.numel(), device=where.device), "amin")
    order = first.argsort()
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return gather_model1(kv.cache, distinct[order], kv.page_size), rank[where], ok


def _row_slots(kv: KVSet, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots [C, K] int64, valid [C, K] bool)`` of rows ``[lo, hi)``: an entry is valid inside
    its row's length and pointing at a slot of the cache; invalid ones read slot -1 (zeros)."""
    idx, lens = kv.indices[lo:hi].long(), kv.lengths[lo:hi].long()
    m = torch.arange(idx.shape[1], device=idx.device)
    ok = (m < lens.unsqueeze(1)) & (idx >= 0) & (idx < kv.capacity)
    return torch.where(ok, idx, -1), ok


def _weights(logits: torch.Tensor, valid: torch.Tensor, attn_sink: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(p [C, H, K], gate [C, H], lse [C, H])`` of the scaled logits ``[C, H, K]``: softmax
    weights (0 at invalid keys), the sink's gate ``1 / (1 + exp(sink - lse))`` and the
    log-sum-exp (-inf when no key is valid)."""
    lse = torch.logsumexp(logits.masked_fill(~valid.unsqueeze(1), float("-inf")), dim=-1)
    safe_lse = torch.where(torch.isneginf(lse), 0.0, lse)
    p = torch.exp(logits - safe_lse.unsqueeze(-1)).masked_fill(~valid.unsqueeze(1), 0.0)
    return p, torch.sigmoid(safe_lse - attn_sink), lse


def _output(weighted: torch.Tensor, gate: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the weighted keys ``[C, H, D]``: gated; 0 and +inf for rows with no key."""
    empty = torch.isneginf(lse)
    out = torch.where(empty.unsqueeze(-1), 0.0, weighted * gate.unsqueeze(-1))
    return out, torch.where(empty, float("inf"), lse)
