"""FlashMLA (pip ``sgl-flash-mla``, module ``flash_mla``) as an alternative CUDA implementation of
``dsv4::sparse_attn`` — optional: imported lazily, nothing else depends on it (GPU.md).

FlashMLA reads the same MODEL1 cache bytes through its "V4" view ``[N_pages, P, 1, 584]`` whose
``stride(0)`` is the padded page size (SPEC §2.2; the per-token 584-byte rows of that view are not
tokens, FlashMLA addresses the real page layout through the page stride). Its contract differs
from ours in three places that this wrapper bridges:

* heads: 64 or 128 only -> q is zero-padded, the sink padded with ``-inf``;
* invalid indices: only exactly ``-1`` and no upper-bound check -> every index that is negative
  or ``>= capacity`` becomes ``-1`` (an out-of-range index would be an illegal address);
* shapes: every row is its own batch entry with ``s_q = 1``; lse comes back ``[T, h, 1]``.

Shape legend: T = query rows, H = heads (<= 128), Hp = padded heads, K = index width.
"""

from __future__ import annotations

import functools

import torch

from ... import layout
from ...config import HEAD_DIM


@functools.lru_cache(maxsize=None)
def flash_mla_module():
    """The ``flash_mla`` module, or None when it is not installed."""
    try:
        import flash_mla
    except ImportError:
        return None
    return flash_mla


def available() -> bool:
    return flash_mla_module() is not None


def cache_view(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """FlashMLA's ``[N_pages, P, 1, 584]`` view of a ``[N_pages, page_bytes]`` uint8 MODEL1 cache
    (no copy; ``stride(0)`` stays the page stride)."""
    row = layout.TOKEN_BYTES
    return torch.as_strided(cache, (cache.shape[0], page_size, 1, row), (cache.stride(0), row, row, 1),
                            cache.storage_offset())


def _index_set(indices: torch.Tensor, lengths: torch.Tensor, capacity: int):
    """``indices [T, K]`` -> ``[T, 1, K]`` int32 with every invalid index -1; lengths clamped."""
    ok = (indices >= 0) & (indices < capacity)
    idx = torch.where(ok, indices, -1).to(torch.int32).unsqueeze(1)
    return idx, lengths.clamp(0, indices.shape[1]).to(torch.int32)


def padded_heads(num_heads: int) -> int:
    if num_heads > 128:
        raise ValueError(f"FlashMLA supports at most 128 heads, got {num_heads}")
    return 64 if num_heads <= 64 else 128


def flashmla_sparse_attn(q: torch.Tensor, swa_cache: torch.Tensor, swa_page_size: int,
                         swa_indices: torch.Tensor, swa_lengths: torch.Tensor,
                         extra_cache: torch.Tensor | None, extra_page_size: int,
                         extra_indices: torch.Tensor | None, extra_lengths: torch.Tensor | None,
                         attn_sink: torch.Tensor, softmax_scale: float, *, sched_meta=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``dsv4::sparse_attn`` through ``flash_mla.flash_mla_with_kvcache`` (arguments already checked).

    Returns ``out [T, H, 512] bf16`` and ``lse [T, H] fp32`` (natural log, sink excluded, +inf for
    rows without valid keys). ``sched_meta``: a ``FlashMLASchedMeta`` to reuse across calls with
    the same shapes and lengths (benchmarks); by default a fresh one per call.
    """
    fm = flash_mla_module()
    if fm is None:
        raise RuntimeError("DSV4 FlashMLA path: the flash_mla module is not installed "
                           "(pip install sgl-flash-mla)")
    T, H, _ = q.shape
    hp = padded_heads(H)
    if T == 0:
        return torch.empty_like(q), q.new_empty(0, H, dtype=torch.float32)
    if hp != H:
        q = torch.nn.functional.pad(q, (0, 0, 0, hp - H))
        attn_sink = torch.cat([attn_sink, attn_sink.new_full((hp - H,), float("-inf"))])
    idx, lens = _index_set(swa_indices, swa_lengths, swa_cache.shape[0] * swa_page_size)
    extra = dict(extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
    if extra_cache is not None:
        ex_idx, ex_lens = _index_set(extra_indices, extra_lengths, extra_cache.shape[0] * extra_page_size)
        extra = dict(extra_k_cache=cache_view(extra_cache, extra_page_size),
                     extra_indices_in_kvcache=ex_idx, extra_topk_length=ex_lens)
    out, lse = fm.flash_mla_with_kvcache(
        q.contiguous().unsqueeze(1), cache_view(swa_cache, swa_page_size), None, None, HEAD_DIM,
        sched_meta if sched_meta is not None else fm.get_mla_metadata()[0], None,
        softmax_scale=softmax_scale, is_fp8_kvcache=True, indices=idx, attn_sink=attn_sink.contiguous(),
        topk_length=lens, use_legacy=True, kv_format="V4", **extra)
    return out[:, 0, :H].contiguous(), lse[:, :H, 0].contiguous()
