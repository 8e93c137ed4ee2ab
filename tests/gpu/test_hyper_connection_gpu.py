"""The mHC ops on the GPU (the Triton kernels registered in ``ops/hyper_connection.py``) against
their references on the same device at the Flash width (hidden 4096, 4 streams, fp32 weights as
``from_pretrained`` keeps them, bf16 streams), and a hyper-connection of that width compiled by
Inductor with the dsv4 passes: the Sinkhorn loop becomes the op, the results stay those of eager."""

import math

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4HyperConnection, DeepseekV4HyperHead,
                                                                  DeepseekV4RMSNorm)

from dsv4_compile import hf_hyper_connection as hyper_connection
from dsv4_compile.fx_passes import DSV4PassManager, FuseSinkhornPass
from dsv4_compile.reference import hyper_connection as ref
from tests.support.compile_checks import fresh_compile_state
from tests.support.hf_model import tiny_hf_config

pytestmark = pytest.mark.gpu


def _bf16_step(scale: float) -> float:
    """One bf16 rounding step (ulp) at magnitude ``scale`` (at least 1): a value a few fp32 ulps
    from a rounding boundary lands one step away."""
    return 2.0 ** (math.floor(math.log2(max(1.0, scale))) - 7)


@pytest.mark.parametrize("n", [4, 3, 8])
@pytest.mark.parametrize("m", [1, 64, 64 * 3 + 5, 4096])
def test_kernel_equals_the_reference(m, n):
    g = torch.Generator(device="cuda").manual_seed(m * 10 + n)
    x = torch.softmax(torch.randn(m, n, n, device="cuda", generator=g) * 3, dim=-1) + 1e-6
    got = torch.ops.dsv4.sinkhorn(x, 20, 1e-6)
    torch.testing.assert_close(got, ref.sinkhorn(x, 20, 1e-6), atol=1e-6, rtol=0)


def test_strided_input_and_no_rows():
    x = torch.rand(8, 4, 4, device="cuda").transpose(-1, -2)
    torch.testing.assert_close(torch.ops.dsv4.sinkhorn(x, 5, 1e-6), ref.sinkhorn(x, 5, 1e-6), atol=1e-6, rtol=0)
    assert torch.ops.dsv4.sinkhorn(torch.empty(0, 4, 4, device="cuda"), 5, 1e-6).shape == (0, 4, 4)


@torch.no_grad()
def test_compiled_hyper_connection_runs_the_op():
    """Fused against the same module compiled without the pass: comb within a few fp32 ulps (only
    the Sinkhorn differs), post and the collapsed streams within one rounding step at their scale;
    both compiles within 1e-3 of eager (Inductor's own fp32 reduction order), the bf16 collapsed
    streams within one bf16 rounding step of eager's."""
    hc = DeepseekV4HyperConnection(tiny_hf_config(num_hidden_layers=1, hidden_size=4096)).cuda()
    for p in (hc.fn, hc.base, hc.scale):
        p.normal_(std=0.5)
    streams = torch.randn(1, 8, hc.hc_mult, 4096, device="cuda").bfloat16()
    fuse = FuseSinkhornPass()
    with fresh_compile_state():
        outs = {name: torch.compile(hc, fullgraph=True, options={"post_grad_custom_post_pass": DSV4PassManager(passes)})(streams)
                for name, passes in (("fused", [fuse]), ("unfused", []))}
    assert fuse.matched_count == 1 and fuse.last_ops == ["dsv4.sinkhorn.default"]
    (post, comb, collapsed), (want_post, want_comb, want_collapsed) = outs["fused"], outs["unfused"]
    torch.testing.assert_close(comb, want_comb, atol=1e-6, rtol=0)
    torch.testing.assert_close(post, want_post, atol=1e-6, rtol=0)
    scale = want_collapsed.float().abs().max().item()
    torch.testing.assert_close(collapsed.float(), want_collapsed.float(), atol=_bf16_step(scale), rtol=0)
    for got, want in zip(outs["fused"], hc(streams)):
        scale = want.float().abs().max().item()
        bf16_step = _bf16_step(scale) if want.dtype == torch.bfloat16 else 0.0  # collapsed: one rounding flip
        torch.testing.assert_close(got.float(), want.float(), atol=max(1e-3 * max(1.0, scale), bf16_step), rtol=0)


def _flash_width(module):
    """Weights drawn so the mixes are O(1), as a trained model's are (``fn`` of std 1/sqrt(N D)):
    random weights of std 0.5 would saturate the sigmoids and softmax and magnify the fp32 rounding
    of 16,384-term sums beyond any fixed tolerance."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.5)
        fn = module.fn if hasattr(module, "fn") else module.hc_fn
        fn.normal_(std=fn.shape[1] ** -0.5)
    return module.cuda()


def _close_to_one_rounding(got, want):
    """fp32 outputs within 2e-5 (the split-K sum adds in another order); bf16 outputs within one
    bf16 rounding step of their largest magnitude."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    else:
        scale = want.float().abs().max().item() if want.numel() else 0.0
        torch.testing.assert_close(got.float(), want.float(), atol=_bf16_step(scale), rtol=0)



