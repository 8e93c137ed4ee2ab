"""Sparse attention's Python entry: ``sparse_attn(q, swa, extra, attn_sink, softmax_scale)``.

A query row attends to two lists of cache entries: its SWA window and, on compressed layers, its
extra (c4 top-k or c128) entries. Each list is a :class:`KVSet`. The op ``dsv4::sparse_attn``
takes the same arguments flattened into 11 positionals (its public schema); :func:`op_args` and
:func:`from_op_args` convert between the two forms, so the layer, the reference, the kernels,
benchmarks and tests all speak in KVSets.

Shape legend: T = query rows, H = heads, K = index width (a multiple of 64), P = page size.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KVSet(NamedTuple):
    """One index list over one MODEL1 cache (``layout.py``): row ``t`` attends to the entries at
    slots ``indices[t, :lengths[t]]``; negative slots and slots past the cache are skipped."""

    cache: torch.Tensor  # [N_pages, page_bytes] uint8
    page_size: int  # P, entries per page
    indices: torch.Tensor  # [T, K] int32 / int64 slots
    lengths: torch.Tensor  # [T] int32 / int64, clamped to [0, K]

    @property
    def capacity(self) -> int:
        """Slots the cache holds."""
        return self.cache.shape[0] * self.page_size


_NO_EXTRA = (None, 0, None, None)  # the op's extra arguments on a layer without compression


def op_args(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
            softmax_scale: float) -> tuple:
    """The 11 positional arguments of ``dsv4::sparse_attn`` (``extra=None``: a ratio-0 layer)."""
    return (q, *swa, *(_NO_EXTRA if extra is None else extra), attn_sink, softmax_scale)


def from_op_args(args: tuple) -> tuple[torch.Tensor, KVSet, KVSet | None, torch.Tensor, float]:
    """Inverse of :func:`op_args`: ``(q, swa, extra, attn_sink, softmax_scale)``."""
    q, *swa, ex_cache, ex_page_size, ex_indices, ex_lengths, attn_sink, softmax_scale = args
    extra = None if ex_cache is None else KVSet(ex_cache, ex_page_size, ex_indices, ex_lengths)
    return q, KVSet(*swa), extra, attn_sink, softmax_scale


def sparse_attn(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA with a per-head attention sink over ``swa`` then ``extra`` (docs/semantics.md §4.4).

    q: [T, H, 512] bf16; attn_sink: [H] fp32. Returns ``out [T, H, 512] bf16`` and ``lse [T, H]
    fp32`` (natural log without the sink; ``+inf`` and out 0 for a row without a valid key).
    """
    return torch.ops.dsv4.sparse_attn(*op_args(q, swa, extra, attn_sink, softmax_scale))
