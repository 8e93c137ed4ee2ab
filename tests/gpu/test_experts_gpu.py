"""``dsv4::routed_experts`` and ``dsv4::moe_experts`` on the GPU: the Triton kernels (a decode
step's few slots) and the grouped GEMMs (more slots) against the reference on the same device, at
the benchmark model's widths; the ``"dsv4"`` experts implementation against transformers'
``grouped_mm`` on one MoE module and the composed MoE block against the block, eager and compiled
with ``fullgraph=True``."""

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

from dsv4_compile import hf_experts
from dsv4_compile.ops.kernels import experts as kernels
from dsv4_compile.reference import experts as ref
from tests.support.compile_checks import fresh_compile_state
from tests.support.hf_model import tiny_hf_config

pytestmark = pytest.mark.gpu


def assert_bf16_close(got, want):
    """Within one bf16 rounding step at the output's scale, and 99.5 % of elements within 1.6 %:
    the kernels accumulate in another order than the reference's GEMMs, so an intermediate (the
    SwiGLU output) or the output can round to the neighbouring bf16 value."""
    got, want = got.float(), want.float()
    step = 2 ** -7 * want.abs().max().item()
    torch.testing.assert_close(got, want, atol=step, rtol=0)
    near = (got - want).abs() <= 1e-3 + 1.6e-2 * want.abs()
    assert near.float().mean().item() >= 0.995


def _experts(num_experts=8, hidden=4096, inter=2048, topk=2) -> DeepseekV4Experts:
    torch.manual_seed(0)
    config = tiny_hf_config(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=num_experts,
                            num_experts_per_tok=topk)
    module = DeepseekV4Experts(config).cuda()
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.08)  # some gate / up values pass the SwiGLU limit
        module.down_proj.normal_(0, 0.02)
    module = module.bfloat16().eval()
    hf_experts.register()
    module.config._experts_implementation = hf_experts.IMPLEMENTATION
    return module


def _route(module, tokens, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, module.hidden_dim, device="cuda", generator=g).bfloat16()
    topk = module.config.num_experts_per_tok
    ids = torch.rand(tokens, module.num_experts, device="cuda", generator=g).argsort(dim=1)[:, :topk]
    weights = torch.rand(tokens, topk, device="cuda", generator=g).bfloat16()
    return x, ids, weights


@pytest.fixture(scope="module")
def module():
    return _experts()


