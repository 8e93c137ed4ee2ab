"""``dsv4::routed_experts`` on the CPU (its reference) against transformers' own experts code, the
grouped path the CUDA op takes for a large step, the ``"dsv4"`` experts implementation, and
argument errors that name the argument (opcheck: ``test_opcheck.py``)."""

import pytest
import torch
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

from dsv4_compile import hf_experts
from dsv4_compile.ops.experts import grouped_routed_experts
from dsv4_compile.reference import experts as ref
from tests.support.hf_model import tiny_hf_config

routed_experts = torch.ops.dsv4.routed_experts


def _experts(seed=0, dtype=torch.bfloat16, **overrides) -> DeepseekV4Experts:
    """A ``DeepseekV4Experts`` of the tiny config (4 experts, hidden 256, intermediate 128), weights
    scaled so that some gate / up values pass the SwiGLU limit."""
    torch.manual_seed(seed)
    module = DeepseekV4Experts(tiny_hf_config(**overrides))
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.5)
        module.down_proj.normal_(0, 0.05)
    return module.to(dtype).eval()


def _route(tokens, topk, num_experts, seed=0, hidden=256, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.rand(tokens, num_experts, generator=gen).argsort(dim=1)[:, :topk]  # K distinct experts a token
    weights = torch.rand(tokens, topk, generator=gen).to(dtype)
    return x, ids, weights


def _eager_slots(module, x, ids):
    """Each slot through transformers' eager expert (one token at a time, unweighted)."""
    rows = []
    for t, k in ((t, k) for t in range(ids.shape[0]) for k in range(ids.shape[1])):
        e = ids[t, k]
        hidden = module._apply_gate(torch.nn.functional.linear(x[t:t + 1], module.gate_up_proj[e]))
        rows.append(torch.nn.functional.linear(hidden, module.down_proj[e]))
    return torch.cat(rows)


@pytest.mark.parametrize("tokens, topk", [(1, 2), (5, 2), (3, 4), (0, 2)])
def test_reference_equals_transformers_per_slot(tokens, topk):
    module = _experts()
    x, ids, _ = _route(tokens, topk, module.num_experts)
    got = routed_experts(x, ids, module.gate_up_proj, module.down_proj, module.limit)
    assert got.shape == (tokens * topk, 256) and got.dtype == torch.bfloat16
    if tokens:
        # one bf16 rounding of a GEMM output apart (CPU GEMMs of other shapes accumulate in another order)
        torch.testing.assert_close(got, _eager_slots(module, x, ids), atol=2e-3, rtol=1.6e-2)


def test_the_limit_is_applied():
    """With the clamp removed the outputs change: the weights above drive gate / up past 10."""
    module = _experts()
    x, ids, _ = _route(6, 2, module.num_experts)
    args = (x, ids, module.gate_up_proj, module.down_proj)
    assert not torch.equal(routed_experts(*args, module.limit), routed_experts(*args, 1e9))


def test_ids_outside_the_experts_give_zero_rows():
    module = _experts()
    x, ids, _ = _route(4, 2, module.num_experts)
    ids[1, 0], ids[3, 1] = -1, module.num_experts
    got = routed_experts(x, ids, module.gate_up_proj, module.down_proj, module.limit)
    assert torch.equal(got[[2, 7]], torch.zeros(2, 256, dtype=got.dtype))
    kept = [s for s in range(8) if s not in (2, 7)]
    valid = ids.clone()
    valid[1, 0] = valid[3, 1] = 0
    assert torch.equal(got[kept], routed_experts(x, valid, module.gate_up_proj, module.down_proj, module.limit)[kept])


@pytest.mark.parametrize("tokens", [1, 40])
def test_grouped_path_equals_the_reference(tokens):
    """The CUDA op's path for a large step (sorted slots, two grouped GEMMs), here on the CPU."""
    module = _experts()
    x, ids, _ = _route(tokens, 2, module.num_experts)
    ids[0, 1] = -3  # an unowned slot sorts past every group and comes back 0
    want = ref.routed_experts(x, ids, module.gate_up_proj, module.down_proj, module.limit)
    got = grouped_routed_experts(x, ids, module.gate_up_proj, module.down_proj, module.limit)
    assert torch.equal(got[1], torch.zeros(256, dtype=got.dtype))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1.6e-2)


def test_weighted_sum_equals_transformers_grouped_mm():
    """The op's slots weighted and summed as ``experts_forward`` does it = transformers' grouped
    implementation (the backend's default before this op) to one bf16 rounding."""
    module = _experts()
    x, ids, weights = _route(9, 2, module.num_experts)
    slots = routed_experts(x, ids, module.gate_up_proj, module.down_proj, module.limit)
    got = (slots.view(9, 2, -1) * weights.unsqueeze(-1)).sum(1).to(x.dtype)
    torch.testing.assert_close(got, grouped_mm_experts_forward(module, x, ids, weights), atol=2e-3, rtol=1.6e-2)


