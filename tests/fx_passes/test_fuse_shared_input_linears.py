"""FuseSharedInputLinearsPass: the bf16 matmuls of one activation by graph-input weights become one
``dsv4::linears`` node, with the same results.

Functions taking their weights as arguments (placeholders, as Inductor's graph holds parameters)
are traced with ``make_fx`` and the pass applied to their graph directly; a whole model step is
compiled with Inductor. On the CPU the op is the same ``torch.mm`` calls, so results are bit for
bit those of the unfused graph; the pass is told to match CPU tensors (by default it matches CUDA
ones only, where the op is one launch)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dsv4_compile import DSV4AttnConfig
from dsv4_compile.compile import compile_step
from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.fx_passes import (DSV4PassManager, FuseGroupedLinearPass, FuseSharedInputLinearsPass,
                                    FuseSinkhornPass, FuseStepMetadataPass)
from dsv4_compile.step import ForwardMode
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.compile_checks import dynamo_graph, fresh_compile_state
from tests.support.hf_model import prefill

FUSED = "dsv4.linears.default"
bf16 = dict(dtype=torch.bfloat16)


def _rewrite(fn, *args, devices=("cpu",)):
    """``fn`` traced at ``args`` and rewritten: (matches, the graph's dsv4 ops, fused nodes' weight
    counts, outputs before and after)."""
    gm = make_fx(fn, tracing_mode="fake")(*args)
    fuse = FuseSharedInputLinearsPass(devices)
    fuse(gm.graph)
    gm.recompile()
    counts = [len(n.args[1]) for n in gm.graph.find_nodes(op="call_function", target=torch.ops.dsv4.linears.default)]
    return fuse.matched_count, fuse.last_ops, counts, fn(*args), gm(*args)


def _weights(*rows, k=64, dtype=torch.bfloat16):
    return [torch.randn(n, k, dtype=dtype) for n in rows]


def test_projections_of_one_input_fused():
    """Three products of ``h`` (one cast to fp32 after, as the compressor's are) become one node;
    the product of another input stays a matmul."""
    def fn(x, w1, w2, w3, v, other):
        h = x * 2
        return h @ w1.T, (h @ w2.T).float(), torch.nn.functional.linear(h, w3), other @ v.T

    x, other = torch.randn(5, 64, **bf16), torch.randn(5, 64, **bf16)
    matches, ops, counts, want, got = _rewrite(fn, x, *_weights(32, 16, 8, 24), other)
    assert (matches, ops, counts) == (1, [FUSED], [3])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_more_weights_than_a_launch_holds():
    """Ten products of one input: one node (the op splits it into launches of 8 on CUDA)."""
    ws = _weights(*range(8, 18))
    matches, _, counts, want, got = _rewrite(lambda x, *w: [x @ wi.T for wi in w], torch.randn(3, 64, **bf16), *ws)
    assert (matches, counts) == (1, [10])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("case", ["one-product", "fp32", "weight-computed", "cuda-only", "inputs-differ"])
def test_other_products_left_alone(case):
    x = torch.randn(4, 64, **bf16)
    fn, args, devices = {
        "one-product": (lambda x, w: x @ w.T, (x, *_weights(8)), ("cpu",)),
        "fp32": (lambda x, w1, w2: (x @ w1.T, x @ w2.T), (x.float(), *_weights(8, 8, dtype=torch.float32)), ("cpu",)),
        "weight-computed": (lambda x, w1, w2: (x @ (2 * w1).T, x @ (2 * w2).T), (x, *_weights(8, 8)), ("cpu",)),
        "cuda-only": (lambda x, w1, w2: (x @ w1.T, x @ w2.T), (x, *_weights(8, 8)), ("cuda",)),
        "inputs-differ": (lambda x, w1, w2: (x @ w1.T, (x + 1) @ w2.T), (x, *_weights(8, 8)), ("cpu",)),
    }[case]
    matches, ops, _, want, got = _rewrite(fn, *args, devices=devices)
    assert (matches, ops) == (0, [])
    assert all(torch.equal(g, w) for g, w in zip(got, want)) if isinstance(want, tuple) else torch.equal(got, want)


def test_lone_product_of_a_deep_k():
    """A product with no other of its input becomes a node of its own from K = lone_min_k (the
    attention's o_b_proj, the lm_head), and not below it or with lone products switched off."""
    x, w = torch.randn(2, 4096, **bf16), torch.randn(8, 4096, **bf16)
    matches, ops, counts, want, got = _rewrite(lambda x, w: x @ w.T, x, w)
    assert (matches, ops, counts) == (1, [FUSED], [1]) and torch.equal(got, want)
    gm = make_fx(lambda x, w: x @ w.T, tracing_mode="fake")(x, w)
    for fuse in (FuseSharedInputLinearsPass(("cpu",), lone_min_k=None), FuseSharedInputLinearsPass(("cpu",), 8192)):
        fuse(gm.graph)
        assert (fuse.matched_count, fuse.last_ops) == (0, [])


def test_a_product_with_its_sum_fused():
    """``addmm(r, x, wᵀ)`` (Inductor's pattern for a residual added to a product) is a product
    followed by ``r + product``: lone from K = lone_min_k, or with the other products of its
    input; its result is eager's ``r + x @ wᵀ`` bit for bit (the product rounded, then the sum).
    With a ``beta`` it is left alone."""
    x, r = torch.randn(2, 4096, **bf16), torch.randn(2, 8, **bf16)
    w, v = torch.randn(8, 4096, **bf16), torch.randn(16, 4096, **bf16)
    matches, ops, counts, _, got = _rewrite(lambda x, w, r: torch.addmm(r, x, w.T), x, w, r)
    assert (matches, ops, counts) == (1, [FUSED], [1]) and torch.equal(got, r + x @ w.T)
    matches, ops, counts, _, got = _rewrite(lambda x, w, v, r: (torch.addmm(r, x, w.T), x @ v.T), x, w, v, r)
    assert (matches, ops, counts) == (1, [FUSED], [2])
    assert torch.equal(got[0], r + x @ w.T) and torch.equal(got[1], x @ v.T)
    matches, ops, _, want, got = _rewrite(lambda x, w, r: torch.addmm(r, x, w.T, beta=0.5), x, w, r)
    assert (matches, ops) == (0, []) and torch.equal(got, want)


def test_a_product_with_a_bias_left_alone():
    """``F.linear(x, w, bias)`` (an ``addmm`` whose ``b`` is one row, broadcast): eager adds the
    bias inside its one rounding, the fused product plus the bias would round twice; so its
    products are not fused, and the results stay eager's."""
    x, w, v = torch.randn(8, 256, **bf16), *_weights(64, 32, k=256)
    b, c = torch.randn(64, **bf16) * 10, torch.randn(32, **bf16) * 10
    linear = torch.nn.functional.linear
    matches, ops, _, want, got = _rewrite(lambda x, w, b, v, c: (linear(x, w, b), linear(x, v, c)), x, w, b, v, c)
    assert (matches, ops) == (0, [])
    assert all(torch.equal(g, e) for g, e in zip(got, want))


def test_a_residual_computed_after_the_first_product():
    """A group whose ``addmm`` adds a residual computed from the group's first product: each
    product's output is taken where the product was, after what it reads."""
    x, w, v = torch.randn(4, 64, **bf16), *_weights(32, 32)

    def fn(x, w, v):
        r = (x @ w.T) * 2
        return torch.addmm(r, x, v.T)

    matches, ops, counts, _, got = _rewrite(fn, x, w, v)
    assert (matches, ops, counts) == (1, [FUSED], [2])
    assert torch.equal(got, (x @ w.T) * 2 + x @ v.T)


class _CountingAddmm(FuseSharedInputLinearsPass):
    """The pass, counting the graph's ``addmm`` nodes before and after it runs."""

    def apply(self, graph):
        self.addmm = [len(graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default))]
        matches = super().apply(graph)
        self.addmm.append(len(graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)))
        return matches


class _CountingNorms(FuseSharedInputLinearsPass):
    """The pass, recording ``(weights, eps)`` of each ``linears`` node of Dynamo's graph with a
    folded norm."""

    def apply_pre_grad(self, graph):
        matches = super().apply_pre_grad(graph)
        self.folded = [(n, eps) for n, eps in _linears_with_norms(graph) if eps is not None]
        return matches


@torch.no_grad()
def test_attention_stack_output_product_and_residual_fused():
    """compile_step of a 2-layer attention stack: Inductor makes each layer's ``o_b`` product and
    the residual added to it one ``addmm``; the pass (lone products from K = 1 here, the tiny
    stack's K being small) turns both into ``linears`` nodes plus a sum, and the step's output stays
    within a bf16 rounding of the stack run eagerly."""
    cfg = DSV4AttnConfig.from_name("tiny").with_(compress_ratios=(0, 4), index_topk=64)
    eng, rec = make_engine(cfg, max_requests=2, max_seq_len=512, capture_layers=False)
    row = eng.admit()
    rec.run(ForwardMode.EXTEND, {row: 20})
    step = eng.build_step(ForwardMode.DECODE, {row: 1})
    x = torch.randn(1, cfg.hidden_size, **bf16)
    want = eng.stack(x, step)  # the compiled call writes the same cache entries again
    fuse = _CountingAddmm(("cpu",), lone_min_k=1)
    with fresh_compile_state():
        got = compile_step(eng.stack, passes=DSV4PassManager([FuseStepMetadataPass(), fuse]))(x, step)
    assert fuse.addmm == [2, 0]
    torch.testing.assert_close(got.float(), want.float(), atol=2 ** -7 * want.float().abs().max().item(), rtol=0)


def _projections(x, w1, w2, w3, w_lone, b):
    """Three bias-free products of ``x`` (one as ``nn.Linear`` calls it, ``bias=None``), a lone one
    of ``x * 2``, one with a bias."""
    y = torch.nn.functional.linear
    return y(x, w1) + 1, y(x, w2, None), y(x, w3).sum(), y(x * 2, w_lone), y(x, w1, b)


@torch.no_grad()
def test_projections_of_one_input_fused_in_dynamos_graph():
    """The pre-grad stage on Dynamo's graph: the bias-free ``F.linear`` calls of one x by graph
    inputs become one ``linears`` call before AOTAutograd traces them (same bits on the CPU); a
    lone product and a product with a bias are left to the post-grad stage."""
    x = torch.randn(3, 64, **bf16)
    args = (x, *_weights(8, 16, 5), *_weights(4), torch.randn(8, **bf16))
    gm, inputs = dynamo_graph(_projections, *args)
    fuse = FuseSharedInputLinearsPass(("cpu",))
    assert fuse.apply_pre_grad(gm.graph) == 1
    gm.recompile()
    fused = gm.graph.find_nodes(op="call_function", target=torch.ops.dsv4.linears.default)
    assert [len(n.args[1]) for n in fused] == [3]
    assert len(gm.graph.find_nodes(op="call_function", target=torch._C._nn.linear)) == 2
    for got, want in zip(gm(*inputs), _projections(*args), strict=True):
        assert torch.equal(got, want)
    assert FuseSharedInputLinearsPass().apply_pre_grad(dynamo_graph(_projections, *args)[0].graph) == 0  # CUDA only


def _normed_projections(x, w1, w2, w_lone, norm, norm2):
    """Products of RMS-normed inputs: two of one weighted norm, a lone one of another, one of a
    norm that something else reads too, two of an unweighted norm."""
    rms_norm, y = torch.ops.dsv4.rms_norm, torch.nn.functional.linear
    h = rms_norm(x, norm, 1e-6)
    shared = rms_norm(x + 1, norm, 1e-6)
    unweighted = rms_norm(x - 1, None, 1e-6)
    return (y(h, w1), y(h, w2), y(rms_norm(x * 2, norm2, 1e-5), w_lone), y(shared, w1), shared.sum(),
            y(unweighted, w1), y(unweighted, w2))


