"""Device-side checks of a compiled step (dsv4_compile/device_checks.py): off by default with the
traced graph unchanged; on, a bad step under torch.compile fails with a message naming the field
before the step writes anything (CPU: torch._assert_async raises)."""

import os
import re
import subprocess
import sys

import pytest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode, StepInputs
from dsv4_compile.compile import compile_step
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.cache_checks import snapshot
from tests.support.compile_checks import GraphCapture, fresh_compile_state

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64, compress_ratios=(4, 128))
ASSERTS = ("aten._assert_async.msg", "aten._assert_scalar.default")


def _engine():
    eng, rec = make_engine(TINY, max_requests=3, max_seq_len=512, capture_layers=False)
    rows = [eng.admit(), eng.admit()]
    with torch.no_grad():
        rec.run(ForwardMode.EXTEND, {rows[0]: 30, rows[1]: 9})
    return eng, rec, rows


def _decode(eng, rec, rows):
    step = eng.build_step(ForwardMode.DECODE, {r: 1 for r in rows})
    return eng.pack_inputs(step, rec.draw({r: 1 for r in rows}).values()), step


def _replace(step: StepInputs, **tensors) -> StepInputs:
    values = dict(zip(("req_rows", "seq_lens", "extend_lens", "out_cache_loc"), step.tensors())) | tensors
    return StepInputs(step.mode, **values)


def _traced_nodes(device_checks):
    eng, rec, rows = _engine()
    capture = GraphCapture("eager")
    with torch.no_grad(), fresh_compile_state():
        compile_step(eng.stack, backend=capture, device_checks=device_checks)(*_decode(eng, rec, rows))
    return [str(n.target) for n in capture.graphs[-1].graph.nodes if n.op == "call_function"]


def test_off_by_default_and_the_graph_is_unchanged():
    plain, off, on = _traced_nodes(None), _traced_nodes(False), _traced_nodes(True)
    assert plain == off
    assert not any("assert" in n or "_check" in n for n in off)
    assert [n for n in on if n not in off], "device checks added nothing to the graph"


BAD = {  # name: (what to change, the message expected)
    "req_rows": (lambda s: {"req_rows": s.req_rows + 10}, "step.req_rows: a row outside"),
    "seq_lens": (lambda s: {"seq_lens": s.seq_lens + 1000}, "step.extend_lens / seq_lens"),
    "extend_lens": (lambda s: {"extend_lens": s.extend_lens + 1}, "step.extend_lens: they sum to more"),
    "out_cache_loc": (lambda s: {"out_cache_loc": s.out_cache_loc + 10**7}, "step.out_cache_loc: a real row's"),
    "unmapped slot": (lambda s: {"out_cache_loc": s.out_cache_loc + 1}, "req_to_token does not map"),
    "dummy row": (lambda s: {"req_rows": torch.zeros_like(s.req_rows)}, "the dummy row 0 has tokens"),
    "row twice": (lambda s: {"req_rows": s.req_rows[:1].repeat(2)}, "a request row appears twice"),
}


@pytest.fixture(scope="module")
def checked():
    """An engine and its step compiled once with device checks by Inductor, after a good step
    ran through it."""
    eng, rec, rows = _engine()
    with torch.no_grad(), fresh_compile_state():
        step_fn = compile_step(eng.stack, device_checks=True)
        step_fn(*_decode(eng, rec, rows))
        yield eng, rec, rows, step_fn


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_step_fails_inside_the_compiled_step(checked, bad):
    eng, rec, rows, step_fn = checked
    x, step = _decode(eng, rec, rows)
    change, message = BAD[bad]
    step = _replace(step, **change(step))
    before = snapshot(eng.stack.cache)
    with torch.no_grad(), pytest.raises(RuntimeError, match=re.escape(message)):
        step_fn(x, step)
    after = snapshot(eng.stack.cache)
    assert all(torch.equal(before[k], after[k]) for k in before), f"{bad}: the cache changed"


def test_environment_switch_turns_them_on_at_import():
    code = ("import dsv4_compile.device_checks as d, dsv4_compile.compile as c; "
            "print(d.ENABLED_BY_ENV, c.ENABLED_BY_ENV)")
    env = dict(os.environ, DSV4_DEVICE_CHECKS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]
