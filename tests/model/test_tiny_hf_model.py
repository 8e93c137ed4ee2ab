"""The tiny transformers DeepSeek V4 model: every layer type, non-degenerate weights, a checkpoint
that round-trips (``tests/model/conftest.py`` asserts it), a forward with finite logits."""

import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from dsv4_compile import DSV4AttnConfig
from tests.support.hf_model import tiny_hf_config, tiny_hf_model


def test_config_covers_every_layer_type_and_maps_to_the_backend():
    config = tiny_hf_config()
    assert config.layer_types == ["sliding_attention", "compressed_sparse_attention",
                                  "heavily_compressed_attention", "compressed_sparse_attention"]
    assert config.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert (config.hc_mult, config.n_routed_experts, config.num_experts_per_tok) == (4, 4, 2)
    assert DSV4AttnConfig.from_hf(config).compress_ratios == (0, 4, 128, 4)


def test_depth_and_layer_type_overrides():
    assert tiny_hf_config(num_hidden_layers=6).layer_types[4:] == ["sliding_attention",
                                                                   "compressed_sparse_attention"]
    config = tiny_hf_config(layer_types=["heavily_compressed_attention"])
    assert config.num_hidden_layers == 1 and config.mlp_layer_types == ["hash_moe"]
    assert DSV4AttnConfig.from_hf(config).compress_ratios == (128,)


def test_loaded_checkpoint_has_drawn_parameters(tiny_hf):
    layers = tiny_hf.model.layers
    assert not tiny_hf.training and not any(p.requires_grad for p in tiny_hf.parameters())
    for layer in layers:
        sinks = layer.self_attn.sinks
        assert sinks.dtype == torch.float32 and 0.5 < sinks.std() < 2
    biases = [m.position_bias for m in tiny_hf.modules()
              if isinstance(m, (hf.DeepseekV4HCACompressor, hf.DeepseekV4CSACompressor, hf.DeepseekV4Indexer))]
    assert len(biases) == 5  # two CSA (each with an indexer) and one HCA compressor
    assert all(b.dtype == torch.float32 and 0.4 < b.std() < 0.6 for b in biases)
    routes = layers[0].mlp.gate.tid2eid
    assert routes.shape == (512, 2) and routes.min() >= 0 and routes.max() <= 3
    assert (routes[:, 0] != routes[:, 1]).all() and len(routes.unique(dim=0)) == 12  # every ordered pair
    correction = layers[1].mlp.gate.e_score_correction_bias
    assert correction.dtype == torch.float32 and 0 < correction.abs().max() < 0.05
    hc = layers[0].attn_hc  # transformers' init: fn ~ N(0, 0.02²), base 0, scale 1
    assert 0.015 < hc.fn.std() < 0.025 and (hc.base == 0).all() and (hc.scale == 1).all()


def test_seed_decides_the_weights():
    a, b, c = tiny_hf_model(seed=3), tiny_hf_model(seed=3), tiny_hf_model(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    q_a = "model.layers.0.self_attn.q_a_proj.weight"
    assert not torch.equal(sa[q_a], sc[q_a])
    assert not torch.equal(sa["model.layers.0.self_attn.sinks"], sc["model.layers.0.self_attn.sinks"])


def test_forward_of_two_short_sequences(tiny_hf):
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = tiny_hf(ids).logits
        alone = tiny_hf(ids[1:, :20]).logits
    assert logits.shape == (2, 32, 512) and logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all() and logits.float().std() > 0.05
    assert not torch.equal(logits[0], logits[1])
    # causal and per-sequence: a prefix of one sequence, alone, gives its first 20 rows
    torch.testing.assert_close(alone[0].float(), logits[1, :20].float(), atol=2e-2, rtol=2e-2)
