"""Whether the backend's ops may read one of a model's tensors as it is."""

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
