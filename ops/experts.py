"""The routed experts of a MoE layer: ``dsv4::routed_experts``, and with the shared expert,
``dsv4::moe_experts``; and the choice of experts, ``dsv4::router_topk`` and ``dsv4::topk_indices``.

The model does not call ``routed_experts`` directly: ``dsv4_compile.hf_experts`` registers it with
transformers as the experts implementation ``"dsv4"``, which ``enable`` sets. On CUDA the op
runs two Triton launches for a decode step's few slots (``ops/kernels/experts.py``) and a
grouped GEMM over the slots sorted by expert for more (prefill); on other devices, the reference.

``moe_experts`` adds the layer's shared expert (transformers' ``DeepseekV4MLP``), which every token
passes through, and the router's logits to the same two launches as rows of programs: their weights
then stream beside the routed experts' instead of in launches of their own, at a decode step's few
tokens where each launch fills a fraction of the GPU (the router's product alone was a split-K
launch and a memset of its counters). ``dsv4_compile.hf_experts`` calls it in place of
transformers' MoE block where it computes the same thing.

``router_topk`` is a learned router's product, scoring and choice of experts in two launches.

``topk_indices`` is the learned router's ``torch.topk(scores, k).indices`` over a layer's experts
(256 in the released models) as one Triton program per row; a compiled step gets it from
``ReplaceShortTopkPass`` (``fx_passes/replace_short_topk.py``) when that pass is in its list.

Shape legend: T tokens, K experts per token, S = T * K slots, E experts, H hidden size,
I expert intermediate size, IS the shared expert's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference import experts as ref
from ._checks import INDEX_DTYPES, check_devices, check_positive, check_tensor
from ._library import HAS_TRITON, dsv4_op

if HAS_TRITON:
    from .kernels import experts as kernels

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


def _check_routed_experts(x, expert_ids, gate_up, down, limit, op: str = "routed_experts",
                          table: bool = False) -> None:
    check_tensor(op, "x", x, dtypes=ACTIVATION_DTYPES, ndim=2)
    check_tensor(op, "expert_ids", expert_ids, dtypes=INDEX_DTYPES, ndim=2,
                 shape=(None, None) if table else (x.shape[0], None))
    check_tensor(op, "gate_up", gate_up, dtypes=(x.dtype,), ndim=3)
    num_experts, two_i, hidden = gate_up.shape
    check_positive(op, "gate_up's expert count", num_experts)
    if hidden != x.shape[1] or two_i % 2:
        raise ValueError(f"dsv4.{op}: gate_up must be [E, 2I, H] with H = {x.shape[1]} (x's hidden "
                         f"size), got shape {tuple(gate_up.shape)}")
    check_tensor(op, "down", down, dtypes=(x.dtype,), shape=(num_experts, hidden, two_i // 2))
    if not limit > 0:  # NaN included
        raise ValueError(f"dsv4.{op}: limit={limit} must be > 0")
    check_devices(op, x=x, expert_ids=expert_ids, gate_up=gate_up, down=down)


def _routed_experts_fake(x, expert_ids, gate_up, down, limit):
    """A slot per token and column of ``expert_ids`` (whose rows are a table's with ``moe_experts``'
    ``token_ids``)."""
    return x.new_empty(x.shape[0] * expert_ids.shape[1], x.shape[1])


def grouped_routed_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                           limit: float) -> torch.Tensor:
    """``routed_experts`` as two grouped GEMMs over the slots sorted by expert (group ends found
    on the device: no host sync); slots of an id outside ``[0, E)`` sort last and come back 0."""
    topk, num_experts = expert_ids.shape[1], gate_up.shape[0]
    ids = expert_ids.reshape(-1)
    owned = (ids >= 0) & (ids < num_experts)
    sorted_ids, order = torch.sort(torch.where(owned, ids, num_experts))
    ends = torch.searchsorted(sorted_ids, torch.arange(1, num_experts + 1, device=ids.device,
                                                       dtype=sorted_ids.dtype)).to(torch.int32)
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    hidden = ref.swiglu(grouped_mm(x[order // topk], gate_up.transpose(-2, -1), offs=ends), limit)
    y = grouped_mm(hidden, down.transpose(-2, -1), offs=ends)
    y = torch.where((sorted_ids < num_experts)[:, None], y, 0)  # rows past the last group are not written
    return torch.empty_like(y).index_copy_(0, order, y)


def _routed_experts_cuda(x, expert_ids, gate_up, down, limit):
    if expert_ids.numel() <= kernels.MAX_SLOTS:
        return kernels.launch_routed_experts(x, expert_ids, gate_up, down, limit)
    return grouped_routed_experts(x, expert_ids, gate_up, down, limit)


@dsv4_op("routed_experts", check=_check_routed_experts, fake=_routed_experts_fake,
         cuda=_routed_experts_cuda if HAS_TRITON else None)
def routed_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   limit: float) -> torch.Tensor:
    """Each slot's expert applied to its token, unweighted: ``x [T, H]``, ``expert_ids [T, K]``,
    ``gate_up [E, 2I, H]``, ``down [E, H, I]`` -> ``[T * K, H]`` (row ``t * K + k``: expert
    ``expert_ids[t, k]`` of token ``t``; 0 for an id outside ``[0, E)``), ``x``'s dtype."""
    return ref.routed_experts(x, expert_ids, gate_up, down, limit)


