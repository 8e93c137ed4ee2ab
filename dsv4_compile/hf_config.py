"""A transformers ``DeepseekV4Config`` as a :class:`DSV4AttnConfig` (docs/semantics.md §1.5).

Imported only by :meth:`DSV4AttnConfig.from_hf`, so the rest of the library never imports
transformers. Every setting the attention backend fixes (head dims, window, indexer width, the two
compress rates, one KV head, RoPE without a YaRN attention factor) is checked, and a ``ValueError``
names the transformers field that does not fit.
"""

from __future__ import annotations

from transformers import DeepseekV4Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .config import HEAD_DIM, INDEX_ALIGN, INDEX_HEAD_DIM, ROPE_DIM, SWA_WINDOW, DSV4AttnConfig

# transformers layer type -> the ratio the backend serves it with.
LAYER_TYPE_RATIOS = {"sliding_attention": 0, "compressed_sparse_attention": 4,
                     "heavily_compressed_attention": 128}


def attn_config_from_hf(config: DeepseekV4Config, *, max_draft_tokens: int = 4, tp_size: int = 1
                        ) -> DSV4AttnConfig:
    """The attention-path settings of ``config`` (its MTP layer is not included); with ``tp_size > 1``
    those of one rank of a tensor-parallel group: its share of the query heads and output groups."""
    _check_fixed_dims(config)
    _check_tp_size(config, tp_size)
    rope = config.rope_parameters
    for label in ("main", "compress"):
        rotary = int(config.head_dim * rope[label].get("partial_rotary_factor", 1.0))
        _require(rotary == ROPE_DIM, f'rope_parameters["{label}"]["partial_rotary_factor"]',
                 rope[label].get("partial_rotary_factor"), f"must give {ROPE_DIM} rotary dims")
    main_type = rope["main"].get("rope_type", "default")
    _require(main_type == "default", 'rope_parameters["main"]["rope_type"]', main_type,
             "must be 'default' (sliding-window layers use plain RoPE)")
    return DSV4AttnConfig(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads // tp_size,
        q_lora_rank=config.q_lora_rank, o_lora_rank=config.o_lora_rank, o_groups=config.o_groups // tp_size,
        compress_ratios=compress_ratios(config), index_n_heads=config.index_n_heads,
        index_topk=config.index_topk, rope_theta=float(rope["main"]["rope_theta"]),
        compress_rope_theta=float(rope["compress"]["rope_theta"]),
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        max_draft_tokens=max_draft_tokens, **_yarn_fields(config))


def compress_ratios(config: DeepseekV4Config) -> tuple[int, ...]:
    """One ratio per decoder layer from ``layer_types`` and ``compress_rates``."""
    ratios = []
    for i, layer_type in enumerate(config.layer_types):
        _require(layer_type in LAYER_TYPE_RATIOS, f"layer_types[{i}]", layer_type,
                 f"must be one of {sorted(LAYER_TYPE_RATIOS)}")
        ratio = LAYER_TYPE_RATIOS[layer_type]
        if ratio:
            rate = config.compress_rates.get(layer_type)
            _require(rate == ratio, f'compress_rates["{layer_type}"]', rate, f"must be {ratio}")
        ratios.append(ratio)
    return tuple(ratios)


def _check_fixed_dims(config: DeepseekV4Config) -> None:
    _require(config.head_dim == HEAD_DIM, "head_dim", config.head_dim, f"must be {HEAD_DIM}")
    _require(config.sliding_window == SWA_WINDOW, "sliding_window", config.sliding_window,
             f"must be {SWA_WINDOW}")
    _require(config.index_head_dim == INDEX_HEAD_DIM, "index_head_dim", config.index_head_dim,
             f"must be {INDEX_HEAD_DIM}")
    kv_heads = getattr(config, "num_key_value_heads", 1)
    _require(kv_heads == 1, "num_key_value_heads", kv_heads, "must be 1 (one shared KV head)")
    _require(config.index_topk > 0 and config.index_topk % INDEX_ALIGN == 0, "index_topk",
             config.index_topk, f"must be a positive multiple of {INDEX_ALIGN}")


def _check_tp_size(config: DeepseekV4Config, tp_size: int) -> None:
    """A rank holds whole heads and whole output groups (each group projects its own run of heads)."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    for field in ("num_attention_heads", "o_groups"):
        value = getattr(config, field)
        _require(value % tp_size == 0, field, value,
                 f"must be divisible by the tensor-parallel size {tp_size} (each rank holds whole heads and "
                 "whole output groups)")


def _yarn_fields(config: DeepseekV4Config) -> dict:
    """``DSV4AttnConfig`` YaRN fields from ``rope_parameters["compress"]`` (transformers' defaults
    for missing keys); a default rope gives factor 1 and no original length, i.e. no YaRN."""
    rope = config.rope_parameters["compress"]
    field = 'rope_parameters["compress"]'
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return {"yarn_factor": 1.0, "yarn_original_max_position": 0}
    _require(rope_type == "yarn", f'{field}["rope_type"]', rope_type,
             "must be 'default' or 'yarn'")
    original = rope["original_max_position_embeddings"]
    # transformers applies YaRN at any length; the backend only when the model outgrows the
    # original length (docs/semantics.md §1.2).
    _require(config.max_position_embeddings > original, "max_position_embeddings",
             config.max_position_embeddings, f"must exceed {field}['original_max_position_embeddings']"
             f"={original} for YaRN")
    _, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, None, layer_type="compress")
    _require(attention_factor == 1.0, f'{field}["attention_factor"]', attention_factor,
             "must be 1 (the backend does not scale cos / sin)")
    factor = rope.get("factor") or config.max_position_embeddings / original
    return {"yarn_factor": float(factor), "yarn_original_max_position": original,
            "yarn_beta_fast": float(rope.get("beta_fast") or 32),
            "yarn_beta_slow": float(rope.get("beta_slow") or 1)}


def _require(ok: bool, field: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"DeepseekV4Config.{field}={value!r} is not supported by the DSV4 attention "
                         f"backend: {why}")
