"""``dsv4::sparse_attn``: sparse MQA over SWA + extra (c4 / c128) entries of FP8 MODEL1 caches,
with a per-head attention sink (SPEC §4.4). A fixed public contract (name and argument order).

Kernels: the reference on every device; on CUDA ``kernels/sparse_attn.py``'s launcher, which picks
a path from the shapes and the GPU (the warp-specialised Gluon kernel on sm_90, else a fused or a
two-pass Triton kernel), or FlashMLA when ``DSV4_ATTN_IMPL=flashmla`` is set (read per call).
``dsv4::sparse_attn_flashmla`` (same signature, CUDA only) always calls FlashMLA; it needs the
optional ``flash_mla`` module (pip ``sgl-flash-mla``), imported on first use.

Shape legend: T = query rows, H = heads, K1 / K2 = index widths (multiples of 64).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ..config import HEAD_DIM, INDEX_ALIGN
from ..reference import sparse_attn as ref
from ._checks import INDEX_DTYPES, check_multiple_of, check_same_rows, check_tensor
from ._cuda import HAS_TRITON, cuda_kernel
from .kv_cache import check_model1_cache

if HAS_TRITON:
    from .kernels import flashmla
    from .kernels import sparse_attn as kernels

FLASHMLA_MAX_HEADS = 128
IMPL_ENV = "DSV4_ATTN_IMPL"  # "flashmla" routes the CUDA kernel of dsv4::sparse_attn to FlashMLA


def _check_index_set(which: str, cache, page_size, indices, lengths, rows: int) -> None:
    op = "sparse_attn"
    check_model1_cache(op, f"{which}_cache", cache, page_size)
    check_tensor(op, f"{which}_indices", indices, dtypes=INDEX_DTYPES, ndim=2, shape=(rows, None))
    check_multiple_of(op, f"{which}_indices.shape[1]", indices.shape[1], INDEX_ALIGN)
    check_tensor(op, f"{which}_lengths", lengths, dtypes=INDEX_DTYPES, ndim=1, shape=(rows,))


def _check(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
           extra_indices, extra_lengths, attn_sink) -> None:
    op = "sparse_attn"
    check_tensor(op, "q", q, dtypes=(torch.bfloat16,), ndim=3, shape=(None, None, HEAD_DIM))
    check_tensor(op, "attn_sink", attn_sink, dtypes=(torch.float32,), ndim=1, shape=(q.shape[1],))
    _check_index_set("swa", swa_cache, swa_page_size, swa_indices, swa_lengths, q.shape[0])
    extras = (extra_cache, extra_indices, extra_lengths)
    if any(t is None for t in extras) and not all(t is None for t in extras):
        raise ValueError(f"dsv4.{op}: extra_cache, extra_indices and extra_lengths must be given "
                         "together (or all None for ratio-0 layers)")
    if extra_cache is not None:
        _check_index_set("extra", extra_cache, extra_page_size, extra_indices, extra_lengths, q.shape[0])


@torch.library.custom_op("dsv4::sparse_attn", mutates_args=())
def sparse_attn(q: torch.Tensor, swa_cache: torch.Tensor, swa_page_size: int, swa_indices: torch.Tensor,
                swa_lengths: torch.Tensor, extra_cache: Optional[torch.Tensor], extra_page_size: int,
                extra_indices: Optional[torch.Tensor], extra_lengths: Optional[torch.Tensor],
                attn_sink: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, 512] bf16, lse [T, H] fp32)``; lse is the natural log without the sink,
    ``+inf`` for a row with no valid key (whose out is 0)."""
    _check(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
           extra_indices, extra_lengths, attn_sink)
    return ref.sparse_attn(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache,
                           extra_page_size, extra_indices, extra_lengths, attn_sink, softmax_scale)


@sparse_attn.register_fake
def _(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
      extra_indices, extra_lengths, attn_sink, softmax_scale):
    _check(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
           extra_indices, extra_lengths, attn_sink)
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


@cuda_kernel(sparse_attn)
def _(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
      extra_indices, extra_lengths, attn_sink, softmax_scale):
    args = (q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
            extra_indices, extra_lengths, attn_sink, softmax_scale)
    _check(*args[:-1])
    if os.environ.get(IMPL_ENV) == "flashmla":
        _check_flashmla_heads(q)
        return flashmla.flashmla_sparse_attn(*args)
    return kernels.launch_sparse_attn(*args)


def _check_flashmla_heads(q: torch.Tensor) -> None:
    if q.shape[1] > FLASHMLA_MAX_HEADS:
        raise ValueError(f"dsv4.sparse_attn_flashmla: q has {q.shape[1]} heads; FlashMLA supports at most "
                         f"{FLASHMLA_MAX_HEADS}")


@torch.library.custom_op("dsv4::sparse_attn_flashmla", mutates_args=(), device_types="cuda")
def sparse_attn_flashmla(q: torch.Tensor, swa_cache: torch.Tensor, swa_page_size: int,
                         swa_indices: torch.Tensor, swa_lengths: torch.Tensor,
                         extra_cache: Optional[torch.Tensor], extra_page_size: int,
                         extra_indices: Optional[torch.Tensor], extra_lengths: Optional[torch.Tensor],
                         attn_sink: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``dsv4::sparse_attn`` computed by FlashMLA (H <= 128); same outputs and semantics."""
    _check(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
           extra_indices, extra_lengths, attn_sink)
    _check_flashmla_heads(q)
    return flashmla.flashmla_sparse_attn(q, swa_cache, swa_page_size, swa_indices, swa_lengths,
                                         extra_cache, extra_page_size, extra_indices, extra_lengths,
                                         attn_sink, softmax_scale)


@sparse_attn_flashmla.register_fake
def _(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
      extra_indices, extra_lengths, attn_sink, softmax_scale):
    _check(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
           extra_indices, extra_lengths, attn_sink)
    _check_flashmla_heads(q)  # fails at trace time too
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)
