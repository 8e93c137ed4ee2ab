"""RMSNorm and RoPE: ``dsv4::rms_norm`` and ``dsv4::rope_tail``, the reference math as one traced op
each (the layers call them; Inductor decomposes them back into that math, so they cost Dynamo one
node a call; on CUDA an inverse RoPE stays one node, running its kernel); RMSNorm followed by
RoPE, fused: ``dsv4::rms_norm_rope``; and for a layer's key, followed by its cache write too:
``dsv4::rms_norm_rope_store_kv``.

The model calls neither fused op: a compiled step gets the first from ``FuseNormRopePass``
(``fx_passes/fuse_norm_rope.py``), which finds a layer's query norm + RoPE (per head) and key norm
+ RoPE in the graph and replaces each chain by one call, and the second from ``FuseKeyStorePass``
(``fx_passes/fuse_key_store.py``), which folds a key's ``rms_norm_rope`` into the ``store_kv``
that is its only reader. On CUDA each is one Triton launch (``ops/kernels/norm_rope.py``);
elsewhere the reference, the unfused math.

Shape legend: T tokens, H heads, D = row length, R = RoPE dims (2 x len(inv_freq)).
"""

from __future__ import annotations

import torch

from ..config import HEAD_DIM, ROPE_DIM
from ..reference import functional as ref
from ..reference import kv_store
from ._checks import SLOT_DTYPES, check_devices, check_inv_freq, check_same_rows, check_tensor
from ._library import HAS_TRITON, dsv4_op
from .kv_cache import check_model1_cache, writes_only

if HAS_TRITON:
    from .kernels import norm_rope as kernels

DTYPES = (torch.bfloat16, torch.float16)


def _check_rms_norm(x, weight, eps) -> None:
    check_tensor("rms_norm", "x", x, dtypes=DTYPES + (torch.float32,))
    if weight is not None:
        check_tensor("rms_norm", "weight", weight, dtypes=(torch.float32, x.dtype), ndim=1, shape=(x.shape[-1],))
    check_devices("rms_norm", x=x, weight=weight)


def _same_as_x(x, *args):
    """The fake of every op here that returns one tensor: x's shape and dtype, contiguous."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@dsv4_op("rms_norm", check=_check_rms_norm, fake=_same_as_x, decompose=True)
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``reference.functional.rms_norm`` as one traced op: ``x [..., D]`` bf16 / fp16 / fp32,
    ``weight [D]`` fp32 or x's dtype, or None -> x's shape and dtype (fp32 math), a new contiguous
    tensor."""
    return ref.rms_norm(x, weight, eps)


def _check_rope_tail(x, positions, inv_freq, inverse=False) -> None:
    check_tensor("rope_tail", "x", x, dtypes=DTYPES + (torch.float32,))
    check_inv_freq("rope_tail", x, inv_freq)
    check_tensor("rope_tail", "positions", positions, dtypes=(torch.int32, torch.int64))
    check_devices("rope_tail", x=x, positions=positions, inv_freq=inv_freq)


def _rope_tail_decomposed(x, positions, inv_freq, inverse=False) -> bool:
    """Which ``rope_tail`` calls Inductor decomposes: all but the inverse rotations on CUDA. The
    inverse rotation is the attention output's, between two ops Inductor cannot fuse with, so
    its kernel is one launch as Inductor's would be, and one node for AOTAutograd to trace where
    the decomposition makes ~25 (one such call a layer). The forward rotations
    stay decomposed: the norm + RoPE patterns match them, and Inductor fuses them."""
    return not (inverse and x.device.type == "cuda" and HAS_TRITON)


@dsv4_op("rope_tail", check=_check_rope_tail, fake=_same_as_x, decompose=_rope_tail_decomposed,
         cuda=kernels.launch_rope_tail if HAS_TRITON else None)
def rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False
              ) -> torch.Tensor:
    """``reference.functional.rope_tail`` as one traced op: RoPE (its inverse when ``inverse``) on
    the last R dims of ``x [..., D]`` at ``positions`` (int, broadcast to ``x.shape[:-1]``),
    ``inv_freq [R / 2] fp32`` -> x's shape and dtype, a new contiguous tensor. On CUDA one
    program a row (``ops/kernels/norm_rope.py``)."""
    return ref.rope_tail(x, positions, inv_freq, inverse)


def _check_rms_norm_rope(x, weight, eps, round_scale, positions, inv_freq, op: str = "rms_norm_rope") -> None:
    check_tensor(op, "x", x, dtypes=DTYPES)
    if x.dim() not in (2, 3):
        raise ValueError(f"dsv4.{op}: x must be [T, D] or [T, H, D], got shape {tuple(x.shape)}")
    check_inv_freq(op, x, inv_freq, power_of_two=True)
    check_tensor(op, "positions", positions, dtypes=(torch.int32, torch.int64), ndim=1, shape=(x.shape[0],))
    if weight is not None:
        check_tensor(op, "weight", weight, dtypes=(torch.float32, x.dtype), ndim=1, shape=(x.shape[-1],))
        if round_scale:
            raise ValueError(f"dsv4.{op}: round_scale is the unweighted norm's rounding; weight must be None")
    check_devices(op, x=x, weight=weight, positions=positions, inv_freq=inv_freq)


@dsv4_op("rms_norm_rope", check=_check_rms_norm_rope, fake=_same_as_x,
         cuda=kernels.launch_rms_norm_rope if HAS_TRITON else None)
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, round_scale: bool,
                  positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RMSNorm of x's rows, then RoPE on their last R dims at each token's position.

    x: [T, D] or [T, H, D] bf16 / fp16; weight: [D] fp32 or x's dtype, or None; positions: [T]
    int32 / int64; inv_freq: [R / 2] fp32, R / 2 a power of two. ``round_scale`` (weight None):
    the scale is rounded to x's dtype before the product (``transformers``' unweighted norm).
    Returns x's shape and dtype, contiguous (``reference.functional.rms_norm_rope``).
    """
    return ref.rms_norm_rope(x, weight, eps, round_scale, positions, inv_freq).contiguous()


def _check_rms_norm_rope_store_kv(cache, slots, x, weight, eps, round_scale, positions, inv_freq, page_size) -> None:
    op = "rms_norm_rope_store_kv"
    check_tensor(op, "x", x, dtypes=(torch.bfloat16,), ndim=2, shape=(None, HEAD_DIM))
    check_tensor(op, "inv_freq", inv_freq, dtypes=(torch.float32,), ndim=1, shape=(ROPE_DIM // 2,))
    _check_rms_norm_rope(x, weight, eps, round_scale, positions, inv_freq, op)
    check_tensor(op, "slots", slots, dtypes=SLOT_DTYPES, ndim=1)
    check_same_rows(op, slots=slots, x=x)
    check_model1_cache(op, "cache", cache, page_size)
    check_devices(op, cache=cache, slots=slots, x=x)


@dsv4_op("rms_norm_rope_store_kv", check=_check_rms_norm_rope_store_kv, fake=writes_only,
         cuda=kernels.launch_rms_norm_rope_store_kv if HAS_TRITON else None,
         mutates_args=("cache",), side_stream=True)
def rms_norm_rope_store_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                           eps: float, round_scale: bool, positions: torch.Tensor, inv_freq: torch.Tensor,
                           page_size: int) -> None:
    """``store_kv(cache, slots, rms_norm_rope(x, weight, eps, round_scale, positions, inv_freq),
    page_size)`` in one op: keys ``x [T, 512] bf16`` normed, rotated on their last 64 dims
    (``inv_freq [32] fp32``), quantised to MODEL1 and written at ``slots [T]`` of ``cache
    [N_pages, Nb] uint8`` (rows whose slot is outside ``[0, N_pages * P)`` are skipped)."""
    kv_store.store_model1(cache, slots, ref.rms_norm_rope(x, weight, eps, round_scale, positions, inv_freq),
                          page_size)
