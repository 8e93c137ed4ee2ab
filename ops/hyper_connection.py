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
* ``dsv4::hc_pre_linears``, ``dsv4::hc_post_pre_linears``, ``dsv4::hc_head_linears``: ``hc_pre``,
  ``hc_post_pre`` and ``hc_head`` with the products of their collapse (``dsv4::linears``' weights),
  as the two ops in turn. ``FuseCollapseLinearsPass`` (``fx_passes/fuse_collapse_linears.py``)
  puts them where a collapse feeds a ``linears`` call. On CUDA at one token they are the
  projection's launch and the products' launch: each product program sums the projection's
  partials and collapses its own K blocks, and one more program beside the products writes
  ``post`` and the Sinkhorn-normalised ``comb``, so the collapse's finishing launch (the Sinkhorn
  steps on its critical path) is gone.
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
from .linear import _check_linears, _linears_cuda, _linears_fake, linears_reference

if HAS_TRITON:
    from .kernels import hyper_connection as kernels
    from .kernels import linear as linear_kernels

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


def _check_pre(op: str, x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight, out_norm_eps) -> None:
    n, _ = _check_streams(op, x)
    _check_weights(op, x, fn, base, scale, (2 + n) * n, 3, hc_eps, norm_eps)
    check_positive(op, "iters", iters)
    _check_out_norm(op, x, out_norm_weight, out_norm_eps)


def _check_hc_pre(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight=None, out_norm_eps=0.0) -> None:
    _check_pre("hc_pre", x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight, out_norm_eps)


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


def _check_head(op: str, x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps) -> None:
    n, _ = _check_streams(op, x)
    _check_weights(op, x, fn, base, scale, n, 1, hc_eps, norm_eps)
    _check_out_norm(op, x, out_norm_weight, out_norm_eps)


def _check_hc_head(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight=None, out_norm_eps=0.0) -> None:
    _check_head("hc_head", x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps)


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


def _check_post_pre(op: str, post, comb, out, streams, *pre_args) -> None:
    _check_posted(op, post, comb, out, streams)
    _check_pre(op, streams, *pre_args)


def _check_hc_post_pre(post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight=None,
                       out_norm_eps=0.0) -> None:
    _check_post_pre("hc_post_pre", post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps,
                    out_norm_weight, out_norm_eps)


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


# -- a collapse and its products ---------------------------------------------------------------------
def _rows(collapsed: torch.Tensor) -> torch.Tensor:
    """``collapsed [..., D]`` as the ``[M, D]`` rows its products read."""
    return collapsed.reshape(-1, collapsed.shape[-1])


def _check_products(op: str, collapsed_like: torch.Tensor, weights) -> None:
    """``weights`` as ``dsv4::linears`` takes them for an input of ``collapsed_like``'s dtype and
    last dim (the collapse the products read)."""
    try:
        _check_linears(_rows(collapsed_like), weights)
    except (TypeError, ValueError) as error:
        raise type(error)(str(error).replace("dsv4.linears: x", f"dsv4.{op}: the collapse").replace(
            "dsv4.linears", f"dsv4.{op}")) from None


def _check_hc_pre_linears(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight, out_norm_eps, weights):
    _check_pre("hc_pre_linears", x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight, out_norm_eps)
    _check_products("hc_pre_linears", x[..., 0, :], weights)


def _check_hc_post_pre_linears(post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight,
                               out_norm_eps, weights):
    _check_post_pre("hc_post_pre_linears", post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps,
                    out_norm_weight, out_norm_eps)
    _check_products("hc_post_pre_linears", out, weights)


def _check_hc_head_linears(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps, weights):
    _check_head("hc_head_linears", x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps)
    _check_products("hc_head_linears", x[..., 0, :], weights)


def _products_fake(collapsed: torch.Tensor, weights) -> list[torch.Tensor]:
    return _linears_fake(_rows(collapsed), weights)


def _collapse_fits(streams: torch.Tensor, weights, posted: bool = False) -> bool:
    """Whether the products' launch makes the collapse itself (else the two ops run in turn): up to
    ``COLLAPSE_MAX_TOKENS`` tokens (``posted``: and as many as the projection makes new streams for)
    and a launch that splits K, whose programs each run few K blocks (a launch of whole-K programs
    ran several times slower with the collapse in its loop: docs/perf-log.md)."""
    n, d = streams.shape[-2:]
    tokens = streams.numel() // (n * d) if n * d else 0
    most = linear_kernels.COLLAPSE_MAX_TOKENS
    if posted:
        most = min(most, kernels.POSTED_MAX_TOKENS)
    if not (1 <= tokens <= most and n <= kernels.MAX_HC_N and d > 0
            and streams.dtype in (torch.bfloat16, torch.float16) and len(weights) <= linear_kernels.MAX_WEIGHTS):
        return False
    return linear_kernels.default_config(d, sum(w.shape[0] for w in weights), tokens)[1]


def _collapse_linears_cuda(streams, fn, base, scale, iters, hc_eps, norm_eps, out_norm, weights, posted=None,
                           head=False) -> list[torch.Tensor]:
    """The fused launches: ``[new_streams,] [post, comb,] collapsed`` in the hc op's shapes, then the
    products."""
    n, d = streams.shape[-2:]
    lead = streams.shape[:-2]
    xs = streams.contiguous().view(-1, n * d)
    partials = kernels.mix_partials(xs, fn.contiguous(), n, d, posted, out_norm[0] is not None,
                                    trigger_dependents=True)
    outs = linear_kernels.launch_linears(None, list(weights), collapse=linear_kernels.Collapse(
        partials, base, scale, iters, hc_eps, norm_eps, out_norm, head))
    hc = outs[:len(outs) - len(weights)]
    shapes = [(*lead, d)] if head else [(*lead, n), (*lead, n, n), (*lead, d)]
    hc = [t.view(shape) for t, shape in zip(hc, shapes, strict=True)]
    new = [partials.streams.view(streams.shape)] if posted is not None else []
    return new + hc + outs[len(hc):]


