"""Fuse each RMSNorm + RoPE chain of a layer into one ``dsv4::rms_norm_rope`` node.

A DeepSeek V4 layer norms its query per head and its key, then rotates the last 64 dims of each
(``rope_tail``). Compiled as written, each chain is a reduction kernel and a pointwise kernel
(the query's took 18 µs at 8 tokens x 64 heads on the H200); the op is one launch.

Matched with Inductor's pattern matcher, on patterns traced from the code they stand for: the
norms of ``transformers``' DeepSeek V4 (``DeepseekV4RMSNorm``, weighted, and
``DeepseekV4UnweightedRMSNorm``, whose scale is rounded to the input's dtype; only once that code
is imported: a graph cannot hold code that never was, and importing ``transformers`` costs seconds
a compile) and this package's ``reference.functional.rms_norm`` (weighted or not), each followed
by ``rope_tail`` at per-token positions, on a ``[T, D]`` key or a ``[T, H, D]`` query. The matcher
re-traces each candidate at its real shapes before replacing it, so slice bounds, reduction dims
and dtypes must agree; a norm or rotation written otherwise is left as it is. Only chains on one
of ``devices`` (CUDA by default: elsewhere the op is the same math) with bf16 / fp16 rows are
replaced.

This package's own layers call the norm and RoPE as ops (``dsv4::rms_norm``, ``dsv4::rope_tail``),
which AOTAutograd decomposes into the same math. Their chains are fused before that, in Dynamo's
graph (:meth:`FuseNormRopePass.apply_pre_grad`): one node for two there, and none of the two dozen
aten nodes the decomposition would make for AOTAutograd to trace, Inductor to propagate fake
tensors through and the matcher to search. The post-grad matcher then finds what is written out
(``transformers``' norms, graphs traced without the pre-grad stage).

Compile time: the patterns are traced once per process (per devices, with or without
``transformers``' norms), and within one graph a re-trace is reused by every candidate of the same
function at the same argument shapes, dtypes and strides (a stack's layers repeat a handful of
chains: 86 candidates, 0.16 s a trace on the CPU, in the 43-layer Flash stack).
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.utils._pytree as pytree
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, register_replacement
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import ops  # noqa: F401  (registers dsv4::rms_norm_rope)
from ..ops.norm_rope import DTYPES
from ..reference.functional import rms_norm, rope_tail
from .base import OnDevicesPass, call_arguments, op_calls, traced_value

_EPS = 1e-6  # traced value of the norms' eps; the pattern takes any (scalar_workaround)
_HF_MODULE = "transformers.models.deepseek_v4.modeling_deepseek_v4"
# traces of the graph being rewritten, by function and argument signature (None outside a rewrite)
_graph_traces: dict | None = None
_NORM_OP, _ROPE_OP = torch.ops.dsv4.rms_norm, torch.ops.dsv4.rope_tail
_FUSED = torch.ops.dsv4.rms_norm_rope.default


def _trace(fn, args, **kwargs) -> torch.fx.GraphModule:
    """``fwd_only`` with the trace's views stated as reshapes: tracing real tensors turns the
    RoPE's ``unflatten`` / ``flatten`` into views, Dynamo's graphs hold them as reshapes. While a
    graph is rewritten, a trace of the same function at the same signature is copied, not redone."""
    key = None if _graph_traces is None else _trace_key(fn, args, kwargs)
    if key is None or key not in _graph_traces:
        gm = fwd_only(fn, args, **kwargs)
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
            node.target = torch.ops.aten.reshape.default
        gm.recompile()
        if key is None:
            return gm
        _graph_traces[key] = gm
    return _copy(_graph_traces[key])  # the matcher renames a trace's placeholders in place


def _trace_key(fn, args, kwargs) -> tuple:
    """What a trace depends on: the function's code and the functions it closes over (the matcher
    wraps a search function in a fresh closure per candidate), the arguments' shapes, strides,
    dtypes and devices (symbolic sizes by expression), other arguments by value."""
    closure = tuple(c.cell_contents for c in fn.__closure__ or () if callable(c.cell_contents))
    leaves = [_signature(v) for v in pytree.tree_leaves((args, kwargs))]
    return (fn.__code__, closure, tuple(leaves))


def _signature(value) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(map(str, value.shape)), tuple(map(str, value.stride())), value.dtype,
                value.device, value.requires_grad)
    if isinstance(value, torch.SymInt):
        return ("symint", str(value.node.expr))
    return ("value", value if isinstance(value, (bool, int, float, str, type(None))) else id(value))


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def _at_tokens(positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Positions broadcast over a query's heads, as the layers pass them."""
    return positions if x.dim() == 2 else positions.unsqueeze(1)


