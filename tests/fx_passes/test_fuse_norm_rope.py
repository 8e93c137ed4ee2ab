"""FuseNormRopePass: a layer's RMSNorm + RoPE chains become ``dsv4::rms_norm_rope`` nodes, with the
same results.

Functions holding each matched chain (``transformers``' two DeepSeek V4 norms and the reference
norm, weighted or not, on keys ``[T, D]`` and queries ``[T, H, D]``) are compiled with Inductor and
the pass, told to match CPU tensors (by default it matches CUDA ones only, where the op is one
launch). On the CPU the op is the reference, the unfused math, so with Inductor rounding where
eager rounds the outputs equal eager ones bit for bit."""

import sys

import pytest
import torch
from torch._inductor.pattern_matcher import PatternMatcherPass
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm, DeepseekV4UnweightedRMSNorm

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.compile import compile_step
from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.fx_passes import DSV4PassManager, FuseNormRopePass, FuseSinkhornPass, FuseStepMetadataPass
from dsv4_compile.reference.functional import apply_rope, rms_norm, rope_tail
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.compile_checks import dynamo_graph, fresh_compile_state
from tests.support.hf_model import three_layer_prefill
from tests.support.oracle_asserts import assert_outputs_match

FUSED = "dsv4.rms_norm_rope.default"
EPS = 1e-5  # not the patterns' traced eps: the pattern takes the graph's


def _compiled(fn, *args, devices=("cpu",)):
    """(matches, the graph's dsv4 ops, eager outputs, compiled outputs) of ``fn`` at ``args``."""
    fuse = FuseNormRopePass(devices)
    with torch.no_grad(), fresh_compile_state():
        got = torch.compile(fn, fullgraph=True, options={"post_grad_custom_post_pass": fuse, **EXACT_NUMERICS})(*args)
        want = fn(*args)
    return fuse.matched_count, fuse.last_ops, want, got


def _inputs(heads: int | None, dim: int = 256):
    gen = torch.Generator().manual_seed(heads or 0)
    shape = (5, dim) if heads is None else (5, heads, dim)
    return (torch.randn(shape, generator=gen).bfloat16(), torch.arange(5) * 37 + 11,
            10000.0 ** (-torch.arange(0, 64, 2).float() / 64))


def _at_tokens(positions, x):
    return positions if x.dim() == 2 else positions.unsqueeze(1)


HF_WEIGHTED = DeepseekV4RMSNorm(256, eps=EPS)
with torch.no_grad():
    HF_WEIGHTED.weight.copy_(torch.rand(256, generator=torch.Generator().manual_seed(3)) + 0.5)
HF_WEIGHTED.requires_grad_(False)
NORMS = {
    "transformers weighted": HF_WEIGHTED,
    "transformers unweighted": DeepseekV4UnweightedRMSNorm(eps=EPS),
    "reference weighted": lambda x: rms_norm(x, HF_WEIGHTED.weight, EPS),
    "reference weighted bf16": lambda x: rms_norm(x, HF_WEIGHTED.weight.bfloat16(), EPS),
    "reference unweighted": lambda x: rms_norm(x, None, EPS),
}


@pytest.mark.parametrize("heads", [None, 4])
@pytest.mark.parametrize("norm", list(NORMS))
def test_norm_then_rope_fused(norm, heads):
    """Each norm, then RoPE on the last 64 dims at the tokens' positions: one op node."""
    x, positions, inv_freq = _inputs(heads)
    fn = NORMS[norm]
    matches, ops, want, got = _compiled(lambda x, p, f: rope_tail(fn(x), _at_tokens(p, x), f), x, positions, inv_freq)
    assert (matches, ops) == (1, [FUSED])
    assert torch.equal(got, want)


def test_query_and_key_of_one_layer():
    """A layer's query (per head, unweighted) and key (weighted) chains, at the same positions: two nodes."""
    q, positions, inv_freq = _inputs(4)
    k, _, _ = _inputs(None)
    q_norm = NORMS["transformers unweighted"]

    def fn(q, k, p, f):
        return rope_tail(q_norm(q), p.unsqueeze(1), f), rope_tail(HF_WEIGHTED(k), p, f)

    matches, ops, want, got = _compiled(fn, q, k, positions, inv_freq)
    assert (matches, ops) == (2, [FUSED, FUSED])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("case", ["rope-elsewhere", "norm-over-heads", "no-norm", "fp32", "cuda-only"])
