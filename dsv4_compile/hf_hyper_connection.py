"""transformers' hyper-connections (mHC) run through the backend's ops.

The model step calls a layer's ``DeepseekV4HyperConnection`` as ``dsv4::hc_pre`` with the module's
own parameters (``fn``, ``base``, ``scale``) and settings, the decoder layer's mix as
``dsv4::hc_post`` (with the next hyper-connection, as ``dsv4::hc_post_pre``) and the model's
``DeepseekV4HyperHead`` as ``dsv4::hc_head``: the same formulas,
op for op on the CPU (where the ops run their reference, bit for bit the module's result), two,
one, two (three above four tokens) and two kernels on CUDA where Inductor makes about ten of the
module's code. A module whose
class overrides ``forward``, or whose parameters are not plain tensors (DTensor shards, a
quantiser's tensors), is called as it is.
"""

from __future__ import annotations

import torch
from torch import nn


def _plain(*params: torch.Tensor) -> bool:
    return all(type(p) in (torch.Tensor, nn.Parameter) for p in params)


def _runs_as_op(hc: nn.Module) -> bool:
    """Whether ``hc`` is a ``DeepseekV4HyperConnection`` the mHC ops compute as it would."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    return type(hc).forward is DeepseekV4HyperConnection.forward and _plain(hc.fn, hc.base, hc.scale)


def _settings(hc: nn.Module) -> tuple:
    return hc.fn, hc.base, hc.scale, hc.hc_sinkhorn_iters, hc.hc_eps, hc.input_norm.eps


def pre(hc: nn.Module, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc(streams)`` for a ``DeepseekV4HyperConnection``: ``streams [..., N, D]`` -> ``post [..., N]``
    fp32, ``comb [..., N, N]`` fp32, the block's input ``[..., D]``."""
    if not _runs_as_op(hc):
        return hc(streams)
    return torch.ops.dsv4.hc_pre(streams, *_settings(hc))


def post(post_w: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The decoder layer's mix of a block's output into the streams:
    ``post_w ⊗ block_out + combᵀ @ streams`` ``[..., N, D]``."""
    return torch.ops.dsv4.hc_post(post_w, comb, block_out, streams)


def post_pre(post_w: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor,
             hc: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`post` then :func:`pre` with the next hyper-connection ``hc``: the new streams, then
    ``hc``'s ``post``, ``comb`` and block input; one op (``dsv4::hc_post_pre``) when ``hc`` runs as one."""
    if not _runs_as_op(hc):
        new = post(post_w, comb, block_out, streams)
        return (new, *hc(new))
    return torch.ops.dsv4.hc_post_pre(post_w, comb, block_out, streams, *_settings(hc))


def head(hc_head: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """``hc_head(streams)`` for a ``DeepseekV4HyperHead``: ``[..., N, D]`` -> ``[..., D]``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    if (type(hc_head).forward is not DeepseekV4HyperHead.forward
            or not _plain(hc_head.hc_fn, hc_head.hc_base, hc_head.hc_scale)):
        return hc_head(streams)
    return torch.ops.dsv4.hc_head(streams, hc_head.hc_fn, hc_head.hc_base, hc_head.hc_scale, hc_head.eps,
                                  hc_head.input_norm.eps)
