"""Configuration of the DeepSeek V4 attention path (docs/semantics.md §1).

One frozen dataclass describes every attention layer of a model: the hard constants of the
attention path (head_dim 512 = 448 nope + 64 rope, window 128, page 256), the indexer, the
low-rank q / grouped output projections, RoPE / YaRN settings and the per-layer compression
ratios. Presets: ``flash`` and ``pro`` (released models, docs/semantics.md §1.3) and ``tiny``
(tests and the demo: every per-head dimension real, only hidden size, head counts and layer count
shrunk).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Hard constants of the attention path (docs/semantics.md §1.1). They are not configurable: the
# cache byte layout and the kernels are built around them.
HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
SWA_WINDOW = 128
PAGE_SIZE = 256
INDEX_HEAD_DIM = 128
INDEX_ALIGN = 64  # index tensors handed to attention are -1 padded to a multiple of this
VALID_RATIOS = (0, 4, 128)


@dataclass(frozen=True)
class DSV4AttnConfig:
    """Every attention-path setting of a DeepSeek V4 model.

    ``compress_ratios`` has one entry per attention layer of the stack (the MTP entry of the HF
    config is not included). Derived quantities are properties, so a preset is fully described by
    the fields below.
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    compress_ratios: tuple[int, ...]
    index_n_heads: int = 64
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max_position: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    # Speculative decoding: most draft tokens verified per request in one step. Sizes the
    # compressor state rings (a ring must hold a window plus the draft tokens written past it).
    max_draft_tokens: int = 4

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name, value,
                     "must be a positive int")
        for name in _POSITIVE_FLOATS:
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                     and value > 0, name, value, "must be a finite number > 0")
        original = self.yarn_original_max_position  # 0: no YaRN
        _require(isinstance(original, int) and not isinstance(original, bool) and original >= 0,
                 "yarn_original_max_position", original, "must be an int >= 0")
        _require(isinstance(self.compress_ratios, tuple), "compress_ratios", self.compress_ratios,
                 "must be a tuple (one entry per layer)")
        _require(self.o_groups > 0 and self.num_heads % self.o_groups == 0, "o_groups",
                 self.o_groups, f"must divide num_heads={self.num_heads}")
        _require(self.index_topk > 0 and self.index_topk % INDEX_ALIGN == 0, "index_topk",
                 self.index_topk, f"must be a positive multiple of {INDEX_ALIGN}")
        _require(len(self.compress_ratios) > 0, "compress_ratios", self.compress_ratios,
                 "needs one entry per layer")
        for r in self.compress_ratios:
            _require(r in VALID_RATIOS, "compress_ratios", self.compress_ratios,
                     f"entries must be in {VALID_RATIOS}")

    # -- derived -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def softmax_scale(self) -> float:
        return HEAD_DIM ** -0.5

    @property
    def index_weight_scale(self) -> float:
        """``index_head_dim**-0.5 * index_n_heads**-0.5`` (docs/semantics.md §4.3 step 3)."""
        return INDEX_HEAD_DIM ** -0.5 * self.index_n_heads ** -0.5

    def state_ring(self, ratio: int) -> int:
        """Rows of compressor state kept per request for a layer of ``ratio`` (docs/semantics.md §2.5).

        A completed window reads the last ``2*ratio`` (c4, overlapping) or ``ratio`` (c128)
        positions. A verify step writes ``max_draft_tokens`` positions past the committed length
        whose rows must not overwrite positions a later window still reads, so the ring holds a
        window plus the draft tokens, rounded up to a power of two.
        """
        window = 8 if ratio == 4 else ratio
        need = window + self.max_draft_tokens - 1
        ring = window
        while ring < need:
            ring *= 2
        return ring

    def with_(self, **changes) -> "DSV4AttnConfig":
        return dataclasses.replace(self, **changes)

    # -- presets -------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> "DSV4AttnConfig":
        try:
            return _PRESETS[name]()
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(_PRESETS)}") from None

    @classmethod
    def from_hf(cls, config, *, max_draft_tokens: int = 4, tp_size: int = 1) -> "DSV4AttnConfig":
        """The attention settings of a transformers ``DeepseekV4Config`` (docs/semantics.md §1.5).

        ``tp_size > 1``: the settings of one rank of a tensor-parallel group, whose attention holds
        ``num_heads / tp_size`` query heads and ``o_groups / tp_size`` output groups (docs/model.md,
        "Tensor parallelism"). Raises ``ValueError`` naming the transformers field for a setting
        the backend does not support. transformers is imported here, on first use, not with this
        module."""
        from .hf_config import attn_config_from_hf

        return attn_config_from_hf(config, max_draft_tokens=max_draft_tokens, tp_size=tp_size)


# Fields that must be positive: the sizes, and the RoPE / YaRN / norm constants (a zero or negative
# one makes every output NaN or inf instead of failing).
_POSITIVE_INTS = ("hidden_size", "num_heads", "q_lora_rank", "o_lora_rank", "o_groups", "index_n_heads", "index_topk",
                  "max_position_embeddings", "max_draft_tokens")
_POSITIVE_FLOATS = ("rope_theta", "compress_rope_theta", "yarn_factor", "yarn_beta_fast", "yarn_beta_slow",
                    "rms_norm_eps")


def _require(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"DSV4AttnConfig.{name}={value!r} {why}")


def _flash() -> DSV4AttnConfig:
    # Layers 0-1 SWA only, then c4 on even and c128 on odd layers, last layer (42) c4.
    ratios = (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 43))
    return DSV4AttnConfig(hidden_size=4096, num_heads=64, q_lora_rank=1024, o_lora_rank=1024,
                          o_groups=8, compress_ratios=ratios, index_topk=512)


def _pro() -> DSV4AttnConfig:
    # Layers 0-1 c128, then c4 on even and c128 on odd layers, layer 60 c4.
    ratios = (128, 128) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 61))
    return DSV4AttnConfig(hidden_size=7168, num_heads=128, q_lora_rank=1536, o_lora_rank=1024,
                          o_groups=16, compress_ratios=ratios, index_topk=1024)


def _tiny() -> DSV4AttnConfig:
    # Real per-head dimensions (512 / 64 rope / 128 indexer / window 128 / page 256); small
    # hidden size, head counts and layer count: one layer of each ratio.
    return DSV4AttnConfig(hidden_size=256, num_heads=8, q_lora_rank=128, o_lora_rank=64,
                          o_groups=2, compress_ratios=(0, 4, 128), index_n_heads=8,
                          index_topk=512)


_PRESETS = {"flash": _flash, "pro": _pro, "tiny": _tiny}
