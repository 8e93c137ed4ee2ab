"""Manifold-constrained hyper-connections (mHC): ``dsv4::sinkhorn``, the Sinkhorn-Knopp
normalisation of the comb weights of transformers' ``DeepseekV4HyperConnection``.

The model does not call the op: a compiled step gets it from ``FuseSinkhornPass``
(``fx_passes/fuse_sinkhorn.py``), which replaces the traced loop of ``2 iters - 1`` normalisations
(a kernel each) by this op (one kernel on CUDA).

Shape legend: N = hc_mult (streams); ``...`` any leading dims (batch, tokens).
"""

from __future__ import annotations

import torch

from ..reference import hyper_connection as ref
from ._checks import check_positive, check_tensor
from ._library import HAS_TRITON, dsv4_op

if HAS_TRITON:
    from .kernels import hyper_connection as kernels


def _check_sinkhorn(x, iters, eps) -> None:
    check_tensor("sinkhorn", "x", x, dtypes=(torch.float32,))
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"dsv4.sinkhorn: x must be [..., N, N] (square in its last two dims), "
                         f"got shape {tuple(x.shape)}")
    check_positive("sinkhorn", "iters", iters)
    if not eps >= 0:  # NaN included
        raise ValueError(f"dsv4.sinkhorn: eps={eps} must be >= 0")


def _sinkhorn_fake(x, iters, eps):
    return x.new_empty(x.shape)


def _sinkhorn_cuda(x, iters, eps):
    if x.shape[-1] > kernels.MAX_N:  # the kernel holds whole matrices in registers
        return ref.sinkhorn(x, iters, eps)
    return kernels.launch_sinkhorn(x, iters, eps)


@dsv4_op("sinkhorn", check=_check_sinkhorn, fake=_sinkhorn_fake, cuda=_sinkhorn_cuda if HAS_TRITON else None)
def sinkhorn(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``x [..., N, N] fp32`` made nearly doubly stochastic: a column normalisation, then
    ``iters - 1`` (row, column) pairs, each ``x / (sum + eps)`` (transformers' loop). A new
    contiguous tensor of ``x``'s shape."""
    return ref.sinkhorn(x, iters, eps)
