"""A transformers DeepSeek V4 model on the backend, on CUDA: the compiled step against the eager
step, and the backend against transformers' own eager forward.

* ``compile_step(backend, mode="reduce-overhead")`` (one graph, CUDA-graph trees or whole-step
  graphs, torch's default Dynamo config) runs prefill, chunked prefill beside decode rows, decode at b = 2 and b = 1 and
  a request joining mid-run, each step beside the eager backend on a cache of its own: the logits
  agree within bf16 / FP8 rounding (Inductor's fused elementwise work rounds differently from
  eager; the same comparison with CPU Inductor: largest relative max error of a step 0.048, greedy
  agreement 0.95 over the 41 rows), with no graph break, no cudagraph skip and at most
  ``MAX_FRAMES`` frames.
* The eager backend and ``transformers`` eager (its own forward, no cache) on one 1,024-token
  prompt: the backend keeps an FP8 cache and ``transformers`` computes in bf16 without one, so
  the logits differ by rounding noise; the bounds are loose multiples of the figures the same
  comparison gives on CPU (relative max error 0.12 over all rows, greedy agreement 0.92).
"""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import DeepseekV4Config

from dsv4_compile.compile import MAX_FRAMES, compile_step
from dsv4_compile.model import ModelBackend, enable
from dsv4_compile.runner import ModelRunner
from dsv4_compile.step import ForwardMode, StepInputs
from dsv4_compile.testing.random_model import random_hf_model
from tests.support.compile_checks import fresh_compile_state, graph_breaks

pytestmark = pytest.mark.gpu
M = ForwardMode
DEVICE = "cuda"
# compiled vs eager backend: relative max logit error of any step, greedy agreement over all rows
COMPILED_RTOL, COMPILED_AGREE = 0.1, 0.85
# backend vs transformers on 1,024 tokens: relative max logit error, greedy agreement
HF_RTOL, HF_AGREE = 0.25, 0.8


def _tiny_config() -> DeepseekV4Config:
    """Every attention layer type (sliding, CSA, HCA, CSA), a hash-routed and learned-routed MoE,
    hyper-connections; real per-head dimensions, small hidden size, heads, experts and vocabulary."""
    return DeepseekV4Config(vocab_size=512, hidden_size=256, moe_intermediate_size=128, num_attention_heads=8,
                            head_dim=512, q_lora_rank=128, o_groups=2, o_lora_rank=64, index_n_heads=8,
                            index_head_dim=128, index_topk=64, n_routed_experts=4, num_experts_per_tok=2,
                            hc_mult=4, num_hidden_layers=4,
                            layer_types=["sliding_attention", "compressed_sparse_attention",
                                         "heavily_compressed_attention", "compressed_sparse_attention"],
                            mlp_layer_types=["hash_moe", "moe", "moe", "moe"])


@pytest.fixture(scope="module")
def model():
    return random_hf_model(_tiny_config(), seed=0, device=DEVICE)


def _scenario():
    """Steps as (mode, {request name: tokens}): prefill of two requests, b's chunked prefill beside
    a's decode (across the 512 page end), decode (b = 2, across c4 window ends), c joining with a
    prompt beside decode rows, decode of three, then of one (the T = 1 frame)."""
    steps = [(M.EXTEND, {"a": 300, "b": 256}), (M.EXTEND, {"a": 1, "b": 256}), (M.EXTEND, {"a": 1, "b": 88})]
    steps += [(M.DECODE, {"a": 1, "b": 1})] * 8
    steps += [(M.EXTEND, {"a": 1, "b": 1, "c": 100})] + [(M.DECODE, {"a": 1, "b": 1, "c": 1})] * 4
    return steps + [(M.DECODE, {"a": 1})] * 4


class _Requests:
    """One backend's requests of the scenario (name -> request row) and the inputs of each step."""

    def __init__(self, backend: ModelBackend):
        self.backend, self.rows = backend, {}

    def inputs(self, mode: ForwardMode, tokens: dict[str, int], ids: dict[str, torch.Tensor]):
        """``(input_ids, step, logit_rows)`` of one step: ``ids`` the new tokens of each request
        (its last row's logits are asked for)."""
        alloc, device = self.backend.allocator, self.backend.cache.device
        for name in tokens:
            if name not in self.rows:
                self.rows[name] = alloc.admit()
        rows = [self.rows[n] for n in tokens]
        loc = torch.cat([alloc.extend(r, tokens[n]) for n, r in zip(tokens, rows)])
        step = StepInputs.make(mode, rows, [alloc.seq_len(r) for r in rows], list(tokens.values()), loc,
                               device=device)
        last = torch.tensor(list(tokens.values())).cumsum(0) - 1
        last = torch.cat([last, last.new_zeros(max(0, 2 - len(last)))])
        return torch.cat([ids[n] for n in tokens]).to(device), step, last.to(device)


