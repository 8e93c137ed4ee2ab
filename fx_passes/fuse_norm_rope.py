"""Fuse each RMSNorm + RoPE chain of a layer into one ``dsv4::rms_norm_rope`` node.

A DeepSeek V4 layer norms its query per head and its key, then rotates the last 64 dims of each
(``rope_tail``). Compiled as written, each chain is a reduction kernel and a pointwise kernel
(the query's took 18 µs at 8 tokens x 64 heads on the H200); the op is one launch.

Matched with Inductor's pattern matcher, on patterns traced from the code they stand for: the
norms of ``transformers``' DeepSeek V4 (``DeepseekV4RMSNorm``, weighted, and
``DeepseekV4UnweightedRMSNorm``, whose scale is rounded to the input's dtype) and this package's
``reference.functional.rms_norm`` (weighted or not), each followed by ``rope_tail`` at per-token
positions, on a ``[T, D]`` key or a ``[T, H, D]`` query. The matcher re-traces each candidate at
its real shapes before replacing it, so slice bounds, reduction dims and dtypes must agree; a
norm or rotation written otherwise is left as it is. Only chains on one of ``devices`` (CUDA by
default: elsewhere the op is the same math) with bf16 / fp16 rows are replaced.
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, register_replacement

from .. import ops  # noqa: F401  (registers dsv4::rms_norm_rope)
from ..ops.norm_rope import DTYPES
from ..reference.functional import rms_norm, rope_tail
from .base import OnDevicesPass

_EPS = 1e-6  # traced value of the norms' eps; the pattern takes any (scalar_workaround)


def _trace(fn, args, **kwargs) -> torch.fx.GraphModule:
    """``fwd_only`` with the trace's views stated as reshapes: tracing real tensors turns the
    RoPE's ``unflatten`` / ``flatten`` into views, Dynamo's graphs hold them as reshapes."""
    gm = fwd_only(fn, args, **kwargs)
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default
    gm.recompile()
    return gm


def _at_tokens(positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Positions broadcast over a query's heads, as the layers pass them."""
    return positions if x.dim() == 2 else positions.unsqueeze(1)


def _search_functions():
    """(name, search function, weighted, round_scale) of every matched chain."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4RMSNorm,
                                                                      DeepseekV4UnweightedRMSNorm)

    def hf_weighted(x, weight, positions, inv_freq, eps):
        norm = types.SimpleNamespace(weight=weight, variance_epsilon=eps)
        return rope_tail(DeepseekV4RMSNorm.forward(norm, x), _at_tokens(positions, x), inv_freq)

    def hf_unweighted(x, positions, inv_freq, eps):
        norm = types.SimpleNamespace(eps=eps)
        return rope_tail(DeepseekV4UnweightedRMSNorm.forward(norm, x), _at_tokens(positions, x), inv_freq)

    def weighted(x, weight, positions, inv_freq, eps):
        return rope_tail(rms_norm(x, weight, eps), _at_tokens(positions, x), inv_freq)

    def unweighted(x, positions, inv_freq, eps):
        return rope_tail(rms_norm(x, None, eps), _at_tokens(positions, x), inv_freq)

    return [(hf_weighted, True, False), (hf_unweighted, False, True), (weighted, True, False),
            (unweighted, False, False)]


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


class FuseNormRopePass(OnDevicesPass):
    def __init__(self, devices: Sequence[str] = ("cuda",)) -> None:
        super().__init__(devices)
        self._patterns: PatternMatcherPass | None = None  # traced on first use

    def apply(self, graph: torch.fx.Graph) -> int:
        if self._patterns is None:
            self._patterns = self._register()
        # a graph with no node a pattern ends in (RoPE's cat) on ``devices`` has nothing to match;
        # the matcher's walk would cost ~0.17 s per layer of a compiled stack (CPU, 43 layers)
        anchors = (node for op, target in self._patterns.patterns for node in graph.find_nodes(op=op, target=target))
        if not any(self._device_of(node) in self.devices for node in anchors):
            return 0
        return self._patterns.apply(graph)

    @staticmethod
    def _device_of(node: torch.fx.Node) -> str | None:
        val = node.meta.get("val")
        return val.device.type if isinstance(val, torch.Tensor) else None

    def _register(self) -> PatternMatcherPass:
        patterns = PatternMatcherPass(pass_name="dsv4_fuse_norm_rope")
        for search, weighted, round_scale in _search_functions():
            # fp32 weights (transformers keeps its norms' in fp32) and weights of x's dtype trace
            # differently (a cast), so each is a pattern; so are keys [T, D] and queries [T, H, D]
            for weight_dtype in (torch.float32, torch.bfloat16) if weighted else (None,):
                for rows in ((2, 3), (2,)):  # queries first: a key pattern would take a query's
                    # positions.unsqueeze(1) for its positions and fail its re-trace
                    register_replacement(search, _replacement(weighted, round_scale),
                                         _example_inputs(rows, weighted, weight_dtype), _trace, [patterns],
                                         extra_check=self._on_devices, scalar_workaround={"eps": _EPS},
                                         skip_duplicates=True)
        return patterns

    def _on_devices(self, match: Match) -> bool:
        x = match.kwargs["x"].meta.get("val")
        return isinstance(x, torch.Tensor) and x.dtype in DTYPES and x.device.type in self.devices

    def source_of_rewrite(self) -> tuple:
        """The rewrite follows the traced code too: the reference norm and RoPE, and transformers'
        norms."""
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

        from ..reference import functional
        return (*super().source_of_rewrite(), functional, hf.DeepseekV4RMSNorm, hf.DeepseekV4UnweightedRMSNorm)
