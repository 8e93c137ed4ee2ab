"""Whole steps as CUDA graphs under torch.compile — no hand-written graph bookkeeping.

Compiled variants of the same stack (all through compile_step, under torch's default Dynamo
config) run a long serving scenario beside an eager twin:

* ``backend="cudagraphs"`` (eager kernels + CUDA-graph trees, one static graph per bucket: that
  backend does not re-key graphs on dynamic sizes): must equal eager bit for bit — outputs and
  every cache byte — after every step, so any stale metadata on replay would show;
* ``mode="reduce-overhead"`` (Inductor + CUDA-graph trees), with and without the dsv4 passes:
  Inductor's fused projections round differently from eager, so every step is checked against
  the cache-free oracle instead.

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
from dsv4_compile.compile import MAX_FRAMES, compile_step
from dsv4_compile.fx_passes import DSV4PassManager
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.compile.serving_mix import ShapeLog, run_draft_mix, run_target_mix
from tests.support.cache_checks import assert_caches_equal, assert_idle_step_is_inert
from tests.support.compile_checks import fresh_compile_state, graph_breaks
from tests.support.oracle_asserts import assert_outputs_match

pytestmark = pytest.mark.gpu
M = ForwardMode
CFG = DSV4AttnConfig.from_name("tiny").with_(index_topk=64, num_heads=16, o_groups=2)
DEVICE = "cuda"


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
    steps = [(M.EXTEND, {"a": 300, "b": 240}, None)]  # b's decode crosses the 256 page boundary
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


def _no_sync_after(fn, first_checked_call: int):
    """Wrap a compiled step so that, from call ``first_checked_call`` on (replays), any
    synchronising CUDA operation inside it raises."""
    calls = [0]

    def step(x, s):
        calls[0] += 1
        torch.cuda.set_sync_debug_mode("error" if calls[0] >= first_checked_call else "default")
        try:
            return fn(x, s)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return step


def _run(eager_pair, compiled_pair, check_exact: bool):
    """The scenario on an eager and a compiled ``(engine, recorder)`` pair; returns request name ->
    (eager row, compiled row)."""
    (eager, eager_rec), (compiled, compiled_rec) = eager_pair, compiled_pair
    names = {}
    for n, (mode, tokens, accepted) in enumerate(_scenario()):
        for name in tokens:
            if name not in names:
                names[name] = (eager.admit(), compiled.admit())
        if "b" in names and "b" not in tokens and mode is M.DECODE:
            eager.release(names["b"][0]), compiled.release(names["b"][1])
            del names["b"]
        if mode is M.IDLE:
            for e in (eager, compiled):
                assert_idle_step_is_inert(e, 4)
            continue
        want = eager_rec.run(mode, {names[k][0]: v for k, v in tokens.items()})
        got = compiled_rec.run(mode, {names[k][1]: v for k, v in tokens.items()})
        if check_exact:
            for k in tokens:
                assert torch.equal(want[names[k][0]], got[names[k][1]]), \
                    f"step {n} ({mode.value}) request {k} differs from eager"
            assert_caches_equal(eager.stack.cache, compiled.stack.cache)
        else:
            assert_outputs_match(compiled_rec, got)
        if accepted:
            for k, a in accepted.items():
                eager.accept(names[k][0], a, tokens[k]), compiled.accept(names[k][1], a, tokens[k])
    return names


@pytest.mark.parametrize("backend, exact", [("cudagraphs", True), ("inductor", False), ("compile_step", False),
                                            ("eager_step_graphs", True), ("step_graphs", False)])
@torch.no_grad()
def test_long_run_as_cuda_graphs(backend, exact):
    """Through compile_step under torch's default recompile limit: the cudagraphs backend with
    dynamic=False (one frame per distinct padded shape: 7 in this scenario), reduce-overhead
    without the dsv4 passes, compile_step as served, and whole-step graphs (cuda_graphs="step")
    over the eager backend (bit for bit) and over Inductor: a replay with new step tensors computes
    the new step."""
    eager, eager_rec = make_engine(CFG, max_requests=4, max_seq_len=1024, device=DEVICE, capture_layers=False)
    eager.bucketed = True
    compiled, compiled_rec = make_engine(CFG, max_requests=4, max_seq_len=1024, device=DEVICE,
                                         capture_layers=False)
    compiled.bucketed = True
    with fresh_compile_state(), _count_recordings() as recordings:
        if backend == "cudagraphs":
            step_fn = compile_step(compiled.stack, backend="cudagraphs", dynamic=False)
        elif backend == "compile_step":  # + the dsv4 FX passes (fused metadata)
            step_fn = compile_step(compiled.stack)
        elif backend == "eager_step_graphs":
            step_fn = compile_step(compiled.stack, backend="eager", cuda_graphs="step")
        elif backend == "step_graphs":
            step_fn = compile_step(compiled.stack, cuda_graphs="step")
        else:
            step_fn = compile_step(compiled.stack, mode="reduce-overhead", passes=DSV4PassManager([]))
        compiled.forward = _no_sync_after(step_fn, first_checked_call=36)
        names = _run((eager, eager_rec), (compiled, compiled_rec), exact)
        assert graph_breaks() == 0
        assert counters["inductor"]["cudagraph_skips"] == 0
        graphs = recordings.count if step_fn.graphs is None else step_fn.graphs.num_graphs
        assert graphs >= 4, f"only {graphs} CUDA graphs recorded"
        assert graphs <= 16, f"{graphs} CUDA graphs recorded: buckets should bound this"
    # the compiled engine also agrees with the cache-free oracle at the end
    out = compiled_rec.run(M.DECODE, {names["a"][1]: 1, names["c"][1]: 1})
    assert_outputs_match(compiled_rec, out)


@torch.no_grad()
def test_step_graphs_see_weights_updated_in_place_and_new_shapes():
    """Whole-step graphs replay the captured kernels on the memory they captured: a weight updated
    in place is seen by the next replay, and a step of a new shape is a signature (and graph) of
    its own, not a replay of another; each graph is captured at a signature's second call."""
    eng, rec = make_engine(CFG, max_requests=4, max_seq_len=512, device=DEVICE, capture_layers=False)
    rows = [eng.admit() for _ in range(3)]
    rec.run(M.EXTEND, {r: 40 + 30 * i for i, r in enumerate(rows)})
    with fresh_compile_state():
        step_fn = compile_step(eng.stack, backend="eager", cuda_graphs="step")
        eng.forward = step_fn
        graphs = []
        for b in (2, 2, 2, 3, 3, 2):
            assert_outputs_match(rec, rec.run(M.DECODE, {r: 1 for r in rows[:b]}))
            graphs.append(step_fn.graphs.num_graphs)
        assert graphs == [0, 1, 1, 1, 2, 2]
        # the last layer's output projection: no cache entry depends on it, so the cache-free
        # oracle over the whole history (with the new weight) stays the reference
        eng.stack.layers[-1].wo_b.mul_(-0.5)
        assert_outputs_match(rec, rec.run(M.DECODE, {r: 1 for r in rows}))
        assert step_fn.graphs.num_graphs == 2


