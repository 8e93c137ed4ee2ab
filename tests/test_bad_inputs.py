"""Bad input at every public entry raises the stated exception, with a message naming the argument
(``dsv4.<op>: ...`` for the ops), and changes nothing: every cache buffer (pools, compressor rings,
index maps) stays byte-identical and the allocator's state is unchanged.

Entries: ``DSV4AttnConfig``, ``StepInputs.make``, ``DSV4AttentionStack`` (constructor and the eager forward's
validation), ``build_step_metadata``, every ``dsv4::`` op called directly (wrong dtype, wrong rank,
mismatched rows, an argument on another device, bad scalars), ``DSV4Cache``, ``PageAllocator``
(extend / truncate / evict / free) and ``Engine`` (build_step / run / accept / idle).

All cases share one engine whose request ``ROW`` holds 40 tokens; row ``FREE`` was never admitted.

A step that is not validated (``validate=False``, or compiled) with request rows outside the
cache's rows runs, and writes nothing but its own real rows' slots (docs/semantics.md §6): no
SWA key, ring row or compressed entry of another request, eagerly and through the compiled
step, whose metadata chain is fused into ``dsv4::step_metadata``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from dsv4_compile import (DSV4AttentionStack, DSV4AttnConfig, DSV4Cache, ForwardMode, StepInputs,
                          build_step_metadata)
from dsv4_compile.compile import compile_step
from dsv4_compile.engine import Engine
from dsv4_compile.fx_passes import DSV4PassManager
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.cache_checks import allocator_state, assert_unchanged, snapshot
from tests.support.compile_checks import fresh_compile_state
from tests.support.step_footprint import assert_only_footprint_changed, step_footprint

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)
ROW, FREE, LENGTH = 1, 2, 40
M = ForwardMode
META = "meta"


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[Engine], object]
    exc: type[Exception]
    names: tuple[str, ...]  # what the message must name (each a whole word or phrase)

    def param(self):
        return pytest.param(self, id=self.id)


@pytest.fixture(scope="module")
def engine():
    eng, rec = make_engine(TINY, max_requests=2, max_seq_len=512, capture_layers=False)
    assert eng.admit() == ROW
    with torch.no_grad():
        rec.run(M.EXTEND, {ROW: LENGTH})
    return eng


def _run_case(engine: Engine, case: Case) -> None:
    cache = engine.stack.cache
    before, state = snapshot(cache), allocator_state(engine.allocator)
    with pytest.raises(case.exc) as info, torch.no_grad():
        case.call(engine)
    for name in case.names:
        assert re.search(rf"(?<!\w){re.escape(name)}(?!\w)", str(info.value)), \
            f"the message {str(info.value)!r} does not name {name!r}"
    assert_unchanged(before, cache, f"a refused call ({case.id})")
    assert allocator_state(engine.allocator) == state, f"a refused call ({case.id}) changed the allocator"


# -- the step ----------------------------------------------------------------------------------
def _make(**bad) -> Callable[[Engine], object]:
    args = dict(mode=M.DECODE, req_rows=[ROW], seq_lens=[LENGTH], extend_lens=[1], out_cache_loc=[300])
    return lambda eng: StepInputs.make(**{**args, **bad})


MAKE_CASES = [
    Case("make-mode", _make(mode="decode"), TypeError, ("mode must be a ForwardMode",)),
    Case("make-float-rows", _make(req_rows=[1.5]), TypeError, ("req_rows",)),
    Case("make-float-loc", _make(out_cache_loc=torch.tensor([300.0])), TypeError, ("out_cache_loc",)),
    Case("make-2d-seq-lens", _make(seq_lens=[[LENGTH]]), ValueError, ("seq_lens",)),
    Case("make-lengths-differ", _make(extend_lens=[1, 1]), ValueError, ("extend_lens",)),
    Case("make-num-tokens-short", _make(out_cache_loc=[300, 301], num_tokens=1), ValueError, ("num_tokens",)),
    Case("make-num-tokens-float", _make(num_tokens=2.0), TypeError, ("num_tokens",)),
    Case("make-row-past-int32", _make(req_rows=[2**32 + ROW]), ValueError, ("req_rows",)),
    Case("make-length-past-int32", _make(seq_lens=torch.tensor([2**32 + LENGTH])), ValueError, ("seq_lens",)),
    Case("make-row-past-int64", _make(req_rows=[2**70]), ValueError, ("req_rows",)),
    Case("make-idle-negative", lambda eng: StepInputs.idle(-1), ValueError, ("num_tokens",)),
]


def _x(n: int, **kw) -> torch.Tensor:
    return torch.zeros(n, TINY.hidden_size, dtype=torch.bfloat16, **kw)


def _redo_last(eng: Engine) -> StepInputs:
    """A valid step: decode position LENGTH - 1 of ROW again (its slot is allocated)."""
    slot = eng.stack.cache.req_to_token[ROW, LENGTH - 1].item()
    return StepInputs.make(M.DECODE, [ROW], [LENGTH], [1], [slot])


def _forward(x=None, mode=None, **fields) -> Callable[[Engine], object]:
    """The stack's eager forward on ``_redo_last`` with the mode, step fields and ``x`` replaced
    (each a function of the good value; ``x`` has one row per ``out_cache_loc`` entry)."""
    def call(eng):
        step = _redo_last(eng)
        tensors = {name: fields[name](t) if name in fields else t
                   for name, t in zip(("req_rows", "seq_lens", "extend_lens", "out_cache_loc"), step.tensors())}
        step = StepInputs(mode or step.mode, **tensors)
        good_x = _x(step.out_cache_loc.shape[0])
        return eng.stack(x(good_x) if x else good_x, step)
    return call


def _i32(*values):
    return lambda t: torch.tensor(values, dtype=t.dtype)


FORWARD_CASES = [
    Case("forward-x-dtype", _forward(x=lambda x: x.float()), TypeError, ("x must be a bfloat16",)),
    Case("forward-x-device", _forward(x=lambda x: x.to(META)), ValueError, ("x is on meta",)),
    Case("forward-x-shape", _forward(x=lambda x: x[:, :7]), ValueError, ("x has shape",)),
    Case("forward-not-a-step", lambda eng: eng.stack(_x(1), _redo_last(eng).tensors()), TypeError,
         ("step must be a StepInputs",)),
    Case("forward-mode", _forward(mode="decode"), TypeError, ("step.mode",)),
    Case("forward-rows-dtype", _forward(req_rows=lambda t: t.float()), TypeError, ("step.req_rows",)),
    Case("forward-seq-lens-rank", _forward(seq_lens=lambda t: t[None]), ValueError, ("step.seq_lens",)),
    Case("forward-loc-device", _forward(out_cache_loc=lambda t: t.to(META)), ValueError, ("step.out_cache_loc",)),
    Case("forward-lengths-differ", _forward(extend_lens=_i32(1, 0)), ValueError, ("seq_lens",)),
    Case("forward-row-range", _forward(req_rows=_i32(5)), ValueError, ("step.req_rows",)),
    Case("forward-ext-past-seq", _forward(seq_lens=_i32(0)), ValueError, ("step.extend_lens",)),
    Case("forward-seq-past-capacity", _forward(seq_lens=_i32(600)), ValueError, ("step.seq_lens",)),
    Case("forward-decode-two", _forward(extend_lens=_i32(2), seq_lens=_i32(LENGTH),
                                        out_cache_loc=lambda t: torch.cat([t - 1, t])),
         ValueError, ("step.extend_lens",)),
    Case("forward-dummy-row-tokens", _forward(req_rows=_i32(0)), ValueError, ("step.req_rows",)),
    Case("forward-wrong-slot", _forward(out_cache_loc=lambda t: t + 1), ValueError, ("step.out_cache_loc",)),
    Case("forward-slot-zero", _forward(out_cache_loc=lambda t: t * 0), ValueError, ("step.out_cache_loc",)),
    Case("forward-free-row", _forward(req_rows=_i32(FREE), out_cache_loc=lambda t: t * 0), ValueError,
         ("step.out_cache_loc", f"request row {FREE}")),
    Case("forward-unallocated-position", _forward(seq_lens=_i32(LENGTH + 1), out_cache_loc=lambda t: t * 0),
         ValueError, ("step.out_cache_loc", f"position {LENGTH}")),
    Case("forward-loc-past-pool", _forward(out_cache_loc=lambda t: t + 10**6), ValueError, ("step.out_cache_loc",)),
    Case("forward-padding-slot", _forward(out_cache_loc=lambda t: torch.cat([t, t])), ValueError,
         ("step.out_cache_loc",)),
    Case("forward-idle-with-requests", _forward(mode=M.IDLE), ValueError, ("step.req_rows",)),
    Case("forward-draft-extend-on-compressed", _forward(mode=M.DRAFT_EXTEND), ValueError, ("step.mode",)),
    Case("forward-verify-too-long",
         _forward(mode=M.TARGET_VERIFY, extend_lens=_i32(TINY.max_draft_tokens + 1),
                  out_cache_loc=lambda t: torch.arange(TINY.max_draft_tokens + 1) + t - TINY.max_draft_tokens),
         ValueError, ("step.extend_lens", "max_draft_tokens")),
    Case("metadata-rows-dtype",
         lambda eng: build_step_metadata(StepInputs(M.DECODE, *(t.float() if i == 0 else t for i, t in
                                                                enumerate(_redo_last(eng).tensors()))),
                                         eng.stack.cache, TINY),
         TypeError, ("dsv4.expand_queries", "req_rows")),
    Case("stack-ratios-differ", lambda eng: DSV4AttentionStack(TINY.with_(compress_ratios=(0,)), eng.stack.cache),
         ValueError, ("compress_ratios",)),
    Case("stack-width-differs", lambda eng: DSV4AttentionStack(TINY.with_(hidden_size=128), eng.stack.cache),
         ValueError, ("hidden_size",)),
]


# -- the ops -----------------------------------------------------------------------------------
def _op_args(eng: Engine, op: str) -> dict:
    """Valid keyword arguments of ``dsv4::<op>`` for a 3-row step (positions 37..39 of ROW) on the
    engine's cache: layer 0 (ratio 0) and layer 1 (ratio 4)."""
    cache, t = eng.stack.cache, 3
    loc = cache.req_to_token[ROW, LENGTH - t:LENGTH].long()
    step = StepInputs.make(M.EXTEND, [ROW], [LENGTH], [t], loc)
    meta = build_step_metadata(step, cache, TINY)
    swa, c4 = cache.layers[0], cache.layers[1]
    heads, index_heads, inv_freq = TINY.num_heads, TINY.index_n_heads, eng.stack.layers[1].inv_freq
    bf16 = dict(dtype=torch.bfloat16)
    rows = dict(req_of_row=meta.req_of_row, seq_lens_causal=meta.seq_lens_causal)
    maps = dict(req_to_token=cache.req_to_token, req_to_page=cache.req_to_page, full_to_swa=cache.full_to_swa)
    steps = dict(zip(("req_rows", "seq_lens", "extend_lens", "out_cache_loc"), step.tensors()))
    return {
        "store_kv": dict(cache=swa.swa_kv, slots=meta.swa_out_loc, k=torch.randn(t, 512, **bf16), page_size=256),
        "dequant_kv": dict(cache=swa.swa_kv, slots=meta.swa_out_loc, page_size=256),
        "store_index_k": dict(cache=c4.index_k, slots=meta.c4_out_loc, k=torch.randn(t, 128, **bf16), page_size=64),
        "compress_kv": dict(state=c4.kv_state, kv=torch.randn(t, 1024), score=torch.randn(t, 1024),
                            ape=torch.randn(4, 1024), **rows, extend_start=meta.extend_start,
                            extend_end=meta.extend_end, norm_weight=torch.ones(512), inv_freq=inv_freq, ratio=4,
                            ring=c4.ring, rotate=False, eps=1e-6),
        "compress_kv_store": dict(state=c4.kv_state, cache=c4.extra_kv, slots=meta.c4_out_loc,
                                  kv=torch.randn(t, 1024), score=torch.randn(t, 1024), ape=torch.randn(4, 1024),
                                  **rows, extend_start=meta.extend_start, extend_end=meta.extend_end,
                                  norm_weight=torch.ones(512), inv_freq=inv_freq, ratio=4, ring=c4.ring, rotate=False,
                                  eps=1e-6, page_size=c4.extra_page_size),
        "indexer_prepare_q": dict(q=torch.randn(t, index_heads, 128, **bf16),
                                  weights=torch.randn(t, index_heads, **bf16), positions=meta.positions,
                                  inv_freq=inv_freq, weight_scale=0.1),
        "indexer_topk": dict(q_fp8=torch.randn(t, index_heads, 128).to(torch.float8_e4m3fn),
                             w=torch.randn(t, index_heads), index_cache=c4.index_k, page_table=meta.page_table,
                             visible=meta.c4_visible, topk=64),
        "sparse_attn": dict(q=torch.randn(t, heads, 512, **bf16), swa_cache=swa.swa_kv, swa_page_size=256,
                            swa_indices=meta.swa_indices, swa_lengths=meta.swa_lengths,
                            extra_cache=c4.extra_kv, extra_page_size=64,
                            extra_indices=torch.full((t, 64), -1, dtype=torch.int32),
                            extra_lengths=meta.c4_topk_lengths, attn_sink=torch.zeros(heads),
                            softmax_scale=TINY.softmax_scale),
        "sparse_attn_inverse_rope": dict(q=torch.randn(t, heads, 512, **bf16), swa_cache=swa.swa_kv, swa_page_size=256,
                                         swa_indices=meta.swa_indices, swa_lengths=meta.swa_lengths, extra_cache=None,
                                         extra_page_size=0, extra_indices=None, extra_lengths=None,
                                         attn_sink=torch.zeros(heads), softmax_scale=TINY.softmax_scale,
                                         positions=meta.positions, inv_freq=inv_freq),
        "expand_queries": steps,
        "build_page_table": dict(req_to_page=cache.req_to_page, **rows),
        "build_swa_metadata": dict(req_to_token=cache.req_to_token, full_to_swa=cache.full_to_swa, **rows,
                                   out_cache_loc=loc),
        "build_c4_metadata": dict(**rows, out_cache_loc=loc, topk=64, num_request_rows=cache.req_to_token.shape[0]),
        "build_c128_metadata": dict(page_table=meta.page_table, **rows, out_cache_loc=loc,
                                    num_request_rows=cache.req_to_token.shape[0]),
        "step_metadata": dict(**steps, **maps, topk=64),
    }[op]


