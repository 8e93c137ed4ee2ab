"""FuseAttentionInverseRopePass: the attention output's inverse RoPE, which the grouped ``o_a_proj``
(``dsv4::grouped_linear`` with positions) applies before its product, moves into the attention
(``dsv4::sparse_attn_inverse_rope``) in Dynamo's graph, and the product runs without positions.

Functions holding the chain are compiled with Inductor, the pass told to match CPU tensors (by
default it matches CUDA ones only, where the rotation then runs inside the attention's split
combine). On the CPU both ops are the reference, so the result equals eager's bit for bit."""

import pytest
import torch

from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.fx_passes import DSV4PassManager, FuseAttentionInverseRopePass
from dsv4_compile.testing.attn_inputs import make_attn_inputs
from tests.support.compile_checks import fresh_compile_state
from tests.support.hf_model import eager_and_compiled_prefill

FUSED = "dsv4.sparse_attn_inverse_rope.default"
UNFUSED = ["dsv4.sparse_attn.default", "dsv4.grouped_linear.default"]
HEADS, GROUPS = 4, 2


def _inputs():
    """(the attention's 11 op arguments, positions [T], inv_freq [32], o_a weight [G N, H 512 / G])."""
    inp = make_attn_inputs(3, HEADS, extra="c4", swa_width=64, extra_width=64, holes=0.2, seed=1)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, 1 << 16, (3,), generator=gen)
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2).float() / 64)
    w = torch.randn(GROUPS * 16, HEADS * 512 // GROUPS, generator=gen).bfloat16()
    return inp.op_args(), positions, inv_freq, w


def _run(fn, devices=("cpu",)):
    """(matches, the graph's dsv4 ops, eager result, compiled result) of ``fn(attn_args, positions,
    inv_freq, w)`` compiled with the pass in the pre-grad stage."""
    fuse = FuseAttentionInverseRopePass(devices)
    passes = DSV4PassManager([fuse])
    options = {"post_grad_custom_post_pass": passes, "pre_grad_custom_pass": passes.pre_grad_stage(),
               **EXACT_NUMERICS}
    args = _inputs()
    with torch.no_grad(), fresh_compile_state():
        got = torch.compile(fn, fullgraph=True, options=options)(*args)
        want = fn(*args)
    return fuse.matched_count, passes.last_ops, want, got


def _projected(attn_args, positions, inv_freq, w):
    out, _ = torch.ops.dsv4.sparse_attn(*attn_args)
    x = out.reshape(out.shape[0], GROUPS, HEADS * 512 // GROUPS)
    return torch.ops.dsv4.grouped_linear(x, w, positions, inv_freq, 512)


def test_rotation_moves_into_the_attention():
    matches, ops, want, got = _run(_projected)
    assert (matches, ops) == (1, [FUSED, "dsv4.grouped_linear.default"])
    assert want.abs().sum() > 0 and torch.equal(got, want)


@pytest.mark.parametrize("case", ["output-read-again", "no-rotation", "short-table", "cuda-only"])
def test_other_chains_left_alone(case):
    """The attention output read by something else too, a product without positions (nothing to
    move), a rotation of 16 frequencies (``grouped_linear`` takes it, the attention's rotation
    takes 32) and a pass that matches CUDA tensors only: the ops stay as they are."""
    def fn(attn_args, positions, inv_freq, w):
        if case == "short-table":
            inv_freq = inv_freq[:16].clone()  # before the attention, as a table the pass could move
        out, _ = torch.ops.dsv4.sparse_attn(*attn_args)
        x = out.reshape(out.shape[0], GROUPS, HEADS * 512 // GROUPS)
        rotation = (None, None) if case == "no-rotation" else (positions, inv_freq)
        y = torch.ops.dsv4.grouped_linear(x, w, *rotation, 512)
        return (y, out.float().sum()) if case == "output-read-again" else y

    matches, ops, want, got = _run(fn, devices=("cuda",) if case == "cuda-only" else ("cpu",))
    assert matches == 0 and ops == UNFUSED
    got, want = (t if isinstance(t, tuple) else (t,) for t in (got, want))
    assert all(torch.equal(g, e) for g, e in zip(got, want))


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@torch.no_grad()
def test_model_step_rotates_in_each_attention():
    """compile_step of a 3-layer model (sliding, CSA, HCA) with the pass: each layer's attention
    takes its output projection's inverse RoPE (3 nodes, no sparse_attn left), and the logits and
    every cache buffer equal the eager backend's, bit for bit."""
    fuse = FuseAttentionInverseRopePass(("cpu",))
    (want, written), (got, caches) = eager_and_compiled_prefill(DSV4PassManager([fuse]), tokens=9)
    assert fuse.matched_count == fuse.last_ops.count(FUSED) == 3
    assert "dsv4.sparse_attn.default" not in fuse.last_ops
    assert torch.equal(got, want)
    assert all(torch.equal(t, w) for t, w in zip(caches, written))
