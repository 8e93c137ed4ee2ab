"""torch.library.opcheck on every dsv4:: op over its materially different paths (schema incl.
mutation declarations, fake-vs-real metadata, AOT dispatch with dynamic shapes), and the op
boundary's device check: a tensor argument on another device than the op's cache / first tensor
is an error naming the op and the argument."""

import pytest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode, KVSet, build_step_metadata, layout
from dsv4_compile.attention import op_args
from dsv4_compile.testing.oracle_recorder import make_engine

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)
ops = torch.ops.dsv4
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
CHECKS_NO_SCHEMA = CHECKS[1:]  # fp8 tensors: the schema check's comparison has no CPU fp8 kernel


@pytest.fixture(scope="module")
def state():
    """A cache with two requests (300 and 40 tokens) and the metadata of a decode and an extend step."""
    torch.manual_seed(0)
    eng, rec = make_engine(TINY, max_requests=3, max_seq_len=512, capture_layers=False)
    rows = [eng.admit(), eng.admit()]
    with torch.no_grad():
        rec.run(ForwardMode.EXTEND, {rows[0]: 300, rows[1]: 40})
    cache = eng.stack.cache
    steps = {
        "decode": eng.build_step(ForwardMode.DECODE, {rows[0]: 1, rows[1]: 1}),
        "extend_padded": eng.build_step(ForwardMode.EXTEND, {rows[0]: 3, rows[1]: 5}, pad_tokens=12),
    }
    metas = {k: build_step_metadata(s, cache, TINY) for k, s in steps.items()}
    return eng, cache, steps, metas


def _opcheck(op, args, checks=CHECKS):
    torch.library.opcheck(op, args, test_utils=checks)


@pytest.mark.parametrize("step_name", ["decode", "extend_padded", "idle"])
def test_metadata_ops(state, step_name):
    _, cache, steps, _ = state
    if step_name == "idle":
        empty = torch.zeros(0, dtype=torch.int32)
        _opcheck(ops.expand_queries, (empty, empty, empty, torch.zeros(3, dtype=torch.int64)))
        return
    step = steps[step_name]
    _opcheck(ops.expand_queries, (step.req_rows, step.seq_lens, step.extend_lens, step.out_cache_loc))
    req, seq, *_ = ops.expand_queries(step.req_rows, step.seq_lens, step.extend_lens, step.out_cache_loc)
    _opcheck(ops.build_page_table, (cache.req_to_page, req, seq))
    _opcheck(ops.build_swa_metadata, (cache.req_to_token, cache.full_to_swa, req, seq, step.out_cache_loc))
    rows = cache.req_to_token.shape[0]
    _opcheck(ops.build_c4_metadata, (req, seq, step.out_cache_loc, 64, rows))
    page_table = ops.build_page_table(cache.req_to_page, req, seq)
    _opcheck(ops.build_c128_metadata, (page_table, req, seq, step.out_cache_loc, rows))
    _opcheck(ops.step_metadata, (*step.tensors(), cache.req_to_token, cache.req_to_page, cache.full_to_swa, 64))


def test_cache_ops():
    cache = torch.zeros(3, layout.model1_page_bytes(64), dtype=torch.uint8)
    k = torch.randn(4, 512).bfloat16()
    _opcheck(ops.store_kv, (cache, torch.tensor([1, -1, 70, 130]), k, 64))
    _opcheck(ops.dequant_kv, (cache, torch.tensor([1, -1, 70], dtype=torch.int32), 64))
    icache = torch.zeros(3, layout.index_page_bytes(), dtype=torch.uint8)
    _opcheck(ops.store_index_k, (icache, torch.tensor([5, -1], dtype=torch.int32), torch.randn(2, 128), 64))
    # the side-stream flag (ops/side_stream.py) and the join that follows such writes
    _opcheck(ops.store_kv, (cache, torch.tensor([1, -1]), k[:2], 64, True))
    _opcheck(ops.join_side_stream, ([cache, icache], [k]))


@pytest.mark.parametrize("layer_id, step_name, index", [(1, "decode", False), (1, "extend_padded", True),
                                                        (2, "extend_padded", False)])
