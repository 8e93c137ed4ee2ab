"""A miniature serving loop around a :class:`DSV4AttentionStack`: what an engine does between
steps. It admits requests, allocates pages for their new tokens, builds the step object (padded
to a bucket when asked), runs the step, rolls back rejected drafts and releases finished
requests. Used by the demo (``python -m dsv4_compile``), the tests and
``benchmarks/bench_step.py``.

The caller supplies the hidden states of every step's new tokens (``run(mode, {row: x})``); the
engine keeps no copy of them. Checking steps against the cache-free oracle is done outside it,
by :class:`dsv4_compile.testing.oracle_recorder.OracleRecorder`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from .allocator import PageAllocator
from .layer import DSV4AttentionStack
from .step import REQUEST_BUCKETS, TOKEN_BUCKETS, ForwardMode, StepInputs, bucket

Forward = Callable[[torch.Tensor, StepInputs], torch.Tensor]


class Engine:
    """Drives ``forward(x, step)`` (the stack itself, or a compiled version of it).

    ``bucketed`` pads every step to :data:`~dsv4_compile.step.REQUEST_BUCKETS` requests and
    :data:`~dsv4_compile.step.TOKEN_BUCKETS` rows, so that a compiled forward sees few shapes.
    """

    def __init__(self, stack: DSV4AttentionStack, *, forward: Forward | None = None, bucketed: bool = False):
        self.stack = stack
        self.forward = forward or stack
        self.bucketed = bucketed
        self.allocator = PageAllocator(stack.cache)
        self.device = stack.cache.device

    # -- request lifecycle ---------------------------------------------------------------------
    def admit(self) -> int:
        """A new request; returns its row."""
        return self.allocator.admit()

    def release(self, row: int) -> None:
        self.allocator.free(row)

    def accept(self, row: int, num_accepted: int, num_drafts: int) -> None:
        """After a verify step of ``num_drafts`` tokens, keep the first ``num_accepted``."""
        self.allocator.truncate(row, self.allocator.seq_len(row) - num_drafts + num_accepted)

    # -- steps ---------------------------------------------------------------------------------
    def build_step(self, mode: ForwardMode, tokens: Mapping[int, int], *, pad_requests: int = 0,
                   pad_tokens: int = 0) -> StepInputs:
        """Allocate ``tokens[row]`` new positions per request and return the step (requests in the
        order of ``tokens``), padded to ``pad_requests`` requests and ``pad_tokens`` rows (the
        bucket sizes) when larger."""
        rows, ext = list(tokens), list(tokens.values())
        locs = [self.allocator.extend(row, n) for row, n in tokens.items()]
        seq_lens = [self.allocator.seq_len(row) for row in rows]
        if self.bucketed:
            pad_requests = max(pad_requests, bucket(len(rows), REQUEST_BUCKETS))
            pad_tokens = max(pad_tokens, bucket(sum(ext), TOKEN_BUCKETS))
        pad_b = max(0, pad_requests - len(rows))
        rows, seq_lens, ext = rows + [0] * pad_b, seq_lens + [0] * pad_b, ext + [0] * pad_b
        loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64, device=self.device)
        return StepInputs.make(mode, rows, seq_lens, ext, loc, num_tokens=max(pad_tokens, loc.shape[0]),
                               device=self.device)

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
        keyword arguments of :meth:`build_step`."""
        step = self.build_step(mode, {row: x.shape[0] for row, x in inputs.items()}, **pad)
        out = self.forward(self.pack_inputs(step, inputs.values()), step)
        result, lo = {}, 0
        for row, x in inputs.items():
            result[row] = out[lo:lo + x.shape[0]].clone()
            lo += x.shape[0]
        return result

    def idle(self, num_tokens: int = 1) -> torch.Tensor:
        """A step with no request: every row is padding. Returns the (throw-away) outputs."""
        step = StepInputs.idle(num_tokens, device=self.device)
        return self.forward(self.pack_inputs(step, ()), step).clone()