def _search_functions(with_hf: bool):
    """(search function, weighted, round_scale) of every matched chain; ``transformers``' norms
    when ``with_hf``."""
    def weighted(x, weight, positions, inv_freq, eps):
        return rope_tail(rms_norm(x, weight, eps), _at_tokens(positions, x), inv_freq)

    def unweighted(x, positions, inv_freq, eps):
        return rope_tail(rms_norm(x, None, eps), _at_tokens(positions, x), inv_freq)

    ours = [(weighted, True, False), (unweighted, False, False)]
    if not with_hf:
        return ours
    hf = sys.modules[_HF_MODULE]

    def hf_weighted(x, weight, positions, inv_freq, eps):
        norm = types.SimpleNamespace(weight=weight, variance_epsilon=eps)
        return rope_tail(hf.DeepseekV4RMSNorm.forward(norm, x), _at_tokens(positions, x), inv_freq)

    def hf_unweighted(x, positions, inv_freq, eps):
        norm = types.SimpleNamespace(eps=eps)
        return rope_tail(hf.DeepseekV4UnweightedRMSNorm.forward(norm, x), _at_tokens(positions, x), inv_freq)

    return [(hf_weighted, True, False), (hf_unweighted, False, True), *ours]


def _replacement(weighted: bool, round_scale: bool):
    if weighted:
        def replace(x, weight, positions, inv_freq, eps):
            return torch.ops.dsv4.rms_norm_rope(x, weight, eps, False, positions, inv_freq)
    else:
        def replace(x, positions, inv_freq, eps):
            return torch.ops.dsv4.rms_norm_rope(x, None, eps, round_scale, positions, inv_freq)
    return replace


def _example_inputs(rows: tuple[int, ...], weighted: bool, weight_dtype: torch.dtype) -> list:
    x = torch.empty(*rows, 128, dtype=torch.bfloat16)
    positions, inv_freq = torch.empty(rows[0], dtype=torch.int64), torch.empty(32)
    return [x, torch.empty(128, dtype=weight_dtype), positions, inv_freq] if weighted else [x, positions, inv_freq]


@functools.cache
def _patterns(devices: tuple[str, ...], with_hf: bool) -> PatternMatcherPass:
    """Every chain's pattern, replaced on ``devices`` only (traced once per process)."""
    patterns = PatternMatcherPass(pass_name="dsv4_fuse_norm_rope")
    for search, weighted, round_scale in _search_functions(with_hf):
        # fp32 weights (transformers keeps its norms' in fp32) and weights of x's dtype trace
        # differently (a cast), so each is a pattern; so are keys [T, D] and queries [T, H, D]
        for weight_dtype in (torch.float32, torch.bfloat16) if weighted else (None,):
            for rows in ((2, 3), (2,)):  # queries first: a key pattern would take a query's
                # positions.unsqueeze(1) for its positions and fail its re-trace
                register_replacement(search, _replacement(weighted, round_scale),
                                     _example_inputs(rows, weighted, weight_dtype), _trace, [patterns],
                                     extra_check=functools.partial(_on_devices, devices),
                                     scalar_workaround={"eps": _EPS}, skip_duplicates=True)
    return patterns


def _on_devices(devices: tuple[str, ...], match: Match) -> bool:
    x, positions, inv_freq = (match.kwargs[name].meta.get("val") for name in ("x", "positions", "inv_freq"))
    return (isinstance(x, torch.Tensor) and x.device.type in devices
            and _fusable_values(x, positions, inv_freq))


def _fusable_values(x: object, positions: object, inv_freq: object) -> bool:
    """Whether ``rms_norm_rope`` takes these traced values (its check, ``ops/norm_rope.py``): x of
    a kernel dtype, one integer position per token, a power-of-two count of fp32 frequencies
    for at most x's last dim (a chain outside that, valid in eager, is left as it is)."""
    return (isinstance(x, torch.Tensor) and x.dtype in DTYPES and isinstance(positions, torch.Tensor)
            and positions.dtype in (torch.int32, torch.int64) and positions.dim() == 1
            and statically_known_true(positions.shape[0] == x.shape[0])
            and isinstance(inv_freq, torch.Tensor) and inv_freq.dtype == torch.float32 and inv_freq.dim() == 1
            and _power_of_two(inv_freq.shape[0]) and 2 * inv_freq.shape[0] <= x.shape[-1])