def test_compress_kv(state, layer_id, step_name, index):
    eng, cache, steps, metas = state
    layer, lc, meta = eng.stack.layers[layer_id], cache.layers[layer_id], metas[step_name]
    comp = layer.indexer.compressor if index else layer.compressor
    state_buf = lc.index_state if index else lc.kv_state
    x = torch.randn(meta.positions.shape[0], TINY.hidden_size).bfloat16()
    with torch.no_grad():
        kv, score = comp.project(x)
    _opcheck(ops.compress_kv, (state_buf.clone(), kv, score, comp.ape.detach(), meta.req_of_row,
                               meta.seq_lens_causal, meta.extend_start, meta.extend_end, comp.norm.detach(),
                               layer.inv_freq, comp.ratio, lc.ring, comp.rotate, TINY.rms_norm_eps))


def _compress_kv_store_args(state, layer_id: int, step_name: str, index: bool) -> tuple:
    """``compress_kv_store``'s arguments for a layer's attention (``index=False``) or indexer
    compressor at a step: its state and compressed cache, the step's out slots."""
    eng, cache, _, metas = state
    layer, lc, meta = eng.stack.layers[layer_id], cache.layers[layer_id], metas[step_name]
    comp = layer.indexer.compressor if index else layer.compressor
    state_buf = lc.index_state if index else lc.kv_state
    cache_buf, page_size = (lc.index_k, layout.INDEX_PAGE_SIZE) if index else (lc.extra_kv, lc.extra_page_size)
    slots = meta.c4_out_loc if comp.ratio == 4 else meta.c128_out_loc
    with torch.no_grad():
        kv, score = comp.project(torch.randn(meta.positions.shape[0], TINY.hidden_size).bfloat16())
    return (state_buf.clone(), cache_buf.clone(), slots, kv, score, comp.ape.detach(), meta.req_of_row,
            meta.seq_lens_causal, meta.extend_start, meta.extend_end, comp.norm.detach(), layer.inv_freq, comp.ratio,
            lc.ring, comp.rotate, TINY.rms_norm_eps, page_size)


@pytest.mark.parametrize("layer_id, step_name, index", [(1, "decode", False), (1, "extend_padded", True),
                                                        (2, "extend_padded", False)])
def test_compress_kv_store(state, layer_id, step_name, index):
    _opcheck(ops.compress_kv_store, _compress_kv_store_args(state, layer_id, step_name, index))


@pytest.mark.parametrize("step_name", ["decode", "extend_padded"])
def test_indexer_ops(state, step_name):
    eng, cache, _, metas = state
    meta, lc, layer = metas[step_name], cache.layers[1], eng.stack.layers[1]
    t, h = meta.positions.shape[0], TINY.index_n_heads
    q, w = torch.randn(t, h, 128).bfloat16(), torch.randn(t, h)
    _opcheck(ops.indexer_prepare_q, (q, w, meta.positions, layer.inv_freq, 0.01), CHECKS_NO_SCHEMA)
    q_fp8, w = ops.indexer_prepare_q(q, w, meta.positions, layer.inv_freq, 0.01)
    # request 0 sees 75 entries (> top-k 64, scored), request 1 sees 10 (all, unscored)
    _opcheck(ops.indexer_topk, (q_fp8, w, lc.index_k, meta.page_table, meta.c4_visible, 64), CHECKS_NO_SCHEMA)


@pytest.mark.parametrize("extra, sink", [(None, 0.0), ("c4", 0.0), ("c128", float("-inf")),
                                         ("c128", float("inf")), ("c4", 3.0)])
def test_sparse_attn(state, extra, sink):
    eng, cache, _, metas = state
    meta = metas["extend_padded"]
    t = meta.positions.shape[0]
    q = torch.randn(t, TINY.num_heads, 512).bfloat16()
    sinks = torch.full((TINY.num_heads,), sink)
    swa = KVSet(cache.layers[0].swa_kv, 256, meta.swa_indices, meta.swa_lengths)
    if extra == "c4":  # short lengths: only a prefix of each index row counts
        idx = torch.where(torch.arange(64) < 20, meta.c4_visible.unsqueeze(1) * 0 + torch.arange(64), -1)
        extra = KVSet(cache.layers[1].extra_kv, 64, (idx + 64).to(torch.int32), meta.c4_topk_lengths.clamp_max(20))
    elif extra == "c128":
        extra = KVSet(cache.layers[2].extra_kv, 2, meta.c128_indices, meta.c128_lengths)
    _opcheck(ops.sparse_attn, op_args(q, swa, extra, sinks, TINY.softmax_scale))
    _opcheck(ops.sparse_attn_inverse_rope,
             (*op_args(q, swa, extra, sinks, TINY.softmax_scale), meta.positions, eng.stack.layers[1].inv_freq))


