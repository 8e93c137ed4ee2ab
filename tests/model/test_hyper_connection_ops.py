"""The mHC ops (``ops/hyper_connection.py``) against transformers' own hyper-connection code, and
in the model step.

CPU: each op's reference is bit for bit what transformers computes — ``DeepseekV4HyperConnection``,
``DeepseekV4HyperHead`` and a whole ``DeepseekV4DecoderLayer`` (its attention and MoE replaced by
stand-ins, so that only the hyper-connections and norms are compared); the model step runs the ops
(``hc_pre`` before the first block, ``hc_post_pre`` between blocks, ``hc_post`` after the last,
``hc_head``) and compiles with no graph break,
the compiled logits equal to the eager backend's; a module whose class overrides ``forward`` is
called as it is; bad arguments are named."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (DeepseekV4DecoderLayer, DeepseekV4HyperConnection,
                                                                  DeepseekV4HyperHead, DeepseekV4RMSNorm)

from dsv4_compile import hf_hyper_connection as hyper_connection
from dsv4_compile.compile import compile_step
from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.fx_passes import DSV4PassManager, FuseStepMetadataPass
from dsv4_compile.model import enable, run_decoder
from dsv4_compile.step import ForwardMode, StepInputs
from tests.support.compile_checks import fresh_compile_state, graph_breaks
from tests.support.hf_model import tiny_hf_config, tiny_hf_model


def _randomised(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.5)
    return module


def _streams(config, *lead, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, config.hc_mult, config.hidden_size, generator=gen).to(dtype)


@pytest.mark.parametrize("hc_mult, lead, dtype", [(4, (1, 7), torch.bfloat16), (4, (2, 3), torch.float32),
                                                  (3, (2, 5), torch.bfloat16)])
@torch.no_grad()
def test_hc_pre_and_hc_head_are_the_modules(hc_mult, lead, dtype):
    config = tiny_hf_config(hc_mult=hc_mult)
    hc, head = _randomised(DeepseekV4HyperConnection(config)), _randomised(DeepseekV4HyperHead(config))
    x = _streams(config, *lead, dtype=dtype)
    for got, want in zip(hyper_connection.pre(hc, x), hc(x), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    got, want = hyper_connection.head(head, x), head(x)
    assert got.dtype == want.dtype and torch.equal(got, want)


class _LoggedNorm(DeepseekV4RMSNorm):
    calls = 0

    def forward(self, hidden_states):
        type(self).calls += 1
        return super().forward(hidden_states)


def _norm(config, cls=DeepseekV4RMSNorm) -> nn.Module:
    norm = cls(config.hidden_size, eps=config.rms_norm_eps)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    return norm


@pytest.mark.parametrize("in_op", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@torch.no_grad()
def test_the_block_norm_in_the_op_is_the_module(dtype, in_op, monkeypatch):
    """``pre`` / ``post_pre`` / ``head`` with the next norm, in the op (its ``out_norm_weight``) or
    after it: the norm module applied to the module's collapse, bit for bit; a norm class with its
    own ``forward`` is called on the op's output either way."""
    monkeypatch.setattr(hyper_connection, "NORM_IN_OP", in_op)
    config = tiny_hf_config()
    hc, head = _randomised(DeepseekV4HyperConnection(config)), _randomised(DeepseekV4HyperHead(config))
    x, norm = _streams(config, 2, 3, dtype=dtype), _norm(config)
    post, comb, collapsed = hc(x)
    for got, want in zip(hyper_connection.pre(hc, x, norm), (post, comb, norm(collapsed)), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    out = _streams(config, 2, 3, dtype=dtype, seed=2)[..., 0, :]
    new = hyper_connection.post(post, comb, out, x)
    want = (new, *hyper_connection.pre(hc, new, norm))
    for got, w in zip(hyper_connection.post_pre(post, comb, out, x, hc, norm), want, strict=True):
        assert torch.equal(got, w)
    assert torch.equal(hyper_connection.head(head, x, norm), norm(head(x)))
    logged, calls = _norm(config, _LoggedNorm), _LoggedNorm.calls
    assert torch.equal(hyper_connection.pre(hc, x, logged)[2], DeepseekV4RMSNorm.forward(logged, collapsed))
    assert torch.equal(hyper_connection.head(head, x, logged), DeepseekV4RMSNorm.forward(logged, head(x)))
    assert _LoggedNorm.calls == calls + 2


def test_no_tokens():
    config = tiny_hf_config()
    args = _pre_args(config)
    args[0] = _streams(config, 0)
    post, comb, collapsed = torch.ops.dsv4.hc_pre(*args)
    assert (post.shape, comb.shape, collapsed.shape) == ((0, 4), (0, 4, 4), (0, config.hidden_size))
    assert torch.ops.dsv4.hc_post(post, comb, collapsed, args[0]).shape == (0, 4, config.hidden_size)
    shapes = [t.shape for t in torch.ops.dsv4.hc_post_pre(post, comb, collapsed, *args)]
    assert shapes == [(0, 4, config.hidden_size), (0, 4), (0, 4, 4), (0, config.hidden_size)]


class _Block(nn.Module):
    """Stands in for a layer's attention or MoE: a fixed nonlinear map of its input."""

    def __init__(self, hidden: int, seed: int, returns_tuple: bool):
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(seed)) / hidden ** 0.5)
        self.returns_tuple = returns_tuple

    def forward(self, x, **kwargs):
        y = torch.tanh(x.float() @ self.w.float()).to(x.dtype)
        return (y, None) if self.returns_tuple else y


