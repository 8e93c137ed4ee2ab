"""A tiny transformers DeepSeek V4 model that exercises every attention and MoE path.

Real per-head dimensions (head 512, 64 rope dims, indexer 128, window 128); hidden size, heads,
experts and depth shrunk; seeded random weights (``dsv4_compile.testing.random_model``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4_compile.testing.random_model import random_hf_model

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
    """:func:`~dsv4_compile.testing.random_model.random_hf_model` of ``config`` (default
    :func:`tiny_hf_config`) on the CPU; with ``path`` it is also saved there (``save_pretrained``)."""
    model = random_hf_model(tiny_hf_config() if config is None else config, seed=seed, dtype=dtype)
    if path is not None:
        model.save_pretrained(path)
    return model


def prefill(layer_types: list[str], tokens: int = 6):
    """The tiny model with a layer of each of ``layer_types`` on the backend, one admitted request
    and its first step: ``(backend, input_ids [tokens], EXTEND step)``."""
    from dsv4_compile.model import enable
    from dsv4_compile.step import ForwardMode, StepInputs

    config = tiny_hf_config(num_hidden_layers=len(layer_types), layer_types=layer_types)
    backend = enable(tiny_hf_model(config=config), max_requests=1, max_seq_len=256)
    ids = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(0))
    row = backend.allocator.admit()
    step = StepInputs.make(ForwardMode.EXTEND, [row], [tokens], [tokens], backend.allocator.extend(row, tokens))
    return backend, ids, step


def three_layer_prefill(tokens: int = 6):
    """:func:`prefill` of one layer of each attention type (sliding, CSA, HCA)."""
    return prefill(["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"], tokens)


def eager_and_compiled_prefill(passes, tokens: int = 6):
    """The :func:`three_layer_prefill` step run eagerly, then from the same cache compiled by
    ``compile_step`` with ``passes`` (a ``DSV4PassManager``) under ``EXACT_NUMERICS``:
    ``((eager logits, cache buffers after it), (compiled logits, cache buffers after it))``, the
    logits fp32, of every token."""
    from dsv4_compile.compile import compile_step
    from dsv4_compile.export import EXACT_NUMERICS
    from tests.support.compile_checks import fresh_compile_state

    backend, ids, step = three_layer_prefill(tokens)
    rows = torch.arange(tokens)
    before = [t.clone() for t in backend.cache.buffers()]
    want = backend(ids, step, rows).float()
    written = [t.clone() for t in backend.cache.buffers()]
    for t, b in zip(backend.cache.buffers(), before):
        t.copy_(b)
    with fresh_compile_state():
        got = compile_step(backend, passes=passes, options=EXACT_NUMERICS)(ids, step, rows).float()
    return (want, written), (got, list(backend.cache.buffers()))
