"""FuseGroupedLinearPass: ``transformers``' grouped linear (``o_a_proj``), traced as a ``bmm`` of
permuted views, becomes one ``dsv4::grouped_linear`` node with the same results.

The module is traced with ``make_fx`` (its weight an argument, as Inductor's graph holds
parameters) and the pass applied to the graph directly; the compiled model step with this pass is
tested with the shared-input pass (``test_fuse_shared_input_linears.py``).
On the CPU the op is the same ``bmm``, so results are bit for bit those of the unfused graph; the
pass is told to match CPU tensors (by default it matches CUDA ones only)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

from dsv4_compile.fx_passes import FuseGroupedLinearPass

FUSED = "dsv4.grouped_linear.default"


def _module_fn(groups: int):
    module = DeepseekV4GroupedLinear(32, groups * 24, groups).bfloat16()

    def fn(x, w):
        return torch.func.functional_call(module, {"weight": w}, (x,)).flatten(1)

    return fn, module.weight.detach()


def _rewrite(fn, *args, devices=("cpu",), decompose=True):
    """``fn`` traced at ``args`` (with Inductor's decompositions, or as Dynamo leaves aten calls)
    and rewritten: (matches, the graph's dsv4 ops, outputs before and after)."""
    decompositions = torch._inductor.decomposition.select_decomp_table() if decompose else None
    gm = make_fx(fn, decomposition_table=decompositions, tracing_mode="fake")(*args)
    fuse = FuseGroupedLinearPass(devices)
    fuse(gm.graph)
    gm.recompile()
    return fuse.matched_count, fuse.last_ops, fn(*args), gm(*args)


@pytest.mark.parametrize("decompose", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_grouped_module_becomes_one_op(rows, decompose):
    fn, w = _module_fn(4)
    x = torch.randn(rows, 4, 32, dtype=torch.bfloat16)
    matches, ops, want, got = _rewrite(fn, x, w, decompose=decompose)
    assert (matches, ops) == (1, [FUSED])
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["weight-computed", "plain-bmm", "cuda-only", "fp32"])
def test_other_products_left_alone(case):
    grouped, w = _module_fn(2)
    x = torch.randn(3, 2, 32, dtype=torch.bfloat16)
    fn, args, devices = {
        "weight-computed": (lambda x, w: grouped(x, 2 * w), (x, w), ("cpu",)),
        "plain-bmm": (lambda a, b: torch.bmm(a, b), (torch.randn(2, 3, 32), torch.randn(2, 32, 24)), ("cpu",)),
        "cuda-only": (grouped, (x, w), ("cuda",)),
        "fp32": (grouped, (x.float(), w.float()), ("cpu",)),
    }[case]
    matches, ops, want, got = _rewrite(fn, *args, devices=devices)
    assert (matches, ops) == (0, [])
    assert torch.equal(got, want)


def test_uuid_follows_the_devices():
    assert FuseGroupedLinearPass(("cpu",)).uuid() != FuseGroupedLinearPass().uuid()
