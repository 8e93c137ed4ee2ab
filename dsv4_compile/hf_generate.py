"""``model.generate()`` on the backend: the per-instance overrides :func:`install` sets.

The class and ``transformers`` are untouched; :func:`uninstall` deletes what :func:`install` set on
the model instance (docs/model.md, "generate()"):

* ``_prepare_cache_for_generation``: when ``generate`` would build its own cache (none passed,
  ``use_cache`` on, no ``cache_implementation``), it builds a
  :class:`~dsv4_compile.hf_cache.DSV4PagedCache` instead; beam search is refused (the rows cannot
  be reordered); anything else goes to ``transformers``.
* ``generate``: releases the request rows of the caches built during the call when it returns or
  raises — except the cache it returns (``return_dict_in_generate``), whose rows go back when that
  object is reset or dropped. Nested calls (the model drafting for itself) release at the outer one.
* ``_is_stateful = False``: ``transformers`` refuses assisted generation for this model because its
  own compressor state cannot roll back; on the backend a rollback is a truncate of the paged cache.
* ``generation_config.num_assistant_tokens`` is capped at ``max_draft_tokens`` (the draft length
  when this model drafts: deeper rollbacks are refused).
* ``_optimize_model_for_decode``: a no-op, so decoding keeps the experts implementation
  ``enable`` set instead of ``transformers`` switching it on accelerators.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .hf_cache import DSV4PagedCache
    from .model import ModelBackend

_OVERRIDES = ("_prepare_cache_for_generation", "generate", "_is_stateful", "_optimize_model_for_decode")


def install(backend: "ModelBackend") -> None:
    """Make ``backend.model.generate()`` run over the backend's paged cache (module docstring)."""
    from .hf_cache import DSV4PagedCache  # imports transformers: loaded with any model

    model = backend.model
    prepare, generate = model._prepare_cache_for_generation, model.generate  # the class's, bound
    created: list["DSV4PagedCache"] = []  # caches built by the outermost generate call running now
    depth = [0]

    def prepare_cache(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        if generation_config.num_beams > 1:
            raise ValueError("beam search is not supported on the dsv4_compile backend: its cache's request rows "
                             "cannot be reordered (use num_beams=1, or backend.close() first)")
        if (model_kwargs.get("past_key_values") is not None or generation_config.use_cache is False
                or generation_config.cache_implementation is not None):
            return prepare(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        model_kwargs["past_key_values"] = cache = DSV4PagedCache(backend, max_length=max_cache_length)
        created.append(cache)

    @functools.wraps(generate)
    def generate_on_backend(*args, **kwargs):
        result = None
        depth[0] += 1
        try:
            result = generate(*args, **kwargs)
            return result
        finally:
            depth[0] -= 1
            if not depth[0]:
                kept = getattr(result, "past_key_values", None)
                for cache in created:
                    if cache is not kept:
                        cache.reset()
                created.clear()

    config = model.generation_config
    generate_on_backend.saved_num_assistant_tokens = config.num_assistant_tokens
    max_draft = backend.config.max_draft_tokens
    if config.num_assistant_tokens is None or config.num_assistant_tokens > max_draft:
        config.num_assistant_tokens = max_draft
    model._prepare_cache_for_generation = prepare_cache
    model.generate = generate_on_backend
    model._is_stateful = False
    model._optimize_model_for_decode = contextlib.nullcontext
    generate_on_backend.dsv4_backend = backend  # marks the overrides (uninstall removes only its own)


def uninstall(backend: "ModelBackend") -> None:
    """Delete the overrides :func:`install` set on ``backend.model`` and restore
    ``num_assistant_tokens`` (no-op if they are not this backend's)."""
    model = backend.model
    generate = model.__dict__.get("generate")
    if getattr(generate, "dsv4_backend", None) is not backend:
        return
    for name in _OVERRIDES:
        model.__dict__.pop(name, None)
    model.generation_config.num_assistant_tokens = generate.saved_num_assistant_tokens
