"""Tensor parallelism of a ``transformers`` DeepSeek V4 model on the backend (docs/model.md,
"Tensor parallelism").

The ranks of a 1-D device mesh hold the same model; its sharded parameters are DTensors under the
checkpoint's names, each rank holding its slice, placed by ``transformers``' own parallel styles:

* attention, by head (:data:`ATTENTION_TP_PLAN`): ``q_b_proj`` column-sharded (``H / tp`` query
  heads a rank), the per-head ``sinks`` with their heads, the grouped ``o_a_proj`` by whole output
  groups (``o_groups / tp``; a group projects a contiguous run of heads) and ``o_b_proj``
  row-sharded, whose partial sums are the layer's one all-reduce. The shared KV head, the
  compressors and the indexer stay replicated: every rank computes them and writes its own cache.
* everything else as the model's own ``tp_plan`` says (``base_model_tp_plan``: experts sharded
  along their intermediate dim with one all-reduce of their outputs; the embedding
  vocabulary-parallel; ``lm_head`` column-sharded, its logits gathered on every rank).

It is the plan ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N,
tp_plan=ATTENTION_TP_PLAN))`` loads shard by shard; :func:`parallelize` applies it to a model that
every rank loaded whole. The layers compute on the local shards at inference (``transformers``'
styles swap them in), so the compiled step's graph holds plain tensors and the collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# transformers plan rules (wildcards over the layers), merged into the model's own tp_plan.
ATTENTION_TP_PLAN = {
    "model.layers.*.self_attn.q_b_proj": "colwise",
    "model.layers.*.self_attn.sinks": "colwise",
    "model.layers.*.self_attn.o_a_proj": "colwise",
    "model.layers.*.self_attn.o_b_proj": "rowwise",
}
_SHARDED = ("q_b_proj.weight", "sinks", "o_a_proj.weight", "o_b_proj.weight")


def resolve_mesh(model: nn.Module, device_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D mesh ``model`` runs tensor-parallel over, ``None`` for one device: ``device_mesh``, or
    for a model loaded sharded (``from_pretrained(distributed_config=...)``) the mesh of its
    attention shards. ``ValueError`` for a mesh that is not 1-D, or a model sharded over another
    mesh or without :data:`ATTENTION_TP_PLAN`."""
    if device_mesh is not None and (not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1):
        raise ValueError(f"device_mesh must be a 1-D DeviceMesh of the tensor-parallel ranks, got {device_mesh!r}")
    loaded = _loaded_mesh(model)
    if device_mesh is not None and loaded is not None and _ranks(loaded) != _ranks(device_mesh):
        raise ValueError(f"device_mesh: the model is sharded over the ranks {_ranks(loaded)}, not "
                         f"{_ranks(device_mesh)}")
    mesh = loaded if device_mesh is None else device_mesh
    return mesh if mesh is not None and mesh.size() > 1 else None


def _loaded_mesh(model: nn.Module) -> DeviceMesh | None:
    """The mesh of the attention shards of a model loaded sharded; ``None`` if nothing is sharded."""
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return None
    for i, layer in enumerate(model.model.layers):
        for name in _SHARDED:
            if not isinstance(layer.self_attn.get_parameter(name), DTensor):
                raise ValueError(f"model: model.layers.{i}.self_attn.{name} is not sharded while other parameters "
                                 "are; load it with DistributedConfig(tp_plan=dsv4_compile.parallel.ATTENTION_TP_PLAN)")
    return model.model.layers[0].self_attn.q_b_proj.weight.device_mesh


def _ranks(mesh: DeviceMesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


def parallelize(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard ``model`` over ``mesh`` in place, as ``from_pretrained`` with
    ``DistributedConfig(tp_size=mesh.size(), tp_plan=ATTENTION_TP_PLAN)`` loads it (nothing to do for
    a model loaded so), then give each grouped ``o_a_proj`` its rank's group count."""
    if _loaded_mesh(model) is None:
        from transformers.distributed.configuration_utils import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        # the plans the loader would apply: the model's own rules, ours merged in, wildcards expanded
        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=mesh.size(), tp_plan=ATTENTION_TP_PLAN))
        apply_tensor_parallelism(model, mesh, plan)
    for layer in model.model.layers:
        layer.self_attn.o_a_proj.n_groups = model.config.o_groups // mesh.size()


def shared_seed(mesh: DeviceMesh) -> int:
    """A random seed drawn on the mesh's first rank and broadcast to the others, so that every rank
    samples the same tokens (the ranks must run the same steps)."""
    seed = torch.Generator().seed() % 2**63 if mesh.get_local_rank() == 0 else 0
    value = torch.tensor([seed], dtype=torch.int64, device=mesh.device_type)
    group = mesh.get_group()
    dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return int(value.item())