def _op_case(op: str, arg: str, change: Callable, exc: type[Exception], what: str) -> Case:
    """``dsv4::<op>`` with argument ``arg`` replaced by ``change(good value)``."""
    def call(eng):
        args = _op_args(eng, op)
        return getattr(torch.ops.dsv4, op)(**{**args, arg: change(args[arg])})
    return Case(f"{op}-{arg}-{what}", call, exc, (f"dsv4.{op}", arg))


def _dtype(to):
    return lambda t: t.to(to)


def _on_meta(t):
    return t.to(META)


def _rank_up(t):
    return t.unsqueeze(0)


def _flat(t):
    return t.flatten()


def _drop_row(t):
    return t[:-1]


def _value(v):
    return lambda _: v


F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64
OP_CASES = [
    _op_case("store_kv", "k", _dtype(F32), TypeError, "dtype"),
    _op_case("store_kv", "slots", _rank_up, ValueError, "rank"),
    _op_case("store_kv", "k", _drop_row, ValueError, "rows"),
    _op_case("store_kv", "page_size", _value(64), ValueError, "page-size"),
    _op_case("store_kv", "slots", _on_meta, ValueError, "device"),
    _op_case("dequant_kv", "slots", _dtype(F32), TypeError, "dtype"),
    _op_case("dequant_kv", "cache", _flat, ValueError, "rank"),
    _op_case("dequant_kv", "slots", _on_meta, ValueError, "device"),
    _op_case("store_index_k", "cache", _dtype(torch.int8), TypeError, "dtype"),
    _op_case("store_index_k", "k", lambda t: t[:, :64], ValueError, "width"),
    _op_case("store_index_k", "slots", _drop_row, ValueError, "rows"),
    _op_case("store_index_k", "k", _on_meta, ValueError, "device"),
    _op_case("compress_kv", "kv", _dtype(I64), TypeError, "dtype"),
    _op_case("compress_kv", "state", _flat, ValueError, "rank"),
    _op_case("compress_kv", "req_of_row", _drop_row, ValueError, "rows"),
    _op_case("compress_kv", "ratio", _value(3), ValueError, "value"),
    _op_case("compress_kv", "extend_end", _on_meta, ValueError, "device"),
    _op_case("compress_kv", "inv_freq", lambda t: t[:16], ValueError, "width"),
    _op_case("compress_kv", "norm_weight", lambda t: t[:96], ValueError, "width"),
    _op_case("compress_kv", "norm_weight", _dtype(I64), TypeError, "dtype"),
    _op_case("compress_kv", "eps", _value(-1.0), ValueError, "value"),
    _op_case("compress_kv_store", "cache", _dtype(torch.int8), TypeError, "dtype"),
    _op_case("compress_kv_store", "page_size", _value(256), ValueError, "page-size"),
    _op_case("compress_kv_store", "slots", _drop_row, ValueError, "rows"),
    _op_case("compress_kv_store", "kv", _dtype(I64), TypeError, "dtype"),
    _op_case("compress_kv_store", "cache", _on_meta, ValueError, "device"),
    _op_case("compress_kv_store", "inv_freq", lambda t: t[:16], ValueError, "width"),
    _op_case("indexer_prepare_q", "positions", _dtype(F32), TypeError, "dtype"),
    _op_case("indexer_prepare_q", "q", lambda t: t[0], ValueError, "rank"),
    _op_case("indexer_prepare_q", "weights", _drop_row, ValueError, "rows"),
    _op_case("indexer_prepare_q", "positions", _on_meta, ValueError, "device"),
    _op_case("indexer_prepare_q", "inv_freq", lambda t: t[:16], ValueError, "width"),
    _op_case("indexer_topk", "q_fp8", _dtype(BF16), TypeError, "dtype"),
    _op_case("indexer_topk", "page_table", _flat, ValueError, "rank"),
    _op_case("indexer_topk", "visible", _drop_row, ValueError, "rows"),
    _op_case("indexer_topk", "topk", _value(10), ValueError, "value"),
    _op_case("indexer_topk", "page_table", _on_meta, ValueError, "device"),
    _op_case("sparse_attn", "q", _dtype(F32), TypeError, "dtype"),
    _op_case("sparse_attn", "swa_indices", _flat, ValueError, "rank"),
    _op_case("sparse_attn", "extra_lengths", _drop_row, ValueError, "rows"),
    _op_case("sparse_attn", "swa_indices", lambda t: t[:, :100], ValueError, "width"),
    _op_case("sparse_attn", "swa_lengths", _on_meta, ValueError, "device"),
    _op_case("sparse_attn", "softmax_scale", _value(float("nan")), ValueError, "value"),
    _op_case("sparse_attn_inverse_rope", "positions", _dtype(F32), TypeError, "dtype"),
    _op_case("sparse_attn_inverse_rope", "positions", _drop_row, ValueError, "rows"),
    _op_case("sparse_attn_inverse_rope", "inv_freq", lambda t: t[:16], ValueError, "width"),
    _op_case("sparse_attn_inverse_rope", "inv_freq", _on_meta, ValueError, "device"),
    _op_case("sparse_attn_inverse_rope", "q", _dtype(F32), TypeError, "dtype"),
    _op_case("expand_queries", "req_rows", _dtype(F32), TypeError, "dtype"),
    _op_case("expand_queries", "out_cache_loc", _rank_up, ValueError, "rank"),
    _op_case("expand_queries", "seq_lens", _drop_row, ValueError, "rows"),
    _op_case("expand_queries", "out_cache_loc", _on_meta, ValueError, "device"),
    _op_case("build_page_table", "seq_lens_causal", _dtype(F32), TypeError, "dtype"),
    _op_case("build_page_table", "req_to_page", _flat, ValueError, "rank"),
    _op_case("build_page_table", "seq_lens_causal", _drop_row, ValueError, "rows"),
    _op_case("build_page_table", "req_of_row", _on_meta, ValueError, "device"),
    _op_case("build_swa_metadata", "full_to_swa", _dtype(F32), TypeError, "dtype"),
    _op_case("build_swa_metadata", "req_to_token", lambda t: t[:, :300], ValueError, "width"),
    _op_case("build_swa_metadata", "out_cache_loc", _drop_row, ValueError, "rows"),
    _op_case("build_swa_metadata", "full_to_swa", _on_meta, ValueError, "device"),
    _op_case("build_c4_metadata", "seq_lens_causal", _dtype(F32), TypeError, "dtype"),
    _op_case("build_c4_metadata", "out_cache_loc", _drop_row, ValueError, "rows"),
    _op_case("build_c4_metadata", "topk", _value(0), ValueError, "value"),
    _op_case("build_c4_metadata", "out_cache_loc", _on_meta, ValueError, "device"),
    _op_case("build_c4_metadata", "req_of_row", _drop_row, ValueError, "rows"),
    _op_case("build_c4_metadata", "num_request_rows", _value(-1), ValueError, "value"),
    _op_case("build_c128_metadata", "out_cache_loc", _dtype(F32), TypeError, "dtype"),
    _op_case("build_c128_metadata", "page_table", _flat, ValueError, "rank"),
    _op_case("build_c128_metadata", "page_table", _drop_row, ValueError, "rows"),
    _op_case("build_c128_metadata", "seq_lens_causal", _on_meta, ValueError, "device"),
    _op_case("build_c128_metadata", "req_of_row", _dtype(F32), TypeError, "dtype"),
    _op_case("build_c128_metadata", "num_request_rows", _value(-1), ValueError, "value"),
    _op_case("step_metadata", "extend_lens", _dtype(F32), TypeError, "dtype"),
    _op_case("step_metadata", "req_to_page", lambda t: t[:, :1], ValueError, "shape"),
    _op_case("step_metadata", "extend_lens", _drop_row, ValueError, "rows"),
    _op_case("step_metadata", "topk", _value(0), ValueError, "value"),
    _op_case("step_metadata", "req_to_token", _on_meta, ValueError, "device"),
]


