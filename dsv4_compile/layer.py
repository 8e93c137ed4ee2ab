"""One DeepSeek V4 attention layer (docs/semantics.md §1.4, §4) and a small stack of them.

``DSV4Attention.forward(x, meta, cache)`` runs, for the step's T query rows::

    q, kv   = projections (low-rank q with per-head RMS norm; kv RMSNorm), RoPE on the last 64 dims
    store   : dsv4::store_kv(kv -> SWA pool)
    ratio 4 : indexer compressor (compress_kv + store_index_k), indexer q (indexer_prepare_q),
              top-k (indexer_topk)
    ratio>0 : attention compressor (compress_kv + store_kv -> c4 / c128 pool)
    attend  : dsv4::sparse_attn over SWA window + extra entries, with the per-head sink
    output  : inverse RoPE, grouped wo_a, wo_b

Model-side math (projections, norms, RoPE) lives in :meth:`DSV4Attention.project_q_kv` and
:class:`Compressor.project`, shared with the cache-free oracle.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from . import layout
from .attention import KVSet, sparse_attn
from .cache import DSV4Cache, LayerCache
from .config import HEAD_DIM, INDEX_HEAD_DIM, PAGE_SIZE, DSV4AttnConfig
from .device_checks import ENABLED_BY_ENV, checked_step
from .rope import layer_inv_freq
from .step import StepInputs, StepMetadata, build_step_metadata
from .validate import validate_step

ops = torch.ops.dsv4


def _init_linear(w: torch.Tensor, gen: torch.Generator) -> None:
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=gen) / math.sqrt(w.shape[-1]))


class Compressor(nn.Module):
    """Projection weights of one compressor (docs/semantics.md §4.2): entry dim ``d``, ratio 4 or 128."""

    def __init__(self, config: DSV4AttnConfig, d: int, ratio: int, rotate: bool, dtype: torch.dtype):
        super().__init__()
        self.d, self.ratio, self.rotate = d, ratio, rotate
        self.eps = config.rms_norm_eps
        width = (2 if ratio == 4 else 1) * d
        self.wkv = nn.Parameter(torch.empty(width, config.hidden_size, dtype=dtype))
        self.wgate = nn.Parameter(torch.empty(width, config.hidden_size, dtype=dtype))
        self.ape = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.norm = nn.Parameter(torch.empty(d, dtype=torch.float32))

    def reset_parameters(self, gen: torch.Generator) -> None:
        _init_linear(self.wkv, gen)
        _init_linear(self.wgate, gen)
        with torch.no_grad():
            self.ape.copy_(torch.randn(self.ape.shape, generator=gen) * 0.5)
            self.norm.copy_(1 + 0.1 * torch.randn(self.norm.shape, generator=gen))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv, score)`` ``[T, coff * d]`` of hidden states ``x [T, hidden]`` (no ape): GEMMs in the
        weights' dtype (fp32 accumulation), rounded to it; ``compress_kv`` widens them to fp32
        (docs/semantics.md §4.2)."""
        # The weights are read as stored: an fp32 GEMM would convert them to fp32 on every step, and
        # torch.mm's out_dtype=fp32 (no rounding of the product) has no CPU kernel, so the CPU and
        # CUDA graphs would differ. Rounding kv / score to bf16 is what transformers' compressor
        # does; it moves an entry by about one bf16 ulp, far below its FP8 quantisation in the cache.
        return F.linear(x, self.wkv), F.linear(x, self.wgate)

    def forward(self, x: torch.Tensor, meta: StepMetadata, state: torch.Tensor, ring: int,
                inv_freq: torch.Tensor) -> torch.Tensor:
        return compress_rows(self, x, meta, state, ring, inv_freq)


