"""A mixed serving schedule for the frame-count tests (CPU here, reduce-overhead on the GPU):
every forward mode, batch 1 and bucketed batch sizes, on a target stack and an SWA-only draft
stack, touching each request-count / token-count class that a compiled step specialises on
(docs/compile.md, "Frames and the recompile limit") with as few steps as that takes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsv4_compile import ForwardMode
from dsv4_compile.engine import Engine
from dsv4_compile.step import StepInputs
from dsv4_compile.testing.oracle_recorder import OracleRecorder

M = ForwardMode
Check = Callable[[OracleRecorder, dict[int, torch.Tensor]], object]


class ShapeLog:
    """Wraps an engine's forward and records the ``(requests, token rows)`` of every step."""

    def __init__(self, forward):
        self.forward = forward
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        self.shapes.append((step.batch_size, step.num_tokens))
        return self.forward(x, step)

    def classes(self) -> set[tuple[int, int]]:
        """The 0 / 1 / many classes of the shapes seen: the frames Dynamo's 0/1 size specialisation
        would make of them."""
        return {(min(b, 2), min(t, 2)) for b, t in self.shapes}


def run_target_mix(engine: Engine, recorder: OracleRecorder, check: Check) -> None:
    """Extend, decode, verify (uniform and ragged, drafts rolled back), idle; ``check`` sees the
    outputs of every step with requests. Shapes with a bucketed engine in the comments."""
    a = engine.admit()
    check(recorder, recorder.run(M.EXTEND, {a: 300}))                  # batch-1 prefill: 1 x 320
    check(recorder, recorder.run(M.DECODE, {a: 1}))                    # batch-1 decode: 1 x 1
    b, c = engine.admit(), engine.admit()
    check(recorder, recorder.run(M.EXTEND, {b: 70, c: 20}))            # 2 x 96
    check(recorder, recorder.run(M.DECODE, {a: 1, b: 1, c: 1}))        # 4 x 4 (one padded request)
    check(recorder, recorder.run(M.TARGET_VERIFY, {a: 3, b: 3, c: 3}))  # 4 x 16
    for row, accepted in ((a, 1), (b, 3), (c, 0)):
        engine.accept(row, accepted, 3)
    check(recorder, recorder.run(M.TARGET_VERIFY, {a: 1, b: 4}))       # ragged: 2 x 8
    engine.accept(a, 1, 1), engine.accept(b, 2, 4)
    engine.idle(1), engine.idle(4)                                     # 0 x 1, 0 x 4
    check(recorder, recorder.run(M.DECODE, {a: 1}, pad_requests=2))    # 2 x 1
    check(recorder, recorder.run(M.DECODE, {a: 1, b: 1, c: 1}))        # 4 x 4 again


def run_draft_mix(engine: Engine, recorder: OracleRecorder, check: Check) -> None:
    """The draft stack's steps: prefill, draft extend at batch 1 and 2, a draft decode, idle."""
    d, e = engine.admit(), engine.admit()
    check(recorder, recorder.run(M.EXTEND, {d: 300, e: 20}))           # 2 x 320
    check(recorder, recorder.run(M.DRAFT_EXTEND, {d: 2}))              # 1 x 2
    check(recorder, recorder.run(M.DRAFT_EXTEND, {d: 2, e: 3}))        # 2 x 8
    check(recorder, recorder.run(M.DECODE, {d: 1}))                    # 1 x 1
    engine.idle(2)                                                     # 0 x 2
