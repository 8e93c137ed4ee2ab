"""A ``transformers`` DeepSeek V4 model on the backend: :func:`enable` and the model step.

``enable(model, max_requests=..., max_seq_len=...)`` returns a :class:`ModelBackend` that owns the
paged FP8 cache (:class:`~dsv4_compile.cache.DSV4Cache`) and its host-side
:class:`~dsv4_compile.allocator.PageAllocator`, and whose ``forward(input_ids, step, logit_rows)`` is
one whole model step over the cache — the function to compile (:func:`dsv4_compile.compile.compile_step`).

The model is not modified: its parameters, buffers and checkpoint names stay as they are (under
tensor parallelism, :mod:`dsv4_compile.parallel`, the sharded ones become DTensors holding the
rank's slice, under the same names). Each layer's attention runs through
:class:`~dsv4_compile.hf_layer.HFAttention` (the model's own modules, read through the backend's
layer protocol); the hyper-connections run the backend's mHC ops with the model's own parameters
(:mod:`dsv4_compile.hf_hyper_connection`); everything else — embedding, norms, MoE, head — is the
model's own modules called on the flat token layout ``[1, T, ...]`` (one "batch" row holding every
query row of the step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .allocator import PageAllocator
from .cache import DSV4Cache
from .config import DSV4AttnConfig
from . import hf_experts, hf_generate, model_forward
from . import hf_hyper_connection as hyper_connection
from .hf_layer import HFAttention
from .layer import paged_attention, prepare_step
from .runner import ModelRunner
from .step import StepInputs, check_step

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The MoE experts implementation the backend sets (docs/model.md, "Experts"): on CUDA the routed
# experts of a decode step's few slots in two launches that read each active expert's weights once
# (``dsv4::routed_experts``), elsewhere and for larger steps one grouped GEMM over the slots sorted
# by expert; no host sync, no graph break either way. ``batched_mm`` gathers a weight copy per
# (token, expert) pair and the eager loop syncs on the set of routed experts (one MoE layer of the
# tiny test model, 64 tokens, CPU: 3 ms grouped, 64 ms batched, 222 ms eager).
EXPERTS_IMPLEMENTATION = hf_experts.IMPLEMENTATION

Attend = Callable[[int, torch.Tensor], torch.Tensor]


class ModelBackend(nn.Module):
    """A ``DeepseekV4ForCausalLM`` with the backend: owns ``cache`` and ``allocator``.

    ``runner`` is the :class:`~dsv4_compile.runner.ModelRunner` the model's own forward uses once
    :func:`enable` installed it (eager by default; assign one with a compiled ``step_fn`` to compile
    it); :meth:`close` gives the model its original forward back.

    Args:
        model: the ``transformers`` model (bf16), registered as the submodule ``model``.
        config: its attention config (``DSV4AttnConfig.from_hf(model.config, tp_size=...)``).
        cache: the paged cache the steps read and write.
        device_mesh: the 1-D mesh of the tensor-parallel ranks the model is sharded over
            (:mod:`dsv4_compile.parallel`), ``None`` on one device.
    """

    def __init__(self, model: nn.Module, config: DSV4AttnConfig, cache: DSV4Cache,
                 device_mesh: DeviceMesh | None = None):
        super().__init__()
        self.model, self.config, self.cache, self.device_mesh = model, config, cache, device_mesh
        self.attn_layers = nn.ModuleList(HFAttention(layer.self_attn, config, i, sharded=device_mesh is not None)
                                         for i, layer in enumerate(model.model.layers))
        self.allocator = PageAllocator(cache)
        self.runner = ModelRunner(self)

    def close(self) -> None:
        """Give the model its original forward and ``generate`` back (the cache stays usable through
        this object)."""
        model_forward.uninstall(self)
        hf_generate.uninstall(self)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def new_logits(self, *shape: int) -> torch.Tensor:
        """Zeros ``[*shape]`` in the dtype of the logits, on the cache's device (a plain tensor also
        when ``lm_head``'s weight is a DTensor)."""
        return torch.zeros(shape, dtype=self.model.lm_head.weight.dtype, device=self.cache.device)

    def empty_output(self, input_ids: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """The logits of a step with no rows (nothing is computed or written)."""
        return self.new_logits(logit_rows.shape[0], self.vocab_size)

    def forward(self, input_ids: torch.Tensor, step: StepInputs, logit_rows: torch.Tensor,
                validate: bool = True, device_checks: bool | None = None) -> torch.Tensor:
        """One model step: ``input_ids [T] int64`` (the step's query rows, the ``StepInputs``
        conventions of the attention stack; padding rows any valid id) -> logits ``[R, vocab]``
        (the model's dtype) of the rows ``logit_rows [R] int64``.

        Writes the step's keys and compressed entries into the cache. ``validate`` /
        ``device_checks``: as :meth:`DSV4AttentionStack.forward <dsv4_compile.layer.DSV4AttentionStack.forward>`.
        """
        if validate and not torch.compiler.is_compiling():
            check_model_inputs(self, input_ids, step, logit_rows)
        embeds = self.model.model.embed_tokens(input_ids)
        meta = prepare_step(self, self.cache, embeds, step, validate, device_checks)
        caches = self.cache.layers

        def attend(i: int, x: torch.Tensor) -> torch.Tensor:
            return paged_attention(self.attn_layers[i], x[0], meta, caches[i]).unsqueeze(0)

        h = run_decoder(self.model, embeds.unsqueeze(0), input_ids.unsqueeze(0), attend)
        return head_logits(self.model, h[:, logit_rows])[0]


def run_decoder(model: nn.Module, embeds: torch.Tensor, input_ids: torch.Tensor, attend: Attend) -> torch.Tensor:
    """The decoder layers of ``model`` on ``embeds [B, S, hidden]`` -> hidden streams
    ``[B, S, hc_mult, hidden]``, with ``attend(layer_index, x [B, S, hidden]) -> [B, S, hidden]`` in
    place of each layer's attention. Everything else is composed as ``DeepseekV4DecoderLayer.forward``
    composes it (hyper-connection collapse, norm, block, hyper-connection expand and mix, for the
    attention and for the MoE): the model's own modules, the hyper-connections through the mHC ops
    (with the block's input norm where it is transformers' own), the MoE block through
    ``hf_experts.moe_forward`` (its experts in one op where that applies)."""
    h = embeds.unsqueeze(2).expand(-1, -1, model.config.hc_mult, -1).contiguous()
    mix = None  # (post, comb, block output) of the last block, not yet mixed into h
    for i, layer in enumerate(model.model.layers):
        # each block is called within this iteration, so its closure sees this layer; its input
        # norm comes with the collapse (in the mHC op where it can)
        for hc, norm, block in ((layer.attn_hc, layer.input_layernorm, lambda x: attend(i, x)),
                                (layer.ffn_hc, layer.post_attention_layernorm,
                                 lambda x: hf_experts.moe_forward(layer.mlp, x, input_ids))):
            if mix is None:
                post, comb, normed = hyper_connection.pre(hc, h, norm)
            else:  # a block's mix and the next hyper-connection: one op
                h, post, comb, normed = hyper_connection.post_pre(*mix, h, hc, norm)
            mix = (post, comb, block(normed))
    return h if mix is None else hyper_connection.post(*mix, h)


def head_logits(model: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` of hidden streams ``[B, S, hc_mult, hidden]``: the model's
    ``hc_head``, final ``norm`` and ``lm_head``."""
    return model.lm_head(hyper_connection.head(model.model.hc_head, streams, model.model.norm))


def check_model_inputs(backend, input_ids, step: StepInputs, logit_rows) -> None:
    """Host checks of the model-specific inputs of a step of ``backend`` (a ``ModelBackend`` or a
    deployed package: its ``cache`` and ``vocab_size``); the step itself is checked by ``validate_step``."""
    check_step(step)
    device = backend.cache.device
    for name, t in (("input_ids", input_ids), ("logit_rows", logit_rows)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int64 Tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the cache is on {device}")
    if input_ids.shape[0] != step.num_tokens:
        raise ValueError(f"input_ids has {input_ids.shape[0]} rows, step.out_cache_loc has {step.num_tokens}")
    if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < backend.vocab_size:
        raise ValueError(f"input_ids: token ids must lie in [0, {backend.vocab_size})")
    if logit_rows.numel() and not 0 <= int(logit_rows.min()) <= int(logit_rows.max()) < step.num_tokens:
        raise ValueError(f"logit_rows: rows must lie in [0, {step.num_tokens})")


def enable(model: nn.Module, *, max_requests: int, max_seq_len: int, max_draft_tokens: int = 4,
           num_full_pages: int | None = None, num_swa_pages: int | None = None,
           experts_implementation: str = EXPERTS_IMPLEMENTATION, device_mesh: DeviceMesh | None = None
           ) -> ModelBackend:
    """The backend for ``model`` (a bf16 ``DeepseekV4ForCausalLM``), with a cache of
    ``max_requests`` concurrent requests of up to ``max_seq_len`` tokens on the model's device.

    Installs the backend as the model's own forward (``model(input_ids, attention_mask, labels)``,
    see :mod:`dsv4_compile.model_forward`) and as the cache of ``model.generate()`` (greedy,
    sampling and assisted generation, see :mod:`dsv4_compile.hf_generate`) until
    ``backend.close()``.

    Tensor parallelism (docs/model.md, "Tensor parallelism"): with ``device_mesh`` (a 1-D
    ``DeviceMesh`` of the ranks, every rank calling ``enable`` alike) the model is sharded over it in
    place (:func:`dsv4_compile.parallel.parallelize`); a model loaded sharded with
    ``DistributedConfig(tp_plan=dsv4_compile.parallel.ATTENTION_TP_PLAN)`` runs over its own mesh.

    Sets the model's MoE experts implementation (``experts_implementation``, default
    :data:`EXPERTS_IMPLEMENTATION`: it compiles without graph breaks or host syncs).
    Raises ``ValueError`` naming what the backend does not support (see ``DSV4AttnConfig.from_hf``).
    """
    param = next(model.parameters())
    if param.dtype != torch.bfloat16:
        raise ValueError(f"model: the backend runs bf16 models, this one holds {param.dtype} parameters "
                         "(load it with dtype=torch.bfloat16)")
    from . import parallel  # torch.distributed.tensor, which transformers' models import anyway

    mesh = parallel.resolve_mesh(model, device_mesh)
    config = DSV4AttnConfig.from_hf(model.config, max_draft_tokens=max_draft_tokens,
                                    tp_size=1 if mesh is None else mesh.size())
    cache = DSV4Cache(config, max_requests=max_requests, max_seq_len=max_seq_len, num_full_pages=num_full_pages,
                      num_swa_pages=num_swa_pages, device=param.device)
    if mesh is not None:  # after every check: sharding changes the model
        parallel.parallelize(model, mesh)
    hf_experts.register()
    model.set_experts_implementation(experts_implementation)
    backend = ModelBackend(model.eval(), config, cache, mesh)
    model_forward.install(backend)
    hf_generate.install(backend)
    return backend
