"""Fuse the bf16 / fp16 linear maps of one activation into one ``dsv4::linears`` node.

A DeepSeek V4 layer projects its normed hidden state several times: ``q_a_proj`` and ``kv_proj``,
the compressor's ``kv_proj`` and ``gate_proj``, the indexer's own compressor and ``weights_proj``;
after the attention, the router and the shared expert's ``gate_proj`` / ``up_proj``. Each is an
``nn.Linear`` call of the model's own module, which traces to ``mm(x, permute(w, [1, 0]))`` with
``w`` a graph input (the parameter). At a decode step's few rows each is a cuBLAS GEMV bound by
latency rather than bytes (a split-K kernel plus a reduction kernel apiece). The pass replaces the
matmuls of one ``x`` by one ``dsv4.linears(x, [w, ...])`` whose outputs take the matmuls' place:
one launch on CUDA up to 64 rows, the same ``torch.mm`` calls above (the op decides at run time,
so dynamic token counts add no guard).

Matched: two or more ``aten.mm`` of the same 2-D ``x`` by ``permute(w, [1, 0])`` (or ``t(w)``,
as a graph traced without Inductor's decompositions holds it) where ``w`` is a
2-D placeholder of ``x``'s dtype (bf16 / fp16), with ``x`` on one of ``devices`` (CUDA by default:
elsewhere the op is the same matmuls). An ``aten.addmm(b, x, permute(w, [1, 0]))`` (no ``beta`` /
``alpha``) whose ``b`` has the product's shape counts as such a product followed by
``b + product``: Inductor's own patterns make one of a product and the residual added to it (the
attention stack's ``o_b`` product), which cuBLAS then runs as three kernels (a copy, a split-K
GEMV, its reduction). The sum then rounds the product to the output dtype before adding ``b``, as
eager ``b + F.linear(x, w)`` does. An ``addmm`` of a bias (``F.linear(x, w, bias)``: ``b`` one row,
broadcast) is left alone: eager adds the bias inside its one rounding.

A product with no other of its input becomes a ``linears`` node of its own when its K is at
least ``lone_min_k`` (default 4096: ``o_b_proj`` and the ``lm_head``, where the kernel's deep K
loop streams the weight 1-7 µs faster than cuBLAS; at K of 1024 / 2048 — ``q_b_proj``, the shared
expert's ``down_proj`` — cuBLAS is as fast or faster: docs/perf-log.md). Anything else — a
quantised linear (another op), a weight computed in the graph, fp32 matmuls — is left as it is.

Groups are fused in Dynamo's graph already (:meth:`FuseSharedInputLinearsPass.apply_pre_grad`,
the pre-grad stage): two or more bias-free ``F.linear(x, w)`` of one 2-D ``x`` by graph inputs
become the ``linears`` call there, so AOTAutograd traces one node instead of a transpose and a
product each (a 43-layer stack's compile on the CPU: ~2.5 s less of ~31). A lone product, or
one with a bias, is left to the post-grad stage, after Inductor's own patterns.

There too, where ``x`` is a weighted ``dsv4::rms_norm`` that only those products read (a layer's
query latent, ``q_a_norm`` and then ``q_b_proj`` and the indexer's ``q_b_proj``), the norm folds
into the call (``linears(input, weights, norm_weight, eps)``: the kernel norms x's rows in its K
loop) and its launch goes; a lone product of such an x becomes a call too, whatever its K.
Opt-in (``fold_input_norm=True``): not yet timed on a GPU.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import ops  # noqa: F401  (registers dsv4::linears)
from ..ops.linear import DTYPES
from .base import OnDevicesPass, call_arguments, traced_value

_aten = torch.ops.aten
_LINEARS = torch.ops.dsv4.linears.default
_NORMS = (torch.ops.dsv4.rms_norm, torch.ops.dsv4.rms_norm.default)  # as Dynamo's graph records the op
_RESHAPES = (_aten.reshape.default, _aten.view.default, _aten._unsafe_view.default)


LONE_MIN_K = 4096


class FuseSharedInputLinearsPass(OnDevicesPass):
    def __init__(self, devices: Sequence[str] = ("cuda",), lone_min_k: int | None = LONE_MIN_K,
                 fold_input_norm: bool = False) -> None:
        """``lone_min_k=None``: products with no other of their input are left as they are.
        ``fold_input_norm=True``: an input's weighted ``dsv4::rms_norm`` folds into its products'
        call (opt-in until measured on the GPU)."""
        super().__init__(devices)
        self.lone_min_k, self.fold_input_norm = lone_min_k, fold_input_norm

    def apply(self, graph: torch.fx.Graph) -> int:
        by_input: dict[object, list[tuple[torch.fx.Node, torch.fx.Node]]] = defaultdict(list)  # (product, w)
        order = {node: i for i, node in enumerate(graph.nodes)}
        products = [*graph.find_nodes(op="call_function", target=_aten.mm.default),
                    *graph.find_nodes(op="call_function", target=_aten.addmm.default)]
        for product in sorted(products, key=order.__getitem__):
            if (w := self._weight_of(product)) is not None:
                by_input[_input_key(_operands(product)[1])].append((product, w))
        matches = 0
        for group in by_input.values():
            if len(group) >= 2 or self._lone(group[0][1]):  # the first product's x is defined before every other
                nodes, weights = map(list, zip(*group))
                _replace(graph, _operands(nodes[0])[1], nodes, weights)
                matches += 1
        return matches

    def apply_pre_grad(self, graph: torch.fx.Graph) -> int:
        """The same groups in Dynamo's graph, before AOTAutograd: two or more ``F.linear(x, w)``
        (no bias, or ``bias=None``) of one 2-D ``x`` by placeholder weights ``w`` become one
        ``linears`` call, so AOTAutograd traces one node instead of a transpose and a product each.
        Lone products are left to :meth:`apply` (Inductor's own post-grad patterns, e.g. ``addmm``,
        run first there)."""
        by_input: dict[torch.fx.Node, list[tuple[torch.fx.Node, torch.fx.Node]]] = defaultdict(list)
        for lin in graph.find_nodes(op="call_function", target=torch._C._nn.linear):  # graph order
            if (w := self._pre_grad_weight_of(lin)) is not None:
                by_input[lin.args[0]].append((lin, w))
        matches = 0
        for x, group in by_input.items():
            lins, weights = map(list, zip(*group))
            norm = self._folded_norm(x, lins)
            if len(group) >= 2 or norm is not None:
                _replace(graph, x, lins, weights, key="example_value", norm=norm)
                matches += 1
        return matches

    def _folded_norm(self, x: torch.fx.Node, lins: list[torch.fx.Node]) -> tuple | None:
        """``(input, weight, eps)`` of ``x = dsv4.rms_norm(input, weight, eps)`` when the norm
        folds into the products ``lins`` of x: folding is on, the norm has a weight, and nothing
        but those products reads x (a lone product too: the kernel then saves the norm's launch).
        Else None."""
        if not (self.fold_input_norm and x.op == "call_function" and x.target in _NORMS):
            return None
        args = call_arguments(x, torch.ops.dsv4.rms_norm)
        if args["weight"] is None or set(x.users) != set(lins):
            return None
        return args["x"], args["weight"], args["eps"]

    def _pre_grad_weight_of(self, lin: torch.fx.Node) -> torch.fx.Node | None:
        """The placeholder ``w`` of ``F.linear(x, w)`` (no bias) in Dynamo's graph when the
        product qualifies, else None."""
        if lin.kwargs or lin.args[2:] not in ((), (None,)):
            return None
        x, w = lin.args[:2]
        if not (isinstance(w, torch.fx.Node) and w.op == "placeholder"):
            return None
        xv, wv = traced_value(x), traced_value(w)
        if not (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)):
            return None
        ok = (xv.dim() == 2 and wv.dim() == 2 and xv.dtype in DTYPES and wv.dtype == xv.dtype
              and xv.device.type in self.devices and wv.device == xv.device)
        return w if ok else None

    def _lone(self, w: torch.fx.Node) -> bool:
        """Whether a product by ``w`` with no other of its input goes to the kernel."""
        return self.lone_min_k is not None and w.meta["val"].shape[1] >= self.lone_min_k

    def _weight_of(self, product: torch.fx.Node) -> torch.fx.Node | None:
        """The placeholder ``w`` of ``mm(x, permute(w, [1, 0]))`` (or ``t(w)``, or the same
        ``addmm`` with a ``b`` first) when the product qualifies, else None."""
        operands = _operands(product)
        if product.kwargs or len(operands) != 3:
            return None
        b, x, wt = operands
        if b is not None and not _is_residual(b, product):
            return None  # a bias: the addmm rounds once where the fused output plus the bias would round twice
        transposed = isinstance(wt, torch.fx.Node) and (
            wt.target is _aten.t.default or (wt.target is _aten.permute.default and list(wt.args[1]) == [1, 0]))
        if not transposed:
            return None
        w = wt.args[0]
        xv, wv = x.meta.get("val"), w.meta.get("val") if isinstance(w, torch.fx.Node) else None
        if not (w.op == "placeholder" and isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor)):
            return None
        ok = (xv.dim() == 2 and wv.dim() == 2 and xv.dtype in DTYPES and wv.dtype == xv.dtype
              and xv.device.type in self.devices and wv.device == xv.device)
        return w if ok else None

    def settings(self) -> tuple:
        return (*super().settings(), self.lone_min_k, self.fold_input_norm)


def _operands(product: torch.fx.Node) -> tuple:
    """``(b or None, x, wᵀ)`` of ``mm(x, wᵀ)`` / ``addmm(b, x, wᵀ)``."""
    return (None, *product.args) if product.target is _aten.mm.default else tuple(product.args)


def _is_residual(b: object, product: torch.fx.Node) -> bool:
    """Whether ``addmm``'s ``b`` is a residual (``r + x @ wᵀ``, which Inductor folds into the
    ``addmm``; eager rounds the product, then the sum): ``b`` of the product's own shape and dtype.
    A bias (``F.linear``'s, broadcast over the rows) is added inside eager's one ``addmm``."""
    bv, pv = getattr(b, "meta", {}).get("val"), product.meta.get("val")
    return (isinstance(bv, torch.Tensor) and isinstance(pv, torch.Tensor) and bv.dtype == pv.dtype
            and bv.dim() == 2 and statically_known_true(bv.shape[0] == pv.shape[0])
            and statically_known_true(bv.shape[1] == pv.shape[1]))


def _input_key(x: torch.fx.Node) -> object:
    """What identifies the value of ``x``: ``x`` itself, or for a 2-D reshape ``(source, last
    dim)`` — each ``nn.Linear`` of a 3-D activation flattens it with a reshape of its own
    (``[-1, H]`` or ``[T, H]``), and every 2-D reshape of one source to the same last dim holds the
    same values."""
    if x.target in _RESHAPES and len(x.args) == 2 and len(x.args[1]) == 2 and isinstance(x.args[1][1], int):
        return "reshape", x.args[0], x.args[1][1]
    return x


def _replace(graph: torch.fx.Graph, x: torch.fx.Node, products: list[torch.fx.Node], weights: list[torch.fx.Node],
             key: str = "val", norm: tuple | None = None) -> None:
    """One ``linears`` node before the first of ``products`` (in graph order: ``aten.mm`` /
    ``aten.addmm`` calls post-grad, ``F.linear`` calls in Dynamo's graph); each product's users read
    its output instead (plus its ``b``, for an ``addmm``), taken where the product was. ``key``: the
    meta entry of the graph's values (``"val"``, Dynamo's ``"example_value"``). ``norm = (input,
    weight, eps)``: x is that RMSNorm, which the node takes in its place (and x's node goes)."""
    with graph.inserting_before(products[0]):
        args = (x, weights) if norm is None else (norm[0], weights, *norm[1:])
        fused = graph.call_function(_LINEARS, args)
        fused.meta[key] = [p.meta[key] for p in products]
    for i, product in enumerate(products):
        with graph.inserting_before(product):  # where the product was: an addmm's b may come after the first
            out = graph.call_function(operator.getitem, (fused, i))
            out.meta[key] = product.meta[key]
            if product.target is _aten.addmm.default:
                out = graph.call_function(_aten.add.Tensor, (product.args[0], out))
                out.meta[key] = product.meta[key]
        inputs = product.args
        product.replace_all_uses_with(out)
        graph.erase_node(product)
        for node in inputs:  # the weight's transpose, another product's own reshape of x
            if (isinstance(node, torch.fx.Node) and not node.users
                    and node.target in (*_RESHAPES, _aten.t.default, _aten.permute.default)):
                graph.erase_node(node)
    if norm is not None:
        graph.erase_node(x)