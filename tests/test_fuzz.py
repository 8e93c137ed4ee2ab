"""Property-based fuzz of the serving path (hypothesis, derandomized: the same examples every run).

Random histories — admit, steps in every mode (extend, decode, target verify with random
acceptance, draft extend, idle; unpadded, bucketed or padded further), truncate (within the draft
limit, and beyond it: refused), free, evict — on the tiny config with small pools, so pages run
out, are evicted and are reused. After every action:

* the allocator against a model of the request lengths, and its index maps against its pages
  (``tests/support/allocator_checks.py``); a step that does not fit changes nothing;
* the step's metadata: ``build_step_metadata`` (the ops as the stack calls them) equals the
  reference of the whole chain; the Triton metadata kernels equal it too (run in a subprocess
  under ``TRITON_INTERPRET=1`` on a CPU machine, natively with CUDA);
* with a forward (:func:`test_serving_fuzz`): every layer's outputs against the oracle on the
  inputs that layer saw, and nothing outside the step's own slots changes (every buffer is
  snapshotted before the step); at the end, every live request's cache contents against the oracle.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dsv4_compile import (DSV4AttentionStack, DSV4AttnConfig, DSV4Cache, ForwardMode, OutOfPagesError, StepInputs,
                          build_step_metadata)
from dsv4_compile.engine import Engine
from dsv4_compile.metadata_chain import CHAIN_OPS, FIELD_NAMES, FIELDS, named, run_chain
from dsv4_compile.reference import metadata as reference
from dsv4_compile.testing.oracle_recorder import OracleRecorder, make_engine
from tests.support.allocator_checks import assert_allocator_consistent
from tests.support.cache_checks import INDEX_MAPS, allocator_state, assert_unchanged, snapshot
from tests.support.oracle_asserts import LAYER_RTOL, assert_cache_matches
from tests.support.step_footprint import assert_only_footprint_changed, step_footprint

TARGET = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)
DRAFT = TARGET.with_(compress_ratios=(0,))
MAX_DRAFT = TARGET.max_draft_tokens
M = ForwardMode
CHUNKS = (1, 3, 4, 13, 64, 127, 130, 200, 257)  # prefill chunk sizes, around 4 / 128 / 256
# lengths where behaviour changes: c128 window and SWA window, page, first SWA eviction (383 + draft)
BOUNDARIES = (128, 256, 383 + MAX_DRAFT, 512)
ACTIONS = ("admit",) * 2 + ("step",) * 6 + ("truncate",) * 2 + ("free", "evict")  # weighted by repetition
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_MAX_ROWS = 16  # steps the Triton kernels check (the interpreter runs ~30 ms per row)
FUZZ = dict(deadline=None, derandomize=True, database=None, print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class History:
    """Draws and applies one random history to ``engine``, checking as it goes. With a
    ``recorder`` steps run the stack (fed by it) instead of only being built, at most
    ``row_budget`` token rows in all; ``kernels``: the chain's ops by name (and a ``device``)
    whose metadata must equal the reference."""

    def __init__(self, data, engine: Engine, *, recorder: OracleRecorder | None = None, kernels=None,
                 row_budget: int = 10**9):
        self.data, self.engine, self.recorder, self.kernels = data, engine, recorder, kernels
        self.alloc, self.cache, self.config = engine.allocator, engine.stack.cache, engine.stack.config
        self.lengths: dict[int, int] = {}  # the model: row -> length
        self.longest: dict[int, int] = {}  # row -> longest length reached
        self.rows_left = row_budget  # forward rows this history may still run
        self.watched = None if recorder is not None else INDEX_MAPS  # without a forward only these change
        if recorder is not None:
            engine.forward = self._checked_forward

    def draw(self, strategy):
        return self.data.draw(strategy)

    def run(self, num_actions: int) -> None:
        """Admit requests and prefill them, then ``num_actions`` random actions."""
        for _ in range(self.draw(st.integers(1, self.cache.max_requests))):
            self.admit()
        self.step(M.EXTEND)
        for _ in range(num_actions):
            action = self.draw(st.sampled_from(ACTIONS))
            getattr(self, action)()
            assert_allocator_consistent(self.alloc, self.lengths)

    # -- allocator actions ---------------------------------------------------------------------
    def admit(self) -> None:
        if len(self.lengths) == self.cache.max_requests:
            event("admit refused: no free row")
            self._refused(OutOfPagesError, self.engine.admit)
            return
        row = self.engine.admit()
        self.lengths[row], self.longest[row] = 0, 0

    def free(self) -> None:
        if self.lengths:
            row = self.draw(st.sampled_from(sorted(self.lengths)))
            self.engine.release(row)
            del self.lengths[row], self.longest[row]

    def evict(self) -> None:
        if self.lengths:
            if self.alloc.evict_swa(self.draw(st.sampled_from(sorted(self.lengths)))):
                event("SWA page evicted")

    def truncate(self) -> None:
        if not self.lengths:
            return
        row = self.draw(st.sampled_from(sorted(self.lengths)))
        new_len = max(0, self.lengths[row] - self.draw(st.integers(0, MAX_DRAFT + 2)))
        if new_len < self.longest[row] - MAX_DRAFT:
            event("truncate refused: deeper than max_draft_tokens")
            self._refused(ValueError, self.alloc.truncate, row, new_len)
            return
        self.alloc.truncate(row, new_len)
        self.lengths[row] = new_len

    def _refused(self, exc: type[Exception], fn, *args) -> None:
        """``fn(*args)`` raises ``exc`` and changes neither the allocator nor any cache buffer."""
        before, state = snapshot(self.cache, self.watched), allocator_state(self.alloc)
        with pytest.raises(exc):
            fn(*args)
        assert_unchanged(before, self.cache, f"a refused {fn.__name__}")
        assert allocator_state(self.alloc) == state

    # -- steps ---------------------------------------------------------------------------------
    def step(self, mode: ForwardMode | None = None) -> None:
        """A step of ``mode`` (default: drawn) over a random subset of the requests."""
        speculative = M.TARGET_VERIFY if any(self.config.compress_ratios) else M.DRAFT_EXTEND
        mode = mode or self.draw(st.sampled_from([M.EXTEND, M.EXTEND, M.DECODE, speculative, speculative, M.IDLE]))
        if mode is M.IDLE:
            self._idle(self.draw(st.integers(0, 5)))
            return
        tokens = self._tokens(mode)
        pad = self._padding(len(tokens), sum(tokens.values()))
        try:
            outputs = self._run(mode, tokens, pad)
        except OutOfPagesError:  # the whole step was refused: _run checked nothing changed
            event(f"{mode.value} step refused: out of pages")
            return
        longest = max(self.lengths.values(), default=0)
        event(f"{mode.value} step, longest request in [{longest // 128 * 128}, {longest // 128 * 128 + 128})")
        for row, n in tokens.items():
            self.lengths[row] += n
            self.longest[row] = max(self.longest[row], self.lengths[row])
        if self.recorder is not None and any(tokens.values()):
            self._check_layers([row for row, n in tokens.items() if n])
        if mode is M.TARGET_VERIFY:
            for row, n in tokens.items():
                accepted = self.draw(st.integers(0, n))
                self.engine.accept(row, accepted, n)
                self.lengths[row] -= n - accepted

    def _tokens(self, mode: ForwardMode) -> dict[int, int]:
        """New tokens per request of a ``mode`` step (requests in a random order)."""
        rows = self.draw(st.permutations(sorted(self.lengths)))
        rows = rows[:self.draw(st.integers(min(1, len(rows)), len(rows)))]
        tokens = {}
        for row in rows:
            room = min(self.cache.max_seq_len - self.lengths[row], self.rows_left)
            if mode is M.EXTEND:
                n = self._chunk(self.lengths[row])
            elif mode is M.DECODE:
                n = 1
            else:
                n = self.draw(st.integers(0, MAX_DRAFT))
            tokens[row] = min(n, room)
            self.rows_left -= tokens[row]
        return tokens

    def _chunk(self, length: int) -> int:
        """A prefill chunk: a size from CHUNKS, or one that ends a few tokens around a boundary."""
        if self.draw(st.booleans()):
            return self.draw(st.sampled_from(CHUNKS))
        end = self.draw(st.sampled_from(BOUNDARIES)) + self.draw(st.integers(-MAX_DRAFT - 2, 2))
        return max(1, end - length)

    def _padding(self, num_requests: int, num_tokens: int) -> dict[str, int]:
        kind = self.draw(st.sampled_from(("none", "bucket", "more")))
        self.engine.bucketed = kind == "bucket"
        if kind != "more":
            return {}
        return dict(pad_requests=num_requests + self.draw(st.integers(0, 2)),
                    pad_tokens=num_tokens + self.draw(st.integers(0, 5)))

    def _run(self, mode: ForwardMode, tokens: dict[int, int], pad: dict[str, int]) -> dict[int, torch.Tensor]:
        """Build the step (and, with a recorder, run it); a step that does not fit must leave the
        allocator and every buffer as they were."""
        before, state = snapshot(self.cache, self.watched), allocator_state(self.alloc)
        try:
            if self.recorder is not None:
                return self.recorder.run(mode, tokens, **pad)
            self._check_metadata(self.engine.build_step(mode, tokens, **pad))
            return {}
        except OutOfPagesError:
            assert_unchanged(before, self.cache, "a step that did not fit")
            assert allocator_state(self.alloc) == state
            raise

    def _idle(self, num_tokens: int) -> None:
        if self.recorder is None:
            self._check_metadata(StepInputs.idle(num_tokens))
            return
        out = self.engine.idle(num_tokens)
        assert torch.equal(out, torch.zeros_like(out)), "an idle step's outputs are not zero"

    def _checked_forward(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """The stack's forward, checking the step's metadata first and, after it, that the step
        changed nothing outside its own slots."""
        self._check_metadata(step)
        before, footprint = snapshot(self.cache), step_footprint(self.cache, step)
        out = self.engine.stack(x, step)
        assert_only_footprint_changed(before, self.cache, footprint, f"a step ({step.mode.value})")
        return out

    def _check_metadata(self, step: StepInputs) -> None:
        """``build_step_metadata`` (and ``self.kernels``, chained and fused) equal the reference of
        the whole chain, field by field (the kernels on steps of at most ``KERNEL_MAX_ROWS`` rows); the
        ratio-r fields exist exactly where the stack needs them."""
        maps = (self.cache.req_to_token, self.cache.req_to_page, self.cache.full_to_swa)
        topk = self.config.index_topk
        want = named(reference.step_metadata(*step.tensors(), *maps, topk))
        got = build_step_metadata(step, self.cache, self.config)
        ratios = set(self.config.compress_ratios) if step.mode.needs_compress else set()
        built = {f.name for f in FIELDS if not f.ratio or f.ratio in ratios}
        assert {name for name in FIELD_NAMES if getattr(got, name) is not None} == built
        for name in built:
            assert torch.equal(getattr(got, name), want[name]), f"build_step_metadata: {name} differs"
        assert torch.equal(got.positions, want["seq_lens_causal"] - 1)
        if self.kernels is not None and step.num_tokens <= KERNEL_MAX_ROWS:
            event("metadata kernels checked")
            device = self.kernels.device
            args = [t.to(device) for t in (*step.tensors(), *maps)]
            chained = run_chain(self.kernels, *args, topk)
            fused = named(self.kernels.step_metadata(*args, topk))
            for name, value in want.items():
                assert torch.equal(chained[name].cpu(), value), f"the {name} kernel differs from the reference"
                assert torch.equal(fused[name].cpu(), value), f"fused step_metadata: {name} differs"

    def _check_layers(self, rows: list[int]) -> None:
        """Each layer's outputs of this step against the oracle on the inputs that layer saw."""
        for i, err in enumerate(self.recorder.layer_errors(rows)):
            assert err <= LAYER_RTOL, f"layer {i} outputs differ from the oracle by {err:.4f} (relative)"


