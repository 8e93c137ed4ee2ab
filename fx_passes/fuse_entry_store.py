"""Fold a compressor's cache write into the compressor: one ``dsv4::compress_kv_store`` call in
place of ``compress_kv`` then ``store_kv`` / ``store_index_k``.

A compressed layer's compressor (and a c4 layer's indexer compressor) makes one potential entry a
row, ``entries = dsv4.compress_kv(state, ...)``, whose only reader is the write of the compressed
cache: ``dsv4.store_kv(cache, slots, entries, page_size)`` for a ``[T, 512]`` entry (a MODEL1
token), ``dsv4.store_index_k(...)`` for a ``[T, 128]`` indexer key. The fused op's entry kernel
quantises and writes each entry itself, so the entries never go to memory and a compressor has one
launch less (at one row a launch of ~1–2 µs on the critical path: five a step in a model of two
CSA layers and one HCA layer).

Matched, in Dynamo's graph (:meth:`FuseEntryStorePass.apply_pre_grad`, which
:func:`~dsv4_compile.compile.compile_step` installs) and, for a graph compiled without that stage,
in the post-grad graph once :class:`~.inplace_mutations.InplaceMutationsPass` has made the two
in-place calls again (run it after that pass): a write whose key is a ``compress_kv`` call read by
nothing else, with the entry width the write's layout takes, on one of ``devices`` (CUDA by
default: elsewhere the op is the same math), and no node between the two that mutates anything or
reads the compressor's state, directly or through a view of it made earlier (the fused call takes
the write's place, so the state is updated later than it was). The fused call writes what the two wrote, byte for byte on the GPU.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .. import ops  # noqa: F401  (registers dsv4::compress_kv_store)
from ..config import HEAD_DIM, INDEX_HEAD_DIM
from .base import OnDevicesPass, call_arguments, may_mutate, op_calls

_COMPRESS = torch.ops.dsv4.compress_kv
_FUSED = torch.ops.dsv4.compress_kv_store.default
# each write and the entry width of its layout
_WRITES = ((torch.ops.dsv4.store_kv, HEAD_DIM), (torch.ops.dsv4.store_index_k, INDEX_HEAD_DIM))


class FuseEntryStorePass(OnDevicesPass):
    def apply(self, graph: torch.fx.Graph) -> int:
        return self._fuse(graph, "val")

    def apply_pre_grad(self, graph: torch.fx.Graph) -> int:
        return self._fuse(graph, "example_value")

    def _fuse(self, graph: torch.fx.Graph, key: str) -> int:
        """Replace each fusable pair of ``graph`` (its values in ``meta[key]``); the matches."""
        matches = 0
        for write_op, width in _WRITES:
            for write in op_calls(graph, write_op):
                w = call_arguments(write, write_op)
                c = self._fusable_compress(w["k"], write, width, key)
                if c is None:
                    continue
                with graph.inserting_before(write):
                    fused = graph.call_function(_FUSED, kwargs={
                        "state": c["state"], "cache": w["cache"], "slots": w["slots"],
                        **{name: c[name] for name in _COMPRESS_ARGS}, "page_size": w["page_size"]})
                fused.meta[key] = None
                entries = w["k"]
                graph.erase_node(write)
                graph.erase_node(entries)
                matches += 1
        return matches

    def _fusable_compress(self, entries: object, write: torch.fx.Node, width: int, key: str) -> dict | None:
        """The arguments of the ``compress_kv`` call ``entries`` when ``write`` may absorb it, else None."""
        if not (isinstance(entries, torch.fx.Node) and entries.target in (_COMPRESS, _COMPRESS.default)
                and len(entries.users) == 1):
            return None
        c = call_arguments(entries, _COMPRESS)
        kv, norm_weight = (node.meta.get(key) if isinstance(node, torch.fx.Node) else None
                           for node in (c["kv"], c["norm_weight"]))
        if not (isinstance(kv, torch.Tensor) and isinstance(norm_weight, torch.Tensor)
                and kv.device.type in self.devices and norm_weight.shape == (width,)):
            return None
        state = _storage(c["state"], key)
        node = entries.next
        while node is not write:
            reads_state = c["state"] in node.all_input_nodes or (
                state is not None and any(_storage(i, key) == state for i in node.all_input_nodes))
            if may_mutate(node) or reads_state:
                return None
            node = node.next
        return c


def _storage(node: object, key: str) -> StorageWeakRef | None:
    """The storage of ``node``'s traced value (a view made of the state before the compressor
    shares the state's), or None where it has none."""
    value = node.meta.get(key) if isinstance(node, torch.fx.Node) else None
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


_COMPRESS_ARGS = tuple(a.name for a in _COMPRESS.default._schema.arguments if a.name != "state")

