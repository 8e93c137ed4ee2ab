"""``dsv4::linears`` on the GPU: the Triton kernel (up to 16 rows) against ``torch.mm`` at the
benchmark model's projection shapes, and a model step compiled with ``FuseSharedInputLinearsPass``
against the same step compiled without it."""

import pytest
import torch

from dsv4_compile.compile import compile_step
from dsv4_compile.fx_passes import DSV4PassManager, FuseSharedInputLinearsPass
from dsv4_compile.fx_passes.pass_manager import default_passes
from dsv4_compile.model import enable
from dsv4_compile.ops.kernels import linear as kernels
from dsv4_compile.step import ForwardMode, StepInputs
from dsv4_compile.testing.random_model import random_hf_model
from tests.gpu.test_model_gpu import _tiny_config
from tests.support.compile_checks import fresh_compile_state

pytestmark = pytest.mark.gpu
# a CSA layer's projections of its normed hidden state (hidden 4096): q_a, kv, compressor kv and
# gate, the indexer's compressor kv and gate, the indexer weights
PROJECTIONS = (1024, 512, 1024, 1024, 256, 256, 64)


def _assert_bf16_close(got, want):
    """Within one bf16 rounding step at the output's scale (another order of the K sums)."""
    torch.testing.assert_close(got.float(), want.float(), atol=2 ** -7 * want.float().abs().max().item(), rtol=0)


@pytest.mark.parametrize("rows", [1, 8, kernels.MAX_ROWS, kernels.MAX_ROWS + 1])
@torch.no_grad()
def test_op_equals_mm(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    weights = [(torch.randn(n, 4096, device="cuda", generator=g) * 0.02).bfloat16() for n in PROJECTIONS]
    for out, w in zip(torch.ops.dsv4.linears(x, weights), weights):
        _assert_bf16_close(out, x @ w.T)


@pytest.mark.filterwarnings("ignore::UserWarning")
@torch.no_grad()
def test_compiled_model_step_with_the_pass():
    """A decode step of two requests (after a prefill) of the 4-layer test model, compiled with the
    default passes and with them less this one: the pass fuses (4 layers x 2 groups, + 2 CSA query
    latents) and the logits agree within bf16 rounding."""
    backend = enable(random_hf_model(_tiny_config(), seed=0, device="cuda"), max_requests=2, max_seq_len=512)
    rows = [backend.allocator.admit(), backend.allocator.admit()]
    prompt = StepInputs.make(ForwardMode.EXTEND, rows, [40, 30], [40, 30],
                             torch.cat([backend.allocator.extend(r, n) for r, n in zip(rows, (40, 30))]), device="cuda")
    ids = torch.randint(0, 512, (70,), device="cuda")
    backend(ids, prompt, torch.tensor([39, 69], device="cuda"))
    decode = StepInputs.make(ForwardMode.DECODE, rows, [41, 31], [1, 1],
                             torch.cat([backend.allocator.extend(r, 1) for r in rows]), device="cuda")
    tokens, logit_rows = ids[:2], torch.arange(2, device="cuda")
    outs = {}
    fused = default_passes()
    linear_passes = [p for p in fused if isinstance(p, FuseSharedInputLinearsPass)]
    assert len(linear_passes) == 1
    for name, chosen in (("fused", fused), ("unfused", [p for p in fused if p not in linear_passes])):
        saved = [t.clone() for t in backend.cache.buffers()]
        passes = DSV4PassManager(chosen)
        with fresh_compile_state():
            outs[name] = compile_step(backend, passes=passes)(tokens, decode, logit_rows).float()
        for t, s in zip(backend.cache.buffers(), saved):
            t.copy_(s)
    assert linear_passes[0].matched_count == 10
    scale = outs["unfused"].abs().max().item()
    torch.testing.assert_close(outs["fused"], outs["unfused"], atol=0.05 * scale, rtol=0)
