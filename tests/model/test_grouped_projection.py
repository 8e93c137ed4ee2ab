"""A layer's inverse RoPE and grouped ``o_a_proj``: transformers' ``DeepseekV4GroupedLinear`` with a
plain weight runs as one ``dsv4::grouped_linear`` on that weight with the rotation inside (bit for bit
``dsv4::rope_tail`` then the module's ``bmm`` on the CPU), any other module is called as it is after
``dsv4::rope_tail``."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

from dsv4_compile.config import HEAD_DIM
from dsv4_compile.model import enable
from tests.support.hf_model import tiny_hf_model

ops = torch.ops.dsv4


class _Doubled(DeepseekV4GroupedLinear):
    def forward(self, x):
        return 2 * super().forward(x)


@pytest.fixture(scope="module")
def layer():
    return enable(tiny_hf_model(), max_requests=1, max_seq_len=256).attn_layers[0]


def _output(layer, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention output ``[rows, H, 512]`` and its rows' positions."""
    gen = torch.Generator().manual_seed(rows)
    o = torch.randn(rows, layer.config.num_heads, HEAD_DIM, generator=gen).bfloat16()
    return o, torch.randint(0, 10_000, (rows,), generator=gen)


def _unroped(layer, o, positions) -> torch.Tensor:
    """``o`` rotated back and grouped ``[T, G, K]``, as the module takes it."""
    o = ops.rope_tail(o, positions.unsqueeze(1), layer.inv_freq, inverse=True)
    return o.reshape(o.shape[0], layer.config.o_groups, -1)


@pytest.mark.parametrize("rows", [1, 5])
@torch.no_grad()
def test_the_module_runs_as_the_op(layer, rows):
    o, positions = _output(layer, rows)
    got = layer._grouped_projection(o, positions)
    want = layer.attn.o_a_proj(_unroped(layer, o, positions))
    assert got.is_contiguous() and torch.equal(got, want)
    assert not torch.equal(got, layer.attn.o_a_proj(o.reshape(want.shape[0], want.shape[1], -1)))
    traced = make_fx(lambda x, p: layer._grouped_projection(x, p))(o, positions)
    targets = {n.target for n in traced.graph.nodes if n.op == "call_function"}
    assert torch.ops.dsv4.grouped_linear.default in targets
    assert not targets & {torch.ops.aten.bmm.default, torch.ops.dsv4.rope_tail.default}


@torch.no_grad()
def test_another_module_is_called_as_it_is(layer, monkeypatch):
    own = layer.attn.o_a_proj
    doubled = _Doubled(own.in_features, own.out_features, own.n_groups).bfloat16()
    doubled.weight.copy_(own.weight)
    monkeypatch.setattr(layer.attn, "o_a_proj", doubled)
    o, positions = _output(layer, 3)
    assert torch.equal(layer._grouped_projection(o, positions), 2 * own(_unroped(layer, o, positions)))
