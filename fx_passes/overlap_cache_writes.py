"""Run a step's cache writes on the side stream, beside the products that do not wait for them.

A layer's key write (``rms_norm_rope_store_kv``) and compressor writes (``compress_kv_store``)
read the hidden state's projections only; at a decode step's few rows they are one- or
two-program kernels of 1-3 µs each, launched between the query's projections (which stream tens
of MiB of weights) and the attention. Each write call gets ``side_stream=True`` (the op forks onto
the device's side stream, ``ops/side_stream.py``) and moves up to just after the last node it
must follow, and a ``dsv4::join_side_stream`` goes before the first node that must follow the
writes. Between the two the main stream runs the query's products, and a CUDA graph of the step
holds the writes as a branch beside them.

Rewritten (post-grad; in-place calls, so after :class:`~.inplace_mutations.InplaceMutationsPass`
and the fusions that make the writes): each in-place call of a ``dsv4::`` op with a
``side_stream`` argument (not set yet) whose written buffers are on one of ``devices`` (CUDA by
default: elsewhere nothing runs on a second stream).

* It moves up past every node it does not depend on, stopping after the latest producer of its
  arguments, any node that may write a tensor (writes keep their order, and nothing moves above
  a write of what it reads) and any reader of a buffer it writes.
* Its join goes before the first later node that reads or writes a buffer it writes, writes a
  tensor at all (``dsv4::`` ops: one it reads), or is the output, not counting the other side
  writes (the side stream runs them in order); a buffer read or written through a view counts as
  the buffer. Writes sharing that node share one join. The join declares the written buffers
  written (their readers follow it in Inductor's schedule) and reads the writes' other inputs made
  in the graph (none of them is freed or reused while the side stream may read it) and the inputs
  of that first node: Inductor schedules a node as early as its inputs allow, and a join that read
  the writes' inputs alone would follow them at once, before the work it is meant to overlap.
"""

from __future__ import annotations

import torch

from .. import ops  # noqa: F401  (registers dsv4::join_side_stream and the side-stream flags)
from .base import OnDevicesPass, call_arguments, may_mutate, memory_of, readers

_JOIN = torch.ops.dsv4.join_side_stream.default
_FLAG = "side_stream"


class OverlapCacheWritesPass(OnDevicesPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        writes = [node for node in graph.nodes if self._is_write(node)]
        for write in writes:
            _move_up(graph, write)
            _set_flag(write)
        joins: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        side = set(writes)
        for write in writes:
            joins.setdefault(_first_to_follow(write, side), []).append(write)
        for before, joined in joins.items():
            written = _unique(b for w in joined for b in _written(w))
            kept = _unique(a for n in (*joined, before) for a in n.all_input_nodes
                           if a.op not in ("placeholder", "get_attr") and a not in written)
            with graph.inserting_before(before):
                join = graph.call_function(_JOIN, (written, kept))
            join.meta["val"] = None
        return len(writes)

    def _is_write(self, node: torch.fx.Node) -> bool:
        """An in-place call of a side-stream op, its flag unset, writing buffers on ``devices``."""
        if not (_is_dsv4_call(node) and any(a.name == _FLAG for a in node.target._schema.arguments)
                and not call_arguments(node, node.target)[_FLAG]):
            return False
        written = _written(node)
        return bool(written) and all(isinstance(v := w.meta.get("val"), torch.Tensor) and v.device.type in self.devices
                                     for w in written)


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes an in-place ``dsv4::`` call writes (its schema's mutated arguments)."""
    named = call_arguments(node, node.target)
    out = []
    for a in node.target._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            value = named.get(a.name)
            out += [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.fx.Node)]
    return out


def _set_flag(node: torch.fx.Node) -> None:
    names = [a.name for a in node.target._schema.arguments]
    if len(node.args) > names.index(_FLAG):
        node.update_arg(names.index(_FLAG), True)
    else:
        node.update_kwarg(_FLAG, True)


def _move_up(graph: torch.fx.Graph, write: torch.fx.Node) -> None:
    """Put ``write`` right after the last node above it that it must follow: an input, a write, a
    view of what it writes or a reader of it (:func:`~.base.readers`: where Inductor runs the read)."""
    inputs, written = set(write.all_input_nodes), memory_of(_written(write))
    read = readers(_written(write), exclude={write})
    node = write.prev
    while node.op != "root" and not (node in inputs or node.op == "placeholder" or may_mutate(node)
                                     or written.intersection(node.all_input_nodes) or node in read):
        node = node.prev
    if node is not write.prev:
        node.append(write)


def _first_to_follow(write: torch.fx.Node, side: set[torch.fx.Node]) -> torch.fx.Node:
    """The first node after ``write`` that must wait for it: a reader or writer of what it writes,
    a writer of what it reads (any write but a ``dsv4::`` op's that names its buffers), or the
    output, through views too; the writes in ``side`` run after it on the same stream and need no
    join."""
    written, inputs = memory_of(_written(write)), memory_of(write.all_input_nodes)
    node = write.next
    while node.op != "output":
        if node in side:
            node = node.next
            continue
        if written.intersection(node.all_input_nodes):
            return node
        if may_mutate(node):
            mine = _written(node) if _is_dsv4_call(node) else None
            if mine is None or inputs.intersection(memory_of(mine)):
                return node
        node = node.next
    return node


def _is_dsv4_call(node: torch.fx.Node) -> bool:
    op = node.target
    return node.op == "call_function" and isinstance(op, torch._ops.OpOverload) and op.namespace == "dsv4"


def _unique(nodes) -> list[torch.fx.Node]:
    return list(dict.fromkeys(nodes))
