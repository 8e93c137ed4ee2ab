"""``dsv4::routed_experts`` on the GPU: the Triton kernels (a decode step's few slots) and the
grouped GEMMs (more slots) against the reference on the same device, at the benchmark model's
widths; the ``"dsv4"`` experts implementation against transformers' ``grouped_mm`` on one MoE
module, eager and compiled with ``fullgraph=True``."""

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
