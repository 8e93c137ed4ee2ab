"""The routed experts of a MoE layer: ``dsv4::routed_experts``.

The model does not call the op directly: ``dsv4_compile.hf_experts`` registers it with
transformers as the experts implementation ``"dsv4"``, which ``enable`` sets. On CUDA the op
runs two Triton launches for a decode step's few slots (``ops/kernels/experts.py``) and a
grouped GEMM over the slots sorted by expert for more (prefill); on other devices, the reference.

Shape legend: T tokens, K experts per token, S = T * K slots, E experts, H hidden size,
I expert intermediate size.
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


def _check_routed_experts(x, expert_ids, gate_up, down, limit) -> None:
    op = "routed_experts"
    check_tensor(op, "x", x, dtypes=ACTIVATION_DTYPES, ndim=2)
    check_tensor(op, "expert_ids", expert_ids, dtypes=INDEX_DTYPES, ndim=2, shape=(x.shape[0], None))
    check_tensor(op, "gate_up", gate_up, dtypes=(x.dtype,), ndim=3)
    num_experts, two_i, hidden = gate_up.shape
    check_positive(op, "gate_up's expert count", num_experts)
    if hidden != x.shape[1] or two_i % 2:
        raise ValueError(f"dsv4.routed_experts: gate_up must be [E, 2I, H] with H = {x.shape[1]} (x's hidden "
                         f"size), got shape {tuple(gate_up.shape)}")
    check_tensor(op, "down", down, dtypes=(x.dtype,), shape=(num_experts, hidden, two_i // 2))
    if not limit > 0:  # NaN included
        raise ValueError(f"dsv4.routed_experts: limit={limit} must be > 0")
    check_devices(op, x=x, expert_ids=expert_ids, gate_up=gate_up, down=down)


def _routed_experts_fake(x, expert_ids, gate_up, down, limit):
    return x.new_empty(expert_ids.numel(), x.shape[1])


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
