"""FuseEntryStorePass: a compressor's ``dsv4::compress_kv`` and the cache write that reads its
entries (``store_kv`` for 512-wide entries, ``store_index_k`` for 128-wide ones) become one
``dsv4::compress_kv_store`` node, in Dynamo's graph or, without that stage, in the post-grad graph;
the cache and the compressor state are written as before.

Functions holding the pair are compiled with Inductor and the pass told to match CPU tensors (by
default it matches CUDA ones only, where the fused op is one launch pair less a kernel). On the CPU
the fused op is the reference, the unfused math, so the cache and state equal eager's bit for bit."""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.export import EXACT_NUMERICS
from dsv4_compile.fx_passes import DSV4PassManager, FuseEntryStorePass, InplaceMutationsPass
from dsv4_compile.fx_passes.pass_manager import default_passes
from dsv4_compile.testing import compress_index as inputs
from tests.support.compile_checks import fresh_compile_state
from tests.support.hf_model import eager_and_compiled_prefill

FUSED = "dsv4.compress_kv_store.default (in place)"
PAGE = 4
WRITES = {512: (torch.ops.dsv4.store_kv, "dsv4.store_kv.default (in place)", layout.model1_page_bytes(PAGE)),
          128: (torch.ops.dsv4.store_index_k, "dsv4.store_index_k.default (in place)", layout.index_page_bytes(PAGE))}
UNFUSED = "dsv4.compress_kv.default (in place)"


def _inputs(d: int):
    """(cache, slots, compress_kv's arguments): a c4 verify step of two requests (d = 128: the
    indexer's compressor, rotated), windows completing on some rows, slots valid and -1."""
    gen = torch.Generator().manual_seed(d)
    args = inputs.compressor_args(4, d, [7, 12], [4, 4], gen, num_tokens=9, ring=16)
    cache = torch.randint(0, 256, (3, WRITES[d][2]), generator=gen, dtype=torch.uint8)
    slots = torch.tensor([0, 5, -1, 7, 2, 9, 3, 11, -1])
    assert (args["seq_lens_causal"] % 4 == 0).sum() >= 2
    return cache, slots, args


def _run(fn, d: int, *, pre_grad: bool = True, devices=("cpu",)):
    """(matches, the graph's dsv4 ops, eager (cache, state), compiled (cache, state)) of
    ``fn(cache, slots, args)``; ``pre_grad=False`` compiles without the pre-grad stage."""
    fuse = FuseEntryStorePass(devices)
    passes = DSV4PassManager([InplaceMutationsPass(devices), fuse])
    options = {"post_grad_custom_post_pass": passes, **EXACT_NUMERICS}
    if pre_grad:
        options["pre_grad_custom_pass"] = passes.pre_grad_stage()
    cache, slots, args = _inputs(d)
    runs = []
    for call in (fn, torch.compile(fn, fullgraph=True, options=options)):
        a = dict(args, state=args["state"].clone())
        c = cache.clone()
        with torch.no_grad(), fresh_compile_state():
            call(c, slots, a)
        runs.append((c, a["state"]))
    (want, want_state), (got, got_state) = runs
    assert not torch.equal(want, cache) and not torch.equal(want_state, args["state"])
    return fuse.matched_count, passes.last_ops, (want, want_state), (got, got_state)


def _written(d: int):
    write = WRITES[d][0]

    def fn(cache, slots, a):
        write(cache, slots, torch.ops.dsv4.compress_kv(**a), PAGE)
    return fn


@pytest.mark.parametrize("pre_grad", [True, False], ids=["pre-grad", "post-grad"])
@pytest.mark.parametrize("d", [512, 128])
def test_compressor_and_its_write_fused(d, pre_grad):
    """``store_kv`` of 512-wide entries, ``store_index_k`` of 128-wide ones: one node, in either
    stage; the cache and the state hold eager's bytes."""
    matches, ops, want, got = _run(_written(d), d, pre_grad=pre_grad)
    assert (matches, ops) == (1, [FUSED])
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("case", ["entries-read-again", "state-read-between", "state-view-read-between",
                                  "cuda-only"])
def test_other_pairs_left_alone(case):
    """Entries something else reads too, a read of the state between the two calls, directly or
    through a view made before the compressor (the fused call would update it later), and a pass
    that matches CUDA tensors only: the two ops stay."""
    def fn(cache, slots, a):
        row = a["state"][0]
        entries = torch.ops.dsv4.compress_kv(**a)
        ring = None
        if case == "state-read-between":
            ring = a["state"].sum()
        elif case == "state-view-read-between":
            ring = row.sum()
        torch.ops.dsv4.store_kv(cache, slots, entries, PAGE)
        return entries.float().sum() if case == "entries-read-again" else ring

    matches, ops, want, got = _run(fn, 512, devices=("cuda",) if case == "cuda-only" else ("cpu",))
    assert matches == 0
    assert ops == [UNFUSED, WRITES[512][1]]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_in_the_default_list_after_the_in_place_calls():
    """The post-grad stage matches the in-place calls InplaceMutationsPass makes: it runs after it."""
    names = [type(p).__name__ for p in default_passes()]
    assert names.index("FuseEntryStorePass") > names.index("InplaceMutationsPass")


@pytest.mark.filterwarnings("ignore::UserWarning")  # transformers' MoE code under Dynamo
@torch.no_grad()
def test_model_step_fuses_each_compressors_write():
    """compile_step of a 3-layer model (sliding, CSA, HCA) with the pass: the CSA layer's two
    compressors and the HCA layer's one fuse with their writes (3 nodes, no compress_kv left), and
    the logits and every cache buffer equal the eager backend's, bit for bit."""
    fuse = FuseEntryStorePass(("cpu",))
    (want, written), (got, caches) = eager_and_compiled_prefill(DSV4PassManager([fuse]), tokens=9)
    assert fuse.matched_count == fuse.last_ops.count(FUSED) == 3
    assert not any("compress_kv.default" in op for op in fuse.last_ops)
    assert torch.equal(got, want)
    assert all(torch.equal(t, w) for t, w in zip(caches, written))
