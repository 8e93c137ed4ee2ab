"""The ``dsv4::linears`` and ``dsv4::grouped_linear`` kernels vs ``torch.mm`` / ``torch.bmm``
(``ops/kernels/linear.py``), small shapes.

Row counts 1 to 64 (x padded to 16, 32 or 64 rows), weights whose row counts leave a partial tile,
one to eight weights a launch, a K that leaves a partial block, a strided x, no rows; for the
grouped kernel, groups whose outputs leave a partial tile and an x whose groups are not adjacent in
memory. The kernel accumulates in another order than ``torch.mm``, so results agree to one
rounding of the output dtype. Under the interpreter the kernel runs fp16 (its ``tl.dot`` misreads
bf16 tiles there: see ``test_experts_kernel.py``)."""

import os

import pytest
import torch

from dsv4_compile.ops.kernels import linear as kernels

DTYPES = [torch.float16] if os.environ.get("TRITON_INTERPRET") == "1" else [torch.float16, torch.bfloat16]
SMALL = (16, 32, 2, 1)  # several tiles and K blocks at these sizes


def _close(got, want):
    """Within one bf16 rounding step at the output's scale."""
    torch.testing.assert_close(got.float(), want.float(), atol=2 ** -7 * want.float().abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 16, 17, 40, kernels.MAX_ROWS])
@pytest.mark.parametrize("rows", [(40,), (16, 33, 8), tuple(range(9, 17))])
def test_kernel_matches_mm(device, dtype, m, rows):
    gen = torch.Generator(device=device).manual_seed(m)
    x = torch.randn(m, 72, generator=gen, device=device).to(dtype)
    weights = [torch.randn(n, 72, generator=gen, device=device).to(dtype) for n in rows]
    outs = kernels.launch_linears(x, weights, SMALL)
    assert [tuple(o.shape) for o in outs] == [(m, n) for n in rows]
    for out, w in zip(outs, weights):
        assert out.dtype == dtype
        _close(out, x @ w.T)


@pytest.mark.parametrize("m", [3, 40])  # the default tiles of few and of many rows
def test_default_config_strided_x_unaligned_weight_and_no_rows(device, m):
    """x strided along K; a weight that is a contiguous view 2 bytes past an aligned address (the
    launcher copies it: the kernel assumes 16-byte aligned weights); no rows of x; a weight of no
    rows."""
    x = torch.randn(m, 144, device=device).to(torch.float16)[:, ::2]
    unaligned = torch.randn(7 * 72 + 1, device=device).to(torch.float16)[1:].view(7, 72)
    weights = [torch.randn(100, 72, device=device).to(torch.float16), unaligned]
    for out, w in zip(kernels.launch_linears(x, weights), weights):
        _close(out, x @ w.T)
    empty = kernels.launch_linears(x[:0], weights)
    assert [tuple(o.shape) for o in empty] == [(0, 100), (0, 7)]
    no_out = kernels.launch_linears(x, [weights[0][:0]])  # a weight of no rows: no program at all
    assert no_out[0].shape == (m, 0)


def test_limits():
    x, w = torch.zeros(kernels.MAX_ROWS + 1, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="at most"):
        kernels.launch_linears(x, [w])
    with pytest.raises(ValueError, match="at most"):
        kernels.launch_linears(x[:2], [w] * (kernels.MAX_WEIGHTS + 1))


@pytest.mark.parametrize("m, count", [(3, 10), (kernels.MAX_ROWS + 4, 2)])  # two launches; torch.mm
def test_op_on_device(device, m, count):
    x = torch.randn(m, 64, device=device).to(DTYPES[-1])
    weights = [torch.randn(8 + g, 64, device=device).to(DTYPES[-1]) for g in range(count)]
    for out, w in zip(torch.ops.dsv4.linears(x, weights), weights):
        _close(out, x @ w.T)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 6, 16, 17, kernels.MAX_ROWS])
@pytest.mark.parametrize("groups, n", [(1, 16), (3, 40), (8, 8)])
def test_grouped_kernel_matches_bmm(device, dtype, m, groups, n):
    gen = torch.Generator(device=device).manual_seed(m * groups)
    x = torch.randn(m, groups, 72, generator=gen, device=device).to(dtype)
    w = torch.randn(groups * n, 72, generator=gen, device=device).to(dtype)
    out = kernels.launch_grouped_linear(x, w, SMALL)
    assert out.shape == (m, groups, n) and out.dtype == dtype and out.is_contiguous()
    _close(out, torch.einsum("mgk,gnk->mgn", x.float(), w.float().view(groups, n, 72)))


