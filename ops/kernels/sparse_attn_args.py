"""The sparse-attention kernels' argument contract, host side.

Every attention kernel (fused, two-pass, warp-specialised) takes each entry list as one tuple
argument, an :class:`EntryList` (``swa`` then ``ex``), whose fields the kernels and the shared
primitives read by name (``swa.cache``, ``ex.width``); the page sizes and the presence of the
extra list are constexprs ``SWA_P``, ``EX_P``, ``HAS_EXTRA``. A layer without an extra list passes
the SWA tensors as stand-ins (never read: ``HAS_EXTRA`` is False), with page size 1 and width 0.

Shape legend: T = query rows, H = heads, K1 / K2 = SWA / extra index widths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from .host import unit_stride
from .sparse_attn_combine import Partials, split_count

if TYPE_CHECKING:
    from ...attention import KVSet


class EntryList(NamedTuple):
    """One entry list as a kernel argument (a tuple argument: the kernel receives its seven fields
    in this order and reads them by name)."""

    cache: torch.Tensor  # [N_pages, page_bytes] uint8
    page_stride: int  # cache.stride(0): bytes from one page to the next
    capacity: int  # N_pages * page size: slots the cache holds
    indices: torch.Tensor  # [T, K] int32 / int64 slots (unit last-dim stride)
    index_stride: int  # indices.stride(0)
    lengths: torch.Tensor  # [T] int32 / int64
    width: int  # K (0 for the stand-in of a missing extra list)

    @classmethod
    def of(cls, kv: KVSet, width: int, rows: slice) -> EntryList:
        """``kv``'s arguments, index rows ``rows``."""
        return cls(kv.cache, kv.cache.stride(0), kv.capacity, kv.indices[rows], kv.indices.stride(0),
                   kv.lengths[rows], width)


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


def entry_lists(swa: KVSet, extra: KVSet | None, rows: slice = slice(None)
                ) -> tuple[EntryList, EntryList, dict]:
    """Both lists' kernel arguments (rows ``rows`` of the index lists) and their constexprs."""
    ex = extra if extra is not None else swa._replace(page_size=1)
    ex_width = 0 if extra is None else extra.indices.shape[1]
    return (EntryList.of(swa, swa.indices.shape[1], rows), EntryList.of(ex, ex_width, rows),
            dict(SWA_P=swa.page_size, EX_P=ex.page_size, HAS_EXTRA=extra is not None))


def row_kernel_args(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                    softmax_scale: float, out: torch.Tensor, lse: torch.Tensor,
                    partials: Partials | None) -> tuple[tuple, dict]:
    """Arguments and constexprs of a kernel with one program per (row, head block, split): the
    fused and the warp-specialised ones. Without ``partials`` (one split) ``lse`` stands in for
    the partial buffers (never written)."""
    swa_list, ex_list, consts = entry_lists(swa, extra)
    part_out, part_lse = (lse, lse) if partials is None else (partials.out, partials.lse)
    args = (q, q.stride(0), q.stride(1), swa_list, ex_list, attn_sink, out, lse, part_out, part_lse, q.shape[1],
            split_count(partials), softmax_scale)
    return args, dict(consts, SPLIT=partials is not None)
