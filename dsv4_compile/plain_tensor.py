"""Whether the backend's ops may read one of a model's tensors as it is, and a norm module's own."""

from __future__ import annotations

import torch
from torch import nn

# A buffer a module assigns as ``nn.Buffer(t)`` (transformers' routers do) is a plain tensor to
# Python, but Dynamo traces its type as ``nn.Buffer``: with ``nn.Buffer`` listed the answer is the
# same eager and inside a compiled step.
_PLAIN_TYPES = (torch.Tensor, nn.Parameter, nn.Buffer)


def is_plain_tensor(t: object) -> bool:
    """Whether ``t`` is a plain tensor, parameter or buffer, which the ops read by pointer: not a
    tensor subclass (a DTensor shard, a quantiser's tensor)."""
    return type(t) in _PLAIN_TYPES


def plain_rms_norm(norm: nn.Module | None) -> tuple[torch.Tensor, float] | None:
    """``(weight, eps)`` of ``norm`` when it is ``transformers``' ``DeepseekV4RMSNorm`` as that
    library defines it, with a plain weight: the ops then compute it themselves (``dsv4::rms_norm``'s
    math). None for anything else (no norm, another class or forward, a quantiser's weight)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

    if norm is None or type(norm).forward is not DeepseekV4RMSNorm.forward or not is_plain_tensor(norm.weight):
        return None
    return norm.weight, norm.variance_epsilon
