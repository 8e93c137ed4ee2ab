"""``dsv4::rope_tail`` on the GPU: a compiled graph keeps an inverse RoPE as the op's node (its
kernel runs) and decomposes a forward one, and both equal the reference within one bf16 rounding."""

import pytest
import torch

from dsv4_compile.fx_passes import DSV4PassManager
from dsv4_compile.reference import functional as ref
from tests.support.compile_checks import fresh_compile_state

pytestmark = pytest.mark.gpu
ops = torch.ops.dsv4


def _rotations(x, positions, inv_freq):
    return ops.rope_tail(x, positions, inv_freq), ops.rope_tail(x, positions, inv_freq, True)


@torch.no_grad()
def test_inverse_rope_runs_its_kernel_in_a_compiled_graph():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(7, 64, 512, generator=gen, device="cuda").bfloat16()
    positions = torch.randint(0, 1 << 16, (7, 1), generator=gen, device="cuda")
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, device="cuda").float() / 64)
    passes = DSV4PassManager([])
    with fresh_compile_state():
        got = torch.compile(_rotations, fullgraph=True, options={"post_grad_custom_post_pass": passes})(
            x, positions, inv_freq)
    assert passes.last_ops == ["dsv4.rope_tail.default"]
    for g, inverse in zip(got, (False, True)):
        torch.testing.assert_close(g.float(), ref.rope_tail(x, positions, inv_freq, inverse).float(),
                                   rtol=2 ** -7, atol=2 ** -7)
