"""Lightning indexer ops (docs/semantics.md §4.3): ``dsv4::indexer_prepare_q`` (RoPE + Hadamard +
per-head FP8 quantisation of the indexer queries) and ``dsv4::indexer_topk`` (logits over the
visible c4 entries + top-k, mapped to c4 slots).

Shape legend: T = rows, H = indexer heads, NP = pages per request, K = topk.
"""

from __future__ import annotations

import torch

from .. import layout
from ..config import INDEX_HEAD_DIM, ROPE_DIM
from ..reference import indexer as ref
from ._checks import INDEX_DTYPES, check_devices, check_same_rows, check_tensor
from ._library import HAS_TRITON, dsv4_op
from .kv_cache import check_index_cache

if HAS_TRITON:
    from .kernels import indexer as kernels

_FP8 = torch.float8_e4m3fn


def _check_prepare(q, weights, positions, inv_freq, weight_scale) -> None:
    op = "indexer_prepare_q"
    check_devices(op, q=q, weights=weights, positions=positions, inv_freq=inv_freq)
    check_tensor(op, "q", q, dtypes=(torch.bfloat16, torch.float32), ndim=3,
                 shape=(None, None, INDEX_HEAD_DIM))
    check_tensor(op, "weights", weights, dtypes=(torch.bfloat16, torch.float32), ndim=2,
                 shape=(None, q.shape[1]))
    check_tensor(op, "positions", positions, dtypes=INDEX_DTYPES, ndim=1)
    check_tensor(op, "inv_freq", inv_freq, dtypes=(torch.float32,), ndim=1, shape=(ROPE_DIM // 2,))
    check_same_rows(op, q=q, weights=weights, positions=positions)


def _prepare_fake(q, *_):
    return q.new_empty(q.shape, dtype=_FP8), q.new_empty(q.shape[:2], dtype=torch.float32)


@dsv4_op("indexer_prepare_q", check=_check_prepare, fake=_prepare_fake,
         cuda=kernels.launch_indexer_prepare_q if HAS_TRITON else None)
def indexer_prepare_q(q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                      inv_freq: torch.Tensor, weight_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_fp8 [T, H, 128] float8_e4m3fn, w [T, H] fp32)`` from ``q [T, H, 128]`` and
    ``weights [T, H]`` at ``positions [T]``."""
    return ref.indexer_prepare_q(q, weights, positions, inv_freq, weight_scale)


def _check_topk(q_fp8, w, index_cache, page_table, visible, topk) -> None:
    op = "indexer_topk"
    check_devices(op, index_cache=index_cache, q_fp8=q_fp8, w=w, page_table=page_table, visible=visible)
    check_tensor(op, "q_fp8", q_fp8, dtypes=(_FP8,), ndim=3, shape=(None, None, INDEX_HEAD_DIM))
    check_tensor(op, "w", w, dtypes=(torch.float32,), ndim=2, shape=(None, q_fp8.shape[1]))
    check_index_cache(op, "index_cache", index_cache, layout.INDEX_PAGE_SIZE)
    check_tensor(op, "page_table", page_table, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor(op, "visible", visible, dtypes=INDEX_DTYPES, ndim=1)
    check_same_rows(op, q_fp8=q_fp8, w=w, page_table=page_table, visible=visible)
    if topk <= 0 or topk % 64:
        raise ValueError(f"dsv4.{op}: topk={topk} must be a positive multiple of 64")


def _topk_fake(q_fp8, w, index_cache, page_table, visible, topk):
    return page_table.new_empty(page_table.shape[0], topk, dtype=torch.int32)


@dsv4_op("indexer_topk", check=_check_topk, fake=_topk_fake,
         cuda=kernels.launch_indexer_topk if HAS_TRITON else None)
def indexer_topk(q_fp8: torch.Tensor, w: torch.Tensor, index_cache: torch.Tensor,
                 page_table: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """``[T, topk] int32`` c4 slots of the selected entries (all visible ones when
    ``visible <= topk``), -1 padded. ``visible`` is clamped to ``[0, NP * 64]``; an entry on a page
    outside ``index_cache`` scores as a zero key and comes out as -1 (docs/semantics.md §6)."""
    return ref.indexer_topk(q_fp8, w, index_cache, page_table, visible, topk)
