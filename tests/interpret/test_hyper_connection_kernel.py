"""The mHC kernels vs their references (``ops/kernels/hyper_connection.py``), small shapes.

Sinkhorn: matrix counts that fill whole programs (BLOCK_M = 4 matrices of 4 x 4), leave one partly
filled, and none, N = 4 (hc_mult), N = 3, 5 or 33 (padded to 4, 8 or 64) and N = MAX_N, strided
input. The sums may be added in another order than the reference's, so results agree to fp32
rounding (atol 1e-6 on values in [0, 1]); through ``torch.ops.dsv4`` an N past the kernel's MAX_N
runs the reference.

hc_pre / hc_head / hc_post / hc_post_pre: token counts filling whole token blocks, a partial one and
none, N = 4 and 3, column counts that are and are not multiples of the column block.
"""

import pytest
import torch

from dsv4_compile.ops.kernels import hyper_connection as kernels
from dsv4_compile.reference import hyper_connection as ref
from dsv4_compile.testing.bench import posted_max_tokens

ATOL = 1e-6


def _comb(shape, device, seed=0):
    """Positive weights like the softmax output the model normalises."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(shape, generator=gen, device=device) + 0.01


@pytest.mark.parametrize("shape", [(0, 4, 4), (1, 4, 4), (64, 4, 4), (65, 4, 4), (2, 3, 4, 4), (4, 4),
                                   (7, 3, 3), (3, 5, 5), (2, 1, 1), (2, 33, 33), (2, kernels.MAX_N, kernels.MAX_N)])
@pytest.mark.parametrize("iters, eps", [(1, 1e-6), (2, 0.0), (20, 1e-6)])
def test_kernel_matches_reference(device, shape, iters, eps):
    x = _comb(shape, device)
    got = kernels.launch_sinkhorn(x, iters, eps)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref.sinkhorn(x, iters, eps), atol=ATOL, rtol=0)


def test_strided_input(device):
    x = _comb((70, 4, 8), device)[:, :, ::2]
    torch.testing.assert_close(kernels.launch_sinkhorn(x, 20, 1e-6), ref.sinkhorn(x, 20, 1e-6), atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", [4, kernels.MAX_N + 1])
def test_op_on_device(device, n):
    x = _comb((3, n, n), device)
    torch.testing.assert_close(torch.ops.dsv4.sinkhorn(x, 20, 1e-6), ref.sinkhorn(x, 20, 1e-6), atol=ATOL, rtol=0)


def _hc_weights(n: int, d: int, mixes: int, scales: int, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(mixes, n * d, generator=gen, device=device) * 0.3,
            torch.randn(mixes, generator=gen, device=device) * 0.5,
            torch.randn(scales, generator=gen, device=device))


def _streams(lead, n, d, device, dtype=torch.float16, seed=1):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*lead, n, d, generator=gen, device=device).to(dtype)


def _out_norm(d: int, device, normed: bool):
    """The block's RMSNorm the collapse may apply: ``(weight [D] fp32, eps)``, or none."""
    if not normed:
        return None, 0.0
    gen = torch.Generator(device=device).manual_seed(4)
    return 1 + 0.2 * torch.randn(d, generator=gen, device=device), 1e-6


def _assert_rounding_close(got, want):
    """fp32 outputs to 1e-5; outputs in the streams' dtype to one rounding step of their scale
    (the sums add in another order, which can move a value across a rounding boundary)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        largest = want.float().abs().amax().item() if want.numel() else 0.0
        step = torch.finfo(want.dtype).eps * max(1.0, largest)
        torch.testing.assert_close(got.float(), want.float(), atol=step, rtol=0)


# tokens filling whole token blocks, a partial one and none; N = 4 (hc_mult), 3 (padded to 4) and
# MAX_HC_N (one column of each stream a product step); D a multiple of the column block and not;
# fewer columns than one split
@pytest.mark.parametrize("lead, n, d", [((1, 1), 4, 64), ((1, 9), 4, 96), ((2, 3), 3, 40), ((17,), 4, 8), ((0,), 4, 64),
                                        ((1, 2), 4, 520), ((3,), kernels.MAX_HC_N, 40)])
@pytest.mark.parametrize("iters", [1, 20])
@pytest.mark.parametrize("normed", [False, True])
def test_hc_pre_matches_reference(device, lead, n, d, iters, normed):
    """With ``normed``, the collapse RMS-normalised by the block's norm (``d = 520``: two collapse
    programs a token, 96: a partial one)."""
    fn, base, scale = _hc_weights(n, d, (2 + n) * n, 3, device)
    x = _streams(lead, n, d, device)
    out_norm = _out_norm(d, device, normed)
    got = kernels.launch_hc_pre(x, fn, base, scale, iters, 1e-6, 1e-6, out_norm=out_norm)
    for g, w in zip(got, ref.hc_pre(x, fn, base, scale, iters, 1e-6, 1e-6, *out_norm), strict=True):
        _assert_rounding_close(g, w)


def test_hc_pre_norm_of_a_cancelling_collapse(device):
    """Streams ``v`` and ``0.1 u - v`` under equal collapse weights (``pre`` from zero projection
    rows and equal bases): the collapse ``0.1 pre u`` is ten times smaller than the streams, so the
    Gram matrix's quadratic form is a difference of terms 100 times its value. The normalised rows
    still agree with the reference's to a rounding (fp32 Gram sums lose ~2^-24 x that ratio)."""
    n, d = 4, 64
    fn, base, scale = _hc_weights(n, d, (2 + n) * n, 3, device)
    fn[:n] = 0
    base[1] = base[0]
    v, u = _streams((2,), 1, d, device)[:, 0], _streams((2,), 1, d, device, seed=5)[:, 0]
    x = torch.stack([v, 0.1 * u - v, torch.zeros_like(v), torch.zeros_like(v)], dim=1)
    out_norm = _out_norm(d, device, True)
    got = kernels.launch_hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, out_norm=out_norm)[2]
    want = ref.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, *out_norm)[2]
    assert want.float().abs().amax() > 1  # normalised: the rows' scale, not the collapse's
    _assert_rounding_close(got, want)


