"""The backend's MoE experts implementation for ``transformers``: ``"dsv4"``.

:func:`register` (which ``enable`` calls) puts :func:`experts_forward` in transformers'
``ALL_EXPERTS_FUNCTIONS`` under :data:`IMPLEMENTATION`, the name ``enable`` then gives
``model.set_experts_implementation``. transformers is imported only then: the package's
config and ops import without it.
On CUDA it runs the routed experts through ``dsv4::routed_experts`` (two launches for a decode
step's few slots: ``ops/experts.py``) and weights and sums each token's slots as transformers
does (traced, so Inductor fuses it with the shared expert's sum); anywhere the op would not compute
exactly what transformers computes (another device, tensor-parallel or quantised weights, another
gate) it is transformers' own ``grouped_mm`` implementation.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops._library import HAS_TRITON

IMPLEMENTATION = "dsv4"


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

    weights = (experts.gate_up_proj, experts.down_proj)
    return (all(type(w) in (torch.Tensor, nn.Parameter) and w.dtype == hidden_states.dtype for w in weights)
            and type(experts)._apply_gate is DeepseekV4Experts._apply_gate
            and experts.config.hidden_act == "silu" and experts.has_gate and experts.is_concatenated
            and not (experts.has_bias or experts.is_transposed or experts.has_post_expert_norm
                     or experts._is_expert_parallel))


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface: ``hidden_states [T, H]``, ``top_k_index [T, K]``,
    ``top_k_weights [T, K]`` -> ``[T, H]``, the weighted sum of each token's routed experts."""
    if not runs_routed_experts_op(self, hidden_states):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    tokens, topk = top_k_index.shape
    slots = torch.ops.dsv4.routed_experts(hidden_states, top_k_index, self.gate_up_proj, self.down_proj,
                                          float(self.limit))
    # transformers' own weighting and sum (same dtypes, same order): the grouped path's numerics
    weighted = slots.view(tokens, topk, -1) * top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)
