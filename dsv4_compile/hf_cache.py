"""The backend's paged cache as a ``transformers`` ``Cache``: :class:`DSV4PagedCache`.

``model.generate()`` with the backend enabled runs over this cache (docs/model.md, "generate()").
Each batch row of ``generate`` is one request row of the backend's allocator, admitted at the
first step. The model's attention writes the cache inside the step, so ``update`` is never called;
the model's forward feeds a step through :meth:`DSV4PagedCache.step`. Pads (``attention_mask`` 0)
never enter the cache: each row holds its real tokens at positions counted from 0.

``get_seq_length()`` counts the *columns* of ``input_ids`` fed so far (pads included), which is
what ``generate`` slices its inputs by; ``crop(-n)`` drops the last ``n`` columns — a truncate of
each row by its real tokens among them, at most ``max_draft_tokens`` deep (rejected draft
tokens). The rows go back to the allocator on :meth:`reset`, when ``generate`` returns (unless the
cache is returned to the caller) or when the cache object is garbage-collected.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from .runner import pages_needed
from .step import ForwardMode

if TYPE_CHECKING:
    from .allocator import PageAllocator
    from .model import ModelBackend
    from .runner import ModelRunner


class DSV4PagedCache(Cache):
    """Request rows of ``backend``'s paged cache, one per batch row of ``generate``.

    Args:
        backend: the :class:`~dsv4_compile.model.ModelBackend` whose allocator holds the rows and
            whose ``runner`` runs the steps.
        max_length: the longest row the caller will feed (prompt width + new tokens); checked
            against the cache's ``max_seq_len`` and free pages when the rows are admitted.
    """

    def __init__(self, backend: "ModelBackend", max_length: int | None = None):
        super().__init__(layers=[])
        self.backend = backend
        self.max_length = max_length
        self.rows: list[int] = []
        self._real = torch.zeros(0, 0, dtype=torch.bool)  # [B, columns] which fed columns were real tokens
        self._release = weakref.finalize(self, _release_rows, backend.allocator, self.rows)

    # -- the Cache interface generate calls ----------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns of ``input_ids`` fed so far (pads included): ``generate``'s notion of the past."""
        return self._real.shape[1]

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.backend.cache.max_seq_len

    @property
    def batch_size(self) -> int:
        return len(self.rows) if self.rows else -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (``transformers``' convention: a count <= 0);
        each row is truncated by its real tokens among them. All rows or none: a rollback deeper
        than ``max_draft_tokens`` raises ``ValueError`` and changes nothing."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass minus the number of tokens to remove")
        n = -tokens_to_remove
        if n == 0:
            return
        if n > self._real.shape[1]:
            raise ValueError(f"crop({tokens_to_remove}): the cache holds {self._real.shape[1]} columns")
        allocator = self.backend.allocator
        try:
            with allocator.transaction():
                for row, real in zip(self.rows, self._real[:, -n:].sum(1).tolist()):
                    allocator.truncate(row, allocator.seq_len(row) - real)
        except ValueError as e:
            raise ValueError(f"{e} (assisted generation: draft at most max_draft_tokens="
                             f"{self.backend.config.max_draft_tokens} tokens per step, e.g. "
                             "assistant_model.generation_config.num_assistant_tokens)") from None
        self._real = self._real[:, :-n]

    def reset(self) -> None:
        """Release the rows; the next step admits new ones."""
        _release_rows(self.backend.allocator, self.rows)
        self._real = torch.zeros(0, 0, dtype=torch.bool)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise ValueError("beam search is not supported on the dsv4_compile backend's cache: its request rows "
                         "cannot be reordered (use num_beams=1)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ValueError("DSV4PagedCache rows cannot be repeated (one request row per batch row)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ValueError("DSV4PagedCache rows cannot be selected (one request row per batch row)")

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, logits_to_keep: int) -> torch.Tensor:
        """Feed ``input_ids [B, S]`` (the new columns; ``attention_mask [B, past + S]`` or ``None``,
        1 on real tokens) and return the logits of the last ``K`` columns, ``[B, K, vocab]`` in the
        model's dtype (``K = S`` when ``logits_to_keep`` is 0; zeros on pads)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(getattr(input_ids, "shape", ()))
            raise ValueError(f"input_ids must be a [batch, columns] tensor, got shape {shape}")
        batch, width = input_ids.shape
        real = torch.ones(batch, width, dtype=torch.bool) if attention_mask is None else \
            attention_mask[:, -width:].ne(0).cpu()
        if attention_mask is not None and attention_mask.shape != (batch, self.get_seq_length() + width):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; the cache holds "
                             f"{self.get_seq_length()} columns and input_ids brings {width}")
        if self.rows and batch != len(self.rows):
            raise ValueError(f"input_ids has {batch} rows, the cache holds {len(self.rows)}")
        # checked before a row is admitted or extended: feed's steps commit to the allocator chunk by chunk
        ids = input_ids.cpu()
        new = self.backend.runner.token_lists("input_ids", [ids[b][real[b]] for b in range(batch)], allow_empty=True)
        self._check_room(new)
        if not self.rows:
            self._admit(batch)
        keep = width if logits_to_keep == 0 else min(logits_to_keep, width)
        tokens = dict(zip(self.rows, new))
        kept = {row: int(real[b, width - keep:].sum()) for b, row in enumerate(self.rows)}
        rows_logits = feed(self.backend.runner, tokens, kept)
        self._real = torch.cat([self._real, real], 1)
        logits = self.backend.new_logits(batch, keep, self.backend.vocab_size)
        for b, row in enumerate(self.rows):
            logits[b, real[b, width - keep:].to(logits.device)] = rows_logits[row]
        return logits

    def _check_room(self, new: list[list[int]]) -> None:
        """``ValueError`` if a row cannot take its ``new`` tokens within the backend's ``max_seq_len``
        (a first ``generate`` step: :meth:`_admit` checks ``max_length`` instead)."""
        if not self.rows and self.max_length is not None:
            return
        limit = self.backend.cache.max_seq_len
        lengths = [self.backend.allocator.seq_len(row) for row in self.rows] or [0] * len(new)
        for b, (length, tokens) in enumerate(zip(lengths, new)):
            if length + len(tokens) > limit:
                raise ValueError(f"input_ids row {b} brings {len(tokens)} tokens to the {length} in the cache, "
                                 f"more than the backend's max_seq_len={limit}")

    def _admit(self, batch: int) -> None:
        """One request row per batch row; ``ValueError`` before admitting any if they cannot hold
        ``max_length`` tokens each."""
        alloc, cache = self.backend.allocator, self.backend.cache
        if self.max_length is not None:
            if self.max_length > cache.max_seq_len:
                raise ValueError(f"generate needs {self.max_length} positions per row (prompt + max_new_tokens), "
                                 f"more than the backend's max_seq_len={cache.max_seq_len}")
            full, swa = pages_needed(self.max_length, self.backend.runner.max_step_tokens,
                                     cache.config.max_draft_tokens)
            need, free = (batch, batch * full, batch * swa), self.backend.runner.free_capacity()
            if any(n > f for n, f in zip(need, free)):
                raise ValueError(f"generate needs {need[0]} request rows, {need[1]} full and {need[2]} SWA pages "
                                 f"for {batch} rows of {self.max_length} tokens; the backend's cache has "
                                 f"{free[0]}, {free[1]} and {free[2]} free")
        self.rows.extend(alloc.admit() for _ in range(batch))
        self._real = torch.zeros(batch, 0, dtype=torch.bool)


def _release_rows(allocator: "PageAllocator", rows: list[int]) -> None:
    """Free ``rows`` (emptied in place, so a second release is a no-op)."""
    while rows:
        allocator.free(rows.pop())


def feed(runner: "ModelRunner", tokens: dict[int, list[int]], keep: dict[int, int]) -> dict[int, torch.Tensor]:
    """Feed ``tokens[row]`` to request rows already admitted on ``runner``'s allocator, in
    ``EXTEND`` steps of at most ``runner.max_step_tokens`` rows; returns the logits of the last
    ``keep[row]`` tokens of each row (``[keep[row], vocab]``, the model's dtype)."""
    fed = dict.fromkeys(tokens, 0)
    out: dict[int, list[torch.Tensor]] = {row: [] for row in tokens}
    while True:
        budget, plan = runner.max_step_tokens, {}
        for row, toks in tokens.items():
            if n := min(len(toks) - fed[row], budget):
                plan[row], budget = n, budget - n
        if not plan:
            break
        ids, logit_rows, parts = [], [], []
        for row, n in plan.items():
            first, end = max(fed[row], len(tokens[row]) - keep[row]), fed[row] + n
            if end > first:
                parts.append((row, len(logit_rows), end - first))
                logit_rows += range(len(ids) + first - fed[row], len(ids) + n)
            ids += tokens[row][fed[row]:end]
        with runner.allocator.transaction():  # a step the model refuses extends no row
            logits = runner.run_step(runner.build_step(ForwardMode.EXTEND, plan), ids, logit_rows)
        for row, n in plan.items():
            fed[row] += n
        for row, start, n in parts:
            # a compiled step's output may be the graph's own buffer, which its next call overwrites
            out[row].append(logits[start:start + n].clone())
    empty = runner.backend.new_logits(0, runner.backend.vocab_size)
    return {row: torch.cat(p) if p else empty for row, p in out.items()}
