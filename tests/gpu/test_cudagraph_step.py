"""Whole steps as CUDA graphs under torch.compile — no hand-written graph bookkeeping (issue 6).

Two compiled variants of the same stack run a long serving scenario beside an eager twin:

* ``backend="cudagraphs"`` (eager kernels + CUDA-graph trees): must equal eager bit for bit —
  outputs and every cache byte — after every step, so any stale metadata on replay would show;
* ``mode="reduce-overhead"`` (Inductor + CUDA-graph trees): equal within bf16 rounding.

Requests join, grow across page (256) and compression (4, 128) boundaries, verify drafts
(uniform D = 2..4 and ragged), go idle and leave; batches are padded to buckets, the only
bookkeeping outside the step. Zero cudagraph skips, zero host syncs during replays.
"""

import contextlib
import logging

import pytest
import torch
from torch._dynamo.utils import counters

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.testing.compile_checks import assert_caches_equal, fresh_compile_state, graph_breaks
from dsv4_compile.testing.oracle_checks import assert_outputs_match, make_engine

pytestmark = pytest.mark.gpu
M = ForwardMode
CFG = DSV4AttnConfig.from_name("tiny").with_(index_topk=64, num_heads=16, o_groups=2)


class _Recordings(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        self.count += "Recording cudagraph tree" in record.getMessage()


@contextlib.contextmanager
def _count_recordings():
    handler = _Recordings()
    torch._logging.set_logs(cudagraphs=True)
    logger = logging.getLogger("torch._inductor.cudagraph_trees.__cudagraphs")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()


def _scenario():
    """(mode, {request name: tokens}, {request name: accepted} | None, joins, leaves) per step."""
    steps = [(M.EXTEND, {"a": 300, "b": 120}, None)]
    for i in range(24):
        steps.append((M.DECODE, {"a": 1, "b": 1, **({"c": 1} if i >= 6 else {})}, None))
        if i == 5:
            steps.append((M.EXTEND, {"c": 70}, None))  # c joins mid-run
    for d, acc in ((2, {"a": 1, "b": 2, "c": 0}), (3, {"a": 3, "b": 0, "c": 2}), (4, {"a": 2, "b": 4, "c": 1})):
        steps.append((M.TARGET_VERIFY, {"a": d, "b": d, "c": d}, acc))
    steps.append((M.TARGET_VERIFY, {"a": 1, "b": 4, "c": 2}, {"a": 1, "b": 2, "c": 0}))  # ragged
    steps.append((M.IDLE, {}, None))
    steps += [(M.DECODE, {"a": 1, "c": 1}, None)] * 12  # b has left
    return steps


def _run(eager, compiled, check_exact: bool, sync_check_after: int):
    names = {}
    for n, (mode, tokens, accepted) in enumerate(_scenario()):
        for name in tokens:
            if name not in names:
                names[name] = (eager.admit(), compiled.admit())
        if "b" in names and "b" not in tokens and mode is M.DECODE:
            eager.release(names["b"][0]), compiled.release(names["b"][1])
            del names["b"]
        if mode is M.IDLE:
            outs = [e.idle(4) for e in (eager, compiled)]
            assert torch.isfinite(outs[1]).all()
            continue
        want = eager.run(mode, {names[k][0]: v for k, v in tokens.items()})
        sync = torch.cuda.set_sync_debug_mode if n >= sync_check_after else (lambda _: None)
        sync("error")
        got = compiled.run(mode, {names[k][1]: v for k, v in tokens.items()})
        sync("default")
        for k in tokens:
            w, g = want[names[k][0]], got[names[k][1]]
            if check_exact:
                assert torch.equal(w, g), f"step {n} ({mode.value}) request {k} differs from eager"
            else:
                assert (w.float() - g.float()).abs().max() <= 0.02 * w.float().abs().max()
        if check_exact:
            assert_caches_equal(eager.stack.cache, compiled.stack.cache)
        if accepted:
            for k, a in accepted.items():
                eager.accept(names[k][0], a, tokens[k]), compiled.accept(names[k][1], a, tokens[k])
    return names


@pytest.mark.parametrize("backend, exact", [("cudagraphs", True), ("inductor", False)])
@torch.no_grad()
def test_long_run_as_cuda_graphs(backend, exact):
    eager = make_engine(CFG, max_requests=4, max_seq_len=1024, device="cuda", capture_layers=False)
    eager.bucketed = True
    compiled = make_engine(CFG, max_requests=4, max_seq_len=1024, device="cuda", capture_layers=False)
    compiled.bucketed = True
    with fresh_compile_state(), _count_recordings() as rec:
        if backend == "cudagraphs":
            compiled.forward = torch.compile(compiled.stack, backend="cudagraphs", fullgraph=True)
        else:
            compiled.forward = torch.compile(compiled.stack, mode="reduce-overhead", fullgraph=True)
        names = _run(eager, compiled, exact, sync_check_after=40)
        assert graph_breaks() == 0
        assert counters["inductor"]["cudagraph_skips"] == 0
        assert rec.count >= 4, f"only {rec.count} CUDA graphs recorded"
        assert rec.count <= 16, f"{rec.count} CUDA graphs recorded: buckets should bound this"
    # the compiled engine also agrees with the cache-free oracle at the end
    out = compiled.run(M.DECODE, {names["a"][1]: 1, names["c"][1]: 1})
    assert_outputs_match(compiled, out)


@torch.no_grad()
def test_replay_switches_indexer_from_all_visible_to_topk():
    """A graph recorded while every row sees <= top-k c4 entries (selection = all, unscored) must,
    when replayed after the rows grow past top-k, rank entries (local-inference-lab/vllm#429)."""
    cfg = CFG.with_(compress_ratios=(4,))
    eng = make_engine(cfg, max_requests=2, max_seq_len=512, device="cuda", capture_layers=False)
    row = eng.admit()
    eng.run(M.EXTEND, {row: 240})  # 60 visible entries < 64
    with fresh_compile_state(), _count_recordings() as rec:
        compiled = torch.compile(eng.stack, mode="reduce-overhead", fullgraph=True)
        eng.forward = compiled
        for _ in range(3):  # warm-up, record, replay: all below top-k
            eng.run(M.DECODE, {row: 1})
        eng.forward = eng.stack
        eng.run(M.EXTEND, {row: 40})  # grow eagerly to 283: 70 visible > 64
        eng.forward = compiled
        recorded = rec.count
        for _ in range(3):  # the same graph (same shapes) replayed, now above top-k
            assert_outputs_match(eng, eng.run(M.DECODE, {row: 1}))
        assert rec.count == recorded, "the decode graph was re-recorded instead of replayed"
        assert counters["inductor"]["cudagraph_skips"] == 0


@torch.no_grad()
def test_draft_extend_and_sizes_up_to_256_with_bounded_graphs():
    """Draft-extend steps of an SWA-only stack, and decode batches 1..256 padded to buckets:
    the number of recorded graphs is the number of buckets touched, not of sizes."""
    cfg = CFG.with_(compress_ratios=(0, 0))
    eng = make_engine(cfg, max_requests=256, max_seq_len=256, device="cuda", capture_layers=False)
    eng.bucketed = True
    rows = [eng.admit() for _ in range(256)]
    eng.run(M.EXTEND, {r: 5 for r in rows})
    with fresh_compile_state(), _count_recordings() as rec:
        eng.forward = torch.compile(eng.stack, mode="reduce-overhead", fullgraph=True)
        for _ in range(2):
            eng.run(M.DRAFT_EXTEND, {r: 2 for r in rows[:8]})
        touched = set()
        for b in list(range(1, 33)) + [40, 64, 100, 128, 200, 256]:
            eng.run(M.DECODE, {r: 1 for r in rows[:b]})
            touched.add(b)
        assert counters["inductor"]["cudagraph_skips"] == 0 and graph_breaks() == 0
        assert rec.count <= 1 + 15, f"{rec.count} graphs for {len(touched)} sizes"
    torch.cuda.synchronize()
    print(f"graphs recorded: {rec.count}; max memory allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
