"""The model's own forward contract on the backend: ``model(input_ids, attention_mask, labels)``.

:func:`install` replaces the model instance's ``forward`` (the class is untouched) with one that
scores a padded batch through the backend when no cache is passed — the way evaluation harnesses
and scripts call a causal LM; ``position_ids`` too when they number each row's real tokens from 0 —
and returns a :class:`~dsv4_compile.hf_cache.DSV4PagedCache` of the batch when ``use_cache=True``
asks for one. It calls the model's original forward in training mode, for outputs the backend does
not make (hidden states, attentions, router logits: asked for by keyword or by the model's config)
and with a ``transformers`` cache. :func:`uninstall` restores it. docs/model.md, "The model's
forward".

Padding: each row is scored over its real tokens only (the ``attention_mask`` ones, which must be
one contiguous run: left or right padding), at positions counted from 0; padded positions' logits
are zeros. The pages a call takes are released before it returns.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .hf_cache import DSV4PagedCache
    from .model import ModelBackend

# Keywords the backend path accepts as the model's forward does, with no effect on the result.
_NEUTRAL = ("use_cache", "return_dict")
# Outputs only the original forward makes; each defaults to the model config's attribute of that name.
_ORIGINAL_OUTPUTS = ("output_hidden_states", "output_attentions", "output_router_logits")


def install(backend: "ModelBackend") -> None:
    """Make ``backend.model(...)`` run through ``backend.runner`` (see the module docstring)."""
    from .hf_cache import DSV4PagedCache  # imports transformers: loaded with any model

    model = backend.model
    original = type(model).forward.__get__(model)

    @functools.wraps(original)
    def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
                labels=None, logits_to_keep: int | torch.Tensor = 0, **kwargs):
        return_dict = kwargs.get("return_dict")
        return_dict = getattr(model.config, "return_dict", True) if return_dict is None else return_dict
        if isinstance(past_key_values, DSV4PagedCache):
            out = cache_forward(backend, past_key_values, input_ids, attention_mask, logits_to_keep,
                                inputs_embeds=inputs_embeds, labels=labels, **kwargs)
            return out if return_dict else out.to_tuple()
        if on_backend(model, input_ids, past_key_values, inputs_embeds, kwargs):
            spans = None if position_ids is None else spans_numbered_from_zero(position_ids, input_ids, attention_mask)
            if position_ids is None or spans is not None:
                if kwargs.get("use_cache") is True:  # a cache asked for: the batch's rows stay in one
                    out = cache_forward(backend, DSV4PagedCache(backend), input_ids, attention_mask, logits_to_keep)
                    out.loss = loss_of(model, out.logits, labels)
                else:
                    out = backend_forward(backend, input_ids, attention_mask, labels, logits_to_keep, spans)
                return out if return_dict else out.to_tuple()
        if backend.device_mesh is not None:
            # transformers' attention broadcasts its one KV head to every query head of the model
            raise ValueError("this call runs transformers' own forward, which does not run on a model whose "
                             "attention heads are sharded (tensor parallelism): pass input_ids, attention_mask "
                             "and labels only (position_ids only if they number each row's real tokens from 0), "
                             "or generate() without a cache of your own")
        return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                        logits_to_keep=logits_to_keep, **kwargs)

    forward.dsv4_backend = backend  # marks the replacement (uninstall removes only its own)
    model.forward = forward


def on_backend(model: torch.nn.Module, input_ids: torch.Tensor | None, past_key_values, inputs_embeds,
               kwargs: dict) -> bool:
    """Whether a call without a ``DSV4PagedCache`` may run on the backend: ``input_ids`` given, the
    model in eval mode (training needs the original, differentiable forward), no cache of another
    kind, no ``inputs_embeds``, no option beyond :data:`_NEUTRAL`, and none of
    :data:`_ORIGINAL_OUTPUTS` on, passed or from the model's config."""
    if input_ids is None or model.training or past_key_values is not None or inputs_embeds is not None:
        return False
    if any(v is not None and v is not False for k, v in kwargs.items() if k not in _NEUTRAL + _ORIGINAL_OUTPUTS):
        return False
    return not any(getattr(model.config, k, False) if kwargs.get(k) is None else kwargs[k] for k in _ORIGINAL_OUTPUTS)


def uninstall(backend: "ModelBackend") -> None:
    """Restore the model's original forward (no-op if :func:`install` did not replace it)."""
    model = backend.model
    if getattr(model.__dict__.get("forward"), "dsv4_backend", None) is backend:
        del model.forward


