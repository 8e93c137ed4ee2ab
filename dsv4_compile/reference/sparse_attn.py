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

import itertools

import torch

from ..attention import KVSet
from .functional import row_chunks
from .kv_store import gather_model1_rows, rows_at

_ROW_CHUNK_KEYS = 1 << 15  # rows x keys gathered at once (each key 512 fp32)
# On the CPU a chunk's keys stay within 8 MB, so that the two products read them from the cache the
# gather left them in: the CPU main job ran at 970-1,140 tokens/s so, 650-810 with 64 MB chunks
# (2 cores; ~430 with one row a chunk)
_CPU_ROW_CHUNK_KEYS = 1 << 12


def sparse_attn(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, 512] bf16; ``swa`` / ``extra`` (None on a ratio-0 layer): MODEL1 caches with
    ``[T, K]`` slot lists and ``[T]`` lengths; attn_sink: [H] fp32. Returns ``out [T, H, 512]
    bf16`` and ``lse [T, H] fp32``."""
    sets = [swa] if extra is None else [swa, extra]
    num_rows = q.shape[0]
    width = sum(s.indices.shape[1] for s in sets)
    chunk = max(1, (_CPU_ROW_CHUNK_KEYS if q.device.type == "cpu" else _ROW_CHUNK_KEYS) // max(1, width))
    outs, lses = [], []
    for lo, hi in row_chunks(num_rows, chunk):
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
    parts, valid = [], []
    for kv in sets:
        idx, lens = kv.indices[lo:hi].long(), kv.lengths[lo:hi].long()
        m = torch.arange(idx.shape[1], device=idx.device)
        ok = (m < lens.unsqueeze(1)) & (idx >= 0) & (idx < kv.capacity)
        parts.append(gather_model1_rows(kv.cache, torch.where(ok, idx, -1), kv.page_size))
        valid.append(ok)
    if all(where is not None for _, where in parts):
        # the sets' distinct rows joined, then one copy out to [C, K, 512]: joining the copied-out
        # keys instead moved every key twice
        offsets = itertools.accumulate((rows.shape[0] for rows, _ in parts[:-1]), initial=0)
        table = torch.cat([rows for rows, _ in parts]).to(dtype)
        keys = rows_at(table, torch.cat([where + off for (_, where), off in zip(parts, offsets)], 1))
    else:
        keys = torch.cat([rows.reshape(*ok.shape, -1).to(dtype) for (rows, _), ok in zip(parts, valid)], 1)
    return keys, torch.cat(valid, 1)


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, attn_sink: torch.Tensor,
            softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense masked attention with sink for a chunk, in the dtype of its inputs: q [C, H, D],
    keys [C, K, D], valid [C, K], attn_sink [H] -> (out [C, H, D], lse [C, H])."""
    logits = torch.einsum("chd,ckd->chk", q, keys) * softmax_scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [C, H]; -inf when no valid key
    empty = torch.isneginf(lse)
    safe_lse = torch.where(empty, 0.0, lse)
    p = torch.exp(logits - safe_lse.unsqueeze(-1))  # 0 at masked keys
    gate = torch.sigmoid(safe_lse - attn_sink)  # 1 / (1 + exp(sink - lse))
    out = torch.einsum("chk,ckd->chd", p, keys) * gate.unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), 0.0, out)
    return out, torch.where(empty, float("inf"), lse)
