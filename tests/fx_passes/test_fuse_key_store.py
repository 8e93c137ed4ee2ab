"""FuseKeyStorePass: a key's ``dsv4::rms_norm_rope`` and the ``dsv4::store_kv`` that reads it become
one ``dsv4::rms_norm_rope_store_kv`` node, and the cache is written with the same bytes.

Functions holding the chain are compiled with Inductor, ``FuseNormRopePass`` and this pass, both told
to match CPU tensors (by default they match CUDA ones only, where each op is one launch). On the
CPU the fused op is the reference, the unfused math, so the written cache equals eager's bit for
bit."""

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

from dsv4_compile import layout
from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.fx_passes import (DSV4PassManager, FuseKeyStorePass, FuseNormRopePass, FuseSinkhornPass,
                                    FuseStepMetadataPass)
from dsv4_compile.reference.functional import rms_norm, rope_tail
from tests.support.compile_checks import fresh_compile_state
from tests.support.hf_model import eager_and_compiled_prefill

FUSED = "dsv4.rms_norm_rope_store_kv.default (in place)"
UNFUSED = ["dsv4.rms_norm_rope.default", "dsv4.store_kv.default (in place)"]
PAGE = layout.SWA_PAGE_SIZE
KV_NORM = DeepseekV4RMSNorm(512, eps=1e-6)
with torch.no_grad():
    KV_NORM.weight.copy_(torch.rand(512, generator=torch.Generator().manual_seed(3)) + 0.5)
KV_NORM.requires_grad_(False)


def _inputs(rope_pairs: int = 32):
    gen = torch.Generator().manual_seed(rope_pairs)
    cache = torch.zeros(3, layout.model1_page_bytes(PAGE), dtype=torch.uint8)
    return (cache, torch.tensor([PAGE + 3, -1, 2 * PAGE + 7, 3 * PAGE]), torch.randn(4, 512, generator=gen).bfloat16(),
            torch.arange(4) * 37 + 11, 10000.0 ** (-torch.arange(0, 2 * rope_pairs, 2).float() / (2 * rope_pairs)))


def _run(fn, inputs, devices=("cpu",)):
    """(key-store matches, the graph's dsv4 ops, eager cache, compiled cache) of ``fn`` at ``inputs``."""
    fuse = FuseKeyStorePass(devices)
    passes = DSV4PassManager([FuseNormRopePass(devices), fuse])
    cache, *rest = inputs
    want, got = cache.clone(), cache.clone()
    with torch.no_grad(), fresh_compile_state():
        torch.compile(fn, fullgraph=True, options={"post_grad_custom_post_pass": passes, **EXACT_NUMERICS})(got, *rest)
        fn(want, *rest)
    return fuse.matched_count, passes.last_ops, want, got


@pytest.mark.parametrize("norm", ["transformers", "reference"])
def test_key_norm_rope_and_store_fused(norm):
    """The key's weighted norm (transformers' or the reference), RoPE, then the cache write: one node;
    the cache holds eager's bytes (the slot past the cache and the negative one write nothing)."""
    def fn(cache, slots, kv, positions, inv_freq):
        normed = KV_NORM(kv) if norm == "transformers" else rms_norm(kv, KV_NORM.weight, 1e-6)
        torch.ops.dsv4.store_kv(cache, slots, rope_tail(normed, positions, inv_freq), PAGE)

    matches, ops, want, got = _run(fn, _inputs())
    assert (matches, ops) == (1, [FUSED])
    assert want.any() and torch.equal(got, want)


@pytest.mark.parametrize("case", ["key-read-again", "other-rope-dims", "cuda-only"])
def test_other_writes_left_alone(case):
    """A key that something else reads too, a key rotated on other than 64 dims (not a MODEL1 key)
    and a pass that matches CUDA tensors only: the two ops stay."""
    def fn(cache, slots, kv, positions, inv_freq):
        k = rope_tail(KV_NORM(kv), positions, inv_freq)
        torch.ops.dsv4.store_kv(cache, slots, k, PAGE)
        return k.float().sum() if case == "key-read-again" else None

    inputs = _inputs(16 if case == "other-rope-dims" else 32)
    matches, ops, want, got = _run(fn, inputs, devices=("cuda",) if case == "cuda-only" else ("cpu",))
    assert matches == 0
    assert ops == (UNFUSED[1:] if case == "cuda-only" else UNFUSED)
    assert torch.equal(got, want)


def test_uuid_follows_the_devices():
    assert FuseKeyStorePass(("cpu",)).uuid() != FuseKeyStorePass().uuid()


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@torch.no_grad()
def test_model_step_fuses_each_layers_key_write():
    """compile_step of a 3-layer model (sliding, CSA, HCA) with the norm + RoPE and key-store passes:
    each layer's key write fuses (3 nodes, the queries' 3 norm + RoPE nodes stay), and the logits and
    every cache buffer equal the eager backend's, bit for bit."""
    fuse = FuseKeyStorePass(("cpu",))
    passes = DSV4PassManager([FuseStepMetadataPass(), FuseSinkhornPass(), FuseNormRopePass(("cpu",)), fuse])
    (want, written), (got, caches) = eager_and_compiled_prefill(passes)
    assert fuse.matched_count == fuse.last_ops.count(FUSED) == 3
    assert fuse.last_ops.count("dsv4.rms_norm_rope.default") == 3
    assert torch.equal(got, want)
    assert all(torch.equal(t, w) for t, w in zip(caches, written))