def _stand_in_layer(config, index: int) -> DeepseekV4DecoderLayer:
    """A decoder layer whose attention and MoE are :class:`_Block` s, bf16 with fp32 hyper-connections
    (as ``from_pretrained`` keeps them)."""
    layer = DeepseekV4DecoderLayer(config, index)
    layer.self_attn = _Block(config.hidden_size, 2 * index + 1, True)
    layer.mlp = _Block(config.hidden_size, 2 * index + 2, False)
    for module in (layer.attn_hc, layer.ffn_hc, layer.input_layernorm, layer.post_attention_layernorm):
        _randomised(module)
    layer = layer.bfloat16()
    for module in (layer.attn_hc, layer.ffn_hc):
        module.float()
    return layer


@torch.no_grad()
def test_run_decoder_is_transformers_decoder_layers():
    """transformers' ``DeepseekV4DecoderLayer.forward`` twice and the model step's composition
    (``run_decoder``: hc_pre, norm, block, then hc_post_pre between blocks, hc_post after the last)
    give the same streams, bit for bit."""
    config = tiny_hf_config(num_hidden_layers=2)
    layers = [_stand_in_layer(config, i) for i in range(2)]
    model = SimpleNamespace(config=config, model=SimpleNamespace(layers=layers))
    embeds = torch.randn(1, 6, config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = embeds.unsqueeze(2).expand(-1, -1, config.hc_mult, -1).contiguous()
    for layer in layers:
        want = layer(want)
    got = run_decoder(model, embeds, torch.zeros(1, 6, dtype=torch.long), lambda i, x: layers[i].self_attn(x)[0])
    assert torch.equal(got, want)


@torch.no_grad()
def test_hc_post_pre_is_hc_post_then_hc_pre():
    config = tiny_hf_config()
    hc = _randomised(DeepseekV4HyperConnection(config)).float()
    streams = _streams(config, 2, 3)
    post, comb, _ = hyper_connection.pre(hc, _streams(config, 2, 3, seed=1))
    out = _streams(config, 2, 3, seed=2)[..., 0, :]
    new = hyper_connection.post(post, comb, out, streams)
    got = hyper_connection.post_pre(post, comb, out, streams, hc)
    for g, w in zip(got, (new, *hc(new)), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


class _LoggedHyperConnection(DeepseekV4HyperConnection):
    calls = 0

    def forward(self, hidden_streams):
        type(self).calls += 1
        return super().forward(hidden_streams)


@torch.no_grad()
def test_a_module_with_its_own_forward_is_called():
    config = tiny_hf_config()
    hc = _randomised(_LoggedHyperConnection(config))
    x = _streams(config, 1, 3)
    for got, want in zip(hyper_connection.pre(hc, x), DeepseekV4HyperConnection.forward(hc, x), strict=True):
        assert torch.equal(got, want)
    assert _LoggedHyperConnection.calls == 1
    # between blocks too: the mix as an op, then the module
    post, comb, out = hyper_connection.pre(hc, _streams(config, 1, 3, seed=1))
    new = hyper_connection.post(post, comb, out, x)
    got = hyper_connection.post_pre(post, comb, out, x, hc)
    for g, w in zip(got, (new, *DeepseekV4HyperConnection.forward(hc, new)), strict=True):
        assert torch.equal(g, w)
    assert _LoggedHyperConnection.calls == 3


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@pytest.mark.parametrize("norm_in_op", [False, True])
@torch.no_grad()
def test_model_step_runs_the_ops(norm_in_op, monkeypatch):
    """The step's logits with the norms in the mHC ops are bit for bit those with the norm modules."""
    layers = 2
    backend = enable(tiny_hf_model(config=tiny_hf_config(num_hidden_layers=layers)), max_requests=1, max_seq_len=256)
    passes = DSV4PassManager([FuseStepMetadataPass()])
    ids = torch.randint(0, 512, (6,), generator=torch.Generator().manual_seed(0))
    row = backend.allocator.admit()
    step = StepInputs.make(ForwardMode.EXTEND, [row], [6], [6], backend.allocator.extend(row, 6))
    want = backend(ids, step, torch.arange(6)).float()
    monkeypatch.setattr(hyper_connection, "NORM_IN_OP", norm_in_op)
    assert torch.equal(backend(ids, step, torch.arange(6)).float(), want)
    with fresh_compile_state():
        got = compile_step(backend, passes=passes, options=EXACT_NUMERICS)(ids, step, torch.arange(6)).float()
        assert graph_breaks() == 0
    ops = passes.last_ops
    counts = [ops.count(f"dsv4.{name}.default") for name in ("hc_pre", "hc_post_pre", "hc_post", "hc_head")]
    assert counts == [1, 2 * layers - 1, 1, 1]
    assert torch.equal(got, want)


def _pre_args(config):
    hc = _randomised(DeepseekV4HyperConnection(config))
    return [_streams(config, 1, 3), hc.fn.data, hc.base.data, hc.scale.data, 20, 1e-6, 1e-6]


@pytest.mark.parametrize("index, value, error, match", [
    (0, torch.zeros(3), ValueError, "x must be"),
    (0, torch.zeros(1, 3, 4, 256, dtype=torch.int32), TypeError, "x must have dtype"),
    (1, torch.zeros(24, 100), ValueError, "fn has shape"),
    (2, torch.zeros(23), ValueError, "base has shape"),
    (3, torch.zeros(2), ValueError, "scale has shape"),
    (3, torch.zeros(3, device="meta"), ValueError, "scale is on meta"),
    (4, 0, ValueError, "iters=0"),
    (5, -1.0, ValueError, "hc_eps=-1.0"),
    (7, torch.ones(100), ValueError, "out_norm_weight has shape"),
    (7, torch.ones(256, dtype=torch.float16), TypeError, "out_norm_weight must have dtype"),
])
def test_hc_pre_bad_arguments_are_named(index, value, error, match):
    args = _pre_args(tiny_hf_config()) + [None, 1e-6]
    args[index] = value
    with pytest.raises(error, match=f"dsv4.hc_pre: {match}"):
        torch.ops.dsv4.hc_pre(*args)


def test_hc_head_hc_post_and_hc_post_pre_bad_arguments_are_named():
    config = tiny_hf_config()
    x = _streams(config, 1, 3)
    head = DeepseekV4HyperHead(config)
    with pytest.raises(ValueError, match="dsv4.hc_head: fn has shape"):
        torch.ops.dsv4.hc_head(x, head.hc_fn.data[:2], head.hc_base.data, head.hc_scale.data, 1e-6, 1e-6)
    post, comb, out = torch.zeros(1, 3, 4), torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, config.hidden_size).bfloat16()
    with pytest.raises(ValueError, match="dsv4.hc_post: comb has shape"):
        torch.ops.dsv4.hc_post(post, comb[:, :2], out, x)
    with pytest.raises(TypeError, match="dsv4.hc_post: out must have dtype torch.bfloat16"):
        torch.ops.dsv4.hc_post(post, comb, out.float(), x)
    with pytest.raises(ValueError, match="dsv4.hc_post: post must be 3-D"):
        torch.ops.dsv4.hc_post(post[0], comb, out, x)
    pre_args = _pre_args(config)[1:]
    with pytest.raises(ValueError, match="dsv4.hc_post_pre: comb has shape"):
        torch.ops.dsv4.hc_post_pre(post, comb[:, :2], out, x, *pre_args)
    with pytest.raises(ValueError, match="dsv4.hc_post_pre: fn has shape"):
        torch.ops.dsv4.hc_post_pre(post, comb, out, x, pre_args[0][:, :8], *pre_args[1:])
    with pytest.raises(ValueError, match="dsv4.hc_post_pre: iters=0"):
        torch.ops.dsv4.hc_post_pre(post, comb, out, x, *pre_args[:3], 0, *pre_args[4:])
    weight = torch.ones(config.hidden_size)
    with pytest.raises(ValueError, match="dsv4.hc_post_pre: out_norm_eps=-1.0"):
        torch.ops.dsv4.hc_post_pre(post, comb, out, x, *pre_args, weight, -1.0)
    with pytest.raises(ValueError, match="dsv4.hc_head: out_norm_weight is on meta"):
        torch.ops.dsv4.hc_head(x, head.hc_fn.data, head.hc_base.data, head.hc_scale.data, 1e-6, 1e-6,
                               weight.to("meta"), 1e-6)


def test_collapse_linears_ops_bad_arguments_are_named():
    """``hc_*_linears``: the hc op's arguments checked as that op checks them, under the fused op's
    name; the products' weights as ``dsv4::linears`` checks them, the collapse named for its x."""
    config = tiny_hf_config()
    x = _streams(config, 1, 3)
    hidden = config.hidden_size
    pre_args = _pre_args(config)[1:] + [None, 1e-6]
    weights = [torch.zeros(8, hidden).bfloat16()]
    post, comb, out = torch.zeros(1, 3, 4), torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, hidden).bfloat16()
    head = DeepseekV4HyperHead(config)
    head_args = [head.hc_fn.data, head.hc_base.data, head.hc_scale.data, 1e-6, 1e-6, None, 1e-6]
    ops = torch.ops.dsv4
    with pytest.raises(ValueError, match="dsv4.hc_pre_linears: iters=0"):
        ops.hc_pre_linears(x, *pre_args[:3], 0, *pre_args[4:], weights)
    with pytest.raises(ValueError, match=rf"dsv4.hc_pre_linears: weights\[0\] has shape \(8, 7\), expected {hidden}"):
        ops.hc_pre_linears(x, *pre_args, [torch.zeros(8, 7).bfloat16()])
    with pytest.raises(ValueError, match="dsv4.hc_pre_linears: weights must hold at least one tensor"):
        ops.hc_pre_linears(x, *pre_args, [])
    with pytest.raises(TypeError, match="dsv4.hc_pre_linears: the collapse must have dtype"):
        ops.hc_pre_linears(x.float(), *pre_args, [w.float() for w in weights])
    with pytest.raises(ValueError, match="dsv4.hc_post_pre_linears: comb has shape"):
        ops.hc_post_pre_linears(post, comb[:, :2], out, x, *pre_args, weights)
    with pytest.raises(TypeError, match=r"dsv4.hc_post_pre_linears: weights\[0\] must have dtype torch.bfloat16"):
        ops.hc_post_pre_linears(post, comb, out, x, *pre_args, [w.float() for w in weights])
    with pytest.raises(ValueError, match="dsv4.hc_head_linears: fn has shape"):
        ops.hc_head_linears(x, head_args[0][:2], *head_args[1:], weights)
    with pytest.raises(ValueError, match="dsv4.hc_head_linears: weights must hold at least one tensor"):
        ops.hc_head_linears(x, *head_args, [])
