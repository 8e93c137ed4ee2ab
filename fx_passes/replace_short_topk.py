"""Replace each ``aten.topk`` of short rows whose values go unread by ``dsv4::topk_indices``.

A DeepSeek V4 MoE layer with a learned router (``DeepseekV4TopKRouter``) picks its experts with
``torch.topk(scores + bias, k, sorted=False).indices`` over the layer's experts (256 in the released
models, 6 a token). Inductor leaves ``topk`` to ``aten``, whose kernel took 4.7–5.4 µs a call in the
benchmark model's decode step on the H200 (one token, 8 experts), in each of the released models'
40 learned-routed layers a step; ``dsv4::topk_indices`` is one Triton program per row. Not among
the default passes: its kernel has not been timed on the device yet (``bench_ops.py --only
router_topk``; ``bench_model.py --ways compiled_step_graphs,compiled_step_graphs_router_topk``).
Add it with ``DSV4PassManager([*default_passes(), ReplaceShortTopkPass()])``. Its indices come in
descending order of score, which ``sorted=False`` allows and ``sorted=True`` asks for; equal
scores go in column order, where ``aten`` leaves their order unspecified.

Matched: ``topk(x, k, dim, largest=True, ...)`` along the last dim of a 2-D fp32 / bf16 / fp16 ``x``
on one of ``devices`` (CUDA by default), with at most ``TOPK_MAX_COLUMNS`` columns and ``k`` at most
``TOPK_MAX_K``, whose values (output 0) nothing reads.
"""

from __future__ import annotations

import operator

import torch

from .. import ops  # noqa: F401  (registers dsv4::topk_indices)
from ..ops.experts import TOPK_DTYPES, TOPK_MAX_COLUMNS, TOPK_MAX_K
from .base import OnDevicesPass, fake_result

_TOPK = torch.ops.aten.topk.default
_TOPK_INDICES = torch.ops.dsv4.topk_indices.default


class ReplaceShortTopkPass(OnDevicesPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        matches = 0
        for node in list(graph.find_nodes(op="call_function", target=_TOPK)):
            if self._replaceable(node):
                x, k = node.args[:2]
                with graph.inserting_before(node):
                    indices = graph.call_function(_TOPK_INDICES, (x, k))
                indices.meta["val"] = fake_result(_TOPK_INDICES, (x, k))
                for user in list(node.users):
                    user.replace_all_uses_with(indices)
                    graph.erase_node(user)
                graph.erase_node(node)
                matches += 1
        return matches

    def _replaceable(self, node: torch.fx.Node) -> bool:
        x, k = node.args[:2]
        dim, largest = _arg(node, 2, "dim", -1), _arg(node, 3, "largest", True)
        xv = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if not (isinstance(xv, torch.Tensor) and xv.dim() == 2 and xv.dtype in TOPK_DTYPES
                and xv.device.type in self.devices and isinstance(k, int) and largest is True and dim in (-1, 1)):
            return False
        columns = xv.shape[1]
        if not (isinstance(columns, int) and 1 <= k <= min(columns, TOPK_MAX_K) and columns <= TOPK_MAX_COLUMNS):
            return False
        # the values unread: every user takes the indices
        return all(u.target is operator.getitem and u.args[1] == 1 for u in node.users)

    def settings(self) -> tuple:
        return (*super().settings(), TOPK_MAX_COLUMNS, TOPK_MAX_K)


def _arg(node: torch.fx.Node, position: int, name: str, default):
    """Argument ``name`` of ``node``, given by position or keyword, else its default."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)