def test_dsv4_implementation_is_grouped_mm_off_cuda():
    hf_experts.register()
    module = _experts()
    module.config._experts_implementation = hf_experts.IMPLEMENTATION
    x, ids, weights = _route(7, 2, module.num_experts)
    assert not hf_experts.runs_routed_experts_op(module, x)
    assert torch.equal(module(x, ids, weights), grouped_mm_experts_forward(module, x, ids, weights))


def test_bad_arguments_name_themselves():
    module = _experts()
    x, ids, _ = _route(3, 2, module.num_experts)
    gu, down = module.gate_up_proj.detach(), module.down_proj.detach()
    cases = [
        ((x.float(), ids, gu, down, 10.0), TypeError, "x must have dtype"),
        ((x, ids.float(), gu, down, 10.0), TypeError, "expert_ids must have dtype"),
        ((x, ids[:2], gu, down, 10.0), ValueError, "expert_ids has shape"),
        ((x, ids, gu.half(), down, 10.0), TypeError, "gate_up must have dtype"),
        ((x, ids, gu[:, :, :128], down, 10.0), ValueError, "gate_up must be"),
        ((x, ids, gu[:0], down[:0], 10.0), ValueError, "expert count=0"),
        ((x, ids, gu, down[:, :, :64], 10.0), ValueError, "down has shape"),
        ((x, ids, gu, down, 0.0), ValueError, "limit=0.0"),
        ((x, ids, gu, down.to("meta"), 10.0), ValueError, "down is on meta"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            routed_experts(*args)


def _shared_expert(seed=1, dtype=torch.bfloat16):
    """transformers' ``DeepseekV4MLP`` of the tiny config (hidden 256, intermediate 128), weights
    scaled so that some gate / up values pass the SwiGLU limit."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4MLP

    torch.manual_seed(seed)
    module = DeepseekV4MLP(tiny_hf_config(intermediate_size=128))
    with torch.no_grad():
        for linear, std in ((module.gate_proj, 0.5), (module.up_proj, 0.5), (module.down_proj, 0.05)):
            linear.weight.normal_(0, std)
    return module.to(dtype).eval()


@pytest.mark.parametrize("tokens", [0, 1, 6])
def test_moe_experts_reference_is_the_routed_experts_and_transformers_shared_expert(tokens):
    experts, shared = _experts(), _shared_expert()
    x, ids, _ = _route(tokens, 2, experts.num_experts)
    weights = (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    slots, shared_out = torch.ops.dsv4.moe_experts(x, ids, experts.gate_up_proj, experts.down_proj, experts.limit,
                                                   *weights)
    assert torch.equal(slots, routed_experts(x, ids, experts.gate_up_proj, experts.down_proj, experts.limit))
    assert shared_out.shape == (tokens, 256) and shared_out.dtype == torch.bfloat16
    if tokens:
        with torch.no_grad():
            want = shared(x)
        assert (want.float().abs().max() > 1.0) and (shared.gate_proj(x).float().abs().max() > experts.limit)
        torch.testing.assert_close(shared_out, want, atol=2e-3, rtol=1.6e-2)


def test_moe_experts_bad_shared_weights_name_themselves():
    experts, shared = _experts(), _shared_expert()
    x, ids, _ = _route(3, 2, experts.num_experts)
    routed = (x, ids, experts.gate_up_proj.detach(), experts.down_proj.detach(), 10.0)
    g, u, d = (w.detach() for w in (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight))
    cases = [((g.half(), u, d), TypeError, "shared_gate must have dtype"),
             ((g[:, :64], u, d), ValueError, "shared_gate has shape"),
             ((g, u[:64], d), ValueError, "shared_up has shape"),
             ((g, u, d.T.contiguous()), ValueError, "shared_down has shape"),
             ((g, u, d.to("meta")), ValueError, "shared_down is on meta")]
    for shared_weights, error, message in cases:
        with pytest.raises(error, match=message):
            torch.ops.dsv4.moe_experts(*routed, *shared_weights)


def test_moe_forward_is_the_block_off_cuda():
    """On the CPU ``moe_forward`` is the block's own forward (the op's kernels are CUDA's), exactly;
    a module of another kind is called as it is."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    hf_experts.register()
    config = tiny_hf_config()
    config._experts_implementation = hf_experts.IMPLEMENTATION
    torch.manual_seed(0)
    block = DeepseekV4SparseMoeBlock(config, 1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    block = block.bfloat16().eval()
    x = torch.randn(1, 5, config.hidden_size).bfloat16()
    ids = torch.zeros(1, 5, dtype=torch.long)
    assert not hf_experts.runs_moe_experts_op(block, x)
    with torch.no_grad():
        assert torch.equal(hf_experts.moe_forward(block, x, ids), block(x, input_ids=ids))
    other = torch.nn.Identity()
    assert not hf_experts.runs_moe_experts_op(other, x)