def test_grouped_strided_x_and_no_rows(device):
    """x's groups 2 K apart (a slice of a wider tensor), the default tiles of few and many rows; no
    rows."""
    w = torch.randn(3 * 24, 64, device=device).to(torch.float16)
    for m in (5, 40):
        x = torch.randn(m, 3, 2, 64, device=device).to(torch.float16)[:, :, 1]
        _close(kernels.launch_grouped_linear(x, w), torch.einsum("mgk,gnk->mgn", x.float(), w.float().view(3, 24, 64)))
    assert kernels.launch_grouped_linear(x[:0], w).shape == (0, 3, 24)
    with pytest.raises(ValueError, match="at most"):
        kernels.launch_grouped_linear(torch.zeros(kernels.MAX_ROWS + 1, 3, 64, dtype=torch.float16,
                                                  device=device), w)


@pytest.mark.parametrize("m", [3, kernels.MAX_ROWS + 4])  # the kernel; torch.bmm
def test_grouped_op_on_device(device, m):
    x = torch.randn(m, 4, 64, device=device).to(DTYPES[-1])
    w = torch.randn(4 * 24, 64, device=device).to(DTYPES[-1])
    _close(torch.ops.dsv4.grouped_linear(x, w), torch.einsum("mgk,gnk->mgn", x.float(), w.float().view(4, 24, 64)))


def _unroped(x, positions, inv_freq, head_dim):
    """x ``[M, G, K]`` with each head's tail rotated back, by the reference."""
    from dsv4_compile.reference.functional import rope_tail

    heads = x.reshape(x.shape[0], -1, head_dim)
    return rope_tail(heads, positions.unsqueeze(1), inv_freq, inverse=True).view(x.shape)


@pytest.mark.parametrize("m", [3, kernels.MAX_ROWS + 4])  # the kernel; then torch.bmm
def test_grouped_op_rotates_heads_back_on_device(device, m):
    """With positions the op undoes each head's RoPE (``rope_tail``'s kernel) before the product."""
    x = torch.randn(m, 2, 1024, device=device).to(DTYPES[-1])
    w = torch.randn(2 * 24, 1024, device=device).to(x.dtype)
    positions = torch.arange(m, device=device) * 977
    inv_freq = 0.7 ** torch.arange(32, dtype=torch.float32, device=device)
    got = torch.ops.dsv4.grouped_linear(x, w, positions, inv_freq, 512)
    _close(got, torch.einsum("mgk,gnk->mgn", _unroped(x, positions, inv_freq, 512).float(), w.float().view(2, 24, 1024)))
    with pytest.raises(AssertionError):  # the rotation is not the identity at these positions
        _close(got, torch.ops.dsv4.grouped_linear(x, w))


def test_weight_prefetch_changes_no_value(device):
    """With PDL and the L2 prefetch (sm_90+ only; never under the interpreter) or without, both
    kernels give the same bits, for weights shorter and longer than the prefetched columns."""
    from dsv4_compile.testing.bench import weight_prefetch

    x = torch.randn(3, 4 * 1024 + 40, device=device).to(DTYPES[-1])
    weights = [torch.randn(rows, x.shape[1], device=device).to(x.dtype) for rows in (40, 1000)]
    xg = torch.randn(3, 2, 200, device=device).to(x.dtype)
    wg = torch.randn(2 * 48, 200, device=device).to(x.dtype)
    with weight_prefetch(False):
        assert kernels._pdl_prefetch_k(x.shape[1], 32, 2, x.device) == 0
        plain = [*kernels.launch_linears(x, weights), kernels.launch_grouped_linear(xg, wg)]
    on_sm90 = x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
    assert (kernels._pdl_prefetch_k(x.shape[1], 32, 2, x.device) > 0) == on_sm90
    prefetched = [*kernels.launch_linears(x, weights), kernels.launch_grouped_linear(xg, wg)]
    for got, want in zip(prefetched, plain):
        assert torch.equal(got, want)


