"""Manifold-constrained hyper-connections (mHC): the Sinkhorn-Knopp normalisation of the comb
weights — reference.

transformers' ``DeepseekV4HyperConnection.forward`` makes its comb weights ``[..., N, N]`` fp32
(N = ``hc_mult`` streams) nearly doubly stochastic with ``iters`` (``hc_sinkhorn_iters``) steps::

    comb = comb / (comb.sum(-2, keepdim=True) + eps)      # columns
    repeat iters - 1 times:
        comb = comb / (comb.sum(-1, keepdim=True) + eps)  # rows
        comb = comb / (comb.sum(-2, keepdim=True) + eps)  # columns
"""

from __future__ import annotations

import torch


def sinkhorn(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``x [..., N, N] fp32`` after one column normalisation and ``iters - 1`` (row, column) pairs,
    each ``x / (sum + eps)``: the transformers loop, op for op. A new contiguous tensor."""
    comb = x.contiguous()  # each division then allocates its result contiguous
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb
