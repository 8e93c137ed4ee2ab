"""The exact function served on GPU — compile_step(stack, mode="reduce-overhead"): Inductor, one
graph, CUDA graphs (a no-op on CPU) and the dsv4 passes — also runs on CPU, so every CI run
exercises it; the mode given and the passes compile_step adds both reach Inductor."""

import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.compile import compile_step
from dsv4_compile.fx_passes import DSV4PassManager
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.compile_checks import fresh_compile_state, graph_breaks
from tests.support.oracle_asserts import assert_cache_matches, assert_outputs_match


@torch.no_grad()
def test_reduce_overhead_step_runs_on_cpu_and_matches_oracle():
    cfg = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)
    eng, rec = make_engine(cfg, max_requests=3, max_seq_len=512, capture_layers=False)
    rows = [eng.admit(), eng.admit()]
    passes = DSV4PassManager()
    with fresh_compile_state():
        eng.forward = compile_step(eng.stack, mode="reduce-overhead", passes=passes)
        assert_outputs_match(rec, rec.run(ForwardMode.EXTEND, {rows[0]: 130, rows[1]: 70}))
        for _ in range(3):
            assert_outputs_match(rec, rec.run(ForwardMode.DECODE, {r: 1 for r in rows}))
        assert graph_breaks() == 0
    assert passes.matched_count >= 1, "the dsv4 passes did not run beside mode='reduce-overhead'"
    assert_cache_matches(rec, rows)
