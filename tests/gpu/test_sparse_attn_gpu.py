"""``dsv4::sparse_attn`` on the GPU at real shapes: our kernels (through the op's registered CUDA
kernel, which picks the fused, warp-specialised or two-pass path) and FlashMLA, against an fp64
golden with the eager reference's error as the yardstick, on the same cache bytes.

Shapes: H in {8, 64, 128}; SWA-only, c4 top-512 / top-1024, c128 at 1k / 128k / 1M context (extra
widths 64 / 1024 / 8192); T from 1 (split-KV + combine) to 4096; each path also forced at four
sizes. Inputs have
-1 holes, sentinel indices, ragged lengths, empty and all-invalid rows, sinks of +inf / -inf.
Also: split counts agree, int64 indices, CUDA-graph capture and replay with new index values, the
``DSV4_ATTN_IMPL=flashmla`` switch, exact dequantisation of every e4m3 code (one-key rows), the
warp-specialised kernel's L2 prefetch leaving results unchanged, the path the op picks on this
device for a few shapes.
"""

import pytest
import torch

from dsv4_compile.attention import sparse_attn
from dsv4_compile.ops.kernels import flashmla, sparse_attn_dispatch, sparse_attn_warp_specialized
from dsv4_compile.ops.kernels.sparse_attn_dispatch import PATHS, launch_sparse_attn
from dsv4_compile.ops.kernels.sparse_attn_warp_specialized import WarpSpecializedConfig
from dsv4_compile.reference import sparse_attn as ref
from dsv4_compile.reference.quant import dequantize_model1, model1_page_views
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


def _skip_unavailable(path):
    if path == "warp_specialized" and not sparse_attn_warp_specialized.available(torch.device("cuda")):
        pytest.skip("the warp-specialised kernel needs Gluon from Triton 3.6 and an sm_90 GPU")


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
    _check(inp, sparse_attn(*inp.args()), f"{shape} H={heads} T={rows}")


@pytest.mark.parametrize("shape", ["c4_top512", "c128_128k"])
def test_many_rows(shape):
    """Prefill / verify sized: one program per (row, head block), no split."""
    inp = _inputs(4096, 64, shape, extra_capacity=1 << 16, holes=0.02)
    _check(inp, sparse_attn(*inp.args()), f"{shape} T=4096")


@pytest.mark.parametrize("path", ["fused", "warp_specialized"])
def test_splits_agree(path):
    _skip_unavailable(path)
    inp = _inputs(3, 64, "c4_top1024", seed=5)
    base_out, base_lse = launch_sparse_attn(*inp.args(), num_splits=1, path=path)
    for splits in (2, 7, 16, 40):  # 40 > key blocks: empty splits
        out, lse = launch_sparse_attn(*inp.args(), num_splits=splits, path=path)
        torch.testing.assert_close(lse, base_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.float(), base_out.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("path", PATHS)
def test_int64_indices(path):
    _skip_unavailable(path)
    inp = _inputs(5, 64, "c4_top512", seed=3)
    want = launch_sparse_attn(*inp.args(), path=path)
    got = launch_sparse_attn(*inp.with_int64_indices().args(), path=path)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("rows, path", [(5, None), (256, None), (256, "two_pass")])  # splits; one per row
def test_cuda_graph_replay(rows, path):
    """Captured once; replays read the current q / index / length / sink values (no host reads)."""
    inp = _inputs(rows, 64, "c4_top512", seed=7)
    fresh = _inputs(rows, 64, "c4_top512", seed=8)
    launch_sparse_attn(*inp.args(), path=path)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = launch_sparse_attn(*inp.args(), path=path)
    for dst, src in ((inp.q, fresh.q), (inp.swa.indices, fresh.swa.indices), (inp.swa.lengths, fresh.swa.lengths),
                     (inp.extra.indices, fresh.extra.indices), (inp.extra.lengths, fresh.extra.lengths),
                     (inp.attn_sink, fresh.attn_sink)):
        dst.copy_(src)
    graph.replay()
    fresh.swa, fresh.extra = fresh.swa._replace(cache=inp.swa.cache), fresh.extra._replace(cache=inp.extra.cache)
    want = launch_sparse_attn(*fresh.args(), path=path)
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
    ours = sparse_attn(*inp.args())
    theirs = torch.ops.dsv4.sparse_attn_flashmla(*inp.op_args())
    torch.cuda.synchronize()
    eager, golden = ref.sparse_attn(*inp.args()), golden_sparse_attn(inp)
    assert_attn_close(ours, eager, golden, "triton")
    assert_attn_close(theirs, eager, golden, "flashmla")


@needs_flashmla
def test_env_switch_routes_to_flashmla(monkeypatch):
    inp = _inputs(4, 64, "c4_top512", seed=11)
    want = torch.ops.dsv4.sparse_attn_flashmla(*inp.op_args())
    monkeypatch.setenv("DSV4_ATTN_IMPL", "flashmla")
    got = sparse_attn(*inp.args())
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows, heads, shape", [(7, 128, "c4_top1024"), (7, 128, "c128_1m"), (130, 8, "c4_top512"),
                                                (40, 64, "swa_only")])
