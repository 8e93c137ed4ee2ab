"""Linear maps of a decode step's few rows: ``dsv4::linears`` and ``dsv4::grouped_linear``.

The model does not call the op: a compiled step gets it from ``FuseSharedInputLinearsPass``
(``fx_passes/fuse_shared_input_linears.py``), which replaces the bf16 matmuls of one activation by
weights of the graph (a layer's q / kv / compressor / indexer projections of the normed hidden
state) by one call, and can fold an RMSNorm that only those products read into it (the query
latent's ``q_a_norm``; opt-in). On CUDA a call with at most 64 rows is one Triton launch
(``ops/kernels/linear.py``, up to 8 weights a launch); more rows, and other devices, run each
product as ``torch.mm``.

``dsv4::grouped_linear`` is a block-diagonal (grouped) linear map, the attention's ``o_a_proj``
(``transformers``' ``DeepseekV4GroupedLinear``: a ``bmm`` over groups). The attention layers call
it directly (its output is contiguous, where the module's is a transposed ``bmm`` whose reshape
depends on whether there is one row); ``FuseGroupedLinearPass`` (``fx_passes/fuse_grouped_linear.py``)
puts it in place of the module's ``bmm`` where the module is called as it is. On CUDA up to 64
rows it is one Triton launch over every group's column tiles, where cuBLAS runs a split-K GEMV and
a reduction kernel (or, from 17 rows, a GEMM and a copy of its transposed output).

Shape legend: M rows, K input features (per group for ``grouped_linear``), N_g output features of
weight g, G groups of N outputs each.
"""

from __future__ import annotations

import torch

from ..reference import functional as ref
from ._checks import INDEX_DTYPES, check_devices, check_inv_freq, check_tensor
from ._library import HAS_TRITON, dsv4_op

if HAS_TRITON:
    from .kernels import linear as kernels
    from .kernels import norm_rope as rope_kernels

DTYPES = (torch.bfloat16, torch.float16)  # what the kernels compute
# grouped_linear takes fp32 too (a stack of fp32 weights calls it): the reference's bmm on every device
GROUPED_DTYPES = (*DTYPES, torch.float32)


def _check_linears(x, weights, norm_weight=None, eps=0.0) -> None:
    check_tensor("linears", "x", x, dtypes=DTYPES, ndim=2)
    if not weights:
        raise ValueError("dsv4.linears: weights must hold at least one tensor")
    for g, w in enumerate(weights):
        check_tensor("linears", f"weights[{g}]", w, dtypes=(x.dtype,), ndim=2, shape=(None, x.shape[1]))
    if norm_weight is not None:
        check_tensor("linears", "norm_weight", norm_weight, dtypes=(torch.float32, x.dtype), ndim=1,
                     shape=(x.shape[1],))
    if not eps >= 0:
        raise ValueError(f"dsv4.linears: eps must be >= 0, got {eps}")
    check_devices("linears", x=x, norm_weight=norm_weight, **{f"weights[{g}]": w for g, w in enumerate(weights)})


def _linears_fake(x, weights, norm_weight=None, eps=0.0):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights]


def _linears_cuda(x, weights, norm_weight=None, eps=0.0):
    if x.shape[0] > kernels.MAX_ROWS:
        return linears_reference(x, weights, norm_weight, eps)
    step = kernels.MAX_WEIGHTS  # a launch's pointer arguments
    return [out for i in range(0, len(weights), step)
            for out in kernels.launch_linears(x, list(weights[i:i + step]), norm_weight=norm_weight, eps=eps)]


def linears_reference(x: torch.Tensor, weights: list[torch.Tensor], norm_weight: torch.Tensor | None = None,
                      eps: float = 0.0) -> list[torch.Tensor]:
    """The products ``linears`` stands for, as ``torch.mm`` calls (after the norm's torch ops)."""
    if norm_weight is not None:
        x = ref.rms_norm(x, norm_weight, eps)
    return [torch.mm(x, w.t()) for w in weights]


