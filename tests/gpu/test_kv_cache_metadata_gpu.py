"""Cache-write and metadata ops on the GPU at real shapes, through ``torch.ops.dsv4`` (so the CUDA
kernels registered in ``ops/kv_cache.py`` and ``ops/metadata.py`` run), against the reference:
caches byte for byte (reference evaluated on the CPU, where its divisions are true divisions),
metadata exactly and field by field (reference on the GPU); plus CUDA-graph capture and replay.

Shapes: up to 16384 rows per store; metadata at L_max = 1M tokens per request (NP = 4096 pages,
c128 width 8192) for decode at b = 1 / 32 / 256, uniform and ragged verify and a 16k-row prefill,
through the five separate ops and the fused ``dsv4::step_metadata``.
"""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.metadata_chain import named, run_chain
from dsv4_compile.reference import kv_store as ref_kv
from dsv4_compile.reference import metadata as ref_meta
from dsv4_compile.testing import cache_inputs as inputs

pytestmark = pytest.mark.gpu

ops = torch.ops.dsv4
L_MAX = 1 << 20
NUM_REQUESTS = 256


def _gen(seed=0):
    return torch.Generator(device="cuda").manual_seed(seed)


# -- cache writes and reads --------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [layout.SWA_PAGE_SIZE, layout.C4_PAGE_SIZE, layout.C128_PAGE_SIZE])
@pytest.mark.parametrize("n", [1, 256, 16384])
def test_store_kv_byte_exact(page_size, n):
    gen = _gen(n)
    num_pages = 2 * n // page_size + 3
    cache = torch.randint(0, 256, (num_pages, layout.model1_page_bytes(page_size)), generator=gen,
                          device="cuda", dtype=torch.uint8)  # canaries
    slots = inputs.distinct_slots(n, num_pages, page_size, gen, num_negative=n // 16)
    k = inputs.model1_keys(n, gen)
    got = cache.clone()
    ops.store_kv(got, slots, k, page_size)
    want = _store_model1_reference(cache, slots, k, page_size)
    assert torch.equal(got.cpu(), want)
    read = ops.dequant_kv(got, slots, page_size)
    assert torch.equal(read.cpu(), ref_kv.gather_model1(want, slots.cpu(), page_size).to(torch.bfloat16))


def _store_model1_reference(cache, slots, k, page_size):
    """The reference's bytes, evaluated on the CPU (the spec) and, as a cross-check, on CUDA."""
    want = cache.to("cpu", copy=True)
    ref_kv.store_model1(want, slots.cpu(), k.cpu(), page_size)
    on_cuda = cache.clone()
    ref_kv.store_model1(on_cuda, slots, k, page_size)
    assert torch.equal(on_cuda.cpu(), want), "torch evaluates the MODEL1 reference differently on CUDA"
    return want


def test_store_kv_every_bf16_value_byte_exact():
    """The hardware fp32 -> e4m3 cast on every finite bf16 input in [-448, 448]."""
    k = inputs.all_bf16_tiles().cuda()
    page_size = layout.C4_PAGE_SIZE
    slots = torch.arange(k.shape[0], device="cuda") + page_size
    cache = torch.zeros(2 + k.shape[0] // page_size, layout.model1_page_bytes(page_size), dtype=torch.uint8,
                        device="cuda")
    got = cache.clone()
    ops.store_kv(got, slots, k, page_size)
    assert torch.equal(got.cpu(), _store_model1_reference(cache, slots, k, page_size))


@pytest.mark.parametrize("k_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [256, 16384])
def test_store_index_k_byte_exact(k_dtype, n):
    gen = _gen(n + 1)
    page_size = layout.INDEX_PAGE_SIZE
    num_pages = 2 * n // page_size + 3
    cache = torch.randint(0, 256, (num_pages, layout.index_page_bytes(page_size)), generator=gen,
                          device="cuda", dtype=torch.uint8)
    slots = inputs.distinct_slots(n, num_pages, page_size, gen, dtype=torch.int32, num_negative=n // 16)
    k = inputs.index_keys(n, k_dtype, gen)
    got = cache.clone()
    ops.store_index_k(got, slots, k, page_size)
    # the reference runs on the CPU: on CUDA, torch evaluates its ``amax / 448`` (tensor / Python
    # scalar) as ``amax * (1 / 448)``, one ulp off a true division for about half of the scales
    want = cache.to("cpu", copy=True)
    ref_kv.store_index_k(want, slots.cpu(), k.cpu(), page_size)
    assert torch.equal(got.cpu(), want)


# -- metadata ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def index_maps():
    """1M-token index maps for 256 requests (about 1 GiB + 2 GiB)."""
    return inputs.index_maps(NUM_REQUESTS, L_MAX, _gen(123))


def _lengths(b, gen, low=1):
    lens = torch.randint(low, L_MAX + 1, (b,), generator=gen, device="cuda", dtype=torch.int32)
    corners = torch.tensor([1, 4, 127, 128, 129, 256, 257, L_MAX], dtype=torch.int32, device="cuda")
    lens[:min(b, corners.numel())] = corners[:b].clamp_min(low)
    return lens


STEPS = ["decode_b1", "decode_b32", "decode_b256", "verify_uniform_b64", "verify_ragged_b64",
         "prefill_16k", "idle_t4", "idle_t0"]


def _step(name, req_to_token, gen):
    """A named step (``StepInputs``) on distinct requests."""
    rows = torch.randperm(NUM_REQUESTS, generator=gen, device="cuda").to(torch.int32) + 1
    ones = torch.ones(NUM_REQUESTS, dtype=torch.int32, device="cuda")
    if name.startswith("decode_b"):
        b = int(name.removeprefix("decode_b"))
        return inputs.make_step(req_to_token, rows[:b], _lengths(b, gen), ones[:b])
    seq = _lengths(64, gen, low=4)
    if name == "verify_uniform_b64":
        return inputs.make_step(req_to_token, rows[:64], seq, 4 * ones[:64])
    if name == "verify_ragged_b64":
        verify = torch.randint(0, 5, (64,), generator=gen, device="cuda", dtype=torch.int32)
        return inputs.make_step(req_to_token, rows[:64], seq, verify, 4 * 64)
    if name.startswith("idle_t"):  # no request: every row (if any) is padding
        return inputs.make_step(req_to_token, [], [], [], int(name.removeprefix("idle_t")))
    assert name == "prefill_16k"  # 16001 real rows, 383 padding rows
    return inputs.make_step(req_to_token, rows[:4], [9000, L_MAX, 5, 300000], [9000, 1, 0, 7000], 16384)


def _assert_fields(got, want):
    """Each field of ``got`` (a dict by name) is int32 and equals the field of that name in ``want``."""
    assert got
    for name, g in got.items():
        w = want[name]
        assert g.dtype == torch.int32 and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        assert torch.equal(g, w), name


def _separate_ops(step, req_to_token, req_to_page, full_to_swa):
    """Every field through the five separate ops, chained as ``build_step_metadata`` chains them."""
    return run_chain(ops, *step.tensors(), req_to_token, req_to_page, full_to_swa, 512)


def _fused_op(step, req_to_token, req_to_page, full_to_swa):
    return named(ops.step_metadata(*step.tensors(), req_to_token, req_to_page, full_to_swa, 512))


def _reference(step, req_to_token, req_to_page, full_to_swa):
    return named(ref_meta.step_metadata(*step.tensors(), req_to_token, req_to_page, full_to_swa, 512))


@pytest.mark.parametrize("name", STEPS)
def test_metadata_exact(index_maps, name):
    req_to_token, full_to_swa = index_maps
    req_to_page = ref_meta.page_map(req_to_token)
    step = _step(name, req_to_token, _gen(5))
    got = _separate_ops(step, req_to_token, req_to_page, full_to_swa)
    fused = _fused_op(step, req_to_token, req_to_page, full_to_swa)
    torch.cuda.synchronize()
    want = _reference(step, req_to_token, req_to_page, full_to_swa)
    n_pages = L_MAX // 256
    assert got["page_table"].shape[1] == n_pages and got["c128_indices"].shape[1] == -(-2 * n_pages // 64) * 64
    _assert_fields(got, want)
    _assert_fields(fused, want)


def test_metadata_and_store_replay_in_cuda_graph(index_maps):
    """Capture the metadata chain and a store once, replay on new step values: no host syncs,
    results follow the new inputs."""
    req_to_token, full_to_swa = index_maps
    req_to_page = ref_meta.page_map(req_to_token)
    static = _step("decode_b256", req_to_token, _gen(10))
    cache = torch.zeros(8, layout.model1_page_bytes(layout.C128_PAGE_SIZE), dtype=torch.uint8, device="cuda")
    keys = inputs.model1_keys(8, _gen(9))
    slots = torch.arange(8, device="cuda") + 2
    for _ in range(2):  # compile and warm up outside capture
        _separate_ops(static, req_to_token, req_to_page, full_to_swa)
        _fused_op(static, req_to_token, req_to_page, full_to_swa)
        ops.store_kv(cache, slots, keys, layout.C128_PAGE_SIZE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _separate_ops(static, req_to_token, req_to_page, full_to_swa)
        fused = _fused_op(static, req_to_token, req_to_page, full_to_swa)
        ops.store_kv(cache, slots, keys, layout.C128_PAGE_SIZE)
    for dst, src in zip(static.tensors(), _step("decode_b256", req_to_token, _gen(11)).tensors(), strict=True):
        dst.copy_(src)
    keys.copy_(inputs.model1_keys(8, _gen(12)))
    cache.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = _reference(static, req_to_token, req_to_page, full_to_swa)
    _assert_fields(out, want)
    _assert_fields(fused, want)
    assert torch.equal(cache.cpu(), _store_model1_reference(torch.zeros_like(cache), slots, keys,
                                                            layout.C128_PAGE_SIZE))
