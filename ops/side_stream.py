"""A second CUDA stream for a step's cache writes: ``dsv4::join_side_stream`` and the fork the
side-stream ops take (``_library.dsv4_op(..., side_stream=True)``).

At a decode step's few rows a layer's key and compressor writes (``rms_norm_rope_store_kv``,
``compress_kv_store``: one- or two-program kernels of 1-3 µs) wait only for the hidden state's
projections, while the query's projections after them stream tens of MiB of weights on every SM.
Launched on a side stream, the writes run beside those products instead of after them; a CUDA
graph captured over the step records the two streams as parallel branches, so replays overlap
them too. ``fx_passes/overlap_cache_writes.py`` sets the ops' ``side_stream`` flag and puts a
``join_side_stream`` before the first read of what they write.

Ordering, which the join carries in the graph: it declares ``written`` (the side ops' mutated
buffers) mutated, so Inductor schedules every later reader of them after it, and takes
``keepalive`` (the side ops' other inputs made in the graph), so Inductor frees or reuses none of
those buffers while the side stream may still read them. A side op's own allocations are made on
the side stream (the allocator reuses them there only; during a capture they come from the
graph's pool, as the side stream joins the capture).

The side stream runs at the highest priority the device has: its one-program kernels take the
SM slots that free up first rather than queueing behind the product's remaining programs.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ._checks import check_devices
from ._library import dsv4_op

_forked_devices: set[torch.device] = set()  # devices with side work not joined yet (host-side, per trace or call)


@functools.lru_cache(maxsize=None)
def _side_stream_of(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device, priority=-100)  # clamped to the highest priority of the device


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA ``device`` (one per device, made on first use)."""
    return _side_stream_of(_indexed(device))


def _indexed(device: torch.device) -> torch.device:
    return device if device.index is not None else torch.device(device.type, torch.cuda.current_device())


@contextlib.contextmanager
def forked(device: torch.device):
    """Launches inside the block go to ``device``'s side stream, after the work the current stream
    has queued so far."""
    device = _indexed(device)
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    _forked_devices.add(device)
    with torch.cuda.stream(side):
        yield


def _check_join(written, keepalive) -> None:
    if not written:
        raise ValueError("dsv4.join_side_stream: written must hold at least one tensor")
    check_devices("join_side_stream", **{f"written[{i}]": t for i, t in enumerate(written)},
                  **{f"keepalive[{i}]": t for i, t in enumerate(keepalive)})


def _join_fake(written, keepalive) -> None:
    return None


def _join_cuda(written: list[torch.Tensor], keepalive: list[torch.Tensor]) -> None:
    device = _indexed(written[0].device)
    if device in _forked_devices:  # a wait on a stream not forked in this capture would be an error
        torch.cuda.current_stream(device).wait_stream(side_stream(device))
        _forked_devices.discard(device)


@dsv4_op("join_side_stream", check=_check_join, fake=_join_fake, cuda=_join_cuda, mutates_args=("written",))
def join_side_stream(written: list[torch.Tensor], keepalive: list[torch.Tensor]) -> None:
    """The current stream waits for the side stream's work so far (CUDA); ``written`` (at least
    one tensor): the buffers that work writes, declared written here so that their readers follow
    the join; ``keepalive``: the tensors it reads, held until the join. Elsewhere nothing runs on a
    side stream, and the op does nothing."""