def _check_moe_experts(x, expert_ids, gate_up, down, limit, shared_gate, shared_up, shared_down, router,
                       token_ids=None) -> None:
    op = "moe_experts"
    _check_routed_experts(x, expert_ids, gate_up, down, limit, op, table=token_ids is not None)
    if token_ids is not None:
        check_positive(op, "expert_ids' table rows", expert_ids.shape[0])
        check_tensor(op, "token_ids", token_ids, dtypes=INDEX_DTYPES, shape=(x.shape[0],))
        check_devices(op, x=x, token_ids=token_ids)
    check_tensor(op, "shared_gate", shared_gate, dtypes=(x.dtype,), ndim=2, shape=(None, x.shape[1]))
    check_tensor(op, "shared_up", shared_up, dtypes=(x.dtype,), shape=tuple(shared_gate.shape))
    check_tensor(op, "shared_down", shared_down, dtypes=(x.dtype,), shape=(x.shape[1], shared_gate.shape[0]))
    check_devices(op, x=x, shared_gate=shared_gate, shared_up=shared_up, shared_down=shared_down)
    if router is not None:
        check_tensor(op, "router", router, dtypes=(x.dtype,), shape=(None, x.shape[1]))
        check_positive(op, "router's expert count", router.shape[0])
        check_devices(op, x=x, router=router)


def _moe_experts_fake(x, expert_ids, gate_up, down, limit, shared_gate, shared_up, shared_down, router,
                      token_ids=None):
    logits = x.new_empty(x.shape[0], router.shape[0] if router is not None else 0)
    return _routed_experts_fake(x, expert_ids, gate_up, down, limit), x.new_empty(x.shape), logits


def _moe_experts_cuda(x, expert_ids, gate_up, down, limit, shared_gate, shared_up, shared_down, router,
                      token_ids=None):
    if x.shape[0] * expert_ids.shape[1] <= kernels.MAX_SLOTS:
        return kernels.launch_moe_experts(x, expert_ids, gate_up, down, limit, (shared_gate, shared_up, shared_down),
                                          router, token_ids=token_ids)
    if token_ids is not None:
        expert_ids = ref.hash_expert_ids(expert_ids, token_ids)
    # a GEMM's worth of tokens: the grouped routed experts and cuBLAS's products, as transformers runs them
    hidden = ref.gated_silu(F.linear(x, shared_gate), F.linear(x, shared_up), limit)
    logits = F.linear(x, router) if router is not None else x.new_empty(x.shape[0], 0)
    return grouped_routed_experts(x, expert_ids, gate_up, down, limit), F.linear(hidden, shared_down), logits


@dsv4_op("moe_experts", check=_check_moe_experts, fake=_moe_experts_fake,
         cuda=_moe_experts_cuda if HAS_TRITON else None)