def compress_rows(comp, x: torch.Tensor, meta: StepMetadata, state: torch.Tensor, ring: int,
                  inv_freq: torch.Tensor) -> torch.Tensor:
    """One potential entry per row ``[T, d] bf16`` via ``dsv4::compress_kv``: ``comp`` is any
    compressor exposing ``project(x)``, ``ape``, ``norm``, ``ratio``, ``rotate`` and ``eps``."""
    kv, score = comp.project(x)
    return ops.compress_kv(state, kv, score, comp.ape, meta.req_of_row, meta.seq_lens_causal, meta.extend_start,
                           meta.extend_end, comp.norm, inv_freq, comp.ratio, ring, comp.rotate, comp.eps)


class Indexer(nn.Module):
    """Lightning indexer weights (docs/semantics.md §4.3): its query projection, head weights and
    compressor."""

    def __init__(self, config: DSV4AttnConfig, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.topk = config.index_n_heads, config.index_topk
        self.weight_scale = config.index_weight_scale
        self.wq_b = nn.Parameter(torch.empty(self.n_heads * INDEX_HEAD_DIM, config.q_lora_rank, dtype=dtype))
        self.weights_proj = nn.Parameter(torch.empty(self.n_heads, config.hidden_size, dtype=dtype))
        self.compressor = Compressor(config, INDEX_HEAD_DIM, 4, rotate=True, dtype=dtype)

    def reset_parameters(self, gen: torch.Generator) -> None:
        _init_linear(self.wq_b, gen)
        _init_linear(self.weights_proj, gen)
        self.compressor.reset_parameters(gen)

    def project_q(self, x: torch.Tensor, q_lora: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw indexer queries ``[T, H_i, 128]`` and head weights ``[T, H_i]``, in the weights'
        dtype (``indexer_prepare_q`` widens them)."""
        q = F.linear(q_lora, self.wq_b).view(x.shape[0], self.n_heads, INDEX_HEAD_DIM)
        return q, F.linear(x, self.weights_proj)


class DSV4Attention(nn.Module):
    """One DSV4 attention layer; ``layer_id`` selects its compress ratio from the config."""

    def __init__(self, config: DSV4AttnConfig, layer_id: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config, self.layer_id = config, layer_id
        self.ratio = config.compress_ratios[layer_id]
        h, hid = config.num_heads, config.hidden_size
        self.wq_a = nn.Parameter(torch.empty(config.q_lora_rank, hid, dtype=dtype))
        self.q_norm = nn.Parameter(torch.empty(config.q_lora_rank, dtype=dtype))
        self.wq_b = nn.Parameter(torch.empty(h * HEAD_DIM, config.q_lora_rank, dtype=dtype))
        self.wkv = nn.Parameter(torch.empty(HEAD_DIM, hid, dtype=dtype))
        self.kv_norm = nn.Parameter(torch.empty(HEAD_DIM, dtype=dtype))
        self.attn_sink = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.wo_a = nn.Parameter(torch.empty(config.o_groups * config.o_lora_rank,
                                             h * HEAD_DIM // config.o_groups, dtype=dtype))
        self.wo_b = nn.Parameter(torch.empty(hid, config.o_groups * config.o_lora_rank, dtype=dtype))
        self.compressor = Compressor(config, HEAD_DIM, self.ratio, False, dtype) if self.ratio else None
        self.indexer = Indexer(config, dtype) if self.ratio == 4 else None
        self.register_buffer("inv_freq", layer_inv_freq(config, self.ratio), persistent=False)

    def reset_parameters(self, gen: torch.Generator) -> None:
        for w in (self.wq_a, self.wq_b, self.wkv, self.wo_a, self.wo_b):
            _init_linear(w, gen)
        with torch.no_grad():
            for norm in (self.q_norm, self.kv_norm):
                norm.copy_(1 + 0.1 * torch.randn(norm.shape, generator=gen))
            self.attn_sink.copy_(torch.randn(self.attn_sink.shape, generator=gen))
        for sub in (self.compressor, self.indexer):
            if sub is not None:
                sub.reset_parameters(gen)

    # -- model-side math (shared with the oracle) ----------------------------------------------
    def project_q_kv(self, x: torch.Tensor, positions: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, H, 512], kv [T, 512], q_lora [T, q_lora])`` bf16, RoPE applied at ``positions``."""
        eps = self.config.rms_norm_eps
        q_lora = ops.rms_norm(F.linear(x, self.wq_a), self.q_norm, eps)
        q = ops.rms_norm(F.linear(q_lora, self.wq_b).view(x.shape[0], self.config.num_heads, HEAD_DIM), None, eps)
        q = ops.rope_tail(q, positions.unsqueeze(1), self.inv_freq)
        kv = ops.rope_tail(ops.rms_norm(F.linear(x, self.wkv), self.kv_norm, eps), positions, self.inv_freq)
        return q, kv, q_lora

    def output(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention output ``[T, H, 512]`` -> hidden ``[T, hidden]``: inverse RoPE, grouped wo_a, wo_b."""
        # one op (the inverse RoPE inside) with a contiguous output: no view in the trace depends on
        # T = 1 (docs/compile.md)
        g = self.config.o_groups
        o = ops.grouped_linear(o.reshape(o.shape[0], g, self.config.num_heads * HEAD_DIM // g), self.wo_a,
                               positions, self.inv_freq, HEAD_DIM)
        return F.linear(o.flatten(1), self.wo_b)

    # -- paged forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, meta: StepMetadata, cache: LayerCache) -> torch.Tensor:
        """x: [T, hidden] bf16 -> [T, hidden] bf16; writes this step's entries into ``cache``."""
        return paged_attention(self, x, meta, cache)


def paged_attention(layer, x: torch.Tensor, meta: StepMetadata, cache: LayerCache) -> torch.Tensor:
    """One attention layer over the paged cache: x [T, hidden] bf16 -> [T, hidden] bf16, writing
    this step's entries into ``cache``.

    ``layer`` is any object with the model-side math of :class:`DSV4Attention`: ``ratio``,
    ``config``, ``inv_freq``, ``attn_sink``, ``project_q_kv``, ``output``, and for compressed
    layers ``compressor`` (and ``indexer`` at ratio 4) with the attributes :func:`compress_rows`
    and :class:`Indexer` use; :mod:`dsv4_compile.hf_layer` provides one over ``transformers``'
    modules.
    """
    q, kv, q_lora = layer.project_q_kv(x, meta.positions)
    ops.store_kv(cache.swa_kv, meta.swa_out_loc, kv, PAGE_SIZE)
    extra = None
    if layer.ratio == 4 and meta.c4_out_loc is not None:
        idx = layer.indexer
        ik = compress_rows(idx.compressor, x, meta, cache.index_state, cache.ring, layer.inv_freq)
        ops.store_index_k(cache.index_k, meta.c4_out_loc, ik, layout.INDEX_PAGE_SIZE)
        iq, iw = idx.project_q(x, q_lora)
        q_fp8, w = ops.indexer_prepare_q(iq, iw, meta.positions, layer.inv_freq, idx.weight_scale)
        topk = ops.indexer_topk(q_fp8, w, cache.index_k, meta.page_table, meta.c4_visible, idx.topk)
        entries = compress_rows(layer.compressor, x, meta, cache.kv_state, cache.ring, layer.inv_freq)
        ops.store_kv(cache.extra_kv, meta.c4_out_loc, entries, cache.extra_page_size)
        extra = KVSet(cache.extra_kv, cache.extra_page_size, topk, meta.c4_topk_lengths)
    elif layer.ratio == 128 and meta.c128_out_loc is not None:
        entries = compress_rows(layer.compressor, x, meta, cache.kv_state, cache.ring, layer.inv_freq)
        ops.store_kv(cache.extra_kv, meta.c128_out_loc, entries, cache.extra_page_size)
        extra = KVSet(cache.extra_kv, cache.extra_page_size, meta.c128_indices, meta.c128_lengths)
    swa = KVSet(cache.swa_kv, PAGE_SIZE, meta.swa_indices, meta.swa_lengths)
    out, _ = sparse_attn(q, swa, extra, layer.attn_sink, layer.config.softmax_scale)
    return layer.output(out, meta.positions)


class DSV4AttentionStack(nn.Module):
    """Attention layers with residual connections over one shared :class:`DSV4Cache`:
    ``h = h + layer_i(h)``. ``forward(x, step)`` is one whole step — the function to compile."""

    def __init__(self, config: DSV4AttnConfig, cache: DSV4Cache, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if cache.config != config:
            differ = [f.name for f in dataclasses.fields(config)
                      if getattr(config, f.name) != getattr(cache.config, f.name)]
            raise ValueError(f"config and cache.config differ in {', '.join(differ)}: the stack runs over the cache "
                             "made for its config")
        self.config = config
        self.cache = cache
        self.layers = nn.ModuleList(DSV4Attention(config, i, dtype) for i in range(config.num_layers))

    def reset_parameters(self, seed: int = 0) -> "DSV4AttentionStack":
        gen = torch.Generator().manual_seed(seed)
        for layer in self.layers:
            layer.reset_parameters(gen)
        return self

    def empty_output(self, x: torch.Tensor) -> torch.Tensor:
        """The output of a step with no rows (nothing is computed or written)."""
        return torch.empty_like(x)

    def forward(self, x: torch.Tensor, step: StepInputs, validate: bool = True,
                device_checks: bool | None = None) -> torch.Tensor:
        """x: [T, hidden] bf16 hidden states of the step's query rows -> [T, hidden] bf16.

        Eager calls validate ``step`` on the host first (``validate=False`` skips that, e.g. while
        capturing a CUDA graph by hand); compiled calls never do. Inference only: a step under
        autograd raises (:func:`require_inference`). ``device_checks`` adds checks
        of the step's tensors inside the step (:mod:`dsv4_compile.device_checks`; ``None``: on
        when ``DSV4_DEVICE_CHECKS=1`` was set at import)."""
        meta = prepare_step(self, self.cache, x, step, validate, device_checks)
        h = x
        for layer, layer_cache in zip(self.layers, self.cache.layers):
            h = h + layer(h, meta, layer_cache)
        return h


def prepare_step(module: nn.Module, cache: DSV4Cache, x: torch.Tensor, step: StepInputs, validate: bool,
                 device_checks: bool | None) -> StepMetadata:
    """What every step does before its layers, for ``module`` (owning ``cache``) with layer inputs
    ``x [T, hidden] bf16``: host validation of ``step`` (eager and ``validate`` only), the
    inference-only check, the optional device checks, then the step metadata."""
    if validate and not torch.compiler.is_compiling():
        validate_step(cache.config, cache, x, step)
    require_inference(module, x)
    if ENABLED_BY_ENV if device_checks is None else device_checks:
        step = checked_step(cache, cache.config.hidden_size, x, step)
    return build_step_metadata(step, cache, cache.config)


def require_inference(module: nn.Module, x: torch.Tensor, parameters: Iterable[nn.Parameter] | None = None) -> None:
    """Raise ``RuntimeError`` when a step would be recorded by autograd: grad mode on and ``x`` or
    a parameter of ``module`` (``parameters``, when the caller holds them already) requiring grad.
    The dsv4:: ops have no backward and a step writes the cache in place, so the library is
    inference-only. Evaluated eagerly and while tracing (a compiled frame guards on grad mode and
    on ``requires_grad``, so it costs nothing per call)."""
    if torch.is_grad_enabled() and (getattr(x, "requires_grad", False) or any(
            p.requires_grad for p in (module.parameters() if parameters is None else parameters))):
        raise RuntimeError(f"{type(module).__name__} is inference-only (the dsv4:: ops have no backward): "
                           "run steps under torch.no_grad() or torch.inference_mode(), or call "
                           ".requires_grad_(False) on the stack")
