"""A step's integer vectors onto its device in one copy.

Between steps the host holds a step's integers as Python lists: request rows, lengths, cache slots,
token ids, logit rows. ``torch.tensor(values, device="cuda")`` for each is a copy from pageable
memory that waits for the device's queue to drain, and a dtype conversion after it is a kernel
launch. :func:`to_device` packs every vector of a step, each in its final dtype, into one host
buffer, pinned on CUDA, and copies it with one asynchronous launch; the tensors it returns are
views of that one device buffer, so no kernel runs. The pinned block is PyTorch's caching host
allocator's, which keeps it from reuse until the copy that reads it is done.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def to_device(device: torch.device, int64: Sequence[Sequence[int]] = (), int32: Sequence[Sequence[int]] = ()
              ) -> list[torch.Tensor]:
    """``[*int64, *int32]``: each vector as a 1-D tensor of that dtype on ``device``, all views of one
    buffer filled by one copy (the int64 vectors first, so that every view is aligned to its dtype)."""
    wide = torch.tensor(list(itertools.chain.from_iterable(int64)), dtype=torch.int64)
    narrow = torch.tensor(list(itertools.chain.from_iterable(int32)), dtype=torch.int32)
    packed = torch.cat([wide.view(torch.uint8), narrow.view(torch.uint8)])
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    views, start = [], 0
    for vectors, dtype in ((int64, torch.int64), (int32, torch.int32)):
        size = dtype.itemsize
        for v in vectors:
            views.append(packed[start:start + size * len(v)].view(dtype))
            start += size * len(v)
    return views