def _linears_with_norms(graph: torch.fx.Graph) -> list[tuple[int, float | None]]:
    """``(weights, eps or None)`` of each ``linears`` node: the eps of a folded norm."""
    nodes = graph.find_nodes(op="call_function", target=torch.ops.dsv4.linears.default)
    return [(len(n.args[1]), n.args[3] if len(n.args) > 2 else None) for n in nodes]


@torch.no_grad()
@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.bfloat16])
def test_input_norm_folds_into_its_products_in_dynamos_graph(norm_dtype):
    """A weighted ``dsv4::rms_norm`` read only by products folds into their ``linears`` call,
    a lone product's too (its launch is then saved whatever K); a norm read by anything else, or
    unweighted, stays a node of its own. Same bits on the CPU (the op's reference is the norm, then
    ``torch.mm``). Without ``fold_input_norm`` (the default) every norm stays."""
    x = torch.randn(3, 64, **bf16) * 5
    args = (x, *_weights(8, 16, 4), (torch.rand(64) + 0.5).to(norm_dtype), (torch.rand(64) + 0.5).to(norm_dtype))
    norms = (torch.ops.dsv4.rms_norm, torch.ops.dsv4.rms_norm.default)
    for fold, want_linears, want_norms in ((True, [(2, 1e-6), (1, 1e-5), (2, None)], 2),
                                           (False, [(2, None), (2, None)], 4)):
        gm, inputs = dynamo_graph(_normed_projections, *args)
        fuse = FuseSharedInputLinearsPass(("cpu",), fold_input_norm=fold)
        assert fuse.apply_pre_grad(gm.graph) == len(want_linears)
        gm.recompile()
        assert _linears_with_norms(gm.graph) == want_linears
        assert sum(len(gm.graph.find_nodes(op="call_function", target=t)) for t in norms) == want_norms
        for got, want in zip(gm(*inputs), _normed_projections(*args), strict=True):
            assert torch.equal(got, want)


def test_uuid_follows_the_devices_lone_min_k_and_the_norm_fold():
    uuids = {FuseSharedInputLinearsPass(("cpu",)).uuid(), FuseSharedInputLinearsPass().uuid(),
             FuseSharedInputLinearsPass(lone_min_k=None).uuid(),
             FuseSharedInputLinearsPass(fold_input_norm=True).uuid()}
    assert FuseSharedInputLinearsPass().fold_input_norm is False
    assert len(uuids) == 4


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@torch.no_grad()
def test_model_step_fuses_each_layers_projections():
    """compile_step of a 2-layer model (sliding, then CSA) with the default passes and this one:
    in each layer the products of the normed hidden state (q_a, kv; on the CSA layer also the
    compressor's, the indexer's compressor and weights) and those of the post-attention norm (the
    router, the shared expert's gate and up) fuse, and on the CSA layer the two of the query latent
    (q_b and the indexer's q_b): 5 nodes. With the query latent's norm folded in, the sliding
    layer's lone q_b joins them: 6 nodes, 2 with a norm. Each layer calls its o_a_proj as one
    grouped_linear itself (2 nodes), so FuseGroupedLinearPass finds no bmm to rewrite. With Inductor
    rounding where eager rounds the logits are the eager backend's, bit for bit, either way."""
    backend, ids, step = prefill(["sliding_attention", "compressed_sparse_attention"])
    config = backend.model.config
    want = backend(ids, step, torch.arange(6)).float()
    for fold, nodes, folded in ((False, 5, []), (True, 6, [1, 2])):
        fuse, grouped = _CountingNorms(("cpu",), fold_input_norm=fold), FuseGroupedLinearPass(("cpu",))
        with fresh_compile_state():
            passes = DSV4PassManager([FuseStepMetadataPass(), FuseSinkhornPass(), fuse, grouped])
            got = compile_step(backend, passes=passes, options=EXACT_NUMERICS)(ids, step, torch.arange(6)).float()
        assert fuse.matched_count == grouped.last_ops.count(FUSED) == nodes
        assert [n for n, _ in fuse.folded] == folded and {eps for _, eps in fuse.folded} <= {config.rms_norm_eps}
        assert grouped.matched_count == 0 and grouped.last_ops.count("dsv4.grouped_linear.default") == 2
        assert torch.equal(got, want)
