"""The backend's MoE experts implementation for ``transformers``: ``"dsv4"``.

:func:`register` (which ``enable`` calls) puts :func:`experts_forward` in transformers'
``ALL_EXPERTS_FUNCTIONS`` under :data:`IMPLEMENTATION`, the name ``enable`` then gives
``model.set_experts_implementation``. transformers is imported only then: the package's
config and ops import without it.
On CUDA it runs the routed experts through ``dsv4::routed_experts`` (two launches for a decode
step's few slots: ``ops/experts.py``) and weights and sums each token's slots as transformers
does (traced, so Inductor fuses it with the shared expert's sum); anywhere the op would not compute
exactly what transformers computes (another device, tensor-parallel or quantised weights, another
gate) it is transformers' own ``grouped_mm`` implementation, or its ``batched_mm`` one where the
products' rows are not 16-byte aligned as ``grouped_mm`` needs (an expert width not divisible by 8
in bf16, on one rank or per rank under tensor parallelism).

:func:`moe_forward` is a MoE block's forward (``DeepseekV4SparseMoeBlock.forward``) with the routed
experts, the shared expert and a hash-routed layer's router product in one op,
``dsv4::moe_experts``: the model step calls it for each MoE layer; where the op would not compute
what the block's own forward computes it calls the block.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops._library import HAS_TRITON
from .plain_tensor import is_plain_tensor

IMPLEMENTATION = "dsv4"
# False: moe_forward always calls the block (its router's product and the shared expert's three
# products apart from the routed experts' launches); benchmarks compare the two
MOE_IN_OP = True
# False: a hash-routed layer's router runs as transformers' gate (its product a launch of its own)
# instead of inside dsv4::moe_experts; benchmarks compare the two
HASH_ROUTER_IN_OP = True
# True: a MoE layer divides its weighted sum by the sum of the routing scores instead of each
# weight, in fp32 (as a compiled step computes transformers' form; eager, transformers rounds each
# weight to bf16: see _routed_sum). False: transformers' form. The weights' kernel of each layer
# is then gone: with LEARNED_ROUTER_OP, 15 µs less GPU time a b = 1 step of the benchmark model on
# an H100 (docs/perf-log.md)
NORMALISE_AFTER_SUM = True
# True: a learned router (sqrt-softplus scores) runs as dsv4::router_topk, its product, scoring and
# choice in two launches. False: as transformers' gate (a split-K product, a scoring kernel, aten.topk)
LEARNED_ROUTER_OP = True


def register() -> None:
    """Register :func:`experts_forward` with transformers as :data:`IMPLEMENTATION` (again is harmless)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)


