"""Continuous batching of a model on the backend: :class:`ModelRunner` (``score``, ``generate``).

The runner is host code between steps. Every step is one ``EXTEND`` step of the model step
(:meth:`ModelBackend.forward <dsv4_compile.model.ModelBackend.forward>` or its compiled version)
that packs, within ``max_step_tokens`` rows: one token of every request that is decoding, then
the next prefill chunk of requests whose tokens are not all in the cache yet, then the first chunk
of newly admitted requests. Decodes and prefill chunks share a step because the step's math is the
same for both (a decode is a one-token chunk), so the batch never waits for a prefill to finish and
the compiled step sees one kind of step.

Admission reserves capacity: a request joins the batch once a request row is free and the pages of
its final length (``full``: one per 256 positions; ``SWA``: the window's pages, see
:func:`pages_needed`) fit beside the reservations of the running requests. Running requests
therefore never run out of pages: a request that does not fit now waits for earlier ones to finish,
and one that can never fit is refused with ``ValueError`` before anything is written. The runner
assumes it is the only user of the allocator while one of its calls runs.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import PAGE_SIZE, SWA_WINDOW
from .counts import check_count
from .sampling import check_sampling, sample_tokens
from .step import TOKEN_BUCKETS, ForwardMode, StepInputs, bucket
from .step_builder import StepBuilder
from .transfer import to_device

if TYPE_CHECKING:
    from .model import ModelBackend

Step = Callable[[torch.Tensor, StepInputs, torch.Tensor], torch.Tensor]
# consume(parts, logits): parts are (request, position of its first token in the step, rows of logits)
Consume = Callable[[list[tuple["_Request", int, slice]], torch.Tensor], None]


@dataclass
class _Request:
    index: int  # position in the caller's list
    tokens: list[int]  # the tokens the cache takes (grows while generating)
    length: int  # final length in the cache: admission reserves its pages
    scored_from: int = 0  # with every_row: the first position whose logits consume gets
    row: int = 0  # request row once admitted
    fed: int = 0  # tokens already in the cache

    @property
    def left(self) -> int:
        return len(self.tokens) - self.fed


class _Unforeseen(Exception):
    """A step built ahead no longer follows: its transaction is undone."""


def pages_needed(length: int, max_step_tokens: int, max_draft_tokens: int) -> tuple[int, int]:
    """``(full, swa)`` pages a request of ``length`` positions holds at most when every chunk has
    at most ``max_step_tokens`` tokens: a full page per 256 positions; SWA pages for the window
    (127 positions and the ``max_draft_tokens`` a rollback may bring back) plus one chunk, and one
    for page alignment."""
    full = -(-length // PAGE_SIZE)
    return full, min(full, -(-(SWA_WINDOW - 1 + max_draft_tokens + max_step_tokens) // PAGE_SIZE) + 1)


class ModelRunner(StepBuilder):
    """Continuous batching over ``backend``'s allocator, running ``step_fn(input_ids, step,
    logit_rows)`` (default: ``backend`` eager; pass :func:`~dsv4_compile.compile.compile_step`'s
    result to run compiled). Steps have at most ``max_step_tokens`` real rows; ``bucketed`` pads them
    as :class:`~dsv4_compile.step_builder.StepBuilder` does. ``build_ahead``: build each step while
    the device runs the one before it (:meth:`_consume_ahead`); False builds each step after the
    last one's results are read (the same tokens, the host's time and the device's added up). By
    default on a GPU only: where the device is the host's CPU nothing overlaps, and building ahead
    costs the host a few percent more (its undo records)."""

    def __init__(self, backend: "ModelBackend", *, step_fn: Step | None = None, max_step_tokens: int = 256,
                 bucketed: bool = True, build_ahead: bool | None = None):
        super().__init__(backend.allocator, bucketed=bucketed)
        self.backend = backend
        self.step_fn = step_fn or backend
        self.build_ahead = self.device.type != "cpu" if build_ahead is None else build_ahead
        if check_count("max_step_tokens", max_step_tokens) < 1:
            raise ValueError("max_step_tokens must be >= 1")
        self.max_step_tokens = max_step_tokens

    # -- public API ----------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int] | torch.Tensor]) -> list[torch.Tensor]:
        """Teacher-forced log-probs: for each sequence of ``L >= 1`` tokens, fp32 ``[L - 1]`` whose
        entry ``t`` is ``log p(token t+1 | tokens <= t)``, on the cache's device. The cache takes each
        sequence's first ``L - 1`` tokens."""
        seqs = self.token_lists("sequences", sequences)
        targets = [torch.tensor(s, dtype=torch.int64, device=self.device) for s in seqs]
        out: list[list[torch.Tensor]] = [[] for _ in seqs]

        def consume(parts, logits):
            for req, start, rows in parts:
                logp = logits[rows].float().log_softmax(-1)
                want = targets[req.index][start + 1:start + 1 + logp.shape[0]]
                out[req.index].append(logp.gather(1, want[:, None])[:, 0])

        requests = [_Request(i, s[:-1], len(s) - 1) for i, s in enumerate(seqs)]
        self._serve("sequences", requests, consume, every_row=True)
        return [torch.cat(p) if p else torch.zeros(0, device=self.device) for p in out]

    @torch.no_grad()
    def logits(self, sequences: Sequence[Sequence[int] | torch.Tensor], last: Sequence[int] | None = None
               ) -> list[torch.Tensor]:
        """Logits of every position of each sequence (``[L, vocab]``, the model's dtype): row ``t``
        predicts token ``t + 1``; with ``last``, of the last ``last[i]`` positions of ``sequences[i]``
        only (``[last[i], vocab]``, ``0 <= last[i] <= L``: the steps compute no other rows' logits).
        The cache takes every token."""
        seqs = self.token_lists("sequences", sequences)
        keep = [len(s) for s in seqs] if last is None else self._counts("last", last, [len(s) for s in seqs])
        out: list[list[torch.Tensor]] = [[] for _ in seqs]

        def consume(parts, logits):
            for req, _, rows in parts:
                out[req.index].append(logits[rows].clone())

        requests = [_Request(i, s, len(s), scored_from=len(s) - k) for i, (s, k) in enumerate(zip(seqs, keep))]
        self._serve("sequences", requests, consume, every_row=True)
        return [torch.cat(p) if p else self.backend.new_logits(0, self.backend.vocab_size) for p in out]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int] | torch.Tensor], max_new_tokens: int, *,
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, stop_ids: Iterable[int] = (),
                 seed: int | None = None, stop: Callable[[int, list[int]], bool] | None = None
                 ) -> list[list[int]]:
        """The new tokens of each prompt: up to ``max_new_tokens``, ending early after the first
        token in ``stop_ids`` (which is included). ``temperature == 0`` is greedy; otherwise tokens are
        drawn on the device (see :func:`~dsv4_compile.sampling.sample_tokens`) from a
        ``torch.Generator`` seeded with ``seed`` (``None``: a random seed, under tensor parallelism
        the first rank's on every rank). ``stop(i, new_tokens)``,
        called after each token of ``prompts[i]``, ends that request when it returns True (stop
        strings: decode and search the new tokens)."""
        max_new_tokens = check_count("max_new_tokens", max_new_tokens)
        temperature, top_p, top_k = check_sampling(temperature, top_p, top_k)
        if stop is not None and not callable(stop):
            raise TypeError(f"stop must be a callable (i, new_tokens) -> bool or None, got {type(stop).__name__}")
        if seed is not None and check_count("seed", seed) >= 2**63:
            raise ValueError(f"seed={seed} must be < 2**63")
        stops = set(self.token_lists("stop_ids", [stop_ids], allow_empty=True)[0])
        prompts = self.token_lists("prompts", prompts)
        out: list[list[int]] = [[] for _ in prompts]
        if max_new_tokens == 0:
            return out
        generator = torch.Generator(device=self.device)
        if seed is None and self.backend.device_mesh is not None:  # the ranks must draw the same tokens
            from .parallel import shared_seed

            seed = shared_seed(self.backend.device_mesh)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)

        def consume(parts, logits):
            if not parts:
                return
            chosen = sample_tokens(logits[:len(parts)], temperature, top_p, generator, top_k).tolist()
            for (req, _, _), token in zip(parts, chosen):
                new = out[req.index]
                new.append(token)
                if len(new) < max_new_tokens and token not in stops and not (stop and stop(req.index, new)):
                    req.tokens.append(token)

        requests = [_Request(i, p[:], len(p) + max_new_tokens - 1) for i, p in enumerate(prompts)]
        self._serve("prompts (with max_new_tokens - 1 generated tokens)", requests, consume, every_row=False,
                    grows=True)
        return out

    @torch.no_grad()
    def warmup(self) -> None:
        """Run one step of every shape class a stream of requests can produce — one request of one
        row, one request of several rows, several requests, each with request, row and logit-row
        counts that differ — so that a compiled ``step_fn`` has traced its frame (counts are
        dynamic, 1 included: docs/compile.md, "Frames and the recompile limit") before real
        requests arrive. The steps run on throw-away requests, released afterwards (their rows
        start clean when admitted again); a class needing more request rows, or full or SWA pages
        (one of each a request), than are free is skipped (a one-request cache runs the first two)."""
        for counts, num_logits in (([1], 2), ([3], 2), ([3, 3], 3)):
            if any(len(counts) > free for free in self.free_capacity()):
                continue
            rows = []
            try:
                for _ in counts:
                    rows.append(self.admit())  # one at a time: a failing admit leaves the others released
                step = self.build_step(ForwardMode.EXTEND, dict(zip(rows, counts)))
                self.step_fn(*self._token_inputs(step, [0] * step.num_tokens, [0] * num_logits))
            finally:
                for row in rows:
                    self.release(row)

    # -- the serving loop ----------------------------------------------------------------------
    def _serve(self, name: str, requests: list[_Request], consume: Consume, *, every_row: bool,
               grows: bool = False) -> None:
        """Run ``requests`` to completion. After each step, ``consume(parts, logits)`` gets the logits
        of each request's fed rows at positions from its ``scored_from`` on (``every_row``), or of the
        last row of each request whose tokens are now all fed; a request with nothing left to feed
        afterwards is finished and released. ``grows``: ``consume`` may append a token to such a request (as
        ``generate`` does), which then goes on. Raises ``ValueError`` before any step if a request
        can never fit.

        While the device runs a step, the next one is planned and built before ``consume`` (which may
        wait for the device) reads the step's logits, and undone if ``consume`` ends a request early
        (:meth:`_consume_ahead`)."""
        free = self._check_capacity(name, requests)
        pending = deque(r for r in requests if r.left)
        running: list[_Request] = []
        ahead: tuple[list[tuple[_Request, int]], StepInputs] | None = None
        try:
            while pending or running:
                if ahead is None:
                    plan = self._plan(pending, running, free, [req.left for req in running])
                    step = self._build(plan)
                else:
                    plan, step = ahead
                ids, logit_rows, parts = self._step_inputs(plan, every_row)
                logits = self.run_step(step, ids, logit_rows)
                for req, n in plan:
                    req.fed += n
                ahead = self._consume_ahead(pending, running, free, grows, lambda: consume(parts, logits))
                self._finish([req for req in running if not req.left], running, free)
        finally:
            for req in running:
                self.release(req.row)

    def _consume_ahead(self, pending: deque[_Request], running: list[_Request], free: list[int], grows: bool,
                       consume: Callable[[], None]) -> tuple[list[tuple[_Request, int]], StepInputs] | None:
        """``consume()``, with the next step planned and built before it (``build_ahead``) as if every
        request whose tokens are all fed gets one more token while it is shorter than its final
        length (``grows``) and ends otherwise: those that end are released first, and waiting
        requests admitted as their capacity allows. If ``consume`` ends a request early (a stop
        token), the step is undone — the allocator's transaction, and the requests, queue and free
        capacity as they were — and None returned: the loop plans again. Returns ``(plan, step)``
        otherwise."""
        if not self.build_ahead:
            consume()
            return None
        foretold = [req.left or int(grows and len(req.tokens) < req.length) for req in running]
        was_pending, was_running, was_free = list(pending), running[:], free[:]
        consumed = False
        try:
            with self.allocator.transaction():
                self._finish([req for req, left in zip(running, foretold) if not left], running, free)
                plan = self._plan(pending, running, free, [left for left in foretold if left])
                if not plan:
                    raise _Unforeseen
                step = self._build(plan)
                consumed = True
                consume()
                if [req.left for req in was_running] != foretold:
                    raise _Unforeseen
        except BaseException as error:
            pending.clear()
            pending.extend(was_pending)
            running[:], free[:] = was_running, was_free
            if not isinstance(error, _Unforeseen):
                raise
            if not consumed:
                consume()
            return None
        return plan, step

    def _plan(self, pending: deque[_Request], running: list[_Request], free: list[int], left: list[int]
              ) -> list[tuple[_Request, int]]:
        """This step's ``(request, tokens)``, ``left[i]`` tokens to feed for ``running[i]``: decodes
        first, then prefill chunks of running requests, then newly admitted requests, within
        ``max_step_tokens``. ``free``: the rows and pages left beside the running requests'
        reservations (``[rows, full, swa]``), updated on admission."""
        budget, plan = self.max_step_tokens, []
        for req, n in sorted(zip(running, left), key=lambda entry: entry[1] > 1):
            n = min(n, budget)
            if n:
                plan.append((req, n))
                budget -= n
        while pending and budget and self._reserve(pending[0], free):
            req = pending.popleft()
            req.row = self.admit()
            running.append(req)
            plan.append((req, min(req.left, budget)))
            budget -= plan[-1][1]
        return plan

    def _build(self, plan: list[tuple[_Request, int]]) -> StepInputs:
        """The step of ``plan``: each request's row extended by its tokens."""
        return self.build_step(ForwardMode.EXTEND, {req.row: n for req, n in plan})

    def _finish(self, done: list[_Request], running: list[_Request], free: list[int]) -> None:
        """Release the requests ``done`` (of ``running``): their rows and pages back to ``free``."""
        for req in done:
            running.remove(req)
            self.release(req.row)
            free[:] = [f + n for f, n in zip(free, self._need(req))]

    def _need(self, req: _Request) -> tuple[int, int, int]:
        """The request row and pages ``req`` reserves: ``(1, full, swa)``."""
        return 1, *pages_needed(req.length, self.max_step_tokens, self.allocator.cache.config.max_draft_tokens)

    def _reserve(self, req: _Request, free: list[int]) -> bool:
        """Take ``req``'s reservation from ``free`` if it fits."""
        need = self._need(req)
        if any(n > f for n, f in zip(need, free)):
            return False
        free[:] = [f - n for f, n in zip(free, need)]
        return True

    def _check_capacity(self, name: str, requests: list[_Request]) -> list[int]:
        """The rows and pages free now (``[rows, full, swa]``); ``ValueError`` naming the first
        request that could not fit even alone."""
        cache, free = self.allocator.cache, self.free_capacity()
        for req in requests:
            if req.length > cache.max_seq_len:
                raise ValueError(f"{name}[{req.index}] needs {req.length} positions in the cache, more than its "
                                 f"max_seq_len={cache.max_seq_len}")
            need = self._need(req)
            if req.length and any(n > f for n, f in zip(need, free)):
                raise ValueError(f"{name}[{req.index}] needs a request row, {need[1]} full and {need[2]} SWA "
                                 f"pages; the cache has {free[0]}, {free[1]} and {free[2]} free")
        return free

    def free_capacity(self) -> list[int]:
        """``[request rows, full pages, SWA pages]`` free in the allocator now."""
        alloc = self.allocator
        return [alloc.cache.max_requests - len(alloc.active_rows), alloc.free_full_pages, alloc.free_swa_pages]

    def _step_inputs(self, plan: list[tuple[_Request, int]], every_row: bool
                     ) -> tuple[list[int], list[int], list[tuple[_Request, int, slice]]]:
        """``(input_ids, logit_rows, parts)`` of a step running ``plan``: the planned tokens and the
        rows whose logits ``consume`` gets (see :meth:`_serve`), before :meth:`run_step` pads them."""
        ids, rows, parts = [], [], []
        for req, n in plan:
            if every_row:
                if (first := max(req.fed, req.scored_from)) < req.fed + n:
                    parts.append((req, first, slice(len(rows), len(rows) + req.fed + n - first)))
                    rows += range(len(ids) + first - req.fed, len(ids) + n)
            elif n == req.left:
                parts.append((req, req.fed, slice(len(rows), len(rows) + 1)))
                rows.append(len(ids) + n - 1)
            ids += req.tokens[req.fed:req.fed + n]
        return ids, rows, parts

    def run_step(self, step: StepInputs, ids: list[int], logit_rows: list[int]) -> torch.Tensor:
        """``step_fn`` on ``step`` with the real rows' token ``ids`` (zeros on the padding rows) ->
        logits of ``logit_rows`` (then of row 0 for padding). The logit rows are padded to at least 2
        so that a compiled step is never specialised to one logit row, and, when the runner is
        ``bucketed``, to a token bucket size (as the step's rows are), so that their count takes few
        values: all the rows of a bucketed step are exactly its ``num_tokens``."""
        size = bucket(len(logit_rows), TOKEN_BUCKETS) if self.bucketed else len(logit_rows)
        logit_rows = logit_rows + [0] * (max(2, size) - len(logit_rows))
        ids = ids + [0] * (step.num_tokens - len(ids))
        return self.step_fn(*self._token_inputs(step, ids, logit_rows))

    def _token_inputs(self, step: StepInputs, ids: list[int], logit_rows: list[int]
                      ) -> tuple[torch.Tensor, StepInputs, torch.Tensor]:
        """``step_fn``'s arguments: ``ids`` and ``logit_rows`` as int64 tensors, one copy for both."""
        ids_t, rows_t = to_device(self.device, int64=[ids, logit_rows])
        return ids_t, step, rows_t

    @staticmethod
    def _counts(name: str, counts: Sequence[int], bounds: list[int]) -> list[int]:
        """``counts``, one per sequence, each in ``[0, bounds[i]]``; ``ValueError`` naming the first
        that is not."""
        if isinstance(counts, torch.Tensor) or not isinstance(counts, Sequence) or len(counts) != len(bounds):
            raise ValueError(f"{name} must be a sequence of {len(bounds)} counts, one per sequence")
        for i, (count, bound) in enumerate(zip(counts, bounds)):
            if check_count(f"{name}[{i}]", count) > bound:
                raise ValueError(f"{name}[{i}]={count} exceeds the sequence's {bound} tokens")
        return [int(c) for c in counts]

    def token_lists(self, name: str, sequences, *, allow_empty: bool = False) -> list[list[int]]:
        """``sequences`` (token sequences or 1-D integer tensors) as lists of ints in ``[0, vocab)``;
        ``TypeError`` / ``ValueError`` naming the first bad one."""
        if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
            raise TypeError(f"{name} must be a sequence of token sequences, got {type(sequences).__name__}")
        vocab, result = self.backend.vocab_size, []
        for i, seq in enumerate(sequences):
            label = f"{name}[{i}]" if name != "stop_ids" else name
            if isinstance(seq, torch.Tensor):
                if seq.dim() != 1 or seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
                    raise TypeError(f"{label} must be a 1-D integer tensor, got {seq.dtype} {tuple(seq.shape)}")
                seq = seq.tolist()
            try:
                tokens = [operator.index(t) for t in seq]
            except TypeError:
                raise TypeError(f"{label} must hold integer token ids") from None
            if not tokens and not allow_empty:
                raise ValueError(f"{label} is empty")
            if any(not 0 <= t < vocab for t in tokens):
                raise ValueError(f"{label}: token ids must lie in [0, {vocab})")
            result.append(tokens)
        return result