def test_other_chains_left_alone(case):
    """RoPE on other dims than the last 64, a norm over another dim, RoPE without a norm, fp32 rows,
    and a pass that matches CUDA tensors only: nothing replaced (Inductor may still reorder fp32 math)."""
    x, positions, inv_freq = _inputs(4)
    norm = NORMS["transformers unweighted"]
    fn, devices = {
        "rope-elsewhere": (lambda x, p, f: torch.cat([apply_rope(norm(x)[..., :64], p[:, None], f),
                                                      norm(x)[..., 64:]], -1), ("cpu",)),
        "norm-over-heads": (lambda x, p, f: rope_tail(norm(x.transpose(1, 2)).transpose(1, 2), p[:, None], f),
                            ("cpu",)),
        "no-norm": (lambda x, p, f: rope_tail(x, p[:, None], f), ("cpu",)),
        "fp32": (lambda x, p, f: rope_tail(norm(x.float()), p[:, None], f), ("cpu",)),
        "cuda-only": (lambda x, p, f: rope_tail(norm(x), p[:, None], f), ("cuda",)),
    }[case]
    matches, ops, want, got = _compiled(fn, x, positions, inv_freq, devices=devices)
    assert (matches, ops) == (0, [])
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("case", ["one-position", "rope-on-48-dims"])
def test_chains_the_fused_op_refuses_left_alone(case):
    """A key's chain at one position broadcast over its tokens, or with RoPE on 48 dims (24
    frequencies, not a power of two): valid in eager, refused by ``rms_norm_rope``'s check, so left
    as they are (before, matched and then failing the compile)."""
    x, positions, inv_freq = _inputs(None)
    if case == "one-position":
        positions = positions[:1].clone()
    else:
        inv_freq = 10000.0 ** (-torch.arange(0, 48, 2).float() / 48)
    norm = NORMS["reference weighted"]
    matches, ops, want, got = _compiled(lambda x, p, f: rope_tail(norm(x), p, f), x, positions, inv_freq)
    assert (matches, ops) == (0, [])
    torch.testing.assert_close(got, want)


def test_uuid_follows_the_devices():
    assert FuseNormRopePass(("cpu",)).uuid() != FuseNormRopePass().uuid()


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@torch.no_grad()
def test_model_step_fuses_each_layers_query_and_key():
    """compile_step of a 3-layer model (sliding, CSA, HCA) with this pass: each layer's query and
    key chains fuse (6 nodes), and the logits are the eager backend's, bit for bit."""
    backend, ids, step = three_layer_prefill()
    fuse = FuseNormRopePass(("cpu",))
    want = backend(ids, step, torch.arange(6)).float()
    with fresh_compile_state():
        passes = DSV4PassManager([FuseStepMetadataPass(), FuseSinkhornPass(), fuse])
        got = compile_step(backend, passes=passes, options=EXACT_NUMERICS)(ids, step, torch.arange(6)).float()
    assert fuse.matched_count == fuse.last_ops.count(FUSED) == 6
    assert torch.equal(got, want)


def test_a_repeated_chain_is_traced_once(monkeypatch):
    """Three keys of one shape through the same chain: three replacements, but the matcher's
    re-trace of the chain (and of its replacement) at their shapes happens once each."""
    from dsv4_compile.fx_passes import fuse_norm_rope

    traced = []
    real = fuse_norm_rope.fwd_only
    monkeypatch.setattr(fuse_norm_rope, "fwd_only", lambda fn, *a, **kw: traced.append(fn) or real(fn, *a, **kw))
    fuse_norm_rope._patterns(("cpu",), True)  # the patterns' own traces, before counting
    traced.clear()
    keys = [_inputs(None)[0] + i for i in range(3)]
    _, positions, inv_freq = _inputs(None)

    def fn(k0, k1, k2, p, f):
        return [rope_tail(HF_WEIGHTED(k), p, f) for k in (k0, k1, k2)]

    matches, ops, want, got = _compiled(fn, *keys, positions, inv_freq)
    assert (matches, ops) == (3, [FUSED] * 3)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert len(traced) == 2  # the search chain and its replacement, once each


def test_transformers_norms_matched_only_once_imported(monkeypatch):
    """With transformers' DeepSeek V4 code not imported, its norms are not among the patterns (a
    graph cannot hold them) and the uuid says so; a CPU graph under the CUDA default traces none."""
    from dsv4_compile.fx_passes import fuse_norm_rope

    with_hf = FuseNormRopePass().uuid()
    assert len(fuse_norm_rope._search_functions(True)) == 4
    monkeypatch.delitem(sys.modules, fuse_norm_rope._HF_MODULE)
    assert FuseNormRopePass().uuid() != with_hf
    assert len(fuse_norm_rope._search_functions(False)) == 2
    monkeypatch.setattr(fuse_norm_rope, "_patterns", lambda *a: pytest.fail("traced patterns for a CPU graph"))
    x, positions, inv_freq = _inputs(4)
    matches, ops, want, got = _compiled(lambda x, p, f: rope_tail(rms_norm(x, None, EPS), p[:, None], f), x, positions,
                                        inv_freq, devices=("cuda",))
    assert (matches, ops) == (0, [])
    torch.testing.assert_close(got, want)


