"""The routed experts of a DeepSeek V4 MoE layer — reference.

transformers' ``DeepseekV4Experts`` holds every routed expert of a layer as two stacked weights:
``gate_up [E, 2I, H]`` (the gate's rows, then the up projection's) and ``down [E, H, I]``. A token
routed to expert ``e`` becomes::

    gate, up = (x @ gate_up[e].T).chunk(2)
    y = (silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)) @ down[e].T

Each (token, expert) pair is a *slot*: ``expert_ids [T, K]`` names the K experts of each token and
slot ``s = t * K + k`` reads token ``t``. The caller weights and sums the K slots of a token
(transformers does that after its grouped GEMMs, so this module stops before it).

Rounding: the matmuls accumulate in fp32 and, like the grouped GEMMs transformers runs, every
intermediate is rounded to the activations' dtype where transformers' own code rounds it (the
gate/up output, SiLU, the product, the down output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """``gate_up [S, 2I]`` (the activations' dtype) -> ``[S, I]``:
    ``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)``, each step rounded to that dtype
    (transformers' ``DeepseekV4Experts._apply_gate``)."""
    return gated_silu(*gate_up.chunk(2, dim=-1), limit)


def gated_silu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """:func:`swiglu` of the gate and up products given apart: ``[S, I]`` each -> ``[S, I]``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def routed_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   limit: float) -> torch.Tensor:
    """Every slot's expert output, unweighted.

    Args:
        x: ``[T, H]`` bf16 / fp16 token activations.
        expert_ids: ``[T, K]`` int32 / int64, the experts of each token; an id outside ``[0, E)``
            makes its slot's output 0 (an expert held by no one, as under expert parallelism).
        gate_up: ``[E, 2I, H]`` of ``x``'s dtype.
        down: ``[E, H, I]`` of ``x``'s dtype.
        limit: the SwiGLU clamp (``config.swiglu_limit``).

    Returns:
        ``[T * K, H]`` of ``x``'s dtype; row ``t * K + k`` is expert ``expert_ids[t, k]`` of token ``t``.

    Every expert is applied to every slot and the slot keeps its own expert's result (no host
    sync, no data-dependent shape): the specification, not a fast path.
    """
    t, k = expert_ids.shape
    rows = x.repeat_interleave(k, dim=0).float()  # [S, H], slot s reads token s // K
    ids = expert_ids.reshape(-1, 1)
    out = torch.zeros(t * k, down.shape[1], dtype=x.dtype, device=x.device)
    for e in range(gate_up.shape[0]):
        hidden = swiglu((rows @ gate_up[e].float().T).to(x.dtype), limit)
        y = (hidden.float() @ down[e].float().T).to(x.dtype)
        out = torch.where(ids == e, y, out)
    return out


def hash_expert_ids(table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """A hash-routed layer's choice (transformers' ``DeepseekV4HashRouter``: ``tid2eid[input_ids]``):
    ``table [V, K]``, ``token_ids [T]`` -> ``[T, K]`` of the table's dtype; a token id outside
    ``[0, V)`` chooses no expert (-1 in each of its K columns) instead of reading past the table."""
    valid = (token_ids >= 0) & (token_ids < table.shape[0])
    return torch.where(valid[:, None], table[token_ids.clamp(0, table.shape[0] - 1)], -1)


def shared_expert(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  limit: float) -> torch.Tensor:
    """transformers' ``DeepseekV4MLP`` (the shared expert every token passes through):
    ``x [T, H]``, ``gate`` / ``up [IS, H]``, ``down [H, IS]`` of ``x``'s dtype -> ``[T, H]``,
    rounded as :func:`routed_experts` rounds an expert."""
    gate_up = (x.float() @ torch.cat([gate, up]).float().T).to(x.dtype)
    return (swiglu(gate_up, limit).float() @ down.float().T).to(x.dtype)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A router's logits: ``x [T, H]``, ``weight [E, H]`` of ``x``'s dtype -> ``x @ weight.T``
    ``[T, E]``, accumulated in fp32 and rounded to ``x``'s dtype (as ``F.linear``)."""
    return (x.float() @ weight.float().T).to(x.dtype)


def router_scores(logits: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek V4's ``sqrtsoftplus`` scores of ``logits [T, E]``, fp32, plus ``bias [E]`` (the
    selection's ``e_score_correction_bias``) when given."""
    scores = F.softplus(logits.float()).sqrt()
    return scores if bias is None else scores + bias.float()


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V4's learned router (transformers' ``DeepseekV4TopKRouter`` with its ``sqrtsoftplus``
    scoring): ``x [T, H]``, ``weight [E, H]`` of ``x``'s dtype, ``bias [E]`` -> ``(indices [T, k]
    int64, logits [T, E])``: :func:`router_logits`, and the ``k`` largest :func:`router_scores` with
    the bias in descending order, as :func:`topk_indices` orders them."""
    logits = router_logits(x, weight)
    return topk_indices(router_scores(logits, bias), k), logits


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``scores [T, E]`` -> ``[T, k]`` int64: each row's ``k`` largest, in descending order, equal
    scores in column order (a stable sort: -0.0 equals +0.0; NaN ranks above every number)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k].contiguous()
