"""``dsv4::routed_experts`` and ``dsv4::moe_experts`` on the CPU (their references) against
transformers' own experts code and MoE block, the grouped path the CUDA op takes for a large step, the ``"dsv4"``
experts implementation, and argument errors that name the argument (opcheck: ``test_opcheck.py``)."""

import copy

import pytest
import torch
from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward
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


def test_dsv4_implementation_on_unaligned_rows_is_batched_mm_off_cuda():
    """An expert width whose bf16 rows are not 16 bytes apart (68: a width of 136 split over two
    tensor-parallel ranks), which torch's grouped_mm refuses: transformers' batched implementation."""
    hf_experts.register()
    module = _experts(moe_intermediate_size=68)
    module.config._experts_implementation = hf_experts.IMPLEMENTATION
    x, ids, weights = _route(7, 2, module.num_experts)
    assert torch.equal(module(x, ids, weights), batched_mm_experts_forward(module, x, ids, weights))


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


def _moe_block(layer_idx: int, dtype=torch.bfloat16):
    """A ``DeepseekV4SparseMoeBlock`` of the tiny config (layer 0 hash-routed, layer 1 a learned
    router; 4 experts, 2 a token) with random weights some of whose gate / up values pass the
    SwiGLU limit; the hash table draws 2 distinct experts a token."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    config = tiny_hf_config()
    torch.manual_seed(layer_idx)
    block = DeepseekV4SparseMoeBlock(config, layer_idx)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0, 0.02 if "down" in name else 0.3)  # outputs of order 1
        if block.is_hash:
            block.gate.tid2eid.copy_(torch.rand(config.vocab_size, 4).argsort(dim=1)[:, :2])
    return block.to(dtype).eval()


@pytest.mark.parametrize("layer_idx, router_op", [(0, True), (0, False), (1, True), (1, False)])  # hash, learned
@pytest.mark.parametrize("normalise_after_sum", [False, True])
@pytest.mark.parametrize("tokens", [0, 1, 6])
@torch.no_grad()
def test_moe_block_composed_is_the_block(layer_idx, router_op, normalise_after_sum, tokens, monkeypatch):
    """The block composed around ``dsv4::moe_experts`` (its reference on the CPU; a hash layer's
    scores from the logits the op returns or from its gate, a learned router through
    ``dsv4::router_topk`` or its gate; the weights normalised before or after the sum) computes
    transformers' block: against the block run in fp64 on the same weights it errs no more than
    the block itself in bf16."""
    monkeypatch.setattr(hf_experts, "HASH_ROUTER_IN_OP", router_op)
    monkeypatch.setattr(hf_experts, "LEARNED_ROUTER_OP", router_op)
    monkeypatch.setattr(hf_experts, "NORMALISE_AFTER_SUM", normalise_after_sum)
    block = _moe_block(layer_idx)
    x = torch.randn(1, tokens, 256).bfloat16()
    input_ids = torch.randint(0, block.experts.config.vocab_size, (1, tokens))
    got = hf_experts.moe_block_composed(block, x, input_ids)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    if tokens:
        assert block.shared_experts.gate_proj(x).float().abs().max() > block.experts.limit
        exact = copy.deepcopy(block).double()(x.double(), input_ids=input_ids)
        own_error = (block(x, input_ids=input_ids).double() - exact).abs().max()
        assert (got.double() - exact).abs().max() <= own_error


@pytest.mark.parametrize("tokens", [0, 1, 6])
def test_moe_experts_reference_is_the_routed_experts_shared_expert_and_router(tokens):
    block = _moe_block(0)
    experts, shared, router = block.experts, block.shared_experts, block.gate.weight
    x, ids, _ = _route(tokens, 2, experts.num_experts)
    weights = (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)
    routed = (x, ids, experts.gate_up_proj, experts.down_proj, experts.limit)
    slots, shared_out, logits = torch.ops.dsv4.moe_experts(*routed, *weights, router)
    assert torch.equal(slots, routed_experts(*routed))
    assert shared_out.shape == (tokens, 256) and logits.shape == (tokens, 4) and logits.dtype == torch.bfloat16
    _, _, no_logits = torch.ops.dsv4.moe_experts(*routed, *weights, None)
    assert no_logits.shape == (tokens, 0)
    if tokens:
        with torch.no_grad():
            torch.testing.assert_close(shared_out, shared(x), atol=2e-3, rtol=1.6e-2)
            torch.testing.assert_close(logits, torch.nn.functional.linear(x, router), atol=2e-3, rtol=1.6e-2)


def test_moe_experts_bad_arguments_name_themselves():
    block = _moe_block(0)
    x, ids, _ = _route(3, 2, 4)
    experts, shared = block.experts, block.shared_experts
    routed = (x, ids, experts.gate_up_proj.detach(), experts.down_proj.detach(), 10.0)
    g, u, d = (w.detach() for w in (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight))
    r = block.gate.weight.detach()
    cases = [((g.half(), u, d, r), TypeError, "shared_gate must have dtype"),
             ((g[:, :64], u, d, r), ValueError, "shared_gate has shape"),
             ((g, u[:64], d, r), ValueError, "shared_up has shape"),
             ((g, u, d.T.contiguous(), r), ValueError, "shared_down has shape"),
             ((g, u, d.to("meta"), r), ValueError, "shared_down is on meta"),
             ((g, u, d, r.half()), TypeError, "router must have dtype"),
             ((g, u, d, r[:, :64]), ValueError, "router has shape"),
             ((g, u, d, r[:0]), ValueError, "router's expert count=0"),
             ((g, u, d, r.to("meta")), ValueError, "router is on meta"),
             ((g, u, d, r, torch.arange(2)), ValueError, "token_ids has shape"),
             ((g, u, d, r, torch.zeros(3)), TypeError, "token_ids must have dtype"),
             ((g, u, d, r, torch.arange(3).to("meta")), ValueError, "token_ids is on meta")]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            torch.ops.dsv4.moe_experts(*routed, *args)
    with pytest.raises(ValueError, match="table rows=0"):
        torch.ops.dsv4.moe_experts(x, ids[:0], *routed[2:], g, u, d, r, torch.arange(3))


@pytest.mark.parametrize("tokens", [0, 1, 6])
def test_moe_experts_looks_up_a_hash_table(tokens):
    """With ``token_ids`` the op takes each token's experts from row ``token_ids[t]`` of the table it
    is given: the same outputs as with the looked-up ids, bit for bit; a token id outside the table
    (-1, V) chooses no expert, so its slots are 0, as ids of -1 make them."""
    block = _moe_block(0)
    experts, shared = block.experts, block.shared_experts
    weights = (experts.gate_up_proj.detach(), experts.down_proj.detach(), 10.0,
               *(w.detach() for w in (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight)),
               block.gate.weight.detach())
    table = block.gate.tid2eid
    x, _, _ = _route(tokens, 2, 4)
    token_ids = torch.randint(0, table.shape[0], (tokens,), generator=torch.Generator().manual_seed(tokens))
    if tokens > 1:
        token_ids[0], token_ids[-1] = -1, table.shape[0]
    chosen = ref.hash_expert_ids(table, token_ids)
    assert chosen.shape == (tokens, 2) and (chosen[1:-1] == table[token_ids[1:-1]]).all()
    assert tokens < 2 or ((chosen[0] == -1).all() and (chosen[-1] == -1).all())
    got = torch.ops.dsv4.moe_experts(x, table, weights[0], weights[1], *weights[2:], token_ids)
    want = torch.ops.dsv4.moe_experts(x, chosen, weights[0], weights[1], *weights[2:])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if tokens > 1:
        assert not got[0][:2].any() and not got[0][-2:].any()


def test_moe_forward_is_the_block_off_cuda():
    """On the CPU ``moe_forward`` is the block's own forward (the op's kernels are CUDA's), exactly;
    a module of another kind is called as it is."""
    hf_experts.register()
    block = _moe_block(1)
    block.experts.config._experts_implementation = hf_experts.IMPLEMENTATION
    x = torch.randn(1, 5, 256).bfloat16()
    ids = torch.zeros(1, 5, dtype=torch.long)
    assert not hf_experts.runs_moe_experts_op(block, x)
    with torch.no_grad():
        assert torch.equal(hf_experts.moe_forward(block, x, ids), block(x, input_ids=ids))
    other = torch.nn.Identity()
    assert not hf_experts.runs_moe_experts_op(other, x)


@pytest.mark.parametrize("layer_idx", [0, 1])  # hash-routed, learned router
@pytest.mark.parametrize("switches_on", [False, True])
@torch.no_grad()
def test_moe_block_composed_compiles_whole(layer_idx, switches_on, monkeypatch):
    """``torch.compile(fullgraph=True)`` of the composed block (with ``NORMALISE_AFTER_SUM`` and
    ``LEARNED_ROUTER_OP`` both off, then both on): no graph break, one frame, and the eager
    composition's values (the ops' references on the CPU)."""
    from torch._dynamo.utils import counters

    from tests.support.compile_checks import fresh_compile_state

    monkeypatch.setattr(hf_experts, "NORMALISE_AFTER_SUM", switches_on)
    monkeypatch.setattr(hf_experts, "LEARNED_ROUTER_OP", switches_on)
    block = _moe_block(layer_idx)
    x = torch.randn(1, 5, 256).bfloat16()
    input_ids = torch.randint(0, block.experts.config.vocab_size, (1, 5))
    with fresh_compile_state():
        compiled = torch.compile(lambda x, ids: hf_experts.moe_block_composed(block, x, ids), fullgraph=True,
                                 options={"emulate_precision_casts": True})
        got = compiled(x, input_ids)
        assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(got, hf_experts.moe_block_composed(block, x, input_ids), atol=0, rtol=0)


@torch.no_grad()
def test_router_topk_reference_is_the_learned_router():
    """``dsv4::router_topk`` (its reference on the CPU) against transformers' ``DeepseekV4TopKRouter``
    with a bias that reorders its choice: the logits to a bf16 rounding, and the same experts for
    every token whose k-th and (k+1)-th biased scores the router's bf16 keeps apart."""
    gate = _moe_block(1).gate
    gate.e_score_correction_bias.normal_(0, 1.0)
    x = torch.randn(1, 64, 256).bfloat16()
    logits_hf, _, indices_hf = gate(x)
    indices, logits = torch.ops.dsv4.router_topk(x[0], gate.weight, gate.e_score_correction_bias, gate.top_k)
    assert indices.shape == (64, gate.top_k) and logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits, logits_hf, atol=2e-2, rtol=1.6e-2)
    ranked = (gate.score_fn(logits_hf) + gate.e_score_correction_bias).float().sort(dim=-1, descending=True).values
    apart = ranked[:, gate.top_k - 1] - ranked[:, gate.top_k] > 0.05
    assert apart.float().mean() > 0.5
    assert torch.equal(indices[apart].sort(dim=-1).values, indices_hf[apart].sort(dim=-1).values)
    unbiased = ref.topk_indices(ref.router_scores(logits), gate.top_k)
    assert not torch.equal(indices.sort(dim=-1).values, unbiased.sort(dim=-1).values)


def test_router_topk_bad_arguments_name_themselves():
    x, w, b = torch.randn(3, 64).bfloat16(), torch.randn(8, 64).bfloat16(), torch.zeros(8)
    cases = [((x.int(), w, b, 2), TypeError, "x must have dtype"),
             ((x, w.half(), b, 2), TypeError, "weight must have dtype"),
             ((x, w[:, :32], b, 2), ValueError, "weight has shape"),
             ((x, w[:0], b[:0], 1), ValueError, "weight's expert count=0"),
             ((x, w, b[:4], 2), ValueError, "bias has shape"),
             ((x, w, b, 9), ValueError, "k=9"),
             ((x, w, b.to("meta"), 2), ValueError, "bias is on meta")]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            torch.ops.dsv4.router_topk(*args)