@pytest.mark.parametrize("lead, n, d", [((1, 5), 4, 64), ((3,), 3, 40), ((0,), 4, 64), ((2,), 4, 1100)])
@pytest.mark.parametrize("normed", [False, True])
def test_hc_head_matches_reference(device, lead, n, d, normed):
    """With ``normed``, the model's final norm applied by the collapse (1100: three programs a token)."""
    fn, base, scale = _hc_weights(n, d, n, 1, device)
    x = _streams(lead, n, d, device)
    out_norm = _out_norm(d, device, normed)
    _assert_rounding_close(kernels.launch_hc_pre(x, fn, base, scale, 0, 1e-6, 1e-6, head=True, out_norm=out_norm),
                           ref.hc_head(x, fn, base, scale, 1e-6, 1e-6, *out_norm))


@pytest.mark.parametrize("lead, n, d", [((1, 5), 4, 64), ((3,), 3, 600), ((0,), 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_hc_post_matches_reference(device, lead, n, d, dtype):
    fn, base, scale = _hc_weights(n, d, (2 + n) * n, 3, device)
    streams = _streams(lead, n, d, device, dtype)
    post, comb, _ = ref.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    out = _streams(lead, 1, d, device, dtype, seed=2)[..., 0, :]
    _assert_rounding_close(kernels.launch_hc_post(post, comb, out, streams), ref.hc_post(post, comb, out, streams))


# the projection makes the streams: a whole and a partial token block, N = 3, columns that fill whole
# blocks of a split and not (520)
@pytest.mark.parametrize("lead, n, d", [((1, 1), 4, 256), ((1, 9), 4, 96), ((2, 3), 3, 64), ((17,), 4, 128),
                                        ((0,), 4, 64), ((1, 2), 4, 520)])
@pytest.mark.parametrize("limit", [None, 64])
@pytest.mark.parametrize("normed", [False, True])
def test_hc_post_pre_matches_reference(device, lead, n, d, limit, normed):
    """The new streams, then hc_pre of them, as the two references in turn; with the projection
    making the streams up to the default token count and up to 64 tokens; with ``normed``, the
    next block's norm applied to the collapse."""
    fn, base, scale = _hc_weights(n, d, (2 + n) * n, 3, device)
    out_norm = _out_norm(d, device, normed)
    streams = _streams(lead, n, d, device)
    post, comb, _ = ref.hc_pre(_streams(lead, n, d, device, seed=3), fn, base, scale, 20, 1e-6, 1e-6)
    out = _streams(lead, 1, d, device, seed=2)[..., 0, :]
    with posted_max_tokens(kernels.POSTED_MAX_TOKENS if limit is None else limit):
        got = kernels.launch_hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, posted=(post, comb, out),
                                    out_norm=out_norm)
    _assert_rounding_close(got[0], ref.hc_post(post, comb, out, streams))
    # hc_pre's outputs of the kernel's own streams (which may differ from the reference's by a rounding)
    for g, w in zip(got[1:], ref.hc_pre(got[0], fn, base, scale, 20, 1e-6, 1e-6, *out_norm), strict=True):
        _assert_rounding_close(g, w)


# -- a collapse made by its products' launch (dsv4::hc_*_linears) ----------------------------------
SMALL_TILE = (16, 32, 2, 1)  # several column tiles and K blocks at these sizes


def _product_weights(d, device, rows=(40, 9)):
    gen = torch.Generator(device=device).manual_seed(7)
    return [(torch.randn(r, d, generator=gen, device=device) / d ** 0.5).to(torch.float16) for r in rows]


def _products_close(products, collapsed, weights):
    """Each product within one rounding of the output's scale of the launch's own collapse times
    the weight (the collapse itself is checked against the reference apart)."""
    rows = collapsed.reshape(-1, collapsed.shape[-1]).float()
    for got, w in zip(products, weights, strict=True):
        want = rows @ w.float().T
        torch.testing.assert_close(got.float(), want, atol=2 ** -9 * max(1.0, want.abs().max().item()), rtol=0)


@pytest.mark.parametrize("kind", ["pre", "post_pre", "head"])
@pytest.mark.parametrize("lead, n, d", [((1,), 4, 64), ((1, 1), 4, 200), ((1,), 3, 96), ((1,), 4, 40)])
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("split_k", [False, True])
def test_products_launch_makes_the_collapse(device, kind, lead, n, d, normed, split_k):
    """``launch_linears(collapse=...)`` after the projection's partials: the collapse (normed or
    not), ``post`` and ``comb`` (one program per token beside the products; none for a head) as
    the hc references give them, the products of that collapse; with K split over programs too
    (every split of the first tile stores its K range of the collapse). One token (the launch's
    limit), N = 4 and 3, D with a partial K block (200, 40)."""
    from dsv4_compile.ops.kernels import linear

    head = kind == "head"
    fn, base, scale = _hc_weights(n, d, n if head else (2 + n) * n, 1 if head else 3, device)
    out_norm = _out_norm(d, device, normed)
    streams = _streams(lead, n, d, device)
    posted = None
    if kind == "post_pre":
        post, comb, _ = ref.hc_pre(_streams(lead, n, d, device, seed=3), fn, base, scale, 20, 1e-6, 1e-6)
        posted = (post, comb, _streams(lead, 1, d, device, seed=2)[..., 0, :])
    weights = _product_weights(d, device)
    partials = kernels.mix_partials(streams.reshape(-1, n * d), fn, n, d, posted, normed)
    got = linear.launch_linears(None, weights, SMALL_TILE, split_k=split_k, collapse=linear.Collapse(
        partials, base, scale, 20, 1e-6, 1e-6, out_norm, head))
    new = partials.streams.view(streams.shape)
    if posted is not None:
        _assert_rounding_close(new, ref.hc_post(*posted, streams))
    if head:
        want = [ref.hc_head(new, fn, base, scale, 1e-6, 1e-6, *out_norm)]
    else:
        want = ref.hc_pre(new, fn, base, scale, 20, 1e-6, 1e-6, *out_norm)
    hc = got[:len(want)]
    for g, w in zip(hc, want, strict=True):
        _assert_rounding_close(g.view(w.shape), w)
    _products_close(got[len(want):], hc[-1], weights)


def test_products_launch_collapse_limits(device):
    from dsv4_compile.ops.kernels import linear

    n, d = 4, 64
    fn, base, scale = _hc_weights(n, d, (2 + n) * n, 3, device)
    partials = kernels.mix_partials(_streams((2,), n, d, device).reshape(2, n * d), fn, n, d, None, False)
    with pytest.raises(ValueError, match="collapse of 2 tokens"):
        linear.launch_linears(None, _product_weights(d, device), collapse=linear.Collapse(
            partials, base, scale, 20, 1e-6, 1e-6, (None, 0.0)))


@pytest.mark.parametrize("tokens", [1, 2])
def test_collapse_linears_ops_kernels_match_their_references(device, tokens):
    """The three ops' CUDA paths (called directly: the interpreter's tensors are CPU ones) against
    their references, the two ops in turn: fused at one token (the products' launch splits K
    at this K and row count), the hc op's launches then the products' above."""
    from dsv4_compile.ops import hyper_connection as ops
    from dsv4_compile.ops.kernels import linear

    n, d = 4, linear.DEEP_K
    fn, base, scale = _hc_weights(n, d, (2 + n) * n, 3, device)
    head_fn, head_base, head_scale = _hc_weights(n, d, n, 1, device, seed=9)
    out_norm = _out_norm(d, device, True)
    streams = _streams((tokens,), n, d, device)
    post, comb, _ = ref.hc_pre(_streams((tokens,), n, d, device, seed=3), fn, base, scale, 20, 1e-6, 1e-6)
    out = _streams((tokens,), 1, d, device, seed=2)[:, 0]
    weights = _product_weights(d, device)
    assert ops._collapse_fits(streams, weights) == (tokens <= linear.COLLAPSE_MAX_TOKENS)
    cases = [(ops._hc_pre_linears_cuda, ops.hc_pre_linears, (streams, fn, base, scale, 20, 1e-6, 1e-6, *out_norm)),
             (ops._hc_post_pre_linears_cuda, ops.hc_post_pre_linears,
              (post, comb, out, streams, fn, base, scale, 20, 1e-6, 1e-6, *out_norm)),
             (ops._hc_head_linears_cuda, ops.hc_head_linears,
              (streams, head_fn, head_base, head_scale, 1e-6, 1e-6, *out_norm))]
    for cuda, reference, args in cases:
        got, want = cuda(*args, weights), reference(*args, weights)
        for g, w in zip(got[:-1], want[:-1], strict=True):
            _assert_rounding_close(g, w)
        _products_close(got[-1], got[-2], weights)
