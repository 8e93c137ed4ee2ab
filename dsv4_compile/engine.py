"""A miniature serving loop around a :class:`DSV4AttentionStack`: what an engine does between
steps. It admits requests, allocates pages for their new tokens, builds the step object (padded
to a bucket when asked), runs the step, rolls back rejected drafts and releases finished
requests. Used by the tests and ``benchmarks/bench_step.py``.

The caller supplies the hidden states of every step's new tokens (``run(mode, {row: x})``); the
engine keeps no copy of them. A step that fails — a request that does not fit, bad inputs — leaves
the allocator and the index maps exactly as they were (:meth:`PageAllocator.transaction`).
Checking steps against the cache-free oracle is done outside it, by
:class:`dsv4_compile.testing.oracle_recorder.OracleRecorder`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from .allocator import PageAllocator
from .counts import check_count
from .layer import DSV4AttentionStack
from .step import ForwardMode, StepInputs
from .step_builder import StepBuilder

Forward = Callable[[torch.Tensor, StepInputs], torch.Tensor]


class Engine(StepBuilder):
    """Drives ``forward(x, step)`` (the stack itself, or a compiled version of it) over an allocator
    of the stack's cache; request lifecycle and step building as :class:`StepBuilder`."""

    def __init__(self, stack: DSV4AttentionStack, *, forward: Forward | None = None, bucketed: bool = False):
        super().__init__(PageAllocator(stack.cache), bucketed=bucketed)
        self.stack = stack
        self.forward = forward or stack

    def pack_inputs(self, step: StepInputs, inputs: Iterable[torch.Tensor]) -> torch.Tensor:
        """``x [T, hidden] bf16`` of ``step``: the requests' new hidden states (each ``[n, hidden]``,
        in step order) concatenated, zeros on the padding rows."""
        x = torch.zeros(step.num_tokens, self.stack.config.hidden_size, dtype=torch.bfloat16,
                        device=self.device)
        real = list(inputs)
        if real:
            rows = torch.cat(real)
            x[: rows.shape[0]] = rows
        return x

    def run(self, mode: ForwardMode, inputs: Mapping[int, torch.Tensor], **pad) -> dict[int, torch.Tensor]:
        """One step: ``inputs[row]`` (``[n, hidden] bf16``) are the hidden states of request ``row``'s
        ``n`` new tokens. Returns each request's outputs for them (``[n, hidden]``). ``pad``: the
        keyword arguments of :meth:`build_step`. If the step fails (the forward validates before it
        writes anything), no request is extended."""
        self._check_inputs(inputs)
        with self.allocator.transaction():
            step = self.build_step(mode, {row: x.shape[0] for row, x in inputs.items()}, **pad)
            out = self.forward(self.pack_inputs(step, inputs.values()), step)
        result, lo = {}, 0
        for row, x in inputs.items():
            result[row] = out[lo:lo + x.shape[0]].clone()
            lo += x.shape[0]
        return result

    def _check_inputs(self, inputs: Mapping[int, torch.Tensor]) -> None:
        if not isinstance(inputs, Mapping):
            raise TypeError(f"inputs must be a mapping of request row to hidden states, "
                            f"got {type(inputs).__name__}")
        hidden = self.stack.config.hidden_size
        for row, x in inputs.items():
            name = f"inputs[{row}]"
            if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
                raise TypeError(f"{name} must be a bfloat16 Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
            if x.device != self.device:
                raise ValueError(f"{name} is on {x.device}, the cache is on {self.device}")
            if x.dim() != 2 or x.shape[1] != hidden:
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected (n, {hidden})")

    def idle(self, num_tokens: int = 1) -> torch.Tensor:
        """A step with no request: every row is padding. Returns the (throw-away) outputs."""
        step = StepInputs.idle(check_count("num_tokens", num_tokens), device=self.device)
        return self.forward(self.pack_inputs(step, ()), step).clone()
