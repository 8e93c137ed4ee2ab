"""Compiling a step: the whole stack as one graph, with CUDA graphs and the dsv4 FX passes.

``torch.compile(stack, mode="reduce-overhead", fullgraph=True)`` records one CUDA graph per
distinct input shape and replays it whenever that shape comes back; the step's metadata is
recomputed inside the graph from the step tensors, so nothing else has to be copied, refreshed
or kept per bucket. Padding the request count and the token count up to a few bucket sizes
(``step.REQUEST_BUCKETS`` / ``step.TOKEN_BUCKETS``) keeps the number of recorded graphs small
(SGLang's capture sizes, without its persistent metadata).
"""

from __future__ import annotations

import torch

from .fx_passes import DSV4PassManager


def compile_step(stack: torch.nn.Module, *, cuda_graphs: bool = True, passes: DSV4PassManager | None = None,
                 **kwargs):
    """``torch.compile(stack, fullgraph=True)`` — a whole step as one graph — with CUDA graphs
    (what ``mode="reduce-overhead"`` sets; a no-op on CPU) and ``passes`` installed as Inductor's
    post-grad custom pass: by default a fresh :class:`DSV4PassManager` (every dsv4 pass: the
    metadata chain fused into one op); ``DSV4PassManager([])`` installs none."""
    options = {"triton.cudagraphs": cuda_graphs,
               "post_grad_custom_post_pass": DSV4PassManager() if passes is None else passes}
    return torch.compile(stack, fullgraph=True, options=options, **kwargs)