@dsv4_op("linears", check=_check_linears, fake=_linears_fake, cuda=_linears_cuda if HAS_TRITON else None)
def linears(x: torch.Tensor, weights: list[torch.Tensor], norm_weight: torch.Tensor | None = None,
            eps: float = 0.0) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]``: ``x [M, K]`` bf16 / fp16, each ``w [N_g, K]`` of x's dtype
    (at least one) -> ``[M, N_g]`` each, x's dtype.

    With ``norm_weight [K]`` (fp32 or x's dtype) the products are of x RMS-normed first,
    ``rms_norm(x, norm_weight, eps)`` (``dsv4::rms_norm``'s math): a layer's query latent, normed
    and then projected by ``q_b_proj`` (and the indexer's ``q_b_proj``). The kernel folds the norm
    into its K loop (one launch where the norm was one of its own); its rounding then falls on
    ``x * norm_weight`` before the product and on the product after the row's scale, where the
    reference rounds the normed row (the outputs agree to a rounding of the output dtype)."""
    return linears_reference(x, weights, norm_weight, eps)


def _check_grouped_linear(x, w, positions=None, inv_freq=None, head_dim=0) -> None:
    check_tensor("grouped_linear", "x", x, dtypes=GROUPED_DTYPES, ndim=3)
    check_tensor("grouped_linear", "w", w, dtypes=(x.dtype,), ndim=2, shape=(None, x.shape[2]))
    if w.shape[0] % x.shape[1]:
        raise ValueError(f"dsv4.grouped_linear: w has {w.shape[0]} rows, not a multiple of the "
                         f"{x.shape[1]} groups of x")
    if (positions is None) != (inv_freq is None):
        raise ValueError("dsv4.grouped_linear: positions and inv_freq are given together (the inverse RoPE) "
                         "or not at all")
    tensors = {"x": x, "w": w}
    if positions is not None:
        check_tensor("grouped_linear", "positions", positions, dtypes=INDEX_DTYPES, ndim=1, shape=(x.shape[0],))
        if head_dim <= 0 or x.shape[2] % head_dim:
            raise ValueError(f"dsv4.grouped_linear: head_dim={head_dim} must be positive and divide x's "
                             f"{x.shape[2]} features per group")
        check_inv_freq("grouped_linear", _heads(x, head_dim), inv_freq, power_of_two=True)
        tensors.update(positions=positions, inv_freq=inv_freq)
    check_devices("grouped_linear", **tensors)


def _grouped_linear_fake(x, w, positions=None, inv_freq=None, head_dim=0):
    return x.new_empty(x.shape[0], x.shape[1], w.shape[0] // x.shape[1])


def _grouped_linear_cuda(x, w, positions=None, inv_freq=None, head_dim=0):
    if positions is not None:  # the inverse RoPE's kernel, then the product
        x = rope_kernels.launch_rope_tail(_heads(x, head_dim), positions.unsqueeze(1), inv_freq,
                                          inverse=True).view(x.shape)
    if x.shape[0] > kernels.MAX_ROWS or x.dtype not in DTYPES:
        return grouped_linear_reference(x, w)
    return kernels.launch_grouped_linear(x, w)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x [M, G, K]`` as ``[M, G K / head_dim, head_dim]``."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2] // head_dim, head_dim)


def grouped_linear_reference(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None,
                             inv_freq: torch.Tensor | None = None, head_dim: int = 0) -> torch.Tensor:
    """The batched product ``transformers``' grouped linear computes (``bmm`` over the groups),
    after the inverse RoPE of each head when ``positions`` are given."""
    if positions is not None:
        x = ref.rope_tail(_heads(x, head_dim), positions.unsqueeze(1), inv_freq, inverse=True).view(x.shape)
    _, groups, k = x.shape
    out = torch.bmm(x.transpose(0, 1), w.reshape(groups, -1, k).transpose(1, 2))
    return out.transpose(0, 1).contiguous()


@dsv4_op("grouped_linear", check=_check_grouped_linear, fake=_grouped_linear_fake,
         cuda=_grouped_linear_cuda if HAS_TRITON else None)
def grouped_linear(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None,
                   inv_freq: torch.Tensor | None = None, head_dim: int = 0) -> torch.Tensor:
    """``out[:, g] = x[:, g] @ w.view(G, N, K)[g].T``: ``x [M, G, K]`` bf16 / fp16 / fp32, ``w [G N, K]``
    of x's dtype -> ``[M, G, N]`` contiguous, x's dtype (fp32: the reference's ``bmm`` on CUDA too).

    With ``positions [M]`` int and ``inv_freq [R / 2]`` fp32 (a power of two), x's heads are rotated
    back first: each group's K features are ``K / head_dim`` heads, and the last R features of each
    head get the inverse RoPE at their row's position, rounded to x's dtype, as
    ``dsv4::rope_tail(x.view(M, -1, head_dim), positions[:, None], inv_freq, inverse=True)`` (an
    attention output before its ``o_a_proj``); on CUDA that op's kernel, then the product's. Rotating
    inside the product's K loop was measured 2.6x slower on the product (docs/perf-log.md)."""
    return grouped_linear_reference(x, w, positions, inv_freq, head_dim)
