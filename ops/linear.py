"""Several linear maps of one input: ``dsv4::linears``.

The model does not call the op: a compiled step gets it from ``FuseSharedInputLinearsPass``
(``fx_passes/fuse_shared_input_linears.py``), which replaces the bf16 matmuls of one activation by
weights of the graph (a layer's q / kv / compressor / indexer projections of the normed hidden
state) by one call. On CUDA a call with at most 16 rows is one Triton launch
(``ops/kernels/linear.py``, up to 8 weights a launch); more rows, and other devices, run each
product as ``torch.mm``.

Shape legend: M rows, K input features, N_g output features of weight g.
"""

from __future__ import annotations

import torch

from ._checks import check_devices, check_tensor
from ._library import HAS_TRITON, dsv4_op

if HAS_TRITON:
    from .kernels import linear as kernels

DTYPES = (torch.bfloat16, torch.float16)


def _check_linears(x, weights) -> None:
    check_tensor("linears", "x", x, dtypes=DTYPES, ndim=2)
    if not weights:
        raise ValueError("dsv4.linears: weights must hold at least one tensor")
    for g, w in enumerate(weights):
        check_tensor("linears", f"weights[{g}]", w, dtypes=(x.dtype,), ndim=2, shape=(None, x.shape[1]))
    check_devices("linears", x=x, **{f"weights[{g}]": w for g, w in enumerate(weights)})


def _linears_fake(x, weights):
    return [x.new_empty(x.shape[0], w.shape[0]) for w in weights]


def _linears_cuda(x, weights):
    if x.shape[0] > kernels.MAX_ROWS:
        return [torch.mm(x, w.t()) for w in weights]
    step = kernels.MAX_WEIGHTS  # a launch's pointer arguments
    return [out for i in range(0, len(weights), step) for out in kernels.launch_linears(x, list(weights[i:i + step]))]


@dsv4_op("linears", check=_check_linears, fake=_linears_fake, cuda=_linears_cuda if HAS_TRITON else None)
def linears(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """``[x @ w.T for w in weights]``: ``x [M, K]`` bf16 / fp16, each ``w [N_g, K]`` of x's dtype
    (at least one) -> ``[M, N_g]`` each, x's dtype."""
    return [torch.mm(x, w.t()) for w in weights]
