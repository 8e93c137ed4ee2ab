"""The routed-experts kernels vs the reference (``ops/kernels/experts.py``), small shapes.

Slot counts of one program tile (1, 2, 16 slots) and the largest (MAX_SLOTS), intermediate and
hidden sizes that leave a partial column tile and a partial K block, ids outside the experts (0 rows),
an expert no slot names, more experts than slots, strided activations. The kernel accumulates in
another order than the reference's GEMMs, so results agree to one rounding of the activations' dtype. The interpreter's
``tl.dot`` misreads bf16 tiles (Triton 3.7: values of order 1e10), so there the kernels run fp16
(their code does not depend on the dtype); on a GPU bf16 as well."""

import os

import pytest
import torch

from dsv4_compile.ops.kernels import experts as kernels
from dsv4_compile.reference import experts as ref

TOL = dict(atol=2e-3, rtol=1.6e-2)
DTYPES = [torch.float16] if os.environ.get("TRITON_INTERPRET") == "1" else [torch.float16, torch.bfloat16]
SMALL = ((16, 16, 2, 1), (16, 32, 1, 1))  # (BLOCK_N, BLOCK_K, warps, stages): several tiles at these sizes


def _weights(num_experts, hidden, inter, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) * 0.4).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen, device=device) * 0.1).to(dtype)
    return gate_up, down


def _inputs(tokens, topk, num_experts, hidden, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    ids = torch.rand(tokens, num_experts, generator=gen, device=device).argsort(dim=1)[:, :topk]
    return x, ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, topk", [(1, 1), (1, 2), (8, 2), (16, 4)])
@pytest.mark.parametrize("hidden, inter", [(64, 32), (48, 40)])
def test_kernel_matches_reference(device, dtype, tokens, topk, hidden, inter):
    gate_up, down = _weights(4, hidden, inter, device, dtype)
    x, ids = _inputs(tokens, topk, 4, hidden, device, dtype)
    want = ref.routed_experts(x, ids, gate_up, down, 10.0)
    got = kernels.launch_routed_experts(x, ids, gate_up, down, 10.0, *SMALL)
    assert got.shape == (tokens * topk, hidden) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, **TOL)


def test_unowned_ids_unused_experts_fp16_strided(device):
    """Ids -1 and E give 0 rows; expert 3 serves no slot; token 4 names expert 0 twice (a hash
    router's table may); x is a strided view."""
    gate_up, down = _weights(4, 64, 32, device, torch.float16)
    x = torch.randn(5, 128, device=device).to(torch.float16)[:, ::2]
    ids = torch.tensor([[0, 1], [2, -1], [1, 0], [4, 2], [0, 0]], device=device)
    got = kernels.launch_routed_experts(x, ids, gate_up, down, 10.0, *SMALL)
    assert torch.equal(got[[3, 6]], torch.zeros(2, 64, dtype=got.dtype, device=device))
    torch.testing.assert_close(got, ref.routed_experts(x, ids, gate_up, down, 10.0), **TOL)


