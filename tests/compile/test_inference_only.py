"""A step under autograd is refused at the entry with an error naming torch.no_grad() /
torch.inference_mode(): eagerly, while torch.compile traces the stack, and through compile_step
(its host-side entry). Without grad mode, or with nothing requiring grad, steps run."""

import pytest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.compile import compile_step
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.cache_checks import snapshot
from tests.support.compile_checks import GraphCapture, fresh_compile_state

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64, compress_ratios=(4,))
ADVICE = r"torch\.no_grad\(\) or torch\.inference_mode\(\)"


def _decode(eng, rec):
    """A valid decode step ``(x, step)`` of the engine's first request (allocated, not run)."""
    row = eng.allocator.active_rows[0]
    step = eng.build_step(ForwardMode.DECODE, {row: 1})
    return eng.pack_inputs(step, rec.draw({row: 1}).values()), step


@pytest.fixture
def engine():
    eng, rec = make_engine(TINY, max_requests=2, max_seq_len=256, capture_layers=False)
    with torch.no_grad():
        rec.run(ForwardMode.EXTEND, {eng.admit(): 20})
    return eng, rec


@pytest.mark.parametrize("how", ["eager", "torch.compile", "compile_step"])
def test_step_under_autograd_is_refused_before_anything_is_written(engine, how):
    eng, rec = engine
    x, step = _decode(eng, rec)
    forward = {"eager": eng.stack,
               "torch.compile": torch.compile(eng.stack, backend=GraphCapture("eager"), fullgraph=True),
               "compile_step": compile_step(eng.stack, backend=GraphCapture("eager"))}[how]
    before = snapshot(eng.stack.cache)
    with fresh_compile_state(), pytest.raises(RuntimeError, match=ADVICE):  # under Dynamo: in its message
        forward(x, step)
    after = snapshot(eng.stack.cache)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_input_requiring_grad_is_refused_too(engine):
    eng, rec = engine
    eng.stack.requires_grad_(False)
    x, step = _decode(eng, rec)
    with pytest.raises(RuntimeError, match=ADVICE):
        eng.stack(x.requires_grad_(), step)


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode, None])
def test_steps_run_without_autograd(engine, context):
    """Under no_grad / inference_mode, or with grad mode on but nothing requiring grad; compiled
    and eager agree."""
    eng, rec = engine
    if context is None:
        eng.stack.requires_grad_(False)
    x, step = _decode(eng, rec)
    with fresh_compile_state(), (context or torch.enable_grad)():
        out = compile_step(eng.stack, backend=GraphCapture("eager"))(x, step)
    assert out.shape == x.shape and not out.requires_grad and torch.isfinite(out).all()


def test_parameter_requiring_grad_after_compile_step_is_refused(engine):
    """compile_step holds the stack's parameters from when it was built: a parameter switched to
    ``requires_grad`` later is still refused at the host-side entry, nothing written."""
    eng, rec = engine
    eng.stack.requires_grad_(False)
    x, step = _decode(eng, rec)
    fn = compile_step(eng.stack, backend=GraphCapture("eager"))
    next(eng.stack.parameters()).requires_grad_(True)
    before = snapshot(eng.stack.cache)
    with fresh_compile_state(), pytest.raises(RuntimeError, match=ADVICE):
        fn(x, step)
    after = snapshot(eng.stack.cache)
    assert all(torch.equal(before[k], after[k]) for k in before)
