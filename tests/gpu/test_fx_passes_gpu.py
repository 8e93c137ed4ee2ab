"""Model-level passes on the GPU: a decode step of the 4-layer test model compiled with the default
passes against the same step compiled with them less one pass. Each pass matches its count and
the logits agree within bf16 rounding (the fused ops round and sum in other orders); where the
fused op computes what the unfused ones do (the compressors' cache writes), the caches are equal
byte for byte too."""

import pytest
import torch

from dsv4_compile.compile import compile_step
from dsv4_compile.fx_passes import (DSV4PassManager, FuseAttentionInverseRopePass, FuseCollapseLinearsPass,
                                    FuseEntryStorePass, FuseKeyStorePass, FuseNormRopePass,
                                    FuseSharedInputLinearsPass)
from dsv4_compile.fx_passes.pass_manager import default_passes
from dsv4_compile.model import enable
from dsv4_compile.step import ForwardMode, StepInputs
from dsv4_compile.testing.bench import passes_configured
from dsv4_compile.testing.random_model import random_hf_model
from tests.gpu.test_model_gpu import _tiny_config
from tests.support.compile_checks import fresh_compile_state

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

# pass -> its matches in the 4-layer model's step: the shared-input linears (4 layers' normed hidden
# states + the 2 CSA layers' query latents; the MoE's router is alone, its shared expert running in
# dsv4::moe_experts, and no lone product has K >= 4096 at hidden 256); the norm + RoPE chains (4
# layers x query and key); the keys' cache writes (4 layers); the compressors' cache writes (2 CSA
# layers x attention and indexer compressor, 1 HCA layer); the attention outputs' inverse RoPE (4
# layers). (Each layer calls its grouped o_a_proj as dsv4::grouped_linear itself:
# FuseGroupedLinearPass has nothing to rewrite here.)
MATCHES = [(FuseSharedInputLinearsPass, 6), (FuseNormRopePass, 8), (FuseKeyStorePass, 4), (FuseEntryStorePass, 5),
           (FuseAttentionInverseRopePass, 4)]
EXACT = (FuseEntryStorePass,)


class DecodeCase:
    """The 4-layer model's decode step (two requests) after their prompts, set up once: ``run``
    compiles it with a pass list and runs it from the cache as the prompts left it (restored
    after). The defaults' run is made once for every test (``defaults``, ``default_matches``): each
    model compile takes tens of seconds."""

    def __init__(self, device: str = DEVICE):
        self.backend = enable(random_hf_model(_tiny_config(), seed=0, device=device), max_requests=2,
                              max_seq_len=512)
        allocator = self.backend.allocator
        rows = [allocator.admit(), allocator.admit()]
        prompt = StepInputs.make(ForwardMode.EXTEND, rows, [40, 30], [40, 30],
                                 torch.cat([allocator.extend(r, n) for r, n in zip(rows, (40, 30))]), device=device)
        ids = torch.randint(0, 512, (70,), device=device)
        self.backend(ids, prompt, torch.tensor([39, 69], device=device))
        self.decode = StepInputs.make(ForwardMode.DECODE, rows, [41, 31], [1, 1],
                                      torch.cat([allocator.extend(r, 1) for r in rows]), device=device)
        self.tokens, self.logit_rows = ids[:2], torch.arange(2, device=device)
        self.saved = [t.clone() for t in self.backend.cache.buffers()]
        passes = default_passes()
        self.defaults = self.run(passes)
        self.default_matches = {type(p): p.matched_count for p in passes}

    def run(self, passes: list) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(logits fp32, the cache buffers after the step)`` of the step compiled with ``passes``."""
        with fresh_compile_state():
            logits = compile_step(self.backend, passes=DSV4PassManager(passes))(self.tokens, self.decode,
                                                                                self.logit_rows).float()
        written = [t.clone() for t in self.backend.cache.buffers()]
        for t, s in zip(self.backend.cache.buffers(), self.saved):
            t.copy_(s)
        return logits, written


@pytest.fixture(scope="module")
def case() -> DecodeCase:
    with torch.no_grad():
        return DecodeCase()


def _assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within bf16 rounding of the largest logit: the fused ops round and sum in other orders."""
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("pass_type, matches", MATCHES, ids=[t.__name__ for t, _ in MATCHES])
@torch.no_grad()
def test_compiled_model_step_with_and_without(case, pass_type, matches):
    assert sum(isinstance(p, pass_type) for p in default_passes()) == 1
    assert case.default_matches[pass_type] == matches
    logits, written = case.run([p for p in default_passes() if not isinstance(p, pass_type)])
    _assert_logits_close(case.defaults[0], logits)
    if pass_type in EXACT:
        assert all(torch.equal(f, u) for f, u in zip(case.defaults[1], written))


@pytest.mark.filterwarnings("ignore::UserWarning")
@torch.no_grad()
def test_query_latent_norm_folded(case):
    """``FuseSharedInputLinearsPass(fold_input_norm=True)``: each layer's query latent norm folds
    into its q_b products (8 calls: 2 more, the sliding and HCA layers' lone q_b), the logits
    within bf16 rounding of the defaults'."""
    folded = passes_configured(FuseSharedInputLinearsPass, fold_input_norm=True)
    fold = next(p for p in folded if isinstance(p, FuseSharedInputLinearsPass))
    logits, _ = case.run(folded)
    assert fold.matched_count == 8
    _assert_logits_close(logits, case.defaults[0])


@pytest.mark.filterwarnings("ignore::UserWarning")
@torch.no_grad()
def test_collapses_made_by_their_products_launch(case):
    """``FuseCollapseLinearsPass`` after the defaults: the first layer's hc_pre and the three
    hc_post_pre before an attention block fuse with the projections of their collapse; on the MoE
    side the collapse goes to ``dsv4::moe_experts`` (a hash layer) or to a learned router's lone
    product (not a ``linears`` call at hidden 256), and the head's lm_head (K 256) is cuBLAS's:
    4 matches. At hidden 256 no products' launch splits K, so each fused call runs the two ops'
    launches (the fused launches are checked at the Flash width in ``test_hyper_connection_gpu.py``);
    the logits within bf16 rounding of the defaults'."""
    collapse = FuseCollapseLinearsPass()
    logits, _ = case.run([*default_passes(), collapse])
    assert collapse.matched_count == 4
    _assert_logits_close(logits, case.defaults[0])
