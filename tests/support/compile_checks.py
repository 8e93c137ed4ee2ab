"""Compile-contract plumbing: a counting backend that keeps the traced FX graphs, fresh compile
state and the graph-break count."""

from __future__ import annotations

import contextlib

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters


class GraphCapture(CompileCounterWithBackend):
    """Counts Dynamo frames / ops like ``CompileCounterWithBackend`` and keeps every graph."""

    def __init__(self, backend: str = "eager"):
        super().__init__(backend)
        self.graphs: list[torch.fx.GraphModule] = []
        self.inputs: list[list] = []  # each graph's inputs at its compile, in placeholder order

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        self.inputs.append(list(example_inputs))
        return super().__call__(gm, example_inputs)

    def dsv4_ops(self, index: int = -1) -> list[str]:
        """Names of the ``dsv4::`` ops called in a captured graph, in order."""
        names = []
        for node in self.graphs[index].graph.nodes:
            name = str(node.target)
            if node.op == "call_function" and name.startswith("dsv4."):
                names.append(name)
        return names


@contextlib.contextmanager
def fresh_compile_state():
    """Reset Dynamo and counters; disable compile caches so every test really compiles."""
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(force_disable_caches=True):
        yield
    torch._dynamo.reset()


def dynamo_graph(fn, *args) -> tuple[torch.fx.GraphModule, list]:
    """Dynamo's graph of ``fn`` at ``args`` (static shapes) and the inputs it takes: what a pass's
    ``apply_pre_grad`` rewrites."""
    capture = GraphCapture("eager")
    with fresh_compile_state():
        torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)(*args)
    return capture.graphs[-1], capture.inputs[-1]


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())

