"""``compress_kv``, ``indexer_prepare_q`` and ``indexer_topk`` on the GPU at real shapes, through
``torch.ops.dsv4`` (the CUDA kernels registered in ``ops/compressor.py`` / ``ops/indexer.py``),
against the references run on the same device.

* compress_kv: decode at b = 256, verify (4 rows per request), prefill T = 4096 from position 0
  and a 4096-row chunk continuing a long request (ring reads + ring rows rewritten in the same
  step), for c4 (d = 128 with the Hadamard, d = 512) and c128 (d = 512): three-way entry error and
  exact rings (``testing.compress_index.check_compress_kv``).
* prepare_q: T up to 4096, 64 heads: fp8 codes within one ulp and >= 99.9% identical, weights
  within a few fp32 ulps.
* topk: decode at b = 1 / 32 / 256 with 16k, 128k and 1M-token capacities (NP = 64 / 512 / 4096),
  and at b = 1 / 4 / 8 / 14 with 4,352 and 8k (NP = 17 / 32: the rank select over the visible
  entries), K = 512 / 1024, 64 heads, plus a T = 4096 prefill at 128k: invariants, rows with
  visible <= K equal to the reference, fp64 selection regret within the reference's + budget (fp8
  MMA accumulation: 2^-10 x the logit magnitude), exact sets where the margin allows.
* CUDA graphs: the three ops captured once and replayed on new inputs (including rows whose
  visible count drops to <= K after capture) equal eager calls.
"""

import pytest
import torch

from dsv4_compile import layout
from dsv4_compile.reference import indexer as ref_indexer
from dsv4_compile.rope import layer_inv_freq
from dsv4_compile.testing import compress_index as inputs

pytestmark = pytest.mark.gpu

ops = torch.ops.dsv4
K4, K8, K16, K128, M1 = 4352, 1 << 13, 1 << 14, 1 << 17, 1 << 20  # tokens per request (K4: 17 index pages)
HEADS = 64


def _gen(seed=0):
    return torch.Generator(device="cuda").manual_seed(seed)


def _compress_op(**args):
    return ops.compress_kv(**args)