@torch.no_grad()
def test_step_graphs_static_inputs_are_not_copied(monkeypatch):
    """A call with its signature's static tensors (``graphs.static_inputs``), the next values
    written into them in place, copies nothing and replays on those values: its output equals a
    call with fresh tensors (copied in) and the eager step's, bit for bit."""
    from dsv4_compile import step_graphs

    eng, rec = make_engine(CFG, max_requests=4, max_seq_len=512, device=DEVICE, capture_layers=False)
    rows = [eng.admit() for _ in range(2)]
    rec.run(M.EXTEND, {r: 50 for r in rows})
    step = eng.build_step(M.DECODE, {r: 1 for r in rows})
    gen = torch.Generator(DEVICE).manual_seed(0)
    xs = [torch.randn(2, CFG.hidden_size, device=DEVICE, generator=gen).bfloat16() for _ in range(3)]
    copies = []
    monkeypatch.setattr(step_graphs, "_copy_in", lambda sig, inputs, copy=step_graphs._copy_in: (
        copies.append(len(inputs)), copy(sig, inputs)))
    with fresh_compile_state():
        step_fn = compile_step(eng.stack, backend="eager", cuda_graphs="step")
        assert step_fn.graphs.static_inputs(xs[0], step) is None  # no signature yet
        step_fn(xs[0], step)
        static_x, static_step, extra = step_fn.graphs.static_inputs(xs[0], step)
        assert extra == () and torch.equal(static_x, xs[0])
        for x in xs[1:]:
            static_x.copy_(x)
            got = step_fn(static_x, static_step).clone()
            assert torch.equal(got, eng.stack(x, step))
            assert torch.equal(got, step_fn(x.clone(), step))
        assert step_fn.graphs.num_graphs == 1
    assert copies == [5, 5]  # the fresh tensors' calls only: x and the step's four tensors


