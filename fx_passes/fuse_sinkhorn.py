"""Fuse the mHC Sinkhorn-Knopp loop into one ``dsv4::sinkhorn`` node.

transformers' ``DeepseekV4HyperConnection`` normalises its comb weights ``[..., N, N]`` fp32 with
``iters`` Sinkhorn-Knopp iterations, which trace to ``2 iters - 1`` steps
``y = div(x, add(sum(x, [d], keepdim=True), eps))``: a column step (d = -2), then ``iters - 1``
(row, column) pairs (d = -1, -2). Inductor cannot fuse a reduction over rows with the next one
over columns, so the loop runs as a string of tiny kernels, two loops per decoder layer (about
104 kernels per decode step of 4 layers on the H200). The pass replaces each chain by
``dsv4.sinkhorn(x, iters, eps)``, one kernel on CUDA, with the same formula (results agree to the
fp32 rounding of the sums).

A chain is the maximal run of steps in which each feeds only the next one (the last step's
output may have any users). It is replaced only when it is exactly column, (row, column) x k,
with one eps throughout, on fp32 tensors whose last two dims are static and equal; any other
chain (row first, an eps that changes, a step that does not end on a column) is left as it is.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from .. import ops  # noqa: F401  (registers dsv4::sinkhorn)
from .base import DSV4InductorPass, fake_result

_aten = torch.ops.aten
_SINKHORN = torch.ops.dsv4.sinkhorn.default
_ROW, _COL = -1, -2  # the dim a step sums over, counted from the end


class _Step(NamedTuple):
    """One normalisation ``div = x / (sum + eps)``, ``sum = x.sum(axis, keepdim=True)``."""
    x: torch.fx.Node
    axis: int  # _ROW or _COL
    eps: float
    sum: torch.fx.Node
    add: torch.fx.Node
    div: torch.fx.Node


class FuseSinkhornPass(DSV4InductorPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        steps = {div: step for div in graph.find_nodes(op="call_function", target=_aten.div.Tensor)
                 if (step := _as_step(div)) is not None}
        following = {}  # step -> the step its output feeds, and nothing else
        for step in steps.values():
            prev = steps.get(step.x)
            if prev is not None and set(prev.div.users) == {step.sum, step.div}:
                following[prev] = step
        inside = set(following.values())
        matches = 0
        for start in steps.values():
            if start in inside:
                continue
            chain = [start]
            while chain[-1] in following:
                chain.append(following[chain[-1]])
            if _is_sinkhorn(chain):
                _replace(graph, chain)
                matches += 1
        return matches


def _as_step(div: torch.fx.Node) -> _Step | None:
    """``div`` as a normalisation step of an fp32 ``[..., N, N]`` tensor with static N, or None.
    The sum and the add must feed only this division (so the chain can be removed)."""
    if div.kwargs or len(div.args) != 2:
        return None
    x, add = div.args
    if not (isinstance(add, torch.fx.Node) and add.target in (_aten.add.Tensor, _aten.add.Scalar)
            and not add.kwargs and len(add.users) == 1):
        return None
    total, eps = add.args
    if not (isinstance(total, torch.fx.Node) and total.target is _aten.sum.dim_IntList and len(total.users) == 1
            and total.args[0] is x and isinstance(eps, numbers.Real) and not isinstance(eps, bool)):
        return None
    dims = total.args[1]
    keepdim = total.args[2] if len(total.args) > 2 else total.kwargs.get("keepdim", False)
    if keepdim is not True or set(total.kwargs) - {"keepdim"} or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return None
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.dtype == torch.float32 and val.dim() >= 2):
        return None
    n, m = val.shape[-2:]
    if not (type(n) is int and type(m) is int and n == m):  # static: comparing a SymInt would add a guard
        return None
    axis = dims[0] % val.dim() - val.dim()
    return _Step(x, axis, float(eps), total, add, div) if axis in (_ROW, _COL) else None


def _is_sinkhorn(chain: list[_Step]) -> bool:
    """Column, then (row, column) pairs, with one eps (>= 0, as the op requires)."""
    axes = [s.axis for s in chain]
    return (len(chain) % 2 == 1 and axes == [_COL if i % 2 == 0 else _ROW for i in range(len(chain))]
            and len({s.eps for s in chain}) == 1 and chain[0].eps >= 0)


def _replace(graph: torch.fx.Graph, chain: list[_Step]) -> None:
    last = chain[-1]
    args = (chain[0].x, (len(chain) + 1) // 2, chain[0].eps)
    with graph.inserting_before(last.div):
        fused = graph.call_function(_SINKHORN, args)
        fused.meta["val"] = fake_result(_SINKHORN, args)
    last.div.replace_all_uses_with(fused)
    for step in reversed(chain):
        for node in (step.div, step.add, step.sum):
            graph.erase_node(node)
