"""Common base of dsv4 Inductor passes: a ``CustomGraphPass`` whose ``uuid`` is a hash of its
source (so the FX graph cache never reuses a graph a changed pass would rewrite differently),
with a match counter and the list of ``dsv4::`` ops of the graph it produced (for golden tests)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import operator
from collections.abc import Sequence

import torch
import torch.utils._pytree as pytree
from torch._inductor.custom_graph_pass import CustomGraphPass


def hash_source(*objects) -> str:
    """sha256 of the source code of classes / functions / modules."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(_source(obj))
    return h.hexdigest()


@functools.cache
def _source(obj) -> bytes:
    """``obj``'s source, read once a process: Inductor asks each pass for its ``uuid`` on every
    compile, and reading the files again took ~0.4 s of a 43-layer compile."""
    return inspect.getsource(obj).encode()


def fake_result(op: torch._ops.OpOverload, args: tuple):
    """What ``op`` returns on ``args`` as fake tensors: its fake impl run on the ``meta["val"]`` of
    the node arguments, lists of nodes included (the ``meta["val"]`` of a node a pass inserts)."""
    vals = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a, list(args))
    with torch._guards.detect_fake_mode(pytree.tree_leaves(vals)):
        return op(*vals)


def getitem_of(graph: torch.fx.Graph, source: torch.fx.Node, index: int) -> torch.fx.Node:
    """A node ``source[index]`` at the graph's insertion point, its ``meta["val"]`` that of
    ``source``'s (post-grad graphs)."""
    item = graph.call_function(operator.getitem, (source, index))
    item.meta["val"] = source.meta["val"][index]
    return item


def traced_value(arg: object) -> object:
    """What Dynamo traced ``arg`` to (its fake value, in a pre-grad graph), None for anything but a
    node."""
    return arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None


def op_calls(graph: torch.fx.Graph, op: torch._ops.OpOverloadPacket) -> list[torch.fx.Node]:
    """The nodes calling ``op``: Dynamo's graph records the packet, or an overload named; a
    post-grad graph the overload."""
    return [*graph.find_nodes(op="call_function", target=op), *graph.find_nodes(op="call_function", target=op.default)]


def call_arguments(node: torch.fx.Node, op: torch._ops.OpOverloadPacket | torch._ops.OpOverload) -> dict:
    """The arguments of ``node``, a call of ``op`` (a packet: its default overload), by name,
    defaults included."""
    schema = (op.default if isinstance(op, torch._ops.OpOverloadPacket) else op)._schema.arguments
    named = {a.name: a.default_value for a in schema if a.has_default_value()}
    named.update(zip((a.name for a in schema), node.args))
    named.update(node.kwargs)
    return named


_MUTATING_WRAPPERS = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


