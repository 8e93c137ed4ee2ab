"""compile_step: how it merges torch.compile's arguments with what a step needs, and the number of
Dynamo frames a full serving mix takes under torch's default Dynamo config (docs/compile.md,
"compile_step" and "Frames and the recompile limit")."""

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from dsv4_compile import DSV4AttnConfig, ForwardMode, StepInputs
from dsv4_compile.compile import MAX_FRAMES, STEP_GRAPHS, compile_options, compile_step
from dsv4_compile.fx_passes import DSV4PassManager
from dsv4_compile.model import enable
from dsv4_compile.runner import ModelRunner
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.compile.serving_mix import ShapeLog, run_draft_mix, run_target_mix
from tests.support.compile_checks import GraphCapture, fresh_compile_state, graph_breaks
from tests.support.hf_model import tiny_hf_model
from tests.support.oracle_asserts import assert_outputs_match

M = ForwardMode
TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64, compress_ratios=(4, 128))
DRAFT = TINY.with_(compress_ratios=(0,))
CG, PASS, PRE_PASS = "triton.cudagraphs", "post_grad_custom_post_pass", "pre_grad_custom_pass"


@pytest.mark.parametrize("mode, options, cuda_graphs, want", [
    (None, None, None, {CG: True}),
    ("default", None, None, {CG: True}),
    ("reduce-overhead", None, None, {CG: True}),
    ("reduce-overhead", {"epilogue_fusion": False}, None, {CG: True, "epilogue_fusion": False}),
    ("max-autotune", None, None, {CG: True, "max_autotune": True, "coordinate_descent_tuning": True}),
    ("max-autotune-no-cudagraphs", None, None,
     {CG: False, "max_autotune": True, "coordinate_descent_tuning": True}),
    ("max-autotune-no-cudagraphs", None, False, {CG: False, "max_autotune": True, "coordinate_descent_tuning": True}),
    (None, {CG: False}, None, {CG: False}),
    (None, {CG: False}, False, {CG: False}),
    (None, {"max_autotune": True}, True, {CG: True, "max_autotune": True}),
    ("reduce-overhead", {CG: False}, None, {CG: False}),  # options refine the mode
])
def test_compile_options_merge_mode_options_and_ours(mode, options, cuda_graphs, want):
    passes = DSV4PassManager([])
    got = compile_options(mode, options, cuda_graphs, passes)
    assert got.pop(PASS) is passes
    assert got.pop(PRE_PASS).manager is passes  # the same passes' pre-grad stage
    assert got == want
    assert isinstance(compile_options(mode, options, cuda_graphs)[PASS], DSV4PassManager)  # default: every pass


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "reduce-overhead", "cuda_graphs": False}, "contradicts"),
    ({"mode": "max-autotune-no-cudagraphs", "cuda_graphs": True}, "contradicts"),
    ({"options": {CG: True}, "cuda_graphs": False}, "contradicts"),
    ({"options": {PASS: DSV4PassManager([])}}, "passes="),
    ({"options": {PRE_PASS: DSV4PassManager([]).pre_grad_stage()}}, "passes="),
    ({"mode": "fast"}, "mode='fast'"),
])
def test_compile_options_refuse_contradictions(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compile_options(**kwargs)


def test_inductor_settings_with_another_backend_are_refused():
    eng, _ = make_engine(TINY, max_requests=1, max_seq_len=256, capture_layers=False)
    for kwargs in ({"cuda_graphs": True}, {"passes": DSV4PassManager()}):
        with pytest.raises(ValueError, match="Inductor settings"):
            compile_step(eng.stack, backend="eager", **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"cuda_graphs": "trees"}, "cuda_graphs='trees'"),
    ({"cuda_graphs": 1}, "cuda_graphs=1"),
    ({"cuda_graphs": STEP_GRAPHS, "mode": "max-autotune-no-cudagraphs"}, "contradicts"),
    ({"cuda_graphs": STEP_GRAPHS, "options": {CG: False}}, "contradicts"),
])
def test_bad_cuda_graphs_are_refused(kwargs, match):
    eng, _ = make_engine(TINY, max_requests=1, max_seq_len=256, capture_layers=False)
    with pytest.raises(ValueError, match=match):
        compile_step(eng.stack, **kwargs)


