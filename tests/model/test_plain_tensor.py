"""``is_plain_tensor`` gives the same answer eager and inside a compiled function, for every way a
module holds a tensor; and a learned router whose correction bias transformers made an
``nn.Buffer`` runs as ``dsv4::router_topk`` in a compiled MoE block."""

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

from dsv4_compile import hf_experts
from dsv4_compile.plain_tensor import is_plain_tensor
from tests.ops.test_routed_experts import _moe_block


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.parameter = nn.Parameter(torch.zeros(3))
        self.assigned_buffer = nn.Buffer(torch.zeros(3))  # how transformers' routers hold theirs
        self.register_buffer("registered_buffer", torch.zeros(3))
        self.subclass = nn.Parameter(TwoTensor(torch.zeros(3), torch.zeros(3)), requires_grad=False)
        self.plain = torch.zeros(3)


@pytest.mark.parametrize("name, plain", [("parameter", True), ("assigned_buffer", True),
                                         ("registered_buffer", True), ("plain", True), ("subclass", False)])
def test_is_plain_tensor_eager_and_compiled(name, plain):
    holder = _Holder()
    answers = lambda x: (x + 1, is_plain_tensor(getattr(holder, name)))  # noqa: E731
    assert answers(torch.ones(1))[1] is plain
    assert torch.compile(answers, backend="eager", fullgraph=True)(torch.ones(1))[1] is plain


@torch.no_grad()
def test_compiled_learned_router_with_a_buffer_bias_runs_the_op(monkeypatch):
    """The learned block with its bias held as transformers holds it: ``dsv4::router_topk`` in the
    traced graph (not ``aten.topk``), and the eager composition's values."""
    monkeypatch.setattr(hf_experts, "LEARNED_ROUTER_OP", True)
    block = _moe_block(1)
    block.gate.e_score_correction_bias = nn.Buffer(block.gate.e_score_correction_bias)
    x = torch.randn(1, 3, 256).bfloat16()
    ids = torch.randint(0, block.experts.config.vocab_size, (1, 3))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x, i: hf_experts.moe_block_composed(block, x, i), backend=capture, fullgraph=True)
    got = compiled(x, ids)
    targets = {node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert torch.ops.dsv4.router_topk in targets and torch.topk not in targets
    torch.testing.assert_close(got, hf_experts.moe_block_composed(block, x, ids), atol=0, rtol=0)