def _run_side_by_side(model, fn_for) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The scenario on two backends of ``model`` (the second stepped through ``fn_for(backend)``);
    the logits of both per step, the next tokens taken from the first."""
    gen = torch.Generator().manual_seed(1)
    eager, other = (enable(model, max_requests=4, max_seq_len=1024) for _ in range(2))
    fn = fn_for(other)
    reqs = _Requests(eager), _Requests(other)
    ids, out = {}, []
    for mode, tokens in _scenario():
        new = {n: ids[n] if n in ids and t == 1 else torch.randint(0, 512, (t,), generator=gen)
               for n, t in tokens.items()}
        want = eager(*reqs[0].inputs(mode, tokens, new)).float()
        got = fn(*reqs[1].inputs(mode, tokens, new)).float().clone()
        out.append((want[:len(tokens)], got[:len(tokens)]))
        ids = {n: want[i].argmax().view(1).cpu() for i, n in enumerate(tokens)}
    return out


def _compare(pairs) -> tuple[float, float]:
    """Largest per-step relative max error and the greedy agreement over all rows."""
    worst = max(((g - w).abs().max() / w.abs().max()).item() for w, g in pairs)
    agree = torch.cat([(g.argmax(-1) == w.argmax(-1)) for w, g in pairs]).float().mean().item()
    return worst, agree


@pytest.mark.parametrize("cuda_graphs", [None, "step"])
@torch.no_grad()
def test_compiled_model_step_matches_eager(model, cuda_graphs):
    """CUDA-graph trees (compile_step's default) and whole-step graphs (``cuda_graphs="step"``)."""
    assert torch._dynamo.config.recompile_limit == 8, "the test must run with torch's default limit"
    with fresh_compile_state():
        pairs = _run_side_by_side(model, lambda backend: compile_step(backend, mode="reduce-overhead",
                                                                      cuda_graphs=cuda_graphs))
        frames = counters["stats"]["unique_graphs"]
        assert graph_breaks() == 0
        assert counters["inductor"]["cudagraph_skips"] == 0
        assert frames <= MAX_FRAMES, f"{frames} frames"
    worst, agree = _compare(pairs)
    print(f"compiled vs eager: relative max logit error {worst:.4f}, greedy agreement {agree:.3f}, frames {frames}")
    assert worst <= COMPILED_RTOL
    assert agree >= COMPILED_AGREE


@torch.no_grad()
def test_runner_on_whole_step_graphs_equals_the_eager_runner(model):
    """The runner's loop (continuous batching, chunked prefill, bucketed steps) on the step as the
    CLI compiles it on CUDA, whole-step graphs, here over Dynamo's eager backend so that it must
    equal the eager runner bit for bit: the same log-probs over three passes (warm-up runs,
    captures, replays) and the same greedy continuations; no graph break."""
    sequences = [list(range(1, 300)), [7] * 3, list(range(100, 160))]
    backend = enable(model, max_requests=4, max_seq_len=1024)
    want = ModelRunner(backend, max_step_tokens=128).score(sequences)
    want_tokens = ModelRunner(backend, max_step_tokens=128).generate(sequences, 6)
    with fresh_compile_state():
        step_fn = compile_step(backend, backend="eager", cuda_graphs="step")
        runner = ModelRunner(backend, step_fn=step_fn, max_step_tokens=128)
        runner.warmup()
        for _ in range(3):
            for got, expected in zip(runner.score(sequences), want):
                assert torch.equal(got, expected)
        assert runner.generate(sequences, 6) == want_tokens
        assert graph_breaks() == 0
    assert 0 < step_fn.graphs.num_graphs <= len(step_fn.graphs.signatures)


@torch.no_grad()
def test_backend_matches_transformers_on_a_long_prompt(model):
    length = 1024
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(2))
    ids = ids.to(DEVICE)
    ref = model(ids[None]).logits[0].float()
    backend = enable(model, max_requests=1, max_seq_len=length)
    row = backend.allocator.admit()
    step = StepInputs.make(M.EXTEND, [row], [length], [length], backend.allocator.extend(row, length), device=DEVICE)
    out = backend(ids, step, torch.arange(length, device=DEVICE)).float()
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"backend vs transformers, {length} tokens: relative max logit error {err:.4f}, "
          f"greedy agreement {agree:.3f}")
    assert err <= HF_RTOL
    assert agree >= HF_AGREE
