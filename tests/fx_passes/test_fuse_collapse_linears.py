"""FuseCollapseLinearsPass: an hc op whose collapse feeds a ``dsv4::linears`` call becomes one
``hc_*_linears`` call, with the same results.

Functions of the ops are traced with ``make_fx`` and the pass applied to their graph; a whole model
step is compiled with Inductor. On the CPU the fused ops are their references, the two ops in
turn, so results are bit for bit those of the unfused graph (the pass is told to match CPU
tensors: by default it matches CUDA ones only, where the fused op saves a launch)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dsv4_compile.compile import compile_step
from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.fx_passes import DSV4PassManager, FuseCollapseLinearsPass
from dsv4_compile.fx_passes.pass_manager import default_passes
from tests.support.compile_checks import fresh_compile_state
from tests.support.hf_model import prefill

ops = torch.ops.dsv4
N, D = 4, 64


def _hc_args(tokens=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, N, D, generator=gen).bfloat16()
    fn, base, scale = torch.randn(24, N * D, generator=gen) * 0.1, torch.randn(24, generator=gen), torch.rand(3)
    return x, fn, base, scale, torch.rand(D, generator=gen) + 0.5


def _weights(*rows):
    return [torch.randn(r, D).bfloat16() for r in rows]


def _blocks(x, fn, base, scale, norm, w1, w2, w3, w_head):
    """A collapse read by two products' calls (the first fuses), one whose call folds a norm (left
    alone), a collapse read as a select of its batch dim, and a head's collapse by a lone product."""
    post, comb, h = ops.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-6)
    a, b = ops.linears(h.reshape(-1, D), [w1, w2])
    c, = ops.linears(h.reshape(-1, D), [w3])
    new, post2, comb2, h2 = ops.hc_post_pre(post, comb, h, x, fn, base, scale, 20, 1e-6, 1e-6, norm, 1e-6)
    d, = ops.linears(h2.select(0, 0), [w1], norm, 1e-6)  # a norm folded: not the collapse's products
    e, = ops.linears(h2.select(0, 0), [w2])
    head = ops.hc_head(new, fn[:N], base[:N], scale[:1], 1e-6, 1e-6, norm, 1e-6)
    logits, = ops.linears(head.view(-1, D), [w_head])
    return a, b, c, d, e, post2, comb2, logits, h.sum()


def _fused_ops(graph):
    return sorted(str(n.target) for n in graph.nodes if n.op == "call_function" and "hc_" in str(n.target))


def test_each_collapse_fuses_with_its_first_products_call():
    args = (*_hc_args(), *_weights(8, 5, 6, 32))
    gm = make_fx(_blocks, tracing_mode="fake")(*args)
    fuse = FuseCollapseLinearsPass(("cpu",))
    fuse(gm.graph)
    gm.recompile()
    assert fuse.matched_count == 3
    assert _fused_ops(gm.graph) == ["dsv4.hc_head_linears.default", "dsv4.hc_post_pre_linears.default",
                                    "dsv4.hc_pre_linears.default"]
    assert fuse.last_ops.count("dsv4.linears.default") == 2  # the second call of h, the folded norm's
    for got, want in zip(gm(*args), _blocks(*args), strict=True):
        assert torch.equal(got, want)


def test_cuda_only_by_default_and_settings_in_uuid():
    args = (*_hc_args(), *_weights(8, 5, 6, 32))
    gm = make_fx(_blocks, tracing_mode="fake")(*args)
    fuse = FuseCollapseLinearsPass()
    fuse(gm.graph)
    assert fuse.matched_count == 0
    assert FuseCollapseLinearsPass().uuid() != FuseCollapseLinearsPass(("cpu",)).uuid()


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@torch.no_grad()
def test_model_step_collapses_in_the_products():
    """compile_step of a 2-layer model (sliding, then CSA) with the default passes and this one:
    the first layer's hc_pre and the three hc_post_pre after it fuse with the projections of their
    collapse (the attention's from a select of the batch dim, the router's and the shared expert's
    from a reshape); the final hc_head's product is cuBLAS's (a tiny K), so it stays. The logits
    are the eager backend's, bit for bit."""
    backend, ids, step = prefill(["sliding_attention", "compressed_sparse_attention"])
    want = backend(ids, step, torch.arange(6)).float()
    fuse = FuseCollapseLinearsPass(("cpu",))
    with fresh_compile_state():
        passes = DSV4PassManager([*default_passes(("cpu",)), fuse])
        got = compile_step(backend, passes=passes, options=EXACT_NUMERICS)(ids, step, torch.arange(6)).float()
    assert fuse.matched_count == 4
    hc_ops = [op for op in fuse.last_ops if ".hc_" in op]
    assert hc_ops == ["dsv4.hc_pre_linears.default", *["dsv4.hc_post_pre_linears.default"] * 3,
                      "dsv4.hc_post.default", "dsv4.hc_head.default"]
    assert torch.equal(got, want)
