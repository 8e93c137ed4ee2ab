"""FlashMLA (pip ``sgl-flash-mla``, module ``flash_mla``) as an alternative CUDA implementation of
``dsv4::sparse_attn`` — optional: ``flash_mla`` is imported on first use and nothing else depends
on it.

FlashMLA reads the same MODEL1 cache bytes through its "V4" view ``[N_pages, P, 1, 584]`` whose
``stride(0)`` is the padded page size (docs/semantics.md §2.2; the per-token 584-byte rows of that view are not
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
import triton
import triton.language as tl

from typing import TYPE_CHECKING

from ... import layout
from ...config import HEAD_DIM
from .host import unit_stride

if TYPE_CHECKING:
    from ...attention import KVSet


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


@triton.jit
def _sanitize_kernel(idx_ptr, len_ptr, out_idx_ptr, out_len_ptr, width, capacity, stride_idx,
                     BLOCK: tl.constexpr):
    """Grid ``[T]``: one row's indices -> int32 with every index outside ``[0, capacity)`` set to -1,
    and its length clamped to ``[0, width]``."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(len_ptr + row)
    tl.store(out_len_ptr + row, tl.minimum(tl.maximum(n, 0), width).to(tl.int32))
    for c0 in range(0, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        idx = tl.load(idx_ptr + row * stride_idx + c, mask=c < width, other=-1)
        ok = (idx >= 0) & (idx < capacity)
        tl.store(out_idx_ptr + row * width + c, tl.where(ok, idx, -1).to(tl.int32), mask=c < width)


def _sanitized_indices(kv: KVSet) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv.indices [T, K]`` -> ``[T, 1, K]`` int32 with every invalid index -1, and ``kv.lengths``
    clamped to ``[0, K]`` int32: one launch (element-wise torch ops cost one launch each)."""
    indices, lengths, capacity = kv.indices, kv.lengths, kv.capacity
    T, K = indices.shape
    idx = torch.empty(T, 1, K, dtype=torch.int32, device=indices.device)
    lens = torch.empty(T, dtype=torch.int32, device=indices.device)
    if T and K:
        indices = unit_stride(indices)
        _sanitize_kernel[(T,)](indices, lengths.contiguous(), idx, lens, K, capacity, indices.stride(0),
                               BLOCK=min(1024, triton.next_power_of_2(K)), num_warps=4)
    elif T:
        lens.zero_()
    return idx, lens


def padded_heads(num_heads: int) -> int:
    """FlashMLA's head count for ``num_heads <= 128`` (checked by the op)."""
    return 64 if num_heads <= 64 else 128


def flashmla_sparse_attn(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                         softmax_scale: float, *, sched_meta=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``dsv4::sparse_attn`` through ``flash_mla.flash_mla_with_kvcache``; arguments as
    ``attention.sparse_attn`` (already checked).

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
    idx, lens = _sanitized_indices(swa)
    extra_kw = dict(extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
    if extra is not None:
        ex_idx, ex_lens = _sanitized_indices(extra)
        extra_kw = dict(extra_k_cache=cache_view(extra.cache, extra.page_size),
                        extra_indices_in_kvcache=ex_idx, extra_topk_length=ex_lens)
    out, lse = fm.flash_mla_with_kvcache(
        q.contiguous().unsqueeze(1), cache_view(swa.cache, swa.page_size), None, None, HEAD_DIM,
        sched_meta if sched_meta is not None else fm.get_mla_metadata()[0], None,
        softmax_scale=softmax_scale, is_fp8_kvcache=True, indices=idx, attn_sink=attn_sink.contiguous(),
        topk_length=lens, use_legacy=True, kv_format="V4", **extra_kw)
    return out[:, 0, :H].contiguous(), lse[:, :H, 0].contiguous()
