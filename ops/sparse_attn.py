"""``dsv4::sparse_attn``: sparse MQA over SWA + extra (c4 / c128) entries of FP8 MODEL1 caches,
with a per-head attention sink (docs/semantics.md §4.4). A fixed public contract (name and
argument order); Python callers use ``dsv4_compile.attention.sparse_attn``, which takes the two
entry lists as ``KVSet``s.

Kernels: the reference on every device; on CUDA ``kernels/sparse_attn_dispatch.py``, which picks
a path from the shapes and the GPU (the warp-specialised Gluon kernel on sm_90, else the fused or
the two-pass Triton kernels), or FlashMLA when ``DSV4_ATTN_IMPL=flashmla`` (see
:func:`_sparse_attn_cuda`). ``dsv4::sparse_attn_flashmla`` (same signature, CUDA only) always
calls FlashMLA; it needs the optional ``flash_mla`` module (pip ``sgl-flash-mla``), imported on
first use. ``dsv4::sparse_attn_inverse_rope`` (two more arguments) is ``sparse_attn`` with each
head's output rotated back at its row's position, as a layer's output projection takes it: on
CUDA inside the split combine where the attention has one (no ``rope_tail`` launch after it); a
compiled step gets it from ``FuseAttentionInverseRopePass``.

Shape legend: T = query rows, H = heads, K1 / K2 = index widths (multiples of 64).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ..attention import KVSet, from_op_args
from ..config import HEAD_DIM, INDEX_ALIGN, ROPE_DIM
from ..reference import functional as ref_functional
from ..reference import sparse_attn as ref
from ._checks import INDEX_DTYPES, check_devices, check_multiple_of, check_tensor
from ._library import HAS_TRITON, dsv4_op
from .kv_cache import check_model1_cache

if HAS_TRITON:
    from .kernels import flashmla
    from .kernels import sparse_attn_dispatch as dispatch

FLASHMLA_MAX_HEADS = 128
IMPL_ENV = "DSV4_ATTN_IMPL"  # "flashmla" routes the CUDA kernel of dsv4::sparse_attn to FlashMLA
_OP = "sparse_attn"
_FLASHMLA_OP = "sparse_attn_flashmla"
_INVERSE_ROPE_OP = "sparse_attn_inverse_rope"


def _check_kv_set(op: str, which: str, kv: KVSet, rows: int) -> None:
    check_model1_cache(op, f"{which}_cache", kv.cache, kv.page_size)
    check_tensor(op, f"{which}_indices", kv.indices, dtypes=INDEX_DTYPES, ndim=2, shape=(rows, None))
    check_multiple_of(op, f"{which}_indices.shape[1]", kv.indices.shape[1], INDEX_ALIGN)
    check_tensor(op, f"{which}_lengths", kv.lengths, dtypes=INDEX_DTYPES, ndim=1, shape=(rows,))


def _check_attn_args(op: str, args: tuple) -> None:
    """Arguments of ``dsv4::<op>`` (``sparse_attn`` or its FlashMLA twin), as positionals
    (``attention.op_args``); errors name ``op``."""
    extras = (args[5], args[7], args[8])  # extra_cache, extra_indices, extra_lengths
    if any(t is None for t in extras) and not all(t is None for t in extras):
        raise ValueError(f"dsv4.{op}: extra_cache, extra_indices and extra_lengths must be given "
                         "together (or all None for ratio-0 layers)")
    q, swa, extra, attn_sink, softmax_scale = from_op_args(args)
    if not math.isfinite(softmax_scale):
        raise ValueError(f"dsv4.{op}: softmax_scale={softmax_scale} must be finite")
    check_tensor(op, "q", q, dtypes=(torch.bfloat16,), ndim=3, shape=(None, None, HEAD_DIM))
    check_tensor(op, "attn_sink", attn_sink, dtypes=(torch.float32,), ndim=1, shape=(q.shape[1],))
    _check_kv_set(op, "swa", swa, q.shape[0])
    if extra is not None:
        _check_kv_set(op, "extra", extra, q.shape[0])
    lists = {f"{which}_{part}": getattr(kv, part) for which, kv in (("swa", swa), ("extra", extra))
             if kv is not None for part in ("cache", "indices", "lengths")}
    check_devices(op, q=q, **lists, attn_sink=attn_sink)


def _check_sparse_attn(*args) -> None:
    _check_attn_args(_OP, args)


def _check_flashmla_heads(q: torch.Tensor) -> None:
    if q.shape[1] > FLASHMLA_MAX_HEADS:
        raise ValueError(f"dsv4.sparse_attn_flashmla: q has {q.shape[1]} heads; FlashMLA supports at most "
                         f"{FLASHMLA_MAX_HEADS}")


def _check_flashmla(*args) -> None:
    """``_check_attn_args``, and a head count FlashMLA supports (in the fake too: fails at trace time)."""
    _check_attn_args(_FLASHMLA_OP, args)
    _check_flashmla_heads(args[0])


def _attn_fake(q: torch.Tensor, *_) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def _flashmla(*args) -> tuple[torch.Tensor, torch.Tensor]:
    return flashmla.flashmla_sparse_attn(*from_op_args(args))


def _sparse_attn_cuda(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernel: our kernels, or FlashMLA when ``DSV4_ATTN_IMPL=flashmla``. The variable is
    read on every call of the op, eager or from a compiled graph; a captured CUDA graph (a capture
    by hand or torch.compile's ``mode="reduce-overhead"``) replays the kernels it recorded, whatever
    the variable says at replay."""
    if os.environ.get(IMPL_ENV) == "flashmla":
        _check_flashmla_heads(args[0])
        return _flashmla(*args)
    return dispatch.launch_sparse_attn(*from_op_args(args))


