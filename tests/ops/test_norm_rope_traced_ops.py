"""``dsv4::rms_norm`` and ``dsv4::rope_tail``: the reference norm and RoPE as one traced op each,
which Inductor decomposes back into that math (but for an inverse RoPE on CUDA, which runs its
kernel). Eager and compiled results equal the reference functions' bit for bit; a Dynamo graph
holds one node per call; Inductor's CPU graph none of them."""

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.ops._library import HAS_TRITON
from dsv4_compile.fx_passes import DSV4PassManager
from dsv4_compile.reference import functional
from tests.support.compile_checks import GraphCapture, fresh_compile_state

ops = torch.ops.dsv4
EPS = 1e-6


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 96, generator=gen).bfloat16()
    weight = torch.rand(96, generator=gen) + 0.5
    return x, weight, (torch.arange(5) * 37 + 11)[:, None], torch.rand(16, generator=gen)


def _with_ops(x, weight, positions, inv_freq):
    return ops.rope_tail(ops.rms_norm(x, weight, EPS), positions, inv_freq), ops.rope_tail(x, positions, inv_freq, True)


def _with_functions(x, weight, positions, inv_freq):
    return (functional.rope_tail(functional.rms_norm(x, weight, EPS), positions, inv_freq),
            functional.rope_tail(x, positions, inv_freq, True))


def _equal(got, want) -> bool:
    return all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_eager_calls_are_the_reference():
    assert _equal(_with_ops(*_inputs()), _with_functions(*_inputs()))


def test_dynamo_records_one_node_per_call():
    capture = GraphCapture("eager")
    with fresh_compile_state():
        got = torch.compile(_with_ops, backend=capture, fullgraph=True)(*_inputs())
    assert capture.dsv4_ops() == ["dsv4.rms_norm", "dsv4.rope_tail", "dsv4.rope_tail"]
    assert _equal(got, _with_functions(*_inputs()))


def test_inductor_compiles_the_reference_math():
    """The post-grad graph (what the FX passes and Inductor see) holds aten ops, no dsv4 op."""
    passes = DSV4PassManager([])
    with torch.no_grad(), fresh_compile_state():
        got = torch.compile(_with_ops, fullgraph=True, options={"post_grad_custom_post_pass": passes,
                                                                **EXACT_NUMERICS})(*_inputs())
    assert passes.last_ops == []
    assert _equal(got, _with_functions(*_inputs()))


@pytest.mark.skipif(not HAS_TRITON, reason="no CUDA kernel without Triton")
def test_inverse_rope_on_cuda_stays_one_node():
    """Inductor's decompositions, traced on fake tensors: on CUDA an inverse ``rope_tail`` stays one
    node (it runs the op's kernel); on the CPU it becomes the reference's aten ops."""
    def inverse(x, positions, inv_freq):
        return ops.rope_tail(x, positions, inv_freq, True)

    targets = {}
    for device in ("cuda", "cpu"):
        with FakeTensorMode():
            x, _, positions, inv_freq = (torch.empty(t.shape, dtype=t.dtype, device=device) for t in _inputs())
            gm = make_fx(inverse, decomposition_table=select_decomp_table())(x, positions, inv_freq)
        targets[device] = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets["cuda"] == [ops.rope_tail.default]
    assert ops.rope_tail.default not in targets["cpu"] and torch.ops.aten.cos.default in targets["cpu"]


@pytest.mark.parametrize("case", ["positions", "inv_freq", "weight"])
def test_bad_argument_is_named(case):
    x, weight, positions, inv_freq = _inputs()
    with pytest.raises((TypeError, ValueError), match=rf"^dsv4\.\w+: .*\b{case}\b"):
        if case == "positions":
            ops.rope_tail(x, positions.float(), inv_freq)
        elif case == "inv_freq":
            ops.rope_tail(x, positions, torch.rand(64))
        else:
            ops.rms_norm(x, weight[:10], EPS)
