"""Paged cache writes and reads by slot (SPEC §2.2, §2.3, §4.1) — reference.

Caches are 2-D ``uint8 [N_pages, page_bytes]`` tensors addressed as ``slot -> (slot // P, slot % P)``.
Writes skip rows whose slot is negative; reads return zeros for them. Both are written without
host synchronisation or data-dependent shapes: a skipped row is redirected to byte positions of
the reserved dummy slot 0 and writes back what is already there.
"""

from __future__ import annotations

import torch

from .quant import (dequantize_index_k, dequantize_model1, index_byte_index, model1_byte_index,
                    quantize_index_k, quantize_model1)


def _scatter_rows(cache: torch.Tensor, byte_idx: torch.Tensor, values: torch.Tensor,
                  valid: torch.Tensor) -> None:
    """``cache.view(-1)[byte_idx[n]] = values[n]`` for valid rows; invalid rows are no-ops.

    byte_idx: [N, W] int64 flat positions (already pointing at slot 0 for invalid rows);
    values: [N, W] uint8; valid: [N] bool.
    """
    flat = cache.view(-1)
    keep = flat[byte_idx]  # invalid rows re-write the dummy slot's own bytes
    flat[byte_idx] = torch.where(valid.unsqueeze(1), values, keep)


def store_model1(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Quantise ``k [N, 512] bf16`` to MODEL1 and write row n at ``slots[n]`` (negative: skipped).

    cache: [N_pages, page_bytes] uint8, contiguous, mutated in place.
    """
    valid = slots >= 0
    data_idx, scale_idx = model1_byte_index(slots.clamp_min(0), page_size, cache.shape[1])
    data, scales = quantize_model1(k)
    _scatter_rows(cache, data_idx, data, valid)
    _scatter_rows(cache, scale_idx, scales, valid)


def gather_model1(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantised keys at ``slots [...]`` of a MODEL1 cache: ``[..., 512] fp32`` (0 for slot < 0)."""
    shape = slots.shape
    flat_slots = slots.reshape(-1)
    valid = flat_slots >= 0
    data_idx, scale_idx = model1_byte_index(flat_slots.clamp_min(0), page_size, cache.shape[1])
    flat = cache.view(-1)
    k = dequantize_model1(flat[data_idx], flat[scale_idx])
    return torch.where(valid.unsqueeze(1), k, 0.0).reshape(*shape, k.shape[-1])


def store_index_k(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Quantise indexer keys ``k [N, 128]`` (fp8 + fp32 scale) and write row n at ``slots[n]``."""
    valid = slots >= 0
    vals_idx, scale_idx = index_byte_index(slots.clamp_min(0), page_size)
    vals, scale = quantize_index_k(k)
    _scatter_rows(cache, vals_idx, vals, valid)
    _scatter_rows(cache, scale_idx, scale.view(torch.uint8).reshape(-1, 4), valid)


def gather_index_k(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dequantised indexer keys at ``slots [...]``: ``[..., 128] fp32`` (0 for slot < 0)."""
    shape = slots.shape
    flat_slots = slots.reshape(-1)
    valid = flat_slots >= 0
    vals_idx, scale_idx = index_byte_index(flat_slots.clamp_min(0), page_size)
    flat = cache.view(-1)
    scale = flat[scale_idx].contiguous().view(torch.float32).reshape(-1)
    k = dequantize_index_k(flat[vals_idx], scale)
    return torch.where(valid.unsqueeze(1), k, 0.0).reshape(*shape, k.shape[-1])
