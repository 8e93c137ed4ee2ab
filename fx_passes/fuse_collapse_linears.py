"""Make a hyper-connection's collapse in the launch of the products that read it: one
``dsv4::hc_pre_linears`` / ``hc_post_pre_linears`` / ``hc_head_linears`` call in place of the hc op
and the ``dsv4::linears`` call of its collapse.

Each block of the model starts from a collapse of the streams (``hc_pre`` / ``hc_post_pre``,
normalised by the block's input norm) whose main reader is one ``linears`` call: a layer's
projections of its normed hidden state, a learned router's product, the ``lm_head`` after the
final ``hc_head``. On CUDA at one token, where the products' launch splits K, the fused op runs
the projection's launch and then the products' launch, whose programs sum the projection's partials
and collapse their own K blocks of the streams, while one more program writes ``post`` and the
Sinkhorn-normalised ``comb``: the hc op's finishing launch (~5 µs at one token, the 20 Sinkhorn
steps on its critical path) is gone. Elsewhere, and above one token, the op is the two ops' launches in turn.

Matched in the post-grad graph, after :class:`~.fuse_shared_input_linears.FuseSharedInputLinearsPass`
has made the ``linears`` calls (run it after that pass): an hc op call whose collapse (or a 2-D
reshape of it to its last dim, or its select of a size-1 dim) is the input of a ``linears`` call
without a folded norm, on one of ``devices`` (CUDA by default). Where a collapse has several such
readers the first in graph order fuses. Every other reader of the hc op's outputs reads the fused
call's.
"""

from __future__ import annotations

import operator

import torch

from .. import ops  # noqa: F401  (registers the hc ops and their _linears forms)
from .base import OnDevicesPass, call_arguments, fake_result, getitem_of, op_calls

_aten = torch.ops.aten
_LINEARS = torch.ops.dsv4.linears
_RESHAPES = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)
_SELECT = _aten.select.int  # of a size-1 dim (the model's batch of one): the same values, row major
# each hc op, its fused form, the index of the collapse among its outputs
_KINDS = ((torch.ops.dsv4.hc_pre, torch.ops.dsv4.hc_pre_linears.default, 2),
          (torch.ops.dsv4.hc_post_pre, torch.ops.dsv4.hc_post_pre_linears.default, 3),
          (torch.ops.dsv4.hc_head, torch.ops.dsv4.hc_head_linears.default, None))


class FuseCollapseLinearsPass(OnDevicesPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        order = {node: i for i, node in enumerate(graph.nodes)}
        matches = 0
        for hc_op, fused_op, collapse_index in _KINDS:
            for hc in op_calls(graph, hc_op):
                collapsed = _output(hc, collapse_index)
                products = self._first_products(collapsed, order) if collapsed is not None else None
                if products is None:
                    continue
                _fuse(graph, hc, hc_op, fused_op, collapse_index, products)
                matches += 1
        return matches

    def _first_products(self, collapsed: torch.fx.Node, order: dict) -> torch.fx.Node | None:
        """The first ``linears`` call (graph order) whose x is ``collapsed`` or a 2-D reshape of it to
        its last dim, with no folded norm, on one of the devices; None when there is none."""
        value = collapsed.meta.get("val")
        if not (isinstance(value, torch.Tensor) and value.device.type in self.devices):
            return None
        inputs = [collapsed, *(r for r in collapsed.users if _flattens(r, value))]
        calls = [user for x in inputs for user in x.users
                 if user.target in (_LINEARS, _LINEARS.default) and user.args[0] is x
                 and call_arguments(user, _LINEARS)["norm_weight"] is None]
        return min(calls, key=order.__getitem__, default=None)


def _output(hc: torch.fx.Node, index: int | None) -> torch.fx.Node | None:
    """The node of ``hc``'s output ``index`` (``hc`` itself for a single output: ``index`` None)."""
    if index is None:
        return hc
    return next((u for u in hc.users if u.target is operator.getitem and u.args[1] == index), None)


def _flattens(view: torch.fx.Node, value: torch.Tensor) -> bool:
    """Whether ``view`` (a reshape, or a select of a size-1 dim) makes ``value [..., D]`` a ``[M, D]``
    matrix of the same values in the same order."""
    out = view.meta.get("val")
    if view.target is _SELECT:
        if value.shape[view.args[1]] != 1:
            return False
    elif view.target not in _RESHAPES:
        return False
    return (isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[1] == value.shape[-1]
            and out.numel() == value.numel())


def _fuse(graph: torch.fx.Graph, hc: torch.fx.Node, hc_op, fused_op, collapse_index: int | None,
          products: torch.fx.Node) -> None:
    """``fused_op`` before ``hc`` with the hc op's arguments and the products' weights; the readers of
    either node read its outputs; both nodes (and a reshape left unread) go."""
    hc_args = call_arguments(hc, hc_op)
    args = tuple(hc_args[a.name] for a in hc_op.default._schema.arguments) + (products.args[1],)
    hc_outputs = [hc] if collapse_index is None else [u for u in hc.users if u.target is operator.getitem]
    product_outputs = [u for u in products.users if u.target is operator.getitem]
    with graph.inserting_before(hc):
        fused = graph.call_function(fused_op, args)
        fused.meta["val"] = fake_result(fused_op, args)
        listed = getitem_of(graph, fused, len(fused.meta["val"]) - 1)  # the products
        replacements = [(out, getitem_of(graph, fused, 0 if collapse_index is None else out.args[1]))
                        for out in hc_outputs]
        replacements += [(out, getitem_of(graph, listed, out.args[1])) for out in product_outputs]
    for out, node in replacements:
        out.replace_all_uses_with(node)
    for out in product_outputs:
        graph.erase_node(out)
    x = products.args[0]
    graph.erase_node(products)
    if (x.target in _RESHAPES or x.target is _SELECT) and not x.users:
        graph.erase_node(x)
    for out in hc_outputs:
        if out is not hc:
            graph.erase_node(out)
    graph.erase_node(hc)