@pytest.mark.parametrize("tokens", [1, 7, 64, 333])
@torch.no_grad()
def test_hc_ops_equal_the_modules_at_flash_width(tokens):
    config = tiny_hf_config(num_hidden_layers=1, hidden_size=4096)
    hc, head = _flash_width(DeepseekV4HyperConnection(config)), _flash_width(DeepseekV4HyperHead(config))
    g = torch.Generator(device="cuda").manual_seed(tokens)
    streams = torch.randn(1, tokens, hc.hc_mult, 4096, device="cuda", generator=g).bfloat16()
    got, want = hyper_connection.pre(hc, streams), hc(streams)
    for a, b in zip(got, want, strict=True):
        _close_to_one_rounding(a, b)
    _close_to_one_rounding(hyper_connection.head(head, streams), head(streams))
    post, comb, _ = want
    block_out = torch.randn(1, tokens, 4096, device="cuda", generator=g).bfloat16()
    _close_to_one_rounding(hyper_connection.post(post, comb, block_out, streams),
                           ref.hc_post(post, comb, block_out, streams))
    # a block's mix then the next hyper-connection, one op: the streams against the reference's, the
    # rest against the module on the op's own streams (a rounding apart from the reference's moves the
    # mixes by more than the fp32 tolerance)
    got = hyper_connection.post_pre(post, comb, block_out, streams, hc)
    _close_to_one_rounding(got[0], ref.hc_post(post, comb, block_out, streams))
    for a, b in zip(got[1:], hc(got[0]), strict=True):
        _close_to_one_rounding(a, b)


@pytest.mark.parametrize("tokens", [1, 5, 333])
@torch.no_grad()
def test_the_block_norm_in_the_ops_at_flash_width(tokens, monkeypatch):
    """The collapse RMS-normalised inside the ops (the block's input norm, the final norm) against
    the norm module on the module's collapse: within one bf16 rounding step (the kernels take the
    sum of squares from the streams' Gram matrix, of the unrounded collapse). Called twice, on fresh
    allocations and a fresh block output: the ops keep nothing between calls."""
    monkeypatch.setattr(hyper_connection, "NORM_IN_OP", True)
    config = tiny_hf_config(num_hidden_layers=1, hidden_size=4096)
    hc, head = _flash_width(DeepseekV4HyperConnection(config)), _flash_width(DeepseekV4HyperHead(config))
    norm = DeepseekV4RMSNorm(4096, eps=config.rms_norm_eps).cuda()
    norm.weight.normal_(1.0, 0.2)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    streams = torch.randn(1, tokens, hc.hc_mult, 4096, device="cuda", generator=g).bfloat16()
    for _ in range(2):
        post, comb, normed = hyper_connection.pre(hc, streams, norm)
        _close_to_one_rounding(normed, norm(hc(streams)[2]))
        _close_to_one_rounding(hyper_connection.head(head, streams, norm), norm(head(streams)))
        block_out = torch.randn(1, tokens, 4096, device="cuda", generator=g).bfloat16()
        got = hyper_connection.post_pre(post, comb, block_out, streams, hc, norm)
        _close_to_one_rounding(got[3], norm(hc(got[0])[2]))


@pytest.mark.parametrize("tokens", [1, 2])
@torch.no_grad()
def test_collapse_made_by_its_products_launch_at_flash_width(tokens):
    """``hc_pre_linears`` / ``hc_post_pre_linears`` / ``hc_head_linears`` (the products' launch
    makes the collapse at one token; two run the two ops' launches) against the hc op and then
    ``linears``: the new streams bit for bit, post and comb within fp32 rounding (the same summed
    mixes and Sinkhorn steps, in another kernel whose multiply-adds the compiler may contract
    otherwise), the collapse within one bf16 rounding (its N terms add in another order),
    the products (a layer's projections of its hidden state, a sliding layer's split-K pair, an
    lm_head-wide weight) within the rounding that moves."""
    config = tiny_hf_config(num_hidden_layers=1, hidden_size=4096)
    hc, head = _flash_width(DeepseekV4HyperConnection(config)), _flash_width(DeepseekV4HyperHead(config))
    g = torch.Generator(device="cuda").manual_seed(tokens)
    streams = torch.randn(1, tokens, hc.hc_mult, 4096, device="cuda", generator=g).bfloat16()
    norm = (torch.rand(4096, device="cuda", generator=g) + 0.5, 1e-6)
    post, comb, _ = hc(streams)
    block_out = torch.randn(1, tokens, 4096, device="cuda", generator=g).bfloat16()
    settings = (hc.fn, hc.base, hc.scale, hc.hc_sinkhorn_iters, hc.hc_eps, hc.input_norm.eps, *norm)
    head_settings = (head.hc_fn, head.hc_base, head.hc_scale, head.eps, head.input_norm.eps, *norm)
    ops = torch.ops.dsv4
    for rows in ((1024, 512, 1024, 1024, 512, 64), (1024, 512), (32768,)):
        weights = [torch.randn(r, 4096, device="cuda", generator=g).bfloat16() * 0.02 for r in rows]
        cases = [(ops.hc_pre_linears(streams, *settings, weights), ops.hc_pre(streams, *settings)),
                 (ops.hc_post_pre_linears(post, comb, block_out, streams, *settings, weights),
                  ops.hc_post_pre(post, comb, block_out, streams, *settings)),
                 (ops.hc_head_linears(streams, *head_settings, weights), (ops.hc_head(streams, *head_settings),))]
        for fused, apart in cases:
            *hc_out, products = fused
            for a, b in zip(hc_out[:-1], apart[:-1], strict=True):
                if a.dtype == torch.bfloat16:  # the new streams
                    assert torch.equal(a, b)
                else:  # post, comb
                    torch.testing.assert_close(a, b)
            _close_to_one_rounding(hc_out[-1], apart[-1])
            for got, w in zip(products, weights, strict=True):
                want = hc_out[-1].reshape(tokens, 4096).float() @ w.float().T
                torch.testing.assert_close(got.float(), want, atol=_bf16_step(want.abs().max().item()) * 2, rtol=0)