def _reference(q: torch.Tensor, swa_cache: torch.Tensor, swa_page_size: int, swa_indices: torch.Tensor,
               swa_lengths: torch.Tensor, extra_cache: Optional[torch.Tensor], extra_page_size: int,
               extra_indices: Optional[torch.Tensor], extra_lengths: Optional[torch.Tensor],
               attn_sink: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, 512] bf16, lse [T, H] fp32)``; lse is the natural log without the sink,
    ``+inf`` for a row with no valid key (whose out is 0)."""
    return ref.sparse_attn(*from_op_args((q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache,
                                          extra_page_size, extra_indices, extra_lengths, attn_sink,
                                          softmax_scale)))


_SCHEMA = torch.library.infer_schema(_reference, mutates_args=())
sparse_attn = dsv4_op(_OP, check=_check_sparse_attn, fake=_attn_fake, cuda=_sparse_attn_cuda,
                      schema=_SCHEMA)(_reference)
# the same op computed by FlashMLA (H <= 128): same signature, outputs and semantics
sparse_attn_flashmla = dsv4_op(_FLASHMLA_OP, check=_check_flashmla, fake=_attn_fake,
                               device_types="cuda", schema=_SCHEMA)(_flashmla)


def _check_inverse_rope(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
                        extra_indices, extra_lengths, attn_sink, softmax_scale, positions, inv_freq) -> None:
    op = _INVERSE_ROPE_OP
    _check_attn_args(op, (q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
                          extra_indices, extra_lengths, attn_sink, softmax_scale))
    check_tensor(op, "positions", positions, dtypes=INDEX_DTYPES, ndim=1, shape=(q.shape[0],))
    check_tensor(op, "inv_freq", inv_freq, dtypes=(torch.float32,), ndim=1, shape=(ROPE_DIM // 2,))
    check_devices(op, q=q, positions=positions, inv_freq=inv_freq)


def _sparse_attn_inverse_rope_cuda(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """Our kernels with the rotation in the split combine, or FlashMLA then ``rope_tail``'s kernel
    (``DSV4_ATTN_IMPL=flashmla``, read as :func:`_sparse_attn_cuda` reads it)."""
    attn_args, inverse_rope = args[:11], tuple(args[11:])
    if os.environ.get(IMPL_ENV) == "flashmla":
        _check_flashmla_heads(args[0])
        out, lse = _flashmla(*attn_args)
        return dispatch.rotated_back(out, inverse_rope), lse
    return dispatch.launch_sparse_attn(*from_op_args(attn_args), inverse_rope=inverse_rope)


def _reference_inverse_rope(q: torch.Tensor, swa_cache: torch.Tensor, swa_page_size: int, swa_indices: torch.Tensor,
                             swa_lengths: torch.Tensor, extra_cache: Optional[torch.Tensor], extra_page_size: int,
                             extra_indices: Optional[torch.Tensor], extra_lengths: Optional[torch.Tensor],
                             attn_sink: torch.Tensor, softmax_scale: float, positions: torch.Tensor,
                             inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_attn``'s ``(out, lse)`` with ``out``'s heads rotated back at their rows' positions
    ``[T]``: ``rope_tail(out, positions[:, None], inv_freq, inverse=True)`` (``inv_freq [32]
    fp32``)."""
    out, lse = _reference(q, swa_cache, swa_page_size, swa_indices, swa_lengths, extra_cache, extra_page_size,
                          extra_indices, extra_lengths, attn_sink, softmax_scale)
    return ref_functional.rope_tail(out, positions.unsqueeze(1), inv_freq, inverse=True), lse


sparse_attn_inverse_rope = dsv4_op(
    _INVERSE_ROPE_OP, check=_check_inverse_rope, fake=_attn_fake,
    cuda=_sparse_attn_inverse_rope_cuda if HAS_TRITON else None,
    schema=torch.library.infer_schema(_reference_inverse_rope, mutates_args=()))(_reference_inverse_rope)
