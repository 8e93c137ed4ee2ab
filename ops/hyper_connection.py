"""Manifold-constrained hyper-connections (mHC) of transformers' DeepSeek V4 model.

* ``dsv4::hc_pre``, ``dsv4::hc_post``, ``dsv4::hc_head``: a layer's hyper-connection before its
  block, the mix after it, the final collapse. The model step calls them with the model's own
  parameters (``dsv4_compile/hf_hyper_connection.py``); on CUDA they take two launches, one and two,
  where Inductor runs transformers' code as about ten kernels per hyper-connection.
* ``dsv4::hc_post_pre``: a block's mix followed by the next hyper-connection (``hc_post`` then
  ``hc_pre``, as one block's output meets the next block), in the two launches of ``hc_pre``: the
  projection's programs make the new streams they read.
* ``hc_pre``, ``hc_post_pre`` and ``hc_head`` take the RMSNorm that follows their collapse as an
  option (``out_norm_weight [D]``, ``out_norm_eps``): the decoder layer normalises the block's input
  and reads it nowhere else, so the op can return it normalised.
* ``dsv4::sinkhorn``: the Sinkhorn-Knopp normalisation of the comb weights alone. Nothing calls it:
  ``FuseSinkhornPass`` (``fx_passes/fuse_sinkhorn.py``) puts it in place of the traced loop of
  ``2 iters - 1`` normalisations (a kernel each) where transformers' own hyper-connection code is
  compiled.

Shape legend: N = hc_mult (streams), D = hidden; ``...`` any leading dims (batch, tokens).
"""

from __future__ import annotations

import torch

from ..reference import hyper_connection as ref
from ._checks import check_devices, check_non_negative, check_positive, check_tensor
from ._library import HAS_TRITON, dsv4_op

if HAS_TRITON:
    from .kernels import hyper_connection as kernels

_STREAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_sinkhorn(x, iters, eps) -> None:
    check_tensor("sinkhorn", "x", x, dtypes=(torch.float32,))
    if x.dim() < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"dsv4.sinkhorn: x must be [..., N, N] (square in its last two dims), "
                         f"got shape {tuple(x.shape)}")
    check_positive("sinkhorn", "iters", iters)
    check_non_negative("sinkhorn", "eps", eps)


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


def _check_streams(op: str, x: torch.Tensor) -> tuple[int, int]:
    """``x [..., N, D]`` floating: ``(N, D)``."""
    check_tensor(op, "x", x, dtypes=_STREAM_DTYPES)
    if x.dim() < 2:
        raise ValueError(f"dsv4.{op}: x must be [..., N, D] (streams, hidden), got shape {tuple(x.shape)}")
    return x.shape[-2], x.shape[-1]


def _check_weights(op: str, x, fn, base, scale, mixes: int, scales: int, hc_eps, norm_eps) -> None:
    n, d = x.shape[-2], x.shape[-1]
    check_tensor(op, "fn", fn, dtypes=_STREAM_DTYPES, shape=(mixes, n * d), ndim=2)
    check_tensor(op, "base", base, dtypes=_STREAM_DTYPES, shape=(mixes,), ndim=1)
    check_tensor(op, "scale", scale, dtypes=_STREAM_DTYPES, shape=(scales,), ndim=1)
    check_devices(op, x=x, fn=fn, base=base, scale=scale)
    check_non_negative(op, "hc_eps", hc_eps)
    check_non_negative(op, "norm_eps", norm_eps)


def _check_out_norm(op: str, x, weight, eps) -> None:
    """The block's RMSNorm that the collapse applies: ``weight [D]`` (fp32 or x's dtype) or None."""
    if weight is None:
        return
    check_tensor(op, "out_norm_weight", weight, dtypes=(torch.float32, x.dtype), shape=(x.shape[-1],), ndim=1)
    check_devices(op, x=x, out_norm_weight=weight)
    check_non_negative(op, "out_norm_eps", eps)


def _check_hc_pre(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight=None, out_norm_eps=0.0) -> None:
    n, _ = _check_streams("hc_pre", x)
    _check_weights("hc_pre", x, fn, base, scale, (2 + n) * n, 3, hc_eps, norm_eps)
    check_positive("hc_pre", "iters", iters)
    _check_out_norm("hc_pre", x, out_norm_weight, out_norm_eps)


def _hc_pre_fake(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight=None, out_norm_eps=0.0):
    lead, n, d = x.shape[:-2], x.shape[-2], x.shape[-1]
    return (x.new_empty((*lead, n), dtype=torch.float32), x.new_empty((*lead, n, n), dtype=torch.float32),
            x.new_empty((*lead, d)))


def _hc_pre_cuda(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight=None, out_norm_eps=0.0):
    if x.shape[-2] > kernels.MAX_HC_N:
        return ref.hc_pre(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight, out_norm_eps)
    return kernels.launch_hc_pre(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm=(out_norm_weight, out_norm_eps))