def test_many_experts_few_slots(device):
    """64 experts, 3 slots naming the highest ids: the grid has a row per slot, not per expert, so
    each program finds its expert among the slots; every id outside the experts: all rows 0."""
    gate_up, down = _weights(64, 64, 32, device, torch.float16)
    x = torch.randn(3, 64, device=device).to(torch.float16)
    ids = torch.tensor([[63], [40], [63]], device=device)
    torch.testing.assert_close(kernels.launch_routed_experts(x, ids, gate_up, down, 10.0, *SMALL),
                               ref.routed_experts(x, ids, gate_up, down, 10.0), **TOL)
    bad = torch.tensor([[-1], [64], [99]], device=device)
    got = kernels.launch_routed_experts(x, bad, gate_up, down, 10.0, *SMALL)
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_configs_at_the_slot_limit(device, dtype):
    """MAX_SLOTS slots with the launcher's default tiles (a K loop of one partial block)."""
    gate_up, down = _weights(4, 64, 32, device, dtype)
    x, ids = _inputs(kernels.MAX_SLOTS // 2, 2, 4, 64, device, dtype)
    torch.testing.assert_close(kernels.launch_routed_experts(x, ids, gate_up, down, 10.0),
                               ref.routed_experts(x, ids, gate_up, down, 10.0), **TOL)


def test_more_slots_than_the_kernels_take(device):
    gate_up, down = _weights(4, 64, 32, device, torch.bfloat16)
    x, ids = _inputs(kernels.MAX_SLOTS // 2 + 1, 2, 4, 64, device, torch.bfloat16)
    with pytest.raises(ValueError, match="at most"):
        kernels.launch_routed_experts(x, ids, gate_up, down, 10.0)


@pytest.mark.parametrize("tokens", [3, kernels.MAX_SLOTS])  # the kernels, then the grouped GEMMs
def test_op_on_device(device, tokens):
    gate_up, down = _weights(4, 64, 32, device, DTYPES[-1])
    x, ids = _inputs(tokens, 2, 4, 64, device, DTYPES[-1])
    torch.testing.assert_close(torch.ops.dsv4.routed_experts(x, ids, gate_up, down, 10.0),
                               ref.routed_experts(x, ids, gate_up, down, 10.0), **TOL)


def _shared(hidden, inter, device, dtype, seed=3):
    gen = torch.Generator(device=device).manual_seed(seed)
    gate, up = ((torch.randn(inter, hidden, generator=gen, device=device) * 0.4).to(dtype) for _ in range(2))
    return gate, up, (torch.randn(hidden, inter, generator=gen, device=device) * 0.1).to(dtype)


def _router(num_experts, hidden, device, dtype, seed=4):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(num_experts, hidden, generator=gen, device=device) * 0.3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, topk", [(1, 2), (5, 2), (16, 4)])
@pytest.mark.parametrize("shared_inter", [32, 40, 24])  # as the routed experts', wider, narrower
def test_shared_expert_and_router_in_the_same_launches(device, dtype, tokens, topk, shared_inter):
    """A shared expert as the grids' next row of programs and the router as the first grid's last:
    the shared expert's output for every token (widths that leave partial tiles, a column grid set
    by the wider of the two), the router's logits, and the routed slots of the launch without
    either, bit for bit; an unowned id."""
    gate_up, down = _weights(4, 48, 32, device, dtype)
    x, ids = _inputs(tokens, topk, 4, 48, device, dtype)
    ids[0, 0] = -1
    shared, router = _shared(48, shared_inter, device, dtype), _router(4, 48, device, dtype)
    slots, shared_out, logits = kernels.launch_moe_experts(x, ids, gate_up, down, 10.0, shared, router, *SMALL)
    assert shared_out.shape == (tokens, 48) and shared_out.dtype == dtype and logits.shape == (tokens, 4)
    torch.testing.assert_close(shared_out, ref.shared_expert(x, *shared, 10.0), **TOL)
    torch.testing.assert_close(logits, ref.router_logits(x, router), **TOL)
    assert torch.equal(slots, kernels.launch_routed_experts(x, ids, gate_up, down, 10.0, *SMALL))
    _, _, none = kernels.launch_moe_experts(x, ids, gate_up, down, 10.0, shared, None, *SMALL)
    assert none.shape == (tokens, 0)


@pytest.mark.parametrize("tokens, topk", [(1, 2), (6, 2), (5, 3)])
def test_moe_experts_looks_up_a_hash_table(device, tokens, topk):
    """``token_ids`` with a table of 10 rows: the outputs of the launch given the looked-up ids, bit
    for bit; a token id outside the table (-1, 10) reads no row and makes its slots 0."""
    dtype = DTYPES[0]
    gate_up, down = _weights(4, 48, 32, device, dtype)
    x, _ = _inputs(tokens, topk, 4, 48, device, dtype)
    gen = torch.Generator(device=device).manual_seed(tokens)
    table = torch.rand(10, 4, generator=gen, device=device).argsort(dim=1)[:, :topk]
    token_ids = torch.randint(0, 10, (tokens,), generator=gen, device=device)
    if tokens > 1:
        token_ids[0], token_ids[-1] = -1, 10
    shared, router = _shared(48, 32, device, dtype), _router(4, 48, device, dtype)
    got = kernels.launch_moe_experts(x, table, gate_up, down, 10.0, shared, router, *SMALL, token_ids=token_ids)
    want = kernels.launch_moe_experts(x, ref.hash_expert_ids(table, token_ids), gate_up, down, 10.0, shared, router,
                                      *SMALL)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if tokens > 1:
        assert not got[0][:topk].any() and not got[0][-topk:].any() and got[0][topk:-topk].abs().sum() > 0


def test_router_of_more_experts_than_columns(device):
    """A router of 40 experts (over 16-row tiles; the layer holds 4 of them, as a rank under expert
    parallelism would): the router's programs outnumber the experts' column tiles, so the grid's
    columns follow the router."""
    gate_up, down = _weights(4, 48, 32, device, torch.float16)
    x, ids = _inputs(3, 3, 4, 48, device, torch.float16)
    router = _router(40, 48, device, torch.float16)
    _, _, logits = kernels.launch_moe_experts(x, ids, gate_up, down, 10.0, _shared(48, 16, device, torch.float16),
                                              router, *SMALL)
    torch.testing.assert_close(logits, ref.router_logits(x, router), **TOL)


def test_moe_experts_with_default_configs(device):
    gate_up, down = _weights(4, 64, 32, device, DTYPES[-1])
    x, ids = _inputs(3, 2, 4, 64, device, DTYPES[-1])
    shared, router = _shared(64, 32, device, DTYPES[-1]), _router(4, 64, device, DTYPES[-1])
    slots, shared_out, logits = torch.ops.dsv4.moe_experts(x, ids, gate_up, down, 10.0, *shared, router)
    torch.testing.assert_close(slots, ref.routed_experts(x, ids, gate_up, down, 10.0), **TOL)
    torch.testing.assert_close(shared_out, ref.shared_expert(x, *shared, 10.0), **TOL)
    torch.testing.assert_close(logits, ref.router_logits(x, router), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, columns, k", [(1, 8, 2), (3, 256, 6), (2, 300, 32), (4, 1024, 1)])
def test_topk_indices_kernel_matches_the_reference(device, dtype, rows, columns, k):
    """Random scores with ties (rounded to a few values), -0.0 / +0.0, ±inf and NaN planted: the
    kernel's columns equal the reference's stable sort, order included."""
    gen = torch.Generator(device=device).manual_seed(columns + k)
    scores = torch.randint(-6, 7, (rows, columns), generator=gen, device=device).float() / 4
    scores[:, 0], scores[:, -1] = -0.0, 0.0
    scores[0, columns // 2] = float("nan")
    scores[-1, 1], scores[-1, 2] = float("inf"), float("-inf")
    scores = scores.to(dtype)
    got = kernels.launch_topk_indices(scores, k)
    assert torch.equal(got.cpu(), ref.topk_indices(scores.cpu(), k))
    assert torch.equal(torch.ops.dsv4.topk_indices(scores, k).cpu(), got.cpu())


def test_topk_indices_strided_and_no_rows(device):
    scores = torch.randn(3, 64, device=device)[:, ::2]
    assert torch.equal(kernels.launch_topk_indices(scores, 5).cpu(), ref.topk_indices(scores.cpu(), 5))
    assert kernels.launch_topk_indices(scores[:0], 5).shape == (0, 5)
    with pytest.raises(ValueError, match="k=33"):
        kernels.launch_topk_indices(scores, 33)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, num_experts, hidden, k", [(1, 8, 64, 2), (5, 40, 300, 6), (16, 256, 96, 6)])
def test_router_topk_kernels_match_the_reference(device, dtype, tokens, num_experts, hidden, k):
    """The learned router's two launches: logits to one rounding of the reference's (a hidden
    size of no power of two splits into a partial K block), and the selection exactly the
    reference's order of ``sqrt(softplus(logits)) + bias`` over the kernel's own logits (the
    two logits may round apart, so their selections may differ at a near tie); a bias that
    reorders the choice; a logit past softplus's linear threshold."""
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
    weight = (torch.randn(num_experts, hidden, generator=gen, device=device) * 0.2).to(dtype)
    weight[0] = x[0] / 2  # token 0's logit of expert 0: |x[0]|² / 2, past 20
    bias = torch.randn(num_experts, generator=gen, device=device)
    indices, logits = kernels.launch_router_topk(x, weight, bias, k, (16, 32, 2, 1))
    want_indices, want_logits = ref.router_topk(x, weight, bias, k)
    assert indices.shape == (tokens, k) and indices.dtype == torch.int64 and logits.dtype == dtype
    torch.testing.assert_close(logits, want_logits, **TOL)
    scores = ref.router_scores(logits, bias)
    assert torch.equal(indices, ref.topk_indices(scores, k))
    assert logits[0, 0] > 20 and (want_indices == indices).float().mean() > 0.9
    unbiased = ref.topk_indices(ref.router_scores(logits), k)
    assert not torch.equal(indices, unbiased)  # the bias changes the choice


def test_router_topk_of_too_many_tokens(device):
    x = torch.randn(kernels.ROUTER_MAX_TOKENS + 1, 64, device=device).half()
    with pytest.raises(ValueError, match="at most"):
        kernels.launch_router_topk(x, torch.randn(8, 64, device=device).half(), torch.zeros(8, device=device), 2)
