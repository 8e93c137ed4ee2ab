"""Fold a layer's key norm + RoPE into the cache write that reads it: one
``dsv4::rms_norm_rope_store_kv`` node in place of ``rms_norm_rope`` then ``store_kv``.

After ``FuseNormRopePass`` a layer's key is ``k = dsv4.rms_norm_rope(kv, ...)`` and its only reader
is the write of the sliding-window cache, ``dsv4.store_kv(cache, slots, k, page_size)`` (the
attention reads the key back from the cache). The fused op norms, rotates, quantises and writes
each key in one program, so the bf16 key never goes to memory and a layer has one launch less.

Matched, in the post-grad graph: an ``auto_functionalized_v2`` node of ``dsv4.store_kv`` whose
``k`` is a ``dsv4.rms_norm_rope`` node with no other user, on a ``[T, 512]`` bf16 key with 32
RoPE frequencies (the MODEL1 key: 448 nope + 64 rope dims), on one of ``devices`` (CUDA by
default: elsewhere the op is the same math). The new node keeps the write's mutated base and
bookkeeping arguments, so the cache is updated exactly as before. Run it after ``FuseNormRopePass``.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from .. import ops  # noqa: F401  (registers dsv4::rms_norm_rope_store_kv)
from ..config import HEAD_DIM, ROPE_DIM
from .base import OnDevicesPass

_AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized_v2
_STORE_KV = torch.ops.dsv4.store_kv.default
_NORM_ROPE = torch.ops.dsv4.rms_norm_rope.default
_FUSED = torch.ops.dsv4.rms_norm_rope_store_kv.default
_NORM_ROPE_ARGS = ("x", "weight", "eps", "round_scale", "positions", "inv_freq")


class FuseKeyStorePass(OnDevicesPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        matches = 0
        for write in list(graph.find_nodes(op="call_function", target=_AUTO_FUNCTIONALIZED)):
            if write.args[0] is _STORE_KV and (key := self._fusable_key(write.kwargs["k"])) is not None:
                _replace(graph, write, key)
                matches += 1
        return matches

    def _fusable_key(self, k: object) -> torch.fx.Node | None:
        """``k`` when it is an ``rms_norm_rope`` node the write can absorb, else None."""
        if not (isinstance(k, torch.fx.Node) and k.target is _NORM_ROPE and len(k.users) == 1
                and len(k.args) == len(_NORM_ROPE_ARGS) and not k.kwargs):
            return None
        x, inv_freq = k.args[0].meta.get("val"), k.args[5].meta.get("val")
        return k if (isinstance(x, torch.Tensor) and isinstance(inv_freq, torch.Tensor)
                     and x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[1] == HEAD_DIM
                     and tuple(inv_freq.shape) == (ROPE_DIM // 2,) and x.device.type in self.devices) else None



def _replace(graph: torch.fx.Graph, write: torch.fx.Node, key: torch.fx.Node) -> None:
    """One ``auto_functionalized_v2(rms_norm_rope_store_kv, ...)`` in place of ``write``: the key's
    arguments, the write's own (slots, page size) and its bookkeeping (``_``-prefixed: the
    mutated cache's base)."""
    kwargs = {"slots": write.kwargs["slots"], **dict(zip(_NORM_ROPE_ARGS, key.args)),
              "page_size": write.kwargs["page_size"],
              **{name: value for name, value in write.kwargs.items() if name.startswith("_")}}
    with graph.inserting_before(write):
        fused = graph.call_function(_AUTO_FUNCTIONALIZED, (_FUSED,), kwargs)
    fused.meta.update(write.meta)  # the same outputs: no value, the updated cache
    if "eager_input_vals" in write.meta:  # what Inductor's decomposition of the node traces with
        _, eager_kwargs = write.meta["eager_input_vals"]
        fused.meta["eager_input_vals"] = ((_FUSED,), {
            **{name: pytree.tree_map(_value, value) for name, value in kwargs.items() if name in eager_kwargs},
            **{name: _value(key.args[i]) for i, name in enumerate(_NORM_ROPE_ARGS)}})
    write.replace_all_uses_with(fused)
    graph.erase_node(write)
    graph.erase_node(key)


def _value(arg: object) -> object:
    """What ``arg`` holds when the graph runs: a node's fake value, anything else itself."""
    return arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg
