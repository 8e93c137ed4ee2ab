"""FuseSinkhornPass: the Sinkhorn-Knopp loop of transformers' ``DeepseekV4HyperConnection``
becomes one ``dsv4::sinkhorn`` node, with the same results.

A real hyper-connection module is compiled with Inductor (the model step runs the mHC ops instead:
tests/model/test_hyper_connection_ops.py); the chains the pass must leave alone (row first, an eps that changes, ...) are traced with ``make_fx`` and the
pass is applied to their graph directly (the same aten ops as Inductor's post-grad graph)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from dsv4_compile.fx_passes import DSV4PassManager, FuseSinkhornPass
from tests.support.compile_checks import fresh_compile_state
from tests.support.hf_model import tiny_hf_config

FUSED = "dsv4.sinkhorn.default"
BF16_STEP = 2 ** -8  # one bf16 rounding step, relative


def _hyper_connection() -> DeepseekV4HyperConnection:
    hc = DeepseekV4HyperConnection(tiny_hf_config(num_hidden_layers=1))
    with torch.no_grad():
        for p in (hc.fn, hc.base, hc.scale):
            p.normal_(std=0.5)
    return hc


@torch.no_grad()
def test_hyper_connection_loop_fused_with_equal_results():
    hc, fuse = _hyper_connection(), FuseSinkhornPass()
    streams = torch.randn(2, 3, hc.hc_mult, 256).bfloat16()
    with fresh_compile_state():
        compiled = torch.compile(hc, fullgraph=True, options={"post_grad_custom_post_pass": DSV4PassManager([fuse])})
        post, comb, collapsed = compiled(streams)
    assert fuse.matched_count == 1
    assert fuse.last_ops == [FUSED]
    want_post, want_comb, want_collapsed = hc(streams)
    torch.testing.assert_close(post, want_post, atol=1e-6, rtol=0)
    torch.testing.assert_close(comb, want_comb, atol=1e-6, rtol=0)
    torch.testing.assert_close(collapsed, want_collapsed, atol=0, rtol=BF16_STEP)


def _loop(steps, eps=1e-6):
    """``x -> x / (x.sum(d, keepdim=True) + eps)`` for each dim d of ``steps`` in turn (``eps``: one
    value, or one per step)."""
    eps = eps if isinstance(eps, list) else [eps] * len(steps)

    def fn(x):
        for d, e in zip(steps, eps):
            x = x / (x.sum(dim=d, keepdim=True) + e)
        return x
    return fn


def _fused(fn, x):
    """``fn`` traced at ``x`` and rewritten by the pass: (matches, the graph's dsv4 ops, outputs
    before and after)."""
    gm = make_fx(fn, tracing_mode="fake")(x)
    fuse = FuseSinkhornPass()
    fuse(gm.graph)
    gm.recompile()
    return fuse.matched_count, fuse.last_ops, fn(x), gm(x)


COL, ROW = -2, -1


@pytest.mark.parametrize("steps, shape, iters", [
    ([COL], (5, 4, 4), 1),
    ([COL, ROW, COL, ROW, COL], (2, 3, 4, 4), 3),
    ([2, 3, 2], (2, 3, 4, 4), 2),  # dims counted from the front
    ([COL, ROW, COL], (4, 4), 2),
])
def test_chain_fused(steps, shape, iters):
    x = torch.rand(shape) + 0.01
    matches, ops, want, got = _fused(_loop(steps), x)
    assert (matches, ops) == (1, [FUSED])
    assert torch.equal(got, want)


def test_fused_node_arguments():
    gm = make_fx(_loop([COL, ROW, COL, ROW, COL], eps=0.5), tracing_mode="fake")(torch.rand(3, 4, 4))
    FuseSinkhornPass()(gm.graph)
    (node,) = gm.graph.find_nodes(op="call_function", target=torch.ops.dsv4.sinkhorn.default)
    assert node.args[1:] == (3, 0.5)
    assert node.meta["val"].shape == (3, 4, 4)


def test_an_intermediate_with_another_user_ends_the_chain():
    """``mid`` (after col, row, col) is also returned: the chain up to it is fused; the (row,
    column) pair after it starts with a row and stays as it is."""
    def fn(x):
        mid = _loop([COL, ROW, COL])(x)
        return mid, _loop([ROW, COL])(mid)
    x = torch.rand(3, 4, 4) + 0.01
    matches, ops, want, got = _fused(fn, x)
    assert (matches, ops) == (1, [FUSED])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("fn, shape, dtype", [
    (_loop([ROW, COL, ROW, COL]), (3, 4, 4), torch.float32),  # row first
    (_loop([COL, ROW]), (3, 4, 4), torch.float32),  # ends on a row
    (_loop([COL, COL]), (3, 4, 4), torch.float32),  # not alternating
    (_loop([COL, ROW, COL], eps=[1e-6, 1e-5, 1e-5]), (3, 4, 4), torch.float32),  # eps changes
    (_loop([COL, ROW, COL]), (3, 4, 5), torch.float32),  # not square
    (_loop([COL, ROW, COL]), (3, 4, 4), torch.float64),
    (_loop([0, 1, 0]), (4, 3, 4, 4), torch.float32),  # sums over leading dims
], ids=["row-first", "ends-on-row", "two-columns", "eps-changes", "not-square", "fp64", "leading-dims"])
def test_other_chains_left_alone(fn, shape, dtype):
    x = torch.rand(shape, dtype=dtype) + 0.01
    matches, ops, want, got = _fused(fn, x)
    assert (matches, ops) == (0, [])
    assert torch.equal(got, want)
