"""``DSV4AttnConfig.from_hf``: a transformers ``DeepseekV4Config`` mapped field by field, RoPE
tables equal to transformers' own, and a ``ValueError`` naming the field the backend cannot serve."""

import pytest
import torch
from transformers import DeepseekV4Config

from dsv4_compile import DSV4AttnConfig
from dsv4_compile.rope import layer_inv_freq, rope_inv_freq
from tests.support.hf_model import tiny_hf_config, tiny_hf_model

FLASH_YARN = dict(rope_type="yarn", factor=16, original_max_position_embeddings=65536, beta_fast=32,
                  beta_slow=1)


def test_tiny_config_maps_every_field():
    cfg = DSV4AttnConfig.from_hf(tiny_hf_config(rms_norm_eps=1e-5, max_position_embeddings=8192),
                                 max_draft_tokens=2)
    assert cfg == DSV4AttnConfig(
        hidden_size=256, num_heads=8, q_lora_rank=128, o_lora_rank=64, o_groups=2,
        compress_ratios=(0, 4, 128, 4), index_n_heads=8, index_topk=64, rope_theta=10000.0,
        compress_rope_theta=160000.0, yarn_factor=1.0, yarn_original_max_position=0,
        max_position_embeddings=8192, rms_norm_eps=1e-5, max_draft_tokens=2)


def test_released_flash_config_equals_the_flash_preset():
    """DeepSeek-V4-Flash as transformers describes it (legacy per-layer ``compress_ratios``, one
    more for the MTP layer, and a flat YaRN ``rope_scaling``-style dict)."""
    flash = DSV4AttnConfig.from_name("flash")
    hf_config = DeepseekV4Config(
        hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024,
        o_lora_rank=1024, o_groups=8, index_n_heads=64, index_topk=512,
        compress_ratios=list(flash.compress_ratios) + [0], rope_parameters=dict(FLASH_YARN))
    assert DSV4AttnConfig.from_hf(hf_config) == flash


def test_nested_rope_parameters_are_read_per_label():
    config = tiny_hf_config(rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.125},
        "compress": {**FLASH_YARN, "rope_theta": 40000.0, "partial_rotary_factor": 0.125,
                     "attention_factor": 1.0, "factor": 8, "beta_fast": 16, "beta_slow": 2}})
    cfg = DSV4AttnConfig.from_hf(config)
    assert (cfg.rope_theta, cfg.compress_rope_theta) == (20000.0, 40000.0)
    assert (cfg.yarn_factor, cfg.yarn_original_max_position, cfg.yarn_beta_fast, cfg.yarn_beta_slow) == (
        8.0, 65536, 16.0, 2.0)


@pytest.mark.parametrize("rope", [None, FLASH_YARN,
                                  dict(FLASH_YARN, factor=40, original_max_position_embeddings=4096)],
                         ids=["default", "flash_yarn", "yarn_factor_40"])
def test_rope_tables_equal_the_transformers_model(rope):
    """Bit for bit, both tables; factor 40 (not a power of two) pins down the rounding of
    ``1 / (factor * base**(2i/64))`` (docs/semantics.md §1.2)."""
    overrides = {} if rope is None else dict(rope_parameters=dict(rope))
    model = tiny_hf_model(config=tiny_hf_config(**overrides), dtype=torch.float32)
    cfg = DSV4AttnConfig.from_hf(model.config)
    rotary = model.model.rotary_emb
    assert torch.equal(layer_inv_freq(cfg, 0), rotary.main_inv_freq)
    assert torch.equal(layer_inv_freq(cfg, 4), rotary.compress_inv_freq)
    assert torch.equal(layer_inv_freq(cfg, 128), rotary.compress_inv_freq)
    assert torch.equal(rotary.compress_inv_freq, rope_inv_freq(160000.0)) == (rope is None)


def _set(**fields):
    def change(config):
        for name, value in fields.items():
            object.__setattr__(config, name, value)
    return change


