"""Model-level passes on the GPU: a decode step of the 4-layer test model compiled with the default
passes against the same step compiled with them less one pass. Each pass matches its count and
the logits agree within bf16 rounding (the fused ops round and sum in other orders); where the
fused op computes what the unfused ones do (the compressors' cache writes), the caches are equal
byte for byte too."""

import pytest
import torch

from dsv4_compile.compile import compile_step
from dsv4_compile.fx_passes import (DSV4PassManager, FuseAttentionInverseRopePass, FuseCollapseLinearsPass,
                                    FuseEntryStorePass, FuseKeyStorePass, FuseNormRopePass,
                                    FuseSharedInputLinearsPass)
from dsv4_compile.fx_passes.pass_manager import default_passes
from dsv4_compile.model import enable
from dsv4_compile.step import ForwardMode, StepInputs
from dsv4_compile.testing.bench import passes_configured
from dsv4_compile.testing.random_model import random_hf_model
from tests.gpu.test_model_gpu import _tiny_config
from tests.support.compile_checks import fresh_compile_state

pytestmark = pytest.mark.gpu

# pass -> its matches in the 4-layer model's step: the shared-input linears (4 layers' normed hidden
# states + the 2 CSA layers' query latents; the MoE's router is alone, its shared expert running in
# dsv4::moe_experts, and no lone product has K >= 4096 at hidden 256); the norm + RoPE chains (4
# layers x query and key); the keys' cache writes (4 layers); the compressors' cache writes (2 CSA
# layers x attention and indexer compressor, 1 HCA layer); the attention outputs' inverse RoPE (4
# layers). (Each layer calls its grouped o_a_proj as dsv4::grouped_linear itself:
# FuseGroupedLinearPass has nothing to rewrite here.)
MATCHES = [(FuseSharedInputLinearsPass, 6), (FuseNormRopePass, 8), (FuseKeyStorePass, 4), (FuseEntryStorePass, 5),
           (FuseAttentionInverseRopePass, 4)]
EXACT = (FuseEntryStorePass,)


def _decode_step_compiled(pass_lists: dict[str, list]) -> tuple[dict, dict]:
    """The 4-layer model's decode step (two requests) compiled with each of ``pass_lists`` in turn,
    from the same cache: ``(logits, cache buffers written)`` by name."""
    backend = enable(random_hf_model(_tiny_config(), seed=0, device="cuda"), max_requests=2, max_seq_len=512)
    rows = [backend.allocator.admit(), backend.allocator.admit()]
    prompt = StepInputs.make(ForwardMode.EXTEND, rows, [40, 30], [40, 30],
                             torch.cat([backend.allocator.extend(r, n) for r, n in zip(rows, (40, 30))]), device="cuda")
    ids = torch.randint(0, 512, (70,), device="cuda")
    backend(ids, prompt, torch.tensor([39, 69], device="cuda"))
    decode = StepInputs.make(ForwardMode.DECODE, rows, [41, 31], [1, 1],
                             torch.cat([backend.allocator.extend(r, 1) for r in rows]), device="cuda")
    tokens, logit_rows = ids[:2], torch.arange(2, device="cuda")
    outs, written = {}, {}
    for name, chosen in pass_lists.items():
        saved = [t.clone() for t in backend.cache.buffers()]
        with fresh_compile_state():
            outs[name] = compile_step(backend, passes=DSV4PassManager(chosen))(tokens, decode, logit_rows).float()
        written[name] = [t.clone() for t in backend.cache.buffers()]
        for t, s in zip(backend.cache.buffers(), saved):
            t.copy_(s)
    return outs, written


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("pass_type, matches", MATCHES, ids=[t.__name__ for t, _ in MATCHES])
@torch.no_grad()
def test_compiled_model_step_with_and_without(pass_type, matches):
    fused = default_passes()
    tested = [p for p in fused if isinstance(p, pass_type)]
    assert len(tested) == 1
    outs, written = _decode_step_compiled({"fused": fused, "unfused": [p for p in fused if p not in tested]})
    assert tested[0].matched_count == matches
    scale = outs["unfused"].abs().max().item()
    torch.testing.assert_close(outs["fused"], outs["unfused"], atol=0.05 * scale, rtol=0)
    if pass_type in EXACT:
        assert all(torch.equal(f, u) for f, u in zip(written["fused"], written["unfused"]))


@pytest.mark.filterwarnings("ignore::UserWarning")
@torch.no_grad()
def test_query_latent_norm_folded():
    """``FuseSharedInputLinearsPass(fold_input_norm=True)``: each layer's query latent norm folds
    into its q_b products (8 calls: 2 more, the sliding and HCA layers' lone q_b), the logits
    within bf16 rounding of the defaults'."""
    folded = passes_configured(FuseSharedInputLinearsPass, fold_input_norm=True)
    fold = next(p for p in folded if isinstance(p, FuseSharedInputLinearsPass))
    outs, _ = _decode_step_compiled({"folded": folded, "defaults": default_passes()})
    assert fold.matched_count == 8
    scale = outs["defaults"].abs().max().item()
    torch.testing.assert_close(outs["folded"], outs["defaults"], atol=0.05 * scale, rtol=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
@torch.no_grad()
def test_collapses_made_by_their_products_launch():
    """``FuseCollapseLinearsPass`` after the defaults: the first layer's hc_pre and the three
    hc_post_pre before an attention block fuse with the projections of their collapse; on the MoE
    side the collapse goes to ``dsv4::moe_experts`` (a hash layer) or to a learned router's lone
    product (not a ``linears`` call at hidden 256), and the head's lm_head (K 256) is cuBLAS's:
    4 matches. At hidden 256 no products' launch splits K, so each fused call runs the two ops'
    launches (the fused launches are checked at the Flash width in ``test_hyper_connection_gpu.py``);
    the logits within bf16 rounding of the defaults'."""
    collapse = FuseCollapseLinearsPass()
    outs, written = _decode_step_compiled({"collapse": [*default_passes(), collapse], "defaults": default_passes()})
    assert collapse.matched_count == 4
    scale = outs["defaults"].abs().max().item()
    torch.testing.assert_close(outs["collapse"], outs["defaults"], atol=0.05 * scale, rtol=0)
