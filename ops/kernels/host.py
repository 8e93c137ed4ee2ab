"""Host-side helpers shared by the launchers."""

from __future__ import annotations

import functools
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETER_SMS = 132  # the interpreter pretends to be an H200, so split paths are exercised


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with stride 1 on its last dim, as the kernels index it (other strides are passed);
    a no-op for the usual contiguous inputs."""
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=None)
def has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled CUDA kernels on sm_90+ (not the interpreter)."""
    return not INTERPRET and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (``_INTERPRETER_SMS`` off CUDA)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
