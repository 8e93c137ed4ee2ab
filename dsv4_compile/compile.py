"""Compiling a step: the one piece of graph bookkeeping left — padding a batch to a bucket size.

``torch.compile(stack, mode="reduce-overhead", fullgraph=True)`` records one CUDA graph per
distinct input shape and replays it whenever that shape comes back; the step's metadata is
recomputed inside the graph from the step tensors, so nothing else has to be copied, refreshed
or kept per bucket. Padding the request count and the token count up to a few bucket sizes keeps
the number of recorded graphs small (SGLang's capture sizes, without its persistent metadata).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from .fx_passes import DSV4PassManager

# Request counts (decode) and token counts (verify / extend) a step is padded up to.
REQUEST_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
TOKEN_BUCKETS = REQUEST_BUCKETS + (320, 384, 448, 512, 640, 768, 896, 1024)


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``n`` (``n`` itself past the largest bucket)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def compile_step(stack: torch.nn.Module, *, cuda_graphs: bool = True, fuse: bool = True, **kwargs):
    """``torch.compile(stack, fullgraph=True)`` — a whole step as one graph — with CUDA graphs
    (what ``mode="reduce-overhead"`` sets; a no-op on CPU) and the dsv4 FX passes
    (``fx_passes.DSV4PassManager``: the metadata chain fused into one op) unless turned off."""
    options = {"triton.cudagraphs": cuda_graphs}
    if fuse:
        options["post_grad_custom_post_pass"] = DSV4PassManager()
    return torch.compile(stack, fullgraph=True, options=options, **kwargs)
