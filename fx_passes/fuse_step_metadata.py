"""Fuse a step's metadata chain into one ``dsv4::step_metadata`` launch.

``build_step_metadata`` traces five ops — ``expand_queries`` feeding ``build_page_table``,
``build_swa_metadata`` and, when the stack has them, ``build_c4_metadata`` /
``build_c128_metadata``. The fused op returns all of their outputs (the same values, one kernel
on CUDA: 3.1 µs instead of 8.3 µs for b=256 at 8k on the H200). The pass finds each
``expand_queries`` node, collects the chain that consumes its rows, and rewires every output to
the fused op's output of the same field (``metadata_chain.FIELDS`` says where each op's outputs
stand among the fused op's). A chain whose consumers do not have the expected form is left as
it is — e.g. an SWA-only stack, whose unused page table was eliminated before the pass runs.
"""

from __future__ import annotations

import operator

import torch

from .. import metadata_chain
from .. import ops  # noqa: F401  (registers the dsv4:: ops matched here)
from ..metadata_chain import CHAIN_OPS, fused_positions, output_index
from .base import DSV4InductorPass, fake_result, getitem_of

_dsv4 = torch.ops.dsv4
# For each op of the chain: where each of its outputs stands among step_metadata's outputs.
_FUSED_POSITIONS = {getattr(_dsv4, op).default: fused_positions(op) for op in CHAIN_OPS}


def _getitems(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


def _single_user(nodes, target, check) -> torch.fx.Node | None:
    found = [n for n in nodes if n.target is target and check(n)]
    return found[0] if len(found) == 1 else None


class FuseStepMetadataPass(DSV4InductorPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        matches = 0
        for expand in list(graph.find_nodes(op="call_function", target=_dsv4.expand_queries.default)):
            chain = self._chain(expand)
            if chain is not None:
                self._replace(graph, expand, chain)
                matches += 1
        return matches

    def source_of_rewrite(self) -> tuple:
        # the output mapping comes from the field table: a changed table rewrites differently
        return (*super().source_of_rewrite(), metadata_chain)

    @staticmethod
    def _chain(expand: torch.fx.Node):
        """The metadata ops fed by ``expand``: ``{target: node}``, or None if not the expected form."""
        rows = _getitems(expand)
        req_of_row, seq_causal = (rows.get(output_index(name)) for name in ("req_of_row", "seq_lens_causal"))
        if req_of_row is None or seq_causal is None:
            return None
        loc = expand.args[3]
        users = set(req_of_row.users) | set(seq_causal.users)
        page = _single_user(users, _dsv4.build_page_table.default,
                            lambda n: n.args[1:] == (req_of_row, seq_causal))
        swa = _single_user(users, _dsv4.build_swa_metadata.default,
                           lambda n: n.args[2:] == (req_of_row, seq_causal, loc))
        if page is None or swa is None:
            return None
        chain = {page.target: page, swa.target: swa}
        rows = _request_rows(swa.args[0])  # the fused op bounds request rows by req_to_token's rows
        c4 = _single_user(users, _dsv4.build_c4_metadata.default,
                          lambda n: n.args[:3] == (req_of_row, seq_causal, loc) and _same_int(n.args[4], rows))
        c128 = _single_user(users, _dsv4.build_c128_metadata.default,
                            lambda n: n.args[:4] == (page, req_of_row, seq_causal, loc)
                            and _same_int(n.args[4], rows))
        for node in (c4, c128):
            if node is not None:
                chain[node.target] = node
        return chain

    @staticmethod
    def _replace(graph: torch.fx.Graph, expand: torch.fx.Node, chain) -> None:
        page, swa = chain[_dsv4.build_page_table.default], chain[_dsv4.build_swa_metadata.default]
        c4 = chain.get(_dsv4.build_c4_metadata.default)
        topk = c4.args[3] if c4 is not None else 1  # c4 outputs are unused without a c4 node
        req_to_token, full_to_swa = swa.args[0], swa.args[1]
        args = (*expand.args, req_to_token, page.args[0], full_to_swa, topk)
        with graph.inserting_before(expand):
            fused = graph.call_function(_dsv4.step_metadata.default, args)
            fused.meta["val"] = fake_result(_dsv4.step_metadata.default, args)
            outputs = {}  # old output node -> getitem of the fused op
            for node in (expand, *chain.values()):
                positions = _FUSED_POSITIONS[node.target]
                if len(positions) == 1:  # an op with one output: the node itself is that tensor
                    outputs[node] = getitem_of(graph, fused, positions[0])
                    continue
                for i, item in _getitems(node).items():
                    outputs[item] = getitem_of(graph, fused, positions[i])
        for old, new in outputs.items():
            old.replace_all_uses_with(new)
        for old in outputs:
            if old.target is operator.getitem:
                graph.erase_node(old)
        for node in (*reversed(chain.values()), expand):
            graph.erase_node(node)


def _request_rows(req_to_token: torch.fx.Node):
    """The rows R of ``req_to_token`` (an int, or a SymInt under dynamic shapes)."""
    return req_to_token.meta["val"].shape[0]


def _same_int(a, b) -> bool:
    """Whether ``a`` and ``b`` are surely the same integer: equal ints, or the same symbol. Never
    evaluates a symbolic comparison (that would add a guard): anything else is not a match."""
    return a is b or (type(a) is int and type(b) is int and a == b)