@pytest.mark.parametrize("x", [torch.rand(5, 4, 4), torch.rand(2, 3, 4, 4), torch.rand(0, 4, 4),
                               torch.rand(3, 3, 3).transpose(1, 2)], ids=["3-D", "4-D", "empty", "strided"])
def test_sinkhorn(x):
    _opcheck(ops.sinkhorn, (x, 20, 1e-6))


def _hyper_connection_args(tokens: int) -> dict[str, tuple]:
    """``hc_pre`` / ``hc_head`` / ``hc_post`` / ``hc_post_pre`` arguments, and the ``_linears`` ops' (two
    products of the collapse): 4 streams of hidden 64, bf16."""
    x = torch.randn(1, tokens, 4, 64).bfloat16()
    fn, base, scale = torch.randn(24, 256) * 0.1, torch.randn(24), torch.randn(3)
    post, comb, out = ops.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    norm = (torch.rand(64) + 0.5, 1e-6)  # the block's RMSNorm, applied to the collapse
    weights = [torch.randn(8, 64).bfloat16(), torch.randn(5, 64).bfloat16()]  # products of the collapse
    return {"hc_pre": (x, fn, base, scale, 20, 1e-6, 1e-6),
            "hc_pre_normed": (x, fn, base, scale, 20, 1e-6, 1e-6, *norm),
            "hc_head": (x, fn[:4], base[:4], scale[:1], 1e-6, 1e-6),
            "hc_head_normed": (x, fn[:4], base[:4], scale[:1], 1e-6, 1e-6, *norm),
            "hc_post": (post, comb, out, x),
            "hc_post_pre": (post, comb, out, x, fn, base, scale, 20, 1e-6, 1e-6),
            "hc_post_pre_normed": (post, comb, out, x, fn, base, scale, 20, 1e-6, 1e-6, *norm),
            "hc_pre_linears": (x, fn, base, scale, 20, 1e-6, 1e-6, None, 0.0, weights),
            "hc_pre_linears_normed": (x, fn, base, scale, 20, 1e-6, 1e-6, *norm, weights),
            "hc_post_pre_linears": (post, comb, out, x, fn, base, scale, 20, 1e-6, 1e-6, *norm, weights),
            "hc_head_linears": (x, fn[:4], base[:4], scale[:1], 1e-6, 1e-6, *norm, weights)}


@pytest.mark.parametrize("tokens", [0, 3])
@pytest.mark.parametrize("case", ["hc_pre", "hc_pre_normed", "hc_head", "hc_head_normed", "hc_post", "hc_post_pre",
                                  "hc_post_pre_normed", "hc_pre_linears", "hc_pre_linears_normed",
                                  "hc_post_pre_linears", "hc_head_linears"])
def test_hyper_connection_ops(case, tokens):
    _opcheck(getattr(ops, case.removesuffix("_normed")), _hyper_connection_args(tokens)[case])


def _experts_args(tokens: int, dtype=torch.bfloat16) -> tuple:
    """``routed_experts`` arguments: 4 experts of hidden 64 x intermediate 32, 2 a token."""
    x = torch.randn(tokens, 64).to(dtype)
    ids = torch.rand(tokens, 4).argsort(dim=1)[:, :2].int()
    return x, ids, torch.randn(4, 64, 64).to(dtype), torch.randn(4, 64, 32).to(dtype), 10.0


@pytest.mark.parametrize("tokens", [0, 3])
def test_routed_experts(tokens):
    _opcheck(ops.routed_experts, _experts_args(tokens, torch.float16))


def _moe_experts_args(tokens: int, dtype=torch.bfloat16, router: bool = True) -> tuple:
    """``moe_experts`` arguments: ``_experts_args``, a shared expert of intermediate 48 and a router
    of its 4 experts (or None)."""
    return (*_experts_args(tokens, dtype), torch.randn(48, 64).to(dtype), torch.randn(48, 64).to(dtype),
            torch.randn(64, 48).to(dtype), torch.randn(4, 64).to(dtype) if router else None)


@pytest.mark.parametrize("tokens", [0, 3])
@pytest.mark.parametrize("router", [True, False])
def test_moe_experts(tokens, router):
    _opcheck(ops.moe_experts, _moe_experts_args(tokens, torch.float16, router))


@pytest.mark.parametrize("tokens", [0, 3])
def test_moe_experts_of_a_hash_table(tokens):
    """``expert_ids`` a table of 10 rows, looked up by ``token_ids``."""
    x, _, *rest = _moe_experts_args(tokens, torch.float16)
    table = torch.rand(10, 4).argsort(dim=1)[:, :2]
    _opcheck(ops.moe_experts, (x, table, *rest, torch.randint(0, 10, (tokens,))))


