"""Cache-free dense oracle of the DSV4 attention path (docs/semantics.md §4.7).

Computes a layer's outputs from one request's *full* token history with no pages, slots, rings or
metadata: windows are reshapes, the indexer scores every visible entry, attention is a dense
masked softmax with the sink as an extra logit column. What the paged cache would hold is
reproduced by applying the same FP8 quantise-dequantise to the raw keys, the compressed entries
and the indexer keys, and the indexer query is FP8-quantised as ``dsv4::indexer_prepare_q`` does.
The paged incremental path must match it up to rounding. ``fp8=False`` leaves all four
unquantised (bf16 keys, an fp32 indexer query after RoPE and Hadamard): the model without the FP8
cache, as a bf16-cache implementation computes it.

A layer is read through duck typing: any object with ``ratio``, ``config`` (``softmax_scale``),
``inv_freq``, ``attn_sink``, ``project_q_kv(x, pos)``, ``output(o, pos)``, a ``compressor``
(``project(x) -> (kv, score)`` fp32, ``ape``, ``norm``, ``ratio``, ``d``, ``rotate``, ``eps``) and an
``indexer`` (``project_q``, ``weight_scale``, ``topk``, ``compressor``) works, not only
:class:`DSV4Attention`.
"""

from __future__ import annotations

import torch

from .config import SWA_WINDOW
from .layer import Compressor, DSV4Attention, DSV4AttentionStack
from .model import ModelBackend, head_logits, run_decoder
from .reference.functional import hadamard, rms_norm, rope_tail
from .reference.indexer import indexer_prepare_q, indexer_rotate_q
from .reference.quant import fake_quant_index_k, fake_quant_model1

_QUERY_CHUNK = 256