@pytest.mark.parametrize("tokens", [1, 8, kernels.MAX_SLOTS // 2, kernels.MAX_SLOTS // 2 + 1, 700])
@torch.no_grad()
def test_op_equals_the_reference(module, tokens):
    x, ids, _ = _route(module, tokens)
    ids[0, -1] = -1  # an unowned slot: 0 on either path
    args = (x, ids, module.gate_up_proj, module.down_proj, module.limit)
    got = torch.ops.dsv4.routed_experts(*args)
    assert torch.equal(got[ids.shape[1] - 1], torch.zeros_like(got[0]))
    assert_bf16_close(got, ref.routed_experts(*args))


@pytest.mark.parametrize("tokens", [1, 8, 64])
@torch.no_grad()
def test_dsv4_experts_equal_grouped_mm(module, tokens):
    x, ids, weights = _route(module, tokens, seed=1)
    assert hf_experts.runs_routed_experts_op(module, x)
    assert_bf16_close(module(x, ids, weights), grouped_mm_experts_forward(module, x, ids, weights))


@torch.no_grad()
def test_compiled_module_runs_the_op_without_breaks(module):
    """Inductor rounding where eager rounds (``emulate_precision_casts``): the compiled weighting and
    sum of the op's slots equal eager's bit for bit."""
    x, ids, weights = _route(module, 4, seed=2)
    with fresh_compile_state():
        compiled = torch.compile(module, fullgraph=True, options={"emulate_precision_casts": True})
        got = compiled(x, ids, weights)
        assert sum(counters["graph_break"].values()) == 0
    torch.testing.assert_close(got, module(x, ids, weights), atol=0, rtol=0)


def test_a_quantised_or_sharded_weight_falls_back():
    """A weight that is not a plain tensor (a tensor subclass, as DTensor shards and quantisers
    hold) keeps transformers' grouped path."""
    class Wrapped(torch.Tensor):
        pass

    module = _experts(num_experts=4, hidden=256, inter=128)
    x, _, _ = _route(module, 2)
    assert hf_experts.runs_routed_experts_op(module, x)
    module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.detach().as_subclass(Wrapped))
    assert not hf_experts.runs_routed_experts_op(module, x)


def _moe_block(layer_idx: int, hidden=1024, inter=512):
    """A ``DeepseekV4SparseMoeBlock`` (layer 0: hash-routed, layer 1: learned router) of 8 experts,
    2 a token, the shared expert of the same width, random weights some of whose gate / up values
    pass the SwiGLU limit, with the backend's experts implementation."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    torch.manual_seed(layer_idx)
    config = tiny_hf_config(hidden_size=hidden, moe_intermediate_size=inter, intermediate_size=inter,
                            n_routed_experts=8, num_experts_per_tok=2)
    block = DeepseekV4SparseMoeBlock(config, layer_idx).cuda()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.08)
        if block.is_hash:
            block.gate.tid2eid.copy_(torch.rand(config.vocab_size, 8, device="cuda").argsort(dim=1)[:, :2])
    hf_experts.register()
    config._experts_implementation = hf_experts.IMPLEMENTATION
    return block.bfloat16().eval()


@pytest.mark.parametrize("tokens", [1, 8, kernels.MAX_SLOTS // 2, 700])  # the kernels, then grouped GEMMs + cuBLAS
@torch.no_grad()
def test_moe_experts_op_equals_the_reference(module, tokens):
    x, ids, _ = _route(module, tokens, seed=3)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    router, *shared = [torch.randn(*shape, device="cuda", generator=g).mul_(std).bfloat16()
                       for shape, std in (((8, 4096), 0.02), ((2048, 4096), 0.08), ((2048, 4096), 0.08),
                                          ((4096, 2048), 0.02))]
    args = (x, ids, module.gate_up_proj, module.down_proj, module.limit)
    slots, shared_out, logits = torch.ops.dsv4.moe_experts(*args, *shared, router)
    assert_bf16_close(slots, ref.routed_experts(*args))
    assert_bf16_close(shared_out, ref.shared_expert(x, *shared, module.limit))
    assert_bf16_close(logits, ref.router_logits(x, router))


@pytest.mark.parametrize("tokens", [1, 8, 16, 17])  # the kernels, then cuBLAS + topk_indices
@pytest.mark.parametrize("num_experts, k", [(8, 2), (256, 6)])
@torch.no_grad()
def test_router_topk_op_equals_the_reference(tokens, num_experts, k):
    """Logits to a bf16 rounding of the reference's, the selection the reference's order of the
    op's own logits (the two may round apart at a near tie)."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 4096, device="cuda", generator=g).bfloat16()
    weight = torch.randn(num_experts, 4096, device="cuda", generator=g).mul_(0.02).bfloat16()
    bias = torch.randn(num_experts, device="cuda", generator=g).mul_(0.1)
    indices, logits = torch.ops.dsv4.router_topk(x, weight, bias, k)
    assert_bf16_close(logits, ref.router_topk(x, weight, bias, k)[1])
    scores = ref.router_scores(logits, bias)
    assert torch.equal(indices, ref.topk_indices(scores, k))


@pytest.mark.parametrize("layer_idx", [0, 1])  # hash-routed, learned router
@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("normalise_after_sum", [False, True])
@torch.no_grad()
def test_moe_forward_equals_the_block(layer_idx, tokens, normalise_after_sum, monkeypatch):
    """Transformers' form of the weights: the block's output to a bf16 step. With
    ``NORMALISE_AFTER_SUM`` the weights stay fp32 where the block rounds each to bf16 (2**-8 of a
    slot's term), which where a token's slots cancel moves an element far from the block's relative
    to itself: against the block run in fp64 it then errs about as much as the bf16 block does (on
    an H100: 0.80-1.0 times its error over these six cases). The learned router runs as the block's
    gate (its op may break a near tie otherwise: the next test)."""
    monkeypatch.setattr(hf_experts, "NORMALISE_AFTER_SUM", normalise_after_sum)
    monkeypatch.setattr(hf_experts, "LEARNED_ROUTER_OP", False)
    block = _moe_block(layer_idx)
    x = torch.randn(1, tokens, 1024, device="cuda").bfloat16()
    input_ids = torch.randint(0, block.experts.config.vocab_size, (1, tokens), device="cuda")
    assert hf_experts.runs_moe_experts_op(block, x)
    got = hf_experts.moe_forward(block, x, input_ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    want = block(x, input_ids=input_ids)
    if not normalise_after_sum:
        assert_bf16_close(got, want)
        return
    exact_block = copy.deepcopy(block).double()
    exact_block.experts.config._experts_implementation = "eager"  # transformers' loop: fp64 as it is
    exact = exact_block(x.double(), input_ids=input_ids)
    own_error = (want.double() - exact).abs().max().item()
    error = (got.double() - exact).abs().max().item()
    assert error <= 1.25 * own_error


@pytest.mark.parametrize("tokens", [8, 16, 40])  # the router's kernels, then cuBLAS + topk_indices
@torch.no_grad()
def test_moe_forward_with_the_router_op_equals_the_block(tokens, monkeypatch):
    """A learned router through ``dsv4::router_topk``: the block's output for every token whose
    experts it chose as transformers' bf16 gate did (its fp32 scores may break a tie of the gate's
    bf16 scores either way), at least half of them."""
    monkeypatch.setattr(hf_experts, "LEARNED_ROUTER_OP", True)
    monkeypatch.setattr(hf_experts, "NORMALISE_AFTER_SUM", False)
    block = _moe_block(1)
    x = torch.randn(1, tokens, 1024, device="cuda").bfloat16()
    input_ids = torch.zeros(1, tokens, dtype=torch.long, device="cuda")
    chosen, _ = torch.ops.dsv4.router_topk(x[0], block.gate.weight, block.gate.e_score_correction_bias, 2)
    agree = (chosen.sort(dim=-1).values == block.gate(x)[2].sort(dim=-1).values).all(dim=-1)
    assert agree.float().mean() >= 0.5
    got = hf_experts.moe_forward(block, x, input_ids)
    assert_bf16_close(got[0, agree], block(x, input_ids=input_ids)[0, agree])


@torch.no_grad()
def test_moe_forward_falls_back_to_the_block():
    """Another experts implementation, or a shared expert that is not transformers' own MLP: the
    block's own forward, exactly."""
    block = _moe_block(1)
    x = torch.randn(1, 3, 1024, device="cuda").bfloat16()
    ids = torch.zeros(1, 3, dtype=torch.long, device="cuda")
    block.experts.config._experts_implementation = "grouped_mm"
    assert not hf_experts.runs_moe_experts_op(block, x)
    assert torch.equal(hf_experts.moe_forward(block, x, ids), block(x, input_ids=ids))
    block.experts.config._experts_implementation = hf_experts.IMPLEMENTATION
    block.shared_experts.__class__ = type("OtherMLP", (type(block.shared_experts),), {})
    assert not hf_experts.runs_moe_experts_op(block, x)
    assert torch.equal(hf_experts.moe_forward(block, x, ids), block(x, input_ids=ids))


@torch.no_grad()
def test_compiled_moe_forward_runs_the_op_without_breaks():
    block = _moe_block(1)
    x = torch.randn(1, 4, 1024, device="cuda").bfloat16()
    ids = torch.zeros(1, 4, dtype=torch.long, device="cuda")
    with fresh_compile_state():
        compiled = torch.compile(lambda x, ids: hf_experts.moe_forward(block, x, ids), fullgraph=True,
                                 options={"emulate_precision_casts": True})
        got = compiled(x, ids)
        assert sum(counters["graph_break"].values()) == 0
    torch.testing.assert_close(got, hf_experts.moe_forward(block, x, ids), atol=0, rtol=0)
