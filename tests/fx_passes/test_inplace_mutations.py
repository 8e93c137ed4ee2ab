"""InplaceMutationsPass: a mutating ``dsv4::`` op whose buffers are whole graph inputs, read by
nothing after the write, is called in place in the post-grad graph (where Inductor would decompose
its ``auto_functionalized_v2`` node to the same call), and anything else is left to Inductor.

The pass is told to match CPU tensors (by default it matches CUDA ones only). Compiled functions
write the same bytes as eager; a stack's steps give the same outputs and caches with and without
the pass."""

import pytest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode, layout
from dsv4_compile.fx_passes import DSV4PassManager, InplaceMutationsPass
from dsv4_compile.fx_passes.pass_manager import default_passes
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.cache_checks import assert_caches_equal
from tests.support.compile_checks import fresh_compile_state
from tests.support.oracle_asserts import assert_outputs_match

PAGE = layout.SWA_PAGE_SIZE
STORE = "dsv4.store_kv.default (in place)"


def _inputs():
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(4, layout.model1_page_bytes(PAGE), dtype=torch.uint8)
    return cache, torch.tensor([PAGE + 3, -1, 2 * PAGE + 7, 5]), torch.randn(4, 512, generator=gen).bfloat16()


def _compiled(fn, devices=("cpu",)):
    """(matches, the graph's dsv4 ops, eager's result and cache, the compiled one's) of ``fn(cache,
    slots, kv)``."""
    inplace = InplaceMutationsPass(devices)
    passes = DSV4PassManager([inplace])
    cache, slots, kv = _inputs()
    want_cache, got_cache = cache.clone(), cache.clone()
    with torch.no_grad(), fresh_compile_state():
        got = torch.compile(fn, fullgraph=True, options={"post_grad_custom_post_pass": passes})(got_cache, slots, kv)
        want = fn(want_cache, slots, kv)
    return inplace.matched_count, passes.last_ops, (want, want_cache), (got, got_cache)


def _store_then_read(cache, slots, kv):
    torch.ops.dsv4.store_kv(cache, slots, kv, PAGE)
    return cache.float().sum(dim=1)  # reads the written cache: the new value, after the call


def _store_into_rows(cache, slots, kv):
    torch.ops.dsv4.store_kv(cache[1:], slots - PAGE, kv, PAGE)  # a view of the input


def _store_into_copy(cache, slots, kv):
    copy = cache.clone()  # an intermediate, not a graph input
    torch.ops.dsv4.store_kv(copy, slots, kv, PAGE)
    return copy


def _stores_twice(cache, slots, kv):
    torch.ops.dsv4.store_kv(cache, slots, kv, PAGE)
    first = cache.sum(dtype=torch.int64)  # between the writes: the first's bytes
    torch.ops.dsv4.store_kv(cache, slots.flip(0), -kv, PAGE)
    return first


def _old_row_used_after_the_write(cache, slots, kv):
    row = cache[1]  # a view, made before the write
    total = row.float().sum()  # read before the write, and feeding it
    old = row.float() * 2  # pointwise: Inductor may compute it where its user runs, after the write
    torch.ops.dsv4.store_kv(cache, slots, kv + total.bfloat16() * 0, PAGE)
    return old * 3


@pytest.mark.parametrize("fn, matches", [(_store_then_read, 1), (_stores_twice, 2), (_store_into_rows, 0),
                                         (_store_into_copy, 0), (_old_row_used_after_the_write, 0)])
def test_whole_input_writes_called_in_place(fn, matches):
    """Writes into a whole graph input become in-place calls (each of two writes of one input too);
    a write into a view of an input or into an intermediate, or one whose input's old bytes are
    read after it (here through a view and a pointwise op), stays with Inductor. Every way, the
    compiled function returns and writes eager's values."""
    count, ops, (want, want_cache), (got, got_cache) = _compiled(fn)
    assert count == matches
    assert ops.count(STORE) == (2 if fn is _stores_twice else 1)
    assert torch.equal(got_cache, want_cache)
    assert (want if fn is _store_into_copy else want_cache).any()  # the test writes something
    if want is not None:
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class _ReadOldValueAfterWrite(InplaceMutationsPass):
    """Gives the pass a graph where the written input is read after the write (its old value, by
    functional semantics); records the matches, then restores the graph for Inductor."""

    def apply(self, graph):
        write = next(iter(graph.find_nodes(op="call_function", target=torch.ops.higher_order.auto_functionalized_v2)))
        cache = write.kwargs["_all_bases"][0]
        with graph.inserting_after(write):
            reader = graph.call_function(torch.ops.aten.sum.default, (cache,))
        self.found = super().apply(graph)
        graph.erase_node(reader)
        return self.found


def test_input_read_after_its_write_left_to_inductor():
    check = _ReadOldValueAfterWrite(("cpu",))
    with torch.no_grad(), fresh_compile_state():
        torch.compile(_store_then_read, fullgraph=True,
                      options={"post_grad_custom_post_pass": DSV4PassManager([check])})(*_inputs())
    assert check.found == 0 and check.last_ops == [STORE]


def test_other_devices_left_to_inductor():
    assert _compiled(_store_then_read, devices=("cuda",))[0] == 0  # CUDA only, CPU tensors


def test_uuid_follows_the_devices():
    assert InplaceMutationsPass(("cpu",)).uuid() != InplaceMutationsPass().uuid()


@torch.no_grad()
def test_stack_steps_equal_inductors_decomposition():
    """A CSA and an HCA layer (every cache write and compressor state update) compiled with the
    default passes, with and without this one: a prefill and decode steps give the same outputs
    and caches, bit for bit, and the oracle's; every mutating call of the graph is rewritten."""
    config = DSV4AttnConfig.from_name("tiny").with_(index_topk=64, compress_ratios=(4, 128))
    engines, outputs, inplace = [], [], InplaceMutationsPass(("cpu",))
    with fresh_compile_state():
        for with_pass in (False, True):
            eng, rec = make_engine(config, max_requests=2, max_seq_len=512, capture_layers=False)
            passes = [p for p in default_passes(("cpu",)) if not isinstance(p, InplaceMutationsPass)]
            manager = DSV4PassManager(passes + [inplace] if with_pass else passes)
            eng.forward = torch.compile(eng.stack, fullgraph=True, options={"post_grad_custom_post_pass": manager})
            rows = [eng.admit(), eng.admit()]
            steps = [rec.run(ForwardMode.EXTEND, {rows[0]: 40, rows[1]: 9})]
            for _ in range(3):
                steps.append(rec.run(ForwardMode.DECODE, {r: 1 for r in rows}))
            assert_outputs_match(rec, steps[-1])
            engines.append(eng)
            outputs.append(steps)
    for want, got in zip(*outputs):
        assert all(torch.equal(want[row], got[row]) for row in want)
    assert_caches_equal(engines[0].stack.cache, engines[1].stack.cache)
    in_place = [op for op in inplace.last_ops if op.endswith("(in place)")]
    assert len(in_place) >= 5 and inplace.matched_count >= 2 * len(in_place)  # two graphs: prefill, decode
