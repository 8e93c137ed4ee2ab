"""Reference values worked out by hand (docs/semantics.md §4.2-§4.4): sparse attention on rows of
length 1 and 0, the indexer's head weights and logits against a dense fp32 computation, the
compressor's state ring after a prefill, and the scaled Walsh-Hadamard transform."""

import math

import torch

from dsv4_compile import layout
from dsv4_compile.attention import KVSet
from dsv4_compile.reference import compressor, functional, indexer, kv_store, quant, sparse_attn
from dsv4_compile.testing.compress_index import CONFIG, compressor_args

I32 = torch.int32


def _sylvester(n):
    """``H[i, j] = (-1)^popcount(i & j)``, the unscaled Sylvester-ordered Hadamard matrix."""
    return torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)])


def test_sparse_attn_reads_only_the_row_length():
    """Length 1 among valid indices: the first key alone, out = k e^l / (e^l + e^sink), lse = l;
    length 0: out 0 and lse +inf (FlashMLA's convention for a row without keys)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(4, 512, generator=gen).bfloat16()
    cache = torch.zeros(1, layout.model1_page_bytes(256), dtype=torch.uint8)
    kv_store.store_model1(cache, torch.arange(4), keys, 256)
    idx = torch.tensor([2, 0, 1, 3] * 16, dtype=I32).expand(2, 64).contiguous()  # every index valid
    q = torch.randn(2, 3, 512, generator=gen).bfloat16()
    sink = torch.tensor([-1.0, 0.0, 2.0])
    out, lse = sparse_attn.sparse_attn(q, KVSet(cache, 256, idx, torch.tensor([1, 0], dtype=I32)), None, sink,
                                       512 ** -0.5)
    k = quant.fake_quant_model1(keys[2:3]).float()[0]
    logit = q[0].float() @ k * 512 ** -0.5  # [H]
    torch.testing.assert_close(lse[0], logit)
    want = (logit.exp() / (logit.exp() + sink.exp())).unsqueeze(1) * k
    torch.testing.assert_close(out[0].float(), want, rtol=2 ** -8, atol=1e-6)
    assert torch.equal(out[1], torch.zeros(3, 512, dtype=torch.bfloat16))
    assert torch.all(lse[1] == float("inf"))


def test_indexer_weights_and_logits_match_dense_fp32():
    """w_h = weights_h * index_weight_scale * amax(Q_h) / 448 and the logits match the dense
    sum_h weights_h * scale * relu(Q_h . K_j) within the query's e4m3 rounding, with per-head query
    magnitudes 1e-2 .. 100 (position 0: RoPE is the identity, Q_h = H q_h / sqrt(128))."""
    gen = torch.Generator().manual_seed(0)
    rows, heads = 3, 4
    q = torch.randn(rows, heads, 128, generator=gen) * torch.tensor([1e-2, 1.0, 10.0, 100.0]).view(1, heads, 1)
    weights = torch.randn(rows, heads, generator=gen)
    scale = CONFIG.index_weight_scale
    keys = torch.randn(64, 128, generator=gen)
    cache = torch.zeros(2, layout.index_page_bytes(), dtype=torch.uint8)
    kv_store.store_index_k(cache, 64 + torch.arange(64), keys, 64)  # page 1
    inv_freq = torch.rand(32, generator=gen)
    q_fp8, w = indexer.indexer_prepare_q(q, weights, torch.zeros(rows, dtype=I32), inv_freq, scale)
    big_q = q @ _sylvester(128) / math.sqrt(128)  # [T, H, 128]
    sigma = big_q.abs().amax(-1) / 448
    torch.testing.assert_close(w, weights * scale * sigma, rtol=1e-5, atol=0)
    got = indexer.indexer_logits(q_fp8, w, cache, torch.ones(rows, 1, dtype=I32))
    k = quant.fake_quant_index_k(keys)  # what the cache holds
    want = torch.einsum("thn,th->tn", (big_q @ k.T).relu(), weights * scale)
    # e4m3: half a step is 2^-4 relative for normals, 2^-10 (times sigma) absolute for subnormals
    q_err = 2 ** -4 * big_q.abs() + 2 ** -10 * sigma.unsqueeze(-1)
    bound = torch.einsum("thn,th->tn", q_err @ k.abs().T, (weights * scale).abs())
    assert torch.all((got - want).abs() <= 1.01 * bound + 1e-6 * want.abs().max())


def test_prefill_fills_the_state_ring_with_its_last_positions():
    """After a 20-token prefill (ratio 4, ring 16) the request's ring row ``pos % 16`` holds
    ``[kv | score + ape[pos % 4]]`` of each of the last 16 positions; the dummy request's is untouched."""
    args = compressor_args(4, 128, [20], [20], torch.Generator().manual_seed(0))
    ring = args["ring"]
    assert ring == 16
    state = torch.full_like(args["state"], -7.0)
    compressor.compress_kv(**dict(args, state=state))
    pos = torch.arange(20 - ring, 20)
    rows = torch.cat([args["kv"][pos], args["score"][pos] + args["ape"][pos % 4]], 1)
    assert torch.equal(state[ring + pos % ring], rows)
    assert torch.all(state[:ring] == -7.0)


def test_hadamard_is_the_orthonormal_sylvester_transform():
    """hadamard(x) = x H / sqrt(n): its own inverse, and it keeps every row's norm."""
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    y = functional.hadamard(x)
    torch.testing.assert_close(y, x @ _sylvester(128) / math.sqrt(128))
    torch.testing.assert_close(functional.hadamard(y), x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