@pytest.mark.parametrize("tokens", [0, 3])
def test_router_topk(tokens):
    _opcheck(ops.router_topk, (torch.randn(tokens, 64).half(), torch.randn(8, 64).half(), torch.randn(8), 2))


@pytest.mark.parametrize("rows", [0, 3])
def test_linears(rows):
    _opcheck(ops.linears, (torch.randn(rows, 64).half(), [torch.randn(n, 64).half() for n in (8, 5)]))
    _opcheck(ops.linears, (torch.randn(rows, 64).half(), [torch.randn(8, 64).half()], torch.rand(64), 1e-6))


@pytest.mark.parametrize("rows", [0, 3])
def test_grouped_linear(rows):
    _opcheck(ops.grouped_linear, (torch.randn(rows, 2, 64).half(), torch.randn(2 * 8, 64).half()))
    _opcheck(ops.grouped_linear, (torch.randn(rows, 2, 64).half(), torch.randn(2 * 8, 64).half(),
                                  torch.arange(rows), torch.rand(4), 32))


@pytest.mark.parametrize("rows", [0, 3])
def test_topk_indices(rows):
    _opcheck(ops.topk_indices, (torch.randn(rows, 9), 3))


@pytest.mark.parametrize("rows", [0, 3])
def test_greedy_tokens(rows):
    _opcheck(ops.greedy_tokens, (torch.randn(rows, 77).bfloat16(),))


def _norm_rope_args(tokens: int, weight: bool) -> tuple:
    return (torch.randn(tokens, 3, 128).bfloat16(), torch.rand(128) + 0.5 if weight else None, 1e-6, not weight,
            torch.arange(tokens) * 7, torch.rand(16))


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("tokens", [0, 3])
def test_rms_norm_rope(tokens, weight):
    _opcheck(ops.rms_norm_rope, _norm_rope_args(tokens, weight))


@pytest.mark.parametrize("weight", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0, 64), (3, 64), (3, 2, 64)])
def test_rms_norm(shape, weight):
    _opcheck(ops.rms_norm, (torch.randn(shape).bfloat16(), None if weight is None else torch.rand(64).to(weight), 1e-6))


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("heads", [None, 2])
@pytest.mark.parametrize("tokens", [0, 3])
def test_rope_tail(tokens, heads, inverse):
    x = torch.randn(tokens, 96) if heads is None else torch.randn(tokens, heads, 96)
    positions = torch.arange(tokens) * 7
    _opcheck(ops.rope_tail, (x.bfloat16(), positions if heads is None else positions[:, None], torch.rand(16), inverse))


def _key_store_args(tokens: int, weight: bool) -> tuple:
    slots = torch.tensor([1, -1, 70, 130, 5])[:tokens]
    return (torch.zeros(3, layout.model1_page_bytes(64), dtype=torch.uint8), slots, torch.randn(tokens, 512).bfloat16(),
            torch.rand(512) + 0.5 if weight else None, 1e-6, not weight, torch.arange(tokens) * 7, torch.rand(32), 64)


@pytest.mark.parametrize("weight", [False, True])
@pytest.mark.parametrize("tokens", [0, 4])
def test_rms_norm_rope_store_kv(tokens, weight):
    _opcheck(ops.rms_norm_rope_store_kv, _key_store_args(tokens, weight))


