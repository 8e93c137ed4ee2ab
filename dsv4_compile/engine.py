"""A miniature serving loop around a :class:`DSV4AttentionStack`: what an engine does between
steps. It admits requests, allocates pages for their new tokens, builds the step object (padded
to a bucket when asked), runs the step, rolls back rejected drafts and releases finished
requests. Used by the demo (``python -m dsv4_compile``), the tests and
``benchmarks/bench_step.py``.

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
from .layer import DSV4AttentionStack
from .step import REQUEST_BUCKETS, TOKEN_BUCKETS, ForwardMode, StepInputs, bucket
from .validate import check_count

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
        seq_len = self.allocator.seq_len(row)
        num_accepted, num_drafts = check_count("num_accepted", num_accepted), check_count("num_drafts", num_drafts)
        if num_drafts > min(seq_len, self.stack.config.max_draft_tokens):
            raise ValueError(f"num_drafts={num_drafts} exceeds request {row}'s length {seq_len} or "
                             f"max_draft_tokens={self.stack.config.max_draft_tokens}")
        if num_accepted > num_drafts:
            raise ValueError(f"num_accepted={num_accepted} exceeds num_drafts={num_drafts}")
        self.allocator.truncate(row, seq_len - num_drafts + num_accepted)

    # -- steps ---------------------------------------------------------------------------------
    def build_step(self, mode: ForwardMode, tokens: Mapping[int, int], *, pad_requests: int = 0,
                   pad_tokens: int = 0) -> StepInputs:
        """Allocate ``tokens[row]`` new positions per request and return the step (requests in the
        order of ``tokens``), padded to ``pad_requests`` requests and ``pad_tokens`` rows (the
        bucket sizes) when larger. All or nothing: if any request's tokens do not fit (or an argument
        is bad), no request is extended."""
        if not isinstance(tokens, Mapping):
            raise TypeError(f"tokens must be a mapping of request row to token count, got {type(tokens).__name__}")
        pad_requests, pad_tokens = check_count("pad_requests", pad_requests), check_count("pad_tokens", pad_tokens)
        with self.allocator.transaction():
            locs = [self.allocator.extend(row, n) for row, n in tokens.items()]
            return self._step(mode, list(tokens), locs, pad_requests, pad_tokens)

    def _step(self, mode: ForwardMode, rows: list[int], locs: list[torch.Tensor], pad_requests: int,
              pad_tokens: int) -> StepInputs:
        """The step of requests ``rows`` whose new slots are ``locs``, padded as build_step says."""
        ext = [loc.shape[0] for loc in locs]
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
