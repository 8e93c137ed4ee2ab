"""``model.generate()`` on the backend: the per-instance overrides :func:`install` sets.

The class and ``transformers`` are untouched; :func:`uninstall` deletes what :func:`install` set on
the model instance (docs/model.md, "generate()"):

* ``_prepare_cache_for_generation``: when ``generate`` would build its own cache (none passed,
  ``use_cache`` on, no ``cache_implementation``), it builds a
  :class:`~dsv4_compile.hf_cache.DSV4PagedCache` instead; beam search is refused (the rows cannot
  be reordered), and so is assisted generation on ``transformers``' own cache (it cannot roll
  back); anything else goes to ``transformers``.
* ``generate``: releases the request rows of the caches built during the call when it returns or
  raises — except the cache it returns (``return_dict_in_generate``), whose rows go back when that
  object is reset or dropped. Nested calls (the model drafting for itself) release at the outer one.
* ``_is_stateful = False``: ``transformers`` refuses assisted generation for this model because its
  own compressor state cannot roll back; on the backend a rollback is a truncate of the paged cache.
* ``_get_candidate_generator``: the draft generator ``transformers`` builds for assisted
  generation (a draft model, this model drafting for itself, prompt lookup) drafts at most
  ``max_draft_tokens`` tokens a step, however long its configured or heuristically grown draft
  length (a deeper rollback is refused), and no candidate runs past ``max_length - 1`` tokens.
* ``_optimize_model_for_decode``: a no-op, so decoding keeps the experts implementation
  ``enable`` set instead of ``transformers`` switching it on accelerators.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .hf_cache import DSV4PagedCache
    from .model import ModelBackend

_OVERRIDES = ("_prepare_cache_for_generation", "generate", "_get_candidate_generator", "_is_stateful",
              "_optimize_model_for_decode")
# Attributes of transformers' candidate generators holding the tokens drafted a step
# (AssistedCandidateGenerator and its subclasses; PromptLookupCandidateGenerator).
_DRAFT_LENGTHS = ("num_assistant_tokens", "num_output_tokens")


def install(backend: "ModelBackend") -> None:
    """Make ``backend.model.generate()`` run over the backend's paged cache (module docstring)."""
    from transformers.generation.configuration_utils import GenerationMode

    from .hf_cache import DSV4PagedCache  # imports transformers: loaded with any model

    model = backend.model
    prepare, generate = model._prepare_cache_for_generation, model.generate  # the class's, bound
    candidate_generator = model._get_candidate_generator
    created: list["DSV4PagedCache"] = []  # caches built by the outermost generate call running now
    depth = [0]

    def prepare_cache(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        if generation_config.num_beams > 1:
            raise ValueError("beam search is not supported on the dsv4_compile backend: its cache's request rows "
                             "cannot be reordered (use num_beams=1, or backend.close() first)")
        passed = model_kwargs.get("past_key_values")
        if (passed is not None or generation_config.use_cache is False
                or generation_config.cache_implementation is not None):
            if generation_mode == GenerationMode.ASSISTED_GENERATION and not isinstance(passed, DSV4PagedCache):
                # transformers' own cache runs the original forward, whose compressor state cannot roll back
                raise ValueError(f"assisted generation is not supported with stateful models, such as "
                                 f"{type(model).__name__}, on transformers' own cache: let generate build the "
                                 f"backend's cache (no cache_implementation, no past_key_values of another type)")
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

    @functools.wraps(candidate_generator)
    def capped_candidate_generator(*args, **kwargs):
        config = inspect.signature(candidate_generator).bind(*args, **kwargs).arguments["generation_config"]
        return capped(candidate_generator(*args, **kwargs), backend.config.max_draft_tokens, config.max_length)

    model._prepare_cache_for_generation = prepare_cache
    model._get_candidate_generator = capped_candidate_generator
    model.generate = generate_on_backend
    model._is_stateful = False
    model._optimize_model_for_decode = contextlib.nullcontext
    generate_on_backend.dsv4_backend = backend  # marks the overrides (uninstall removes only its own)


def uninstall(backend: "ModelBackend") -> None:
    """Delete the overrides :func:`install` set on ``backend.model`` (no-op if they are not this
    backend's)."""
    model = backend.model
    generate = model.__dict__.get("generate")
    if getattr(generate, "dsv4_backend", None) is not backend:
        return
    for name in _OVERRIDES:
        model.__dict__.pop(name, None)


def capped(generator, max_draft: int, max_length: int):
    """``generator`` (a ``transformers`` candidate generator) drafting at most ``max_draft`` tokens
    a step: before each draft its draft length is capped, whether configured longer or grown by
    the heuristic schedule (which adds 2 after every fully accepted draft). Its candidate sequences
    are cut to ``max_length - 1`` tokens, the most a verify step feeds within generate's length
    (prompt lookup's own cap lets a draft run to ``max_length``, past what the cache was sized for).
    The wrapper holds the generator weakly: a cycle would keep it, and the draft cache it holds,
    alive past ``generate`` (until a garbage collection), and with them the draft model's request
    rows."""
    this, get_candidates = weakref.ref(generator), type(generator).get_candidates

    def get_capped_candidates(input_ids, *args, **kwargs):
        generator = this()
        for name in _DRAFT_LENGTHS:
            if getattr(generator, name, None) is not None:
                setattr(generator, name, min(getattr(generator, name), max_draft))
        candidate_ids, candidate_logits = get_candidates(generator, input_ids, *args, **kwargs)
        drafted = max(min(candidate_ids.shape[1], max_length - 1) - input_ids.shape[1], 0)
        candidate_ids = candidate_ids[:, :input_ids.shape[1] + drafted]
        return candidate_ids, None if candidate_logits is None else candidate_logits[:, :drafted]

    generator.get_candidates = get_capped_candidates
    return generator