def may_mutate(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write a tensor: a mutable op, a functionalised one, an in-place method."""
    if node.op == "call_method":
        return node.target.endswith("_")
    if node.op != "call_function":
        return node.op == "call_module"
    target = node.target
    if target in _MUTATING_WRAPPERS:
        return True
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    return getattr(target, "__name__", "").endswith("_")


def memory_of(nodes) -> set[torch.fx.Node]:
    """The nodes through which the memory of ``nodes`` is reached: their bases (up the chains of
    views) and every view of those, transitively."""
    bases = []
    for node in nodes:
        while is_view(node):
            node = node.args[0]
        bases.append(node)
    out: set[torch.fx.Node] = set()
    while bases:
        node = bases.pop()
        if node not in out:
            out.add(node)
            bases += [u for u in node.users if is_view(u)]
    return out


def readers(nodes, exclude=()) -> set[torch.fx.Node]:
    """The nodes that read the memory of ``nodes`` (views of it included: :func:`memory_of`) where
    Inductor runs them, not entering ``exclude``: their users and, through a pointwise op or a view,
    those users' users, transitively. Inductor may inline a pointwise op into its users, so its
    read happens where they run (possibly past a later write to that memory); any other op reads
    where it stands."""
    memory = memory_of(nodes)
    out: set[torch.fx.Node] = set()
    frontier = [u for node in memory for u in node.users if u not in memory]
    while frontier:
        node = frontier.pop()
        if node in out or node in exclude:
            continue
        out.add(node)
        if is_view(node) or _pointwise(node):
            frontier += node.users
    return out


def _pointwise(node: torch.fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags


def is_view(node: object) -> bool:
    """An aten view of its first argument (``_unsafe_view`` too: it shares the memory, though its
    schema does not say so), or an item of a view op that returns several (``split``, ``unbind``,
    ``chunk``: each item shares the memory of the op's input)."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return is_view(node.args[0])
    op = node.target
    return (isinstance(op, torch._ops.OpOverload) and (op.is_view or op is torch.ops.aten._unsafe_view.default)
            and isinstance(node.args[0], torch.fx.Node))


def dsv4_ops(graph: torch.fx.Graph) -> list[str]:
    """The ``dsv4::`` ops called in ``graph``, in order, read from its nodes: ``"dsv4.<op>.<overload>"``,
    with ``" (in place)"`` for a mutating op (which a post-grad graph wraps in
    ``auto_functionalized_v2`` until :class:`InplaceMutationsPass` calls it directly)."""
    names = []
    for node in graph.nodes:
        target, suffix = node.target, ""
        if target is torch.ops.higher_order.auto_functionalized_v2:
            target, suffix = node.args[0], " (in place)"
        elif isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:  # InplaceMutationsPass's
            suffix = " (in place)"
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target.namespace == "dsv4":
            names.append(f"{target}{suffix}")
    return names


class DSV4InductorPass(CustomGraphPass):
    """Subclasses implement :meth:`apply` (rewrite ``graph`` in place, return matches)."""

    def __init__(self) -> None:
        self.matched_count = 0
        self.last_ops: list[str] = []

    def apply(self, graph: torch.fx.Graph) -> int:
        raise NotImplementedError

    def apply_pre_grad(self, graph: torch.fx.Graph) -> int:
        """Rewrite Dynamo's graph, before AOTAutograd decomposes it (Inductor's pre-grad stage);
        return the matches. Most passes rewrite the post-grad graph only: this default does
        nothing. A pass that can find its chains among this package's op calls there spares each
        node it removes AOTAutograd's trace, a fake-tensor propagation and the post-grad search."""
        return 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.matched_count += self.apply(graph)
        graph.lint()
        self.last_ops = dsv4_ops(graph)  # later Inductor passes keep mutating `graph`

    def pre_grad(self, graph: torch.fx.Graph) -> None:
        """:meth:`apply_pre_grad`, its matches counted in :attr:`matched_count` as ``__call__``
        counts :meth:`apply`'s."""
        self.matched_count += self.apply_pre_grad(graph)
        graph.lint()

    def uuid(self) -> str:
        return hash_source(*self.source_of_rewrite())

    def source_of_rewrite(self) -> tuple:
        """What decides how the pass rewrites a graph, hashed into its uuid: the pass's class and
        module, and this module (passes build nodes with its helpers); a pass whose rewrite also
        follows other code adds it."""
        return type(self), inspect.getmodule(type(self)), inspect.getmodule(DSV4InductorPass)


class OnDevicesPass(DSV4InductorPass):
    """A pass that rewrites only nodes on ``devices`` (device types; CUDA by default, where its ops
    are kernels: elsewhere they are the same math). :meth:`settings` (the devices, and whatever a
    subclass adds) goes into the uuid, so a pass configured otherwise keys other cached graphs."""

    def __init__(self, devices: Sequence[str] = ("cuda",)) -> None:
        super().__init__()
        self.devices = tuple(devices)

    def settings(self) -> tuple:
        return (self.devices,)

    def uuid(self) -> str:
        return hashlib.sha256((super().uuid() + repr(self.settings())).encode()).hexdigest()
