"""The oracle's FP8 switch: ``fp8=False`` drops the cache quantisation (SWA keys, compressed
entries, indexer keys and query) and then equals a plain fp64 computation of the layer; with FP8
the outputs move by FP8 rounding noise only."""

import torch

from dsv4_compile import DSV4AttnConfig
from dsv4_compile.cache import DSV4Cache
from dsv4_compile.layer import DSV4Attention, DSV4AttentionStack
from dsv4_compile.oracle import oracle_layer, oracle_layer_inputs

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(length, TINY.hidden_size, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@torch.no_grad()
def test_fp8_cache_moves_every_layer_by_fp8_noise_only():
    """e4m3 keeps 3 mantissa bits under a power-of-two tile scale: each quantised element is off
    by at most 2**-4 of itself, about 2**-4 / sqrt(3) ≈ 0.036 RMS, and the attention output, a
    softmax-weighted mean of keys, inherits that relative error. So each layer's output moves by
    less than 2**-4 relative, and by far more than bf16 rounding (2**-9)."""
    stack = DSV4AttentionStack(TINY, DSV4Cache(TINY, max_requests=1, max_seq_len=256)).reset_parameters(0)
    x = _inputs(64)
    with_fp8, without = oracle_layer_inputs(stack, x), oracle_layer_inputs(stack, x, fp8=False)
    assert torch.equal(with_fp8[0], without[0])
    for i in range(1, len(without)):
        rel = _rel(with_fp8[i] - with_fp8[i - 1], without[i] - without[i - 1])
        assert 2 ** -6 < rel < 2 ** -4, (i, rel)


def _rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, sign: int = 1) -> torch.Tensor:
    """Interleaved-pair rotation of the last 64 dims as complex multiplication (fp64)."""
    angle = pos.double().unsqueeze(-1) * inv_freq.double()  # [..., 32]
    z = torch.view_as_complex(x[..., -64:].reshape(*x.shape[:-1], 32, 2).contiguous())
    rotated = torch.view_as_real(z * torch.polar(torch.ones_like(angle), sign * angle)).flatten(-2)
    return torch.cat([x[..., :-64], rotated], dim=-1)


def _norm(x: torch.Tensor, weight=None, eps: float = 1e-6) -> torch.Tensor:
    y = x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return y if weight is None else y * weight.double()


def _c128_layer_fp64(layer: DSV4Attention, x: torch.Tensor) -> torch.Tensor:
    """One ratio-128 layer over positions 0..L-1, written out from its weights in fp64."""
    w = {name: p.double() for name, p in layer.named_parameters()}
    x, L, H = x.double(), x.shape[0], layer.config.num_heads
    pos, f = torch.arange(L), layer.inv_freq
    q = _norm((_norm(x @ w["wq_a"].T, w["q_norm"]) @ w["wq_b"].T).view(L, H, 512))  # per head
    q = _rope(q, pos.view(L, 1), f)
    kv = _rope(_norm(x @ w["wkv"].T, w["kv_norm"]), pos, f)
    entries = []
    for start in range(0, L - 127, 128):  # each complete window of 128 positions
        win = x[start:start + 128]
        gate = torch.softmax(win @ w["compressor.wgate"].T + w["compressor.ape"], dim=0)
        pooled = (gate * (win @ w["compressor.wkv"].T)).sum(0)
        entries.append(_rope(_norm(pooled, w["compressor.norm"]), torch.tensor(start), f))
    out = torch.empty(L, H, 512, dtype=torch.float64)
    for t in range(L):
        keys = torch.cat([kv[max(0, t - 127):t + 1], *[e[None] for e in entries[:(t + 1) // 128]]])
        logits = q[t] @ keys.T * 512 ** -0.5  # [H, keys]
        weights = torch.exp(logits) / (torch.exp(logits).sum(-1, keepdim=True) + torch.exp(w["attn_sink"])[:, None])
        out[t] = weights @ keys
    out = _rope(out, pos.view(L, 1), f, sign=-1).reshape(L, 2, H * 256)
    grouped = torch.einsum("tgd,grd->tgr", out, w["wo_a"].view(2, 64, H * 256))
    return grouped.flatten(1) @ w["wo_b"].T


@torch.no_grad()
def test_without_fp8_a_c128_layer_equals_a_plain_fp64_computation():
    """260 positions: two c128 entries (seen from 127 and 255 on) and a full SWA window; YaRN
    RoPE. Without FP8 only bf16 roundings remain (q, kv, pooled entry, attention output); with
    FP8 the error is several times larger."""
    layer = DSV4Attention(TINY.with_(compress_ratios=(128,)), 0)
    layer.reset_parameters(torch.Generator().manual_seed(0))
    x = _inputs(260)
    expected = _c128_layer_fp64(layer, x)
    err = _rel(oracle_layer(layer, x, fp8=False), expected)
    err_fp8 = _rel(oracle_layer(layer, x), expected)
    assert err < 2 ** -7 and err_fp8 > 4 * err, (err, err_fp8)
