"""Argument checks at the op boundary: type, dtype, rank, shape and device only (never values, so
they are safe in fake impls and under tracing). Errors name the op and the argument. Index values
are not checked here: every op skips or masks out-of-range indices itself (docs/semantics.md §6)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_tensor(op: str, name: str, t: torch.Tensor, *, dtypes: Sequence[torch.dtype] | None = None,
                 ndim: int | None = None, shape: Sequence[int | None] | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"dsv4.{op}: {name} must be a Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"dsv4.{op}: {name} must have dtype {want}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"dsv4.{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                raise ValueError(f"dsv4.{op}: {name} has shape {tuple(t.shape)}, "
                                 f"expected {want} at dim {axis}")


def check_devices(op: str, **tensors) -> None:
    """Every tensor among ``tensors`` is on the device of the first one (the cache, or the op's
    first tensor): a tensor elsewhere (another GPU, ``meta``) would be silently misread. Arguments
    that are not tensors are left to :func:`check_tensor`."""
    given = [(name, t) for name, t in tensors.items() if isinstance(t, torch.Tensor)]
    if not given:
        return
    first, device = given[0][0], given[0][1].device
    for name, t in given[1:]:
        if t.device != device:
            raise ValueError(f"dsv4.{op}: {name} is on {t.device}, expected {device} (the device of {first})")


def check_positive(op: str, name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"dsv4.{op}: {name}={value} must be positive")


def check_non_negative(op: str, name: str, value: float) -> None:
    if not value >= 0:  # NaN included
        raise ValueError(f"dsv4.{op}: {name}={value} must be >= 0")


def check_multiple_of(op: str, name: str, value: int, m: int) -> None:
    if value % m:
        raise ValueError(f"dsv4.{op}: {name}={value} must be a multiple of {m}")


def check_inv_freq(op: str, x: torch.Tensor, inv_freq: torch.Tensor, *, power_of_two: bool = False) -> None:
    """``inv_freq [R / 2] fp32`` with R between 2 and x's last dim; R / 2 a power of two when
    ``power_of_two`` (a kernel's ``tl.arange`` over the pairs)."""
    check_tensor(op, "inv_freq", inv_freq, dtypes=(torch.float32,), ndim=1)
    half = inv_freq.shape[0]
    if not 0 < 2 * half <= x.shape[-1]:
        raise ValueError(f"dsv4.{op}: inv_freq has {half} entries; RoPE on 2 x that many of x's "
                         f"last {x.shape[-1]} dims needs between 1 and {x.shape[-1] // 2}")
    if power_of_two and half & (half - 1):
        raise ValueError(f"dsv4.{op}: inv_freq must have a power-of-two length, got {half}")


def check_same_rows(op: str, **tensors: torch.Tensor) -> None:
    # Pairwise comparison, not a set: under tracing the sizes are SymInts (unhashable).
    rows = [t.shape[0] for t in tensors.values()]
    if any(r != rows[0] for r in rows[1:]):
        shown = {name: t.shape[0] for name, t in tensors.items()}
        raise ValueError(f"dsv4.{op}: row counts differ: {shown}")


INDEX_DTYPES = (torch.int32, torch.int64)
SLOT_DTYPES = (torch.int32, torch.int64)
