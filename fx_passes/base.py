"""Common base of dsv4 Inductor passes: a ``CustomGraphPass`` whose ``uuid`` is a hash of its
source (so the FX graph cache never reuses a graph a changed pass would rewrite differently),
with a match counter and a snapshot of the graph it produced (for golden tests)."""

from __future__ import annotations

import hashlib
import inspect

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


def hash_source(*objects) -> str:
    """sha256 of the source code of classes / functions / modules."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()


class DSV4InductorPass(CustomGraphPass):
    """Subclasses implement :meth:`apply` (rewrite ``graph`` in place, return matches)."""

    def __init__(self) -> None:
        self.matched_count = 0
        self.last_graph: str | None = None

    def apply(self, graph: torch.fx.Graph) -> int:
        raise NotImplementedError

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.matched_count += self.apply(graph)
        graph.lint()
        self.last_graph = str(graph)  # later Inductor passes keep mutating `graph`

    def uuid(self) -> str:
        return hash_source(type(self), inspect.getmodule(type(self)))
