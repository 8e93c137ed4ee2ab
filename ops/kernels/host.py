"""Host-side helpers shared by the launchers."""

from __future__ import annotations

import functools
import os

import torch
import triton

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


# Weight bytes a program launched with PDL asks the L2 for before its wait (the projections', the
# experts' and the router's launches)
PREFETCH_BYTES = 32768


def prefetch_columns(k: int, block_n: int, itemsize: int) -> int:
    """Leading columns of its ``block_n`` weight rows (``k`` columns each) a program asks the L2
    for before its PDL wait: :data:`PREFETCH_BYTES` worth, a power of two, at least one 128-byte
    line of 2-byte weights (the ``PREFETCH_K`` of ``primitives.prefetch_then_wait``)."""
    return max(64, min(triton.next_power_of_2(k), PREFETCH_BYTES // (block_n * itemsize)))
