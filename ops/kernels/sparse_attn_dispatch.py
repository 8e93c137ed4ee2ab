"""Sparse attention on CUDA: tiling and path choice, and the launch of the chosen path
(``dsv4::sparse_attn``'s CUDA kernel).

Three paths (``choose_path``): on sm_90 the warp-specialised Gluon kernel
(``sparse_attn_warp_specialized.py``: producer warps dequantise keys while two consumer
warpgroups run the dots); on other GPUs the fused Triton kernel (``sparse_attn_fused.py``) for
few rows (decode at small batch, where splitting the key list fills the GPU) and the two-pass
kernels (``sparse_attn_two_pass.py``) for many (``use_two_pass``). The fused and warp-specialised
kernels split a row's key list when rows are few (``choose_splits``) and then finish with the
combine of ``sparse_attn_combine.py``.

Shape legend: T = query rows, H = heads, K1 / K2 = SWA / extra index widths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton

from ...config import HEAD_DIM
from . import sparse_attn_warp_specialized
from .host import has_pdl, num_sms
from .norm_rope import launch_rope_tail
from .sparse_attn_args import key_width, normalize
from .sparse_attn_combine import allocate_partials, launch_combine
from .sparse_attn_fused import MAX_HEAD_BLOCK, MIN_HEAD_BLOCK, FusedConfig, launch_fused
from .sparse_attn_two_pass import TwoPassConfig, launch_two_pass
from .sparse_attn_warp_specialized import WarpSpecializedConfig, launch_warp_specialized

if TYPE_CHECKING:
    from ...attention import KVSet

PATHS = ("fused", "warp_specialized", "two_pass")


def choose_splits(num_rows: int, num_head_blocks: int, width: int, block_n: int, num_sms: int) -> int:
    """Key-range splits per (row, head block), from shapes only: fill one wave of SMs when rows
    are few, never more splits than key blocks; 1 (no combine) once rows alone fill the GPU."""
    programs = max(1, num_rows * num_head_blocks)
    return max(1, min(num_sms // programs, triton.cdiv(width, block_n)))


def few_rows_block_n(num_rows: int, num_heads: int, width: int, num_sms: int) -> int | None:
    """Keys per block when one or two rows of at most 64 heads over a short key list run as
    16-head fused programs (one 32- or 64-key block per split covers the list), else None.

    There the GPU is nearly idle, so four times the programs share the list (the gather repeats
    per head block; the dots, the accumulator and the partial stores shrink 4x). H200, µs with 16
    / 64 heads per program (FlashMLA): c4 Flash (640 keys) b = 1 11.6 / 14.3 (12.3), b = 2 13.6 /
    15.8 (12.6); c128 at 128k b = 1 14.4 / 14.9 (14.1); not at 1M (9216 keys: 33 / 27, b = 2 64 /
    34), b = 4 or 128 heads.
    """
    if num_rows <= 2 and num_heads <= MAX_HEAD_BLOCK:
        head_blocks = triton.cdiv(num_heads, MIN_HEAD_BLOCK)
        for block_n in (32, 64):
            if choose_splits(num_rows, head_blocks, width, block_n, num_sms) * block_n >= width:
                return block_n
    return None


def choose_tiling(num_rows: int, num_heads: int, width: int, num_sms: int) -> tuple[int, int]:
    """(heads per program, keys per block) of the fused kernel, from shapes only.

    Heads: 16 per program for the few rows of ``few_rows_block_n``, else all of a row's heads up
    to 64 per program. Keys: 64 per block once rows fill the SMs with at most 2 splits (6-14 %
    faster), else 32.
    """
    block_n = few_rows_block_n(num_rows, num_heads, width, num_sms)
    if block_n is not None:
        return MIN_HEAD_BLOCK, block_n
    head_block = min(MAX_HEAD_BLOCK, max(MIN_HEAD_BLOCK, triton.next_power_of_2(num_heads)))
    splits_32 = choose_splits(num_rows, triton.cdiv(num_heads, head_block), width, 32, num_sms)
    return head_block, 64 if splits_32 <= 2 else 32


def use_two_pass(num_rows: int, num_head_blocks: int, width: int) -> bool:
    """The two-pass kernels from 64 (row, head block) pairs on, or from 16 over key lists of at
    most 2048; the fused kernel, split over the key list, otherwise: with few rows the two-pass
    value kernel has 4 programs per pair, each walking the whole list.

    H200, µs fused / two-pass (FlashMLA): 64 heads, 640 keys, T = 8: 23.0 / 24.8 (14.1), T = 16:
    26.1 / 24.9 (16.0); 128 heads, 1152 keys, T = 8: 35.2 / 36.3, T = 16: 53.9 / 44.2; 8320 keys
    (c128 at 1M), T = 16: 176 / 234, T = 64: 577 / 451 (249).
    """
    programs = num_rows * num_head_blocks
    return programs >= 64 or (programs >= 16 and width <= 2048)


def choose_path(num_rows: int, num_heads: int, width: int, num_sms: int, warp_specialized: bool) -> str:
    """The path for these shapes, given whether the warp-specialised kernel runs here
    (``sparse_attn_warp_specialized.available``): the fused kernel's 16-head programs for the few
    rows of ``few_rows_block_n`` (c4 Flash b = 1: 11.3 µs against 12.0 warp-specialised); else
    the warp-specialised kernel, whatever the head count (fewer than 64 heads are padded: 8, 16 or
    32 heads, c4 Flash, b = 8 / 128: 10.0-12.0 / 38.7-43.8 µs, against 16.7-21.7 / 62.6-87.9 for
    the Triton kernels); without it, the two-pass kernels for many rows (``use_two_pass``) and the
    fused kernel for few."""
    if few_rows_block_n(num_rows, num_heads, width, num_sms) is not None:
        return "fused"
    if warp_specialized:
        return "warp_specialized"
    head_block, _ = choose_tiling(num_rows, num_heads, width, num_sms)
    if use_two_pass(num_rows, triton.cdiv(num_heads, head_block), width):
        return "two_pass"
    return "fused"


@dataclass(frozen=True)
class Plan:
    """How one call runs: its path, heads per program, keys per block and key-list splits (1
    for the two-pass path, which never splits)."""

    path: str
    head_block: int
    block_n: int
    splits: int


def plan(num_rows: int, num_heads: int, width: int, device: torch.device, *, path: str | None = None,
         num_splits: int | None = None, fused_block_n: int | None = None,
         warp_specialized_block_n: int = WarpSpecializedConfig.block_n) -> Plan:
    """The :class:`Plan` of ``launch_sparse_attn`` (arguments there), from the shapes and the device."""
    sms = num_sms(device)
    head_block, block_n = choose_tiling(num_rows, num_heads, width, sms)
    here = sparse_attn_warp_specialized.available(device)
    path = path or choose_path(num_rows, num_heads, width, sms, here)
    if path not in PATHS:
        raise ValueError(f"launch_sparse_attn: path={path!r}; expected one of {PATHS}")
    if path == "warp_specialized" and not here:
        raise ValueError("launch_sparse_attn: the warp-specialised kernel needs Gluon from Triton 3.6 "
                         "and an sm_90 GPU")
    if path == "two_pass":
        return Plan(path, head_block, block_n, 1)
    if path == "warp_specialized":
        head_block, block_n = sparse_attn_warp_specialized.HEAD_BLOCK, warp_specialized_block_n
    else:
        block_n = fused_block_n or block_n
    splits = num_splits or choose_splits(num_rows, triton.cdiv(num_heads, head_block), width, block_n, sms)
    return Plan(path, head_block, block_n, splits)


def launch_sparse_attn(q: torch.Tensor, swa: KVSet, extra: KVSet | None, attn_sink: torch.Tensor,
                       softmax_scale: float, *, inverse_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                       path: str | None = None, num_splits: int | None = None,
                       pdl: bool | None = None, fused: FusedConfig = FusedConfig(),
                       two_pass: TwoPassConfig = TwoPassConfig(),
                       warp_specialized: WarpSpecializedConfig = WarpSpecializedConfig()
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA with sink; arguments as ``attention.sparse_attn`` (already checked by the op).

    q: [T, H, 512] bf16; attn_sink: [H] fp32. Returns ``out [T, H, 512] bf16`` and ``lse [T, H]
    fp32`` (natural log, sink excluded; +inf and out 0 for a row without valid keys). Never reads
    tensor values on the host (CUDA-graph safe).

    ``inverse_rope``: ``(positions [T] int, inv_freq [32] fp32)``: each head's output rotated back
    at its row's position (``dsv4::sparse_attn_inverse_rope``), by the split combine where there
    is one, else by ``rope_tail``'s kernel after the attention.

    ``path``: one of ``PATHS`` (default ``choose_path``). ``num_splits`` overrides the shape-based
    split count of the fused and warp-specialised kernels (tests). ``fused``, ``two_pass`` and
    ``warp_specialized`` hold each path's tuning knobs (benchmarks). ``pdl``: launch the fused
    kernel's split combine with programmatic dependent launch, so its launch overlaps the main
    grid (default: on sm_90+).
    """
    q, swa, extra, attn_sink = normalize(q, swa, extra, attn_sink)
    T, H, _ = q.shape
    out = torch.empty(T, H, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    how = plan(T, H, key_width(swa, extra), q.device, path=path, num_splits=num_splits,
               fused_block_n=fused.block_n, warp_specialized_block_n=warp_specialized.block_n)
    if T == 0:
        return out, lse
    args = (q, swa, extra, attn_sink, softmax_scale, out, lse)
    if how.path == "two_pass":
        launch_two_pass(*args, head_block=how.head_block, config=two_pass)
        return rotated_back(out, inverse_rope), lse
    partials = allocate_partials(T, how.splits, H, q.device)
    # PDL pays off when the main grid lets the combine launch early (the fused kernel does)
    pdl = partials is not None and how.path == "fused" and (has_pdl(q.device) if pdl is None else pdl)
    if how.path == "warp_specialized":
        launch_warp_specialized(*args, partials, config=warp_specialized)
    else:
        launch_fused(*args, partials, head_block=how.head_block, block_n=how.block_n,
                     num_stages=fused.num_stages, pdl=pdl)
    if partials is None:
        return rotated_back(out, inverse_rope), lse
    launch_combine(partials, attn_sink, out, lse, pdl=pdl, inverse_rope=inverse_rope)
    return out, lse


def rotated_back(out: torch.Tensor, inverse_rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """``out [T, H, 512]`` with each head rotated back at its row's position by ``rope_tail``'s
    kernel, or as it is without ``inverse_rope``."""
    if inverse_rope is None:
        return out
    positions, inv_freq = inverse_rope
    return launch_rope_tail(out, positions.unsqueeze(1), inv_freq, inverse=True)