def _bare_engine(config: DSV4AttnConfig) -> Engine:
    """An engine over small pools (3 requests of up to 2 pages, 4 full and 3 SWA pages to share),
    its stack unused (metadata only)."""
    cache = DSV4Cache(config, max_requests=3, max_seq_len=512, num_full_pages=5, num_swa_pages=4)
    return Engine(DSV4AttentionStack(config, cache))


@settings(max_examples=80, **FUZZ)
@given(data=st.data(), config=st.sampled_from([TARGET, DRAFT]))
def test_allocator_and_metadata_fuzz(data, config):
    History(data, _bare_engine(config)).run(30)


def _metadata_kernels(device: str) -> types.SimpleNamespace:
    """The Triton launchers of the chain's ops and of ``step_metadata``, by op name."""
    from dsv4_compile.ops.kernels import metadata as kernels
    ops = {op: getattr(kernels, f"launch_{op}") for op in (*CHAIN_OPS, "step_metadata")}
    return types.SimpleNamespace(device=device, **ops)


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                    reason="the Triton kernels need TRITON_INTERPRET=1 (test_metadata_kernels_fuzz_under_interpreter "
                           "runs this in a subprocess) or CUDA")
@settings(max_examples=15, **FUZZ)
@given(data=st.data(), config=st.sampled_from([TARGET, DRAFT]))
def test_metadata_kernels_fuzz(data, config):
    History(data, _bare_engine(config), kernels=_metadata_kernels("cpu" if INTERPRET else "cuda")).run(20)


@pytest.mark.skipif(INTERPRET or torch.cuda.is_available(), reason="test_metadata_kernels_fuzz runs directly")
def test_metadata_kernels_fuzz_under_interpreter():
    """``test_metadata_kernels_fuzz`` in a fresh process with ``TRITON_INTERPRET=1`` (the variable
    is read when the kernels are decorated, so it must be set before Triton is imported)."""
    pytest.importorskip("triton")
    root = Path(__file__).parent.parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{Path(__file__).relative_to(root)}::test_metadata_kernels_fuzz"],
                          env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]


@settings(max_examples=40, **FUZZ)
@given(data=st.data(), config=st.sampled_from([TARGET, DRAFT]))
def test_serving_fuzz(data, config):
    """Two requests sharing two full and two SWA pages: a request's second page is refused while the
    other holds one."""
    engine, recorder = make_engine(config, max_requests=2, max_seq_len=512, num_full_pages=3, num_swa_pages=3)
    history = History(data, engine, recorder=recorder, row_budget=400)
    with torch.no_grad():
        history.run(10)
        assert_cache_matches(recorder, [row for row, n in history.lengths.items() if n])
