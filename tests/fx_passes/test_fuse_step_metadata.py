"""FuseStepMetadataPass: the five metadata ops of a step become one dsv4::step_metadata, with
identical results; compile_step installs it; the pass manager's uuid tracks its passes. Ops are
counted from the nodes of the graph the pass produced (``DSV4InductorPass.last_ops``)."""

import expecttest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.compile import compile_step
from dsv4_compile.fx_passes import (DSV4PassManager, FuseAttentionInverseRopePass, FuseEntryStorePass,
                                    FuseGroupedLinearPass, FuseKeyStorePass, FuseNormRopePass,
                                    FuseSharedInputLinearsPass, FuseSinkhornPass, FuseStepMetadataPass,
                                    InplaceMutationsPass)
from dsv4_compile.metadata_chain import CHAIN_OPS
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.cache_checks import assert_caches_equal
from tests.support.compile_checks import fresh_compile_state
from tests.support.oracle_asserts import assert_outputs_match

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)
CHAIN = [f"dsv4.{op}.default" for op in CHAIN_OPS]
FUSED = "dsv4.step_metadata.default"


def _twin_runs(config, mode, tokens):
    """The same step compiled with and without the pass; returns both engines, outputs and the pass."""
    pairs = [make_engine(config, max_requests=3, max_seq_len=512, capture_layers=False) for _ in range(2)]
    fuse_pass = FuseStepMetadataPass()
    outs = []
    with torch.no_grad(), fresh_compile_state():
        for (eng, rec), with_pass in zip(pairs, (False, True)):
            rows = [eng.admit(), eng.admit()]
            rec.run(ForwardMode.EXTEND, {rows[0]: 130, rows[1]: 70})
            options = {"post_grad_custom_post_pass": DSV4PassManager([fuse_pass])} if with_pass else {}
            eng.forward = torch.compile(eng.stack, fullgraph=True, options=options)
            outs.append(rec.run(mode, {r: tokens for r in rows}))
    return [eng for eng, _ in pairs], outs, fuse_pass


class TestFuseStepMetadata(expecttest.TestCase):
    def test_decode_chain_fused_with_identical_results(self):
        cfg = TINY.with_(compress_ratios=(4, 128))
        (plain, fused), (want, got), fuse_pass = _twin_runs(cfg, ForwardMode.DECODE, 1)
        self.assertEqual(fuse_pass.matched_count, 1)
        self.assertEqual(fuse_pass.last_ops.count(FUSED), 1)
        self.assertEqual([op for op in fuse_pass.last_ops if op in CHAIN], [])
        for row in want:
            self.assertTrue(torch.equal(want[row], got[row]))
        assert_caches_equal(plain.stack.cache, fused.stack.cache)
        self.assertExpectedInline("\n".join(fuse_pass.last_ops), """\
dsv4.step_metadata.default
dsv4.store_kv.default (in place)
dsv4.compress_kv.default (in place)
dsv4.store_index_k.default (in place)
dsv4.indexer_prepare_q.default
dsv4.compress_kv.default (in place)
dsv4.store_kv.default (in place)
dsv4.indexer_topk.default
dsv4.sparse_attn.default
dsv4.grouped_linear.default
dsv4.store_kv.default (in place)
dsv4.compress_kv.default (in place)
dsv4.store_kv.default (in place)
dsv4.sparse_attn.default
dsv4.grouped_linear.default""")

    def test_swa_only_stack_is_left_alone(self):
        """Without compressed layers the page table is dead code (eliminated before the pass), so
        there is no chain to fuse: expand + SWA stay two ops, results unchanged."""
        cfg = TINY.with_(compress_ratios=(0,))
        (plain, fused), (want, got), fuse_pass = _twin_runs(cfg, ForwardMode.TARGET_VERIFY, 3)
        self.assertEqual(fuse_pass.matched_count, 0)
        self.assertEqual([op for op in fuse_pass.last_ops if op in CHAIN or op == FUSED],
                         ["dsv4.expand_queries.default", "dsv4.build_swa_metadata.default"])
        for row in want:
            self.assertTrue(torch.equal(want[row], got[row]))
        assert_caches_equal(plain.stack.cache, fused.stack.cache)

    def test_compile_step_installs_the_passes(self):
        """The passes given to compile_step run on the step's graph: the chain is fused, and the
        compiled step still matches the oracle."""
        eng, rec = make_engine(TINY, max_requests=2, max_seq_len=512, capture_layers=False)
        row = eng.admit()
        passes = DSV4PassManager()
        with torch.no_grad(), fresh_compile_state():
            rec.run(ForwardMode.EXTEND, {row: 50})
            eng.forward = compile_step(eng.stack, passes=passes)
            assert_outputs_match(rec, rec.run(ForwardMode.DECODE, {row: 1}))
        self.assertEqual(passes.matched_count, 1)
        self.assertEqual(passes.last_ops.count(FUSED), 1)
        self.assertEqual([op for op in passes.last_ops if op in CHAIN], [])

    def test_uuid_tracks_the_pass_list(self):
        self.assertEqual(DSV4PassManager().uuid(), DSV4PassManager(
            [FuseStepMetadataPass(), FuseSinkhornPass(), FuseSharedInputLinearsPass(), FuseGroupedLinearPass(),
             FuseAttentionInverseRopePass(), FuseNormRopePass(), FuseKeyStorePass(), InplaceMutationsPass(),
             FuseEntryStorePass()]).uuid())
        self.assertNotEqual(DSV4PassManager().uuid(),
                            DSV4PassManager([FuseStepMetadataPass(), FuseSinkhornPass()]).uuid())
        self.assertNotEqual(DSV4PassManager().uuid(), DSV4PassManager([FuseStepMetadataPass()]).uuid())
        self.assertNotEqual(DSV4PassManager().uuid(), DSV4PassManager([]).uuid())
        with self.assertRaises(TypeError):
            DSV4PassManager([lambda graph: None])


if __name__ == "__main__":
    expecttest.run_tests()
