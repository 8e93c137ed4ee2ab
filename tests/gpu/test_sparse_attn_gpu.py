"""``dsv4::sparse_attn`` on the GPU at real shapes: the Triton kernels (through the op's registered
CUDA kernel, which picks the fused or the two-pass path) and FlashMLA, against an fp64 golden with
the eager reference's error as the yardstick (STYLE habit 11), on the same cache bytes.

Shapes: H in {8, 64, 128}; SWA-only, c4 top-512 / top-1024, c128 at 1k / 128k / 1M context (extra
widths 64 / 1024 / 8192); T from 1 (fused, split-KV + combine) to 4096 (two-pass, in row chunks);
each path also forced at one size. Inputs have
-1 holes, sentinel indices, ragged lengths, empty and all-invalid rows, sinks of +inf / -inf.
Also: split counts agree, int64 indices, CUDA-graph capture and replay with new index values, the
``DSV4_ATTN_IMPL=flashmla`` switch.
"""

import pytest
import torch

from dsv4_compile.ops.kernels import flashmla
from dsv4_compile.ops.kernels import sparse_attn as K
from dsv4_compile.reference import sparse_attn as ref
from dsv4_compile.testing.attn_inputs import assert_attn_close, golden_sparse_attn, make_attn_inputs

pytestmark = pytest.mark.gpu
needs_flashmla = pytest.mark.skipif(not flashmla.available(), reason="flash_mla not installed")

SHAPES = {  # name: (extra, extra width, extra capacity)
    "swa_only": (None, 0, None),
    "c4_top512": ("c4", 512, None),
    "c4_top1024": ("c4", 1024, None),
    "c128_1k": ("c128", 64, None),
    "c128_128k": ("c128", 1024, None),
    "c128_1m": ("c128", 8192, 1 << 14),
}
ADVERSARIAL = dict(holes=0.1, ragged=True, sentinels=True, empty_rows=1, invalid_rows=1, special_sink=True)


def _inputs(rows, heads, shape, seed=0, **kw):
    extra, width, capacity = SHAPES[shape]
    kw = dict(ADVERSARIAL, extra_capacity=capacity, swa_capacity=1 << 16) | kw
    return make_attn_inputs(rows, heads, extra=extra, extra_width=max(width, 64), seed=seed, device="cuda",
                            **kw)


def _check(inp, got, what):
    torch.cuda.synchronize()
    assert_attn_close(got, ref.sparse_attn(*inp.args()), golden_sparse_attn(inp), what)


@pytest.mark.parametrize("rows", [1, 7, 130])
@pytest.mark.parametrize("heads", [8, 64, 128])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_op_matches_reference(shape, heads, rows):
    if shape == "c128_1m" and rows > 7:
        pytest.skip("fp64 golden at 1M context: a few rows suffice")
    inp = _inputs(rows, heads, shape, seed=rows)
    _check(inp, torch.ops.dsv4.sparse_attn(*inp.args()), f"{shape} H={heads} T={rows}")


@pytest.mark.parametrize("shape", ["c4_top512", "c128_128k"])
def test_many_rows(shape):
    """Prefill / verify sized: one program per (row, head block), no split."""
    inp = _inputs(4096, 64, shape, extra_capacity=1 << 16, holes=0.02)
    _check(inp, torch.ops.dsv4.sparse_attn(*inp.args()), f"{shape} T=4096")


def test_splits_agree():
    inp = _inputs(3, 64, "c4_top1024", seed=5)
    base_out, base_lse = K.launch_sparse_attn(*inp.args(), num_splits=1)
    for splits in (2, 7, 16, 40):  # 40 > key blocks: empty splits
        out, lse = K.launch_sparse_attn(*inp.args(), num_splits=splits)
        torch.testing.assert_close(lse, base_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.float(), base_out.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("two_pass", [False, True])
def test_int64_indices(two_pass):
    inp = _inputs(5, 64, "c4_top512", seed=3)
    want = K.launch_sparse_attn(*inp.args(), two_pass=two_pass)
    inp.swa_indices, inp.extra_indices = inp.swa_indices.long(), inp.extra_indices.long()
    inp.swa_lengths, inp.extra_lengths = inp.swa_lengths.long(), inp.extra_lengths.long()
    got = K.launch_sparse_attn(*inp.args(), two_pass=two_pass)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [5, 256])  # fused (split + combine); two-pass
def test_cuda_graph_replay(rows):
    """Captured once; replays read the current q / index / length / sink values (no host reads)."""
    inp = _inputs(rows, 64, "c4_top512", seed=7)
    fresh = _inputs(rows, 64, "c4_top512", seed=8)
    K.launch_sparse_attn(*inp.args())  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = K.launch_sparse_attn(*inp.args())
    for name in ("q", "swa_indices", "swa_lengths", "extra_indices", "extra_lengths", "attn_sink"):
        getattr(inp, name).copy_(getattr(fresh, name))
    graph.replay()
    fresh.swa_cache, fresh.extra_cache = inp.swa_cache, inp.extra_cache
    want = K.launch_sparse_attn(*fresh.args())
    torch.testing.assert_close((out, lse), want, rtol=0, atol=0)


@needs_flashmla
@pytest.mark.parametrize("rows", [1, 64, 512])
@pytest.mark.parametrize("heads", [8, 64, 128])
@pytest.mark.parametrize("shape", ["swa_only", "c4_top512", "c4_top1024", "c128_1k", "c128_1m"])
def test_flashmla_agrees(shape, heads, rows):
    """FlashMLA on the same cache bytes meets the same bar as our kernel."""
    if shape == "c128_1m" and rows > 64:
        pytest.skip("fp64 golden at 1M context: a few rows suffice")
    inp = _inputs(rows, heads, shape, seed=rows + heads)
    ours = torch.ops.dsv4.sparse_attn(*inp.args())
    theirs = torch.ops.dsv4.sparse_attn_flashmla(*inp.args())
    torch.cuda.synchronize()
    eager, golden = ref.sparse_attn(*inp.args()), golden_sparse_attn(inp)
    assert_attn_close(ours, eager, golden, "triton")
    assert_attn_close(theirs, eager, golden, "flashmla")


@needs_flashmla
def test_env_switch_routes_to_flashmla(monkeypatch):
    inp = _inputs(4, 64, "c4_top512", seed=11)
    want = torch.ops.dsv4.sparse_attn_flashmla(*inp.args())
    monkeypatch.setenv("DSV4_ATTN_IMPL", "flashmla")
    got = torch.ops.dsv4.sparse_attn(*inp.args())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("shape", ["c4_top1024", "c128_1m"])
def test_both_paths(shape, two_pass):
    """Each strategy of ``launch_sparse_attn`` forced, at a size where either could be picked:
    the fused kernel (split over the key list) and the two-pass kernels."""
    inp = _inputs(7, 128, shape, seed=5)
    _check(inp, K.launch_sparse_attn(*inp.args(), two_pass=two_pass), f"{shape} two_pass={two_pass}")