def dense_compress(comp: Compressor, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Every complete window of ``x [L, hidden]``: ``[L // r, d]`` bf16 (docs/semantics.md §4.2)."""
    r, d = comp.ratio, comp.d
    n = x.shape[0] // r
    kv, score = (t.float() for t in comp.project(x[: n * r]))
    score = score + comp.ape.repeat(n, 1)
    kv, score = kv.view(n, r, kv.shape[1]), score.view(n, r, kv.shape[1])  # [n, r, Wc]
    if r == 4:  # previous window's overlap half, then this window's own half
        prev_kv = torch.cat([kv.new_zeros(1, r, d), kv[:, :, :d]], 0)[:n]
        prev_score = torch.cat([score.new_full((1, r, d), float("-inf")), score[:, :, :d]], 0)[:n]
        kv = torch.cat([prev_kv, kv[:, :, d:]], 1)  # [n, 8, d]
        score = torch.cat([prev_score, score[:, :, d:]], 1)
    e = (torch.softmax(score, dim=1) * kv).sum(dim=1)  # [n, d]
    y = rms_norm(e.to(torch.bfloat16), comp.norm, comp.eps)
    y = rope_tail(y, torch.arange(n, device=x.device) * r, inv_freq)
    return hadamard(y).to(torch.bfloat16) if comp.rotate else y


def _indexer_selection(layer: DSV4Attention, x, q_lora, pos, n_visible, fp8: bool) -> torch.Tensor:
    """[L, n_c4] bool: the c4 entries each position attends to (all visible, or the top-k)."""
    idx = layer.indexer
    keys = dense_compress(idx.compressor, x, layer.inv_freq)  # [n, 128]
    keys = fake_quant_index_k(keys) if fp8 else keys.float()
    iq, iw = idx.project_q(x, q_lora)
    if fp8:
        q, w = indexer_prepare_q(iq, iw, pos, layer.inv_freq, idx.weight_scale)
    else:
        q, w = indexer_rotate_q(iq, pos, layer.inv_freq), iw.float() * idx.weight_scale
    logits = torch.einsum("thd,nd->thn", q.float(), keys).relu()
    logits = torch.einsum("thn,th->tn", logits, w)  # [L, n]
    j = torch.arange(keys.shape[0], device=x.device)
    visible = j < n_visible.unsqueeze(1)
    logits = logits.masked_fill(~visible, float("-inf"))
    k = min(idx.topk, keys.shape[0])
    top = torch.topk(logits, k, dim=1).indices
    top_mask = torch.zeros_like(visible).scatter(1, top, True)
    return torch.where((n_visible > idx.topk).unsqueeze(1), top_mask, visible)


def oracle_layer(layer: DSV4Attention, x: torch.Tensor, *, fp8: bool = True) -> torch.Tensor:
    """Outputs ``[L, hidden]`` of ``layer`` for every position of one request's history ``x``;
    ``fp8=False``: without the FP8 cache simulation."""
    L = x.shape[0]
    pos = torch.arange(L, device=x.device)
    q, kv, q_lora = layer.project_q_kv(x, pos)
    cached = fake_quant_model1 if fp8 else (lambda k: k)
    keys = [cached(kv)]
    s = torch.arange(L, device=x.device)
    masks = [(s <= pos.unsqueeze(1)) & (s > pos.unsqueeze(1) - SWA_WINDOW)]  # [L, L] window
    if layer.ratio:
        keys.append(cached(dense_compress(layer.compressor, x, layer.inv_freq)))
        n_visible = (pos + 1) // layer.ratio
        if layer.ratio == 4:
            masks.append(_indexer_selection(layer, x, q_lora, pos, n_visible, fp8))
        else:
            masks.append(torch.arange(keys[1].shape[0], device=x.device) < n_visible.unsqueeze(1))
    keys_all, mask = torch.cat(keys, 0).float(), torch.cat(masks, 1)
    out = torch.cat([_sink_attention(q[lo:lo + _QUERY_CHUNK], keys_all, mask[lo:lo + _QUERY_CHUNK],
                                     layer.attn_sink, layer.config.softmax_scale)
                     for lo in range(0, L, _QUERY_CHUNK)], 0)
    return layer.output(out, pos)


def _sink_attention(q, keys, mask, sink, scale: float) -> torch.Tensor:
    """Softmax over the allowed keys plus one sink logit per head whose value row is zero."""
    logits = torch.einsum("thd,kd->thk", q.float(), keys) * scale
    logits = logits.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink_col = sink.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
    p = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thk,kd->thd", p, keys).to(torch.bfloat16)


def oracle_stack(stack: DSV4AttentionStack, x: torch.Tensor, *, fp8: bool = True) -> torch.Tensor:
    """The stack's outputs ``[L, hidden]`` for every position of one request's history ``x``."""
    return oracle_layer_inputs(stack, x, fp8=fp8)[-1]


def oracle_layer_inputs(stack: DSV4AttentionStack, x: torch.Tensor, *, fp8: bool = True
                        ) -> list[torch.Tensor]:
    """Hidden states entering each layer of ``stack.layers``, then the stack output:
    ``num_layers + 1`` x ``[L, hidden]``."""
    hs = [x]
    for layer in stack.layers:
        hs.append(hs[-1] + oracle_layer(layer, hs[-1], fp8=fp8))
    return hs


@torch.no_grad()
def oracle_model_logits(backend: ModelBackend, input_ids: torch.Tensor, *, fp8: bool = True) -> torch.Tensor:
    """Logits ``[L, vocab]`` fp32 of every position of one sequence ``input_ids [L]`` through the
    backend's model, each attention layer computed by :func:`oracle_layer` (``fp8``: with the FP8
    cache simulation) and everything else by the model's own modules."""
    model = backend.model
    ids = input_ids.unsqueeze(0)

    def attend(i: int, x: torch.Tensor) -> torch.Tensor:
        return oracle_layer(backend.attn_layers[i], x[0], fp8=fp8).unsqueeze(0)

    return head_logits(model, run_decoder(model, model.model.embed_tokens(ids), ids, attend))[0].float()


@torch.no_grad()
def oracle_cache_entries(layer: DSV4Attention, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What the paged cache should hold for one request with layer input history ``x [L, hidden]``:
    ``swa`` (last min(L, 128) keys, oldest first) and, per ratio, ``extra`` ([L // r, 512]) and
    ``index_k`` ([L // 4, 128] fp32), all quantise-dequantised."""
    L = x.shape[0]
    pos = torch.arange(L, device=x.device)
    kv = layer.project_q_kv(x, pos)[1]
    out = {"swa": fake_quant_model1(kv[max(0, L - SWA_WINDOW):])}
    if layer.ratio:
        out["extra"] = fake_quant_model1(dense_compress(layer.compressor, x, layer.inv_freq))
    if layer.ratio == 4:
        out["index_k"] = fake_quant_index_k(dense_compress(layer.indexer.compressor, x, layer.inv_freq))
    return out
