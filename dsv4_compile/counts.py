"""The check of a host-side count argument (token counts, request rows, sizes, seeds), shared by
the step, the cache, the allocator, the engine and the runner. It imports nothing of the package,
so the modules below :mod:`dsv4_compile.validate` use it too."""

from __future__ import annotations


def check_count(name: str, value) -> int:
    """``value`` as a non-negative Python int (a bool, float or tensor is refused by name)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name}={value} must be >= 0")
    return value
