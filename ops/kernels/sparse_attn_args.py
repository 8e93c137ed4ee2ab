"""The sparse-attention kernels' argument contract, host side.

Every attention kernel (fused, two-pass, warp-specialised) takes each entry list as the same seven
arguments: ``cache, page_stride, capacity, indices, indices row stride, lengths, width`` (``swa_*``
then ``ex_*``) and the page sizes and presence of the extra list as constexprs ``SWA_P``, ``EX_P``,
``HAS_EXTRA``. A layer without an extra list passes the SWA tensors as stand-ins (never read:
``HAS_EXTRA`` is False), with page size 1 and width 0.

Shape legend: T = query rows, H = heads, K1 / K2 = SWA / extra index widths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .host import unit_stride
from .sparse_attn_combine import Partials, split_count

if TYPE_CHECKING:
    from ...attention import KVSet


def normalize(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor):
    """``(q, swa, extra, attn_sink)`` with unit last-dim strides, as the kernels index them."""
    q, attn_sink = unit_stride(q), unit_stride(attn_sink)
    swa = swa._replace(cache=unit_stride(swa.cache), indices=unit_stride(swa.indices),
                       lengths=unit_stride(swa.lengths))
    if extra is not None:
        extra = extra._replace(cache=unit_stride(extra.cache), indices=unit_stride(extra.indices),
                               lengths=unit_stride(extra.lengths))
    return q, swa, extra, attn_sink


def key_width(swa: KVSet, extra: KVSet | None) -> int:
    """Index width of a row, K1 + K2: the most keys it can attend to."""
    return swa.indices.shape[1] + (0 if extra is None else extra.indices.shape[1])


def list_args(swa: KVSet, extra: KVSet | None, rows: slice = slice(None)) -> tuple[tuple, dict]:
    """Both lists' 14 kernel arguments (rows ``rows`` of the index lists) and their constexprs."""
    ex = extra if extra is not None else swa._replace(page_size=1)
    args = ()
    for kv, width in ((swa, swa.indices.shape[1]), (ex, 0 if extra is None else ex.indices.shape[1])):
        args += (kv.cache, kv.cache.stride(0), kv.cache.shape[0] * kv.page_size, kv.indices[rows],
                 kv.indices.stride(0), kv.lengths[rows], width)
    return args, dict(SWA_P=swa.page_size, EX_P=ex.page_size, HAS_EXTRA=extra is not None)


def row_kernel_args(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                    softmax_scale: float, out: torch.Tensor, lse: torch.Tensor,
                    partials: Partials | None) -> tuple[tuple, dict]:
    """Arguments and constexprs of a kernel with one program per (row, head block, split): the
    fused and the warp-specialised ones. Without ``partials`` (one split) ``lse`` stands in for
    the partial buffers (never written)."""
    lists, consts = list_args(swa, extra)
    part_out, part_lse = (lse, lse) if partials is None else (partials.out, partials.lse)
    args = (q, q.stride(0), q.stride(1), *lists, attn_sink, out, lse, part_out, part_lse, q.shape[1],
            split_count(partials), softmax_scale)
    return args, dict(consts, SPLIT=partials is not None)
