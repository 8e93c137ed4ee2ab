"""FuseStepMetadataPass: the five metadata ops of a step become one dsv4::step_metadata, with
identical results; the pass manager's uuid tracks its passes."""

import expecttest
import torch

from dsv4_compile import DSV4AttnConfig, ForwardMode
from dsv4_compile.compile import compile_step
from dsv4_compile.fx_passes import DSV4PassManager, FuseStepMetadataPass
from dsv4_compile.testing.oracle_recorder import make_engine
from tests.support.cache_checks import assert_caches_equal
from tests.support.compile_checks import fresh_compile_state
from tests.support.oracle_asserts import assert_outputs_match

TINY = DSV4AttnConfig.from_name("tiny").with_(index_topk=64)


def _dsv4_lines(graph: str) -> str:
    names = []
    for line in graph.splitlines():
        if "call_function[target=torch.ops.dsv4." in line:
            names.append(line.split("target=torch.ops.")[1].split("]")[0])
        elif "auto_functionalized_v2" in line and "args = (dsv4." in line:
            names.append(line.split("args = (")[1].split(",")[0] + " (in place)")
    return "\n".join(names)


def _twin_runs(config, mode, tokens, fuse):
    """The same step compiled with and without the pass; returns both engines, outputs and the pass."""
    pairs = [make_engine(config, max_requests=3, max_seq_len=512, capture_layers=False) for _ in range(2)]
    fuse_pass = FuseStepMetadataPass()
    outs = []
    with torch.no_grad(), fresh_compile_state():
        for (eng, rec), with_pass in zip(pairs, (False, True)):
            rows = [eng.admit(), eng.admit()]
            rec.run(ForwardMode.EXTEND, {rows[0]: 130, rows[1]: 70})
            options = {"post_grad_custom_post_pass": DSV4PassManager([fuse_pass])} if with_pass and fuse else {}
            eng.forward = torch.compile(eng.stack, fullgraph=True, options=options)
            outs.append(rec.run(mode, {r: tokens for r in rows}))
    return [eng for eng, _ in pairs], outs, fuse_pass


class TestFuseStepMetadata(expecttest.TestCase):
    def test_decode_chain_fused_with_identical_results(self):
        cfg = TINY.with_(compress_ratios=(4, 128))
        (plain, fused), (want, got), fuse_pass = _twin_runs(cfg, ForwardMode.DECODE, 1, fuse=True)
        self.assertEqual(fuse_pass.matched_count, 1)
        for row in want:
            self.assertTrue(torch.equal(want[row], got[row]))
        assert_caches_equal(plain.stack.cache, fused.stack.cache)
        self.assertExpectedInline(_dsv4_lines(fuse_pass.last_graph), """\
dsv4.step_metadata.default
dsv4.store_kv.default (in place)
dsv4.compress_kv.default (in place)
dsv4.store_index_k.default (in place)
dsv4.indexer_prepare_q.default
dsv4.compress_kv.default (in place)
dsv4.store_kv.default (in place)
dsv4.indexer_topk.default
dsv4.sparse_attn.default
dsv4.store_kv.default (in place)
dsv4.compress_kv.default (in place)
dsv4.store_kv.default (in place)
dsv4.sparse_attn.default""")

    def test_swa_only_stack_is_left_alone(self):
        """Without compressed layers the page table is dead code (eliminated before the pass), so
        there is no chain to fuse: expand + SWA stay two ops, results unchanged."""
        cfg = TINY.with_(compress_ratios=(0,))
        (plain, fused), (want, got), fuse_pass = _twin_runs(cfg, ForwardMode.TARGET_VERIFY, 3, fuse=True)
        self.assertEqual(fuse_pass.matched_count, 0)
        self.assertIn("dsv4.build_swa_metadata", fuse_pass.last_graph)
        for row in want:
            self.assertTrue(torch.equal(want[row], got[row]))
        assert_caches_equal(plain.stack.cache, fused.stack.cache)

    def test_compile_step_installs_the_passes(self):
        eng, rec = make_engine(TINY, max_requests=2, max_seq_len=512, capture_layers=False)
        row = eng.admit()
        with torch.no_grad(), fresh_compile_state():
            rec.run(ForwardMode.EXTEND, {row: 50})
            eng.forward = compile_step(eng.stack)
            assert_outputs_match(rec, rec.run(ForwardMode.DECODE, {row: 1}))

    def test_uuid_tracks_the_pass_list(self):
        self.assertEqual(DSV4PassManager().uuid(), DSV4PassManager([FuseStepMetadataPass()]).uuid())
        self.assertNotEqual(DSV4PassManager().uuid(), DSV4PassManager([]).uuid())
        with self.assertRaises(TypeError):
            DSV4PassManager([lambda graph: None])


if __name__ == "__main__":
    expecttest.run_tests()
