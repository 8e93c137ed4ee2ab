"""transformers' hyper-connections (mHC) run through the backend's ops.

The model step calls a layer's ``DeepseekV4HyperConnection`` as ``dsv4::hc_pre`` with the module's
own parameters (``fn``, ``base``, ``scale``) and settings, the decoder layer's mix as
``dsv4::hc_post`` (with the next hyper-connection, as ``dsv4::hc_post_pre``) and the model's
``DeepseekV4HyperHead`` as ``dsv4::hc_head``. The norm that follows a collapse (the block's input
norm, the model's final norm) goes into the op too (:data:`NORM_IN_OP`, set by default) when it is
transformers' ``DeepseekV4RMSNorm`` with a plain weight; otherwise the norm module is called on the
op's output.
The same formulas,
op for op on the CPU (where the ops run their reference, bit for bit the module's result), two,
one, two (three above four tokens) and two kernels on CUDA where Inductor makes about ten of the
module's code. A module whose
class overrides ``forward``, or whose parameters are not plain tensors (DTensor shards, a
quantiser's tensors), is called as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from .plain_tensor import is_plain_tensor, plain_rms_norm


# Whether the ops apply the norm after a collapse (else the norm module runs on the op's output).
# On the H200 (bench_model.py, b = 1) the fold takes 13 of the step's 134 kernels away
# (docs/perf-log.md).
NORM_IN_OP = True


def _plain(*params: torch.Tensor) -> bool:
    return all(is_plain_tensor(p) for p in params)


def _runs_as_op(hc: nn.Module) -> bool:
    """Whether ``hc`` is a ``DeepseekV4HyperConnection`` the mHC ops compute as it would."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    return type(hc).forward is DeepseekV4HyperConnection.forward and _plain(hc.fn, hc.base, hc.scale)


def _settings(hc: nn.Module) -> tuple:
    return hc.fn, hc.base, hc.scale, hc.hc_sinkhorn_iters, hc.hc_eps, hc.input_norm.eps


def _op_norm(norm: nn.Module | None) -> tuple[torch.Tensor | None, float]:
    """``(weight, eps)`` of ``norm`` when the ops apply it themselves (a ``DeepseekV4RMSNorm`` as
    transformers defines it, with a plain weight), else ``(None, 0.0)``."""
    rms = plain_rms_norm(norm) if NORM_IN_OP else None
    return rms if rms is not None else (None, 0.0)


def _normed(collapsed: torch.Tensor, norm: nn.Module | None, applied: bool) -> torch.Tensor:
    """The block's input: ``collapsed`` as the op returned it, through ``norm`` unless it applied it."""
    return collapsed if norm is None or applied else norm(collapsed)


def pre(hc: nn.Module, streams: torch.Tensor, norm: nn.Module | None = None
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc(streams)`` for a ``DeepseekV4HyperConnection``, then ``norm`` (the block's input norm, if
    given) on its collapse: ``streams [..., N, D]`` -> ``post [..., N]`` fp32, ``comb [..., N, N]``
    fp32, the block's input ``[..., D]``."""
    if not _runs_as_op(hc):
        post_w, comb, collapsed = hc(streams)
        return post_w, comb, _normed(collapsed, norm, False)
    weight, eps = _op_norm(norm)
    post_w, comb, collapsed = torch.ops.dsv4.hc_pre(streams, *_settings(hc), weight, eps)
    return post_w, comb, _normed(collapsed, norm, weight is not None)


def post(post_w: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The decoder layer's mix of a block's output into the streams:
    ``post_w ⊗ block_out + combᵀ @ streams`` ``[..., N, D]``."""
    return torch.ops.dsv4.hc_post(post_w, comb, block_out, streams)


def post_pre(post_w: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor,
             hc: nn.Module, norm: nn.Module | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`post` then :func:`pre` with the next hyper-connection ``hc`` and block input norm
    ``norm``: the new streams, then ``hc``'s ``post``, ``comb`` and block input; one op
    (``dsv4::hc_post_pre``) when ``hc`` runs as one."""
    if not _runs_as_op(hc):
        new = post(post_w, comb, block_out, streams)
        return (new, *pre(hc, new, norm))
    weight, eps = _op_norm(norm)
    new, post_w, comb, collapsed = torch.ops.dsv4.hc_post_pre(post_w, comb, block_out, streams, *_settings(hc),
                                                              weight, eps)
    return new, post_w, comb, _normed(collapsed, norm, weight is not None)


def head(hc_head: nn.Module, streams: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
    """``hc_head(streams)`` for a ``DeepseekV4HyperHead``, then ``norm`` (the model's final norm, if
    given): ``[..., N, D]`` -> ``[..., D]``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    if (type(hc_head).forward is not DeepseekV4HyperHead.forward
            or not _plain(hc_head.hc_fn, hc_head.hc_base, hc_head.hc_scale)):
        return _normed(hc_head(streams), norm, False)
    weight, eps = _op_norm(norm)
    collapsed = torch.ops.dsv4.hc_head(streams, hc_head.hc_fn, hc_head.hc_base, hc_head.hc_scale, hc_head.eps,
                                       hc_head.input_norm.eps, weight, eps)
    return _normed(collapsed, norm, weight is not None)