@torch.no_grad()
def test_step_graphs_on_a_cpu_stack_run_the_compiled_step_as_is():
    """cuda_graphs="step" is accepted by any backend; on a CPU stack there is nothing to capture:
    no StepGraphs, and the step's outputs are those of the eager stack."""
    eng, rec = make_engine(TINY, max_requests=2, max_seq_len=256, capture_layers=False)
    row = eng.admit()
    rec.run(M.EXTEND, {row: 30})
    with fresh_compile_state():
        step_fn = compile_step(eng.stack, backend="eager", cuda_graphs=STEP_GRAPHS)
        assert step_fn.graphs is None
        eng.forward = step_fn
        for _ in range(3):
            assert_outputs_match(rec, rec.run(M.DECODE, {row: 1}))


@torch.no_grad()
def test_every_mode_traces_the_same_graph():
    """What lets compile_step hand Dynamo one mode: on a given stack every mode traces the same
    graph for the same shapes (DRAFT_EXTEND, valid only on an SWA-only stack, included there)."""
    for config, modes in ((TINY, (M.EXTEND, M.DECODE, M.TARGET_VERIFY, M.IDLE)), (DRAFT, (M.EXTEND, M.DRAFT_EXTEND))):
        eng, rec = make_engine(config, max_requests=2, max_seq_len=256, capture_layers=False)
        rows = [eng.admit(), eng.admit()]
        rec.run(M.EXTEND, {r: 9 for r in rows})
        step = eng.build_step(M.DECODE, {r: 1 for r in rows})
        x = torch.zeros(2, config.hidden_size, dtype=torch.bfloat16)
        capture = GraphCapture("eager")
        with fresh_compile_state():
            compiled = torch.compile(eng.stack, backend=capture, fullgraph=True, dynamic=True)
            for mode in modes:
                compiled(x, StepInputs(mode, *step.tensors()))
        assert capture.frame_count == len(modes)
        codes = [gm.code for gm in capture.graphs]
        assert all(code == codes[0] for code in codes[1:]), [m.value for m in modes]


@torch.no_grad()
def test_serving_mix_stays_within_the_frame_bound_with_default_config():
    """The whole mix (every mode, batch 1 and bucketed sizes, idle, a draft stack beside the
    target) through compile_step with torch's default Dynamo config: no graph break, one frame
    per class of MAX_FRAMES touched (idle or not), not one per request / token-count class (six for
    the target: one request and one token row are no frame of their own)."""
    assert torch._dynamo.config.recompile_limit == 8, "the test must run with torch's default limit"
    results = {}
    with fresh_compile_state():
        for name, config, mix in (("target", TINY, run_target_mix), ("draft", DRAFT, run_draft_mix)):
            eng, rec = make_engine(config, max_requests=4, max_seq_len=512, capture_layers=False)
            eng.bucketed = True
            capture = GraphCapture("eager")
            eng.forward = log = ShapeLog(compile_step(eng.stack, backend=capture))
            mix(eng, rec, lambda *_: None)
            results[name] = (capture.frame_count, len(log.classes()))
            assert_outputs_match(rec, rec.run(M.DECODE, {1: 1}))
        assert graph_breaks() == 0
    print(f"frames (compiled, classes touched): {results}")
    assert results == {"target": (2, 6), "draft": (2, 4)}
    assert all(frames <= MAX_FRAMES for frames, _ in results.values())