def _calls(state) -> dict[str, tuple]:
    """One valid call of every op of this library: op name -> arguments."""
    eng, cache, steps, metas = state
    step, meta, lc, layer = steps["decode"], metas["decode"], cache.layers[1], eng.stack.layers[1]
    comp = layer.compressor
    t = meta.positions.shape[0]
    kv, score = comp.project(torch.randn(t, TINY.hidden_size).bfloat16())
    q_fp8, w = ops.indexer_prepare_q(torch.randn(t, 8, 128), torch.randn(t, 8), meta.positions, layer.inv_freq, 0.1)
    pool = torch.zeros(3, layout.model1_page_bytes(64), dtype=torch.uint8)
    slots, keys = torch.tensor([1, 70]), torch.randn(2, 512).bfloat16()
    attn = op_args(torch.randn(t, TINY.num_heads, 512).bfloat16(),
                   KVSet(cache.layers[0].swa_kv, 256, meta.swa_indices, meta.swa_lengths),
                   KVSet(cache.layers[2].extra_kv, 2, meta.c128_indices, meta.c128_lengths),
                   torch.zeros(TINY.num_heads), TINY.softmax_scale)
    return {
        "expand_queries": step.tensors(),
        "build_page_table": (cache.req_to_page, meta.req_of_row, meta.seq_lens_causal),
        "build_swa_metadata": (cache.req_to_token, cache.full_to_swa, meta.req_of_row, meta.seq_lens_causal,
                               step.out_cache_loc),
        "build_c4_metadata": (meta.req_of_row, meta.seq_lens_causal, step.out_cache_loc, 64,
                              cache.req_to_token.shape[0]),
        "build_c128_metadata": (meta.page_table, meta.req_of_row, meta.seq_lens_causal, step.out_cache_loc,
                                cache.req_to_token.shape[0]),
        "step_metadata": (*step.tensors(), cache.req_to_token, cache.req_to_page, cache.full_to_swa, 64),
        "store_kv": (pool, slots, keys, 64),
        "dequant_kv": (pool, slots, 64),
        "store_index_k": (torch.zeros(2, layout.index_page_bytes(), dtype=torch.uint8), slots, torch.randn(2, 128), 64),
        "compress_kv": (lc.kv_state.clone(), kv.detach(), score.detach(), comp.ape.detach(), meta.req_of_row,
                        meta.seq_lens_causal, meta.extend_start, meta.extend_end, comp.norm.detach(), layer.inv_freq,
                        comp.ratio, lc.ring, comp.rotate, TINY.rms_norm_eps),
        "compress_kv_store": _compress_kv_store_args(state, 1, "decode", index=True),
        "indexer_prepare_q": (torch.randn(t, 8, 128), torch.randn(t, 8), meta.positions, layer.inv_freq, 0.1),
        "indexer_topk": (q_fp8, w, lc.index_k, meta.page_table, meta.c4_visible, 64),
        "sparse_attn": attn,
        "sparse_attn_inverse_rope": (*attn, meta.positions, layer.inv_freq),
        "routed_experts": _experts_args(3),
        "moe_experts": _moe_experts_args(3),
        "router_topk": (torch.randn(3, 64).bfloat16(), torch.randn(8, 64).bfloat16(), torch.randn(8), 2),
        "linears": (torch.randn(3, 64).bfloat16(), [torch.randn(8, 64).bfloat16(), torch.randn(5, 64).bfloat16()]),
        "grouped_linear": (torch.randn(3, 2, 64).bfloat16(), torch.randn(16, 64).bfloat16()),
        "rms_norm": (torch.randn(3, 64).bfloat16(), torch.rand(64), 1e-6),
        "rope_tail": (torch.randn(3, 96).bfloat16(), torch.arange(3), torch.rand(16)),
        "rms_norm_rope": _norm_rope_args(3, True),
        "rms_norm_rope_store_kv": _key_store_args(4, True),
        **_hyper_connection_args(3),
    }


# sinkhorn, greedy_tokens and topk_indices are absent: their one tensor argument has no device to disagree with
ALL_OPS = ["expand_queries", "build_page_table", "build_swa_metadata", "build_c4_metadata",
           "build_c128_metadata", "step_metadata", "store_kv", "dequant_kv", "store_index_k", "compress_kv",
           "compress_kv_store", "indexer_prepare_q", "indexer_topk", "sparse_attn", "sparse_attn_inverse_rope",
           "routed_experts", "moe_experts", "router_topk", "linears", "grouped_linear", "rms_norm", "rope_tail",
           "rms_norm_rope", "rms_norm_rope_store_kv", "hc_pre", "hc_head", "hc_post", "hc_post_pre", "hc_pre_linears",
           "hc_post_pre_linears", "hc_head_linears"]


@pytest.mark.parametrize("op_name", ALL_OPS)
def test_tensor_on_another_device_is_named(state, op_name):
    """Each tensor argument in turn on ``meta`` (the others on the CPU): a ValueError naming the op
    and that argument, before anything runs."""
    args = _calls(state)[op_name]
    op = getattr(ops, op_name)
    names = [a.name for a in op.default._schema.arguments]
    getattr(ops, op_name)(*args)  # the call itself is valid
    for i, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            continue
        moved = (*args[:i], arg.to("meta"), *args[i + 1:])
        with pytest.raises(ValueError, match=rf"^dsv4\.{op_name}: .*\b{names[i]}\b"):
            op(*moved)
