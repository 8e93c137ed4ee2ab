"""Registering Triton launchers as the CUDA kernels of ``dsv4::`` ops.

Where Triton is not installed (platforms it does not support) nothing is registered: the
reference stays the kernel on every device, and the package still imports and runs.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


def cuda_kernel(op):
    """``op.register_kernel("cuda")`` when Triton is available, else a no-op decorator."""
    return op.register_kernel("cuda") if HAS_TRITON else (lambda fn: fn)
