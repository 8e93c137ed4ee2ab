"""Sparse MQA attention over SWA + extra (compressed) entries with a per-head sink (SPEC §4.4)
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

from .kv_store import gather_model1

_ROW_CHUNK_KEYS = 1 << 15  # rows x keys gathered at once (each key 512 fp32)


def _valid_entries(indices: torch.Tensor, lengths: torch.Tensor, capacity: int) -> torch.Tensor:
    """[T, K] bool: inside the row's length and pointing at a slot of the cache."""
    m = torch.arange(indices.shape[1], device=indices.device)
    return (m < lengths.unsqueeze(1)) & (indices >= 0) & (indices < capacity)


def sparse_attn(q: torch.Tensor, swa_cache: torch.Tensor, swa_page_size: int, swa_indices: torch.Tensor,
                swa_lengths: torch.Tensor, extra_cache: torch.Tensor | None, extra_page_size: int,
                extra_indices: torch.Tensor | None, extra_lengths: torch.Tensor | None,
                attn_sink: torch.Tensor, softmax_scale: float,
                compute_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, 512] bf16; caches: [N_pages, page_bytes] uint8 (MODEL1); indices: [T, K] int32
    slots; lengths: [T] int32; attn_sink: [H] fp32. Returns ``out [T, H, 512] bf16`` and
    ``lse [T, H] fp32``."""
    sets = [(swa_cache, swa_page_size, swa_indices, swa_lengths)]
    if extra_cache is not None:
        sets.append((extra_cache, extra_page_size, extra_indices, extra_lengths))
    num_rows = q.shape[0]
    width = sum(s[2].shape[1] for s in sets)
    chunk = max(1, _ROW_CHUNK_KEYS // max(1, width))
    outs, lses = [], []
    for lo in range(0, num_rows, chunk):
        hi = min(lo + chunk, num_rows)
        keys, valid = [], []
        for cache, page_size, idx, lens in sets:
            ok = _valid_entries(idx[lo:hi], lens[lo:hi], cache.shape[0] * page_size)
            keys.append(gather_model1(cache, torch.where(ok, idx[lo:hi], -1), page_size))
            valid.append(ok)
        o, lse = _attend(q[lo:hi], torch.cat(keys, 1), torch.cat(valid, 1), attn_sink, softmax_scale,
                         compute_dtype)
        outs.append(o)
        lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape), q.new_zeros(q.shape[:2], dtype=torch.float32)
    return torch.cat(outs, 0), torch.cat(lses, 0)


def _attend(q, keys, valid, attn_sink, softmax_scale: float, compute_dtype):
    """Dense masked attention for a chunk: q [C, H, D], keys [C, K, D], valid [C, K]."""
    k = keys.to(compute_dtype)
    logits = torch.einsum("chd,ckd->chk", q.to(compute_dtype), k) * softmax_scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [C, H]; -inf when no valid key
    empty = torch.isneginf(lse)
    safe_lse = torch.where(empty, 0.0, lse)
    p = torch.exp(logits - safe_lse.unsqueeze(-1))  # 0 at masked keys
    gate = torch.sigmoid(safe_lse - attn_sink.to(compute_dtype))  # 1 / (1 + exp(sink - lse))
    out = torch.einsum("chk,ckd->chd", p, k) * gate.unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), 0.0, out)
    lse = torch.where(empty, float("inf"), lse)
    return out.to(torch.bfloat16), lse.float()