@pytest.mark.parametrize("m", [1, 5, 16, 24, kernels.MAX_ROWS])
@pytest.mark.parametrize("rows", [(40,), (16, 33, 8)])
def test_split_k_matches_mm(device, m, rows):
    """K split over programs (each tile's last program sums the partials): the products of
    ``torch.mm``, the same bits on a second call, and an unsplit launch's up to the sum's order."""
    gen = torch.Generator(device=device).manual_seed(7 * m)
    x = torch.randn(m, 200, generator=gen, device=device).to(DTYPES[-1])
    weights = [torch.randn(n, 200, generator=gen, device=device).to(x.dtype) for n in rows]
    tiles = sum(-(-n // SMALL[0]) for n in rows)
    assert kernels._split_plan(tiles, 200, SMALL[1], torch.device(device))[0] == 7  # 7 K blocks of 32, one a program
    split = kernels.launch_linears(x, weights, SMALL, split_k=True)
    again = kernels.launch_linears(x, weights, SMALL, split_k=True)
    for out, out2, plain, w in zip(split, again, kernels.launch_linears(x, weights, SMALL), weights):
        _close(out, x @ w.T)
        _close(out, plain)
        assert torch.equal(out, out2)


@pytest.mark.parametrize("m", [1, 5, 17, kernels.MAX_ROWS])
@pytest.mark.parametrize("norm_dtype", [torch.float32, "x"])
def test_norm_in_the_k_loop_matches_mm_of_the_normed_rows(device, m, norm_dtype):
    """With a norm weight the products are of ``rms_norm(x, norm, eps)``: rows of very different
    scales (each normed by its own), a K that leaves a partial block, several weights; asked to
    split K, the launch does not (a program needs whole rows for their norms) and gives the same
    bits; without the norm the products are not these."""
    from dsv4_compile.reference.functional import rms_norm

    gen = torch.Generator(device=device).manual_seed(m)
    dtype = DTYPES[-1]
    scale = 10.0 ** torch.linspace(-2, 2, m, device=device)[:, None]
    x = (torch.randn(m, 200, generator=gen, device=device) * scale).to(dtype)
    norm = (1 + torch.rand(200, generator=gen, device=device)).to(dtype if norm_dtype == "x" else norm_dtype)
    weights = [torch.randn(n, 200, generator=gen, device=device).to(dtype) for n in (40, 16, 7)]
    outs = kernels.launch_linears(x, weights, SMALL, norm_weight=norm, eps=1e-6)
    normed = rms_norm(x, norm, 1e-6)
    for out, w in zip(outs, weights):
        _close(out, normed @ w.T)
    for got, again in zip(outs, kernels.launch_linears(x, weights, SMALL, split_k=True, norm_weight=norm, eps=1e-6)):
        assert torch.equal(got, again)
    assert not torch.allclose(outs[0].float(), (x @ weights[0].T).float(), rtol=0.1)
    default = kernels.launch_linears(x, weights, norm_weight=norm, eps=1e-6)  # the default tile
    _close(default[0], normed @ weights[0].T)


def test_norm_eps_and_op_above_the_kernel_rows(device):
    """``eps`` reaches the kernel (a row of zeros plus eps: tiny rows scale by ``rsqrt(eps)``);
    above :data:`MAX_ROWS` rows the op runs the reference (norm, then ``torch.mm``)."""
    from dsv4_compile.reference.functional import rms_norm

    dtype = DTYPES[-1]
    x = (torch.randn(3, 64, device=device) * 1e-3).to(dtype)
    w, norm = torch.randn(24, 64, device=device).to(dtype), torch.rand(64, device=device) + 0.5
    for eps in (1e-6, 1e-2):
        _close(kernels.launch_linears(x, [w], norm_weight=norm, eps=eps)[0], rms_norm(x, norm, eps) @ w.T)
    many = torch.randn(kernels.MAX_ROWS + 3, 64, device=device).to(dtype)
    _close(torch.ops.dsv4.linears(many, [w], norm, 1e-6)[0], rms_norm(many, norm, 1e-6) @ w.T)
    _close(torch.ops.dsv4.linears(many[:3], [w], norm, 1e-6)[0], rms_norm(many[:3], norm, 1e-6) @ w.T)


def test_default_config_splits_only_small_groups_at_deep_k():
    assert kernels.default_config(4096, 1536) == (kernels.SPLIT_K_CONFIG, True)  # sliding q_a + kv
    assert kernels.default_config(4096, 8) == (kernels.SPLIT_K_CONFIG, True)  # a router alone
    assert kernels.default_config(4096, 2560) == (kernels.DEEP_K_CONFIG, False)  # HCA hidden
    assert kernels.default_config(4096, 4160) == (kernels.DEEP_K_CONFIG, False)  # CSA hidden
    assert kernels.default_config(1024, 1536) == (kernels.SHALLOW_K_CONFIG, False)
    assert kernels.default_config(4096, 129280) == (kernels.WIDE_CONFIG, False)


def test_default_config_of_a_folded_norm_is_one_stage_at_shallow_k():
    """With the norm folded the query latent's products (K 1024, up to 16 rows) take the one-stage
    tile; deeper K and more rows go as without it."""
    assert kernels.default_config(1024, 40960, 1, norm=True) == (kernels.NORMED_SHALLOW_K_CONFIG, False)
    assert kernels.default_config(1024, 32768, 16, norm=True) == (kernels.NORMED_SHALLOW_K_CONFIG, False)
    assert kernels.NORMED_SHALLOW_K_CONFIG[3] == 1
    assert kernels.default_config(1024, 32768, 17, norm=True) == (kernels.MANY_ROWS_SHALLOW_K_CONFIG, False)
    assert kernels.default_config(4096, 4160, 1, norm=True) == (kernels.DEEP_K_CONFIG, False)


def test_default_config_above_16_rows_by_depth_unsplit():
    """From 17 rows of x the tile goes by K alone (a skinny GEMM's), never split."""
    for rows in (8, 1536, 4160, 129280):
        assert kernels.default_config(4096, rows, 17) == (kernels.MANY_ROWS_DEEP_K_CONFIG, False)
        assert kernels.default_config(1024, rows, kernels.MAX_ROWS) == (kernels.MANY_ROWS_SHALLOW_K_CONFIG, False)
    assert kernels.default_config(4096, 1536, 16) == (kernels.SPLIT_K_CONFIG, True)
    assert [kernels.rows_pad(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