@torch.no_grad()
def test_serving_mix_with_reduce_overhead_under_default_config():
    """The serving mix of tests/compile/serving_mix.py (every mode, batch 1 and bucketed sizes,
    idle, a draft stack beside the target) through compile_step with CUDA graphs and torch's
    default Dynamo config: every step matches the oracle, no graph break, no cudagraph skip, at
    most MAX_FRAMES frames per stack and at most one recorded graph per distinct padded shape."""
    assert torch._dynamo.config.recompile_limit == 8, "the test must run with torch's default limit"
    draft_cfg = CFG.with_(compress_ratios=(0,))
    with fresh_compile_state(), _count_recordings() as recordings:
        shapes = 0
        for config, mix in ((CFG, run_target_mix), (draft_cfg, run_draft_mix)):
            eng, rec = make_engine(config, max_requests=4, max_seq_len=512, device=DEVICE, capture_layers=False)
            eng.bucketed = True
            graphs_before = counters["stats"]["unique_graphs"]
            eng.forward = log = ShapeLog(compile_step(eng.stack))
            mix(eng, rec, assert_outputs_match)
            frames = counters["stats"]["unique_graphs"] - graphs_before
            assert frames <= MAX_FRAMES, f"{frames} frames for the shape classes {sorted(log.classes())}"
            shapes += len(set(log.shapes))
        assert graph_breaks() == 0
        assert counters["inductor"]["cudagraph_skips"] == 0
        assert 0 < recordings.count <= shapes, f"{recordings.count} CUDA graphs for {shapes} distinct shapes"
    print(f"recorded {recordings.count} CUDA graphs for {shapes} distinct padded shapes")


@torch.no_grad()
def test_replay_switches_indexer_from_all_visible_to_topk():
    """A graph recorded while every row sees <= top-k c4 entries (selection = all, unscored) must,
    when replayed after the rows grow past top-k, rank entries (local-inference-lab/vllm#429)."""
    cfg = CFG.with_(compress_ratios=(4,))
    eng, rec = make_engine(cfg, max_requests=2, max_seq_len=512, device=DEVICE, capture_layers=False)
    row = eng.admit()
    rec.run(M.EXTEND, {row: 240})  # 60 visible entries < 64
    with fresh_compile_state(), _count_recordings() as recordings:
        compiled = torch.compile(eng.stack, mode="reduce-overhead", fullgraph=True)
        eng.forward = compiled
        for _ in range(3):  # warm-up, record, replay: all below top-k
            rec.run(M.DECODE, {row: 1})
        eng.forward = eng.stack
        rec.run(M.EXTEND, {row: 40})  # grow eagerly to 283: 70 visible > 64
        eng.forward = compiled
        recorded = recordings.count
        for _ in range(3):  # the same graph (same shapes) replayed, now above top-k
            assert_outputs_match(rec, rec.run(M.DECODE, {row: 1}))
        assert recordings.count == recorded, "the decode graph was re-recorded instead of replayed"
        assert counters["inductor"]["cudagraph_skips"] == 0


@torch.no_grad()
def test_draft_extend_on_the_swa_only_draft_stack():
    eng, rec = make_engine(CFG.with_(compress_ratios=(0, 0)), max_requests=8, max_seq_len=512, device=DEVICE,
                           capture_layers=False)
    eng.bucketed = True
    rows = [eng.admit() for _ in range(8)]
    rec.run(M.EXTEND, {r: 100 + 20 * i for i, r in enumerate(rows)})
    with fresh_compile_state():
        eng.forward = torch.compile(eng.stack, mode="reduce-overhead", fullgraph=True)
        for _ in range(4):
            assert_outputs_match(rec, rec.run(M.DRAFT_EXTEND, {r: 3 for r in rows}))
        assert counters["inductor"]["cudagraph_skips"] == 0 and graph_breaks() == 0


@torch.no_grad()
def test_sizes_up_to_256_requests_and_1024_verify_tokens_with_bounded_graphs():
    """Decode batches 1..256 and verify steps up to 1024 tokens, padded to buckets: the number of
    recorded graphs is the number of buckets touched, not of sizes. Prints graphs and memory."""
    eng, rec = make_engine(CFG, max_requests=256, max_seq_len=256, device=DEVICE, capture_layers=False)
    eng.bucketed = True
    rows = [eng.admit() for _ in range(256)]
    rec.run(M.EXTEND, {r: 5 for r in rows})
    with fresh_compile_state(), _count_recordings() as recordings:
        eng.forward = torch.compile(eng.stack, mode="reduce-overhead", fullgraph=True)
        decode_sizes = list(range(1, 33)) + [40, 64, 100, 128, 200, 256]
        for b in decode_sizes:
            rec.run(M.DECODE, {r: 1 for r in rows[:b]})
        decode_graphs = recordings.count
        verify_sizes = [(64, 2), (100, 3), (200, 4), (256, 4)]  # up to 1024 tokens
        for b, d in verify_sizes:
            rec.run(M.TARGET_VERIFY, {r: d for r in rows[:b]})
            for r in rows[:b]:
                eng.accept(r, 1, d)
        assert counters["inductor"]["cudagraph_skips"] == 0 and graph_breaks() == 0
        assert decode_graphs <= 15, f"{decode_graphs} decode graphs for {len(decode_sizes)} sizes"
        assert recordings.count - decode_graphs <= len(verify_sizes)
    torch.cuda.synchronize()
    mem = torch.cuda.max_memory_allocated() / 2**20
    print(f"graphs recorded: {decode_graphs} decode + {recordings.count - decode_graphs} verify; "
          f"max memory allocated {mem:.0f} MiB")