def _set_rope(label, **fields):
    return lambda config: config.rope_parameters[label].update(fields)


UNSUPPORTED = [
    ("head_dim", _set(head_dim=256), "DeepseekV4Config.head_dim=256"),
    ("rope_dims", _set_rope("compress", partial_rotary_factor=0.25),
     'rope_parameters["compress"]["partial_rotary_factor"]=0.25'),
    ("main_rope_dims", _set_rope("main", partial_rotary_factor=0.0625),
     'rope_parameters["main"]["partial_rotary_factor"]=0.0625'),
    ("sliding_window", _set(sliding_window=256), "sliding_window=256"),
    ("index_head_dim", _set(index_head_dim=64), "index_head_dim=64"),
    ("csa_rate", _set(compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 128}),
     'compress_rates["compressed_sparse_attention"]=8'),
    ("hca_rate", _set(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 64}),
     'compress_rates["heavily_compressed_attention"]=64'),
    ("layer_type", _set(layer_types=["sliding_attention", "full_attention"]), "layer_types[1]='full_attention'"),
    ("kv_heads", _set(num_key_value_heads=2), "num_key_value_heads=2"),
    ("topk_not_aligned", _set(index_topk=100), "index_topk=100"),
    ("topk_zero", _set(index_topk=0), "index_topk=0"),
    ("main_rope_type", _set_rope("main", rope_type="yarn"), 'rope_parameters["main"]["rope_type"]'),
    ("compress_rope_type", _set_rope("compress", rope_type="linear", factor=2.0),
     'rope_parameters["compress"]["rope_type"]'),
    ("attention_factor", _set_rope("compress", **FLASH_YARN, attention_factor=1.2),
     'rope_parameters["compress"]["attention_factor"]=1.2'),
    ("derived_attention_factor", _set_rope("compress", **FLASH_YARN),  # no key: 0.1 ln 16 + 1
     'rope_parameters["compress"]["attention_factor"]=1.277'),
    ("yarn_below_original_length", _set_rope("compress", **{**FLASH_YARN, "attention_factor": 1.0,
                                                "original_max_position_embeddings": 2 ** 20}),
     "max_position_embeddings=1048576"),
]


@pytest.mark.parametrize("change, message", [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_unsupported_settings_name_the_transformers_field(change, message):
    config = tiny_hf_config()
    DSV4AttnConfig.from_hf(config)  # supported as built
    change(config)
    with pytest.raises(ValueError, match="DSV4 attention backend") as err:
        DSV4AttnConfig.from_hf(config)
    assert message in str(err.value)


@pytest.mark.parametrize("overrides, tp_size, field", [({}, 3, "num_attention_heads=8"),
                                                       ({"num_attention_heads": 6, "o_groups": 3}, 2, "o_groups=3")])
def test_tensor_parallel_split_must_keep_whole_heads_and_groups(overrides, tp_size, field):
    with pytest.raises(ValueError, match=f"DeepseekV4Config.{field} .*tensor-parallel size {tp_size}"):
        DSV4AttnConfig.from_hf(tiny_hf_config(**overrides), tp_size=tp_size)
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        DSV4AttnConfig.from_hf(tiny_hf_config(), tp_size=0)


def test_a_tensor_parallel_rank_holds_its_share_of_heads_and_groups():
    """``tp_size=2``: the rank's q-side counts; the softmax and indexer scales stay the model's."""
    whole, rank = (DSV4AttnConfig.from_hf(tiny_hf_config(), tp_size=n) for n in (1, 2))
    assert (rank.num_heads, rank.o_groups) == (4, 1)
    assert rank.softmax_scale == whole.softmax_scale and rank.index_weight_scale == whole.index_weight_scale
    assert rank == whole.with_(num_heads=4, o_groups=1)


def test_config_module_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, dsv4_compile.config; assert 'transformers' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