def _guard_lines(step_fn) -> list[int]:
    """Lines of each compiled frame's guard tree (Dynamo's cache entries of the step's code)."""
    entries = _debug_get_cache_entry_list(step_fn.compiled._torchdynamo_orig_callable.__code__)
    return [len(str(entry.guard_manager).splitlines()) for entry in entries]


@torch.no_grad()
def test_without_model_guards_the_mix_compiles_the_same_frames_and_matches_the_oracle():
    """model_guards=False keeps the guards on the step's inputs: the serving mix still compiles
    one frame per class (new shapes are noticed) and every step matches the oracle, while each
    frame's guard tree shrinks to less than half of what it is with every guard."""
    lines = {}
    with fresh_compile_state():
        for model_guards in (True, False):
            eng, rec = make_engine(TINY, max_requests=4, max_seq_len=512, capture_layers=False)
            eng.bucketed = True
            capture = GraphCapture("eager")
            step_fn = compile_step(eng.stack, backend=capture, model_guards=model_guards)
            eng.forward = log = ShapeLog(step_fn)
            run_target_mix(eng, rec, assert_outputs_match)
            assert (capture.frame_count, len(log.classes())) == (2, 6)
            lines[model_guards] = _guard_lines(step_fn)
    assert len(lines[False]) == len(lines[True]) == 2
    assert all(2 * n < m for n, m in zip(lines[False], lines[True])), lines


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@torch.no_grad()
def test_model_step_without_model_guards_equals_the_eager_backend():
    """On a transformers model (most of whose guards are on its modules) the step compiled without
    model guards scores as the eager backend does, in as many frames, with a far smaller guard tree."""
    backend = enable(tiny_hf_model(), max_requests=4, max_seq_len=512)
    sequences = [list(range(1, 40)), [7] * 3, list(range(100, 400))]
    want = ModelRunner(backend).score(sequences)
    lines = {}
    with fresh_compile_state():
        for model_guards in (True, False):
            step_fn = compile_step(backend, backend="eager", model_guards=model_guards)
            runner = ModelRunner(backend, step_fn=step_fn)
            runner.warmup()
            for got, expected in zip(runner.score(sequences), want):
                assert torch.equal(got, expected)
            lines[model_guards] = _guard_lines(step_fn)
    assert len(lines[False]) == len(lines[True]) == 1
    assert all(5 * n < m for n, m in zip(lines[False], lines[True])), lines


@torch.no_grad()
def test_strided_inputs_compile_no_frame_of_their_own():
    """A model step handed its token ids as a column of a token matrix (stride > 1, as a decode
    loop's ``tokens[:, -1]``) after a call with contiguous ids: the same frame, the eager values."""
    backend = enable(tiny_hf_model(), max_requests=2, max_seq_len=256)
    rows = [backend.allocator.admit(), backend.allocator.admit()]
    prompt = StepInputs.make(M.EXTEND, rows, [8, 8], [8, 8], torch.cat([backend.allocator.extend(r, 8) for r in rows]))
    backend(torch.arange(16) + 3, prompt, torch.tensor([7, 15]))
    tokens = torch.tensor([[11, 12, 13], [21, 22, 23]])
    decode = [StepInputs.make(M.DECODE, rows, [9 + i, 9 + i], [1, 1], torch.cat([backend.allocator.extend(r, 1)
                                                                             for r in rows])) for i in range(2)]
    saved = [t.clone() for t in backend.cache.buffers()]
    logit_rows = torch.arange(2)
    want = [backend(tokens[:, i].contiguous(), step, logit_rows) for i, step in enumerate(decode)]
    for t, s in zip(backend.cache.buffers(), saved):
        t.copy_(s)
    capture = GraphCapture("eager")
    with fresh_compile_state():
        step_fn = compile_step(backend, backend=capture)
        got = [step_fn(tokens[:, i].contiguous() if i == 0 else tokens[:, i], step, logit_rows)
               for i, step in enumerate(decode)]
    assert not tokens[:, 1].is_contiguous() and capture.frame_count == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