def _flashmla_on_meta(eng: Engine):
    args = {k: v.to(META) if isinstance(v, torch.Tensor) else v for k, v in _op_args(eng, "sparse_attn").items()}
    return torch.ops.dsv4.sparse_attn_flashmla(**{**args, "q": args["q"].float()})


OP_CASES.append(Case("sparse_attn_flashmla-q-dtype", _flashmla_on_meta, TypeError,
                     ("dsv4.sparse_attn_flashmla", "q")))


# -- cache, allocator, engine ------------------------------------------------------------------
def _alloc(method: str, *args) -> Callable[[Engine], object]:
    return lambda eng: getattr(eng.allocator, method)(*args)


def _engine(method: str, *args, **kwargs) -> Callable[[Engine], object]:
    return lambda eng: getattr(eng, method)(*args, **kwargs)


def _cache(**bad) -> Callable[[Engine], object]:
    return lambda eng: DSV4Cache(TINY, **{**dict(max_requests=2, max_seq_len=512), **bad})


def _config(**bad) -> Callable[[Engine], object]:
    return lambda eng: TINY.with_(**bad)


HOST_CASES = [
    Case("config-rank-negative", _config(q_lora_rank=-1), ValueError, ("DSV4AttnConfig.q_lora_rank=-1",)),
    Case("config-width-float", _config(hidden_size=256.5), ValueError, ("DSV4AttnConfig.hidden_size=256.5",)),
    Case("config-eps-nan", _config(rms_norm_eps=float("nan")), ValueError, ("DSV4AttnConfig.rms_norm_eps=nan",)),
    Case("config-theta-zero", _config(rope_theta=0.0), ValueError, ("DSV4AttnConfig.rope_theta=0.0",)),
    Case("config-yarn-length", _config(yarn_original_max_position=-1), ValueError,
         ("DSV4AttnConfig.yarn_original_max_position=-1",)),
    Case("config-ratios-list", _config(compress_ratios=[0, 4]), ValueError, ("DSV4AttnConfig.compress_ratios",)),
    Case("config-topk", _config(index_topk=63), ValueError, ("DSV4AttnConfig.index_topk=63",)),
    Case("cache-max-requests", _cache(max_requests=0), ValueError, ("max_requests",)),
    Case("cache-max-seq-len", _cache(max_seq_len=300), ValueError, ("max_seq_len",)),
    Case("cache-full-pages", _cache(num_full_pages=1), ValueError, ("num_full_pages",)),
    Case("cache-no-full-pages", _cache(num_full_pages=0), ValueError, ("num_full_pages",)),
    Case("cache-float-requests", _cache(max_requests=1.5), TypeError, ("max_requests",)),
    Case("extend-free-row", _alloc("extend", FREE, 1), ValueError, (f"row {FREE}",)),
    Case("extend-requests-list", _alloc("extend_requests", [ROW]), TypeError, ("tokens must be a mapping",)),
    Case("extend-float-row", _alloc("extend", 1.0, 1), TypeError, ("row must be an int",)),
    Case("extend-negative", _alloc("extend", ROW, -3), ValueError, ("num_tokens",)),
    Case("extend-tensor-count", _alloc("extend", ROW, torch.tensor(3)), TypeError, ("num_tokens",)),
    Case("extend-past-capacity", _alloc("extend", ROW, 512 - LENGTH + 1), ValueError, ("num_tokens", "max_seq_len")),
    Case("truncate-past-length", _alloc("truncate", ROW, LENGTH + 1), ValueError, ("new_len",)),
    Case("truncate-too-deep", _alloc("truncate", ROW, LENGTH - TINY.max_draft_tokens - 1), ValueError,
         ("new_len", "max_draft_tokens")),
    Case("truncate-float", _alloc("truncate", ROW, 39.0), TypeError, ("new_len",)),
    Case("truncate-negative-row", _alloc("truncate", -1, 39), ValueError, ("row=-1",)),
    Case("evict-free-row", _alloc("evict_swa", FREE), ValueError, (f"row {FREE}",)),
    Case("free-free-row", _alloc("free", FREE), ValueError, (f"row {FREE}",)),
    Case("free-bool-row", _alloc("free", True), TypeError, ("row must be an int",)),
    Case("build-mode", _engine("build_step", "extend", {ROW: 1}), TypeError, ("mode must be a ForwardMode",)),
    Case("build-tokens-list", _engine("build_step", M.EXTEND, [ROW]), TypeError, ("tokens must be a mapping",)),
    Case("build-float-count", _engine("build_step", M.EXTEND, {ROW: 2.0}), TypeError, ("num_tokens",)),
    Case("build-pad", _engine("build_step", M.EXTEND, {ROW: 1}, pad_tokens=-1), ValueError, ("pad_tokens",)),
    Case("build-free-row", _engine("build_step", M.EXTEND, {ROW: 1, FREE: 1}), ValueError, (f"row {FREE}",)),
    Case("build-past-capacity", _engine("build_step", M.EXTEND, {ROW: 1000}), ValueError, ("num_tokens",)),
    Case("run-inputs", _engine("run", M.EXTEND, [_x(1)]), TypeError, ("inputs must be a mapping",)),
    Case("run-dtype", _engine("run", M.EXTEND, {ROW: _x(1).float()}), TypeError, (f"inputs[{ROW}]",)),
    Case("run-device", _engine("run", M.EXTEND, {ROW: _x(1, device=META)}), ValueError,
         (f"inputs[{ROW}] is on meta",)),
    Case("run-width", _engine("run", M.EXTEND, {ROW: _x(1)[:, :7]}), ValueError, (f"inputs[{ROW}]",)),
    Case("run-decode-two", _engine("run", M.DECODE, {ROW: _x(2)}), ValueError, ("step.extend_lens",)),
    Case("run-verify-too-long", _engine("run", M.TARGET_VERIFY, {ROW: _x(TINY.max_draft_tokens + 1)}), ValueError,
         ("step.extend_lens", "max_draft_tokens")),
    Case("run-draft-extend", _engine("run", M.DRAFT_EXTEND, {ROW: _x(1)}), ValueError, ("step.mode",)),
    Case("accept-more-than-drafts", _engine("accept", ROW, 2, 1), ValueError, ("num_accepted",)),
    Case("accept-negative", _engine("accept", ROW, -1, 1), ValueError, ("num_accepted",)),
    Case("accept-too-many-drafts", _engine("accept", ROW, 0, TINY.max_draft_tokens + 1), ValueError,
         ("num_drafts",)),
    Case("accept-free-row", _engine("accept", FREE, 0, 1), ValueError, (f"row {FREE}",)),
    Case("idle-negative", _engine("idle", -1), ValueError, ("num_tokens",)),
]