def moe_experts(x: torch.Tensor, expert_ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float,
                shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
                router: torch.Tensor | None, token_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``routed_experts(x, expert_ids, gate_up, down, limit)``, the shared expert of every token
    (``shared_gate`` / ``shared_up [IS, H]``, ``shared_down [H, IS]``) and the router's logits
    ``x @ router.T`` (``router [E_r, H]``, or None) -> ``(slots [T * K, H], shared [T, H], logits
    [T, E_r] or [T, 0])``, ``x``'s dtype, each as the three computed apart (the logits as
    ``F.linear`` rounds them). With ``token_ids [T]``, ``expert_ids`` is a hash-routed layer's table
    ``[V, K]`` and token ``t`` takes row ``token_ids[t]`` of it (``reference.experts.hash_expert_ids``;
    the kernels look it up themselves, so the step has no launch for it)."""
    if token_ids is not None:
        expert_ids = ref.hash_expert_ids(expert_ids, token_ids)
    logits = ref.router_logits(x, router) if router is not None else x.new_empty(x.shape[0], 0)
    return (ref.routed_experts(x, expert_ids, gate_up, down, limit),
            ref.shared_expert(x, shared_gate, shared_up, shared_down, limit), logits)


TOPK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# topk_indices runs its kernel up to these sizes (a row's keys in one program's registers, k rounds
# of two reductions each) and the reference's sort above them.
TOPK_MAX_COLUMNS = 1024
TOPK_MAX_K = 32


def _check_topk_indices(scores, k) -> None:
    check_tensor("topk_indices", "scores", scores, dtypes=TOPK_DTYPES, ndim=2)
    if not 1 <= k <= scores.shape[1]:
        raise ValueError(f"dsv4.topk_indices: k={k} must be between 1 and the {scores.shape[1]} columns of scores")


def _topk_indices_fake(scores, k):
    return scores.new_empty(scores.shape[0], k, dtype=torch.int64)


def _topk_indices_cuda(scores, k):
    if scores.shape[1] > TOPK_MAX_COLUMNS or k > TOPK_MAX_K:
        return ref.topk_indices(scores, k)
    return kernels.launch_topk_indices(scores, k)


@dsv4_op("topk_indices", check=_check_topk_indices, fake=_topk_indices_fake,
         cuda=_topk_indices_cuda if HAS_TRITON else None)
def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``scores [T, E]`` fp32 / bf16 / fp16, ``1 <= k <= E`` -> ``[T, k]`` int64: the columns of each
    row's ``k`` largest scores, in descending order, equal scores in column order (-0.0 equals
    +0.0; NaN ranks above every number). On CUDA one program per row up to
    ``TOPK_MAX_COLUMNS`` columns and ``TOPK_MAX_K``; the reference's sort above."""
    return ref.topk_indices(scores, k)


def _check_router_topk(x, weight, bias, k) -> None:
    op = "router_topk"
    check_tensor(op, "x", x, dtypes=ACTIVATION_DTYPES, ndim=2)
    check_tensor(op, "weight", weight, dtypes=(x.dtype,), ndim=2, shape=(None, x.shape[1]))
    check_positive(op, "weight's expert count", weight.shape[0])
    check_tensor(op, "bias", bias, dtypes=TOPK_DTYPES, shape=(weight.shape[0],))
    if not 1 <= k <= weight.shape[0]:
        raise ValueError(f"dsv4.{op}: k={k} must be between 1 and the {weight.shape[0]} experts of weight")
    check_devices(op, x=x, weight=weight, bias=bias)


def _router_topk_fake(x, weight, bias, k):
    return x.new_empty(x.shape[0], k, dtype=torch.int64), x.new_empty(x.shape[0], weight.shape[0])


def _router_topk_cuda(x, weight, bias, k):
    if x.shape[0] > kernels.ROUTER_MAX_TOKENS or weight.shape[0] > TOPK_MAX_COLUMNS or k > TOPK_MAX_K:
        logits = F.linear(x, weight)
        return topk_indices(ref.router_scores(logits, bias), k), logits
    return kernels.launch_router_topk(x, weight, bias, k)


@dsv4_op("router_topk", check=_check_router_topk, fake=_router_topk_fake,
         cuda=_router_topk_cuda if HAS_TRITON else None)
def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V4's learned router (``reference.experts.router_topk``): ``x [T, H]`` bf16 / fp16,
    ``weight [E, H]`` of its dtype, ``bias [E]``, ``1 <= k <= E`` -> ``(indices [T, k]`` int64, the
    ``k`` largest ``sqrt(softplus(logit)) + bias`` in descending order, ``logits [T, E]`` of ``x``'s
    dtype). On CUDA up to ``ROUTER_MAX_TOKENS`` tokens two launches (``ops/kernels/experts.py``)
    where the router's product alone was a split-K launch, its counters' memset, a scoring kernel
    and ``aten.topk``; cuBLAS's product and ``topk_indices`` above."""
    return ref.router_topk(x, weight, bias, k)
