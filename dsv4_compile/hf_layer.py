"""The attention math of a ``transformers`` ``DeepseekV4Attention``, as the backend's layer protocol.

:func:`dsv4_compile.layer.paged_attention` and the dense oracle read a layer through a few names
(``project_q_kv``, ``output``, ``compressor``, ``indexer``, ``attn_sink``, ``inv_freq``, ...).
:class:`HFAttention` provides them over the model's own modules: every projection and norm is a
call of the module that holds the checkpoint weight (so quantised linears keep working), and no
parameter is copied; the query latent's norm, ``transformers``' own RMSNorm, is that math as
``dsv4::rms_norm`` on the module's weight. Differences from ``transformers``' eager arithmetic
(RoPE angles in fp32, compressor pooling in fp32, FP8 cache) are listed in docs/semantics.md §7.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import HEAD_DIM, INDEX_HEAD_DIM, DSV4AttnConfig
from .plain_tensor import is_plain_tensor, plain_rms_norm
from .rope import layer_inv_freq

ops = torch.ops.dsv4


class HFCompressor:
    """A ``transformers`` compressor (``DeepseekV4CSACompressor`` / ``HCACompressor``, or the indexer,
    which carries its own compressor weights) seen as the backend's compressor: entry dim ``d``."""

    def __init__(self, module: nn.Module, d: int, ratio: int, rotate: bool, eps: float):
        self.module, self.d, self.ratio, self.rotate, self.eps = module, d, ratio, rotate, eps

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv, score)`` ``[T, coff * d]`` of ``x [T, hidden]``: the module's own projections, in their
        output dtype (``compress_kv`` widens them to fp32)."""
        return self.module.kv_proj(x), self.module.gate_proj(x)

    @property
    def ape(self) -> torch.Tensor:
        """``[ratio, coff * d]`` fp32 position bias."""
        return self.module.position_bias.float()

    @property
    def norm(self) -> torch.Tensor:
        """``[d]`` RMSNorm weight of the pooled entry."""
        return self.module.kv_norm.weight


class HFIndexer:
    """A ``transformers`` ``DeepseekV4Indexer`` seen as the backend's lightning indexer."""

    def __init__(self, module: nn.Module, config: DSV4AttnConfig):
        self.module = module
        self.n_heads, self.topk, self.weight_scale = config.index_n_heads, config.index_topk, config.index_weight_scale
        self.compressor = HFCompressor(module, INDEX_HEAD_DIM, 4, rotate=True, eps=config.rms_norm_eps)

    def project_q(self, x: torch.Tensor, q_lora: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw indexer queries ``[T, H_i, 128]`` and head weights ``[T, H_i]`` (before scaling), in
        the projections' output dtype (``indexer_prepare_q`` widens them)."""
        q = self.module.q_b_proj(q_lora).view(x.shape[0], self.n_heads, INDEX_HEAD_DIM)
        return q, self.module.scorer.weights_proj(x)


class HFAttention(nn.Module):
    """Layer ``layer_id`` of a model, over its ``DeepseekV4Attention`` ``attn`` (registered as the
    submodule ``attn``: parameters are shared, never copied).

    ``inv_freq`` is the layer's RoPE table (docs/semantics.md §1.2), a non-persistent buffer.
    ``sharded``: the attention's heads are sharded over tensor-parallel ranks
    (:mod:`dsv4_compile.parallel`; ``config`` is the rank's), its ``sinks`` a DTensor.
    """

    def __init__(self, attn: nn.Module, config: DSV4AttnConfig, layer_id: int, sharded: bool = False):
        super().__init__()
        self.attn, self.config, self.layer_id, self.sharded = attn, config, layer_id, sharded
        self.ratio = config.compress_ratios[layer_id]
        eps = config.rms_norm_eps
        self.compressor = HFCompressor(attn.compressor, HEAD_DIM, self.ratio, False, eps) if self.ratio else None
        self.indexer = HFIndexer(attn.compressor.indexer, config) if self.ratio == 4 else None
        self.register_buffer("inv_freq", layer_inv_freq(config, self.ratio).to(attn.sinks.device),
                             persistent=False)

    @property
    def attn_sink(self) -> torch.Tensor:
        """``[H]`` fp32 per-head sink logits (``transformers`` keeps them in fp32 when loading); the
        rank's heads when sharded."""
        sinks = self.attn.sinks
        return (sinks.to_local() if self.sharded else sinks).float()

    def project_q_kv(self, x: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, H, 512], kv [T, 512], q_lora [T, q_lora])`` of ``x [T, hidden]``, RoPE at ``positions``."""
        a = self.attn
        q_lora = self._q_latent_norm(a.q_a_proj(x))
        q = a.q_b_norm(a.q_b_proj(q_lora).view(x.shape[0], self.config.num_heads, HEAD_DIM))
        q = ops.rope_tail(q, positions.unsqueeze(1), self.inv_freq)
        kv = ops.rope_tail(a.kv_norm(a.kv_proj(x)), positions, self.inv_freq)
        return q, kv, q_lora

    def _q_latent_norm(self, q_lora: torch.Tensor) -> torch.Tensor:
        """``q_a_norm`` of the query latent: ``transformers``' ``DeepseekV4RMSNorm`` with a plain
        weight is called as ``dsv4::rms_norm`` on that weight (the same math, one traced op),
        which ``FuseSharedInputLinearsPass(fold_input_norm=True)`` folds into the ``q_b_proj``
        products that read it; any other module is called as it is."""
        rms = plain_rms_norm(self.attn.q_a_norm)
        return self.attn.q_a_norm(q_lora) if rms is None else ops.rms_norm(q_lora, *rms)

    def output(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention output ``[T, H, 512]`` -> ``[T, hidden]``: inverse RoPE, grouped ``o_a_proj``, ``o_b_proj``."""
        return self.attn.o_b_proj(self._grouped_projection(o, positions).flatten(1))

    def _grouped_projection(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE and ``o_a_proj`` of ``o [T, H, 512]`` -> ``[T, G, N]``: transformers'
        ``DeepseekV4GroupedLinear`` with a plain weight of ``o``'s dtype and no bias as one
        ``dsv4::grouped_linear`` on that weight (the inverse RoPE inside it), any other module (a
        quantiser's, a tensor-parallel shard) called as it is after ``dsv4::rope_tail``. The
        module's ``bmm`` output is transposed, and reshaping it asks whether T = 1 (a view then, a
        copy otherwise): traced, that adds a guard which gives one row a frame of its own, with
        shapes that are static after that point and symbolic before it (docs/compile.md)."""
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

        proj, g = self.attn.o_a_proj, self.config.o_groups
        grouped = o.reshape(o.shape[0], g, self.config.num_heads * HEAD_DIM // g)
        if (type(proj).forward is not DeepseekV4GroupedLinear.forward or proj.bias is not None
                or not is_plain_tensor(proj.weight) or proj.weight.dtype != o.dtype or proj.n_groups != g):
            o = ops.rope_tail(o, positions.unsqueeze(1), self.inv_freq, inverse=True)
            return proj(o.reshape(grouped.shape))
        return ops.grouped_linear(grouped, proj.weight, positions, self.inv_freq, HEAD_DIM)