OPS = torch.ops.dsv4
# chains of the package's op calls, at (x, weight, positions, inv_freq): -> matches in Dynamo's graph
OP_CHAINS = {
    "query": (lambda x, w, p, f: OPS.rope_tail(OPS.rms_norm(x, None, EPS), p.unsqueeze(1), f), 4, 1),
    "key": (lambda x, w, p, f: OPS.rope_tail(OPS.rms_norm(x, w, EPS), p, f), None, 1),
    "key, keywords": (lambda x, w, p, f: OPS.rope_tail(x=OPS.rms_norm(x, eps=EPS, weight=w), inv_freq=f,
                                                       positions=p), None, 1),
    "norm read twice": (lambda x, w, p, f: (OPS.rope_tail(n := OPS.rms_norm(x, w, EPS), p, f), n), None, 0),
    "inverse": (lambda x, w, p, f: OPS.rope_tail(OPS.rms_norm(x, w, EPS), p, f, True), None, 0),
    "fp32": (lambda x, w, p, f: OPS.rope_tail(OPS.rms_norm(x.float(), w, EPS), p, f), None, 0),
    "query, positions[:, None]": (lambda x, w, p, f: OPS.rope_tail(OPS.rms_norm(x, None, EPS), p[:, None], f), 4, 0),
}


@pytest.mark.parametrize("chain", list(OP_CHAINS))
def test_op_calls_fused_in_dynamos_graph(chain):
    """The pre-grad stage on Dynamo's graph: ``rope_tail(rms_norm(...))`` calls of a query or key
    become one ``rms_norm_rope`` call, which computes the same bits; a norm read elsewhere, an
    inverse rotation, fp32 rows, positions broadcast otherwise than by ``unsqueeze(1)`` (left to
    the post-grad patterns) stay."""
    fn, heads, want_matches = OP_CHAINS[chain]
    x, positions, inv_freq = _inputs(heads)
    args = (x, HF_WEIGHTED.weight, positions, inv_freq)
    gm, inputs = dynamo_graph(fn, *args)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert FuseNormRopePass(("cpu",)).apply_pre_grad(gm.graph) == want_matches
    gm.recompile()
    ops = [str(n.target) for n in gm.graph.nodes if str(n.target).startswith("dsv4.")]
    if want_matches:
        assert ops == ["dsv4.rms_norm_rope.default"]
        assert len(gm.graph.find_nodes(op="call_method", target="unsqueeze")) == 0
    else:
        assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == calls
    got, want = gm(*inputs), fn(*args)
    assert all(torch.equal(g, w) for g, w in zip(torch.utils._pytree.tree_leaves(got),
                                                  torch.utils._pytree.tree_leaves(want), strict=True))


def test_op_calls_on_other_devices_stay():
    fn, heads, _ = OP_CHAINS["query"]
    x, positions, inv_freq = _inputs(heads)
    gm, _ = dynamo_graph(fn, x, HF_WEIGHTED.weight, positions, inv_freq)
    assert FuseNormRopePass().apply_pre_grad(gm.graph) == 0  # CUDA only, CPU tensors


@torch.no_grad()
def test_stack_step_chains_fused_before_autograd(monkeypatch):
    """compile_step installs the pre-grad stage: a 2-layer stack's query and key chains (two a
    layer) fuse in Dynamo's graph, with no post-grad pattern to find them, and the compiled
    decode step matches the oracle."""
    from dsv4_compile.fx_passes import fuse_norm_rope

    monkeypatch.setattr(fuse_norm_rope, "_patterns", lambda *a: PatternMatcherPass())
    config = DSV4AttnConfig.from_name("tiny").with_(index_topk=64, compress_ratios=(0, 128))
    eng, rec = make_engine(config, max_requests=2, max_seq_len=512, capture_layers=False)
    row = eng.admit()
    fuse = FuseNormRopePass(("cpu",))
    with fresh_compile_state():
        rec.run(ForwardMode.EXTEND, {row: 40})
        eng.forward = compile_step(eng.stack, passes=DSV4PassManager([fuse]), options=EXACT_NUMERICS)
        assert_outputs_match(rec, rec.run(ForwardMode.DECODE, {row: 1}))
    assert fuse.matched_count == fuse.last_ops.count(FUSED) == 4
