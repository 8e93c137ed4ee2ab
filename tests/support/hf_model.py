"""A tiny transformers DeepSeek V4 model that exercises every attention and MoE path.

Real per-head dimensions (head 512, 64 rope dims, indexer 128, window 128); hidden size, heads,
experts and depth shrunk. transformers' own init leaves parts of the model degenerate (zero sinks
and compressor position biases, every token hashed to expert 0, zero router bias), so those are
re-drawn from the seed; everything else keeps transformers' init, seeded.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.core_model_loading import build_glob_alternation
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

# Every attention layer type: sliding, CSA (ratio 4), HCA (ratio 128), CSA.
_LAYER_CYCLE = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                "compressed_sparse_attention")
_TINY = dict(vocab_size=512, hidden_size=256, moe_intermediate_size=128, num_attention_heads=8,
             head_dim=512, q_lora_rank=128, o_groups=2, o_lora_rank=64, index_n_heads=8,
             index_head_dim=128, index_topk=64, n_routed_experts=4, num_experts_per_tok=2, hc_mult=4)


def tiny_hf_config(**overrides) -> DeepseekV4Config:
    """The tiny config; any ``DeepseekV4Config`` field may be overridden.

    Depth follows ``layer_types`` when given, else ``num_hidden_layers`` (default 4) cycling
    sliding / CSA / HCA / CSA; ``mlp_layer_types`` defaults to one ``hash_moe`` then ``moe``."""
    layer_types = overrides.pop("layer_types", None)
    n = overrides.pop("num_hidden_layers", 4 if layer_types is None else len(layer_types))
    if layer_types is None:
        layer_types = list(itertools.islice(itertools.cycle(_LAYER_CYCLE), n))
    mlp_layer_types = overrides.pop("mlp_layer_types", ["hash_moe"] + ["moe"] * (n - 1))
    return DeepseekV4Config(**{**_TINY, **overrides}, num_hidden_layers=n, layer_types=layer_types,
                            mlp_layer_types=mlp_layer_types)


def tiny_hf_model(seed: int = 0, dtype: torch.dtype = torch.bfloat16, path: str | Path | None = None,
                  config: DeepseekV4Config | None = None) -> DeepseekV4ForCausalLM:
    """``DeepseekV4ForCausalLM`` of ``config`` (default :func:`tiny_hf_config`) with weights drawn
    from ``seed`` (the global RNG is left as it was), in ``dtype`` except the modules transformers
    keeps in fp32; eval mode, no grad. With ``path`` it is also saved there (``save_pretrained``)."""
    config = tiny_hf_config() if config is None else config
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DeepseekV4ForCausalLM._from_config(config, dtype=torch.float32)
    _draw_degenerate_parameters(model, torch.Generator().manual_seed(seed + 1))
    _cast_like_from_pretrained(model, dtype)
    model.eval().requires_grad_(False)
    if path is not None:
        model.save_pretrained(path)
    return model


@torch.no_grad()
def _cast_like_from_pretrained(model: DeepseekV4ForCausalLM, dtype: torch.dtype) -> None:
    """Floating saved tensors to ``dtype``, except those ``from_pretrained(dtype=...)``
    keeps in fp32 (sinks, norms, position biases, hyper-connections, ...): the model then equals
    a reload of its own checkpoint."""
    plan = model._get_dtype_plan(dtype)
    keep, _, _ = build_glob_alternation(list(plan)) if plan else (None, None, None)
    for name, t in model.state_dict(keep_vars=True).items():  # RoPE tables are not saved: stay fp32
        if t.is_floating_point() and not (keep is not None and keep.search(name)):
            t.data = t.data.to(dtype)


@torch.no_grad()
def _draw_degenerate_parameters(model: DeepseekV4ForCausalLM, gen: torch.Generator) -> None:
    """Sinks ~ N(0, 1); compressor / indexer position biases ~ N(0, 0.5²); hash routes: ``top_k``
    distinct valid experts per token; router correction bias ~ N(0, 0.01²)."""
    def randn(t: torch.Tensor, scale: float) -> torch.Tensor:
        return (torch.randn(t.shape, generator=gen) * scale).to(t.dtype)

    for module in model.modules():
        if isinstance(module, hf.DeepseekV4Attention):
            module.sinks.copy_(randn(module.sinks, 1.0))
        elif isinstance(module, (hf.DeepseekV4HCACompressor, hf.DeepseekV4CSACompressor, hf.DeepseekV4Indexer)):
            module.position_bias.copy_(randn(module.position_bias, 0.5))
        elif isinstance(module, hf.DeepseekV4HashRouter):
            vocab, k = module.tid2eid.shape
            experts = torch.rand(vocab, module.num_experts, generator=gen).argsort(dim=1)[:, :k]
            module.tid2eid.copy_(experts)
        elif isinstance(module, hf.DeepseekV4TopKRouter):
            module.e_score_correction_bias.copy_(randn(module.e_score_correction_bias, 0.01))