@pytest.mark.parametrize("case", [c.param() for c in MAKE_CASES + FORWARD_CASES + OP_CASES + HOST_CASES])
def test_bad_input_is_refused_by_name_and_changes_nothing(engine, case):
    _run_case(engine, case)


# -- unvalidated steps ---------------------------------------------------------------------------
def _step_with_foreign_rows(eng: Engine, victim: int) -> tuple[StepInputs, StepInputs]:
    """An extend step of the engine's first request at position 127 (it completes a c4 and a c128
    window) beside two requests on rows -1 and R (the cache's row count) that carry ``victim``'s
    slots at positions 127, 254 and 255 (each completing a window but 254), padded to 6 rows.
    Returns it and the step of its real request alone (what it may write)."""
    row, rows = eng.allocator.active_rows[0], eng.stack.cache.req_to_token.shape[0]
    own = eng.allocator.extend(row, 1)
    foreign = eng.stack.cache.req_to_token[victim, [127, 254, 255]].long()
    step = StepInputs.make(M.EXTEND, [row, -1, rows], [128, 128, 256], [1, 1, 2], torch.cat([own, foreign]),
                           num_tokens=6)
    return step, StepInputs.make(M.EXTEND, [row], [128], [1], own, num_tokens=6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_unvalidated_step_with_out_of_range_request_rows_writes_only_its_own_slots(compiled):
    eng, rec = make_engine(TINY, max_requests=2, max_seq_len=512, capture_layers=False)
    row, victim = eng.admit(), eng.admit()
    passes = DSV4PassManager()
    with torch.no_grad(), fresh_compile_state():
        rec.run(M.EXTEND, {row: 127, victim: 256})
        step, own = _step_with_foreign_rows(eng, victim)
        cache = eng.stack.cache
        before, footprint = snapshot(cache), step_footprint(cache, own)
        x = torch.randn(step.num_tokens, TINY.hidden_size, dtype=torch.bfloat16)
        out = compile_step(eng.stack, passes=passes)(x, step) if compiled else eng.stack(x, step, validate=False)
    assert torch.isfinite(out.float()).all()
    assert_only_footprint_changed(before, cache, footprint, "a step with out-of-range request rows")
    assert passes.matched_count == compiled  # the compiled step runs the fused metadata op
