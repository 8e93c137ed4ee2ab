"""A ``transformers`` DeepSeek V4 model with seeded random weights, built on its device directly.

A benchmark model with the Flash attention dimensions and the full vocabulary holds several GiB
of parameters: it is created on the target device in its dtype (no CPU copy, no fp32 staging).
The result looks like a checkpoint loaded with ``from_pretrained(dtype=...)``: the modules
``transformers`` keeps in fp32 (norms, sinks, position biases, hyper-connections) are fp32, the
rest ``dtype``. ``transformers``' own init leaves parts of the model degenerate — zero sinks and
position biases, every token hashed to expert 0 (which would also make the MoE unrealistically
cheap) — so those are drawn from the seed as well.
"""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.core_model_loading import build_glob_alternation
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf


def random_hf_model(config: DeepseekV4Config, *, seed: int = 0, device: torch.device | str | None = None,
                    dtype: torch.dtype = torch.bfloat16) -> DeepseekV4ForCausalLM:
    """``DeepseekV4ForCausalLM(config)`` on ``device`` with weights drawn from ``seed`` (the global
    RNG is left as it was); eval mode, no grad."""
    device = torch.device(device or "cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = DeepseekV4ForCausalLM._from_config(config, dtype=dtype)
    _keep_fp32_like_from_pretrained(model, dtype)
    _draw_degenerate_parameters(model, torch.Generator(device).manual_seed(seed + 1))
    return model.eval().requires_grad_(False)


@torch.no_grad()
def _keep_fp32_like_from_pretrained(model: DeepseekV4ForCausalLM, dtype: torch.dtype) -> None:
    """Upcast the tensors ``from_pretrained(dtype=dtype)`` keeps in fp32: its dtype plan, matched
    against the checkpoint names as its loader matches them."""
    plan = model._get_dtype_plan(dtype)
    if not plan:
        return
    keep, _, _ = build_glob_alternation(list(plan))
    for name, t in model.state_dict(keep_vars=True).items():
        if t.is_floating_point() and keep.search(name):
            t.data = t.data.float()


@torch.no_grad()
def _draw_degenerate_parameters(model: DeepseekV4ForCausalLM, gen: torch.Generator) -> None:
    """Sinks ~ N(0, 1); compressor / indexer position biases ~ N(0, 0.5²); hash routes: ``top_k``
    distinct experts per token, uniformly; router correction bias ~ N(0, 0.01²)."""
    def randn(t: torch.Tensor, scale: float) -> torch.Tensor:
        return (torch.randn(t.shape, generator=gen, device=t.device) * scale).to(t.dtype)

    for module in model.modules():
        if isinstance(module, hf.DeepseekV4Attention):
            module.sinks.copy_(randn(module.sinks, 1.0))
        elif isinstance(module, (hf.DeepseekV4HCACompressor, hf.DeepseekV4CSACompressor, hf.DeepseekV4Indexer)):
            module.position_bias.copy_(randn(module.position_bias, 0.5))
        elif isinstance(module, hf.DeepseekV4HashRouter):
            vocab, k = module.tid2eid.shape
            scores = torch.rand(vocab, module.num_experts, generator=gen, device=module.tid2eid.device)
            module.tid2eid.copy_(scores.argsort(dim=1)[:, :k])
        elif isinstance(module, hf.DeepseekV4TopKRouter):
            module.e_score_correction_bias.copy_(randn(module.e_score_correction_bias, 0.01))
