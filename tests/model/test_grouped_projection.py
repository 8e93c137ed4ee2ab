"""A layer's grouped ``o_a_proj``: transformers' ``DeepseekV4GroupedLinear`` with a plain weight runs
as ``dsv4::grouped_linear`` on that weight (bit for bit the module's ``bmm`` on the CPU), any other
module is called as it is."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

from dsv4_compile.model import enable
from tests.support.hf_model import tiny_hf_model


class _Doubled(DeepseekV4GroupedLinear):
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.fixture(scope="module")
def layer():
    return enable(tiny_hf_model(), max_requests=1, max_seq_len=256).attn_layers[0]


def _output(layer, rows: int) -> torch.Tensor:
    groups = layer.config.o_groups
    gen = torch.Generator().manual_seed(rows)
    return torch.randn(rows, groups, layer.attn.o_a_proj.weight.shape[1], generator=gen).bfloat16()


@pytest.mark.parametrize("rows", [1, 5])
@torch.no_grad()
def test_the_module_runs_as_the_op(layer, rows):
    o = _output(layer, rows)
    got = layer._grouped_projection(o)
    assert got.is_contiguous() and torch.equal(got, layer.attn.o_a_proj(o))
    traced = make_fx(lambda x: layer._grouped_projection(x))(o)
    targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert torch.ops.dsv4.grouped_linear.default in targets and torch.ops.aten.bmm.default not in targets


@torch.no_grad()
def test_another_module_is_called_as_it_is(layer, monkeypatch):
    own = layer.attn.o_a_proj
    doubled = _Doubled(own.in_features, own.out_features, own.n_groups).bfloat16()
    doubled.weight.copy_(own.weight)
    monkeypatch.setattr(layer.attn, "o_a_proj", doubled)
    o = _output(layer, 3)
    assert torch.equal(layer._grouped_projection(o), 2 * own(o))