def runs_routed_experts_op(experts: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether ``dsv4::routed_experts`` computes ``experts`` (a ``DeepseekV4Experts``) on
    ``hidden_states``: CUDA with Triton, plain bf16 / fp16 weight tensors (not DTensor shards or a
    quantiser's tensors), DeepSeek V4's own clamped SwiGLU, no bias, no expert parallelism."""
    if hidden_states.device.type != "cuda" or not HAS_TRITON:
        return False
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    return (all(_plain(w, hidden_states.dtype) for w in (experts.gate_up_proj, experts.down_proj))
            and type(experts)._apply_gate is DeepseekV4Experts._apply_gate
            and experts.config.hidden_act == "silu" and experts.has_gate and experts.is_concatenated
            and not (experts.has_bias or experts.is_transposed or experts.has_post_expert_norm
                     or experts._is_expert_parallel))


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: ``hidden_states [T, H]``, ``top_k_index [T, K]``,
    ``top_k_weights [T, K]`` -> ``[T, H]``, the weighted sum of each token's routed experts."""
    if not runs_routed_experts_op(self, hidden_states):
        from transformers.integrations.moe import batched_mm_experts_forward, grouped_mm_experts_forward

        grouped = grouped_mm_experts_forward if _rows_aligned(self, hidden_states) else batched_mm_experts_forward
        return grouped(self, hidden_states, top_k_index, top_k_weights)
    slots = torch.ops.dsv4.routed_experts(hidden_states, top_k_index, self.gate_up_proj, self.down_proj,
                                          float(self.limit))
    return _weighted_sum(slots, top_k_weights, hidden_states.dtype)


def _rows_aligned(experts: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether every row of the experts' products starts at a multiple of 16 bytes, as torch's
    ``grouped_mm`` requires (on the CPU and CUDA): the hidden size and the weights' last two sizes
    (this rank's shard under tensor parallelism), e.g. an expert width divisible by 8 in bf16."""
    sizes = [hidden_states.shape[-1]]
    for weight in (experts.gate_up_proj, experts.down_proj):
        sizes += (weight.to_local() if hasattr(weight, "to_local") else weight).shape[-2:]
    return all(n * hidden_states.element_size() % 16 == 0 for n in sizes)


def _weighted_sum(slots: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``slots [T * K, H]``, ``top_k_weights [T, K]`` -> ``[T, H]`` in ``dtype``: transformers' own
    weighting and sum of a token's experts (same dtypes, same order: the grouped path's numerics)."""
    tokens, topk = top_k_weights.shape
    weighted = slots.view(tokens, topk, slots.shape[-1]) * top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(dtype)


def runs_moe_experts_op(block: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether ``dsv4::moe_experts`` computes the experts of ``block`` (a ``DeepseekV4SparseMoeBlock``
    whose forward is transformers' own) on ``hidden_states [..., H]``: the routed experts as
    :func:`runs_routed_experts_op` asks, through this implementation; transformers' own hash or
    learned router; a shared expert that is transformers' ``DeepseekV4MLP`` with plain weights of
    the activations' dtype, no bias, the routed experts' SwiGLU limit."""
    # names imported from the module itself: torch 2.11's Dynamo refuses an import whose result is
    # transformers' lazy package module (`from ...deepseek_v4 import modeling_deepseek_v4`)
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HashRouter, DeepseekV4MLP, DeepseekV4SparseMoeBlock, DeepseekV4TopKRouter)

    if not MOE_IN_OP or type(block).forward is not DeepseekV4SparseMoeBlock.forward:
        return False  # (a block of another kind may have neither experts nor a shared expert)
    experts, shared, gate = block.experts, block.shared_experts, block.gate
    router_class = DeepseekV4HashRouter if block.is_hash else DeepseekV4TopKRouter
    if (type(shared) is not DeepseekV4MLP or type(gate).forward is not router_class.forward
            or getattr(experts.config, "_experts_implementation", None) != IMPLEMENTATION
            or not runs_routed_experts_op(experts, hidden_states)):
        return False
    projections = (shared.gate_proj, shared.up_proj, shared.down_proj)
    return (all(type(p) is nn.Linear and p.bias is None and _plain(p.weight, hidden_states.dtype) for p in projections)
            and shared.config.hidden_act == "silu" and shared.limit == experts.limit)


def _plain(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """A weight the ops read as it is: a plain tensor (not a DTensor shard or a quantiser's) of ``dtype``."""
    return is_plain_tensor(weight) and weight.dtype == dtype


def moe_forward(block: nn.Module, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``block(hidden_states, input_ids=input_ids)`` (``hidden_states [B, S, H]``, ``input_ids
    [B, S]``) -> ``[B, S, H]``: :func:`moe_block_composed` where ``dsv4::moe_experts`` applies
    (:func:`runs_moe_experts_op`), the block itself elsewhere."""
    if not runs_moe_experts_op(block, hidden_states):
        return block(hidden_states, input_ids=input_ids)
    return moe_block_composed(block, hidden_states, input_ids)


def moe_block_composed(block: nn.Module, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``DeepseekV4SparseMoeBlock.forward`` composed around one ``dsv4::moe_experts`` (the routed
    experts, the shared expert and a hash-routed layer's router logits). The experts are chosen by
    a hash layer's table (looked up inside the op, which also runs its router's product, where its
    weight is plain, of the activations' dtype; else the gate runs whole), or by a learned router before the op
    (its choice needs its logits): ``dsv4::router_topk`` where :func:`_runs_router_topk_op` says
    so, else the gate. Both kinds score the chosen experts as transformers' routers do,
    ``score_fn(logits)`` at the chosen columns (a learned gate's own weights go unused); then
    :func:`_routed_sum`, plus the shared expert."""
    gate, experts, shared = block.gate, block.experts, block.shared_experts
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    router_in_op = block.is_hash and HASH_ROUTER_IN_OP and _plain(gate.weight, hidden_states.dtype)
    token_ids = input_ids.reshape(-1)
    if router_in_op:  # the op looks the table up itself; the lookup below fuses into the scores' kernel
        choice = gate.tid2eid
    elif not block.is_hash and _runs_router_topk_op(gate, hidden_states.dtype):
        choice, logits = torch.ops.dsv4.router_topk(flat, gate.weight, gate.e_score_correction_bias, gate.top_k)
    else:
        logits, _, choice = gate(hidden_states, input_ids) if block.is_hash else gate(hidden_states)
    slots, shared_out, op_logits = torch.ops.dsv4.moe_experts(
        flat, choice, experts.gate_up_proj, experts.down_proj, float(experts.limit), shared.gate_proj.weight,
        shared.up_proj.weight, shared.down_proj.weight, gate.weight if router_in_op else None,
        token_ids if router_in_op else None)
    indices = gate.tid2eid[token_ids].long() if router_in_op else choice
    scores = gate.score_fn(op_logits if router_in_op else logits).gather(1, indices)
    routed = _routed_sum(slots, scores, gate.routed_scaling_factor, hidden_states.dtype)
    return routed.view(hidden_states.shape) + shared_out.view(hidden_states.shape)


def _runs_router_topk_op(gate: nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``dsv4::router_topk`` computes ``gate`` (transformers' learned router, its forward
    checked by the caller) for activations of ``dtype``: :data:`LEARNED_ROUTER_OP` on, transformers'
    ``sqrt(softplus)`` scoring, plain weight and bias."""
    from transformers.activations import SqrtSoftplusActivation

    bias = gate.e_score_correction_bias
    return (LEARNED_ROUTER_OP and type(gate.score_fn) is SqrtSoftplusActivation and _plain(gate.weight, dtype)
            and is_plain_tensor(bias) and bias.is_floating_point())


def _routed_sum(slots: torch.Tensor, scores: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``slots [T * K, H]``, ``scores [T, K]`` of the chosen experts -> ``[T, H]`` in ``dtype``:
    ``sum_k slot_k * w_k`` with transformers' routing weights ``w = scores / (sum(scores) + 1e-20) *
    scale``. :data:`NORMALISE_AFTER_SUM`: the same sum as ``(sum_k slot_k * score_k) / (sum(scores) +
    1e-20) * scale``, every term a reduction over K at each output element, so that Inductor can
    compute the weights inside the sum's kernel instead of in one of their own; in fp32, rounded
    once. A compiled step's fused kernel computes transformers' form in fp32 too; eager, transformers
    rounds each weight to bf16, which moves a term by up to 2**-8 of itself (where a token's slots
    cancel, far more than a rounding of their sum)."""
    if not NORMALISE_AFTER_SUM:
        return _weighted_sum(slots, scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) * scale, dtype)
    tokens, topk = scores.shape
    per_slot = scores.float().unsqueeze(-1).expand(tokens, topk, slots.shape[-1])
    total = (slots.float().view(per_slot.shape) * per_slot).sum(dim=1)
    return (total / (per_slot.sum(dim=1) + 1e-20) * scale).to(dtype)
