"""Next-token choice: ``dsv4::greedy_tokens``, the argmax of each logits row.

A decode step ends in picking a token from each sampled row's logits: at a full vocabulary
(129,280 entries) ``aten``'s argmax runs each row through one thread block, the slowest kernel of a
greedy step after the GEMMs. On CUDA the op is two Triton launches (``ops/kernels/sampling.py``):
per-chunk maxima over the whole GPU, then the pick among them.
"""

from __future__ import annotations

import torch

from ._checks import check_tensor
from ._library import HAS_TRITON, dsv4_op

if HAS_TRITON:
    from .kernels import sampling as kernels

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_greedy_tokens(logits) -> None:
    check_tensor("greedy_tokens", "logits", logits, dtypes=DTYPES, ndim=2)
    if logits.shape[1] == 0:
        raise ValueError("dsv4.greedy_tokens: logits has no columns (an argmax needs at least one)")


def _greedy_tokens_fake(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def _greedy_tokens_cuda(logits):
    return kernels.launch_greedy_tokens(logits if logits.stride(-1) == 1 else logits.contiguous())


@dsv4_op("greedy_tokens", check=_check_greedy_tokens, fake=_greedy_tokens_fake,
         cuda=_greedy_tokens_cuda if HAS_TRITON else None)
def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits [m, V]`` fp32 / bf16 / fp16 (V >= 1) -> ``[m] int64``: ``logits.argmax(-1)``, the
    first of equal maxima, a NaN counting as the maximum."""
    return logits.argmax(-1)
