"""Whole steps compile with fullgraph=True: zero graph breaks, bounded frames, results and cache
contents equal to eager in every forward mode (docs/semantics.md §3.2 modes)."""

import pytest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.cache_checks import assert_caches_equal, assert_idle_step_is_inert
from tests.support.compile_checks import GraphCapture, fresh_compile_state, graph_breaks

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)
DRAFT = TINY.with_(compress_ratios=(0,))
M = ForwardMode

# mode -> (config, prefill per request, two steps of {request index: tokens}) ; the two steps use
# different batch sizes / token counts, so a second shape is seen.
SCENARIOS = {
    "decode": (TINY, (130, 7, 260), M.DECODE, [{0: 1}, {0: 1, 1: 1, 2: 1}]),
    "verify_uniform": (TINY, (130, 7, 260), M.TARGET_VERIFY, [{0: 3, 1: 3}, {0: 3, 1: 3, 2: 3}]),
    "verify_ragged": (TINY, (130, 7, 260), M.TARGET_VERIFY, [{0: 2, 1: 4}, {0: 1, 1: 3, 2: 4}]),
    "extend": (TINY, (130, 7, 260), M.EXTEND, [{0: 40}, {0: 9, 1: 130, 2: 3}]),
    "draft_extend": (DRAFT, (130, 7, 260), M.DRAFT_EXTEND, [{0: 2}, {0: 2, 1: 2, 2: 2}]),
}


def _pair(config, prefill):
    """An eager engine and an identical one to compile, both prefilled the same way, each with
    its recorder (the two draw the same inputs)."""
    pairs = [make_engine(config, max_requests=4, max_seq_len=768, capture_layers=False) for _ in range(2)]
    for eng, rec in pairs:
        rows = [eng.admit() for _ in prefill]
        rec.run(M.EXTEND, dict(zip(rows, prefill)))
    return pairs, rows


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.mark.parametrize("name", list(SCENARIOS) + ["idle"])
def test_step_compiles_fullgraph_and_matches_eager_exactly(name):
    """aot_eager keeps eager's kernels, so the traced + functionalised step must reproduce eager
    bit for bit — outputs and every cache byte (mutations in place, in order)."""
    config, prefill, mode, steps = SCENARIOS.get(name, SCENARIOS["decode"])
    ((eager, eager_rec), (comp, comp_rec)), rows = _pair(config, prefill)
    capture = GraphCapture("aot_eager")
    with fresh_compile_state():
        comp.forward = torch.compile(comp.stack, backend=capture, fullgraph=True)
        for tokens in steps:
            if name == "idle":
                outs = [assert_idle_step_is_inert(eng, len(tokens) * 2) for eng in (eager, comp)]
                assert torch.equal(outs[0], outs[1])
                continue
            tokens = {rows[i]: n for i, n in tokens.items()}
            want, got = eager_rec.run(mode, tokens), comp_rec.run(mode, tokens)
            for row in tokens:
                assert torch.equal(want[row], got[row]), f"row {row} differs from eager"
            assert_caches_equal(eager.stack.cache, comp.stack.cache)
        assert graph_breaks() == 0
        assert capture.frame_count <= 2, f"{capture.frame_count} frames for two steps of one mode"


@pytest.mark.parametrize("name", ["decode"])
def test_inductor_step_matches_eager(name):
    """Inductor fuses the projections / norms / RoPE (different fp32 rounding), so compare with a
    bf16-level tolerance; the dsv4 ops themselves are opaque and unchanged."""
    config, prefill, mode, steps = SCENARIOS[name]
    ((_, eager_rec), (comp, comp_rec)), rows = _pair(config, prefill)
    with fresh_compile_state():
        comp.forward = torch.compile(comp.stack, fullgraph=True)
        for tokens in steps:
            tokens = {rows[i]: n for i, n in tokens.items()}
            want, got = eager_rec.run(mode, tokens), comp_rec.run(mode, tokens)
            for row in tokens:
                scale = want[row].float().abs().max()
                assert (want[row].float() - got[row].float()).abs().max() <= 0.02 * scale
        assert graph_breaks() == 0


@pytest.mark.parametrize("mode, tokens_per_request, sizes", [
    (M.DECODE, 1, range(1, 65)),
    (M.TARGET_VERIFY, 3, (1, 2, 3, 5, 8, 13, 21, 34, 55, 64)),
    (M.EXTEND, 5, (1, 2, 3, 7, 16, 31, 64)),
])
def test_batch_sizes_do_not_recompile(mode, tokens_per_request, sizes):
    """At most 2 Dynamo frames per mode over batch sizes 1..64 (a static first size, then one
    dynamic graph). Two layers (c4, c128) keep the 100+ eager-kernel steps cheap."""
    eng, rec = make_engine(TINY.with_(compress_ratios=(4, 128)), max_requests=64, max_seq_len=256,
                           capture_layers=False)
    rows = [eng.admit() for _ in range(64)]
    rec.run(M.EXTEND, {r: 9 for r in rows})
    capture = GraphCapture("eager")
    with fresh_compile_state():
        eng.forward = torch.compile(eng.stack, backend=capture, fullgraph=True)
        for b in sizes:
            rec.run(mode, {r: tokens_per_request for r in rows[:b]})
            if mode is M.TARGET_VERIFY:  # reject every draft: lengths stay within the cache
                for r in rows[:b]:
                    eng.accept(r, 0, tokens_per_request)
        assert graph_breaks() == 0
        assert capture.frame_count <= 2, f"{capture.frame_count} compiles over batch sizes {list(sizes)}"
