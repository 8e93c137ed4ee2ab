"""Manifold-constrained hyper-connections (mHC) — reference: transformers'
``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` and the decoder layer's mix, op for op.

Shape legend: N = ``hc_mult`` streams, D = hidden, M = ``(2 + N) N`` mix weights of a layer's
hyper-connection (``pre`` N, ``post`` N, ``comb`` N x N), ``...`` any leading dims (batch, tokens).

* :func:`hc_pre`: the hyper-connection before a block. The streams ``x [..., N, D]``, flattened,
  RMS-normalised (no weight) and projected by ``fn [M, N D]`` fp32, give the mix weights; ``pre``
  collapses the streams into the block's input, ``post`` and ``comb`` go to :func:`hc_post`.
  ``comb`` is made nearly doubly stochastic by :func:`sinkhorn`.
* :func:`hc_post`: the block's output expanded back onto the streams and mixed with them:
  ``post ⊗ out + combᵀ @ streams``.
* :func:`hc_head`: the final collapse before the model's norm (``pre`` only, ``fn [N, N D]``).

Both collapses take the block's (or the head's) own RMSNorm as an option (``out_norm_weight [D]``,
``out_norm_eps``): the decoder layer normalises the collapsed streams before its block, and nothing
else reads them, so the ops return them normalised (:func:`~.functional.rms_norm`, the arithmetic
of transformers' ``DeepseekV4RMSNorm``).

:func:`sinkhorn` (``iters`` steps)::

    comb = comb / (comb.sum(-2, keepdim=True) + eps)      # columns
    repeat iters - 1 times:
        comb = comb / (comb.sum(-1, keepdim=True) + eps)  # rows
        comb = comb / (comb.sum(-2, keepdim=True) + eps)  # columns
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .functional import rms_norm


def sinkhorn(x: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``x [..., N, N] fp32`` after one column normalisation and ``iters - 1`` (row, column) pairs,
    each ``x / (sum + eps)``: the transformers loop, op for op. A new contiguous tensor."""
    comb = x.contiguous()  # each division then allocates its result contiguous
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``x [..., N, D]`` flattened to ``[..., N D]`` fp32, RMS-normalised, projected by ``fn [M, N D]``:
    ``[..., M] fp32``."""
    return F.linear(rms_norm(x.flatten(-2).float(), None, norm_eps), fn.float())


def collapse(pre: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor | None = None,
             norm_eps: float = 0.0) -> torch.Tensor:
    """``sum_n pre[..., n] x[..., n, :]``: ``[..., D]`` in ``x``'s dtype (the sum in fp32), then
    :func:`~.functional.rms_norm` with ``norm_weight`` when it is given."""
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)
    return collapsed if norm_weight is None else rms_norm(collapsed, norm_weight, norm_eps)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
           norm_eps: float, out_norm_weight: torch.Tensor | None = None, out_norm_eps: float = 0.0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., N, D]``, ``fn [M, N D]``, ``base [M]``, ``scale [3]`` -> ``post [..., N]`` fp32,
    ``comb [..., N, N]`` fp32, ``collapsed [..., D]`` (``x``'s dtype; RMS-normalised with
    ``out_norm_weight [D]`` and ``out_norm_eps`` when the weight is given)."""
    n = x.shape[-2]
    pre_w, post_w, comb_w = mixes(x, fn, norm_eps).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.unbind(0)
    comb_w = comb_w.view(*comb_w.shape[:-1], n, n)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = torch.softmax(comb_w * comb_scale + comb_b.view(n, n), dim=-1) + hc_eps
    return post, sinkhorn(comb, iters, hc_eps), collapse(pre, x, out_norm_weight, out_norm_eps)


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, out_norm_weight: torch.Tensor | None = None, out_norm_eps: float = 0.0
            ) -> torch.Tensor:
    """``x [..., N, D]``, ``fn [N, N D]``, ``base [N]``, ``scale [1]`` -> ``[..., D]`` (``x``'s dtype;
    RMS-normalised as :func:`hc_pre`'s collapse when ``out_norm_weight`` is given)."""
    pre = torch.sigmoid(mixes(x, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return collapse(pre, x, out_norm_weight, out_norm_eps)


def hc_post(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``post [..., N]``, ``comb [..., N, N]``, the block's ``out [..., D]``, ``streams [..., N, D]``
    -> the next streams ``[..., N, D]`` in ``streams``' dtype: ``post ⊗ out + combᵀ @ streams``, the
    weights rounded to that dtype first (as the decoder layer does)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
