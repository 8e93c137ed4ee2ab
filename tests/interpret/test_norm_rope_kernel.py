"""The ``dsv4::rms_norm_rope`` kernel vs its reference (``ops/kernels/norm_rope.py``), small shapes.

Keys ``[T, D]`` and queries ``[T, H, D]``; weighted (fp32 and bf16 weights), unweighted, and the
unweighted norm with its scale rounded to bf16; a row length that is not a power of two; int32
and int64 positions far into the context; no tokens. The kernel sums the squares in another order
than the reference, and under the interpreter truncates where the GPU rounds to bf16, so each
value agrees to two bf16 steps at its own scale (the RoPE output rounds once more)."""

import pytest
import torch

from dsv4_compile.ops.kernels import norm_rope as kernels
from dsv4_compile.reference import functional as ref


def _close(got, want):
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)


def _inputs(device, shape, weight, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (3 * torch.randn(*shape, generator=gen, device=device)).bfloat16()
    w = None if weight is None else (torch.rand(shape[-1], generator=gen, device=device) + 0.5).to(weight)
    positions = torch.randint(0, 1 << 20, (shape[0],), generator=gen, device=device)
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, device=device).float() / 64)
    return x, w, positions, inv_freq


@pytest.mark.parametrize("shape", [(5, 512), (4, 3, 512), (3, 2, 192)])
@pytest.mark.parametrize("weight, round_scale", [(None, False), (None, True), (torch.float32, False),
                                                 (torch.bfloat16, False)])
def test_kernel_matches_reference(device, shape, weight, round_scale):
    x, w, positions, inv_freq = _inputs(device, shape, weight)
    got = kernels.launch_rms_norm_rope(x, w, 1e-6, round_scale, positions, inv_freq)
    want = ref.rms_norm_rope(x, w, 1e-6, round_scale, positions, inv_freq)
    assert got.shape == x.shape and got.dtype == x.dtype
    _close(got, want)
    # the rotation moved the tail: the reference without RoPE differs there, equals before it
    plain = ref.rms_norm_rope(x, w, 1e-6, round_scale, torch.zeros_like(positions), inv_freq)
    _close(got[..., :-64], plain[..., :-64])
    assert not torch.allclose(got[..., -64:].float(), plain[..., -64:].float(), atol=0.1)


def test_int32_positions_and_no_tokens(device):
    x, _, positions, inv_freq = _inputs(device, (4, 2, 512), None, seed=1)
    wide = kernels.launch_rms_norm_rope(x, None, 1e-6, True, positions, inv_freq)
    assert torch.equal(kernels.launch_rms_norm_rope(x, None, 1e-6, True, positions.int(), inv_freq), wide)
    empty = kernels.launch_rms_norm_rope(x[:0], None, 1e-6, True, positions[:0], inv_freq)
    assert empty.shape == (0, 2, 512)
