"""Between steps, on the host: request rows, page allocation and the step object.

:class:`StepBuilder` is what every serving loop of the project shares — the attention-stack
:class:`~dsv4_compile.engine.Engine` and the model :class:`~dsv4_compile.runner.ModelRunner`. It
drives one :class:`~dsv4_compile.allocator.PageAllocator` (there is one per cache), admits and
releases requests, rolls back rejected drafts, and builds the :class:`~dsv4_compile.step.StepInputs`
of a step, padded to the bucket sizes when asked. Building a step is all or nothing
(:meth:`PageAllocator.transaction`).
"""

from __future__ import annotations

from collections.abc import Mapping

from .allocator import PageAllocator
from .counts import check_count
from .step import REQUEST_BUCKETS, TOKEN_BUCKETS, ForwardMode, StepInputs, bucket, check_mode
from .transfer import to_device


class StepBuilder:
    """Request lifecycle and step building over ``allocator``.

    ``bucketed`` pads every step to :data:`~dsv4_compile.step.REQUEST_BUCKETS` requests and
    :data:`~dsv4_compile.step.TOKEN_BUCKETS` rows, so that a compiled forward sees few shapes.
    """

    def __init__(self, allocator: PageAllocator, *, bucketed: bool = False):
        self.allocator = allocator
        self.bucketed = bucketed
        self.device = allocator.cache.device

    # -- request lifecycle ---------------------------------------------------------------------
    def admit(self) -> int:
        """A new request; returns its row."""
        return self.allocator.admit()

    def release(self, row: int) -> None:
        self.allocator.free(row)

    def accept(self, row: int, num_accepted: int, num_drafts: int) -> None:
        """After a verify step of ``num_drafts`` tokens, keep the first ``num_accepted``."""
        seq_len = self.allocator.seq_len(row)
        max_drafts = self.allocator.cache.config.max_draft_tokens
        num_accepted, num_drafts = check_count("num_accepted", num_accepted), check_count("num_drafts", num_drafts)
        if num_drafts > min(seq_len, max_drafts):
            raise ValueError(f"num_drafts={num_drafts} exceeds request {row}'s length {seq_len} or "
                             f"max_draft_tokens={max_drafts}")
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
        check_mode(mode)
        pad_requests, pad_tokens = check_count("pad_requests", pad_requests), check_count("pad_tokens", pad_tokens)
        with self.allocator.transaction():
            loc = self.allocator.extend_requests(tokens)
            return self._step(mode, list(tokens), list(tokens.values()), loc, pad_requests, pad_tokens)

    def _step(self, mode: ForwardMode, rows: list[int], ext: list[int], loc: list[int], pad_requests: int,
              pad_tokens: int) -> StepInputs:
        """The step of requests ``rows``, ``ext[i]`` new positions each, whose full slots are
        ``loc`` (concatenated), padded as build_step says."""
        seq_lens = [self.allocator.seq_len(row) for row in rows]
        if self.bucketed:
            pad_requests = max(pad_requests, bucket(len(rows), REQUEST_BUCKETS))
            pad_tokens = max(pad_tokens, bucket(len(loc), TOKEN_BUCKETS))
        pad_b = max(0, pad_requests - len(rows))
        rows, seq_lens, ext = rows + [0] * pad_b, seq_lens + [0] * pad_b, ext + [0] * pad_b
        loc = loc + [0] * max(0, pad_tokens - len(loc))
        # one copy for the four tensors, each in its dtype (docs/compile.md, "Caches are module buffers")
        loc, rows, seq_lens, ext = to_device(self.device, int64=[loc], int32=[rows, seq_lens, ext])
        return StepInputs(mode, rows, seq_lens, ext, loc)
