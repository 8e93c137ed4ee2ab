"""OverlapCacheWritesPass: a step's cache writes get ``side_stream=True`` and move up to just after
what they depend on, and a ``dsv4::join_side_stream`` goes before the first node that must follow
them; in Inductor's generated code the work between the two (the query's products) is what the
side stream overlaps.

Functions are compiled with Inductor, the pass told to match CPU tensors (by default it matches
CUDA ones only). On the CPU the flag and the join change nothing, so results equal eager's bit for
bit; what is checked here is the rewritten graph and the order of Inductor's calls. The GPU run
(two streams, CUDA graphs) is in ``tests/gpu/test_side_stream_gpu.py``."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from dsv4_compile import layout
from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.fx_passes import DSV4PassManager, InplaceMutationsPass, OverlapCacheWritesPass
from dsv4_compile.fx_passes.pass_manager import default_passes
from tests.support.compile_checks import fresh_compile_state
from tests.support.hf_model import eager_and_compiled_prefill

ops = torch.ops.dsv4
PAGE = 4
JOIN = "join_side_stream"


class Recorded(OverlapCacheWritesPass):
    """The pass, keeping the rewritten graph's dsv4 calls and products in order: ``(op name,
    side_stream flag of a write)``."""

    def apply(self, graph):
        matches = super().apply(graph)
        self.calls = [(_name(n), n.args[-1] if _name(n) == "store_kv" else None) for n in graph.nodes if _name(n)]
        return matches


def _name(node) -> str:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return ""
    if target.namespace == "dsv4" or target is torch.ops.aten.mm.default:
        return target._schema.name.split("::")[1]
    return ""


def _inputs():
    """(cache holding keys at the slots, slots, new keys, x, w)."""
    gen = torch.Generator().manual_seed(0)
    cache, slots = torch.zeros(3, layout.model1_page_bytes(PAGE), dtype=torch.uint8), torch.tensor([1, -1, 9, 6])
    ops.store_kv(cache, slots, torch.randn(4, 512, generator=gen).bfloat16(), PAGE)
    return (cache, slots, torch.randn(4, 512, generator=gen).bfloat16(),
            torch.randn(4, 64, generator=gen).bfloat16(), torch.randn(256, 64, generator=gen).bfloat16())


def _compile(fn, devices=("cpu",)):
    """(pass, eager (cache, outputs), compiled (cache, outputs), Inductor's code) of ``fn`` at
    :func:`_inputs`."""
    overlap = Recorded(devices)
    passes = DSV4PassManager([InplaceMutationsPass(devices), overlap])
    options = {"post_grad_custom_post_pass": passes, **EXACT_NUMERICS}
    cache, *rest = _inputs()
    want, got = cache.clone(), cache.clone()
    with torch.no_grad(), fresh_compile_state():
        eager = fn(want, *rest)
        compiled, code = run_and_get_code(torch.compile(fn, fullgraph=True, options=options), got, *rest)
    return overlap, (want, eager), (got, compiled), "\n".join(code)


def _calls_in_code(code: str) -> list[str]:
    """The dsv4 ops and extern products Inductor's code calls, in order (``store_kv+side`` for a
    write flagged for the side stream)."""
    out = []
    for line in code.splitlines():
        m = re.search(r"torch\.ops\.dsv4\.(\w+)\.default\((.*)\)\s*$", line)
        if m:
            out.append(m.group(1) + ("+side" if m.group(2).endswith("True") else ""))
        elif re.search(r"extern_kernels\.(mm|addmm)\(", line):
            out.append("mm")
    return out


def _same(want, got) -> bool:
    (want_cache, want_out), (got_cache, got_out) = want, got
    want_out, got_out = torch.utils._pytree.tree_leaves(want_out), torch.utils._pytree.tree_leaves(got_out)
    return (not torch.equal(want_cache, _inputs()[0]) and torch.equal(want_cache, got_cache)
            and all(torch.equal(w, g) for w, g in zip(want_out, got_out)))


def test_write_moves_above_the_product_and_its_join_waits_for_the_next_read():
    """A read of the cache, a product, the write, a second read: the write moves up to just after
    the first read (not above it), the join goes before the second; Inductor calls the write, the
    product, the join, the read, in that order."""
    def fn(cache, slots, k, x, w):
        old = ops.dequant_kv(cache, slots, PAGE)
        q = x @ w.t()
        ops.store_kv(cache, slots, k, PAGE)
        return old, ops.dequant_kv(cache, slots, PAGE), q

    overlap, want, got, code = _compile(fn)
    assert overlap.matched_count == 1
    assert overlap.calls == [("dequant_kv", None), ("store_kv", True), ("mm", None),
                                                         (JOIN, None), ("dequant_kv", None)]
    assert _calls_in_code(code) == ["dequant_kv", "store_kv+side", "mm", JOIN, "dequant_kv"]
    assert _same(want, got)


def test_write_stays_below_a_read_through_a_split_and_a_pointwise_op():
    """A read of the cache's old bytes through one item of a ``split`` and a cast that Inductor
    inlines into the reduction after it: the write stays below the reduction, where the read runs,
    and the outputs are eager's."""
    def fn(cache, slots, k, x, w):
        first, _ = cache.split([1, 2])
        old = first.float().sum(dim=1)
        ops.store_kv(cache, slots, k, PAGE)
        return old, x @ w.t()

    overlap, want, got, code = _compile(fn)
    assert overlap.matched_count == 1
    assert _same(want, got)