@dsv4_op("hc_pre", check=_check_hc_pre, fake=_hc_pre_fake, cuda=_hc_pre_cuda if HAS_TRITON else None)
def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
           norm_eps: float, out_norm_weight: torch.Tensor | None = None,
           out_norm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The hyper-connection before a block (transformers' ``DeepseekV4HyperConnection.forward``):
    streams ``x [..., N, D]``, ``fn [(2 + N) N, N D]``, ``base [(2 + N) N]``, ``scale [3]`` ->
    ``post [..., N]`` fp32, ``comb [..., N, N]`` fp32 (Sinkhorn-normalised with ``iters`` steps),
    the block's input ``collapsed [..., D]`` in ``x``'s dtype. With ``out_norm_weight [D]``
    (the block's RMSNorm, eps ``out_norm_eps``) the block's input comes out normalised."""
    return ref.hc_pre(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight, out_norm_eps)


def _check_hc_head(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight=None, out_norm_eps=0.0) -> None:
    n, _ = _check_streams("hc_head", x)
    _check_weights("hc_head", x, fn, base, scale, n, 1, hc_eps, norm_eps)
    _check_out_norm("hc_head", x, out_norm_weight, out_norm_eps)


def _hc_head_fake(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight=None, out_norm_eps=0.0):
    return x.new_empty((*x.shape[:-2], x.shape[-1]))


def _hc_head_cuda(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight=None, out_norm_eps=0.0):
    if x.shape[-2] > kernels.MAX_HC_N:
        return ref.hc_head(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps)
    return kernels.launch_hc_pre(x, fn, base, scale, 0, hc_eps, norm_eps, head=True,
                                 out_norm=(out_norm_weight, out_norm_eps))


@dsv4_op("hc_head", check=_check_hc_head, fake=_hc_head_fake, cuda=_hc_head_cuda if HAS_TRITON else None)
def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, out_norm_weight: torch.Tensor | None = None, out_norm_eps: float = 0.0) -> torch.Tensor:
    """The final collapse of the streams (transformers' ``DeepseekV4HyperHead.forward``):
    ``x [..., N, D]``, ``fn [N, N D]``, ``base [N]``, ``scale [1]`` -> ``[..., D]`` in ``x``'s dtype;
    normalised by the model's final RMSNorm when its ``out_norm_weight [D]`` is given, as ``hc_pre``."""
    return ref.hc_head(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps)


def _check_posted(op: str, post, comb, out, streams) -> None:
    """The arguments of a block's mix (``hc_post``, and ``hc_post_pre``'s first four)."""
    n, d = _check_streams(op, streams)
    lead = tuple(streams.shape[:-2])
    check_tensor(op, "post", post, dtypes=_STREAM_DTYPES, shape=(*lead, n), ndim=len(lead) + 1)
    check_tensor(op, "comb", comb, dtypes=_STREAM_DTYPES, shape=(*lead, n, n), ndim=len(lead) + 2)
    check_tensor(op, "out", out, dtypes=(streams.dtype,), shape=(*lead, d), ndim=len(lead) + 1)
    check_devices(op, streams=streams, post=post, comb=comb, out=out)


def _check_hc_post(post, comb, out, streams) -> None:
    _check_posted("hc_post", post, comb, out, streams)


def _hc_post_fake(post, comb, out, streams):
    return streams.new_empty(streams.shape)


def _hc_post_cuda(post, comb, out, streams):
    if streams.shape[-2] > kernels.MAX_HC_N:
        return ref.hc_post(post, comb, out, streams)
    return kernels.launch_hc_post(post, comb, out, streams)


@dsv4_op("hc_post", check=_check_hc_post, fake=_hc_post_fake, cuda=_hc_post_cuda if HAS_TRITON else None)
def hc_post(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The hyper-connection after a block (the decoder layer's mix): ``post [..., N]``,
    ``comb [..., N, N]``, the block's ``out [..., D]``, ``streams [..., N, D]`` -> the next streams
    ``post ⊗ out + combᵀ @ streams`` ``[..., N, D]`` in ``streams``' dtype (a new tensor)."""
    return ref.hc_post(post, comb, out, streams)


def _check_hc_post_pre(post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight=None,
                       out_norm_eps=0.0) -> None:
    _check_posted("hc_post_pre", post, comb, out, streams)
    n = streams.shape[-2]
    _check_weights("hc_post_pre", streams, fn, base, scale, (2 + n) * n, 3, hc_eps, norm_eps)
    check_positive("hc_post_pre", "iters", iters)
    _check_out_norm("hc_post_pre", streams, out_norm_weight, out_norm_eps)


def _hc_post_pre_fake(post, comb, out, streams, *pre_args):
    return (streams.new_empty(streams.shape), *_hc_pre_fake(streams, *pre_args))


def _hc_post_pre_cuda(post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight=None,
                      out_norm_eps=0.0):
    if streams.shape[-2] > kernels.MAX_HC_N:
        return _hc_post_pre_reference(post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps,
                                      out_norm_weight, out_norm_eps)
    return kernels.launch_hc_pre(streams, fn, base, scale, iters, hc_eps, norm_eps, posted=(post, comb, out),
                                 out_norm=(out_norm_weight, out_norm_eps))


def _hc_post_pre_reference(post, comb, out, streams, *pre_args):
    new = ref.hc_post(post, comb, out, streams)
    return (new, *ref.hc_pre(new, *pre_args))


@dsv4_op("hc_post_pre", check=_check_hc_post_pre, fake=_hc_post_pre_fake,
         cuda=_hc_post_pre_cuda if HAS_TRITON else None)
def hc_post_pre(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor, fn: torch.Tensor,
                base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float, norm_eps: float,
                out_norm_weight: torch.Tensor | None = None,
                out_norm_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_post(post, comb, out, streams)`` followed by ``hc_pre`` of its result with the next
    hyper-connection's ``fn``, ``base``, ``scale``, ``iters``, ``hc_eps``, ``norm_eps`` and the next
    block's ``out_norm_weight``, ``out_norm_eps`` (arguments as those two ops) -> ``new_streams
    [..., N, D]`` (``streams``' dtype), then ``hc_pre``'s ``post``, ``comb`` and ``collapsed``; equal
    to the two ops called in turn."""
    return _hc_post_pre_reference(post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps,
                                  out_norm_weight, out_norm_eps)
