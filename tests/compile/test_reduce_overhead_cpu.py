"""The exact function served on GPU — torch.compile(stack, mode="reduce-overhead",
fullgraph=True) — also runs on CPU (CUDA graphs are a no-op there), so every CI run exercises it."""

import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.compile_checks import fresh_compile_state, graph_breaks
from tests.support.oracle_asserts import assert_cache_matches, assert_outputs_match


@torch.no_grad()
def test_reduce_overhead_step_runs_on_cpu_and_matches_oracle():
    cfg = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)
    eng, rec = make_engine(cfg, max_requests=3, max_seq_len=512, capture_layers=False)
    rows = [eng.admit(), eng.admit()]
    with fresh_compile_state():
        eng.forward = torch.compile(eng.stack, mode="reduce-overhead", fullgraph=True)
        assert_outputs_match(rec, rec.run(ForwardMode.EXTEND, {rows[0]: 130, rows[1]: 70}))
        for _ in range(3):
            assert_outputs_match(rec, rec.run(ForwardMode.DECODE, {r: 1 for r in rows}))
        assert graph_breaks() == 0
    assert_cache_matches(rec, rows)
