"""Call the mutating ``dsv4::`` ops in place in the post-grad graph, as Inductor would after it.

AOTAutograd wraps each call of a mutating op (the cache writes, ``compress_kv``'s state) in
``auto_functionalized_v2``. Inductor's last post-grad passes decide whether a mutated buffer must
be cloned (``reinplace_inplaceable_ops``) and then decompose every such node by re-tracing it with
``make_fx`` (``decompose_auto_functionalized``): ~14 ms a node on the CPU, 167 nodes and 2.4 s of a
cold compile of the 43-layer Flash stack. A step's mutated buffers are graph inputs that nothing
reads in their old state after the write, so no clone is needed and the decomposition is the op
called on the input itself; this pass writes that graph directly (the same generated code).

Rewritten: a node whose op is a ``dsv4::`` op, each mutated argument a whole base (not a view of
one), each base a placeholder that the graph copies back into (an input mutation) and that nothing
but that write-back reads after the node (directly, through a view, or in a pointwise op that
Inductor may inline into a user after the node: ``base.readers``). The op is called on the
placeholders where the node was; the node's result outputs read the call, its new-base outputs the
placeholders. Anything else is left to Inductor.
"""

from __future__ import annotations

import operator
import torch

from .base import OnDevicesPass, readers

_AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized_v2
_COPY = torch.ops.aten.copy_.default
# the kwargs auto_functionalized_v2 adds for a mutated argument that is a view of its base
_VIEW_KEYS = ("alias", "storage_offset", "size", "stride", "slice_dim")


class InplaceMutationsPass(OnDevicesPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        order = {node: i for i, node in enumerate(graph.nodes)}
        matches = 0
        for node in list(graph.find_nodes(op="call_function", target=_AUTO_FUNCTIONALIZED)):
            plan = self._plan(node, order)
            if plan is not None:
                # the call takes the node's place in the order: a later node's check may meet it
                order[_rewrite(graph, node, *plan)] = order[node]
                matches += 1
        return matches

    def _plan(self, node: torch.fx.Node, order: dict[torch.fx.Node, int]
              ) -> tuple[torch._ops.OpOverload, dict, list[torch.fx.Node]] | None:
        """``(op, its arguments by name, the node's bases)`` when ``node`` can be an in-place call."""
        op = node.args[0] if len(node.args) == 1 else None
        if not (isinstance(op, torch._ops.OpOverload) and op.namespace == "dsv4"):
            return None
        kwargs = dict(node.kwargs)
        bases = kwargs.pop("_all_bases", None)
        mutated = [a for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if not bases or len(bases) != len(mutated):
            return None
        op_kwargs = {a.name: kwargs[a.name] for a in op._schema.arguments if a.name in kwargs}
        for a in mutated:
            index = kwargs.get(f"_{a.name}_base_index")
            if not isinstance(index, int) or any(f"_{a.name}_{k}" in kwargs for k in _VIEW_KEYS):
                return None
            base = bases[index]
            if not (isinstance(base, torch.fx.Node) and base.op == "placeholder" and self._on_devices(base)):
                return None
            write_back = [u for u in base.users if u.target is _COPY and u.args[0] is base]
            # the old value read after the node (in the functional graph every read sees the old bytes)
            read_after = [u for u in readers([base], exclude={node, *write_back})
                          if order.get(u, len(order)) > order[node]]
            if not write_back or read_after:
                return None
            op_kwargs[a.name] = base
        return op, op_kwargs, bases

    def _on_devices(self, node: torch.fx.Node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and val.device.type in self.devices


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, op: torch._ops.OpOverload, op_kwargs: dict,
             bases: list[torch.fx.Node]) -> torch.fx.Node:
    """``op`` called on the bases where ``node`` was; ``node``'s outputs read from it and them.
    ``auto_functionalized_v2`` returns ``(*results, *new bases)``, with one ``None`` result for an
    op that returns nothing."""
    schema = op._schema
    args = tuple(op_kwargs[a.name] if a.name in op_kwargs else a.default_value for a in schema.arguments)
    results = len(schema.returns)
    first_base = max(results, 1)  # the output index of the first new base
    with graph.inserting_before(node):
        call = graph.call_function(op, args)
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)) and results:
        call.meta["val"] = val[0] if results == 1 else tuple(val[:results])
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise AssertionError(f"auto_functionalized_v2 output read by {user.format_node()}")
        i = user.args[1]
        if i >= first_base:
            user.replace_all_uses_with(bases[i - first_base])
        elif results == 1:
            user.replace_all_uses_with(call)
        else:
            user.args = (call, i)
            continue
        graph.erase_node(user)
    graph.erase_node(node)
    return call
