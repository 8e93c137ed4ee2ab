"""Rotate a layer's attention output back inside the attention: ``dsv4::sparse_attn_inverse_rope``
in place of ``sparse_attn``, and the output projection's own inverse RoPE dropped.

A layer's attention output ``out [T, H, 512]`` goes, reshaped to ``[T, G, H 512 / G]``, to the
grouped ``o_a_proj`` as ``dsv4.grouped_linear(x, w, positions, inv_freq, 512)``, which rotates each
head's last 64 dims back by its row's position before the product: on CUDA a ``rope_tail`` launch
between the attention's split combine and the product. The pass asks the attention for its output
already rotated back (``sparse_attn_inverse_rope``: the rotation inside the combine) and calls
``grouped_linear`` without positions: one launch less a layer at decode sizes (where the
attention splits its key lists), the same launches elsewhere (the rotation then runs after the
attention instead of before the product). The values are the same to the bit.

Matched in Dynamo's graph (:meth:`FuseAttentionInverseRopePass.apply_pre_grad`, which
:func:`~dsv4_compile.compile.compile_step` installs; a graph compiled without that stage keeps the
two rotations apart): a ``grouped_linear`` call with positions and a head dim of 512 whose ``x`` is
a reshape, read by nothing else, of the output of a ``sparse_attn`` call, read by nothing else, to
as many rows; the attention's query on one of ``devices`` (CUDA by default: elsewhere the ops are
the same math), and the positions and RoPE table defined before the attention.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import ops  # noqa: F401  (registers dsv4::sparse_attn_inverse_rope)
from ..config import HEAD_DIM, ROPE_DIM
from .base import OnDevicesPass, call_arguments, op_calls, traced_value

_ATTN = torch.ops.dsv4.sparse_attn
_GROUPED = torch.ops.dsv4.grouped_linear
_FUSED = torch.ops.dsv4.sparse_attn_inverse_rope.default
_ATTN_ARGS = tuple(a.name for a in _ATTN.default._schema.arguments)
_ROTATION_ARGS = ("positions", "inv_freq")


class FuseAttentionInverseRopePass(OnDevicesPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        """Nothing post-grad: the pattern is matched in Dynamo's graph only."""
        return 0

    def apply_pre_grad(self, graph: torch.fx.Graph) -> int:
        order = {node: i for i, node in enumerate(graph.nodes)}
        matches = 0
        for product in op_calls(graph, _GROUPED):
            attn = self._fusable_attention(product, order)
            if attn is None:
                continue
            g = call_arguments(product, _GROUPED)
            a = call_arguments(attn, _ATTN)
            with graph.inserting_before(attn):
                fused = graph.call_function(_FUSED, (*(a[name] for name in _ATTN_ARGS),
                                                     *(g[name] for name in _ROTATION_ARGS)))
            fused.meta.update(attn.meta)  # the same values: (out, lse)
            attn.replace_all_uses_with(fused)
            graph.erase_node(attn)
            _without_rotation(product)
            matches += 1
        return matches

    def _fusable_attention(self, product: torch.fx.Node, order: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
        """The ``sparse_attn`` call whose output ``product`` (a ``grouped_linear`` call) rotates back
        when the pass may move the rotation into it, else None."""
        g = call_arguments(product, _GROUPED)
        x, positions, inv_freq = g["x"], g["positions"], g["inv_freq"]
        if positions is None or g["head_dim"] != HEAD_DIM or not _reshape_read_once(x):
            return None
        out = x.args[0]
        if not (isinstance(out, torch.fx.Node) and out.target is operator.getitem and out.args[1] == 0
                and len(out.users) == 1):
            return None
        attn = out.args[0]
        if not (isinstance(attn, torch.fx.Node) and attn.target in (_ATTN, _ATTN.default)):
            return None
        q, out_val, x_val = traced_value(call_arguments(attn, _ATTN)["q"]), traced_value(out), traced_value(x)
        if not (isinstance(q, torch.Tensor) and q.device.type in self.devices and isinstance(out_val, torch.Tensor)
                and isinstance(x_val, torch.Tensor) and statically_known_true(x_val.shape[0] == out_val.shape[0])):
            return None
        if not all(isinstance(t, torch.fx.Node) and order[t] < order[attn] for t in (positions, inv_freq)):
            return None
        # what sparse_attn_inverse_rope's check takes (grouped_linear takes any power-of-two table)
        table, at = traced_value(inv_freq), traced_value(positions)
        if not (isinstance(table, torch.Tensor) and table.dtype == torch.float32
                and tuple(table.shape) == (ROPE_DIM // 2,)
                and isinstance(at, torch.Tensor) and at.dtype in (torch.int32, torch.int64)):
            return None
        return attn


def _reshape_read_once(x: object) -> bool:
    """Whether ``x`` is a reshape (or view) of a node, read by one node."""
    if not (isinstance(x, torch.fx.Node) and len(x.users) == 1 and x.args and isinstance(x.args[0], torch.fx.Node)):
        return False
    return ((x.op == "call_method" and x.target in ("reshape", "view"))
            or (x.op == "call_function" and x.target is torch.reshape))


def _without_rotation(product: torch.fx.Node) -> None:
    """``product`` (a ``grouped_linear`` call) with its positions and RoPE table set to None."""
    names = [a.name for a in _GROUPED.default._schema.arguments]
    args = list(product.args)
    kwargs = dict(product.kwargs)
    for name in _ROTATION_ARGS:
        if name in kwargs:
            kwargs[name] = None
        elif names.index(name) < len(args):
            args[names.index(name)] = None
    product.args, product.kwargs = tuple(args), kwargs