def test_each_path(rows, heads, shape, path):
    """Each path of ``launch_sparse_attn`` forced, whichever the shapes would pick: the fused
    kernel (split over the key list), its warp-specialised version (8 heads padded to 64) and the
    two-pass kernels."""
    _skip_unavailable(path)
    inp = _inputs(rows, heads, shape, seed=5)
    _check(inp, launch_sparse_attn(*inp.args(), path=path), f"{shape} T={rows} H={heads} {path}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows, heads, shape", [(1, 64, "c4_top512"), (8, 64, "c128_128k"), (130, 8, "c4_top512")])
def test_inverse_rope_is_rope_tail_of_the_output(rows, heads, shape, path):
    """``dsv4::sparse_attn_inverse_rope``'s rotation on each path (in the split combine where the
    path splits the key list, else ``rope_tail``'s kernel after it): the output ``rope_tail``'s
    kernel makes of the plain output, to the bit, and the same lse."""
    _skip_unavailable(path)
    inp = _inputs(rows, heads, shape, seed=6)
    positions = torch.randint(0, 1 << 20, (rows,), device="cuda")
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, device="cuda").float() / 64)
    out, lse = launch_sparse_attn(*inp.args(), path=path)
    got, got_lse = launch_sparse_attn(*inp.args(), path=path, inverse_rope=(positions, inv_freq))
    want = torch.ops.dsv4.rope_tail(out, positions.unsqueeze(1), inv_freq, True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_lse, lse, rtol=0, atol=0)


# rows, heads, shape -> the path on sm_90 with Triton 3.6's Gluon / on any other GPU
DEFAULT_PATHS = [(1, 64, "c4_top512", "fused", "fused"), (32, 64, "c4_top512", "warp_specialized", "two_pass"),
                 (7, 128, "c4_top1024", "warp_specialized", "fused"), (130, 8, "c4_top512", "warp_specialized", "two_pass"),
                 (8, 32, "c4_top512", "warp_specialized", "fused")]


@pytest.mark.parametrize("rows, heads, shape, on_sm90, elsewhere", DEFAULT_PATHS)
def test_default_path_on_this_gpu(rows, heads, shape, on_sm90, elsewhere):
    """The path the op takes on this GPU (the warp-specialised kernel on sm_90 for any head count,
    except one or two rows over a short list), and that path's result equals the op's bit for bit."""
    inp = _inputs(rows, heads, shape)
    want = on_sm90 if sparse_attn_warp_specialized.available(inp.q.device) else elsewhere
    assert sparse_attn_dispatch.plan(rows, heads, inp.entries_per_row(), inp.q.device).path == want
    torch.testing.assert_close(sparse_attn(*inp.args()), launch_sparse_attn(*inp.args(), path=want), rtol=0, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_one_key_rows_return_the_dequantised_key(path):
    """With one key and a -inf sink a row's output is that key, bit for bit: every e4m3 code
    (NaN codes excepted) under scale bytes 2^-22 .. 2^13 (the quantiser's range and beyond)
    must dequantise exactly as the reference does."""
    _skip_unavailable(path)
    inp = make_attn_inputs(64, 64, extra=None, seed=1, device="cuda")
    inp.swa.lengths.fill_(1)
    inp.attn_sink.fill_(float("-inf"))
    slots = inp.swa.indices[:, 0].long()
    page, offset = slots // inp.swa.page_size, slots % inp.swa.page_size
    data, scales = model1_page_views(inp.swa.cache, inp.swa.page_size)
    codes = torch.arange(64 * 448, device="cuda") % 256
    data[page, offset, :448] = torch.where(codes % 128 == 127, 0, codes).to(torch.uint8).view(64, 448)
    exponents = torch.tensor([105, 113, 120, 126, 127, 128, 133, 134, 135, 140], device="cuda")
    scales[page, offset, :7] = exponents[torch.arange(64 * 7, device="cuda") % 10].to(torch.uint8).view(64, 7)
    want = dequantize_model1(data[page, offset], scales[page, offset]).to(torch.bfloat16)
    out, lse = launch_sparse_attn(*inp.args(), path=path)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(out.float(), want[:, None].expand_as(out).float(), rtol=0, atol=0)


@pytest.mark.parametrize("rows, shape", [(7, "c128_1m"), (130, "c4_top512")])
def test_warp_specialized_prefetch_leaves_results_unchanged(rows, shape):
    """The L2 prefetch (on by default for long lists only) moves no values: forced on and off,
    the outputs are bitwise equal."""
    _skip_unavailable("warp_specialized")
    inp = _inputs(rows, 64, shape, seed=9)
    on, off = (launch_sparse_attn(*inp.args(), path="warp_specialized",
                                  warp_specialized=WarpSpecializedConfig(prefetch=flag))
               for flag in (True, False))
    torch.testing.assert_close(on, off, rtol=0, atol=0)
