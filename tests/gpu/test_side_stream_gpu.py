"""Cache writes on the side stream on the GPU: a flagged write and its join, eagerly and captured in
a CUDA graph beside a product on the main stream, write the bytes the plain write does (replays with
new keys too); a model step compiled with ``OverlapCacheWritesPass`` added to the default passes,
whole-step graphs or cudagraph trees, gives the logits and cache bytes of the step without it, over
a prompt and replayed decode steps, with no cudagraph skip."""

import pytest
import torch
from torch._dynamo.utils import counters

from dsv4_compile import layout
from dsv4_compile.compile import compile_step
from dsv4_compile.fx_passes import DSV4PassManager, OverlapCacheWritesPass
from dsv4_compile.fx_passes.pass_manager import default_passes
from dsv4_compile.model import enable
from dsv4_compile.ops.side_stream import side_stream
from dsv4_compile.step import ForwardMode, StepInputs
from dsv4_compile.testing.random_model import random_hf_model
from tests.gpu.test_model_gpu import _tiny_config
from tests.support.compile_checks import fresh_compile_state

pytestmark = pytest.mark.gpu
ops = torch.ops.dsv4
PAGE = 64


def _keys(seed: int) -> torch.Tensor:
    return torch.randn(96, 512, generator=torch.Generator().manual_seed(seed)).bfloat16().cuda()


def _written(slots: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    cache = torch.zeros(4, layout.model1_page_bytes(PAGE), dtype=torch.uint8, device="cuda")
    ops.store_kv(cache, slots, k, PAGE)
    return cache


@torch.no_grad()
def test_flagged_write_and_join_eager_and_in_a_cuda_graph():
    slots = torch.randperm(4 * PAGE, device="cuda")[:96]
    k, big = _keys(0), torch.randn(4096, 4096, device="cuda").bfloat16()
    cache = torch.zeros(4, layout.model1_page_bytes(PAGE), dtype=torch.uint8, device="cuda")
    main = torch.cuda.current_stream()
    ops.store_kv(cache, slots, k, PAGE, True)
    assert torch.cuda.current_stream() == main and side_stream(cache.device) != main
    ops.join_side_stream([cache], [slots, k])
    assert torch.equal(cache, _written(slots, k))

    graph, capture_stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    capture_stream.wait_stream(main)
    with torch.cuda.stream(capture_stream):  # warm-up off the capture
        ops.store_kv(cache, slots, k, PAGE, True)
        product = big @ big
        ops.join_side_stream([cache], [slots, k])
    main.wait_stream(capture_stream)
    with torch.cuda.graph(graph):
        ops.store_kv(cache, slots, k, PAGE, True)
        product = big @ big
        ops.join_side_stream([cache], [slots, k])
    for seed in (1, 2):
        cache.zero_()
        k.copy_(_keys(seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(cache, _written(slots, k)) and torch.equal(product, big @ big)


def _run(passes: list, graphs: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(logits of each step, cache buffers after them) of a fresh 4-layer model on the backend:
    the prompt of two requests (40 and 30 tokens) eagerly, then four decode steps compiled with
    ``passes`` (captured on the second call, then replayed)."""
    backend = enable(random_hf_model(_tiny_config(), seed=0, device="cuda"), max_requests=2, max_seq_len=512)
    rows = [backend.allocator.admit(), backend.allocator.admit()]
    prompt = StepInputs.make(ForwardMode.EXTEND, rows, [40, 30], [40, 30],
                             torch.cat([backend.allocator.extend(r, n) for r, n in zip(rows, (40, 30))]), device="cuda")
    ids = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(1)).cuda()
    logits = [backend(ids, prompt, torch.tensor([39, 69], device="cuda")).float()]
    with fresh_compile_state():
        step = compile_step(backend, mode="reduce-overhead", passes=DSV4PassManager(passes),
                            **({"cuda_graphs": "step"} if graphs == "step" else {}))
        for i in range(4):
            decode = StepInputs.make(ForwardMode.DECODE, rows, [41 + i, 31 + i], [1, 1],
                                     torch.cat([backend.allocator.extend(r, 1) for r in rows]), device="cuda")
            ids = torch.randint(0, 512, (2,), generator=torch.Generator().manual_seed(i)).cuda()
            logits.append(step(ids, decode, torch.arange(2, device="cuda")).float())
        assert counters["inductor"]["cudagraph_skips"] == 0
    return logits, [t.clone() for t in backend.cache.buffers()]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("graphs", ["step", "trees"])
@torch.no_grad()
def test_model_steps_with_and_without_the_side_stream(graphs):
    overlap = OverlapCacheWritesPass()
    side_logits, side_cache = _run([*default_passes(), overlap], graphs)
    # 4 keys, 5 compressors (2 CSA layers x 2, 1 HCA layer) in each compiled graph
    assert overlap.matched_count and overlap.matched_count % 9 == 0
    main_logits, main_cache = _run(default_passes(), graphs)
    assert all(torch.equal(s, m) for s, m in zip(side_logits, main_logits))
    assert all(torch.equal(s, m) for s, m in zip(side_cache, main_cache))