def backend_forward(backend: "ModelBackend", input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    labels: torch.Tensor | None, logits_to_keep: int | torch.Tensor = 0,
                    spans: list[tuple[int, int]] | None = None) -> Any:
    """``MoeCausalLMOutputWithPast`` of the padded batch ``input_ids [B, S]`` (``attention_mask [B, S]``,
    1 on real tokens; ``None``: no padding): ``logits [B, S', vocab]`` in the model's dtype (zeros on
    padded positions; ``S'``: the positions ``logits_to_keep`` selects, as in ``transformers``) and,
    with ``labels [B, S]``, the model's own ``loss_function`` of those logits. ``spans``: the rows'
    :func:`real_spans` when the caller has them already."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast  # loaded with any model

    spans = real_spans(input_ids, attention_mask) if spans is None else spans
    batch, width = input_ids.shape
    # an int keeps the columns transformers' slice [-logits_to_keep:] keeps (0: all); only theirs are computed
    first = slice(-logits_to_keep, None).indices(width)[0] if isinstance(logits_to_keep, int) else 0
    kept = [(max(lo, first), hi) for lo, hi in spans]  # each row's real positions among the kept columns
    scored = [b for b, (lo, hi) in enumerate(kept) if hi > lo]
    rows = backend.runner.logits([input_ids[b, slice(*spans[b])] for b in scored],
                                 last=[kept[b][1] - kept[b][0] for b in scored])
    logits = backend.new_logits(batch, width - first, backend.vocab_size)
    for b, row_logits in zip(scored, rows):
        logits[b, kept[b][0] - first:kept[b][1] - first] = row_logits
    if not isinstance(logits_to_keep, int):  # the positions a tensor selects
        logits = logits[:, logits_to_keep]
    return MoeCausalLMOutputWithPast(loss=loss_of(backend.model, logits, labels), logits=logits)


def loss_of(model: torch.nn.Module, logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
    """The model's own ``loss_function`` of ``logits [B, S, vocab]`` against ``labels [B, S]`` (shifted
    inside, -100 ignored), as ``transformers`` computes it; None without labels."""
    return None if labels is None else model.loss_function(logits, labels, model.config.vocab_size)


def cache_forward(backend: "ModelBackend", cache: "DSV4PagedCache", input_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None, logits_to_keep: int | torch.Tensor, **others) -> Any:
    """``MoeCausalLMOutputWithPast`` of one ``generate`` step over ``cache``: ``input_ids [B, S]``
    (the new columns), ``attention_mask [B, past + S]`` -> ``logits [B, K, vocab]`` of the last
    ``K = logits_to_keep`` columns (all when 0; zeros on pads) and ``past_key_values=cache``.
    ``position_ids`` are not needed: a row's positions count its real tokens from 0."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast  # loaded with any model

    if cache.backend is not backend:
        raise ValueError("past_key_values is a DSV4PagedCache of another model's backend")
    unsupported = sorted(k for k, v in others.items() if k not in _NEUTRAL and v is not None and v is not False)
    if input_ids is None or unsupported:
        raise ValueError(f"with a DSV4PagedCache the model's forward takes input_ids, attention_mask and "
                         f"logits_to_keep only; got {unsupported or ['inputs_embeds instead of input_ids']}")
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(f"with a DSV4PagedCache logits_to_keep must be an int >= 0, got {logits_to_keep!r}")
    logits = cache.step(input_ids, attention_mask, logits_to_keep)
    return MoeCausalLMOutputWithPast(logits=logits, past_key_values=cache)


def spans_numbered_from_zero(position_ids: torch.Tensor, input_ids: torch.Tensor,
                             attention_mask: torch.Tensor | None) -> list[tuple[int, int]] | None:
    """The rows' :func:`real_spans` when ``position_ids [B or 1, S]`` number each row's real tokens
    0, 1, ... (what padding leaves them, and what ``transformers`` derives from ``attention_mask``):
    the positions the backend scores them at. None for other positions (packed sequences, an
    offset), a mask with holes or a shape that is not ``input_ids``': those are left to the
    model's own forward."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return None
    try:
        spans = real_spans(input_ids, attention_mask)
    except ValueError:
        return None
    if position_ids.shape[1] != input_ids.shape[1] or position_ids.shape[0] not in (1, len(spans)):
        return None
    positions = position_ids.cpu()
    numbered = all(torch.equal(positions[b % positions.shape[0], lo:hi], torch.arange(hi - lo, dtype=positions.dtype))
                   for b, (lo, hi) in enumerate(spans))
    return spans if numbered else None


def real_spans(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[tuple[int, int]]:
    """Per row of ``input_ids [B, S]``, the ``[lo, hi)`` of its real tokens: where ``attention_mask``
    is nonzero, which must be one contiguous run (a row with no real token scores nothing)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, seq] tensor, got {tuple(getattr(input_ids, 'shape', ()))}")
    if attention_mask is None:
        return [(0, input_ids.shape[1])] * input_ids.shape[0]
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                         f"{tuple(input_ids.shape)}")
    spans = []
    for b, row in enumerate(attention_mask.ne(0).cpu()):
        real = row.nonzero()[:, 0].tolist()
        if real and real[-1] - real[0] + 1 != len(real):
            raise ValueError(f"attention_mask row {b}: the real tokens must be one contiguous run "
                             "(left or right padding)")
        spans.append((real[0], real[-1] + 1) if real else (0, 0))
    return spans
