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
from array import array
from collections.abc import Sequence

import torch


# ``array`` type codes of 8- and 4-byte signed integers (the C types' sizes on every platform torch
# supports; checked, since C only bounds them)
_INT64, _INT32 = "q", "i"
if array(_INT64).itemsize != 8 or array(_INT32).itemsize != 4:
    raise ImportError(f"dsv4_compile.transfer: array type codes {_INT64!r} / {_INT32!r} are not 8 / 4 bytes here")


def to_device(device: torch.device, int64: Sequence[Sequence[int]] = (), int32: Sequence[Sequence[int]] = ()
              ) -> list[torch.Tensor]:
    """``[*int64, *int32]``: each vector as a 1-D tensor of that dtype on ``device``, all views of one
    buffer filled by one copy (the int64 vectors first, so that every view is aligned to its dtype)."""
    # the bytes packed by ``array`` (C loops over the ints) and one tensor over them: 20-30 % less
    # host time than a tensor per dtype, concatenated
    data = bytearray(array(_INT64, itertools.chain.from_iterable(int64)).tobytes())
    wide = len(data)
    data += array(_INT32, itertools.chain.from_iterable(int32)).tobytes()
    packed = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    views = list(packed[:wide].view(torch.int64).split([len(v) for v in int64])) if int64 else []
    if int32:
        views += packed[wide:].view(torch.int32).split([len(v) for v in int32])
    return views
