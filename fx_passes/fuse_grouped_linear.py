"""Route a grouped (block-diagonal) linear map's batched product through ``dsv4::grouped_linear``.

The attention's ``o_a_proj`` is ``transformers``' ``DeepseekV4GroupedLinear``: ``x [T, G, K]`` and
the weight ``w [G N, K]`` are viewed as G batches and multiplied by ``bmm``, which traces to::

    bmm(permute(x, [1, 0, 2]), permute(reshape(w, [G, N, K]), [0, 2, 1]))      # [G, T, N]

(``transpose`` in place of ``permute`` in a graph traced without Inductor's decompositions). At a
decode step's few rows cuBLAS runs it as a batched split-K GEMV plus a reduction kernel; the op
is one Triton launch over every group's column tiles up to 64 rows, the same ``bmm`` above (it
decides at run time, so dynamic token counts add no guard). The pass puts
``permute(grouped_linear(x, w), [1, 0, 2])`` in the product's place; the permutes the module
applies after it then compose to the op's own layout.

Matched: ``w`` a 2-D placeholder (the parameter) of ``x``'s dtype (bf16 / fp16), reshaped to
``[G, N, K]`` with G the groups of ``x``, ``x`` on one of ``devices`` (CUDA by default: elsewhere
the op is the same ``bmm``). Anything else is left as it is.
"""

from __future__ import annotations

import torch

from .. import ops  # noqa: F401  (registers dsv4::grouped_linear)
from ..ops.linear import DTYPES
from .base import OnDevicesPass, fake_result

_aten = torch.ops.aten
_GROUPED = torch.ops.dsv4.grouped_linear.default
_RESHAPES = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)


def _swapped(node: object, dims: tuple[int, int, int]) -> torch.fx.Node | None:
    """The source of ``node`` when it is a permute of a 3-D tensor by ``dims`` (or the transpose of
    the two dims that ``dims`` swaps), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is _aten.permute.default and tuple(node.args[1]) == dims:
        return node.args[0]
    if node.target is _aten.transpose.int:
        swap = tuple(i for i in range(3) if dims[i] != i)
        if sorted(d % 3 for d in node.args[1:3]) == list(swap):
            return node.args[0]
    return None


class FuseGroupedLinearPass(OnDevicesPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        matches = 0
        for bmm in list(graph.find_nodes(op="call_function", target=_aten.bmm.default)):
            if (operands := self._operands(bmm)) is not None:
                _replace(graph, bmm, *operands)
                matches += 1
        return matches

    def _operands(self, bmm: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
        """``(x [T, G, K], w [G N, K])`` of a matched grouped product, else None."""
        if bmm.kwargs or len(bmm.args) != 2:
            return None
        x, grouped_w = _swapped(bmm.args[0], (1, 0, 2)), _swapped(bmm.args[1], (0, 2, 1))
        if x is None or grouped_w is None or grouped_w.target not in _RESHAPES:
            return None
        w = grouped_w.args[0]
        if not (isinstance(w, torch.fx.Node) and w.op == "placeholder"):
            return None
        xv, wv, gv = x.meta.get("val"), w.meta.get("val"), grouped_w.meta.get("val")
        if not all(isinstance(v, torch.Tensor) for v in (xv, wv, gv)):
            return None
        ok = (xv.dim() == 3 and wv.dim() == 2 and gv.dim() == 3 and xv.dtype in DTYPES and wv.dtype == xv.dtype
              and xv.device.type in self.devices and wv.device == xv.device
              and gv.shape[0] == xv.shape[1] and gv.shape[2] == xv.shape[2] == wv.shape[1])
        return (x, w) if ok else None



def _replace(graph: torch.fx.Graph, bmm: torch.fx.Node, x: torch.fx.Node, w: torch.fx.Node) -> None:
    """``permute(grouped_linear(x, w), [1, 0, 2])`` in place of ``bmm``; the operands' permutes and
    the weight's reshape go when nothing else reads them."""
    with graph.inserting_before(bmm):
        fused = graph.call_function(_GROUPED, (x, w))
        fused.meta["val"] = fake_result(_GROUPED, (x, w))
        batched = graph.call_function(_aten.permute.default, (fused, [1, 0, 2]))
        batched.meta["val"] = fused.meta["val"].permute(1, 0, 2)
    operands = bmm.args
    bmm.replace_all_uses_with(batched)
    graph.erase_node(bmm)
    for node in operands:
        source = node.args[0]
        if not node.users:
            graph.erase_node(node)
            if source.op == "call_function" and source.target in _RESHAPES and not source.users:
                graph.erase_node(source)
