"""The ordered list of dsv4 passes, installed as Inductor's ``post_grad_custom_post_pass`` (and,
through :meth:`DSV4PassManager.pre_grad_stage`, as its ``pre_grad_custom_pass``).

torch 2.11 accepts a single custom pass there, so the manager is that pass and runs its own
list in order; its ``uuid`` combines every pass's uuid (a changed pass invalidates cached graphs).
The default list holds the passes measured to pay on the H200: the metadata fusion, the Sinkhorn
fusion (one hyper-connection 48 -> 10 kernels; 50 -> 16 µs at one token, 66 -> 39 µs at 64:
benchmarks/README.md, "Hyper-connections"), the shared-input linear fusion (the benchmark
model's decode step at b = 1: 1,476 -> 1,295 µs, 312 -> 254 kernels; with lone products of
K >= 4096 12 µs less GPU time a step; the query latent's norm folded into its products, one
launch less a layer, is opt-in until timed), the grouped ``o_a_proj`` as one launch (4 µs a step at
b = 8), the attention output's inverse RoPE moved into the attention (in its split combine: one
launch less a layer at decode sizes), the norm + RoPE fusion (docs/compile.md, "The norm + RoPE
fusion pass") and, after it, the key's cache write folded into its norm + RoPE (one launch less a
layer), the mutating ops called in place where Inductor would call them so (no launch saved:
compile time), and after them each compressor's cache write folded into the compressor (one
launch less a compressor; in Dynamo's graph already when the pre-grad stage runs). Another list
is given by name, e.g. ``DSV4PassManager([FuseStepMetadataPass()])``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .base import DSV4InductorPass, hash_source
from .fuse_attention_inverse_rope import FuseAttentionInverseRopePass
from .fuse_entry_store import FuseEntryStorePass
from .fuse_grouped_linear import FuseGroupedLinearPass
from .fuse_key_store import FuseKeyStorePass
from .fuse_norm_rope import FuseNormRopePass
from .fuse_shared_input_linears import FuseSharedInputLinearsPass
from .fuse_sinkhorn import FuseSinkhornPass
from .fuse_step_metadata import FuseStepMetadataPass
from .inplace_mutations import InplaceMutationsPass


def default_passes(devices: Sequence[str] | None = None) -> list[DSV4InductorPass]:
    """A fresh instance of each default pass, in the order they run. ``devices``: the device types
    the per-device passes rewrite (their default, CUDA, when None); ``("cpu",)`` rewrites a CPU
    graph as a CUDA one is, to test the rewrite or time its compile where there is no GPU."""
    on = {} if devices is None else {"devices": tuple(devices)}
    return [FuseStepMetadataPass(), FuseSinkhornPass(), FuseSharedInputLinearsPass(**on), FuseGroupedLinearPass(**on),
            FuseAttentionInverseRopePass(**on), FuseNormRopePass(**on), FuseKeyStorePass(**on),
            InplaceMutationsPass(**on), FuseEntryStorePass(**on)]


class DSV4PassManager(DSV4InductorPass):
    def __init__(self, passes: list[DSV4InductorPass] | None = None) -> None:
        super().__init__()
        self.passes: list[DSV4InductorPass] = []
        for p in passes if passes is not None else default_passes():
            self.add(p)

    def add(self, p: DSV4InductorPass) -> None:
        if not isinstance(p, DSV4InductorPass):
            raise TypeError(f"expected a DSV4InductorPass, got {type(p).__name__}")
        self.passes.append(p)

    def apply(self, graph: torch.fx.Graph) -> int:
        return self._matches_of(lambda p: p(graph))

    def apply_pre_grad(self, graph: torch.fx.Graph) -> int:
        return self._matches_of(lambda p: p.pre_grad(graph))

    def _matches_of(self, run: Callable[[DSV4InductorPass], None]) -> int:
        """Run each pass in order; the matches they add to their counts."""
        before = sum(p.matched_count for p in self.passes)
        for p in self.passes:
            run(p)
        return sum(p.matched_count for p in self.passes) - before

    def pre_grad_stage(self) -> PreGradStage:
        """The same passes for Inductor's ``pre_grad_custom_pass`` slot."""
        return PreGradStage(self)

    def uuid(self) -> str:
        return hashlib.sha256((hash_source(type(self)) + "".join(p.uuid() for p in self.passes)).encode()
                              ).hexdigest()


class PreGradStage(CustomGraphPass):
    """A manager's passes on Dynamo's graph, before AOTAutograd: each pass's ``apply_pre_grad``,
    in order (docs/compile.md, "FX passes"). Its uuid is the manager's."""

    def __init__(self, manager: DSV4PassManager) -> None:
        self.manager = manager

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.manager.pre_grad(graph)

    def uuid(self) -> str:
        return self.manager.uuid()