def test_write_nothing_reads_is_joined_before_the_output():
    """The join still comes (a captured graph must end with its side branch joined), after the
    product the outputs read."""
    def fn(cache, slots, k, x, w):
        ops.store_kv(cache, slots, k, PAGE)
        return x @ w.t()

    overlap, want, got, code = _compile(fn)
    assert overlap.matched_count == 1
    assert _calls_in_code(code) == ["store_kv+side", "mm", JOIN]
    assert _same(want, got)


def test_writes_keep_their_order_and_stop_at_a_write():
    """Two writes of one cache keep their order (a write is a barrier for the other), one join for
    both before the read."""
    def fn(cache, slots, k, x, w):
        ops.store_kv(cache, slots, k, PAGE)
        q = x @ w.t()
        ops.store_kv(cache, slots[:2], k[:2] * 2, PAGE)
        return ops.dequant_kv(cache, slots, PAGE), q

    overlap, want, got, code = _compile(fn)
    assert overlap.matched_count == 2
    calls = _calls_in_code(code)
    assert calls.count(JOIN) == 1 and calls.index(JOIN) > calls.index("mm")
    assert [c for c in calls if c.startswith("store_kv")] == ["store_kv+side"] * 2
    assert _same(want, got)


def test_cuda_only_by_default():
    def fn(cache, slots, k, x, w):
        ops.store_kv(cache, slots, k, PAGE)
        return x @ w.t()

    overlap, want, got, code = _compile(fn, devices=("cuda",))
    assert overlap.matched_count == 0 and JOIN not in code
    assert _same(want, got)


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@torch.no_grad()
def test_model_step_writes_beside_the_query_products():
    """compile_step of a 3-layer model (sliding, CSA, HCA) with the default passes and this one: the
    six writes (three keys, three compressors) run on the side stream, four joins (the CSA layer's
    indexer reads its keys before the attention reads the rest), and in Inductor's code each join
    follows a product issued after the write before it; logits and every cache buffer equal the
    eager backend's, bit for bit."""
    overlap = OverlapCacheWritesPass(("cpu",))
    passes = DSV4PassManager([*default_passes(("cpu",)), overlap])
    ((want, written), (got, caches)), code = run_and_get_code(eager_and_compiled_prefill, passes, 1)
    assert overlap.matched_count == 6
    assert overlap.last_ops.count(f"dsv4.{JOIN}.default (in place)") == 4
    calls = _calls_in_code("\n".join(code))
    writes = [i for i, c in enumerate(calls) if c.endswith("+side")]
    joins = [i for i, c in enumerate(calls) if c == JOIN]
    assert len(writes) == 6 and len(joins) == 4
    for j in joins:
        last_write = max(i for i in writes if i < j)
        assert any(c in ("mm", "linears") for c in calls[last_write + 1:j]), calls[last_write:j + 1]
    assert torch.equal(got, want)
    assert all(torch.equal(t, w) for t, w in zip(caches, written))


def test_a_read_through_a_view_made_before_the_write_waits_for_the_join():
    """A hand-built post-grad graph: a view of the cache made before the write and read after it
    (the compiled graphs of this package make their views after the write, but a view is the same
    memory wherever it is made); the join goes before that read, not at the output."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    cache, slots, k, x, w = (graph.placeholder(n) for n in ("cache", "slots", "k", "x", "w"))
    for node, value in zip((cache, slots, k, x, w), _inputs()):
        node.meta["val"] = value
    head = graph.call_function(aten.slice.Tensor, (cache, 0, 0, 2))
    q = graph.call_function(aten.mm.default, (x, graph.call_function(aten.t.default, (w,))))
    graph.call_function(ops.store_kv.default, (cache, slots, k, PAGE))
    total = graph.call_function(aten.sum.default, (head,))
    graph.output((q, total))
    overlap = Recorded(("cpu",))
    overlap(graph)
    assert overlap.matched_count == 1
    order = [n for n in graph.nodes if n.op == "call_function"]
    join = next(n for n in order if n.target is ops.join_side_stream.default)
    assert order.index(join) == order.index(total) - 1