def _hc_pre_linears_fake(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight, out_norm_eps, weights):
    post, comb, collapsed = _hc_pre_fake(x, fn, base, scale, iters, hc_eps, norm_eps)
    return post, comb, collapsed, _products_fake(collapsed, weights)


def _hc_pre_linears_cuda(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight, out_norm_eps, weights):
    if not _collapse_fits(x, weights):
        post, comb, collapsed = _hc_pre_cuda(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight,
                                             out_norm_eps)
        return post, comb, collapsed, _linears_cuda(_rows(collapsed), weights)
    post, comb, collapsed, *products = _collapse_linears_cuda(x, fn, base, scale, iters, hc_eps, norm_eps,
                                                              (out_norm_weight, out_norm_eps), weights)
    return post, comb, collapsed, products


@dsv4_op("hc_pre_linears", check=_check_hc_pre_linears, fake=_hc_pre_linears_fake,
         cuda=_hc_pre_linears_cuda if HAS_TRITON else None)
def hc_pre_linears(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                   hc_eps: float, norm_eps: float, out_norm_weight: torch.Tensor | None, out_norm_eps: float,
                   weights: list[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``hc_pre(x, fn, ..., out_norm_eps)`` -> ``(post, comb, collapsed)``, then ``linears(collapsed
    [M, D], weights)`` (M the tokens of ``x``'s leading dims): ``(post, comb, collapsed, products)``,
    equal to the two ops in turn."""
    post, comb, collapsed = ref.hc_pre(x, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight, out_norm_eps)
    return post, comb, collapsed, linears_reference(_rows(collapsed), weights)


def _hc_post_pre_linears_fake(post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight,
                              out_norm_eps, weights):
    new, post, comb, collapsed = _hc_post_pre_fake(post, comb, out, streams, fn, base, scale, iters, hc_eps,
                                                   norm_eps)
    return new, post, comb, collapsed, _products_fake(collapsed, weights)


def _hc_post_pre_linears_cuda(post, comb, out, streams, fn, base, scale, iters, hc_eps, norm_eps, out_norm_weight,
                              out_norm_eps, weights):
    if not _collapse_fits(streams, weights, posted=True):
        new, post, comb, collapsed = _hc_post_pre_cuda(post, comb, out, streams, fn, base, scale, iters, hc_eps,
                                                       norm_eps, out_norm_weight, out_norm_eps)
        return new, post, comb, collapsed, _linears_cuda(_rows(collapsed), weights)
    new, post, comb, collapsed, *products = _collapse_linears_cuda(
        streams, fn, base, scale, iters, hc_eps, norm_eps, (out_norm_weight, out_norm_eps), weights,
        posted=(post, comb, out))
    return new, post, comb, collapsed, products


@dsv4_op("hc_post_pre_linears", check=_check_hc_post_pre_linears, fake=_hc_post_pre_linears_fake,
         cuda=_hc_post_pre_linears_cuda if HAS_TRITON else None)
def hc_post_pre_linears(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor,
                        fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
                        norm_eps: float, out_norm_weight: torch.Tensor | None, out_norm_eps: float,
                        weights: list[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``hc_post_pre(post, comb, out, streams, fn, ..., out_norm_eps)`` -> ``(new_streams, post, comb,
    collapsed)``, then ``linears(collapsed [M, D], weights)``: ``(new_streams, post, comb, collapsed,
    products)``, equal to the two ops in turn."""
    new, post, comb, collapsed = _hc_post_pre_reference(post, comb, out, streams, fn, base, scale, iters, hc_eps,
                                                        norm_eps, out_norm_weight, out_norm_eps)
    return new, post, comb, collapsed, linears_reference(_rows(collapsed), weights)


def _hc_head_linears_fake(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps, weights):
    collapsed = _hc_head_fake(x, fn, base, scale, hc_eps, norm_eps)
    return collapsed, _products_fake(collapsed, weights)


def _hc_head_linears_cuda(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps, weights):
    if not _collapse_fits(x, weights):
        collapsed = _hc_head_cuda(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps)
        return collapsed, _linears_cuda(_rows(collapsed), weights)
    collapsed, *products = _collapse_linears_cuda(x, fn, base, scale, 0, hc_eps, norm_eps,
                                                  (out_norm_weight, out_norm_eps), weights, head=True)
    return collapsed, products


@dsv4_op("hc_head_linears", check=_check_hc_head_linears, fake=_hc_head_linears_fake,
         cuda=_hc_head_linears_cuda if HAS_TRITON else None)
def hc_head_linears(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                    norm_eps: float, out_norm_weight: torch.Tensor | None, out_norm_eps: float,
                    weights: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``hc_head(x, fn, ..., out_norm_eps)`` -> ``collapsed``, then ``linears(collapsed [M, D],
    weights)`` (the model's final collapse and its lm_head): ``(collapsed, products)``, equal to the
    two ops in turn."""
    collapsed = ref.hc_head(x, fn, base, scale, hc_eps, norm_eps, out_norm_weight, out_norm_eps)
    return collapsed, linears_reference(_rows(collapsed), weights)