def _power_of_two(n: object) -> bool:
    return isinstance(n, int) and n > 0 and not n & (n - 1)


def _device_of(node: torch.fx.Node) -> str | None:
    val = node.meta.get("val")
    return val.device.type if isinstance(val, torch.Tensor) else None


class FuseNormRopePass(OnDevicesPass):
    def apply_pre_grad(self, graph: torch.fx.Graph) -> int:
        """``rope_tail(rms_norm(x, weight, eps), positions, inv_freq)`` calls in Dynamo's graph,
        the norm read by the rotation alone, on the forms the post-grad patterns match (a key
        ``[T, D]`` at ``positions [T]``, a query ``[T, H, D]`` at ``positions.unsqueeze(1)``):
        one ``rms_norm_rope`` call each."""
        matches = 0
        for rope in op_calls(graph, _ROPE_OP):
            chain = self._fusable_chain(rope)
            if chain is None:
                continue
            args, inputs = chain
            with graph.inserting_before(rope):
                fused = graph.call_function(_FUSED, args)
            fused.meta.update(rope.meta)  # the same value: x's shape and dtype, contiguous
            rope.replace_all_uses_with(fused)
            graph.erase_node(rope)
            for node in inputs:  # the norm, and the query's unsqueezed positions unless read elsewhere
                if not node.users:
                    graph.erase_node(node)
            matches += 1
        return matches

    def _fusable_chain(self, rope: torch.fx.Node) -> tuple[tuple, list[torch.fx.Node]] | None:
        """``rms_norm_rope``'s arguments for the chain ending in ``rope`` and the nodes it reads
        that the fused call does not, or None."""
        r = call_arguments(rope, _ROPE_OP)
        norm = r["x"]
        if r["inverse"] is not False or not (isinstance(norm, torch.fx.Node) and len(norm.users) == 1
                                             and norm.target in (_NORM_OP, _NORM_OP.default)):
            return None
        n = call_arguments(norm, _NORM_OP)
        x, positions = traced_value(n["x"]), r["positions"]
        if not (isinstance(x, torch.Tensor) and x.dtype in DTYPES and x.device.type in self.devices
                and x.dim() in (2, 3)):
            return None
        inputs = [norm]
        if x.dim() == 3:  # a query: the token positions broadcast over its heads
            if not (isinstance(positions, torch.fx.Node) and positions.op == "call_method"
                    and positions.target == "unsqueeze" and positions.args[1:] == (1,) and not positions.kwargs):
                return None
            inputs.append(positions)
            positions = positions.args[0]
        if not _fusable_values(x, traced_value(positions), traced_value(r["inv_freq"])):
            return None
        return (n["x"], n["weight"], n["eps"], False, positions, r["inv_freq"]), inputs

    def apply(self, graph: torch.fx.Graph) -> int:
        global _graph_traces
        if not any(_device_of(node) in self.devices for node in graph.nodes):
            return 0  # nothing to replace, and no pattern to trace
        patterns = _patterns(self.devices, _HF_MODULE in sys.modules)
        # a graph with no node a pattern ends in (RoPE's cat) on ``devices`` has nothing to match;
        # the matcher's walk would cost ~0.17 s per layer of a compiled stack (CPU, 43 layers)
        anchors = (node for op, target in patterns.patterns for node in graph.find_nodes(op=op, target=target))
        if not any(_device_of(node) in self.devices for node in anchors):
            return 0
        _graph_traces = {}
        try:
            return patterns.apply(graph)
        finally:
            _graph_traces = None

    def source_of_rewrite(self) -> tuple:
        """The rewrite follows the traced code too: the reference norm and RoPE, and transformers'
        norms when they are imported (and so matched)."""
        from ..reference import functional
        hf = sys.modules.get(_HF_MODULE)
        hf_norms = (hf.DeepseekV4RMSNorm, hf.DeepseekV4UnweightedRMSNorm) if hf is not None else ()
        return (*super().source_of_rewrite(), functional, *hf_norms)