# -- compress_kv ---------------------------------------------------------------------------------
def _decode(gen, b):
    """b requests of random lengths < 1M; an eighth of them complete a c128 (and c4) window."""
    seq = torch.randint(1, M1, (b,), generator=gen, device="cuda")
    seq[: max(1, b // 8)] = seq[: max(1, b // 8)] // 128 * 128 + 128
    return seq.tolist(), [1] * b


SCENARIOS = {
    "decode_b256": lambda gen: _decode(gen, 256),
    "verify_b64": lambda gen: (torch.randint(8, K128, (64,), generator=gen, device="cuda").tolist(),
                               [4] * 64),
    "prefill_4096": lambda gen: ([4096], [4096]),
    "chunk_4096_at_100k": lambda gen: ([100_000 + 4096, 777], [4096, 7]),
}


@pytest.mark.parametrize("ratio,d", [(4, 128), (4, 512), (128, 512)])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_compress_kv(ratio, d, scenario):
    gen = _gen(ratio + d)
    seq, ext = SCENARIOS[scenario](gen)
    args = inputs.compressor_args(ratio, d, seq, ext, gen, num_tokens=sum(ext) + 3)
    inputs.check_compress_kv(_compress_op, args)


# -- prepare_q -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 256, 4096])
def test_prepare_q(rows):
    gen = _gen(rows)
    q, w = inputs.indexer_q(rows, HEADS, gen)
    positions = torch.randint(0, M1, (rows,), generator=gen, device="cuda", dtype=torch.int32)
    inv_freq = layer_inv_freq(inputs.CONFIG, 4).cuda()
    scale = inputs.CONFIG.index_weight_scale
    q_fp8, w_out = ops.indexer_prepare_q(q, w, positions, inv_freq, scale)
    torch.cuda.synchronize()
    q_ref, w_ref = ref_indexer.indexer_prepare_q(q, w, positions, inv_freq, scale)
    got, want = q_fp8.float(), q_ref.float()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0 ** -6))) - 3)
    assert torch.all((got - want).abs() <= ulp)
    assert (q_fp8.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean() >= 0.999
    torch.testing.assert_close(w_out, w_ref, rtol=2 ** -16, atol=0)  # sigma: amax of a 128-term sum


# -- topk ----------------------------------------------------------------------------------------
def _topk_args(visible, capacity, topk, gen, *, pool_pages=None):
    """Rows with their own pages (pool = rows x NP + 1 pages, random-code cache) by default."""
    num_pages = capacity // (4 * layout.INDEX_PAGE_SIZE)
    pool = pool_pages or len(visible) * num_pages + 1
    return inputs.indexer_topk_args(visible, HEADS, num_pages, topk, gen, pool_pages=pool, gaussian=False)


def _check_topk(args, got):
    """Budget: fp8 MMA accumulation, 2^-10 x the row's rounding scale (about 16x its error)."""
    return inputs.check_topk(args, got, budget_rel=2.0 ** -10)


@pytest.mark.parametrize("b,capacity,topk", [(1, K4, 512), (8, K4, 512), (14, K4, 512), (1, K8, 512), (4, K8, 512),
                                             (1, K16, 512), (32, K16, 512), (256, K16, 1024), (1, M1, 1024),
                                             (32, K128, 512), (32, M1, 512), (256, K128, 1024), (256, M1, 512)])
def test_topk_decode(b, capacity, topk):
    gen = _gen(b + topk)
    visible = torch.randint(capacity // 32, capacity // 4 + 1, (b,), generator=gen, device="cuda")
    small = b // 8  # rows with visible <= K
    visible[:small] = torch.randint(0, topk + 1, (small,), generator=gen, device="cuda")
    args = _topk_args(visible.tolist(), capacity, topk, gen)
    got = ops.indexer_topk(**args)
    torch.cuda.synchronize()
    _check_topk(args, got)


def test_topk_prefill_4096():
    """One request's 4096-row chunk ending at 128k tokens: causal visible counts (p + 1) // 4."""
    gen = _gen(7)
    pos = torch.arange(K128 - 4096, K128, device="cuda")
    args = _topk_args(((pos + 1) // 4).tolist(), K128, 512, gen, pool_pages=K128 // 256 + 1)
    args["page_table"] = args["page_table"][:1].expand_as(args["page_table"]).contiguous()  # one request
    got = ops.indexer_topk(**args)
    torch.cuda.synchronize()
    _check_topk(args, got)


# -- CUDA graphs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [K16, K128])  # the select in one program per row, and split
def test_ops_in_cuda_graph_replay(capacity):
    """Capture once, replay on new inputs: equal to eager calls; a row whose visible count drops
    to <= K after capture takes all its entries (the choice is made on the device)."""
    gen = _gen(11)
    topk, b = 512, 8
    args = _topk_args([4 * topk] * b, capacity, topk, gen)
    comp = inputs.compressor_args(4, 512, *_decode(gen, b), gen)
    state0 = comp["state"].clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles the kernels) outside the capture
        ops.indexer_topk(**args)
        _compress_op(**comp)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        sel = ops.indexer_topk(**args)
        entries = _compress_op(**comp)
    new = _topk_args([3, topk, topk + 1, 9 * topk, 2, 4 * topk, 1000, 700], capacity, topk, _gen(12))
    for name in ("q_fp8", "w", "index_cache", "page_table", "visible"):
        args[name].copy_(new[name])
    comp["state"].copy_(state0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(sel, ops.indexer_topk(**args))
    state_after = comp["state"].clone()
    comp["state"].copy_(state0)
    assert torch.equal(entries, _compress_op(**comp))
    assert torch.equal(state_after, comp["state"])
